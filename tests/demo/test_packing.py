import torch

from ditq.demo.packing import pil_to_pixels, pixels_to_pil, pixels_to_tokens, tokens_to_pixels


def test_packing_round_trip_is_exact():
    generator = torch.Generator().manual_seed(0)
    pixels = torch.rand(2, 4, 64, 48, generator=generator) * 2 - 1
    tokens = pixels_to_tokens(pixels)
    assert tokens.shape == (2, 16 * 12, 64)
    assert torch.equal(tokens_to_pixels(tokens, 64, 48), pixels)


def test_token_holds_one_4x4_tile_row_major():
    pixels = torch.zeros(1, 4, 8, 8)
    pixels[0, :, 4:8, 0:4] = 1.0  # bottom-left tile -> token (row 1, col 0) = index 2
    tokens = pixels_to_tokens(pixels)
    assert tokens[0, 2].eq(1.0).all() and tokens[0, [0, 1, 3]].eq(0.0).all()


def test_pil_conversion_keeps_alpha():
    pixels = torch.full((4, 8, 8), -1.0)
    pixels[3, :4] = 1.0  # top half opaque
    image = pixels_to_pil(pixels)
    assert image.mode == "RGBA"
    back = pil_to_pixels(image)
    assert torch.equal(back, pixels)
