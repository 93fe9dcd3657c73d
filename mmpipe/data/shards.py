"""Shard URLs: brace lists, resolving, splitting by replica and worker, preflight, opening.

`data.path` is webdataset's URL list: brace lists (`train-{000000..000007}.tar`), several of
them joined by `::`, and `${NAME}` replaced by the environment variable `WDS_NAME`. Each URL
is opened by webdataset's own opener (`webdataset.gopen`):

- a local file (relative names resolve against the working directory, then the project
  root; `file:` URLs too): checked up front, a missing one is an error before launch;
- `pipe:COMMAND`: a shell command whose stdout is the tar (e.g.
  `pipe:aws s3 cp s3://bucket/train-{0..9}.tar -`);
- `http://`, `https://` (with curl), `gs://` (with gsutil) and the other schemes webdataset
  knows; a scheme it does not know is an error before launch.

`.tar` and gzip-compressed `.tar.gz` shards are read (recognised by their first bytes). What
the opener gives is parsed by mmpipe's strict tar reader (mmpipe.data.tario): a cut, garbage
or a failed command or download is one counted `corrupt shard` error naming the shard.

Shards are split between replicas by `dp_rank` / `dp_size` (shard k goes to replica
k % dp_size) and then between a replica's loader workers (the replica's j-th shard to worker
j % num_workers), never by the RANK environment variable: every pipeline stage of a replica
runs its own reader and must see the same samples in the same order, so the split depends
only on the arguments. See docs/data.md.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import zlib
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator
from urllib.parse import urlparse
from urllib.request import url2pathname

from webdataset import utils as wds_utils
from webdataset.gopen import Pipe, gopen, gopen_schemes
from webdataset.shardlists import expand_urls

from mmpipe.data.skips import SampleError
from mmpipe.data.tario import ShardError, iter_groups, iter_members, read_upto, skip_bytes, split_name

_EARLY_STOP = (-13, 141)
"""Exit statuses of a command killed by SIGPIPE because we stopped reading."""
_TOOLS = {"http": "curl", "https": "curl", "gs": "gsutil"}
"""The programs webdataset.gopen runs for these schemes (checked up front)."""
_CURL_EXITS = {6: "could not resolve the host", 7: "could not connect to the server",
               18: "the transfer ended early", 22: "the server answered with an HTTP error such as 404",
               28: "the transfer timed out", 56: "the connection broke while receiving data"}
"""curl's exit statuses a shard download meets most (curl -s prints no message of its own)."""
_ENV = re.compile(r"\$\{(\w+)\}")


@dataclass(frozen=True, slots=True)
class Shard:
    """One shard of the full, expanded shard list."""

    url: str
    """A resolved local path, `pipe:COMMAND` (whose stdout is the tar) or a URL webdataset opens."""
    index: int
    """Position in the full shard list (limits and resume refer to it)."""

    @property
    def name(self) -> str:
        """Short name for logs: the file name, or for a command the last `*.tar*` word in it."""
        if self.url.startswith("pipe:"):
            try:
                words = shlex.split(self.url[5:])
            except ValueError:
                words = self.url[5:].split()
            tars = [w for w in words if ".tar" in w]
            return _basename(tars[-1]) if tars else self.url[:48]
        return _basename(self.url)


def _basename(url: str) -> str:
    return Path(url if is_local(url) else urlparse(url).path).name


def shard_name(url: str) -> str:
    """Short name of a shard URL for logs (see Shard.name)."""
    return Shard(url, 0).name


def scheme_of(url: str) -> str:
    """`pipe`, `` for a local path, `file`, or the URL scheme (`http`, `gs`, ...)."""
    if url.startswith("pipe:"):
        return "pipe"
    scheme = urlparse(url).scheme
    return "" if len(scheme) == 1 else scheme  # c:/x is a drive, not a scheme


def is_local(url: str) -> bool:
    """True for a (resolved) local file path."""
    return scheme_of(url) == ""


# ---------------------------------------------------------------------------- shard lists

def expand(path: str, *, key: str = "data.path") -> list[str]:
    """The URLs of a shard list as webdataset expands it: `::` lists, `${NAME}` from the
    environment variable WDS_NAME, brace lists."""
    if not path or not path.strip():
        raise ValueError(f"{key} is empty; give a brace list such as data/shards/train-{{000000..000007}}.tar")
    for name in _ENV.findall(path):
        if f"WDS_{name}" not in os.environ:
            raise ValueError(
                f"{key}={path!r}: ${{{name}}} is read from the environment variable WDS_{name} "
                f"(webdataset's convention), which is not set; set it, or write ${name} without braces "
                f"inside a pipe: command for the shell to expand")
    urls = [u.strip() for u in expand_urls(path)]
    if any(not u for u in urls):
        raise ValueError(f"{key}={path!r} has an empty entry (a stray '::'?)")
    return urls


_GLOB = re.compile(r"[*?\[]")
SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
"""What a file in a folder given as data.path must end with to be read as a shard."""


def _local_files(name: str, root: Path | None) -> tuple[list[str], str]:
    """The files a local entry of data.path stands for, and how it was read: `file` (one file),
    `folder` (its *.tar / *.tar.gz files, in name order), `glob` (the matches, sorted), or `` (no
    match). Relative names are tried in the working directory, then under `root`."""
    p = Path(name).expanduser()
    bases = [Path("")] if p.is_absolute() else [Path.cwd()] + ([Path(root)] if root else [])
    for base in bases:
        if _GLOB.search(name):
            hits = sorted(str(Path(h).absolute()) for h in glob.glob(str(base / p)) if Path(h).is_file())
            if hits:
                return hits, "glob"
            continue
        c = base / p
        if c.is_file():
            return [str(c)], "file"
        if c.is_dir():
            return sorted(str(f) for f in c.iterdir() if f.is_file() and f.name.endswith(SHARD_SUFFIXES)), "folder"
    return [], ""


def _no_file_hint(name: str, root: Path | None) -> str:
    """The fix for a local entry that matches nothing: regenerating the shipped shards only when
    the entry names them."""
    shipped = Path(root) / "data" / "shards" if root else None
    p = Path(name)
    if (not p.is_absolute() and p.parts[:2] == ("data", "shards")) or (
            shipped is not None and p.is_absolute() and p.is_relative_to(shipped)):
        return "regenerate the shipped shards with `python -m mmpipe.data.synth --out data/` or fix the path"
    return ("fix the path: give shard files (a brace list such as train-{000000..000009}.tar), a folder of "
            "*.tar shards, or a glob such as DIR/*.tar")


def resolve_urls(path: str, *, root: Path | None = None, key: str = "data.path") -> list[str]:
    """Shard URLs of data.path: local files (checked, made absolute), `pipe:` commands and
    URLs of schemes webdataset opens (not checked here: a failure is a counted error).

    Relative file names resolve against the working directory, then `root`. A local entry that
    is a folder stands for the *.tar / *.tar.gz files in it, in name order (not its subfolders);
    one holding `*`, `?` or `[` is a glob, its matches sorted (`expansions` says what each became).

    Raises:
        FileNotFoundError: when no local file, or only some of the local files, exist.
        ValueError: an empty pipe: command, a scheme webdataset cannot open, an unset WDS_ variable,
            a folder without shards.
    """
    urls = expand(path, key=key)
    out: list[str] = []
    missing: list[str] = []
    local = 0
    for url in urls:
        scheme = scheme_of(url)
        if scheme == "pipe":
            if not url[5:].strip():
                raise ValueError(f"{key}={path!r}: a pipe: URL needs a command, e.g. pipe:cat shard-{{0..3}}.tar")
            out.append(url)
            continue
        if scheme not in ("", "file"):
            if scheme not in gopen_schemes:
                example = "pipe:aws s3 cp s3://bucket/train-{0..9}.tar -" if scheme == "s3" else \
                    "pipe:COMMAND that writes the tar to stdout"
                raise ValueError(
                    f"{key}={path!r}: webdataset has no opener for {scheme}:// URLs (it opens local files, "
                    f"pipe:, {', '.join(k + '://' for k in sorted(gopen_schemes) if k not in ('__default__', 'pipe'))}); "
                    f"use a command instead, e.g. {example}")
            out.append(url)
            continue
        local += 1
        name = url2pathname(urlparse(url).path) if scheme == "file" else url
        files, how = _local_files(name, root)
        if how == "folder" and not files:
            raise ValueError(f"{key}={path!r}: {name} is a folder with no {' / '.join('*' + s for s in SHARD_SUFFIXES)} "
                             f"shards in it; give the folder that holds the shards, or the shard files")
        if not files:
            missing.append(name)
        out.extend(files)
    looked = f"cwd {Path.cwd()}" + (f" and root {root}" if root else "")
    if missing and len(missing) == len(urls):
        raise FileNotFoundError(
            f"{key}={path!r} matches no file (looked in {looked}); {_no_file_hint(missing[0], root)}"
        )
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise FileNotFoundError(
            f"{key}={path!r}: {len(missing)} of {local} shards are missing ({shown}; "
            f"looked in {looked}); fix the brace range or regenerate the data"
        )
    return out


def expansions(path: str, *, root: Path | None = None, key: str = "data.path") -> list[str]:
    """One line for each entry of data.path that is a folder or a glob: what it was read as."""
    lines = []
    for url in expand(path, key=key):
        if scheme_of(url) not in ("", "file"):
            continue
        name = url2pathname(urlparse(url).path) if scheme_of(url) == "file" else url
        files, how = _local_files(name, root)
        if how in ("folder", "glob") and files:
            what = "a folder: its" if how == "folder" else "a glob: its"
            span = Path(files[0]).name + (f" .. {Path(files[-1]).name}" if len(files) > 1 else "")
            lines.append(f"{key}: {name} is {what} {len(files)} shard(s) are read in name order ({span})")
    return lines


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


def check_shards(path: str, *, root: Path | None = None, dp_size: int = 1, num_workers: int = 1,
                 key: str = "data.path") -> list[str]:
    """Preflight: the shard list resolves, the programs webdataset opens its URLs with are
    installed, every reader gets a shard, and every local shard is a tar whose first member is
    a webdataset sample's file (one header read each). Returns the URLs."""
    urls = resolve_urls(path, root=root, key=key)
    for scheme in sorted({scheme_of(u) for u in urls}):
        tool = _TOOLS.get(scheme)
        if tool and shutil.which(tool) is None:
            raise ValueError(f"{key}={path!r}: webdataset reads {scheme}:// URLs with `{tool}`, which is not "
                             f"installed (not on PATH); install it or copy the shards to local disk")
    shards_for_reader(urls, dp_rank=0, dp_size=dp_size, num_workers=num_workers, key=key)
    for url in urls:
        if is_local(url):
            check_first_member(url, key=key)
    return urls


def check_first_member(url: str, *, key: str = "data.path") -> None:
    """A local shard is a tar (or gzip-compressed tar) whose first member is named as webdataset
    names a sample's files, `KEY.ext`. Reads one 512-byte header (after decompression).

    Raises:
        ValueError: one line naming the key, the file and what it is instead.
    """
    fix = ("give webdataset shards: tar files of KEY.ext members (e.g. 000001.jpg + 000001.json); "
           "`mmpipe shards` converts a LLaVA-style JSON into them")
    try:
        with open_shard(url) as (f, seekable, _):
            first = next(iter_members(f, select=lambda name: False, seekable=seekable), None)
    except ShardError as err:
        raise ValueError(f"{key}: {url} is not a tar archive ({err}); {fix}") from None
    except OSError as err:
        raise ValueError(f"{key}: cannot read {url} ({err.strerror or err}); make it readable by this user") from None
    if first is None:
        raise ValueError(f"{key}: {url} is an empty tar archive (no member); {fix}")
    if split_name(first[0]) is None:
        raise ValueError(f"{key}: {url} is a tar but not a webdataset shard: its first member {first[0]!r} is "
                         f"not named KEY.ext; {fix}")


# ---------------------------------------------------------------------------- opening
#
# webdataset leaves decompression to Python's tarfile (mode "r|*"), which mmpipe does not use
# (see mmpipe.data.tario); the standard gzip module does the work here. The two small classes
# below only let us sniff the gzip magic on a stream that cannot seek back, and turn gzip's
# errors into the ShardError the reader counts.

class _Prefixed:
    """A read-only stream that first gives back bytes already read from `rest` (to sniff the
    compression of a stream that cannot seek back)."""

    def __init__(self, head: bytes, rest: IO[bytes]) -> None:
        self.head, self.rest = head, rest

    def read(self, n: int = -1) -> bytes:
        if not self.head:
            return self.rest.read(n)
        if n is None or n < 0:
            out, self.head = self.head + self.rest.read(), b""
            return out
        out, self.head = self.head[:n], self.head[n:]
        return out


class _Gunzip:
    """The decompressed bytes of a gzip stream; a cut or damaged stream is a ShardError."""

    def __init__(self, raw: Any) -> None:
        self.gz = gzip.GzipFile(fileobj=raw, mode="rb")

    def read(self, n: int = -1) -> bytes:
        try:
            return self.gz.read(n)
        except (EOFError, OSError, zlib.error) as err:
            raise ShardError(f"gzip data cut or damaged ({err})") from None


def _decompressed(f: IO[bytes], seekable: bool) -> tuple[Any, bool]:
    """(stream, seekable): `f` itself, or its gzip-decompressed content (`.tar.gz`)."""
    head = read_upto(f, 2)
    if seekable:
        f.seek(-len(head), os.SEEK_CUR)
        raw: Any = f
    else:
        raw = _Prefixed(head, f)
    if head == b"\x1f\x8b":
        return _Gunzip(raw), False
    return raw, seekable


def _explain(pipe: Pipe, status: int, err_file: IO[bytes] | None) -> str:
    """`command 'x' exited with status 1: <stderr tail>` or `curl exited with status 22 (...)`."""
    args = pipe.args[0][0]
    if isinstance(args, str):
        what = f"command {args.strip()!r}"
    else:
        what = str(args[0])
    text = f"{what} exited with status {status}"
    if what == "curl" and status in _CURL_EXITS:
        text += f" ({_CURL_EXITS[status]})"
    if err_file is not None:
        err_file.seek(0)
        tail = err_file.read()[-400:].decode("utf-8", "replace").strip().replace("\n", " | ")
        text += f": {tail}" if tail else ""
    return text


def _reason(err: Exception) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror + (f": {err.filename}" if err.filename else "")
    return str(err)


def _open(url: str, err_file: IO[bytes] | None) -> Any:
    if url.startswith("pipe:"):
        # webdataset's own Pipe, as its gopen_pipe makes it, plus the command's stderr kept
        # for the error message (gopen_pipe takes no stderr argument).
        if getattr(wds_utils, "enforce_security", False):
            raise ValueError("pipe: URLs are disabled by WDS_SECURE=1")
        return Pipe(url[5:], mode="rb", shell=True, bufsize=1 << 20, ignore_status=[141], stderr=err_file)
    return gopen(url, "rb")


@contextmanager
def open_shard(url: str) -> Iterator[tuple[IO[bytes], bool, Callable[[], None]]]:
    """(stream, seekable, finish) of a shard URL, opened by webdataset's opener and
    decompressed when it is gzip.

    `finish()` is called after a complete read: for a command or download it reads what is
    left and raises ShardError on a non-zero exit status. A ShardError inside the block is
    re-raised naming the command's status (and stderr) when the command failed.
    """
    with tempfile.TemporaryFile() if url.startswith("pipe:") else nullcontext() as err_file:
        try:
            opened = _open(url, err_file)
        except (OSError, ValueError, ImportError) as err:
            raise ShardError(f"cannot open: {_reason(err)}") from None
        if not isinstance(opened, Pipe):
            with opened as fh:
                stream, seekable = _decompressed(fh, fh.seekable())
                yield stream, seekable, lambda: None
            return
        proc, out = opened.proc, opened.stream
        # Read the child's stdout itself, not Pipe.read: Pipe.read raises as soon as the child
        # has exited badly, dropping the bytes just read; we check the status at the end.

        def finish() -> None:
            skip_bytes(out, 1 << 62, False)  # the tar's end padding; a writer must not get SIGPIPE
            status = proc.wait()
            if status != 0:
                raise ShardError(_explain(opened, status, err_file))

        try:
            stream, _ = _decompressed(out, False)
            yield stream, False, finish
        except ShardError:
            out.close()
            try:
                status = proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                status = None
            if status not in (None, 0, *_EARLY_STOP, *opened.ignore_status):
                raise ShardError(_explain(opened, status, err_file)) from None
            raise
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            out.close()


def read_shard(shard: Shard, *, select: Callable[[str], bool] | None = None) -> Iterator[dict | SampleError]:
    """The samples of one shard, each with `__key__`, `__url__`, `__shard__` (index) and
    `__ordinal__` (position in the shard), and SampleErrors (located at the shard) for
    members with unsafe names.

    Raises:
        ShardError: after yielding the samples before the damage.
    """
    with open_shard(shard.url) as (f, seekable, finish):
        ordinal = 0
        for sample in iter_groups(iter_members(f, select=select, seekable=seekable)):
            if isinstance(sample, SampleError):
                yield sample.at(shard=shard.name, key="")
                continue
            sample["__url__"] = shard.url
            sample["__shard__"] = shard.index
            sample["__ordinal__"] = ordinal
            ordinal += 1
            yield sample
        finish()


def listed_samples(shards: list[Shard]) -> dict[str, int]:
    """Samples per local shard (by url) as the index.json next to it lists them (mmpipe's
    converter and demo data write one); shards no readable index lists are absent."""
    listed: dict[str, int] = {}
    folders = {Path(s.url).parent for s in shards if is_local(s.url)}
    for idx in (f / "index.json" for f in folders):
        if not idx.is_file():
            continue
        try:
            for entry in json.loads(idx.read_text()).get("shards", []):
                listed[str(idx.parent / entry["file"])] = int(entry["samples"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue  # an index we cannot read lists nothing: the caller counts by other means
    return {s.url: listed[str(Path(s.url))] for s in shards if is_local(s.url) and str(Path(s.url)) in listed}


def count_samples(shard: Shard) -> int:
    """Samples in a shard, from the headers alone (member data is skipped, not read)."""
    return sum(1 for s in read_shard(shard, select=lambda name: False) if not isinstance(s, SampleError))
