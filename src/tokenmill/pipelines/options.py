"""Runner options shared by every Beam pipeline: which engine runs it, and how tokenmill reaches workers.

`--runner` takes:

- `local` (the default): Beam's FnApiRunner, named explicitly: Beam's default local runner first tries
  to download and start the Prism binary, which must never happen here. It runs `--workers` SDK worker
  processes (multi_processing mode), one per core by default, so Python's GIL does not serialize the work,
  and cuts each stage's input into bundles of at most 8 MiB (tokenmill.pipelines.local_runner), so a
  worker's memory does not grow with the corpus.
- `dataflow` (or `DataflowRunner`): Google Cloud Dataflow; needs --project, --region, --temp_location.
- `dask` (or `DaskRunner`): Beam's DaskRunner with tokenmill's fixes (tokenmill.pipelines.dask_runner)
  on a dask.distributed cluster: `--dask_address tcp://HOST:8786`, or without it a cluster of `--workers`
  worker processes on loopback that lives for the run.
- any other Beam runner by class name (FlinkRunner, SparkRunner, PortableRunner, PrismRunner,
  DirectRunner, ...) or import path (`my_package.runners.MyRunner`); its own options go through
  `--beam_option` (repeatable, passed to Beam as they are).

Remote workers need the tokenmill package. Unless the command names one (`--extra_package`,
`--setup_file`) or a container that holds it (`--sdk_container_image`), tokenmill builds a wheel of the
installed package at launch (tokenmill.pipelines.worker_package) and passes it as `--extra_package`:
for Dataflow, and for portable runners unless their workers run in this environment (LOOPBACK, PROCESS
or EXTERNAL environments, and the local runners).
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenmill.pipelines.warm_workers import WarmWorkers

#: The names `--runner` gives a meaning of its own; any other name is a Beam runner, passed through.
RUNNERS = ("local", "dataflow", "dask")
_ALIASES = {
    "local": "local",
    "dataflow": "dataflow",
    "dataflowrunner": "dataflow",
    "dask": "dask",
    "daskrunner": "dask",
}
_RUNNER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
#: Runners whose workers run in this environment: nothing to ship. (Beam's StandardOptions.LOCAL_RUNNERS.)
_LOCAL_BEAM_RUNNERS = {
    "bundlebaseddirectrunner",
    "directrunner",
    "switchingdirectrunner",
    "fnapirunner",
    "prismrunner",
    "testdirectrunner",
}
#: How `--workers` reads for the Beam runners that have such a flag.
_WORKER_FLAGS = {
    "bundlebaseddirectrunner": "direct_num_workers",
    "directrunner": "direct_num_workers",
    "switchingdirectrunner": "direct_num_workers",
    "fnapirunner": "direct_num_workers",
    "flinkrunner": "parallelism",
}
#: Portable environments whose workers run where the job runs (this machine's packages).
_ENVIRONMENTS_WITHOUT_STAGING = {"LOOPBACK", "PROCESS", "EXTERNAL"}


def runner_name(value: str) -> str:
    """`--runner`: local, dataflow and dask (any case, or as DataflowRunner/DaskRunner), else a Beam
    runner's class name or import path, kept as written."""
    alias = _ALIASES.get(value.lower())
    if alias:
        return alias
    if not _RUNNER_NAME.match(value):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a runner: give local, dataflow, dask, or a Beam runner's class name "
            "(FlinkRunner, SparkRunner, PortableRunner, ...) or import path"
        )
    return value


def add_runner_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the runner flags that every pipeline subcommand accepts."""
    group = parser.add_argument_group("runner")
    group.add_argument(
        "--runner",
        type=runner_name,
        default="local",
        metavar="RUNNER",
        help="local (default): Beam's FnApiRunner on this machine's cores; dataflow: Google Cloud "
        "Dataflow; dask: a dask.distributed cluster (--dask_address, or a local one); or any Beam "
        "runner by class name (FlinkRunner, SparkRunner, PortableRunner, ...) with its options "
        "through --beam_option",
    )
    group.add_argument(
        "--workers",
        type=int,
        default=0,
        help="local: worker processes (default: one per core); dataflow: --num_workers; dask: worker "
        "processes of the local cluster; DirectRunner: --direct_num_workers; FlinkRunner: --parallelism",
    )
    group.add_argument("--project", help="Dataflow: Google Cloud project")
    group.add_argument("--region", help="Dataflow: region, e.g. us-central1")
    group.add_argument("--temp_location", help="Dataflow: gs:// path for temporary files")
    group.add_argument("--staging_location", help="Dataflow: gs:// path for staged packages")
    group.add_argument("--job_name", help="Dataflow: job name")
    group.add_argument("--machine_type", help="Dataflow: worker machine type, e.g. n2-standard-8")
    group.add_argument("--max_num_workers", type=int, help="Dataflow: autoscaling ceiling")
    group.add_argument("--service_account_email", help="Dataflow: worker service account")
    group.add_argument(
        "--sdk_container_image",
        help="Dataflow and portable runners: a worker image that holds tokenmill (docker/curate.Dockerfile); "
        "no package is shipped then",
    )
    group.add_argument(
        "--setup_file", help="remote workers: a setup.py to build and ship instead of the built wheel"
    )
    group.add_argument(
        "--extra_package",
        action="append",
        help="remote workers: a built tokenmill wheel to ship (default: one built from the installed "
        "package at launch)",
    )
    group.add_argument(
        "--dask_address",
        metavar="ADDRESS",
        help="dask: the scheduler of a running cluster, e.g. tcp://dask-scheduler:8786 "
        "(default: a cluster of --workers processes on loopback, started for the run)",
    )
    group.add_argument(
        "--dry_run", action="store_true", help="Dataflow: build and validate the job graph, do not submit it"
    )
    group.add_argument(
        "--beam_option",
        action="append",
        default=[],
        metavar="FLAG",
        help="any other Beam pipeline flag, passed through as is (repeatable), e.g. "
        "--beam_option=--experiments=use_runner_v2 or --beam_option=--flink_master=HOST:8081",
    )


def local_worker_count(requested: int = 0) -> int:
    return requested if requested > 0 else max(1, os.cpu_count() or 1)


def _usage_error(message: str) -> Exception:
    from tokenmill.errors import UsageError

    return UsageError(message)


def _beam_option_value(flags: list[str], name: str) -> str | None:
    """The value of `--name=value` or `--name value` among pass-through flags (the last one wins)."""
    value = None
    for index, flag in enumerate(flags):
        if flag.startswith(f"--{name}="):
            value = flag.split("=", 1)[1]
        elif flag == f"--{name}" and index + 1 < len(flags):
            value = flags[index + 1]
    return value


def ships_package(args: argparse.Namespace) -> bool:
    """Whether the workers need tokenmill shipped to them: remote workers, and nothing named already."""
    if args.runner in ("local", "dask") or args.runner.lower() in _LOCAL_BEAM_RUNNERS:
        return False
    if args.extra_package or args.setup_file or args.sdk_container_image:
        return False
    passed = args.beam_option
    if any(
        _beam_option_value(passed, name) for name in ("extra_package", "setup_file", "sdk_container_image")
    ):
        return False
    environment = _beam_option_value(passed, "environment_type")
    return not (environment and environment.upper() in _ENVIRONMENTS_WITHOUT_STAGING)


def _package_flags(args: argparse.Namespace) -> list[str]:
    flags = [f"--extra_package={package}" for package in args.extra_package or []]
    if args.setup_file:
        flags.append(f"--setup_file={args.setup_file}")
    if args.sdk_container_image:
        flags.append(f"--sdk_container_image={args.sdk_container_image}")
    if ships_package(args):
        from tokenmill.pipelines.worker_package import PackageError, build_worker_wheel

        try:
            flags.append(f"--extra_package={build_worker_wheel()}")
        except PackageError as error:
            raise _usage_error(str(error)) from None
    return flags


def _workers_flag(args: argparse.Namespace, flag: str | None) -> list[str]:
    if not args.workers:
        return []
    if flag is None:
        raise _usage_error(
            f"--workers has no meaning for --runner {args.runner}: give the runner's own flag with "
            "--beam_option (for example --beam_option=--parallelism=8)"
        )
    return [f"--{flag}={args.workers}"]


def pipeline_flags(args: argparse.Namespace) -> list[str]:
    """Beam command-line flags for the chosen runner (building the worker wheel where one is shipped)."""
    if args.runner == "local":
        workers = local_worker_count(args.workers)
        mode = "multi_processing" if workers > 1 else "in_memory"
        return [f"--direct_num_workers={workers}", f"--direct_running_mode={mode}", *args.beam_option]
    if args.runner == "dask":
        flags = [f"--dask_local_workers={local_worker_count(args.workers)}"]
        if args.dask_address:
            flags.append(f"--dask_client_address={args.dask_address}")
        return [*flags, *args.beam_option]

    if args.runner == "dataflow":
        missing = [name for name in ("project", "region", "temp_location") if not getattr(args, name)]
        if missing:
            raise _usage_error("--runner dataflow needs " + ", ".join(f"--{name}" for name in missing))
        flags = ["--runner=DataflowRunner", *_workers_flag(args, "num_workers")]
    else:
        flags = [f"--runner={args.runner}", *_workers_flag(args, _WORKER_FLAGS.get(args.runner.lower()))]
    # Cloud options mean the same on every runner that reads them (a Flink job may write to gs:// too).
    for name in (
        "project",
        "region",
        "temp_location",
        "staging_location",
        "job_name",
        "machine_type",
        "max_num_workers",
        "service_account_email",
    ):
        value = getattr(args, name)
        if value:
            flags.append(f"--{name}={value}")
    flags.extend(_package_flags(args))
    if args.dry_run:
        if args.runner != "dataflow":
            raise _usage_error("--dry_run is a Dataflow option")
        flags.append("--dry_run=True")
    return [*flags, *args.beam_option]


def start_warm_workers(args: argparse.Namespace, modules: Sequence[str] = ()) -> WarmWorkers | None:
    """A pool of worker processes for a local run with several workers, whose template starts now so
    that its imports of `modules` overlap the launcher's (tokenmill.pipelines.warm_workers); None for any
    other run, and where the system cannot fork and watch processes (Linux's pidfds). Close it (or use
    it as a context manager) whether or not the run starts."""
    if args.runner != "local" or getattr(args, "dry_run", False):
        return None
    workers = local_worker_count(args.workers)
    chosen = any(
        _beam_option_value(args.beam_option, name) for name in ("direct_running_mode", "environment_type")
    )
    if workers < 2 or chosen or not hasattr(os, "pidfd_open"):
        return None  # one in-process worker, workers the user chose, or a system without pidfds
    from tokenmill.pipelines.warm_workers import WarmWorkers

    return WarmWorkers(workers, modules)


def create_runner(args: argparse.Namespace, warm_workers: WarmWorkers | None = None):
    """The Beam runner object for `--runner` (an unknown name is a usage error naming the known ones);
    a local run takes its workers from `warm_workers` where given."""
    if args.runner == "local":
        from tokenmill.pipelines.local_runner import BoundedBundleFnApiRunner

        return BoundedBundleFnApiRunner(warm_workers=warm_workers)
    if args.runner == "dask":
        from tokenmill.pipelines.dask_runner import DaskRunner

        return DaskRunner()
    from apache_beam.runners.runner import create_runner as create_beam_runner

    name = "DataflowRunner" if args.runner == "dataflow" else args.runner
    try:
        return create_beam_runner(name)
    except (ValueError, ImportError, AttributeError) as error:
        raise _usage_error(f"--runner {args.runner}: {error}") from None


def make_pipeline(args: argparse.Namespace, job_kind: str, warm_workers: WarmWorkers | None = None):
    """A beam.Pipeline for the runner the arguments ask for (see start_warm_workers)."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import GoogleCloudOptions, PipelineOptions

    if args.runner == "dask":
        try:
            import tokenmill.pipelines.dask_runner  # noqa: F401 - registers --dask_local_workers with Beam
        except ModuleNotFoundError as error:  # the `dask` extra is not installed
            raise _usage_error(
                f"--runner dask needs dask and distributed ({error}): pip install 'tokenmill[dask]'"
            ) from None
    flags = pipeline_flags(args)
    options = PipelineOptions(flags, save_main_session=False, pipeline_type_check=True)
    runner = create_runner(args, warm_workers)
    if args.runner == "dataflow" and not args.job_name:
        options.view_as(GoogleCloudOptions).job_name = f"tokenmill-{job_kind}"
    return beam.Pipeline(runner=runner, options=options)
