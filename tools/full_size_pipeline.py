"""A complete ``QwenImage21Pipeline`` directory with random weights, plus fixtures for a benchmark sweep.

Writes what ``QwenImage21Pipeline.from_pretrained(OUT)`` reads -- ``model_index.json``, ``scheduler/``,
``vae/``, ``text_encoder/``, ``processor/``, ``transformer/`` -- and nothing is downloaded:

- transformer: ``QwenImage21Transformer2DModel`` (diffusers' default init), VAE:
  ``AutoencoderKLQwenImage21`` (diffusers' default init), text encoder: ``Qwen3VLForConditionalGeneration``
  (transformers' default init: normal(0, initializer_range)). Each is built directly on ``--device``
  after ``torch.manual_seed(seed)``, stored in BF16 and saved with ``save_pretrained`` as safetensors
  shards of at most 5 GB. The same seed gives the same weights on the same kind of device (CPU and CUDA
  draw different numbers).
- processor: ``Qwen3VLProcessor`` from a byte-level BPE tokenizer trained here with ``tokenizers`` on
  the text below (Qwen2's pre-tokenizer and special tokens, wrapped in ``Qwen2Tokenizer``), a chat
  template in Qwen's form, the Qwen2-VL image processor (patch 16, merge 2, temporal patch 2, mean/std
  0.5) and the Qwen3-VL video processor's config. The token ids of the special tokens are this
  tokenizer's (they follow its ~700 learned tokens), not Qwen's 151643..., and the text encoder's
  config names those ids.
- scheduler: ``FlowMatchEulerDiscreteScheduler`` with Qwen-Image's public scheduler config.

Presets (``PRESETS``): ``full`` is the real size -- the transformer and VAE at their diffusers default
configs, and the text encoder at Qwen3-VL-8B-Instruct's size, with the values of that model's public
``config.json`` (text: hidden 4096, 36 layers, MLP 12288, 32 heads, 8 KV heads, head dim 128, vocabulary
151936, interleaved M-RoPE theta 5e6 with sections 24/20/20; vision: depth 27, hidden 1152, MLP 4304,
16 heads, patch 16, merge 2, temporal patch 2, 2304 position embeddings, out 4096, deepstack layers
8/16/24). ``tiny`` is the same classes at about a million parameters in all, built in a second on a CPU,
every Linear 16-aligned and at least 32 wide so that ditq quantizes the blocks' Linears.

Fixtures (``FIXTURES``): five, in ``ditq probe``'s format (``fixtures.json`` + ``refs/REF.png``), with
0, 1, 2, 3 and 4 reference images, at 1024x1024 (``full``) or 64x64 (``tiny``); the references are flat
shapes drawn with PIL (a few KB each). They go to ``OUT/fixtures`` unless ``--fixtures-out`` names
another directory.

Video processor and torchvision: ``Qwen3VLVideoProcessor`` needs torchvision, and ``Qwen3VLProcessor``
builds and loads one whenever it is built or loaded. Where torchvision is missing (ditq's CPU test
environment) the processor is built, and can be loaded, without it inside ``without_video_processor()``;
``QwenImage21Pipeline`` never passes videos. The video processor's config is written into
``processor/processor_config.json`` regardless, so that where torchvision is installed the processor loads
as usual, video processor included.

Usage:
    python tools/full_size_pipeline.py --out DIR [--preset full|slim|tiny] [--device cpu|cuda] [--seed 0]
        [--fixtures-out DIR] [--force]
    python tools/full_size_pipeline.py --preset full --dry-run   # counts on the meta device, no files
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import diffusers
import torch
import transformers
from diffusers import (
    AutoencoderKLQwenImage21,
    FlowMatchEulerDiscreteScheduler,
    QwenImage21Transformer2DModel,
)
from PIL import Image, ImageDraw
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
from transformers import (
    Qwen2Tokenizer,
    Qwen2VLImageProcessorPil,
    Qwen3VLConfig,
    Qwen3VLForConditionalGeneration,
    Qwen3VLProcessor,
)
from transformers.processing_utils import ProcessorMixin

from ditq.demo.words import VOCABULARY
from ditq.fsutil import FIXTURES_SET, OutputKind, atomic_directory

__all__ = [
    "FIXTURES",
    "PRESETS",
    "Preset",
    "build",
    "build_processor",
    "build_tokenizer",
    "main",
    "without_video_processor",
]

SHARD_SIZE = "5GB"
DTYPE = torch.bfloat16

# ---- tokenizer and processor -------------------------------------------------------------------------

# Qwen2/Qwen3's special tokens, in Qwen's id order (there from 151643 on, here from the learned vocabulary's end).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Qwen2's pre-tokenizer split (as in transformers' tokenization_qwen2.py), then GPT-2 byte-level bytes.
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
TOKENIZER_VOCAB_SIZE = 2048  # learned tokens + SPECIAL_TOKENS, at most; the tiny text encoder's vocabulary
# Qwen-VL's chat template for plain conversations (no tools, no reasoning): roles, text, image and video slots.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for content in message['content'] %}"
    "{%- if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif content['type'] == 'video' or 'video' in content %}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif 'text' in content %}{{- content['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Text the tokenizer learns from (with the fixture prompts and ditq's demo words); any text still encodes, byte by byte.
TOKENIZER_TEXT = (
    "Comprehend and analyze the provided prompt.",
    "A photo of a cat sitting on a windowsill in the morning sun, with plants and a cup of coffee.",
    "A watercolor painting of a lighthouse on a rocky coast under a stormy sky, waves breaking on the rocks.",
    "A close-up portrait of an old man with a white beard and a knitted hat, soft studio lighting.",
    "A futuristic city street at night with neon signs, rain reflections and people with umbrellas.",
    "A bowl of fresh fruit on a kitchen table: apples, oranges, bananas and grapes, natural light.",
    "Change the background to a beach at sunset and keep the person in the picture unchanged.",
    "Replace the text on the sign with the words OPEN LATE in bold red letters.",
    "Remove the car from the street, make the sky clear blue and add a few white clouds.",
    "Combine the people from the first and second pictures into one group photo in a park.",
    "The quick brown fox jumps over the lazy dog. 0 1 2 3 4 5 6 7 8 9, 10, 100, 1024, 2048.",
)
# The Qwen3-VL image and video processors' public configs (the Qwen3-VL-8B-Instruct repository's files).
IMAGE_PROCESSOR_CONFIG: dict[str, Any] = dict(
    patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5]
)
VIDEO_PROCESSOR_CONFIG: dict[str, Any] = {
    **IMAGE_PROCESSOR_CONFIG,
    "size": {"longest_edge": 25165824, "shortest_edge": 4096},
    "video_processor_type": "Qwen3VLVideoProcessor",
}

# ---- presets ---------------------------------------------------------------------------------------------

# Qwen-Image's public scheduler config (Qwen/Qwen-Image); the pipeline passes `mu` from the image size.
SCHEDULER_CONFIG: dict[str, Any] = dict(
    base_image_seq_len=256,
    base_shift=0.5,
    max_image_seq_len=8192,
    max_shift=0.9,
    num_train_timesteps=1000,
    shift=1.0,
    shift_terminal=0.02,
    time_shift_type="exponential",
    use_dynamic_shifting=True,
)


def _setting(cls: type, config: dict[str, Any], name: str) -> Any:
    """``config[name]``, else the class's default for it."""
    return config.get(name, inspect.signature(cls).parameters[name].default)


@dataclass(frozen=True)
class Preset:
    """Every size of one build; component configs are keyword arguments of the component's class or config."""

    transformer: dict[str, Any]
    vae: dict[str, Any]
    text_config: dict[str, Any]  # Qwen3VLTextConfig; token ids come from the tokenizer
    vision_config: dict[str, Any]  # Qwen3VLVisionConfig
    image_min_pixels: int  # the image processor's size["shortest_edge"]: smaller images are scaled up to it
    image_max_pixels: int
    fixture_size: int  # fixtures' width and height, and the reference pictures' side
    notes: str = ""

    def __post_init__(self) -> None:
        text_width = self.text_config["hidden_size"]
        context = _setting(QwenImage21Transformer2DModel, self.transformer, "context_in_dim")
        if context != text_width:
            raise ValueError(f"transformer context_in_dim {context} != text encoder hidden_size {text_width}")
        if self.vision_config["out_hidden_size"] != text_width:
            raise ValueError("vision out_hidden_size must equal the text hidden_size")
        z_dim = _setting(AutoencoderKLQwenImage21, self.vae, "z_dim")
        in_channels = _setting(QwenImage21Transformer2DModel, self.transformer, "in_channels")
        if in_channels != z_dim:
            raise ValueError(f"transformer in_channels {in_channels} != the VAE's z_dim {z_dim}")
        if self.fixture_size % 32:
            raise ValueError(
                f"fixture_size {self.fixture_size} is not a multiple of 32 (QwenImage21Pipeline)"
            )


TINY_Z = 16
_FULL = Preset(
    transformer={},  # QwenImage21Transformer2DModel() defaults: 32 blocks, 32 x 128 heads, context 4096
    vae={},  # AutoencoderKLQwenImage21() defaults: z_dim 64, 16x spatial compression
    # Qwen/Qwen3-VL-8B-Instruct config.json, text_config (rope_scaling there = rope_parameters here)
    text_config=dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        hidden_act="silu",
        max_position_embeddings=262144,
        rms_norm_eps=1e-6,
        attention_bias=False,
        initializer_range=0.02,
        rope_parameters=dict(
            rope_type="default", rope_theta=5000000, mrope_section=[24, 20, 20], mrope_interleaved=True
        ),
    ),
    # Qwen/Qwen3-VL-8B-Instruct config.json, vision_config
    vision_config=dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        hidden_act="gelu_pytorch_tanh",
        in_channels=3,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=4096,
        num_position_embeddings=2304,
        deepstack_visual_indexes=[8, 16, 24],
        initializer_range=0.02,
    ),
    image_min_pixels=65536,  # Qwen3-VL's preprocessor_config.json
    image_max_pixels=16777216,
    fixture_size=1024,
    notes="real sizes: transformer and VAE at diffusers defaults, text encoder at Qwen3-VL-8B-Instruct",
)
PRESETS: dict[str, Preset] = {
    "full": _FULL,
    # the full widths with two of each stack of layers: what one full-width layer costs (to quantize, verify, load),
    # on a CPU, in about 5.4 GB (the text encoder's token embedding and lm_head are whole)
    "slim": replace(
        _FULL,
        transformer={"num_layers": 2},
        text_config={**_FULL.text_config, "num_hidden_layers": 2},
        vision_config={**_FULL.vision_config, "depth": 2, "deepstack_visual_indexes": [0, 1]},
        notes="full widths, two transformer blocks, two text-encoder layers, two vision blocks",
    ),
    "tiny": Preset(
        transformer=dict(
            patch_size=1,
            in_channels=TINY_Z,
            out_channels=TINY_Z,
            num_layers=2,
            attention_head_dim=32,
            num_attention_heads=2,
            context_in_dim=64,
            mlp_ratio=3,
            axes_dims_rope=(8, 12, 12),  # sums to attention_head_dim
        ),
        vae=dict(  # four down-sampling stages keep the 16x compression the pipeline assumes
            base_dim=16,
            decoder_base_dim=16,
            z_dim=TINY_Z,
            dim_mult=[1, 1, 1, 1, 1],
            num_res_blocks=1,
            latents_mean=[0.0] * TINY_Z,
            latents_std=[1.0] * TINY_Z,
        ),
        text_config=dict(
            vocab_size=TOKENIZER_VOCAB_SIZE,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            max_position_embeddings=4096,
            rope_parameters=dict(
                rope_type="default", rope_theta=5000000, mrope_section=[6, 5, 5], mrope_interleaved=True
            ),
        ),
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            out_hidden_size=64,
            num_position_embeddings=256,
            deepstack_visual_indexes=[0, 1],
        ),
        image_min_pixels=32 * 32,  # one merged 32x32 token; a 64x64 reference keeps its size
        image_max_pixels=16777216,
        fixture_size=64,
        notes="the same classes at tiny sizes, for CPU tests",
    ),
}

# ---- fixtures --------------------------------------------------------------------------------------------

# Reference id -> (shape, shape color, background color); drawn flat so that each PNG stays a few KB.
REFERENCES: dict[str, tuple[str, tuple[int, int, int], tuple[int, int, int]]] = {
    "ref-star-red": ("star", (220, 40, 40), (245, 245, 245)),
    "ref-circle-green": ("circle", (40, 170, 60), (225, 205, 165)),
    "ref-square-blue": ("square", (40, 80, 220), (200, 200, 200)),
    "ref-triangle-yellow": ("triangle", (240, 220, 40), (40, 40, 40)),
}
# Fixture id -> (references, prompt); mode and size follow from them and the preset.
FIXTURES: dict[str, tuple[tuple[str, ...], str]] = {
    "generate-0ref": (
        (),
        "A red fox sitting in a snowy pine forest at sunrise, soft golden light, detailed fur.",
    ),
    "edit-1ref": (
        ("ref-star-red",),
        "Make the star from picture 1 deep blue and place it on a night sky full of stars.",
    ),
    "edit-2ref": (
        ("ref-star-red", "ref-circle-green"),
        "Put the star from picture 1 and the circle from picture 2 side by side on a wooden table.",
    ),
    "edit-3ref": (
        ("ref-star-red", "ref-circle-green", "ref-square-blue"),
        "Arrange the star from picture 1, the circle from picture 2 and the square from picture 3 "
        "in a row on a white shelf.",
    ),
    "edit-4ref": (
        ("ref-star-red", "ref-circle-green", "ref-square-blue", "ref-triangle-yellow"),
        "Place the star, the circle, the square and the triangle from pictures 1 to 4 in the four "
        "corners of a sunny beach scene.",
    ),
}


def draw_reference(
    shape: str, color: tuple[int, int, int], background: tuple[int, int, int], side: int
) -> Image.Image:
    """A flat shape centred on a flat background, side x side RGB."""
    image = Image.new("RGB", (side, side), background)
    draw = ImageDraw.Draw(image)
    low, high, centre = side * 0.2, side * 0.8, side / 2
    if shape == "circle":
        draw.ellipse((low, low, high, high), fill=color)
    elif shape == "square":
        draw.rectangle((low, low, high, high), fill=color)
    elif shape == "triangle":
        draw.polygon([(centre, low), (high, high), (low, high)], fill=color)
    elif shape == "star":
        draw.regular_polygon((centre, centre, side * 0.3), n_sides=5, fill=color)
        draw.regular_polygon((centre, centre, side * 0.3), n_sides=5, rotation=36, fill=color)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return image


def write_fixtures(directory: Path, size: int) -> None:
    """``fixtures.json`` and ``refs/REF.png`` in ``ditq probe``'s format."""
    refs = directory / "refs"
    refs.mkdir(parents=True)
    for ref_id, (shape, color, background) in REFERENCES.items():
        draw_reference(shape, color, background, size).save(refs / f"{ref_id}.png", optimize=True)
    fixtures = {
        fixture_id: {
            "mode": "edit" if references else "generate",
            "references": list(references),
            "width": size,
            "height": size,
            "prompt": prompt,
            "negative_prompt": None,
        }
        for fixture_id, (references, prompt) in FIXTURES.items()
    }
    (directory / "fixtures.json").write_text(json.dumps(fixtures, indent=2) + "\n")
    marker = {"schema": "ditq-fixtures-set-v1", "written_by": "tools/full_size_pipeline.py"}
    (directory / FIXTURES_SET.markers[0]).write_text(json.dumps(marker) + "\n")  # --force may replace it


# ---- components ------------------------------------------------------------------------------------------


def build_tokenizer() -> Qwen2Tokenizer:
    """Byte-level BPE learned from ``TOKENIZER_TEXT`` etc., SPECIAL_TOKENS after the learned tokens."""
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    demo_words = " ".join(word for word in VOCABULARY if word.isalnum())
    text = [*TOKENIZER_TEXT, *(prompt for _, prompt in FIXTURES.values()), demo_words]
    bpe.train_from_iterator(text, trainer)
    learned = json.loads(bpe.to_str())["model"]
    vocab: dict[str, int] = learned["vocab"]
    vocab.update({token: len(vocab) + i for i, token in enumerate(SPECIAL_TOKENS)})
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=[tuple(pair) for pair in learned["merges"]],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=262144,
    )
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    first = len(vocab) - len(SPECIAL_TOKENS)
    assert ids == list(range(first, len(vocab))), f"special token ids {ids} are not {first}..{len(vocab) - 1}"
    assert len(tokenizer) <= TOKENIZER_VOCAB_SIZE
    return tokenizer


@contextmanager
def without_video_processor() -> Iterator[None]:
    """``Qwen3VLProcessor`` built and loaded from its image processor and tokenizer alone.

    Its video processor needs torchvision; without torchvision, transformers can neither build one nor
    check the argument's class (``Qwen3VLProcessor(..., video_processor=None)`` fails in
    ``check_argument_for_proper_class``) nor load one (``AutoVideoProcessor``), so the processor's list of
    sub-processors leaves it out inside this block. Images and text are processed as usual.
    """
    assert "get_attributes" not in vars(Qwen3VLProcessor), (
        "transformers changed: Qwen3VLProcessor.get_attributes"
    )
    inherited = ProcessorMixin.get_attributes.__func__  # type: ignore[attr-defined]

    def get_attributes(cls: type) -> list[str]:
        return [name for name in inherited(cls) if name != "video_processor"]

    Qwen3VLProcessor.get_attributes = classmethod(get_attributes)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        del Qwen3VLProcessor.get_attributes


def build_processor(preset: Preset) -> Qwen3VLProcessor:
    """The processor without its video processor (see ``without_video_processor``); ``save_processor`` adds it."""
    image_processor = Qwen2VLImageProcessorPil(
        **IMAGE_PROCESSOR_CONFIG,
        size={"shortest_edge": preset.image_min_pixels, "longest_edge": preset.image_max_pixels},
    )
    with without_video_processor():
        return Qwen3VLProcessor(
            image_processor=image_processor, tokenizer=build_tokenizer(), chat_template=CHAT_TEMPLATE
        )


def save_processor(processor: Qwen3VLProcessor, directory: Path) -> None:
    """``save_pretrained``, then the video processor's entry that it would have written with torchvision."""
    with without_video_processor():
        processor.save_pretrained(str(directory))
    config_path = directory / "processor_config.json"
    config = json.loads(config_path.read_text())
    config["video_processor"] = VIDEO_PROCESSOR_CONFIG
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def text_encoder_config(preset: Preset, tokenizer: Qwen2Tokenizer) -> Qwen3VLConfig:
    """Qwen3-VL at the preset's sizes; the token ids the model looks for are this tokenizer's."""
    vocab = tokenizer.get_vocab()  # special tokens included
    return Qwen3VLConfig(
        text_config=preset.text_config,
        vision_config=preset.vision_config,
        image_token_id=vocab["<|image_pad|>"],
        video_token_id=vocab["<|video_pad|>"],
        vision_start_token_id=vocab["<|vision_start|>"],
        vision_end_token_id=vocab["<|vision_end|>"],
        tie_word_embeddings=False,
    )


Model = Any  # a diffusers ModelMixin or a transformers PreTrainedModel (mypy sees neither's methods)


# Diffusers models are drawn in float32 and cast; torch's `to`, since ModelMixin.to warns about an empty list of
# modules to keep in float32 on every cast.
def build_transformer(preset: Preset) -> Model:
    return torch.nn.Module.to(QwenImage21Transformer2DModel.from_config(preset.transformer), DTYPE)


def build_vae(preset: Preset) -> Model:
    return torch.nn.Module.to(AutoencoderKLQwenImage21.from_config(preset.vae), DTYPE)


def build_text_encoder(config: Qwen3VLConfig) -> Model:
    return Qwen3VLForConditionalGeneration._from_config(config, dtype=DTYPE)


MODEL_INDEX: dict[str, Any] = {
    "_class_name": "QwenImage21Pipeline",
    "processor": ["transformers", "Qwen3VLProcessor"],
    "sample_sigmas": None,
    "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
    "text_encoder": ["transformers", "Qwen3VLForConditionalGeneration"],
    "transformer": ["diffusers", "QwenImage21Transformer2DModel"],
    "vae": ["diffusers", "AutoencoderKLQwenImage21"],
}

# ---- build -----------------------------------------------------------------------------------------------


def model_builders(preset: Preset, tokenizer: Qwen2Tokenizer) -> dict[str, Callable[[], Model]]:
    """Component name -> builder of the model on the current default device; built, saved and freed in turn."""
    config = text_encoder_config(preset, tokenizer)
    return {
        "transformer": lambda: build_transformer(preset),
        "vae": lambda: build_vae(preset),
        "text_encoder": lambda: build_text_encoder(config),
    }


def tensor_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def dry_run(preset: Preset) -> dict[str, dict[str, Any]]:
    """Each model built on the meta device: parameters and BF16 bytes, no memory, no files."""
    summary: dict[str, dict[str, Any]] = {}
    tokenizer = build_tokenizer()
    for name, builder in model_builders(preset, tokenizer).items():
        with torch.device("meta"):
            model = builder()
        summary[name] = {
            "class": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "bytes": tensor_bytes(model),
        }
        print(
            f"{name:13s} {summary[name]['class']:34s} {summary[name]['parameters']:>15,d} parameters "
            f"{summary[name]['bytes'] / 1e9:8.3f} GB (BF16 tensors)",
            flush=True,
        )
    return summary


PIPELINE = OutputKind(
    "a full-size pipeline", ("BUILD.json",)
)  # what --force may replace: only what this wrote


def build(
    out: Path,
    preset_name: str,
    device: str = "cpu",
    seed: int = 0,
    fixtures_out: Path | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Write the pipeline directory ``out`` (and the fixtures) atomically; returns what BUILD.json records."""
    preset = PRESETS[preset_name]
    start = time.perf_counter()
    components: dict[str, dict[str, Any]] = {}
    fixtures_context = (
        atomic_directory(fixtures_out, FIXTURES_SET, force=force)
        if fixtures_out is not None
        else nullcontext(None)
    )
    with atomic_directory(out, PIPELINE, force=force) as tmp, fixtures_context as fixtures_tmp:
        write_fixtures(fixtures_tmp or tmp / "fixtures", preset.fixture_size)
        processor = build_processor(preset)
        save_processor(processor, tmp / "processor")
        FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG).save_pretrained(str(tmp / "scheduler"))
        for name, builder in model_builders(preset, processor.tokenizer).items():
            torch.manual_seed(seed)
            with torch.device(device):
                model = builder()
            model.save_pretrained(str(tmp / name), max_shard_size=SHARD_SIZE)
            components[name] = {
                "class": type(model).__name__,
                "parameters": sum(p.numel() for p in model.parameters()),
                "bytes": folder_bytes(tmp / name),
            }
            print(
                f"{name:13s} {components[name]['class']:34s} {components[name]['parameters']:>15,d} parameters "
                f"{components[name]['bytes'] / 1e9:8.3f} GB on disk",
                flush=True,
            )
            del model
            if device == "cuda":
                torch.cuda.empty_cache()
        (tmp / "model_index.json").write_text(
            json.dumps({**MODEL_INDEX, "_diffusers_version": diffusers.__version__}, indent=2, sort_keys=True)
            + "\n"
        )
        info: dict[str, Any] = {
            "preset": preset_name,
            "notes": preset.notes,
            "seed": seed,
            "device": device,
            "dtype": str(DTYPE).removeprefix("torch."),
            "versions": {
                "torch": torch.__version__,
                "diffusers": diffusers.__version__,
                "transformers": transformers.__version__,
            },
            "components": components,
            "total_parameters": sum(c["parameters"] for c in components.values()),
            "total_bytes": folder_bytes(tmp),
            "build_seconds": round(time.perf_counter() - start, 2),
        }
        (tmp / "BUILD.json").write_text(json.dumps(info, indent=2) + "\n")
    print(f"wrote {out} ({info['total_bytes'] / 1e9:.3f} GB) in {info['build_seconds']} s", flush=True)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, help="the pipeline directory to write (must not exist unless --force)"
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument(
        "--device", default="cpu", help="where the weights are drawn: cpu, cuda or cuda:N (default: cpu)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fixtures-out", type=Path, help="fixtures.json and refs/ (default: OUT/fixtures)")
    parser.add_argument("--force", action="store_true", help="replace an existing OUT (and --fixtures-out)")
    parser.add_argument(
        "--dry-run", action="store_true", help="build on the meta device, print sizes, write nothing"
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        dry_run(PRESETS[args.preset])
        return 0
    if args.out is None:
        parser.error("--out is required (or --dry-run)")
    if not (args.device == "cpu" or args.device == "cuda" or args.device.startswith("cuda:")):
        parser.error(f"--device {args.device}: expected cpu, cuda or cuda:N")
    if args.device != "cpu" and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: no CUDA device here")
    try:
        build(args.out, args.preset, args.device, args.seed, args.fixtures_out, args.force)
    except FileExistsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
