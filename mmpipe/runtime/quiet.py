"""Library chatter during a rank's set-up, held back unless the user asks for it
(`MMPIPE_DEBUG=1`, which `launcher.verbose=true` sets): DeepSpeed's loggers and the lines it
prints with print()."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator


class _Drop(logging.Filter):
    """Drops records whose message starts with one of `starts` (one library line, not its logger)."""

    def __init__(self, *starts: str) -> None:
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.starts)


def quiet_third_party() -> None:
    """Filter the library warnings a user can do nothing about, each at its source:
    torch's `No CUDA runtime is found, using CUDA_HOME=...` (logged when DeepSpeed's op builder
    imports torch's C++ extension module on a machine with no GPU, where no CUDA is expected) and
    torch.distributed's FutureWarning that `all_gather_into_tensor` is deprecated (DeepSpeed's
    ZeRO-1 calls it every step; printed with a stray `return func(*args, **kwargs)` line)."""
    import warnings

    logging.getLogger("torch.utils.cpp_extension").addFilter(_Drop("No CUDA runtime is found"))
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                            category=FutureWarning)


def quiet_deepspeed() -> None:
    """DeepSpeed's loggers at WARNING: its INFO lines repeat per rank and step."""
    quiet_third_party()
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
    except ImportError:  # pragma: no cover
        pass


@contextlib.contextmanager
def held_prints() -> Iterator[None]:
    """DeepSpeed prints its set-up (SEED_LAYERS=..., Using topology: ...) with print() on every
    rank, which no logger level silences: hold it back, unless MMPIPE_DEBUG=1, and show it only
    if the set-up fails."""
    if os.environ.get("MMPIPE_DEBUG") == "1":
        yield
        return
    import io

    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise
