"""A crash planted in one torchrun rank, for tests only: a directory on PYTHONPATH whose sitecustomize (imported by
every Python process at start) makes rank $PLANTED_CRASH_RANK raise a RuntimeError in its $PLANTED_CRASH_STEP-th
training step, as a bug in nanopt or a library would. Nothing here is part of the package; a process without
PLANTED_CRASH_RANK in its environment, or another rank, is untouched."""

import importlib.abc
import importlib.util
import os
import sys

_RANK = os.environ.get("PLANTED_CRASH_RANK")
_AT = int(os.environ.get("PLANTED_CRASH_STEP", "3"))


class _WrapStep(importlib.abc.MetaPathFinder):
    """Once nanopt.train.step is imported, its `step` raises on the chosen call (nanopt.train.loop imports the
    function from the module after the module has run, so it gets the wrapped one)."""

    def find_spec(self, name, path, target=None):
        if name != "nanopt.train.step":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            real, calls = module.step, [0]

            def step(*args, **kwargs):
                calls[0] += 1
                if calls[0] == _AT:
                    raise RuntimeError(f"planted crash in rank {_RANK}")
                return real(*args, **kwargs)

            module.step = step

        spec.loader.exec_module = exec_module
        return spec


if _RANK is not None and os.environ.get("RANK") == _RANK:
    sys.meta_path.insert(0, _WrapStep())
