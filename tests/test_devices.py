"""The one resolver of --device, --dtype and --offload: the words every command takes, the defaults per device."""

from __future__ import annotations

import argparse
from collections.abc import Callable

import pytest
import torch

from ditq.devices import (
    DTYPE_CHOICES,
    OFFLOAD_MODES,
    add_device_arguments,
    default_dtype,
    resolve_device,
    resolve_dtype,
    resolve_offload,
)
from ditq.errors import InputError


def test_cpu_and_auto_resolve_here() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("text", ["xpu", "gpu", "cuda:", "cuda:x", "cpu,cuda", ""])
def test_a_word_that_is_no_device_is_one_line_naming_the_option(text: str) -> None:
    with pytest.raises(InputError) as raised:
        resolve_device(text)
    message = str(raised.value)
    assert message.startswith("--device ") and "\n" not in message
    assert "auto, cpu, cuda, cuda:N" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("text", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_cuda_device_is_refused(text: str) -> None:
    with pytest.raises(InputError, match=rf"^--device {text}: no CUDA device is available here$"):
        resolve_device(text)


def test_a_cuda_index_past_the_device_count_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("auto") == torch.device("cuda")
    with pytest.raises(InputError, match=r"^--device cuda:1: this machine has 1 CUDA device$"):
        resolve_device("cuda:1")


def test_one_default_dtype_per_device_type() -> None:
    assert default_dtype("cpu") == "float32"
    assert default_dtype(torch.device("cuda", 1)) == "bfloat16"
    assert resolve_dtype(None, torch.device("cpu")) is torch.float32
    assert resolve_dtype(None, "cuda") is torch.bfloat16
    assert resolve_dtype("float16", "cpu") is torch.float16
    assert resolve_dtype(torch.bfloat16, "cpu") is torch.bfloat16
    with pytest.raises(InputError, match=r"^--dtype 'int8': not a compute dtype"):
        resolve_dtype("int8", "cpu")


def test_offload_modes() -> None:
    assert [resolve_offload(mode) for mode in OFFLOAD_MODES] == ["none", "auto", "model", "block"]
    with pytest.raises(InputError, match=r"^--offload 'disk': not an offload mode"):
        resolve_offload("disk")


def test_the_cli_choices_are_the_resolver_lists() -> None:
    parser = argparse.ArgumentParser()
    add_device_arguments(parser, "cpu", "where to run", dtype=True, offload=True)
    actions = {action.dest: action for action in parser._actions}
    assert tuple(actions["dtype"].choices or ()) == DTYPE_CHOICES
    assert tuple(actions["offload"].choices or ()) == OFFLOAD_MODES
    args = parser.parse_args([])
    assert (args.device, args.dtype, args.offload) == ("cpu", None, "none")


def test_generate_and_serve_compute_in_the_same_default_dtype_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ditq.demo import default_model_dir
    from ditq.pipeline import generate as generate_module
    from ditq.runtime.adapter import GenerationRequest
    from ditq.runtime.options import LoadOptions, ResolvedLoad
    from ditq.serve import server
    from ditq.serve.config import ServeConfig

    class Loaded(Exception):
        """Stops each entry point where it loads the model, with what it asked for."""

    def load(model_dir: object, load: ResolvedLoad) -> None:
        raise Loaded(str(load.device), load.dtype)

    def create_app(config: ServeConfig, *, load: Callable[[], object], facts: dict[str, object], **_: object):
        assert (facts["device"], facts["dtype"]) == ("cpu", "float32")  # what /health says
        return load()

    monkeypatch.setattr(generate_module, "open_pipeline", load)  # generate opens as serve does
    monkeypatch.setattr(server, "create_app", create_app)
    monkeypatch.setattr(server, "open_pipeline", load)
    with pytest.raises(Loaded) as generated:
        generate_module.generate(None, GenerationRequest(prompt="a kite"), LoadOptions(device="cpu"))
    with pytest.raises(Loaded) as served:
        server.serve(default_model_dir(), ServeConfig(), LoadOptions(device="cpu", skip_doctor=True))
    assert generated.value.args == served.value.args == ("cpu", torch.float32)


def test_the_python_api_defaults_to_the_best_device_and_its_dtype() -> None:
    """load_pipeline and load_component take device 'auto' and the device's compute dtype unless told: on this
    CPU-only machine, the CPU in float32 (bfloat16 matmuls there are many times slower)."""
    import inspect

    import ditq
    from ditq.demo import default_model_dir

    for function in (ditq.load_pipeline, ditq.load_component):
        parameters = inspect.signature(function).parameters
        assert (parameters["device"].default, parameters["dtype"].default) == ("auto", None)
    if torch.cuda.is_available():
        pytest.skip("the defaults resolve to CUDA here")
    pipeline = ditq.load_pipeline(default_model_dir())
    assert pipeline.transformer.device.type == "cpu" and pipeline.transformer.dtype == torch.float32
