"""The family registry (mmpipe/model/hf/family.py, families/): every class mmpipe trained before it
is registered, each family declares every field, every family file is registered, and the shared
modules dispatch through the registry instead of naming families (read from the source, as
tests/unit/test_imports.py reads the layering)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from pathlib import Path

from mmpipe.model.hf import families as families_package
from mmpipe.model.hf.arch import supported_models
from mmpipe.model.hf.configs import ARCHITECTURES
from mmpipe.model.hf.demo import MODELS
from mmpipe.model.hf.family import FIELDS, REGISTRY, Family, family_named
from mmpipe.model.hf.media import image_processors

HF = Path(__file__).resolve().parents[3] / "mmpipe" / "model" / "hf"
BEFORE = {
    "llava": "LlavaForConditionalGeneration",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_audio": "Qwen2AudioForConditionalGeneration",
    "llava_next": "LlavaNextForConditionalGeneration",
    "llava_onevision": "LlavaOnevisionForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen2_5_omni_thinker": "Qwen2_5OmniThinkerForConditionalGeneration",
}
"""model_type -> class of every family mmpipe supported before the registry (configs.ARCHITECTURES
then), in the order its errors listed them."""


def test_every_family_supported_before_is_registered_in_the_same_order():
    assert dict(list(REGISTRY.items())[:len(BEFORE)]) == {k: REGISTRY[k] for k in BEFORE}
    assert {k: REGISTRY[k].architecture for k in BEFORE} == BEFORE
    assert list(REGISTRY)[:len(BEFORE)] == list(BEFORE)
    assert ARCHITECTURES == {k: f.architecture for k, f in REGISTRY.items()}
    listed = supported_models()
    assert all(f.architecture in listed for f in REGISTRY.values()) and "model=compose" in listed
    assert family_named("qwen3_vl") is REGISTRY["qwen3_vl"]


def test_each_family_declares_every_field():
    """No field has a default, so a family file that leaves one out does not build; the
    capabilities that go together are given together."""
    assert all(f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               for f in dataclasses.fields(Family))
    assert FIELDS == tuple(f.name for f in dataclasses.fields(Family)) and len(FIELDS) >= 19
    demos = [f.demo.name for f in REGISTRY.values()]
    assert len(set(demos)) == len(demos) and set(demos) <= set(MODELS)
    for family in REGISTRY.values():
        assert isinstance(family, Family)
        assert family.title and family.text_types and family.towers, family.model_type
        assert bool(family.image_processors) == (family.vision is not None), family.model_type
        assert (family.vision is None) == (family.default_image_processor is None), family.model_type
        assert (family.audio is None) == (family.default_feature_extractor is None), family.model_type
        assert family.video_processor is None or family.vision is not None, family.model_type
        assert not family.audio_in_video or (family.audio and family.video_processor), family.model_type
        assert set(family.image_processors) <= set(image_processors())
        assert callable(family.layer_parts) and callable(family.tower_layer) and callable(family.demo.write)


def test_every_family_file_is_registered():
    """A file of families/ is one family, in the one list (and nothing else is in it)."""
    files = sorted(p.stem for p in (HF / "families").glob("*.py") if p.stem != "__init__")
    for stem in files:
        family = importlib.import_module(f"mmpipe.model.hf.families.{stem}").FAMILY
        assert family in families_package.FAMILIES, stem
    assert len(files) == len(families_package.FAMILIES)
    assert families_package.FAMILIES == tuple(REGISTRY.values())


def _names() -> set[str]:
    """What names a family: its model_type, an outer folder's model_type, its class."""
    out = set()
    for family in REGISTRY.values():
        out |= {family.model_type, family.architecture}
        if family.outer is not None:
            out.add(family.outer.model_type)
    return out


def _family_strings(path: Path, names: set[str]) -> list[str]:
    """`file:line 'name'` of every string in a module's code that names a family (not its
    docstrings: prose may name classes)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [f"{path.name}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs and n.value in names]


def test_the_shared_modules_name_no_family():
    """model/hf/*.py dispatch through the registry: no `model_type == "..."` chain, no table keyed by
    model_type, no family's class named in code; each family's facts are in its file."""
    names = _names()
    found = [hit for path in sorted(HF.glob("*.py")) for hit in _family_strings(path, names)]
    assert found == []


def test_the_check_sees_a_family_name(tmp_path):
    """The check above catches the if-chains the registry replaced."""
    shared = tmp_path / "chain.py"
    shared.write_text('def towers(config):\n    """Which tower (llava)."""\n'
                      '    if config.model_type == "qwen2_vl":\n        return "model.visual"\n'
                      '    return {"llava": "model.vision_tower"}.get(config.model_type)\n')
    assert _family_strings(shared, _names()) == ["chain.py:3 'qwen2_vl'", "chain.py:5 'llava'"]
