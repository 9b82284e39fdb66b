"""lm-evaluation-harness made unimportable, for tests only: a directory on PYTHONPATH whose sitecustomize (imported
by every Python process at start) makes `import lm_eval` fail as it does where the `harness` extra is not
installed. Nothing here is part of the package."""

import importlib.abc
import sys


class _NoHarness(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "lm_eval" or name.startswith("lm_eval."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


sys.meta_path.insert(0, _NoHarness())
