"""The mixture plan as the report sees it: a JSON dict in the docs/formats.md "Mixture plan" shape.

The report works on the plan dict rather than on `tokenmill.mixtures` objects, so that a page can be built
from a saved plan (`--plan`) and so that this package does not depend on the planner's internals. This
module checks the dict, spreads each source's tokens over its cells, and compares two revisions.
"""

from __future__ import annotations

import math
from typing import Any

from tokenmill.reports.inputs import InputError

PHASE_FIELDS = ("name", "tokens", "steps", "start_step", "end_step", "sources")
SOURCE_FIELDS = ("name", "cells", "weight", "tokens", "tokens_available", "epochs")


def validate_plan(plan: Any, origin: str) -> dict[str, Any]:
    """Refuse a plan that lacks the fields the page reads, naming the first one missing."""
    if not isinstance(plan, dict):
        raise InputError(f"{origin}: a mixture plan must be a JSON object")
    phases = plan.get("phases")
    if not isinstance(phases, list) or not phases:
        raise InputError(f"{origin}: the mixture plan has no 'phases' list")
    for i, phase in enumerate(phases):
        if not isinstance(phase, dict):
            raise InputError(f"{origin}: phases[{i}] is not an object")
        for key in PHASE_FIELDS:
            if key not in phase:
                raise InputError(f"{origin}: phases[{i}] has no '{key}'")
        if not isinstance(phase["sources"], list):
            raise InputError(f"{origin}: phases[{i}].sources is not a list")
        for j, source in enumerate(phase["sources"]):
            if not isinstance(source, dict):
                raise InputError(f"{origin}: phases[{i}].sources[{j}] is not an object")
            for key in SOURCE_FIELDS:
                if key not in source:
                    raise InputError(f"{origin}: phases[{i}].sources[{j}] has no '{key}'")
            if not isinstance(source["cells"], list):
                raise InputError(f"{origin}: phases[{i}].sources[{j}].cells is not a list")
    return plan


def cell_allocation(
    plan: dict[str, Any], cell_tokens: dict[str, int]
) -> dict[str, dict[str, dict[str, float]]]:
    """Per cell, per phase: weight, tokens and epochs.

    Inside a source the sampler draws sequence windows uniformly, so each of a source's cells contributes in
    proportion to the tokens it holds and is repeated as often as the source as a whole (its epochs).
    A cell whose source has no tokens yet (planned before the data exists) gets an equal share.
    """
    result: dict[str, dict[str, dict[str, float]]] = {}
    for phase in plan["phases"]:
        for source in phase["sources"]:
            cells = [str(c) for c in source["cells"]]
            available = [max(0, int(cell_tokens.get(c, 0))) for c in cells]
            total = sum(available)
            for cell, tokens in zip(cells, available, strict=True):
                share = tokens / total if total else 1 / len(cells)
                entry = result.setdefault(cell, {}).setdefault(
                    phase["name"], {"weight": 0.0, "tokens": 0.0, "epochs": 0.0, "tokens_available": 0.0}
                )
                entry["weight"] += float(source["weight"]) * share
                entry["tokens"] += float(source["tokens"]) * share
                entry["tokens_available"] = float(tokens)
                entry["epochs"] = entry["tokens"] / tokens if tokens else float(source.get("epochs") or 0.0)
    return dict(sorted(result.items()))


def _changed(old: Any, new: Any) -> bool:
    if isinstance(old, float | int) and isinstance(new, float | int):
        return not math.isclose(float(old), float(new), rel_tol=1e-9, abs_tol=1e-12)
    return old != new


def diff_plans(previous: dict[str, Any], current: dict[str, Any]) -> dict[str, Any]:
    """What changed from `previous` to `current`: top-level settings, phases and their sources.

    Phases and sources are matched by name. Every entry carries a status (added, removed, changed,
    unchanged) and, where both sides exist, (old, new) pairs for the fields that differ.
    """
    settings = [
        {"field": key, "old": previous.get(key), "new": current.get(key)}
        for key in sorted(set(previous) | set(current))
        if key != "phases"
        and not isinstance(previous.get(key), dict | list)
        and not isinstance(current.get(key), dict | list)
        and _changed(previous.get(key), current.get(key))
    ]
    old_phases = {p["name"]: p for p in previous.get("phases", [])}
    new_phases = {p["name"]: p for p in current.get("phases", [])}
    order = [p["name"] for p in current.get("phases", [])] + [
        p["name"] for p in previous.get("phases", []) if p["name"] not in new_phases
    ]
    phases = []
    for name in order:
        old, new = old_phases.get(name), new_phases.get(name)
        if old is None or new is None:
            phase = old or new or {}
            phases.append(
                {
                    "name": name,
                    "status": "added" if old is None else "removed",
                    "fields": [],
                    "sources": [
                        {"name": s["name"], "status": "added" if old is None else "removed", "fields": []}
                        for s in phase.get("sources", [])
                    ],
                }
            )
            continue
        fields = [
            {"field": key, "old": old.get(key), "new": new.get(key)}
            for key in ("tokens", "steps", "start_step", "end_step")
            if _changed(old.get(key), new.get(key))
        ]
        old_sources = {s["name"]: s for s in old["sources"]}
        new_sources = {s["name"]: s for s in new["sources"]}
        sources = []
        for source_name in [s["name"] for s in new["sources"]] + [
            s["name"] for s in old["sources"] if s["name"] not in new_sources
        ]:
            a, b = old_sources.get(source_name), new_sources.get(source_name)
            if a is None or b is None:
                sources.append(
                    {"name": source_name, "status": "added" if a is None else "removed", "fields": []}
                )
                continue
            source_fields = [
                {"field": key, "old": a.get(key), "new": b.get(key)}
                for key in ("weight", "tokens", "epochs", "tokens_available", "cells")
                if _changed(a.get(key), b.get(key))
            ]
            sources.append(
                {
                    "name": source_name,
                    "status": "changed" if source_fields else "unchanged",
                    "fields": source_fields,
                }
            )
        changed = bool(fields) or any(s["status"] != "unchanged" for s in sources)
        phases.append(
            {
                "name": name,
                "status": "changed" if changed else "unchanged",
                "fields": fields,
                "sources": sources,
            }
        )
    return {
        "settings": settings,
        "phases": phases,
        "changed": bool(settings) or any(p["status"] != "unchanged" for p in phases),
    }
