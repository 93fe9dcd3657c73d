"""The planner's numbers against a real run: step-time prediction, memory, and the policies.

    python benchmarks/bench_calibration.py [--out DIR] [--steps 60] [--skip-bench] [--only tiny|hf] [--lora R]

For two models, the default tiny model and a 7.6 M-parameter Qwen2-VL that transformers writes
here (the tiny demo Qwen2-VL scaled up: 4 vision blocks of width 128, 6 decoder layers of width
256, images of up to 64 LLM tokens; `save_pretrained` into DIR/qwen2-vl-7m, nothing committed):

1. `mmpipe profile` (layers, a real pipeline's fixed costs and memory) writes measured-<model>.yaml;
2. `mmpipe train` planned with it: the median |measured / predicted - 1| of the step time
   after the warm-up (the steps planned with the run's own fit), and per stage the peak
   memory measured against predicted;
3. `mmpipe train` with the defaults (hardware=cpu, no profile): the same figures;
4. `mmpipe bench` with the defaults (all four policies, alternating), unless --skip-bench.

With `--lora R` the trained and benchmarked runs use LoRA adapters of rank R (alpha 2R) on the
decoder, the projectors trained in full (`mmpipe profile` times the layers without adapters and
its real pipeline with them).
It prints one block per model, which is what docs/in-the-loop.md's figures are
(the bench tables, the prediction errors and the memory lines), and `uptime` before and after:
the figures depend on how busy the machine is. On 2 cores a full run takes 30-60 minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARM = 8
"""Steps left out of the prediction error: the re-fit's warm-up (6 steps) and the two steps
the feeder planned before the first fit reached it (runtime/feed.py FIT_LAG)."""


def write_qwen2_vl_7m(folder: Path) -> Path:
    """A Qwen2-VL of 7.6 M parameters (random weights, norms perturbed), its tokenizer and chat
    template (mmpipe's demo ones), and an image processor allowing 4 to 64 LLM tokens an image."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil

    from mmpipe.model.hf.demo_kit import QWEN_SPECIALS, corpus, perturb, qwen_tokenizer
    from mmpipe.model.hf.families.qwen2_vl import TEMPLATE as QWEN2_VL_TEMPLATE

    torch.manual_seed(7)
    tok = qwen_tokenizer(corpus())
    ids = {t: tok.convert_tokens_to_ids(t) for t in QWEN_SPECIALS}
    cfg = Qwen2VLConfig(
        vision_config=dict(depth=4, embed_dim=128, hidden_size=256, num_heads=4, mlp_ratio=4, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        text_config=dict(vocab_size=len(tok) + 3, hidden_size=256, intermediate_size=1024, num_hidden_layers=6,
                         num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5,
                         max_position_embeddings=4096, bos_token_id=None, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id,
                         rope_parameters={"rope_type": "default", "mrope_section": [4, 6, 6], "rope_theta": 1e4}),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    model = Qwen2VLForConditionalGeneration(cfg)
    perturb(model, 7)
    model.save_pretrained(folder)
    tok.chat_template = QWEN2_VL_TEMPLATE
    tok.save_pretrained(folder)
    Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 64).save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {folder}: Qwen2-VL, {params / 1e6:.1f} M parameters", flush=True)
    return folder


def mmpipe(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "mmpipe", *args], cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"mmpipe {' '.join(args)} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc.stdout


def run_figures(run_dir: Path) -> str:
    """Median prediction error after the warm-up, micro-batches, samples/s, memory per stage."""
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    late = [r for r in rows if r["step"] > WARM and r.get("prediction_error") is not None]
    err = statistics.median(abs(r["prediction_error"]) for r in late) if late else float("nan")
    mbs = statistics.mean(r["micro_batches"] for r in late) if late else float("nan")
    sps = sum(r["samples"] for r in late) / sum(r["step_time"] for r in late) if late else float("nan")
    meas = [max(r["stage_peak_mem_gb"][s] for r in rows) for s in range(len(rows[0]["stage_peak_mem_gb"]))]
    pred = [max(r["predicted_peak_mem_gb"][s] for r in rows) for s in range(len(meas))]
    mem = ", ".join(f"stage {s} {m:.2f} GB measured / {p:.2f} predicted ({m / p - 1:+.0%})"
                    for s, (m, p) in enumerate(zip(meas, pred)))
    return (f"step time: median |measured / predicted - 1| {err:.1%} over steps {WARM + 1}-{rows[-1]['step']}; "
            f"{mbs:.1f} micro-batches a step; {sps:.1f} samples/s\n    memory ({rows[0]['peak_mem_measure']}): {mem}")


def one_model(name: str, model_args: list[str], out: Path, steps: int, bench: bool,
              train_args: tuple[str, ...] = ()) -> None:
    prof = out / f"profile-{name}"
    print(f"\n== {name}: mmpipe profile", flush=True)
    text = mmpipe("profile", *model_args, *train_args, f"hydra.run.dir={prof}")
    print("\n".join(l for l in text.splitlines() if l.startswith(("Engine", "Memory", "peak", "wrote"))), flush=True)
    hw = next((prof / "conf" / "hardware").glob("measured-*.yaml")).stem
    for label, extra in ((f"hardware={hw} (profiled)", ["--config-dir", str(prof / "conf"), f"hardware={hw}"]),
                         ("defaults (hardware=cpu)", [])):
        run = out / f"train-{name}-{'profiled' if extra else 'default'}"
        mmpipe("train", *extra, *model_args, *train_args, f"train.steps={steps}", f"hydra.run.dir={run}")
        print(f"-- {name}, mmpipe train, {label}:\n    {run_figures(run)}", flush=True)
    if bench:
        print(f"-- {name}, mmpipe bench (defaults):", flush=True)
        text = mmpipe("bench", *model_args, *train_args, f"hydra.run.dir={out / f'bench-{name}'}")
        print(text[text.index("mmpipe bench: model"):], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="where the runs and the checkpoint go (default: a temporary folder)")
    ap.add_argument("--steps", type=int, default=60, help="training steps of each measured run")
    ap.add_argument("--skip-bench", action="store_true", help="no mmpipe bench")
    ap.add_argument("--only", choices=("tiny", "hf"), help="one of the two models")
    ap.add_argument("--lora", type=int, default=0, help="train with LoRA adapters of this rank (0: full training)")
    args = ap.parse_args()
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)
    with tempfile.TemporaryDirectory(prefix="mmpipe-calib-") as tmp:
        out = Path(args.out or tmp)
        out.mkdir(parents=True, exist_ok=True)
        lora = (f"train.lora.r={args.lora}", f"train.lora.alpha={2 * args.lora}") if args.lora else ()
        if args.only in (None, "tiny"):
            tiny = ("train.trainable=[vision.proj,audio.proj]",) if lora else ()
            one_model("tiny", [], out, args.steps, not args.skip_bench, lora + tiny)
        if args.only in (None, "hf"):
            folder = out / "qwen2-vl-7m"
            if not (folder / "config.json").is_file():
                write_qwen2_vl_7m(folder)
            one_model("qwen2-vl-7m", ["model=hf", f"model.path={folder}"], out, args.steps, not args.skip_bench,
                      lora + (("train.trainable=[vision.proj]",) if lora else ()))
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(), flush=True)


if __name__ == "__main__":
    main()
