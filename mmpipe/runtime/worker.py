"""One training rank: entry of each launched process, and its stop signal.

The launcher runs `main([RUN_DIR/run.yaml])` in every process (mmpipe.runtime.launch.
worker_command); under an external launcher `mmpipe train` calls `run_rank(rc)` in place.
Either way:

- **Errors.** A user error (bad data with data.on_error=raise, a bad config value, a missing
  file: ValueError and FileNotFoundError, as the CLI counts them; a write the disk refuses, full
  or read-only, naming the file) ends the rank with status 2 and one line, no traceback
  (`MMPIPE_DEBUG=1` adds it). Under mmpipe's launcher the line
  goes to the file named by MMPIPE_ERROR_FILE and the launcher prints it once for the whole
  job; elsewhere it is printed as `mmpipe train: error: ...`. Anything else is a bug: its
  traceback is printed and the status is 1.
- **Stopping.** SIGTERM, SIGINT and SIGHUP become one event, `STOP` (a StopSignal). By default
  the signal raises StopRequested in the main thread at once (the rank unwinds, closing its
  files, and exits with 128 + the signal number). Code that wants to finish a step first (e.g.
  to save a checkpoint) defers it:

      from mmpipe.runtime.worker import STOP, StopRequested

      with STOP.deferred():                 # signals now only set STOP.requested
          for step in ...:
              train one step
              if STOP.agreed(group):        # any rank of the job got one: all stop here together
                  save a checkpoint
                  raise StopRequested(STOP.requested)

  A second signal while deferred raises at once. Ranks receive a signal at slightly different
  moments, so they must agree (STOP.agreed, an all-reduce) before doing collective work like
  saving. The launcher gives them launcher.grace_s seconds before SIGKILL.
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

USER_ERRORS = (ValueError, FileNotFoundError)
"""Exceptions reported as one line (as the CLI reports config errors); SampleError is a ValueError."""
EXIT_USER_ERROR = 2
"""Status of a rank that ended on a user error."""
EXIT_PEER_LOST = 3
"""Status of a rank whose collective failed because another rank vanished: a consequence, not a
cause (the launcher names the rank that failed first)."""
PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
"""How gloo's errors say that the other end of a connection is gone."""
DISK_ERRORS = (errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS)
"""Write errors that are the run directory's disk or permissions, not a bug: one line, status 2."""
ERROR_PREFIX = "mmpipe train: error: "
"""How a rank's one-line error starts when it prints it (the launcher looks for it)."""
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""What StopSignal turns into a stop request."""


class StopRequested(BaseException):
    """A stop signal reached this rank. A BaseException, like KeyboardInterrupt: `except
    Exception` in library code does not swallow it."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"stopped by {signal.Signals(self.signum).name}")


@dataclass(kw_only=True, slots=True)
class StopSignal:
    """SIGTERM / SIGINT / SIGHUP as one catchable event of this process (see the module docstring)."""

    requested: int | None = None
    """The first stop signal received (None: none yet)."""
    defer: bool = False
    """While True the first signal only sets `requested`; see `deferred()`."""

    def install(self) -> None:
        """Handle the stop signals in this process (main thread only)."""
        for s in SIGNALS:
            signal.signal(s, self._handle)

    def _handle(self, signum: int, _frame) -> None:
        first = self.requested is None
        if first:
            self.requested = signum
        if not (self.defer and first):
            raise StopRequested(signum)

    @contextmanager
    def deferred(self) -> Iterator[StopSignal]:
        """Within the block a first signal only sets `requested`; check it where stopping is safe."""
        before, self.defer = self.defer, True
        try:
            yield self
            if self.requested is not None:
                raise StopRequested(self.requested)
        finally:
            self.defer = before

    def agreed(self, group=None) -> bool:
        """Whether any rank of `group` (default: all) has a stop request; a collective call."""
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if self.requested is not None else 0], dtype=torch.long)
        if dist.get_backend(group) == "nccl":
            flag = flag.cuda()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())


STOP = StopSignal()
"""This process's stop signal (signals belong to the process, so there is one)."""


def run_rank(rc, *, score: Path | None = None) -> int:
    """Train on this rank (or, with `score`, evaluate that committed checkpoint: `mmpipe eval`)
    with the stop signal installed and errors reported as described above. Returns the exit status."""
    from mmpipe.runtime.train import score_checkpoint, train

    STOP.install()
    try:
        if score is not None:
            score_checkpoint(rc, score)
        else:
            train(rc, stop=STOP)
    except StopRequested as stop:
        rank = os.environ.get("RANK", "?")
        print(f"rank {rank}: {stop}", file=sys.stderr, flush=True)
        return 128 + stop.signum
    except USER_ERRORS as err:
        return report_error(err)
    except OSError as err:  # the run directory's disk is full or not writable: say which file
        if err.errno not in DISK_ERRORS:
            raise
        return report_error(err, line=disk_error_line(err))
    except RuntimeError as err:
        if not any(p in str(err) for p in PEER_LOST):
            raise
        first = str(err).split(". ")[0]
        return report_error(err, line=f"rank {os.environ.get('RANK', '?')} lost contact with another rank ({first})",
                            status=EXIT_PEER_LOST)
    return 0


def disk_error_line(err: OSError) -> str:
    """One line for a write the disk refused: the file, why, the fix."""
    where = err.filename or "a file of the run directory"
    fix = ("free space on that disk, or train in a run directory on another (hydra.run.dir=DIR)"
           if err.errno in (errno.ENOSPC, errno.EDQUOT) else
           "make the run directory writable by this user, or give another (hydra.run.dir=DIR)")
    return f"cannot write {where}: {err.strerror or err}; {fix}"


def report_error(err: BaseException, *, line: str | None = None, status: int = EXIT_USER_ERROR) -> int:
    """One line for a user error (plus its traceback with MMPIPE_DEBUG=1); returns `status`.
    Where the error file cannot be written (the run directory's disk is full), the line goes to
    stderr, from which mmpipe's launcher takes it."""
    if os.environ.get("MMPIPE_DEBUG") == "1":
        traceback.print_exception(err)
    line = " ".join((line or str(err)).split())
    target = os.environ.get("MMPIPE_ERROR_FILE")
    if target:  # mmpipe's launcher prints it once for the job
        try:
            Path(target).write_text(line + "\n")
            return status
        except OSError:
            pass
    print(f"{ERROR_PREFIX}{line}", file=sys.stderr, flush=True)
    return status


def main(argv: list[str]) -> int:
    """`main([RUN_DIR/run.yaml])`: the launched process's entry; `main([JOB_DIR/run.yaml,
    CHECKPOINT])` scores that checkpoint instead (`mmpipe eval`)."""
    import yaml

    from mmpipe.config import run_config_from_dict

    path = Path(argv[0])
    try:
        rc = run_config_from_dict(yaml.safe_load(path.read_text()), run_dir=str(path.parent))
    except USER_ERRORS as err:
        return report_error(err)
    return run_rank(rc, score=Path(argv[1]) if len(argv) > 1 else None)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
