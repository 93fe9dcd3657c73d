"""Paths and words as a user gives and pastes them: the shipped package's folder, relative paths
looked up there, model folders made absolute, and quoting for the shell and Hydra's override
grammar (every hint mmpipe prints is pasted back into a shell)."""

from __future__ import annotations

import difflib
import os
import re
import shlex
from importlib.resources import files
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parent
"""The mmpipe package folder, in a checkout and in an installed wheel alike. Its data/shards,
data/workloads and data/tokenizer.json are the shipped sample data (in a checkout, links to the
top-level data/ folder; a wheel holds copies), so relative paths such as data/shards/... resolve
here when the current directory has no such file (`resolve_path`)."""

CONF_DIR = Path(str(files("mmpipe.conf")))
"""The shipped Hydra configs (groups model, data, hardware, recipes): the top-level conf/ folder
of a checkout (its recipes/ a link to the top-level recipes/), mmpipe/conf in a wheel."""


def resolve_path(p: str) -> str:
    """A relative path is taken from the current directory when it is there, else from the
    mmpipe package (its shipped configs and sample data: `data/shards/...`,
    `data/tokenizer.json`, `data/workloads/...`); a brace list counts as there when its first
    file is. Absolute paths and `pipe:` commands pass unchanged."""
    if not p or os.path.isabs(p) or p.startswith("pipe:"):
        return p
    first = re.sub(r"\{([^{},.]*)(?:\.\.[^{}]*|,[^{}]*)\}", r"\1", p)
    if not Path(first).exists() and (PACKAGE_ROOT / first).exists():
        return str(PACKAGE_ROOT / p)
    return p


_SHELL_SAFE = re.compile(r"[\w./:@%+=,-]*")
_HYDRA_SAFE = re.compile(r"[\w./:@%+-]*")


def shell_word(text: str) -> str:
    """`text` as one word a POSIX shell passes through unchanged (hints are pasted into shells:
    brackets glob, braces expand, spaces split)."""
    if _SHELL_SAFE.fullmatch(text):
        return text
    if not any(c in text for c in "\"$`!\\"):
        return f'"{text}"'
    return shlex.quote(text)


def nearest(word: str, candidates: list[str], cutoff: float = 0.6) -> str | None:
    """The candidate a mistyped word most likely meant: the shortest one that extends it
    (`train.zero` -> `train.zero_stage`), else the closest spelling (difflib), else None."""
    extending = [c for c in candidates if c.startswith(word) and c != word]
    if extending:
        return min(extending, key=lambda c: (len(c), c))
    near = difflib.get_close_matches(word, candidates, n=1, cutoff=cutoff)
    return near[0] if near else None


def override_hint(key: str, value: str) -> str:
    """`key=value` for a string value as a user types it: quoted for Hydra's override grammar
    where it has brackets, braces, commas, spaces or quotes, then for the shell."""
    if not _HYDRA_SAFE.fullmatch(value):
        value = "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return shell_word(f"{key}={value}")


def model_folder(p: str) -> str:
    """A model folder as given, made absolute (the workers and `mmpipe export` read it from run.yaml)."""
    return str(Path(resolve_path(p)).expanduser().absolute())
