"""The mixture spec: its schema (pydantic), its rules, and `load_mixture`.

A spec file (mixtures/*.yaml) is validated in two passes. The pydantic models below check each field's
type and range and give the JSON Schema that editors use (`tokenmill mixture schema`); the resolver then
checks what involves several fields (unknown sources, weight sums, phase budgets, slices) and turns the
spec into a `Mixture`: explicit sources plus the implicit ones that patterns in phase weights create,
phase budgets in tokens, weights normalized. Every problem is reported with its YAML path and line.
docs/mixtures.md is the user-facing description of the rules enforced here.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
)

from tokenmill.mixtures.errors import Issue, Lines, MixtureError, Path, format_path
from tokenmill.mixtures.selectors import Selector, looks_like_selector, parse_selector
from tokenmill.mixtures.yamlnodes import load_yaml
from tokenmill.units import format_count, parse_count

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$"
_NAME = re.compile(NAME_PATTERN)
COUNT_PATTERN = r"^\s*[0-9][0-9_]*(\.[0-9_]+)?([eE][+-]?[0-9]+)?\s*[KMBGTPkmbgtp]?\s*$"
# Weights are written as decimals; float sums such as 0.1 + 0.2 miss 0.3 by ~1e-16, so allow that much.
WEIGHT_SUM_TOLERANCE = 1e-6
SHARE_SUM_TOLERANCE = 1e-9
DEFAULT_MAX_EPOCHS = 1.0


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ValueError(f"not a count: {value!r} (expected a number such as 18.75T, 926B, 48e9)")
    return parse_count(value)


def _share(value: Any) -> Any:
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            return float(Fraction(value.strip()[:-1].strip()) / 100)
        except ValueError:
            raise ValueError(f"not a share: {value!r} (expected a fraction such as 0.8 or 80%)") from None
    return value


def _one_or_many(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


Count = Annotated[
    int,
    BeforeValidator(_count),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "integer", "minimum": 0},
                {"type": "number", "minimum": 0},
                {"type": "string", "pattern": COUNT_PATTERN},
            ],
            "description": "a token count: 18.75T, 926B, 48e9, 1_000_000 (K, M, B/G, T, P suffixes)",
            "examples": ["18.75T", "926B", "48e9"],
        }
    ),
]
Positive = Annotated[int, Field(gt=0, strict=True)]
Name = Annotated[str, Field(pattern=NAME_PATTERN)]
Epochs = Annotated[float, Field(gt=0, allow_inf_nan=False)]
Weight = Annotated[float, Field(strict=True, allow_inf_nan=False, json_schema_extra={"minimum": 0})]
Share = Annotated[
    float,
    Field(gt=0, le=1, allow_inf_nan=False),
    BeforeValidator(_share),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                {"type": "string", "pattern": r"^\s*[0-9.]+\s*%\s*$"},
            ],
            "examples": [0.8, "80%"],
        }
    ),
]


class SourceSpec(BaseModel):
    """A named source: cells (a cell name, a token-shard path or a pattern; one or a list), a declared
    token count, or both. Shorthand: `name: domain=web/quality=4` or `name: [cell, cell]`."""

    model_config = ConfigDict(extra="forbid")

    cells: Annotated[list[str], BeforeValidator(_one_or_many)] = Field(
        default_factory=list,
        description="cells, token-shard paths or patterns (domain=code/*, quality>=3): one or a list",
    )
    tokens: Count | None = Field(
        None, description="declared token count, used when planning without tokens/counts.json"
    )
    max_epochs: Epochs | None = Field(None, description="most times the whole run may repeat this source")
    description: str | None = None


class PhaseSpec(BaseModel):
    """One phase of training: its share of the budget (or absolute tokens) and its weights."""

    model_config = ConfigDict(extra="forbid")

    name: Name = Field(description="phase name, e.g. pretraining")
    description: str | None = None
    share: Share | None = Field(None, description="fraction of total_tokens (0.8 or '80%'); or give tokens")
    tokens: Count | None = Field(None, description="absolute token budget of this phase; or give share")
    normalize: bool = Field(
        False, description="rescale weights to sum to 1; by default they must already sum to 1"
    )
    weights: dict[str, Weight] = Field(
        min_length=1,
        description="weight per source name or cell pattern (domain=code/*, quality>=3); >= 0, sum 1",
    )


class EvaluationSpec(BaseModel):
    """What the run evaluates on, with zero training weight: held-out slices of cells (chosen by the same
    selectors as sources) and external sets made by `tokenmill tokenize-eval`."""

    model_config = ConfigDict(extra="forbid")

    heldout: Annotated[list[str], BeforeValidator(_one_or_many)] = Field(
        default_factory=list,
        description="cells whose held-out slices are evaluated: cells or patterns (domain=*/* is every cell)",
    )
    group_by: Literal["domain", "source", "cell", "all"] = Field(
        "domain",
        description="one evaluation set per domain of the matched cells (default), per training source that "
        "draws them, per cell, or one in all",
    )
    sets: Annotated[list[Name], BeforeValidator(_one_or_many)] = Field(
        default_factory=list, description="external evaluation sets by name (tokens/eval/<name>/)"
    )


class ProvenanceSpec(BaseModel):
    """Where a mixture comes from when it reproduces a published one: repository, path and commit."""

    model_config = ConfigDict(extra="forbid")

    repository: str = Field(description="e.g. marin-community/marin")
    path: str = Field(description="the file in the repository")
    commit: str = Field(description="the commit read", pattern=r"^[0-9a-f]{7,40}$")
    url: str | None = None
    note: str | None = None


class SearchSpec(BaseModel):
    """Where a proposed mixture's weights come from: the mixture search that chose them (docs/search.md)."""

    model_config = ConfigDict(extra="forbid")

    swarm: str = Field(description="the swarm's folder (its swarm.json holds every proxy's weights)")
    swarm_sha256: str = Field(description="sha256 of the swarm.json the fit read")
    fit: str = Field(description="the fit's record (fit.json)")
    proposal: str = Field(description="the proposal's record: predicted metrics with their spread")
    phase: str = Field(description="the phase whose weights were searched; the others are the base's")
    base: str = Field(description="the base mixture")
    objective: dict[str, float] = Field(description="metric -> weight, minimised")
    kl_weight: float = Field(0.0, description="the pull toward the token-proportional prior")
    evidence_reused: list[str] = Field(
        default_factory=list,
        description="sources whose content changed since the swarm ran, whose evidence was reused as asked",
    )


class MixtureSpec(BaseModel):
    """A training data mixture (mixtures/*.yaml). See docs/mixtures.md."""

    model_config = ConfigDict(extra="forbid", title="tokenmill mixture")

    name: Name = Field(description="mixture name")
    description: str | None = None
    illustrative: bool | None = Field(
        None, description="declared counts are illustrative, not measured; plans and reports say so"
    )
    slice_of: str | None = Field(
        None,
        description="plan as a slice of this mixture (path relative to this file): same sources, phases and "
        "weights, each source repeated as often as in the full run (simulated epoching)",
    )
    tokenizer: str | None = Field(None, description="tokenizer name; must match tokens/counts.json")
    total_tokens: Count | None = Field(
        None,
        description="token budget of the whole run: what phase shares, epochs and slices refer to (default: "
        "total_steps x batch_size x sequence_length)",
    )
    total_steps: Positive | None = Field(
        None,
        description="the run's length in steps, when it is not total_tokens / tokens per step (a run trained "
        "for a given number of steps of a mixture made for another budget): phases keep their shares of the "
        "budget in steps, each boundary rounded down to a whole mixture block, and the last phase ends at "
        "this step, which may fall inside a block",
    )
    provenance: ProvenanceSpec | None = Field(None, description="where the mixture comes from")
    search: SearchSpec | None = Field(
        None, description="the mixture search that proposed these weights (tokenmill mixture propose)"
    )
    sequence_length: Positive | None = Field(None, description="tokens per sequence")
    batch_size: Positive | None = Field(None, description="sequences per step")
    block_size: Positive | None = Field(
        None,
        description="sequences per mixture block (default: batch_size); phase boundaries are whole blocks",
    )
    max_epochs: Epochs | None = Field(
        None, description=f"default max_epochs of every source ({DEFAULT_MAX_EPOCHS})"
    )
    shortfall: Literal["error", "redistribute"] | None = Field(
        None,
        description="when a source cannot give its share within max_epochs: error (default), or redistribute "
        "the rest over the phase's other sources by weight",
    )
    counts: str | None = Field(
        None, description="default tokens/counts.json to plan against (relative to this file)"
    )
    sources: dict[str, SourceSpec] | None = Field(None, description="named sources")
    phases: list[PhaseSpec] | None = Field(None, min_length=1, description="ordered phases")
    evaluation: EvaluationSpec | None = Field(
        None, description="evaluation sets (zero training weight): held-out slices and external sets"
    )

    @field_validator("sources", mode="before")
    @classmethod
    def _shorthand_sources(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: {"cells": v} if isinstance(v, str | list) else v for k, v in value.items()}
        return value


# Fields a slice takes from its parent; giving them in the slice would make it no longer a slice.
SLICE_INHERITED = ("tokenizer", "sources", "phases", "max_epochs", "shortfall")
FULL_REQUIRED = ("tokenizer", "sequence_length", "batch_size", "phases")
RUN_LENGTH = ("total_tokens", "total_steps")  # one of them, in a full mixture and in a slice


def mixture_json_schema() -> dict[str, Any]:
    """JSON Schema of mixtures/*.yaml, for editors (yaml-language-server) and `tokenmill mixture schema`."""
    schema = MixtureSpec.model_json_schema()
    properties = schema["properties"]
    source_ref = properties["sources"]["anyOf"][0]["additionalProperties"]
    # The shorthand forms are accepted by the validator before the model sees them.
    properties["sources"]["anyOf"][0]["additionalProperties"] = {
        "anyOf": [source_ref, {"type": "string"}, {"type": "array", "items": {"type": "string"}}]
    }
    properties["sources"]["anyOf"][0]["propertyNames"] = {"pattern": NAME_PATTERN}
    schema["anyOf"] = [{"required": ["slice_of"]}, {"required": list(FULL_REQUIRED)}]
    schema["allOf"] = [{"anyOf": [{"required": [name]} for name in RUN_LENGTH]}]
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


# ---------------------------------------------------------------------------------------------------------
# The resolved mixture


@dataclass(frozen=True)
class Where:
    """Where something was written: file, YAML path, line."""

    file: str | None
    path: Path
    line: int | None

    def issue(self, message: str) -> Issue:
        return Issue(format_path(self.path), message, self.line, self.file)


@dataclass
class Source:
    """A source after resolution. Implicit sources are the patterns used directly as weight keys."""

    name: str
    selectors: tuple[Selector, ...]
    declared_tokens: int | None
    max_epochs: float
    implicit: bool
    where: Where


@dataclass
class MixturePhase:
    """A phase as the spec asks for it: a token budget and source weights (the plan rounds it to steps)."""

    name: str
    budget: Fraction  # tokens asked for, before rounding to whole blocks
    weights: dict[str, Fraction]  # source name -> weight, normalized to sum 1, spec order, zeros kept
    where: Where
    weight_where: dict[str, Where] = field(default_factory=dict)


@dataclass
class SliceInfo:
    of: str  # the full run's mixture name
    path: str  # its file
    fraction: Fraction  # this run's tokens / the full run's tokens
    of_total_tokens: int


@dataclass
class Evaluation:
    """The spec's evaluation sets: held-out slices of the cells `heldout` selects, grouped `group_by`, and
    external sets by name."""

    heldout: tuple[Selector, ...]
    group_by: str
    sets: tuple[str, ...]
    where: Where


@dataclass
class Mixture:
    """A validated mixture, ready to plan (`plan_mixture`)."""

    name: str
    description: str | None
    file: str | None
    tokenizer: str
    total_tokens: int  # the budget
    sequence_length: int
    batch_size: int
    block_size: int
    max_epochs: float
    shortfall: str
    sources: dict[str, Source]
    phases: list[MixturePhase]
    illustrative: bool = False
    slice: SliceInfo | None = None
    counts_path: str | None = None
    block_size_explicit: bool = False
    spec: MixtureSpec | None = None
    total_steps: int | None = None  # the run's length when given in steps (the budget is total_tokens)
    provenance: dict[str, str] | None = None
    evaluation: Evaluation | None = None


# ---------------------------------------------------------------------------------------------------------
# Loading

_FIELDS = {
    "top": set(MixtureSpec.model_fields),
    "sources": set(SourceSpec.model_fields),
    "phases": set(PhaseSpec.model_fields),
    "evaluation": set(EvaluationSpec.model_fields),
}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _pydantic_message(error: dict[str, Any]) -> str:
    kind, value, loc = error["type"], error.get("input"), error["loc"]
    if kind == "missing":
        return "required field missing"
    if kind == "extra_forbidden":
        group = "top" if len(loc) == 1 else str(loc[0])
        close = difflib.get_close_matches(str(loc[-1]), sorted(_FIELDS.get(group, ())), n=1)
        return "unknown field" + (f"; did you mean {close[0]}?" if close else "")
    if kind == "value_error":
        return str(error["ctx"]["error"])
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return f"expected a whole number, got {_short(value)}"
    if kind in ("float_type", "float_parsing", "finite_number"):
        return f"expected a finite number, got {_short(value)}"
    if kind in ("bool_type", "bool_parsing"):
        return f"expected true or false, got {_short(value)}"
    if kind == "string_type":
        return f"expected a string, got {_short(value)}"
    if kind in ("dict_type", "model_type", "model_attributes_type"):
        return f"expected a mapping, got {_short(value)}"
    if kind == "list_type":
        return f"expected a list, got {_short(value)}"
    if kind == "string_pattern_mismatch":
        return f"bad name {_short(value)}: use letters, digits, '_', '.', '-'"
    if kind == "too_short":
        return "must not be empty"
    if kind == "literal_error":
        return f"expected {error['ctx']['expected']}, got {_short(value)}"
    message = str(error["msg"]).replace("Input should be", "must be")
    return f"{message}, got {_short(value)}"


def _validate(data: Any, lines: Lines) -> MixtureSpec:
    if not isinstance(data, dict):
        raise MixtureError(
            [lines.issue((), "a mixture is a mapping of fields (name, total_tokens, phases, ...)")]
        )
    try:
        return MixtureSpec.model_validate(data)
    except ValidationError as error:
        issues = []
        for item in error.errors(include_url=False):
            path: Path = tuple(item["loc"])
            issues.append(lines.issue(path, _pydantic_message(item)))
        raise MixtureError(issues) from None


def _fraction(value: float) -> Fraction:
    # repr() is the shortest decimal that round-trips, so 0.8 becomes exactly 4/5 and shares that a
    # person wrote as decimals sum exactly.
    return Fraction(repr(float(value)))


def _read_file(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except FileNotFoundError:
        raise MixtureError(f"no such mixture file: {path}", file=path) from None
    except (OSError, UnicodeDecodeError) as error:
        raise MixtureError(f"cannot read {path}: {error}", file=path) from None


def load_mixture(path: str | os.PathLike[str]) -> Mixture:
    """Read and validate a mixture spec; MixtureError (`path: message (line N)`) when it is wrong."""
    path = os.fspath(path)
    return load_mixture_text(_read_file(path), path)


def load_mixture_text(
    text: str, file: str | None = None, read: Callable[[str], str] | None = None
) -> Mixture:
    """Validate a spec given as text. `read(path)` fetches a slice's parent (default: from disk)."""
    data, lines = load_yaml(text, file)
    return _resolve(_validate(data, lines), data, lines, file, read)


def mixture_from_spec(
    spec: MixtureSpec, file: str | None = None, read: Callable[[str], str] | None = None
) -> Mixture:
    """Validate a spec built in code (a ladder rung's slice) as `load_mixture_text` validates a file's,
    without YAML text in between. `file`: where the spec is (or would be) written; its slice_of and
    counts paths are relative to it."""
    return _resolve(spec, spec.model_dump(exclude_none=True), Lines(file), file, read)


def _resolve(
    spec: MixtureSpec, data: dict[str, Any], lines: Lines, file: str | None, read: Callable[[str], str] | None
) -> Mixture:
    if spec.slice_of is not None:
        return _resolve_slice(spec, data, lines, file, read or _read_file)
    missing = [name for name in FULL_REQUIRED if getattr(spec, name) is None]
    issues = [lines.issue((name,), "required field missing (or give slice_of)") for name in missing]
    if spec.total_tokens is None and spec.total_steps is None:
        issues.append(lines.issue(("total_tokens",), "required field missing (or give total_steps)"))
    if issues:
        raise MixtureError(sorted(issues, key=lambda issue: issue.line or 0))
    return _resolve_full(spec, lines, file)


def _relative(file: str | None, target: str) -> str:
    if os.path.isabs(target) or "://" in target or not file:
        return target
    return os.path.normpath(os.path.join(os.path.dirname(file), target))


def _run_tokens(spec: MixtureSpec, sequence_length: int, batch_size: int) -> int:
    """The budget: total_tokens, else total_steps x batch_size x sequence_length."""
    if spec.total_tokens is not None:
        return spec.total_tokens
    assert spec.total_steps is not None
    return spec.total_steps * batch_size * sequence_length


def _resolve_full(spec: MixtureSpec, lines: Lines, file: str | None) -> Mixture:
    issues: list[Issue] = []
    assert spec.sequence_length is not None and spec.batch_size is not None
    total_tokens = _run_tokens(spec, spec.sequence_length, spec.batch_size)
    default_epochs = spec.max_epochs if spec.max_epochs is not None else DEFAULT_MAX_EPOCHS

    def where(path: Path) -> Where:
        return Where(file, path, lines.line(path))

    sources: dict[str, Source] = {}
    for name, source_spec in (spec.sources or {}).items():
        path = ("sources", name)
        if looks_like_selector(name) or not _matches_name(name):
            issues.append(
                lines.issue(
                    path,
                    "bad source name: use letters, digits, '_', '.', '-' (a name with = * / < > reads as a "
                    "cell pattern; use the pattern as a weight key instead)",
                )
            )  # kept below all the same, so that its weights do not also read as unknown sources
        selectors = []
        for i, text in enumerate(source_spec.cells):
            evaluated = evaluation_path(text)
            if evaluated:
                issues.append(lines.issue((*path, "cells", i), _trained_evaluation(evaluated, name)))
                continue
            try:
                selectors.append(parse_selector(text))
            except ValueError as error:
                issues.append(lines.issue((*path, "cells", i), str(error)))
        if not source_spec.cells and source_spec.tokens is None:
            issues.append(
                lines.issue(path, "give cells (a cell, shard path or pattern), declared tokens, or both")
            )
        sources[name] = Source(
            name=name,
            selectors=tuple(selectors),
            declared_tokens=source_spec.tokens,
            max_epochs=source_spec.max_epochs if source_spec.max_epochs is not None else default_epochs,
            implicit=False,
            where=where(path),
        )

    phases: list[MixturePhase] = []
    seen_phases: dict[str, int] = {}
    assert spec.phases is not None
    for index, phase_spec in enumerate(spec.phases):
        path = ("phases", index)
        if phase_spec.name in seen_phases:
            issues.append(
                lines.issue(
                    (*path, "name"), f"duplicate phase name (also phases[{seen_phases[phase_spec.name]}])"
                )
            )
        seen_phases.setdefault(phase_spec.name, index)
        if (phase_spec.share is None) == (phase_spec.tokens is None):
            both = phase_spec.share is not None
            issues.append(
                lines.issue(
                    path,
                    "give share or tokens, not both" if both else "give share (of total_tokens) or tokens",
                )
            )
            budget = Fraction(0)
        elif phase_spec.share is not None:
            budget = _fraction(phase_spec.share) * total_tokens
        else:
            budget = Fraction(phase_spec.tokens or 0)

        raw: dict[str, Fraction] = {}
        weight_where: dict[str, Where] = {}
        broken = False  # a bad entry makes the sum meaningless; report the entry only
        for key, value in phase_spec.weights.items():
            key_path = (*path, "weights", key)
            if value < 0:
                issues.append(lines.issue(key_path, f"negative weight {value:g}; weights must be >= 0"))
                broken = True
                continue
            if key not in sources:
                evaluated = evaluation_path(key)
                if evaluated:
                    issues.append(lines.issue(key_path, _trained_evaluation(evaluated, key)))
                    broken = True
                    continue
                if not looks_like_selector(key):
                    issues.append(lines.issue(key_path, "unknown source" + _suggest(key, sources)))
                    broken = True
                    continue
                try:
                    selector = parse_selector(key)
                except ValueError as error:
                    issues.append(lines.issue(key_path, str(error)))
                    broken = True
                    continue
                if key not in sources:
                    sources[key] = Source(
                        name=key,
                        selectors=(selector,),
                        declared_tokens=None,
                        max_epochs=default_epochs,
                        implicit=True,
                        where=where(key_path),
                    )
            raw[key] = _fraction(value)
            weight_where[key] = where(key_path)
        total = sum(raw.values(), Fraction(0))
        weights_path = (*path, "weights")
        if not broken and total == 0:
            issues.append(lines.issue(weights_path, "weights are all zero"))
        elif not broken and not phase_spec.normalize and abs(total - 1) > WEIGHT_SUM_TOLERANCE:
            issues.append(
                lines.issue(
                    weights_path,
                    f"weights sum to {float(total):.6g}, not 1 (set normalize: true to rescale them)",
                )
            )
        weights = {key: value / total for key, value in raw.items()} if total else raw
        phases.append(MixturePhase(phase_spec.name, budget, weights, where(path), weight_where))

    issues.extend(_check_budgets(spec, phases, lines, total_tokens))
    evaluation, evaluation_issues = _resolve_evaluation(spec.evaluation, sources, phases, lines, file)
    issues.extend(evaluation_issues)
    if issues:
        raise MixtureError(sorted(issues, key=lambda issue: issue.line or 0))
    return Mixture(
        name=spec.name,
        description=spec.description,
        file=file,
        tokenizer=spec.tokenizer or "",
        total_tokens=total_tokens,
        total_steps=spec.total_steps,
        provenance=_provenance(spec),
        sequence_length=spec.sequence_length or 0,
        batch_size=spec.batch_size or 0,
        block_size=spec.block_size or spec.batch_size or 0,
        block_size_explicit=spec.block_size is not None,
        max_epochs=default_epochs,
        shortfall=spec.shortfall or "error",
        sources=sources,
        phases=phases,
        illustrative=bool(spec.illustrative),
        counts_path=_relative(file, spec.counts) if spec.counts else None,
        spec=spec,
        evaluation=evaluation,
    )


def evaluation_path(text: str) -> str | None:
    """What evaluation data a source's cell or weight key points at (`.../heldout`, `eval/<name>`), or None.

    Held-out slices and external sets sit beside the training shards; naming one as a source would train
    on what the run evaluates on.
    """
    parts = [part.strip() for part in text.strip().strip("/").split("/") if part.strip()]
    if "heldout" in parts:
        return "a held-out slice (" + "/".join(parts[: parts.index("heldout") + 1]) + ")"
    if "eval" in parts[:-1]:
        return f"evaluation set {parts[parts.index('eval') + 1]}"
    return None


def _trained_evaluation(what: str, source: str) -> str:
    return (
        f"{what} cannot be trained on (source {source}): evaluation sets have zero training weight; name it "
        "under evaluation (heldout: for held-out slices, sets: for external sets)"
    )


def _resolve_evaluation(
    spec: EvaluationSpec | None,
    sources: dict[str, Source],
    phases: list[MixturePhase],
    lines: Lines,
    file: str | None,
) -> tuple[Evaluation | None, list[Issue]]:
    """The evaluation sets, and an issue for each set that is also trained on (a source of its name)."""
    if spec is None:
        return None, []
    issues = []
    selectors = []
    for i, text in enumerate(spec.heldout):
        try:
            selectors.append(parse_selector(text))
        except ValueError as error:
            issues.append(lines.issue(("evaluation", "heldout", i), str(error)))
    seen: set[str] = set()
    for i, name in enumerate(spec.sets):
        path = ("evaluation", "sets", i)
        if name in seen:
            issues.append(lines.issue(path, f"evaluation set {name} is listed twice"))
        seen.add(name)
        if name in sources:
            trained = [
                f"{phase.name} {float(phase.weights[name]):.4g}"
                for phase in phases
                if phase.weights.get(name, 0) > 0
            ]
            source_line = sources[name].where.line
            at = f" (line {source_line})" if source_line else ""
            how = f"weight {', '.join(trained)}" if trained else "no weight yet"
            issues.append(
                lines.issue(
                    path,
                    f"evaluation set {name} is also a training source: source {name}{at}, {how}; an "
                    "evaluation set has zero training weight (rename the source or drop it from "
                    "evaluation.sets)",
                )
            )
    if not selectors and not spec.sets and not issues:
        issues.append(lines.issue(("evaluation",), "names no evaluation set: give heldout: or sets:"))
    where = Where(file, ("evaluation",), lines.line(("evaluation",)))
    return Evaluation(tuple(selectors), spec.group_by, tuple(spec.sets), where), issues


def _provenance(spec: MixtureSpec) -> dict[str, str] | None:
    if spec.provenance is None:
        return None
    return {key: value for key, value in spec.provenance.model_dump().items() if value is not None}


def _check_budgets(
    spec: MixtureSpec, phases: list[MixturePhase], lines: Lines, total_tokens: int
) -> list[Issue]:
    assert spec.phases is not None
    total = sum((phase.budget for phase in phases), Fraction(0))
    if all(p.share is not None for p in spec.phases) and all(p.tokens is None for p in spec.phases):
        shares = sum((_fraction(p.share or 0) for p in spec.phases), Fraction(0))
        if abs(shares - 1) > SHARE_SUM_TOLERANCE:
            return [lines.issue(("phases",), f"phase shares sum to {float(shares):.10g}, not 1")]
        return []
    if any((p.share is None) == (p.tokens is None) for p in spec.phases):
        return []  # already reported per phase
    if abs(total - total_tokens) > SHARE_SUM_TOLERANCE * total_tokens:
        return [
            lines.issue(
                ("phases",),
                f"phase budgets sum to {format_count(float(total), 6)} ({round(total):,} tokens), "
                f"but total_tokens is {format_count(total_tokens, 6)} ({total_tokens:,})",
            )
        ]
    return []


def _matches_name(name: str) -> bool:
    return _NAME.match(name) is not None


def _suggest(key: str, sources: dict[str, Source]) -> str:
    names = [name for name, source in sources.items() if not source.implicit]
    close = difflib.get_close_matches(key, names, n=1, cutoff=0.75)
    return f"; did you mean {close[0]}?" if close else ""


def _resolve_slice(
    spec: MixtureSpec, data: dict[str, Any], lines: Lines, file: str | None, read: Callable[[str], str]
) -> Mixture:
    assert spec.slice_of is not None
    issues = [
        lines.issue((name,), f"not allowed in a slice: it comes from {spec.slice_of}")
        for name in SLICE_INHERITED
        if name in data
    ]
    if issues:
        raise MixtureError(issues)
    parent_file = _relative(file, spec.slice_of)
    where = Where(file, ("slice_of",), lines.line(("slice_of",)))
    try:
        parent_text = read(parent_file)
    except MixtureError as error:
        raise MixtureError([where.issue(f"cannot read {parent_file}: {error}")]) from None
    parent = load_mixture_text(parent_text, parent_file, read)
    if parent.slice is not None:
        raise MixtureError([where.issue(f"{parent_file} is itself a slice; slice the full run instead")])
    batch_size = spec.batch_size or parent.batch_size
    sequence_length = spec.sequence_length or parent.sequence_length
    if spec.total_tokens is None and spec.total_steps is None:
        raise MixtureError([lines.issue(("total_tokens",), "required field missing (or give total_steps)")])
    total_tokens = _run_tokens(spec, sequence_length, batch_size)
    if total_tokens > parent.total_tokens or total_tokens == 0:
        given = "total_tokens" if spec.total_tokens is not None else "total_steps"
        raise MixtureError(
            [
                lines.issue(
                    (given,),
                    "a slice takes between 1 token and its full run's "
                    f"{format_count(parent.total_tokens, 6)}, "
                    f"not {format_count(total_tokens, 6)}",
                )
            ]
        )
    fraction = Fraction(total_tokens, parent.total_tokens)
    if spec.block_size is not None:
        block_size = spec.block_size
    elif parent.block_size_explicit:
        block_size = parent.block_size
    else:
        block_size = batch_size
    phases = [
        MixturePhase(
            phase.name, phase.budget * fraction, dict(phase.weights), phase.where, dict(phase.weight_where)
        )
        for phase in parent.phases
    ]
    # A slice evaluates on its full run's sets unless it names its own.
    evaluation = parent.evaluation
    if spec.evaluation is not None:
        evaluation, evaluation_issues = _resolve_evaluation(
            spec.evaluation, parent.sources, parent.phases, lines, file
        )
        if evaluation_issues:
            raise MixtureError(evaluation_issues)
    return Mixture(
        name=spec.name,
        description=spec.description,
        file=file,
        tokenizer=parent.tokenizer,
        total_tokens=total_tokens,
        total_steps=spec.total_steps,
        provenance=_provenance(spec) or parent.provenance,
        sequence_length=sequence_length,
        batch_size=batch_size,
        block_size=block_size,
        block_size_explicit=spec.block_size is not None or parent.block_size_explicit,
        max_epochs=parent.max_epochs,
        shortfall=parent.shortfall,
        sources=dict(parent.sources),
        phases=phases,
        illustrative=bool(spec.illustrative) or parent.illustrative,
        slice=SliceInfo(parent.name, parent_file, fraction, parent.total_tokens),
        counts_path=_relative(file, spec.counts) if spec.counts else parent.counts_path,
        spec=spec,
        evaluation=evaluation,
    )
