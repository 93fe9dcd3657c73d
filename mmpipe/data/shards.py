"""Shard URLs: brace lists, resolving, splitting by replica and worker, preflight, opening.

`data.path` is a brace list of shard files such as `data/shards/train-{000000..000007}.tar`,
or a `pipe:` command such as `pipe:cat data/shards/train-{000000..000007}.tar`, brace-expanded
into one command per shard. Shards are split between replicas by `dp_rank` / `dp_size` (shard
k goes to replica k % dp_size) and then between a replica's loader workers (the replica's
j-th shard to worker j % num_workers), never by the RANK environment variable: every pipeline
stage of a replica runs its own reader and must see the same samples in the same order, so
the split depends only on the arguments. See docs/data.md.
"""

from __future__ import annotations

import shlex
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import braceexpand

from mmpipe.data.tario import ShardError, iter_groups, iter_members, skip_bytes

_SIGPIPE = (-13, 141)
"""Exit statuses of a command killed by SIGPIPE because we stopped reading."""


@dataclass(frozen=True, slots=True)
class Shard:
    """One shard of the full, expanded shard list."""

    url: str
    """A local path or `pipe:COMMAND` (whose stdout is the tar)."""
    index: int
    """Position in the full shard list (limits and resume refer to it)."""

    @property
    def name(self) -> str:
        """Short name for logs: the file name, or for a command the last `*.tar*` word in it."""
        if not self.url.startswith("pipe:"):
            return Path(self.url).name
        try:
            words = shlex.split(self.url[5:])
        except ValueError:
            words = self.url[5:].split()
        tars = [w for w in words if ".tar" in w]
        return Path(tars[-1]).name if tars else self.url[:48]


def shard_name(url: str) -> str:
    """Short name of a shard URL for logs (see Shard.name)."""
    return Shard(url, 0).name


# ---------------------------------------------------------------------------- shard lists

def resolve_urls(path: str, *, root: Path | None = None) -> list[str]:
    """Shard URLs of data.path: existing local files (checked) or `pipe:` commands.

    Relative file names resolve against the working directory, then `root`.

    Raises:
        FileNotFoundError: when no file, or only some of the files, exist.
    """
    if not path:
        raise ValueError("data.path is empty; give a brace list such as data/shards/train-{000000..000007}.tar")
    if path.lstrip().startswith("pipe:"):
        urls = list(braceexpand.braceexpand(path.strip()))
        if any(not u[5:].strip() for u in urls):
            raise ValueError(f"data.path={path!r}: a pipe: URL needs a command, e.g. pipe:cat shard-{{0..3}}.tar")
        return urls
    names = list(braceexpand.braceexpand(path))
    found: list[str] = []
    missing: list[str] = []
    for name in names:
        p = Path(name)
        candidates = [p] if p.is_absolute() else [Path.cwd() / p] + ([Path(root) / p] if root else [])
        hit = next((c for c in candidates if c.is_file()), None)
        if hit is None:
            missing.append(name)
        else:
            found.append(str(hit))
    looked = f"cwd {Path.cwd()}" + (f" and root {root}" if root else "")
    if not found:
        raise FileNotFoundError(
            f"data.path={path!r} matches no file (looked in {looked}); generate the shipped "
            f"shards with `python -m mmpipe.data.synth --out data/` or fix the path"
        )
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise FileNotFoundError(
            f"data.path={path!r}: {len(missing)} of {len(names)} shards are missing ({shown}; "
            f"looked in {looked}); fix the brace range or regenerate the data"
        )
    return found


def shards_for_reader(shards: list[Any], *, dp_rank: int, dp_size: int, worker_id: int = 0,
                      num_workers: int = 1, key: str = "data.path") -> list[Any]:
    """The shards of loader worker `worker_id` of replica `dp_rank`.

    Replica r reads shards r, r + dp, r + 2dp, ...; its worker j the j-th, (j+W)-th, ... of
    those. Every reader needs at least one shard: fewer shards than dp x workers is an error
    (a reader without shards would hang its replica's pipeline).
    """
    if dp_size < 1:
        raise ValueError(f"parallel.dp={dp_size} must be >= 1")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} is outside 0..{dp_size - 1} (parallel.dp={dp_size})")
    if num_workers < 1:
        raise ValueError(f"data.num_workers={num_workers} must be >= 1")
    if not 0 <= worker_id < num_workers:
        raise ValueError(f"worker_id={worker_id} is outside 0..{num_workers - 1} (data.num_workers={num_workers})")
    readers = dp_size * num_workers
    if len(shards) < readers:
        if num_workers == 1:
            raise ValueError(
                f"{key} has {len(shards)} shard(s) but parallel.dp={dp_size}; every replica needs "
                f"at least one shard: lower parallel.dp to <= {len(shards)} or write more shards"
            )
        raise ValueError(
            f"{key} has {len(shards)} shard(s) but parallel.dp x data.num_workers = {dp_size} x {num_workers} "
            f"= {readers} readers; every reader needs at least one shard: lower data.num_workers to "
            f"<= {max(1, len(shards) // dp_size)} or write more shards"
        )
    return shards[dp_rank::dp_size][worker_id::num_workers]


def check_shards(path: str, *, root: Path | None = None, dp_size: int = 1, num_workers: int = 1) -> list[str]:
    """Preflight: the shard list resolves and gives every reader a shard. Returns the URLs."""
    urls = resolve_urls(path, root=root)
    shards_for_reader(urls, dp_rank=0, dp_size=dp_size, num_workers=num_workers)
    return urls


# ---------------------------------------------------------------------------- opening

@contextmanager
def open_shard(url: str) -> Iterator[tuple[IO[bytes], bool, Callable[[], None]]]:
    """(stream, seekable, finish) for a local path or a `pipe:` command.

    `finish()` is called after a complete read: for a command it reads what is left and
    raises ShardError on a non-zero exit status. A ShardError inside the block is re-raised
    naming the command's status and stderr when the command failed.
    """
    if not url.startswith("pipe:"):
        try:
            fh = open(url, "rb", buffering=1 << 20)
        except OSError as err:
            raise ShardError(f"cannot open: {err.strerror or err}") from None
        with fh:
            yield fh, True, lambda: None
        return
    cmd = url[5:].strip()
    with tempfile.TemporaryFile() as err_file:
        proc = subprocess.Popen(cmd, shell=True, stdout=subprocess.PIPE, stderr=err_file, bufsize=1 << 20)
        assert proc.stdout is not None

        def failure(status: int) -> ShardError:
            err_file.seek(0)
            tail = err_file.read()[-400:].decode("utf-8", "replace").strip().replace("\n", " | ")
            return ShardError(f"command {cmd!r} exited with status {status}" + (f": {tail}" if tail else ""))

        def finish() -> None:
            skip_bytes(proc.stdout, 1 << 62, False)  # the tar's end padding; a writer must not get SIGPIPE
            status = proc.wait()
            if status != 0:
                raise failure(status)

        try:
            yield proc.stdout, False, finish
        except ShardError:
            proc.stdout.close()
            try:
                status = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                status = None
            if status not in (None, 0, *_SIGPIPE):
                raise failure(status) from None
            raise
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()


def read_shard(shard: Shard, *, select: Callable[[str], bool] | None = None) -> Iterator[dict]:
    """The samples of one shard, each with `__key__`, `__url__`, `__shard__` (index) and
    `__ordinal__` (position in the shard).

    Raises:
        ShardError: after yielding the samples before the damage.
    """
    with open_shard(shard.url) as (f, seekable, finish):
        for ordinal, sample in enumerate(iter_groups(iter_members(f, select=select, seekable=seekable))):
            sample["__url__"] = shard.url
            sample["__shard__"] = shard.index
            sample["__ordinal__"] = ordinal
            yield sample
        finish()


def count_samples(shard: Shard) -> int:
    """Samples in a shard, from the headers alone (member data is skipped, not read)."""
    return sum(1 for _ in read_shard(shard, select=lambda name: False))
