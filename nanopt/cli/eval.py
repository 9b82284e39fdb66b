"""`nanopt eval`."""

from nanopt.cli.app import app, not_built


@app.command("eval", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def eval_command() -> None:
    """Not built yet in this version."""
    not_built("eval")
