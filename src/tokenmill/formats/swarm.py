"""Mixture search records (docs/formats.md, "Mixture search"): a swarm's manifest, each proxy's result, the
fit and the proposal, all in the swarm's folder.

    SWARM/swarm.json                 SwarmManifest: the base mixture, the sources (keyed by content), the
                                     evaluation sets, every proxy's weights and files
    SWARM/proxy-NNN/mixture.yaml     the proxy's mixture: the base with the searched phase's weights replaced
    SWARM/proxy-NNN/run.yaml         the proxy's run configuration
    SWARM/proxy-NNN/run/             its run folder (metrics.jsonl, eval.jsonl, checkpoints/)
    SWARM/proxy-NNN/result.json      ProxyResult, written last: finished (with its final evaluation) or failed
    SWARM/fit.json                   SwarmFit: per metric, the fitted models and their out-of-fold quality
    SWARM/proposal.json              Proposal: the proposed weights, epochs, predicted metrics

Sources and evaluation sets are named in these records, but the evidence is keyed by content: a source's
`content` is a hash of its cells' training manifests (each shard's documents, tokens and sha256), an
evaluation set's a hash of its held-out (or external) manifests, never of a name. So a re-bucketed or
re-deduplicated corpus is detected (the hash changes), and a renamed cell or source is not mistaken for new
data (the hash stays).
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from tokenmill.formats.base import Count, FormatModel, read_model, write_model

SWARM = "swarm.json"
RESULT = "result.json"
FIT = "fit.json"
PROPOSAL = "proposal.json"
VALIDATION = "validation.json"
FORMAT_VERSION = 1


class SwarmSource(FormatModel):
    """One dimension of the search: a source of the searched phase."""

    name: str
    content: str  # sha256 over its cells' content keys, sorted (names left out)
    cells: list[str]
    tokens_available: Count
    max_epochs: float
    prior: float  # the token-proportional weight
    base_weight: float  # the base mixture's weight in the searched phase
    fixed_epochs: float  # epochs the other phases take of it at the target budget


class SwarmEvalSet(FormatModel):
    """An evaluation set every proxy scores at its end."""

    name: str
    kind: Literal["heldout", "external"]
    content: str  # sha256 over its manifests' content
    tokens: Count | None = None
    bytes: Count | None = None


class SwarmProxy(FormatModel):
    """One proxy run: its weights over the searched phase's sources and its files (relative to the swarm)."""

    id: str  # proxy-000, ...
    index: Count
    weights: dict[str, float]  # source name -> weight in the searched phase (sums to 1)
    concentration: float | None = None  # the Dirichlet concentration it was drawn with (null: an anchor)
    kind: Literal["sampled", "prior", "uniform", "base", "validation"] = "sampled"
    seed: int = 0
    mixture: str  # proxy-000/mixture.yaml
    run_config: str  # proxy-000/run.yaml
    run: str  # proxy-000/run
    compute_multiple: float = 1.0  # of a proxy's tokens (a validation run trains longer)


class SwarmManifest(FormatModel):
    """`swarm.json`: everything `mixture fit` and `propose` need besides the proxies' results."""

    model_config = ConfigDict(strict=True, frozen=True, extra="ignore")

    format_version: Literal[1]
    name: str
    seed: int
    base_mixture: str  # the base mixture's file, as given
    base_mixture_sha256: str
    base_mixture_text: str  # the base spec, verbatim: proxies are written from it
    run_config: str  # the proxy run configuration's file, as given
    tokens: str  # the token shards folder the swarm trains and evaluates on
    phase: str  # the searched phase
    phases: list[str]  # every phase of the base, in order (the others keep the base's weights)
    phase_tokens: Count  # the searched phase's tokens at the target budget
    target_tokens: Count  # the target run's budget, at which epoch caps are checked
    proxy_tokens: Count  # one proxy's budget
    concentrations: list[float]
    sources: list[SwarmSource]
    evaluation: list[SwarmEvalSet]
    proxies: list[SwarmProxy]
    rejected_over_cap: Count = 0  # samples that broke an epoch cap at the target budget
    rejected_duplicate: Count = 0  # samples equal to an earlier one at block granularity
    block_size: Count
    created_by: str = ""  # the command line that made it


class ProxyResult(FormatModel):
    """`proxy-NNN/result.json`: what a proxy run ended with."""

    id: str
    status: Literal["finished", "failed"]
    run_config_sha256: str  # the run.yaml it ran (a changed one runs again)
    seconds: float
    steps: Count | None = None
    tokens_trained: Count | None = None
    train_loss: float | None = None
    # set name -> metric -> value (loss, bits_per_byte), dropless, at the run's last step; averages too
    metrics: dict[str, dict[str, float]] = {}
    error: str | None = None  # failed: the last lines of the run's output


class CurvePoint(FormatModel):
    """The out-of-fold Spearman of a fit made on the first `proxies` proxies (mean over a few draws)."""

    proxies: Count
    spearman: float


class ModelQuality(FormatModel):
    """A fitted model's out-of-fold quality on one metric (k-fold over proxies)."""

    model: Literal["loglinear", "gp"]
    spearman: float | None
    r2: float | None
    folds: Count
    predicted: list[float]  # out-of-fold prediction per proxy, in `MetricFit.proxies` order
    # (proxies used, out-of-fold Spearman) at growing subsets of the swarm: when did the fit stabilise
    learning_curve: list[CurvePoint] = []
    stable_at: Count | None = None  # proxies after which the Spearman stays within 0.05 of the full fit's


class LogLinearFit(FormatModel):
    """metric(w) = floor + exp(intercept + sum_j effect_j * w_j), floor >= 0 (Data Mixing Laws' form)."""

    floor: float
    intercept: float
    effects: dict[str, float]  # source name -> effect (per unit weight, in the exponent)


class MetricFit(FormatModel):
    """The fits of one metric (`heldout_macro:bits_per_byte`, `heldout/domain=c00:loss`, ...)."""

    metric: str
    set: str
    measure: Literal["loss", "bits_per_byte"]
    proxies: list[str]  # the proxies fitted, in order
    measured: list[float]
    loglinear: LogLinearFit
    quality: list[ModelQuality]


class SwarmFit(FormatModel):
    """`fit.json`: every metric's fits, and the evidence they rest on."""

    format_version: Literal[1]
    swarm: str
    sources: list[str]  # the search's dimensions, in order
    source_content: dict[str, str]  # name -> content key the fit was made on
    evidence_reused: list[str] = []  # sources whose content changed, reused because the user said so
    proxies_finished: Count
    proxies_failed: list[str] = []
    proxies_without_evaluation: list[str] = []
    metrics: list[MetricFit]
    warnings: list[str] = []


class PredictedMetric(FormatModel):
    """A metric predicted at a mixture, with its spread (bootstrap of the log-linear fit; the GP's std)."""

    metric: str
    loglinear: float
    loglinear_std: float
    gp: float | None = None
    gp_std: float | None = None


class Proposal(FormatModel):
    """`proposal.json`: the proposed weights of the searched phase and why."""

    format_version: Literal[1]
    swarm: str
    phase: str
    objective: dict[str, float]  # metric -> weight in the objective
    kl_weight: float
    model: Literal["loglinear", "gp"]
    mixture: str  # the mixture YAML written
    weights: dict[str, float]  # source -> proposed weight
    prior: dict[str, float]
    base: dict[str, float]
    epochs: dict[str, float]  # source -> epochs at the target budget, every phase counted
    max_epochs: dict[str, float]
    predicted: list[PredictedMetric]  # at the proposal
    predicted_prior: list[PredictedMetric]
    predicted_base: list[PredictedMetric]
    evidence_reused: list[str] = []
    diff: dict = Field(default_factory=dict)  # `mixture diff` of the base's plan and the proposal's


class ValidationArm(FormatModel):
    """One mixture of a validation: its runs (one per seed) and their metric."""

    name: Literal["proposal", "prior", "uniform", "base"]
    weights: dict[str, float]
    runs: list[str]  # proxy ids, relative to the swarm's validation/ folder
    values: list[float]  # the metric per seed
    mean: float
    std: float  # sample standard deviation over the seeds


class Validation(FormatModel):
    """`validation/validation.json`: the proposal against the prior and uniform mixtures, each trained at
    `compute_multiple` x a proxy's tokens with every seed. Written when the runs are set up (`jobs`), and
    again with the arms' values once they have run."""

    format_version: Literal[1]
    swarm: str
    metric: str
    compute_multiple: float
    seeds: list[int]
    jobs: list[SwarmProxy]  # one per arm and seed, files relative to validation/
    arms: list[ValidationArm] = []
    # the proposal's margin over each other arm (their mean minus its; positive: the proposal is better),
    # and whether it is more than twice the larger seed standard deviation of the two
    margins: dict[str, float] = {}
    beats: dict[str, bool] = {}


def read_swarm(path: str) -> SwarmManifest:
    return read_model(SwarmManifest, path)


def write_swarm(path: str, manifest: SwarmManifest) -> None:
    write_model(path, manifest)


def read_result(path: str) -> ProxyResult:
    return read_model(ProxyResult, path)


def write_result(path: str, result: ProxyResult) -> None:
    write_model(path, result)


def read_fit(path: str) -> SwarmFit:
    return read_model(SwarmFit, path)


def write_fit(path: str, fit: SwarmFit) -> None:
    write_model(path, fit)


def read_proposal(path: str) -> Proposal:
    return read_model(Proposal, path)


def write_proposal(path: str, proposal: Proposal) -> None:
    write_model(path, proposal)


def read_validation(path: str) -> Validation:
    return read_model(Validation, path)


def write_validation(path: str, validation: Validation) -> None:
    write_model(path, validation)
