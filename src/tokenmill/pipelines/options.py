"""Runner options shared by every Beam pipeline: the local runner here, DataflowRunner at scale.

The local runner is Beam's FnApiRunner, named explicitly: Beam's default local runner first tries to
download and start the Prism binary, which must never happen here. It runs `--workers` SDK worker
processes (multi_processing mode), one per core by default, so Python's GIL does not serialize the work.

On Dataflow the package itself must reach the workers: `--setup_file` (this repository's setup) or
`--extra_package` (a built wheel) does that; `tokenmill` fills in the setup file when neither is given.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

RUNNERS = ("local", "dataflow")


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the runner flags that every pipeline subcommand accepts."""
    group = parser.add_argument_group("runner")
    group.add_argument(
        "--runner",
        choices=RUNNERS,
        default="local",
        help="local: Beam's FnApiRunner on this machine's cores; dataflow: Google Cloud Dataflow",
    )
    group.add_argument(
        "--workers",
        type=int,
        default=0,
        help="local worker processes (default: one per core); on Dataflow, --num_workers",
    )
    group.add_argument("--project", help="Dataflow: Google Cloud project")
    group.add_argument("--region", help="Dataflow: region, e.g. us-central1")
    group.add_argument("--temp_location", help="Dataflow: gs:// path for temporary files")
    group.add_argument("--staging_location", help="Dataflow: gs:// path for staged packages")
    group.add_argument("--job_name", help="Dataflow: job name")
    group.add_argument("--machine_type", help="Dataflow: worker machine type, e.g. n2-standard-8")
    group.add_argument("--max_num_workers", type=int, help="Dataflow: autoscaling ceiling")
    group.add_argument("--service_account_email", help="Dataflow: worker service account")
    group.add_argument("--setup_file", help="Dataflow: setup.py/pyproject path shipped to workers")
    group.add_argument(
        "--extra_package", action="append", help="Dataflow: a built wheel of tokenmill to ship"
    )
    group.add_argument(
        "--dry_run", action="store_true", help="Dataflow: build and validate the job graph, do not submit it"
    )
    group.add_argument(
        "--beam_option",
        action="append",
        default=[],
        metavar="FLAG",
        help="any other Beam pipeline flag, passed through as is (repeatable), "
        "e.g. --beam_option=--experiments=use_runner_v2",
    )


def local_worker_count(requested: int = 0) -> int:
    return requested if requested > 0 else max(1, os.cpu_count() or 1)


def project_root() -> Path:
    return Path(__file__).resolve().parents[3]


def pipeline_flags(args: argparse.Namespace) -> list[str]:
    """Beam command-line flags for the chosen runner."""
    if args.runner == "local":
        workers = local_worker_count(args.workers)
        mode = "multi_processing" if workers > 1 else "in_memory"
        return [f"--direct_num_workers={workers}", f"--direct_running_mode={mode}", *args.beam_option]

    missing = [name for name in ("project", "region", "temp_location") if not getattr(args, name)]
    if missing:
        from tokenmill.cli import UsageError

        raise UsageError("--runner dataflow needs " + ", ".join(f"--{name}" for name in missing))
    flags = [
        "--runner=DataflowRunner",
        f"--project={args.project}",
        f"--region={args.region}",
        f"--temp_location={args.temp_location}",
    ]
    for name in ("staging_location", "job_name", "machine_type", "max_num_workers", "service_account_email"):
        value = getattr(args, name)
        if value:
            flags.append(f"--{name}={value}")
    if args.workers:
        flags.append(f"--num_workers={args.workers}")
    for package in args.extra_package or []:
        flags.append(f"--extra_package={package}")
    if not args.extra_package:
        setup_file = args.setup_file or str(project_root() / "setup.py")
        flags.append(f"--setup_file={setup_file}")
    if args.dry_run:
        flags.append("--dry_run=True")
    return [*flags, *args.beam_option]


def make_pipeline(args: argparse.Namespace, job_kind: str):
    """A beam.Pipeline for the runner the arguments ask for."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions

    flags = pipeline_flags(args)
    options = PipelineOptions(flags, save_main_session=False, pipeline_type_check=True)
    if args.runner == "local":
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        return beam.Pipeline(runner=FnApiRunner(), options=options)
    if not args.job_name:
        options.view_as(beam.options.pipeline_options.GoogleCloudOptions).job_name = f"tokenmill-{job_kind}"
    return beam.Pipeline(options=options)
