"""model=compose: unimodal checkpoints and a new projector form a LLaVA or a Qwen2-Audio model
that computes what transformers' own class computes with those weights."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import (
    CLIPModel,
    CLIPVisionModel,
    LlamaForCausalLM,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2AudioConfig,
    Qwen2AudioForConditionalGeneration,
    Qwen2ForCausalLM,
    SiglipVisionModel,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
)

from mmpipe.model.geometry import audio_tokens
from mmpipe.model.hf.build import build_layer, build_layers
from mmpipe.model.hf.compose import spec_from_compose
from mmpipe.model.hf.skeleton import owned_keys

from . import hf_cases as H


def _eager(cls, folder):
    return cls.from_pretrained(folder, local_files_only=True, attn_implementation="eager")


def _projector_from(layers, name, ref_projector):
    layer = next(l for l in layers if l.name == name)
    ref_projector.load_state_dict(layer.projector.state_dict())


def test_composed_vision_model_is_a_transformers_llava(unimodal):
    vision, llm = unimodal("clip-vision"), unimodal("llama")
    spec = spec_from_compose(name="clip+llama", vision=str(vision), llm=str(llm), image_token_id=H.IMAGE)
    assert spec.hf.architecture == "LlavaForConditionalGeneration"
    layers = build_layers(spec, seed=3)
    config = LlavaConfig.from_dict(json.loads(spec.hf.config))
    config._attn_implementation = "eager"
    ref = LlavaForConditionalGeneration(config)
    ref.model.vision_tower = _eager(CLIPVisionModel, vision)
    causal = _eager(LlamaForCausalLM, llm)
    ref.model.language_model, ref.lm_head = causal.model, causal.lm_head
    _projector_from(layers, "vision.proj", ref.model.multi_modal_projector)
    samples = H.llava_samples(spec, np.random.default_rng(4))
    pixels = H.processed_images(vision, [b for s in samples for b in s.images])["pixel_values"]
    out = ref(input_ids=H.padded(samples, "input_ids"), attention_mask=H.mask(samples), pixel_values=pixels,
              labels=H.padded(samples, "labels"))
    H.compare(spec, layers, ref, out.loss, samples)


def test_composed_audio_model_is_a_transformers_qwen2_audio(unimodal):
    """Whisper's encoder weights in Qwen2-Audio's audio tower (pooling, then its final norm)."""
    audio, llm = unimodal("whisper"), unimodal("qwen2")
    spec = spec_from_compose(name="whisper+qwen2", audio=str(audio), llm=str(llm), audio_token_id=H.AUDIO)
    assert spec.hf.architecture == "Qwen2AudioForConditionalGeneration"
    layers = build_layers(spec, seed=5)
    config = Qwen2AudioConfig.from_dict(json.loads(spec.hf.config))
    config._attn_implementation = "eager"
    ref = Qwen2AudioForConditionalGeneration(config)
    whisper = _eager(WhisperForConditionalGeneration, audio)
    ref.model.audio_tower.load_state_dict(whisper.model.encoder.state_dict())
    causal = _eager(Qwen2ForCausalLM, llm)
    ref.model.language_model.load_state_dict(causal.model.state_dict())
    ref.lm_head.load_state_dict(causal.lm_head.state_dict())
    _projector_from(layers, "audio.proj", ref.model.multi_modal_projector)
    ref.model.audio_tower.embed_positions.requires_grad_(False)
    rng = np.random.default_rng(6)
    clips = [rng.standard_normal(n).astype(np.float32) * 0.1 for n in (9_000, 30_001)]
    n = [audio_tokens(spec.audio, len(c) / 16000) for c in clips]
    samples = [H.sample("a", [H.text(rng, 3), [H.AUDIO] * n[0], H.text(rng, 4), [H.AUDIO] * n[1], H.text(rng, 8)],
                        audio=clips)]
    fe = WhisperFeatureExtractor.from_pretrained(audio, local_files_only=True)
    feats = fe(clips, sampling_rate=16000, padding="max_length", return_attention_mask=True, return_tensors="pt")
    out = ref(input_ids=H.padded(samples, "input_ids"), attention_mask=H.mask(samples),
              input_features=feats["input_features"], feature_attention_mask=feats["attention_mask"],
              labels=H.padded(samples, "labels"))
    H.compare(spec, layers, ref, out.loss, samples)


@pytest.mark.parametrize("kind,cls,prefix", [("clip", CLIPModel, "vision_model."),
                                              ("siglip-vision", SiglipVisionModel, "")])
def test_each_part_loads_from_its_own_folder(kind, cls, prefix, unimodal, llava_clip_llama):
    """The vision half of a CLIP model, a SigLIP vision model, a causal LM, and a projector taken
    from a LLaVA checkpoint: every tensor a layer holds is the source's."""
    vision, llm = unimodal(kind), unimodal("llama")
    spec = spec_from_compose(name="c", vision=str(vision), llm=str(llm), projector=str(llava_clip_llama),
                             image_token_id=H.IMAGE, vision_feature_layer=-1, vision_feature_select_strategy="full")
    sources = {"model.vision_tower.": (cls.from_pretrained(vision).state_dict(), prefix),
               "model.language_model.": (LlamaForCausalLM.from_pretrained(llm).state_dict(), "model."),
               "lm_head.": (LlamaForCausalLM.from_pretrained(llm).state_dict(), "lm_head."),
               "model.multi_modal_projector.": (LlavaForConditionalGeneration.from_pretrained(
                   llava_clip_llama).state_dict(), "model.multi_modal_projector.")}
    checked = 0
    for name in ("vision.embed", "vision.block.2", "vision.proj", "llm.embed", "llm.block.1", "llm.norm", "llm.head"):
        layer = build_layer(spec, name, seed=0)
        state = layer.state_dict()
        for local, key in owned_keys(spec, name).items():
            ours_prefix = next(p for p in sources if key.startswith(p))
            theirs, their_prefix = sources[ours_prefix]
            assert torch.equal(state[local], theirs[their_prefix + key[len(ours_prefix):]]), key
            checked += 1
    assert checked > 20


def test_compose_errors_name_the_setting(unimodal, tmp_path):
    vision, audio, llm = unimodal("clip-vision"), unimodal("whisper"), unimodal("llama")
    with pytest.raises(ValueError, match=r"model=compose needs exactly one encoder"):
        spec_from_compose(name="x", vision=str(vision), audio=str(audio), llm=str(llm), image_token_id=1,
                          audio_token_id=2)
    with pytest.raises(ValueError, match=r"model\.image_token_id=300 must be a token id of the "
                                         r"LLM's vocabulary \(0\.\.299\)"):
        spec_from_compose(name="x", vision=str(vision), llm=str(llm), image_token_id=300)
    with pytest.raises(ValueError, match=r"model\.llm\.path=.* is a clip_vision_model"):
        spec_from_compose(name="x", vision=str(vision), llm=str(vision), image_token_id=1)
    with pytest.raises(ValueError, match=r"model\.vision\.path=.* is a llama model; use a CLIP or SigLIP"):
        spec_from_compose(name="x", vision=str(llm), llm=str(llm), image_token_id=1)
    with pytest.raises(ValueError, match=r"model\.audio\.path=.* is not a checkpoint folder"):
        spec_from_compose(name="x", audio=str(tmp_path), llm=str(llm), audio_token_id=1)
    with pytest.raises(ValueError, match=r"model\.image_token_id is not set and the tokenizer in model\.llm\.path="
                                         r".* has no <image> token"):
        spec_from_compose(name="x", vision=str(vision), llm=str(llm))
