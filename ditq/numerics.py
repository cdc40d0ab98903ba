"""The quantization arithmetic, written once: quantizer, decoder, reference kernels and doctor share it.

Weights: symmetric, static, scale = amax / qmax per output channel (or per
group of ``group_size`` input features), q = round(w / scale) clamped to
[-qmax, qmax]. int8: qmax = 127; fp8 e4m3: qmax = 448 and the cast rounds.
Activations (w8a8, fp8): dynamic, symmetric, one scale per token (row),
scale = amax(|x|) / qmax.
Attention keys (quantized attention): smoothed first, key - mean over the sequence per head
(SageAttention), then quantized per token like activations.
All scale arithmetic is float32.
"""

from __future__ import annotations

import sys

import torch

from ditq.schemes import Scheme

__all__ = [
    "FP8_MAX",
    "INT8_MAX",
    "TINY",
    "dequantize_weight",
    "pack_int_to_int32",
    "quantize_activation_per_token",
    "quantize_weight",
    "relative_l2",
    "representable_neighbours",
    "smooth_keys",
    "unpack_int32_to_int",
]

INT8_MAX = 127.0
FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448.0
TINY = 1e-12  # the smallest amax a scale is taken from (an all-zero row quantizes to zeros)


def _grouped(weight: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """(out, in) -> (out, in // g, g) for grouped scales, (out, 1, in) for per-channel."""
    out_features, in_features = weight.shape
    if group_size is None:
        return weight.reshape(out_features, 1, in_features)
    if in_features % group_size:
        raise ValueError(f"in_features {in_features} is not a multiple of group size {group_size}")
    return weight.reshape(out_features, in_features // group_size, group_size)


def quantize_weight(weight: torch.Tensor, scheme: Scheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D weight.

    Returns (q, scale): q has the weight's shape and the scheme's storage dtype
    (int8 or float8_e4m3fn); scale is float32 (out, 1) per channel or
    (out, in // group_size) per group.
    """
    if weight.ndim != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    w = _grouped(weight.to(torch.float32), scheme.group_size)
    scale = w.abs().amax(dim=2, keepdim=True).clamp_min(TINY) / scheme.weight_qmax
    scaled = w / scale
    if scheme.weight_type == "int":
        q = scaled.round_().clamp_(-scheme.weight_qmax, scheme.weight_qmax).to(torch.int8)
    else:
        q = scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(weight.shape), scale.reshape(weight.shape[0], -1).contiguous()


def dequantize_weight(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """q (out, in) int8|fp8 with scale (out, 1) or (out, n_groups) -> weight in ``dtype`` (computed in float32)."""
    out_features, in_features = q.shape
    n_groups = scale.shape[1]
    grouped = q.to(torch.float32).reshape(out_features, n_groups, in_features // n_groups)
    if grouped.data_ptr() == q.data_ptr():  # q was float32 already: not changed in place
        grouped = grouped.clone()
    grouped.mul_(scale.to(torch.float32).unsqueeze(-1))  # in place: one float32 copy of the weight, not two
    return grouped.reshape(out_features, in_features).to(dtype)


def quantize_activation_per_token(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-token quantization of x (..., K).

    Returns (q, scale) with q int8 or float8_e4m3fn of x's shape and scale
    float32 of shape (..., 1).
    """
    xf = x.to(torch.float32)
    qmax = INT8_MAX if kind == "int8" else FP8_MAX
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp_min(TINY) / qmax
    scaled = xf / scale
    if kind == "int8":
        return scaled.round_().clamp_(-128.0, 127.0).to(torch.int8), scale
    if kind == "fp8":
        return scaled.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale
    raise ValueError(f"unknown activation kind {kind!r}")


def smooth_keys(key: torch.Tensor) -> torch.Tensor:
    """key minus its mean over the sequence axis, in float32 (SageAttention's smoothing).

    Every score q . k_j of one query row shifts by the same q . mean, which softmax cancels, so attention is
    unchanged while the keys' shared offset no longer dominates each token's int8/fp8 range.
    key (B, S, H, D) -> float32 of the same shape.
    """
    keys = key.to(torch.float32)
    return keys - keys.mean(dim=1, keepdim=True)


def pack_int_to_int32(q: torch.Tensor, num_bits: int = 8) -> torch.Tensor:
    """compressed-tensors' packing: (out, in) int8 holding ``num_bits``-wide values -> (out, ceil(in / (32 /
    num_bits))) int32.

    Each value is biased by 2**(num_bits - 1) to an unsigned field; 32 / num_bits fields go little-end first into
    one int32 (value j of a word in bits num_bits * j and up), the last word zero-padded.
    """
    if num_bits not in (4, 8):
        raise ValueError(f"num_bits {num_bits}: ditq packs 4- and 8-bit values")
    per_word = 32 // num_bits
    out_features, in_features = q.shape
    unsigned = q.to(torch.int32) + (1 << (num_bits - 1))
    pad = -in_features % per_word
    if pad:
        unsigned = torch.nn.functional.pad(unsigned, (0, pad))
    unsigned = unsigned.reshape(out_features, -1, per_word)
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=q.device)
    packed = (unsigned.to(torch.int64) << shifts.to(torch.int64)).sum(dim=-1)
    # Wrap the unsigned 32-bit value into int32's range.
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def unpack_int32_to_int(packed: torch.Tensor, shape: tuple[int, int], num_bits: int = 8) -> torch.Tensor:
    """Inverse of pack_int_to_int32: (out, ceil(in / (32 / num_bits))) int32 -> (out, in) int8.

    On a little-endian host the words' bytes are already the fields in order (low first), so 4- and 8-bit values
    are read a byte at a time, ``UNPACK_ROWS`` rows at a time into the output: flipping each field's top bit makes
    it two's complement (the bias of 2**(num_bits - 1) taken off), and a nibble is sign-extended by shifts. No
    temporary is wider than a byte a value, where shifting whole words made four (unpacking was about 30 % of
    ``ditq verify``'s time). Other widths, big-endian hosts and tensors on a GPU (the w8a16 repack, the int8
    embedding's rows; the byte path has not run there yet) shift the words.
    """
    out_features, in_features = shape
    if num_bits not in (4, 8) or sys.byteorder != "little" or packed.ndim != 2 or packed.device.type != "cpu":
        return _unpack_shifting(packed, shape, num_bits)
    if packed.shape[0] != out_features or packed.shape[1] * 32 // num_bits < in_features:
        raise ValueError(
            f"packed words {tuple(packed.shape)} cannot hold {num_bits}-bit values of shape {shape}"
        )
    packed = packed.contiguous()
    values = torch.empty(out_features, in_features, dtype=torch.int8, device=packed.device)
    step = max(1, UNPACK_ROWS // max(1, packed.shape[1] * 4))
    for start in range(0, out_features, step):
        stop = min(start + step, out_features)
        flipped = (packed[start:stop].view(torch.uint8) ^ (0x80 if num_bits == 8 else 0x88)).view(torch.int8)
        if num_bits == 4:  # the low nibble (the earlier value) then the high one, each sign-extended
            flipped = torch.stack(((flipped << 4) >> 4, flipped >> 4), dim=-1)
        values[start:stop] = flipped.reshape(stop - start, -1)[:, :in_features]
    return values


# packed bytes unpack_int32_to_int reads at a time (4 MiB; its temporaries a few times that)
UNPACK_ROWS = 1 << 22


def _unpack_shifting(packed: torch.Tensor, shape: tuple[int, int], num_bits: int) -> torch.Tensor:
    """unpack_int32_to_int by shifting whole words: any width, any byte order."""
    out_features, in_features = shape
    shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=packed.device)
    unsigned = (packed.unsqueeze(-1) >> shifts) & ((1 << num_bits) - 1)
    values = (unsigned - (1 << (num_bits - 1))).to(torch.int8).reshape(out_features, -1)
    return values[:, :in_features].contiguous()


def relative_l2(actual: torch.Tensor, reference: torch.Tensor) -> float:
    """||actual - reference|| / ||reference||, in float64.

    Tensors of one shape on the CPU are summed ``L2_CHUNK`` elements at a time (their float64 copies never made
    whole: a full-size layer's were gigabytes); others (broadcast as ``actual - reference`` does, or on a GPU,
    where the chunked form has not run yet) are copied whole.
    """
    if actual.shape != reference.shape or actual.device.type != "cpu":
        a, r = actual.to(torch.float64), reference.to(torch.float64)
        return float((a - r).norm() / r.norm().clamp_min(1e-30))
    flat_a, flat_r = actual.reshape(-1), reference.reshape(-1)
    sums = torch.zeros(2, dtype=torch.float64, device=actual.device)
    for start in range(0, flat_a.numel(), L2_CHUNK):
        a = flat_a[start : start + L2_CHUNK].to(torch.float64)
        r = flat_r[start : start + L2_CHUNK].to(torch.float64)
        difference = a - r
        sums[0] += torch.dot(difference, difference)
        sums[1] += torch.dot(r, r)
    error, norm = sums.sqrt().tolist()
    return error / max(norm, 1e-30)


L2_CHUNK = 1 << 20  # elements relative_l2 takes at a time (8 MiB a float64 copy)


def representable_neighbours(value: float, dtype: torch.dtype) -> tuple[float, float]:
    """The two values of ``dtype`` around ``value`` (both ``value`` where it is representable).

    A correct computation whose exact answer is ``value`` returns one of them in ``dtype``: e.g. 4304 in bfloat16,
    whose spacing above 4096 is 32, comes back as 4288 or 4320 (4304 is their midpoint). Positive finite values.
    """
    if value <= 0:
        raise ValueError(f"expected a positive value, got {value}")
    nearest = torch.tensor(value, dtype=torch.float64).to(dtype)
    if float(nearest) == value:
        return value, value
    bits = {2: torch.int16, 4: torch.int32}[nearest.element_size()]
    step = -1 if float(nearest) > value else 1  # to the neighbour on value's other side
    other = (nearest.view(bits) + step).view(dtype)
    low, high = sorted((float(nearest), float(other)))
    return low, high
