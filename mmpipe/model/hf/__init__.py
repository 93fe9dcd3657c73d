"""Models made of Hugging Face transformers classes, built, loaded and exported per pipeline layer.

Supported: `LlavaForConditionalGeneration` (CLIP / SigLIP tower, Llama / Mistral / Qwen2),
`LlavaNextForConditionalGeneration` and `LlavaOnevisionForConditionalGeneration` (any-resolution
tiles), `Qwen2VLForConditionalGeneration` (images and videos), `Qwen2AudioForConditionalGeneration`,
`Qwen3VLForConditionalGeneration` (dense), `Qwen2_5_VLForConditionalGeneration` (images
and videos), `Qwen2_5OmniThinkerForConditionalGeneration` (a thinker or a full Qwen2.5-Omni folder;
images, clips, videos, and with use_audio_in_video a video's audio track), and
compositions of unimodal checkpoints (`model=compose`). Each class is a family, declared in one
file of `families/` (family.py). See docs/hf.md.

What the runtime calls:
- spec: `spec_from_settings(model_group)`, or `spec_from_folder(DIR)`, `spec_from_config(dict,
  name=...)`, `spec_from_compose(...)`;
- layers: `build_layer(spec, name, seed=...)` (one rank, its layers only; loads its tensors),
  `build_layers` (one process), `tied_embedding(spec)` (DeepSpeed TiedLayerSpec wiring),
  `placeholder_tokens(spec)`;
- data: `preprocess_images` (a sample's images), `preprocess_audio`, `preprocess_video` per sample, then
  `mmpipe.runtime.batch.collate_hf`;
- loading figures: `LOAD_LOG`, `stage_load_summary(names)`;
- memory: `estimate_memory(spec, stages=..., trainable=...)`, `check_memory(...)`;
- export: `export(spec, RUN/checkpoints/stepN, OUT)`.
"""

from mmpipe.model.hf import families  # noqa: F401 - registers every family (family.py) before any lookup
from mmpipe.model.hf.arch import spec_from_config, spec_from_folder
from mmpipe.model.hf.build import TiedEmbedding, build_layer, build_layers, placeholder_tokens, tied_embedding
from mmpipe.model.hf.compose import spec_from_compose
from mmpipe.model.hf.export import ExportReport, export, save_layer_states
from mmpipe.model.hf.media import AudioInput, ImageInput, preprocess_audio, preprocess_image, preprocess_images
from mmpipe.model.hf.memory import StageMemory, check_memory, estimate_memory, layer_params
from mmpipe.model.hf.settings import spec_from_settings
from mmpipe.model.hf.video import VideoInput, preprocess_video
from mmpipe.model.hf.weights import LOAD_LOG, LoadReport, stage_load_summary

__all__ = ["AudioInput", "ExportReport", "ImageInput", "LOAD_LOG", "LoadReport", "StageMemory", "TiedEmbedding",
           "VideoInput", "build_layer", "build_layers", "check_memory", "estimate_memory", "export", "layer_params",
           "placeholder_tokens", "preprocess_audio", "preprocess_image", "preprocess_images", "preprocess_video",
           "save_layer_states",
           "spec_from_compose", "spec_from_config", "spec_from_folder", "spec_from_settings", "stage_load_summary",
           "tied_embedding"]
