"""Every notebook is a lab, stored clean, and its solutions work.

The shipped notebooks run top to bottom unsolved under nbval. Here, for every notebook: each of
its exercises is in it once, ships as a template (or, for a find-the-bug lab, buggy) that says so
without raising, no later cell uses the attendee's answer, there are at least three
predict-then-run prompts and the progress table, each prompt's explanation named in its cell and
written only in the lab module (the stored outputs print it), and the stored outputs hold no error, no
absolute path and no widget text repr. Then each exercise cell runs exactly as stored, first as
shipped (it must say "not yet" or show its bug, not fail), then with LABSUPPORT_SOLUTIONS=1, so it
runs its reference solution and must pass its check (on real ranks where the subject is
distributed): solutions cannot rot. Exercise cells do
not depend on the cells around them, so running only them keeps this fast.

What a lab gives away is checked too (issue 28): no cell around a bug lab names its cause, no reveal
cell's source holds its answer, the lab module's docstrings (and those of the names a notebook takes
from it) describe a bug lab by its symptom, and no text of a notebook sends the attendee to a lab module.
"""
import ast
import importlib
import inspect
import io
import json
import re
import tokenize
from pathlib import Path

import pytest
from IPython.core.inputtransformer2 import TransformerManager
from IPython.core.interactiveshell import InteractiveShell

from labsupport.lab import exercise as ex
from labsupport.lab import predict

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def cells(path: Path) -> list[dict]:
    return json.loads(path.read_text(encoding="utf-8"))["cells"]


def source(cell) -> str:
    return "".join(cell["source"])


def exercise_cells(path: Path) -> dict[str, tuple[int, str]]:
    """{exercise name: (cell index, the cell's source)}, each exercise once."""
    found = {}
    for i, cell in enumerate(cells(path)):
        m = re.match(r"%%exercise (\w+)\n", source(cell))
        if cell["cell_type"] == "code" and m:
            assert m.group(1) not in found, f"{path.name}: exercise {m.group(1)} appears twice"
            found[m.group(1)] = (i, source(cell))
    return found


notebooks = pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)


@notebooks
def test_the_notebook_holds_its_exercises_each_shipped_unsolved(path, capsys):
    ex._load_all()
    found = exercise_cells(path)
    mine = {e.name for e in ex.EXERCISES.values() if e.notebook == path.stem[:2]}
    assert set(found) == mine and mine, f"{path.name}: cells {sorted(found)}, exercises {sorted(mine)}"
    assert any(ex.EXERCISES[name].bug_lab for name in found), f"{path.name} has no find-the-bug lab"
    for name, (index, cell) in found.items():
        body = cell.split("\n", 1)[1]
        intro = source(cells(path)[index - 1])
        if ex.EXERCISES[name].bug_lab:
            assert "lab.hint" in intro or "Find the bug" in intro or "🐞" in intro, f"{name}: no story before it"
        else:
            assert "raise NotImplementedError" in body and '"""' in body, f"{name}: not a template with a docstring"
    local = [name for name in found if ex.EXERCISES[name].ranks == 0]
    for name in local:  # those graded in this process: their shipped cell says "not yet" and raises nothing
        status = ex.run_cell(name, exercise_cells(path)[name][1].split("\n", 1)[1], {})
        assert status == (ex.BUGGY if ex.EXERCISES[name].bug_lab else ex.UNSOLVED), (name, capsys.readouterr().out)


@notebooks
def test_later_cells_never_use_the_attendees_answers(path):
    all_cells = cells(path)
    for name, (index, _) in exercise_cells(path).items():
        for cell in all_cells[index + 1:]:
            if cell["cell_type"] == "code" and not source(cell).startswith(f"%%exercise {name}"):
                assert not re.search(rf"(?<![.\w'\"]){name}\(", source(cell)), \
                    f"{path.name}: a later cell calls the attendee's {name}: {source(cell)[:80]!r}"


@notebooks
def test_predictions_and_progress(path):
    code = [source(c) for c in cells(path) if c["cell_type"] == "code"]
    guesses = [g for s in code for g in re.findall(r"lab\.reveal\((\w+),", s)]
    assert len(guesses) >= 3, f"{path.name} has {len(guesses)} predict-then-run prompts, needs 3"
    for guess in guesses:  # each guess is asked for, with None as the shipped answer
        assert any(re.search(rf"^{guess} = None +# your prediction", s, re.M) for s in code), guess
    assert any(f'lab.progress("{path.stem[:2]}")' in s for s in code), f"{path.name} does not show lab.progress()"


def reveal_calls(path: Path) -> list[tuple[int, ast.Call]]:
    """(cell index, call) for every lab.reveal(...) in the notebook's code cells, in order."""
    found = []
    for index, cell in enumerate(cells(path)):
        if cell["cell_type"] == "code" and "reveal(" in source(cell):
            tree = ast.parse(TransformerManager().transform_cell(source(cell)))
            found += sorted(((index, node) for node in ast.walk(tree) if isinstance(node, ast.Call)
                             and getattr(node.func, "attr", None) == "reveal"), key=lambda c: c[1].lineno)
    return found


@notebooks
def test_predictions_are_explained_from_the_lab_module_not_the_cell(path):
    """A cell's source is read before it runs: it names its explanation (the prediction's name), and any value the
    explanation quotes, but holds no text that could give the answer away (issue 18, section 3)."""
    module = importlib.import_module(f"labsupport.lab.{next(m for m in ex.MODULES if m[2:4] == path.stem[:2])}")
    for index, call in reveal_calls(path):
        where = f"{path.name}[{index}] {ast.unparse(call)[:70]}"
        kw = {k.arg: k.value for k in call.keywords}
        assert isinstance(kw.get("why"), ast.Constant), f"{where}: why= must name an explanation, a string key"
        key = kw["why"].value
        assert isinstance(call.args[0], ast.Name) and call.args[0].id == f"guess_{key}", \
            f"{where}: why={key!r} should be the prediction's name, guess_{key} -> {key!r}"
        assert key in getattr(module, "WHY", {}), f"{where}: {key!r} is not in {module.__name__}.WHY"
        passed = set(kw) - {"why", "unit", "label", "tolerance", "choices"}
        assert passed == predict.fields(module.WHY[key]), f"{where}: passes {passed}, the explanation takes others"
        for node in ast.walk(call):
            assert not isinstance(node, ast.JoinedStr), f"{where}: an f-string in a reveal call"
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node not in (kw.get("unit"),
                                                                                            kw.get("label")):
                assert len(node.value.split()) <= 2, f"{where}: the text {node.value[:40]!r} belongs in the lab module"
    code = "".join(source(c) for c in cells(path) if c["cell_type"] == "code")
    for key, text in getattr(module, "WHY", {}).items():  # nor anywhere else in a code cell
        for piece in re.split(r"\{[^}]*\}", text):
            assert len(piece) < 40 or piece[:40] not in code, f"{path.name}: a code cell holds the {key!r} text"


@notebooks
def test_stored_reveal_outputs_print_the_lab_modules_explanation(path):
    """The outputs stored before the explanations moved are still what the cells print: each reveal's line ends
    with its explanation, every fixed part of a template in order (the values are the run's)."""
    calls, all_cells = reveal_calls(path), cells(path)
    for index, call in calls:
        lines = [line for o in all_cells[index].get("outputs", []) if o["output_type"] == "stream"
                 for line in ex.unwrap("".join(o["text"])).splitlines()
                 if line.startswith(("No prediction entered.", "You predicted"))]
        n = [c for i, c in calls if i == index].index(call)  # the cell's n-th reveal prints its n-th line
        key = next(k.value.value for k in call.keywords if k.arg == "why")
        text = predict.explanations()[key]
        pattern = "(.+?)".join(re.escape(piece) for piece in re.split(r"\{[^}]*\}", text))
        assert len(lines) > n and re.search(rf" {pattern}$", lines[n]), f"{path.name}[{index}] {key}: {lines[n:n + 1]}"


@notebooks
def test_stored_outputs_are_clean(path):
    for cell in cells(path):
        if "NBVAL_CHECK_OUTPUT" in source(cell):
            raise AssertionError(f"{path.name}: use the nbval-check-output tag, not a comment")
        for output in cell.get("outputs", []):
            assert output["output_type"] != "error", f"{path.name}: a stored error in {source(cell)[:60]!r}"
            text = json.dumps(output)
            assert not re.search(r"(?<![\w.])/(work|tmp|root|home)/", text), f"{path.name}: an absolute path: {text[:200]}"
            assert "VBox(" not in text, f"{path.name}: a widget's text repr is stored"
            stale_output_lines(path, output)


FEEDBACK_START = ("✔", "○", "🐞", "✘", "🔒", "hint ")


def stale_output_lines(path, output) -> None:
    """A stored output printed by code older than the notebook's (issue 28: 02-04 kept feedback from before it
    was wrapped): feedback lines wider than exercise.WIDTH, or the training launch line's old one-line form."""
    text = "".join(output.get("text", ""))
    for line in text.splitlines():
        assert not (line.startswith(FEEDBACK_START) and len(line) > ex.WIDTH), \
            f"{path.name}: a stored feedback line of {len(line)} characters, not wrapped: re-execute it: {line[:80]!r}"
        assert not re.search(r"rank\(s\), global batch", line), \
            f"{path.name}: the launch line's old form is stored: re-execute the notebook: {line[:80]!r}"


@pytest.mark.multiprocess
@pytest.mark.slow
@notebooks
def test_shipped_cells_say_not_yet_and_the_solutions_pass(path, monkeypatch, capsys):
    """Each exercise cell as stored: "not solved yet" (or the bug's symptom), never an error; then
    the same cell with LABSUPPORT_SOLUTIONS=1 passes. Distributed checks run on a pool of the size
    most of the notebook's exercises need, as in the notebook (the others through a launch)."""
    from labsupport.pool import ranks
    found = exercise_cells(path)
    sizes = [ex.get(name).ranks for name in found if ex.get(name).ranks]
    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext labsupport", store_history=False)
    if sizes:
        ranks.start(max(sizes, key=sizes.count), timeout=60)
    try:
        for name, (_, cell) in found.items():
            monkeypatch.delenv("LABSUPPORT_SOLUTIONS", raising=False)
            shipped = shell.run_cell(cell, store_history=False)
            out = capsys.readouterr().out
            expected = ex.BUGGY if ex.get(name).bug_lab else ex.UNSOLVED
            assert shipped.success and ex.get(name).status == expected, f"{path.name}, {name} as shipped: {out}"
            monkeypatch.setenv("LABSUPPORT_SOLUTIONS", "1")
            solved = shell.run_cell(cell, store_history=False)
            out = capsys.readouterr().out
            assert solved.success and ex.get(name).status == ex.SOLVED and f"✔ {name}:" in out, f"{path.name}, {name}: {out}"
    finally:
        ranks.stop()


@notebooks
def test_no_cell_around_a_bug_lab_names_its_cause(path):
    """Issue 28, section 2: the attendee's copy keeps markdown and code, so a cause named above a bug lab, in
    its first hint, or in the two cells below it is on screen while the attendee hunts for it. What a lab
    teaches once solved is its lesson, printed by the check (lab.lesson)."""
    ex._load_all()
    all_cells = cells(path)
    for name, (index, _) in exercise_cells(path).items():
        lab = ex.get(name)
        if not lab.bug_lab:
            continue
        assert lab.cause, f"{name}: a bug lab names its cause (Exercise.cause) so that this test can keep it hidden"
        above = [source(c) for c in all_cells[:index] if c["cell_type"] == "markdown"]
        below = [source(c) for c in all_cells[index + 1:index + 3]]
        for cause in lab.cause:
            for where, text in [("above it", t) for t in above] + [("below it", t) for t in below] + \
                               [("in its first hint", lab.hints[0])]:
                assert cause.lower() not in text.lower(), f"{path.name}, {name}: {cause!r} {where}: {text[:120]!r}"


@notebooks
def test_lessons_shown_under_labs_are_written_in_the_lab_module(path):
    ex._load_all()
    for cell in cells(path):
        for name in re.findall(r"lab\.lesson\([\"'](\w+)[\"']\)", source(cell)):
            assert ex.get(name).lesson, f"{path.name}: lab.lesson({name!r}) but {name} has no lesson"


def stored_answer(cell) -> str | None:
    """What the stored output of an unanswered prediction printed as its answer: "9", "1,572,864 bytes", "'1f1b'"."""
    for o in cell.get("outputs", []):
        for line in ex.unwrap("".join(o.get("text", ""))).splitlines():
            m = re.match(r"No prediction entered\. \w[\w ]*: (.+?)\.(?: |$)", line)
            if m:
                return m.group(1)
    return None


@notebooks
def test_a_reveal_cells_source_does_not_hold_its_answer(path):
    """Issue 28, section 2: the attendee reads a reveal cell before running it. An assert comparing with the
    answer (`idle == 9`) or a message that states it gives the prediction away."""
    for index, call in reveal_calls(path):
        cell = cells(path)[index]
        answer = stored_answer(cell)
        assert answer is not None, f"{path.name}[{index}]: no stored answer line"
        tree = ast.parse(TransformerManager().transform_cell(source(cell)))
        number = re.match(r"-?[\d,]+(\.\d+)?", answer)
        for node in ast.walk(tree):
            if number and isinstance(node, ast.Compare):  # `idle == 9` answers 9/12 as well as 9
                constants = [side.value for side in [node.left, *node.comparators]
                             if isinstance(side, ast.Constant) and isinstance(side.value, (int, float))]
                assert not [c for c in constants if c not in (0, 1)], \
                    f"{path.name}[{index}]: a reveal cell compares with a number before the answer is shown: " \
                    f"{ast.unparse(node)} (checks go in the check cell)"
            if not number and isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert repr(node.value) != answer or node in call.args, \
                    f"{path.name}[{index}]: the cell's source holds the answer {answer}"


def lab_module(path: Path):
    """The notebook's lab module (labsupport.lab.nb07_context_and_experts for 07_*.ipynb)."""
    return importlib.import_module(f"labsupport.lab.{next(m for m in ex.MODULES if m[2:4] == path.stem[:2])}")


def python_of(cell) -> str:
    """A code cell as Python: a cell magic's first line dropped (the bodies of %%exercise and %%ranks are Python),
    line magics and shell escapes turned into calls as IPython runs them."""
    text = source(cell)
    if text.startswith("%%"):
        text = text.split("\n", 1)[1] if "\n" in text else ""
    return TransformerManager().transform_cell(text)


def names_imported_from(module, path: Path) -> set[str]:
    """The names the notebook's code cells take from `module`: `from labsupport.lab.nbNN_x import a, b`, and
    `nbNN_x.a` after `from labsupport.lab import nbNN_x`."""
    short = module.__name__.rsplit(".", 1)[1]
    names = set()
    for cell in cells(path):
        if cell["cell_type"] != "code" or short not in source(cell):
            continue
        for node in ast.walk(ast.parse(python_of(cell))):
            if isinstance(node, ast.ImportFrom) and node.module == module.__name__:
                names |= {alias.name for alias in node.names}
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == short:
                names.add(node.attr)
    return names


@notebooks
def test_the_lab_modules_docstrings_give_a_bug_lab_by_its_symptom(path):
    """Issue 28: an attendee who opens the notebook's lab module, or asks `help()` about a name a cell imports from
    it, reads its docstrings first. The module's docstring, and the docstring of every function or class the
    notebook takes from it, describe each of its bug labs by the symptom, never by a phrase of the lab's `cause`.
    (The module also holds the hints, solutions and lessons: that is why no text of the notebook sends the attendee
    there, see the next test.)"""
    ex._load_all()
    module = lab_module(path)
    docs = {module.__name__: module.__doc__ or ""}
    for name in sorted(names_imported_from(module, path)):
        obj = getattr(module, name)
        if inspect.isfunction(obj) or inspect.isclass(obj):  # a constant's __doc__ is its type's
            docs[f"{module.__name__}.{name}"] = inspect.getdoc(obj) or ""
    labs = [e for e in ex.EXERCISES.values() if e.notebook == path.stem[:2] and e.bug_lab]
    for lab in labs:
        for where, doc in docs.items():
            for cause in lab.cause:
                assert cause.lower() not in " ".join(doc.split()).lower(), \
                    f"{where}'s docstring names {lab.name}'s cause {cause!r}: say the symptom, the lesson says why"


# A lab module, named in text: the package as a dotted name or a path (labsupport.lab.nb07_..., labsupport/lab/...),
# a module's own name (nb07_context_and_experts), or in words.
POINTS_AT_A_LAB_MODULE = re.compile(r"labsupport\s*[./]\s*lab\b|\bnb\d\d_[a-z]\w*|\blab(?:'s)? modules?\b", re.I)


@notebooks
def test_no_text_in_a_notebook_sends_the_attendee_to_a_lab_module(path):
    """Issue 28: the lab module holds every lab's hints, solution and lesson, so a sentence that names it sends the
    attendee to read the answer instead of debugging the cell. No markdown cell and no comment in a code cell names
    the package labsupport.lab or one of its modules; the notebook offers help through `lab.hint(...)` and
    `lab.solution(...)`. The imports a cell needs are code, not text, and stay; but an exercise's cell never imports
    from a notebook's lab module, whose name its import line would show the attendee: pieces an exercise's cell
    needs live in a module of their own (`labsupport.lab.ring_pieces`)."""
    for index, cell in enumerate(cells(path)):
        if cell["cell_type"] == "markdown":
            texts = [source(cell)]
        elif cell["cell_type"] == "code":
            if source(cell).startswith("%%exercise"):
                found = re.search(r"^\s*(?:from|import)\s+labsupport\.lab\.nb\d\d_\w*", source(cell), re.M)
                assert not found, f"{path.name}[{index}]: an exercise's cell imports from a lab module: {found.group(0)!r}"
            try:
                texts = [t.string for t in tokenize.generate_tokens(io.StringIO(python_of(cell)).readline)
                         if t.type == tokenize.COMMENT]
            except (tokenize.TokenError, SyntaxError):
                texts = re.findall(r"#.*", source(cell))
        else:
            continue
        for text in texts:
            found = POINTS_AT_A_LAB_MODULE.search(text)
            assert not found, f"{path.name}[{index}] ({cell['cell_type']}) names a lab module, {found.group(0)!r}: " \
                              f"{text[max(0, found.start() - 60):found.end() + 60]!r}"


def test_nothing_above_the_rank_order_lab_says_which_rank_holds_a_coordinate():
    """Issue 28: notebook 06's place_rank lab asks which rank holds coordinate (d, p, t). Rank 0 holds (0, 0, 0)
    whichever order the grid's axes are numbered in; any other rank number above the lab, or a group's list of
    ranks, in a cell's text, its source or its stored output, tells where a coordinate sits (section 3's traffic
    table once called (0, 1, 0) "rank 2"). Those cells name ranks by their coordinates."""
    path = next(p for p in NOTEBOOKS if p.stem.startswith("06"))
    index = exercise_cells(path)["place_rank"][0]
    for i, cell in enumerate(cells(path)[:index]):
        texts = [source(cell)] + [json.dumps(o.get("text", "")) + json.dumps(o.get("data", {}))
                                  for o in cell.get("outputs", [])]
        for text in texts:
            found = re.search(r"\branks? #?[1-9]\d*\b|\[\d+, \d+(, \d+)*\]", text)
            assert not found, f"{path.name}[{i}] above the place_rank lab: {text[max(0, found.start() - 60):found.end() + 40]!r}"
