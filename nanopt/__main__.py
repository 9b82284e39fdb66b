"""`python -m nanopt`: the command line, or one line saying how to install it when this Python lacks what it needs."""

import sys


def _run() -> None:
    try:
        from nanopt.cli import main
    except ModuleNotFoundError as exc:
        if not exc.name or exc.name.split(".")[0] == "nanopt":
            raise  # a bug in nanopt itself: keep the traceback
        sys.stderr.write(f"error: {sys.executable} does not have nanopt's dependency '{exc.name}'. Hint: run "
                         "`make install` and use .venv/bin/nanopt (or .venv/bin/python -m nanopt), or "
                         "`pip install -e .` into this Python\n")
        sys.exit(2)
    main()


if __name__ == "__main__":
    _run()
