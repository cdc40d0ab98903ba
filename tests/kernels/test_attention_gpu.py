"""The Triton quantized-attention path on a GPU, at sizes the CPU tests cannot reach: ragged lengths, both head
dims of the models, padded keys and causal segments, against the reference arithmetic run on the same inputs and
against float32 SDPA; its quantization against ``ditq.numerics``' bit for bit; and the doctor's verdict."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ditq.kernels.attention import get_attention_kernel
from ditq.kernels.attention.reference import (
    QK_DTYPE,
    allowed_keys,
    attend_reference,
    quantize_qk_reference,
    quantize_value_reference,
)
from ditq.numerics import quantize_activation_per_token, relative_l2

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (batch, query rows, keys, heads, head dim, causal offset or None, padded keys)
CASES = [
    (1, 4096, 4352, 4, 128, None, False),  # a decode step: the target over [text, target]
    (2, 333, 1000, 3, 128, None, True),  # ragged, padded prompt keys (guidance batch)
    (2, 77, 300, 2, 128, 223, True),  # a text segment: causal from its start
    (1, 1000, 2500, 4, 64, None, False),  # the demo's head dim
]
SDPA_BOUNDS = {"int8": 0.02, "fp8": 0.08, "int8-fp8": 0.08}  # as the doctor's
# Against the reference arithmetic: bf16 rounding of P (unnormalized here) and of the output; int8-fp8 rounds P to
# e4m3 against the running row maximum where the reference has the final one (the doctor's MATCH_BOUNDS)
MATCH_BOUNDS = {"int8": 5e-3, "fp8": 5e-3, "int8-fp8": 0.03}
KINDS = ["int8", "fp8", "int8-fp8"]


def _inputs(batch: int, rows: int, keys: int, heads: int, head_dim: int, seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = 1.5 * torch.randn(batch, rows, heads, head_dim, generator=g, device="cuda")
    offset = 3 * torch.randn(1, 1, heads, head_dim, generator=g, device="cuda")
    k = torch.randn(batch, keys, heads, head_dim, generator=g, device="cuda") + offset
    v = torch.randn(batch, keys, heads, head_dim, generator=g, device="cuda")
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}xQ{c[1]}xK{c[2]}xH{c[3]}xD{c[4]}")
def test_triton_attention_matches_the_reference_and_sdpa(kind: str, case: tuple) -> None:  # type: ignore[type-arg]
    batch, rows, keys, heads, head_dim, causal, padded = case
    path = get_attention_kernel(f"triton-attention-{kind}")
    ok, why = path.supports(torch.device("cuda"), torch.bfloat16, head_dim)
    if not ok:
        pytest.skip(why)
    q, k, v = _inputs(batch, rows, keys, heads, head_dim, seed=rows)
    key_valid = None
    if padded:
        key_valid = torch.ones(batch, keys, dtype=torch.bool, device="cuda")
        key_valid[-1, keys // 3 : keys // 3 + 17] = False
    qk = path.quantize(q, k, kind)
    out = path.attend(qk, v, key_valid, causal, head_dim**-0.5)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    reference = attend_reference(quantize_qk_reference(q, k, kind), v, key_valid, causal, head_dim**-0.5)
    assert relative_l2(out, reference) < MATCH_BOUNDS[kind]
    mask = allowed_keys(key_valid, causal, range(rows), keys, q.device)
    sdpa = F.scaled_dot_product_attention(*(x.float().transpose(1, 2) for x in (q, k, v)), attn_mask=mask)
    assert relative_l2(out, sdpa.transpose(1, 2)) < SDPA_BOUNDS[kind]


@pytest.mark.parametrize("kind", KINDS)
def test_triton_quantization_is_the_reference_bit_for_bit(kind: str) -> None:
    path = get_attention_kernel(f"triton-attention-{kind}")
    if not path.supports(torch.device("cuda"), torch.bfloat16, 128)[0]:
        pytest.skip(path.supports(torch.device("cuda"), torch.bfloat16, 128)[1])
    q, k, _ = _inputs(2, 999, 1234, 3, 128, seed=7)
    got = path.quantize(q, k, kind)
    # The reference arithmetic on the CPU: torch on CUDA divides by a Python scalar as a multiply by its
    # reciprocal (one bit off IEEE division), so ``scale = amax / qmax`` computed there is not the kernel's
    # div_rn. The keys' mean is the path's own (on the GPU: a float32 sum's order differs from the CPU's).
    smoothed = k.float() - k.mean(dim=1, dtype=torch.float32, keepdim=True)
    want = {
        "query": quantize_activation_per_token(q.cpu(), QK_DTYPE[kind]),
        "key": quantize_activation_per_token(smoothed.cpu(), QK_DTYPE[kind]),
    }
    for name in ("query", "key"):
        a, a_scale = getattr(got, name).cpu(), getattr(got, f"{name}_scale").cpu()
        b, b_scale = want[name]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), name
        assert torch.equal(a_scale, b_scale), name


def test_triton_value_quantization_is_the_reference_bit_for_bit() -> None:
    """int8-fp8's V, stored with the keys contiguous for the P . V product (rows padded to 16 keys), one scale per
    channel."""
    from ditq.kernels._triton.attention import quantize_value

    _, _, v = _inputs(2, 8, 999, 3, 128, seed=8)
    got, got_scale = quantize_value(v[:, 5:])  # a token slice, as the text segments pass it
    want, want_scale = quantize_value_reference(v[:, 5:].cpu())
    assert got.shape == (2, 3, 128, 1008) and got_scale.shape == (2, 3, 128)
    assert torch.equal(got_scale.cpu(), want_scale[:, 0])
    stored = got[..., :994].permute(0, 3, 1, 2).cpu()  # (B, S, H, D) as the reference holds it
    assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("kind", KINDS)
def test_the_doctor_passes_the_triton_path(kind: str) -> None:
    from ditq.doctor.attention import check_attention_path

    path = get_attention_kernel(f"triton-attention-{kind}")
    result = check_attention_path(path, "cuda", head_dim=128)
    assert result.verdict in ("PASS", "SKIP"), result.reason
    if result.verdict == "PASS":
        assert result.worst_rel_l2 is not None and result.worst_rel_l2 < SDPA_BOUNDS[kind]
