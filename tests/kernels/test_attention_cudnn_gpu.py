"""cuDNN's fp8 flash attention (kind fp8-fp8) on a Hopper GPU: against the kind's reference arithmetic on the same
inputs and against float32 SDPA at served and ragged shapes; masked calls through the reference exactly; one graph
per shape; one opaque op under torch.compile, no graph break; the doctor's verdict. Skipped where the path cannot
run (no sm_90, no nvidia-cudnn-frontend), with its reason."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditq.kernels.attention import get_attention_kernel
from ditq.kernels.attention.cudnn import planned_shapes
from ditq.kernels.attention.reference import allowed_keys, attend_reference, quantize_qk_reference
from ditq.numerics import relative_l2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KIND = "fp8-fp8"
PATH = "cudnn-attention-fp8-fp8"
# (batch, query rows, keys, heads, head dim): the served shapes (0 and 4 references, 1024x1024), a prefix step's
# reference segment over an odd key count, a batch of two, the demo's head dim
CASES = [
    (1, 4352, 4352, 8, 128),
    (1, 4096, 20736, 4, 128),
    (1, 4096, 4485, 4, 128),
    (2, 333, 1000, 3, 128),
    (1, 1000, 2500, 4, 64),
]


def _path():  # type: ignore[no-untyped-def]
    path = get_attention_kernel(PATH)
    ok, why = path.supports(torch.device("cuda"), torch.bfloat16, 128)
    if not ok:
        pytest.skip(why)
    return path


def _inputs(batch: int, rows: int, keys: int, heads: int, head_dim: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = 1.5 * torch.randn(batch, rows, heads, head_dim, generator=g, device="cuda")
    offset = 3 * torch.randn(1, 1, heads, head_dim, generator=g, device="cuda")
    k = torch.randn(batch, keys, heads, head_dim, generator=g, device="cuda") + offset
    v = torch.randn(batch, keys, heads, head_dim, generator=g, device="cuda")
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}xQ{c[1]}xK{c[2]}xH{c[3]}xD{c[4]}")
def test_cudnn_fp8_attention_matches_the_reference_and_sdpa(case: tuple) -> None:  # type: ignore[type-arg]
    from ditq.doctor.attention import ATTENTION_BOUNDS, MATCH_BOUNDS

    path = _path()
    batch, rows, keys, heads, head_dim = case
    q, k, v = _inputs(batch, rows, keys, heads, head_dim, seed=rows + keys)
    qk = path.quantize(q, k, KIND)
    out = path.attend(qk, v, None, None, head_dim**-0.5)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    reference = attend_reference(quantize_qk_reference(q, k, KIND), v, None, None, head_dim**-0.5)
    sdpa = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v))).transpose(1, 2)
    match, error = relative_l2(out, reference), relative_l2(out, sdpa)
    print(f"{case}: rel-L2 vs the reference {match:.4f}, vs float32 SDPA {error:.4f} (reference's own "
          f"{relative_l2(reference, sdpa):.4f})")  # fmt: skip
    assert match < MATCH_BOUNDS[KIND] and error < ATTENTION_BOUNDS[KIND]


def test_masked_calls_run_the_reference_arithmetic() -> None:
    path = _path()
    q, k, v = _inputs(2, 77, 300, 2, 128, seed=5)
    key_valid = torch.ones(2, 300, dtype=torch.bool, device="cuda")
    key_valid[1, 120:140] = False
    qk = path.quantize(q, k, KIND)
    for valid, causal in ((key_valid, None), (None, 223), (key_valid, 223)):
        got = path.attend(qk, v, valid, causal, 128**-0.5)
        want = attend_reference(qk, v, valid, causal, 128**-0.5)
        assert torch.equal(got, want)
        mask = allowed_keys(valid, causal, range(77), 300, q.device)
        sdpa = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)), attn_mask=mask)
        assert relative_l2(got, sdpa.transpose(1, 2)) < 0.08


def test_one_graph_per_shape() -> None:
    path = _path()
    q, k, v = _inputs(1, 512, 1536, 4, 128, seed=9)
    before = len(planned_shapes())
    for _ in range(3):
        path.attend(path.quantize(q, k, KIND), v, None, None, 128**-0.5)
    assert len(planned_shapes()) == before + 1
    path.attend(path.quantize(q, k[:, :1024], KIND), v[:, :1024], None, None, 128**-0.5)
    assert len(planned_shapes()) == before + 2


def test_compiled_without_a_graph_break_and_the_same_output() -> None:
    path = _path()
    q, k, v = _inputs(1, 1024, 3072, 4, 128, seed=11)

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return path.attend(path.quantize(q, k, KIND), v, None, None, 128**-0.5)

    eager = attention(q, k, v)
    compiled = torch.compile(attention, fullgraph=True, dynamic=True)(q, k, v)  # a graph break raises
    # inductor's fused quantization may round a scale one ulp apart from eager torch's: the outputs agree to e4m3
    # rounding of a few elements
    assert relative_l2(compiled, eager) < 0.01


def test_the_doctor_passes_the_cudnn_path() -> None:
    from ditq.doctor.attention import ATTENTION_BOUNDS, check_attention_path

    _path()
    result = check_attention_path(get_attention_kernel(PATH), "cuda", head_dim=128)
    print([(c.geometry, c.dtype, c.step, c.value) for c in result.checks if c.value is not None])
    assert result.verdict == "PASS", result.reason
    assert result.worst_rel_l2 is not None and result.worst_rel_l2 < ATTENTION_BOUNDS[KIND]
