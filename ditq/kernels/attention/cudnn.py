"""cuDNN's own fp8 flash attention on Hopper, through nvidia-cudnn-frontend: the ``fp8-fp8`` kind's fast path.

cuDNN's ``sdpa_fp8`` takes Q, K and V in e4m3 with one descale each, quantizes P itself (``scale_s``) and, on
Hopper, writes its output in e4m3 only (``scale_o``): exactly ``reference``'s fp8-fp8 arithmetic, which this path is
checked against like every other.

- Q, the smoothed K and V are quantized by torch ops outside the cuDNN call (``reference.quantize_per_tensor``), so
  that under torch.compile they fuse into what produced them (RoPE, the KV cache's concatenation); the cuDNN call
  itself is one custom op (``ditq::cudnn_sdpa_fp8``) the compiler keeps whole, with no graph break.
- A cuDNN graph is built once per shape and layout, on its first call, and kept for the process (``_PLANS``): the
  build is host work of tens of milliseconds, so a server's warm-up and calibration pay it, not its requests.
- A call with a mask (a causal text segment of the prefill, or padded prompt keys) runs the kind's reference
  arithmetic in torch ops: cuDNN's padding mask needs the padding at the end of a sequence, and Qwen-Image-2.1's
  padded prompt keys lie between its text and its images. A batch of one prompt has no padding, and the prefill's
  text segments are short (tens to hundreds of queries). A shape cuDNN declines (``check_support``) runs the same
  arithmetic, once logged.

Install the frontend with ``pip install 'ditq[cudnn]'``; it loads the cuDNN library torch already ships.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ditq.kernels.attention.reference import (
    OUTPUT_HEADROOM,
    QuantizedQK,
    attend_reference,
    quantize_per_tensor,
    quantize_qk_reference,
)
from ditq.kernels.attention.registry import register_attention_kernel
from ditq.kernels.cuda_common import cuda_available, cuda_op, direct
from ditq.numerics import FP8_MAX

__all__ = ["attend_cudnn", "cudnn_available", "planned_shapes"]

log = logging.getLogger(__name__)

_MIN_BACKEND = 90100  # cuDNN 9.1: fp8 flash attention forward on sm_90


def cudnn_available() -> str | None:
    """None when cuDNN's fp8 attention can be built here (CUDA, the frontend, a cuDNN backend new enough), else
    why not in one phrase."""
    missing = cuda_available()
    if missing:
        return missing
    if importlib.util.find_spec("cudnn") is None:
        return "nvidia-cudnn-frontend is not installed (pip install 'ditq[cudnn]')"
    try:
        import cudnn

        version = int(cudnn.backend_version())
    except Exception as error:  # a frontend that cannot find or load cuDNN's library
        return (
            f"cuDNN's library cannot be loaded by nvidia-cudnn-frontend: {str(error).splitlines()[0][:120]}"
        )
    if version < _MIN_BACKEND:
        return f"cuDNN {version} is older than 9.1, which fp8 attention needs"
    return None


@dataclass
class _Plan:
    """One built cuDNN graph and what it runs with: its tensor descriptors, workspace and amax outputs."""

    graph: Any
    descriptors: dict[str, Any]
    workspace: torch.Tensor
    amax: torch.Tensor  # (2, 1, 1, 1, 1) float32: amax of P and of the output, written and never read


_PLANS: dict[tuple[Any, ...], _Plan | None] = {}  # None: cuDNN declined the shape
_HANDLES: dict[int, Any] = {}
_CONSTANTS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> (descale_s, scale_s)
_LOCK = threading.Lock()  # plans are built by whichever thread calls first (a server's worker, its warm-up)


def planned_shapes() -> list[tuple[Any, ...]]:
    """The keys of the graphs built (or declined) so far: (device, Q shape, K shape, strides, scale)."""
    return list(_PLANS)


def _handle(device: torch.device) -> Any:
    import cudnn

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _HANDLES:
        with torch.cuda.device(index):
            _HANDLES[index] = cudnn.create_handle()
    return _HANDLES[index]


def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """P's descale and scale as cuDNN reads them: (1, 1, 1, 1) float32, 1/448 and 448 (P <= 1 fills e4m3)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _CONSTANTS:
        scale = torch.full((1, 1, 1, 1), FP8_MAX, dtype=torch.float32, device=device)
        _CONSTANTS[index] = (scale.reciprocal(), scale)
    return _CONSTANTS[index]


def _bhsd(graph: Any, name: str, x: torch.Tensor, data_type: Any) -> Any:
    """A (B, S, H, D) tensor as cuDNN's (B, H, S, D) descriptor, the same memory."""
    batch, seq, heads, dim = x.shape
    s_batch, s_seq, s_heads, s_dim = x.stride()
    return graph.tensor(name=name, dim=[batch, heads, seq, dim], stride=[s_batch, s_heads, s_seq, s_dim],
                        data_type=data_type)  # fmt: skip


def _build(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sm_scale: float) -> _Plan:
    import cudnn

    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    handle = _handle(query.device)
    graph = cudnn.pygraph(
        io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle
    )
    tensors = {name: _bhsd(graph, name, x, e4m3) for name, x in (("q", query), ("k", key), ("v", value))}
    for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o"):
        tensors[name] = graph.tensor(name=name, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
    out, _, amax_s, amax_o = graph.sdpa_fp8(
        q=tensors["q"], k=tensors["k"], v=tensors["v"],
        descale_q=tensors["descale_q"], descale_k=tensors["descale_k"], descale_v=tensors["descale_v"],
        descale_s=tensors["descale_s"], scale_s=tensors["scale_s"], scale_o=tensors["scale_o"],
        is_inference=True, attn_scale=sm_scale, use_causal_mask=False, name="sdpa_fp8",
    )  # fmt: skip
    batch, seq, heads, dim = query.shape
    out.set_output(True).set_dim([batch, heads, seq, dim]).set_stride(
        [seq * heads * dim, dim, heads * dim, 1]
    )
    out.set_data_type(e4m3)
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    tensors.update(out=out, amax_s=amax_s, amax_o=amax_o)
    workspace = torch.empty(max(1, graph.get_workspace_size()), dtype=torch.uint8, device=query.device)
    amax = torch.empty(2, 1, 1, 1, 1, dtype=torch.float32, device=query.device)
    return _Plan(graph, tensors, workspace, amax)


def _plan(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, sm_scale: float) -> _Plan | None:
    """The built graph for this shape and layout (built now on its first call), or None where cuDNN declined it."""
    shape_key = (query.device.index, tuple(query.shape), tuple(key.shape), query.stride(), key.stride(),
                 value.stride(), float(sm_scale))  # fmt: skip
    if shape_key in _PLANS:
        return _PLANS[shape_key]
    with _LOCK:
        if shape_key not in _PLANS:
            try:
                _PLANS[shape_key] = _build(query, key, value, sm_scale)
            except Exception as error:  # cuDNN's refusal of a shape (cudnnGraphNotSupportedError and kin)
                log.warning("cuDNN fp8 attention declines Q %s, K %s (%s); that shape runs the same arithmetic in "
                            "torch ops", tuple(query.shape), tuple(key.shape), str(error).splitlines()[0][:200])  # fmt: skip
                _PLANS[shape_key] = None
    return _PLANS[shape_key]


def _sdpa_fp8(
    query: torch.Tensor,
    query_descale: torch.Tensor,
    key: torch.Tensor,
    key_descale: torch.Tensor,
    value: torch.Tensor,
    value_descale: torch.Tensor,
    output_scale: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """(B, S_q, H, D), (B, S_kv, H, D) x2 e4m3 with their (1, 1, 1, 1) float32 descales, the output's scale ->
    the output (B, S_q, H, D) e4m3 (times ``output_scale``); where cuDNN declined the shape, or off CUDA, the same
    arithmetic in torch ops."""
    plan = _plan(query, key, value, sm_scale) if query.is_cuda else None
    if plan is None:
        qk = QuantizedQK("fp8-fp8", query, query_descale, key, key_descale)
        # V as its e4m3 values: quantized again per tensor, it rounds to the same values at the same scale
        out = attend_reference(qk, value.to(torch.float32) * value_descale, None, None, sm_scale)
        return (out * output_scale).to(torch.float8_e4m3fn).contiguous()  # the fake's layout
    out = torch.empty(query.shape, dtype=torch.float8_e4m3fn, device=query.device)
    descale_s, scale_s = _constants(query.device)
    d = plan.descriptors
    pack = {d["q"]: query, d["k"]: key, d["v"]: value, d["descale_q"]: query_descale, d["descale_k"]: key_descale,
            d["descale_v"]: value_descale, d["descale_s"]: descale_s, d["scale_s"]: scale_s,
            d["scale_o"]: output_scale, d["out"]: out, d["amax_s"]: plan.amax[0], d["amax_o"]: plan.amax[1]}  # fmt: skip
    import cudnn

    handle = _handle(query.device)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(query.device).cuda_stream)
    plan.graph.execute(pack, plan.workspace, handle=handle)
    return out


# One custom op: torch.compile keeps the call whole (the graph's host-side execution cannot be traced). On other
# devices than CUDA it computes the same arithmetic in torch ops, so that the path's wrapper is tested on the CPU.
_sdpa_op = cuda_op("ditq::cudnn_sdpa_fp8", _sdpa_fp8, device_types=None)


@_sdpa_op.register_fake
def _sdpa_fake(query: torch.Tensor, query_descale: torch.Tensor, key: torch.Tensor, key_descale: torch.Tensor,
               value: torch.Tensor, value_descale: torch.Tensor, output_scale: torch.Tensor,
               sm_scale: float) -> torch.Tensor:  # fmt: skip
    return query.new_empty(query.shape, dtype=torch.float8_e4m3fn)


def _masked(
    query: torch.Tensor,
    query_descale: torch.Tensor,
    key: torch.Tensor,
    key_descale: torch.Tensor,
    value: torch.Tensor,
    key_valid: torch.Tensor | None,
    causal_offset: int | None,
    sm_scale: float,
) -> torch.Tensor:
    """A masked call: the kind's reference arithmetic on the quantized Q and K -> (B, S_q, H, D) in V's dtype."""
    qk = QuantizedQK("fp8-fp8", query, query_descale, key, key_descale)
    return attend_reference(qk, value, key_valid, causal_offset, sm_scale).contiguous()  # the fake's layout


# Masked calls as one op too: traced, the reference's loop over query chunks would tie a compiled graph to each
# sequence length (a recompilation per shape).
_masked_op = cuda_op("ditq::cudnn_sdpa_fp8_masked", _masked, device_types=None)


@_masked_op.register_fake
def _masked_fake(query: torch.Tensor, query_descale: torch.Tensor, key: torch.Tensor, key_descale: torch.Tensor,
                 value: torch.Tensor, key_valid: torch.Tensor | None, causal_offset: int | None,
                 sm_scale: float) -> torch.Tensor:  # fmt: skip
    return value.new_empty(query.shape)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def attend_cudnn(
    qk: QuantizedQK,
    value: torch.Tensor,
    key_valid: torch.Tensor | None,
    causal_offset: int | None,
    sm_scale: float,
) -> torch.Tensor:
    """cuDNN's fp8 flash attention (sdpa_fp8): e4m3 Q . K^T and P . V, e4m3 output; masked calls and shapes cuDNN
    declines run the same arithmetic in torch ops."""
    if key_valid is not None or causal_offset is not None:
        return direct(_masked_op)(qk.query, qk.query_scale, qk.key, qk.key_scale, value, key_valid, causal_offset,
                                  float(sm_scale))  # fmt: skip
    v_q, v_scale = quantize_per_tensor(value)
    output_descale = OUTPUT_HEADROOM * v_scale
    out = direct(_sdpa_op)(_last_dim_contiguous(qk.query), qk.query_scale, _last_dim_contiguous(qk.key),
                           qk.key_scale, _last_dim_contiguous(v_q), v_scale, output_descale.reciprocal(),
                           float(sm_scale))  # fmt: skip
    return (out.to(torch.float32) * output_descale).to(value.dtype)


register_attention_kernel(
    name="cudnn-attention-fp8-fp8",
    kind="fp8-fp8",
    device_type="cuda",
    priority=100,
    quantize=quantize_qk_reference,
    min_capability=(9, 0),
    dtypes=frozenset({torch.bfloat16, torch.float16}),
    head_dims=frozenset({64, 128}),
    available=cudnn_available,
    description="cuDNN's fp8 flash attention (nvidia-cudnn-frontend sdpa_fp8): e4m3 Q, smoothed K, V and output, "
    "one scale per tensor; one graph per shape, built on its first call and kept.",
)(attend_cudnn)
