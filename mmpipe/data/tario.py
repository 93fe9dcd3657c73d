"""Strict streaming tar parsing for webdataset shards: members, and members grouped into samples.

A small tar parser of our own (USTAR, GNU long names, pax `path`) rather than Python's
`tarfile` in stream mode, for three reasons: it tells a clean end of archive from garbage or
a cut in the middle of a shard (tarfile takes a garbage header for the end), it can skip the
bytes of members nobody asked for (metadata-only reading seeks past the media), and it lets a
`pipe:` command's exit status be checked once its output is read (see mmpipe.data.shards,
which opens the shards and feeds them here).

Members are grouped into samples as webdataset does: `dir/KEY.suffix` has key `dir/KEY`
(everything before the first dot of the file name) and suffix `suffix` (lower-cased);
consecutive members with the same key form one sample.
"""

from __future__ import annotations

import os
import re
from typing import IO, Callable, Iterator

from mmpipe.data.skips import UNSAFE_NAME, SampleError

BLOCK = 512
_ZERO = bytes(BLOCK)
_KEY = re.compile(r"^((?:.*/|)[^./][^.]*)\.([^/]+)$")
_DRIVE = re.compile(r"^[A-Za-z]:")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_UNSAFE = re.compile(r"[\x00-\x1f\x7f\\]|^/|^[A-Za-z]:|(?:^|/)\.\.(?:/|$)")
"""Anything unsafe_name refuses, except a `__` suffix."""
_SUFFIXES = re.compile(r"(\.\w+)+$")
"""The suffixes of a member name (`.0.png`): what is left is the key it would have had."""


class ShardError(Exception):
    """A shard that cannot be read to its end (the reader counts it as `corrupt shard`)."""

    def __init__(self, detail: str, *, member: str = "") -> None:
        super().__init__(detail)
        self.member = member
        """The member being read when the data ended ('' inside a header)."""


def _number(field: bytes) -> int:
    """A tar numeric field: octal text, or base-256 when the high bit of byte 0 is set."""
    if field[:1] and field[0] & 0x80:
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    text = field.split(b"\0", 1)[0].strip(b" ")
    return int(text, 8) if text else 0


def _cstr(field: bytes) -> str:
    return field.split(b"\0", 1)[0].decode("utf-8", "replace")


def read_upto(f: IO[bytes], n: int) -> bytes:
    """Up to n bytes (fewer only at end of stream); pipes may return short reads."""
    chunks, got = [], 0
    while got < n:
        b = f.read(n - got)
        if not b:
            break
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def skip_bytes(f: IO[bytes], n: int, seekable: bool) -> None:
    """Pass n bytes of the stream (seek when it can, else read and drop them; stops at its end)."""
    if seekable:
        f.seek(n, os.SEEK_CUR)
    else:
        while n > 0:
            b = f.read(min(n, 1 << 20))
            if not b:
                break
            n -= len(b)


def _pax_path(data: bytes) -> str | None:
    path = None
    pos = 0
    while pos < len(data):
        sp = data.find(b" ", pos)
        if sp < 0:
            break
        try:
            length = int(data[pos:sp])
        except ValueError:
            break
        rec = data[sp + 1:pos + length - 1]
        k, _, v = rec.partition(b"=")
        if k == b"path":
            path = v.decode("utf-8", "replace")
        pos += max(length, 1)
    return path


def iter_members(f: IO[bytes], *, select: Callable[[str], bool] | None = None,
                 seekable: bool = False) -> Iterator[tuple[str, bytes | None]]:
    """(name, data) of each regular file in a tar stream; data is None when `select` says no.

    Raises:
        ShardError: the stream ends inside a header or a member, lacks the end-of-archive
            block, or a header's checksum is wrong (garbage in the middle of the shard).
    """
    at = 0
    long_name: str | None = None
    while True:
        hdr = read_upto(f, BLOCK)
        if not hdr:
            if at == 0:
                raise ShardError("unexpected end of data: the shard is empty")
            raise ShardError(f"unexpected end of data at byte {at}: no end-of-archive block (truncated?)")
        if len(hdr) < BLOCK:
            raise ShardError(f"unexpected end of data in the header at byte {at}")
        if hdr == _ZERO:
            return
        try:
            stored = _number(hdr[148:156])
            size = _number(hdr[124:136])
        except ValueError:
            stored, size = -1, 0
        if stored != sum(hdr[:148]) + 8 * 32 + sum(hdr[156:]):
            raise ShardError(f"not a tar header at byte {at} (bad checksum): garbage in the shard")
        kind = hdr[156:157]
        name = _cstr(hdr[0:100])
        if hdr[257:262] == b"ustar":
            prefix = _cstr(hdr[345:500])
            if prefix:
                name = f"{prefix}/{name}"
        at += BLOCK
        padded = -(-size // BLOCK) * BLOCK
        if kind in (b"L", b"x"):
            data = read_upto(f, padded)
            if len(data) < padded:
                raise ShardError(f"unexpected end of data in a long-name header at byte {at}")
            long_name = data[:size].split(b"\0", 1)[0].decode("utf-8", "replace") if kind == b"L" \
                else _pax_path(data[:size])
        elif kind in (b"0", b"\0", b"7"):
            name = long_name or name
            long_name = None
            if select is None or select(name):
                data = read_upto(f, padded)
                if len(data) < size:
                    raise ShardError(f"unexpected end of data in member {name} at byte {at}", member=name)
                yield name, data[:size]
            else:
                skip_bytes(f, padded, seekable)
                yield name, None
        else:  # directories, links, global pax headers: nothing a sample needs
            long_name = None
            skip_bytes(f, padded, seekable)
        at += padded


def split_name(name: str) -> tuple[str, str] | None:
    """(key, lower-case suffix) of a member name, or None for names webdataset ignores."""
    m = _KEY.match(name)
    return (m.group(1), m.group(2).lower()) if m else None


def unsafe_name(name: str) -> str | None:
    """Why a member name must never become a sample key or a path (None: it is safe).

    A key travels into logs, recorded sample lists and whatever tools later build paths from
    them, so a name that climbs out of its folder, is absolute, holds control characters, or
    whose suffix would overwrite the reader's own `__key__`-style fields is refused, not
    cleaned up.
    """
    if _UNSAFE.search(name) is None and "__" not in name:
        return None  # the common case, in one regex pass (this runs for every member)
    if _CONTROL.search(name):
        return "it holds a NUL or another control character"
    if name.startswith("/") or _DRIVE.match(name):
        return "it is an absolute path"
    if "\\" in name:
        return "it holds a backslash"
    if ".." in name.split("/"):
        return "it has a '..' path component"
    parts = split_name(name)
    if parts is not None and parts[1].startswith("__"):
        return "its suffix starts with '__' (reserved for the reader's fields)"
    return None


def iter_groups(members: Iterator[tuple[str, bytes | None]]) -> Iterator[dict | SampleError]:
    """Samples: consecutive members with the same key, as {"__key__", suffix: bytes, ...}.

    Unselected members still mark a sample (so metadata-only reading counts the same samples
    as full reading) but carry no data. A sample cut by a ShardError is not yielded. A member
    with an unsafe name (see `unsafe_name`) is never used: consecutive such members of one
    would-be key give one SampleError (`unsafe member name`) in the sample's place.
    """
    cur: dict | None = None
    bad: str | None = None
    try:
        for name, data in members:
            why = unsafe_name(name)
            if why is not None:
                if cur is not None:
                    yield cur
                    cur = None
                would_be = _SUFFIXES.sub("", name)
                if bad != would_be:
                    bad = would_be
                    yield SampleError(UNSAFE_NAME, f"member {name[:200]!r}: {why}; it is not used")
                continue
            bad = None
            parts = split_name(name)
            if parts is None:
                continue
            key, suffix = parts
            if cur is None or cur["__key__"] != key:
                if cur is not None:
                    yield cur
                cur = {"__key__": key}
            if data is not None:
                cur[suffix] = data
    except ShardError as err:
        # The cut member belongs to the next sample: the current one is complete.
        parts = split_name(err.member) if err.member else None
        if cur is not None and parts is not None and parts[0] != cur["__key__"]:
            yield cur
        raise
    if cur is not None:
        yield cur
