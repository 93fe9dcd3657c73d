"""`mmpipe report RUN_DIR [RUN_DIR ...]`: the figures of one or several runs in one PNG.

Reads each run's metrics.jsonl (a sweep or bench directory stands for the runs inside it) and
draws four panels side by side: loss (with the held-out `eval_loss`, dashed, where the run
evaluated), samples/s and measured bubble per step, and the planner's predicted step time
against the measured one (the engine's train_batch time, which
`predicted_step_time` predicts). Runs are named by the overrides that set them apart
(`.hydra/overrides.yaml`), so a sweep over policies reads as a legend of policies.
"""

from __future__ import annotations

import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml


@dataclass(frozen=True, kw_only=True, slots=True)
class RunMetrics:
    """One run's per-step records."""

    path: Path
    """The run directory."""
    label: str
    """How the legend names it."""
    steps: list[dict]
    """metrics.jsonl, one record per logged step."""


def find_runs(dirs: list[str] | tuple[str, ...]) -> list[Path]:
    """The run directories named, a sweep or bench directory standing for the runs in it."""
    runs: list[Path] = []
    for d in map(Path, dirs):
        if (d / "metrics.jsonl").is_file():
            runs.append(d)
            continue
        inside = sorted((p.parent for p in d.glob("*/metrics.jsonl")), key=_natural)
        if not inside:
            where = "is not a directory" if not d.is_dir() else "has no metrics.jsonl, nor runs with one inside"
            raise ValueError(f"report.runs: {d} {where}; give run directories of mmpipe train (or a sweep of them)")
        runs += inside
    return runs


def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _overrides(run: Path) -> list[str]:
    f = run / ".hydra" / "overrides.yaml"
    return list(yaml.safe_load(f.read_text()) or []) if f.is_file() else []


def load_runs(dirs: list[str] | tuple[str, ...]) -> list[RunMetrics]:
    paths = find_runs(dirs)
    given = [_overrides(p) for p in paths]
    common = set.intersection(*(set(g) for g in given)) if given else set()
    labels = [" ".join(o for o in g if o not in common) for g in given]
    if len(set(labels)) < len(labels) or not all(labels):
        labels = [p.name if len({q.name for q in paths}) == len(paths) else str(p) for p in paths]
    out = []
    for path, label in zip(paths, labels):
        lines = (path / "metrics.jsonl").read_text().splitlines()
        out.append(RunMetrics(path=path, label=label, steps=[json.loads(l) for l in lines if l.strip()]))
    return out


def _series(run: RunMetrics, key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in run.steps if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def summary(run: RunMetrics) -> str:
    """One line of figures per run (medians over the logged steps)."""
    _, loss = _series(run, "loss")
    _, sps = _series(run, "samples_per_s")
    _, bubble = _series(run, "bubble")
    _, err = _series(run, "prediction_error")
    _, held_out = _series(run, "eval_loss")
    _, bound = _series(run, "bound_fraction")
    _, mfu = _series(run, "mfu")
    parts = [f"{run.label}: {len(run.steps)} steps"]
    if loss:
        parts.append(f"loss {loss[0]:.3f} -> {loss[-1]:.3f}")
    if held_out:
        parts.append(f"eval_loss {held_out[0]:.3f} -> {held_out[-1]:.3f} ({len(held_out)} evaluations)")
    if sps:
        parts.append(f"{statistics.median(sps):.1f} samples/s")
    if bubble:
        parts.append(f"bubble {statistics.median(bubble):.1%}")
    if err:
        parts.append(f"|prediction error| {statistics.median(abs(e) for e in err):.1%}")
    if bound:
        parts.append(f"{statistics.median(bound):.1%} of the lower bound")
    if mfu:
        parts.append(f"MFU {statistics.median(mfu):.2%} (encoders counted)")
    return ", ".join(parts) + "".join(f"; {line}" for line in recut_lines(run))


def recut_lines(run: RunMetrics) -> list[str]:
    """One phrase per re-cut of the run (plan.recut=auto): where, the cuts, the predicted and the
    measured gain."""
    from mmpipe.planner.api import describe_gain

    measured = {r["recut_measured"]["after_step"]: r["recut_measured"] for r in run.steps if "recut_measured" in r}
    out = []
    for r in run.steps:
        cut = r.get("recut")
        if cut and cut.get("recut"):
            m = measured.get(r["step"])
            out.append(f"re-cut after step {r['step']}: {cut['old']} -> {cut['new']}, {describe_gain(cut)}"
                       + (f", measured {m['gain']:+.1%}" if m else ", not measured (the run ended first)"))
    return out


def write_report(dirs: list[str] | tuple[str, ...], *, out: Path) -> tuple[Path, list[str]]:
    """Draw the runs into `out` (a PNG); return its path and one summary line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = load_runs(dirs)
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    (ax_loss, ax_sps), (ax_bubble, ax_pred) = axes
    for i, run in enumerate(runs):
        colour = f"C{i % 10}"
        for ax, key, scale in ((ax_loss, "loss", 1.0), (ax_sps, "samples_per_s", 1.0), (ax_bubble, "bubble", 100.0)):
            x, y = _series(run, key)
            ax.plot(x, [v * scale for v in y], color=colour, label=run.label, lw=1.4)
        for r in run.steps:  # where the run re-cut its stages (plan.recut=auto)
            if (r.get("recut") or {}).get("recut"):
                ax_sps.axvline(r["step"] + 0.5, color=colour, ls=":", lw=1.2)
        x, y = _series(run, "bound_fraction")
        if x:
            ax_bubble.plot(x, [v * 100.0 for v in y], color=colour, label=f"{run.label} of bound".strip(), lw=1.4,
                           ls="--")
        x, y = _series(run, "eval_loss")
        if x:
            ax_loss.plot(x, y, color=colour, label=f"{run.label} eval_loss".strip(), lw=1.4, ls="--", marker="o", ms=3)
        pts = [(r["predicted_step_time"], r["engine_time"]) for r in run.steps
               if isinstance(r.get("predicted_step_time"), (int, float)) and r["predicted_step_time"] > 0
               and isinstance(r.get("engine_time"), (int, float))]
        if pts:
            ax_pred.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, color=colour, label=run.label, alpha=0.8)
    for ax, title, ylabel in ((ax_loss, "loss (dashed: held-out eval_loss)", "loss"),
                              (ax_sps, "throughput (dotted: a re-cut)", "samples/s"),
                              (ax_bubble, "measured bubble (dashed: achieved fraction of the step's lower bound)",
                               "idle share of the stages / fraction of the bound (%)")):
        ax.set(title=title, xlabel="step", ylabel=ylabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    ax_pred.set(title="step time: predicted vs measured", xlabel="predicted (s)", ylabel="measured train_batch (s)")
    ax_pred.grid(alpha=0.3)
    lims = [v for c in ax_pred.collections for v in c.get_offsets().flatten()]
    if lims:
        lo, hi = min(lims), max(lims)
        ax_pred.plot([lo, hi], [lo, hi], color="grey", lw=1, ls="--", label="measured = predicted")
    ax_loss.legend(fontsize=8, loc="upper right")
    fig.suptitle(", ".join(str(r.path) for r in runs) if len(runs) <= 2 else f"{len(runs)} runs", fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out, [summary(r) for r in runs]
