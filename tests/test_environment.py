"""The install files agree with each other.

pyproject.toml is the source of truth for dependencies; environment.yml must list the same
packages (with both extras, [lab] and [dev]) for conda users, and the Makefile's TORCH_PIN (the
one place torch is pinned) must satisfy pyproject's torch range, or `make` would install a second
torch build. `make lab` installs what attendees need and no test tools; `make test` adds them.

environment.yml is read with a tiny line parser instead of PyYAML (not a declared
dependency); the parser understands only the layout that file uses and fails loudly on
anything else, and a test compares it with PyYAML whenever PyYAML happens to be installed.
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from packaging.requirements import Requirement  # packaging comes with pytest
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]

# PyPI name -> conda-forge name, where they differ.
CONDA_NAMES = {
    "torch": "pytorch",
    "matplotlib": "matplotlib-base",  # matplotlib without the Qt GUI stack
    "playwright": "playwright-python",
}
# Entries of environment.yml that are not packages of pyproject.toml.
CONDA_ONLY = {"python", "pip"}


# ------------------------------------------------------------------ readers

def pyproject_requirements(text: str, extras=("lab", "dev")) -> dict[str, str]:
    """{canonical PyPI name: version specifier} of the dependencies plus the given extras."""
    project = tomllib.loads(text)["project"]
    reqs = list(project["dependencies"])
    for extra in extras:
        reqs += project["optional-dependencies"][extra]
    out = {}
    for line in reqs:
        req = Requirement(line)
        out[canonicalize_name(req.name)] = str(SpecifierSet(str(req.specifier)))
    return out


def parse_environment_yml(text: str) -> dict:
    """Parse the subset of YAML that environment.yml uses.

    Top-level `key: value` and `key:` followed by a list of `- item`; inside `dependencies`
    one `- pip:` item followed by a more indented list. Comments and blank lines are skipped.
    """
    doc: dict = {}
    key = None          # top-level key whose list we are in
    pip_indent = None   # indent of the `- pip:` item while reading its list
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split(" #")[0].rstrip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        indent = len(line) - len(line.lstrip())
        body = line.strip()
        if indent == 0:
            pip_indent = None
            m = re.fullmatch(r"([\w-]+):\s*(.*)", body)
            if not m:
                raise ValueError(f"environment.yml:{number}: expected 'key: value', got {raw!r}")
            key, value = m.groups()
            doc[key] = value if value else []
            continue
        if key is None or not body.startswith("- ") or not isinstance(doc[key], list):
            raise ValueError(f"environment.yml:{number}: unexpected line {raw!r}")
        item = body[2:].strip()
        if pip_indent is not None and indent > pip_indent:
            doc[key][-1]["pip"].append(item)
            continue
        pip_indent = None
        if item == "pip:":
            pip_indent = indent
            doc[key].append({"pip": []})
        elif ":" in item or item.startswith(("{", "[")):
            raise ValueError(f"environment.yml:{number}: only '- pip:' may hold a list, got {raw!r}")
        else:
            doc[key].append(item)
    return doc


def conda_requirements(doc: dict) -> dict[str, str]:
    """{conda name: version constraint} of the conda packages in `dependencies`."""
    out = {}
    for item in doc["dependencies"]:
        if isinstance(item, dict):
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", item)
        name, spec = m.group(1).lower(), m.group(2).replace(" ", "")
        if name in out:
            raise ValueError(f"environment.yml lists {name} twice")
        out[name] = spec
    return out


def compare(pyproject_text: str, environment_text: str) -> list[str]:
    """Every disagreement between the two files, one sentence each (empty if they agree)."""
    pypi = pyproject_requirements(pyproject_text)
    conda = conda_requirements(parse_environment_yml(environment_text))
    conda = {k: v for k, v in conda.items() if k not in CONDA_ONLY}
    expected = {CONDA_NAMES.get(name, name): spec for name, spec in pypi.items()}
    problems = []
    for name in sorted(expected.keys() - conda.keys()):
        problems.append(f"{name} is in pyproject.toml but not in environment.yml")
    for name in sorted(conda.keys() - expected.keys()):
        problems.append(f"{name} is in environment.yml but not in pyproject.toml "
                        "(or CONDA_NAMES lacks its PyPI name)")
    for name in sorted(expected.keys() & conda.keys()):
        if SpecifierSet(expected[name]) != SpecifierSet(conda[name]):
            problems.append(f"{name}: pyproject.toml says {expected[name] or 'any version'!r}, "
                            f"environment.yml says {conda[name] or 'any version'!r}")
    return problems


def makefile_torch_pin(text: str) -> Requirement:
    pins = re.findall(r"^TORCH_PIN\s*:?=\s*(\S+)\s*$", text, flags=re.MULTILINE)
    assert len(pins) == 1, f"expected one TORCH_PIN assignment in the Makefile, found {pins}"
    return Requirement(pins[0])


# ------------------------------------------------------------------ the checks

def read(name: str) -> str:
    return (ROOT / name).read_text()


def test_pyproject_and_environment_list_the_same_packages():
    problems = compare(read("pyproject.toml"), read("environment.yml"))
    assert not problems, "\n".join(problems)


def test_environment_installs_the_package_and_a_supported_python():
    doc = parse_environment_yml(read("environment.yml"))
    assert doc["channels"] == ["conda-forge"]
    pip_lists = [item["pip"] for item in doc["dependencies"] if isinstance(item, dict)]
    assert pip_lists == [["-e ."]], "environment.yml should pip-install only this package, editable"
    python = conda_requirements(doc)["python"]
    requires = tomllib.loads(read("pyproject.toml"))["project"]["requires-python"]
    assert python.startswith("="), f"pin python with '=X.Y' in environment.yml, got {python!r}"
    assert SpecifierSet(requires).contains(python.lstrip("=")), \
        f"environment.yml's python{python} is outside pyproject's requires-python {requires}"


def test_makefile_torch_pin_satisfies_pyproject_range():
    pin = makefile_torch_pin(read("Makefile"))
    assert canonicalize_name(pin.name) == "torch"
    (spec,) = pin.specifier  # exactly one clause: ==X.Y.Z
    assert spec.operator == "==", f"TORCH_PIN should pin an exact version, got {pin}"
    torch_range = pyproject_requirements(read("pyproject.toml"))["torch"]
    assert SpecifierSet(torch_range).contains(spec.version), \
        f"Makefile's {pin} is outside pyproject.toml's torch{torch_range}; pip would install another torch"


def test_torch_is_pinned_in_the_makefile_only():
    others = [line for line in read("Makefile").splitlines()
              if re.search(r"torch\s*==", line) and not line.startswith("TORCH_PIN")]
    assert not others, f"torch pinned outside TORCH_PIN: {others}"


def test_the_comparison_catches_a_mismatch():
    """The checks above can fail: one package added to one file only, or a changed range."""
    pyproject = read("pyproject.toml")
    environment = read("environment.yml")
    assert compare(pyproject, environment + "  - scipy\n") == [
        "scipy is in environment.yml but not in pyproject.toml (or CONDA_NAMES lacks its PyPI name)"]
    one_more = pyproject.replace('"numpy",', '"numpy",\n    "scipy",')
    assert compare(one_more, environment) == ["scipy is in pyproject.toml but not in environment.yml"]
    narrower = pyproject.replace('"torch>=2.4,<3"', '"torch>=2.14,<3"')
    assert len(compare(narrower, environment)) == 1
    assert not SpecifierSet(pyproject_requirements(narrower)["torch"]).contains("2.13.0")
    with pytest.raises(ValueError):
        parse_environment_yml(environment + "  - conda-forge::\n      nested: [1]\n")


def test_attendees_get_jupyterlab_and_no_test_tools():
    attendee = pyproject_requirements(read("pyproject.toml"), extras=("lab",))
    assert {"jupyterlab", "ipykernel", "ipywidgets", "torch"} <= attendee.keys()
    tests_only = {"pytest", "pytest-timeout", "playwright", "psutil", "nbval"}
    assert not tests_only & attendee.keys(), f"attendees would install {sorted(tests_only & attendee.keys())}"
    assert tests_only <= pyproject_requirements(read("pyproject.toml"), extras=("dev",)).keys()


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
@pytest.mark.parametrize("target, extras", [("lab", "[lab]"), ("test", "[lab,dev]")])
def test_make_installs_the_extras_of_its_target(tmp_path, target, extras):
    """What `make lab` / `make test` would run in a fresh checkout (make -n prints, runs nothing)."""
    res = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    installs = [line for line in res.stdout.splitlines() if "pip install" in line]
    assert "torch==" in installs[1] and "-e" not in installs[1], "torch (TORCH_PIN) goes in first"
    assert installs[-1].endswith(f'pip install -e ".{extras}"'), installs


@pytest.mark.skipif(shutil.which("make") is None, reason="needs GNU make")
def test_make_builds_deepspeed_against_the_pinned_torch(tmp_path):
    """DeepSpeed is source only and its build imports torch: without build isolation, after the
    pinned torch and before the package (which lists it), so pip never fetches another torch."""
    res = subprocess.run(["make", "-n", "lab", f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    installs = [line for line in res.stdout.splitlines() if "pip install" in line]
    torch_at = next(i for i, line in enumerate(installs) if "torch==" in line)
    (deepspeed_at,) = [i for i, line in enumerate(installs) if line.endswith(" deepspeed")]
    assert torch_at < deepspeed_at < len(installs) - 1, installs
    assert "--no-build-isolation" in installs[deepspeed_at]
    assert "deepspeed" in pyproject_requirements(read("pyproject.toml"), extras=())


def test_line_parser_agrees_with_pyyaml():
    yaml = pytest.importorskip("yaml")
    text = read("environment.yml")
    assert parse_environment_yml(text) == yaml.safe_load(text)


def nbval_sanitizer():
    """The function nbval applies to stored and fresh outputs, built from tests/nbval_sanitize.cfg."""
    from nbval.plugin import get_sanitize_patterns

    patterns = get_sanitize_patterns(read("tests/nbval_sanitize.cfg"))
    assert len(patterns) >= 8

    def sanitize(s: str) -> str:
        for regex, replace in patterns:
            s = re.sub(regex, replace, s)
        return s
    return sanitize


def test_nbval_sanitizers_mask_what_changes_between_runs():
    sanitize = nbval_sanitizer()
    a = ("step 3 took ~0.52 s (~1,234.5 tokens/s, ~3.1 GB/s, MFU ~41.5%) on pid 4242 at 127.0.0.1:29511, "
         "run dir runs/20250101-120000-cell, object at 0x7f3a2b1c")
    b = ("step 3 took ~12ms (~98 tokens/s, ~870 MB/s, MFU ~9.0%) on pid 7 at 127.0.0.1:40001, "
         "run dir /tmp/clone/runs/20260202-080000-other, object at 0x55aa")
    assert sanitize(a) == sanitize(b)


def test_nbval_sanitizers_leave_predictions_alone():
    """Only numbers marked "~" are measurements; a computed value with a unit is compared as printed."""
    sanitize = nbval_sanitizer()
    row = "all-reduce, one buffer (flat):  0.468 s predicted, ~0.512 s measured"
    assert sanitize(row) == "all-reduce, one buffer (flat):  0.468 s predicted, ~TIME measured"
    assert sanitize("0.468 s") != sanitize("0.470 s"), "a wrong prediction would pass unnoticed"
    kept = ["    8                     256 KiB        0.143 ms        0.282 ms         75.2 ms        257.7 ms",
            "GPU         fp32 TFLOP/s  bf16 TFLOP/s",
            "H100 at 989.0 TFLOP/s, NVLink 450 GB/s, 1,234 tokens/s predicted",
            "loss 4.1732 after 20 steps, 16 MB all-reduce, world size 2, 5 min budget"]
    for line in kept:
        assert sanitize(line) == line
