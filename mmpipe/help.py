"""`mmpipe --help` and `mmpipe <command> --help`: Hydra's help, written by mmpipe.

Hydra renders `hydra.help.template` after composing the config with the user's overrides;
mmpipe's template is one resolver (registered in mmpipe/cli.py) that calls `render_help`
with the composed config, so the listed values are the ones the command would run with. The
meaning of each key comes from the docstrings of the dataclasses (mmpipe/schema.py). The config
groups are listed from the search path the config was composed with (Hydra's own
$APP_CONFIG_GROUPS sees only a main config path, and mmpipe has none: see mmpipe/cli.py).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import yaml

from mmpipe.commands import Command, usage
from mmpipe.schema import key_docs

FLAGS = ("Hydra flags (after the command): --help (that command's keys), --cfg job|hydra|all (print the "
         "composed config, run nothing), --package KEY, --resolve, --info, -m/--multirun (one job per value "
         "of a,b,c overrides), --config-dir DIR (your config folder; it wins over the shipped one), "
         "--hydra-help.")
GRAMMAR = ("Overrides: KEY=VALUE sets, +KEY=VALUE adds a key, ++KEY=VALUE adds or sets, ~KEY removes "
           "(model keys, groups), GROUP=OPTION picks a config; quote values with brackets, braces, commas "
           "or spaces for Hydra and the shell: \"data.path='a/train-{000000..000009}.tar'\".")
GROUPS = "\0groups\0"
"""Where the config groups go (Hydra's $APP_CONFIG_GROUPS lists only its main config path's)."""
WIDTH = 110
DOC_COLUMN = 44


def render_help(command: Command | None, root: Any) -> str:
    """The help text of `command` (None: of mmpipe), with `root`'s composed values."""
    lines = _general() if command is None else _command(command, root)
    text = "\n".join(lines).replace(GROUPS, "\n".join(config_groups(root)))
    return text.replace("$", "$$")  # Hydra substitutes $NAMES in the template: keep dollars literal


def _wrap(text: str, indent: str = "") -> list[str]:
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=indent) or [""]


def _general() -> list[str]:
    return ["mmpipe: data-aware pipeline-parallel training of multimodal LLMs on DeepSpeed, configured with Hydra",
            "", "usage: mmpipe COMMAND [KEY=VALUE ...] [Hydra flags]", "", "commands:", usage(), "",
            "config groups (GROUP=OPTION):", GROUPS, "", *_wrap(FLAGS), "", *_wrap(GRAMMAR), "",
            "examples:", "  mmpipe train", "  mmpipe train --help", "  mmpipe train --cfg job",
            "  mmpipe train -m plan.policy=data-aware,ds-default train.steps=3",
            "  mmpipe report multirun/<date>/<time>"]


def _command(command: Command, root: Any) -> list[str]:
    lines = [f"mmpipe {command.name}: {command.summary}", "",
             f"usage: mmpipe {command.name} {command.arguments} [Hydra flags]", "", "examples:"]
    lines += [f"  {e}" for e in command.examples]
    for note in command.notes:
        lines += ["", *_wrap(note)]
    lines += ["", "config groups (GROUP=OPTION):", GROUPS, "",
              "settings (the values this command would run with; the meaning from mmpipe/config.py):"]
    docs = key_docs()
    for key in command.keys:
        for dotted, value in _values(key, root, docs):
            shown = f"  {dotted}: {value}"
            doc = textwrap.wrap(docs.get(dotted, ""), WIDTH - DOC_COLUMN)
            if doc and len(shown) < DOC_COLUMN:
                lines.append(f"{shown:<{DOC_COLUMN}}{doc.pop(0)}")
            else:
                lines.append(shown)
            lines += [" " * DOC_COLUMN + d for d in doc]
    lines += ["", *_wrap(FLAGS), "", *_wrap(GRAMMAR)]
    if command.name != "train":
        lines += ["", "mmpipe --help lists every command; mmpipe train --help every training key."]
    return lines


def config_groups(root: Any) -> list[str]:
    """`group: option, option` for every config group on the search path the config was composed
    with (--config-dir and hydra.searchpath folders included), Hydra's own groups left out."""
    import importlib.resources

    groups: dict[str, set[str]] = {}
    for source in root.hydra.runtime.config_sources:
        if source.schema == "file":
            base: Any = Path(source.path)
        elif source.schema == "pkg" and source.provider != "hydra":
            base = importlib.resources.files(source.path)
        else:
            continue
        stack = [("", base)]
        while stack:
            prefix, folder = stack.pop()
            if not folder.is_dir():
                continue
            for entry in folder.iterdir():
                if entry.is_dir() and not entry.name.startswith((".", "_")) and f"{prefix}{entry.name}" != "hydra":
                    stack.append((f"{prefix}{entry.name}/", entry))
                elif prefix and entry.name.endswith(".yaml"):
                    groups.setdefault(prefix.rstrip("/"), set()).add(entry.name.removesuffix(".yaml"))
    return [f"{g}: {', '.join(sorted(o))}" for g, o in sorted(groups.items())]


def _values(key: str, root: Any, docs: dict[str, str]) -> list[tuple[str, str]]:
    """`key` (a section or a dotted key) and the documented keys under it, with their values
    as YAML (`???`: not set yet)."""
    from omegaconf import DictConfig, OmegaConf

    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(root, parent) if parent else root
    # a DictConfig's `in` is False for a mandatory `???` value (model.path): ask its keys
    if not OmegaConf.is_config(node) or leaf not in node.keys():
        return []
    if OmegaConf.is_missing(node, leaf):
        return [(key, "???")]
    value = node[leaf]
    if isinstance(value, DictConfig) and key not in docs:
        return [item for sub in value for item in _values(f"{key}.{sub}", root, docs)]
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True, throw_on_missing=False)
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return [(key, text.removesuffix("...").strip())]
