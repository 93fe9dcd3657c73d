"""Run `mmpipe plan` on every public trace x every 7B-12B model preset (and a few variants that
take the planner's other paths) and write each plan JSON and printed report to a folder, so
that two folders can be compared: a refactor of the planner must leave every plan identical.

    python scripts/compare_plans.py OUT_DIR [--steps 2] [--only NAME,...]
    python scripts/compare_plans.py --diff BEFORE_DIR AFTER_DIR

Each case runs in this process through the command line (`mmpipe.cli.main`), so the config
(`RunConfig`), `commands.run_plan` and `planner/command.py` are all on the path. Set-up: the
plan recipes' (hardware h100, pp=4 x dp=2, 256 samples per step, 8 micro-batches, projector
and LLM trained), `plan.steps` (default 2: four full steps of every trace take about twice as
long and take no other path). A pair whose trace the model cannot read (audio on a vision
model) is recorded as its error line, which must stay the same too. The plan JSON holds no
wall-clock figure; the report's lines are compared whole.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

ROOT = Path(__file__).resolve().parents[1]
TRACES = sorted(p.stem for p in (ROOT / "data" / "workloads").glob("*.jsonl"))
PRESETS = ["llava-1.5-7b", "llava-next-mistral-7b", "llava-onevision-qwen2-7b", "omni-7b", "qwen2-audio-7b",
           "qwen2-vl-7b", "qwen2.5-omni-7b", "qwen2.5-vl-7b", "qwen3-vl-8b", "internvl3-8b", "gemma3-12b"]
BASE = ["hardware=h100", "data=trace", "parallel.pp=4", "parallel.dp=2", "train.global_batch=256",
        "train.micro_batches=8"]


def trainable(model: str) -> str:
    """The plan recipes' trained parts: the towers' projectors and the LLM."""
    if model == "qwen2-audio-7b":
        return "[audio.proj,llm]"
    if model in ("omni-7b", "qwen2.5-omni-7b"):
        return "[vision.proj,audio.proj,llm]"
    return "[vision.proj,llm]"


def cases(steps: int) -> dict[str, list[str]]:
    """Case name -> the `mmpipe plan` overrides (without plan.out / hydra.run.dir)."""
    out: dict[str, list[str]] = {}
    for trace in TRACES:
        for model in PRESETS:
            out[f"{trace}__{model}"] = [*BASE, f"model={model}", f"data.path=data/workloads/{trace}.jsonl",
                                        f"train.trainable={trainable(model)}", f"plan.steps={steps}"]
    def pair(t: str, m: str) -> list[str]:
        return out[f"{t}__{m}"]
    out["v-ds-default"] = pair("llava-sft", "qwen2-vl-7b") + ["plan.policy=ds-default"]
    out["v-llava-grouped"] = pair("llava-pretrain", "llava-1.5-7b") + ["plan.policy=llava-grouped"]
    out["v-packed-ffd"] = pair("audio-caption", "qwen2-audio-7b") + ["plan.policy=packed-ffd"]
    out["v-all-stages"] = pair("vision-dynamic", "qwen2.5-vl-7b") + ["train.trainable=[all]", "plan.encoders=stages"]
    out["v-spread"] = pair("omni-mix", "qwen2.5-omni-7b") + ["plan.encoders=spread"]
    out["v-mixed"] = pair("omni-mix", "omni-7b") + ["plan.encoders={vision: spread}"]
    out["v-lora"] = pair("llava-sft", "qwen2-vl-7b") + ["train.trainable=[vision.proj]", "train.lora.r=16",
                                                         "train.lora.parts=[llm]"]
    out["v-fp32-sgd"] = pair("llava-sft", "llava-1.5-7b") + ["train.precision=fp32", "train.optimizer=sgd",
                                                               "plan.memory_headroom=0.05"]
    out["v-auto-layout"] = pair("llava-pretrain", "qwen2-vl-7b") + [
        "parallel.pp=auto", "parallel.dp=auto", "parallel.devices=8"]
    out["v-auto-pp"] = pair("audio-caption", "omni-7b") + ["parallel.pp=auto", "parallel.devices=8",
                                                           "train.trainable=[all]"]
    out["v-stages"] = pair("llava-sft", "llava-1.5-7b") + [
        "plan.stages=[[vision.embed,llm.block.6],[llm.block.7,llm.block.15],[llm.block.16,llm.block.23],"
        "[llm.block.24,llm.head]]"]
    out["v-stages-baseline"] = out["v-stages"] + ["plan.policy=packed-ffd"]
    out["v-shards-tiny"] = ["data=shards", "model=tiny", "hardware=cpu", "parallel.pp=2", "parallel.dp=1",
                            "train.global_batch=8", "train.micro_batches=2", "plan.steps=3"]
    out["v-simulate"] = ["simulate", "model=tiny", "hardware=cpu", "data=trace",
                          "data.path=data/workloads/llava-sft.jsonl", "parallel.pp=2", "parallel.dp=2",
                          "train.global_batch=32", "train.micro_batches=4", "plan.steps=3"]
    out["v-bad-layout"] = pair("llava-sft", "qwen2-vl-7b") + ["parallel.pp=400"]
    return {name: _merged(o) for name, o in out.items()}


def _merged(overrides: list[str]) -> list[str]:
    """Later overrides replace earlier ones of the same key (the command line refuses a key
    given twice)."""
    keys: dict[str, str] = {}
    for o in overrides:
        keys[o.partition("=")[0]] = o
    return list(keys.values())


def run_case(name: str, overrides: list[str], out: Path) -> tuple[int, float]:
    """Plan one case: OUT/NAME.json (the plan, absent on error), OUT/NAME.txt (what it printed)."""
    from mmpipe.cli import main

    command = "plan"
    if overrides and overrides[0] == "simulate":  # the schedules compared on the planned step
        command, overrides = "simulate", overrides[1:]
    plan = out / f"{name}.json"
    text = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
        code = main([command, *overrides, f"plan.out={plan}", f"hydra.run.dir={out / 'runs' / name}"])
    seconds = time.perf_counter() - t0
    lines = [ln.replace(str(out), "OUT") for ln in text.getvalue().splitlines()
             if not ln.startswith("plan written to")]
    (out / f"{name}.txt").write_text(f"rc={code}\n" + "\n".join(lines) + "\n")
    return code, seconds


def diff(before: Path, after: Path) -> int:
    """Compare two folders' plans and reports; prints each difference, returns how many."""
    names = sorted({p.name for d in (before, after) for p in d.iterdir() if p.suffix in (".json", ".txt")})
    bad = 0
    plans = 0
    for n in names:
        a, b = before / n, after / n
        if not a.is_file() or not b.is_file():
            print(f"{n}: only in {'after' if b.is_file() else 'before'}")
            bad += 1
            continue
        same = (json.loads(a.read_text()) == json.loads(b.read_text())) if n.endswith(".json") \
            else a.read_text() == b.read_text()
        plans += n.endswith(".json")
        if not same:
            print(f"{n}: differs")
            bad += 1
    print(f"compared {len(names)} files ({plans} plans); {bad} differ")
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated case names")
    ap.add_argument("--diff", nargs=2, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.diff:
        return 1 if diff(Path(args.diff[0]), Path(args.diff[1])) else 0
    if not args.out:
        ap.error("give OUT_DIR or --diff BEFORE AFTER")
    os.chdir(ROOT)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    every = cases(args.steps)
    chosen = args.only.split(",") if args.only else list(every)
    unknown = [n for n in chosen if n not in every]
    if unknown:
        ap.error(f"--only: no case named {', '.join(unknown)}; the cases are: {', '.join(every)}")
    t0 = time.perf_counter()
    for name in chosen:
        code, s = run_case(name, every[name], out)
        print(f"{name:<45} rc={code} {s:6.1f} s", flush=True)
    print(f"{len(chosen)} cases in {time.perf_counter() - t0:.0f} s -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
