"""`mmpipe report RUN_DIR [RUN_DIR ...]`: the figures of one or several runs in one PNG.

Reads each run's metrics.jsonl (a sweep or bench directory stands for the runs inside it) and
draws four panels side by side: loss (with the held-out `eval_loss`, dashed, where the run
evaluated), samples/s and measured bubble per step, and the planner's predicted step time
against the measured one (the engine's train_batch time, which
`predicted_step_time` predicts). Runs are named by the overrides that set them apart
(`.hydra/overrides.yaml`), so a sweep over policies reads as a legend of policies; runs with
the same overrides (a bench's rounds) are repeats of one configuration and share a name.

The printed figures are mmpipe.measure's, per configuration, over the steps every run timed
(each launch's warm-up left out), as `mmpipe bench` computes them: the same runs get the
same samples/s and the same ranking from both commands.
"""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from pathlib import Path

import yaml

from mmpipe.measure import (
    METRICS_FILE,
    WARMUP_STEPS,
    Throughput,
    compared_records,
    rank,
    read_records,
    shared_text,
    throughput,
)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunMetrics:
    """One run's per-step records."""

    path: Path
    """The run directory."""
    label: str
    """How the legend names it (runs with the same overrides share it)."""
    steps: list[dict]
    """metrics.jsonl, one record per logged step."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Configuration:
    """The runs of one configuration (one run, or the repeats of a bench's rounds)."""

    label: str
    runs: list[RunMetrics]
    timed: list[dict]
    """Their records on the steps every run of the report timed (mmpipe.measure)."""
    throughput: Throughput
    """Steady-state samples/s, tokens/s and step time over `timed`."""


def find_runs(dirs: list[str] | tuple[str, ...]) -> list[Path]:
    """The run directories named, a sweep or bench directory standing for the runs in it."""
    runs: list[Path] = []
    for d in map(Path, dirs):
        if (d / METRICS_FILE).is_file():
            runs.append(d)
            continue
        inside = sorted((p.parent for p in d.glob(f"*/{METRICS_FILE}")), key=_natural)
        if not inside:
            where = "is not a directory" if not d.is_dir() else "has no metrics.jsonl, nor runs with one inside"
            raise ValueError(f"report.runs: {d} {where}; give run directories of mmpipe train (or a sweep of them)")
        runs += inside
    return runs


def _natural(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.name)]


def _overrides(run: Path) -> list[str] | None:
    f = run / ".hydra" / "overrides.yaml"
    return list(yaml.safe_load(f.read_text()) or []) if f.is_file() else None


def run_labels(paths: list[Path], given: list[list[str] | None]) -> list[str]:
    """Each run's name: the overrides that set it apart from the others (the same for runs with
    the same overrides: repeats), all its overrides when every run has the same, else its folder."""
    if len(paths) > 1 and all(g is not None for g in given):
        sets = [set(g or ()) for g in given]
        common = set.intersection(*sets)
        labels = [" ".join(o for o in g or () if o not in common) for g in given]
        if all(labels):
            return labels
        if all(s == sets[0] for s in sets) and given[0]:
            return [" ".join(given[0])] * len(paths)
    return [p.name if len({q.name for q in paths}) == len(paths) else str(p) for p in paths]


def load_runs(dirs: list[str] | tuple[str, ...]) -> list[RunMetrics]:
    paths = find_runs(dirs)
    labels = run_labels(paths, [_overrides(p) for p in paths])
    return [RunMetrics(path=path, label=label, steps=read_records(path)) for path, label in zip(paths, labels)]


def configurations(runs: list[RunMetrics]) -> tuple[list[Configuration], list[int]]:
    """The runs grouped by name, each group's figures over the steps every run timed; and those
    steps (mmpipe.measure.compared_records)."""
    groups: dict[str, list[RunMetrics]] = {}
    for run in runs:
        groups.setdefault(run.label, []).append(run)
    records, common = compared_records({label: [r.steps for r in group] for label, group in groups.items()})
    return [Configuration(label=label, runs=group, timed=records[label], throughput=throughput(records[label]))
            for label, group in groups.items()], common


def _series(run: RunMetrics, key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in run.steps if isinstance(r.get(key), (int, float))]
    return [p[0] for p in pts], [p[1] for p in pts]


def _values(records: list[dict], key: str) -> list[float]:
    return [r[key] for r in records if isinstance(r.get(key), (int, float))]


def _ends(config: Configuration, key: str) -> tuple[float, float, int] | None:
    """The mean over the runs of the first and of the last value of `key`, and how many there are."""
    series = [y for y in (_series(run, key)[1] for run in config.runs) if y]
    if not series:
        return None
    return statistics.mean(y[0] for y in series), statistics.mean(y[-1] for y in series), sum(map(len, series))


def summary(config: Configuration) -> str:
    """One line of figures per configuration: loss first -> last, steady-state samples/s and
    step time, and medians over the timed steps."""
    n_runs = len(config.runs)
    logged = sum(len(r.steps) for r in config.runs)
    parts = [f"{config.label}: " + (f"{n_runs} runs, " if n_runs > 1 else "") + f"{logged} steps"]
    if loss := _ends(config, "loss"):
        parts.append(f"loss {loss[0]:.3f} -> {loss[1]:.3f}")
    if held_out := _ends(config, "eval_loss"):
        parts.append(f"eval_loss {held_out[0]:.3f} -> {held_out[1]:.3f} ({held_out[2]} evaluations)")
    t = config.throughput
    if t.steps:
        parts.append(f"{t.samples_per_s:.1f} samples/s, {t.step_time:.3f} s a step")
    timed = config.timed
    if bubble := _values(timed, "bubble"):
        parts.append(f"bubble {statistics.median(bubble):.1%}")
    if err := _values(timed, "prediction_error"):
        parts.append(f"|prediction error| {statistics.median(abs(e) for e in err):.1%}")
    if bound := _values(timed, "bound_fraction"):
        parts.append(f"{statistics.median(bound):.1%} of the lower bound")
    if mfu := _values(timed, "mfu"):
        parts.append(f"MFU {statistics.median(mfu):.2%} (encoders counted)")
    return ", ".join(parts) + "".join(f"; {line}" for run in config.runs for line in recut_lines(run))


def ranking(configs: list[Configuration], common: list[int]) -> str:
    """The configurations fastest first by steady-state samples/s (as `mmpipe bench` ranks them)."""
    sps = {c.label: c.throughput.samples_per_s for c in configs}
    return (f"fastest first ({shared_text(common)}; the first {WARMUP_STEPS} steps of each launch not timed): "
            + ", ".join(f"{label} {sps[label]:.1f} samples/s" for label in rank(sps)))


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
    """Draw the runs into `out` (a PNG); return its path, one summary line per configuration and,
    with several, their ranking."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    runs = load_runs(dirs)
    configs, common = configurations(runs)
    colours = {c.label: f"C{i % 10}" for i, c in enumerate(configs)}
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    (ax_loss, ax_sps), (ax_bubble, ax_pred) = axes
    seen: set[str] = set()
    for run in runs:
        colour = colours[run.label]
        name = run.label if run.label not in seen else f"_{run.label}"  # a repeat: in the legend once
        seen.add(run.label)
        for ax, key, scale in ((ax_loss, "loss", 1.0), (ax_sps, "samples_per_s", 1.0), (ax_bubble, "bubble", 100.0)):
            x, y = _series(run, key)
            ax.plot(x, [v * scale for v in y], color=colour, label=name, lw=1.4)
        for r in run.steps:  # where the run re-cut its stages (plan.recut=auto)
            if (r.get("recut") or {}).get("recut"):
                ax_sps.axvline(r["step"] + 0.5, color=colour, ls=":", lw=1.2)
        x, y = _series(run, "bound_fraction")
        if x:
            ax_bubble.plot(x, [v * 100.0 for v in y], color=colour, label=f"{name} of bound", lw=1.4,
                           ls="--")
        x, y = _series(run, "eval_loss")
        if x:
            ax_loss.plot(x, y, color=colour, label=f"{name} eval_loss", lw=1.4, ls="--", marker="o", ms=3)
        pts = [(r["predicted_step_time"], r["engine_time"]) for r in run.steps
               if isinstance(r.get("predicted_step_time"), (int, float)) and r["predicted_step_time"] > 0
               and isinstance(r.get("engine_time"), (int, float))]
        if pts:
            ax_pred.scatter([p[0] for p in pts], [p[1] for p in pts], s=14, color=colour, label=name, alpha=0.8)
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
    return out, [summary(c) for c in configs] + ([ranking(configs, common)] if len(configs) > 1 else [])
