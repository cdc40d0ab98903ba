"""The doctor for quantized-attention paths, and the one policy that chooses one before a pipeline uses it
(``attention_chooser``; the runtime installs the choice: ``ditq.runtime.attention.install_attention``).

Cases, per activation dtype the path claims (bfloat16, float16), at ``ATTENTION_SHAPE`` with the head dim asked:

- ``synthetic``: seeded random Q/K/V, the keys with a shared offset (which smoothing removes), batch 1's last
  prompt keys padded; two calls as Qwen-Image-2.1's prefill makes them: a text segment (queries [48, 96) over
  keys [0, 96), causal from 48) and the target (every query over every key), and a third with no mask at all, as
  a batch of one unpadded prompt makes every call of the cached step (a path may run masked calls another way:
  cuDNN's does). Steps: ``finite``; ``output``
  against float32 SDPA of the unquantized inputs with the same mask, relative L2 within ``ATTENTION_BOUNDS``
  (the 8-bit scores' own error, measured on the reference arithmetic, with margin); ``match`` against the
  reference arithmetic (``ditq.kernels.attention.reference``) within ``MATCH_BOUNDS`` (rounding only).
- ``analytic``: every key of a head equal, so attention is uniform and the output is exactly the mean of the
  valid values (as rounded to e4m3 where P . V is 8-bit too), with the padding mask and without; relative L2 within
  ``ANALYTIC_BOUNDS`` (the output's rounding: the output dtype's, or e4m3's where the kind writes e4m3).

A path whose check raises, gives NaN/inf or misses a bound is refused with the failing step as its reason, and
``choose_attention_kernel`` tries the next candidate.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ditq.doctor.checks import CHECK_DTYPES, raised, verdict
from ditq.errors import DitqError
from ditq.kernels.attention import (
    FP8_PV_KINDS,
    AttentionPath,
    all_attention_kernels,
    attend_reference,
    candidate_attention_paths,
    dequantized_values,
    quantize_qk_reference,
    quantize_value_reference,
)
from ditq.numerics import relative_l2
from ditq.runfiles import DoctorCheck, DoctorPath

__all__ = [
    "ANALYTIC_BOUNDS",
    "ATTENTION_BOUNDS",
    "ATTENTION_SHAPE",
    "AUTO_KINDS",
    "AUTO_SHAPES",
    "MATCH_BOUNDS",
    "AttentionChoice",
    "AttentionTiming",
    "AutoAttention",
    "attention_chooser",
    "check_attention_path",
    "choose_attention_kernel",
    "choose_auto_attention",
    "run_attention_doctor",
    "time_attention",
]

log = logging.getLogger(__name__)

# Against float32 SDPA, synthetic case: the reference arithmetic measures 0.009 (int8), 0.037 (fp8 e4m3), 0.036
# (int8-fp8: e4m3 P and V) and 0.057 (fp8-fp8: e4m3 Q, K, P, V and output, one scale per tensor) on such inputs; the
# bounds leave about 2x for a kernel's own rounding, 1.4x for fp8-fp8 (its e4m3 output's rounding is already in).
ATTENTION_BOUNDS = {"int8": 0.02, "fp8": 0.08, "int8-fp8": 0.08, "fp8-fp8": 0.08}
# Against the reference arithmetic: bf16 rounding of P and of the output only; int8-fp8 rounds P to e4m3 against
# the running row maximum of a fused kernel where the reference has the final one, so the two round P differently
# (measured 0.014-0.021 on an H200; each is as far from float32 SDPA as the other); fp8-fp8 likewise, and its e4m3
# output rounds the two results' small differences to neighbouring e4m3 values.
MATCH_BOUNDS = {"int8": 0.01, "fp8": 0.01, "int8-fp8": 0.03, "fp8-fp8": 0.05}
# Uniform attention: the output's own rounding (bf16 half an ulp is 0.2%; an e4m3 output's half a step is 2**-4).
ANALYTIC_BOUNDS = {"int8": 0.01, "fp8": 0.01, "int8-fp8": 0.01, "fp8-fp8": 2**-4}
ATTENTION_SHAPE = (2, 192, 2)  # batch, tokens, heads; the head dim is the model's
_TEXT = (48, 96)  # the synthetic text segment: queries [48, 96) over keys [0, 96), causal from 48
_PADDED = slice(80, 96)  # batch 1's padded prompt keys


def _inputs(head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, tokens, heads = ATTENTION_SHAPE
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, tokens, heads, head_dim, generator=g)
    k = torch.randn(batch, tokens, heads, head_dim, generator=g) + 3 * torch.randn(
        1, 1, heads, head_dim, generator=g
    )
    v = torch.randn(batch, tokens, heads, head_dim, generator=g)
    key_valid = torch.ones(batch, tokens, dtype=torch.bool)
    key_valid[1, _PADDED] = False
    return q, k, v, key_valid


def _sdpa32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    q, k, v = (x.to(torch.float32).transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


def _calls(
    path: AttentionPath, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_valid: torch.Tensor
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """label -> (path output, reference-arithmetic output, float32 SDPA output) for the two prefill calls."""
    start, end = _TEXT
    sm_scale = q.shape[-1] ** -0.5
    qk = path.quantize(q, k, path.kind)
    ref_qk = quantize_qk_reference(q.cpu(), k.cpu(), path.kind)
    causal = torch.ones(end - start, end, dtype=torch.bool).tril(start)[None, None]
    valid = key_valid.cpu()[:, None, None, :]
    qc, kc, vc = q.cpu(), k.cpu(), v.cpu()
    everything = torch.ones(1, 1, 1, 1, dtype=torch.bool)
    return {
        "text segment": (
            path.attend(qk.rows(start, end).keys(end), v[:, :end], key_valid, start, sm_scale),
            attend_reference(
                ref_qk.rows(start, end).keys(end), vc[:, :end], key_valid.cpu(), start, sm_scale
            ),
            _sdpa32(qc[:, start:end], kc[:, :end], vc[:, :end], causal & valid[..., :end]),
        ),
        "target": (
            path.attend(qk, v, key_valid, None, sm_scale),
            attend_reference(ref_qk, vc, key_valid.cpu(), None, sm_scale),
            _sdpa32(qc, kc, vc, valid),
        ),
        "unmasked": (
            path.attend(qk, v, None, None, sm_scale),
            attend_reference(ref_qk, vc, None, None, sm_scale),
            _sdpa32(qc, kc, vc, everything),
        ),
    }


def _check(step: str, where: str, weights: str, dtype: str, value: float | None, bound: float | None,
           message: str = "") -> DoctorCheck:  # fmt: skip
    passed = value is not None and bound is not None and value <= bound
    if step == "finite":
        passed = message == ""
    elif not message:
        message = f"rel-L2 {value:.2e} {'<=' if passed else '>'} {bound:g}"
    return DoctorCheck(step=step, geometry=where, weights=weights, dtype=dtype, passed=passed, message=message,
                       value=value, bound=bound)  # fmt: skip


def _dtype_checks(
    path: AttentionPath, device: torch.device, dtype: torch.dtype, head_dim: int
) -> list[DoctorCheck]:
    name = str(dtype).removeprefix("torch.")
    batch, tokens, heads = ATTENTION_SHAPE
    where = f"B{batch} S{tokens} H{heads} D{head_dim}"
    checks = []
    q, k, v, key_valid = (x.to(dtype) if x.is_floating_point() else x for x in _inputs(head_dim, seed=0))
    calls = _calls(path, q.to(device), k.to(device), v.to(device), key_valid.to(device))
    for label, (out, reference, sdpa) in calls.items():
        out = out.float().cpu()
        bad = int((~torch.isfinite(out)).sum())
        checks.append(_check("finite", f"{where} ({label})", "synthetic", name, None, None,
                             f"{bad} non-finite outputs" if bad else ""))  # fmt: skip
        checks.append(_check("output", f"{where} ({label})", "synthetic", name, relative_l2(out, sdpa),
                             ATTENTION_BOUNDS[path.kind]))  # fmt: skip
        checks.append(_check("match", f"{where} ({label})", "synthetic", name, relative_l2(out, reference),
                             MATCH_BOUNDS[path.kind]))  # fmt: skip
    # Uniform keys: every score of a row equal, so the output is the mean of the valid values.
    uniform_qk = path.quantize(q.to(device), k[:, :1].expand_as(k).contiguous().to(device), path.kind)
    # P . V in e4m3: the mean of the values as they were rounded
    rounded = (
        dequantized_values(*quantize_value_reference(v, path.kind))
        if path.kind in FP8_PV_KINDS
        else v.float()
    )
    for label, valid in (("uniform keys", key_valid), ("uniform keys, unmasked", None)):
        out = path.attend(uniform_qk, v.to(device), None if valid is None else valid.to(device), None,
                          head_dim**-0.5).float().cpu()  # fmt: skip
        weights = (torch.ones_like(key_valid) if valid is None else valid).to(torch.float32)[:, :, None, None]
        mean_v = (rounded * weights).sum(dim=1, keepdim=True) / weights.sum(dim=1, keepdim=True)
        checks.append(_check("output", f"{where} ({label})", "analytic", name,
                             relative_l2(out, mean_v.expand_as(out)), ANALYTIC_BOUNDS[path.kind]))  # fmt: skip
    return checks


def check_attention_path(
    path: AttentionPath,
    device: torch.device | str,
    head_dim: int,
    dtypes: Sequence[torch.dtype] = CHECK_DTYPES,
) -> DoctorPath:
    """Every case for ``path`` on ``device``: PASS, FAIL (first failing step as the reason) or SKIP (why not)."""
    device = torch.device(device)
    supported = [d for d in dtypes if path.supports(device, d, head_dim)[0]]
    checks: list[DoctorCheck] = []
    for dtype in supported:
        try:
            checks += _dtype_checks(path, device, dtype, head_dim)
        except Exception as error:  # a raising path is refused with its error, not a crash of the caller
            checks.append(DoctorCheck(step="output", geometry=f"D{head_dim}", weights="synthetic",
                                      dtype=str(dtype).removeprefix("torch."), passed=False,
                                      message=raised(error)))  # fmt: skip
    skipped = (
        None if supported else "; ".join(sorted({path.supports(device, d, head_dim)[1] for d in dtypes}))
    )
    outcome, reason = verdict(checks, skipped)
    values = [
        c.value for c in checks if c.step == "output" and c.weights == "synthetic" and c.value is not None
    ]
    return DoctorPath(path=path.name, scheme=f"attn-{path.kind}", device=str(device), verdict=outcome,
                      reason=reason, capability_overclaim=outcome == "FAIL", checks=checks, report_dir=None,
                      worst_rel_l2=max(values) if values else None, bound=ATTENTION_BOUNDS[path.kind])  # fmt: skip


@dataclass(frozen=True)
class AttentionChoice:
    """The attention policy's decision: the path, and the candidates refused before it (with their reasons)."""

    kind: str
    path: AttentionPath
    verified: bool
    refused: tuple[tuple[str, str], ...] = ()

    def summary(self) -> str:
        line = f"{self.path.name} ({self.kind} Q.K^T{'' if self.verified else ', unverified'})"
        return line + "".join(f"; refused {name}: {why}" for name, why in self.refused)


def choose_attention_kernel(
    kind: str, device: torch.device | str, dtype: torch.dtype, head_dim: int, verify: bool = True
) -> AttentionChoice:
    """The first candidate path (registry order, DITQ_ATTENTION_KERNELS / DITQ_DISABLE_ATTENTION_KERNELS honoured)
    that passes ``check_attention_path`` in ``dtype`` on this device; a failing one is refused with a warning
    naming its reason and the next is tried. ``verify=False`` (--skip-doctor) takes the first candidate."""
    device = torch.device(device)
    candidates = candidate_attention_paths(kind, device, dtype, head_dim)
    if not candidates:
        raise DitqError(f"no {kind} attention path can run {dtype} at head dim {head_dim} on {device}")
    if not verify:
        log.warning(
            "--skip-doctor: attention path %s runs without verification on this device", candidates[0].name
        )
        return AttentionChoice(kind, candidates[0], verified=False)
    refused: list[tuple[str, str]] = []
    for path in candidates:
        result = check_attention_path(path, device, head_dim, dtypes=(dtype,))
        if result.verdict == "PASS":
            if refused:
                log.warning(
                    "attention doctor: using %s after refusing %s",
                    path.name,
                    ", ".join(n for n, _ in refused),
                )
            return AttentionChoice(kind, path, verified=True, refused=tuple(refused))
        log.warning("attention doctor: refusing %s (%s); trying the next path", path.name, result.reason)
        refused.append((path.name, result.reason))
    reasons = "; ".join(f"{name}: {why}" for name, why in refused)
    raise DitqError(f"no {kind} attention path passed the doctor on {device} ({reasons})")


def run_attention_doctor(
    device: torch.device | str, kinds: Sequence[str], head_dim: int = 128
) -> list[DoctorPath]:
    """`ditq doctor --attention KIND`: every path of those kinds for this device type, at ``head_dim``."""
    device = torch.device(device)
    return [
        check_attention_path(path, device, head_dim)
        for path in all_attention_kernels()
        if path.kind in kinds and path.device_type == device.type
    ]


# --attention auto: the kinds considered, most faithful first (on the demo model, bf16: int8 0.8 dB under the parity
# band, int8-fp8 4.2 dB; fp8 Q.K^T 9.5 dB, never offered: docs/results.md, "Quantized attention"; fp8-fp8 last, the
# least faithful on the doctor's synthetic case and the fastest where cuDNN runs it), and the served
# shapes a kind must be faster at: (queries, keys) of Qwen-Image-2.1 at 1024x1024 (4096 image tokens and about 256
# text tokens), with no references and at a 4-reference cached step. On a CPU a sixteenth of them bounds the
# start-up's cost.
AUTO_KINDS = ("int8", "int8-fp8", "fp8-fp8")
AUTO_SHAPES = {"cuda": ((4352, 4352), (4096, 20736)), "cpu": ((272, 272), (256, 1296))}


@dataclass(frozen=True)
class AttentionTiming:
    """One served shape, timed both ways on this device: the quantized path against SDPA (the model's own)."""

    queries: int
    keys: int
    path_ms: float
    sdpa_ms: float

    def describe(self) -> str:
        return f"{self.path_ms:.3g} ms vs SDPA {self.sdpa_ms:.3g} ms at {self.queries}x{self.keys} tokens"


@dataclass(frozen=True)
class AutoAttention:
    """``--attention auto``'s decision: ``choice``, the first kind of ``AUTO_KINDS`` whose verified path was faster
    at every served shape, or None where the model keeps its own attention; ``timings`` (kind -> its timings) and
    ``refused`` (kind -> the doctor's refusal) are the evidence either way."""

    choice: AttentionChoice | None
    timings: dict[str, tuple[AttentionTiming, ...]]
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def path(self) -> AttentionPath | None:
        """The path to install, or None: the model keeps its own attention."""
        return None if self.choice is None else self.choice.path

    def summary(self) -> str:
        def measured(kind: str) -> str:
            return "; ".join(t.describe() for t in self.timings[kind])

        others = [f"{kind} not faster: {measured(kind)}" for kind in self.timings
                  if self.choice is None or kind != self.choice.kind]  # fmt: skip
        others += [f"{kind}: {why}" for kind, why in self.refused.items()]
        if self.choice is not None:
            head = f"auto: {self.choice.summary()}, faster ({measured(self.choice.kind)})"
            return head + "".join(f"; {line}" for line in others)
        return f"auto: the model's own attention ({'; '.join(others)})"


def _median_ms(call: Callable[[], Any], device: torch.device, repeats: int = 3) -> float:
    """Median wall time of ``call`` after one warm-up, the device synchronised around each."""
    call()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begun = time.perf_counter()
        call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - begun) * 1000)
    return sorted(times)[len(times) // 2]


def _quantized_attention(
    path: AttentionPath, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> torch.Tensor:
    return path.attend(path.quantize(q, k, path.kind), v, None, None, q.shape[-1] ** -0.5)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))


def time_attention(
    path: AttentionPath, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int
) -> tuple[AttentionTiming, ...]:
    """``path`` (quantizing Q and K, then attending) against SDPA at ``AUTO_SHAPES`` on ``device``, seeded
    inputs in ``dtype``, (B, S, H, D) as the model holds them."""
    g = torch.Generator(device=device).manual_seed(
        0
    )  # drawn where they are used: each kind auto tries draws them
    timings = []
    for queries, keys in AUTO_SHAPES["cuda" if device.type == "cuda" else "cpu"]:
        q = torch.randn(1, queries, heads, head_dim, generator=g, device=device, dtype=dtype)
        k, v = (
            torch.randn(1, keys, heads, head_dim, generator=g, device=device, dtype=dtype) for _ in range(2)
        )
        quantized = functools.partial(_quantized_attention, path, q, k, v)
        sdpa = functools.partial(_sdpa, q, k, v)
        timings.append(
            AttentionTiming(queries, keys, _median_ms(quantized, device), _median_ms(sdpa, device))
        )
    return tuple(timings)


def choose_auto_attention(
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    verify: bool = True,
    timer: Callable[..., tuple[AttentionTiming, ...]] = time_attention,
) -> AutoAttention:
    """The first kind of ``AUTO_KINDS`` (most faithful first) whose doctor-chosen path is faster than SDPA at every
    served shape on this device; otherwise None and the model's own attention (never slower than not asking)."""
    timings: dict[str, tuple[AttentionTiming, ...]] = {}
    refused: dict[str, str] = {}
    for kind in AUTO_KINDS:
        try:
            choice = choose_attention_kernel(kind, device, dtype, head_dim, verify=verify)
        except DitqError as error:  # no path, or none passed: the next kind, and why
            refused[kind] = str(error)
            continue
        timings[kind] = timer(choice.path, device, dtype, heads, head_dim)
        if all(t.path_ms < t.sdpa_ms for t in timings[kind]):
            return AutoAttention(choice, timings, refused)
    return AutoAttention(None, timings, refused)


def attention_chooser(
    kind: str, device: torch.device | str, dtype: torch.dtype, verify: bool = True
) -> Callable[[int, int], AttentionChoice | AutoAttention]:
    """``--attention KIND``'s chooser for ``ditq.runtime.attention.install_attention``: (heads, head dim) -> the
    doctor-chosen ``kind`` path (``choose_attention_kernel``), or for "auto" ``choose_auto_attention``'s decision.
    ``verify=False`` (--skip-doctor) takes the first candidate unchecked. It chooses; the runtime installs."""
    device = torch.device(device)
    if kind == "auto":
        return functools.partial(_choose_auto, device, dtype, verify)
    return functools.partial(_choose_kind, kind, device, dtype, verify)


def _choose_auto(
    device: torch.device, dtype: torch.dtype, verify: bool, heads: int, head_dim: int
) -> AutoAttention:
    return choose_auto_attention(device, dtype, heads, head_dim, verify=verify)


def _choose_kind(
    kind: str, device: torch.device, dtype: torch.dtype, verify: bool, _heads: int, head_dim: int
) -> AttentionChoice:
    return choose_attention_kernel(kind, device, dtype, head_dim, verify=verify)
