"""The doctor's quantized-attention cases: the CPU paths pass with their numbers; a path that gives NaN, a wrong
output or raises is refused with its reason and the chooser falls back to the next one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from ditq.cli import main
from ditq.doctor.attention import (
    ANALYTIC_BOUNDS,
    ATTENTION_BOUNDS,
    AUTO_SHAPES,
    AttentionTiming,
    check_attention_path,
    choose_attention_kernel,
    choose_auto_attention,
    time_attention,
)
from ditq.errors import DitqError, InputError
from ditq.kernels.attention import (
    ENV_ATTENTION_DISABLE,
    QuantizedQK,
    attend_reference,
    get_attention_kernel,
    quantize_qk_reference,
    register_attention_kernel,
    unregister_attention_kernel,
)


def _nan(qk: QuantizedQK, value: torch.Tensor, key_valid, causal_offset, sm_scale) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return torch.full((*qk.query.shape[:3], value.shape[-1]), float("nan"), dtype=value.dtype)


def _ten_percent_off(
    qk: QuantizedQK, value: torch.Tensor, key_valid, causal_offset, sm_scale
) -> torch.Tensor:  # type: ignore[no-untyped-def]
    return attend_reference(qk, value, key_valid, causal_offset, sm_scale) * 1.1


def _raises(qk: QuantizedQK, value: torch.Tensor, key_valid, causal_offset, sm_scale) -> torch.Tensor:  # type: ignore[no-untyped-def]
    raise RuntimeError("no kernel image for this device")


BROKEN = {
    "test-nan-attention": _nan,
    "test-off-attention": _ten_percent_off,
    "test-raising-attention": _raises,
}


@pytest.fixture
def broken() -> Iterator[None]:
    """Three broken int8 CPU paths ahead of the reference (priorities 300, 200, 100)."""
    for priority, (name, attend) in zip((300, 200, 100), BROKEN.items(), strict=True):
        register_attention_kernel(name=name, kind="int8", device_type="cpu", priority=priority,
                                  quantize=quantize_qk_reference)(attend)  # fmt: skip
    yield
    for name in BROKEN:
        unregister_attention_kernel(name)


@pytest.mark.parametrize("kind", ["int8", "fp8", "fp8-fp8"])
def test_cpu_reference_paths_pass_with_their_numbers(kind: str) -> None:
    result = check_attention_path(get_attention_kernel(f"cpu-reference-attention-{kind}"), "cpu", head_dim=64)
    assert result.verdict == "PASS", result.reason
    assert {c.step for c in result.checks} == {"finite", "output", "match"}
    assert {c.weights for c in result.checks} == {"synthetic", "analytic"}
    # Measured: int8 8.7e-3, fp8 3.6e-2, fp8-fp8 5.7e-2 against float32 SDPA; the reference matches itself exactly.
    assert result.worst_rel_l2 is not None and 0.001 < result.worst_rel_l2 < ATTENTION_BOUNDS[kind]
    assert all(c.value == 0.0 for c in result.checks if c.step == "match")
    analytic = [c.value for c in result.checks if c.weights == "analytic"]
    # uniform keys with the padding mask and without, in bfloat16 and float16
    assert len(analytic) == 4 and all(v is not None and v < ANALYTIC_BOUNDS[kind] for v in analytic)


@pytest.mark.usefixtures("broken")
def test_each_broken_path_fails_at_the_step_that_shows_it() -> None:
    reasons = {
        name: check_attention_path(get_attention_kernel(name), "cpu", head_dim=32).reason for name in BROKEN
    }
    assert reasons["test-nan-attention"].startswith("finite: ")
    assert reasons["test-off-attention"].startswith("output: rel-L2 1.")  # 10% off: 1.0e-01 > 0.02
    assert "raised RuntimeError: no kernel image for this device" in reasons["test-raising-attention"]


@pytest.mark.usefixtures("broken")
def test_the_chooser_refuses_broken_paths_and_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    choice = choose_attention_kernel("int8", "cpu", torch.bfloat16, head_dim=32)
    assert choice.path.name == "cpu-reference-attention-int8" and choice.verified
    assert [name for name, _ in choice.refused] == list(BROKEN)
    assert "refusing test-nan-attention" in caplog.text
    assert "refused test-off-attention: output" in choice.summary()
    # Unverified (--skip-doctor): the first candidate, whatever it does.
    assert (
        choose_attention_kernel("int8", "cpu", torch.bfloat16, 32, verify=False).path.name
        == "test-nan-attention"
    )


@pytest.mark.usefixtures("broken")
def test_no_passing_path_is_an_error_naming_each_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_ATTENTION_DISABLE, "cpu-reference-attention-int8")
    with pytest.raises(DitqError, match=r"no int8 attention path passed.*test-nan-attention: finite"):
        choose_attention_kernel("int8", "cpu", torch.bfloat16, head_dim=32)
    monkeypatch.setenv(ENV_ATTENTION_DISABLE, "cpu-reference-attention-int9")
    with pytest.raises(InputError, match="did you mean 'cpu-reference-attention-int8'"):
        choose_attention_kernel("int8", "cpu", torch.bfloat16, head_dim=32)


def test_cli_checks_attention_paths_too(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "doctor",
        "--device",
        "cpu",
        "--kernels",
        "cpu-reference-w8a8",
        "--geometry",
        "64x32",
        "--rows",
        "4",
    ]
    assert main([*args, "--attention", "int8", "--head-dim", "32"]) == 0
    printed = capsys.readouterr().out
    assert "cpu-reference-attention-int8" in printed and "attn-int8" in printed
    with pytest.raises(SystemExit) as exit_info:
        main([*args, "--attention", "int4"])
    assert exit_info.value.code == 2
    assert "argument --attention: invalid choice: 'int4'" in capsys.readouterr().err


def _timer(path_ms: dict[str, tuple[float, float]]):  # type: ignore[no-untyped-def]
    """A timer giving each kind's ``path_ms`` (20 ms where not given) at the two served shapes against SDPA's
    10 ms, recording what it was asked."""
    asked: list[tuple[str, int, int]] = []

    def timer(path, device, dtype, heads, head_dim):  # type: ignore[no-untyped-def]
        asked.append((path.name, heads, head_dim))
        return tuple(
            AttentionTiming(q, k, ms, 10.0)
            for (q, k), ms in zip(AUTO_SHAPES["cpu"], path_ms.get(path.kind, (20.0, 20.0)), strict=True)
        )

    timer.asked = asked  # type: ignore[attr-defined]
    return timer


def test_auto_takes_the_most_faithful_verified_kind_that_is_faster_at_every_served_shape() -> None:
    cpu = torch.device("cpu")
    int8_faster = _timer({"int8": (4.0, 9.0), "int8-fp8": (2.0, 5.0)})
    decision = choose_auto_attention(cpu, torch.bfloat16, heads=2, head_dim=32, timer=int8_faster)
    assert decision.choice is not None and decision.choice.path.name == "cpu-reference-attention-int8"
    assert int8_faster.asked == [("cpu-reference-attention-int8", 2, 32)]  # type: ignore[attr-defined]
    assert decision.summary().startswith(
        "auto: cpu-reference-attention-int8 (int8 Q.K^T), faster (4 ms vs SDPA"
    )
    # int8 slower at one shape: int8-fp8, faster at both, is taken, and the summary says why int8 was not
    only_int8_fp8 = _timer({"int8": (4.0, 11.0), "int8-fp8": (2.0, 5.0)})
    decision = choose_auto_attention(cpu, torch.bfloat16, 2, 32, timer=only_int8_fp8)
    assert decision.choice is not None and decision.choice.kind == "int8-fp8"
    assert [name for name, _, _ in only_int8_fp8.asked] == [  # type: ignore[attr-defined]
        "cpu-reference-attention-int8",
        "cpu-reference-attention-int8-fp8",
    ]
    assert "; int8 not faster: 4 ms vs SDPA 10 ms" in decision.summary()
    neither = choose_auto_attention(cpu, torch.bfloat16, 2, 32, timer=_timer({"int8": (4.0, 11.0),
                                                                              "int8-fp8": (12.0, 5.0)}))  # fmt: skip
    assert neither.choice is None
    assert neither.summary() == (
        "auto: the model's own attention (int8 not faster: 4 ms vs SDPA 10 ms at 272x272 tokens; 11 ms vs SDPA 10 "
        "ms at 256x1296 tokens; int8-fp8 not faster: 12 ms vs SDPA 10 ms at 272x272 tokens; 5 ms vs SDPA 10 ms at "
        "256x1296 tokens; fp8-fp8 not faster: 20 ms vs SDPA 10 ms at 272x272 tokens; 20 ms vs SDPA 10 ms at "
        "256x1296 tokens)"
    )
    # fp8-fp8, the least faithful kind, only where the two before it are not faster
    only_fp8_fp8 = _timer({"int8": (4.0, 11.0), "int8-fp8": (12.0, 5.0), "fp8-fp8": (3.0, 4.0)})
    decision = choose_auto_attention(cpu, torch.bfloat16, 2, 32, timer=only_fp8_fp8)
    assert decision.choice is not None and decision.choice.path.name == "cpu-reference-attention-fp8-fp8"


@pytest.mark.usefixtures("broken")
def test_auto_keeps_the_models_attention_where_no_path_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(
        ENV_ATTENTION_DISABLE,
        "cpu-reference-attention-int8,cpu-reference-attention-int8-fp8,cpu-reference-attention-fp8-fp8",
    )
    timer = _timer({"int8": (1.0, 1.0), "int8-fp8": (1.0, 1.0)})
    decision = choose_auto_attention(torch.device("cpu"), torch.bfloat16, 2, 32, timer=timer)
    assert decision.choice is None and decision.timings == {} and timer.asked == []  # type: ignore[attr-defined]
    assert "int8: no int8 attention path passed the doctor" in decision.summary()
    assert "int8-fp8: no int8-fp8 attention path" in decision.summary()


def test_the_timer_runs_both_ways_at_the_served_shapes() -> None:
    path = get_attention_kernel("cpu-reference-attention-int8")
    timings = time_attention(path, torch.device("cpu"), torch.float32, heads=2, head_dim=32)
    assert [(t.queries, t.keys) for t in timings] == list(AUTO_SHAPES["cpu"])
    assert all(t.path_ms > 0 and t.sdpa_ms > 0 for t in timings)


def test_the_command_line_offers_every_attention_kind() -> None:
    from ditq.commands import ATTENTION_CHOICES
    from ditq.kernels.attention import ATTENTION_KINDS

    assert ATTENTION_CHOICES == ATTENTION_KINDS  # kept apart so that parsing arguments needs no torch
