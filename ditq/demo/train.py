"""Train the demo model: `python -m ditq.demo.train --out DIR [--steps N] [--device cuda] [--compile]`.

Rectified flow (x_t = (1 - t) x0 + t noise, the transformer predicts noise - x0), text encoder and transformer
trained together from scratch on procedural tasks (`ditq.demo.scenes`). CPU workers sample task specs and token
ids; the training device rasterizes them. Without --steps, the learning-rate schedule follows wall time and
training stops after --time-budget seconds (compilation included; --eval-every's evaluations excluded). The t2i
prompts of the evaluation set are never trained on; --eval-every scores the EMA weights on a separate validation
draw while training. Writes DIR/model (diffusers layout, bf16 safetensors, EMA weights), DIR/train_log.jsonl and
DIR/train_summary.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21AttnProcessor,
    _qwenimage21_prepare_qkv,
)
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ditq.demo import load_demo_pipeline
from ditq.demo.packing import PIXELS_PER_TOKEN, pixels_to_tokens
from ditq.demo.pipeline import TOKENS_PER_SLOT, DitqDemoPipeline, joint_layout
from ditq.demo.presets import PRESETS, build_pipeline
from ditq.demo.scenes import CANVAS, REFERENCE_CANVAS, Task, rasterize, sample_kind, sample_task, scene_arrays
from ditq.demo.text_encoder import build_text_inputs

__all__ = ["TaskBatches", "main", "train"]

_REFERENCE_SLOTS = (REFERENCE_CANVAS // PIXELS_PER_TOKEN) ** 2 // TOKENS_PER_SLOT
VALIDATION_SEED = 7  # --eval-every draws its tasks with this seed, not the evaluation's


@torch.compiler.disable
def _segment_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    segments: list[tuple[int, int, bool]],
    key_valid: torch.Tensor | None,
) -> torch.Tensor:
    """The block-causal prefill of `QwenImage21AttnProcessor` on (B, S, H, D) tensors: every prefix segment attends
    to the keys before its end (text causally), the target to everything; padded keys are dropped."""
    query, key, value = (x.transpose(1, 2) for x in (query, key, value))
    prefix_len = segments[-1][1] if segments else 0
    outputs = []
    for start, end, is_text in segments:
        mask = None if key_valid is None else key_valid[:, None, None, :end]
        if is_text:
            causal = torch.ones(end - start, end, dtype=torch.bool, device=query.device).tril(start)
            mask = causal[None, None] if mask is None else mask & causal
        outputs.append(
            F.scaled_dot_product_attention(
                query[:, :, start:end], key[:, :, :end], value[:, :, :end], attn_mask=mask
            )
        )
    mask = None if key_valid is None else key_valid[:, None, None, :]
    outputs.append(F.scaled_dot_product_attention(query[:, :, prefix_len:], key, value, attn_mask=mask))
    return torch.cat(outputs, dim=2).transpose(1, 2)


class CompiledTrainingProcessor(QwenImage21AttnProcessor):
    """Training-time attention for --compile: the same computation as `QwenImage21AttnProcessor` (no KV cache),
    with the per-segment attention loop left out of the compiled graph, so one compiled block serves every task
    layout (the loop's segment count differs per layout and would otherwise recompile the whole block)."""

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        attention_mask: Any = None,
        rotary_emb: torch.Tensor | None = None,
        layer_cache: Any = None,
        kv_cache_mode: str | None = None,
        cache_write_slice: slice | None = None,
        segments: list[tuple[int, int, bool]] | None = None,
        key_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if layer_cache is not None or segments is None:
            raise ValueError("CompiledTrainingProcessor runs full training forwards only (no KV cache)")
        query, key, value, _ = _qwenimage21_prepare_qkv(attn, hidden_states, rotary_emb, None, None, None)
        hidden = _segment_attention(query, key, value, segments, key_valid)
        return attn.to_out[0](hidden.flatten(2, 3).type_as(query))


class TaskBatches(IterableDataset):
    """Endless batches of one (kind, references) layout each: spec arrays + token ids, seeded per worker."""

    def __init__(
        self,
        batch_size: int,
        seed: int,
        word_to_id: dict[str, int],
        max_text_tokens: int,
        excluded_prompts: frozenset[str],
        prompt_dropout: float = 0.1,
    ):
        self.batch_size, self.seed, self.word_to_id = batch_size, seed, word_to_id
        self.max_text_tokens, self.excluded_prompts, self.prompt_dropout = (
            max_text_tokens,
            excluded_prompts,
            prompt_dropout,
        )

    def __iter__(self) -> Iterator[dict[str, Any]]:
        worker = get_worker_info()
        rng = np.random.default_rng([self.seed, worker.id if worker is not None else 0])
        while True:
            kind, num_refs = sample_kind(rng)
            tasks: list[Task] = []
            while len(tasks) < self.batch_size:
                task = sample_task(rng, kind, num_refs)
                if task.prompt not in self.excluded_prompts:
                    tasks.append(task)
            prompts = [task.prompt if rng.random() >= self.prompt_dropout else "" for task in tasks]
            text = build_text_inputs(
                self.word_to_id, self.max_text_tokens, prompts, [_REFERENCE_SLOTS] * num_refs
            )
            batch: dict[str, Any] = {
                "num_refs": num_refs,
                "target": scene_arrays([task.target for task in tasks]),
                "input_ids": text.input_ids,
                "attention_mask": text.attention_mask,
                "image_mask": text.image_mask,
            }
            if num_refs:
                batch["references"] = scene_arrays([ref for task in tasks for ref in task.references])
            yield batch


def _loader(dataset: TaskBatches, workers: int) -> Iterator[dict[str, Any]]:
    loader = DataLoader(
        dataset,
        batch_size=None,
        num_workers=workers,
        prefetch_factor=4 if workers else None,
        persistent_workers=workers > 0,
    )
    return iter(loader)


def _velocity_loss(
    pipe: DitqDemoPipeline, batch: dict[str, Any], device: torch.device, generator: torch.Generator
):
    """Flow-matching MSE for one batch (target tokens only; references are clean prefix tokens)."""
    x0 = pixels_to_tokens(rasterize(batch["target"], CANVAS, device))  # (B, 256, 64)
    size = x0.shape[0]
    num_refs = batch["num_refs"]
    ref_tokens = None
    if num_refs:
        refs = pixels_to_tokens(rasterize(batch["references"], REFERENCE_CANVAS, device))  # (B*k, 64, 64)
        ref_tokens = refs.reshape(size, num_refs * refs.shape[1], refs.shape[2])
    noise = torch.randn(x0.shape, device=device, generator=generator)
    t = torch.sigmoid(torch.randn(size, device=device, generator=generator))  # logit-normal times
    noisy = (1 - t[:, None, None]) * x0 + t[:, None, None] * noise
    mask = batch["attention_mask"].to(device)
    embeds = pipe.text_encoder(batch["input_ids"].to(device), mask)
    grid = CANVAS // PIXELS_PER_TOKEN
    ref_grid = REFERENCE_CANVAS // PIXELS_PER_TOKEN
    img_mask, img_shapes = joint_layout(
        batch["image_mask"].to(device), (ref_grid, ref_grid), num_refs, (grid, grid)
    )
    model_input = noisy if ref_tokens is None else torch.cat([ref_tokens, noisy], dim=1)
    prediction = pipe.transformer(
        hidden_states=model_input,
        encoder_hidden_states=embeds,
        encoder_hidden_states_mask=mask,
        timestep=t,
        img_shapes=img_shapes,
        img_mask=img_mask,
        return_dict=False,
    )[0][:, -x0.shape[1] :]
    return F.mse_loss(prediction.float(), noise - x0)


class _Validation:
    """Scores EMA weights on the validation draw: one uncompiled float32 copy of the pipeline, built once and
    refilled from the EMA tensors at every call; the tasks are drawn once."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        from ditq.demo.evaluate import evaluation_tasks

        self.pipe = build_pipeline(PRESETS[args.preset], seed=args.seed).to(device)
        self.pipe.set_progress_bar_config(disable=True)
        self.params = list(self.pipe.transformer.parameters()) + list(self.pipe.text_encoder.parameters())
        self.tasks = evaluation_tasks(args.eval_t2i, args.eval_edits, seed=VALIDATION_SEED)

    def __call__(self, ema: list[torch.Tensor]) -> dict[str, Any]:
        from ditq.demo.evaluate import evaluate

        with torch.no_grad():
            torch._foreach_copy_(self.params, ema)
        result = evaluate(self.pipe, self.tasks)
        return {
            "t2i_accuracy": result["t2i_accuracy"],
            "edit_accuracy": result["edit_accuracy"],
            "by_layout": {key: value["accuracy"] for key, value in result["by_layout"].items()},
        }


def train(args: argparse.Namespace) -> dict[str, Any]:
    from ditq.demo.evaluate import heldout_t2i_prompts

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    pipe = build_pipeline(PRESETS[args.preset], seed=args.seed)
    if args.init is not None:  # continue from a saved demo pipeline of the same preset
        source = load_demo_pipeline(args.init, dtype=torch.float32)
        pipe.transformer.load_state_dict(source.transformer.state_dict())
        pipe.text_encoder.load_state_dict(source.text_encoder.state_dict())
    dataset = TaskBatches(
        args.batch_size,
        args.seed,
        pipe.text_encoder.word_to_id,
        pipe.text_encoder.config["max_text_tokens"],
        heldout_t2i_prompts(),
    )
    batches = _loader(dataset, args.workers)  # workers start before the accelerator is touched
    torch.backends.cuda.matmul.allow_tf32 = True
    pipe.transformer.to(device).train()
    pipe.text_encoder.to(device).train()
    if args.compile:
        torch._dynamo.config.recompile_limit = 64
        pipe.transformer.set_attn_processor(CompiledTrainingProcessor())
        pipe.transformer.compile_repeated_blocks(dynamic=True)
    params = [p for module in (pipe.transformer, pipe.text_encoder) for p in module.parameters()]
    ema = [p.detach().clone() for p in params]
    optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.99), weight_decay=0.01)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "train_log.jsonl").open("w")
    warmup = min(100, max(1, (args.steps or 1000) // 10))
    validation = _Validation(args, device) if args.eval_every else None  # built off the training clock
    start = time.perf_counter()
    losses: list[torch.Tensor] = []  # kept on the device: no synchronization per step
    evaluations: list[dict[str, Any]] = []
    eval_seconds, next_eval, samples = 0.0, args.eval_every, 0
    step = 0
    while True:
        # progress in [0, 1]: by steps when --steps is given (reproducible), else by wall time (fits the budget)
        elapsed = time.perf_counter() - start - eval_seconds
        progress = step / args.steps if args.steps else elapsed / args.time_budget
        if progress >= 1.0:
            break
        if validation is not None and elapsed >= next_eval:
            eval_start = time.perf_counter()
            record = {"step": step, "train_s": round(elapsed, 1), **validation(ema)}
            evaluations.append(record)
            log.write(json.dumps({"eval": record}) + "\n")
            log.flush()
            print(json.dumps({"eval": record}), flush=True)
            eval_seconds += time.perf_counter() - eval_start
            next_eval = elapsed + args.eval_every
        lr_scale = min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for group in optimizer.param_groups:
            group["lr"] = args.lr * lr_scale
        batch = next(batches)
        samples += int(batch["input_ids"].shape[0])
        with autocast:
            loss = _velocity_loss(pipe, batch, device, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        decay = min(args.ema, (1 + step) / (10 + step))
        torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - decay)
        # clone: the 0-d loss can be a view of a whole (batch, tokens, channels) buffer, 32 MiB at batch 512
        losses.append(loss.detach().clone())
        if step % args.log_every == 0 or step == args.steps:
            trained = time.perf_counter() - start - eval_seconds
            record = {
                "step": step,
                "loss": float(losses[-1]),
                "lr": args.lr * lr_scale,
                "s": round(trained, 2),
                "samples_per_s": round(samples / trained, 1),
            }
            if device.type == "cuda":
                record["cuda_allocated_gb"] = round(torch.cuda.memory_allocated(device) / 2**30, 2)
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(json.dumps(record), flush=True)
        step += 1
    seconds = time.perf_counter() - start - eval_seconds
    if validation is not None:
        evaluations.append({"step": step, "train_s": round(seconds, 1), **validation(ema)})
        log.write(json.dumps({"eval": evaluations[-1]}) + "\n")
        print(json.dumps({"eval": evaluations[-1]}), flush=True)
    log.close()
    with torch.no_grad():
        for p, e in zip(params, ema, strict=True):
            p.copy_(e)
    if args.compile:  # saved and shipped with the default processor
        pipe.transformer.set_attn_processor(QwenImage21AttnProcessor())
    pipe.transformer.eval().to("cpu", torch.bfloat16)
    pipe.text_encoder.eval().to("cpu", torch.bfloat16)
    pipe.save_pretrained(out / "model", safe_serialization=True)
    recent = [float(value) for value in torch.stack(losses[-500:]).cpu()] if losses else []
    summary = {
        "command": "python -m ditq.demo.train " + " ".join(sys.argv[1:]),
        "preset": args.preset,
        "steps": step,
        "batch_size": args.batch_size,
        "train_seconds": round(seconds, 1),
        "eval_seconds": round(eval_seconds, 1),
        "samples": samples,
        "compile": bool(args.compile),
        "final_loss_mean_last_500_steps": float(np.mean(recent)) if recent else None,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "seed": args.seed,
        "init": str(args.init) if args.init is not None else None,
        "validation": evaluations,
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="output directory (model/ and logs are written here)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: fit --time-budget)")
    parser.add_argument(
        "--time-budget", type=float, default=720.0, help="seconds of training when --steps is unset"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--init", type=Path, default=None, help="start from this saved demo pipeline's weights"
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--lr", type=float, default=8e-4)
    parser.add_argument("--ema", type=float, default=0.999)
    parser.add_argument("--workers", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the transformer blocks (regional, dynamic shapes)",
    )
    parser.add_argument(
        "--eval-every",
        type=float,
        default=0.0,
        help="score the EMA weights on a validation draw every this many training seconds (0: never)",
    )
    parser.add_argument("--eval-t2i", type=int, default=100, help="validation t2i tasks per --eval-every")
    parser.add_argument("--eval-edits", type=int, default=100, help="validation edits per --eval-every")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ditq.demo.train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    summary = train(parser.parse_args(argv))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
