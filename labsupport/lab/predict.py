"""Predict, then run: the attendee writes a guess before a measurement, the run shows it beside the result.

    guess_ring_bytes = None   # your prediction, e.g. 1.5e6
    ... the cell that measures ...
    reveal(guess_ring_bytes, measured, unit="bytes", why="ring_bytes")

A guess is a number (compared by ratio, or by difference where one side is 0) or a choice
(compared for equality). With no guess, the question still gets its answer, so the notebook runs
top to bottom as shipped.

`why` names the explanation printed after the answer, keyed by the prediction's name (guess_NAME ->
"NAME"). The texts live in the notebook's lab module (nb05_pipeline_parallel.WHY, ...), not in
the cell: the attendee reads a cell's source before running it, and the explanation often states
the answer. An explanation that quotes computed values has {fields}; the cell passes the values
by name, never the text: reveal(guess_params, n, why="params", n_layers=cfg.n_layers, ...).
"""
from __future__ import annotations

import importlib
import string

from .exercise import MODULES, wrap


def explanations() -> dict[str, str]:
    """Every notebook's explanations, by key: the WHY dicts of the lab modules (a key is unique over all)."""
    found: dict[str, str] = {}
    for module in MODULES:
        for key, text in getattr(importlib.import_module(f"labsupport.lab.{module}"), "WHY", {}).items():
            if key in found:
                raise ValueError(f"the explanation {key!r} is defined twice (again in {module})")
            found[key] = text
    return found


def fields(text: str) -> set[str]:
    """The names of the values an explanation needs: "{n:,} bytes" -> {"n"}."""
    return {name for _, name, _, _ in string.Formatter().parse(text) if name}


def explain(key: str, **values) -> str:
    """The explanation named `key`, its {fields} filled from `values`."""
    known = explanations()
    if key not in known:
        raise KeyError(f"no explanation named {key!r}; the explanations are: {', '.join(sorted(known))}")
    text = known[key]
    needed = fields(text)
    if set(values) != needed:
        raise TypeError(f"the explanation {key!r} takes the values {sorted(needed) or 'none'}, "
                        f"the cell passed {sorted(values) or 'none'}")
    return text.format(**values)


def _number(x) -> str:
    """1,572,864 for counts, 357.8 for measurements: what a reader would write."""
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) >= 1e4):
        return f"{int(x):,}"
    return f"{x:,.4g}"


def reveal(guess, measured, unit: str = "", why: str = "", tolerance: float = 0.1,
           label: str = "Measured", choices: tuple = (), **values) -> None:
    """Print the guess beside the measured value, and the explanation named `why` (see `explain`).

    Numbers count as right within `tolerance` (relative); anything else must be equal, and a guess outside
    `choices` (when the question offers some) is told so, not called wrong. `label` names where the
    value comes from ("Simulated", "Formula"), so that a computed answer is not called a measurement. `values`
    fill the explanation's {fields}.
    """
    because = explain(why, **values) if why else ""
    numbers = isinstance(measured, (int, float)) and isinstance(guess, (int, float))
    shown = f"{_number(measured)} {unit}".strip() if isinstance(measured, (int, float)) else repr(measured)
    if guess is None:
        line = f"No prediction entered. {label}: {shown}."
    elif numbers:
        ratio = guess / measured if measured else float("inf") if guess else 1.0
        line = f"You predicted {_number(guess)}; {label.lower()} {shown}: " + (
            "right." if abs(ratio - 1) <= tolerance else
            f"off by {_number(abs(guess - measured))}." if 0 in (guess, measured) else  # no factor from 0
            f"off by a factor {max(ratio, 1 / ratio):.3g}.")
    elif choices and guess not in choices:
        line = (f"You predicted {guess!r}, which is none of the answers offered "
                f"({', '.join(map(repr, choices))}); the answer is {shown}.")
    else:
        line = f"You predicted {guess!r}; the answer is {shown}: " + ("right." if guess == measured else "not quite.")
    print(wrap(line + (f" {because}" if because else "")))
