"""A ladder spec (configs/ladders/*.yaml): a family of model shapes (the rungs), the big run they forecast
(the target), the big mixture and a tokens-per-active-parameter rule. Read and validated here; paths are
resolved against the spec's folder.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PositiveInt, ValidationError

from tokenmill.trainer.model.shape import ModelConfig, load_model_config
from tokenmill.units import parse_count
from tokenmill.validation import validation_problems

FORMAT_VERSION = 1  # of ladder-plan.json and ladder.json


class LadderError(ValueError):
    """A ladder spec, a run folder or a fit that cannot be used; the message names the file."""


def _count(value: Any) -> Any:
    return None if value is None else parse_count(value)


Count = Annotated[int, BeforeValidator(_count)]
Name = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]+$")]


class RungSpec(BaseModel):
    """One rung: a model of the family; tokens follow the ladder's rule unless given."""

    model_config = ConfigDict(extra="forbid")

    name: Name
    model: str
    tokens: Count | None = None
    sequence_length: PositiveInt | None = None
    batch_size: PositiveInt | None = None
    racks: PositiveInt | None = None  # batch_size = racks x the ladder's sequences_per_rack
    block_size: PositiveInt | None = None
    # A hand-written slice spec of the same rung (mixtures/marin-ladder-*.yaml), planned side by side.
    compare: str | None = None


class TargetSpec(BaseModel):
    """The big run the ladder forecasts."""

    model_config = ConfigDict(extra="forbid")

    model: str
    # default: the mixture's run, total_steps x tokens per step when it gives total_steps, else total_tokens
    tokens: Count | None = None
    sequence_length: PositiveInt | None = None  # default: the mixture's
    racks: PositiveInt | None = None  # its batch in racks: checked against the mixture's batch


class LadderSpec(BaseModel):
    """configs/ladders/*.yaml; paths are relative to the spec's file."""

    model_config = ConfigDict(extra="forbid")

    name: Name
    description: str | None = None
    mixture: str
    tokens_per_active_param: float = Field(gt=0)
    sequence_length: PositiveInt | None = None
    batch_size: PositiveInt | None = None
    block_size: PositiveInt | None = None
    sequences_per_rack: PositiveInt | None = None  # what a rung's `racks` multiplies
    # "blocks": a rung's tokens are rounded to whole mixture blocks (lcm of batch and block); "steps": to
    # whole steps, steps = round(k x active / tokens per step) (Marin), the last block possibly partial.
    round_to: Literal["blocks", "steps"] = "blocks"
    target: TargetSpec
    rungs: list[RungSpec] = Field(min_length=1)


@dataclass
class Ladder:
    """A validated spec with its paths resolved against the spec's folder."""

    file: str
    spec: LadderSpec
    mixture: str
    target_model: str
    rung_models: list[str]
    rung_compare: list[str | None]


def _relative(file: str, target: str) -> str:
    if os.path.isabs(target) or "://" in target:
        return target
    return os.path.normpath(os.path.join(os.path.dirname(file), target))


def load_ladder(path: str | os.PathLike[str]) -> Ladder:
    """Read and validate a ladder spec; LadderError names the file and the field."""
    path = os.fspath(path)
    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise LadderError(f"{path}: cannot read the ladder spec ({error.strerror or error})") from error
    except yaml.YAMLError as error:
        raise LadderError(f"{path}: not valid YAML ({error})") from error
    if not isinstance(raw, dict):
        raise LadderError(f"{path}: a ladder spec is a mapping")
    try:
        spec = LadderSpec.model_validate(raw)
    except ValidationError as error:
        raise LadderError(f"{path}: {validation_problems(error, 'ladder')}") from error
    names = [rung.name for rung in spec.rungs]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise LadderError(f"{path}: rungs: duplicate names {', '.join(duplicates)}")
    for where, item in [
        *((f"rungs[{i}]", rung) for i, rung in enumerate(spec.rungs)),
        ("target", spec.target),
    ]:
        if item.racks is not None and spec.sequences_per_rack is None:
            raise LadderError(
                f"{path}: {where}.racks: give sequences_per_rack (sequences in one rack's batch)"
            )
        if item.racks is not None and getattr(item, "batch_size", None) is not None:
            raise LadderError(f"{path}: {where}: give racks or batch_size, not both")
    return Ladder(
        file=path,
        spec=spec,
        mixture=_relative(path, spec.mixture),
        target_model=_relative(path, spec.target.model),
        rung_models=[_relative(path, rung.model) for rung in spec.rungs],
        rung_compare=[_relative(path, rung.compare) if rung.compare else None for rung in spec.rungs],
    )


def read_model(path: str) -> ModelConfig:
    """A model shape the ladder names; LadderError if it cannot be read."""
    try:
        return load_model_config(path)
    except ValueError as error:
        raise LadderError(str(error)) from error


def racks_batch(spec: LadderSpec, racks: int | None) -> int | None:
    """Sequences per step of `racks` racks, or None when no racks are given."""
    return racks * spec.sequences_per_rack if racks is not None and spec.sequences_per_rack else None
