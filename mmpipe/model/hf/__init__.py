"""Models built from Hugging Face transformers classes and checkpoints (see docs/hf.md)."""
