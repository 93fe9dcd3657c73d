"""The values of train.attention, in a module without torch: the config validates them on
every command (`mmpipe plan`, `--help`, `--cfg`), which should not pay for importing torch.
What each kernel does and when it can run: `mmpipe/model/kernels.py`."""

KERNELS = ("auto", "flash", "flex", "sdpa", "eager")
"""Values of train.attention."""
