"""How a pipeline is opened, as one value: ``LoadOptions`` is validated when built (one line naming the flag),
resolved once, parsed once from the command line, and opened by ``open_pipeline`` alone."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from pathlib import Path

import pytest
import torch

from ditq.commands import LOAD_FLAGS, add_load_arguments, load_options_from_args
from ditq.doctor import VerifiedChooser
from ditq.errors import InputError
from ditq.pipeline.open import load_pipeline, open_pipeline
from ditq.runtime.options import LoadOptions, resolve_load_options


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({"device": "gpu"}, "--device 'gpu': not a device"),
        ({"dtype": "int8"}, "--dtype 'int8': not a compute dtype"),
        ({"offload": "disk"}, "--offload 'disk': not an offload mode"),
        ({"attention": "int4"}, "--attention 'int4': not an attention kind"),
        ({"kv_cache": "int4"}, "--kv-cache 'int4': not a KV cache kind"),
        ({"compile": "tvm"}, "--compile 'tvm': not a compile backend"),
        ({"accumulate": "sloppy"}, "--accumulate 'sloppy': not an accumulation"),
        ({"max_memory": "lots"}, "--max-memory: cannot read 'lots' as a size"),
        (
            {"skip_doctor": True, "accumulate": "fast"},
            "--accumulate fast: fast accumulation serves only where",
        ),
    ],
)
def test_a_bad_option_is_one_line_naming_its_flag(change: dict[str, object], refused: str) -> None:
    with pytest.raises(InputError, match=f"^{refused}") as raised:
        LoadOptions(**change)  # type: ignore[arg-type]
    assert "\n" not in str(raised.value)


def test_the_options_are_frozen_and_replace_validates_again() -> None:
    options = LoadOptions(device="cpu", kv_cache="int8")
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.device = "cuda"  # type: ignore[misc]
    assert options.replace(compile="eager").compile == "eager"
    with pytest.raises(InputError, match=r"^--kv-cache 'int4'"):
        options.replace(kv_cache="int4")


def test_auto_is_resolved_once_into_a_device_and_its_dtype() -> None:
    """On this CPU-only machine: the CPU in float32; the resolved options name them, so resolving them again
    changes nothing."""
    load = resolve_load_options(LoadOptions())
    assert (load.device, load.dtype) == (torch.device("cpu"), torch.float32)
    assert (load.options.device, load.options.dtype, load.memory_cap) == ("cpu", "float32", None)
    assert resolve_load_options(load.options) == load
    with pytest.raises(
        InputError, match=r"^--max-memory caps accelerator memory; device 'cpu' has none to cap$"
    ):
        resolve_load_options(LoadOptions(device="cpu", max_memory="1GiB"))


def test_a_record_lists_the_fields_it_keeps_and_never_the_python_chooser() -> None:
    options = LoadOptions(device="cpu", compile="eager", chooser=lambda *_: None)
    assert options.record("device", "offload", "compile") == {
        "device": "cpu",
        "offload": "none",
        "compile": "eager",
    }
    everything = options.record()
    assert "chooser" not in everything and len(everything) == len(dataclasses.fields(LoadOptions)) - 1


def _parsed(argv: list[str], **kwargs: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_load_arguments(parser, **kwargs)  # type: ignore[arg-type]
    return parser.parse_args(argv)


def test_the_command_line_is_parsed_into_one_value() -> None:
    args = _parsed(
        ["--device", "cpu", "--offload", "auto", "--variant", "fp16", "--attention", "auto", "--kv-cache", "fp8",
         "--compile", "--compile-backend", "eager", "--accumulate", "fast", "--max-memory", "2GiB"]
    )  # fmt: skip
    assert load_options_from_args(args) == LoadOptions(
        device="cpu", offload="auto", variant="fp16", attention="auto", kv_cache="fp8", compile="eager",
        accumulate="fast", max_memory="2GiB",
    )  # fmt: skip
    assert load_options_from_args(_parsed([])) == LoadOptions()  # the flags' defaults are LoadOptions'


def test_a_command_offers_only_its_flags_and_keeps_the_others_defaults() -> None:
    """The baseline offers four flags and fixes its dtype itself; an offered flag shows the command's own help."""
    flags = ("device", "offload", "variant", "compile")
    parser = argparse.ArgumentParser()
    add_load_arguments(parser, "in process: where", flags=flags, helps={"skip_doctor": "unused"})
    offered = {action.dest for action in parser._actions} - {"help"}
    assert offered == {*flags, "compile_backend"}
    args = parser.parse_args(["--offload", "model"])
    assert load_options_from_args(args, dtype="bfloat16") == LoadOptions(offload="model", dtype="bfloat16")
    parser = argparse.ArgumentParser()
    add_load_arguments(parser, flags=["skip_doctor"], helps={"skip_doctor": "do not run the kernel doctor"})
    assert parser._actions[-1].help == "do not run the kernel doctor"
    assert set(LOAD_FLAGS) <= {f.name for f in dataclasses.fields(LoadOptions)}


def test_the_opener_chooses_kernels_through_the_doctor_and_records_what_it_found(
    demo_artifacts: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    checked = open_pipeline(demo_artifacts["w8a8"], LoadOptions(device="cpu"))
    assert isinstance(checked.kernel_chooser, VerifiedChooser)
    assert checked.load_facts["kernel_choice_seconds"] >= 0 and checked.load_facts["accumulate"] == "exact"
    assert checked.load_facts["kv_cache"] is None and checked.load_facts["compile"] is None
    with caplog.at_level(logging.WARNING, logger="ditq.pipeline.open"):
        unchecked = open_pipeline(demo_artifacts["w8a8"], LoadOptions(device="cpu", skip_doctor=True))
    assert unchecked.kernel_chooser is None and "kernel_choice_seconds" not in unchecked.load_facts
    assert "without verification" in caplog.text


def test_the_python_api_keeps_its_keywords_and_its_quiet_first_candidate(
    demo_artifacts: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """``ditq.load_pipeline`` maps its keywords into LoadOptions and opens through the opener; without a chooser it
    takes the registry's first candidate, as it always did, and says nothing about the doctor."""
    import ditq

    assert ditq.load_pipeline is load_pipeline
    with caplog.at_level(logging.WARNING):
        pipeline = ditq.load_pipeline(demo_artifacts["w8a8"], device="cpu", dtype=torch.float32)
    assert "without verification" not in caplog.text
    assert {p.dtype for p in pipeline.text_encoder.parameters()} == {torch.float32}


def test_where_ditq_fits_the_model_on_cuda_the_allocator_grows_in_place_unless_the_environment_says(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--offload auto or --max-memory on CUDA: expandable segments, so that memory reserved between fixed segments
    does not run out a request the budget fits; a PYTORCH_CUDA_ALLOC_CONF the user set is left as it is, and
    nothing is set on the CPU or where ditq does not manage the fit."""
    from ditq.runtime.memory_cap import ALLOCATOR_ENV, expandable_segments

    cuda = torch.device("cuda", 0)  # the device's name only: nothing here starts CUDA
    monkeypatch.delenv(ALLOCATOR_ENV, raising=False)
    assert expandable_segments(torch.device("cpu"), managed=True) is None
    assert expandable_segments(cuda, managed=False) is None
    assert ALLOCATOR_ENV not in os.environ
    assert expandable_segments(cuda, managed=True) == "expandable_segments"
    assert os.environ[ALLOCATOR_ENV] == "expandable_segments:True"
    monkeypatch.setenv(ALLOCATOR_ENV, "backend:native,max_split_size_mb:256")
    assert expandable_segments(cuda, managed=True) == "environment: backend:native,max_split_size_mb:256"
    assert os.environ[ALLOCATOR_ENV] == "backend:native,max_split_size_mb:256"
    # the CPU load resolves with no allocator setting, offload auto or not
    monkeypatch.delenv(ALLOCATOR_ENV)
    assert resolve_load_options(LoadOptions(device="cpu", offload="auto")).allocator is None
    assert ALLOCATOR_ENV not in os.environ
