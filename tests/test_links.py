"""Writing never follows a link (docs/design.md, "The trust boundary"), and new files' modes are safe.

A real trained run is copied, a symbolic link is planted at one path nanopt writes or deletes in it, pointing at a
"victim" outside the run, and the real command runs (`nanopt train`, `train --resume none`, `nanopt eval`). It must
refuse in one line naming the link, exit 2, without a traceback, leave the victim byte for byte as it was and
create nothing outside the run. Most are refused by the one check before the lock (nanopt.files.check_run_dir), so
they cost no training. Then nanopt.files itself: no-follow opens, exclusive temporaries, FIFOs, modes, deletion
confined to its root.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest
from clihelp import assert_user_error
from faulthelp import Launcher, tiny_run

from nanopt.rundir import RunDir

VICTIM_TEXT = "the user's own file, which no nanopt command may change\n"
CONTINUE = ("--set", "max_steps=6", "--allow-changed")  # the trained run goes on: it writes everything again


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, tiny_dataset: Path, launcher: Launcher) -> Path:
    """4 steps, a checkpoint and an evaluation every 2: step-000002/ and step-000004/, latest, best, metrics.jsonl,
    loss.png."""
    run = tiny_run(tmp_path_factory.mktemp("links"), tiny_dataset, "run", max_steps=4, checkpoint_interval=2,
                   eval_interval=2, keep_checkpoints=3)
    launcher.train(run)
    return run


def snapshot(root: Path, leave_out: str = "run") -> dict[str, str]:
    """Every entry under `root` but `leave_out`, links not followed: a file's sha256, "dir", or where a link
    points."""
    found = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder, name)
            rel = path.relative_to(root)
            if rel.parts[0] == leave_out:
                continue
            found[str(rel)] = ("-> " + os.readlink(path) if path.is_symlink() else "dir" if path.is_dir()
                               else hashlib.sha256(path.read_bytes()).hexdigest())
    return found


@pytest.fixture
def world(tmp_path: Path, trained: Path) -> tuple[Path, Path]:
    """A copy of the trained run, and beside it `outside/`: victim.txt, and dir/ as a user's (or another run's)
    directory: a note, a `.tmp-*` folder of theirs, and a checkpoint of another run."""
    run = Path(shutil.copytree(trained, tmp_path / "run", symlinks=True))
    outside = tmp_path / "outside"
    (outside / "dir" / ".tmp-mine").mkdir(parents=True)
    (outside / "victim.txt").write_text(VICTIM_TEXT)
    (outside / "dir" / "notes.txt").write_text(VICTIM_TEXT)
    (outside / "dir" / ".tmp-mine" / "keep.txt").write_text(VICTIM_TEXT)
    shutil.copytree(trained / "checkpoints" / "step-000002", outside / "dir" / "step-000002")
    return run, outside


def plant(run: Path, outside: Path, rel: str) -> Path:
    """Replace `rel` in the run (whatever is there) with a link to the victim file or directory."""
    link = run / rel
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    else:
        link.unlink(missing_ok=True)
    link.symlink_to(outside / ("dir" if rel in DIRECTORIES else "victim.txt"))
    return link


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


DIRECTORIES = {"checkpoints", "previous", "checkpoints/step-000002", "checkpoints/step-000004"}

# (what is planted, the command's arguments after the run directory). The temporaries are NAME.tmp beside the file
# (nanopt.rundir.temporary; test_the_planted_paths_are_the_ones_nanopt_writes keeps this list honest).
TRAIN_CASES = [
    (".lock", CONTINUE),
    ("checkpoints/latest.tmp", CONTINUE),
    ("checkpoints/best.tmp", CONTINUE),
    ("checkpoints/latest", CONTINUE),
    ("metrics.jsonl", CONTINUE),
    ("metrics.jsonl.tmp", CONTINUE),
    ("loss.png", CONTINUE),
    ("loss.png.tmp", CONTINUE),
    ("checkpoints", CONTINUE),  # checkpoints written elsewhere, the user's .tmp-* there deleted, retention there
    ("checkpoints/step-000002", CONTINUE),
    ("stalls", CONTINUE),  # the stall watch writes each rank's stacks there
    ("previous", ("--resume", "none")),
    ("metrics.jsonl", ("--resume", "none")),
]


@pytest.mark.parametrize(("rel", "args"), TRAIN_CASES, ids=[f"{rel} {' '.join(a[:2])}" for rel, a in TRAIN_CASES])
def test_train_refuses_a_link_where_it_writes_and_leaves_its_target_alone(world, launcher: Launcher, rel: str,
                                                                          args: tuple[str, ...]):
    run, outside = world
    link = plant(run, outside, rel)
    before = snapshot(run.parent)
    child = launcher.run("train", run, "--no-live", *args)
    assert_user_error(child, f"{link}: is a symbolic link", "Hint: remove the link")
    assert snapshot(run.parent) == before  # the victim as it was, nothing new outside the run
    assert link.is_symlink()


def test_a_link_at_the_hooks_log_is_refused_and_the_hook_writes_nothing_through_it(world, launcher: Launcher):
    """The on-exit hook still runs (a run's end always runs it), its output is not logged through the link."""
    run, outside = world
    link = plant(run, outside, "on_exit.log")
    before = snapshot(run.parent)
    child = launcher.run("train", run, "--no-live", *CONTINUE, "--on-exit", "echo the hook ran")
    assert child.status == 2 and "Traceback" not in child.stderr, child.stderr
    assert error_lines(child.stderr) == [f"error: {link}: is a symbolic link, and nanopt never writes or deletes "
                                         "through one. Hint: remove the link; to keep a run's files on another disk, "
                                         "move the whole run directory there"]
    assert "its output was not logged" in child.stderr
    assert snapshot(run.parent) == before


EVAL_CASES = ["eval.json", "eval.json.tmp", "checkpoints/step-000004/eval.json", "checkpoints/step-000004",
              "checkpoints"]


@pytest.mark.parametrize("rel", EVAL_CASES)
def test_eval_refuses_a_link_where_it_writes_and_leaves_its_target_alone(world, launcher: Launcher, rel: str):
    run, outside = world
    link = plant(run, outside, rel)
    before = snapshot(run.parent)
    child = launcher.run("eval", run, "--tokens", "256", "--no-samples")
    assert_user_error(child, f"{link}: is a symbolic link")
    assert snapshot(run.parent) == before


@pytest.mark.parametrize(("rel", "args"), [("checkpoints", ()), ("previous", ("--resume", "none"))])
def test_a_file_where_a_directory_belongs_is_refused_before_the_first_step(tmp_path: Path, tiny_dataset: Path,
                                                                           launcher: Launcher, rel: str, args):
    """A `checkpoints` file used to train until the first save, then fail with a disk-space hint that sent the
    user after the wrong problem. Now it is refused before anything is written (no lock, no metrics), with a hint
    that fits."""
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=4, checkpoint_interval=2)
    (run / "metrics.jsonl").write_text("")  # a run with something for --resume none to move aside
    (run / rel).write_text("a file of the user's\n")
    child = launcher.run("train", run, "--no-live", *args)
    assert_user_error(child, f"{run / rel}: is a file, where nanopt keeps a directory", f"its {rel}/ there")
    assert "disk space" not in child.stderr
    assert sorted(p.name for p in run.iterdir()) == sorted(["model.json", "train.json", "metrics.jsonl", rel])
    assert (run / "metrics.jsonl").read_text() == "" and (run / rel).read_text() == "a file of the user's\n"


def test_the_planted_paths_are_the_ones_nanopt_writes(tmp_path: Path):
    from nanopt.rundir import temporary

    paths = RunDir(tmp_path)
    written = {str(p.relative_to(tmp_path)) for p in paths.written_files() + paths.written_dirs()}
    planted = {rel for rel, _ in TRAIN_CASES} | set(EVAL_CASES) | {"on_exit.log"}
    assert {rel for rel in planted if "step-" not in rel} <= written
    assert str(temporary(paths.metrics).relative_to(tmp_path)) == "metrics.jsonl.tmp"


# ------------------------------------------------------------------------------------------- nanopt.files


@pytest.fixture
def umask_002():
    previous = os.umask(0o002)  # a group-sharing umask: group write would be kept by a plain open()
    yield
    os.umask(previous)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("mode", ["wb", "ab", "a+"])
def test_open_file_refuses_a_link_and_a_hard_link_before_it_truncates(tmp_path: Path, mode: str):
    from nanopt.errors import WritePathError
    from nanopt.files import open_file

    victim = tmp_path / "victim"
    victim.write_text(VICTIM_TEXT)
    (tmp_path / "soft").symlink_to(victim)
    os.link(victim, tmp_path / "hard")
    for name, why in (("soft", "is a symbolic link"), ("hard", r"has other names \(hard links\)")):
        with pytest.raises(WritePathError, match=why):
            open_file(tmp_path / name, mode)
    assert victim.read_text() == VICTIM_TEXT


@pytest.mark.parametrize("how", ["open_file", "replacing's temporary"])
def test_a_fifo_where_nanopt_writes_is_refused_without_blocking(tmp_path: Path, how: str):
    from nanopt.errors import WritePathError
    from nanopt.files import open_file, replace_file

    fifo = tmp_path / ("metrics.jsonl" if how == "open_file" else "eval.json.tmp")
    os.mkfifo(fifo)
    outcome: list[BaseException] = []

    def write() -> None:
        try:
            open_file(fifo, "a") if how == "open_file" else replace_file(tmp_path / "eval.json", "{}")
        except BaseException as exc:  # noqa: BLE001 - the outcome is asserted below
            outcome.append(exc)

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(timeout=10)
    if writer.is_alive():  # blocked in open(): a reader lets it go, so the test process can end
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        pytest.fail(f"writing {fifo.name} blocked on a FIFO")
    assert len(outcome) == 1 and isinstance(outcome[0], WritePathError), outcome
    assert "is a named pipe (FIFO), where nanopt writes a file" in outcome[0].message


def test_a_replaced_file_is_a_new_exclusive_file_with_a_safe_mode(tmp_path: Path, umask_002):
    """A leftover temporary (a killed writer's, world-writable) is removed, not reused: the new file is created
    exclusively, so it never inherits a mode, an owner or other names from whatever was at either path."""
    from nanopt.files import replacing

    path, tmp = tmp_path / "train.json", tmp_path / "train.json.tmp"
    path.write_text("{}")
    path.chmod(0o666)  # downloaded world-writable
    tmp.write_text("a leftover")
    tmp.chmod(0o666)
    with open(tmp, "rb") as held:  # held open, the leftover's inode stays its own
        with replacing(path) as f:
            st = os.fstat(f.fileno())
            assert st.st_ino != os.fstat(held.fileno()).st_ino and st.st_nlink == 1 and st.st_size == 0
            f.write(b'{"micro_batch_size": 8}\n')
        assert held.read() == b"a leftover"  # never opened for writing
    assert path.read_text() == '{"micro_batch_size": 8}\n' and not tmp.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644 & ~0o002


def test_a_failed_replacement_keeps_the_old_file_and_removes_its_temporary(tmp_path: Path):
    from nanopt.files import replacing

    path = tmp_path / "eval.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), replacing(path) as f:
        f.write(b"half")
        raise RuntimeError("the disk is full")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["eval.json"]


@pytest.mark.parametrize("at", ["destination", "temporary"])
def test_replacing_refuses_a_link_at_either_name(tmp_path: Path, at: str):
    from nanopt.errors import WritePathError
    from nanopt.files import replace_file

    victim = tmp_path / "victim"
    victim.write_text(VICTIM_TEXT)
    (tmp_path / ("eval.json" if at == "destination" else "eval.json.tmp")).symlink_to(victim)
    with pytest.raises(WritePathError, match="is a symbolic link"):
        replace_file(tmp_path / "eval.json", "{}")
    assert victim.read_text() == VICTIM_TEXT


def test_new_files_and_directories_get_no_group_or_world_write(tmp_path: Path, umask_002):
    from nanopt.files import give_file_mode, make_dir, open_file, write_file

    with open_file(tmp_path / "appended", "ab") as f:
        f.write(b"x")
    write_file(tmp_path / "written", "x")
    made = make_dir(tmp_path / "made")
    library = tmp_path / "model.safetensors"  # as safetensors leaves it: private
    library.write_text("x")
    library.chmod(0o600)
    give_file_mode(library)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "appended", tmp_path / "written", made,
                                                               library)}
    assert modes == {"appended": 0o644, "written": 0o644, "made": 0o755, "model.safetensors": 0o644}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # the mode probe is gone


def test_a_trained_and_evaluated_run_has_no_group_or_world_write_under_a_sharing_umask(tmp_path: Path,
                                                                                      tiny_dataset: Path,
                                                                                      cli_in_process, umask_002):
    """Checkpoints (safetensors writes 0600, rewritten here), pointers, metrics, the chart and eval.json: 0644 and
    0755 less the umask, never the 0664 / 0775 a plain open() / mkdir() would give under umask 002."""
    run = tiny_run(tmp_path, tiny_dataset, "run", max_steps=4, checkpoint_interval=2, eval_interval=2)
    for argv in (("train", run, "--no-live"), ("eval", run, "--tokens", "256", "--no-samples")):
        result = cli_in_process(*argv)
        assert result.returncode == 0, result.stderr
    written = [p for p in run.rglob("*") if p.name not in ("model.json", "train.json")]  # the test wrote those
    assert {"loss.png", "eval.json", "latest", "best", "model.safetensors"} <= {p.name for p in written}
    assert {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in written} == {
        str(p): oct(0o755 if p.is_dir() else 0o644) for p in written}


def test_make_dir_refuses_a_link_and_a_file(tmp_path: Path):
    from nanopt.errors import WritePathError
    from nanopt.files import make_dir

    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "linked").symlink_to(tmp_path / "elsewhere")
    (tmp_path / "file").write_text("")
    with pytest.raises(WritePathError, match="is a symbolic link"):
        make_dir(tmp_path / "linked")
    with pytest.raises(WritePathError, match="is a file, where nanopt keeps a directory"):
        make_dir(tmp_path / "file")
    assert make_dir(tmp_path / "elsewhere").is_dir()  # a real directory is fine


def test_remove_tree_deletes_only_a_real_directory_inside_its_root(tmp_path: Path):
    from nanopt.errors import WritePathError
    from nanopt.files import remove_tree

    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "sub" / "keep.txt").write_text(VICTIM_TEXT)
    root = tmp_path / "run" / "checkpoints"
    (root / ".tmp-step-000002").mkdir(parents=True)
    (root / ".tmp-step-000002" / "inner").symlink_to(outside / "sub")  # a link inside: removed as a link
    (root / ".tmp-link").symlink_to(outside / "sub")
    (tmp_path / "run" / "linked").symlink_to(outside)
    before = snapshot(outside, leave_out="")
    with pytest.raises(WritePathError, match="is a symbolic link"):
        remove_tree(root / ".tmp-link", inside=root)
    with pytest.raises(WritePathError, match="is outside"):
        remove_tree(outside / "sub", inside=root)
    with pytest.raises(WritePathError, match="is a symbolic link"):  # the root itself reached through a link
        remove_tree(tmp_path / "run" / "linked" / "sub", inside=tmp_path / "run" / "linked")
    remove_tree(root / ".tmp-link", inside=root, quiet=True)  # quiet: left alone, nothing raised
    remove_tree(root / ".tmp-step-000002", inside=root)
    assert sorted(p.name for p in root.iterdir()) == [".tmp-link"]
    assert snapshot(outside, leave_out="") == before


def test_retention_and_clean_up_never_delete_through_a_linked_checkpoints_directory(world):
    """Called as training calls them, past the run check: nothing in the linked directory is deleted."""
    from nanopt.errors import WritePathError
    from nanopt.train import checkpoint as ckpt

    run, outside = world
    shutil.copytree(run / "checkpoints" / "step-000004", outside / "dir" / "step-000004")  # retention would pick 2
    plant(run, outside, "checkpoints")
    before = snapshot(outside, leave_out="")
    ckpt.remove_stale_temporaries(run)  # a clean-up: leaves the linked directory alone, quietly
    with pytest.raises(WritePathError, match="checkpoints: is a symbolic link"):
        ckpt.apply_retention(run, keep=1)
    assert snapshot(outside, leave_out="") == before


@pytest.mark.parametrize("force", [False, True])
def test_tokenize_never_writes_or_replaces_through_a_link(tmp_path: Path, tiny_dataset: Path, force: bool):
    """A link as the output is refused (with --force too: it used to be renamed aside and the new dataset put in its
    place), and so is one at the staging directory's name, which used to be deleted as a leftover."""
    from nanopt.data.corpus.sources import TextListSource
    from nanopt.data.tokenize.pipeline import build_dataset
    from nanopt.errors import WritePathError

    target = Path(shutil.copytree(tiny_dataset, tmp_path / "theirs"))
    (tmp_path / "ds").symlink_to(target)
    (tmp_path / f".fresh.partial-{os.getpid()}").symlink_to(target)  # the name this process would stage in
    before = snapshot(tmp_path, leave_out="")
    for out, why in (("ds", "ds: is a symbolic link"), ("fresh", "fresh.partial-.*: is a symbolic link")):
        with pytest.raises(WritePathError, match=why):
            build_dataset(tmp_path / out, TextListSource(["one document"]), vocab_size=300, force=force)
    assert snapshot(tmp_path, leave_out="") == before


@pytest.mark.parametrize("rel", sorted({str(p.relative_to("R")) for p in RunDir(Path("R")).written_files()
                                        + RunDir(Path("R")).written_dirs()} | {"checkpoints/.tmp-step-000002"}))
def test_check_run_dir_refuses_a_link_at_every_path_nanopt_writes(tmp_path: Path, rel: str):
    from nanopt.errors import WritePathError
    from nanopt.files import check_run_dir

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "notes").symlink_to(tmp_path)  # not a name nanopt writes: allowed
    check_run_dir(run)
    if rel == "checkpoints":
        shutil.rmtree(run / rel)
    (run / rel).symlink_to(tmp_path)
    with pytest.raises(WritePathError) as refused:
        check_run_dir(run)
    assert refused.value.one_line().startswith(f"{run / rel}: is a symbolic link")
