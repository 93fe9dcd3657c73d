"""Model assembly: layer names and order, placeholder merging, the text-only path, packing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from mmpipe.data.video import DecodedVideo
from mmpipe.model import carrier as C
from mmpipe.model.geometry import (
    VideoMeta,
    audio_frames,
    audio_tokens,
    image_tokens,
    resize_image,
    video_grid,
    video_tokens,
)
from mmpipe.model.group import model_from_group
from mmpipe.model.layers import build_layer, build_layers, run_layers, token_loss
from mmpipe.model.spec import is_trainable, layer_names, spec_from_dict
from mmpipe.paths import CONF_DIR
from mmpipe.runtime.batch import collate

IMG, AUD, VID = 5, 6, 7


def tiny():
    return spec_from_dict(yaml.safe_load((CONF_DIR / "model/tiny.yaml").read_text()))


class FakeSample:
    def __init__(self, key, spec, rng, images=(), clips=(), text=12, videos=()):
        """videos: (frames, fps, height, width) of each clip; its placeholder tokens come first."""
        self.key, self.images, self.audio, self.videos = key, [], [], []
        ids, labels = [1, 3], [-100, -100]
        for n, fps, h, w in videos:
            meta = VideoMeta(frames=n, fps=fps, height=h, width=w)
            t, gh, gw = video_grid(spec.vision, meta)
            frames = rng.integers(0, 256, (t * spec.vision.video.temporal_patch, gh * spec.vision.patch,
                                           gw * spec.vision.patch, 3), dtype=np.uint8)
            self.videos.append(DecodedVideo(frames=frames, meta=meta))
            n_tok = video_tokens(spec.vision, meta)
            ids += [VID] * n_tok
            labels += [-100] * n_tok
        for h, w in images:
            rh, rw = resize_image(spec.vision, h, w)
            self.images.append(rng.integers(0, 256, (rh, rw, 3), dtype=np.uint8))
            n = image_tokens(spec.vision, h, w)
            ids += [IMG] * n
            labels += [-100] * n
        for s in clips:
            mel = rng.standard_normal((spec.audio.mel_bins, audio_frames(spec.audio, s)))
            self.audio.append(mel.astype(np.float32))
            n = audio_tokens(spec.audio, s)
            ids += [AUD] * n
            labels += [-100] * n
        words = [int(x) for x in rng.integers(10, 200, text)]
        ids += [4] + words
        labels += [-100] + words
        self.input_ids, self.labels = ids, labels


@pytest.fixture
def spec():
    return tiny()


@pytest.fixture
def layers(spec):
    return build_layers(spec, seed=0, image_token=IMG, audio_token=AUD, video_token=VID)


def _collate(samples, spec, packed=True):
    return collate(samples, patch=spec.vision.patch, packed=packed, pad_id=0,
                   temporal_patch=spec.vision.video.temporal_patch)


def test_layer_names_follow_the_grammar_in_order(spec):
    names = layer_names(spec)
    assert names == (["vision.embed", "vision.block.0", "vision.block.1", "vision.proj",
                      "audio.embed", "audio.block.0", "audio.block.1", "audio.proj",
                      "llm.embed", "llm.block.0", "llm.block.1", "llm.block.2", "llm.block.3",
                      "llm.norm", "llm.head"])


def test_every_preset_lists_layers_without_building_weights():
    for path in sorted((CONF_DIR / "model").glob("*.yaml")):
        if path.stem in ("hf", "compose"):
            continue  # they read checkpoint folders (tests/unit/test_config.py composes them)
        spec = model_from_group(yaml.safe_load(path.read_text())).spec
        names = layer_names(spec)
        assert names[-2:] == ["llm.norm", "llm.head"]
        assert names.count("llm.embed") == 1
        assert len([n for n in names if n.startswith("llm.block.")]) == spec.llm.blocks


def test_spec_errors_name_the_key():
    cfg = yaml.safe_load((CONF_DIR / "model/tiny.yaml").read_text())
    cfg["vision"]["hiden"] = 3
    with pytest.raises(ValueError, match=r"model\.vision\.hiden is not a setting"):
        spec_from_dict(cfg)
    cfg = yaml.safe_load((CONF_DIR / "model/tiny.yaml").read_text())
    cfg["audio"]["proj"] = [64]
    with pytest.raises(ValueError, match=r"model\.audio\.proj ends in 64 but model\.llm\.hidden=128"):
        spec_from_dict(cfg)


def test_trainable_prefixes():
    assert is_trainable("vision.proj", ("vision.proj", "llm"))
    assert not is_trainable("vision.block.0", ("vision.proj", "llm"))
    assert is_trainable("llm.block.3", ("llm",))
    assert is_trainable("audio.embed", ("all",))


def test_a_layer_is_the_same_whoever_builds_it(spec, layers):
    alone = build_layer(spec, "llm.block.2", seed=0, image_token=IMG, audio_token=AUD)
    for k, v in alone.state_dict().items():
        assert torch.equal(v, layers[11].state_dict()[k])
    other_seed = build_layer(spec, "llm.block.2", seed=1, image_token=IMG, audio_token=AUD)
    assert not torch.equal(other_seed.state_dict()["block.mlp.up_proj.weight"],
                           alone.state_dict()["block.mlp.up_proj.weight"])


def test_image_and_audio_embeddings_land_on_their_placeholders(spec, layers):
    rng = np.random.default_rng(0)
    s = FakeSample("a", spec, rng, images=[(40, 72)], clips=[0.9])
    mb = collate([s], patch=spec.vision.patch, packed=True, pad_id=0)
    x = mb.carrier
    for layer in layers[:8]:  # encoders and projectors
        x = layer(x)
    img, aud = x[C.IMAGE], x[C.AUDIO]
    assert img.shape == (image_tokens(spec.vision, 40, 72), spec.llm.hidden)
    assert aud.shape == (audio_tokens(spec.audio, 0.9), spec.llm.hidden)
    h = layers[8](x)[C.HIDDEN][0]
    ids = torch.tensor(s.input_ids)
    torch.testing.assert_close(h[ids == IMG], img)
    torch.testing.assert_close(h[ids == AUD], aud)
    text = (ids != IMG) & (ids != AUD)
    torch.testing.assert_close(h[text], layers[8].embed.weight[ids[text]])


def test_video_embeddings_land_on_video_tokens_after_the_images(spec, layers):
    """A sample whose video comes before its image in the text: the IMAGE slot holds the images'
    embeddings first, then the videos'; llm.embed puts each on its own tokens, in order."""
    rng = np.random.default_rng(5)
    s = FakeSample("v", spec, rng, videos=[(16, 8.0, 48, 64), (6, 4.0, 32, 32)], images=[(40, 72)])
    mb = _collate([s], spec)
    assert mb.carrier[C.VIDEOS].tolist() == [2]
    assert mb.carrier[C.IMAGE_GRID].tolist() == [[1, 4, 8], [4, 6, 8], [3, 4, 4]]  # image, then the videos
    x = mb.carrier
    for layer in layers[:4]:  # the vision tower and its projector
        x = layer(x)
    n_img = image_tokens(spec.vision, 40, 72)
    n_vid = [video_tokens(spec.vision, v.meta) for v in s.videos]
    assert n_vid == [48, 12] and x[C.IMAGE].shape == (n_img + sum(n_vid), spec.llm.hidden)
    h = layers[8](layers[7](layers[6](layers[5](layers[4](x)))))[C.HIDDEN][0]
    ids = torch.tensor(s.input_ids)
    torch.testing.assert_close(h[ids == IMG], x[C.IMAGE][:n_img])
    torch.testing.assert_close(h[ids == VID], x[C.IMAGE][n_img:])


def test_a_video_patch_sees_its_frames_in_order(spec, layers):
    """Temporal patches: swapping the two frames of a pair changes the embedding (the Conv3d reads
    them in order); every temporal patch attends on its own, so changing the last pair leaves the
    first pair's encoder states as they were."""
    rng = np.random.default_rng(6)
    s = FakeSample("v", spec, rng, videos=[(16, 8.0, 32, 32)])
    frames = s.videos[0].frames  # 8 frames, 4 temporal patches

    def tower(f):
        s.videos[0] = DecodedVideo(frames=f, meta=s.videos[0].meta)
        x = _collate([s], spec).carrier
        for layer in layers[:3]:
            x = layer(x)
        return C.from_wire(x[C.IMAGE], torch.float32)[0]

    base = tower(frames)
    swapped = frames.copy()
    swapped[[0, 1]] = frames[[1, 0]]
    assert not torch.allclose(tower(swapped)[:16], base[:16])
    changed = frames.copy()
    changed[6:] = 255 - frames[6:]
    other = tower(changed)
    torch.testing.assert_close(other[:48], base[:48])
    assert not torch.allclose(other[48:], base[48:])


def test_text_only_sample_runs_no_encoder_work(spec, layers):
    rng = np.random.default_rng(1)
    s = FakeSample("t", spec, rng, text=30)
    mb = collate([s], patch=spec.vision.patch, packed=True, pad_id=0)
    seen = []
    for layer in layers[:8]:
        layer.register_forward_hook(lambda m, i, o: seen.append(o[C.IMAGE].numel() + o[C.AUDIO].numel()))
    full = token_loss(run_layers(layers, mb.carrier), (mb.targets, torch.tensor([1.0])))
    assert seen == [0] * 8  # every encoder layer saw empty input
    llm_only = token_loss(run_layers(layers[8:], mb.carrier), (mb.targets, torch.tensor([1.0])))
    assert full.item() == pytest.approx(llm_only.item(), rel=1e-6)


def test_packed_and_padded_micro_batches_give_equal_loss_and_grads(spec, layers):
    rng = np.random.default_rng(2)
    samples = [FakeSample("a", spec, rng, images=[(30, 30)], text=5),
               FakeSample("b", spec, rng, clips=[1.7], text=40, videos=[(8, 4.0, 48, 48)]),
               FakeSample("c", spec, rng, images=[(100, 20), (16, 16)], clips=[0.4], text=9)]
    results = []
    for packed in (True, False):
        for l in layers:
            l.zero_grad()
        mb = _collate(samples, spec, packed=packed)
        loss = token_loss(run_layers(layers, mb.carrier), (mb.targets, torch.tensor([1.0 / mb.label_tokens])))
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for l in layers for p in l.parameters()]))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    for a, b in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_wire_format_roundtrips_frozen_floats():
    t = torch.randn(3, 4)
    wire = C.to_wire(t)
    assert not wire.is_floating_point()
    assert torch.equal(C.from_wire(wire, torch.float32), t)
    g = torch.randn(2, requires_grad=True) * 1
    assert C.to_wire(g) is g  # a float with a gradient travels as a float


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_activations_cross_stages_bit_exact(dtype):
    """A frozen bf16/fp16 activation travels as int16 and comes back as the same bits, neither
    upcast nor truncated; fp32 inputs (log-mel features) reach a half layer rounded to it."""
    t = (torch.randn(3, 5) * 100).to(dtype)
    wire = C.to_wire(t)
    assert wire.dtype == torch.int16
    back = C.from_wire(wire, dtype)
    assert back.dtype == dtype and torch.equal(back.view(torch.int16), t.view(torch.int16))
    mels = torch.randn(2, 4)
    assert torch.equal(C.from_wire(C.to_wire(mels), dtype), mels.to(dtype))


def test_a_packed_sample_has_the_loss_and_gradient_of_its_unpacked_self(spec, layers):
    """Per-sample attention and positions: packing changes nothing for the sample."""
    rng = np.random.default_rng(3)
    # Several images and clips on both sides: an image or clip that attends to another one
    # (of its own sample or of a neighbour) changes the loss or the gradients.
    a = FakeSample("a", spec, rng, images=[(48, 32), (16, 40)], clips=[0.6, 0.3], text=20,
                   videos=[(12, 6.0, 32, 48), (9, 4.0, 48, 32)])
    others = [FakeSample("b", spec, rng, clips=[0.9], text=50, videos=[(16, 8.0, 32, 32)]),
              FakeSample("c", spec, rng, images=[(24, 80)], clips=[0.2, 0.5], text=7)]

    def loss_and_grads(samples, only_first: bool):
        for l in layers:
            l.zero_grad()
        mb = _collate(samples, spec)
        targets = mb.targets.clone()
        if only_first:
            targets[0, len(samples[0].input_ids):] = -100  # keep only sample a's labels
        loss = token_loss(run_layers(layers, mb.carrier), (targets, torch.tensor([1.0])))
        loss.backward()
        return loss.item(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                             for l in layers for p in l.parameters()]

    alone_loss, alone_grads = loss_and_grads([a], only_first=False)
    packed_loss, packed_grads = loss_and_grads([a, *others], only_first=True)
    assert packed_loss == pytest.approx(alone_loss, rel=1e-5)
    for g1, g2 in zip(alone_grads, packed_grads):
        torch.testing.assert_close(g1, g2, rtol=1e-4, atol=5e-6)  # fp32 summation order differs


@pytest.mark.parametrize("media", ["text", "image", "video", "audio", "mixed"])
def test_a_stage_boundary_may_fall_after_any_layer(spec, layers, media):
    """DeepSpeed sends a gradient back for every float a stage received (`assert buffer.grad is not
    None` in _exec_send_grads): whatever media a micro-batch holds, every float that crosses any cut,
    a tower's empty states [1, 0, Dv] of a micro-batch without its media included, gets one."""
    rng = np.random.default_rng(5)
    kinds = {"text": {}, "image": {"images": [(30, 30)]}, "video": {"videos": [(8, 4.0, 48, 48)]},
             "audio": {"clips": [1.7]}, "mixed": {"images": [(30, 30)], "clips": [1.7], "videos": [(8, 4.0, 48, 48)]}}
    mb = _collate([FakeSample("m", spec, rng, text=9, **kinds[media]), FakeSample("t", spec, rng, text=7)], spec)
    scale = (mb.targets, torch.tensor([1.0]))
    whole = token_loss(run_layers(layers, mb.carrier), scale)
    for cut in range(1, len(layers) - 1):
        x = mb.carrier
        for layer in layers[:cut]:
            x = layer(x)
        for t in x:  # what DeepSpeed sends: floats that need a gradient back, integers otherwise
            assert not t.is_floating_point() or t.requires_grad, f"{media}: a float without grad after cut {cut}"
        received = tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t for t in x)
        loss = token_loss(run_layers(layers[cut:], received), scale)
        loss.backward()
        assert loss.item() == whole.item()
        for slot, t in enumerate(received):
            assert not t.is_floating_point() or t.grad is not None, \
                f"{media}: no gradient came back for slot {slot} across cut {cut} ({layers[cut].name})"
