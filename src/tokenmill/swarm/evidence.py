"""Evidence keyed to content: which data a source and an evaluation set are, whatever they are called.

A cell's content key is a hash of its training manifest's shards, in order (documents, tokens and the two
sha256 of each), without the cell's name; a source's is a hash of its cells' keys, sorted; an evaluation
set's a hash of its manifests' keys. Re-bucketing, re-deduplicating or re-tokenizing a corpus changes the
keys of the sources it touches; renaming a cell (or a source) changes none. A swarm records the keys it was
run on, and `fit` and `propose` compare them with the corpus they are given (`compare_sources`).

Cost: one manifest read per cell (a few KB each; a 200-cell corpus is 200 small reads, local or gs://).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from tokenmill import storage
from tokenmill.formats.plan import EvalSetPlan, MixturePlan
from tokenmill.formats.swarm import SwarmEvalSet, SwarmSource
from tokenmill.formats.tokens import COUNTS, read_counts, read_eval_manifest, read_manifest


def _digest(value: object) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _shards_key(shards: Iterable) -> str:
    return _digest([[s.documents, s.tokens, s.bin_sha256, s.idx_sha256] for s in shards])


def cell_contents(tokens_dir: str, cells: Iterable[str]) -> dict[str, str]:
    """cell -> content key of its training shards (from its manifest.json under tokens_dir)."""
    counts = read_counts(storage.join(tokens_dir, COUNTS))
    keys = {}
    for cell in cells:
        if cell not in counts.cells:
            raise ValueError(f"{storage.join(tokens_dir, COUNTS)}: no cell {cell}")
        keys[cell] = _shards_key(read_manifest(storage.join(tokens_dir, counts.manifest_path(cell))).shards)
    return keys


def combined(keys: Iterable[str]) -> str:
    """One key for a set of parts: their keys sorted, so that order and names do not count."""
    return _digest(sorted(keys))


def source_contents(plan: MixturePlan, tokens_dir: str, names: Sequence[str]) -> dict[str, str]:
    """source -> content key, for the sources `names` of a plan made against tokens_dir's counts.json."""
    cells = sorted({cell for name in names for cell in plan.sources[name].cells})
    per_cell = cell_contents(tokens_dir, cells)
    return {name: combined(per_cell[cell] for cell in plan.sources[name].cells) for name in names}


def eval_set_content(tokens_dir: str, eval_set: EvalSetPlan) -> str:
    """The content key of an evaluation set: its manifests' shards (held-out slices or an external set)."""
    keys = []
    for manifest in eval_set.manifests:
        keys.append(_shards_key(read_eval_manifest(storage.join(tokens_dir, manifest)).shards))
    return combined(keys)


def eval_sets(plan: MixturePlan, tokens_dir: str) -> list[SwarmEvalSet]:
    """The plan's evaluation sets with their content keys."""
    return [
        SwarmEvalSet(
            name=s.name,
            kind=s.kind,
            content=eval_set_content(tokens_dir, s),
            tokens=s.tokens,
            bytes=s.bytes,
        )
        for s in plan.evaluation or []
    ]


@dataclass
class Comparison:
    """A swarm's sources against the corpus they are now: which are the same data (perhaps renamed), which
    changed, which are gone. `names` maps a recorded source to its current name."""

    names: dict[str, str] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)
    changed: list[str] = field(default_factory=list)  # same name, other content
    missing: list[str] = field(default_factory=list)  # neither the name nor the content is there

    @property
    def valid(self) -> bool:
        return not self.changed and not self.missing

    def describe(self) -> str:
        parts = []
        if self.changed:
            parts.append("content changed: " + ", ".join(self.changed))
        if self.missing:
            parts.append("not in the corpus (by name or by content): " + ", ".join(self.missing))
        if self.renamed:
            parts.append(
                "renamed, same content: " + ", ".join(f"{a} -> {b}" for a, b in self.renamed.items())
            )
        return "; ".join(parts) or "every source has the content the swarm ran on"


def compare_sources(recorded: Sequence[SwarmSource], current: Mapping[str, str]) -> Comparison:
    """Match recorded sources to current ones (name -> content key): by content first, then by name."""
    by_content: dict[str, list[str]] = {}
    for name, key in current.items():
        by_content.setdefault(key, []).append(name)
    result = Comparison()
    taken: set[str] = set()
    for source in recorded:
        candidates = [n for n in by_content.get(source.content, []) if n not in taken]
        if candidates:
            name = source.name if source.name in candidates else candidates[0]
            result.names[source.name] = name
            taken.add(name)
            if name != source.name:
                result.renamed[source.name] = name
        elif source.name in current:
            result.names[source.name] = source.name
            taken.add(source.name)
            result.changed.append(source.name)
        else:
            result.missing.append(source.name)
    return result
