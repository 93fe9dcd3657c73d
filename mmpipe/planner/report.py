"""Human output of a plan: stage table, per-step prediction, baselines side by side, the
schedule comparison, and a matplotlib timeline of one step (Agg backend, no display)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mmpipe.measure import mean_over_shared
from mmpipe.planner.layout import Layout, LayoutChoice
from mmpipe.planner.problem import Placement
from mmpipe.planner.samples import SampleTable
from mmpipe.planner.schedules import SCHEDULES
from mmpipe.planner.spread import SpreadStep
from mmpipe.planner.stage_cost import StageCosts
from mmpipe.planner.step import Replicas, StepEval, mb_costs, simulate_replica

GB = 1e9
MODALITY_COLOURS = {"text": "#9e9e9e", "image": "#1f77b4", "audio": "#2ca02c",
                    "image+audio": "#9467bd", "video": "#d62728"}


def stage_table(sc: StageCosts, evals: Sequence[StepEval]) -> str:
    """Stage -> layers, recompute, busy share, bubble share and peak memory (mean over steps
    of the slowest replica; memory: worst step)."""
    names = sc.cost.names
    P = sc.pp
    busy = np.zeros(P)
    bubble = np.zeros(P)
    for e in evals:
        r = e.replicas[e.slowest]
        if r is None:
            continue
        busy += np.asarray(r.busy) / max(r.makespan, 1e-12)
        bubble += np.asarray(r.bubble)
    k = max(1, len(evals))
    peak = np.max([e.peak_bytes for e in evals], axis=0) if evals else sc.static
    usable = sc.cost.usable_bytes
    lines = [f"{'stage':>5}  {'layers':<36} {'#':>3} {'recomp':>6} {'busy':>6} {'bubble':>6} "
             f"{'static GB':>9} {'peak GB':>8}"]
    for s, (a, b) in enumerate(sc.stages):
        span = f"{names[a]} .. {names[b - 1]}"
        flag = " OVER" if peak[s] > usable else ""
        lines.append(f"{s:>5}  {span:<36} {b - a:>3} {'on' if sc.recompute[s] else 'off':>6} "
                     f"{busy[s] / k:>6.1%} {bubble[s] / k:>6.1%} {sc.static[s] / GB:>9.1f} "
                     f"{peak[s] / GB:>8.1f}{flag}")
    head = sc.cost.memory_headroom
    lines.append(f"memory a plan may fill per device: {usable / GB:.1f} GB"
                 + (f" (usable {sc.cost.hardware.usable_bytes / GB:.1f} GB less the "
                    f"{head:.0%} plan.memory_headroom)" if head else ""))
    return "\n".join(lines)


def layout_table(choice: LayoutChoice) -> str:
    """The ranked layouts: predicted step time, samples/s, efficiency against the lower bound,
    peak memory per stage, bubble, and how each was priced."""
    lines = [f"  {'layout':<10} {'step s':>8} {'samples/s':>10} {'eff.':>6} {'bubble':>6}  "
             f"{'peak GB per stage':<28} {'priced':<9} note"]
    for i, x in enumerate(choice.layouts):
        mark = "*" if i == 0 and x.fits else " "
        fmt = ".0f" if max(x.peak_bytes, default=0.0) >= 10 * GB else ".2g"
        peak = " ".join(format(b / GB, fmt) for b in x.peak_bytes[:8])
        if len(x.peak_bytes) > 8:
            peak += f" .. max {format(max(x.peak_bytes) / GB, fmt)}"
        if x.how == "bounded":
            nums = (f"{'>=' + format(x.step_time, '.3f'):>8} {'<=' + format(x.samples_per_s, '.1f'):>10} "
                    f"{'<=' + format(x.efficiency, '.2f'):>6} {'-':>6}")
        elif x.fits:
            nums = (f"{x.step_time:>8.3f} {x.samples_per_s:>10.1f} {x.efficiency:>6.2f} "
                    f"{x.bubble:>6.1%}")
        else:
            nums = f"{'-':>8} {'-':>10} {'-':>6} {'-':>6}"
        lines.append(f"{mark} {f'{x.pp}x{x.dp}':<10} {nums}  {peak:<28} {x.how:<9} {x.note}")
    return "\n".join(lines)


def layout_json(x: Layout) -> dict:
    """One ranked layout as the plan file's `predicted.layouts` entry."""
    ok = x.fits and x.how != "bounded"
    return {"pp": x.pp, "dp": x.dp, "priced": x.how, "fits": x.fits,
            "step_time_s": round(x.step_time, 6) if ok else None,
            "samples_per_s": round(x.samples_per_s, 3) if ok else None,
            "efficiency": round(x.efficiency, 4) if ok else None,
            "bubble": round(x.bubble, 4) if ok else None,
            "peak_memory_gb": [round(b / GB, 3) for b in x.peak_bytes] if ok else [],
            "at_least_s": round(x.step_time, 6) if x.how == "bounded" else None,
            "small_step": x.small_step, "note": x.note}


def steps_table(rows: Sequence[tuple[str, Sequence[float], str]], lower: Sequence[float]) -> str:
    """Per-step predicted time of several policies side by side, with the lower bound; the
    means are over the steps every policy planned (mmpipe.measure.mean_over_shared), and say so."""
    head = f"{'step':>4} {'lower bound':>11} " + " ".join(f"{name:>14}" for name, _, _ in rows)
    out = [head]
    n = len(lower)
    for k in range(n):
        cells = []
        for _, times, _ in rows:
            cells.append(f"{times[k]:>13.3f}s" if k < len(times) else f"{'-':>14}")
        out.append(f"{k:>4} {lower[k]:>10.3f}s " + " ".join(cells))
    means, shared = mean_over_shared({name: times for name, times, _ in rows})
    low = float(np.mean(lower[:shared])) if shared else float("nan")
    out.append(f"{'mean':>4} {low:>10.3f}s " + " ".join(f"{means[name]:>13.3f}s" for name, _, _ in rows))
    span = "step 0" if shared == 1 else f"steps 0-{shared - 1}"
    out.append(f"mean: over the {shared} step{'s' if shared != 1 else ''} every policy planned ({span})"
               + (f" of {n}" if shared < n else ""))
    out.append("settings: " + "; ".join(f"{name}: {setting}" for name, _, setting in rows))
    return "\n".join(out)


def schedule_comparison(sc: StageCosts, table: SampleTable, mbs: list[list[int]], *,
                        packing: bool) -> str:
    """Makespan, worst bubble and peak activation memory of each schedule on the same
    micro-batches (one replica)."""
    c = mb_costs(sc, table, mbs, packing=packing)
    out = [f"{'schedule':<12} {'makespan':>9} {'bubble':>7} {'peak act GB':>11}"]
    for name in SCHEDULES:
        try:
            r = simulate_replica(c, schedule=name)
        except ValueError as err:
            out.append(f"{name:<12} n/a ({err})")
            continue
        out.append(f"{name:<12} {r.makespan:>8.3f}s {max(r.bubble):>7.1%} "
                   f"{max(r.peak_act) / GB:>11.1f}")
    return "\n".join(out)


def plot_timeline(path: str, sc: StageCosts, table: SampleTable, replicas: Replicas, *,
                  packing: bool, modality: Sequence[str], title: str = "") -> None:
    """Draw the slowest replica's 1F1B timeline: stages as rows, forward (light) and backward
    (dark) blocks coloured by the micro-batch's modality."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    times = []
    for mbs in replicas:
        times.append(simulate_replica(mb_costs(sc, table, mbs, packing=packing)).makespan
                     if mbs else 0.0)
    r = int(np.argmax(times))
    mbs = replicas[r]
    res = simulate_replica(mb_costs(sc, table, mbs, packing=packing), events=True)
    kinds = [_mb_modality(mb, modality) for mb in mbs]
    fig, ax = plt.subplots(figsize=(12, 0.6 * sc.pp + 1.6))
    for e in res.events:
        colour = MODALITY_COLOURS.get(kinds[e.mb], "#ff7f0e")
        ax.barh(e.device, e.end - e.start, left=e.start, height=0.8, color=colour,
                alpha=0.55 if e.op == "F" else 1.0, edgecolor="black", linewidth=0.3)
        if e.end - e.start > res.makespan / 80:
            ax.text((e.start + e.end) / 2, e.device, f"{e.op}{e.mb}", ha="center",
                    va="center", fontsize=6)
    ax.set_yticks(range(sc.pp))
    ax.set_yticklabels([f"stage {s}" for s in range(sc.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time (s)")
    ax.set_title(title or f"replica {r}: {len(mbs)} micro-batches, {res.makespan:.3f} s")
    used = sorted(set(kinds))
    ax.legend(handles=[Patch(color=MODALITY_COLOURS.get(k, "#ff7f0e"), label=k) for k in used]
              + [Patch(color="white", label="light: forward, dark: backward")],
              loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _mb_modality(mb: list[int], modality: Sequence[str]) -> str:
    kinds = {modality[i] for i in mb}
    if any("video" in k for k in kinds):  # the costliest medium names the micro-batch
        return "video"
    has_img = any("image" in k for k in kinds)
    has_aud = any("audio" in k for k in kinds)
    return "image+audio" if has_img and has_aud else "image" if has_img else \
        "audio" if has_aud else "text"


def encoders_report(value: str, chosen: dict[str, str], compared: Sequence[tuple[Placement, float]],
                    spread_steps: Sequence[SpreadStep] | None, n_steps: int, show_steps: int = 4) -> str:
    """The placement chosen, the placements compared (mean simulated step time of each one's
    best plan) and, under a spread placement, each rank's encode load on the first steps."""
    towers = ", ".join(f"{t} {w}" for t, w in chosen.items()) or "none"
    lines = [f"encoders: {towers} (plan.encoders={value})"]
    if len(compared) > 1:
        cells = [f"{e.name} {t / n_steps:.3f} s" if np.isfinite(t) else f"{e.name} does not fit"
                 for e, t in compared]
        lines.append("placements compared (mean simulated step time of each one's best plan): " + "; ".join(cells))
    if spread_steps:
        lines.append(f"encode load per rank (pre-pass forward + post-pass, s; shares keep: {spread_steps[0].mode}; "
                     f"gradient reduce and weight broadcast of the spread towers {spread_steps[0].allreduce:.3f} s):")
        for k, st in enumerate(spread_steps[:show_steps]):
            loads = [x for rep in st.loads for x in rep]
            pre, post = max(st.pre, default=0.0), max(st.post, default=0.0)
            lines.append(f"  step {k}: max {max(loads, default=0.0):.3f} mean {np.mean(loads) if loads else 0.0:.3f}; "
                         f"slowest pre-pass {pre:.3f}, post-pass {post:.3f}")
    return "\n".join(lines)
