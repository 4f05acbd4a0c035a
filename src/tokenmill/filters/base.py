"""The contract of a per-document curation step, independent of Beam.

A step has one job, is configured in its constructor, loads whatever it needs once in `setup()`, and
judges a batch of documents at a time: it may annotate a document (add columns) and returns, for each
document, None to keep it or a `Removal` saying why it goes. Beam wraps every step in one generic DoFn
(`tokenmill.pipelines.curate.ApplyStep`), so a step can be tested, benchmarked and reused without Beam.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Removal:
    """Why a document was removed: `reason` names the rule; `detail` gives the numbers."""

    reason: str
    detail: dict = field(default_factory=dict)


class DocumentStep(ABC):
    """One curation step over batches of documents (dicts with the docs/formats.md columns)."""

    #: The stage name used in `removed/stage=<stage>/` and in stats.json.
    stage: str = ""

    def setup(self) -> None:  # noqa: B027 - most steps need no set-up
        """Load models or tables; called once per worker before the first batch."""

    @abstractmethod
    def apply(self, documents: list[dict]) -> list[Removal | None]:
        """Judge each document (annotating it in place if the step adds columns)."""
