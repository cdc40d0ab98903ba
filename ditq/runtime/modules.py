"""Quantized Linear modules: one per scheme, holding the tensors exactly as the checkpoint stores them.

A module's persistent buffers are the tensors its format stores, with their
stored names, dtypes and shapes (``ditq.checkpoint.codecs``), so a
component's state dict reads straight from the safetensors files with
``load_state_dict(assign=True)``. The matmul is done by
a kernel path from ``ditq.kernels`` chosen per layer; the path's one-time
repack (``prepare``) runs after loading, explicitly via ``prepare`` or lazily
on the first forward.

After the repack the module keeps only what the path needs: stored buffers
that the prepared form aliases stay (so device moves never duplicate them),
the others are released, and prepared tensors that are new memory become
non-persistent buffers so ``.to()`` and offload hooks move them with the
module.

A layer quantized with SVDQuant's low-rank branch (``ditq.checkpoint.low_rank``) also holds ``low_rank_up`` (out, R)
and ``low_rank_down`` (R, in) and adds (x @ down^T) @ up^T, in the activations' dtype, to the kernel path's
output: the branch is outside the paths, so every path runs it, and no repack touches it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

import ditq.kernels  # noqa: F401 - importing the package registers every kernel path
from ditq.checkpoint.codecs import SCALE, Codec, codec_for
from ditq.checkpoint.low_rank import LOW_RANK_DOWN, LOW_RANK_NAMES, LOW_RANK_UP, low_rank_specs
from ditq.errors import DitqError, InputError
from ditq.kernels.registry import KernelPath, Prepared, candidate_paths
from ditq.schemes import FP8, W4A8, W4A16, W8A8, W8A16, Scheme

__all__ = [
    "FP8Linear",
    "QuantizedLinear",
    "W8A8Linear",
    "W8A16Linear",
    "fusable",
    "fuse_linears",
    "linear_from_stored",
    "quantized_linear_class",
    "quantized_linears",
    "stored_layer_count",
]

log = logging.getLogger(__name__)
_LOGGED_CHOICES: set[tuple[str, str, str]] = set()
_PREPARED_PREFIX = "prepared_"


@dataclass(frozen=True)
class _Alias:
    """A prepared tensor that is a view of a stored buffer: rebuilt with as_strided, never copied."""

    buffer: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


class QuantizedLinear(torch.nn.Module):
    """y = x @ dequant(stored)^T + bias, computed by one kernel path (plus (x @ down^T) @ up^T where the layer has a
    low-rank branch of rank ``low_rank``).

    ``scheme`` (the class's preset unless given) says what runs and which format the buffers hold: a
    checkpoint may store a scheme in another format than ditq writes (int8 weight-only as int-quantized);
    its kernel paths still read their own format, into which ``kernel_stored`` converts once, at the repack.
    """

    scheme: Scheme
    # the stored Linears this one computes side by side, as (name in their parent, width); empty unless fused
    # (``fuse_linears``)
    fused_members: tuple[tuple[str, int], ...] = ()

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group_size: int | None = None,
        device: torch.device | str | None = "meta",
        bias_dtype: torch.dtype = torch.bfloat16,
        scheme: Scheme | None = None,
        low_rank: int = 0,
    ) -> None:
        super().__init__()
        if scheme is not None:
            if scheme.name != type(self).scheme.name:
                raise InputError(f"{type(self).__name__} runs {type(self).scheme.name}, not {scheme.name}")
            self.scheme = scheme
        self.in_features = in_features
        self.out_features = out_features
        self.group_size = group_size
        for name, (dtype, shape) in self.codec.specs(out_features, in_features, group_size).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        if bias:
            self.register_buffer("bias", torch.empty(out_features, dtype=bias_dtype, device=device))
        else:
            self.bias: torch.Tensor | None = None
        self.low_rank = low_rank
        for name, (dtype, shape) in low_rank_specs(out_features, in_features, low_rank).items():
            self.register_buffer(name, torch.empty(shape, dtype=dtype, device=device))
        self.kernel: KernelPath | None = None
        self._prepared_layout: dict[str, str | _Alias] | None = None

    @property
    def codec(self) -> Codec:
        """The stored format: names, dtypes and shapes of the buffers, and how they read."""
        return codec_for(self.scheme)

    def extra_repr(self) -> str:
        kernel = self.kernel.name if self.kernel is not None else "unchosen"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, scheme={self.scheme.name}, kernel={kernel}"
            + (f", low_rank={self.low_rank}" if self.low_rank else "")
        )

    @property
    def qweight(self) -> torch.Tensor:
        """A tensor this layer holds (its stored weight, or after a repack what replaced it): where peft, placing a
        LoRA adapter beside a quantized layer, reads the device from (``ditq.runtime.lora``)."""
        return next(t for t in self._buffers.values() if t is not None)

    @property
    def stored_names(self) -> tuple[str, ...]:
        return tuple(self.codec.specs(self.out_features, self.in_features, self.group_size))

    @property
    def prepared(self) -> bool:
        return self._prepared_layout is not None

    def stored_tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors of this Linear (before the repack released any of them)."""
        missing = [n for n in self.stored_names if n not in self._buffers]
        if missing:
            raise DitqError(
                f"{type(self).__name__}: stored tensors {missing} were released by the "
                f"{self.kernel.name if self.kernel else ''} repack; reload the component to read them"
            )
        return {name: self._buffers[name] for name in self.stored_names}  # type: ignore[misc]

    def low_rank_tensors(self) -> dict[str, torch.Tensor]:
        """The low-rank branch's stored tensors (``low_rank_up``, ``low_rank_down``), empty without one."""
        return {name: self._buffers[name] for name in LOW_RANK_NAMES if self.low_rank}  # type: ignore[misc]

    def kernel_stored(self) -> dict[str, torch.Tensor]:
        """The stored tensors in the format the scheme's kernel paths read: the checkpoint's own where ditq
        writes that format, else decoded and re-encoded (exact: same values and scales, another layout)."""
        stored = self.stored_tensors()
        kernel_codec = codec_for(self.kernel.scheme if self.kernel is not None else self.scheme)
        if kernel_codec is self.codec:
            return stored
        return kernel_codec.encode(*self.codec.read(stored))

    def use_kernel(
        self,
        path: KernelPath | None = None,
        device: torch.device | str | None = None,
        activation_dtype: torch.dtype | None = None,
    ) -> KernelPath:
        """Choose the kernel path (None: the first candidate for ``device``/``activation_dtype``)."""
        if path is None:
            device = torch.device(device) if device is not None else self._buffer_device()
            activation_dtype = activation_dtype or self._default_activation_dtype()
            candidates = candidate_paths(
                self.scheme, device, activation_dtype, self.in_features, self.out_features
            )
            if not candidates:
                raise DitqError(
                    f"no kernel path for {self.scheme.name} on {device} with {activation_dtype} activations "
                    f"and shape ({self.out_features}, {self.in_features}); see DITQ_KERNELS / DITQ_DISABLE_KERNELS"
                )
            path = candidates[0]
        if path.scheme.name != self.scheme.name:
            raise InputError(
                f"kernel path {path.name!r} is for {path.scheme.name}, this layer is {self.scheme.name}"
            )
        if self.kernel is not None and self.kernel.name != path.name and self.prepared:
            self._unprepare()
        self.kernel = path
        key = (type(self).__name__, path.name, path.device_type)
        if key not in _LOGGED_CHOICES:
            _LOGGED_CHOICES.add(key)
            log.info("%s: kernel path %s (%s)", type(self).__name__, path.name, path.description)
        return path

    def prepare(
        self, device: torch.device | str | None = None, activation_dtype: torch.dtype | None = None
    ) -> None:
        """Repack the stored tensors for the chosen path, once.

        ``device`` is where the matmul will run. When the buffers live elsewhere
        (offload keeps them on the host) the stored tensors travel to ``device``
        for the repack and the result comes back next to the other buffers.
        """
        if self.prepared:
            return
        run_device = torch.device(device) if device is not None else self._buffer_device()
        if self.kernel is None or self.kernel.device_type != run_device.type:
            self.use_kernel(None, run_device, activation_dtype)
        assert self.kernel is not None
        home = self._buffer_device()
        stored = {n: t.to(run_device) for n, t in self.kernel_stored().items()}
        prepared = self.kernel.prepare(stored, run_device)
        if "weight_scale" not in prepared:
            raise DitqError(f"kernel path {self.kernel.name!r}: prepare returned no 'weight_scale'")
        by_storage = {_storage_key(t): n for n, t in stored.items()}
        layout: dict[str, str | _Alias] = {}
        for key, tensor in prepared.items():
            source = by_storage.get(_storage_key(tensor))
            if source is not None:
                layout[key] = _Alias(
                    source, tuple(tensor.shape), tuple(tensor.stride()), int(tensor.storage_offset())
                )
            else:
                self.register_buffer(_PREPARED_PREFIX + key, tensor.to(home), persistent=False)
                layout[key] = _PREPARED_PREFIX + key
        kept = {alias.buffer for alias in layout.values() if isinstance(alias, _Alias)}
        for name in self.stored_names:
            if name not in kept:
                del self._buffers[name]
        self._prepared_layout = layout

    def _unprepare(self) -> None:
        if any(n not in self._buffers for n in self.stored_names):
            raise DitqError(
                f"{type(self).__name__}: cannot switch kernel path after a repack released stored tensors"
            )
        for name in [n for n in self._buffers if n.startswith(_PREPARED_PREFIX)]:
            del self._buffers[name]
        self._prepared_layout = None

    def prepared_tensors(self) -> Prepared:
        """The chosen path's repacked form, on the module's current device."""
        assert self._prepared_layout is not None
        out: Prepared = {}
        for key, where in self._prepared_layout.items():
            if isinstance(where, _Alias):
                base = getattr(self, where.buffer)
                out[key] = base.as_strided(where.size, where.stride, where.offset)
            else:
                out[key] = getattr(self, where)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.prepared or (self.kernel is not None and self.kernel.device_type != x.device.type):
            if self.prepared:
                raise DitqError(
                    f"{type(self).__name__} was repacked for {self.kernel.device_type if self.kernel else '?'}, "
                    f"input is on {x.device}"
                )
            self.prepare(x.device, x.dtype)
        assert self.kernel is not None
        y = self.kernel.matmul(x, self.prepared_tensors(), self.bias)
        if self.low_rank:  # (..., K) @ (K, R) @ (R, N), in the activations' dtype
            down, up = (getattr(self, name).to(x.dtype) for name in (LOW_RANK_DOWN, LOW_RANK_UP))
            y = y + torch.nn.functional.linear(torch.nn.functional.linear(x, down), up)
        return y

    def _buffer_device(self) -> torch.device:
        return next(t.device for t in self._buffers.values() if t is not None)

    def _default_activation_dtype(self) -> torch.dtype:
        return self.bias.dtype if self.bias is not None else torch.bfloat16

    def _load_from_state_dict(
        self, state_dict: Mapping[str, Any], prefix: str, *args: Any, **kwargs: Any
    ) -> None:
        # Loading new stored tensors invalidates any repack; a state dict without them (a LoRA adapter's, loaded
        # into the whole model with strict=False) leaves it as it is.
        if self.prepared and any(prefix + name in state_dict for name in self.stored_names):
            self._unprepare()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class W8A16Linear(QuantizedLinear):
    """int8 weights (packed four to an int32), per-channel or grouped scales; activations untouched."""

    scheme = W8A16


class W8A8Linear(QuantizedLinear):
    """int8 weights per channel; activations quantized to int8 per token at run time."""

    scheme = W8A8


class FP8Linear(QuantizedLinear):
    """float8_e4m3fn weights per channel; activations quantized to fp8 per token at run time."""

    scheme = FP8


class W4A16Linear(QuantizedLinear):
    """int4 weights (packed eight to an int32), grouped or per-channel scales; activations untouched."""

    scheme = W4A16


class W4A8Linear(QuantizedLinear):
    """int4 weights (packed eight to an int32), grouped or per-channel scales; activations quantized to fp8 per
    token at run time."""

    scheme = W4A8


_CLASSES: dict[str, type[QuantizedLinear]] = {
    c.scheme.name: c for c in (W8A16Linear, W8A8Linear, FP8Linear, W4A16Linear, W4A8Linear)
}


def quantized_linear_class(scheme_name: str) -> type[QuantizedLinear]:
    if scheme_name not in _CLASSES:
        raise InputError(f"no quantized Linear for scheme {scheme_name!r} (known: {', '.join(_CLASSES)})")
    return _CLASSES[scheme_name]


def linear_from_stored(
    stored: Mapping[str, torch.Tensor], scheme: Scheme, bias: torch.Tensor | None
) -> QuantizedLinear:
    """A module holding exactly ``stored`` (and ``bias``), on their device; no copies. ``stored`` may hold a
    low-rank branch beside the codec's tensors."""
    cls = quantized_linear_class(scheme.name)
    codec = codec_for(scheme)
    out_features, in_features = codec.features(stored)
    scale = stored.get(SCALE)
    columns = scale.shape[1] if scale is not None and scale.ndim == 2 else 1
    group_size = codec.scheme_for(in_features, columns).group_size
    module = cls(
        in_features,
        out_features,
        bias=bias is not None,
        group_size=group_size,
        device="meta",
        scheme=scheme.with_group_size(group_size),
        low_rank=stored[LOW_RANK_UP].shape[1] if LOW_RANK_UP in stored else 0,
    )
    for name in (*module.stored_names, *module.low_rank_tensors()):
        if name not in stored:
            raise InputError(f"{scheme.name} stored weight lacks {name!r} (has {sorted(stored)})")
        setattr(module, name, stored[name])
    if bias is not None:
        module.bias = bias.detach()
    return module


def quantized_linears(module: torch.nn.Module) -> dict[str, QuantizedLinear]:
    """Every QuantizedLinear inside ``module``, by qualified name."""
    return {name: m for name, m in module.named_modules() if isinstance(m, QuantizedLinear)}


def fusable(members: list[Any]) -> bool:
    """Whether ``members`` can be stacked into one Linear: quantized alike (one class, scheme, group size, input
    width and bias presence), unprepared and in the stored form, without a low-rank branch."""
    if not all(isinstance(m, QuantizedLinear) and not m.prepared and not m.low_rank for m in members):
        return False
    first = members[0]
    return all(
        type(m) is type(first)
        and m.scheme == first.scheme
        and m.in_features == first.in_features
        and (m.bias is None) == (first.bias is None)
        for m in members
    )


def fuse_linears(named: dict[str, QuantizedLinear]) -> QuantizedLinear:
    """One QuantizedLinear whose output is the members' outputs side by side, in order (their rows stacked, each
    row with its own scale, so the fusion is exact per output channel). Its ``fused_members`` names them (as their
    parent named them) with their widths."""
    members = list(named.values())
    codec = members[0].codec
    read = [codec.read(m.stored_tensors()) for m in members]
    scale_dtype = members[0].stored_tensors()[SCALE].dtype
    q = torch.cat([values for values, _ in read])
    scale = torch.cat([s.to(scale_dtype) for _, s in read])
    biases = [m.bias for m in members]
    bias = None if biases[0] is None else torch.cat([b for b in biases if b is not None])
    fused = linear_from_stored(codec.encode(q, scale), members[0].scheme, bias)
    fused.fused_members = tuple((name, m.out_features) for name, m in named.items())
    return fused


def stored_layer_count(layer: QuantizedLinear) -> int:
    """The stored (checkpoint) Linears a loaded one computes: 1, or the members of a fused one."""
    return len(layer.fused_members) or 1
