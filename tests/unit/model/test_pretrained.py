"""Weights from local checkpoint folders: our pipeline layers compute what the original
transformers models compute."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    SiglipVisionConfig,
    SiglipVisionModel,
    WhisperConfig,
    WhisperModel,
)

from mmpipe.cli import main
from mmpipe.config import PACKAGE_ROOT
from mmpipe.model import carrier as C
from mmpipe.model.layers import build_layers, run_layers
from mmpipe.model.pretrained import Pretrained, check_matches
from mmpipe.model.spec import spec_from_dict
from mmpipe.runtime.batch import collate

IMG, AUD = 5, 6


class S:
    def __init__(self, ids, images=(), audio=()):
        self.key, self.input_ids, self.labels = "s", ids, ids
        self.images, self.audio = list(images), list(audio)


@pytest.fixture(scope="module")
def spec():
    return spec_from_dict(yaml.safe_load((PACKAGE_ROOT / "conf/model/tiny.yaml").read_text()))


@pytest.fixture(scope="module")
def checkpoints(spec, tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    torch.manual_seed(0)
    v, a, l = spec.vision, spec.audio, spec.llm
    vision = SiglipVisionModel(SiglipVisionConfig(hidden_size=v.hidden, intermediate_size=v.mlp, num_hidden_layers=v.blocks,
                                                  num_attention_heads=v.heads, patch_size=v.patch, image_size=64))
    audio = WhisperModel(WhisperConfig(d_model=a.hidden, encoder_layers=a.blocks, decoder_layers=1,
                                       encoder_attention_heads=a.heads, decoder_attention_heads=a.heads,
                                       encoder_ffn_dim=a.mlp, decoder_ffn_dim=a.mlp, num_mel_bins=a.mel_bins,
                                       max_source_positions=400))
    llm = LlamaForCausalLM(LlamaConfig(vocab_size=l.vocab, hidden_size=l.hidden, intermediate_size=l.mlp,
                                       num_hidden_layers=l.blocks, num_attention_heads=l.heads,
                                       num_key_value_heads=l.kv_heads, rms_norm_eps=1e-6, tie_word_embeddings=False))
    for name, model in (("vision", vision), ("audio", audio), ("llm", llm)):
        model.eval()
        model.save_pretrained(root / name)
    return {"vision": vision, "audio": audio, "llm": llm,
            "pre": Pretrained(vision=str(root / "vision"), audio=str(root / "audio"), llm=str(root / "llm"))}


def test_llm_layers_compute_the_checkpoints_logits(spec, checkpoints):
    layers = build_layers(spec, seed=0, image_token=IMG, audio_token=AUD, pretrained=checkpoints["pre"])
    ids = [int(x) for x in np.random.default_rng(0).integers(10, 2000, 37)]
    mb = collate([S(ids)], patch=spec.vision.patch, packed=True, pad_id=0)
    with torch.no_grad():
        ours = run_layers(layers, mb.carrier)
        theirs = checkpoints["llm"](torch.tensor([ids])).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_vision_layers_compute_the_checkpoints_features(spec, checkpoints):
    layers = build_layers(spec, seed=0, image_token=IMG, audio_token=AUD, pretrained=checkpoints["pre"])
    img = np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    n = 64 // 8 * 64 // 8 // 4
    mb = collate([S([IMG] * n, images=[img])], patch=8, packed=True, pad_id=0)
    x = mb.carrier
    with torch.no_grad():
        for layer in layers[:3]:  # embed and blocks
            x = layer(x)
        ours = layers[3].norm(C.from_wire(x[C.IMAGE], torch.float32)[0])
        pixels = torch.from_numpy(img).permute(2, 0, 1)[None].float() / 255 * 2 - 1
        theirs = checkpoints["vision"](pixel_values=pixels).last_hidden_state[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_audio_layers_compute_the_checkpoints_encoder(spec, checkpoints):
    layers = build_layers(spec, seed=0, image_token=IMG, audio_token=AUD, pretrained=checkpoints["pre"])
    mel = np.random.default_rng(2).standard_normal((spec.audio.mel_bins, 800)).astype(np.float32)
    mb = collate([S([AUD] * 200, audio=[mel])], patch=8, packed=True, pad_id=0)
    x = mb.carrier
    with torch.no_grad():
        for layer in layers[4:7]:  # audio embed and blocks
            x = layer(x)
        ours = layers[7].norm(C.from_wire(x[C.AUDIO], torch.float32)[0])
        theirs = checkpoints["audio"].encoder(torch.from_numpy(mel)[None]).last_hidden_state[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_checkpoint_of_another_shape_is_refused(spec, checkpoints, tmp_path):
    other = LlamaForCausalLM(LlamaConfig(vocab_size=spec.llm.vocab, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    other.save_pretrained(tmp_path / "small")
    with pytest.raises(ValueError, match=r"model\.llm\.hidden=128 but the checkpoint in .* has hidden_size=64; "
                                         r"set model\.llm\.hidden=64"):
        check_matches(spec, Pretrained(llm=str(tmp_path / "small")))


def test_a_folder_without_a_checkpoint_is_a_config_error(tmp_path, capsys):
    assert main(["train", f"pretrained.llm={tmp_path}"]) == 2
    assert f"pretrained.llm='{tmp_path}' is not a checkpoint folder" in capsys.readouterr().err
