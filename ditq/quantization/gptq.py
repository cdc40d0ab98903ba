"""GPTQ: calibrated rounding of symmetric n-bit integer weights with group-wise scales.

The algorithm is Frantar, Ashkboos, Hoefler and Alistarh, "GPTQ: Accurate Post-Training Quantization for
Generative Pre-trained Transformers" (2022, arXiv:2210.17323). A Linear's weight W (N, K) is quantized one input
column at a time, in order; each column's rounding error is spread over the columns not yet quantized through the
inverse of the layer's input Hessian H = 2/n * sum x x^T (K, K), so that ||X W^T - X Wq^T|| stays small on the
calibration inputs X rather than ||W - Wq||.

What this module does and does not do:

- symmetric weights, q in [-2**(bits-1), 2**(bits-1) - 1] stored as int8, scale = amax(|w|) / (2**(bits-1) - 1)
  per group of ``group_size`` input columns (or per output row), float32, never below ``TINY``;
- columns go in their own order, each group's scale taken from the error-updated weights at the moment its first
  column is quantized (the reference's ``static_groups=False``); later columns of the group keep that scale, so
  they may round to -2**(bits-1), which the storage range admits;
- or, with ``act_order`` (``Calibration``'s default), in order of decreasing Hessian diagonal, every group's scale
  taken up front from the weights as given (the reference's ``static_groups=True``);
- everything is float32 except the damped Hessian's inversion, done in float64: several (K, K) float64 matrices
  live at once (1.2 GB each at K = 12288), which ``--calibration-memory`` (the float32 Hessians' budget) does not
  count.

``HessianAccumulator`` and ``hessian_hooks`` gather H from a module's forward passes; ``gptq_quantize`` rounds
with it. Round to nearest and dequantization are ``ditq.numerics``' (the same conventions: H = I gives exactly
their rounding). On CUDA, with Triton, the act-order sweep runs as ``gptq_triton``'s kernel, one launch a block of
columns, the loop's arithmetic in the loop's order (its codes, all but a few in millions at full size); nothing
else here imports from ditq: ``calibrated`` wires it in.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

__all__ = [
    "TINY",
    "HessianAccumulator",
    "gptq_quantize",
    "hessian_hooks",
]

TINY = (
    1e-12  # the smallest amax a scale is taken from (an all-zero group quantizes to zeros); as ditq.numerics
)
BLOCK_SIZE = 128  # columns whose errors propagate at once (the lazy update's blocks); the Triton sweep's too


class HessianAccumulator:
    """H = 2/n * sum x x^T (K, K) over every row x (K,) of the inputs given to ``add``.

    Each row of an input (..., K) is one sample: a batch of B sequences of S tokens adds B * S. The sum S = sum x x^T
    is kept in one (K, K) tensor of ``dtype`` (float32 or float64) however many inputs come, and scaled by 2/n when
    ``hessian`` is read: one pass over S per input, not the reference GPTQ's two (its running average rescales H
    before each addition), which is what a host accumulator's time goes on. Each update's product is made where the
    input is; for an accumulator on another device (the host, for inputs on CUDA) it is summed ``PRODUCT_ROWS`` rows
    at a time (one (K, K) product and one chunk beside the activations) and taken over through a pinned buffer. A
    bfloat16 or float16 input on CUDA is multiplied as it is, into a float32 product (``_product_into``): its
    elements' products are exact in float32, as those of the input cast first are, and the tensor cores make them.
    With ``device=None`` the accumulator is made on the first input's.

    A row with a NaN or an infinity is left out (``dropped`` counts them): it carries no usable sample, and one would
    make the whole sum NaN (at one denoising step the tiny Qwen-Image pipeline's image tokens are NaN: its
    scheduler divides by zero there).
    """

    def __init__(
        self,
        in_features: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = "cpu",
    ) -> None:
        if in_features < 1:
            raise ValueError(f"in_features must be positive, got {in_features}")
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"the Hessian is accumulated in float32 or float64, not {dtype}")
        self.in_features = in_features
        self._dtype = dtype
        # None: made on the first input's device (a streamed layer's weight waits on the host; its inputs do not)
        self._sum: torch.Tensor | None = (
            None if device is None else torch.zeros(in_features, in_features, dtype=dtype, device=device)
        )
        self._rows = 0
        self._dropped = 0

    @property
    def samples(self) -> int:
        """How many rows (K,) have been added, the non-finite ones left out."""
        return self._rows

    @property
    def dropped(self) -> int:
        """How many rows were left out for a NaN or an infinity."""
        return self._dropped

    @property
    def hessian(self) -> torch.Tensor:
        """H (K, K), a new tensor where the sum is: all zeros until the first ``add`` (on the CPU where no device was
        given and none came)."""
        if self._sum is None:
            return torch.zeros(self.in_features, self.in_features, dtype=self._dtype)
        return self._sum * (2.0 / max(self.samples, 1))

    @torch.no_grad()
    def add(self, x: torch.Tensor) -> None:
        """Fold the rows of x (..., K) into H; an input with no rows changes nothing."""
        if x.shape[-1:] != (self.in_features,):
            raise ValueError(f"expected inputs of shape (..., {self.in_features}), got {tuple(x.shape)}")
        if self._sum is None:
            self._sum = torch.zeros(self.in_features, self.in_features, dtype=self._dtype, device=x.device)
        rows = x.detach().reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            return
        # a row's sum is NaN or infinite where any of its values is: one value a row, not a mask of the input's size
        finite = torch.isfinite(rows.sum(dim=1, dtype=torch.float32))
        dropped = int(finite.logical_not().sum())
        if dropped:  # the rare case pays for the copy
            self._dropped += dropped
            rows = rows[finite]
        if x.device == self._sum.device:
            _product_into(self._sum, rows)
        else:  # on the device for a host accumulator: one product and one chunk of rows at a time
            product = torch.zeros_like(self._sum, device=x.device)
            for chunk in rows.split(PRODUCT_ROWS):
                _product_into(product, chunk)
            self._sum += _staged(product)
        self._rows += rows.shape[0]


def _product_into(total: torch.Tensor, rows: torch.Tensor) -> None:
    """total (K, K) += rows^T rows, for rows (m, K) on total's device: a bfloat16 or float16 ``rows`` on CUDA
    straight into total's float32 (``out_dtype``), anything else cast to total's dtype first."""
    half = rows.dtype in (torch.bfloat16, torch.float16)
    if rows.is_cuda and half and total.dtype == torch.float32 and not _NO_OUT_DTYPE:
        try:
            torch.addmm(total, rows.T, rows, out_dtype=torch.float32, out=total)
            return
        except (RuntimeError, NotImplementedError, TypeError):  # a torch without addmm's out_dtype on CUDA
            _NO_OUT_DTYPE.append(True)
    cast = rows.to(dtype=total.dtype)
    total.addmm_(cast.T, cast)


_NO_OUT_DTYPE: list[bool] = []  # set once addmm(out_dtype=) is found missing: half inputs are then cast first
PRODUCT_ROWS = 4096  # rows cast to float32 at a time for a product made on the device for a host accumulator
_STAGING: list[torch.Tensor] = []  # one pinned host buffer, grown to the largest product copied through it


def _staged(product: torch.Tensor) -> torch.Tensor:
    """``product`` (on CUDA) copied to the host through a pinned buffer (a pageable copy runs several times slower),
    as a view of that buffer: read it before the next call. The hooks run one layer at a time, on one thread."""
    if product.device.type != "cuda":
        return product.cpu()
    held = _STAGING[0] if _STAGING else None
    if held is None or held.dtype != product.dtype or held.numel() < product.numel():
        held = torch.empty(product.numel(), dtype=product.dtype, pin_memory=True)
        _STAGING[:] = [held]
    view = held[: product.numel()].view(product.shape)
    view.copy_(product)  # synchronous: the view is whole when this returns
    return view


def _first_tensor(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """A forward call's input: its first positional tensor, else its first keyword tensor."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    raise ValueError("a hooked module was called without a tensor input")


def _accumulator_for(
    name: str, layer: torch.nn.Module, device: torch.device | str | None
) -> HessianAccumulator:
    """An accumulator sized by ``layer.in_features``, on ``device``, or (None) on the device its inputs come on:
    where its weight is, for a resident layer; the device, for a streamed one whose weight waits on the host."""
    in_features = getattr(layer, "in_features", None)
    if not isinstance(in_features, int):
        raise ValueError(f"{name!r} is a {type(layer).__name__} with no in_features: not a Linear")
    return HessianAccumulator(in_features, device=device)


@contextmanager
def hessian_hooks(
    module: torch.nn.Module, names: Iterable[str], device: torch.device | str | None = None
) -> Iterator[dict[str, HessianAccumulator]]:
    """Within the block, every forward call of the named submodules feeds its input to its own accumulator.

    ``names`` are ``module.get_submodule`` paths of Linears (any module with an int ``in_features``); repeats
    count once. ``device``: where the accumulators sum (None: where each layer's inputs come; "cpu" keeps the
    device's memory for the activations, each (K, K) product copied over as it is made). Yields the dict name ->
    ``HessianAccumulator``, filled as the caller runs ``module``; the forward
    pre-hooks are removed on leaving, an exception included. An unknown name or a module without
    ``in_features`` raises ValueError before any hook is registered.
    """
    layers: dict[str, torch.nn.Module] = {}
    for name in dict.fromkeys(names):
        try:
            layers[name] = module.get_submodule(name)
        except AttributeError as error:
            raise ValueError(f"no submodule {name!r} in {type(module).__name__}: {error}") from None
    accumulators = {name: _accumulator_for(name, layer, device) for name, layer in layers.items()}
    handles = []
    try:
        for name, layer in layers.items():
            accumulator = accumulators[name]

            def hook(
                _: torch.nn.Module,
                args: tuple[Any, ...],
                kwargs: dict[str, Any],
                accumulator: HessianAccumulator = accumulator,
            ) -> None:
                accumulator.add(_first_tensor(args, kwargs))

            handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
        yield accumulators
    finally:
        for handle in handles:
            handle.remove()
        _STAGING.clear()  # the pinned buffer is let go with the hooks


def _check(weight: torch.Tensor, bits: int, group_size: int | None) -> tuple[int, int, int]:
    """Validate a weight (N, K) and the format; returns (qmax, group width, number of groups)."""
    if weight.ndim != 2:
        raise ValueError(f"expected a 2-D weight (out, in), got shape {tuple(weight.shape)}")
    if not 2 <= bits <= 8:
        raise ValueError(f"bits must be between 2 and 8 (stored as int8), got {bits}")
    in_features = weight.shape[1]
    if group_size is None:
        return 2 ** (bits - 1) - 1, in_features, 1
    if group_size < 1:
        raise ValueError(f"group size must be positive, got {group_size}")
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group size {group_size}")
    return 2 ** (bits - 1) - 1, group_size, in_features // group_size


def _scale(w: torch.Tensor, qmax: int) -> torch.Tensor:
    """Symmetric scale of w (N, g) per row: amax(|w|) / qmax, float32 (N,)."""
    return w.abs().amax(dim=1).clamp_min(TINY) / qmax


def _round(w: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """round(w / scale) clamped to [-qmax - 1, qmax], still float32; w and scale broadcast."""
    return (w / scale).round_().clamp_(-qmax - 1, qmax)


def _inverse_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, float32 (K, K), computed in float64.

    ``hessian`` must already have its dead columns' diagonal set to 1.
    """
    h = hessian.to(torch.float64)
    h.diagonal().add_(damp * float(h.diagonal().mean()))
    lower, info = torch.linalg.cholesky_ex(h)
    upper = torch.full_like(h, math.nan)
    if int(info) == 0 and bool(torch.isfinite(lower).all()):
        upper, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(lower), upper=True)
    if int(info) != 0 or not bool(torch.isfinite(upper).all()):
        raise ValueError(
            f"GPTQ: the damped Hessian is not positive definite (its Cholesky factorization failed at "
            f"damp={damp}); try a larger damp, e.g. 0.1"
        )
    return upper.to(torch.float32)


def _group_columns(
    w: torch.Tensor,
    block: torch.Tensor,
    errors: torch.Tensor,
    h_inv: torch.Tensor,
    start: int,
    i: int,
    end: int,
) -> torch.Tensor:
    """The error-updated weights of columns [start + i, end) (N, end - start - i), column start + i of the block
    being the next to quantize.

    ``block`` holds the block's columns from ``start`` with every update so far; columns past the block have only
    the earlier blocks' updates in ``w``, so this block's errors so far (``errors[:, :i]``) are applied to them here.
    """
    inside = block[:, i : end - start]
    stop = start + block.shape[1]
    if end <= stop:
        return inside
    outside = w[:, stop:end] - errors[:, :i] @ h_inv[start : start + i, stop:end]
    return torch.cat([inside, outside], dim=1)


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    bits: int = 4,
    group_size: int | None = 128,
    damp: float = 0.01,
    block_size: int = BLOCK_SIZE,
    act_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ-round weight (N, K) against the input Hessian (K, K): (q int8 (N, K), scale float32 (N, G)).

    G = K // group_size, or 1 when ``group_size`` is None (one scale per output row); K must be a multiple of
    ``group_size``. q is in [-2**(bits-1), 2**(bits-1) - 1]; ``ditq.numerics.dequantize_weight(q, scale)`` is the
    quantized weight.
    Columns whose Hessian diagonal is 0 (inputs always zero there) are zeroed and given H[i, i] = 1; the damped
    Hessian adds ``damp`` * mean(diag H) to the diagonal. Errors propagate within blocks of ``block_size`` columns
    and lazily to the rest (which does not change the result, only its speed). Without ``act_order`` columns go in
    their own order, each group's scale taken from the updated weights when its first column comes; with it they go
    in order of decreasing Hessian diagonal (the inputs that carry the most energy first, while the most columns
    are left to absorb their errors) and every group's scale is taken up front from the weights as given (the
    reference's ``static_groups``: a group's columns are no longer together in the new order). Neither input is
    modified. Raises ValueError on a bad shape or format, or when the damped Hessian has no Cholesky
    factor (a larger ``damp`` helps).
    """
    qmax, width, _ = _check(weight, bits, group_size)
    in_features = weight.shape[1]
    if hessian.shape != (in_features, in_features):
        raise ValueError(
            f"the Hessian has shape {tuple(hessian.shape)}, expected ({in_features}, {in_features}) "
            f"for a weight of shape {tuple(weight.shape)}"
        )
    if block_size < 1 or damp < 0:
        raise ValueError(f"block_size must be positive and damp non-negative, got {block_size} and {damp}")
    w = weight.detach().to(torch.float32, copy=True)
    h = hessian.detach().to(device=w.device, dtype=torch.float64, copy=True)
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    if act_order:
        return _act_order(w, h, qmax, width, damp, block_size)
    return _gptq_columns(w, _inverse_cholesky(h, damp), qmax, width, block_size, None)


def _gptq_columns(
    w: torch.Tensor,
    h_inv: torch.Tensor,
    qmax: int,
    width: int,
    block_size: int,
    column_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The column sweep: w (N, K) float32, rounded in place with error feedback through h_inv's upper Cholesky
    factor (K, K) -> (q int8 (N, K), scale (N, K // width)). ``column_scale`` (N, K): every column's scale, fixed up
    front (act order); None: each group's taken from the updated weights when its first column comes."""
    out_features, in_features = w.shape
    q = torch.zeros_like(w)
    scale = torch.empty(out_features, in_features // width, dtype=torch.float32, device=w.device)
    for start in range(0, in_features, block_size):
        stop = min(start + block_size, in_features)
        block = w[:, start:stop].clone()
        errors = torch.zeros_like(block)
        h_block = h_inv[start:stop, start:stop]
        for i in range(stop - start):
            column = start + i
            if column_scale is None and column % width == 0:
                scale[:, column // width] = _scale(
                    _group_columns(w, block, errors, h_inv, start, i, column + width), qmax
                )
            step = scale[:, column // width] if column_scale is None else column_scale[:, column]
            current = block[:, i]
            q[:, column] = _round(current, step, qmax)
            error = (current - q[:, column] * step) / h_block[i, i]
            block[:, i:] -= error.unsqueeze(1) @ h_block[i, i:].unsqueeze(0)
            errors[:, i] = error
        w[:, stop:] -= errors @ h_inv[start:stop, stop:]
    return q.to(torch.int8), scale


class _ActOrder(NamedTuple):
    """What the act-order sweep takes, from the weights and the Hessian as given."""

    order: torch.Tensor  # (K,) the columns by decreasing diag(H)
    h_inv: torch.Tensor  # (K, K) float32, the upper Cholesky factor of the permuted damped H^-1
    weight: torch.Tensor  # (N, K) float32, the columns in that order (a copy: the sweep rounds it in place)
    column_scale: torch.Tensor  # (N, K) float32, every permuted column's group scale
    scale: torch.Tensor  # (N, K // width) float32, the group scales in the original order


def _act_order_inputs(w: torch.Tensor, h: torch.Tensor, qmax: int, width: int, damp: float) -> _ActOrder:
    """w (N, K) float32 (dead columns zeroed), h (K, K) float64 (dead diagonal set) -> the sweep's inputs, every
    group's scale taken up front from the weights as given."""
    scale = w.reshape(w.shape[0], -1, width).abs().amax(dim=2).clamp_min(TINY) / qmax
    order = torch.argsort(h.diagonal(), descending=True, stable=True)
    h_inv = _inverse_cholesky(h[order][:, order], damp)
    return _ActOrder(order, h_inv, w[:, order], scale[:, order // width], scale)


def _act_order(
    w: torch.Tensor, h: torch.Tensor, qmax: int, width: int, damp: float, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ in order of decreasing diag(H) with static group scales: w (N, K) float32 (dead columns zeroed), h
    (K, K) float64 (dead diagonal set) -> (q int8 (N, K), scale (N, K // width)) in the original column order."""
    inputs = _act_order_inputs(w, h, qmax, width, damp)
    if _triton_sweeps(w, block_size):  # the same sweep, one launch a block of columns (gptq_triton)
        from ditq.quantization.gptq_triton import sweep_columns

        q = sweep_columns(inputs.weight, inputs.h_inv, qmax, inputs.column_scale, block_size)
    else:
        q, _ = _gptq_columns(inputs.weight, inputs.h_inv, qmax, width, block_size, inputs.column_scale)
    return q[:, torch.argsort(inputs.order)], inputs.scale.contiguous()


def _triton_sweeps(w: torch.Tensor, block_size: int) -> bool:
    """Whether the act-order sweep of w runs as ``gptq_triton``'s kernel: on CUDA, with Triton installed, at the
    kernel's block size (the blocks cut the lazy updates' matmuls, so another size rounds differently), for K * K
    below 2**31 (the kernel's offsets into the Hessian's factor are 32-bit)."""
    small = w.shape[1] ** 2 < 2**31
    return w.is_cuda and small and block_size == BLOCK_SIZE and importlib.util.find_spec("triton") is not None
