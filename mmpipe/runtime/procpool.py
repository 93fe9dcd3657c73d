"""A small pool of forked worker processes that maps a function over items, in order.

Why not multiprocessing.Pool: a worker killed there (the OOM killer, a crash in a media
library) loses its task and `get()` waits forever. Why not ProcessPoolExecutor: its workers
are forked lazily from whichever thread submits first, and at exit it waits for them. Here:

- Workers are forked when the pool is made (by the thread that makes it: PR_SET_PDEATHSIG
  follows that thread), so they inherit what the function needs without pickling it.
- One item in flight per worker, each on its own pipe: an item is sent only to a worker that
  waits for one, so neither side can block on a full pipe while the other does too.
- A worker that raises sends its exception back; it is raised by `map` with the worker's
  traceback as its cause. A worker that dies is seen through its process sentinel: `map`
  raises one error naming it, never hangs.
- Workers end with the pool (`close`), with the process (daemons, terminated at exit), and
  when the process is killed (PR_SET_PDEATHSIG). They sit in their own process group, so a
  signal for the whole group (the launcher's SIGTERM, a Ctrl-C) reaches the parent, which
  ends them: a rank that saves a checkpoint on SIGTERM still has its workers for that step.

Results cross with multiprocessing's pickler, on which torch registers its reductions: a
tensor comes back through shared memory, not through the pipe.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from multiprocessing.connection import wait
from typing import Any

from mmpipe.runtime.host import parent_death_signal


class WorkerTraceback(Exception):
    """The traceback of an exception raised in a worker (the cause of the one re-raised)."""


class WorkerDied(RuntimeError):
    """A worker process ended without answering."""


def _serve(fn: Callable[[Any], Any], init: Callable[[], None] | None, conn, parent: int) -> None:
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)  # not the rank's inherited stop handler
    os.setpgid(0, 0)
    arm = parent_death_signal()
    if arm is not None:
        arm()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(0)
    if init is not None:
        init()
    while True:
        try:
            item = conn.recv()
        except EOFError:
            return
        try:
            reply = (True, fn(item))
        except BaseException as err:  # noqa: BLE001 - sent to the parent
            reply = (False, err, traceback.format_exc())
        try:
            conn.send(reply)
        except Exception:  # noqa: BLE001 - an exception that does not pickle
            conn.send((False, RuntimeError(f"{type(reply[-2]).__name__}: {reply[-2]}"), reply[-1]))


class ProcessPool:
    """`workers` forked processes running `fn` (0: `map` runs it in the calling thread)."""

    def __init__(self, fn: Callable[[Any], Any], workers: int, *, name: str = "mmpipe-worker",
                 init: Callable[[], None] | None = None):
        self.fn = fn
        self.workers = workers
        self._procs: list = []
        self._conns: list = []
        self._broken: str | None = None
        ctx = mp.get_context("fork")
        for k in range(workers):
            mine, theirs = ctx.Pipe(duplex=True)
            p = ctx.Process(target=_serve, args=(fn, init, theirs, os.getpid()), name=f"{name}-{k}", daemon=True)
            p.start()
            theirs.close()
            self._procs.append(p)
            self._conns.append(mine)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def map(self, items: Sequence[Any], *, what: Callable[[Any], str] = repr) -> list[Any]:
        """fn(item) for each item, in order. `what(item)` names an item in a dead worker's error."""
        if self._broken:
            raise WorkerDied(self._broken)
        if not self.workers:
            return [self.fn(x) for x in items]
        out: list[Any] = [None] * len(items)
        todo, idle, busy = deque(range(len(items))), list(range(len(self._procs))), {}
        try:
            while todo or busy:
                while todo and idle:
                    w, j = idle.pop(), todo.popleft()
                    self._conns[w].send(items[j])
                    busy[w] = j
                ready = wait([self._conns[w] for w in busy] + [self._procs[w].sentinel for w in busy])
                for w in [w for w in busy if self._conns[w] in ready or self._procs[w].sentinel in ready]:
                    j = busy.pop(w)
                    try:
                        reply = self._conns[w].recv()
                    except (EOFError, OSError):
                        raise self._died(w, what(items[j])) from None
                    if not reply[0]:
                        self._broken = f"a worker raised {type(reply[1]).__name__}: {reply[1]}"
                        raise reply[1] from WorkerTraceback(reply[2])
                    out[j] = reply[1]
                    idle.append(w)
        except BaseException:
            self.close()  # the others' answers to this map would be read by the next one
            raise
        return out

    def _died(self, w: int, what: str) -> WorkerDied:
        p = self._procs[w]
        p.join(timeout=5)
        code = p.exitcode
        how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0
               else f"exited with status {code}")
        self._broken = (f"{p.name} (pid {p.pid}) {how} while working on {what}; the kernel's OOM killer or a "
                        f"crash in a native library are the usual causes")
        return WorkerDied(self._broken)

    def close(self) -> None:
        """Kill the workers (idempotent)."""
        if self._broken is None and self.workers:
            self._broken = "the pool is closed"
        for p in self._procs:
            if p.exitcode is None:
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []
