"""Which notebooks hold interactive ranks: a per-user registry of pools (labsupport.pool).

Every open notebook can start a pool, and each pool holds memory (see labsupport.pool). So each
kernel that runs a pool writes down one small JSON file, PID.json in `registry_dir()` (PID: the
kernel's process id): its processes, port, kernel, notebook and last use. A notebook that starts a pool reads the others' files (`other_pools`),
measures what their processes hold, and names them (`others_line`); `%ranks stop --others`
ends them (RankPool.stop_others), first leaving PID.stopped (`leave_stop_note`), which the owner
reads at its next cell (`read_stop_note`) to say who stopped its ranks.

A process id is reused once its process is gone, so the registry names a process by its id and
its start time (`_start_ticks`): a file whose kernel is gone (killed before its exit hook ran)
is removed by the next reader. Files are written whole and renamed into place, so no one ever
reads half of one. The registry is best effort: where it cannot be written (a read-only home),
notebooks lose the notice, never their ranks.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .launch import descendants

REGISTRY_ENV = "LABSUPPORT_POOL_REGISTRY"  # the registry's folder, if not the Jupyter runtime dir's
TOUCH_S = 5  # how often, at most, a pool writes its last use into its file


def registry_dir() -> Path:
    """$LABSUPPORT_POOL_REGISTRY, else labsupport-pools/ in Jupyter's runtime dir (per user; on a
    JupyterHub, in the user's home)."""
    if os.environ.get(REGISTRY_ENV):
        return Path(os.environ[REGISTRY_ENV])
    from jupyter_core.paths import jupyter_runtime_dir
    return Path(jupyter_runtime_dir()) / "labsupport-pools"


# ---------------------------------------------------------------- this kernel's own entry

def register(nproc: int, port: int, run_dir: Path, pids: list[int], idle_minutes: float) -> dict:
    """Write down the pool this kernel just started (`pids`: its controller's and engines'); its entry."""
    entry = {**_this_kernel(), "nproc": nproc, "port": port, "run_dir": str(run_dir),
             "pids": {str(pid): _start_ticks(pid) for pid in pids},
             "idle_minutes": idle_minutes, "started": time.time(), "last_used": time.time()}
    _write(entry)
    return entry


def touch(entry: dict) -> None:
    """After a cell: the entry's last use, written at most every TOUCH_S (a cell may take milliseconds)."""
    if time.time() - entry["last_used"] > TOUCH_S:
        entry["last_used"] = time.time()
        _write(entry)


def unregister() -> None:
    """This kernel's pool has ended: its file goes, and the note of whoever stopped it."""
    _remove(os.getpid())


def read_stop_note() -> str | None:
    """Who stopped this kernel's ranks (the note `leave_stop_note` left), once; None if nobody did."""
    note = registry_dir() / f"{os.getpid()}.stopped"
    try:
        by = json.loads(note.read_text())["by"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        by = "another notebook"
    try:
        note.unlink()
    except OSError:
        pass
    return str(by)


def _this_kernel() -> dict:
    """Who owns a pool: this process (its id and start), its parent (the Jupyter server), kernel and notebook."""
    return {"owner": os.getpid(), "owner_start": _start_ticks(os.getpid()), "parent": os.getppid(),
            "notebook": os.environ.get("JPY_SESSION_NAME") or None, "kernel": _kernel_id()}


def _kernel_id() -> str | None:
    """This Jupyter kernel's id (a Jupyter server names its connection file kernel-ID.json; other clients
    name it as they like: then its name); None outside a kernel."""
    if "ipykernel" not in sys.modules:
        return None
    try:
        from ipykernel.connect import get_connection_file
        name = Path(get_connection_file()).stem
    except Exception:  # not in a kernel after all
        return None
    return name.removeprefix("kernel-")


def _write(entry: dict) -> None:
    folder = registry_dir()
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        part = folder / f".{entry['owner']}.json.part"
        part.write_text(json.dumps(entry))
        os.replace(part, folder / f"{entry['owner']}.json")
    except OSError:
        pass


def _remove(owner: int) -> None:
    folder = registry_dir()
    for name in (f"{owner}.json", f"{owner}.stopped"):
        try:
            (folder / name).unlink()
        except OSError:
            pass


# ---------------------------------------------------------------- other notebooks' pools

def other_pools() -> list[dict]:
    """The pools that other notebooks of this user hold on the same Jupyter server: the registry's
    entries whose owner is another Jupyter kernel with our parent (the server; in a test, the test),
    still running, not already stopped. Each entry gains "memory" (bytes, see _memory). Files of
    kernels that are gone are removed (their pools died with them, see pool._serve)."""
    folder = registry_dir()
    try:
        files = sorted(folder.glob("*.json"))
    except OSError:
        return []
    found = []
    for path in files:
        try:
            entry = json.loads(path.read_text())
            owner = int(entry["owner"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if owner == os.getpid():
            continue
        if _start_ticks(owner) != entry.get("owner_start"):  # its kernel is gone
            _remove(owner)
            continue
        if not entry.get("kernel") or entry.get("parent") != os.getppid() or (folder / f"{owner}.stopped").exists():
            continue
        processes = live_processes(entry)
        if processes:
            entry["memory"] = _memory(processes)
            found.append(entry)
    return found


def live_processes(entry: dict) -> list[int]:
    """The entry's processes that still run (the same processes: same id, same start), and everything they started."""
    pids = [int(pid) for pid, ticks in entry.get("pids", {}).items() if _start_ticks(pid) == ticks]
    return [p for pid in pids for p in (pid, *descendants(pid))]


def leave_stop_note(owner: int) -> None:
    """Tell the kernel `owner` that this notebook stopped its ranks (it reads the note with read_stop_note)."""
    try:
        (registry_dir() / f"{owner}.stopped").write_text(json.dumps({"by": _label(_this_kernel()), "at": time.time()}))
    except OSError:
        pass


def others_line(others: list[dict]) -> str:
    """What a pool's start prints when other notebooks hold ranks: a line for each (its memory, how long it
    has been idle), and the call that stops them."""
    def idle(entry):
        minutes = int((time.time() - entry["last_used"]) // 60)
        return "used in the last minute" if minutes < 1 else f"idle for {minutes} min"
    lines = [f"{_label(e)} still holds {e['nproc']} interactive ranks ({_gb(e['memory'])}, {idle(e)})."
             for e in others]
    lines.append("`%ranks stop --others` stops them; that notebook starts them again when it needs them."
                 if len(others) == 1 else f"`%ranks stop --others` stops them all "
                 f"({_gb(sum(e['memory'] for e in others))}); each notebook restarts its own when needed.")
    return "\n".join(lines)


def stopped_line(stopped: list[dict]) -> str:
    """What `%ranks stop --others` prints: the pools it stopped (entries of other_pools), or that there were none."""
    return "\n".join(f"stopped the {e['nproc']} ranks of {_label(e)} ({_gb(e['memory'])}); it starts them "
                     f"again when it needs them" for e in stopped) or "no other notebook holds interactive ranks"


def _label(entry: dict) -> str:
    if entry.get("notebook"):
        return Path(entry["notebook"]).name
    if entry.get("kernel"):
        return f"the notebook of kernel {entry['kernel'][:8]}"
    return f"process {entry['owner']}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


# ---------------------------------------------------------------- processes, from /proc

def _start_ticks(pid) -> int | None:
    """When process `pid` started (clock ticks since boot): with the pid, it names one process, even after
    the pid is reused. None if there is no such process."""
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _memory(pids) -> int:
    """What the processes hold, in bytes: their PSS (each shared page divided among the processes that map
    it, so sums mean something), or their RSS where /proc has no smaps_rollup."""
    total = 0
    for pid in pids:
        for path, field in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
            try:
                with open(path) as f:
                    line = next((line for line in f if line.startswith(field)), None)
            except OSError:
                continue
            if line is not None:
                total += int(line.split()[1]) * 1024
                break
    return total
