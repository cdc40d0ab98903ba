import torch

from ditq.demo.text_encoder import DemoTextEncoder
from ditq.demo.words import VOCABULARY, tokenize_words


def test_tokenize_resolves_plurals_and_punctuation():
    assert tokenize_words("Two red Circles, and a grey STAR.") == [
        "two",
        "red",
        "circle",
        "and",
        "a",
        "gray",
        "star",
    ]


def test_layout_marks_reference_slots_and_padding():
    encoder = DemoTextEncoder(hidden_size=32, num_layers=1, num_heads=2, max_text_tokens=8)
    inputs = encoder.build_inputs(["a red circle", "put the objects from pictures 1 and 2 together"], [4, 4])
    ids = encoder.word_to_id
    row = inputs.input_ids[0].tolist()
    # <bos> <picture1> <image>x4 <picture2> <image>x4 then 8 text positions
    assert (
        row[:11]
        == [ids["<bos>"], ids["<picture1>"]]
        + [ids["<image>"]] * 4
        + [ids["<picture2>"]]
        + [ids["<image>"]] * 4
    )
    assert inputs.image_mask[0].sum() == 8
    assert inputs.attention_mask[0].tolist() == [True] * 14 + [False] * 5
    assert inputs.attention_mask[1].all()  # 9 words truncated to 8: nothing padded
    assert row[11:14] == [ids["a"], ids["red"], ids["circle"]]


def test_unknown_words_map_to_unk_and_forward_shape():
    encoder = DemoTextEncoder(hidden_size=32, num_layers=1, num_heads=2, max_text_tokens=6)
    inputs = encoder.build_inputs(["a magenta hexagon"], [])
    assert inputs.input_ids[0, 2].item() == VOCABULARY.index("<unk>")
    out = encoder(inputs.input_ids, inputs.attention_mask)
    assert out.shape == (1, 7, 32) and torch.isfinite(out).all()
