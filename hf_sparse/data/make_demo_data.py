"""Regenerates ``demo_sentiment.csv``, the small labelled data set ``hf-sparse demo`` fine-tunes on.

Short product and film reviews built from templates: the label follows the sentiment word, flipped by a
negation, so a model has to read word order to reach high accuracy. Deterministic (seeded); written by us,
no third-party text.
"""

import csv
import random
from pathlib import Path

POSITIVE = [
    "great",
    "wonderful",
    "excellent",
    "delightful",
    "superb",
    "charming",
    "brilliant",
    "lovely",
    "moving",
    "clever",
    "gripping",
    "fantastic",
    "solid",
    "pleasant",
    "memorable",
]
NEGATIVE = [
    "awful",
    "terrible",
    "boring",
    "dull",
    "clumsy",
    "tedious",
    "bland",
    "disappointing",
    "weak",
    "messy",
    "forgettable",
    "painful",
    "poor",
    "annoying",
    "flat",
]
SUBJECTS = [
    "the film",
    "this movie",
    "the plot",
    "the acting",
    "the soundtrack",
    "the ending",
    "the camera",
    "the story",
    "the phone",
    "this laptop",
    "the battery",
    "the screen",
    "the service",
    "the meal",
    "the book",
    "the sequel",
    "the dialogue",
    "the cast",
    "the design",
    "the hotel",
]
TEMPLATES = [
    "{s} was {n}{a}",
    "{s} is {n}{a}",
    "honestly {s} felt {n}{a}",
    "i thought {s} was {n}{a}",
    "{s} turned out {n}{a}",
    "overall {s} seemed {n}{a} to me",
    "{s} was {n}{a} and i said so",
]


DEFAULT_PATH = Path(__file__).with_name("demo_sentiment.csv")


def main(path: Path = DEFAULT_PATH, rows: int = 1200, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["sentence", "label"])
        for _ in range(rows):
            positive = rng.random() < 0.5
            negated = rng.random() < 0.3
            adjective = rng.choice(POSITIVE if positive else NEGATIVE)
            text = rng.choice(TEMPLATES).format(s=rng.choice(SUBJECTS), n="not " if negated else "", a=adjective)
            writer.writerow([text, int(positive != negated)])


if __name__ == "__main__":
    main()
