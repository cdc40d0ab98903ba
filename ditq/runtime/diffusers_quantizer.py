"""ditq as a diffusers quantization backend: ``ModelMixin.from_pretrained`` loads a compressed-tensors component
into the runtime's QuantizedLinears, through ditq's codecs, scheme rule and kernels.

diffusers builds the model from its config with every parameter on the meta device, chooses the backend that
``quantization_config.quant_method`` names (``DiffusersAutoQuantizer``), and asks it, in this order:

- ``update_torch_dtype``: the dtype of every tensor that is not stored quantized (None: float32, as diffusers
  loads any model);
- ``maybe_update_loaded_keys``: the weight files it resolved, whose headers are read (no tensor data);
- ``preprocess_model``, on meta: the config's groups are read against those headers (a scheme ditq does not read
  is refused in one line naming ``config.json``) and each stored quantized Linear becomes its scheme's
  QuantizedLinear (``ditq.runtime.swap``), whose buffers carry the stored tensors' names, dtypes and shapes, so
  no source-precision weight of a quantized layer ever exists;
- per stored tensor, ``check_if_quantized_param`` and ``create_quantized_param``: a quantized Linear's stored
  tensors take their place through ``ditq.runtime.fill`` (stored dtype; scales float32), read as the file holds
  them, not as diffusers cast them; every other tensor, biases included, loads the way diffusers loads it;
- ``update_missing_keys``: a tensor of the model that no file holds is refused (an incomplete artifact).

Before diffusers reads a local folder at all (``refuse_before_diffusers``, which ``ditq.diffusers`` hooks into
``from_pretrained``), the loader's refusals come first: a ditq artifact holding what its manifest does not list
(``ditq.checkpoint.manifest.check_sealed_reads``), and a ``quantization_config`` diffusers would crash on or
misread (not an object, the wrapped form, ``quant_method`` spelled another way, a config group ditq does not read
or given twice), each one line naming the ``config.json``.

Each layer chooses its kernel path and repacks on its first forward, on its input's device and dtype
(``QuantizedLinear.forward``), as ``ditq.load_pipeline`` chooses without a doctor's chooser; or call
``ditq.runtime.prepare_quantized`` first (before ``torch.compile`` or offload hooks). Registration in diffusers'
registry is ``ditq.diffusers``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from diffusers.quantizers.base import DiffusersQuantizer
from diffusers.quantizers.quantization_config import QuantizationConfigMixin

from ditq.checkpoint.codecs import config_groups
from ditq.checkpoint.layout import load_component_config
from ditq.checkpoint.manifest import check_sealed_reads, is_sealed
from ditq.checkpoint.safetensors_io import TensorEntry
from ditq.errors import InputError
from ditq.runtime.embedding import QuantizedEmbedding
from ditq.runtime.fill import assign_tensor
from ditq.runtime.loader import check_complete, check_tensor_places, file_entries
from ditq.runtime.modules import QuantizedLinear
from ditq.runtime.swap import swap_quantized_linears

__all__ = [
    "QUANT_METHODS",
    "CompressedTensorsConfig",
    "CompressedTensorsMethod",
    "CompressedTensorsQuantizer",
    "refuse_before_diffusers",
]


class CompressedTensorsMethod(str, Enum):
    """The ``quant_method`` this backend answers to (diffusers' own ``QuantizationMethod`` is closed)."""

    COMPRESSED_TENSORS = "compressed-tensors"


# Both spellings a config may carry (``ditq.schemes.normalize_quant_method``).
QUANT_METHODS = ("compressed-tensors", "compressed_tensors")


def refuse_before_diffusers(path: str | os.PathLike[str] | None, subfolder: str | None = None) -> None:
    """What ``ditq.load_pipeline`` refuses in a local folder ``path`` (``subfolder``: a component's), refused in one
    line before diffusers reads it; a hub id (no such folder) is diffusers' to fetch."""
    if path is None or not os.path.isdir(path):
        return
    folder = Path(path) / subfolder if subfolder else Path(path)
    root = next((f for f in (folder, folder.parent) if is_sealed(f)), None)
    if root is not None:
        check_sealed_reads(root)
    if (folder / "config.json").is_file():
        _check_quantization_config(folder)


def _check_quantization_config(folder: Path) -> None:
    """A ``quantization_config`` that is compressed-tensors', or reads as if it meant to be, is one diffusers can
    take to this backend: an object, flat, ``quant_method`` spelled as registered, every group one ditq reads."""
    where = f"{folder / 'config.json'}"
    raw = load_component_config(folder).get("quantization_config")
    if raw is None:
        return
    if not isinstance(raw, dict):
        raise InputError(f"{where}: quantization_config is a {type(raw).__name__}, not an object")
    if "quant_method" not in raw:
        keys = ", ".join(sorted(map(str, raw))[:4]) or "nothing"
        raise InputError(
            f"{where}: quantization_config has no quant_method (it holds {keys}): diffusers reads the flat form "
            "only; ditq.load_pipeline reads the wrapped one too"
        )
    method = raw["quant_method"]
    if not isinstance(method, str):
        raise InputError(f"{where}: quantization_config.quant_method is not a string")
    if method in QUANT_METHODS:
        config_groups(raw, where)
    elif method.strip().lower().replace("_", "-") == QUANT_METHODS[0]:
        raise InputError(
            f"{where}: quant_method {method[:40]!r}: diffusers looks it up as written; spell it "
            f"{QUANT_METHODS[0]!r}"
        )


class CompressedTensorsConfig(QuantizationConfigMixin):
    """A component's compressed-tensors ``quantization_config``, flat form, kept as stored.

    It is read (``ditq.checkpoint.codecs.config_groups``) once the files it describes are known, so that an
    error names their ``config.json``; ``to_dict`` gives back the stored dict, which ``save_pretrained`` of a
    config writes.
    """

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = dict(config)
        # diffusers types quant_method as its own closed enum; any str enum with a value serves its lookups
        self.quant_method = CompressedTensorsMethod.COMPRESSED_TENSORS  # type: ignore[assignment]

    @classmethod
    def from_dict(
        cls, config_dict: Mapping[str, Any], return_unused_kwargs: bool = False, **kwargs: Any
    ) -> Any:
        config = cls(config_dict)
        return (config, kwargs) if return_unused_kwargs else config

    def to_dict(self) -> dict[str, Any]:
        return dict(self.config)

    def to_diff_dict(self) -> dict[str, Any]:
        """What ``to_json_string`` (and so ``repr``) prints: the stored dict, which has no defaults to leave out."""
        return self.to_dict()


class CompressedTensorsQuantizer(DiffusersQuantizer):
    """Loads a compressed-tensors component (module docstring); it quantizes nothing itself."""

    use_keep_in_fp32_modules = True  # as ditq.runtime.fill keeps them
    quantization_config: CompressedTensorsConfig

    def __init__(self, quantization_config: CompressedTensorsConfig, **kwargs: Any) -> None:
        if not kwargs.get("pre_quantized", True):
            raise InputError(
                "quantization_config: ditq's compressed-tensors backend loads quantized checkpoints; quantize a "
                "model with ditq.quantize_ (in memory) or ditq quantize (an artifact)"
            )
        super().__init__(quantization_config, **kwargs)
        self.dtype = torch.float32
        self.component_dir: Path | None = None
        self.entries: dict[str, TensorEntry] = {}

    def validate_environment(self, *args: Any, **kwargs: Any) -> None:
        device_map = kwargs.get("device_map")
        if isinstance(device_map, dict) and "disk" in device_map.values():
            raise InputError(
                "device_map: ditq's compressed-tensors backend keeps no weight on disk; place every module on a "
                "device, or stream from host memory with ditq.load_pipeline(offload=...)"
            )

    def update_torch_dtype(self, torch_dtype: torch.dtype | None) -> torch.dtype:
        self.dtype = torch_dtype if torch_dtype is not None else torch.float32
        return self.dtype

    def maybe_update_loaded_keys(self, loaded_keys: list[str], checkpoint_files: list[str]) -> list[str]:
        paths = [Path(f) for f in checkpoint_files]
        self.component_dir = paths[0].parent
        self.entries = file_entries(paths)
        return loaded_keys

    def _process_model_before_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> None:
        if self.component_dir is None:
            raise InputError(
                f"{type(model).__name__}: ditq's compressed-tensors backend loads with from_pretrained (a folder "
                "with config.json and safetensors files), not from a single file"
            )
        swap_quantized_linears(
            model, self.entries, self.quantization_config.config, self.component_dir, self.dtype
        )
        check_tensor_places(model, self.entries)

    def check_if_quantized_param(
        self,
        model: torch.nn.Module,
        param_value: torch.Tensor,
        param_name: str,
        state_dict: dict[str, Any],
        **kwargs: Any,
    ) -> bool:
        module_name, _, attr = param_name.rpartition(".")
        module = model.get_submodule(module_name)
        return isinstance(module, QuantizedLinear | QuantizedEmbedding) and attr in module.stored_names

    def create_quantized_param(  # type: ignore[override]
        self,
        model: torch.nn.Module,
        param_value: torch.Tensor,
        param_name: str,
        target_device: torch.device | str | int,
        state_dict: dict[str, Any],
        *args: Any,
        **kwargs: Any,
    ) -> None:
        # (diffusers declares (*args, **kwargs) -> Parameter, passes these arguments and reads no result.)
        # state_dict holds the tensor as the file stores it; param_value may be cast to the run dtype already
        stored = state_dict[param_name]
        device = torch.device(target_device)
        assign_tensor(model, param_name, stored, self.entries[param_name], device, self.dtype)

    def update_missing_keys(self, model: torch.nn.Module, missing_keys: list[str], prefix: str) -> list[str]:
        assert self.component_dir is not None
        check_complete(self.component_dir, missing_keys)
        return missing_keys

    def _process_model_after_weight_loading(self, model: torch.nn.Module, **kwargs: Any) -> torch.nn.Module:
        return model

    @property
    def is_serializable(self) -> bool:
        return False  # a layer's repack releases stored tensors: the artifact on disk is the serialized form

    @property
    def is_trainable(self) -> bool:
        return False
