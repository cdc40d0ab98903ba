"""The demo's text encoder: a word-level transformer whose vocabulary lives in its own config.

It reads one joint sequence per prompt, laid out like the full model's vision-language template:
    <bos> [<pictureI> <image> x slots_I] for each reference I, then the prompt's words (padded to a fixed length)
`<image>` positions are placeholders: the DiT drops each reference's latent tokens into them (one slot per 2x2
latent tokens), so what the encoder writes there is never read.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ditq.demo.words import PICTURE_TOKENS, VOCABULARY, tokenize_words

__all__ = ["DemoTextEncoder", "TextInputs", "build_text_inputs"]

logger = logging.getLogger(__name__)


@dataclass
class TextInputs:
    input_ids: torch.Tensor  # (B, L) int64
    attention_mask: torch.Tensor  # (B, L) bool, False at padding
    image_mask: torch.Tensor  # (B, L) bool, True at reference-image slots


def build_text_inputs(
    word_to_id: dict[str, int], max_text_tokens: int, prompts: list[str], reference_slots: list[int]
) -> TextInputs:
    """The joint sequences (module docstring) for `prompts`; words past `max_text_tokens` are dropped (logged)."""
    if len(reference_slots) > len(PICTURE_TOKENS):
        raise ValueError(f"at most {len(PICTURE_TOKENS)} reference images, got {len(reference_slots)}")
    unknown, pad, image = word_to_id["<unk>"], word_to_id["<pad>"], word_to_id["<image>"]
    prefix = [word_to_id["<bos>"]]
    for index, slots in enumerate(reference_slots):
        prefix += [word_to_id[PICTURE_TOKENS[index]]] + [image] * slots
    rows, valid = [], []
    for prompt in prompts:
        words = tokenize_words(prompt)
        if len(words) > max_text_tokens:
            logger.warning(
                "prompt has %d words; the demo text encoder reads the first %d", len(words), max_text_tokens
            )
            words = words[:max_text_tokens]
        ids = [word_to_id.get(word, unknown) for word in words]
        padding = max_text_tokens - len(ids)
        rows.append(prefix + ids + [pad] * padding)
        valid.append([True] * (len(prefix) + len(ids)) + [False] * padding)
    image_row = [token == image for token in rows[0]]
    return TextInputs(
        input_ids=torch.tensor(rows, dtype=torch.long),
        attention_mask=torch.tensor(valid, dtype=torch.bool),
        image_mask=torch.tensor([image_row] * len(prompts), dtype=torch.bool),
    )


class DemoTextEncoder(ModelMixin, ConfigMixin):  # type: ignore[misc]
    """Token embedding + learned positions + a few pre-norm transformer layers -> (B, L, hidden_size)."""

    @register_to_config
    def __init__(
        self,
        vocabulary: list[str] | tuple[str, ...] = VOCABULARY,
        hidden_size: int = 128,
        num_layers: int = 2,
        num_heads: int = 4,
        max_positions: int = 128,
        max_text_tokens: int = 24,
    ):
        super().__init__()
        self.word_to_id = {word: index for index, word in enumerate(vocabulary)}
        self.token_embedding = nn.Embedding(len(vocabulary), hidden_size)
        self.position_embedding = nn.Embedding(max_positions, hidden_size)
        layer = nn.TransformerEncoderLayer(
            hidden_size, num_heads, 2 * hidden_size, dropout=0.0, batch_first=True, norm_first=True
        )
        self.layers = nn.TransformerEncoder(layer, num_layers, enable_nested_tensor=False)
        self.final_norm = nn.LayerNorm(hidden_size)

    def build_inputs(self, prompts: list[str], reference_slots: list[int]) -> TextInputs:
        """Token ids and masks for `prompts`, each preceded by the same reference layout (`slots` per image)."""
        return build_text_inputs(self.word_to_id, self.config["max_text_tokens"], prompts, reference_slots)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B, L) ids, (B, L) bool valid -> (B, L, hidden_size) embeddings (padding rows are finite, unused)."""
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.token_embedding(input_ids) + self.position_embedding(positions)[None]
        hidden = self.layers(hidden, src_key_padding_mask=~attention_mask)
        return self.final_norm(hidden)
