"""One rank of a 2-stage DeepSpeed pipeline over a tiny tied Hugging Face model (for
test_hf_pipeline.py): one SGD step, then its checkpoint and its copy of the tied weight."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]  # this checkout's mmpipe and its tests package (the shared case)
from mmpipe.runtime.pipeline import (  # noqa: E402
    GlobalGradClip,
    PipelineSpec,
    build_pipeline_module,
    fix_buffer_reuse,
    make_optimizer,
)
from tests.unit.model import hf_pipeline_case as case  # noqa: E402


def _fp32_config(micro_batches: int) -> dict:
    # What mmpipe.runtime.dsconfig.deepspeed_config gives an fp32, ZeRO-0 run without a RunConfig
    # (this harness builds the pipeline by hand): mmpipe clips globally itself (GlobalGradClip).
    return {"train_batch_size": micro_batches, "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": micro_batches, "gradient_clipping": 0.0,
            "steps_per_print": 2**31 - 1, "zero_optimization": {"stage": 0}}


def main(folder: str, out: str) -> None:
    import deepspeed

    torch.set_num_threads(1)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    spec, mbs, scale, stages = case.setup(Path(folder))
    torch.manual_seed(0)
    module = build_pipeline_module(PipelineSpec(model=spec, stages=stages, seed=0, image_token=-1, audio_token=-1))
    optimizer = make_optimizer(module.parameters(), lr=case.LR, weight_decay=0.0, kind="sgd")
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer,
                                           config=_fp32_config(len(mbs)))
    fix_buffer_reuse(engine)
    GlobalGradClip(optimizer, max_norm=case.CLIP, group=engine.grid.get_pipe_parallel_group())
    loss = engine.train_batch(data_iter=iter([mb.for_engine(scale) for mb in mbs]))
    engine.save_checkpoint(out, tag="step1")
    rank = dist.get_rank()
    tied = module.tied_modules[next(iter(module.tied_modules))]
    torch.save(tied.embed.weight.detach().clone(), Path(out) / f"tied_rank{rank}.pt")
    if engine.is_last_stage():
        (Path(out) / "loss.json").write_text(json.dumps({"loss": float(loss)}))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
