"""Importing a Hugging Face transformers checkpoint into a run directory (`nanopt import`).

`source` finds the files (a local directory, or the hub through huggingface_hub, config, tokenizer and safetensors
only), `config` maps config.json to model.json (refusing what nanopt cannot represent exactly), `weights` streams
the safetensors tensors into the checkpoint's model.safetensors one tensor at a time, and `run` assembles the run
directory beside its final name and renames it into place.

Sits beside nanopt.export (the other direction; the tensor names are nanopt.model.hf_names') and imports nanopt.train
(the checkpoint format), nanopt.data (tokenizers), nanopt.model and the contracts.
"""
