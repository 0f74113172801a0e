"""Drive the notebooks the way a learner does: a real JupyterLab, a headless Chromium, clicks.

The pieces, meant to be combined by the browser tests (tests/test_browser.py):

    require_chromium()               Chromium's path; skips the test without it (fails it when CI is set)
    jupyter_lab(folder)              context manager: a private JupyterLab server on 127.0.0.1 -> Lab
    make_lab_style()                 the options `make lab` gives JupyterLab for its look (LAB_STYLE)
    chromium_page()                  context manager: a headless Chromium tab (Playwright, sync API)
    artifacts_on_failure(page, ..)   context manager: on an exception, save a screenshot (and the server
                                     log) to tests/artifacts/<name>.png before re-raising
    open_notebook(page, lab, path)   open a notebook and wait until its kernel is idle
    run_all_cells(page)              Run > Run All Cells from the menu, wait until every cell ran
    run_notebook_in_browser(...)     the last two together; raises NotebookError if a cell failed

Nothing of the developer's own Jupyter setup leaks in: the server gets fresh config, data,
runtime, settings and workspace folders, serves a temporary copy of the notebooks, and its
kernels write run directories under a temporary LABSUPPORT_RUNS. Every process it starts is
tagged in its environment and killed when the context ends, whatever happened.
"""
from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest

REPO = Path(__file__).resolve().parent.parent
NOTEBOOKS = REPO / "notebooks"
ARTIFACTS = Path(__file__).resolve().parent / "artifacts"
CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser", "google-chrome")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
MARKER = "LABSUPPORT_BROWSER_LAB"  # environment variable that tags every process a Lab started

# Front-end settings of the private server: no toasts over the widgets, no requests to the
# internet, and every cell attached to the DOM so that tests can see all of them.
LAB_SETTINGS = {
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
        {"fetchNews": "false", "checkForUpdates": False, "doNotDisturbMode": True},
    "@jupyterlab/extensionmanager-extension/plugin.jupyterlab-settings": {"enabled": False},
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}


class NotebookError(AssertionError):
    """A notebook cell raised while the browser ran it (the message carries the traceback's last line)."""


# ---------------------------------------------------------------- Chromium

def require_chromium() -> str:
    """Path of a Chromium binary for Playwright. Without one (or without playwright) the test is
    skipped with the reason, except in CI (the CI variable is set), where it fails: there the
    browser tests must run."""
    problem = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        problem = "the playwright package is missing (pip install -e '.[dev]')"
    path = os.environ.get("LABSUPPORT_CHROMIUM")
    if path is None:
        path = next((found for name in CHROMIUM_CANDIDATES if (found := shutil.which(name))), None)
    if problem is None and not (path and os.access(path, os.X_OK)):
        problem = ("no Chromium found (looked for LABSUPPORT_CHROMIUM, " + ", ".join(CHROMIUM_CANDIDATES)
                   + "); `make browser` installs it with apt-get")
    if problem:
        if os.environ.get("CI"):
            pytest.fail(f"browser test cannot run: {problem}. In CI it must run.", pytrace=False)
        pytest.skip(f"browser test skipped: {problem}")
    return path


@contextmanager
def chromium_page(width: int = 1280, height: int = 1000, timeout_s: float = 30):
    """A page (tab) of a headless Chromium; the browser is closed afterwards."""
    executable = require_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": width, "height": height})
            page.set_default_timeout(timeout_s * 1000)
            yield page
        finally:
            browser.close()


def artifact_path(name: str, suffix: str = ".png") -> Path:
    """tests/artifacts/<name><suffix> (git-ignored), with the test name made file-safe."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_") + suffix)


@contextmanager
def artifacts_on_failure(page, name: str, lab: "Lab | None" = None):
    """Re-raise whatever fails inside, after saving a screenshot of `page` and the server log."""
    try:
        yield
    except BaseException:
        try:
            page.screenshot(path=str(artifact_path(name)), full_page=True)
        except Exception as exc:  # the page may be gone; the original failure matters more
            print(f"(no screenshot: {exc})", file=sys.stderr)
        if lab is not None and lab.log.exists():
            shutil.copyfile(lab.log, artifact_path(name, "-jupyter.log"))
        raise


# ---------------------------------------------------------------- the JupyterLab server

_WORKSPACES = itertools.count()


@dataclass
class Lab:
    """A running private JupyterLab. `url` is the base URL (ends with '/'), `root` the folder it serves."""

    url: str
    token: str
    root: Path
    runs: Path
    log: Path
    process: subprocess.Popen
    tag: str  # the MARKER value of its processes: tagged_processes(lab.tag) finds them

    def notebook_url(self, notebook: str | Path) -> str:
        """The address that opens `notebook` (a path relative to `root`, or inside it) in JupyterLab."""
        path = Path(notebook)
        relative = path.relative_to(self.root) if path.is_absolute() else path
        # A fresh workspace each time: JupyterLab otherwise restores the tabs an earlier test left
        # open, and the notebook in front might not be this one.
        workspace = f"test-{next(_WORKSPACES)}"
        return f"{self.url}lab/workspaces/{workspace}/tree/{quote(relative.as_posix())}?reset&token={self.token}"

    def api(self, path: str, timeout: float = 5):
        """GET the server's REST API (e.g. 'api/kernels'); returns the decoded JSON."""
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged_processes(tag: str) -> list:
    """Live processes whose environment carries MARKER=tag (the server, its kernels, their children)."""
    import psutil

    found = []
    needle = f"{MARKER}={tag}".encode()
    for proc in psutil.process_iter():
        try:
            if proc.pid == os.getpid() or proc.status() == psutil.STATUS_ZOMBIE:
                continue
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


def _stop_tree(process: subprocess.Popen, tag: str, grace_s: float = 10) -> None:
    """SIGTERM the server (it shuts its kernels down), then SIGKILL whatever it left behind."""
    import psutil

    try:
        family = psutil.Process(process.pid).children(recursive=True)
    except psutil.Error:
        family = []
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)
    leftovers = {p.pid: p for p in family if p.is_running()}
    leftovers.update({p.pid: p for p in tagged_processes(tag)})
    for proc in leftovers.values():
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(leftovers.values()), timeout=5)


def make_lab_style() -> list[str]:
    """The command-line options the Makefile's LAB_STYLE gives the JupyterLab of `make lab` (its custom
    CSS), one per item as the shell splits them: read from the Makefile itself, so a test that passes
    them to `jupyter_lab(extra_args=...)` starts JupyterLab as `make lab` does. Runs no target of it."""
    out = subprocess.run(["make", "--no-print-directory", "-s", "-C", str(REPO),
                          "--eval", 'print-lab-style: ; @printf "%s\\n" $(LAB_STYLE)', "print-lab-style"],
                         check=True, capture_output=True, text=True).stdout
    return out.splitlines()


@contextmanager
def jupyter_lab(notebooks: str | Path | None = None, *, ipython_dir: str | Path | None = None,
                extra_args: list[str] = (), startup_timeout_s: float = 90):
    """Start JupyterLab on 127.0.0.1 serving a temporary copy of `notebooks` (default: the repo's
    notebooks/, which may not exist yet), yield a `Lab`, and always stop it and its kernels.
    The kernels read IPython's configuration from `ipython_dir` (e.g. the one `make lab-copy`
    writes), else from an empty temporary one. `extra_args` go to JupyterLab's command line
    (e.g. `make_lab_style()`).

    The server runs this interpreter's JupyterLab (`python -m jupyterlab`), with a random token,
    no browser, LABSUPPORT_RUNS in a temporary folder and the repository on PYTHONPATH, so the
    kernels import this checkout's labsupport even without `pip install -e .`.
    """
    source = Path(notebooks) if notebooks is not None else NOTEBOOKS
    tmp = Path(tempfile.mkdtemp(prefix="labsupport-lab-"))
    root = tmp / "notebooks"
    if source.is_dir():
        shutil.copytree(source, root, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    else:
        root.mkdir()
    for name, values in LAB_SETTINGS.items():
        target = tmp / "lab-settings" / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(values))

    tag, token, port = secrets.token_hex(8), secrets.token_hex(24), free_port()
    env = {key: value for key, value in os.environ.items() if key not in ("MPLBACKEND", "JUPYTER_TOKEN")}
    env.update({
        MARKER: tag,
        "LABSUPPORT_RUNS": str(tmp / "runs"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "JUPYTER_CONFIG_DIR": str(tmp / "config"),
        "JUPYTER_DATA_DIR": str(tmp / "data"),
        "JUPYTER_RUNTIME_DIR": str(tmp / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp / "lab-settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp / "lab-workspaces"),
        "IPYTHONDIR": str(ipython_dir or tmp / "ipython"),
        "PYDEVD_DISABLE_FILE_VALIDATION": "1",  # a debugger warning that ipykernel prints otherwise
    })
    command = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               "--ServerApp.port_retries=0", f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
               "--LabApp.expose_app_in_browser=True",  # tests read the notebook model through window.jupyterapp
               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--LabApp.extension_manager=readonly", "--ServerApp.terminals_enabled=False", *extra_args]
    if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and CI runners often run as root
        command.append("--allow-root")
    log = tmp / "jupyter.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    lab = Lab(f"http://127.0.0.1:{port}/", token, root, tmp / "runs", log, process, tag)
    try:
        deadline = time.monotonic() + startup_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with code {process.returncode} while starting:\n"
                                   + lab.log_tail())
            try:
                lab.api("api/status", timeout=2)
                break
            except (urllib.error.URLError, ConnectionError, TimeoutError, json.JSONDecodeError):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"JupyterLab did not answer within {startup_timeout_s:.0f} s:\n"
                                       + lab.log_tail()) from None
                time.sleep(0.3)
        yield lab
    finally:
        _stop_tree(process, tag)
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- notebooks in the page

# JavaScript run in the page; `window.jupyterapp` exists because the server exposes it.
_NOTEBOOK_STATE_JS = """() => {
  const app = window.jupyterapp;
  const panel = app && app.shell.currentWidget;
  if (!panel || !panel.content || !panel.content.model || !panel.sessionContext) return null;
  const ctx = panel.sessionContext, kernel = ctx.session && ctx.session.kernel;
  const cells = [];
  const model = panel.content.model.cells;
  for (let i = 0; i < model.length; i++) {
    const cell = model.get(i);
    if (cell.type !== 'code') continue;
    const errors = [];
    for (let j = 0; j < cell.outputs.length; j++) {
      const out = cell.outputs.get(j).toJSON();
      if (out.output_type === 'error') errors.push(out.ename + ': ' + out.evalue);
    }
    cells.push({index: i, source: cell.sharedModel.getSource(), count: cell.executionCount, errors});
  }
  return {ready: ctx.isReady, kernel: kernel ? kernel.status : null, cells};
}"""


def notebook_state(page) -> dict | None:
    """The current notebook as the front-end sees it: kernel status and, per code cell, its
    execution count and errors. None while the notebook is not open yet."""
    return page.evaluate(_NOTEBOOK_STATE_JS)


def _accept_kernel_dialog(page) -> None:
    """A notebook without kernel metadata asks which kernel to start: take the default."""
    dialog = page.locator(".jp-Dialog .jp-Dialog-button.jp-mod-accept")
    if dialog.count():
        dialog.first.click()


def wait_for_kernel_idle(page, timeout_s: float = 60) -> None:
    """Wait until the open notebook's kernel is started and idle (the status dot reads idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = notebook_state(page)
        if state and state["ready"] and state["kernel"] == "idle":
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the notebook's kernel was not idle after {timeout_s:.0f} s (state: {state})")
        _accept_kernel_dialog(page)
        page.wait_for_timeout(250)


def open_notebook(page, lab: Lab, notebook: str | Path, timeout_s: float = 90):
    """Open `notebook` (relative to lab.root) in JupyterLab and wait until its kernel is idle."""
    page.goto(lab.notebook_url(notebook), wait_until="domcontentloaded", timeout=timeout_s * 1000)
    page.locator(".jp-NotebookPanel .jp-Notebook").first.wait_for(state="visible", timeout=timeout_s * 1000)
    wait_for_kernel_idle(page, timeout_s)
    return page


def _click_menu(page, menu: str, item: str) -> None:
    page.locator("#jp-MainMenu .lm-MenuBar-itemLabel", has_text=re.compile(rf"^{re.escape(menu)}$")).click()
    page.locator(".lm-Menu .lm-Menu-itemLabel", has_text=re.compile(rf"^{re.escape(item)}$")).click()


def run_all_cells(page, timeout_s: float = 180):
    """Clear the outputs, then Run > Run All Cells from the menu bar, and wait until every non-empty
    code cell has run and the kernel is idle. Raises NotebookError naming the first cell that failed."""
    _click_menu(page, "Edit", "Clear Outputs of All Cells")  # execution counts too, so "ran" is visible
    page.wait_for_function("""() => {
        const panel = window.jupyterapp.shell.currentWidget, cells = panel.content.model.cells;
        for (let i = 0; i < cells.length; i++) {
          const c = cells.get(i);
          if (c.type === 'code' && c.executionCount !== null) return false;
        }
        return true; }""", timeout=10_000)
    _click_menu(page, "Run", "Run All Cells")
    deadline = time.monotonic() + timeout_s
    while True:
        state = notebook_state(page)
        failed = [c for c in state["cells"] if c["errors"]]
        if failed:
            cell = failed[0]
            raise NotebookError(f"cell {cell['index']} failed: {cell['errors'][0]}\n--- source ---\n{cell['source']}")
        pending = [c["index"] for c in state["cells"] if c["source"].strip() and c["count"] is None]
        if not pending and state["kernel"] == "idle":
            return page
        if time.monotonic() > deadline:
            raise TimeoutError(f"cells {pending} had not run after {timeout_s:.0f} s (kernel {state['kernel']})")
        page.wait_for_timeout(250)


def run_notebook_in_browser(page, lab: Lab, notebook: str | Path, timeout_s: float = 180):
    """Open `notebook` (relative to lab.root), run all its cells, and return the page."""
    open_notebook(page, lab, notebook)
    return run_all_cells(page, timeout_s)


def write_notebook(path: str | Path, *cells: str) -> Path:
    """Write a minimal nbformat-4 notebook whose code cells are `cells` (python3 kernel)."""
    path = Path(path)
    notebook = {
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                     "language_info": {"name": "python"}},
        "cells": [{"cell_type": "code", "id": f"cell-{i}", "metadata": {}, "execution_count": None,
                   "outputs": [], "source": source} for i, source in enumerate(cells)],
    }
    path.write_text(json.dumps(notebook, indent=1))
    return path


def wait_for_text(locator, expected: str, timeout_s: float = 15) -> str:
    """Wait until the element's rendered text (inner_text, whitespace kept) equals `expected`;
    returns it. Unlike Playwright's to_have_text this does not collapse spaces, so column
    alignment counts. Raises AssertionError showing the last text seen."""
    deadline = time.monotonic() + timeout_s
    text = None
    while True:
        if locator.count():
            text = locator.first.inner_text().strip("\n")
            if text == expected:
                return text
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s:.0f} s the text is\n{text}\nexpected\n{expected}")
        time.sleep(0.1)


def wait_for_redraw(figure, before: str, what: str, timeout_s: float = 10) -> None:
    """Wait until the figure's image differs from `before`: the picture is a message of its own,
    arriving after the readout's."""
    deadline = time.monotonic() + timeout_s
    while figure.get_attribute("src") == before:
        assert time.monotonic() < deadline, f"the figure was not redrawn after {what}"
        time.sleep(0.1)
