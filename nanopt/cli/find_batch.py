"""`nanopt find-batch`."""

from nanopt.cli.app import app, not_built


@app.command("find-batch", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def find_batch_command() -> None:
    """Not built yet in this version."""
    not_built("find-batch")
