"""Where a loaded pipeline's weights live while it runs: all on the device, one component at a time, per block,
or placed by how often each component runs.

- ``none``: every component on the device.
- ``model``: components wait on the host and move to the device whole, one at
  a time, when they run (diffusers' ``enable_model_cpu_offload``, through accelerate).
- ``block``: components' blocks stream to the device one by one around their
  forward (diffusers' block-level group offload), for models that do not fit.
- ``auto``: a ``Placement``. Components are ranked by how often a request runs them: the denoiser (transformer
  or UNet: every step) first, then the VAE (once per reference and once to decode), then the rest (text
  encoders: once per request), smallest first. The longest prefix of that ranking whose weights fit the budget
  stays resident; each other component's weights wait in pinned host memory and are copied to the device block
  by block as it runs (``_Streamed``: the blocks of its block lists, wherever they nest, like a text encoder's
  language model and vision tower). ``Placement.demote`` takes the next step when a measured request does not
  fit: the VAE decodes in tiles, then the resident components start to stream from the last one up; streaming
  the denoiser too (diffusers' block-level group offload, on a side stream) is the last resort.

Quantized layers must be repacked before offload hooks are attached, so the
hooks see the final set of tensors (``ditq.runtime.loader.prepare_quantized``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ditq.devices import OFFLOAD_MODES
from ditq.errors import DitqError, InputError

__all__ = [
    "DENOISERS",
    "VAE_STAGES",
    "Placement",
    "apply_offload",
    "demote_until_it_runs",
    "module_bytes",
    "run_order",
    "runs_out",
    "streams",
    "transfer_rate_gbps",
]

log = logging.getLogger(__name__)

DENOISERS = ("transformer", "unet", "transformer_2", "prior")  # the components a request runs at every step
VAE_STAGES = ("decoding", "image_encoding")  # the stage clock's stages that VAE tiling makes smaller
_TRANSFER_PROBE_BYTES = 256 * 2**20
_TILING = "the VAE decodes in tiles"  # Placement.demote's first step


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers (what moving it moves)."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)


def _modules(pipeline: Any) -> dict[str, torch.nn.Module]:
    return {
        name: c
        for name, c in pipeline.components.items()
        if isinstance(c, torch.nn.Module) and module_bytes(c) > 0
    }


def run_order(pipeline: Any) -> list[str]:
    """The pipeline's weighted components, the most often run first: denoisers, the VAE, then the rest by size."""
    modules = _modules(pipeline)
    first = [n for n in DENOISERS if n in modules]
    vae = [n for n in ("vae",) if n in modules]
    rest = sorted(
        (n for n in modules if n not in first and n not in vae), key=lambda n: module_bytes(modules[n])
    )
    return first + vae + rest


def transfer_rate_gbps(device: torch.device) -> float | None:
    """Pinned host -> ``device`` copy rate, GB/s (one 256 MiB copy after a warm-up); None off CUDA."""
    if device.type != "cuda":
        return None
    host = torch.empty(_TRANSFER_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    target = torch.empty_like(host, device=device)
    target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    del host, target
    return round(_TRANSFER_PROBE_BYTES / seconds / 1e9, 2)


def _block_lists(module: torch.nn.Module) -> list[torch.nn.ModuleList]:
    """The outermost ModuleLists of one repeated class that hold weights (a quantized model's too, whose Linears
    are no longer ``torch.nn.Linear``)."""
    found: list[tuple[str, torch.nn.ModuleList]] = []
    for name, child in module.named_modules():
        if not isinstance(child, torch.nn.ModuleList) or len(child) == 0:
            continue
        if any(name.startswith(f"{outer}.") for outer, _ in found) or len({type(i) for i in child}) != 1:
            continue
        if module_bytes(child) > 0:
            found.append((name, child))
    return [child for _, child in found]


class _Streamed:
    """A component whose weights wait in pinned host memory: each block of its block lists is copied to the device
    when its forward starts and dropped there when it ends. The rest of its tensors (embeddings, norms, heads, a VAE's
    first and last convolutions) are copied when the module that owns them runs, or once for the whole of the
    component's own forward, and dropped when that ends: a component that is not called through its forward (a VAE's
    ``encode`` and ``decode``, and their tiled paths) still finds each weight on the device when it is used."""

    def __init__(self, component: torch.nn.Module, device: torch.device) -> None:
        self.device = device
        items = [item for block_list in _block_lists(component) for item in block_list]
        in_blocks = {id(t) for item in items for t in (*item.parameters(), *item.buffers())}
        everything = list(dict.fromkeys([*component.parameters(), *component.buffers()]))
        self.rest = [t for t in everything if id(t) not in in_blocks]
        self.home: dict[int, torch.Tensor] = {}
        self.onloaded: set[int] = set()  # ids of the tensors now on the device
        self.in_forward = False  # inside the component's own forward: its rest stays until that ends
        for tensor in everything:
            host = tensor.data.to("cpu")
            self.home[id(tensor)] = host.pin_memory() if device.type == "cuda" else host
            tensor.data = self.home[id(tensor)]
        self.handles = [component.register_forward_pre_hook(lambda _m, _a: self._enter())]
        self.handles.append(component.register_forward_hook(lambda _m, _a, _o: self._leave()))
        for item in items:
            tensors = [*item.parameters(), *item.buffers()]
            self.handles.append(item.register_forward_pre_hook(lambda _m, _a, t=tensors: self.onload(t)))
            self.handles.append(item.register_forward_hook(lambda _m, _a, _o, t=tensors: self.offload(t)))
        for owner in component.modules():
            if owner is component:
                continue
            own = [
                t
                for t in (*owner.parameters(recurse=False), *owner.buffers(recurse=False))
                if id(t) not in in_blocks
            ]
            if own:
                self.handles.append(owner.register_forward_pre_hook(lambda _m, _a, t=own: self.onload(t)))
                self.handles.append(owner.register_forward_hook(lambda _m, _a, _o, t=own: self._drop(t)))

    def _enter(self) -> None:
        self.in_forward = True
        self.onload(self.rest)

    def _leave(self) -> None:
        self.in_forward = False
        self.offload(self.rest)

    def _drop(self, tensors: list[torch.Tensor]) -> None:
        if not self.in_forward:
            self.offload(tensors)

    def onload(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            if id(tensor) not in self.onloaded:
                tensor.data = self.home[id(tensor)].to(self.device, non_blocking=True)
                self.onloaded.add(id(tensor))

    def offload(self, tensors: list[torch.Tensor]) -> None:
        for tensor in tensors:
            tensor.data = self.home[id(tensor)]
            self.onloaded.discard(id(tensor))

    def remove(self, component: torch.nn.Module) -> None:
        """The hooks removed and every weight copied to the device for good (``Placement.restore``)."""
        for handle in self.handles:
            handle.remove()
        for tensor in dict.fromkeys([*component.parameters(), *component.buffers()]):
            tensor.data = self.home[id(tensor)].to(self.device)
        self.home.clear()


def runs_out(call: Callable[[], Any], catch: bool = True) -> tuple[bool, str | None]:
    """``call`` run: (True, the stage it was in, ``PipelineAdapter.failed_stage``) where it ran out of accelerator
    memory, else (False, None); any other error, and with ``catch`` False that one too, is raised. The memory is
    freed after it either way, out of the handler: after a failed call its frames (and the activations they hold)
    are let go first, by a full garbage collection, so that the placement's moves after it have the memory they
    freed; after one that ran, whose tensors are gone already, the accelerator's cache is emptied alone. A full
    collection after every call cost 0.33 s each in a test process of many objects, most of a tiny model's
    calibration."""
    from ditq.runtime.adapter import PipelineAdapter
    from ditq.runtime.memory import empty_accelerator_cache, free_accelerator_memory, is_out_of_memory

    ran_out, stage, failed = False, None, True
    try:
        call()
        failed = False
    except Exception as error:
        if not catch or not is_out_of_memory(error):
            raise
        ran_out, stage = True, PipelineAdapter.failed_stage(error)
    finally:
        if failed:
            free_accelerator_memory()
        else:
            empty_accelerator_cache()
    return ran_out, stage


def demote_until_it_runs(
    placement: Placement, pipeline: Any, call: Callable[[], Any], refusal: str, stage: str | None = None
) -> None:
    """``call`` run until it does not run out of memory (``runs_out``): each time it does, ``placement`` takes its
    next step (``Placement.demote``, told the stage it ran out in, or ``stage`` where given); with nothing left to
    move, an InputError ``refusal``."""
    while True:
        ran_out, failed = runs_out(call)
        if not ran_out:
            return
        if placement.demote(pipeline, stage if stage is not None else failed) is None:
            raise InputError(refusal)


def streams(module: torch.nn.Module) -> bool:
    """Whether ``module``'s weights wait on the host while it runs: streamed by ``_Streamed`` or diffusers' group
    offload (``--offload auto``, ``block``), or moved in whole by accelerate's offload hook (``model``)."""
    if hasattr(module, "ditq_streamed") or hasattr(module, "_hf_hook"):
        return True
    from diffusers.hooks.group_offloading import _is_group_offload_enabled

    return bool(_is_group_offload_enabled(module))


def _stream(component: torch.nn.Module, device: torch.device, denoiser: bool) -> None:
    """``component``'s weights from pinned host memory to ``device`` as it runs. The denoiser streams through
    diffusers' block-level group offload (its blocks copied on a side stream ahead of use, which diffusers' pipelines
    read their execution device from); any other component through ``_Streamed`` hooks."""
    component.to("cpu")
    if not denoiser:
        component.ditq_streamed = _Streamed(component, device)  # type: ignore[assignment]
        return
    from diffusers.hooks import apply_group_offloading

    cuda = device.type == "cuda"
    apply_group_offloading(
        component,
        onload_device=device,
        offload_device=torch.device("cpu"),
        offload_type="block_level",
        num_blocks_per_group=1,
        use_stream=cuda,
        low_cpu_mem_usage=False,  # pinned copies made once, not per transfer
        exclude_kwargs=getattr(component, "_skip_keys", None),
    )
    if cuda:  # diffusers' stream offload leaves blocks' buffers (ditq's quantized weights) on the device
        from ditq.runtime.diffusers_hooks import mend_stream_offload

        mend_stream_offload(component)


def _unstream(component: torch.nn.Module, device: torch.device, denoiser: bool) -> None:
    """What ``_stream`` did to ``component``, undone: its hooks removed and its weights resident on ``device``."""
    if not denoiser:
        component.ditq_streamed.remove(component)  # type: ignore[operator,union-attr]
        del component.ditq_streamed
        return
    from ditq.runtime.diffusers_hooks import remove_group_offloading

    remove_group_offloading(component)
    component.to(device)


def _step_cache_outermost(pipeline: Any, module: torch.nn.Module) -> None:
    """Where ``module`` is the transformer under a step cache (``ditq.runtime.step_cache.StepCacheRun``) whose
    offload hooks just changed: the cache's hooks registered again outside them, so a block it skips is not
    copied."""
    step_cache = getattr(pipeline, "ditq_step_cache", None)
    if step_cache is not None and step_cache.transformer is module:
        step_cache.wrap_outermost()


@dataclass
class Placement:
    """``auto`` offload: which components stay on the device, which stream, and whether the VAE decodes in tiles."""

    device: torch.device
    order: list[str]  # run_order
    sizes: dict[str, int]  # component -> bytes
    budget_bytes: int | None  # what the weights may take on the device (None: the device's free memory)
    resident: list[str] = field(default_factory=list)
    streamed: list[str] = field(default_factory=list)
    vae_tiling: bool = False
    transfer_gbps: float | None = None
    steps: list[str] = field(default_factory=list)  # what each demotion did, in order

    @classmethod
    def fit(cls, pipeline: Any, device: torch.device, budget_bytes: int | None) -> Placement:
        """The longest prefix of the run order whose weights fit ``budget_bytes`` resident (at least the first
        component), the rest streamed; applied to ``pipeline``."""
        order = run_order(pipeline)
        modules = _modules(pipeline)
        sizes = {n: module_bytes(modules[n]) for n in order}
        if budget_bytes is None and device.type == "cuda":
            free, _total = torch.cuda.mem_get_info(device)
            budget_bytes = int(free)
        placement = cls(device, order, sizes, budget_bytes)
        total = 0
        for name in order:
            total += sizes[name]
            if budget_bytes is not None and total > budget_bytes and placement.resident:
                break
            placement.resident.append(name)
        if (
            budget_bytes is not None and order and sizes[order[0]] > budget_bytes
        ):  # not even the denoiser fits
            placement.resident = []
        placement.streamed = [n for n in order if n not in placement.resident]
        for name in placement.resident:
            modules[name].to(device)
        for name in placement.streamed:
            _stream(modules[name], device, denoiser=name in DENOISERS)
        if placement.streamed:
            placement.transfer_gbps = transfer_rate_gbps(device)
        log.info("placement on %s: %s", device, placement.summary())
        return placement

    def demote(self, pipeline: Any, stage: str | None = None) -> str | None:
        """One step toward less device memory (VAE tiling, then the last resident component streamed); what it
        did, or None when nothing is left to move. ``stage``: where the call ran out of memory
        (``StageClock.failed_stage``); tiling, which costs fidelity and decode time, is taken only where that was
        the VAE's (or is unknown): it frees nothing in the text encoder or the denoising steps."""
        vae = getattr(pipeline, "vae", None)
        tiling_helps = stage is None or stage in VAE_STAGES
        if (
            tiling_helps
            and not self.vae_tiling
            and vae is not None
            and callable(getattr(vae, "enable_tiling", None))
        ):
            vae.enable_tiling()
            self.vae_tiling = True
            step = _TILING
        elif self.resident:
            name = self.resident.pop()
            module = _modules(pipeline)[name]
            _stream(module, self.device, denoiser=name in DENOISERS)
            _step_cache_outermost(pipeline, module)
            self.streamed.insert(0, name)
            if self.transfer_gbps is None:
                self.transfer_gbps = transfer_rate_gbps(self.device)
            step = f"{name} streams from pinned host memory"
        else:
            return None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.steps.append(step)
        log.info("placement on %s: %s; now %s", self.device, step, self.summary())
        return step

    def restore(self, pipeline: Any, keep: int) -> list[str]:
        """The demotions after the first ``keep`` undone, the latest first (a streamed component resident again,
        the VAE's tiles off): a shape that ran out of memory with nothing left to move gained nothing by them, and
        every smaller shape would pay for them (``ditq.serve.cost.calibrate``). What it undid."""
        undone = []
        while len(self.steps) > keep:
            step = self.steps.pop()
            if step == _TILING:
                pipeline.vae.disable_tiling()
                self.vae_tiling = False
            else:
                name = self.streamed.pop(0)
                module = _modules(pipeline)[name]
                _unstream(module, self.device, denoiser=name in DENOISERS)
                _step_cache_outermost(pipeline, module)
                self.resident.append(name)
            undone.append(step)
        if not self.streamed:
            self.transfer_gbps = None
        if undone:
            log.info("placement on %s: undone: %s; now %s", self.device, "; ".join(undone), self.summary())
        return undone

    def summary(self) -> str:
        resident = ", ".join(self.resident) or "nothing"
        streamed = ", ".join(self.streamed) or "nothing"
        tiling = "; VAE tiling" if self.vae_tiling else ""
        return f"resident {resident}; streamed {streamed}{tiling}"

    def to_json(self) -> dict[str, Any]:
        return {
            "resident": list(self.resident),
            "streamed": list(self.streamed),
            "vae_tiling": self.vae_tiling,
            "sizes_bytes": dict(self.sizes),
            "budget_bytes": self.budget_bytes,
            "transfer_gbps": self.transfer_gbps,
            "demotions": list(self.steps),
        }


def apply_offload(pipeline: Any, mode: str, device: torch.device, budget_bytes: int | None = None) -> None:
    """Place ``pipeline`` on ``device`` per ``mode``; ``auto`` sets ``pipeline.ditq_placement`` (``budget_bytes``:
    what its weights may take there, default the device's free memory)."""
    if mode == "none":
        pipeline.to(device)
    elif mode == "auto":
        pipeline.ditq_placement = Placement.fit(pipeline, device, budget_bytes)
    elif mode == "model":
        try:
            import accelerate  # noqa: F401
        except ImportError as error:
            raise DitqError("offload 'model' needs accelerate (pip install accelerate)") from error
        if getattr(pipeline, "model_cpu_offload_seq", None) is None:
            # A pipeline without a declared order offloads its modules in model_index order.
            modules = [n for n, c in pipeline.components.items() if isinstance(c, torch.nn.Module)]
            pipeline.model_cpu_offload_seq = "->".join(modules)
        pipeline.enable_model_cpu_offload(device=device)
    elif mode == "block":
        pipeline.enable_group_offload(
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
        )
    else:
        raise DitqError(f"unknown offload mode {mode!r} (known: {', '.join(OFFLOAD_MODES)})")
