"""StageClock: the pipeline's stages timed for one block, and put back as they were afterwards."""

from __future__ import annotations

import torch

from ditq.runtime.stage_clock import StageClock


class _Vae(torch.nn.Module):
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return latents.tanh()


class _Pipeline:
    def __init__(self) -> None:
        self.transformer = torch.nn.Linear(4, 4)
        self.vae = _Vae()

    def encode_prompt(self, prompt: str) -> torch.Tensor:
        return torch.full((1, 4), float(len(prompt)))


def test_stages_are_timed_inside_the_block_and_put_back_after_it() -> None:
    pipeline = _Pipeline()
    clock = StageClock(torch.device("cpu"))
    with clock.instrument(pipeline):
        start = clock.now()
        latents = pipeline.encode_prompt("a kite")
        for _ in range(3):
            latents = pipeline.transformer(latents)
            clock.mark_step()
        pipeline.vae.decode(latents)
        end = clock.now()
    assert "encode_prompt" not in vars(pipeline) and "decode" not in vars(pipeline.vae)
    assert not pipeline.transformer._forward_hooks and not pipeline.transformer._forward_pre_hooks
    timings = clock.timings(start, end)
    assert set(timings) == {"text_encoding", "denoising", "decoding", "postprocess", "total"}
    assert all(seconds >= 0.0 for seconds in timings.values())
    assert timings["total"] >= timings["text_encoding"] + timings["denoising"] + timings["decoding"]
    assert len(clock.step_times()) == 3
    pipeline.encode_prompt("untimed")
    assert clock.timings(start, end) == timings
