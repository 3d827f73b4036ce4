"""Errors shared by every command (kept apart from cli.py so `python -m pdpool.cli` and
`import pdpool.cli` see the same classes)."""


class CliError(Exception):
    """A user error: printed as one line, exit status 2, no traceback."""
