"""`tokenmill mixture swarm`: from a base mixture, a proxy run configuration and a budget, the swarm's
folder: one mixture and one run configuration per proxy, and swarm.json (tokenmill.formats.swarm).

The dimensions are the sources of one phase of the base mixture (the searched phase); every other phase keeps
the base's weights, so a proxy trains the whole run's phases at the proxy budget and is scored at its end on
the base's evaluation sets (dropless). Epoch caps are checked at the target budget, the base mixture's own:
a mixture the swarm proposes must be one the target run can train.
"""

from __future__ import annotations

import hashlib
import shlex
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from tokenmill import storage
from tokenmill.errors import UsageError
from tokenmill.formats.plan import MixturePlan
from tokenmill.formats.swarm import (
    FORMAT_VERSION,
    SWARM,
    SwarmManifest,
    SwarmProxy,
    SwarmSource,
    read_swarm,
    write_swarm,
)
from tokenmill.formats.tokens import COUNTS
from tokenmill.mixtures import MixtureError, load_counts, load_mixture, load_mixture_text, plan_mixture
from tokenmill.swarm.evidence import eval_sets, source_contents
from tokenmill.swarm.sample import DEFAULT_CONCENTRATIONS, SearchSpace, sample_mixtures
from tokenmill.trainer.run.config import RunConfigError, build_run_config, read_run_config_file


@dataclass(frozen=True)
class Base:
    """The base mixture, planned at the target budget against the swarm's token shards."""

    path: str
    text: str
    spec: dict[str, Any]  # the YAML, as a mapping
    plan: MixturePlan
    tokens: str
    phase_index: int

    @property
    def phase(self) -> str:
        return self.plan.phases[self.phase_index].name


def load_base(path: str, tokens: str | None, phase: str | None) -> Base:
    """Read and plan the base mixture; UsageError naming what is wrong."""
    try:
        text = Path(path).read_text(encoding="utf-8")
        mixture = load_mixture(path)
    except OSError as error:
        raise UsageError(f"cannot read the base mixture {path}: {error.strerror or error}") from error
    except MixtureError as error:
        raise UsageError(f"base mixture {error}") from error
    if mixture.slice is not None:
        raise UsageError(f"{path}: a slice (slice_of:) cannot be a swarm's base; give the full mixture")
    if tokens is None:
        if not mixture.counts_path:
            raise UsageError(f"{path} names no counts: file; give --tokens DIR (with counts.json)")
        tokens = str(Path(mixture.counts_path).parent)
    try:
        plan = plan_mixture(mixture, load_counts(storage.join(tokens, COUNTS)), tokens)
    except MixtureError as error:
        raise UsageError(f"cannot plan the base mixture against {tokens}: {error}") from error
    names = [p.name for p in plan.phases]
    if phase is None:
        index = 0
    elif phase in names:
        index = names.index(phase)
    else:
        raise UsageError(f"{path}: no phase {phase!r} (phases: {', '.join(names)})")
    if not plan.evaluation:
        raise UsageError(
            f"{path}: the base mixture names no evaluation sets, so proxies would have nothing to be judged "
            "on: add `evaluation: {heldout: domain=*/*}` (held-out slices, tokenize --heldout-fraction) "
            'and/or external sets (docs/mixtures.md, "Evaluation sets")'
        )
    spec = yaml.safe_load(text)
    return Base(path, text, spec, plan, tokens, index)


def search_space(base: Base) -> SearchSpace:
    """The searched phase's sources, their token-proportional prior and the room their caps leave."""
    plan, phase = base.plan, base.plan.phases[base.phase_index]
    names = tuple(source.name for source in phase.sources)
    available = np.array([plan.sources[n].tokens_available for n in names], dtype=float)
    fixed = np.zeros(len(names))
    for other in plan.phases:
        if other.name == phase.name:
            continue
        for source in other.sources:
            if source.name in names:
                fixed[names.index(source.name)] += source.tokens / max(
                    plan.sources[source.name].tokens_available, 1
                )
    return SearchSpace(
        names=names,
        prior=available / available.sum(),
        tokens_available=available,
        max_epochs=np.array([plan.sources[n].max_epochs for n in names], dtype=float),
        fixed_epochs=fixed,
        phase_tokens=phase.tokens,
        block_size=plan.block_size,
    )


def proxy_spec(base: Base, name: str, weights: dict[str, float], total_tokens: int) -> dict[str, Any]:
    """The base spec with the searched phase's weights replaced and the proxy's budget."""
    spec = dict(base.spec)
    spec["name"] = name
    spec.pop("counts", None)  # the run configuration gives the shards (data.tokens)
    spec.pop("total_steps", None)
    spec.pop("provenance", None)
    spec["total_tokens"] = int(total_tokens)
    phases = [dict(p) for p in spec["phases"]]
    phases[base.phase_index].pop("normalize", None)
    phases[base.phase_index]["weights"] = {key: float(value) for key, value in weights.items()}
    spec["phases"] = phases
    return spec


def write_mixture(path: str, spec: dict[str, Any], header: str) -> None:
    """The spec as YAML under a comment header (wrapped), atomically."""
    lines = [line for paragraph in header.splitlines() for line in textwrap.wrap(paragraph, 100) or [""]]
    text = "".join(f"# {line}\n" for line in lines) + yaml.safe_dump(spec, sort_keys=False)
    storage.write_bytes(path, text.encode())


def check_proxy_mixture(path: str, base: Base) -> MixturePlan:
    """Plan a written proxy mixture against the shards, so that a bad one fails here, not in a worker."""
    try:
        return plan_mixture(load_mixture(path), load_counts(storage.join(base.tokens, COUNTS)), base.tokens)
    except MixtureError as error:
        raise UsageError(f"the proxy mixture {path} cannot be planned: {error}") from error


def proxy_run_config(
    raw: dict[str, Any], source: str, output: str, mixture: str, tokens: str, seed: int
) -> dict[str, Any]:
    """A proxy's run configuration: the user's, with its own mixture, folder and seed, evaluated dropless at
    the end of each phase only (a proxy is judged on where it ends), model inlined."""
    overrides = {
        "output": output,
        "seed": seed,
        "data.mixture": mixture,
        "data.plan": None,
        "data.tokens": tokens,
        "evaluation.every": 0,
        "evaluation.dispatch": "dropless",
        "evaluation.sets": None,
        "logging.publish": None,
    }
    try:
        config = build_run_config(raw, overrides, source)
    except RunConfigError as error:
        raise UsageError(str(error)) from error
    settings = config.model_dump(mode="json", exclude_defaults=True)
    # The model in full: a proxy is the same model whatever tokenmill's defaults become.
    settings["model"] = config.model_shape.model_dump(mode="json")
    return settings


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def write_job(
    root: str,
    job: SwarmProxy,
    base: Base,
    proxy_tokens: int,
    raw_run: dict[str, Any],
    run_source: str,
    header: str,
) -> None:
    """Write one proxy's (or validation run's) mixture and run configuration under `root`: the base's
    phases at `proxy_tokens` x the job's compute multiple."""
    mixture_path = storage.join(root, job.mixture)
    total = int(round(proxy_tokens * job.compute_multiple))
    spec = proxy_spec(base, f"{Path(root.rstrip('/')).name}-{job.id}", job.weights, total)
    write_mixture(mixture_path, spec, header)
    check_proxy_mixture(mixture_path, base)
    run = proxy_run_config(
        raw_run,
        run_source,
        storage.join(root, job.run),
        mixture_path,
        base.tokens,
        job.seed,
    )
    storage.write_bytes(storage.join(root, job.run_config), yaml.safe_dump(run, sort_keys=False).encode())


def create_swarm(
    base_path: str,
    run_config: str,
    output: str,
    proxies: int,
    proxy_tokens: int,
    seed: int = 0,
    phase: str | None = None,
    tokens: str | None = None,
    concentrations: Sequence[float] = DEFAULT_CONCENTRATIONS,
    overwrite: bool = False,
) -> SwarmManifest:
    """Sample the swarm and write its folder; the same arguments write the same files."""
    if proxies < 1:
        raise UsageError("--proxies: at least 1")
    manifest_path = storage.join(output, SWARM)
    if storage.exists(manifest_path) and not overwrite:
        raise UsageError(
            f"{manifest_path} exists: run it (tokenmill mixture run {output}), or give --overwrite to sample "
            "a new swarm there (its proxies' results are removed)"
        )
    base = load_base(base_path, tokens, phase)
    if proxy_tokens > base.plan.total_tokens:
        raise UsageError(
            f"--proxy-tokens {proxy_tokens:,} is more than the target run's {base.plan.total_tokens:,}: "
            "a proxy "
            "is a small run"
        )
    try:
        raw_run = read_run_config_file(run_config)
    except RunConfigError as error:
        raise UsageError(str(error)) from error
    space = search_space(base)
    anchors = [("prior", space.prior), ("uniform", space.capped_uniform())]
    base_weights = np.array([s.weight for s in base.plan.phases[base.phase_index].sources])
    anchors.append(("base", base_weights))
    try:
        report = sample_mixtures(space, proxies, seed, concentrations, anchors)
    except ValueError as error:
        raise UsageError(f"{base_path}, phase {base.phase}: {error}") from error
    if overwrite and storage.exists(output):
        storage.remove_tree(output)
    contents = source_contents(base.plan, base.tokens, space.names)
    phase_plan = base.plan.phases[base.phase_index]
    sources = [
        SwarmSource(
            name=name,
            content=contents[name],
            cells=list(base.plan.sources[name].cells),
            tokens_available=int(space.tokens_available[j]),
            max_epochs=float(space.max_epochs[j]),
            prior=float(space.prior[j]),
            base_weight=float(phase_plan.sources[j].weight),
            fixed_epochs=float(space.fixed_epochs[j]),
        )
        for j, name in enumerate(space.names)
    ]
    jobs = []
    width = max(3, len(str(proxies - 1)))
    for index, draw in enumerate(report.draws):
        proxy_id = f"proxy-{index:0{width}d}"
        jobs.append(
            SwarmProxy(
                id=proxy_id,
                index=index,
                weights={name: float(w) for name, w in zip(space.names, draw.weights)},
                concentration=draw.concentration,
                kind=draw.kind,
                seed=seed,
                mixture=f"{proxy_id}/mixture.yaml",
                run_config=f"{proxy_id}/run.yaml",
                run=f"{proxy_id}/run",
            )
        )
    name = Path(output.rstrip("/")).name
    for job in jobs:
        header = f"swarm {name}, {job.id} ({job.kind}): the base mixture with this proxy's weights"
        write_job(output, job, base, proxy_tokens, raw_run, run_config, header)
    manifest = SwarmManifest(
        format_version=FORMAT_VERSION,
        name=name,
        seed=seed,
        base_mixture=base_path,
        base_mixture_sha256=sha256_text(base.text),
        base_mixture_text=base.text,
        run_config=run_config,
        tokens=base.tokens,
        phase=base.phase,
        phases=[p.name for p in base.plan.phases],
        phase_tokens=phase_plan.tokens,
        target_tokens=base.plan.total_tokens,
        proxy_tokens=proxy_tokens,
        concentrations=[float(c) for c in concentrations],
        sources=sources,
        evaluation=eval_sets(base.plan, base.tokens),
        proxies=jobs,
        rejected_over_cap=report.rejected_over_cap,
        rejected_duplicate=report.rejected_duplicate,
        block_size=base.plan.block_size,
        created_by=shlex.join(["tokenmill", *sys.argv[1:]]) if sys.argv[0].endswith("tokenmill") else "",
    )
    write_swarm(manifest_path, manifest)
    return manifest


def base_of(manifest: SwarmManifest, tokens: str | None = None) -> Base:
    """The swarm's base as recorded (its spec text), planned against `tokens` (default: the swarm's)."""
    tokens = tokens or manifest.tokens
    try:
        mixture = load_mixture_text(manifest.base_mixture_text, manifest.base_mixture)
        plan = plan_mixture(mixture, load_counts(storage.join(tokens, COUNTS)), tokens)
    except MixtureError as error:
        raise UsageError(f"the swarm's base mixture ({manifest.base_mixture}): {error}") from error
    index = [p.name for p in plan.phases].index(manifest.phase)
    return Base(
        manifest.base_mixture,
        manifest.base_mixture_text,
        yaml.safe_load(manifest.base_mixture_text),
        plan,
        tokens,
        index,
    )


def open_swarm(folder: str) -> SwarmManifest:
    path = storage.join(folder, SWARM)
    if not storage.exists(path):
        raise UsageError(f"{folder}: not a swarm (no {SWARM}); make one with tokenmill mixture swarm")
    return read_swarm(path)
