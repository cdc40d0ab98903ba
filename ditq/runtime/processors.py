"""A pipeline's transformers processors, loaded without the sub-processor it never runs: the video processor.

Qwen-Image's text encoder is Qwen3-VL, and its processor (``Qwen3VLProcessor``) holds an image processor, a
tokenizer and a video processor. transformers builds a video processor only with torchvision installed, and it
builds every sub-processor a processor names whenever it loads one, so without torchvision the whole pipeline
failed to load ("Qwen3VLVideoProcessor requires the Torchvision library"). A diffusers pipeline passes its
processor text and images, never videos (Qwen-Image's pipeline calls ``processor(text=..., images=...)``), so
where torchvision is missing each such processor is loaded here from its image processor and tokenizer alone and
handed to the pipeline: transformers' own class, less ``video_processor`` among its sub-processors. Text and
images are processed exactly as transformers processes them (the image processor falls back to its PIL backend);
videos are not accepted. Where torchvision is installed nothing changes: diffusers loads the processor itself.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

from ditq.checkpoint.layout import component_class, component_names
from ditq.errors import InputError, error_line

__all__ = ["VIDEO_PROCESSOR", "image_text_processor", "missing_library", "processors_without_video"]

VIDEO_PROCESSOR = "video_processor"  # the sub-processor that needs torchvision
# How to add torchvision: the build that matches the installed torch, from the index torch came from.
TORCHVISION_HINT = (
    "install the torchvision build that matches your torch, from the index your torch came from "
    "(pip install torchvision --index-url https://download.pytorch.org/whl/cpu on a CPU; .../whl/cuXXX, your "
    "CUDA, on a GPU)"
)
_REQUIRES = re.compile(r"(?P<what>\w+) requires the (?P<library>[\w-]+) library")


@functools.cache
def image_text_processor(cls: type) -> type:
    """``cls`` (a transformers ``ProcessorMixin``) without its video processor: the same name and module, the
    same processing of text and images."""

    class Processor(cls):
        @classmethod
        def get_attributes(klass) -> list[str]:
            return [name for name in super().get_attributes() if name != VIDEO_PROCESSOR]

    Processor.__name__, Processor.__qualname__, Processor.__module__ = (
        cls.__name__,
        cls.__qualname__,
        cls.__module__,
    )
    return Processor


def _needs_video_processor(cls: type) -> bool:
    from transformers.processing_utils import ProcessorMixin

    return issubclass(cls, ProcessorMixin) and VIDEO_PROCESSOR in cls.get_attributes()  # type: ignore[attr-defined]


def processors_without_video(
    model_dir: Path, index: dict[str, Any], classes: dict[str, type]
) -> dict[str, Any]:
    """Component -> its processor, loaded from ``model_dir`` without a video processor, for each transformers
    processor component that names one, where torchvision is missing; empty where it is installed (diffusers
    loads them as usual). ``classes`` is each component's class (``check_component_classes``)."""
    from transformers.utils import is_torchvision_available

    if is_torchvision_available():
        return {}
    loaded = {}
    for name in component_names(index):
        library, _ = component_class(index, name)
        cls = classes.get(name)
        if library == "transformers" and isinstance(cls, type) and _needs_video_processor(cls):
            processor_cls: Any = image_text_processor(cls)
            loaded[name] = processor_cls.from_pretrained(str(Path(model_dir) / name), local_files_only=True)
    return loaded


def missing_library(error: ImportError, where: Path) -> InputError:
    """transformers' "X requires the Torchvision library but it was not found ... Check out the" (a message over
    several lines) as one line naming ``where``, the class and the library, and for torchvision how to add it."""
    found = _REQUIRES.search(str(error))
    if found is None:
        return InputError(f"{where}: {error_line(error) or type(error).__name__}")
    library = found["library"].lower()
    how = TORCHVISION_HINT if library == "torchvision" else f"install {library}"
    return InputError(f"{where}: {found['what']} needs {library}, which is not installed: {how}")
