"""One proxy run, in its own process: every phase of its mixture in turn (`tokenmill train` in this
process), then its final evaluation read from eval.jsonl into proxy-NNN/result.json.

    python -m tokenmill.swarm.worker SWARM PROXY_ID        # what `tokenmill mixture run` starts
    python -m tokenmill.swarm.worker SWARM --index env     # a job array's task: SLURM_ARRAY_TASK_ID or
                                                           # JOB_COMPLETION_INDEX picks the proxy

A killed worker leaves its run folder's checkpoints; run again, `tokenmill train` resumes from them, and a
phase already trained to its end is a no-op. result.json is written last (atomically), so it exists only
for a proxy that finished (or failed with its error recorded).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import time
import traceback
from pathlib import Path

from tokenmill import storage
from tokenmill.formats.evals import EVAL, latest_records, read_eval
from tokenmill.formats.runs import METRICS, read_metrics
from tokenmill.formats.swarm import RESULT, ProxyResult, SwarmProxy, write_result
from tokenmill.swarm.build import open_swarm, sha256_text
from tokenmill.swarm.runner import job_result

INDEX_VARIABLES = ("SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX")
ERROR_LINES = 30


def final_metrics(run_dir: str) -> tuple[dict[str, dict[str, float]], int | None, int | None]:
    """set -> {loss, bits_per_byte} of the last evaluation point, dropless; with its step and tokens."""
    path = storage.join(run_dir, EVAL)
    if not storage.exists(path):
        return {}, None, None
    records = [r for r in latest_records(read_eval(path)) if r.dispatch == "dropless"]
    if not records:
        return {}, None, None
    last = max(r.step for r in records)
    final = [r for r in records if r.step == last]
    metrics = {r.set: {"loss": r.loss, "bits_per_byte": r.bits_per_byte} for r in final}
    return metrics, last, final[0].tokens_trained


def run_job(root: str, job: SwarmProxy, phases: list[str]) -> ProxyResult:
    """Train every phase of the job, then record its result (written to root/job.id/result.json)."""
    started = time.monotonic()
    run_config = storage.join(root, job.run_config)
    config_sha = sha256_text(Path(run_config).read_text(encoding="utf-8"))
    output = io.StringIO()
    error = None
    try:
        for phase in phases:
            # The trainer's output goes to this process's own (the runner's log of it) and is kept for
            # the error of a failed proxy.
            with (
                contextlib.redirect_stderr(_Tee(sys.stderr, output)),
                contextlib.redirect_stdout(_Tee(sys.stdout, output)),
            ):
                code = train_command(["--config", run_config, "--data.phase", phase])
            if code:
                error = f"tokenmill train --data.phase {phase} exited with {code}"
                break
    except Exception:  # a proxy that fails is recorded as failed; the swarm goes on
        error = traceback.format_exc()
    run_dir = storage.join(root, job.run)
    metrics, step, tokens = final_metrics(run_dir)
    if error is None and not metrics:
        error = f"{run_dir}/{EVAL}: no evaluation recorded (does the base mixture name evaluation sets?)"
    train_loss = None
    metrics_path = storage.join(run_dir, METRICS)
    if storage.exists(metrics_path):
        rows = [row for row in read_metrics(metrics_path) if row.loss is not None]
        train_loss = rows[-1].loss if rows else None
    tail = None
    if error is not None:
        tail = "\n".join((output.getvalue() + "\n" + error).strip().splitlines()[-ERROR_LINES:])
    result = ProxyResult(
        id=job.id,
        status="failed" if error else "finished",
        run_config_sha256=config_sha,
        seconds=round(time.monotonic() - started, 3),
        steps=step,
        tokens_trained=tokens,
        train_loss=train_loss,
        metrics=metrics,
        error=tail,
    )
    write_result(storage.join(root, job.id, RESULT), result)
    return result


def train_command(argv: list[str]) -> int:
    """`tokenmill train ARGV` in this process (one JAX start for every phase of a proxy)."""
    from tokenmill.errors import UsageError
    from tokenmill.trainer.commands import register

    parser = argparse.ArgumentParser(prog="tokenmill")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", *argv])
    try:
        return int(args.handler(args) or 0)
    except UsageError as error:
        print(f"tokenmill train: error: {error}", file=sys.stderr)
        return 2


class _Tee(io.TextIOBase):
    def __init__(self, *streams: io.TextIOBase):
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def pick(manifest_jobs: list[SwarmProxy], proxy: str | None, index: str | None) -> SwarmProxy:
    if index is not None:
        if index == "env":
            found = next((os.environ[v] for v in INDEX_VARIABLES if os.environ.get(v)), None)
            if found is None:
                raise SystemExit(f"--index env: none of {', '.join(INDEX_VARIABLES)} is set")
            index = found
        position = int(index)
        if not 0 <= position < len(manifest_jobs):
            raise SystemExit(f"--index {position}: the swarm has {len(manifest_jobs)} proxies")
        return manifest_jobs[position]
    by_id = {job.id: job for job in manifest_jobs}
    if proxy not in by_id:
        raise SystemExit(f"no proxy {proxy!r} in the swarm")
    return by_id[proxy]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tokenmill.swarm.worker", description=__doc__)
    parser.add_argument("swarm", help="the swarm's folder")
    parser.add_argument("proxy", nargs="?", help="the proxy's id (proxy-007)")
    parser.add_argument("--index", help="the proxy's position, or env: from the job array's index variable")
    parser.add_argument("--validation", action="store_true", help="a run of the swarm's validation/")
    parser.add_argument("--again", action="store_true", help="run a proxy that has finished again")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    for noisy in ("absl", "jax._src"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if (args.proxy is None) == (args.index is None):
        parser.error("give a proxy id or --index")
    from tokenmill.swarm.validate import open_validation

    manifest = open_swarm(args.swarm)
    if args.validation:
        root, jobs = storage.join(args.swarm, "validation"), open_validation(args.swarm)
    else:
        root, jobs = args.swarm, manifest.proxies
    job = pick(jobs, args.proxy, args.index)
    if args.index is not None:
        print(f"array task {jobs.index(job)}: {job.id}", flush=True)
    done = job_result(root, job)
    if done is not None and done.status == "finished" and not args.again:
        # A resubmitted job array's task, or a second runner: what finished stays as it is.
        print(f"{job.id}: finished already ({storage.join(root, job.id, RESULT)}), skipped")
        return 0
    result = run_job(root, job, manifest.phases)
    print(f"{job.id}: {result.status} in {result.seconds:.0f}s")
    return 0 if result.status == "finished" else 1


if __name__ == "__main__":
    sys.exit(main())
