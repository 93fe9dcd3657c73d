"""Command-line overrides: the checks Hydra does not make, and Hydra's errors as one line.

Part of the CLI edge (with mmpipe/cli.py and mmpipe/schema.py). Hydra applies repeated keys
one after the other, so `data.path=a data.path=b` (what a shell makes of an unquoted brace
list) silently trains on b: `check_overrides` refuses it and shows the quoting that works.
`explain` turns Hydra's and OmegaConf's multi-line errors into mmpipe's one line: the key as
typed, the bad value and the fix (a hint is shell-safe as printed).
"""

from __future__ import annotations

import difflib
import re

import yaml

from mmpipe.paths import nearest, override_hint, shell_word
from mmpipe.schema import HF_MODEL_DOCS, describe_type, key_docs, key_type


def check_overrides(overrides: list[str], *, command: str) -> None:
    """Every override parses, and no key is given twice (ValueError naming both values)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    given: dict[tuple[str, str | None], list[str]] = {}
    for line in overrides:
        try:
            (o,) = parser.parse_overrides([line])
        except OverrideParseException as err:
            raise ValueError(_grammar_hint(line, str(err), command)) from None
        given.setdefault((o.key_or_group, o.package), []).append(line)
    for (key, _), lines in given.items():
        if len(lines) > 1:
            raise ValueError(_repeated_hint(key, lines, command))


def _grammar_hint(line: str, message: str, command: str) -> str:
    why = message.splitlines()[0]
    key, eq, value = line.partition("=")
    if not eq or not value or value[0] in "'\"":
        return f"{shell_word(line)}: not an override Hydra can read ({why}); write key=value"
    return (f"{shell_word(line)}: Hydra's override grammar reads brackets, braces and commas as lists, "
            f"dictionaries and sweeps ({why}); to pass the value as a string, quote it for Hydra and the "
            f"shell: mmpipe {command} {override_hint(key.lstrip('+~'), value)}")


def _repeated_hint(key: str, lines: list[str], command: str) -> str:
    values = [line.partition("=")[2] for line in lines]
    given = ", ".join(shell_word(line) for line in lines)
    head = f"{key} is given {len(lines)} times ({given}); one value would silently win"
    braces = _brace_list(values)
    if braces:
        return (f"{head}. The shell expanded a brace list into several words: quote it so mmpipe gets it "
                f"whole: mmpipe {command} {override_hint(key, braces)}")
    if all(line.startswith(key + "=") for line in lines):
        sweep = shell_word(f"{key}=" + ",".join(values))
        return f"{head}; give it once (one job per value: mmpipe {command} -m {sweep})"
    return f"{head}; give it once"


def _brace_list(values: list[str]) -> str | None:
    """`pre{first..last}post` when the values are what a shell makes of that brace list."""
    parts = [re.fullmatch(r"(.*?)(\d+)(\D*)", v) for v in values]
    if not all(parts) or len({(p[1], p[3], len(p[2])) for p in parts}) != 1:  # type: ignore[index]
        return None
    numbers = [int(p[2]) for p in parts]  # type: ignore[index]
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        return None
    first, last = parts[0], parts[-1]
    return f"{first[1]}{{{first[2]}..{last[2]}}}{first[3]}"  # type: ignore[index]


def _chain(err: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while err is not None and err not in out:
        out.append(err)
        err = err.__cause__ or (None if err.__suppress_context__ else err.__context__)  # type: ignore[assignment]
    return out


def explain(err: BaseException, overrides: list[str], *, command: str) -> str:
    """One line for a composition error: the key as typed, the bad value, the fix."""
    from omegaconf.errors import ConfigKeyError, ConfigTypeError, OmegaConfBaseException, ValidationError

    chain = _chain(err)
    text = " ".join(" ".join(str(e).split()) for e in chain)
    typed = {o.lstrip("+~").partition("=")[0]: o for o in overrides}

    def as_typed(key: str, value: object = "?") -> str:
        return shell_word(typed.get(key, f"{key}={value}").lstrip("+"))

    def unknown(key: str) -> str:
        # OmegaConf names the first node that does not exist (`trian` of trian.steps=3): the
        # override as typed, and the nearest key to all of it
        key = next((k for k in typed if k.startswith(key + ".")), key) if key not in typed else key
        return f"{as_typed(key)}: no such config key{_near(key, overrides)}"

    m = re.search(r"Could not find '([\w-]+)/([^']+)'\s*Available options in '[\w-]+':\s*(.*?)\s*Config search path",
                  text)
    if m:
        group, name, options = m.groups()
        return f"{group}={name}: no such {group} config; available: {', '.join(options.split())}"
    m = re.search(r"Ambiguous value for argument '([^']+)'", text)
    if m:
        key = m.group(1).partition("=")[0]
        return (f"{shell_word(m.group(1))} gives several values: add -m to run one job per value "
                f"(mmpipe {command} -m {shell_word(m.group(1))}), or write a list as {key}=[...]")
    m = re.search(r"Could not delete from config\. '([^']+)' does not exist", text)
    if m:
        key = m.group(1)
        if key in known_keys():
            return f"~{key}: {key} is null already; nothing to remove"
        return f"~{key}: no such config key{_near(key, overrides)}"
    m = re.search(r"Could not append to config\. An item is already at '([^']+)'", text)
    if m:
        key = m.group(1)
        return f"+{typed.get(key, key).lstrip('+')}: {key} is set already; drop the + (or write ++ to add or set)"
    for e in chain:
        if not isinstance(e, OmegaConfBaseException) or not getattr(e, "full_key", None):
            continue
        key = str(e.full_key)
        if isinstance(e, ConfigTypeError) and "does not support deletion" in str(e):
            return (f"~{key}: a typed setting cannot be removed; set it instead "
                    f"(its default: {_default_text(key)}, e.g. {key}={_default_text(key)})")
        if isinstance(e, (ConfigKeyError, ConfigTypeError)) or "not in struct" in str(e) or "not in '" in str(e):
            return unknown(key)
        if isinstance(e, ValidationError):
            key = re.sub(r"(\[\d+\])+$", "", key)  # an element of a list: the list as typed
            value = typed.get(key, "=?").partition("=")[2]
            wanted = describe_type(key_type(key)) if key_type(key) is not None else "of another type"
            return f"{key}={value!r} must be {wanted}"
    m = re.search(r"Could not override '([^']+)'", text)
    if m:
        return unknown(m.group(1))
    if any(isinstance(e, yaml.YAMLError) for e in chain):
        return f"a config file is not valid YAML: {text}"
    first = str(err).strip().splitlines()
    return " ".join(" ".join(first[:3]).split()) or type(err).__name__


def _near(key: str, overrides: list[str] = ()) -> str:
    keys = known_keys() + _model_keys(overrides)
    near = nearest(key, keys, cutoff=0.75)
    if near:
        return f"; did you mean {near}?"
    section, _, rest = key.partition(".")
    sections = sorted({k.split(".")[0] for k in keys})
    close = difflib.get_close_matches(section, sections, n=1, cutoff=0.6)
    if close and close[0] != section:  # a misspelt section: its key if that exists, else the section
        guess = f"{close[0]}.{rest}" if rest else close[0]
        return f"; did you mean {guess}?" if guess in keys or not rest else \
            f"; did you mean {close[0]} (mmpipe train --help lists its keys)?"
    return f"; see mmpipe train --help for the {section} keys" if section in {k.split('.')[0] for k in known_keys()} \
        else "; see mmpipe train --help for the keys and groups"


def _default_text(key: str) -> str:
    from omegaconf import OmegaConf

    from mmpipe.schema import schema

    value = OmegaConf.select(OmegaConf.structured(schema()), key, throw_on_missing=False)
    return "null" if value is None else str(OmegaConf.to_container(value) if OmegaConf.is_config(value) else value)


def _model_keys(overrides: list[str]) -> list[str]:
    """The keys of the model group the overrides choose (model=hf, model=compose, a preset; else
    the default), dotted: the schema types `model` loosely, so its keys come from the group file."""
    from mmpipe.paths import CONF_DIR

    name = next((o.partition("=")[2] for o in overrides if o.lstrip("+").partition("=")[0] == "model"), "tiny")
    path = CONF_DIR / "model" / f"{name}.yaml"
    if not path.is_file():
        return []

    def flat(prefix: str, node) -> list[str]:
        if isinstance(node, dict):
            return [k for sub, v in node.items() for k in flat(f"{prefix}.{sub}", v)]
        return [prefix]

    return flat("model", yaml.safe_load(path.read_text()) or {})


def known_keys() -> list[str]:
    """Every typed key and every key of the model spec, dotted (a Hugging Face group's keys come
    from the group the overrides choose: _model_keys)."""
    return sorted(k for k in key_docs() if k not in HF_MODEL_DOCS)
