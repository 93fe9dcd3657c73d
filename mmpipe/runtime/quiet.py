"""Library chatter during a rank's set-up, held back unless the user asks for it
(`MMPIPE_DEBUG=1`, which `launcher.verbose=true` sets): DeepSpeed's loggers and the lines it
prints with print()."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator


def quiet_deepspeed() -> None:
    """DeepSpeed's loggers at WARNING: its INFO lines repeat per rank and step."""
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
