"""The data layer: shards, tokenizer, chat template, media decoding, the readers and converters.

Import the submodules directly: `shards` (shard URLs: resolving, splitting by replica and
worker, `check_shards`, opening), `tario` (strict tar parsing), `reader` (SampleStream,
iter_samples, iter_meta), `loader` (the torch DataLoader bridge), `mixture`, `captions`
(img2dataset shards as caption conversations), `options` (the data option choices and their
check), `records` (Record, Sample, decode_record), `convert`, `commands`, `synth`, `tokenizer`,
`template` (the Templater interface, the tiny template), `chat` (a checkpoint's chat template),
`media`, `skips`; see docs/data.md.
"""
