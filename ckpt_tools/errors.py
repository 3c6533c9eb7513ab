"""Errors the toolkit raises on purpose. Only `cli.py` turns them into exit codes.

Every message is one line: what (file / tensor / rank), expected vs found, and the fix.
"""


class CkptError(Exception):
    """Base class: a problem with the user's input, config or environment (exit code 1)."""


class ConfigError(CkptError, ValueError):
    """A model or parallel configuration that cannot work (e.g. TP not dividing heads)."""


class LayoutError(CkptError):
    """A tensor that does not match the layout table: unknown key, wrong shape, bad split."""


class FormatError(CkptError):
    """A checkpoint directory or file that is missing, incomplete or not what it claims to be."""


def collect(problems: list[str], error: type[CkptError] = CkptError) -> None:
    """Raise once for all problems found, so the user fixes them in one pass."""
    if len(problems) == 1:
        raise error(problems[0])
    if problems:
        raise error(f"{len(problems)} problems: " + "; ".join(problems))
