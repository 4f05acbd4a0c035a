"""Errors in mixture specs, each pointing at a YAML path and line.

A spec is edited by hand, so every complaint names where to look: `phases[1].weights.code-q4: unknown
source (line 42)`. Several problems found in one pass are reported together, on one line, so that a user
fixes them in one go rather than one per run.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

PathPart = str | int
# One line stays readable with a few problems; a spec with fifty wrong weights needs the first few to start.
MAX_SHOWN = 5
Path = tuple[PathPart, ...]


def format_path(path: Path) -> str:
    """('phases', 1, 'weights', 'code') -> 'phases[1].weights.code'."""
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else str(part)
    return text


@dataclass(frozen=True)
class Issue:
    """One problem: where (YAML path, line, file) and what."""

    path: str
    message: str
    line: int | None = None
    file: str | None = None

    def __str__(self) -> str:
        text = f"{self.path}: {self.message}" if self.path else self.message
        return f"{text} (line {self.line})" if self.line else text


class MixtureError(ValueError):
    """A mixture spec (or the counts it is planned against) is wrong; str() is one line per the docs.

    `issues` holds each problem; `file` is the file the first one is in (a slice's parent, for
    problems inherited from it), so that a command line can prefix it.
    """

    def __init__(self, issues: Iterable[Issue] | str, file: str | None = None) -> None:
        if isinstance(issues, str):
            issues = [Issue("", issues, None, file)]
        self.issues = list(issues)
        self.file = file or next((issue.file for issue in self.issues if issue.file), None)
        shown = [str(issue) for issue in self.issues[:MAX_SHOWN]]
        if len(self.issues) > MAX_SHOWN:
            more = len(self.issues) - MAX_SHOWN
            shown.append(f"and {more} more problem{'s' if more > 1 else ''}")
        super().__init__("; ".join(shown))


class NeedsCounts(MixtureError):
    """Planning needs tokens/counts.json: some weighted source has cells but no declared count."""


class Lines:
    """Line numbers (1-based) of the values and keys of a composed YAML document, by path."""

    def __init__(self, file: str | None = None) -> None:
        self.file = file
        self.values: dict[Path, int] = {}
        self.keys: dict[Path, int] = {}

    def line(self, path: Path) -> int | None:
        """The line of the key at path (where the path ends in a key), else of its value; for a path
        that was never written (a missing field), the line of the nearest enclosing one.

        The key's line is the better pointer: for `weights:` followed by an indented block, the value
        starts a line later than the name a user looks for.
        """
        while True:
            if path in self.keys:
                return self.keys[path]
            if path in self.values:
                return self.values[path]
            if not path:
                return None
            path = path[:-1]

    def issue(self, path: Path, message: str) -> Issue:
        return Issue(format_path(path), message, self.line(path), self.file)
