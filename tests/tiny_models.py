"""The tests' one builder of tiny models: real diffusers transformers, VAEs and pipelines at tiny configs, seeded,
and saved as diffusers model directories. The tiny Qwen-Image-2.1 pipeline is the demo's own
(``ditq.demo.build_tiny_pipeline``); ``save_tiny_pipeline`` and ``tiny_adapter`` are how tests get it.

Every builder is seeded and returns the real diffusers class at a tiny
config: 2 attention heads of 16 channels (inner width 32), so every block
Linear is a multiple of 16 wide -- except Wan's feed-forward, whose width 40
is deliberately not (the shape guard must keep it in source precision).

``make_model_dir`` writes the layout of a hub snapshot: ``model_index.json``
naming the transformer as ``["diffusers", ClassName]``, ``transformer/``
with ``config.json`` and one safetensors file (or two shards and an index),
a ``scheduler/`` folder (a component that is never quantized), and on
request a tiny transformers ``text_encoder/`` (T5, or CLIP).
``example_inputs`` gives seeded forward inputs for each class.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    FluxTransformer2DModel,
    QwenImage21Transformer2DModel,
    QwenImageTransformer2DModel,
    SD3Transformer2DModel,
    WanTransformer3DModel,
)
from safetensors.torch import save_file

from ditq.demo import build_tiny_pipeline
from ditq.runtime.adapter import PipelineAdapter

__all__ = [
    "LLMC_DATA",
    "LLMC_SCHEMES",
    "MIXED_FLUX_LAYERS",
    "TEXT_ENCODERS",
    "TINY_CONFIGS",
    "TINY_TRANSFORMERS",
    "build_tiny",
    "build_tiny_clip_text_encoder",
    "build_tiny_text_encoder",
    "example_inputs",
    "llmc_pipeline_dir",
    "make_flux_pipeline_dir",
    "make_model_dir",
    "plan_file",
    "save_sharded",
    "save_tiny_pipeline",
    "tiny_adapter",
    "tiny_qwen_vae",
    "tiny_vae",
    "to_variant_only",
    "write_model_dir",
]

# llm-compressor's model_free_ptq checkpoints of the tiny demo transformer (tests/data/llmc/make_fixtures.py):
# fixture folder -> the ditq scheme it holds
LLMC_DATA = Path(__file__).parent / "data" / "llmc"
LLMC_SCHEMES = {"w8a8": "w8a8", "fp8_dynamic": "fp8", "w8a16": "w8a16"}

HEADS = 2
HEAD_DIM = 16
INNER = HEADS * HEAD_DIM  # 32

# name -> (class, init kwargs). Listed once; tests parametrize over the keys.
TINY_CONFIGS: dict[str, tuple[type[torch.nn.Module], dict[str, Any]]] = {
    "qwenimage": (
        QwenImageTransformer2DModel,
        dict(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=2,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=HEADS,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        ),
    ),
    "qwenimage21": (
        QwenImage21Transformer2DModel,
        dict(
            patch_size=1,
            in_channels=16,
            out_channels=16,
            num_layers=2,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=HEADS,
            context_in_dim=32,
            mlp_ratio=3,
            axes_dims_rope=(4, 6, 6),
        ),
    ),
    "flux": (
        FluxTransformer2DModel,
        dict(
            patch_size=1,
            in_channels=16,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=HEADS,
            joint_attention_dim=32,
            pooled_projection_dim=24,
            guidance_embeds=False,
            axes_dims_rope=(4, 6, 6),
        ),
    ),
    "sd3": (
        SD3Transformer2DModel,
        dict(
            sample_size=8,
            patch_size=2,
            in_channels=4,
            num_layers=2,
            attention_head_dim=HEAD_DIM,
            num_attention_heads=HEADS,
            joint_attention_dim=32,
            caption_projection_dim=INNER,
            pooled_projection_dim=24,
            out_channels=4,
            pos_embed_max_size=16,
        ),
    ),
    "wan": (
        WanTransformer3DModel,
        dict(
            patch_size=(1, 2, 2),
            num_attention_heads=HEADS,
            attention_head_dim=HEAD_DIM,
            in_channels=4,
            out_channels=4,
            text_dim=32,
            freq_dim=32,
            ffn_dim=40,  # deliberately not a multiple of 16: the shape guard must skip these Linears
            num_layers=2,
            rope_max_seq_len=32,
        ),
    ),
}


def build_tiny(name: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A seeded random instance of the named tiny transformer, in eval mode.

    Weights are drawn with a larger spread than the default init so that a
    quantized forward pass differs measurably from the BF16 one.
    """
    cls, kwargs = TINY_CONFIGS[name]
    torch.manual_seed(seed)
    model = cls(**kwargs)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.ndim >= 2:
                fan_in = param[0].numel()
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
    return model.to(dtype).eval()


TINY_TRANSFORMERS: dict[str, Callable[..., torch.nn.Module]] = {
    name: (lambda seed=0, dtype=torch.float32, _n=name: build_tiny(_n, seed, dtype)) for name in TINY_CONFIGS
}


def build_tiny_text_encoder(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny transformers T5 encoder (2 blocks, d_model 32, d_ff 64)."""
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    config = T5Config(
        vocab_size=64,
        d_model=32,
        d_kv=16,
        d_ff=64,
        num_layers=2,
        num_heads=2,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
    )
    return T5EncoderModel(config).to(dtype).eval()


def build_tiny_clip_text_encoder(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """A tiny transformers CLIP text encoder (2 layers, hidden 32, intermediate 64)."""
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(seed)
    config = CLIPTextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        projection_dim=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return CLIPTextModel(config).to(dtype).eval()


TEXT_ENCODERS: dict[str, Callable[..., torch.nn.Module]] = {
    "t5": build_tiny_text_encoder,
    "clip": build_tiny_clip_text_encoder,
}


def save_sharded(state: dict[str, torch.Tensor], folder: Path, stem: str, shards: int) -> None:
    """Write ``state`` as ``{stem}.safetensors`` or as ``shards`` files plus ``{stem}.safetensors.index.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    tensors = {n: state[n].detach().contiguous().clone() for n in names}
    if shards == 1:
        save_file(tensors, str(folder / f"{stem}.safetensors"), metadata={"format": "pt"})
        return
    per_shard = -(-len(names) // shards)
    weight_map: dict[str, str] = {}
    total = 0
    for index in range(shards):
        chunk = names[index * per_shard : (index + 1) * per_shard]
        file_name = f"{stem}-{index + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in chunk}, str(folder / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(chunk, file_name))
        total += sum(tensors[n].numel() * tensors[n].element_size() for n in chunk)
    index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index_doc, indent=2) + "\n")


def to_variant_only(model_dir: Path, variant: str) -> list[str]:
    """Rename every component's ``*.safetensors`` to ``*.{variant}.safetensors`` (a hub snapshot that ships only
    a variant); returns the components renamed."""
    renamed = []
    for path in sorted(Path(model_dir).glob("*/*.safetensors")):
        path.rename(path.with_name(f"{path.name.removesuffix('.safetensors')}.{variant}.safetensors"))
        renamed.append(path.parent.name)
    return renamed


def write_model_dir(
    model_dir: Path,
    model: torch.nn.Module,
    shards: int = 1,
    text_encoder: torch.nn.Module | None = None,
    state: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save any diffusers ``model`` as the transformer of a diffusers model directory at ``model_dir``.

    ``state`` replaces the model's own weights (e.g. for a model built on the meta device).
    """
    transformer_dir = Path(model_dir) / "transformer"
    transformer_dir.mkdir(parents=True)
    model.save_config(str(transformer_dir))  # config.json with _class_name
    save_sharded(
        model.state_dict() if state is None else state, transformer_dir, "diffusion_pytorch_model", shards
    )
    FlowMatchEulerDiscreteScheduler(shift=3.0).save_config(str(Path(model_dir) / "scheduler"))
    index: dict[str, Any] = {
        "_class_name": "DiffusionPipeline",
        "_diffusers_version": "0.42.1",
        "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"],
        "transformer": ["diffusers", type(model).__name__],
    }
    if text_encoder is not None:
        encoder_dir = Path(model_dir) / "text_encoder"
        text_encoder.config.save_pretrained(str(encoder_dir))
        save_sharded(text_encoder.state_dict(), encoder_dir, "model", 1)
        index["text_encoder"] = ["transformers", type(text_encoder).__name__]
    (Path(model_dir) / "model_index.json").write_text(json.dumps(index, indent=2) + "\n")
    return Path(model_dir)


def make_model_dir(
    tmp_path: Path,
    name: str,
    dtype: torch.dtype = torch.bfloat16,
    shards: int = 1,
    seed: int = 0,
    text_encoder: bool | str = False,
) -> Path:
    """Save the named tiny transformer as a diffusers model directory under ``tmp_path``; return its path.

    ``text_encoder``: True or "t5" for a T5 encoder, "clip" for a CLIP text encoder.
    """
    encoder = None
    if text_encoder:
        kind = "t5" if text_encoder is True else str(text_encoder)
        encoder = TEXT_ENCODERS[kind](seed=seed, dtype=dtype)
    return write_model_dir(
        Path(tmp_path) / f"{name}-model",
        build_tiny(name, seed=seed, dtype=dtype),
        shards=shards,
        text_encoder=encoder,
    )


# A hand-written mixed-precision plan for the tiny Flux transformer: every scheme and keep, some layers unnamed
# (kept too). Listed once; the quantizer, verify, loader and doctor tests read it.
MIXED_FLUX_LAYERS: dict[str, str] = {
    "transformer_blocks.0.attn.to_q": "fp8",
    "transformer_blocks.0.attn.to_k": "fp8",
    "transformer_blocks.0.attn.to_v": "fp8",
    "transformer_blocks.0.attn.to_out.0": "fp8",
    "transformer_blocks.0.ff.net.0.proj": "w8a8",
    "transformer_blocks.0.ff.net.2": "w8a8",
    "single_transformer_blocks.0.proj_mlp": "w8a8",
    "single_transformer_blocks.0.attn.to_q": "w8a16",
    "single_transformer_blocks.1.proj_out": "w8a16",
    "single_transformer_blocks.0.proj_out": "keep",
    "transformer_blocks.0.attn.add_q_proj": "keep",
}


def plan_file(source: Path, layers: dict[str, str] | None = None, **fields: Any) -> Any:
    """A ``PlanFile`` measured on ``source`` giving ``layers`` (default: ``MIXED_FLUX_LAYERS``, the tiny Flux
    model's) their schemes; every scheme is a candidate."""
    from ditq.plan import PlanFile, PlanTarget

    return PlanFile(
        source=str(source),
        schemes=["fp8", "w8a8", "w8a16"],
        target=PlanTarget(kind="db", db=40.0),
        layers=MIXED_FLUX_LAYERS if layers is None else layers,
        quantized_fraction=0.5,
        **fields,
    )


def example_inputs(name: str, model: torch.nn.Module, batch: int = 1, seed: int = 0) -> dict[str, Any]:
    """Seeded keyword arguments for one forward pass of the named tiny transformer (in the model's dtype)."""
    _, kwargs = TINY_CONFIGS[name]
    dtype = next(model.parameters()).dtype
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(dtype)

    text_len = 6
    if name == "qwenimage":
        h = w = 4  # latent tokens after patching
        return dict(
            hidden_states=randn(batch, h * w, kwargs["in_channels"]),
            encoder_hidden_states=randn(batch, text_len, kwargs["joint_attention_dim"]),
            encoder_hidden_states_mask=torch.ones(batch, text_len, dtype=torch.long),
            timestep=torch.full((batch,), 0.5, dtype=dtype),
            img_shapes=[(1, h, w)] * batch,
            return_dict=False,
        )
    if name == "qwenimage21":
        h = w = 4  # 16 target tokens = 4 vision-language slots of 2x2
        img_mask = torch.tensor([[False] * text_len + [True] * (h * w // 4)] * batch)
        return dict(
            hidden_states=randn(batch, h * w, kwargs["in_channels"]),
            encoder_hidden_states=randn(batch, text_len, kwargs["context_in_dim"]),
            timestep=torch.full((batch,), 0.5, dtype=dtype),
            img_shapes=[[(1, h, w)]] * batch,
            img_mask=img_mask,
            return_dict=False,
        )
    if name == "flux":
        h = w = 4
        img_ids = torch.stack(
            torch.meshgrid(torch.zeros(1), torch.arange(h * 1.0), torch.arange(w * 1.0), indexing="ij"), -1
        ).reshape(-1, 3)
        return dict(
            hidden_states=randn(batch, h * w, kwargs["in_channels"]),
            encoder_hidden_states=randn(batch, text_len, kwargs["joint_attention_dim"]),
            pooled_projections=randn(batch, kwargs["pooled_projection_dim"]),
            timestep=torch.full((batch,), 0.5, dtype=dtype),
            img_ids=img_ids.to(dtype),
            txt_ids=torch.zeros(text_len, 3, dtype=dtype),
            return_dict=False,
        )
    if name == "sd3":
        return dict(
            hidden_states=randn(batch, kwargs["in_channels"], 8, 8),
            encoder_hidden_states=randn(batch, text_len, kwargs["joint_attention_dim"]),
            pooled_projections=randn(batch, kwargs["pooled_projection_dim"]),
            timestep=torch.full((batch,), 500.0, dtype=dtype),
            return_dict=False,
        )
    if name == "wan":
        return dict(
            hidden_states=randn(batch, kwargs["in_channels"], 2, 8, 8),
            timestep=torch.full((batch,), 500.0, dtype=dtype),
            encoder_hidden_states=randn(batch, text_len, kwargs["text_dim"]),
            return_dict=False,
        )
    raise KeyError(f"no example inputs for {name!r} (known: {', '.join(TINY_CONFIGS)})")


def _clip_tokenizer(folder: Path) -> Any:
    """A CLIP BPE tokenizer over single letters (no merges), built here: nothing is downloaded."""
    from transformers import CLIPTokenizer

    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["<|startoftext|>", "<|endoftext|>", *(c + "</w>" for c in letters), *letters]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps({w: i for i, w in enumerate(words)}))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(
        vocab_file=str(folder / "vocab.json"), merges_file=str(folder / "merges.txt"), model_max_length=16
    )


def _t5_tokenizer() -> Any:
    """A T5 unigram tokenizer over single letters, built here with ``tokenizers``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    unigram = Tokenizer(
        models.Unigram([*pieces, *((c, -3.0) for c in "abcdefghijklmnopqrstuvwxyz")], unk_id=2)
    )
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    return T5TokenizerFast(
        tokenizer_object=unigram, pad_token="<pad>", eos_token="</s>", unk_token="<unk>", extra_ids=0
    )


# diffusers' AutoencoderKL at two 16-channel blocks: the tiny Flux pipeline's VAE and ``tiny_vae``
TINY_VAE_CONFIG: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 2,
    "up_block_types": ["UpDecoderBlock2D"] * 2,
    "block_out_channels": [16, 16],
    "layers_per_block": 1,
    "latent_channels": 4,
    "norm_num_groups": 8,
}


def make_flux_pipeline_dir(model_dir: Path, seed: int = 0) -> Path:
    """A tiny FluxPipeline saved at ``model_dir``: CLIP ``text_encoder`` + T5 ``text_encoder_2`` (their
    tokenizers built here), the tiny Flux transformer (pooled width 32 to match CLIP) and a tiny VAE.
    Prompts up to 16 tokens (``max_sequence_length=16``); sizes multiples of 4."""
    from diffusers import AutoencoderKL, FluxPipeline

    torch.manual_seed(seed)
    flux_config = {**TINY_CONFIGS["flux"][1], "num_single_layers": 1, "pooled_projection_dim": 32}
    vae = AutoencoderKL(
        **TINY_VAE_CONFIG,  # its 4 latent channels packed 2x2 into the transformer's 16 input channels
        use_quant_conv=False,
        use_post_quant_conv=False,
        shift_factor=0.0609,  # Flux's VAE constants; the pipeline reads both
        scaling_factor=1.5035,
    )
    pipeline = FluxPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=build_tiny_clip_text_encoder(seed),
        tokenizer=_clip_tokenizer(Path(model_dir) / "tokenizer"),
        text_encoder_2=build_tiny_text_encoder(seed),
        tokenizer_2=_t5_tokenizer(),
        transformer=FluxTransformer2DModel(**flux_config).eval(),
    )
    pipeline.save_pretrained(str(model_dir))
    return Path(model_dir)


def llmc_pipeline_dir(model_dir: Path, fixture: str) -> Path:
    """The tiny demo pipeline (seed 0, bfloat16) at ``model_dir`` with its transformer replaced by the committed
    ``tests/data/llmc/<fixture>/transformer`` ("source" for the BF16 transformer they were made from)."""
    import shutil
    import warnings

    from ditq.demo import build_tiny_pipeline

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build_tiny_pipeline(seed=0).to(torch.bfloat16).save_pretrained(str(model_dir))
    shutil.rmtree(Path(model_dir) / "transformer")
    shutil.copytree(LLMC_DATA / fixture / "transformer", Path(model_dir) / "transformer")
    return Path(model_dir)


def save_tiny_pipeline(folder: Path, seed: int = 0, dtype: torch.dtype | None = None) -> Path:
    """The tiny demo pipeline, seeded, saved as a diffusers folder at ``folder`` (in ``dtype`` when given): the
    source most tests quantize, load or serve. diffusers' FutureWarnings on saving are not the test's."""
    pipeline = build_tiny_pipeline(seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        (pipeline if dtype is None else pipeline.to(dtype)).save_pretrained(str(folder))
    return folder


def tiny_adapter(seed: int = 0) -> PipelineAdapter:
    """The tiny demo pipeline, seeded, behind the adapter that serve and generate run (a fresh one each call)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return PipelineAdapter(build_tiny_pipeline(seed=seed))


def tiny_vae() -> torch.nn.Module:
    """diffusers' ``AutoencoderKL`` at two 16-channel blocks, seeded, in eval mode."""
    from diffusers import AutoencoderKL

    torch.manual_seed(0)
    return AutoencoderKL(**TINY_VAE_CONFIG, sample_size=32).eval()


def tiny_qwen_vae() -> torch.nn.Module:
    """Qwen-Image-2.1's VAE at the tiny preset's size (``tools/full_size_pipeline.py``), seeded."""
    from diffusers import AutoencoderKLQwenImage21

    torch.manual_seed(0)
    z_dim = 16
    vae = AutoencoderKLQwenImage21(
        base_dim=16, decoder_base_dim=16, z_dim=z_dim, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
        latents_mean=[0.0] * z_dim, latents_std=[1.0] * z_dim,
    )  # fmt: skip
    for parameter in vae.parameters():  # diffusers' init leaves some at zero or one: every weight drawn
        parameter.data.normal_(0.0, 0.2)
    return vae.eval()
