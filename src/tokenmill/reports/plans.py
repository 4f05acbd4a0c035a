"""The mixture plan as the page shows it: each source's tokens spread over its cells, and what changed since
a previous plan, as table rows.

The plan is a `tokenmill.formats.plan.MixturePlan`, read from a saved plan (`--plan`) or made by the
planner (`--mixture`); the comparison is the planner's own (`tokenmill.mixtures.diff.diff_plans`, what
`tokenmill mixture diff` prints), laid out for the page.
"""

from __future__ import annotations

from typing import Any

from tokenmill.formats.plan import MixturePlan
from tokenmill.mixtures.diff import diff_plans


def cell_allocation(plan: MixturePlan, cell_tokens: dict[str, int]) -> dict[str, dict[str, dict[str, float]]]:
    """Per cell, per phase: weight, tokens and epochs.

    Inside a source the sampler draws sequence windows uniformly, so each of a source's cells contributes in
    proportion to the tokens it holds and is repeated as often as the source as a whole (its epochs).
    A cell whose source has no tokens yet (planned before the data exists) gets an equal share.
    """
    result: dict[str, dict[str, dict[str, float]]] = {}
    for phase in plan.phases:
        for source in phase.sources:
            available = [max(0, int(cell_tokens.get(cell, 0))) for cell in source.cells]
            total = sum(available)
            for cell, tokens in zip(source.cells, available, strict=True):
                share = tokens / total if total else 1 / len(source.cells)
                entry = result.setdefault(cell, {}).setdefault(
                    phase.name, {"weight": 0.0, "tokens": 0.0, "epochs": 0.0, "tokens_available": 0.0}
                )
                entry["weight"] += source.weight * share
                entry["tokens"] += source.tokens * share
                entry["tokens_available"] = float(tokens)
                entry["epochs"] = entry["tokens"] / tokens if tokens else source.epochs
    return dict(sorted(result.items()))


def _current_first(before: list[str], now: list[str]) -> list[str]:
    """The names in `now`'s order, then those only in `before`."""
    return [*now, *(name for name in before if name not in now)]


#: A source's changes the page lists, in this order (a change of block_sequences shows as one of weight).
SOURCE_FIELDS = ("weight", "tokens", "epochs", "tokens_available")


def _fields(changes: dict[str, list[Any]], names: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
    shown = [name for name in names if name in changes] if names is not None else list(changes)
    return [{"field": name, "old": changes[name][0], "new": changes[name][1]} for name in shown]


def _source_rows(sources: list[dict[str, Any]], order: list[str]) -> list[dict[str, Any]]:
    by_name = {source["name"]: source for source in sources}
    rows = []
    for name in _current_first(list(by_name), order):
        if name in by_name:
            source = by_name[name]
            whole = source["status"] in ("added", "removed")
            rows.append(
                {
                    "name": name,
                    "status": source["status"],
                    "fields": [] if whole else _fields(source["changes"], SOURCE_FIELDS),
                }
            )
    return rows


def plan_changes(previous: MixturePlan, current: MixturePlan) -> dict[str, Any]:
    """What changed from `previous` to `current`, as the page's rows.

    `settings`: the run's fields that differ; `phases`: every phase of either plan (the current plan's
    order, then removed ones), each `added`, `removed`, `changed` or `unchanged`, with the fields that
    differ and its sources that were added, removed or changed (again the current order first);
    `changed`: whether anything did.
    """
    diff = diff_plans(previous, current)
    by_name = {phase["name"]: phase for phase in diff["phases"]}
    now = {phase.name: phase for phase in current.phases}
    phases = []
    for name in _current_first([phase.name for phase in previous.phases], list(now)):
        phase = by_name.get(name)
        if phase is None:
            phases.append({"name": name, "status": "unchanged", "fields": [], "sources": []})
            continue
        order = [source.name for source in now[name].sources] if name in now else []
        whole = phase["status"] in ("added", "removed")
        phases.append(
            {
                "name": name,
                "status": phase["status"],
                "fields": [] if whole else _fields(phase["changes"]),
                "sources": _source_rows(phase["sources"], order),
            }
        )
    settings = _fields(dict(sorted(diff["fields"].items())))
    return {
        "settings": settings,
        "phases": phases,
        "changed": bool(settings) or any(phase["status"] != "unchanged" for phase in phases),
    }
