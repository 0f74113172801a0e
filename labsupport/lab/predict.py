"""Predict, then run: the attendee writes a guess before a measurement, the run shows it beside the result.

    guess = None   # your prediction, e.g. 1.5e6
    ... the cell that measures ...
    reveal(guess, measured, unit="bytes", why="...")

A guess is a number (compared by ratio) or a choice (compared for equality). With no guess,
the question still gets its answer, so the notebook runs top to bottom as shipped.
"""
from __future__ import annotations


def _number(x) -> str:
    """1,572,864 for counts, 357.8 for measurements: what a reader would write."""
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer() and abs(x) >= 1e4):
        return f"{int(x):,}"
    return f"{x:,.4g}"


def reveal(guess, measured, unit: str = "", why: str = "", tolerance: float = 0.1,
           label: str = "Measured") -> None:
    """Print the guess beside the measured value, and `why` the value is what it is.

    Numbers count as right within `tolerance` (relative); anything else must be equal. `label` names where the
    value comes from ("Simulated", "Formula"), so that a computed answer is not called a measurement.
    """
    numbers = isinstance(measured, (int, float)) and isinstance(guess, (int, float))
    shown = f"{_number(measured)} {unit}".strip() if isinstance(measured, (int, float)) else repr(measured)
    if guess is None:
        line = f"No prediction entered. {label}: {shown}."
    elif numbers:
        ratio = guess / measured if measured else float("inf") if guess else 1.0
        line = f"You predicted {_number(guess)}; {label.lower()} {shown}: " + (
            "right." if abs(ratio - 1) <= tolerance else
            f"off by a factor {max(ratio, 1 / ratio) if ratio else float('inf'):.3g}.")
    else:
        line = f"You predicted {guess!r}; the answer is {shown}: " + ("right." if guess == measured else "not quite.")
    print(line + (f" {why}" if why else ""))
