"""The planner: a mixture spec plus token counts -> steps, tokens and epochs per phase and source.

How the numbers are made (docs/mixtures.md says the same for users):

* A step is `batch_size` sequences of `sequence_length` tokens. A mixture block is `block_size`
  sequences; the sampler fills each block with an exact number of sequences per source. Phase boundaries
  must fall on whole steps (the trainer switches phase at a step) and whole blocks (a block belongs to one
  phase), so they are rounded, half up, to multiples of lcm(batch_size, block_size) sequences: the
  `block_steps` of the plan. The last phase ends at total_tokens rounded the same way.
* A spec that gives `total_steps` is a run of that many steps (the reference run: 390,251 steps of a
  mixture made for an 18.75T budget): each phase keeps its share of the budget as a share of the steps,
  floored to a whole step and then down to a whole granule (Marin's rule: midtraining from 80% of the
  steps, rounded down to a block boundary), and the last phase ends exactly at total_steps. Its last block
  may then be partial: the sampler fills a block's positions in a keyed random order, so a partial block
  of r sequences draws each source's r/B share of its block_sequences in expectation; the plan counts the
  largest-remainder apportionment of r over the block's counts, so that the phase's sources still add up to
  its tokens exactly (each source within one sequence of the expectation).
* Inside a phase, a source's sequences per block (`block_sequences`) come from its weight by largest
  remainder (Hamilton) apportionment of the block, ties to the source listed first, so that they sum to
  exactly `block_size`. A source's tokens in a phase are block_sequences x blocks x sequence_length,
  which is exactly what a sampler that fills blocks this way draws. The plan's `weight` is the realized
  block_sequences / block_size; `weight_requested` is the spec's weight, normalized.
* A source's tokens available are the sum over the cells it selects in tokens/counts.json, or its
  declared count when planning without counts. In a slice (simulated epoching) they are scaled by the
  slice's share of the full run, so the small run repeats each source as often as the big one.
* Evaluation sets (the spec's `evaluation`) have zero training weight: held-out slices of the cells that
  its selectors match, grouped per domain, per cell or all in one, counted from counts.json's `heldout_*`
  fields, and external sets counted from their manifests in `<tokens>/eval/<name>/`.
* max_epochs caps a source's tokens over the whole run. Going over is an error that gives the numbers,
  unless the spec sets `shortfall: redistribute`: then, phase by phase, a source gets at most what its
  remaining allowance pays for, and the rest of the block goes to the phase's other sources by weight
  (water-filling), which is an error only when every source of the phase is exhausted.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from tokenmill.cells import parse_cell
from tokenmill.errors import FormatError
from tokenmill.formats import plan as plan_format
from tokenmill.formats.plan import EvalSetPlan, MixturePlan, PhasePlan, SourcePlan, SourceTotal
from tokenmill.formats.tokens import (
    TokenCounts,
    counts_from_json,
    eval_manifest_path,
    heldout_manifest_path,
    read_counts,
    read_eval_manifest,
)
from tokenmill.mixtures.errors import Issue, MixtureError, NeedsCounts, format_path
from tokenmill.mixtures.spec import Mixture, MixturePhase, Source
from tokenmill.units import format_count

# A realized weight this far (relative) from the asked one means the block is too small for the weight.
WEIGHT_DEVIATION_WARNING = 0.10


def _fc(value: float | int | Fraction) -> str:
    return format_count(float(value), 4)


def block_counts(weights: Sequence[float | Fraction], block_size: int) -> list[int]:
    """Sequences per block for each weight: largest remainder apportionment of block_size.

    Weights need not sum to 1. Each count is the floor or ceiling of weight / sum x block_size, the
    counts sum to block_size, and ties in the remainder go to the earlier weight. Exact (rational)
    arithmetic, so that the same weights give the same counts on every machine.
    """
    exact = [w if isinstance(w, Fraction) else Fraction(repr(float(w))) for w in weights]
    total = sum(exact, Fraction(0))
    if block_size < 0 or any(w < 0 for w in exact):
        raise ValueError("block_counts needs a non-negative block size and weights")
    if total == 0:
        if block_size:
            raise ValueError("block_counts needs a positive weight")
        return [0] * len(exact)
    quotas = [w * block_size / total for w in exact]
    counts = [math.floor(q) for q in quotas]
    rest = block_size - sum(counts)
    order = sorted(range(len(exact)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:rest]:
        counts[i] += 1
    return counts


def _water_fill(
    weights: dict[str, Fraction], caps: dict[str, int], block_size: int
) -> tuple[dict[str, int], int]:
    """Apportion the block by weight, no source over its cap; the capped sources' rest goes to the others.

    Returns the counts and how many sequences of the block could not be placed (0 unless all are capped).
    A source over its cap at one level is over it at any higher level, so capping every offender at once
    and re-apportioning the rest among the others is the exact water-filling solution.
    """
    counts: dict[str, int] = {}
    active = dict(weights)
    left = block_size
    while active and left > 0:
        names = list(active)
        alloc = dict(zip(names, block_counts([active[n] for n in names], left), strict=True))
        over = [name for name in names if alloc[name] > caps[name]]
        if not over:
            counts.update(alloc)
            return counts, 0
        for name in over:
            counts[name] = caps[name]
            left -= caps[name]
            del active[name]
    for name in active:
        counts.setdefault(name, 0)
    return counts, left


def load_counts(path: str | os.PathLike[str]) -> TokenCounts:
    """tokens/counts.json to plan against; MixtureError if it is missing or breaks the format."""
    path = os.fspath(path)
    try:
        return read_counts(path)
    except FileNotFoundError:
        raise MixtureError(f"no such counts file: {path}", file=path) from None
    except OSError as error:
        raise MixtureError(f"cannot read counts {path}: {error}", file=path) from None
    except FormatError as error:
        raise MixtureError(str(error), file=path) from None


def _catalog(counts: TokenCounts, warnings: list[str]) -> dict[str, int]:
    """counts.json -> {cell: tokens}; a cell whose name is not a cell is left out, with a warning."""
    catalog: dict[str, int] = {}
    for name, entry in counts.cells.items():
        try:
            parse_cell(name)
        except ValueError as error:
            warnings.append(f"counts.json: cells.{name}: ignored: {error}")
            continue
        catalog[name] = entry.tokens
    return catalog


# ---------------------------------------------------------------------------------------------------------
# Planning


@dataclass
class _Resolved:
    source: Source
    cells: list[str]
    available_full: int
    available: int  # after slicing
    tokens_from: str
    allowance: int  # max_epochs x available, in tokens
    empty_reason: str = ""


def plan_mixture(
    mixture: Mixture,
    counts: TokenCounts | Mapping[str, Any] | None = None,
    tokens_dir: str | None = None,
) -> MixturePlan:
    """Plan a mixture against tokens/counts.json (`tokenmill.formats.tokens.read_counts`, or the same as a
    dict) or, with None, against the spec's declared counts. `tokens_dir` (the folder of counts.json) is
    where external evaluation sets are counted from (`eval/<name>/manifest.json`); without it they are
    listed uncounted.

    Raises MixtureError, pointing at the spec's lines, when the plan cannot be made: a phase too small
    for one block, a source with no tokens, a source over its max_epochs (with the numbers); and for a
    catalog that breaks the format, naming the field.
    """
    warnings: list[str] = []
    if counts is not None and not isinstance(counts, TokenCounts):
        try:
            counts = counts_from_json(counts)
        except FormatError as error:
            raise MixtureError(str(error)) from None
    catalog = _catalog(counts, warnings) if counts is not None else None
    tokenizer_sha256 = None
    if counts is not None:
        counts_tokenizer = counts.tokenizer.name if counts.tokenizer else None
        tokenizer_sha256 = (counts.tokenizer.sha256 if counts.tokenizer else None) or None
        if counts_tokenizer and mixture.tokenizer and counts_tokenizer != mixture.tokenizer:
            warnings.append(
                f"tokenizer: the mixture names {mixture.tokenizer!r} but counts.json was made with "
                f"{counts_tokenizer!r}; token counts do not carry over between tokenizers"
            )

    length, batch, block = mixture.sequence_length, mixture.batch_size, mixture.block_size
    tokens_per_step = length * batch
    block_steps = math.lcm(batch, block) // batch
    ends = _phase_ends(mixture, block_steps)
    starts = [0, *ends[:-1]]

    resolved = _resolve_sources(mixture, catalog, warnings)

    issues: list[Issue] = []
    remaining = {name: item.allowance for name, item in resolved.items()}
    used = dict.fromkeys(resolved, 0)
    phase_plans: list[PhasePlan] = []
    for phase, start, end in zip(mixture.phases, starts, ends, strict=True):
        steps = end - start
        blocks, partial = divmod(steps * batch, block)
        sequence_tokens = blocks * length  # tokens that one sequence per block gives over the phase
        # The caps count a partial block whole: a source never goes over its allowance.
        cap_tokens = (blocks + (1 if partial else 0)) * length
        positive = {name: weight for name, weight in phase.weights.items() if weight > 0}
        asked = dict(zip(positive, block_counts(list(positive.values()), block), strict=True))
        for name in positive:
            item = resolved[name]
            if item.available == 0:
                where = phase.weight_where[name]
                message = f"source has no tokens: {item.empty_reason}"
                if mixture.shortfall == "error":
                    issues.append(where.issue(message))
                else:
                    warnings.append(str(where.issue(message + "; its weight goes to the other sources")))
        if mixture.shortfall == "redistribute":
            caps = {name: remaining[name] // cap_tokens for name in positive}
            given, unplaced = _water_fill(positive, caps, block)
            if unplaced:
                capacity = sum(caps.values()) * cap_tokens
                issues.append(
                    phase.where.issue(
                        f"not enough tokens even with shortfall: redistribute: within max_epochs its sources "
                        f"can give {_fc(capacity)} tokens, the phase needs {_fc(blocks * block * length)}"
                    )
                )
                given = {name: min(asked[name], caps[name]) for name in positive}
            short = [name for name in positive if given[name] < asked[name] and resolved[name].available > 0]
            if short and not unplaced:
                moved = sum(asked[name] - given[name] for name in short) * sequence_tokens
                names = ", ".join(short[:5]) + (f" and {len(short) - 5} more" if len(short) > 5 else "")
                warnings.append(
                    f"{format_path(phase.where.path)} ({phase.name}): {names} at max_epochs; "
                    f"{_fc(moved)} tokens went to the other sources by weight"
                )
        else:
            given = asked
        names = list(phase.weights)
        in_partial = dict(zip(names, block_counts([given.get(n, 0) for n in names], partial), strict=True))
        plans = []
        for name, weight in phase.weights.items():
            item = resolved[name]
            count = given.get(name, 0)
            tokens = count * sequence_tokens + in_partial[name] * length
            remaining[name] -= tokens
            used[name] += tokens
            if weight > 0 and count == 0 and asked.get(name) == 0:
                warnings.append(
                    str(
                        phase.weight_where[name].issue(
                            f"weight {float(weight):.4g} rounds to 0 of {block} sequences per block, so the "
                            "source gets nothing; raise block_size or the weight"
                        )
                    )
                )
            elif (
                count
                and abs(count / block - weight) > WEIGHT_DEVIATION_WARNING * weight
                and count == asked.get(name)
            ):
                warnings.append(
                    str(
                        phase.weight_where[name].issue(
                            f"weight {float(weight):.4g} becomes {count}/{block} = {count / block:.4g} "
                            "per block; raise block_size for a closer match"
                        )
                    )
                )
            plans.append(
                SourcePlan(
                    name=name,
                    cells=item.cells,
                    weight=count / block,
                    tokens=tokens,
                    tokens_available=item.available,
                    epochs=tokens / item.available if item.available else 0.0,
                    weight_requested=float(weight),
                    block_sequences=count,
                    selectors=[selector.text for selector in item.source.selectors],
                    max_epochs=item.source.max_epochs,
                )
            )
        phase_plans.append(
            PhasePlan(
                name=phase.name,
                tokens=steps * tokens_per_step,
                steps=steps,
                start_step=start,
                end_step=end,
                tokens_requested=round(phase.budget),
                blocks=blocks,
                sources=plans,
                partial_block_sequences=partial,
            )
        )
        if catalog is not None:
            warnings.extend(_overlaps(phase, resolved))
    if mixture.shortfall == "error":
        issues.extend(_over_cap(mixture, resolved, used, phase_plans))
    evaluation = None
    if mixture.evaluation is not None:
        evaluation, evaluation_issues = _evaluation_sets(mixture, counts, tokens_dir, warnings)
        issues.extend(evaluation_issues)
    if issues:
        raise MixtureError(issues)

    totals = {
        name: SourceTotal(
            name=name,
            cells=item.cells,
            selectors=[selector.text for selector in item.source.selectors],
            tokens_available=item.available,
            tokens=used[name],
            epochs=used[name] / item.available if item.available else 0.0,
            max_epochs=item.source.max_epochs,
            tokens_from=item.tokens_from,
            tokens_available_full=item.available_full,
        )
        for name, item in resolved.items()
    }
    slice_info = None
    if mixture.slice is not None:
        slice_info = plan_format.PlanSlice(
            of=mixture.slice.of,
            file=mixture.slice.path,
            fraction=float(mixture.slice.fraction),
            of_total_tokens=mixture.slice.of_total_tokens,
        )
    total_steps = ends[-1]
    return MixturePlan(
        format_version=plan_format.FORMAT_VERSION,
        name=mixture.name,
        description=mixture.description,
        tokenizer=mixture.tokenizer,
        tokenizer_sha256=tokenizer_sha256,
        total_tokens=mixture.total_tokens,
        sequence_length=length,
        batch_size=batch,
        block_size=block,
        tokens_per_step=tokens_per_step,
        phases=phase_plans,
        total_steps=total_steps,
        planned_tokens=total_steps * tokens_per_step,
        block_steps=block_steps,
        shortfall=mixture.shortfall,
        tokens_from="counts.json" if catalog is not None else "declared",
        illustrative=mixture.illustrative and catalog is None,
        total_steps_given=mixture.total_steps is not None,
        provenance=mixture.provenance,
        slice=slice_info,
        sources=totals,
        cells=_cell_totals(catalog, resolved, used, mixture, warnings) if catalog is not None else {},
        warnings=warnings,
        # Only when the spec names evaluation sets, so that older plans keep their bytes (and plan_sha256).
        **({"evaluation": evaluation} if evaluation is not None else {}),
    )


def _phase_ends(mixture: Mixture, block_steps: int) -> list[int]:
    """Each phase's end step: the cumulative budget rounded, half up, to whole granules of block_steps.

    With total_steps: the cumulative share of the budget times total_steps, floored to a step and then down
    to a granule; the last phase ends at total_steps.
    """
    granule_tokens = block_steps * mixture.batch_size * mixture.sequence_length
    budget = sum((phase.budget for phase in mixture.phases), Fraction(0))
    ends: list[int] = []
    cumulative = Fraction(0)
    for index, phase in enumerate(mixture.phases):
        cumulative += phase.budget
        last = index == len(mixture.phases) - 1
        if mixture.total_steps is not None:
            if last:
                ends.append(mixture.total_steps)
            else:
                step = math.floor(cumulative / budget * mixture.total_steps) if budget else 0
                ends.append(step // block_steps * block_steps)
            continue
        # The last phase ends at the run's budget even when shares summed to 1 only within tolerance.
        target = Fraction(mixture.total_tokens) if last else cumulative
        ends.append(math.floor(target / granule_tokens + Fraction(1, 2)) * block_steps)
    issues = []
    for phase, start, end in zip(mixture.phases, [0, *ends[:-1]], ends, strict=True):
        if end <= start:
            issues.append(
                phase.where.issue(
                    f"{_fc(phase.budget)} tokens round to no steps: phase boundaries fall on whole mixture "
                    f"blocks, here {block_steps} step(s) of {mixture.batch_size * mixture.sequence_length:,} "
                    "tokens; give the phase more tokens or use a smaller block_size or batch_size"
                )
            )
    if issues:
        raise MixtureError(issues)
    return ends


def _resolve_sources(
    mixture: Mixture, catalog: dict[str, int] | None, warnings: list[str]
) -> dict[str, _Resolved]:
    """Tokens available to every source a phase weighs (in order of first use)."""
    fraction = mixture.slice.fraction if mixture.slice else Fraction(1)
    wanted: dict[str, bool] = {}
    for phase in mixture.phases:
        for name, weight in phase.weights.items():
            wanted[name] = wanted.get(name, False) or weight > 0
    uncounted: list[Source] = []
    resolved: dict[str, _Resolved] = {}
    for name, positive in wanted.items():
        source = mixture.sources[name]
        cells = sorted({cell for selector in source.selectors if (cell := selector.cell)})
        reason = ""
        if catalog is not None and source.selectors:
            cells = sorted({cell for selector in source.selectors for cell in selector.select(catalog)})
            available = sum(catalog[cell] for cell in cells)
            tokens_from = "counts"
            what = ", ".join(selector.text for selector in source.selectors)
            reason = (
                f"{what} matches no cell in counts.json"
                if not cells
                else "its cells hold 0 tokens in counts.json"
            )
        elif source.declared_tokens is not None:
            available = source.declared_tokens
            tokens_from = "declared"
            reason = "declared tokens: 0"
            if catalog is not None and positive:
                warnings.append(
                    str(source.where.issue("no cells, only a declared count: the sampler cannot draw it"))
                )
        else:
            available, tokens_from = 0, "declared"
            if positive:
                uncounted.append(source)
        sliced = math.floor(available * fraction)
        if available and not sliced:
            reason = f"{available:,} tokens sliced to {float(fraction):.4g} of the full run round to 0"
        resolved[name] = _Resolved(
            source=source,
            cells=cells,
            available_full=available,
            available=sliced,
            tokens_from=tokens_from,
            allowance=math.floor(Fraction(repr(source.max_epochs)) * sliced),
            empty_reason=reason,
        )
    if uncounted:
        more = f" (and {len(uncounted) - 1} more sources)" if len(uncounted) > 1 else ""
        raise NeedsCounts(
            [
                uncounted[0].where.issue(
                    "no declared tokens, and no tokens/counts.json to count its cells"
                    f"{more}: plan with --counts"
                )
            ]
        )
    return resolved


def _over_cap(
    mixture: Mixture, resolved: dict[str, _Resolved], used: dict[str, int], phases: list[PhasePlan]
) -> list[Issue]:
    issues = []
    for name, item in resolved.items():
        if item.available == 0 or used[name] <= item.allowance:
            continue
        parts = [
            f"{phase.name} {_fc(source.tokens)}"
            for phase in phases
            for source in phase.sources
            if source.name == name and source.tokens
        ]
        issues.append(
            item.source.where.issue(
                f"needs {_fc(used[name])} tokens ({', '.join(parts)}) = "
                f"{used[name] / item.available:.4g} epochs of its {_fc(item.available)}; "
                f"max_epochs {item.source.max_epochs:g} allows {_fc(item.allowance)} "
                "(raise max_epochs, lower its weights, or set shortfall: redistribute)"
            )
        )
    return issues


def _overlaps(phase: MixturePhase, resolved: dict[str, _Resolved]) -> list[str]:
    owners: dict[str, list[str]] = {}
    for name, weight in phase.weights.items():
        if weight > 0:
            for cell in resolved[name].cells:
                owners.setdefault(cell, []).append(name)
    shared = [f"{cell} ({', '.join(names)})" for cell, names in owners.items() if len(names) > 1]
    if not shared:
        return []
    more = f" and {len(shared) - 3} more" if len(shared) > 3 else ""
    return [
        f"{format_path(phase.where.path)} ({phase.name}): cells drawn by more than one source: "
        f"{'; '.join(shared[:3])}{more}; their epochs add up"
    ]


def _cell_totals(
    catalog: dict[str, int],
    resolved: dict[str, _Resolved],
    used: dict[str, int],
    mixture: Mixture,
    warnings: list[str],
) -> dict[str, dict[str, Any]]:
    """Tokens drawn from each cell: a source's tokens spread over its cells by size (uniform sampling).

    max_epochs is enforced per source; a cell that two sources draw (web/* in one phase, web/quality>=3
    in the next) repeats as often as both together, so such a cell over its sources' cap is a warning.
    """
    fraction = float(mixture.slice.fraction) if mixture.slice else 1.0
    drawn = dict.fromkeys(catalog, 0.0)
    drawers: dict[str, list[str]] = {}
    for name, item in resolved.items():
        if item.available_full and used[name]:
            for cell in item.cells:
                drawn[cell] += used[name] * catalog[cell] / item.available_full
                drawers.setdefault(cell, []).append(name)
    result = {}
    over = []
    for cell in sorted(catalog):
        available = catalog[cell] * fraction
        epochs = drawn[cell] / available if available else 0.0
        result[cell] = {
            "tokens_available": math.floor(available),
            "tokens": round(drawn[cell]),
            "epochs": epochs,
        }
        names = drawers.get(cell, [])
        cap = min((resolved[name].source.max_epochs for name in names), default=math.inf)
        if len(names) > 1 and epochs > cap * (1 + 1e-9):
            over.append(f"{cell} {epochs:.4g} epochs by {', '.join(names)}")
    if over:
        more = f" and {len(over) - 3} more" if len(over) > 3 else ""
        warnings.append(
            f"cells drawn by several sources repeat more than their max_epochs: {'; '.join(over[:3])}{more}"
        )
    return result


def _heldout_groups(cell: str, group_by: str, sources: dict[str, list[str]]) -> list[str]:
    """The evaluation sets a matched cell's held-out slice belongs to. By source, a cell is in the set of
    every source that draws it (whatever its weights, so that every mixture of a swarm has the same sets),
    and in `heldout/unsourced` when no source does."""
    if group_by == "cell":
        return [f"heldout/{cell}"]
    if group_by == "domain":
        return [f"heldout/domain={parse_cell(cell)[0]}"]
    if group_by == "source":
        return [f"heldout/source={name}" for name, cells in sources.items() if cell in cells] or [
            "heldout/unsourced"
        ]
    return ["heldout"]


def _evaluation_sets(
    mixture: Mixture, counts: TokenCounts | None, tokens_dir: str | None, warnings: list[str]
) -> tuple[list[EvalSetPlan], list[Issue]]:
    """The run's evaluation sets, counted where counts are known; issues for what cannot be evaluated."""
    evaluation = mixture.evaluation
    issues: list[Issue] = []
    sets: list[EvalSetPlan] = []
    texts = [selector.text for selector in evaluation.heldout]
    where = evaluation.where
    if evaluation.heldout and counts is None:
        sets.append(
            EvalSetPlan(
                name="heldout",
                kind="heldout",
                cells=sorted({cell for s in evaluation.heldout if (cell := s.cell)}),
                selectors=texts,
                manifests=[],
                tokens=None,
                documents=None,
                bytes=None,
            )
        )
    elif evaluation.heldout and counts is not None:
        rule = counts.heldout
        matched = sorted(
            {cell for s in evaluation.heldout for cell in s.select(counts.cells) if _is_cell(cell)}
        )
        if rule is None or not rule.active:
            issues.append(
                where.issue(
                    "held-out slices asked for, but counts.json was made without them (tokenize with "
                    "--heldout-fraction 0, or before held-out slices existed): tokenize again"
                )
            )
        elif not matched:
            issues.append(where.issue(f"heldout: {', '.join(texts)} matches no cell in counts.json"))
        else:
            sources = {
                name: {cell for selector in source.selectors for cell in selector.select(counts.cells)}
                for name, source in mixture.sources.items()
            }
            groups: dict[str, list[str]] = {}
            for cell in matched:
                for group in _heldout_groups(cell, evaluation.group_by, sources):
                    groups.setdefault(group, []).append(cell)
            empty = []
            for name, cells in sorted(groups.items()):
                entries = [counts.cells[cell] for cell in cells]
                documents = sum(entry.heldout_documents or 0 for entry in entries)
                if documents == 0:
                    empty.append(name)
                    continue
                sets.append(
                    EvalSetPlan(
                        name=name,
                        kind="heldout",
                        cells=cells,
                        selectors=texts,
                        manifests=[
                            counts.cells[cell].heldout_manifest or heldout_manifest_path(cell)
                            for cell in cells
                        ],
                        tokens=sum(entry.heldout_tokens or 0 for entry in entries),
                        documents=documents,
                        bytes=sum(entry.heldout_bytes or 0 for entry in entries),
                    )
                )
            if empty:
                more = f" and {len(empty) - 5} more" if len(empty) > 5 else ""
                warnings.append(
                    f"evaluation: {', '.join(empty[:5])}{more} hold no held-out documents (cells too small "
                    "for the held-out rule) and are left out"
                )
    for index, name in enumerate(evaluation.sets):
        relative = eval_manifest_path(name)
        if tokens_dir is None:
            sets.append(
                EvalSetPlan(
                    name=name,
                    kind="external",
                    cells=[],
                    selectors=[],
                    manifests=[relative],
                    tokens=None,
                    documents=None,
                    bytes=None,
                )
            )
            continue
        path = os.path.join(tokens_dir, relative)
        set_where = f"evaluation.sets[{index}]"
        try:
            manifest = read_eval_manifest(path)
        except FileNotFoundError:
            issues.append(
                where.issue(
                    f"{set_where}: evaluation set {name}: no {path} (make it with `tokenmill tokenize-eval "
                    f"--name {name} --input ... --tokenizer ... --output {tokens_dir}`)"
                )
            )
            continue
        except (OSError, FormatError) as error:
            issues.append(where.issue(f"{set_where}: evaluation set {name}: {error}"))
            continue
        expected = counts.tokenizer.sha256 if counts is not None and counts.tokenizer else None
        if expected and manifest.tokenizer.sha256 != expected:
            issues.append(
                where.issue(
                    f"{set_where}: evaluation set {name} was made with tokenizer sha256 "
                    f"{manifest.tokenizer.sha256} ({manifest.tokenizer.name}), but counts.json with "
                    f"{expected}"
                )
            )
            continue
        sets.append(
            EvalSetPlan(
                name=name,
                kind="external",
                cells=[],
                selectors=[],
                manifests=[relative],
                tokens=manifest.tokens,
                documents=manifest.documents,
                bytes=manifest.bytes,
            )
        )
    return sets, issues


def _is_cell(name: str) -> bool:
    try:
        parse_cell(name)
    except ValueError:
        return False
    return True
