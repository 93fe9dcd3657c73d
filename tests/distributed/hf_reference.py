"""The reference of test_hf_train.py: the transformers model's own forward and backward on the raw
samples, its inputs built here from the shards' tar members with the checkpoint's own chat
template (`apply_chat_template`) and processors (LlavaProcessor, Qwen2AudioProcessor, Qwen3VLProcessor,
Qwen2_5_VLProcessor, Qwen2_5OmniProcessor; for LLaVA-NeXT and OneVision the folder's own processor
from AutoProcessor, a conversation's images nested as apply_chat_template nests them, OneVision's
clips decoded whole by transformers' `load_video` and given to it as frames;
Qwen2VLProcessor, Qwen2_5_VLProcessor and Qwen2_5OmniProcessor with the folder's image processor (as
AutoImageProcessor gives it: the torchvision backend) and video processor, a video decoded whole by
transformers' own PyAV reader, `load_video`, and sampled by the processor), under the label
convention of docs/data.md, written from that text.
None of mmpipe's data code is used.

The convention: a turn `human` is a `user` message, `gpt` an `assistant` one; with structured
content each `<image>` / `<audio>` placeholder is an item, whitespace between a placeholder and the
start or end of its turn dropped; answer k is labelled with the tokens the render through answer k
adds to the render of the turns before it with the generation prompt; everything else is -100.
"""

from __future__ import annotations

import io
import json
import re
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import soundfile
import soxr
import torch
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
SHARDS = ROOT / "data" / "shards"  # the shipped shards
PLACEHOLDER = re.compile(r"(<image>|<audio>|<video>)")
ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
ANYRES = {"llava-next": "LlavaNextImageProcessor", "llava-onevision": "LlavaOnevisionImageProcessor"}
"""The any-resolution kinds and the image processor AutoProcessor gives each (torchvision backend)."""


def raw_samples(keys: set[str]) -> dict[str, dict]:
    """{key: {"conversations", "images": [bytes], "audio": [bytes], "videos": [bytes]}} read from the
    shipped tars."""
    found: dict[str, dict] = {}
    shards = sorted(SHARDS.glob("*.tar"))
    if not shards:
        raise FileNotFoundError(f"no shipped shards in {SHARDS}")
    for shard in shards:
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                key, _, rest = m.name.partition(".")
                if key not in keys:
                    continue
                entry = found.setdefault(key, {"images": {}, "audio": {}, "videos": {}})
                data = tar.extractfile(m).read()
                if rest == "json":
                    entry["conversations"] = json.loads(data)["conversations"]
                else:
                    index, ext = rest.split(".")
                    entry["audio" if ext == "wav" else "videos" if ext == "mp4" else "images"][int(index)] = data
        if len(found) == len(keys) and all("conversations" in e for e in found.values()):
            break
    for e in found.values():
        for kind in ("images", "audio", "videos"):
            e[kind] = [e[kind][i] for i in sorted(e[kind])]
    return found


def _items(text: str) -> list[dict]:
    pieces = PLACEHOLDER.split(text)
    items = [{"type": p[1:-1]} if n % 2 else {"type": "text", "text": p} for n, p in enumerate(pieces)]
    texts = [i for i, it in enumerate(items) if it["type"] == "text" and it["text"].strip()]
    for i, it in enumerate(items):
        if it["type"] != "text":
            continue
        if not texts or i < texts[0] or i > texts[-1]:
            it["text"] = ""  # whitespace at the turn's edges, among placeholders
        elif i == texts[0] and any(x["type"] != "text" for x in items[:i]):
            it["text"] = it["text"].lstrip()
        if texts and i == texts[-1] and any(x["type"] != "text" for x in items[i + 1:]):
            it["text"] = it["text"].rstrip()
    return [it for it in items if it["type"] != "text" or it["text"]]


def messages(conversations: list[dict], *, structured: bool) -> list[dict]:
    out = []
    for turn in conversations:
        role, text = ROLES[turn["from"]], turn["value"]
        if not structured:
            out.append({"role": role, "content": text})
        elif role == "user":
            out.append({"role": role, "content": _items(text)})
        else:
            out.append({"role": role, "content": [{"type": "text", "text": text}]})
    return out


def video(data: bytes):
    """(every frame, VideoMetadata) of a clip, by transformers' own PyAV reader (it reads files)."""
    from transformers.video_utils import load_video

    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        return load_video(f.name, backend="pyav")


def waveform(data: bytes, rate: int) -> np.ndarray:
    x, sr = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
    x = x.mean(axis=1)
    return soxr.resample(x, sr, rate).astype(np.float32) if sr != rate else x


class Reference:
    """One architecture's processors and model (kind: one of mmpipe.model.hf.demo.MODELS)."""

    def __init__(self, kind: str, folders: dict[str, Path]):
        from transformers import AutoTokenizer

        self.kind = kind
        text_folder = folders["compose-llm"] if kind == "compose" else folders[kind]
        self.tok = AutoTokenizer.from_pretrained(text_folder)
        self.structured = kind != "compose"  # the composed LLM's template reads string content
        if kind in ("llava", "compose"):
            from transformers import AutoImageProcessor, LlavaProcessor

            media = folders["compose-vision"] if kind == "compose" else folders[kind]
            self.processor = LlavaProcessor(image_processor=AutoImageProcessor.from_pretrained(media),
                                            tokenizer=self.tok, patch_size=7, vision_feature_select_strategy="default",
                                            num_additional_image_tokens=1)
        elif kind in ANYRES:  # the folder's whole processor, as AutoProcessor loads it (torchvision backend)
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(folders[kind])
            assert type(self.processor.image_processor).__name__ == ANYRES[kind], type(self.processor.image_processor)
        elif kind == "qwen2-audio":
            from transformers import Qwen2AudioProcessor, WhisperFeatureExtractor

            self.processor = Qwen2AudioProcessor(feature_extractor=WhisperFeatureExtractor.from_pretrained(
                folders[kind]), tokenizer=self.tok)
        elif kind in ("qwen2.5-vl", "qwen2.5-omni"):
            from transformers import (
                AutoImageProcessor,
                Qwen2_5_VLProcessor,
                Qwen2_5OmniProcessor,
                Qwen2VLVideoProcessor,
                WhisperFeatureExtractor,
            )

            parts = dict(image_processor=AutoImageProcessor.from_pretrained(folders[kind]),
                         video_processor=Qwen2VLVideoProcessor.from_pretrained(folders[kind]), tokenizer=self.tok)
            if kind == "qwen2.5-vl":
                self.processor = Qwen2_5_VLProcessor(**parts)
            else:
                self.processor = Qwen2_5OmniProcessor(
                    **parts, feature_extractor=WhisperFeatureExtractor.from_pretrained(folders[kind]))
        elif kind == "internvl":  # the folder's whole processor (InternVLProcessor: <img> tiles' tokens </img>)
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(folders[kind])
            assert type(self.processor).__name__ == "InternVLProcessor", type(self.processor)
        elif kind == "gemma3":  # the folder's whole processor (Gemma3Processor: \n\n<boi> image tokens <eoi>\n\n)
            from transformers import AutoProcessor

            self.processor = AutoProcessor.from_pretrained(folders[kind])
            assert type(self.processor).__name__ == "Gemma3Processor", type(self.processor)
        elif kind == "qwen3-vl":
            from transformers import Qwen3VLProcessor

            self.processor = Qwen3VLProcessor.from_pretrained(folders[kind])
        else:
            from transformers import AutoImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

            self.processor = Qwen2VLProcessor(image_processor=AutoImageProcessor.from_pretrained(folders[kind]),
                                              video_processor=Qwen2VLVideoProcessor.from_pretrained(folders[kind]),
                                              tokenizer=self.tok)
        self.folders = folders

    # ------------------------------------------------------------------ inputs

    def _encode(self, text: str, images: list, clips: list, videos: list = ()) -> tuple[list[int], dict]:
        """Token ids of a rendered text with its media expanded by the model's processor."""
        if self.kind in ("llava", "compose"):
            n = text.count("<image>")
            out = self.processor(text=text, images=images[:n] or None, return_tensors="pt")
            return out["input_ids"][0].tolist(), {"pixel_values": out.get("pixel_values")}
        if self.kind in ANYRES:  # one conversation's images, nested as apply_chat_template nests them
            n, v = text.count("<image>"), text.count("<video>")
            nested = [images[:n]] if self.kind == "llava-onevision" else images[:n]
            out = self.processor(text=text, images=nested if n else None, videos=[f for f, _ in videos[:v]] or None,
                                 return_tensors="pt")
            return out["input_ids"][0].tolist(), {k: out.get(k) for k in ("pixel_values", "image_sizes",
                                                                          "batch_num_images", "pixel_values_videos")}
        if self.kind == "internvl":  # each <IMG_CONTEXT> expanded to its tiles' tokens, every tile's pixels
            n = text.count("<IMG_CONTEXT>")
            out = self.processor(text=text, images=images[:n] or None, return_tensors="pt")
            return out["input_ids"][0].tolist(), {"pixel_values": out.get("pixel_values")}
        if self.kind == "gemma3":  # each <start_of_image> expanded; token_type_ids mark the image tokens; no
            # second <bos> after the template's own (ProcessorMixin.apply_chat_template's rule)
            n = text.count(self.tok.boi_token)
            out = self.processor(text=text, images=images[:n] or None, return_tensors="pt",
                                 add_special_tokens=not text.startswith(self.tok.bos_token))
            return out["input_ids"][0].tolist(), {"pixel_values": out.get("pixel_values"),
                                                  "token_type_ids": out["token_type_ids"][0].tolist()}
        if self.kind == "qwen2-audio":
            n = text.count("<|AUDIO|>")
            out = self.processor(text=text, audio=clips[:n] or None, sampling_rate=16000, return_tensors="pt")
            return out["input_ids"][0].tolist(), {"input_features": out.get("input_features"),
                                                  "feature_attention_mask": out.get("feature_attention_mask")}
        if self.kind in ("qwen2.5-vl", "qwen2.5-omni"):  # + second_per_grid_ts / video_second_per_grid
            n, v = text.count(self.processor.image_token), text.count(self.processor.video_token)
            m = text.count("<|AUDIO|>") if self.kind == "qwen2.5-omni" else 0
            out = self.processor(text=text, images=images[:n] or None, audio=clips[:m] or None,
                                 videos=[f for f, _ in videos[:v]] or None,
                                 video_metadata=[meta for _, meta in videos[:v]] or None, return_tensors="pt")
            return out["input_ids"][0].tolist(), {k: out.get(k) for k in (
                "pixel_values", "image_grid_thw", "input_features", "feature_attention_mask", "pixel_values_videos",
                "video_grid_thw", "second_per_grid_ts", "video_second_per_grid")}
        if self.kind == "qwen3-vl":  # Qwen3VLProcessor expands each <|image_pad|> and marks image tokens
            n = text.count("<|image_pad|>")
            out = self.processor(text=text, images=images[:n] or None, return_tensors="pt")
            return out["input_ids"][0].tolist(), {"pixel_values": out.get("pixel_values"),
                                                  "image_grid_thw": out.get("image_grid_thw"),
                                                  "mm_token_type_ids": out["mm_token_type_ids"][0].tolist()}
        n, v = text.count("<|image_pad|>"), text.count("<|video_pad|>")
        out = self.processor(text=text, images=images[:n] or None, videos=[f for f, _ in videos[:v]] or None,
                             video_metadata=[m for _, m in videos[:v]] or None, return_tensors="pt")
        keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
        return out["input_ids"][0].tolist(), {k: out[k] for k in keys if k in out}

    def sample(self, raw: dict) -> dict:
        """input_ids, labels and the model's media inputs of one raw sample."""
        images = [Image.open(io.BytesIO(b)).convert("RGB") for b in raw["images"]]
        clips = [waveform(b, 16000) for b in raw["audio"]]
        videos = [video(b) for b in raw.get("videos", [])]
        msgs = messages(raw["conversations"], structured=self.structured)

        def render(part, gen):
            return self.tok.apply_chat_template(part, tokenize=False, add_generation_prompt=gen)

        ids, media = self._encode(render(msgs, False), images, clips, videos)
        labels = [-100] * len(ids)
        for j, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            before = self._encode(render(msgs[:j], True), images, clips, videos)[0]
            through = self._encode(render(msgs[:j + 1], False), images, clips, videos)[0]
            assert through[:len(before)] == before and ids[:len(through)] == through, "renders do not extend"
            labels[len(before):len(through)] = ids[len(before):len(through)]
        return {"input_ids": ids, "labels": labels, **media}

    def batch(self, samples: list[dict]) -> dict:
        """One padded batch of every sample (right padding, attention mask, -100 on padding)."""
        t = max(len(s["input_ids"]) for s in samples)
        pad = self.tok.pad_token_id
        out = {"input_ids": torch.tensor([s["input_ids"] + [pad] * (t - len(s["input_ids"])) for s in samples]),
               "attention_mask": torch.tensor([[1] * len(s["input_ids"]) + [0] * (t - len(s["input_ids"]))
                                               for s in samples]),
               "labels": torch.tensor([s["labels"] + [-100] * (t - len(s["labels"])) for s in samples])}
        for key in ("pixel_values", "image_grid_thw", "input_features", "feature_attention_mask", "image_sizes",
                    "batch_num_images", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
                    "video_second_per_grid"):
            parts = [s[key] for s in samples if s.get(key) is not None]
            if key == "pixel_values" and self.kind in ANYRES and parts:  # [images, tiles, ...]: pad the tiles
                most = max(p.shape[1] for p in parts)
                parts = [torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 0, 0, most - p.shape[1])) for p in parts]
            if parts:
                out[key] = torch.cat(parts)
        if self.kind in ("qwen2-vl", "qwen2.5-vl"):  # text 0, image 1, video 2 (what the Qwen-VL processors return)
            image, video_ = (self.tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>"))
            out["mm_token_type_ids"] = (out["input_ids"] == image).int() + 2 * (out["input_ids"] == video_).int()
        if self.kind == "gemma3":  # the processor's token types (the image tokens), padded as text
            types = [s["token_type_ids"] for s in samples]
            out["token_type_ids"] = torch.tensor([x + [0] * (t - len(x)) for x in types])
        if self.kind == "qwen3-vl":  # the processor's own token types, padded as text
            types = [s["mm_token_type_ids"] for s in samples]
            out["mm_token_type_ids"] = torch.tensor([x + [0] * (t - len(x)) for x in types], dtype=torch.int32)
        return out

    def loss(self, model, samples: list[dict]):
        """The model's loss on the samples as one batch: the mean over all their label tokens.
        LLaVA-OneVision's get_video_features stacks only clips of one frame count, so a step with
        clips runs its samples one at a time, each loss weighted by its label tokens (the same mean)."""
        if self.kind != "llava-onevision" or all(s.get("pixel_values_videos") is None for s in samples):
            return model(**self.batch(samples)).loss
        total, count = 0.0, 0
        for s in samples:
            n = sum(1 for y in s["labels"][1:] if y != -100)  # the labels the shifted loss counts
            total, count = total + model(**self.batch([s])).loss * n, count + n
        return total / count

    # ------------------------------------------------------------------ model

    def model(self, folder: Path | None = None):
        """The transformers model (eager attention) from its checkpoint, or from `folder` (an
        export); parameters its modules declare frozen stay frozen."""
        import transformers

        if self.kind == "compose" and folder is None:
            return self._composed()
        cls = {"llava": "LlavaForConditionalGeneration", "compose": "LlavaForConditionalGeneration",
               "qwen2-vl": "Qwen2VLForConditionalGeneration", "qwen3-vl": "Qwen3VLForConditionalGeneration",
               "qwen2-audio": "Qwen2AudioForConditionalGeneration",
               "llava-next": "LlavaNextForConditionalGeneration",
               "llava-onevision": "LlavaOnevisionForConditionalGeneration",
               "qwen2.5-vl": "Qwen2_5_VLForConditionalGeneration",
               "qwen2.5-omni": "Qwen2_5OmniThinkerForConditionalGeneration",
               "internvl": "InternVLForConditionalGeneration", "gemma3": "Gemma3ForConditionalGeneration"}[self.kind]
        cls = getattr(transformers, cls)
        model = cls.from_pretrained(folder or self.folders[self.kind], attn_implementation="eager")
        with torch.device("meta"):
            fresh = cls(model.config)
        frozen = {n for n, p in fresh.named_parameters() if not p.requires_grad}
        for n, p in model.named_parameters():  # from_pretrained (5.24) loses requires_grad_(False)
            p.requires_grad_(n not in frozen)
        return model

    def _composed(self):
        """A LLaVA of the CLIP vision model, the causal LM and the projector folder's projector."""
        from transformers import (
            AutoConfig,
            CLIPVisionModel,
            LlavaConfig,
            LlavaForConditionalGeneration,
            Qwen2ForCausalLM,
        )

        f = self.folders
        vision = CLIPVisionModel.from_pretrained(f["compose-vision"], attn_implementation="eager")
        causal = Qwen2ForCausalLM.from_pretrained(f["compose-llm"], attn_implementation="eager")
        config = LlavaConfig(vision_config=vision.config, text_config=AutoConfig.from_pretrained(f["compose-llm"]),
                             image_token_id=self.tok.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                             vision_feature_select_strategy="default", projector_hidden_act="gelu")
        config._attn_implementation = "eager"
        model = LlavaForConditionalGeneration(config)
        model.model.vision_tower = vision
        model.model.language_model, model.lm_head = causal.model, causal.lm_head
        donor = LlavaForConditionalGeneration.from_pretrained(f["compose-projector"])
        model.model.multi_modal_projector.load_state_dict(donor.model.multi_modal_projector.state_dict())
        return model
