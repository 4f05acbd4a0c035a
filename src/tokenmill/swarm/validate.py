"""`tokenmill mixture validate`: the proposal against the token-proportional and the uniform mixture, each
trained at a multiple of a proxy's compute with several seeds, judged on the swarm's objective metric.

The runs are proxies of their own (the same run configuration, `compute_multiple` x the proxy budget),
under SWARM/validation/<arm>-s<seed>/, run by the same pool as the swarm (resumable). The verdict: the
proposal beats an arm when its mean is lower by more than twice the larger of the two seed standard
deviations. The uniform arm is water-filled under the epoch caps when uniform weights break one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tokenmill import storage
from tokenmill.errors import UsageError
from tokenmill.formats.swarm import (
    PROPOSAL,
    VALIDATION,
    SwarmManifest,
    SwarmProxy,
    Validation,
    ValidationArm,
    read_proposal,
    read_validation,
    write_validation,
)
from tokenmill.swarm.build import base_of, search_space, write_job
from tokenmill.swarm.runner import job_result, run_jobs
from tokenmill.trainer.run.config import RunConfigError, read_run_config_file

FOLDER = "validation"


def open_validation(swarm: str) -> list[SwarmProxy]:
    path = storage.join(swarm, FOLDER, VALIDATION)
    if not storage.exists(path):
        raise UsageError(f"{swarm}: no validation set up ({path}); run tokenmill mixture validate")
    return read_validation(path).jobs


def set_up(
    swarm: str, manifest: SwarmManifest, compute_multiple: float, seeds: Sequence[int], metric: str | None
) -> Validation:
    """Write the validation runs' files (the same arguments: the same files) and validation.json."""
    proposal_path = storage.join(swarm, PROPOSAL)
    if not storage.exists(proposal_path):
        raise UsageError(f"{swarm}: no {PROPOSAL}; run tokenmill mixture propose first")
    proposal = read_proposal(proposal_path)
    base = base_of(manifest)
    space = search_space(base)
    arms = {
        "proposal": np.array([proposal.weights[name] for name in proposal.weights]),
        "prior": space.realized(space.prior),
        "uniform": space.realized(space.capped_uniform()),
    }
    names = list(space.names)
    if list(proposal.weights) != names:
        # A proposal made on renamed sources names them as they are now; the swarm's order is what counts.
        arms["proposal"] = np.array(list(proposal.weights.values()))
    try:
        raw_run = read_run_config_file(manifest.run_config)
    except RunConfigError as error:
        raise UsageError(str(error)) from error
    root = storage.join(swarm, FOLDER)
    jobs = []
    for arm, weights in arms.items():
        for seed in seeds:
            job_id = f"{arm}-s{seed}"
            job = SwarmProxy(
                id=job_id,
                index=len(jobs),
                weights={name: float(w) for name, w in zip(names, weights)},
                kind="validation",
                seed=int(seed),
                mixture=f"{job_id}/mixture.yaml",
                run_config=f"{job_id}/run.yaml",
                run=f"{job_id}/run",
                compute_multiple=float(compute_multiple),
            )
            header = (
                f"swarm {manifest.name}, validation: the {arm} mixture, seed {seed}, "
                f"{compute_multiple:g}x a proxy"
            )
            write_job(root, job, base, manifest.proxy_tokens, raw_run, manifest.run_config, header)
            jobs.append(job)
    validation = Validation(
        format_version=1,
        swarm=manifest.name,
        metric=metric or next(iter(proposal.objective)),
        compute_multiple=float(compute_multiple),
        seeds=[int(s) for s in seeds],
        jobs=jobs,
    )
    write_validation(storage.join(root, VALIDATION), validation)
    return validation


def judge(swarm: str, validation: Validation) -> Validation:
    """The arms' values, margins and verdicts, from the runs' results (every run must have finished)."""
    root = storage.join(swarm, FOLDER)
    name, _, measure = validation.metric.rpartition(":")
    arms = []
    for arm in ("proposal", "prior", "uniform"):
        jobs = [job for job in validation.jobs if job.id.startswith(f"{arm}-s")]
        values = []
        for job in jobs:
            result = job_result(root, job)
            if result is None or result.status != "finished" or name not in result.metrics:
                raise UsageError(
                    f"{storage.join(root, job.id)}: not finished with {name}; run validate again"
                )
            values.append(result.metrics[name][measure])
        arms.append(
            ValidationArm(
                name=arm,
                weights=jobs[0].weights,
                runs=[job.id for job in jobs],
                values=[float(v) for v in values],
                mean=float(np.mean(values)),
                std=float(np.std(values, ddof=1)) if len(values) > 1 else 0.0,
            )
        )
    proposal = arms[0]
    margins = {a.name: a.mean - proposal.mean for a in arms[1:]}
    beats = {a.name: margins[a.name] > 2 * max(a.std, proposal.std) for a in arms[1:]}
    judged = validation.model_copy(update={"arms": arms, "margins": margins, "beats": beats})
    write_validation(storage.join(root, VALIDATION), judged)
    return judged


def validate(
    swarm: str,
    manifest: SwarmManifest,
    compute_multiple: float,
    seeds: Sequence[int],
    workers: int,
    gpus: Sequence[str] = (),
    metric: str | None = None,
) -> Validation:
    validation = set_up(swarm, manifest, compute_multiple, seeds, metric)
    summary = run_jobs(swarm, storage.join(swarm, FOLDER), validation.jobs, workers, gpus, validation=True)
    if summary.failed:
        raise UsageError(f"validation runs failed: {', '.join(summary.failed)} (see their worker.log)")
    return judge(swarm, validation)
