"""`nanopt profile`."""

from nanopt.cli.app import app, not_built


@app.command("profile", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def profile_command() -> None:
    """Not built yet in this version."""
    not_built("profile")
