"""Every random stream a training step can touch, as JSON: saved into checkpoints, checked and restored on resume.

The state is a dict of the Python, numpy, torch CPU and CUDA generators' states (no pickle in checkpoints). A
checkpoint may come from someone else, so a state read from one is checked before it is restored: each generator
library validates only part of its state (numpy reads its key array at any position it is given, Python keeps any
object as its cached Gaussian), and a state that one of them refuses would otherwise fail as a traceback in the
middle of a resume. `rng_state_problem` applies the state to private generators, which leaves the process's own
streams untouched.
"""

from __future__ import annotations

import base64
import binascii
import math
import random
from typing import TYPE_CHECKING, Any

from nanopt.errors import CheckpointError

if TYPE_CHECKING:
    import torch

PYTHON_STATE_WORDS = 625  # random.getstate()'s internal state: 624 words of MT19937 and the position
NUMPY_KEY_WORDS = 624  # numpy's MT19937 key
MAX_CUDA_STATE_BYTES = 64  # torch's Philox state is 16 bytes (seed and offset); its exact size is checked on restore


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(text, validate=True)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """Every RNG a training step can touch, JSON-serializable (no pickle in checkpoints)."""
    import numpy as np
    import torch

    np_state = np.random.get_state()
    state = {"python": [list(s) if isinstance(s, tuple) else s for s in random.getstate()],
             "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
             "torch": _b64(torch.get_rng_state()), "cuda": None}
    if torch.cuda.is_available():
        state["cuda"] = _b64(torch.cuda.get_rng_state())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore a state `rng_state` made (and `rng_state_problem` passed). CheckpointError when the CUDA state is not
    this torch's size: it is the one part that can only be checked once CUDA is in use."""
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_unb64(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        cuda = _unb64(state["cuda"])
        if cuda.numel() != torch.cuda.get_rng_state().numel():
            raise CheckpointError(f"the checkpoint's CUDA random state is {cuda.numel()} bytes, this torch's "
                                  f"{torch.cuda.get_rng_state().numel()}", "resume from another checkpoint")
        torch.cuda.set_rng_state(cuda)


def rng_state_problem(state: Any) -> str | None:
    """What is wrong with an RNG state read from a file, or None when `set_rng_state` can restore it."""
    if not isinstance(state, dict):
        return f"is a JSON {type(state).__name__}, not an object"
    for part, check in (("python", _python_problem), ("numpy", _numpy_problem), ("torch", _torch_problem),
                        ("cuda", _cuda_problem)):
        if part not in state and part != "cuda":  # `cuda` is null on a machine without a GPU
            return f"has no '{part}' state"
        problem = check(state.get(part))
        if problem:
            return f"'{part}' {problem}"
    return None


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _python_problem(value: Any) -> str | None:
    if not (isinstance(value, list) and len(value) == 3 and isinstance(value[1], list)
            and len(value[1]) == PYTHON_STATE_WORDS):
        return f"is not [version, {PYTHON_STATE_WORDS} integers, gauss]"
    version, internal, gauss = value
    if not all(_is_int(word, 0, 2**32 - 1) for word in internal):
        return "holds a word that is not a 32-bit unsigned integer"
    if gauss is not None and not (isinstance(gauss, float) and math.isfinite(gauss)):
        return "holds a cached Gaussian that is not a finite number"
    try:
        random.Random().setstate((version, tuple(internal), gauss))
    except (TypeError, ValueError, OverflowError) as exc:
        return f"is refused by Python ({exc})"
    return None


def _numpy_problem(value: Any) -> str | None:
    if not (isinstance(value, list) and len(value) == 5 and value[0] == "MT19937" and isinstance(value[1], list)
            and len(value[1]) == NUMPY_KEY_WORDS):
        return f"is not [\"MT19937\", {NUMPY_KEY_WORDS} integers, position, has_gauss, gauss]"
    _, keys, pos, has_gauss, cached = value
    if not all(_is_int(word, 0, 2**32 - 1) for word in keys):
        return "holds a key that is not a 32-bit unsigned integer"
    # numpy reads key[pos] unchecked: a position outside the key would read outside it.
    if not (_is_int(pos, 0, NUMPY_KEY_WORDS) and _is_int(has_gauss, 0, 1)):
        return f"has a position outside 0..{NUMPY_KEY_WORDS} or a has_gauss flag other than 0 or 1"
    if not (isinstance(cached, (int, float)) and not isinstance(cached, bool) and math.isfinite(cached)):
        return "holds a cached Gaussian that is not a finite number"
    return None


def _torch_problem(value: Any) -> str | None:
    import torch

    tensor = _decoded(value)
    if tensor is None:
        return "is not base64 text"
    try:
        torch.Generator().set_state(tensor)
    except RuntimeError as exc:
        return f"is refused by torch ({str(exc).splitlines()[0][:80]})"
    return None


def _cuda_problem(value: Any) -> str | None:
    if value is None:
        return None
    tensor = _decoded(value)
    if tensor is None or not 0 < tensor.numel() <= MAX_CUDA_STATE_BYTES:
        return f"is not null or the base64 text of at most {MAX_CUDA_STATE_BYTES} bytes"
    return None


def _decoded(value: Any) -> torch.Tensor | None:
    if not isinstance(value, str):
        return None
    try:
        return _unb64(value)
    except (binascii.Error, ValueError):
        return None
