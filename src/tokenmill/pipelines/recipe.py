"""Curation recipes: the YAML under configs/curate/ that chooses the stages and their thresholds.

```yaml
name: web
fields: {text: text, id: id, url: url}
chars_per_token: 4.0
target_file_bytes: 256M
max_record_bytes: 64MiB   # a longer line / record is rejected as record_too_large, never held whole
removed_text: true        # false: removed/ keeps id, source, reason, detail and size, not the text
dedupe_index: true        # with a dedupe stage: OUTPUT/dedupe-index/, for later runs' --dedupe-against
default_cell: {domain: web, quality: 0}
normalize: {max_chars: 1_000_000}
sources:                  # license and provenance per input file: the first pattern that matches
  "crawl-2024/*": {license: CC-BY-4.0, provenance: "https://example.org/crawl-2024"}
stages:
  - language: {languages: [en], min_score: 0.5}
  - exact_dedupe: {}
  - gopher_repetition: {}
  - gopher_quality: {min_doc_words: 50}
```

`sources` maps shell-style patterns over each input file's source (its path below the input root; `*`
matches across folders) to the files' `license` and `provenance`, which stats.json and the overview page
show per source. `fields.license` names the input field (a dotted path into nested objects, such as
Dolma's `metadata.license`) that holds each record's own license: stats.json counts documents read per
value and source.

`stages` run in the order written, after normalization; each entry names one stage kind and its
parameters. Heuristic filters take datatrove's own parameter names. An unknown stage or parameter is
an error that names the recipe file and the stage's position.

A new stage is one entry in a registry below: a per-document stage is a `DocumentStep` class (see
tokenmill.filters.base); a stage that compares documents with each other (dedupe) is a Beam PTransform
named by import path, whose `expand(documents)` returns a dict with the PCollections `kept` and
`removed` (removed documents carry `stage`, `reason`, `detail`), and optionally `stats`: (stage,
{name: number or nested dict of numbers}) pairs, summed into stats.json under `stages.<stage>`; a value
that is not a number (line_boilerplate's table of repeated lines) must come in one pair only, and is
taken as it is (tokenmill.filters.base.sum_numbers).
"""

from __future__ import annotations

import fnmatch
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tokenmill.corpora.records import DEFAULT_MAX_RECORD_BYTES, InputFields
from tokenmill.domains.model import DomainsError
from tokenmill.domains.stage import DomainClusters
from tokenmill.filters.base import DocumentStep, DomainChains
from tokenmill.filters.classifiers import ClassifierError, DomainClassifier, QualityClassifier
from tokenmill.filters.code import CodeQuality
from tokenmill.filters.decontam import Decontaminate
from tokenmill.filters.heuristics import FILTER_CLASSES, HeuristicFilter, datatrove_filter_class
from tokenmill.filters.language import LanguageFilter
from tokenmill.filters.normalize import Normalize
from tokenmill.filters.pii import PersonalData
from tokenmill.filters.url_filter import UrlFilter
from tokenmill.units import parse_byte_size
from tokenmill.validation import validation_problems


def _heuristic_filter(
    kind: str, language: str = "en", shared_words: bool = True, **params: Any
) -> HeuristicFilter:
    step = HeuristicFilter(kind, params, language=language, shared_words=shared_words)
    datatrove_filter_class(kind)(**params)  # datatrove checks its own parameter names here
    return step


#: Per-document stages: kind -> factory(**params) -> DocumentStep.
DOCUMENT_STAGES: dict[str, Callable[..., DocumentStep]] = {
    "language": LanguageFilter,
    **{kind: partial(_heuristic_filter, kind) for kind in FILTER_CLASSES},
    "code_quality": CodeQuality,
    "domain_classifier": DomainClassifier,
    "quality_classifier": QualityClassifier,
    "domain_clusters": DomainClusters,
    "decontam": Decontaminate,
    "url_filter": UrlFilter,
    "pii": PersonalData,
}
#: Stages that compare documents across inputs: kind -> "module:PTransform" (imported when used, so that
#: recipes load without Beam's start-up cost where only the per-document stages are needed).
GROUPING_STAGES: dict[str, str] = {
    "exact_dedupe": "tokenmill.pipelines.exact_dedupe:ExactDedupe",
    "fuzzy_dedupe": "tokenmill.pipelines.fuzzy_dedupe:FuzzyDedupe",
    "line_boilerplate": "tokenmill.pipelines.line_boilerplate:LineBoilerplate",
}
#: `by_domain: {<domain>: [stages...], default: [stages...]}` gives each domain its own chain of
#: per-document stages (after `domain_classifier`); see tokenmill.filters.base.DomainChains.
BY_DOMAIN = "by_domain"
STAGE_KINDS = (*DOCUMENT_STAGES, *GROUPING_STAGES, BY_DOMAIN)
#: Stages that set or read the domain classifier's label; `domain_clusters` (topic domains cNN, see
#: tokenmill.domains.stage) replaces that label, so these run before it.
_LABEL_READERS = ("domain_classifier", BY_DOMAIN, "line_boilerplate")  # line_boilerplate: skip_domains


@dataclass
class GroupingStep:
    """A recipe stage that is a Beam transform over all documents (see the module docstring)."""

    stage: str
    transform: Any


class RecipeError(ValueError):
    """A recipe that cannot be used; the message names the file and the field."""


class Fields(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: str = "text"
    id: str | None = "id"
    url: str | None = "url"
    #: The input field (dotted path) that holds a record's license; it stays in `metadata` as well.
    license: str | None = Field(None, min_length=1)


#: The longest license or provenance a recipe or a record may give (the page shows it whole).
MAX_SOURCE_TEXT = 500


class SourceInfo(BaseModel):
    """What a recipe's `sources:` entry says about the input files its pattern matches: their license
    (an SPDX expression where there is one) and where they come from (a URL or a sentence)."""

    model_config = ConfigDict(extra="forbid")
    license: str | None = Field(None, min_length=1, max_length=MAX_SOURCE_TEXT)
    provenance: str | None = Field(None, min_length=1, max_length=MAX_SOURCE_TEXT)

    @model_validator(mode="after")
    def _says_something(self) -> SourceInfo:
        if self.license is None and self.provenance is None:
            raise ValueError("give a license, a provenance or both")
        return self


class DefaultCell(BaseModel):
    """The cell of documents that no classifier has placed (the seam the classifier stages fill)."""

    model_config = ConfigDict(extra="forbid")
    domain: str = "web"
    quality: int = Field(0, ge=0, le=4)


class NormalizeParams(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_chars: int = Field(1_000_000, gt=0)


class Recipe(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    fields: Fields = Fields()
    chars_per_token: float = Field(4.0, gt=0)
    target_file_bytes: int = 256 * 10**6
    #: A JSON line, Parquet text or WARC record longer than this is rejected as `record_too_large`.
    max_record_bytes: int = Field(DEFAULT_MAX_RECORD_BYTES, gt=0)
    #: False records removed documents without their text (id, source, stage, reason, detail, n_chars):
    #: at web scale most of what is read is removed, and writing it whole doubles the output.
    removed_text: bool = True
    #: True writes OUTPUT/dedupe-index/ (when the recipe has a dedupe stage): what this run kept, for later
    #: runs' `--dedupe-against` (tokenmill.pipelines.dedupe_index).
    dedupe_index: bool = True
    batch_size: int = Field(256, gt=0)
    default_cell: DefaultCell = DefaultCell()
    normalize: NormalizeParams = NormalizeParams()
    #: Input files' license and provenance by pattern over their source (the first that matches).
    sources: dict[str, SourceInfo] = {}
    stages: list[dict[str, dict[str, Any] | None]] = []

    @field_validator("target_file_bytes", "max_record_bytes", mode="before")
    @classmethod
    def _parse_bytes(cls, value: Any) -> int:
        return parse_byte_size(value)

    @field_validator("stages")
    @classmethod
    def _check_stages(cls, stages: list[dict]) -> list[dict]:
        for position, stage in enumerate(stages):
            if len(stage) != 1:
                raise ValueError(f"stages[{position}]: one stage kind per entry, got {sorted(stage)}")
            kind = next(iter(stage))
            if kind not in STAGE_KINDS:
                raise ValueError(
                    f"stages[{position}]: unknown stage {kind!r}; known: {', '.join(STAGE_KINDS)}"
                )
            if kind == BY_DOMAIN:
                _check_chains(stage[kind], f"stages[{position}].{BY_DOMAIN}")
        kinds = [next(iter(stage)) for stage in stages]
        if "domain_clusters" in kinds:
            # domain_clusters replaces the classifier's label with cNN: a later reader of it would see cNN.
            clusters_at = kinds.index("domain_clusters")
            late = [
                f"stages[{i}] {kind}"
                for i, kind in enumerate(kinds)
                if i > clusters_at and kind in _LABEL_READERS
            ]
            if late:
                raise ValueError(
                    f"stages[{clusters_at}]: domain_clusters replaces the domain label, so "
                    f"{', '.join(late)} must come before it"
                )
        return stages

    @field_validator("sources")
    @classmethod
    def _check_sources(cls, sources: dict[str, SourceInfo]) -> dict[str, SourceInfo]:
        for pattern in sources:
            if not pattern.strip():
                raise ValueError("a source pattern is empty")
        return sources

    def source_pattern(self, source: str) -> str | None:
        """The first `sources:` pattern that matches `source` (an input file's source), or None."""
        return next((pattern for pattern in self.sources if fnmatch.fnmatchcase(source, pattern)), None)

    def source_info(self, source: str) -> SourceInfo | None:
        """What the `sources:` table says of the input file `source`, or None."""
        pattern = self.source_pattern(source)
        return None if pattern is None else self.sources[pattern]

    @property
    def input_fields(self) -> InputFields:
        return InputFields(text=self.fields.text, id=self.fields.id, url=self.fields.url)

    def stage_list(self) -> list[tuple[str, dict]]:
        return [(kind, dict(params or {})) for stage in self.stages for kind, params in stage.items()]

    def stage_names(self) -> list[str]:
        """Stage names in the order documents meet them (removed/stage=<name>); a per-domain block
        contributes its inner stages, in first-seen order."""
        names = ["normalize"]
        for kind, params in self.stage_list():
            inner = (
                [next(iter(entry)) for chain in params.values() for entry in chain]
                if kind == BY_DOMAIN
                else [kind]
            )
            names.extend(name for name in inner if name not in names)
        return names


def _check_chains(chains: Any, where: str) -> None:
    if not isinstance(chains, dict) or not chains:
        raise ValueError(f"{where}: a mapping of domain -> list of stages (and optionally default)")
    for domain, chain in chains.items():
        if not isinstance(chain, list):
            raise ValueError(f"{where}.{domain}: a list of stages")
        for position, entry in enumerate(chain):
            if not isinstance(entry, dict) or len(entry) != 1 or next(iter(entry)) not in DOCUMENT_STAGES:
                raise ValueError(
                    f"{where}.{domain}[{position}]: one per-document stage per entry "
                    f"({', '.join(DOCUMENT_STAGES)})"
                )


def build_step(kind: str, params: dict, where: str) -> DocumentStep | GroupingStep:
    """The step for one recipe stage; bad parameters are a RecipeError naming `where`."""
    try:
        if kind == BY_DOMAIN:
            return DomainChains(
                {
                    domain: [
                        build_step(inner, dict(inner_params or {}), f"{where}.{domain}[{position}]")
                        for position, entry in enumerate(chain)
                        for inner, inner_params in entry.items()
                    ]
                    for domain, chain in params.items()
                }
            )
        if kind in GROUPING_STAGES:
            module_name, class_name = GROUPING_STAGES[kind].split(":")
            transform_class = getattr(importlib.import_module(module_name), class_name)
            return GroupingStep(kind, transform_class(**params))
        return DOCUMENT_STAGES[kind](**params)
    except RecipeError:
        raise
    except (ClassifierError, DomainsError) as error:
        raise RecipeError(f"{where}: {kind}: {error}") from None
    except (TypeError, ValueError) as error:
        raise RecipeError(f"{where}: bad parameters for {kind}: {error}") from None


def build_steps(recipe: Recipe, source: str = "recipe") -> list[DocumentStep | GroupingStep]:
    steps: list[DocumentStep | GroupingStep] = [Normalize(max_chars=recipe.normalize.max_chars)]
    for position, (kind, params) in enumerate(recipe.stage_list()):
        steps.append(build_step(kind, params, f"{source}: stages[{position}]"))
    return steps


def load_recipe(path: str | Path) -> Recipe:
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"recipe not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise RecipeError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe is a mapping with at least `name`")
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as error:
        raise RecipeError(f"{path}: {validation_problems(error, '(top)')}") from None
    build_steps(recipe, str(path))  # parameter errors surface now, before any pipeline starts
    return recipe
