"""`nanopt train`."""

from nanopt.cli.app import app, not_built


@app.command("train", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def train_command() -> None:
    """Not built yet in this version."""
    not_built("train")
