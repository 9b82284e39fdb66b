"""The commands, one module each; importing this package registers each on the app, in the order of the pretraining
lifecycle (the order of --help). Each parses its options, calls one library function and renders the result through
nanopt.cli.display."""

import importlib

LIFECYCLE = ("plan", "estimate", "tokenize", "find_batch", "profile", "preflight", "train", "slurm", "health", "eval",
             "export", "importer")

for _module in LIFECYCLE:
    importlib.import_module(f"nanopt.cli.commands.{_module}")
