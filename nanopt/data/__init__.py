"""Datasets: corpus sources, the tokenize pipeline, the shard format and the resumable distributed loader.

Import from the submodules (nanopt.data.dataset, nanopt.data.loader, nanopt.data.pipeline); this package imports
nothing heavy by itself.
"""
