"""Errors every stage's commands share, at the bottom of the package so that any module may import them.

Nothing here imports from tokenmill: cli.py and the stages' command modules import downward to this file,
never the other way round.
"""

from __future__ import annotations


class UsageError(Exception):
    """A problem with what the user asked for: printed as one line, exit status 2, no traceback."""


class FormatError(ValueError):
    """A file that does not follow docs/formats.md; the message names the file and the field.

    `tokenmill.formats` raises it when it reads (or is asked to write) a stats.json, counts.json, manifest,
    plan, run config, metrics line or model card that breaks the format. A stage that has more to say
    wraps it in its own error (a `ShardError`, a `MixtureError`), keeping it as the cause.
    """

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}")
