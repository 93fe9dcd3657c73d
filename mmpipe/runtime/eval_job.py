"""What `mmpipe eval RUN_DIR ...` scores, read from the run directory and checked before any
import of torch or DeepSpeed, so a wrong argument is one line within a second (the scoring
itself is mmpipe.runtime.evaluate)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from mmpipe.config import RunConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class EvalJob:
    """`mmpipe eval`: a run's committed checkpoint and the held-out shards to score it on."""

    rc: RunConfig
    """The run's config (RUN_DIR/run.yaml) with the checkpoint's stages, the held-out shards as
    data.eval_path (and data.path: the ranks read nothing else, every replica all of it),
    train.eval_samples as given, and the job's own folder as run_dir (nothing is written into
    the run's)."""
    checkpoint: Path
    """The committed step folder."""
    step: int
    """Its step."""


def eval_job(run_dir: str, *, checkpoint: str | None, data_path: str | None, samples: int | None,
             job_dir: str) -> EvalJob:
    """What `mmpipe eval RUN_DIR [checkpoint=stepN] [data.path=SHARDS] [train.eval_samples=N]`
    scores, checked before any process starts. Raises ValueError naming the argument."""
    import json

    import yaml

    from mmpipe.config import check_run, run_config_from_dict
    from mmpipe.runtime.committed import MARKER, newest_committed

    run = Path(run_dir)
    if not (run / "run.yaml").is_file():
        raise ValueError(f"{run_dir} is not a run directory (no run.yaml); give the hydra.run.dir of a "
                         f"`mmpipe train` run")
    raw = yaml.safe_load((run / "run.yaml").read_text())
    if checkpoint is None:  # the newest committed one (a save cut short by a crash is never scored)
        folder = newest_committed(run, f"mmpipe eval {run_dir}")[0]
    else:
        named = Path(checkpoint) if Path(checkpoint).is_dir() else run / "checkpoints" / checkpoint
        if not (named / MARKER).is_file():
            have = sorted((p.parent.name for p in (run / "checkpoints").glob(f"step*/{MARKER}")),
                          key=lambda name: int(name[4:]) if name[4:].isdigit() else -1) or ["none"]
            raise ValueError(f"checkpoint={checkpoint}: {named} is not a committed checkpoint of {run_dir} "
                             f"(committed: {', '.join(have)})")
        folder = named
    path = data_path or ((raw.get("data") or {}).get("eval_path") if isinstance(raw, dict) else None)
    if not path:
        raise ValueError(f"give data.path=SHARDS, the held-out shards to score ({run_dir} set no data.eval_path)")
    rc = run_config_from_dict(raw, run_dir=str(run))  # a Hugging Face model: seconds of imports, so after the above
    try:
        record = json.loads((folder / MARKER).read_text())
        step, names = int(record["step"]), rc.layers
        stages = tuple((names[a], names[b - 1]) for a, b in record["topology"]["stages"])
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        raise ValueError(f"the commit record {folder / MARKER} is unreadable ({type(err).__name__}: {err}); the "
                         f"checkpoint is damaged") from None
    t = rc.train
    job = replace(rc, run_dir=job_dir,
                  data=replace(rc.data, path=path, eval_path=path, sources=None),
                  train=replace(t, eval_samples=t.eval_samples if samples is None else samples, eval_every=0,
                                resume=None, save_every=0, save_final=False, record_samples=False,
                                loggers=("jsonl",)),
                  plan=replace(rc.plan, stages=stages, across_replicas=True))
    check_run(job)
    return EvalJob(rc=job, checkpoint=folder, step=step)
