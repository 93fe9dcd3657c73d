"""A committed checkpoint's record, and whether this run may resume from it: no torch, no
DeepSpeed, so the command line checks `train.resume` in a second, before any rank starts, with
the very rules the ranks apply (runtime/checkpoint.py's find_checkpoint then also hashes every
file). What a run must share with its checkpoint is its topology (`run_topology`): the model's
weight-shaping figures, adapters, trained set, precision, and the layout (pp, dp, stages,
ZeRO stage), which may change when the checkpoint's optimizer state can be remapped.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from mmpipe.config import RunConfig
from mmpipe.model.spec import identity_differences, lora_identity, model_identity

MARKER = "committed.json"
"""The file whose presence makes a step folder a checkpoint."""
FORMAT = 1
"""Version of the marker's layout."""
_STEP = re.compile(r"step(\d+)")


class RunStopped(ValueError):
    """A stop every rank agreed on: each rank raises the same one-line message."""


class CheckpointError(RunStopped):
    """A checkpoint that cannot be written or used."""


def step_folders(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every step<N> folder under root, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP.fullmatch(p.name))]
    return sorted(found, reverse=True)


def required_files(topology: dict) -> list[str]:
    """Files mmpipe itself adds to every checkpoint of a run with this topology."""
    return ([f"rng_rank{r}.pt" for r in range(topology["pp"] * topology["dp"])]
            + [f"data_state_dp{d}.json" for d in range(topology["dp"])])


def newest_committed(target: Path, key: str) -> tuple[Path, list[str]]:
    """The committed checkpoint `target` names (a step folder, or the newest in a checkpoints
    folder or a run directory) and a warning for each newer unfinished save. Raises
    CheckpointError starting with `key`. Pure path logic: the CLI checks train.resume with it
    before launching."""
    if (target / MARKER).is_file():
        return target, []
    if not target.is_dir():
        raise CheckpointError(f"{key}: no such folder; give a run directory or its checkpoints/step<N> folder")
    if _STEP.fullmatch(target.name):
        raise CheckpointError(f"{key}: {target} is not a committed checkpoint (no {MARKER}: its save did not finish, "
                              f"or an older mmpipe wrote it); resume from the run directory to use its newest "
                              f"committed checkpoint")
    root = target / "checkpoints" if (target / "checkpoints").is_dir() else target
    folders = step_folders(root)
    if not folders:
        raise CheckpointError(f"{key}: no checkpoint there (give a run directory, its checkpoints folder or a "
                              f"step<N> folder)")
    committed = [p for _, p in folders if (p / MARKER).is_file()]
    if not committed:
        raise CheckpointError(f"{key}: no committed checkpoint in {root} (unfinished saves: "
                              f"{', '.join(p.name for _, p in folders)}); start without train.resume")
    newest = int(_STEP.fullmatch(committed[0].name).group(1))
    return committed[0], [f"skipping {p}: not committed (its save did not finish)" for s, p in folders if s > newest]


def other_model(key: str, folder: Path, saved: dict, identity: dict | None) -> str | None:
    """The error for a checkpoint of another model than this run's (None: the same, or a
    checkpoint that predates the record), naming what differs."""
    recorded = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(recorded, dict) or not identity:
        return None
    diffs = identity_differences(recorded, identity)
    if not diffs:
        return None
    return (f"{key}: {folder} holds model {recorded.get('name')}, not this run's model {identity.get('name')} "
            f"({'; '.join(diffs[:3])}{'; ...' if len(diffs) > 3 else ''}); resume with the model it was trained "
            f"with (its model=... and model.* settings), or train this one without train.resume")


def _typed(value) -> str:
    """A value as the user types it on the command line (lists without quotes or spaces)."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(map(_typed, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def _lora_problem(saved: dict | None, now: dict | None) -> str | None:
    """Why this run's train.lora (its lora_identity) cannot resume a checkpoint's, as train.lora.*
    settings: what differs and the settings that resume."""
    if saved == now:
        return None
    if saved is None:
        return (f"this run asks for adapters (train.lora.r={now['r']}) but the checkpoint trained none; resume "
                f"with train.lora.r=0, or train adapters in a new run (no train.resume)")
    settings = " ".join(f"train.lora.{k}={_typed(v)}" for k, v in saved.items())
    if now is None:
        return f"the checkpoint trained adapters but this run asks for none (train.lora.r=0); resume with {settings}"
    diffs = ", ".join(f"train.lora.{k}={_typed(now.get(k))} (checkpoint: {_typed(v)})" for k, v in saved.items()
                      if now.get(k) != v)
    return f"{diffs} differs from the checkpoint's adapters; resume with {settings}"


def _trained_problem(saved: dict, now: dict) -> str | None:
    """A checkpoint that trained another set of layers, or (LoRA) built its frozen base weights
    from other folders or another seed."""
    if "trainable" in saved and saved["trainable"] != now.get("trainable"):
        was = _typed(saved["trainable"])
        return (f"train.trainable={_typed(now.get('trainable'))} differs from the checkpoint's {was}; resume "
                f"with train.trainable={was}")
    base, mine = saved.get("base"), now.get("base")
    if "base" in saved and base != mine and base and mine:
        if base.get("seed") != mine.get("seed"):
            return (f"train.seed={mine.get('seed')} differs from the checkpoint's {base.get('seed')}, which built "
                    f"its frozen base weights; resume with train.seed={base.get('seed')}")
        folders = ", ".join(f"{part} {folder}" for part, folder in base.get("folders") or [])
        return (f"the model's folders differ from those the checkpoint's frozen base weights came from ({folders}); "
                f"resume with those (model.path=...)")
    if "base" in saved and base != mine:
        return f"the checkpoint's base weights record ({base}) differs from this run's ({mine}); resume with the same"
    return None


def choose(target: Path, key: str, run_dir: Path, topology: dict, steps: int):
    """(folder, marker record, warnings, an earlier committed folder) of the checkpoint `target`
    names, or the one-line error why this run cannot resume from it: another model, adapters,
    trained set, precision, a layout its files cannot be remapped to, a step not below
    train.steps, newer checkpoints in this run directory. Reads the marker only (the ranks then
    check every file's hash). `topology["stages"]` None: the cut is not known yet (before
    launch), and a checkpoint of the same pp is taken to have it."""
    try:
        folder, warnings = newest_committed(target, key)
    except CheckpointError as err:
        return str(err)
    root = folder.parent
    try:
        record = json.loads((folder / MARKER).read_text())
        step, files = int(record["step"]), record["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{key}: the commit record {folder / MARKER} is unreadable ({err}); the checkpoint is damaged"
    saved = record.get("topology")
    missing = [n for n in required_files(saved) if n not in files] if isinstance(saved, dict) else ["its topology"]
    if record.get("format") != FORMAT or missing:
        return (f"{key}: {folder} is not an mmpipe checkpoint of this version (format {record.get('format')}, "
                f"lacks {', '.join(missing) or 'nothing'})")
    other = other_model(key, folder, saved, topology.get("model"))
    if other:
        return other
    for problem in (_lora_problem(saved.get("lora"), topology.get("lora")),
                    _trained_problem(saved, topology)):
        if problem:
            return f"{key}: {problem}"
    if saved.get("precision", "fp32") != topology["precision"]:
        return (f"{key}: the checkpoint was written with train.precision={saved.get('precision', 'fp32')}; this run "
                f"has train.precision={topology['precision']}; resume with the same (the weights and the optimizer's "
                f"master copy differ between them)")
    now = topology if topology.get("stages") is not None or saved["pp"] != topology["pp"] else \
        {**topology, "stages": saved["stages"]}
    changes = layout_changes(saved, now)
    if changes:
        why = reshard_problem(saved, files)
        if why:
            return f"{key}: the checkpoint's layout differs from this run's ({'; '.join(changes)}); {why}"
        warnings.append(f"resharded: {'; '.join(changes)}: the weights (layer files), the optimizer state of every "
                        f"parameter (by name), the learning-rate schedule and the step counters carry over; random "
                        f"states start afresh")
    if saved["dp"] != topology["dp"]:
        warnings.append(f"parallel.dp={topology['dp']} differs from the checkpoint's {saved['dp']}: the reader "
                        f"positions carry over exactly when every replica reads the one stream "
                        f"(plan.across_replicas=true), else each reader skips the samples the old replicas had "
                        f"taken (a mixture restarts its epoch, with a warning; docs/data.md); random states start "
                        f"afresh")
    if step >= steps:
        return (f"{key}: the checkpoint is at step {step}, not below train.steps={steps}; raise train.steps to "
                f"train further")
    if root.resolve() == (run_dir / "checkpoints").resolve():
        newer = [p.name for s, p in step_folders(root) if s > step and (p / MARKER).is_file()]
        if newer:
            return (f"{key}: this run directory has newer checkpoints ({', '.join(newer)}); resuming step {step} "
                    f"here would mix two histories in one run directory; resume into a new one "
                    f"(hydra.run.dir=NEW) or resume the newest (train.resume={run_dir})")
    earlier = next((p for s, p in step_folders(root) if s < step and (p / MARKER).is_file()), None)
    return folder, record, warnings, earlier


def order_file(stage: int) -> str:
    """The file naming, in the optimizer's order, the parameters a stage trains under ZeRO
    stage 0 (what lets such a checkpoint resume on another layout)."""
    return f"optimizer_params_stage{stage}.json"


def zero_file(stage: int, dp_rank: int, precision: str) -> str:
    """DeepSpeed's ZeRO optimizer file of one stage and replica (the pipeline engine's naming;
    `bf16_` in front when bf16 is on)."""
    return f"{'bf16_' if precision == 'bf16' else ''}zero_pp_rank_{dp_rank}_mp_rank_{stage:02d}_optim_states.pt"


def layout_changes(saved: dict, now: dict) -> list[str]:
    """What differs between a checkpoint's layout (its topology record) and this run's, as
    `key old -> new` phrases; empty when DeepSpeed's own loader reads the checkpoint as it is
    (same stages and ZeRO stage, and the same replicas under ZeRO-1, whose files are per
    replica)."""
    changes = []
    if (saved["pp"], saved["stages"]) != (now["pp"], now["stages"]):
        cut = f" stages {now['stages']}" if now["stages"] is not None else ""
        changes.append(f"pipeline pp={saved['pp']} stages {saved['stages']} -> pp={now['pp']}{cut}")
    zero_saved, zero_now = saved.get("zero", 0), now.get("zero", 0)
    if zero_saved != zero_now:
        changes.append(f"ZeRO stage {zero_saved} -> {zero_now}")
    if saved["dp"] != now["dp"] and (changes or zero_saved or zero_now):
        changes.append(f"replicas dp={saved['dp']} -> dp={now['dp']}")
    return changes


def reshard_problem(saved: dict, files: dict) -> str | None:
    """Why a checkpoint (its topology and committed files) cannot resume on another layout, or
    None when it can."""
    if saved.get("zero", 0):
        precision = saved.get("precision", "fp32")
        names = [zero_file(s, d, precision) for s in range(saved["pp"]) for d in range(saved["dp"])]
        lacking = [n for n in names if n not in files]
    else:
        lacking = [order_file(s) for s in range(saved["pp"]) if order_file(s) not in files]
    if lacking:
        return (f"the checkpoint lacks {lacking[0]} (written by an earlier mmpipe), so its optimizer state cannot "
                f"be remapped: resume with its layout")
    return None


def run_topology(rc: RunConfig, stages: list | None = None) -> dict:
    """What a checkpoint must match to load: the model (its weight-shaping figures), DeepSpeed's
    files are per stage (and, under ZeRO, per replica), their layout depends on the precision;
    reader positions are per replica. `stages`: the cut (None before launch, when it is not
    chosen yet)."""
    return {"pp": rc.parallel.pp, "dp": rc.parallel.dp, "stages": None if stages is None else [list(s) for s in stages],
            "precision": rc.train.precision, "zero": rc.train.zero, "model": model_identity(rc.model),
            "lora": lora_identity(rc.train.lora), "trainable": list(rc.train.trainable), "base": _base(rc)}


def _base(rc: RunConfig) -> dict | None:
    """Where a LoRA run's frozen base weights come from (its checkpoints leave them out: every
    start rebuilds them): the model's source folders and the seed; None for full training."""
    if not rc.train.lora.active:
        return None
    folders = [[part, str(Path(folder).resolve())] for part, folder in (rc.model.hf.weights if rc.model.hf else ())]
    return {"folders": folders, "seed": rc.train.seed}
