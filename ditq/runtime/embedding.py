"""A token embedding stored quantized: the rows a lookup asks for are gathered, then dequantized; the whole table
never exists in floating point.

The module holds the tensors exactly as the checkpoint stores them (a Linear's codec, ``ditq.checkpoint.codecs``,
with the embedding's rows as the Linear's output channels: ``weight_packed`` int32 (vocabulary, hidden / 4),
``weight_scale`` float32 (vocabulary, 1), ``weight_shape`` int64 (2,) under the 4-bit schemes' ``w8a16`` rows), so a
component's state dict reads straight from the safetensors files. A looked-up row equals the same row of the
codec's decode (``Codec.decode``) bit for bit: both scale each int value by its row's scale in float32.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ditq.checkpoint.codecs import SCALE, Codec, codec_for
from ditq.errors import InputError
from ditq.numerics import dequantize_weight
from ditq.schemes import Scheme

__all__ = ["QuantizedEmbedding", "embedding_from_stored"]


class QuantizedEmbedding(torch.nn.Module):
    """out[..., :] = dequant(stored row input[...]) in ``dtype``: ``torch.nn.Embedding``'s lookup (no ``max_norm``,
    no gradients) over rows stored in ``scheme``'s format."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        scheme: Scheme,
        padding_idx: int | None = None,
        device: torch.device | str | None = "meta",
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_idx = (
            padding_idx  # read by models' code as nn.Embedding's; a lookup treats it as any row
        )
        self.scheme = scheme
        self.dtype = dtype  # what a lookup returns (the run dtype the loader builds it for)
        for name, (stored_dtype, shape) in self.stored_specs().items():
            self.register_buffer(name, torch.empty(shape, dtype=stored_dtype, device=device))

    @property
    def codec(self) -> Codec:
        return codec_for(self.scheme)

    def stored_specs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return self.codec.specs(self.num_embeddings, self.embedding_dim, self.scheme.group_size)

    @property
    def stored_names(self) -> tuple[str, ...]:
        return tuple(self.stored_specs())

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        return {name: self._stored(name) for name in self.stored_names}

    def _stored(self, name: str) -> torch.Tensor:
        tensor = self._buffers[name]
        assert tensor is not None  # registered in __init__, never released
        return tensor

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, scheme={self.scheme.name}, dtype={self.dtype}"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        codec, flat = self.codec, input_ids.reshape(-1)
        rows = self._stored(codec.weight_name)[flat]  # (n, stored columns): only the rows asked for
        q = codec.decode_values(rows, (flat.numel(), self.embedding_dim))  # (n, dim) int8
        scale = self._stored(SCALE)[flat]  # (n, 1 | groups) float32
        looked_up = dequantize_weight(q, scale, self.dtype)
        return looked_up.reshape(*input_ids.shape, self.embedding_dim)


def embedding_from_stored(
    stored: Mapping[str, torch.Tensor], scheme: Scheme, dtype: torch.dtype, padding_idx: int | None = None
) -> QuantizedEmbedding:
    """A module holding exactly ``stored`` (one embedding's tensors in ``scheme``'s format), on their device."""
    num_embeddings, embedding_dim = codec_for(scheme).features(stored)
    module = QuantizedEmbedding(num_embeddings, embedding_dim, scheme, padding_idx, "meta", dtype)
    for name in module.stored_names:
        if name not in stored:
            raise InputError(f"{scheme.name} stored embedding lacks {name!r} (has {sorted(stored)})")
        setattr(module, name, stored[name])
    return module
