"""Registers each command module on the app, in the order of the pretraining lifecycle (the order of --help)."""

import importlib

LIFECYCLE = ("plan", "estimate", "tokenize", "find_batch", "profile", "preflight", "train", "slurm", "health", "eval",
             "export", "importer")

for _module in LIFECYCLE:
    importlib.import_module(f"nanopt.cli.commands.{_module}")
