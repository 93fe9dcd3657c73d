"""The reader's option choices and their one check, shared by `DataConfig` and the readers.

`mmpipe.config.DataConfig` calls `check_options` when the config is read (before anything is
launched); `SampleStream` and `Mixture` call it again because Python callers build them
without a config. Messages name the key as the user types it (`data.on_error=...`).
"""

from __future__ import annotations

from mmpipe.data.tokenizer import AUDIO, IMAGE

ON_ERROR = ("skip", "raise")
"""data.on_error: skip (count the bad sample and go on) or raise."""
TOO_LONG_MODES = ("drop", "truncate")
"""data.too_long: drop a sample over model.llm.max_seq_len, or truncate its answer tail."""
CAPTION_PROMPT = f"{IMAGE}\nDescribe the image briefly."
"""data.caption_prompt: the human turn of an image-caption sample (img2dataset shards)."""


def check_options(*, on_error: str = "skip", too_long: str = "drop", shuffle_buffer: int = 0,
                  epochs: int | None = None, num_workers: int = 1, caption_prompt: str = CAPTION_PROMPT,
                  decode_workers: int | str = "auto") -> None:
    """Raise ValueError naming the first bad data option, its value and the fix."""
    if on_error not in ON_ERROR:
        raise ValueError(f"data.on_error={on_error!r} is unknown; use skip or raise")
    if too_long not in TOO_LONG_MODES:
        raise ValueError(f"data.too_long={too_long!r} is unknown; use drop or truncate")
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"data.num_workers={num_workers!r} must be a positive integer")
    if decode_workers != "auto" and (not isinstance(decode_workers, int) or isinstance(decode_workers, bool)
                                     or decode_workers < 0):
        raise ValueError(f"data.decode_workers={decode_workers!r} must be auto or a whole number >= 0 (0: decode "
                         f"in the feeder thread; N: N worker processes per data-reading rank)")
    if shuffle_buffer < 0:
        raise ValueError(f"data.shuffle_buffer={shuffle_buffer} must be >= 0 (0: stream order)")
    if epochs is not None and epochs < 1:
        raise ValueError(f"data.epochs={epochs} must be >= 1, or null to repeat the data forever")
    if not isinstance(caption_prompt, str) or caption_prompt.count(IMAGE) != 1 or AUDIO in caption_prompt:
        raise ValueError(f"data.caption_prompt={caption_prompt!r} must hold exactly one {IMAGE} placeholder and "
                         f"no {AUDIO}, e.g. {CAPTION_PROMPT!r}")
