"""Evaluation sets as people have them: JSON Lines, JSON arrays and Parquet, in the common benchmark layouts.

A set is named (a benchmark: `mmlu`, `gsm8k`) and holds one or more files. Each record becomes one text to
match: the fields of its *layout* joined in order, or fields the user lists. Layouts and the fields each
role is looked for under, when the set gives no mapping:

* `question-choices-answer` (MMLU, ARC, HellaSwag, GSM8K, TriviaQA): `question` (or `query`, `ctx`,
  `problem`, `input`), `choices` (or `options`, `endings`: a list, a dict of label -> text, or ARC's
  `{"text": [...], "label": [...]}`), `answer` (or `answerKey`, `label`, `answers`, `target`, `solution`).
  An answer that points into the choices (an index, a letter, a label, or the text of a choice) adds no
  text: the choices already hold it.
* `prompt-completion` (HumanEval, instruction sets): `prompt`, then `completion` (or `canonical_solution`,
  `response`, `output`, `target`).
* `passage-question` (SQuAD, BoolQ, RACE, DROP): `passage` (or `context`, `article`, `story`), `question`,
  `answer` (or `answers`; a span already in the passage adds no text).

`auto` (the default) picks the layout from the first record's fields. A mapping (`question=ctx,
choices=endings,answer=label`) names a set's own fields; a list of dotted paths (`problem,solution.final`,
`?` marking optional ones) bypasses layouts. Bad input fails before any index is written, with a
`DecontamError` naming the file and the line (JSON Lines) or row (Parquet, JSON arrays) and the field.

Memory: one set's normalized texts at a time, plus one Parquet row group or one JSON Lines file.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from tokenmill import storage
from tokenmill.filters.decontam.hashing import normalize_for_matching
from tokenmill.validation import validation_problems

JSON_SUFFIXES = (".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
EVAL_SUFFIXES = JSON_SUFFIXES + PARQUET_SUFFIXES
AUTO = "auto"


class DecontamError(ValueError):
    """An evaluation file or index that cannot be used; the message names the file (and line or row)."""


@dataclass(frozen=True)
class Role:
    """One part of a layout: its name, the fields it is looked for under, and whether a record needs it."""

    name: str
    aliases: tuple[str, ...]
    required: bool


#: The layouts, each a list of roles in the order their texts are joined.
LAYOUTS: dict[str, tuple[Role, ...]] = {
    "question-choices-answer": (
        Role("question", ("question", "query", "ctx", "problem", "input"), True),
        Role("choices", ("choices", "options", "endings"), False),
        Role("answer", ("answer", "answerKey", "label", "answers", "target", "solution"), False),
    ),
    "prompt-completion": (
        Role("prompt", ("prompt",), True),
        Role("completion", ("completion", "canonical_solution", "response", "output", "target"), False),
    ),
    "passage-question": (
        Role("passage", ("passage", "context", "article", "story"), True),
        Role("question", ("question", "query"), True),
        Role("answer", ("answer", "answers"), False),
    ),
}
# `auto` tries the layouts in this order: a passage with a question is reading comprehension even though
# it also has a question field.
_AUTO_ORDER = ("passage-question", "prompt-completion", "question-choices-answer")


@dataclass(frozen=True)
class FieldSpec:
    """How a record becomes text: a layout (`auto`: chosen per set from its first record) with roles
    optionally mapped to the set's own fields, or, when `paths` is set, those dotted paths joined in order
    (a trailing `?` marks a path optional)."""

    layout: str = AUTO
    mapping: tuple[tuple[str, str], ...] = ()
    paths: tuple[str, ...] = ()

    @classmethod
    def parse(cls, value: str) -> FieldSpec:
        """`auto`, a layout name, `LAYOUT:role=field,...`, `role=field,...` (a layout is inferred from the
        roles), or `path,path?,...`."""
        value = value.strip()
        if not value:
            raise DecontamError("no fields given; name a layout (auto, " + ", ".join(LAYOUTS) + ") or fields")
        layout, _, rest = value.partition(":") if ":" in value else ("", "", value)
        if layout and layout not in LAYOUTS:
            raise DecontamError(f"unknown layout {layout!r} in {value!r} (layouts: {', '.join(LAYOUTS)})")
        if not layout and (rest == AUTO or rest in LAYOUTS):
            return cls(layout=rest)
        parts = [part.strip() for part in rest.split(",") if part.strip()]
        if any("=" in part for part in parts):
            mapping = []
            for part in parts:
                role, sep, path = (piece.strip() for piece in part.partition("="))
                if not sep or not role or not path:
                    raise DecontamError(f"{value!r}: expected role=field pairs, got {part!r}")
                mapping.append((role, path))
            return cls.mapped(layout or None, dict(mapping))
        if layout:
            raise DecontamError(f"{value!r}: after {layout}: give role=field pairs")
        return cls(layout="", paths=tuple(parts))

    @classmethod
    def mapped(cls, layout: str | None, mapping: dict[str, str]) -> FieldSpec:
        """A layout with some roles mapped; with no layout named, the one whose roles cover the mapping."""
        roles = set(mapping)
        if layout is None:
            # The first layout that has every role named: question and answer alone are a Q&A set.
            preference = ("question-choices-answer", "prompt-completion", "passage-question")
            layout = next((name for name in preference if roles <= {r.name for r in LAYOUTS[name]}), None)
            if layout is None:
                raise DecontamError(f"no layout has the roles {', '.join(sorted(roles))}")
        unknown = roles - {role.name for role in LAYOUTS[layout]}
        if unknown:
            known = ", ".join(role.name for role in LAYOUTS[layout])
            raise DecontamError(f"layout {layout} has no role {', '.join(sorted(unknown))} (roles: {known})")
        return cls(layout=layout, mapping=tuple(sorted(mapping.items())))


@dataclass
class EvalFile:
    """One file of a set, as read: its path, the SHA-256 of its bytes and its number of lines or rows."""

    path: str
    sha256: str
    rows: int


@dataclass
class EvalSet:
    """One evaluation set, read: its records' normalized texts and where each came from."""

    name: str
    fields: FieldSpec
    layout: str = ""  # the layout used (auto resolved), or "" for explicit paths
    resolved: list[str] = field(default_factory=list)  # role=field pairs or paths actually read
    files: list[EvalFile] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # normalized record texts, in file order
    file_numbers: list[int] = field(default_factory=list)  # index into files, per text
    line_numbers: list[int] = field(default_factory=list)  # 1-based line (JSON Lines) or row, per text
    empty: int = 0


@dataclass(frozen=True)
class EvalSetSource:
    """What to read for one set: its name, its files and how its records become text."""

    name: str
    files: tuple[str, ...]
    fields: FieldSpec = FieldSpec()


def eval_set_name(path: str) -> str:
    """A file's set name when none is given: the file name without its extensions."""
    base = os.path.basename(path)
    for suffix in EVAL_SUFFIXES:
        if base.endswith(suffix):
            return base[: -len(suffix)]
    return base.rsplit(".", 1)[0] if "." in base else base


# ----------------------------------------------------------------------------------------- sources


def _split_named(value: str) -> tuple[str | None, str]:
    """`NAME=PATH` -> (NAME, PATH); a path with `=` in it (hive partitions) keeps it when the part before
    the `=` is not a bare name."""
    name, sep, rest = value.partition("=")
    if sep and name and not any(c in name for c in "/:*?[") and rest:
        return name.strip(), rest.strip()
    return None, value


def expand_eval_paths(patterns: Iterable[str]) -> list[str]:
    """Every file the patterns name, sorted and without repeats; a pattern matching nothing is an error."""
    files: list[str] = []
    for pattern in patterns:
        matches = storage.expand_glob(pattern)
        if not matches:
            raise DecontamError(f"--evals {pattern!r} matches no file")
        files.extend(matches)
    return sorted(dict.fromkeys(files))


def eval_set_sources(
    evals: Iterable[str],
    default_fields: FieldSpec | None = None,
    set_fields: dict[str, FieldSpec] | None = None,
) -> list[EvalSetSource]:
    """Sets from `--evals [NAME=]PATH_OR_GLOB` values: a named value is one set of every file it matches,
    an unnamed one a set per file named after the file. Two sets of one name are an error."""
    default_fields = default_fields or FieldSpec()
    set_fields = dict(set_fields or {})
    files_by_name: dict[str, list[str]] = {}
    origin: dict[str, str] = {}
    for value in evals:
        name, pattern = _split_named(value)
        paths = expand_eval_paths([pattern])
        if name is not None:
            if name in files_by_name:
                raise DecontamError(f"evaluation set {name!r} is named twice ({origin[name]!r}, {value!r})")
            files_by_name[name], origin[name] = paths, value
            continue
        for path in paths:
            own = eval_set_name(path)
            if own in files_by_name:
                raise DecontamError(
                    f"{path} and {origin[own]} are both evaluation set {own!r}; rename one or name "
                    f"the set: --evals NAME={pattern}"
                )
            files_by_name[own], origin[own] = [path], path
    unknown = sorted(set(set_fields) - set(files_by_name))
    if unknown:
        raise DecontamError(
            f"--set-fields names no evaluation set: {', '.join(unknown)} "
            f"(sets: {', '.join(sorted(files_by_name))})"
        )
    return [
        EvalSetSource(name, tuple(paths), set_fields.get(name, default_fields))
        for name, paths in sorted(files_by_name.items())
    ]


class _SetEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    files: list[str]
    layout: str = AUTO
    fields: list[str] | dict[str, str] | None = None

    @field_validator("files", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("layout")
    @classmethod
    def _known_layout(cls, value: str) -> str:
        if value != AUTO and value not in LAYOUTS:
            raise ValueError(f"unknown layout {value!r} (layouts: {AUTO}, {', '.join(LAYOUTS)})")
        return value


class _SetsFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    sets: list[_SetEntry]


def load_sets_file(path: str) -> list[EvalSetSource]:
    """The sets a YAML file lists (docs/decontam.md), each with its files (paths or globs, relative to the
    file's folder when local), layout and field mapping."""
    if not storage.exists(path):
        raise DecontamError(f"{path}: no such evaluation sets file")
    with storage.open_file(path, "rb") as handle:
        try:
            raw = yaml.safe_load(handle.read())
        except yaml.YAMLError as error:
            raise DecontamError(f"{path}: not valid YAML ({error})") from None
    try:
        parsed = _SetsFile.model_validate(raw)
    except ValidationError as error:
        raise DecontamError(f"{path}: {validation_problems(error, 'sets')}") from None
    folder = os.path.dirname(storage.local_path(path)) if storage.is_local(path) else ""
    sources, seen = [], set()
    for position, entry in enumerate(parsed.sets):
        where = f"{path}: sets[{position}] ({entry.name})"
        if entry.name in seen:
            raise DecontamError(f"{where}: evaluation set {entry.name!r} is listed twice")
        seen.add(entry.name)
        patterns = [
            pattern
            if not folder or "://" in pattern or os.path.isabs(pattern)
            else os.path.join(folder, pattern)
            for pattern in entry.files
        ]
        try:
            files = expand_eval_paths(patterns)
            if isinstance(entry.fields, list):
                if entry.layout != AUTO:
                    raise DecontamError("give a layout with a role mapping, or a list of fields, not both")
                fields = FieldSpec(layout="", paths=tuple(entry.fields))
            elif isinstance(entry.fields, dict):
                fields = FieldSpec.mapped(None if entry.layout == AUTO else entry.layout, entry.fields)
            else:
                fields = FieldSpec(layout=entry.layout)
        except DecontamError as error:
            raise DecontamError(f"{where}: {error}") from None
        sources.append(EvalSetSource(entry.name, tuple(files), fields))
    return sources


# ----------------------------------------------------------------------------------------- reading


def _open_bytes(path: str) -> bytes:
    with storage.open_file(path, "rb") as handle:
        data = handle.read()
    if path.endswith(".gz"):
        return gzip.decompress(data)
    if path.endswith(".zst"):
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()
    return data


def _json_records(path: str, data: bytes) -> Iterator[tuple[str, int, Any]]:
    """(where, number, record) for each record of a JSON Lines file, or of a JSON array (`.json` files
    that start with `[`: numbered by position, 1-based)."""
    if data.lstrip()[:1] == b"[" and ".json" in os.path.basename(path) and ".jsonl" not in path:
        try:
            records = json.loads(data)
        except UnicodeDecodeError:
            raise DecontamError(f"{path}: not valid UTF-8") from None
        except json.JSONDecodeError as error:
            raise DecontamError(
                f"{path}: not valid JSON ({error.msg} at line {error.lineno} column {error.colno})"
            ) from None
        for number, record in enumerate(records, start=1):
            yield f"{path}: record {number}", number, record
        return
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            record = json.loads(raw)
        except UnicodeDecodeError:
            raise DecontamError(f"{where}: not valid UTF-8") from None
        except json.JSONDecodeError as error:
            raise DecontamError(f"{where}: not valid JSON ({error.msg} at column {error.colno})") from None
        yield where, number, record


def _parquet_records(path: str, data: bytes) -> Iterator[tuple[str, int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(pa.BufferReader(data))
        row = 0
        for batch in parquet.iter_batches(batch_size=4096):
            for record in batch.to_pylist():
                row += 1
                yield f"{path}: row {row}", row, record
    except (pa.ArrowInvalid, OSError) as error:
        raise DecontamError(f"{path}: not a readable Parquet file ({error})") from None


def _records(path: str) -> tuple[str, Iterator[tuple[str, int, Any]]]:
    """The SHA-256 of the file's bytes and its records."""
    data = _open_bytes(path)
    digest = hashlib.sha256(data).hexdigest()
    if path.endswith(PARQUET_SUFFIXES):
        return digest, _parquet_records(path, data)
    if path.endswith(JSON_SUFFIXES):
        return digest, _json_records(path, data)
    raise DecontamError(f"{path}: not an evaluation file (expected {', '.join(EVAL_SUFFIXES)})")


def _field_value(record: dict, dotted: str) -> Any:
    """The value at a dotted path (a number steps into a list); None when absent."""
    value: Any = record
    for key in dotted.split("."):
        if isinstance(value, dict):
            value = value.get(key)
        elif isinstance(value, list) and key.isdigit() and int(key) < len(value):
            value = value[int(key)]
        else:
            return None
        if value is None:
            return None
    return value


def _as_text(value: Any) -> str:
    """A field's text: a string, number or bool, a list of them (joined), or a dict's `text`."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str | int | float):
        return str(value)
    if isinstance(value, list):
        return " ".join(_as_text(item) for item in value if item is not None)
    if isinstance(value, dict) and ("text" in value or "value" in value):
        return _as_text(value["text"] if "text" in value else value["value"])  # SQuAD's, TriviaQA's answers
    raise TypeError(type(value).__name__)


def _choice_texts(value: Any) -> tuple[list[str], list[str]]:
    """(texts, labels) of a choices field: a list, ARC's {"text": [...], "label": [...]}, or label -> text."""
    if isinstance(value, dict) and "text" in value:
        texts = [_as_text(text) for text in value["text"] or []]
        return texts, [str(label) for label in value.get("label") or []]
    if isinstance(value, dict):
        return [_as_text(text) for text in value.values()], [str(label) for label in value]
    if isinstance(value, list):
        return [_as_text(item) for item in value], []
    return [_as_text(value)], []


def _answer_in_choices(answer: Any, texts: list[str], labels: list[str]) -> bool:
    """Whether an answer only points at a choice: an index, a letter, a label, or a choice's own text."""
    if not texts:
        return False
    if isinstance(answer, int) and not isinstance(answer, bool):
        return 0 <= answer < len(texts)
    if isinstance(answer, str):
        stripped = answer.strip()
        if stripped in labels or (stripped.isdigit() and int(stripped) < len(texts)):
            return True
        if len(stripped) == 1 and stripped.isalpha() and ord(stripped.upper()) - ord("A") < len(texts):
            return True
        return normalize_for_matching(stripped) in {normalize_for_matching(text) for text in texts}
    return False


class _Reader:
    """Turns the records of one set into texts, resolving its layout from the first record."""

    def __init__(self, source: EvalSetSource):
        self.source = source
        self.fields = source.fields
        self.layout = source.fields.layout if not source.fields.paths else ""
        self.roles: list[tuple[Role, str]] = []  # (role, field path) once resolved

    def resolve(self, record: dict, where: str) -> None:
        mapping = dict(self.fields.mapping)
        layouts = _AUTO_ORDER if self.layout == AUTO else (self.layout,)
        for layout in layouts:
            roles = []
            for role in LAYOUTS[layout]:
                path = mapping.get(role.name) or next(
                    (alias for alias in role.aliases if _field_value(record, alias) is not None), None
                )
                if path is None and role.required:
                    break
                if path is not None:
                    roles.append((role, path))
            else:
                self.layout, self.roles = layout, roles
                return
        keys = ", ".join(sorted(record)[:20])
        wanted = "any layout (" + ", ".join(_AUTO_ORDER) + ")" if self.layout == AUTO else self.layout
        raise DecontamError(
            f"{where}: the record's fields ({keys}) fit no role of {wanted}; map them with "
            f"--set-fields {self.source.name}=question=FIELD,... or list them: "
            f"--set-fields {self.source.name}=FIELD,FIELD"
        )

    def describe(self) -> list[str]:
        if self.fields.paths:
            return list(self.fields.paths)
        return [f"{role.name}={path}" for role, path in self.roles]

    def text(self, record: Any, where: str) -> str:
        if not isinstance(record, dict):
            raise DecontamError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if self.fields.paths:
            return self._paths_text(record, where)
        if not self.roles:
            self.resolve(record, where)
        values: dict[str, Any] = {}
        for role, path in self.roles:
            value = _field_value(record, path)
            if value is None and role.required:
                raise DecontamError(
                    f"{where}: missing field {path!r} (the {role.name} of layout {self.layout}; "
                    f"map another with --set-fields {self.source.name}={role.name}=FIELD)"
                )
            if value is not None:
                values[role.name] = value
        paths = {role.name: path for role, path in self.roles}

        def text_of(name: str, convert: Any = _as_text) -> Any:
            try:
                return convert(values[name])
            except TypeError as error:
                raise DecontamError(f"{where}: field {paths[name]!r} is a {error}, not text") from None

        texts, labels = text_of("choices", _choice_texts) if "choices" in values else ([], [])
        parts: list[str] = []
        for role, _ in self.roles:
            if role.name not in values:
                continue
            if role.name == "choices":
                parts.extend(texts)
            elif role.name != "answer":
                parts.append(text_of(role.name))
            elif _answer_in_choices(values["answer"], texts, labels):
                continue  # an index, letter or label: the choices already hold the answer's text
            elif "passage" in values:
                # A span of the passage (SQuAD) adds nothing; a yes/no or free answer does.
                answer = text_of("answer")
                if (
                    f" {normalize_for_matching(answer)} "
                    not in f" {normalize_for_matching(text_of('passage'))} "
                ):
                    parts.append(answer)
            else:
                parts.append(text_of("answer"))
        return normalize_for_matching(" ".join(parts))

    def _paths_text(self, record: dict, where: str) -> str:
        parts = []
        for spec in self.fields.paths:
            optional, dotted = spec.endswith("?"), spec.rstrip("?")
            value = _field_value(record, dotted)
            if value is None:
                if optional:
                    continue
                raise DecontamError(
                    f"{where}: missing field {dotted!r} (this set's fields: {', '.join(self.fields.paths)}; "
                    f"choose others with --fields or --set-fields {self.source.name}=FIELD,FIELD; "
                    "a trailing ? makes a field optional)"
                )
            try:
                parts.append(_as_text(value))
            except TypeError as error:
                raise DecontamError(f"{where}: field {dotted!r} is a {error}, not text") from None
        return normalize_for_matching(" ".join(parts))


def read_eval_set(source: EvalSetSource) -> EvalSet:
    """Read and check every file of a set; any bad record is a DecontamError naming file and line/row."""
    reader = _Reader(source)
    eval_set = EvalSet(name=source.name, fields=source.fields)
    for file_number, path in enumerate(source.files):
        digest, records = _records(path)
        rows = 0
        for where, number, record in records:
            rows = number
            text = reader.text(record, where)
            if not text:
                eval_set.empty += 1
                continue
            eval_set.texts.append(text)
            eval_set.file_numbers.append(file_number)
            eval_set.line_numbers.append(number)
        eval_set.files.append(EvalFile(path, digest, rows))
    eval_set.layout = reader.layout
    eval_set.resolved = reader.describe()
    return eval_set


def read_eval_sets(sources: list[EvalSetSource]) -> list[EvalSet]:
    """Read every set; fails on the first bad record."""
    return [read_eval_set(source) for source in sources]
