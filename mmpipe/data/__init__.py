"""The data layer: shards, tokenizer, chat template, media decoding, the reader and converters.

Import the submodules directly: `reader` (SampleStream, iter_samples, iter_meta, loader),
`records` (Record, Sample, decode_record), `mixture`, `convert`, `commands`, `tario` (tar and
pipe: reading), `synth`, `tokenizer`, `template` (the Templater interface, the tiny template),
`chat` (a checkpoint's chat template), `media`, `skips`; see docs/data.md.
"""
