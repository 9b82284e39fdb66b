"""Data: tokenizers, corpus sources, the tokenize pipeline, the shard format, datasets and the resumable
distributed loader (where token ids are checked against the model's vocabulary).

Here, the dataset directory itself: the shard format (shards), its meta.json (meta), opening and checking one
against a model (dataset), writing one safely (output), and token counts as people write them (budget). Below:
`corpus` (sources), `tokenizers`, `tokenize` (the pipeline from a corpus to a dataset), `loaders` and `mixtures`.

Imports only the contracts (nanopt.config, nanopt.errors); import from the submodules, this package imports
nothing heavy by itself.
"""
