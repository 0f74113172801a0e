"""Predict, then run: the attendee writes a guess before a measurement, the run shows it beside the result.

    guess = None   # your prediction, e.g. 1.5e6
    ... the cell that measures ...
    reveal(guess, measured, unit="bytes", why="...")

A guess is a number (compared by ratio) or a choice (compared for equality). With no guess,
the question still gets its answer, so the notebook runs top to bottom as shipped.
"""
from __future__ import annotations


def reveal(guess, measured, unit: str = "", why: str = "", tolerance: float = 0.1) -> str:
    """Print the guess beside the measured value, and `why` the value is what it is.

    Numbers count as right within `tolerance` (relative); anything else must be equal.
    Returns "right", "off" or "no guess".
    """
    shown = f"{measured:,.6g} {unit}".strip() if isinstance(measured, (int, float)) else f"{measured}"
    if guess is None:
        verdict, line = "no guess", f"No prediction entered. Measured: {shown}."
    elif isinstance(measured, (int, float)) and isinstance(guess, (int, float)):
        ratio = guess / measured if measured else float("inf") if guess else 1.0
        right = abs(ratio - 1) <= tolerance
        verdict = "right" if right else "off"
        line = (f"You predicted {guess:,.6g}; measured {shown}: "
                + ("right." if right else f"off by a factor {max(ratio, 1 / ratio) if ratio else float('inf'):.3g}."))
    else:
        verdict = "right" if guess == measured else "off"
        line = f"You predicted {guess!r}; the answer is {measured!r}: " + ("right." if verdict == "right" else "not quite.")
    print(line + (f" {why}" if why else ""))
    return verdict
