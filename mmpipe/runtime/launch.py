"""Local process launcher (torchrun-style environment, no `--local_rank` argument).

`mmpipe train` starts `nproc` copies of a worker command with RANK / LOCAL_RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT set and limits each one's torch threads to its share of the cores.
Under an external launcher (torchrun, deepspeed, a cluster scheduler) those variables already
exist and the worker runs in place instead.

What it guarantees:
- **Output.** Each rank's stdout and stderr go to `LOG_DIR/rank<R>.log`; rank 0's are also
  passed to the console as they come (the progress bar, the summary).
- **A rank fails.** The launcher names it and how it ended (`rank 1 was killed by SIGKILL`,
  `rank 0 exited with status 1`) with the last lines of its output, stops the other ranks
  (SIGTERM to each rank's process group, SIGKILL after `grace_s`) and exits non-zero. A rank
  that ended on a user error (bad data with data.on_error=raise, a config mistake) leaves one
  line in `LOG_DIR/rank<R>.error` (see mmpipe.runtime.worker); the launcher prints that line
  once, however many ranks hit the same error.
- **The launcher is stopped.** SIGTERM, SIGINT or SIGHUP to the launcher is passed to every
  rank as SIGTERM; the launcher waits for them (SIGKILL after `grace_s`), says so and exits
  with 128 + the signal number. Ranks also get SIGKILL from the kernel if the launcher itself
  is killed (Linux PR_SET_PDEATHSIG), so no rank outlives it.
- **The same code.** Workers import the very `mmpipe` package the launcher runs, whatever the
  current directory holds (see worker_command).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import mmpipe
from mmpipe.runtime.host import accelerator_env, parent_death_signal, threads_per_rank
from mmpipe.runtime.worker import ERROR_PREFIX, EXIT_PEER_LOST, EXIT_USER_ERROR

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""Signals that make the launcher stop its ranks and exit."""
PEER_WAIT_S = 2.0
"""A rank that failed only because it lost a peer is a symptom: the launcher waits this long for
the rank that caused it to end too, so that it names the cause."""
TAIL_LINES = 12
"""Lines of a failed rank's output the launcher prints."""
_TAIL_BYTES = 64 * 1024


def under_external_launcher() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The worker's entry, run with `python -c`. `python -m mmpipe.runtime.worker` would put the
# current directory first on sys.path, so a `mmpipe/` folder there (a checkout, an old copy)
# would be imported instead of the launcher's package. `python -P` (3.11+) drops the directory
# but would then import the installed package even when the launcher runs another checkout
# (`python -m mmpipe` from a source tree). This drops the directory and, when a plain import
# would not find the launcher's package, puts the launcher's package root first: the workers
# run the code the launcher runs, on every Python mmpipe supports.
# When the rank is done (its files closed, its atexit handlers run, its output flushed) it
# leaves with os._exit: the interpreter's own teardown then spent 2.4 s per rank in native
# destructors (no Python frame left; measured on the 2-core machine) for nothing.
_BOOT = """\
import importlib.util, os, sys
if not getattr(sys.flags, "safe_path", False) and sys.path and sys.path[0] in ("", os.getcwd()):
    del sys.path[0]
root = sys.argv.pop(1)
spec = importlib.util.find_spec("mmpipe")
if spec is None or os.path.realpath(os.path.dirname(os.path.dirname(spec.origin))) != os.path.realpath(root):
    sys.path.insert(0, root)
from mmpipe.runtime.worker import main
code = main(sys.argv[1:])
import atexit
atexit._run_exitfuncs()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
"""


def package_root() -> str:
    """The folder holding the `mmpipe` package this process runs."""
    return str(Path(mmpipe.__file__).resolve().parent.parent)


def worker_command(*args: str) -> list[str]:
    """The command that runs `mmpipe.runtime.worker.main(args)` with this process's mmpipe."""
    return [sys.executable, "-c", _BOOT, package_root(), *args]


@dataclass(frozen=True, kw_only=True, slots=True)
class RankEnd:
    """How one rank ended."""

    rank: int
    """Its RANK."""
    code: int
    """Popen's return code: the exit status, or minus the signal that killed it."""

    def describe(self) -> str:
        if self.code < 0:
            try:
                name = signal.Signals(-self.code).name
            except ValueError:
                name = f"signal {-self.code}"
            return f"rank {self.rank} was killed by {name}"
        return f"rank {self.rank} exited with status {self.code}"

    @property
    def status(self) -> int:
        """The shell's view: 128 + the signal number for a signal."""
        return 128 - self.code if self.code < 0 else self.code


class _Rank:
    """A running rank: its process, and a thread that copies its output to its log (and, for
    rank 0, to the console), keeping the tail for the failure message."""

    def __init__(self, rank: int, proc: subprocess.Popen, log: Path, error_file: Path, echo: IO[bytes] | None):
        self.rank, self.proc, self.log, self.error_file, self.echo = rank, proc, log, error_file, echo
        self.tail = bytearray()
        self.finished = False
        self.mid_line = False
        """Whether the console was left in the middle of a line (a progress bar) by this rank."""
        self.thread = threading.Thread(target=self._pump, name=f"mmpipe-rank{rank}-output", daemon=True)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        with open(self.log, "ab", buffering=0) as log:
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                if log is not None:
                    try:
                        log.write(chunk)
                    except OSError:  # the log's disk is full: keep draining (a rank must never block)
                        log = None
                self.tail += chunk
                del self.tail[:-_TAIL_BYTES]
                if self.echo is not None:
                    try:
                        self.echo.write(chunk)
                        self.echo.flush()
                        self.mid_line = not chunk.endswith(b"\n")
                    except (OSError, ValueError):  # the console went away: keep logging
                        self.echo = None

    def last_lines(self, n: int = TAIL_LINES) -> list[str]:
        text = self.tail.decode("utf-8", "replace").replace("\r", "\n")
        return [l.rstrip() for l in text.split("\n") if l.strip()][-n:]

    def error_line(self) -> str | None:
        """The one-line user error the rank left, if any: in its error file, or, when that could
        not be written (a full disk), as the last such line of its output."""
        try:
            text = self.error_file.read_text().strip()
        except OSError:
            text = ""
        if not text:
            prefix = ERROR_PREFIX.encode()
            lines = [l for l in bytes(self.tail).splitlines() if l.startswith(prefix)]
            text = lines[-1][len(prefix):].decode("utf-8", "replace") if lines else ""
        return " ".join(text.split()) or None

    def finish(self) -> None:
        """After the process ended: drain its output, record its error line in its log too,
        and kill whatever it left in its process group (e.g. DataLoader workers)."""
        if self.finished:
            return
        self.finished = True
        _signal_group(self.proc.pid, signal.SIGKILL)
        self.thread.join(timeout=5)
        line = self.error_line()
        if line:
            try:
                with open(self.log, "a") as log:
                    log.write(f"error: {line}\n")
            except OSError:
                pass  # a full disk: the line is still said on the console


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def launch(argv: list[str], *, nproc: int, backend: str = "auto", master_port: int = 0,
           extra_env: dict[str, str] | None = None, timeout_s: float | None = None,
           log_dir: str | Path | None = None, grace_s: float = 10.0, name: str = "mmpipe train",
           console: IO[bytes] | None = None) -> int:
    """Run `argv` in `nproc` local processes and supervise them (see the module docstring).

    Args:
        log_dir: where rank<R>.log and rank<R>.error go (None: a temporary folder, removed after).
        grace_s: seconds between SIGTERM and SIGKILL when ranks are stopped.
        name: how messages start (`{name}: error: ...`).
        console: where rank 0's output is echoed (default: this process's stdout).
    Returns:
        0 when every rank exited 0; else the failing rank's exit status (128 + N for signal
        N), 128 + N when the launcher got signal N, or 124 after `timeout_s`.
    """
    if log_dir is None:
        with tempfile.TemporaryDirectory(prefix="mmpipe-logs-") as tmp:
            return launch(argv, nproc=nproc, backend=backend, master_port=master_port, extra_env=extra_env,
                          timeout_s=timeout_s, log_dir=tmp, grace_s=grace_s, name=name, console=console)
    logs = Path(log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    port = master_port or free_port()
    threads = threads_per_rank(nproc)
    base = dict(os.environ)
    base.update(accelerator_env(backend))
    base.update({
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc), "OMP_NUM_THREADS": str(threads),
        "MMPIPE_THREADS": str(threads), "PYTHONUNBUFFERED": "1",
    })
    base.update(extra_env or {})
    echo = console if console is not None else getattr(sys.stdout, "buffer", None)
    got: list[int] = []
    previous = _catch(STOP_SIGNALS, got)
    ranks: list[_Rank] = []
    try:
        preexec = parent_death_signal()
        for rank in range(nproc):
            error_file = logs / f"rank{rank}.error"
            error_file.unlink(missing_ok=True)
            env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), MMPIPE_ERROR_FILE=str(error_file))
            # Own session: a Ctrl-C in the terminal reaches the launcher only, which stops the
            # ranks in order; the group also holds each rank's DataLoader workers.
            proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=preexec)
            ranks.append(_Rank(rank, proc, logs / f"rank{rank}.log", error_file, echo if rank == 0 else None))
        for r in ranks:
            r.thread.start()
        return _supervise(ranks, got, timeout_s=timeout_s, grace_s=grace_s, name=name)
    finally:
        _stop([r for r in ranks if r.proc.poll() is None], grace_s)
        for r in ranks:
            if r.thread.ident is not None:  # started
                r.finish()
        _restore(previous)


def _supervise(ranks: list[_Rank], got: list[int], *, timeout_s: float | None, grace_s: float, name: str) -> int:
    start = time.monotonic()
    running = list(ranks)
    while running:
        ended = [RankEnd(rank=r.rank, code=r.proc.returncode) for r in running if r.proc.poll() is not None]
        running = [r for r in running if r.proc.returncode is None]
        failed = [e for e in ended if e.code != 0]
        if failed and all(e.code == EXIT_PEER_LOST for e in failed):
            failed += _wait_for_cause(running)
            running = [r for r in running if r.proc.returncode is None]
        if failed:
            for r in ranks:
                if r.proc.returncode is not None:
                    r.finish()  # drained: all a failed rank 0 said is on the console
            for r in ranks:  # what the stopped ranks say on their way out stays in their logs
                r.echo = None
        # On a stop signal rank 0 keeps echoing: with train.save_on_signal its line about the
        # step it saved is what the user waits for.
        if failed:
            first = _culprit(failed)
            _stop(running, grace_s)
            _report(first, ranks, running, name)
            return first.status
        if got:
            sig = signal.Signals(got[0])
            _say(ranks, f"{name}: got {sig.name}; stopping {len(running)} rank(s)")
            _stop(running, grace_s)
            _say(ranks, f"{name}: stopped by {sig.name}")
            return 128 + int(sig)
        if timeout_s is not None and time.monotonic() - start > timeout_s:
            _stop(running, grace_s)
            _say(ranks, f"{name}: error: the ranks ran past {timeout_s:g} s; stopped them")
            return 124
        time.sleep(0.05)
    return 0


def _wait_for_cause(running: list[_Rank]) -> list[RankEnd]:
    """The ranks (of `running`) that fail within PEER_WAIT_S."""
    deadline = time.monotonic() + PEER_WAIT_S
    while time.monotonic() < deadline:
        failed = [RankEnd(rank=r.rank, code=r.proc.returncode) for r in running
                  if r.proc.poll() is not None and r.proc.returncode != 0]
        if failed:
            return failed
        time.sleep(0.05)
    return []


def _culprit(failed: list[RankEnd]) -> RankEnd:
    """Of the ranks seen failing together, the likeliest cause: one killed by a signal, else
    one that ended on a user error, else one with another failure; a rank that only lost its
    peers comes last; ties go to the lowest rank."""
    def order(e: RankEnd) -> tuple[int, int]:
        kind = 0 if e.code < 0 else 1 if e.code == EXIT_USER_ERROR else 3 if e.code == EXIT_PEER_LOST else 2
        return kind, e.rank

    return min(failed, key=order)


def _report(end: RankEnd, ranks: list[_Rank], stopped: list[_Rank], name: str) -> None:
    rank = next(r for r in ranks if r.rank == end.rank)
    rank.finish()
    line = rank.error_line()
    if line:  # the worker's own one-line error: bad data, a config value
        _say(ranks, f"{name}: error: {line}")
        return
    others = f"; stopped rank(s) {', '.join(str(r.rank) for r in stopped)}" if stopped else ""
    if rank.rank == 0:  # its output is already on the console
        _say(ranks, f"{name}: error: {end.describe()}{others}; its output is above and in {rank.log}")
        return
    tail = rank.last_lines()
    shown = "\n".join(f"  | {l}" for l in tail) if tail else "  | (no output)"
    _say(ranks, f"{name}: error: {end.describe()}{others}; the last lines of {rank.log}:\n{shown}")


def _say(ranks: list[_Rank], text: str) -> None:
    """A launcher message on stderr, on a line of its own after a progress bar."""
    if any(r.mid_line for r in ranks):
        for r in ranks:
            r.mid_line = False
        text = "\n" + text
    print(text, file=sys.stderr, flush=True)


def _stop(ranks: list[_Rank], grace_s: float) -> None:
    """SIGTERM to each rank's process group, then SIGKILL to those still there after grace_s."""
    for r in ranks:
        if r.proc.poll() is None:
            _signal_group(r.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for r in ranks:
        try:
            r.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(r.proc.pid, signal.SIGKILL)
            r.proc.wait()


def _catch(signals: tuple[int, ...], got: list[int]) -> dict[int, object]:
    """Record the stop signals in `got` instead of dying (only the main thread may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def note(signum, _frame) -> None:
        got.append(signum)

    return {s: signal.signal(s, note) for s in signals}


def _restore(previous: dict[int, object]) -> None:
    for s, handler in previous.items():
        signal.signal(s, handler)
