"""`mmpipe export RUN_DIR [checkpoint=stepN] out=DIR`: a finished run's Hugging Face model, written
back as the transformers class it is (the work is mmpipe.model.hf.export)."""

from __future__ import annotations

from pathlib import Path

from mmpipe.config import run_config_from_dict, tokenizer_source


def run_export(run_dir: str, *, out: str, checkpoint: str | None = None, overwrite: bool = False,
               merge: bool = False):
    """`mmpipe export RUN_DIR [checkpoint=stepN] out=DIR [overwrite=true]`: the run's model
    (RUN_DIR/run.yaml) at its latest or named checkpoint, written as the transformers class it is
    (mmpipe.model.hf.export), with the tokenizer and processor files of its source (or of
    data.tokenizer when that was a folder). `out` is never a source folder; it holds files of
    another kind only with `overwrite` (see mmpipe.export_folder). Returns the ExportReport.

    Raises:
        ValueError: one line naming the argument (RUN_DIR, checkpoint=, out=).
    """
    import yaml

    from mmpipe.export_folder import check_out
    from mmpipe.model.group import is_hf_group
    from mmpipe.runtime.committed import MARKER, newest_committed

    run = Path(run_dir)
    if not (run / "run.yaml").is_file():
        raise ValueError(f"{run_dir} is not a run directory (no run.yaml); give the hydra.run.dir of a "
                         f"`mmpipe train` run")
    raw = yaml.safe_load((run / "run.yaml").read_text())
    if not is_hf_group(raw.get("model") or {}):  # from the file: building its config imports torch
        raise ValueError(f"{run_dir} trained model {(raw.get('model') or {}).get('name', '?')}, mmpipe's own model: "
                         f"export writes a Hugging Face model; train one with model=hf, model=compose or a Hub preset")
    if checkpoint is None:  # the newest committed one (a save cut short by a crash is never exported)
        folder = newest_committed(run, f"mmpipe export {run_dir}")[0]
    else:
        folder = Path(checkpoint) if Path(checkpoint).is_dir() else run / "checkpoints" / checkpoint
        if not (folder / MARKER).is_file():
            have = sorted(p.parent.name for p in (run / "checkpoints").glob(f"step*/{MARKER}")) or ["none"]
            raise ValueError(f"checkpoint={checkpoint}: {folder} is not a committed checkpoint of {run_dir} "
                             f"(committed: {', '.join(have)}); save with train.save_every=N or train.save_final=true")
    # out= against the folders run.yaml names, before the model is built (seconds of imports);
    # export() checks again against the built model's folders
    check_out(out, _named_folders(raw, folder), overwrite=overwrite)
    rc = run_config_from_dict(raw, run_dir=str(run))
    path, key = tokenizer_source(rc) if rc.data.tokenizer else (None, "")
    tokenizer = path if path and Path(path).is_dir() else None
    if merge and not rc.train.lora.active:
        raise ValueError(f"merge=true: {run_dir} trained no adapters (train.lora.r=0); its export is the whole "
                         f"model already: drop merge=true")
    from mmpipe.model.hf import export  # torch and transformers: after the arguments are checked

    return export(rc.model, folder, out, seed=rc.train.seed, tokenizer=tokenizer, overwrite=overwrite,
                  about={"run": str(run.resolve())}, lora=rc.train.lora, merge=merge,
                  trainable=rc.train.trainable)


def _named_folders(raw: dict, checkpoint: Path) -> dict[str, str]:
    """The source folders run.yaml names as typed (`model.path`, `model.<part>.path`, a
    `data.tokenizer` folder) and the checkpoint: what `out` must keep clear of."""
    model = raw.get("model") if isinstance(raw.get("model"), dict) else {}
    out = {"model.path": model["path"]} if isinstance(model.get("path"), str) else {}
    out.update({f"model.{part}.path": v["path"] for part, v in model.items()
                if isinstance(v, dict) and isinstance(v.get("path"), str)})
    tokenizer = (raw.get("data") or {}).get("tokenizer")
    if isinstance(tokenizer, str) and Path(tokenizer).is_dir():
        out["data.tokenizer"] = tokenizer
    out["checkpoint"] = str(checkpoint)
    return out
