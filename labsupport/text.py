"""The training text before it becomes tensors: reading it, and its vocabulary of characters.

No torch here, so that `estimate/` can size the CPU presets' embedding (their vocabulary is the
corpus's) without importing it; `data.py` turns the text into token ids and batches.
"""
from __future__ import annotations

from pathlib import Path

DEFAULT_CORPUS = Path(__file__).resolve().parent.parent / "data" / "corpus.txt"


class DataError(ValueError):
    """A user-fixable problem with the data or the batch shape; the message is one line."""


def load_text(path=None) -> str:
    """Read a UTF-8 text file (default: the shipped corpus), failing with a message a user can act on."""
    path = Path(path) if path is not None else DEFAULT_CORPUS
    if path.is_dir():
        raise DataError(f"{path} is a directory; pass the path of a UTF-8 text file")
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"corpus file {path} does not exist; check the path "
                        f"(the shipped corpus is {DEFAULT_CORPUS})") from None
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror}; check the file's permissions") from None
    if not raw:
        raise DataError(f"corpus file {path} is empty; pass a file that contains text")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"corpus file {path} is not valid UTF-8 (bad byte at offset {e.start}); "
                        "convert it to UTF-8 or pass another file") from None


def vocabulary(text: str) -> list[str]:
    """The character tokenizer's tokens: every distinct character of the text, sorted."""
    return sorted(set(text))
