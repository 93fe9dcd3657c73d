"""Benchmark: what loading one pipeline stage of a checkpoint costs each process.

    python -m mmpipe.model.hf.bench [DIR] [--stages 4]

Each stage's layers are built in a fresh process (as a pipeline rank builds them) and the
process reports its load time, the bytes it read and its peak resident memory; a last process
loads the whole model with transformers' `from_pretrained` for comparison. Without DIR, a
LLaVA checkpoint of about 0.2 B parameters (CLIP-B-like tower, 12-layer Llama) is written to a
temporary folder first.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path


def _stage(folder: str, names: list[str], queue) -> None:
    import torch

    torch.set_num_threads(1)
    from mmpipe.model.hf.arch import spec_from_folder
    from mmpipe.model.hf.build import build_layer
    from mmpipe.model.hf.weights import LOAD_LOG, memory_mb

    spec = spec_from_folder(folder)
    base = memory_mb("VmRSS")
    t0 = time.perf_counter()
    layers = [build_layer(spec, n, seed=0) for n in names]
    seconds = time.perf_counter() - t0
    params = sum(p.numel() for l in layers for p in l.parameters())
    queue.put({"layers": f"{names[0]}..{names[-1]}", "params_M": params / 1e6, "seconds": seconds,
               "read_MB": sum(r.bytes for r in LOAD_LOG) / 2**20,
               "rss_before_MB": base, "peak_rss_MB": memory_mb()})


def _whole(folder: str, queue) -> None:
    import torch

    torch.set_num_threads(1)
    import transformers
    from transformers import AutoConfig

    from mmpipe.model.hf.weights import memory_mb

    arch = AutoConfig.from_pretrained(folder, local_files_only=True).architectures[0]
    base = memory_mb("VmRSS")
    t0 = time.perf_counter()
    model = getattr(transformers, arch).from_pretrained(folder, local_files_only=True)
    with torch.no_grad():  # touch every weight: from_pretrained may leave them on the file mapping
        sum(float(p.sum()) for p in model.parameters())
    queue.put({"layers": "whole model (from_pretrained)", "seconds": time.perf_counter() - t0,
               "rss_before_MB": base, "peak_rss_MB": memory_mb()})


def _write_example(root: Path) -> Path:
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    torch.manual_seed(0)
    config = LlavaConfig(
        vision_config=CLIPVisionConfig(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                       num_attention_heads=12, image_size=224, patch_size=16),
        text_config=LlamaConfig(vocab_size=32064, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                                num_attention_heads=12, num_key_value_heads=12),
        image_token_id=32000)
    folder = root / "llava-example"
    LlavaForConditionalGeneration(config).save_pretrained(folder, max_shard_size="200MB")
    CLIPImageProcessorPil(size={"shortest_edge": 224}, crop_size={"height": 224, "width": 224}).save_pretrained(folder)
    return folder


def _run(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", help="a checkpoint folder (default: write an example)")
    parser.add_argument("--stages", type=int, default=4, help="pipeline stages of equal layer counts")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.folder) if args.folder else _write_example(Path(tmp))
        from mmpipe.model.hf.arch import spec_from_folder
        from mmpipe.model.spec import layer_names

        names = layer_names(spec_from_folder(folder))
        size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
        print(f"{folder}: {len(names)} layers, {size:.0f} MB of safetensors, {args.stages} stages")
        bounds = [round(i * len(names) / args.stages) for i in range(args.stages + 1)]
        rows = [_run(_stage, str(folder), names[a:b]) for a, b in zip(bounds, bounds[1:])]
        rows.append(_run(_whole, str(folder)))
        for r in rows:
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()}))


if __name__ == "__main__":
    main()
