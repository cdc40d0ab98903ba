"""The 4-bit schemes store a text encoder's token embedding as int8 rows (``Scheme.embedding``: w8a16's codec, one
scale per row) in its own config group; verify with the source passes, compressed-tensors' own file-level decoder
reads it back as ditq decodes it, the loader builds a QuantizedEmbedding without the BF16 table, in-memory
quantization stores the same bytes, and the 8-bit schemes keep the embedding as it was, as the 4-bit ones keep one
whose weight another module shares."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tiny_models import build_tiny_clip_text_encoder, build_tiny_text_encoder, make_model_dir

import ditq
from ditq.checkpoint.codecs import codec_for
from ditq.checkpoint.layout import weight_files
from ditq.checkpoint.safetensors_io import read_header
from ditq.cli import main
from ditq.quantization.targets import plan_targets
from ditq.runtime.embedding import QuantizedEmbedding
from ditq.runtime.loader import load_component
from ditq.schemes import W8A16

EMBEDDING = "embeddings.token_embedding"  # CLIP's token table (64 x 32 in the tiny model)


@pytest.fixture(scope="module")
def clip_artifact(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(source, artifact): the tiny Flux model with a CLIP text encoder, its text encoder quantized w4a16."""
    root = tmp_path_factory.mktemp("embedding")
    source = make_model_dir(root, "flux", dtype=torch.float32, text_encoder="clip")
    return source, ditq.quantize(source, root / "w4a16", "w4a16", components=["text_encoder"]).path


def _stored(artifact: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(artifact / "text_encoder"):
        tensors |= load_file(str(path))
    return tensors


def _embedding_tensors(artifact: Path) -> dict[str, torch.Tensor]:
    stored = _stored(artifact)
    return {n.removeprefix(f"{EMBEDDING}."): t for n, t in stored.items() if n.startswith(f"{EMBEDDING}.")}


def test_the_embedding_has_its_own_group(clip_artifact: tuple[Path, Path]) -> None:
    _, artifact = clip_artifact
    config = json.loads((artifact / "text_encoder/config.json").read_text())["quantization_config"]
    groups = list(config["config_groups"].values())
    assert groups[0]["targets"] == [EMBEDDING] and "input_activations" not in groups[0]
    assert groups[0]["weights"] == {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "channel",
        "dynamic": False,
    }
    assert EMBEDDING not in config["ignore"] and EMBEDDING not in groups[1]["targets"]
    assert {g["weights"]["num_bits"] for g in groups[1:]} == {4}
    assert "embeddings.position_embedding" in config["ignore"]  # not the token embedding: kept
    manifest = json.loads((artifact / "MANIFEST.json").read_text())
    assert EMBEDDING in manifest["components"]["text_encoder"]["quantized"]
    specs = codec_for(W8A16).specs(
        64, 32
    )  # the bytes counted (benchmarks/four_bit_bytes.py) are the bytes stored
    stored = _embedding_tensors(artifact)
    assert {n: (t.dtype, tuple(t.shape)) for n, t in stored.items()} == specs
    entries = {
        n: e for path in weight_files(artifact / "text_encoder") for n, e in read_header(path).entries.items()
    }
    counted = sum(torch.Size(shape).numel() * dtype.itemsize for dtype, shape in specs.values())
    assert sum(entries[f"{EMBEDDING}.{n}"].end - entries[f"{EMBEDDING}.{n}"].begin for n in specs) == counted


def test_verify_with_source_passes(
    clip_artifact: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    source, artifact = clip_artifact
    assert main(["verify", str(artifact), "--source", str(source)]) == 0
    assert "1 w8a16" in capsys.readouterr().out  # the embedding, decoded by both decoders and bounded


def test_compressed_tensors_reads_it_back(clip_artifact: tuple[Path, Path], tmp_path: Path) -> None:
    from compressed_tensors.entrypoints.convert.convert_checkpoint import convert_checkpoint
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer

    _, artifact = clip_artifact
    dequantizer = CompressedTensorsDequantizer(artifact / "text_encoder", dtype=torch.float32)
    convert_checkpoint(artifact / "text_encoder", tmp_path / "dequantized", dequantizer, device="cpu")
    theirs: dict[str, torch.Tensor] = {}
    for path in sorted((tmp_path / "dequantized").glob("*.safetensors")):
        theirs |= load_file(str(path))
    assert torch.equal(theirs[f"{EMBEDDING}.weight"], codec_for(W8A16).decode(_embedding_tensors(artifact)))


def test_loader_and_in_memory_hold_the_same_rows(clip_artifact: tuple[Path, Path]) -> None:
    _, artifact = clip_artifact
    model = load_component(artifact, "text_encoder", device="cpu", dtype=torch.float32)
    table = model.get_submodule(EMBEDDING)
    assert isinstance(table, QuantizedEmbedding) and table.dtype == torch.float32
    assert not [n for n, p in model.named_parameters() if n.startswith(EMBEDDING)]  # no floating table at all
    decoded = codec_for(W8A16).decode(_embedding_tensors(artifact))
    ids = torch.tensor([[0, 5, 63, 5, 1]])
    assert torch.equal(table(ids), decoded[ids])
    assert model(ids).last_hidden_state.isfinite().all()
    in_memory = build_tiny_clip_text_encoder(seed=0, dtype=torch.float32)  # the source's text encoder, seeded
    ditq.quantize_(in_memory, "w4a16")
    held = in_memory.get_submodule(EMBEDDING)
    assert isinstance(held, QuantizedEmbedding)
    for name, tensor in _embedding_tensors(artifact).items():
        assert torch.equal(held.stored_tensors()[name], tensor), name


def test_eight_bit_schemes_keep_the_embedding(tmp_path: Path) -> None:
    source = make_model_dir(tmp_path, "flux", dtype=torch.float32, text_encoder="clip")
    result = ditq.quantize(source, tmp_path / "fp8", "fp8", components=["text_encoder"])
    ignored = result.manifest["components"]["text_encoder"]["ignored"]
    assert ignored[EMBEDDING] == "not a Linear: Embedding stays in source precision"
    assert torch.equal(
        _stored(result.path)[f"{EMBEDDING}.weight"],
        load_file(str(weight_files(source / "text_encoder")[0]))[f"{EMBEDDING}.weight"],
    )


def test_the_embedding_alone_loads(tmp_path: Path) -> None:
    source = make_model_dir(tmp_path, "flux", dtype=torch.float32, text_encoder="clip")
    out = ditq.quantize(
        source, tmp_path / "only", "w4a16", components=["text_encoder"], targets=["token_embedding"]
    )
    config = json.loads((out.path / "text_encoder/config.json").read_text())["quantization_config"]
    assert [g["targets"] for g in config["config_groups"].values()] == [[EMBEDDING]]  # by name: not "Linear"
    model = load_component(out.path, "text_encoder", device="cpu", dtype=torch.float32)
    assert isinstance(model.get_submodule(EMBEDDING), QuantizedEmbedding)
    in_memory = build_tiny_clip_text_encoder(seed=0, dtype=torch.float32)  # the same alone target, in memory
    ditq.quantize_(in_memory, "w4a16", targets=["token_embedding"])
    assert [n for n, m in in_memory.named_modules() if isinstance(m, QuantizedEmbedding)] == [EMBEDDING]


def test_shared_and_tied_embeddings_stay() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    cases = [
        (LlamaForCausalLM(config), "model.embed_tokens", "shared: its weight is also lm_head's"),  # tied
        (build_tiny_text_encoder(), "shared", "shared: its weight is also encoder.embed_tokens's"),  # T5
    ]
    for model, prefix, reason in cases:
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        plan = plan_targets(model, "text_encoder", shapes, embeddings=True)
        assert plan.ignored[prefix] == reason and not plan.embeddings
