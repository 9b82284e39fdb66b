"""Exporting a checkpoint to other tools: `hf`, a Hugging Face transformers directory.

Imports nanopt.model (the state-dict layout) and the contracts.
"""
