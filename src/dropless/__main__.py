"""``python -m dropless ...``: the command-line entry point."""

from dropless.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
