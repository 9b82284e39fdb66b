"""Data: tokenizers, corpus sources, the tokenize pipeline, the shard format, datasets and the resumable
distributed loader (where token ids are checked against the model's vocabulary).

Imports only the contracts (nanopt.config, nanopt.errors); import from the submodules, this package imports
nothing heavy by itself.
"""
