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
    """Why a document was removed: `reason` names the rule; `detail` gives the numbers; `stage`, when set,
    names the inner step that removed it (for steps that run other steps, such as per-domain chains)."""

    reason: str
    detail: dict = field(default_factory=dict)
    stage: str | None = None


class DocumentStep(ABC):
    """One curation step over batches of documents (dicts with the docs/formats.md columns)."""

    #: The stage name used in `removed/stage=<stage>/` and in stats.json.
    stage: str = ""

    def setup(self) -> None:  # noqa: B027 - most steps need no set-up
        """Load models or tables; called once per worker before the first batch."""

    def warm_up_calls(self) -> list[tuple[str, tuple[str, ...]]]:
        """`module:function` calls, with string arguments, that do this step's per-process set-up ahead
        of time: a local run's warm pool makes them in the workers' template while the launcher builds
        the job (tokenmill.pipelines.warm_workers), and `setup()` in each forked worker then finds their
        work done. None by default."""
        return []

    @abstractmethod
    def apply(self, documents: list[dict]) -> list[Removal | None]:
        """Judge each document (annotating it in place if the step adds columns)."""

    def drain_stats(self) -> dict:
        """Numbers this step counted since the last call (nested dicts of numbers, summed across workers
        into stats.json under `stages.<stage>`), then forgotten. Most steps count nothing beyond removals."""
        return {}

    def drain_stage_stats(self) -> dict[str, dict]:
        """`drain_stats()` keyed by stage name (steps that run other steps key each inner stage)."""
        stats = self.drain_stats()
        return {self.stage: stats} if stats else {}


class DomainChains(DocumentStep):
    """Each domain's own chain of steps: documents go through the chain of their `domain` (set by the
    domain classifier), or through `default` when their domain has no chain of its own.

    Prose heuristics would remove a domain the mixture wants (code fails Gopher's stop-word rule by
    nature), so the recipe gives each domain the checks that suit it. Removals keep the inner step's name.
    """

    stage = "by_domain"

    def __init__(self, chains: dict[str, list[DocumentStep]]):
        self.chains = chains

    def stage_names(self) -> list[str]:
        """Inner stage names, in first-seen order, for the funnel."""
        names: list[str] = []
        for chain in self.chains.values():
            for step in chain:
                if step.stage not in names:
                    names.append(step.stage)
        return names

    def setup(self) -> None:
        for chain in self.chains.values():
            for step in chain:
                step.setup()

    def warm_up_calls(self) -> list[tuple[str, tuple[str, ...]]]:
        return [call for chain in self.chains.values() for step in chain for call in step.warm_up_calls()]

    def drain_stage_stats(self) -> dict[str, dict]:
        drained: dict[str, dict] = {}
        for chain in self.chains.values():
            for step in chain:
                for stage, numbers in step.drain_stage_stats().items():
                    drained.setdefault(stage, []).append(numbers)
        # A stage in several chains reports once, its numbers summed.
        return {stage: sum_numbers(parts) for stage, parts in drained.items()}

    def apply(self, documents: list[dict]) -> list[Removal | None]:
        verdicts: list[Removal | None] = [None] * len(documents)
        by_chain: dict[str, list[int]] = {}
        for index, document in enumerate(documents):
            name = document.get("domain") if document.get("domain") in self.chains else "default"
            by_chain.setdefault(name, []).append(index)
        for name, indices in by_chain.items():
            for step in self.chains.get(name, []):
                alive = [i for i in indices if verdicts[i] is None]
                if not alive:
                    break
                for index, removal in zip(alive, step.apply([documents[i] for i in alive])):
                    if removal is not None:
                        verdicts[index] = Removal(removal.reason, removal.detail, removal.stage or step.stage)
        return verdicts


def sum_numbers(parts: list[dict]) -> dict:
    """Stage statistics of several workers as one: numbers summed key by key, nested dicts alike. A value
    that only one part has is taken as it is, which is how a table a stage reports once (line_boilerplate's
    most repeated lines per source, with their text) passes through; such a value in two parts is an
    error, never a silent concatenation."""
    total: dict = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict):
                total[key] = sum_numbers([total.get(key, {}), value])
            elif key not in total:
                total[key] = value
            elif isinstance(value, int | float) and isinstance(total[key], int | float):
                total[key] = total[key] + value
            else:
                raise ValueError(f"stage statistics: {key!r} is reported twice and is not a number")
    return total
