"""Nothing downloads at run time, curate needs no trainer; the Dataflow job graph builds and every DoFn
survives pickling."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.internal import pickler
from apache_beam.options.pipeline_options import WorkerOptions
from conftest import SAMPLE, WEB_RECIPE, offline_env, run_tokenmill

from tokenmill.pipelines.curate import CurateRun, build_pipeline
from tokenmill.pipelines.options import add_runner_arguments, make_pipeline, pipeline_flags
from tokenmill.pipelines.recipe import load_recipe

# Appended to the offline sitecustomize: every process of the run (the CLI and Beam's workers) fails to
# import the trainer's libraries, as on a curate-only install (`pip install tokenmill[dataflow]`).
BLOCK_TRAINER = """
import importlib.abc, sys

class _NoTrainer(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jax", "jaxlib", "optax", "orbax"):
            raise ImportError(f"{name} is not part of a curate-only install")
        return None

sys.meta_path.insert(0, _NoTrainer())
"""


@pytest.mark.slow  # half a minute of curate runs: make test-slow
def test_curate_runs_with_the_network_blocked_and_without_the_trainer(tmp_path):
    env, log = offline_env(tmp_path)
    with open(Path(env["PYTHONPATH"]) / "sitecustomize.py", "a") as site:
        site.write(BLOCK_TRAINER)
    assert "curate" in run_tokenmill("--help", env=env).stdout
    result = run_tokenmill(
        "curate",
        "--recipe",
        str(WEB_RECIPE),
        "--input",
        str(SAMPLE / "*"),
        "--output",
        str(tmp_path / "out"),
        "--workers",
        "2",
        env=env,
    )
    assert "balanced: True" in result.stdout
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["kept"]["documents"] > 100
    # The guard was live (Beam's workers talk over loopback, which it allows) and refused nothing.
    assert not log.exists(), log.read_text()


def dataflow_args(*extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_runner_arguments(parser)
    return parser.parse_args(
        [
            "--runner",
            "dataflow",
            "--project",
            "tokenmill-test",
            "--region",
            "us-central1",
            "--temp_location",
            "gs://tokenmill-test/tmp",
            "--machine_type",
            "n2-standard-8",
            "--workers",
            "50",
            *extra,
        ]
    )


def test_dataflow_flags():
    flags = pipeline_flags(dataflow_args("--max_num_workers", "200"))
    assert "--runner=DataflowRunner" in flags
    assert "--num_workers=50" in flags and "--max_num_workers=200" in flags
    assert "--machine_type=n2-standard-8" in flags
    # By default the workers get a wheel built from the installed package (never a checkout's setup.py).
    [shipped] = [flag.split("=", 1)[1] for flag in flags if flag.startswith("--extra_package=")]
    assert shipped.endswith("tokenmill-0.1.0-py3-none-any.whl") and Path(shipped).is_file()
    assert not any(flag.startswith("--setup_file") for flag in flags)
    wheel_flags = pipeline_flags(dataflow_args("--extra_package", "dist/tokenmill-0.1.0-py3-none-any.whl"))
    assert [flag for flag in wheel_flags if "--extra_package" in flag or "--setup_file" in flag] == [
        "--extra_package=dist/tokenmill-0.1.0-py3-none-any.whl"
    ]
    setup_flags = pipeline_flags(dataflow_args("--setup_file", "./setup.py"))
    assert [flag for flag in setup_flags if "--extra_package" in flag or "--setup_file" in flag] == [
        "--setup_file=./setup.py"
    ]
    # A worker image that holds tokenmill (docker/curate.Dockerfile) needs no package.
    image_flags = pipeline_flags(dataflow_args("--sdk_container_image", "gcr.io/p/tokenmill-curate:1"))
    assert "--sdk_container_image=gcr.io/p/tokenmill-curate:1" in image_flags
    assert not any(flag.startswith(("--extra_package", "--setup_file")) for flag in image_flags)


def test_dataflow_job_graph_builds_and_every_dofn_pickles():
    recipe = load_recipe(WEB_RECIPE)
    run = CurateRun(
        recipe, str(WEB_RECIPE), ["gs://tokenmill-test/raw/a.jsonl.zst"], "gs://tokenmill-test/out"
    )
    # A dry run builds the package for the workers (the installed tokenmill's wheel) and the job, and
    # submits nothing.
    pipeline = make_pipeline(dataflow_args("--dry_run"), "curate")
    build_pipeline(pipeline, run)

    dofns = []

    class CollectDoFns(beam.pipeline.PipelineVisitor):
        def visit_transform(self, applied):
            if isinstance(applied.transform, beam.ParDo):
                dofns.append(applied.transform.dofn)

    pipeline.visit(CollectDoFns())
    assert len(dofns) > 10
    for dofn in dofns:
        restored = pickler.loads(pickler.dumps(dofn))
        assert type(restored) is type(dofn)
    step_names = {type(dofn).__name__ for dofn in dofns}
    assert {"ReadFile", "ApplyStep", "_WriteFile", "WriteStats"} <= step_names

    result = pipeline.run()  # DataflowRunner with --dry_run: translates to a Dataflow job, submits nothing
    assert result.state == "DONE"
    job = result.job
    assert job.proto.name == "tokenmill-curate"
    worker_options = pipeline.options.view_as(WorkerOptions)
    assert (worker_options.machine_type, worker_options.num_workers) == ("n2-standard-8", 50)
    from apache_beam.portability.api import beam_runner_api_pb2

    staged = {
        beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(dependency.role_payload).staged_name
        for environment in job.proto_pipeline.components.environments.values()
        for dependency in environment.dependencies
    }
    assert {"tokenmill-0.1.0-py3-none-any.whl", "extra_packages.txt"} <= staged  # what workers install
    transforms = {t.unique_name for t in job.proto_pipeline.components.transforms.values()}
    assert {"Read", "Step2_exact_dedupe", "WriteOutputs", "WriteStats"} <= {
        name.split("/")[0] for name in transforms
    }
