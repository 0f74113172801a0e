"""The package's import rules, checked without launching anything (one subprocess, a second or two).

estimate/ is pure math: it imports no torch. A widget draws estimate/'s numbers or the files a run
wrote: it imports nothing from parallel/ and no module that imports torch. model.py is the model,
whatever parallelizes it: it imports nothing from parallel/. And no module uses a private name (`_x`)
of another: what crosses a module boundary is public where it is defined.

The static checks read every import statement, those inside functions included; whether a module
"imports torch" is learnt by importing it in a subprocess where `import torch` fails.
"""
import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "labsupport"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def where(path: Path) -> str:
    return str(path.relative_to(PACKAGE)) if path.is_relative_to(PACKAGE) else path.name


def is_module(name: str) -> bool:
    """Whether `name` is a module or package of labsupport (not a function or constant in one)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path, name: str = ""):
    """(line, module, names) for every import in the file of module `name` (by default, the one at
    `path`), relative ones made absolute; for `import a.b`, names is empty."""
    package = (name or module_name(path)).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            yield node.lineno, module, [alias.name for alias in node.names]


def imported_modules(path: Path, name: str = "") -> set[str]:
    """The labsupport modules the file imports, at any depth (`from . import x` counts x)."""
    found = set()
    for _, module, names in imports(path, name):
        if module.split(".")[0] == "labsupport":
            found.add(module)
            found.update(f"{module}.{n}" for n in names if is_module(f"{module}.{n}"))
    return found


def named(paths, prefix: str, name: str = "") -> list[str]:
    """`file:line module` for every import in `paths` of `prefix` or a module below it."""
    return [f"{where(p)}:{line} {module}" for p in paths for line, module, names in imports(p, name)
            if any(m == prefix or m.startswith(prefix + ".") for m in (module, *(f"{module}.{n}" for n in names)))]


BLOCKED = """
import importlib, json, sys
sys.modules["torch"] = None  # `import torch` now raises ImportError
failed = {}
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except ImportError as e:
        failed[name] = str(e)
print(json.dumps(failed))
"""


def needing_torch(modules) -> dict:
    """Those of `modules` that cannot be imported where torch cannot (with the reason)."""
    res = subprocess.run([sys.executable, "-c", BLOCKED, *sorted(modules)], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


ESTIMATE = sorted((PACKAGE / "estimate").glob("*.py"))
WIDGETS = sorted((PACKAGE / "widgets").glob("*.py"))


def test_estimate_and_widgets_import_no_torch():
    """Neither directly nor through another labsupport module, at import or inside a function."""
    assert named(ESTIMATE + WIDGETS, "torch") == []
    modules = {module_name(p) for p in ESTIMATE + WIDGETS}
    modules |= {m for p in ESTIMATE + WIDGETS for m in imported_modules(p)}
    assert needing_torch(modules) == {}


def test_widgets_and_model_import_nothing_from_parallel():
    assert named(WIDGETS + [PACKAGE / "model.py"], "labsupport.parallel") == []


def private_names_used(path: Path, name: str = "") -> list[str]:
    """Where the file takes a private name from another labsupport module: `from m import _x`,
    or `m._x` with m a labsupport module it imported."""
    found, modules = [], {}
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    for line, module, names in imports(path, name):
        if module.split(".")[0] != "labsupport":
            continue
        for n in names:
            if n.startswith("_") and not n.startswith("__"):
                found.append(f"{where(path)}:{line} from {module} import {n}")
            if is_module(f"{module}.{n}"):
                modules[n] = f"{module}.{n}"
    for node in ast.walk(tree):  # `import labsupport.x as y` binds y; plain `import labsupport.x` binds labsupport
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "labsupport":
                    modules[alias.asname or "labsupport"] = alias.name if alias.asname else "labsupport"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in modules:
                found.append(f"{where(path)}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_uses_a_private_name_of_another():
    assert [use for p in sorted(PACKAGE.rglob("*.py")) for use in private_names_used(p)] == []


def test_the_checks_see_what_they_look_for(tmp_path):
    """The scans are not vacuous: they find a planted private import and attribute, an import from
    parallel/, and a module that needs torch."""
    planted = tmp_path / "planted.py"
    planted.write_text("from . import collectives\nfrom ..parallel.context import _x\n"
                       "import labsupport.metrics as m\ncollectives._wrap, m._y\n", encoding="utf-8")
    name = "labsupport.widgets.planted"
    assert private_names_used(planted, name) == ["planted.py:2 from labsupport.parallel.context import _x",
                                                 "planted.py:4 collectives._wrap", "planted.py:4 m._y"]
    assert named([planted], "labsupport.parallel", name) == ["planted.py:2 labsupport.parallel.context"]
    assert imported_modules(planted, name) == {"labsupport.widgets", "labsupport.widgets.collectives",
                                               "labsupport.parallel.context", "labsupport.metrics"}
    assert list(needing_torch(["labsupport.metrics", "labsupport.trace"])) == ["labsupport.metrics"]


def test_notebooks_import_overlap_from_metrics():
    """Notebook 02 does `from labsupport.metrics import overlap`: the torch-free trace.overlap, the same function."""
    from labsupport import metrics, trace
    assert metrics.overlap is trace.overlap
