"""Memory per attendee: each open notebook's kernel and its interactive ranks, measured.

    python tests/pool_memory.py notebooks/04_tensor_parallel.ipynb notebooks/05_pipeline_parallel.ipynb
    python tests/pool_memory.py NB1 NB2 --then "%ranks stop --others"      # run in the last kernel, then measure
    python tests/pool_memory.py NB1 NB2 --idle-minutes 1 --wait 90          # the kernels' idle limit; measure later

Each notebook is opened as JupyterLab opens it: a python3 kernel in the notebook's folder, with
JPY_SESSION_NAME naming the notebook. All its code cells run in order (Run All; a cell that fails
is reported and the next one runs, as Run All does not), and its kernel stays up, as it does while
the notebook's tab is open. After each notebook, after `--then` and after `--wait`, the script
prints every kernel's own memory and that of its pool's controller and engines (its descendants),
read from /proc: RSS (VmRSS in /proc/PID/status, what `ps` and `top` show; shared library pages
count in every process that maps them) and PSS (Pss in /proc/PID/smaps_rollup: each shared page
divided among the processes that share it, so PSS adds up to what the node holds). The kernels end
with the script (their pools with them).
"""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from labsupport.launch import descendants  # noqa: E402

MB = 1e6


def memory(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of `pid` in bytes; (0, 0) once it has exited."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return 0.0, 0.0

    def field(text, name):
        line = next((line for line in text.splitlines() if line.startswith(name + ":")), None)
        return float(line.split()[1]) * 1024 if line else 0.0  # kB
    return field(status, "VmRSS"), field(rollup, "Pss")


def role(pid: int) -> str:
    """controller, engine or other; "exited" for a process gone or a zombie (no memory, not yet reaped)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "exited"
    if state == "Z":
        return "exited"
    for name in ("controller", "engine"):
        if f"ipyparallel.{name}" in args:
            return name
    return "other"


def measure(kernels: list[tuple[str, int]], title: str) -> None:
    """One table: per kernel, its own memory and its descendants' by role; then the totals."""
    print(f"\n{title}")
    print(f"  {'notebook':<28}{'process':<12}{'count':>6}{'RSS MB':>9}{'PSS MB':>9}")
    total = {"all": [0.0, 0.0], "kernels": [0.0, 0.0], "pools": [0.0, 0.0]}
    for name, pid in kernels:
        groups = {"kernel": [pid]}
        for child in descendants(pid):
            groups.setdefault(role(child), []).append(child)
        for what, pids in groups.items():
            rss, pss = (sum(m) for m in zip(*(memory(p) for p in pids)))
            if what == "exited":
                continue
            print(f"  {name:<28}{what:<12}{len(pids):>6}{rss / MB:>9.0f}{pss / MB:>9.0f}")
            for key in ("all", "kernels" if what == "kernel" else "pools"):
                total[key][0] += rss
                total[key][1] += pss
    for key, (rss, pss) in total.items():
        print(f"  {'total: ' + key:<40}{rss / MB:>15.0f}{pss / MB:>9.0f}")


def run_all(kc, path: Path) -> tuple[int, float]:
    """Run every code cell of the notebook in the kernel; (cells that failed, seconds). What a cell prints
    about interactive ranks (the pool's notes on memory) is shown."""
    import nbformat
    nb = nbformat.read(path, as_version=4)
    failed, began = 0, time.monotonic()

    def show(msg):
        text = msg["content"].get("text", "")
        if "interactive ranks" in text or "%ranks stop --others" in text:
            print("  " + text.strip().replace("\n", "\n  "), flush=True)
    for cell in nb.cells:
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        reply = kc.execute_interactive(cell.source, timeout=900, output_hook=show)
        if reply["content"]["status"] != "ok":
            failed += 1
            print(f"  {path.name}: a cell failed: {reply['content'].get('ename')}: "
                  f"{str(reply['content'].get('evalue'))[:120]}", flush=True)
    return failed, time.monotonic() - began


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("notebooks", nargs="+", type=Path)
    p.add_argument("--then", help="code to run in the last notebook's kernel, then measure again")
    p.add_argument("--idle-minutes", type=float, help="LABSUPPORT_POOL_IDLE_MINUTES for the kernels")
    p.add_argument("--wait", type=float, default=0, help="seconds to wait at the end, then measure again")
    args = p.parse_args()
    from jupyter_client.manager import start_new_kernel

    print(f"{platform.node()}: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"python {platform.python_version()}; {' '.join(sys.argv[1:])}")
    runs = tempfile.TemporaryDirectory(prefix="pool-memory-")
    env = {**os.environ, "LABSUPPORT_RUNS": runs.name, "PYTHONPATH": str(REPO)}
    if args.idle_minutes is not None:
        env["LABSUPPORT_POOL_IDLE_MINUTES"] = str(args.idle_minutes)
    kernels, managers = [], []
    try:
        for path in args.notebooks:
            path = path.resolve()
            km, kc = start_new_kernel(kernel_name="python3", cwd=str(path.parent),
                                      env={**env, "JPY_SESSION_NAME": str(path)})
            managers.append((km, kc))
            kernels.append((path.stem, km.provisioner.process.pid))
            failed, seconds = run_all(kc, path)
            measure(kernels, f"after Run All of {path.name} ({seconds:.0f} s, {failed} cells failed):")
        if args.then:
            out = []
            managers[-1][1].execute_interactive(
                args.then, timeout=120, output_hook=lambda msg: out.append(msg["content"].get("text", "")))
            print(f"\n{args.then} (in {args.notebooks[-1].name}) printed: {''.join(out).strip()}")
            measure(kernels, f"after {args.then}:")
        if args.wait:
            time.sleep(args.wait)
            measure(kernels, f"{args.wait:.0f} s later:")
    finally:
        for km, kc in managers:
            kc.stop_channels()
            km.shutdown_kernel(now=False)
        runs.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
