"""The former home of Qwen2.5-Omni's code, kept as an import path: the family is
families/qwen2_5_omni.py, a run's note on a full folder is outer.py's."""

from mmpipe.model.hf.outer import source_note

__all__ = ["source_note"]
