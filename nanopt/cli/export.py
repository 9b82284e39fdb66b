"""`nanopt export`."""

from nanopt.cli.app import app, not_built


@app.command("export", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def export_command() -> None:
    """Not built yet in this version."""
    not_built("export")
