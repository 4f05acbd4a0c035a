"""Sampling a swarm's mixtures: Dirichlet draws around the token-proportional prior (RegMix's procedure),
each kept only if every source stays within its epoch cap at the target run's budget, and only once.

A draw with concentration c has parameters c x K x prior (K sources): its mean is the prior, and c sets the
spread (c = 0.2 gives mixtures dominated by one or two sources, c = 5 mixtures near the prior). Cycling
through a spread of concentrations covers both the corners the regression needs to see and the
neighbourhood of the prior where the answer usually is. Weights are rounded to what the trainer realizes:
whole sequences of a mixture block (`block_counts`), so two draws that round to the same block are the same
mixture (a duplicate, drawn again).

Memory and time grow with proxies x sources (a few hundred by a few hundred at most); nothing here reads data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenmill.mixtures.plan import block_counts

DEFAULT_CONCENTRATIONS = (0.2, 0.5, 1.0, 2.0, 5.0)
# Draws tried per mixture kept before the caps are declared too tight to sample from.
MAX_TRIES_PER_PROXY = 2000


@dataclass(frozen=True)
class SearchSpace:
    """The simplex of one phase's weights over its sources, cut by the epoch caps.

    A source j may take at most `upper[j]` of the phase: (max_epochs_j - the epochs the other phases take of
    it) x its tokens / the phase's tokens, at the target budget.
    """

    names: tuple[str, ...]
    prior: np.ndarray  # token-proportional weights
    tokens_available: np.ndarray
    max_epochs: np.ndarray
    fixed_epochs: np.ndarray
    phase_tokens: int
    block_size: int

    @property
    def upper(self) -> np.ndarray:
        room = np.maximum(self.max_epochs - self.fixed_epochs, 0.0)
        return np.minimum(room * self.tokens_available / self.phase_tokens, 1.0)

    def epochs(self, weights: np.ndarray) -> np.ndarray:
        """Epochs of each source at the target budget, every phase counted."""
        return self.fixed_epochs + weights * self.phase_tokens / self.tokens_available

    def feasible(self, weights: np.ndarray, slack: float = 1e-9) -> bool:
        return bool(np.all(self.epochs(weights) <= self.max_epochs * (1 + slack)))

    def realized(self, weights: Sequence[float]) -> np.ndarray:
        """The weights the trainer draws: whole sequences of each mixture block."""
        return np.array(block_counts(list(weights), self.block_size), dtype=float) / self.block_size

    def block_key(self, weights: np.ndarray) -> tuple[int, ...]:
        return tuple(int(round(w * self.block_size)) for w in weights)

    def uniform(self) -> np.ndarray:
        return np.full(len(self.names), 1.0 / len(self.names))

    def capped_uniform(self) -> np.ndarray:
        """Uniform weights, water-filled under the caps when uniform itself breaks one."""
        return water_fill(self.uniform(), self.upper)


def water_fill(weights: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """`weights` moved onto {sum 1, 0 <= w <= upper}: capped sources keep their cap, the rest share what is
    left in proportion to their weights. Raises ValueError when the caps sum to less than 1."""
    if upper.sum() < 1 - 1e-12:
        raise ValueError(
            f"the epoch caps leave at most {upper.sum():.3f} of the phase to its sources: no mixture fits"
        )
    result = np.array(weights, dtype=float)
    capped = np.zeros(len(result), dtype=bool)
    for _ in range(len(result) + 1):
        free = ~capped
        left = 1.0 - upper[capped].sum()
        share = result[free].sum()
        result[free] = result[free] * left / share if share > 0 else left / free.sum()
        over = free & (result > upper)
        if not over.any():
            break
        capped |= over
        result[capped] = upper[capped]
    return result


@dataclass(frozen=True)
class Draw:
    weights: np.ndarray
    concentration: float | None
    kind: str  # sampled, prior, uniform, base


@dataclass
class SampleReport:
    draws: list[Draw]
    rejected_over_cap: int
    rejected_duplicate: int


def sample_mixtures(
    space: SearchSpace,
    count: int,
    seed: int,
    concentrations: Sequence[float] = DEFAULT_CONCENTRATIONS,
    anchors: Sequence[tuple[str, np.ndarray]] = (),
) -> SampleReport:
    """`count` distinct feasible mixtures: the `anchors` first (prior, uniform, base: each kept when
    feasible and new), then Dirichlet draws cycling through `concentrations`. The same arguments give the
    same mixtures (numpy's PCG64 seeded with `seed`)."""
    if len(space.names) < 2:
        raise ValueError(
            f"a swarm searches the weights of two sources or more; this phase has {len(space.names)} "
            f"({', '.join(space.names) or 'none'}): list the sources to search in the base mixture's phase"
        )
    if space.upper.sum() < 1 - 1e-12:
        water_fill(space.prior, space.upper)  # raises with the numbers
    rng = np.random.default_rng(seed)
    seen: set[tuple[int, ...]] = set()
    draws: list[Draw] = []
    over_cap = duplicate = 0

    def offer(weights: np.ndarray, concentration: float | None, kind: str) -> bool:
        nonlocal over_cap, duplicate
        realized = space.realized(weights)
        if not space.feasible(realized):
            over_cap += 1
            return False
        key = space.block_key(realized)
        if key in seen:
            duplicate += 1
            return False
        seen.add(key)
        draws.append(Draw(realized, concentration, kind))
        return True

    for kind, weights in anchors:
        if len(draws) < count:
            offer(np.asarray(weights, dtype=float), None, kind)
    tries = 0
    k = len(space.names)
    prior = np.maximum(space.prior, 1e-6)
    while len(draws) < count:
        concentration = float(concentrations[tries % len(concentrations)])
        tries += 1
        if tries > MAX_TRIES_PER_PROXY * count:
            raise ValueError(
                f"only {len(draws)} of {count} mixtures found in {tries - 1} draws ({over_cap} over an epoch "
                f"cap, {duplicate} duplicates): the caps or the block size ({space.block_size} sequences) "
                "leave too few distinct mixtures; raise max_epochs, the block size, or ask for fewer proxies"
            )
        offer(rng.dirichlet(concentration * k * prior), concentration, "sampled")
    return SampleReport(draws, over_cap, duplicate)
