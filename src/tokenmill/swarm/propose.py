"""`tokenmill mixture propose`: the weights of the searched phase that minimise the fitted objective, within
every source's epoch cap at the target budget, optionally pulled toward the prior.

    minimise   sum_m c_m metric_m(w) + kl_weight x KL(w || prior)
    subject to sum_j w_j = 1,
               0 <= w_j <= (max_epochs_j - epochs of the other phases) x tokens_j / phase tokens

solved with SLSQP (scipy) from several starts (the prior, the uniform mixture water-filled under the caps,
the best proxies, random draws), keeping the best; then rounded to whole sequences of a mixture block and
planned against the shards with `shortfall: error`, so that the mixture written is one the target run
can train. The prediction's spread: the log-linear models refitted on bootstrap resamples of the proxies,
and the Gaussian process's own standard deviation.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import optimize

from tokenmill import storage
from tokenmill.errors import UsageError
from tokenmill.formats.swarm import (
    FIT,
    PROPOSAL,
    SWARM,
    PredictedMetric,
    Proposal,
    SwarmManifest,
    write_proposal,
)
from tokenmill.formats.tokens import COUNTS
from tokenmill.mixtures import MixtureError, diff_plans, load_counts, load_mixture, plan_mixture
from tokenmill.swarm.build import Base, search_space, write_mixture
from tokenmill.swarm.evidence import Comparison
from tokenmill.swarm.fit import Evidence, collect, fit_gp, fit_metric_loglinear
from tokenmill.swarm.sample import SearchSpace, water_fill

BOOTSTRAPS = 64
RANDOM_STARTS = 16


@dataclass(frozen=True)
class Objective:
    """A weighted sum of metrics (`heldout_macro:bits_per_byte` by default)."""

    weights: Mapping[str, float]

    @staticmethod
    def parse(items: Sequence[str] | None) -> Objective:
        """`METRIC` or `METRIC=WEIGHT`, each; none: the held-out macro bits per byte."""
        if not items:
            return Objective({"heldout_macro:bits_per_byte": 1.0})
        weights = {}
        for item in items:
            metric, _, weight = item.partition("=")
            try:
                weights[metric] = float(weight) if weight else 1.0
            except ValueError:
                raise UsageError(f"--objective {item!r}: METRIC or METRIC=WEIGHT") from None
        return Objective(weights)


def kl(weights: np.ndarray, prior: np.ndarray) -> float:
    w = np.maximum(weights, 1e-12)
    return float(np.sum(w * np.log(w / np.maximum(prior, 1e-12))))


@dataclass
class Models:
    """The objective's metrics, fitted on every proxy: log-linear (per set) and a GP (per metric)."""

    evidence: Evidence
    objective: Objective
    seed: int

    def __post_init__(self) -> None:
        missing = [m for m in self.objective.weights if m not in self.evidence.values]
        if missing:
            raise UsageError(
                f"--objective: no such metric {', '.join(missing)}; the swarm measured "
                + ", ".join(sorted(self.evidence.values))
            )
        everything = np.arange(len(self.evidence.proxies))
        self.loglinear = {
            m: fit_metric_loglinear(self.evidence, m, everything) for m in self.objective.weights
        }
        self._gp = {}

    def value(self, weights: np.ndarray) -> float:
        return float(
            sum(c * self.loglinear[m].predict(weights)[0] for m, c in self.objective.weights.items())
        )

    def gp(self, metric: str):
        if metric not in self._gp:
            self._gp[metric] = fit_gp(self.evidence.weights, self.evidence.values[metric], self.seed)
        return self._gp[metric]

    def predicted(self, weights: np.ndarray, metrics: Sequence[str]) -> list[PredictedMetric]:
        """Each metric at `weights`: the log-linear value with its bootstrap spread, the GP's mean and std."""
        rng = np.random.default_rng(self.seed)
        n = len(self.evidence.proxies)
        samples = {m: [] for m in metrics}
        for _ in range(BOOTSTRAPS):
            rows = rng.integers(0, n, n)
            for m in metrics:
                samples[m].append(fit_metric_loglinear(self.evidence, m, rows).predict(weights)[0])
        result = []
        for m in metrics:
            full = fit_metric_loglinear(self.evidence, m, np.arange(n)).predict(weights)[0]
            mean, std = self.gp(m).predict(weights, return_std=True)
            result.append(
                PredictedMetric(
                    metric=m,
                    loglinear=float(full),
                    loglinear_std=float(np.std(samples[m], ddof=1)),
                    gp=float(mean[0]),
                    gp_std=float(std[0]),
                )
            )
        return result


def optimise(models: Models, space: SearchSpace, kl_weight: float, seed: int) -> np.ndarray:
    """The best weights found from every start (see the module's docstring)."""
    upper = space.upper
    k = len(space.names)
    rng = np.random.default_rng(seed)
    starts = [water_fill(space.prior, upper), space.capped_uniform()]
    order = np.argsort([models.value(w) for w in models.evidence.weights])
    starts += [water_fill(models.evidence.weights[i], upper) for i in order[:4]]
    starts += [water_fill(rng.dirichlet(np.ones(k)), upper) for _ in range(RANDOM_STARTS)]

    def objective(w: np.ndarray) -> float:
        return models.value(w) + (kl_weight * kl(w, space.prior) if kl_weight else 0.0)

    best, best_value = None, np.inf
    for start in starts:
        solution = optimize.minimize(
            objective,
            start,
            method="SLSQP",
            bounds=[(0.0, float(u)) for u in upper],
            constraints=[{"type": "eq", "fun": lambda w: float(np.sum(w) - 1.0)}],
            options={"maxiter": 500, "ftol": 1e-10},
        )
        candidate = water_fill(np.clip(solution.x, 0.0, None), upper)
        value = objective(candidate)
        if value < best_value:
            best, best_value = candidate, value
    assert best is not None
    return best


def round_to_blocks(weights: np.ndarray, space: SearchSpace) -> np.ndarray:
    """Whole sequences of a block, without breaking a cap: a source rounded over its cap gives a sequence to
    the source with the most room."""
    realized = space.realized(weights)
    unit = 1.0 / space.block_size
    for _ in range(space.block_size):
        over = np.flatnonzero(space.epochs(realized) > space.max_epochs * (1 + 1e-9))
        if not len(over):
            return realized
        room = space.upper - realized
        room[over] = -np.inf
        realized[over[0]] -= unit
        realized[int(np.argmax(room))] += unit
    raise UsageError("no whole-block mixture fits the epoch caps; raise max_epochs or the block size")


def propose(
    args, manifest: SwarmManifest, base: Base, comparison: Comparison, reused: Sequence[str]
) -> Proposal:
    """Optimise, round, check, and write the mixture (args.output) and SWARM/proposal.json."""
    swarm = args.swarm
    fit_file = storage.join(swarm, FIT)
    if not storage.exists(fit_file):
        raise UsageError(
            f"{swarm}: no {FIT}; run tokenmill mixture fit {swarm} first (it says how good the fit is)"
        )
    evidence = collect(manifest, swarm)
    k = len(evidence.sources)
    if len(evidence.proxies) < k + 1:
        raise UsageError(
            f"{swarm}: {len(evidence.proxies)} finished proxies, fewer than the {k} sources + 1 a fit needs"
        )
    objective = Objective.parse(args.objective)
    models = Models(evidence, objective, args.seed)
    space = search_space(base)
    # The swarm's sources in its order, named as they are now (a renamed source keeps its evidence).
    current = [comparison.names.get(name, name) for name in evidence.sources]
    order = [space.names.index(name) for name in current]
    space = SearchSpace(
        names=tuple(current),
        prior=space.prior[order],
        tokens_available=space.tokens_available[order],
        max_epochs=space.max_epochs[order],
        fixed_epochs=space.fixed_epochs[order],
        phase_tokens=space.phase_tokens,
        block_size=space.block_size,
    )
    best = round_to_blocks(optimise(models, space, args.kl_weight, args.seed), space)
    base_phase = base.plan.phases[base.phase_index]
    base_weights = np.array([next(s.weight for s in base_phase.sources if s.name == n) for n in current])
    metrics = list(dict.fromkeys([*objective.weights, "heldout_macro:bits_per_byte"]))
    metrics = [m for m in metrics if m in evidence.values]
    output = args.output
    spec = proposed_spec(base, dict(zip(current, best)), output)
    spec["search"] = {
        "swarm": swarm,
        "swarm_sha256": storage.file_sha256(storage.join(swarm, SWARM)),
        "fit": fit_file,
        "proposal": storage.join(swarm, PROPOSAL),
        "phase": base.phase,
        "base": base.path,
        "objective": dict(objective.weights),
        "kl_weight": float(args.kl_weight),
        "evidence_reused": list(reused),
    }
    header = (
        f"Proposed by tokenmill mixture propose from swarm {swarm} ({len(evidence.proxies)} proxies): the "
        f"weights of phase {base.phase} minimise {', '.join(objective.weights)} under every epoch cap; the "
        f"other phases are {base.path}'s. Predictions and their spread: {storage.join(swarm, PROPOSAL)}."
    )
    write_mixture(output, spec, header)
    try:
        proposed_plan = plan_mixture(
            load_mixture(output), load_counts(storage.join(base.tokens, COUNTS)), base.tokens
        )
    except MixtureError as error:
        raise UsageError(f"the proposed mixture {output} does not plan: {error}") from error
    epochs = {s.name: s.epochs for s in proposed_plan.sources.values()}
    proposal = Proposal(
        format_version=1,
        swarm=manifest.name,
        phase=base.phase,
        objective=dict(objective.weights),
        kl_weight=float(args.kl_weight),
        model="loglinear",
        mixture=output,
        weights={n: float(w) for n, w in zip(current, best)},
        prior={n: float(w) for n, w in zip(current, space.prior)},
        base={n: float(w) for n, w in zip(current, base_weights)},
        epochs={n: float(epochs.get(n, 0.0)) for n in current},
        max_epochs={n: float(c) for n, c in zip(current, space.max_epochs)},
        predicted=models.predicted(best, metrics),
        predicted_prior=models.predicted(space.prior, metrics),
        predicted_base=models.predicted(base_weights, metrics),
        evidence_reused=list(reused),
        diff=diff_plans(base.plan, proposed_plan),
    )
    write_proposal(storage.join(swarm, PROPOSAL), proposal)
    return proposal


def proposed_spec(base: Base, weights: Mapping[str, float], output: str) -> dict:
    """The base spec, the searched phase's weights replaced; the budget and the rest are the base's."""
    spec = dict(base.spec)
    spec["name"] = f"{spec['name']}-proposed"
    spec["description"] = f"{base.spec.get('name')} with phase {base.phase}'s weights from a mixture search"
    phases = [dict(p) for p in spec["phases"]]
    phases[base.phase_index].pop("normalize", None)
    phases[base.phase_index]["weights"] = {name: float(w) for name, w in weights.items()}
    spec["phases"] = phases
    if spec.get("counts") and base.path:
        # counts: is relative to the spec's file, and the proposal is written elsewhere.
        counts = (Path(base.path).parent / spec["counts"]).resolve()
        spec["counts"] = os.path.relpath(counts, Path(output).resolve().parent)
    return spec
