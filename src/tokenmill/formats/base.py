"""What every format module shares: the model base, JSON in and out through tokenmill.storage, and errors
that name the file and the field.

A format's model validates on read (`parse`), so that a consumer gets typed fields or a `FormatError`
such as `tokens/counts.json: cells.domain=web/quality=1.tokens: expected a whole number >= 0, got -1`,
never a KeyError deep inside a stage. Writers go through `storage.write_json` (sorted keys, indent 2,
atomic), so a file's bytes depend only on its content.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError

from tokenmill import storage
from tokenmill.errors import FormatError

#: Problems listed in one error; a file with hundreds of bad entries needs the first few to start.
MAX_PROBLEMS = 5


class FormatModel(BaseModel):
    """A record of one of the files in docs/formats.md.

    Strict: a count is an int, not "12" or 12.0 or true, so a hand-edited file fails on read rather than
    later. Keys the model does not name are ignored; `to_json` writes what the model holds.
    """

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    def to_json(self) -> dict[str, Any]:
        """The record as the JSON object the format fixes.

        Fields never set are left out: a file read and written back keeps exactly its keys (a plan saved
        before a field was added stays without it), so a writer gives every field it means to write.
        """
        return self.model_dump(mode="python", exclude_unset=True)


Model = TypeVar("Model", bound=BaseModel)


def _whole_number(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"expected a whole number >= 0, got {value!r}")
    return value


#: Documents, tokens, steps: an int >= 0 (a bool is refused, though Python counts it as an int).
Count = Annotated[int, BeforeValidator(_whole_number)]


def _location(parts: tuple[int | str, ...]) -> str:
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _problem(error: Mapping[str, Any]) -> str:
    location = tuple(error["loc"])
    if not location and error["type"] in ("model_type", "dict_type"):
        return "not a JSON object"
    message = str(error["msg"]).removeprefix("Value error, ")
    if error["type"] != "value_error" and not isinstance(error.get("input"), dict | list):
        message += f", got {error.get('input')!r}"
    where = _location(location)
    return f"{where}: {message}" if where else message


def describe(error: ValidationError) -> str:
    """Every problem of a validation error as `field.path: what`, joined by "; " (the first MAX_PROBLEMS).

    Missing fields of one object make one problem: `phases[0] has no 'tokens', 'steps'`.
    """
    problems: list[str | list[str]] = []  # a list: the names missing from one object, said together
    missing: dict[str, list[str]] = {}
    for item in error.errors():
        location = tuple(item["loc"])
        if item["type"] != "missing":
            problems.append(_problem(item))
            continue
        parent = _location(location[:-1])
        if parent not in missing:
            missing[parent] = []
            problems.append([parent])
        missing[parent].append(f"'{location[-1]}'")
    lines = [
        problem
        if isinstance(problem, str)
        else (f"{problem[0]} has no " if problem[0] else "no ") + ", ".join(missing[problem[0]])
        for problem in problems
    ]
    shown = lines[:MAX_PROBLEMS]
    if len(lines) > MAX_PROBLEMS:
        more = len(lines) - MAX_PROBLEMS
        shown.append(f"and {more} more problem{'s' if more > 1 else ''}")
    return "; ".join(shown)


def parse(model: type[Model], value: Any, path: str) -> Model:
    """`value` (parsed JSON) as a `model`; FormatError naming `path` and each bad field."""
    try:
        return model.model_validate(value)
    except ValidationError as error:
        raise FormatError(path, describe(error)) from None


def load_json(path: str | os.PathLike[str]) -> Any:
    """A JSON file's value; FormatError if it is not UTF-8 JSON. FileNotFoundError if there is no file."""
    path = os.fspath(path)
    try:
        return storage.read_json(path)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise FormatError(path, f"not valid JSON ({error})") from None


def read_model(model: type[Model], path: str | os.PathLike[str]) -> Model:
    """A JSON file read and validated as `model`."""
    return parse(model, load_json(path), os.fspath(path))


def write_model(path: str, record: FormatModel) -> None:
    """`record` as JSON at `path`, atomically (sorted keys, indent 2, trailing newline)."""
    storage.write_json(path, record.to_json())
