"""What changed between two plans: tokens and epochs per source, per phase and over the run.

Used by `tokenmill mixture diff A B` to review a mixture edit before it goes in: phases are matched by
name and sources by name, so a reweighting shows as changed tokens and epochs, and a renamed source as
one removed and one added.
"""

from __future__ import annotations

from typing import Any

from tokenmill.formats.plan import MixturePlan

RUN_FIELDS = (
    "tokenizer",
    "total_tokens",
    "sequence_length",
    "batch_size",
    "block_size",
    "tokens_per_step",
    "block_steps",
    "total_steps",
    "planned_tokens",
    "shortfall",
    "tokens_from",
)
PHASE_FIELDS = ("tokens", "steps", "start_step", "end_step")
SOURCE_FIELDS = ("weight", "block_sequences", "tokens", "tokens_available", "epochs")
TOTAL_FIELDS = ("tokens", "tokens_available", "epochs", "max_epochs")


def _status(a: Any, b: Any, changed: bool) -> str:
    if a is None:
        return "added"
    if b is None:
        return "removed"
    return "changed" if changed else "same"


def _pairs(a: Any, b: Any, fields: tuple[str, ...]) -> dict[str, list[Any]]:
    """{field: [a, b]} for the fields that differ (a missing side reads as 0)."""
    result = {}
    for name in fields:
        old = getattr(a, name) if a is not None else 0
        new = getattr(b, name) if b is not None else 0
        if old != new:
            result[name] = [old, new]
    return result


def _union(a: list[str], b: list[str]) -> list[str]:
    return list(dict.fromkeys([*a, *b]))


def diff_plans(a: MixturePlan, b: MixturePlan) -> dict[str, Any]:
    """The differences from plan a to plan b, as a JSON-ready dict; unchanged entries are left out.

    Shape: {"a", "b", "fields": {field: [a, b]}, "phases": [{"name", "status", "changes": {...},
    "sources": [{"name", "status", "changes": {field: [a, b]}}]}], "sources": [...run totals...]}.
    status is added, removed or changed; a side that lacks the phase or source counts as 0.
    """
    result: dict[str, Any] = {
        "a": a.name,
        "b": b.name,
        "fields": {
            name: [getattr(a, name), getattr(b, name)]
            for name in RUN_FIELDS
            if getattr(a, name) != getattr(b, name)
        },
        "phases": [],
        "sources": [],
    }
    a_phases = {phase.name: phase for phase in a.phases}
    b_phases = {phase.name: phase for phase in b.phases}
    for name in _union(list(a_phases), list(b_phases)):
        old, new = a_phases.get(name), b_phases.get(name)
        changes = _pairs(old, new, PHASE_FIELDS)
        old_sources = {s.name: s for s in old.sources} if old else {}
        new_sources = {s.name: s for s in new.sources} if new else {}
        sources = []
        for source_name in _union(list(old_sources), list(new_sources)):
            before, after = old_sources.get(source_name), new_sources.get(source_name)
            source_changes = _pairs(before, after, SOURCE_FIELDS)
            if source_changes or before is None or after is None:
                sources.append(
                    {
                        "name": source_name,
                        "status": _status(before, after, bool(source_changes)),
                        "changes": source_changes,
                    }
                )
        if changes or sources or old is None or new is None:
            result["phases"].append(
                {"name": name, "status": _status(old, new, True), "changes": changes, "sources": sources}
            )
    for name in _union(list(a.sources), list(b.sources)):
        before, after = a.sources.get(name), b.sources.get(name)
        changes = _pairs(before, after, TOTAL_FIELDS)
        if changes or before is None or after is None:
            result["sources"].append(
                {"name": name, "status": _status(before, after, True), "changes": changes}
            )
    return result
