"""The mixture plan (docs/formats.md, "Mixture plan"): steps, tokens and epochs per phase and source.

`tokenmill.mixtures.plan_mixture` makes a `MixturePlan`; `tokenmill mixture plan --json` writes it; the
trainer's sampler, the report page and the scaling ladder read it back, here, into the same object. The
fields of the format's first table are required; those it added later ("Added fields") are optional, so
that a plan saved by an older planner still reads (its missing fields read as None or empty, and
`to_json` leaves them out again).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import AfterValidator

from tokenmill.formats.base import Count, FormatModel, parse, read_model, write_model

FORMAT_VERSION = 1


class SourcePlan(FormatModel):
    """One source in one phase."""

    name: str
    cells: list[str]
    weight: float  # realized: block_sequences / block_size
    tokens: Count
    tokens_available: Count
    epochs: float  # this phase's tokens / tokens_available
    weight_requested: float | None = None  # the spec's weight, normalized
    block_sequences: Count | None = None  # sequences of this source in every block of the phase
    selectors: list[str] | None = None
    max_epochs: float | None = None


class PhasePlan(FormatModel):
    name: str
    tokens: Count
    steps: Count
    start_step: Count
    end_step: Count  # exclusive: the next phase starts here
    tokens_requested: Count | None = None
    blocks: Count | None = None  # whole blocks
    sources: list[SourcePlan]
    partial_block_sequences: Count | None = None  # sequences of a last, partial block

    def source(self, name: str) -> SourcePlan:
        return next(source for source in self.sources if source.name == name)


class SourceTotal(FormatModel):
    """One source over the whole run."""

    name: str
    cells: list[str]
    selectors: list[str]
    tokens_available: Count
    tokens: Count
    epochs: float
    max_epochs: float
    tokens_from: Literal["counts", "declared"]
    tokens_available_full: Count  # before slicing; equals tokens_available outside a slice


class CellTotal(FormatModel):
    """One cell of counts.json over the whole run: a source's tokens spread over its cells by size."""

    tokens_available: Count
    tokens: Count
    epochs: float


class PlanSlice(FormatModel):
    """A slice of a bigger run (simulated epoching): this run is `fraction` of the mixture `of`."""

    of: str
    file: str
    fraction: float
    of_total_tokens: Count


class EvalSetPlan(FormatModel):
    """One evaluation set of the run (zero training weight): a group of cells' held-out slices, or an
    external set. `manifests` are the sets' manifest.json files relative to the tokens folder (one per cell
    of a held-out set, `eval/<name>/manifest.json` for an external one); the counts are null when the plan
    was made without them."""

    name: str  # heldout/domain=<d>, heldout/<cell>, heldout, or the external set's name
    kind: Literal["heldout", "external"]
    cells: list[str]
    selectors: list[str]
    manifests: list[str]
    tokens: Count | None
    documents: Count | None
    bytes: Count | None


def _some_phases(phases: list[PhasePlan]) -> list[PhasePlan]:
    if not phases:
        raise ValueError("empty (a plan has at least one phase)")
    return phases


class MixturePlan(FormatModel):
    """The plan document. Fields are in the order `tokenmill mixture plan --json` prints them."""

    format_version: Literal[1] | None = None
    name: str
    description: str | None = None
    tokenizer: str
    tokenizer_sha256: str | None = None  # from counts.json, when planned against it
    total_tokens: Count  # the spec's budget, before rounding
    sequence_length: Count
    batch_size: Count
    block_size: Count
    tokens_per_step: Count
    total_steps: Count | None = None  # the last phase's end_step
    total_steps_given: bool | None = None  # the spec gave total_steps: total_tokens is its budget
    planned_tokens: Count | None = None  # total_steps x tokens_per_step
    block_steps: Count | None = None  # every phase boundary is a multiple of it
    shortfall: Literal["error", "redistribute"] | None = None
    tokens_from: Literal["counts.json", "declared"] | None = None
    illustrative: bool | None = None
    slice: PlanSlice | None = None
    phases: Annotated[list[PhasePlan], AfterValidator(_some_phases)]
    sources: dict[str, SourceTotal] = {}
    cells: dict[str, CellTotal] = {}
    warnings: list[str] = []
    provenance: dict[str, str] | None = None
    evaluation: list[EvalSetPlan] | None = None  # absent when the spec names no evaluation sets

    def phase(self, name: str) -> PhasePlan:
        return next(phase for phase in self.phases if phase.name == name)


def plan_from_json(value: Mapping[str, Any] | Any, origin: str = "mixture plan") -> MixturePlan:
    """A plan given as parsed JSON; FormatError names `origin` and each field that breaks the format."""
    return parse(MixturePlan, value, origin)


def read_plan(path: str) -> MixturePlan:
    """A plan file (`tokenmill mixture plan --json` output); FormatError names the file and the field."""
    return read_model(MixturePlan, path)


def write_plan(path: str, plan: MixturePlan) -> None:
    write_model(path, plan)
