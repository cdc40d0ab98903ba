"""fp8 fast accumulation (``scaled-mm-fp8-fast``) on a GPU: its error against the float32 reference at the DiT's and
the text encoder's layer shapes, beside the exact path's and the scheme's own quantization error; the doctor's
verdict with the bound it derived; and the chooser taking it only with --accumulate fast."""

from __future__ import annotations

import pytest
import torch

from ditq import doctor
from ditq.kernels import get_kernel
from ditq.kernels.reference import reference_float32
from ditq.kernels.stored import analytic_stored
from ditq.numerics import quantize_weight, relative_l2
from ditq.schemes import FP8

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (in, out): the full-size DiT's projections and MLP, and the text encoder's widest
GEOMETRIES = [(3072, 3072), (3072, 12288), (12288, 3072), (4096, 12288)]


def _fast():  # type: ignore[no-untyped-def]
    path = get_kernel("scaled-mm-fp8-fast")
    ok, why = path.supports(torch.device("cuda"), torch.bfloat16, 4096, 4096)
    if not ok:
        pytest.skip(why)
    return path


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"{g[0]}x{g[1]}")
def test_fast_accumulation_error_is_a_small_part_of_the_schemes_own(geometry: tuple[int, int]) -> None:
    fast, exact = _fast(), get_kernel("scaled-mm-fp8")
    k, n = geometry
    g = torch.Generator().manual_seed(k + n)
    weight = torch.randn(n, k, generator=g) * 0.02
    q, scale = quantize_weight(weight, FP8)
    x = torch.randn(512, k, generator=g).cuda().bfloat16()
    stored = {name: t.cuda() for name, t in {"weight": q, "weight_scale": scale}.items()}
    reference = reference_float32(x, q.cuda(), scale.cuda(), None, "fp8")
    errors = {path.name: relative_l2(path.matmul(x, path.prepare(stored, x.device), None), reference)
              for path in (exact, fast)}  # fmt: skip
    own = doctor.scheme_error(FP8, doctor.Geometry(k, n), torch.device("cuda"))
    print(f"{k}x{n}: exact {errors['scaled-mm-fp8']:.2e}, fast {errors['scaled-mm-fp8-fast']:.2e}, "
          f"the scheme's own error {own:.2e}")  # fmt: skip
    assert errors["scaled-mm-fp8"] <= doctor.REL_L2_BOUND
    assert errors["scaled-mm-fp8-fast"] <= doctor.FAST_FRACTION * own


@pytest.mark.parametrize("k", [4096, 12288])
def test_fast_accumulation_on_the_analytic_case_only_drops_bits(k: int) -> None:
    fast = _fast()
    stored = {key: t.cuda() for key, t in analytic_stored(FP8, 256, k).items()}
    out = fast.matmul(
        torch.ones(8, k, dtype=torch.bfloat16, device="cuda"), fast.prepare(stored, "cuda"), None
    )
    shortfall = float((k - out.double()).max()) / k
    print(f"analytic K={k}: largest relative shortfall {shortfall:.4f}, outputs {out.unique()[:4].tolist()}")
    assert float(out.double().max()) <= k and 0 <= shortfall <= doctor.FAST_ANALYTIC_PER_TERM * k


def test_the_doctor_and_the_chooser_take_fast_accumulation_only_when_asked() -> None:
    _fast()
    geometry = doctor.Geometry(12288, 3072)  # the MLP's down projection, K = 12288
    (result,) = doctor.check_paths([get_kernel("scaled-mm-fp8-fast")], [geometry], torch.device("cuda"),
                                   dtypes=(torch.bfloat16,), use_cache=False)  # fmt: skip
    print(result.reason, result.worst_rel_l2, result.bound)
    assert result.verdict == "PASS" and result.bound is not None and result.bound > doctor.REL_L2_BOUND
    exact = doctor.choose_kernel(FP8, "cuda", torch.bfloat16, 12288, 3072)
    fast = doctor.choose_kernel(FP8, "cuda", torch.bfloat16, 12288, 3072, accumulate="fast")
    assert exact.path.accumulate == "exact" and fast.path.name == "scaled-mm-fp8-fast"
