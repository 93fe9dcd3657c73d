"""The model families mmpipe trains, one file each (family.py says what a file declares).

`FAMILIES` is the one list: its order is the order errors and `mmpipe demo-checkpoints` list them
in. A new family that needs no new capability is a new file here building a `Family` named
`FAMILY`, and one entry below.
"""

from mmpipe.model.hf.families import (
    gemma3,
    internvl,
    llava,
    llava_next,
    llava_onevision,
    qwen2_5_omni,
    qwen2_5_vl,
    qwen2_audio,
    qwen2_vl,
    qwen3_vl,
)
from mmpipe.model.hf.family import Family, register

FAMILIES: tuple[Family, ...] = tuple(register(module.FAMILY) for module in (
    llava, qwen2_vl, qwen2_audio, llava_next, llava_onevision, qwen3_vl, qwen2_5_vl, qwen2_5_omni,
    internvl, gemma3))
"""Every family, registered (family.REGISTRY) in this order."""
