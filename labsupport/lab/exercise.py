"""Graded exercises: the attendee writes the mechanism, a check runs it and says what went wrong.

An exercise cell starts with the magic and defines one function (or value) named like the exercise:

    %%exercise ring_reduce_scatter_step
    def ring_reduce_scatter_step(chunks, step, rank, world):
        ...

The magic runs the cell, then the exercise's `grade` on what the cell defined. Feedback teaches:
what was expected, what came back, where (which rank, which step). Three outcomes:

* solved: one line saying what was checked;
* not solved yet (the template still raises NotImplementedError): one line, no error, so a
  notebook shipped unsolved runs top to bottom;
* wrong: the feedback as one red line (`ExerciseFailed`), so the attendee sees it at once.

A find-the-bug lab starts out wrong on purpose: as shipped (the first version of the cell that
runs) its feedback is the symptom, printed, not raised. A changed cell that still has the bug is
a wrong answer: the symptom as one red line, so the attendee sees their attempt was checked.
Later cells never depend on an exercise: they use labsupport's own code.

Each line starts with a symbol and says in words what it means, for a browser without the
symbol's font: ✔ solved, ○ not solved yet, 🐞 the bug to find, ✘ wrong. Feedback is printed in
lines of at most WIDTH characters, broken between words (`wrap`): JupyterLab breaks a text
output's longer lines at any character ("micro-bat" / "ch").

What a lab teaches once it is solved (why the bug did what it did, what the exercise shows) is its
`lesson`, written here in the lab module, never in the notebook: markdown and code stay in the
attendee's copy, so text under a lab would be on screen while the attendee works on it. The lesson
is printed under the ✔ line when the check passes, with the solution when the attendee asks for it,
and by `lesson(name)` (a cell under the lab) from then on. Where a lab's module shows more of what it
teaches (a table, a figure), it asks `unlocked(name)` first and prints `locked(name, what)` until then.
A bug lab also names its `cause`: the phrases that give it away, which a test keeps out of the cells
around the lab.

`hint(name)` gives the next hint, `solution(name)` shows the reference solution (and, in
Jupyter, puts it into a new cell), `progress()` lists what is done. With LABSUPPORT_SOLUTIONS=1
every exercise cell runs its reference solution instead, and any failure raises: that is how
CI keeps the solutions from rotting.
"""
from __future__ import annotations

import importlib
import os
import re
import textwrap
from dataclasses import dataclass, field
from typing import Callable

# The notebooks' exercise modules, imported on first use (each registers its exercises).
MODULES = ("nb00_collectives", "nb01_single_device", "nb02_data_parallel", "nb03_zero", "nb04_tensor_parallel",
           "nb05_pipeline_parallel", "nb06_3d_parallelism", "nb07_context_and_experts")

SOLVED, UNSOLVED, WRONG, BUGGY = "solved", "not solved yet", "wrong", "bug not fixed yet"


# JupyterLab shows text outputs (print, and an error's traceback) with `word-break: break-all`: a line
# wider than the output area breaks at whatever character reaches the edge. With the file browser open
# (JupyterLab 4.6, Chromium, default font) the area holds 66 characters in a window 960 pixels wide, 74
# at 1024, 107 at 1280, 127 at 1440 (250 more pixels with the file browser closed: 32 characters).
# Lines of 72 fit from about 1,010 pixels with the file browser open, and from 760 with it closed.
WIDTH = 72
INDENT = "  "  # what starts a line that continues the one above it


def wrap(text: str, width: int = WIDTH) -> str:
    """`text` with each line longer than `width` broken between words, never inside one (a word longer
    than `width` gets a line of its own); the lines that continue it start with INDENT more than its own
    indentation. Line breaks already in the text stay, and so does a table's row (columns aligned by runs
    of spaces): broken, its cells would land under the wrong columns."""
    lines = []
    for line in text.split("\n"):
        indent = line[:len(line) - len(line.lstrip(" "))]
        if re.search(r"\S {3,}\S", line):
            lines.append(line)
            continue
        lines += textwrap.wrap(line, width, subsequent_indent=indent + INDENT, break_long_words=False,
                               break_on_hyphens=False) or [line]
    return "\n".join(lines)


def paragraphs(*texts: str) -> str:
    """A lesson written as paragraphs (each string one, its source line breaks ignored), each on one line:
    printing wraps them (`wrap`)."""
    return "\n\n".join(" ".join(t.split()) for t in texts)


def unwrap(text: str) -> str:
    """What `wrap` was given, for text without lines that start with INDENT of their own: each line that
    starts with INDENT joins the line above it."""
    return re.sub(rf"\n{INDENT}(?=\S)", " ", text)


class Wrong(Exception):
    """Raised by a grade function: the message is the feedback (what, where, expected, got)."""


class Unsolved(Exception):
    """Raised by a grade function when the attendee's code still raises NotImplementedError."""


def attempt(fn, *args):
    """Call the attendee's function; its NotImplementedError means the template is still unsolved."""
    try:
        return fn(*args)
    except NotImplementedError:
        raise Unsolved("it still raises NotImplementedError") from None


class ExerciseFailed(AssertionError):
    """A wrong answer, shown in the notebook as one line instead of a traceback."""

    def _render_traceback_(self):
        return [f"\033[31m{line}\033[0m" for line in wrap(f"✘ {self}").split("\n")]


@dataclass
class Exercise:
    name: str                              # what the cell defines, and the key of hint()/solution()
    notebook: str                          # "00", "01", ...
    title: str
    grade: Callable[[object, str], str]    # (what the cell defined, the cell's source) -> success message
    hints: tuple[str, ...]
    solution: str                          # a cell body that solves it
    ranks: int = 0                         # how many ranks its check runs on (0: in the notebook's process)
    bug_lab: bool = False
    lesson: str = ""                       # what it teaches, shown once it is solved (or its solution shown)
    cause: tuple[str, ...] = ()            # a bug lab's give-away phrases, kept out of the cells around it
    status: str = UNSOLVED
    hints_shown: int = field(default=0, repr=False)
    shipped: str | None = field(default=None, repr=False)  # a bug lab's first source graded: the cell as shipped
    earned: bool = field(default=False, repr=False)        # solved once, or its solution shown: the lesson is open


EXERCISES: dict[str, Exercise] = {}


def register(exercise: Exercise) -> Exercise:
    EXERCISES[exercise.name] = exercise
    exercise.status = BUGGY if exercise.bug_lab else UNSOLVED
    return exercise


def _load_all() -> None:
    for module in MODULES:
        importlib.import_module(f"labsupport.lab.{module}")


def get(name: str) -> Exercise:
    _load_all()
    if name not in EXERCISES:
        raise KeyError(f"no exercise named {name!r}; the exercises are: {', '.join(EXERCISES)}")
    return EXERCISES[name]


def solutions_mode() -> bool:
    return os.environ.get("LABSUPPORT_SOLUTIONS", "") not in ("", "0")


def run_cell(name: str, source: str, namespace: dict) -> str:
    """What `%%exercise NAME` does: run the cell in `namespace`, grade it, print the verdict."""
    ex = get(name)
    if solutions_mode():
        print(f"(LABSUPPORT_SOLUTIONS is set: running the reference solution of {name})")
        source = ex.solution
    exec(compile(source, f"<exercise {name}>", "exec"), namespace)
    if name not in namespace:
        raise ExerciseFailed(f"{name}: the cell must define `{name}`")
    return grade(ex, namespace[name], source)


def grade(ex: Exercise, answer, source: str) -> str:
    """Grade `answer`; print the verdict; raise ExerciseFailed for a wrong answer (not for a bug lab as shipped)."""
    if ex.bug_lab and ex.shipped is None:
        ex.shipped = source
    changed = ex.bug_lab and source != ex.shipped  # an attempt at the bug lab
    try:
        message = ex.grade(answer, source)
    except Unsolved as e:
        status, line = UNSOLVED, (f"○ {ex.name}: not solved yet ({e}). Write it and run the cell again; "
                                  f"lab.hint({ex.name!r}) helps.")
    except Wrong as e:
        if not ex.bug_lab:
            status, line = WRONG, f"{ex.name}: {e}"
        elif changed:
            status, line = BUGGY, f"{ex.name}: your change was checked, and the bug is still there: {e}"
        else:
            status, line = BUGGY, f"🐞 {ex.name}, the bug to find: {e}"
    else:
        status, line = SOLVED, f"✔ {ex.name}: {message}"
        ex.earned = True
        if ex.lesson:
            line += f"\n{ex.lesson}"
    ex.status = status
    if solutions_mode() and status != SOLVED:
        raise ExerciseFailed(f"{ex.name}: the reference solution does not pass: {line}")
    if status == WRONG or (status == BUGGY and changed):
        raise ExerciseFailed(line)
    print(wrap(line))
    return status


def hint(name: str) -> None:
    """Print the next hint of exercise `name` (all of them once they are used up)."""
    ex = get(name)
    ex.hints_shown = min(ex.hints_shown + 1, len(ex.hints))
    for i, text in enumerate(ex.hints[:ex.hints_shown], 1):
        print(wrap(f"hint {i}/{len(ex.hints)}: {text}"))


def solution(name: str, load: bool = True) -> None:
    """Show the reference solution; in Jupyter (`load`) it also appears in a new cell below. Nothing is
    returned: as a cell's last line, a returned string would be shown a second time, quoted."""
    ex = get(name)
    cell = f"%%exercise {name}\n{ex.solution.strip()}\n"
    print(cell)
    if ex.lesson:
        print(wrap(ex.lesson))
    ex.earned = True
    if load:
        try:
            get_ipython().set_next_input(cell)  # noqa: F821 (defined inside IPython only)
        except NameError:
            pass


# Where `make notebooks` stores the notebooks for readers, every lesson is shown (see lesson()).
STORED = "LABSUPPORT_STORED_COPY"


def unlocked(name: str) -> bool:
    """Whether what exercise `name` teaches may be shown: the attendee has earned it (solved it, or asked for
    the solution), or this is the reader's copy in notebooks/, executed by `make notebooks` with
    LABSUPPORT_STORED_COPY=1 set, so that copy reads as a whole (or CI's run with the solutions)."""
    ex = get(name)
    return ex.earned or ex.status == SOLVED or os.environ.get(STORED, "") not in ("", "0") or solutions_mode()


def locked(name: str, what: str = "") -> None:
    """The line shown instead of what exercise `name` teaches (its lesson, or `what`) until `unlocked(name)`."""
    shown, check = (what, f"{name}'s check") if what else (f"What {name} teaches", "its check")
    print(wrap(f"🔒 (locked) {shown} appears here once {check} above passes, or after lab.solution({name!r})."))


def lesson(name: str) -> None:
    """Print what exercise `name` teaches, once it is `unlocked` (earned, or the stored copy); a locked line before."""
    ex = get(name)
    if not ex.lesson:
        raise KeyError(f"exercise {name!r} has no lesson")
    if unlocked(name):
        print(wrap(ex.lesson))
    else:
        locked(name)


def progress(notebook: str | None = None) -> None:
    """Print every exercise (of one notebook, e.g. "00") with its status."""
    _load_all()
    rows = [ex for ex in EXERCISES.values() if notebook is None or ex.notebook == notebook]
    width = max(len(ex.name) for ex in rows)
    print(f"{'nb':<4}{'exercise':<{width + 2}}status")
    for ex in rows:
        print(f"{ex.notebook:<4}{ex.name:<{width + 2}}{'✔ ' if ex.status == SOLVED else '  '}{ex.status}")
    print(f"{sum(ex.status == SOLVED for ex in rows)} of {len(rows)} done")
