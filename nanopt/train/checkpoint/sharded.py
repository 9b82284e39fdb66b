"""Model and optimizer state as torch.distributed.checkpoint (DCP) shards: what a checkpoint of a run on several
ranks holds instead of two safetensors files.

Every rank writes the part of the state it owns (FSDP2: its shards; DDP: an even share of the replicated tensors,
DCP's deduplication), so no rank ever holds the whole model, and the checkpoint reads back on any number of ranks:
DCP reshards what each rank loads to its own layout. One process (eval, export) reads it without a process group,
straight into the model's own tensors, so memory stays at one copy of the weights.

Only tensors go into the shards: the optimizer's parameter groups (and everything else that is not a tensor) are in
meta.json. DCP's own `.metadata` index is a pickle: nanopt.train.checkpoint.shard_index reads it against stand-ins and
builds the index itself from checked fields, so a crafted checkpoint can neither run code nor change a real object.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from nanopt.errors import CheckpointError
from nanopt.files import link_refused
from nanopt.train.checkpoint.shard_index import METADATA_FILE, SHARD_FILE, read_index

# torch.distributed.checkpoint is imported inside the functions that use it: it costs a process over a second to
# import, and eval or export of a one-process checkpoint never needs it.

def is_shard_file(name: str) -> bool:
    return name == METADATA_FILE or SHARD_FILE.fullmatch(name) is not None


def tensors_only(state: dict[str, Any]) -> dict[str, Any]:
    """{"model": {fqn: tensor}, "optimizer": {"state": {fqn: {name: tensor}}}}: the optimizer's param_groups (plain
    numbers and names) travel in meta.json instead, and a plain number in the state becomes a tensor."""
    optimizer = {fqn: {name: value if torch.is_tensor(value) else torch.tensor(value) for name, value in entry.items()}
                 for fqn, entry in state["optimizer"]["state"].items()}
    return {"model": state["model"], "optimizer": {"state": optimizer}}


def save_async(state: dict[str, Any], directory: Path, group: Any, stager: Any = None) -> Future:
    """Start writing `state` (see tensors_only) into `directory` on every rank; returns once DCP has copied the
    state to host memory (the training step may change the weights from then on), with `stager` (new_stager)
    when one is given. The future completes on every rank once all ranks' shards and the index are written and
    synced."""
    import torch.distributed.checkpoint as dcp

    _refuse_link(directory)
    staging = {"async_stager": stager} if stager is not None else {}
    return dcp.async_save(state, checkpoint_id=str(directory), process_group=group, **staging)


def save_failure(exc: BaseException) -> str | None:
    """Why a save failed, in a few words, for an exception its future raised; None for one that is no failure of the
    save (KeyboardInterrupt, SystemExit). DCP reports a rank's failed write as a CheckpointException, a
    BaseException whose text is every rank's traceback: its first OSError says why (a full disk: "File too large",
    "No space left on device"), else its first failure's own line."""
    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
        return None
    causes = [pair[0] for pair in getattr(exc, "failures", {}).values() if isinstance(pair, tuple) and pair]
    chosen = next((c for c in causes if isinstance(c, OSError)), causes[0] if causes else exc)
    if isinstance(chosen, OSError) and chosen.strerror:
        return chosen.strerror
    text = str(chosen).strip().splitlines()
    return f"{type(chosen).__name__}: {text[0][:200]}" if text else type(chosen).__name__


def new_stager(device: torch.device) -> Any:
    """A stager that keeps the host copy of the state between saves, so that each save after the first copies into
    memory it already has (pinned on CUDA) instead of allocating and faulting in a copy of the whole state: that
    allocation was most of the time a save blocked the step. None on a torch without DCP's stagers (before 2.9),
    or whose stagers cannot be reused (2.11): every save then allocates its own copy."""
    import inspect

    import torch.distributed.checkpoint as dcp

    try:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    except ImportError:
        return None
    if "async_stager" not in inspect.signature(dcp.async_save).parameters or not _stagers_survive_reuse():
        return None
    cuda = device.type == "cuda"
    return DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=False,
                                        use_non_blocking_copy=cuda))


def _stagers_survive_reuse() -> bool:
    """Whether this torch's DefaultStager can stage a second time. torch 2.11 closes it at the end of every stage
    (pytorch/pytorch#183413): the second save then fails with `KeyError: <class 'type'>`, which on the first H100
    run ended every GPU training run at its second checkpoint. Asked of a throwaway stager on a one-element tensor
    (no pinned memory, microseconds), not of the version, so a torch that fixes or reintroduces it is handled."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    probe = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False, use_async_staging=False,
                                         use_non_blocking_copy=False))
    try:
        for _ in range(2):
            probe.stage({"probe": torch.zeros(1)})
    except Exception:  # noqa: BLE001 - any failure to stage twice means: one stager per save
        return False
    finally:
        probe.close()
    return True


def save(state: dict[str, Any], directory: Path, group: Any) -> None:
    """The same, waiting for the write (nanopt's benchmarks compare the two)."""
    import torch.distributed.checkpoint as dcp

    _refuse_link(directory)
    dcp.save(state, checkpoint_id=str(directory), process_group=group)


def _refuse_link(directory: Path) -> None:
    """The `.tmp-step-N/` checkpoint.begin made on rank 0 is never a link: DCP writes wherever it is told. (A
    directory another node does not see yet is DCP's to report.)"""
    if Path(directory).is_symlink():
        raise link_refused(Path(directory))


def load(state: dict[str, Any], directory: Path, group: Any = None) -> None:
    """Fill `state`'s tensors in place from the checkpoint in `directory`, whatever world size wrote it. `group`
    None: this process alone reads it (no process group needed)."""
    import torch.distributed.checkpoint as dcp

    index = read_index(directory)  # read once: the same index is checked and then given to DCP
    _check_all_tensors(state, index, directory)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(single process|torch.distributed is disabled).*")
        try:
            dcp.load(state, storage_reader=_index_checking_reader(directory, index), process_group=group,
                     no_dist=group is None)
        except dcp.CheckpointException as exc:  # a shard unreadable on some rank: every rank raises it
            raise CheckpointError(f"{directory}: cannot read the shards ({str(exc).splitlines()[0][:160]})",
                                  "use another checkpoint") from None


def load_model_weights(model: torch.nn.Module, directory: Path, aliases: dict[str, str]) -> None:
    """Read the model part of a sharded checkpoint into `model`'s own parameters and buffers, tensor by tensor
    (memory: the model once, plus DCP's read buffers). `aliases` are tied names that are stored once. Names and
    shapes were compared with the model's when the checkpoint was verified (nanopt.train.checkpoint.contents)."""
    target = {key: value for key, value in model.state_dict().items() if key not in aliases}
    with torch.no_grad():
        load({"model": target}, directory)


def check_complete(directory: Path, files: list[str]) -> None:
    """CheckpointError unless DCP's index reads and every shard file it points to is among `files`: a shard written
    by a node whose disk the others cannot see would otherwise be missing only when someone resumes."""
    index = read_index(directory)
    needed = {info.relative_path for info in (index.storage_data or {}).values()}
    absent = sorted(needed - set(files))
    if absent:
        raise CheckpointError(f"{directory}: the shard index names {absent[:3]}, which the checkpoint does not hold "
                              "(multi-node runs need the run directory on a filesystem every node sees)",
                              "use another checkpoint")


def stored_specs(directory: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, dtype name)} of every entry in the index, read without loading a shard; an entry stored as an
    object, not a tensor, has the dtype "object"."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {key: (tuple(meta.size), str(meta.properties.dtype).removeprefix("torch."))
            if isinstance(meta, TensorStorageMetadata) else ((), "object")
            for key, meta in read_index(directory).state_dict_metadata.items()}


def _model_entries(directory: Path) -> dict[str, Any]:
    """{weight name: its TensorStorageMetadata (size and dtype)} from the index, for the model part."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = "model."
    return {key[len(prefix):]: meta for key, meta in read_index(directory).state_dict_metadata.items()
            if key.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}


def _index_checking_reader(directory: Path, index: Any) -> Any:
    """DCP's file reader, answering with `index` (read_index's, built from checked fields) instead of unpickling
    the file again without restriction."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import metadata as dcp_metadata

    class IndexCheckingReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if hasattr(dcp_metadata, "StorageMeta") and getattr(index, "storage_meta", None) is None:
                index.storage_meta = dcp_metadata.StorageMeta()
            if getattr(index, "storage_meta", None) is not None and hasattr(self, "load_id"):
                index.storage_meta.load_id = self.load_id
            return index

    return IndexCheckingReader(str(directory))


def _check_all_tensors(state: dict[str, Any], index: Any, directory: Path) -> None:
    """Every key asked for is stored as a tensor: DCP unpickles a non-tensor entry without restriction (no
    weights_only), which would run whatever code a crafted checkpoint holds."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    stored = index.state_dict_metadata
    for key in _flat_keys(state):
        if key in stored and not isinstance(stored[key], TensorStorageMetadata):
            raise CheckpointError(f"{directory}: '{key}' is stored as an object, not a tensor (not written by nanopt)",
                                  "use another checkpoint")


def _flat_keys(state: dict[str, Any], prefix: str = "") -> list[str]:
    keys = []
    for key, value in state.items():
        if isinstance(value, dict):
            keys += _flat_keys(value, f"{prefix}{key}.")
        else:
            keys.append(f"{prefix}{key}")
    return keys


def read_model_state(directory: Path) -> dict[str, torch.Tensor]:
    """The model part of a sharded checkpoint as whole tensors on the CPU (one process, no process group), each
    allocated once from the index and filled in place: one copy of the weights."""
    state = {key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
             for key, meta in _model_entries(directory).items()}
    load({"model": state}, directory)
    return state
