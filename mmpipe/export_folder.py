"""The folder `mmpipe export` writes: never a source of the model, never someone else's files, and
whole or not at all.

- `check_out(out, sources)` refuses an `out` that is, is inside, or contains a folder the export
  reads (model.path, each model=compose part, a data.tokenizer folder, the checkpoint): writing
  there would replace the very weights the export copies from. Folders are compared by their
  real paths (symlinks resolved) and, for what exists, by device and inode (a bind mount or a
  second spelling of the same folder).
- It refuses an `out` that holds files the export did not write, always, naming them: the
  export's own earlier output is recognised by its manifest (`mmpipe-export.json`: every file
  and its size), and only those files are ever replaced, so exporting to the same folder again
  needs no flag. A file of the manifest changed since (its size differs) is refused too unless
  `overwrite`; a file or folder the manifest does not list is the user's and no flag replaces it.
- `staged(out)` is where the files are written: a temporary sibling folder, renamed into place
  only once every file is written and fsynced. A failed export (a missing layer file, a full
  disk) removes the temporary folder and leaves `out` as it was. Folders and files get the modes
  the user's umask gives a new file (0755 / 0644 under umask 022), not mkdtemp's private 0700,
  so a serving account can read the export.

Written here rather than taken from a library: neither transformers' save_pretrained (which
writes in place and deletes stale shards) nor the standard library offers a folder-level
atomic replace with these refusals.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

MANIFEST = "mmpipe-export.json"
"""What an export wrote (file name -> size): the mark of a folder it may write again."""
FORMAT = 1
"""Version of the manifest's layout."""


def _real(p: str | Path) -> Path:
    return Path(os.path.realpath(os.path.expanduser(str(p))))


def _within(inner: Path, outer: Path) -> bool:
    """`inner` is `outer` or lies inside it (both real paths; existing ancestors also compared by
    device and inode)."""
    if inner == outer or outer in inner.parents:
        return True
    try:
        target = os.stat(outer)
    except OSError:
        return False
    for p in (inner, *inner.parents):
        try:
            if os.path.samestat(os.stat(p), target):
                return True
        except OSError:
            continue
    return False


def check_out(out: str | Path, sources: Mapping[str, str | Path], *, overwrite: bool = False) -> Path:
    """The real path to export into, after the refusals above. `sources` maps how the user
    named each source folder (`model.path`, `model.llm.path`, `data.tokenizer`, `checkpoint`)
    to the folder. Nothing is written.

    Raises:
        ValueError: one line naming `out`, the folder it collides with and the fix.
    """
    real = _real(out)
    given = f"out={out}"
    for key, folder in sources.items():
        src = _real(folder)
        what = f"{key}={folder}" if key != "checkpoint" else f"the checkpoint being exported ({folder})"
        elsewhere = src.parent.parent / "export" if key == "checkpoint" else src.parent / f"{src.name}-trained"
        fix = f"give another folder, e.g. out={elsewhere} (nothing was written)"
        if real == src or _within(real, src) and _within(src, real):
            raise ValueError(f"{given} is {what}, a folder the export reads: writing there would replace the "
                             f"files it copies from; {fix}")
        if _within(real, src):
            raise ValueError(f"{given} is inside {what}, a folder the export reads; {fix}")
        if _within(src, real):
            raise ValueError(f"{given} contains {what}, a folder the export reads; {fix}")
    if real.exists() and not real.is_dir():
        raise ValueError(f"{given} is a file, not a folder; give a folder (new, empty, or an earlier export)")
    if real.is_dir():
        refuse_foreign(real, given, overwrite=overwrite)
    return real


def refuse_foreign(folder: Path, given: str, *, overwrite: bool) -> None:
    """Raise unless every entry of `folder` is an earlier export's own (its manifest lists it);
    a listed file changed since passes only with `overwrite`.

    Raises:
        ValueError: one line naming the files and the fix (nothing was written).
    """
    unlisted, changed = foreign_files(folder)
    if unlisted:
        raise ValueError(f"{given} holds files mmpipe export did not write ({_few(unlisted)}); overwrite=true "
                         f"replaces only an earlier export's files: move them out or give a new or empty folder "
                         f"(nothing was written)")
    if changed and not overwrite:
        raise ValueError(f"{given} holds files an earlier export wrote that changed since ({_few(changed)}); "
                         f"add overwrite=true to replace them, or give a new or empty folder (nothing was written)")


def _few(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def foreign_files(folder: Path) -> tuple[list[str], list[str]]:
    """Entries of `folder` that are not an earlier export's, unchanged: (entries its manifest
    does not list (every entry when it has none): files added, folders, links; files it lists
    whose size changed)."""
    recorded: dict[str, int] = {}
    manifest = folder / MANIFEST
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text())
            recorded = {str(k): int(v) for k, v in data["files"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            recorded = {}
    unlisted, changed = [], []
    for entry in sorted(folder.iterdir(), key=lambda p: p.name):
        name = entry.name
        if name == MANIFEST and recorded:
            continue
        if entry.is_symlink() or not entry.is_file():
            unlisted.append(name + ("/" if entry.is_dir() else ""))
        elif name not in recorded:
            unlisted.append(name)
        elif entry.stat().st_size != recorded[name]:
            changed.append(name)
    return unlisted, changed


def _umask() -> int:
    """The process's umask (read by setting it and putting it back: os has no getter)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _finish(folder: Path, about: Mapping[str, object]) -> None:
    """Write the manifest, give the folder and its files the modes the umask gives new ones
    (mkdtemp makes a 0700 folder, and a copied file keeps its source's mode), and flush every
    file and the folder's entries to disk."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    record = {"format": FORMAT, **about, "files": files}
    (folder / MANIFEST).write_text(json.dumps(record, indent=1) + "\n")
    mask = _umask()
    for p in folder.iterdir():
        os.chmod(p, 0o666 & ~mask)
        _fsync(p)
    os.chmod(folder, 0o777 & ~mask)
    _fsync(folder)


@contextmanager
def staged(out: Path, about: Mapping[str, object] | None = None, *, overwrite: bool = False) -> Iterator[Path]:
    """A temporary folder beside `out` (a real path from check_out) to write the export into;
    when the block ends normally it gets the manifest and replaces `out` (the old folder, if
    any, is moved aside first and deleted after; it is checked again first, so a file the user
    put there while the export ran is refused, not deleted). Any error removes it and leaves
    `out` as it was."""
    parent = out.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=parent))
    try:
        yield tmp
        _finish(tmp, about or {})
        if out.is_dir():
            refuse_foreign(out, f"out={out}", overwrite=overwrite)
        old = None
        if out.exists() and any(out.iterdir()):
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=parent))
            os.replace(out, old)  # onto the empty folder mkdtemp made: same filesystem, one rename
        try:
            os.replace(tmp, out)  # a new name, or the empty folder left
        except BaseException:
            if old is not None:
                os.replace(old, out)
            raise
        _fsync(parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
