"""Per-step metrics: JSON lines always, TensorBoard and Weights & Biases when asked for; the progress bar.

`train.loggers` names the sinks. metrics.jsonl is the record every tool of mmpipe reads
(`mmpipe report`, `mmpipe bench`); TensorBoard event files (RUN_DIR/tensorboard, through
torch.utils.tensorboard) and a wandb run (offline unless WANDB_MODE says otherwise) get the
same per-step figures: the numbers of each record, lists as one series per entry
(`stage_busy_s/0`, `stage_busy_s/1`, ...), `eval_loss` on the steps that evaluated. Both are
optional packages, checked before launch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from tqdm import tqdm

OPTIONAL = {"tensorboard": "tensorboard", "wandb": "wandb"}
"""Logger name -> the package it needs (installed with `pip install 'mmpipe[<logger>]'`)."""


def check_loggers(loggers: tuple[str, ...]) -> None:
    """Every logger asked for can start (before any process is launched)."""
    for name in loggers:
        package = OPTIONAL.get(name)
        if package and importlib.util.find_spec(package) is None:
            raise ValueError(f"train.loggers asks for {name}, but the {package} package is not installed; "
                             f"pip install 'mmpipe[{name}]', or drop {name} from train.loggers")


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a metrics record, lists spread into one series per entry."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if isinstance(value, bool) or key == "step":
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif isinstance(value, (list, tuple)):
            out.update({f"{key}/{i}": float(v) for i, v in enumerate(value)
                        if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return out


class MetricsWriter:
    """Writes one JSON object per line to `path` (created with its folder; a new run starts the
    file afresh, a resumed run appends to it) and the same figures to the other `loggers`,
    which live in the same folder."""

    def __init__(self, path: Path, *, append: bool = False, loggers: tuple[str, ...] = ("jsonl",)):
        check_loggers(loggers)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._fh = path.open("a" if append else "w")
        self._tb = None
        self._wandb = None
        if "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(path.parent / "tensorboard"))
        if "wandb" in loggers:
            import wandb

            run_dir = path.parent.resolve()
            self._wandb = wandb.init(project=os.environ.get("WANDB_PROJECT", "mmpipe"),
                                     name=f"{run_dir.parent.name}/{run_dir.name}", dir=str(run_dir),
                                     mode=os.environ.get("WANDB_MODE", "offline"))

    def write(self, record: dict) -> None:
        self._fh.write(json.dumps(record) + "\n")
        self._fh.flush()
        step = int(record.get("step", 0))
        if self._tb is not None:
            for key, value in scalars(record).items():
                self._tb.add_scalar(key, value, global_step=step)
        if self._wandb is not None:
            self._wandb.log(scalars(record), step=step)

    def close(self) -> None:
        self._fh.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


class ProgressBar:
    """A tqdm bar with loss, the latest held-out loss and throughput."""

    def __init__(self, total: int):
        self._bar = tqdm(total=total, desc="train", unit="step", dynamic_ncols=True, mininterval=0.5)

    def update(self, *, loss: float, samples_per_s: float, tokens_per_s: float, eval_loss: float | None = None) -> None:
        shown = {"loss": f"{loss:.3f}"}
        if eval_loss is not None:
            shown["eval_loss"] = f"{eval_loss:.3f}"
        shown.update(samples_s=f"{samples_per_s:.1f}", tokens_s=f"{tokens_per_s:.0f}")
        self._bar.set_postfix(ordered_dict=shown, refresh=False)  # in this order (keywords are sorted)
        self._bar.update(1)

    def note(self, message: str) -> None:
        """A line above the bar (printed plainly, it would land on the bar's line)."""
        self._bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
