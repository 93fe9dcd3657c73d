"""The one DeepSpeed config of a run: what mmpipe generates from its own keys, and the user's
JSON (`deepspeed.config=FILE.json`) merged over it.

mmpipe owns every setting that its planner, feeder, loss scaling or clipping depends on; a user
file that sets one of them is refused before launch, with the mmpipe key to use instead.
Everything else (monitors, communication and activation-checkpointing options,
steps_per_print, ...) passes through to DeepSpeed untouched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmpipe.config import RunConfig

_BATCH = ("mmpipe plans the micro-batches of every step itself; use train.global_batch and "
          "train.micro_batches")
_PRECISION = "mmpipe sets the precision; use train.precision=fp32|bf16|fp16"
_OFFLOAD = ("mmpipe does not offload (untested with the pipeline engine and its clipping); "
            "remove it")

OWNED: dict[str, str] = {
    "train_batch_size": _BATCH,
    "train_micro_batch_size_per_gpu": _BATCH,
    "gradient_accumulation_steps": _BATCH,
    "managed_gradient_accumulation": _BATCH,
    "elasticity": _BATCH,
    "pipeline": "mmpipe builds the pipeline (stages, schedule, recompute); use parallel.pp and plan.stages",
    "fp16.enabled": _PRECISION,
    "bf16.enabled": _PRECISION,
    "bfloat16.enabled": _PRECISION,
    "amp": _PRECISION,
    "torch_autocast": _PRECISION,
    "data_types.grad_accum_dtype": _PRECISION + " (bf16 accumulates gradients in fp32)",
    "data_types.param_dtype": _PRECISION,
    "zero_optimization.stage": "mmpipe sets the ZeRO stage (the pipeline engine runs 0 or 1); use "
                               "train.zero_stage=0|1",
    "zero_optimization.offload_optimizer": _OFFLOAD,
    "zero_optimization.offload_param": _OFFLOAD,
    "zero_optimization.cpu_offload": _OFFLOAD,
    "zero_optimization.elastic_checkpoint": "mmpipe reads ZeRO-1's optimizer files by parameter to resume on "
                                            "another layout (pp, dp, cut, ZeRO stage); remove it",
    "gradient_clipping": "mmpipe clips by the gradient norm of the whole model across all stages; "
                         "use train.grad_clip",
    "optimizer": "mmpipe builds the optimizer and hands it to DeepSpeed; use train.optimizer, train.lr "
                 "and train.weight_decay",
    "scheduler": "mmpipe builds the learning-rate schedule; use train.lr and train.warmup_steps",
    "zero_allow_untested_optimizer": "mmpipe sets it for the optimizer train.optimizer chooses; remove it",
    "gradient_allreduce_op": "mmpipe's loss scale relies on DeepSpeed averaging gradients over the "
                             "replicas; remove it",
}
"""DeepSpeed keys (dotted for a key inside a section) that mmpipe owns, and why / what to use."""


def load_user_config(path: str) -> dict[str, Any]:
    """Read and check a user's DeepSpeed JSON; one-line errors name deepspeed.config."""
    from mmpipe.paths import resolve_path

    file = Path(resolve_path(path))
    if not file.is_file():
        raise FileNotFoundError(f"deepspeed.config={path}: no such file; give the path of a DeepSpeed JSON "
                                f"config, or deepspeed.config=null")
    try:
        user = json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"deepspeed.config={path} is not valid JSON: {err.msg} at line {err.lineno} "
                         f"column {err.colno}") from None
    except UnicodeDecodeError:
        raise ValueError(f"deepspeed.config={path} is not a text file; give a DeepSpeed JSON config") from None
    if not isinstance(user, dict):
        raise ValueError(f"deepspeed.config={path} holds a JSON {type(user).__name__}, not an object of "
                         f"DeepSpeed settings")
    refused = [k for k in _dotted_keys(user) if k in OWNED]
    if refused:
        also = f" (also refused: {', '.join(refused[1:])})" if len(refused) > 1 else ""
        raise ValueError(f"deepspeed.config={path} sets {refused[0]}: {OWNED[refused[0]]}{also}")
    return user


def _dotted_keys(d: Mapping[str, Any], prefix: str = "") -> list[str]:
    out = []
    for k, v in d.items():
        out.append(prefix + k)
        if isinstance(v, Mapping) and not prefix:  # owned keys are at most one section deep
            out += _dotted_keys(v, f"{k}.")
    return out


def deepspeed_clips(zero_stage: int) -> bool:
    """Whether DeepSpeed's own optimizer wrapper clips, by the global norm.

    Under ZeRO-1 DeepSpeed wraps the optimizer (BF16_Optimizer for bf16, DeepSpeedZeroOptimizer
    for fp32 and fp16). Both count every stage's gradients (they skip copies by the
    tensor-parallel rank, 0 on every stage here) and sum the squares over
    `mpu.get_model_parallel_group()`, which for a pipeline is every stage of the replica
    (ZeRO-1 first over the replicas' shards): they clip by the norm of the whole model. Plain
    fp32 without ZeRO steps the bare torch optimizer, and DeepSpeed's clipping there counts
    stage 0's gradients only (see GlobalGradClip), so mmpipe clips that mode itself.
    """
    return zero_stage > 0


def deepspeed_config(rc: RunConfig, *, micro_batches: int | None = None,
                     user: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config dict of a run: mmpipe's settings, the user's JSON merged over them."""
    t = rc.train
    m = t.micro_batches if micro_batches is None else micro_batches
    cfg: dict[str, Any] = {
        "train_batch_size": m * rc.parallel.dp,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": m,
        "gradient_clipping": t.grad_clip if deepspeed_clips(t.zero) else 0.0,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": t.zero},
        # torch SGD is not on DeepSpeed's list of ZeRO-tested optimizers; it only steps the
        # fp32 shard each rank owns, which any torch optimizer can.
        "zero_allow_untested_optimizer": True,
    }
    if t.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
        # Without this DeepSpeed accumulates the micro-batches' gradients in bf16.
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    elif t.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "loss_scale": 0}  # 0: dynamic loss scaling
    return _merge(cfg, user or {})


def _merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) else v
    return out


TESTED_DEEPSPEED = ("0.19.8",)
"""DeepSpeed releases mmpipe's workarounds of its internals were tested with: fix_buffer_reuse
and GlobalGradClip (runtime/pipeline.py), and the reliance on its bf16/fp16/ZeRO-1 wrappers
clipping by the global norm (deepspeed_clips)."""
UNTESTED_DEEPSPEED_ENV = "MMPIPE_ALLOW_UNTESTED_DEEPSPEED"
"""Set to 1 to run with a DeepSpeed release not in TESTED_DEEPSPEED."""


def require_tested_deepspeed() -> None:
    """Refuse (one line) a DeepSpeed release the workarounds were not tested with."""
    import os
    from importlib.metadata import version

    from packaging.version import Version

    installed = version("deepspeed")
    if Version(installed).base_version in TESTED_DEEPSPEED or os.environ.get(UNTESTED_DEEPSPEED_ENV) == "1":
        return
    raise ValueError(f"deepspeed {installed} is installed, but mmpipe patches DeepSpeed internals that it tested "
                       f"with deepspeed {', '.join(TESTED_DEEPSPEED)} only; install deepspeed=="
                       f"{TESTED_DEEPSPEED[-1]}, or set {UNTESTED_DEEPSPEED_ENV}=1 to try anyway")
