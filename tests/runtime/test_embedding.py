"""QuantizedEmbedding: a lookup gathers the stored rows and dequantizes only them, and equals the codec's decode of
the whole table row for row, bit for bit; its buffers are exactly the bytes the codec stores."""

from __future__ import annotations

import pytest
import torch

from ditq.checkpoint.codecs import codec_for
from ditq.numerics import quantize_weight
from ditq.runtime.embedding import QuantizedEmbedding, embedding_from_stored
from ditq.schemes import get_scheme

# (scheme, group size): the 4-bit schemes' rows (w8a16 per row), and int4 rows in groups as another tool may store
ROW_FORMATS = [("w8a16", None), ("w4a16", 32), ("w4a16", None)]


def _stored(
    scheme_name: str, group_size: int | None, rows: int = 96, dim: int = 64
) -> dict[str, torch.Tensor]:
    scheme = get_scheme(scheme_name).with_group_size(group_size)
    table = (
        torch.randn(rows, dim, generator=torch.Generator().manual_seed(0))
        * torch.linspace(0.01, 3, rows)[:, None]
    )
    return codec_for(scheme).encode(*quantize_weight(table, scheme))


@pytest.mark.parametrize(("scheme_name", "group_size"), ROW_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_equals_the_decoded_table(
    scheme_name: str, group_size: int | None, dtype: torch.dtype
) -> None:
    scheme = get_scheme(scheme_name).with_group_size(group_size)
    stored = _stored(scheme_name, group_size)
    module = embedding_from_stored(stored, scheme, dtype)
    reference = codec_for(scheme).decode(stored, dtype)  # (96, 64): the whole table, as verify decodes it
    ids = torch.randint(0, 96, (3, 7), generator=torch.Generator().manual_seed(1))
    ids[0, :2] = torch.tensor([0, 95])  # the first and last rows, and repeats
    out = module(ids)
    assert out.dtype == dtype and out.shape == (3, 7, 64)
    assert torch.equal(out, reference[ids])
    assert torch.equal(module(torch.arange(96)), reference)


def test_buffers_are_the_stored_bytes() -> None:
    scheme = get_scheme("w8a16")
    module = QuantizedEmbedding(151936, 4096, scheme, device="meta")  # Qwen3-VL-8B's table, no memory
    held = sum(t.numel() * t.element_size() for t in module.buffers())
    specs = codec_for(scheme).specs(151936, 4096)
    assert held == sum(torch.Size(shape).numel() * dtype.itemsize for dtype, shape in specs.values())
    assert held == 151936 * 4096 + 151936 * 4 + 2 * 8  # int8 rows, a float32 scale per row, the shape
