"""Optimizer state that outlives its layout: read by parameter name from a checkpoint of any
pipeline cut, data-parallel size and ZeRO stage, and put into this rank's optimizer.

A checkpoint's model weights are already layout-free (DeepSpeed writes one file per layer,
named by global layer index). Its optimizer state is not:

- ZeRO stage 0 (fp32): one torch optimizer state per stage, keyed by the position of each
  parameter in that stage's optimizer; mmpipe writes next to it the parameters' names in that
  order (`optimizer_params_stage<S>.json`, checkpoint.order_file).
- ZeRO stage 1 (fp32, bf16, fp16): per stage and replica, a flat fp32 partition of the master
  weights and of each Adam moment, plus DeepSpeed's `param_slice_mappings` (parameter name ->
  offset and length of its piece in that partition), which DeepSpeed saves for its universal
  checkpoints. A parameter's pieces, in replica order, are the whole parameter.

`read_states` turns either into whole per-parameter tensors by name; `load_states` writes them
into this rank's optimizer, whatever its ZeRO stage and partitioning, through DeepSpeed's own
fragment mapping (`param._hp_mapping`: where each parameter's piece lies in this rank's
partition). DeepSpeed's universal checkpoint (`ds_to_universal` then
`checkpoint.load_universal`) does the same for ZeRO-1 by first writing a second, per-parameter
copy of the checkpoint with an offline script, and does not read ZeRO-0's plain torch
optimizer state; mmpipe reads the committed files directly instead (and once, per stage).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmpipe.runtime.committed import layout_changes, order_file, reshard_problem, zero_file

__all__ = ["ReshardError", "SavedOptimizer", "layout_changes", "load_states", "order_file", "read_states",
           "reshard_problem", "zero_file"]

_COUNTERS = ("lr_scheduler", "global_steps", "global_samples", "skipped_steps", "step")
"""What a stage's model-states file holds besides weights: the schedule and step counters
(the same on every stage)."""
_SCALER = ("loss_scaler", "dynamic_loss_scale", "overflow")
"""An fp16 ZeRO optimizer's loss-scale state (the same on every rank)."""


def _steps_taken(values: list) -> object:
    """The optimizer's step count from its per-parameter `step` entries: their largest, in its
    own type (a tensor copied, an int as it is). DeepSpeed's FusedAdam (the CUDA default)
    counts only the last parameter of a group and leaves the others' `step` at 0, so any one
    entry may be 0 while the optimizer took many steps; torch's optimizers count each."""
    best = max(values, key=float)
    return best.clone() if torch.is_tensor(best) else best


def _count_for(optimizer, count) -> object:
    """A step count in the form `optimizer` keeps it: torch's optimizers a float32 tensor per
    parameter, DeepSpeed's FusedAdam a Python int (its kernel takes an int)."""
    if type(optimizer).__module__.startswith("torch.optim"):
        return torch.tensor(float(count), dtype=torch.float32)
    return int(float(count))


class ReshardError(ValueError):
    """A checkpoint whose optimizer state cannot be put into this layout."""


def model_file(stage: int) -> str:
    """DeepSpeed's per-stage model-states file (schedule, counters; the optimizer under ZeRO-0)."""
    return f"mp_rank_{stage:02d}_model_states.pt"


@dataclass(kw_only=True, slots=True)
class SavedOptimizer:
    """A checkpoint's optimizer state, whole per parameter and named layout-free."""

    states: dict[str, dict[str, torch.Tensor]]
    """Parameter name -> its optimizer state (`step`, `exp_avg`, `exp_avg_sq` for AdamW; empty
    for SGD), the moments flat."""
    masters: dict[str, torch.Tensor] = field(default_factory=dict)
    """Parameter name -> its fp32 master weight, flat (ZeRO-1 checkpoints; under ZeRO-0 fp32 the
    layer files hold the weights themselves)."""
    hyper: dict
    """The optimizer's hyper-parameters (its param_group without `params`)."""
    counters: dict
    """The schedule and DeepSpeed's step counters (_COUNTERS)."""
    scaler: dict | None = None
    """An fp16 run's loss-scale state (_SCALER), None otherwise."""
    known: set[str] = field(default_factory=set)
    """Every parameter name the checkpoint's optimizer holds (to name what this run lacks)."""


def read_states(folder: Path, saved: dict, wanted: set[str], load) -> SavedOptimizer:
    """The optimizer state of the parameters `wanted` from checkpoint `folder`, whose topology
    record is `saved` (pp, dp, zero); `load(path)` reads one file (the run's safe checkpoint
    engine). Reads one file at a time and keeps only what `wanted` names; a tied parameter's
    state, the same on every stage holding it, is taken from the first."""
    pp, dp, zero = saved["pp"], saved["dp"], saved.get("zero", 0)
    out: SavedOptimizer | None = None
    for s in range(pp):
        sd = load(str(folder / model_file(s)))
        counters = {k: sd[k] for k in _COUNTERS}
        if zero:
            part = _read_zero_stage(folder, s, dp, saved.get("precision", "fp32"), wanted, load)
        else:
            part = _read_plain_stage(folder, s, sd["optimizer"], wanted)
        del sd
        if out is None:
            out = SavedOptimizer(states={}, hyper=part.hyper, counters=counters, scaler=part.scaler)
        for name, state in part.states.items():
            out.states.setdefault(name, state)
        for name, master in part.masters.items():
            out.masters.setdefault(name, master)
        out.known |= part.known
    assert out is not None
    return out


def _read_plain_stage(folder: Path, stage: int, opt: dict, wanted: set[str]) -> SavedOptimizer:
    """One stage of a ZeRO-0 checkpoint: torch's optimizer state, by position, named by the
    stage's order file."""
    if not (folder / order_file(stage)).is_file():
        raise ReshardError(f"checkpoint {folder}: {order_file(stage)} is missing (written by an earlier mmpipe), "
                           f"so its optimizer state cannot be remapped: resume with the same layout")
    names = json.loads((folder / order_file(stage)).read_text())
    order = [i for g in opt["param_groups"] for i in g["params"]]
    if len(order) != len(names):
        raise ReshardError(f"checkpoint {folder}: stage {stage}'s optimizer holds {len(order)} parameters, "
                           f"{order_file(stage)} names {len(names)}; it is damaged")
    counts = [st["step"] for st in opt["state"].values() if "step" in st]
    states = {name: {k: (v.flatten() if torch.is_tensor(v) and v.dim() else v) for k, v in opt["state"][i].items()}
              for name, i in zip(names, order) if name in wanted and i in opt["state"]}
    for state in states.values():  # one count for the stage (FusedAdam keeps it on one parameter only)
        if "step" in state:
            state["step"] = _steps_taken(counts)
    hyper = {k: v for k, v in opt["param_groups"][0].items() if k != "params"}
    return SavedOptimizer(states=states, hyper=hyper, counters={}, known=set(names))


def _read_zero_stage(folder: Path, stage: int, dp: int, precision: str, wanted: set[str], load) -> SavedOptimizer:
    """One stage of a ZeRO-1 checkpoint: each replica's flat partitions, cut into per-parameter
    pieces by DeepSpeed's param_slice_mappings and joined in replica order."""
    pieces: dict[str, dict[str, list[torch.Tensor]]] = {}
    steps: dict[str, object] = {}
    hyper: dict = {}
    scaler: dict | None = None
    known: set[str] = set()
    for d in range(dp):
        path = folder / zero_file(stage, d, precision)
        osd = load(str(path))["optimizer_state_dict"]
        base = osd["base_optimizer_state"]
        hyper = hyper or {k: v for k, v in base["param_groups"][0].items() if k != "params"}
        if scaler is None and "loss_scaler" in osd:
            scaler = {k: osd[k] for k in _SCALER}
        masters = osd["single_partition_of_fp32_groups"]
        for g, mapping in enumerate(osd["param_slice_mappings"]):
            state = base["state"].get(g, {})
            flats = {"master": masters[g], **{k: v for k, v in state.items() if torch.is_tensor(v) and v.dim()}}
            for name, addr in mapping.items():
                known.add(name)
                if name not in wanted:
                    continue
                got = pieces.setdefault(name, {k: [] for k in flats})
                for k, flat in flats.items():
                    got[k].append(flat.narrow(0, addr.start, addr.numel).clone())
                if "step" in state:
                    steps[name] = state["step"]
        del osd, base
    states, masters = {}, {}
    for name, got in pieces.items():
        masters[name] = torch.cat(got.pop("master"))
        states[name] = {k: torch.cat(v) for k, v in got.items()}
        if name in steps:  # a copy each: torch's optimizers count steps in place, per parameter
            states[name]["step"] = _steps_taken([steps[name]])
    return SavedOptimizer(states=states, masters=masters, hyper=hyper, counters={}, scaler=scaler, known=known)


def load_states(engine, names: dict, saved: SavedOptimizer) -> None:
    """Put `saved` into this rank's optimizer; `names` maps each trained parameter of this
    stage to its layout-free name. ZeRO-0: torch's load_state_dict on the plain optimizer.
    ZeRO-1 (DeepSpeedZeroOptimizer, BF16_Optimizer): this rank's partition of the master weights
    and moments, filled piece by piece at the offsets DeepSpeed's fragment mapping gives, then
    handed to the wrapped torch optimizer and linked again as DeepSpeed's own loader does."""
    opt = engine.optimizer
    groups = getattr(opt, "bf16_groups", None) or getattr(opt, "bit16_groups", None)
    if groups is None:  # ZeRO-0: the torch optimizer itself
        params = [p for g in opt.param_groups for p in g["params"]]
        counts = [st["step"] for p in params if "step" in (st := saved.states.get(names[p], {}))]
        state = {i: {k: (v.view_as(p) if torch.is_tensor(v) and v.dim() else _count_for(opt, max(counts, key=float))
                         if k == "step" else v)
                     for k, v in saved.states[names[p]].items()}
                 for i, p in enumerate(params) if names[p] in saved.states}
        opt.load_state_dict({"state": state, "param_groups": [{**saved.hyper, "params": list(range(len(params)))}]})
        return
    flats = getattr(opt, "fp32_groups_flat_partition", None) or opt.single_partition_of_fp32_groups
    base_state: dict[int, dict] = {}
    for g, (lps, flat) in enumerate(zip(groups, flats)):
        moments: dict[str, torch.Tensor] = {}
        counts: list = []
        for lp in lps:
            mapping = getattr(lp, "_hp_mapping", None)
            if mapping is None:  # no piece of this parameter in this rank's partition
                continue
            name = names[lp]
            hp, lo = mapping.hp_fragment_address, mapping.lp_fragment_address
            master = saved.masters.get(name)
            if master is None:  # a ZeRO-0 fp32 checkpoint: its layer files hold the master weights
                master = lp.detach().flatten().float()
            flat.data.narrow(0, hp.start, hp.numel).copy_(master.narrow(0, lo.start, lo.numel))
            for k, v in saved.states.get(name, {}).items():
                if not (torch.is_tensor(v) and v.dim()):
                    counts.append(v)
                    continue
                into = moments.setdefault(k, torch.zeros_like(flat))
                into.narrow(0, hp.start, hp.numel).copy_(v.narrow(0, lo.start, lo.numel))
        if moments:
            base_state[g] = {"step": _count_for(opt.optimizer, max(counts, key=float) if counts else 0), **moments}
    inner = opt.optimizer
    template = inner.state_dict()["param_groups"]
    inner.load_state_dict({"state": base_state,
                           "param_groups": [{**g, **saved.hyper, "params": g["params"]} for g in template]})
    if saved.scaler is not None and hasattr(opt, "loss_scaler"):
        opt.loss_scaler = saved.scaler["loss_scaler"]
        opt.dynamic_loss_scale = saved.scaler["dynamic_loss_scale"]
        opt.overflow = saved.scaler["overflow"]
    opt._link_all_hp_params()  # the fragments' views into the newly loaded state (DeepSpeed's loaders do this)
