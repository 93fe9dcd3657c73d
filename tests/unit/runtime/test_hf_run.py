"""Running a Hugging Face model: what is refused before launch (one line, no process, no run
directory), the planner and the runtime agreeing on every sample's length, and `mmpipe export` of
a checkpoint saved before any update giving the source back bit for bit."""

from __future__ import annotations

import re
from collections import Counter
from itertools import groupby, islice

import pytest
import torch
from safetensors.torch import load_file

from mmpipe.cli import load, main
from mmpipe.data.records import decode_record
from mmpipe.data.skips import SkipCounter
from mmpipe.model.geometry import features
from mmpipe.model.hf import build_layer, build_layers, save_layer_states
from mmpipe.model.hf.demo import MODELS, model_overrides
from mmpipe.model.spec import layer_names
from mmpipe.runtime import hf_run
from mmpipe.runtime.batch import collate_hf
from mmpipe.runtime.checkpoint import commit
from mmpipe.runtime.hf_run import load_templater
from mmpipe.runtime.preflight import write_run_config
from mmpipe.runtime.stream import make_stream


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


def test_a_planner_only_preset_is_refused(capsys, tmp_path):
    assert main(["train", "model=omni-7b", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    assert _error(capsys).startswith("mmpipe train: error: model=omni-7b is a planner-only composition (no "
                                     "transformers class holds both a vision and an audio tower)")
    assert not (tmp_path / "run").exists()


def test_a_7b_preset_that_does_not_fit_says_what_it_needs(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(hf_run, "device_memory", lambda _: (24 * 2**30, "RAM"))  # this machine's 24 GB
    assert main(["train", "model=llava-1.5-7b", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = _error(capsys)
    assert re.search(r"mmpipe train: error: model llava-1\.5-7b needs 10\d\.\d GiB of RAM for the weights, gradients "
                     r"and optimizer states of its 2 processes here .*7,05\d,\d{3},\d{3} parameters held.* but this "
                     r"machine has 24\.0 GiB of RAM", err), err
    assert not (tmp_path / "run").exists()
    # bf16 under ZeRO-1 over 2 replicas: 2-byte weights and gradients, DeepSpeed's fp32 gradient
    # buffer, the fp32 master and moments sharded in two (2 + 2 + 4 + 12 / 2 = 14 bytes a trained
    # parameter); 4 processes share the RAM
    assert main(["train", "model=llava-1.5-7b", "train.precision=bf16", "parallel.dp=2",
                 f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    err = _error(capsys)
    assert re.search(r"needs 13\d\.\d GiB of RAM .* of its 4 processes .*bf16, ZeRO-1, adamw, fp32 gradient "
                     r"accumulation: 2 bytes per weight, 14 per trained parameter", err), err
    # the same run fits a machine with enough memory (and then wants a tokenizer of the model)
    monkeypatch.setattr(hf_run, "device_memory", lambda _: (512 * 2**30, "RAM"))
    assert main(["train", "model=llava-1.5-7b", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    assert "has no checkpoint folder to take its tokenizer and chat template from" in _error(capsys)


def test_an_unsupported_checkpoint_is_a_one_line_error(capsys, tmp_path):
    from transformers import GPT2Config, LlavaConfig

    GPT2Config().save_pretrained(tmp_path / "gpt2")
    assert main(["train", "model=hf", f"model.path={tmp_path / 'gpt2'}", f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    assert _error(capsys) == (
        f"mmpipe train: error: model.path='{tmp_path / 'gpt2'}': model_type 'gpt2' is not supported; supported: "
        f"LlavaForConditionalGeneration, Qwen2VLForConditionalGeneration, Qwen2AudioForConditionalGeneration, "
        f"LlavaNextForConditionalGeneration, LlavaOnevisionForConditionalGeneration, "
        f"Qwen3VLForConditionalGeneration, Qwen2_5_VLForConditionalGeneration, "
        f"Qwen2_5OmniThinkerForConditionalGeneration, InternVLForConditionalGeneration, "
        f"Gemma3ForConditionalGeneration, or model=compose of a CLIP/SigLIP vision model or a Whisper "
        f"encoder with a llama/mistral/qwen2 causal LM")
    LlavaConfig(vision_feature_layer=[-2, -5]).save_pretrained(tmp_path / "layers")
    assert main(["train", "model=hf", f"model.path={tmp_path / 'layers'}"]) == 2
    assert "vision_feature_layer=[-2, -5]: only a single layer index is supported" in _error(capsys)
    assert not (tmp_path / "run").exists()


def test_missing_folders_name_their_keys(capsys, hf_checkpoints):
    assert main(["train", "model=hf"]) == 2
    assert _error(capsys).startswith("mmpipe train: error: model.path is not set; give model.path=DIR")
    assert main(["train", "model=compose", f"model.vision.path={hf_checkpoints['compose-vision']}"]) == 2
    assert _error(capsys).startswith("mmpipe train: error: model.llm.path is not set; give model.llm.path=DIR")
    assert main(["train", "model=compose", f"model.vision.path={hf_checkpoints['compose-vision']}",
                 f"model.audio.path={hf_checkpoints['compose-vision']}",
                 f"model.llm.path={hf_checkpoints['compose-llm']}"]) == 2
    assert "model=compose needs exactly one encoder, model.vision.path or model.audio.path" in _error(capsys)


def test_typos_in_a_model_group_suggest_its_own_keys(capsys):
    assert main(["train", "model=hf", "model.pth=x"]) == 2
    assert _error(capsys) == "mmpipe train: error: model.pth=x: no such config key; did you mean model.path?"
    assert main(["train", "model=compose", "model.llm.pth=x"]) == 2
    assert _error(capsys) == "mmpipe train: error: model.llm.pth=x: no such config key; did you mean model.llm.path?"


def test_use_audio_in_video_is_omnis_only(capsys, tmp_path, hf_checkpoints):
    """model.use_audio_in_video: a one-line error before launch for a model other than Omni, or a
    value that is not a boolean."""
    run = f"hydra.run.dir={tmp_path / 'run'}"
    assert main(["train", *model_overrides("qwen2.5-vl", hf_checkpoints), "model.use_audio_in_video=true", run]) == 2
    assert _error(capsys).endswith("model.use_audio_in_video=true: only Qwen2.5-Omni reads a video's audio track, "
                                   "this model is qwen2_5_vl; set model.use_audio_in_video=false")
    assert main(["train", *model_overrides("qwen2.5-omni", hf_checkpoints), "model.use_audio_in_video=sometimes",
                 run]) == 2
    assert _error(capsys).endswith("model.use_audio_in_video='sometimes' must be true or false")
    assert not (tmp_path / "run").exists()


def test_the_tokenizer_must_be_the_models(capsys, hf_checkpoints):
    assert main(["train", *model_overrides("llava", hf_checkpoints), "data.tokenizer=data/tokenizer.json"]) == 2
    assert re.search(r"data\.tokenizer='.*data/tokenizer\.json': its image token is id 5, but model llava replaces "
                     r"id \d+ \(image_token_id of its config\)", _error(capsys))


def test_gemma3_under_flash_attn_is_a_one_line_error_before_launch(capsys, tmp_path, hf_checkpoints):
    """flash-attn cannot mask Gemma 3's bidirectional image blocks: refused by name before any rank starts,
    on any machine (the model's blocks are checked before the package and the GPU)."""
    assert main(["train", *model_overrides("gemma3", hf_checkpoints), "train.attention=flash",
                 f"hydra.run.dir={tmp_path / 'run'}"]) == 2
    assert _error(capsys) == ("mmpipe train: error: train.attention=flash cannot attend bidirectionally inside an "
                              "image (Gemma 3's image blocks): flash-attn's varlen kernel is causal or not per call; "
                              "use train.attention=auto (FlexAttention) or flex")


def test_gemma3_templated_ids_are_gemma3processors(hf_checkpoints):
    """The templater's ids of a two-round conversation with images next to text, to a turn's edge and to
    each other are Gemma3Processor's (the folder's own, AutoProcessor) on the chat template's render: the
    "\\n\\n" around each image tokenized with the text beside it; labels on the answers only."""
    from PIL import Image
    from transformers import AutoProcessor

    from mmpipe.data.template import IGNORE, Turn

    rc = load(model_overrides("gemma3", hf_checkpoints), job="test")
    tok = load_templater(rc)
    proc = AutoProcessor.from_pretrained(hf_checkpoints["gemma3"])
    turns = [Turn(role="human", text="<image>\nWhat is it?"), Turn(role="gpt", text="a line"),
             Turn(role="human", text="And these <image><image> two?\n\nSay."), Turn(role="gpt", text="two lines")]
    n = rc.model.vision.merge ** -2 * (rc.model.vision.image_size // rc.model.vision.patch) ** 2
    ours = tok.template(turns, image_tokens=[int(n)] * 3)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a line"}]},
            {"role": "user", "content": [{"type": "text", "text": "And these "}, {"type": "image"}, {"type": "image"},
                                         {"type": "text", "text": " two?\n\nSay."}]},
            {"role": "assistant", "content": [{"type": "text", "text": "two lines"}]}]
    text = proc.tokenizer.apply_chat_template(msgs, tokenize=False)
    images = [Image.new("RGB", (30, 20), (40 * i, 90, 200)) for i in range(3)]
    out = proc(text=text, images=images, add_special_tokens=not text.startswith(proc.tokenizer.bos_token))
    assert ours.input_ids == out["input_ids"][0]
    boi = proc.tokenizer.convert_tokens_to_ids(proc.tokenizer.boi_token)
    assert ours.input_ids.count(boi) == 3 and ours.input_ids.count(tok.image_id) == 3 * n
    answers = proc.tokenizer.decode([y for y in ours.labels if y != IGNORE])
    assert "a line" in answers and "two lines" in answers and "What" not in answers


VIDEO_MODELS = ("qwen2-vl", "llava-onevision", "qwen2.5-vl", "qwen2.5-omni+track")
"""The cases whose shipped video samples are trained (the rest skip them as `no encoder`)."""


@pytest.mark.parametrize("name", [*MODELS, "qwen2.5-omni+track"])
def test_plan_and_runtime_agree_on_every_sample(name, hf_checkpoints):
    """The planner's LLM length of a sample (from its metadata) is the length the runtime collates
    with the checkpoint's templater and processors, and the towers make as many embeddings as
    the text holds media tokens (the embedding layer refuses any other count). `qwen2.5-omni+track`:
    Omni with model.use_audio_in_video=true on the video mix, whose clips with a tone track are
    decoded twice (frames, then the track) and interleaved in the text."""
    # the shipped data starts with the video mix (videos, images, audio, text); a model with an audio tower
    # reads the part with image+audio samples too
    data = ["data.path='data/shards/train-{000000..000007}.tar'"] if name in ("qwen2-audio", "qwen2.5-omni") else []
    track = name.endswith("+track")
    name = name.removesuffix("+track")
    rc = load([*model_overrides(name, hf_checkpoints), *data, *(["model.use_audio_in_video=true"] if track else [])],
              job="test")
    spec, tok = rc.model, load_templater(rc)
    names = layer_names(spec)
    front = [build_layer(spec, n, seed=0) for n in names[:names.index("llm.embed") + 1]]
    kinds: Counter = Counter()
    tracks: Counter = Counter()
    samples, planned = [], []
    for rec in islice(make_stream(rc, tokenizer=tok, dp_rank=0, skips=SkipCounter()).records(), 12 if track else 40):
        f = features(spec, rec.meta)
        sample = decode_record(rec, tok, spec)
        mb = collate_hf([sample], spec=spec, packed=True, pad_id=tok.pad_id)
        assert mb.tokens == mb.carrier[0].shape[1] == f.llm_len, rec.key
        if spec.vision is not None:
            assert sample.input_ids.count(tok.image_id) == sum(f.image_tokens), rec.key
        if spec.vision is not None and spec.vision.image_markers:  # InternVL: <img> image tokens </img>; Gemma 3:
            runs = [(k, len(list(g))) for k, g in groupby(sample.input_ids)]  # <start_of_image> .. <end_of_image>
            wrap = tok.wrap or tuple(tok.tokenizer.convert_tokens_to_ids([tok.tokenizer.boi_token,
                                                                          tok.tokenizer.eoi_token]))
            assert [runs[i - 1][0] == wrap[0] and runs[i + 1][0] == wrap[1]
                    for i, (k, _) in enumerate(runs) if k == tok.image_id] == [True] * len(rec.meta.images)
        if spec.audio is not None:
            assert sample.input_ids.count(tok.audio_id) == sum(f.audio_tokens), rec.key
        if f.video_tokens:
            assert sample.input_ids.count(tok.video_id) == sum(f.video_tokens), rec.key
        carrier = mb.carrier
        for layer in front:
            carrier = layer(carrier)
        hidden = carrier[7]
        assert hidden.shape == (1, f.llm_len, spec.llm.hidden)
        kinds[f.modality] += 1
        for m in rec.meta.videos:
            tracks[bool(m.has_audio)] += 1
        if track and rec.meta.videos and rec.meta.videos[0].has_audio:  # <audio_bos> video.. audio.. <audio_eos>
            ids = sample.input_ids
            start = ids.index(tok.video_id)
            assert ids[start - 1] == tok.track[0] and tok.audio_id in ids[start:ids.index(tok.track[1], start)], rec.key
        samples.append(sample)
        planned.append(f.llm_len)
    assert kinds["text"] and kinds["image" if spec.vision is not None else "audio"], kinds
    assert kinds["video"] if name + "+track" * track in VIDEO_MODELS else not kinds["video"], kinds
    if track:  # some clips carry a tone track, interleaved (audio tokens inside the video's run), some none
        assert tracks[True] and tracks[False], tracks
    elif spec.vision is not None and spec.audio is not None:  # Qwen2.5-Omni: every kind of sample
        assert kinds["audio"] and kinds["image+audio"], kinds
    for packed in (True, False):
        mb = collate_hf(samples, spec=spec, packed=packed, pad_id=tok.pad_id)
        assert mb.tokens == sum(planned)


def test_an_image_the_processor_refuses_is_a_counted_skip(hf_checkpoints):
    """Qwen2-VL's resize refuses an aspect ratio over 200: the sample is an `undecodable image`
    (counted and skipped by the reader), not an exception in a rank."""
    import io
    import json

    from PIL import Image

    from mmpipe.data.records import make_record
    from mmpipe.data.skips import SampleError

    rc = load(model_overrides("qwen2-vl", hf_checkpoints), job="test")
    png = io.BytesIO()
    Image.new("RGB", (420, 2)).save(png, format="PNG")
    raw = {"__key__": "k", "__url__": "x.tar", "0.png": png.getvalue(), "json": json.dumps({"conversations": [
        {"from": "human", "value": "<image>\nWhat is it?"}, {"from": "gpt", "value": "a line"}]}).encode()}
    with pytest.raises(SampleError, match=r"undecodable image: the model's image processor refuses it \(image of "
                                          r"2x420 has an aspect ratio over 200"):
        make_record(raw, load_templater(rc), rc.model)


@pytest.mark.parametrize("name", ["llava", "llava-onevision", "internvl", "gemma3"])
def test_export_right_after_loading_is_the_source_bit_for_bit(name, capsys, tmp_path, hf_checkpoints):
    """A checkpoint of the layers as every rank loads them, saved in the pipeline's layout, exports
    to the very tensors of the source (OneVision's image_newline too), loads with the original
    class with no missing or unexpected key, and carries the source's tokenizer, chat template and
    processor config (OneVision, InternVL, Gemma 3: the whole processor, which AutoProcessor loads back)."""
    import transformers
    from transformers import AutoProcessor, AutoTokenizer

    source = hf_checkpoints[name]
    run = tmp_path / "run"
    rc = load([*model_overrides(name, hf_checkpoints), f"hydra.run.dir={run}"], job="test")
    write_run_config(rc)
    save_layer_states(build_layers(rc.model, seed=rc.train.seed), rc.model, run / "checkpoints" / "step0")
    commit(run / "checkpoints" / "step0", step=0, files={}, topology={}, schedule={})  # as a finished save does
    assert main(["export", str(run), f"out={tmp_path / 'out'}"]) == 0
    assert "mmpipe export: wrote" in capsys.readouterr().out
    ours, theirs = load_file(tmp_path / "out" / "model.safetensors"), load_file(source / "model.safetensors")
    assert set(ours) == set(theirs)
    for key, t in theirs.items():
        assert ours[key].dtype == t.dtype and torch.equal(ours[key], t), key
    cls = getattr(transformers, rc.model.hf.architecture)
    _, info = cls.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok.chat_template == AutoTokenizer.from_pretrained(source).chat_template
    config = "preprocessor_config.json" if name == "llava" else "processor_config.json"
    assert (tmp_path / "out" / config).read_text() == (source / config).read_text()
    if name != "llava":
        want = {"llava-onevision": "LlavaOnevisionProcessor", "internvl": "InternVLProcessor",
                "gemma3": "Gemma3Processor"}[name]
        assert type(AutoProcessor.from_pretrained(tmp_path / "out")).__name__ == want


def test_export_errors_name_the_argument(capsys, tmp_path):
    run = tmp_path / "tiny"
    write_run_config(load([f"hydra.run.dir={run}"], job="test"))
    assert main(["export", str(run), f"out={tmp_path / 'out'}"]) == 2
    assert "mmpipe export: error: " in (err := _error(capsys)) and "trained model tiny, mmpipe's own model: export " \
                                                                   "writes a Hugging Face model" in err
    assert main(["export", str(tmp_path / "nowhere"), "out=x"]) == 2
    assert "is not a run directory (no run.yaml)" in _error(capsys)
    assert main(["export", str(run), "out=x", "step=3"]) == 2
    assert "step=3: not an export argument; usage: mmpipe export RUN_DIR [checkpoint=stepN] out=DIR" in _error(capsys)
    assert main(["export", str(run)]) == 2
    assert "give one run directory and out=DIR" in _error(capsys)


def test_an_internvl_folder_whose_tokens_disagree_is_refused(hf_checkpoints, tmp_path):
    """InternVL's processor repeats the tokenizer's context_image_token and wraps it in its
    start_image_token / end_image_token: a config's image_token_id of another token, or a tokenizer
    naming no markers, is a one-line error when the templater is made (transformers fails at the
    forward; mmpipe would train on another token)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    folder = tmp_path / "internvl"
    shutil.copytree(hf_checkpoints["internvl"], folder)
    config = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer_config.json").read_text())
    video = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<video>")
    (folder / "config.json").write_text(json.dumps({**config, "image_token_id": video}))
    rc = load(model_overrides("internvl", {"internvl": folder}), job="test")
    with pytest.raises(ValueError, match=rf"image_token_id={video} \('<video>'\) is not the tokenizer's "
                                         rf"context_image_token '<IMG_CONTEXT>' \(\d+\), .*set image_token_id to \d+$"):
        load_templater(rc)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in tok.items() if "image_token" not in k}))
    with pytest.raises(ValueError, match=r"the tokenizer names no start_image_token / end_image_token"):
        load_templater(load(model_overrides("internvl", {"internvl": folder}), job="test"))
