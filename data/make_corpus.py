"""Write data/corpus.txt, the small training text this project ships.

A character-level GPT with a few hundred thousand parameters only shows a falling loss
within a few hundred steps if the text is full of repeated structure, so the corpus is
generated rather than collected: short stories from a tiny grammar about a fixed cast,
fixed facts about that cast, dialogues, arithmetic and counting drills. A fixed seed and
the standard library alone make the output byte-identical on every machine, which lets
`--check` tell whether the shipped file is the one this script writes.

    python data/make_corpus.py           # (re)write data/corpus.txt
    python data/make_corpus.py --check   # exit 1 if data/corpus.txt differs
"""
import argparse
import random
import sys
from pathlib import Path

SEED = 1234
TARGET_CHARS = 550_000
OUT = Path(__file__).resolve().parent / "corpus.txt"

# The cast and the world. Each name always lives in the same place and likes the same
# thing, so the model can memorise these facts as well as learn the grammar.
HOMES = {
    "Ada": "the harbor",
    "Boris": "the old mill",
    "Clara": "the library",
    "Dmitri": "the station",
    "Emma": "the bakery",
    "Farid": "the market",
    "Grace": "the garden",
    "Hugo": "the river",
}
LIKES = {
    "Ada": "boats",
    "Boris": "buns",
    "Clara": "books",
    "Dmitri": "trains",
    "Emma": "cakes",
    "Farid": "apples",
    "Grace": "roses",
    "Hugo": "fish",
}
NAMES = list(HOMES)
PLACES = list(HOMES.values())
OBJECTS = ["a red kite", "a small lamp", "an old map", "a wooden box",
           "a green apple", "a brass key", "a letter", "a blue cup"]
VERBS = ["found", "carried", "lost", "painted", "sold", "bought", "hid", "opened"]
TIMES = ["In the morning", "At noon", "In the evening", "Late at night"]
WEATHER = ["sunny", "rainy", "windy", "cold", "warm"]
NUMBER_WORDS = ["zero", "one", "two", "three", "four", "five",
                "six", "seven", "eight", "nine", "ten"]


def story(rng, day):
    """A few sentences about one person, who stays the subject throughout."""
    name, friend = rng.sample(NAMES, 2)
    place, obj = rng.choice(PLACES), rng.choice(OBJECTS)
    lines = [
        f"Day {day}. The weather was {rng.choice(WEATHER)}.",
        f"{rng.choice(TIMES)}, {name} went to {place} and {rng.choice(VERBS)} {obj}.",
        f"At {place}, {name} met {friend}.",
        f"{name} gave {obj} to {friend}, and {friend} said: \"Thank you, {name}.\"",
    ]
    if rng.random() < 0.5:
        lines.append(f"Then {friend} walked home to {HOMES[friend]}.")
    lines.append(f"{name} walked home to {HOMES[name]}.")
    return lines


def facts(rng):
    """Fixed facts about the cast, in a random order and with a little variation."""
    lines = []
    for name in rng.sample(NAMES, rng.randint(3, 5)):
        if rng.random() < 0.5:
            lines.append(f"{name} lives near {HOMES[name]} and likes {LIKES[name]}.")
        else:
            lines.append(f"Q: What does {name} like?")
            lines.append(f"A: {name} likes {LIKES[name]}.")
    return lines


def dialogue(rng):
    """Questions whose answers repeat words from the question."""
    name, other = rng.sample(NAMES, 2)
    place = rng.choice(PLACES)
    n = rng.randint(2, 10)
    return [
        f"{name}: Where are you going?",
        f"{other}: I am going to {place}.",
        f"{name}: How many {LIKES[other]} do you have?",
        f"{other}: I have {NUMBER_WORDS[n]} {LIKES[other]}, that is {n}.",
    ]


def arithmetic(rng):
    """Correct sums, differences and times-table facts."""
    lines = []
    for _ in range(rng.randint(4, 8)):
        kind = rng.choice("+-*")
        if kind == "*":
            a, b = rng.randint(1, 12), rng.randint(1, 12)
            lines.append(f"{a} * {b} = {a * b}.")
        else:
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            if kind == "-":
                a, b = max(a, b), min(a, b)
                lines.append(f"{a} - {b} = {a - b}.")
            else:
                lines.append(f"{a} + {b} = {a + b}.")
    return lines


def counting(rng):
    """Runs of consecutive numbers, forwards or backwards."""
    start, length = rng.randint(0, 90), rng.randint(5, 10)
    numbers = list(range(start, start + length))
    if rng.random() < 0.3:
        return ["Count down: " + ", ".join(map(str, reversed(numbers))) + "."]
    return ["Count: " + ", ".join(map(str, numbers)) + "."]


def generate(seed=SEED, target_chars=TARGET_CHARS):
    """The corpus as one string: paragraphs separated by blank lines."""
    rng = random.Random(seed)
    paragraphs, size, day = [], 0, 0
    while size < target_chars:
        kind = rng.choice(["story", "story", "facts", "dialogue", "arithmetic", "counting"])
        if kind == "story":
            day += 1
            lines = story(rng, day)
        else:
            lines = {"facts": facts, "dialogue": dialogue,
                     "arithmetic": arithmetic, "counting": counting}[kind](rng)
        paragraph = "\n".join(lines) + "\n"
        paragraphs.append(paragraph)
        size += len(paragraph) + 1
    return "\n".join(paragraphs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if data/corpus.txt differs from the generator's output")
    args = parser.parse_args(argv)
    expected = generate().encode("utf-8")
    if args.check:
        if not OUT.is_file() or OUT.read_bytes() != expected:
            print(f"{OUT} is missing or out of date: run `python data/make_corpus.py` to rewrite it",
                  file=sys.stderr)
            return 1
        print(f"{OUT} is up to date ({len(expected):,} bytes)")
        return 0
    OUT.write_bytes(expected)  # bytes, so no platform turns "\n" into "\r\n"
    print(f"wrote {OUT} ({len(expected):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
