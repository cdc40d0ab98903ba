"""The demo world's words: colors, backgrounds, shapes and counts, as data.

Everything the scene generator draws, the prompts say and the scorer checks is named here once.
"""

from __future__ import annotations

__all__ = [
    "ALIASES",
    "BACKGROUND_COLORS",
    "COUNT_WORDS",
    "OBJECT_COLORS",
    "PICTURE_TOKENS",
    "SHAPES",
    "SPECIAL_TOKENS",
    "VOCABULARY",
    "tokenize_words",
]

# Object colors (sRGB, 0..255). Hues far apart so that a nearest-color rule separates them.
OBJECT_COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "orange": (245, 140, 20),
    "yellow": (240, 220, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "purple": (150, 60, 200),
}
# Background colors: none of them close to an object color.
BACKGROUND_COLORS: dict[str, tuple[int, int, int]] = {
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "gray": (128, 128, 128),
    "beige": (225, 205, 165),
}
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star")
COUNT_WORDS: dict[int, str] = {1: "a", 2: "two", 3: "three", 4: "four"}

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<unk>", "<bos>", "<image>")
# One marker token before each reference image's slots, like "Picture 1:" in the full model's template.
PICTURE_TOKENS: tuple[str, ...] = ("<picture1>", "<picture2>", "<picture3>", "<picture4>")
_PLAIN_WORDS: tuple[str, ...] = (
    "a an one two three four 1 2 3 4 and on with in of to from the it its",
    "background picture pictures object objects put together change color make keep same shape",
    "place scene into them all both",
)
VOCABULARY: tuple[str, ...] = (
    *SPECIAL_TOKENS,
    *PICTURE_TOKENS,
    *OBJECT_COLORS,
    *BACKGROUND_COLORS,
    *SHAPES,
    *(word for line in _PLAIN_WORDS for word in line.split()),
)
# Spelling variants read as the canonical word (plurals carry no extra meaning: the count word does).
ALIASES: dict[str, str] = {
    **{f"{shape}s": shape for shape in SHAPES},
    "grey": "gray",
    "colour": "color",
    "colors": "color",
    "colours": "color",
    "violet": "purple",
}


def tokenize_words(text: str) -> list[str]:
    """Lower-case words and digits of `text`, aliases resolved; punctuation dropped."""
    words: list[str] = []
    current = []
    for char in text.lower() + " ":
        if char.isalnum():
            current.append(char)
        elif current:
            word = "".join(current)
            words.append(ALIASES.get(word, word))
            current = []
    return words
