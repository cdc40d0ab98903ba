import json

import torch

from ditq.demo import load_demo_pipeline
from ditq.demo.train import main


def test_smoke_training_runs_and_saves_a_loadable_pipeline(tmp_path):
    code = main(
        [
            "--out",
            str(tmp_path),
            "--steps",
            "2",
            "--preset",
            "tiny",
            "--batch-size",
            "2",
            "--workers",
            "0",
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    summary = json.loads((tmp_path / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["final_loss_mean_last_500_steps"] > 0
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert log[0]["step"] == 0 and log[0]["loss"] > 0
    pipe = load_demo_pipeline(tmp_path / "model")
    assert pipe.transformer.dtype == torch.float32  # stored bf16, loaded at the requested dtype
    image = pipe("a red circle on a white background", num_inference_steps=2).images[0]
    assert image.mode == "RGBA"
