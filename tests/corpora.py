"""Generated text corpora for the tests (no downloads): short reviews whose sentiment is
carried by one to three cue words among filler, so a text model can learn it in seconds."""

from __future__ import annotations

import random

POSITIVE = ["good", "great", "fine", "lovely", "superb", "excellent", "happy", "bright"]
NEGATIVE = ["bad", "awful", "poor", "dismal", "terrible", "sad", "gloomy", "broken"]
FILLER = [
    "the",
    "a",
    "movie",
    "plot",
    "actor",
    "scene",
    "it",
    "was",
    "and",
    "very",
    "quite",
    "film",
    "story",
    "ending",
]


def reviews(n: int = 400, seed: int = 0) -> list[tuple[str, str]]:
    """``n`` ``(text, label)`` pairs, labels alternating ``"neg"``, ``"pos"``."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        label = "pos" if i % 2 else "neg"
        words = rng.choices(FILLER, k=rng.randint(2, 30))
        cue = POSITIVE if label == "pos" else NEGATIVE
        for _ in range(rng.randint(1, 3)):
            words.insert(rng.randrange(len(words) + 1), rng.choice(cue))
        rows.append((" ".join(words), label))
    return rows
