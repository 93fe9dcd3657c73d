"""The structured-config schema Hydra composes into, derived from mmpipe's typed dataclasses.

Part of the CLI edge (with mmpipe/cli.py, the only code that sees Hydra). Every key, type,
default and docstring lives once, in the frozen dataclasses of mmpipe/config.py (and the
planner's HardwareSpec): this module turns them into plain OmegaConf
dataclasses, registers the result in Hydra's ConfigStore as `schema`, and reads the field
docstrings for `--help`. So a typo or a value of the wrong type is caught while Hydra composes,
and `--cfg job` shows every key with its default. The frozen dataclasses still validate the
values (ranges, names, cross-key rules) when the composed config becomes a RunConfig.

`model` is typed loosely (any mapping): a model config has several shapes (mmpipe's tiny spec,
a preset with an inline Hugging Face config, `model=hf`, `model=compose`) and
`mmpipe.model.group.model_from_group` validates it.
"""

from __future__ import annotations

import ast
import collections.abc
import dataclasses
import functools
import inspect
import operator
import textwrap
import types
import typing
from typing import Any, Union

from omegaconf import MISSING

from mmpipe.config import GROUPS, HardwareOrigin, RunConfig
from mmpipe.model.spec import ModelSpec
from mmpipe.planner.api import HardwareSpec

SCHEMA_NAME = "schema"
"""The schema's name in Hydra's ConfigStore (conf/config.yaml lists it first in its defaults)."""

_SCALARS = (int, float, str, bool)
_LOOSE = ("model",)
"""Sections typed as any mapping: their own loader validates them."""
_SECTION_CLASSES: dict[str, tuple[type, ...]] = {"hardware": (HardwareSpec, HardwareOrigin)}
"""Sections whose RunConfig field is a raw mapping, typed by these dataclasses instead."""


def section_classes() -> dict[str, tuple[type, ...]]:
    """Each config section and the dataclass(es) that declare its keys (empty: loosely typed)."""
    hints = typing.get_type_hints(RunConfig)
    out: dict[str, tuple[type, ...]] = {}
    for f in dataclasses.fields(RunConfig):
        if f.name not in GROUPS:  # derived, not typed by the user (run_dir, the model group as given, ...)
            continue
        if f.name in _LOOSE:
            out[f.name] = ()
        elif f.name in _SECTION_CLASSES:
            out[f.name] = _SECTION_CLASSES[f.name]
        else:
            out[f.name] = (hints[f.name],)
    return out


def _omegaconf_type(tp: Any) -> Any:
    """The nearest annotation OmegaConf supports: scalars, `X | None`, lists and mappings of
    scalars; anything richer is Any (its dataclass validates it)."""
    if tp in _SCALARS or tp is Any:
        return tp
    if dataclasses.is_dataclass(tp):  # a nested section (train.lora): its own typed node
        return _schema_class(f"{tp.__name__}Schema", (tp,))
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        inner = [_omegaconf_type(a) for a in rest]
        one = inner[0] if len(inner) == 1 else (
            functools.reduce(operator.or_, inner) if all(i in _SCALARS for i in inner) else Any)
        return one | None if len(rest) < len(args) and one is not Any else one
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis and args[0] in _SCALARS:
        return list[args[0]]
    if origin in (dict, collections.abc.Mapping) and len(args) == 2:
        return dict[str, args[1] if args[1] in _SCALARS else Any]
    return Any


def _default(f: dataclasses.Field) -> dataclasses.Field:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return dataclasses.field(default=MISSING)
    if dataclasses.is_dataclass(value):
        cls = _schema_class(f"{type(value).__name__}Schema", (type(value),))
        return dataclasses.field(default_factory=cls)
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, (list, dict, collections.abc.Mapping)):
        frozen = dict(value) if isinstance(value, collections.abc.Mapping) else value
        return dataclasses.field(default_factory=lambda: type(frozen)(frozen))
    return dataclasses.field(default=value)


@functools.cache
def _schema_class(name: str, classes: tuple[type, ...]) -> type:
    fields = []
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            fields.append((f.name, _omegaconf_type(hints[f.name]), _default(f)))
    return dataclasses.make_dataclass(name, fields)


@functools.cache
def schema() -> type:
    """The root schema: one typed node per section (a plain dataclass OmegaConf accepts)."""
    root = []
    for section, classes in section_classes().items():
        if not classes:
            root.append((section, Any, dataclasses.field(default=MISSING)))
        else:
            cls = _schema_class(f"{section.title()}Schema", classes)
            root.append((section, cls, dataclasses.field(default_factory=cls)))
    return dataclasses.make_dataclass("MmpipeSchema", root)


def register() -> None:
    """Put the schema into Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=schema())


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (attribute docstrings are not kept at
    run time, so they are read from the source, which ships with the package)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _nested_docs(prefix: str, cls: type) -> dict[str, str]:
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner = [a for a in (typing.get_args(hints[f.name]) or (hints[f.name],)) if dataclasses.is_dataclass(a)]
        if inner:
            out.update(_nested_docs(f"{prefix}.{f.name}", inner[0]))
        else:
            out[f"{prefix}.{f.name}"] = field_docs(cls).get(f.name, "")
    return out


HF_MODEL_DOCS = {
    "model.path": "model=hf: a local checkpoint folder written by save_pretrained (config.json, *.safetensors, "
                  "tokenizer with a chat template, processor config); nothing is downloaded.",
    "model.vision.path": "model=compose: a CLIP / SigLIP (vision) checkpoint folder (or model.audio.path).",
    "model.audio.path": "model=compose: a Whisper checkpoint folder (instead of model.vision.path).",
    "model.llm.path": "model=compose: a Llama / Mistral / Qwen2 causal LM folder, with its tokenizer and chat "
                      "template.",
    "model.projector.path": "model=compose: a folder holding the projector (a LLaVA checkpoint, an earlier "
                            "export); null: a new, random one.",
    "model.vision_feature_layer": "model=compose: the tower's hidden state the projector reads (-2: the "
                                  "penultimate block).",
    "model.vision_feature_select_strategy": "model=compose: default (drop the class token) | full.",
    "model.image_token_id": "model=compose: null: the LLM tokenizer's <image> token.",
    "model.audio_token_id": "model=compose: null: the LLM tokenizer's <audio> token.",
    "model.projector_hidden_act": "model=compose: the projector's activation (LLaVA's projector_hidden_act).",
    "model.max_seq_len": "model=hf / compose: the longest sample in tokens; null: the config's "
                         "max_position_embeddings.",
}
"""The keys of the Hugging Face model groups (conf/model/hf.yaml, compose.yaml), which no
dataclass declares (mmpipe.model.hf.settings checks them)."""


@functools.cache
def key_docs() -> dict[str, str]:
    """`section.key` -> its docstring, for every typed key, for the keys of the model spec
    (the `model` section is typed loosely, but ModelSpec documents its tiny-spec shape) and for
    the Hugging Face model groups' keys."""
    out = {**_nested_docs("model", ModelSpec), **HF_MODEL_DOCS}
    for section, classes in section_classes().items():
        for cls in classes:
            hints = typing.get_type_hints(cls)
            for key in (f.name for f in dataclasses.fields(cls)):
                if dataclasses.is_dataclass(hints[key]):  # a nested section: train.lora.r, ...
                    out.update(_nested_docs(f"{section}.{key}", hints[key]))
                else:
                    out[f"{section}.{key}"] = field_docs(cls).get(key, "")
    return out


def key_type(dotted: str) -> Any:
    """The schema annotation of `section.key` (None when the key is not typed)."""
    section, _, key = dotted.partition(".")
    key, _, sub = key.partition(".")
    for cls in section_classes().get(section, ()):
        for f in dataclasses.fields(cls):
            if f.name == key:
                tp = typing.get_type_hints(cls)[key]
                if sub and dataclasses.is_dataclass(tp):  # train.lora.r
                    return next((_omegaconf_type(typing.get_type_hints(tp)[g.name]) for g in dataclasses.fields(tp)
                                 if g.name == sub), None)
                return _omegaconf_type(tp)
    return None


def describe_type(tp: Any) -> str:
    """What a value of this annotation is, as an error message says it."""
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in names:
        return names[tp]
    if origin in (Union, types.UnionType):
        return " or ".join("null" if a is type(None) else describe_type(a) for a in args)
    if origin is list:
        example = {str: "a,b", bool: "true,false"}.get(args[0] if args else None, "1,2")
        return f"a list such as [{example}]"
    if origin is dict:
        return "a mapping such as {key: value}"
    return "a value of another type"
