"""An idle timeout: call `expire()` once nothing has used a resource for a while.

The interactive ranks (labsupport.pool) hold memory between cells; a pool nobody uses ends itself
after its idle limit, as a Jupyter server can cull idle kernels (`cull_idle_timeout`). Each use calls
`touch()`; a watcher thread sleeps until the limit since the last use has passed, then calls
`expire()` holding `lock`: the pool holds the same lock while a cell runs, so a cell longer than
the limit is never cut, and the watcher looks again once the cell is over.
"""
from __future__ import annotations

import threading
import time


class IdleTimer:
    """Call `expire()` (holding `lock`) once `touch()` has not been called for `seconds`; `cancel()` stops it."""

    def __init__(self, seconds: float, lock, expire):
        self.seconds, self._lock, self._expire = seconds, lock, expire
        self._last = time.monotonic()
        self._cancelled = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="labsupport-idle-timer").start()

    def touch(self) -> None:
        """A use: the limit counts from now."""
        self._last = time.monotonic()

    def cancel(self) -> None:
        """Never expire (what it watched has ended); the watcher quits at its next look."""
        self._cancelled.set()

    def _watch(self) -> None:
        while not self._cancelled.wait(max(self._last + self.seconds - time.monotonic(), 0.05)):
            with self._lock:
                if self._cancelled.is_set():  # cancelled while we waited for the lock
                    return
                if time.monotonic() - self._last >= self.seconds:
                    self._expire()
                    return
