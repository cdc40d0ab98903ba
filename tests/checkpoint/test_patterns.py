"""``re:`` patterns in a quantization_config: a restricted language, refused in one line outside it, so that no
pattern can make verify, generate or serve backtrack for ever."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from ditq.checkpoint.patterns import compile_pattern, matches
from ditq.errors import InputError
from ditq.quantization.verifier import verify
from ditq.runtime.loader import load_component

REFUSED = {
    "(.*)*X": "only a single character may repeat",  # 2^n backtracking: hung verify, generate and serve
    "(a+)+$": "only a single character may repeat",
    "(a|aa)*X": "only a single character may repeat",
    ".*.*.*.*X": "4 repeats",
    r"(a)\1": "a backreference",
    "(?!a.*b.*c).*.*": "4 repeats",  # a lookaround's repeats count
    "(": "not a valid regular expression",
    "x" * 201: "longer than 200 characters",
}
ACCEPTED = [
    r"^(?!transformer_blocks\.).*",  # llm-compressor's "everything outside the blocks"
    r".*lm_head",
    r"transformer_blocks\.\d+\.(attn|ff)\..*",
    r".*to_(q|k|v)$",
    r"proj_out",
    r"(?:a)*b",
]
NAMES = [
    "transformer_blocks.0.attn.to_q",
    "transformer_blocks.11.ff.net.0.proj",
    "proj_out",
    "lm_head",
    "aab",
]


@pytest.mark.parametrize("pattern", sorted(REFUSED))
def test_a_pattern_outside_the_language_is_refused_at_once_in_one_line(pattern: str) -> None:
    started = time.perf_counter()
    with pytest.raises(InputError) as info:
        compile_pattern(pattern, "transformer/config.json: ignore")
    assert time.perf_counter() - started < 0.1
    message = str(info.value)
    assert message.startswith("transformer/config.json: ignore: pattern ") and REFUSED[pattern] in message
    assert "\n" not in message


@pytest.mark.parametrize("pattern", ACCEPTED)
def test_patterns_inside_the_language_match_as_re_match_does(pattern: str) -> None:
    compile_pattern(pattern, "config.json")
    linear = torch.nn.Linear(1, 1)
    for name in NAMES:
        assert matches([f"re:{pattern}"], name, linear) == bool(re.match(pattern, name))


@pytest.mark.parametrize(
    ("pattern", "message"), [("(.*)*X", "only a single character"), ("(", "not a valid")]
)
def test_a_refused_ignore_pattern_stops_verify_and_the_loader_quickly(
    pattern: str, message: str, artifact
) -> None:  # type: ignore[no-untyped-def]
    """Issue 28, item 6: with ``ignore: ["re:(.*)*X"]`` verify ran past 60 s; an invalid pattern was a traceback."""
    _, out = artifact("flux", "w8a8")
    config_path = out / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["ignore"].append(f"re:{pattern}")
    config_path.write_text(json.dumps(config))
    started = time.perf_counter()
    report = verify(out)
    check = next(c for c in report.checks if c.name == "transformer: config")
    assert (
        not check.ok
        and "transformer/config.json: ignore: pattern" in check.detail
        and message in check.detail
    )
    with pytest.raises(InputError, match=rf"{config_path}: ignore: pattern .*{message}"):
        load_component(out, "transformer", device="cpu")
    assert time.perf_counter() - started < 10


def test_a_refused_target_pattern_names_its_group(artifact) -> None:  # type: ignore[no-untyped-def]
    _, out = artifact("flux", "w8a8")
    config_path = out / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"]["config_groups"]["group_0"]["targets"] = ["re:(.*)*X"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(
        InputError, match=r"config group 'group_0': targets: pattern '\(\.\*\)\*X' is refused"
    ):
        load_component(Path(out), "transformer", device="cpu")


def test_a_config_holds_at_most_max_patterns_re_entries() -> None:
    from ditq.checkpoint.patterns import MAX_PATTERNS, check_entries

    entries = [f"re:.*block{i}" for i in range(MAX_PATTERNS)] + ["proj_out"]
    assert check_entries(entries, "config.json: ignore") == tuple(entries)
    with pytest.raises(
        InputError, match=rf"^config.json: ignore: {MAX_PATTERNS + 1} 're:' patterns \(at most"
    ):
        check_entries([*entries, "re:one_more"], "config.json: ignore")
