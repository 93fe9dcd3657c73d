"""The data layer: synthetic shards, tokenizer, chat template, media decoding and the shard reader.

Import the submodules directly (`mmpipe.data.reader`, `mmpipe.data.tokenizer`, ...); see
docs/data.md.
"""
