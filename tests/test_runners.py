"""Runners and workers: any Beam runner by name, a second real engine (Dask), the package and container
the workers get, a curate-only install without the trainer, and models loaded once per worker process.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import pickle
import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import apache_beam as beam
import numpy as np
import pytest
import yaml
from conftest import REPO, SAMPLE, WEB_RECIPE, run_tokenmill, tree_bytes
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from tokenmill.cli import main
from tokenmill.errors import UsageError
from tokenmill.filters.models import SharedModel
from tokenmill.pipelines.options import add_runner_arguments, make_pipeline, pipeline_flags
from tokenmill.pipelines.worker_package import build_worker_wheel, worker_metadata

TRAINER_MODULES = ("jax", "jaxlib", "optax", "orbax")


def runner_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_runner_arguments(parser)
    return parser.parse_args(list(argv))


# --- any Beam runner by name ---------------------------------------------------------------------------


def test_any_beam_runner_name_passes_through_with_its_options():
    flink = runner_args(
        "--runner", "FlinkRunner", "--workers", "8", "--beam_option=--flink_master=127.0.0.1:8081"
    )
    flags = pipeline_flags(flink)
    assert flags[0] == "--runner=FlinkRunner" and "--parallelism=8" in flags
    assert flags[-1] == "--flink_master=127.0.0.1:8081"  # passed through last, as given
    # Flink's workers are containers by default: they get the installed tokenmill as a wheel.
    assert any(flag.startswith("--extra_package=") and flag.endswith(".whl") for flag in flags)
    pipeline = make_pipeline(flink, "curate")
    assert type(pipeline.runner).__name__ == "FlinkRunner"
    from apache_beam.options.pipeline_options import FlinkRunnerOptions

    assert pipeline.options.view_as(FlinkRunnerOptions).flink_master == "127.0.0.1:8081"

    spark = make_pipeline(runner_args("--runner", "SparkRunner"), "curate")
    assert type(spark.runner).__name__ == "SparkRunner"
    by_path = runner_args("--runner", "apache_beam.runners.portability.portable_runner.PortableRunner")
    assert type(make_pipeline(by_path, "curate").runner).__name__ == "PortableRunner"
    # Workers in this environment (LOOPBACK, or a local runner) need nothing shipped.
    loopback = runner_args("--runner", "PortableRunner", "--beam_option=--environment_type=LOOPBACK")
    assert not any("--extra_package" in flag for flag in pipeline_flags(loopback))
    assert not any(
        "--extra_package" in flag for flag in pipeline_flags(runner_args("--runner", "DirectRunner"))
    )
    # The short names keep their meaning whatever the case; Beam's class names map onto them.
    assert runner_args("--runner", "DataflowRunner").runner == "dataflow"
    assert runner_args("--runner", "DaskRunner").runner == "dask"
    assert runner_args("--runner", "Local").runner == "local"


def test_bad_runner_requests_are_usage_errors_that_say_what_to_do():
    with pytest.raises(UsageError, match="Unexpected pipeline runner: NoSuchRunner"):
        make_pipeline(runner_args("--runner", "NoSuchRunner"), "curate")
    with pytest.raises(argparse.ArgumentError, match="not a runner"):
        runner_args("--runner", "Flink Runner")
    with pytest.raises(UsageError, match="--workers has no meaning for --runner SparkRunner.*--beam_option"):
        pipeline_flags(runner_args("--runner", "SparkRunner", "--workers", "4"))
    with pytest.raises(UsageError, match="--dry_run is a Dataflow option"):
        pipeline_flags(runner_args("--runner", "FlinkRunner", "--dry_run"))
    with pytest.raises(UsageError, match="--runner dataflow needs --project, --region, --temp_location"):
        pipeline_flags(runner_args("--runner", "dataflow"))


@pytest.fixture(scope="module")
def quick_recipe(tmp_path_factory) -> Path:
    """The web recipe without its two slowest stages (fuzzy dedupe, Gopher repetition): every kind of
    transform curate uses is still there (multiple outputs, batching, GroupByKey, combiners, side inputs)."""
    recipe = yaml.safe_load(WEB_RECIPE.read_text())
    recipe["name"] = "web-quick"
    recipe["stages"] = [
        stage for stage in recipe["stages"] if next(iter(stage)) not in ("fuzzy_dedupe", "gopher_repetition")
    ]
    path = tmp_path_factory.mktemp("recipe") / "web-quick.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def curate(recipe: Path, output: Path, *runner: str) -> subprocess.CompletedProcess:
    return run_tokenmill(
        "curate", "--recipe", str(recipe), "--input", str(SAMPLE / "*"), "--output", str(output), *runner
    )


@pytest.fixture(scope="module")
def local_quick_output(quick_recipe, tmp_path_factory) -> Path:
    """The local runner's output, made in this process on one worker: its bytes do not depend on the worker
    count (test_curate.py), and two worker processes took three times as long here."""
    output = tmp_path_factory.mktemp("local") / "out"
    argv = ["curate", "--recipe", str(quick_recipe), "--input", str(SAMPLE / "*"), "--output", str(output)]
    assert main([*argv, "--workers", "1"]) == 0
    return output


@pytest.fixture(scope="module")
def local_quick(local_quick_output) -> dict[str, bytes]:
    return tree_bytes(local_quick_output)


def test_portable_runner_by_name_gives_the_local_runners_bytes(quick_recipe, local_quick, tmp_path):
    # A real Beam job service (embedded) and SDK workers on loopback, reached only through --runner and
    # --beam_option: the path a Flink or Spark job server takes.
    result = curate(
        quick_recipe,
        tmp_path / "out",
        "--runner",
        "PortableRunner",
        "--beam_option=--job_endpoint=embed",
        "--beam_option=--environment_type=LOOPBACK",
    )
    assert "balanced: True" in result.stdout
    assert tree_bytes(tmp_path / "out") == local_quick


# --- Dask --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dask_cluster():
    """A dask.distributed cluster of two worker processes on loopback, shared by the Dask tests."""
    import logging

    from dask.distributed import LocalCluster

    with LocalCluster(
        n_workers=2,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address="127.0.0.1:0",
        silence_logs=logging.CRITICAL,
    ) as cluster:
        yield cluster


@pytest.mark.slow  # the default suite's 15-minute budget; make test-slow runs it
def test_curate_on_a_dask_cluster_gives_the_local_runners_bytes(
    dask_cluster, quick_recipe, local_quick, tmp_path
):
    result = curate(
        quick_recipe, tmp_path / "out", "--runner", "dask", "--dask_address", dask_cluster.scheduler_address
    )
    assert "balanced: True" in result.stdout
    assert "CPU seconds inside each step: " in result.stdout  # Beam counters came back from the workers
    assert tree_bytes(tmp_path / "out") == local_quick
    stats = json.loads((tmp_path / "out" / "stats.json").read_text())
    assert stats["rejected"]["documents"] == 3 and stats["kept"]["documents"] > 100


def test_tokenize_on_a_dask_cluster_gives_the_local_runners_bytes(dask_cluster, local_quick_output, tmp_path):
    curated, tokenizer = str(local_quick_output / "curated"), str(tmp_path / "tokenizer.json")
    run_tokenmill("tokenizer", "train", "--input", curated, "--vocab-size", "512", "--output", tokenizer)
    tokenize = ("tokenize", "--input", curated, "--tokenizer", tokenizer, "--output")
    run_tokenmill(*tokenize, str(tmp_path / "local"))
    run_tokenmill(
        *tokenize,
        str(tmp_path / "dask"),
        "--runner",
        "dask",
        "--dask_address",
        dask_cluster.scheduler_address,
    )
    assert tree_bytes(tmp_path / "dask") == tree_bytes(tmp_path / "local")
    assert (tmp_path / "dask" / "counts.json").exists()


def test_dask_flags_reach_the_runner():
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.runners.dask.dask_runner import DaskOptions

    from tokenmill.pipelines.dask_runner import DaskRunner, TokenmillDaskOptions

    args = runner_args(
        "--runner",
        "dask",
        "--workers",
        "3",
        "--dask_address",
        "tcp://127.0.0.1:8786",
        "--beam_option=--dask_shuffle_partitions=5",
    )
    options = PipelineOptions(pipeline_flags(args))
    ours = options.view_as(TokenmillDaskOptions)
    assert (ours.dask_local_workers, ours.dask_shuffle_partitions) == (3, 5)
    assert options.view_as(DaskOptions).address == "tcp://127.0.0.1:8786"
    assert isinstance(make_pipeline(args, "curate").runner, DaskRunner)


def record_load(path: str) -> np.ndarray:
    """A stand-in for a heavy model: says which process loaded it, and when."""
    with open(path, "a") as log:
        log.write(f"{os.getpid()}\n")
    return np.arange(1000)


class UsesModel(beam.DoFn):
    def __init__(self, log: str):
        self.model = SharedModel(record_load, log)
        self.bundles = beam.metrics.Metrics.counter("test", "bundles")

    def setup(self):
        self.array = self.model.get()

    def start_bundle(self):
        self.bundles.inc()

    def process(self, element: int):
        if element % 7 == 0:
            yield beam.pvalue.TaggedOutput("sevens", element)
        else:
            yield int(self.array[element % 1000])


def test_dask_runner_routes_outputs_keeps_finish_bundle_and_loads_models_once_per_process(
    dask_cluster, tmp_path
):
    from apache_beam.options.pipeline_options import PipelineOptions

    from tokenmill.pipelines.dask_runner import DaskRunner

    log = tmp_path / "loads.log"
    result_path = tmp_path / "result.json"
    options = PipelineOptions([f"--dask_client_address={dask_cluster.scheduler_address}"])
    pipeline = beam.Pipeline(runner=DaskRunner(), options=options)
    numbers = pipeline | beam.Create(list(range(60)))  # 60 bundles: one per element
    split = numbers | beam.ParDo(UsesModel(str(log))).with_outputs("sevens", main="rest")
    sevens = split.sevens | "SumSevens" >> beam.CombineGlobally(sum)
    # BatchElements emits its last, partial batch in finish_bundle.
    batched = split.rest | beam.BatchElements(min_batch_size=4, max_batch_size=4) | beam.Map(len)
    counted = batched | "CountBatched" >> beam.CombineGlobally(sum)
    by_key = numbers | beam.Map(lambda n: (n % 3, n)) | beam.CombinePerKey(sum) | beam.combiners.ToDict()

    def write(_, sevens, counted, by_key):
        result_path.write_text(json.dumps({"sevens": sevens, "counted": counted, "by_key": by_key}))

    (
        pipeline
        | "Once" >> beam.Create([None])
        | beam.Map(
            write,
            beam.pvalue.AsSingleton(sevens),
            beam.pvalue.AsSingleton(counted),
            beam.pvalue.AsSingleton(by_key),
        )
    )
    result = pipeline.run()
    assert result.wait_until_finish() == "DONE"
    assert json.loads(result_path.read_text()) == {
        "sevens": sum(range(0, 60, 7)),
        "counted": 60 - len(range(0, 60, 7)),
        "by_key": {"0": sum(range(0, 60, 3)), "1": sum(range(1, 60, 3)), "2": sum(range(2, 60, 3))},
    }
    [bundles] = result.metrics().query(beam.metrics.MetricsFilter().with_name("bundles"))["counters"]
    assert bundles.committed == 60
    loads = log.read_text().split()
    assert 1 <= len(loads) <= 2 and len(set(loads)) == len(loads)  # once per worker process


class CountValues(beam.CombineFn):
    """Counts values, and writes how many accumulators each merge saw (to catch an unlifted combine)."""

    def __init__(self, log: str):
        self.log = log

    def create_accumulator(self) -> int:
        return 0

    def add_input(self, count: int, _) -> int:
        return count + 1

    def merge_accumulators(self, counts) -> int:
        counts = list(counts)
        with open(self.log, "a") as log:
            log.write(f"{len(counts)}\n")
        return sum(counts)

    def extract_output(self, count: int) -> int:
        return count


class FailsOncePerBundle(beam.DoFn):
    """Raises the first time it meets a multiple of 100 (one per bundle here), like a flaky read."""

    def __init__(self, markers: str):
        self.markers = markers

    def process(self, element: int):
        marker = Path(self.markers) / str(element)
        if element % 100 == 0 and not marker.exists():
            marker.touch()
            raise ConnectionResetError(f"transient failure on {element}")
        yield ("hot", element)


def test_dask_runner_combines_before_the_shuffle_and_retries_failed_bundles(dask_cluster, tmp_path):
    from apache_beam.options.pipeline_options import PipelineOptions

    from tokenmill.pipelines.dask_runner import DaskRunner

    merges, markers, output = tmp_path / "merges.log", tmp_path / "markers", tmp_path / "count.json"
    markers.mkdir()
    options = PipelineOptions(
        [
            f"--dask_client_address={dask_cluster.scheduler_address}",
            "--dask_npartitions=40",  # 40 bundles of 100 values, every value under one key
            "--dask_task_retries=1",
        ]
    )
    pipeline = beam.Pipeline(runner=DaskRunner(), options=options)
    (
        pipeline
        | beam.Create(list(range(4000)))
        | beam.ParDo(FailsOncePerBundle(str(markers)))
        | beam.CombinePerKey(CountValues(str(merges)))
        | beam.Map(lambda counted: output.write_text(json.dumps(counted)))
    )
    assert pipeline.run().wait_until_finish() == "DONE"  # every bundle failed once and was retried
    assert sorted(int(marker.name) for marker in markers.iterdir()) == list(range(0, 4000, 100))
    assert json.loads(output.read_text()) == ["hot", 4000]  # nothing lost or counted twice
    # The hot key's values were combined per bundle: its final merge saw 40 accumulators, not 4,000 values.
    assert [int(count) for count in merges.read_text().split()] == [40]


@pytest.mark.slow
def test_full_web_recipe_on_a_local_dask_cluster_gives_the_local_runners_bytes(tmp_path):
    # --runner dask without an address: tokenmill starts (and stops) a cluster of --workers processes.
    curate(WEB_RECIPE, tmp_path / "local", "--workers", "2")
    result = curate(WEB_RECIPE, tmp_path / "dask", "--runner", "dask", "--workers", "2")
    assert "balanced: True" in result.stdout
    assert tree_bytes(tmp_path / "dask") == tree_bytes(tmp_path / "local")


def test_dask_runner_refuses_what_it_cannot_run():
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.transforms.userstate import ReadModifyWriteStateSpec

    from tokenmill.pipelines.dask_runner import DaskRunner

    class Stateful(beam.DoFn):
        STATE = ReadModifyWriteStateSpec("seen", beam.coders.VarIntCoder())

        def process(self, element, seen=beam.DoFn.StateParam(STATE)):  # noqa: B008 - Beam's idiom
            yield element

    pipeline = beam.Pipeline(
        runner=DaskRunner(), options=PipelineOptions(["--dask_client_address=tcp://127.0.0.1:1"])
    )
    _ = pipeline | beam.Create([("a", 1)]) | "KeepState" >> beam.ParDo(Stateful())
    with pytest.raises((NotImplementedError, OSError)):
        pipeline.run()


# --- the package and the container of the workers ----------------------------------------------------------


def test_the_worker_wheel_is_rebuilt_identically_from_a_non_editable_install(tmp_path):
    wheel = Path(build_worker_wheel(str(tmp_path / "from-checkout")))
    assert wheel.name == f"tokenmill-{importlib.metadata.version('tokenmill')}-py3-none-any.whl"
    names = zipfile.ZipFile(wheel).namelist()
    assert "tokenmill/pipelines/curate.py" in names and "tokenmill/reports/templates/base.html.j2" in names
    assert not any("__pycache__" in name or name.endswith(".pyc") for name in names)

    # pip installs it (not editable), and that install alone builds the same wheel again: what
    # `pip install tokenmill` followed by a Dataflow launch does.
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--no-index",
            "--target",
            str(target),
            str(wheel),
        ],
        check=True,
    )
    assert (target / "bin" / "tokenmill").exists()  # the console script came from entry_points.txt
    script = (
        "import sys, tokenmill; from tokenmill.pipelines.worker_package import build_worker_wheel; "
        f"print(tokenmill.__file__); print(build_worker_wheel({str(tmp_path / 'from-install')!r}))"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    imported, rebuilt = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True, env=env
    ).stdout.split()
    assert imported.startswith(str(target))
    assert Path(rebuilt).read_bytes() == wheel.read_bytes()


def test_workers_get_the_dataflow_extra_and_never_the_trainer():
    metadata = importlib.metadata.distribution("tokenmill").read_text("METADATA")
    shipped = [
        Requirement(line.split(":", 1)[1])
        for line in worker_metadata(metadata).splitlines()
        if line.startswith("Requires-Dist:")
    ]
    unconditional = {requirement.name for requirement in shipped if requirement.marker is None}
    optional = {requirement.name for requirement in shipped if requirement.marker is not None}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    for dependency in project["optional-dependencies"]["dataflow"]:
        assert Requirement(dependency).name in unconditional
    assert not unconditional & {"jax", "optax", "orbax-checkpoint"}
    assert {"jax", "optax", "orbax-checkpoint"} <= optional
    # The same holds for the package itself: the trainer is an extra, never a core dependency.
    core = {Requirement(dependency).name for dependency in project["dependencies"]}
    assert not core & {"jax", "jaxlib", "optax", "orbax-checkpoint"}
    assert {Requirement(d).name for d in project["optional-dependencies"]["train"]} == {
        "jax",
        "optax",
        "orbax-checkpoint",
        "scikit-learn",  # the mixture search's Gaussian-process fit
        "safetensors",  # tokenmill export hf
        "ml_dtypes",
    }
    # An extra folded into the worker's requirements keeps any other condition it had.
    folded = worker_metadata('Requires-Dist: gcsfs>=2024; python_version >= "3.11" and extra == "dataflow"\n')
    assert folded == 'Requires-Dist: gcsfs>=2024; python_version >= "3.11"\n'


def test_curate_pipeline_help_and_recipes_import_no_trainer():
    script = """
import sys
from tokenmill.cli import build_parser
build_parser().format_help()
import tokenmill.pipelines.curate, tokenmill.pipelines.tokenize, tokenmill.pipelines.commands
import tokenmill.pipelines.dask_runner, tokenmill.pipelines.worker_package
from tokenmill.pipelines.recipe import build_steps, load_recipe
for recipe in ("configs/curate/web.yaml", "configs/curate/warc.yaml"):
    build_steps(load_recipe(recipe), recipe)
print(sorted(name for name in sys.modules if name.split(".")[0] in {TRAINER}))
""".replace("{TRAINER}", repr(set(TRAINER_MODULES)))
    loaded = subprocess.run(
        [sys.executable, "-c", script], check=True, capture_output=True, text=True, cwd=REPO
    ).stdout
    assert loaded.strip() == "[]"


def dockerfile_args(text: str) -> dict[str, str]:
    return dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.MULTILINE))


def test_the_curate_container_matches_the_installed_beam_and_holds_no_trainer():
    text = (REPO / "docker" / "curate.Dockerfile").read_text()
    defaults = dockerfile_args(text)
    assert defaults["BEAM_VERSION"] == beam.__version__  # the launcher's SDK, as Dataflow requires
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert defaults["PYTHON_VERSION"] in SpecifierSet(project["requires-python"])
    [base] = re.findall(r"^FROM (\S+)$", text, re.MULTILINE)
    assert base == "apache/beam_python${PYTHON_VERSION}_sdk:${BEAM_VERSION}"
    assert "ENTRYPOINT" not in text  # the SDK image's boot program is what the runners start
    for sources in re.findall(r"^COPY (.+) \S+$", text, re.MULTILINE):
        for source in sources.split():
            assert (REPO / source).exists(), source
    [install] = re.findall(
        r'pip install --no-cache-dir (".*?") gcsfs "apache-beam\[gcp\]==\$\{BEAM_VERSION\}"', text
    )
    extras = re.fullmatch(r'"\.\[([\w,]+)\]"', install).group(1).split(",")
    assert extras == ["dataflow"] and set(extras) <= set(project["optional-dependencies"])
    # The build context is the repository root; the ignore file beside the Dockerfile keeps the sources.
    ignore = (REPO / "docker" / "curate.Dockerfile.dockerignore").read_text().split()
    assert ignore[ignore.index("*") + 1 :][:4] == ["!pyproject.toml", "!setup.py", "!README.md", "!src/"]


def readme_commands(text: str) -> list[str]:
    """The shell commands of README's code blocks, continuation lines joined."""
    commands, current = [], ""
    for line in text.splitlines():
        current += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if not line.endswith("\\"):
            commands.append(current)
            current = ""
    return commands


def test_readme_dataflow_command_parses_and_ships_the_package():
    [command] = [
        c
        for c in readme_commands((REPO / "README.md").read_text())
        if c.startswith("tokenmill curate") and "dataflow" in c
    ]
    from tokenmill.cli import build_parser

    args = build_parser().parse_args([token.strip("'") for token in command.split()[1:]])
    flags = pipeline_flags(args)
    assert "--runner=DataflowRunner" in flags
    assert any(flag.startswith("--extra_package=") and flag.endswith(".whl") for flag in flags)


# --- models: once per worker process, from local or gs:// paths ---------------------------------------------


def test_a_shared_model_loads_once_per_process_however_often_its_step_is_pickled(tmp_path):
    log = tmp_path / "loads.log"
    handle = SharedModel(record_load, str(log))
    copies = [pickle.loads(pickle.dumps(handle)) for _ in range(5)]
    models = [copy.get() for copy in copies]
    assert all(model is models[0] for model in models)
    assert log.read_text().split() == [str(os.getpid())]
    # A pickled handle never carries the loaded model.
    assert pickle.loads(pickle.dumps(copies[0]))._held is None


LANGUAGE_MODEL_SCRIPT = """
import random, sys
import fasttext

path = sys.argv[1]
words = {
    "en": "the cat sat on the mat and the dog ran in the park with the children".split(),
    "fr": "le chat est sur le tapis et le chien court dans le parc avec les enfants".split(),
}
rng = random.Random(0)
train = path + ".txt"
with open(train, "w") as handle:
    handle.write("".join(
        f"__label__{lang} {' '.join(rng.sample(words[lang], 8))}\\n" for _ in range(100) for lang in words
    ))
# The classifier configs' settings (configs/classifiers/*.yaml); smaller hash tables make fastText diverge on
# so little text.
fasttext.train_supervised(
    train, dim=16, epoch=10, lr=0.5, wordNgrams=2, bucket=200_000, minCount=1, thread=1, seed=1, verbose=0
).save_model(path)
"""


def train_language_model(path: Path) -> None:
    """A two-language fastText language-id model (lid.176.bin's format), trained in a second.

    In a fresh process: after some other tests have run in this one, fastText's training on so little
    text can end in "Encountered NaN"."""
    subprocess.run([sys.executable, "-c", LANGUAGE_MODEL_SCRIPT, str(path)], check=True, timeout=120)


def test_language_and_decontam_models_load_from_gs_once_per_process(gcs, tmp_path, monkeypatch):
    from tokenmill.filters.decontam import Decontaminate, build_index, eval_set_sources, read_eval_sets
    from tokenmill.filters.language import LanguageFilter

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "lid.bin"
    train_language_model(model)
    evals = tmp_path / "evals" / "quiz.jsonl"
    evals.parent.mkdir()
    question = "what is the name of the river that flows through the middle of the old town of prague"
    evals.write_text(json.dumps({"question": question, "answer": "the vltava"}) + "\n")
    index = tmp_path / "decontam.idx"
    build_index(read_eval_sets(eval_set_sources([str(evals)]))).save(str(index))
    remote_model = gcs.upload(model, "models", "lid.bin")
    remote_index = gcs.upload(index, "models", "decontam.idx")

    documents = [
        {"text": "the dog ran in the park with the children"},
        {"text": "le chien court dans le parc avec les enfants"},
        {"text": f"Quiz night! {question.capitalize()}? Answer: the Vltava.", "metadata": None},
    ]
    verdicts = {}
    for where, model_path, index_path in (
        ("local", str(model), str(index)),
        ("gs", remote_model, remote_index),
    ):
        language = LanguageFilter(languages=["en"], min_score=0.0, backend="fasttext", model_path=model_path)
        decontam = Decontaminate(index_path)
        copies = [pickle.loads(pickle.dumps(step)) for step in (language, language, decontam, decontam)]
        for copy in copies:
            copy.setup()
        assert copies[0]._model is copies[1]._model  # one model per process, not per step copy
        assert copies[2]._index is copies[3]._index
        judged = [dict(document) for document in documents]
        verdicts[where] = (
            [v and v.reason for v in copies[0].apply(judged)],
            [v and v.reason for v in copies[2].apply(judged)],
        )
    assert (
        verdicts["local"]
        == verdicts["gs"]
        == (
            [None, "language_not_kept", None],
            [None, None, "contaminated"],
        )
    )
    with pytest.raises(ValueError, match="language model_path not found: gs://.*/missing.bin"):
        LanguageFilter(backend="fasttext", model_path=gcs.url("models", "missing.bin"))
