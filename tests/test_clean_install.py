"""A plain install curates: `pip install .` alone, in a new virtual environment, runs every shipped recipe.

The dev extras (pytest, datasketch, dask, Beam's gcp extra, ...) are installed in .venv, so a module that
only they bring would hide there. This test builds a virtual environment with nothing but
`pip install .` of the package's files (those the curate container copies: docker/curate.Dockerfile),
imports every tokenmill module outside the `train` and `dask` extras, trains the demo's classifiers and
topic domains with it (mixed.yaml and demo.yaml read them, as in scripts/demo.sh), and curates
data/sample with every configs/curate/*.yaml (warc.yaml with a WARC file added); each run's counts must
balance, in stats.json and in the rows of the files written. Then it installs the worker wheel that a
Dataflow launch ships (tokenmill.pipelines.worker_package) into a second new environment, as a worker
would, and curates there too.

Slow (pip installs two environments, from pip's cache where it has one): `make test-install`, which
CI runs after `make test`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from conftest import REPO, SAMPLE, rejected_rows
from test_warc import good_records, write_warc

from tokenmill.formats.stats import read_stats

pytestmark = [pytest.mark.slow, pytest.mark.install]

RECIPES = sorted((REPO / "configs" / "curate").glob("*.yaml"))
#: What the curate container copies to install tokenmill (docker/curate.Dockerfile).
PACKAGE_FILES = ("pyproject.toml", "setup.py", "README.md", "src")
#: Modules of the optional extras: the trainer and the export of its checkpoints (`train`), the Dask runner
#: (`dask`).
EXTRA_MODULES = ("tokenmill.trainer", "tokenmill.export", "tokenmill.pipelines.dask_runner")
#: Modules that only the dev extras bring; a plain install must not have them.
DEV_ONLY = ("pytest", "datasketch", "dask", "hypothesis", "jax")
#: The demo's models, trained as scripts/demo.sh trains them (the recipes' model paths are these).
MODEL_COMMANDS = [
    ["-m", "tokenmill.samples.classifier_data", "--output", "out/demo/classifier-data"],
    ["-m", "tokenmill", "classifier", "train", "--kind", "domain"]
    + ["--input", "out/demo/classifier-data/domain.jsonl", "--output", "out/demo/models/domain"],
    ["-m", "tokenmill", "classifier", "train", "--kind", "quality"]
    + ["--input", "out/demo/classifier-data/quality.jsonl", "--output", "out/demo/models/quality"]
    + ["--calibration", "out/demo/classifier-data/calibration.jsonl"],
    ["-m", "tokenmill", "domains", "train", "--input", "data/sample", "--k", "32", "--domains", "8"]
    + ["--min-share", "0.02", "--output", "out/demo/models/domains"],
    # demo.yaml's decontam stage reads the index of the demo's evaluation set.
    ["-m", "tokenmill", "decontam", "index", "--evals", "data/evals/docs-qa.jsonl"]
    + ["--output", "out/demo/decontam.index"],
]
IMPORT_EVERY_MODULE = f"""
import importlib, pkgutil, sys, tokenmill
names = [m.name for m in pkgutil.walk_packages(tokenmill.__path__, "tokenmill.")
         if m.name != "tokenmill.__main__" and not m.name.startswith({EXTRA_MODULES!r})]
for name in names:
    importlib.import_module(name)
dev = [name for name in {DEV_ONLY!r} if importlib.util.find_spec(name)]
assert not dev, f"a plain install has dev-only packages: {{dev}}"
print(len(names))
"""


def _run(command: list[str], cwd: Path, timeout: float = 1200) -> str:
    # No PYTHONPATH: the new environment must find everything in itself, not in the checkout or .venv.
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_FIND_LINKS", "PIP_CONFIG_FILE", "TMPDIR"):
        if name in os.environ:
            env[name] = os.environ[name]
    cache = Path.home() / ".cache" / "pip"  # pip's own cache, so reruns install without downloading
    env["PIP_CACHE_DIR"] = str(cache)
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if result.returncode:
        what = " ".join(command)
        raise AssertionError(f"{what} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


def _new_environment(folder: Path, *requirements: str) -> Path:
    """A new virtual environment at `folder` with `pip install REQUIREMENTS` and nothing else; its python."""
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True, capture_output=True)
    python = folder / "bin" / "python"
    _run([str(python), "-m", "pip", "install", "--quiet", *requirements], folder.parent)
    return python


def _assert_balanced(output: Path) -> dict:
    """stats.json balances, and the files written hold the rows it counts (every document once)."""
    stats = read_stats(str(output / "stats.json"))
    assert stats.balanced, f"{output}: stats.json does not balance"
    kept, removed, rejected = stats.kept.documents, stats.removed.documents, stats.rejected.documents
    assert stats.read.documents == kept + removed + rejected
    curated_ids = [i for p in sorted((output / "curated").rglob("*.parquet")) for i in pq.read_table(p)["id"]]
    removed_ids = [i for p in sorted((output / "removed").rglob("*.parquet")) for i in pq.read_table(p)["id"]]
    assert (len(curated_ids), len(removed_ids), len(rejected_rows(output))) == (kept, removed, rejected)
    ids = [str(i) for i in curated_ids + removed_ids]
    assert len(set(ids)) == len(ids), f"{output}: a document is written twice"
    assert kept > 0 and removed > 0, f"{output}: nothing kept or nothing removed ({kept}, {removed})"
    return {"read": stats.read.documents, "kept": kept, "removed": removed, "rejected": rejected}


def _curate(python: Path, work: Path, recipe: Path, inputs: list[str], output: str) -> dict:
    command = [str(python), "-m", "tokenmill", "curate", "--recipe", str(recipe), "--output", output]
    for pattern in inputs:
        command += ["--input", pattern]
    _run(command, work)
    return _assert_balanced(work / output)


@pytest.fixture(scope="module")
def plain_install(tmp_path_factory) -> Path:
    """The python of a new environment with `pip install .` of the package's files and no extras."""
    root = tmp_path_factory.mktemp("clean-install")
    package = root / "tokenmill"
    package.mkdir()
    for name in PACKAGE_FILES:
        source = REPO / name
        if source.is_dir():
            caches = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(source, package / name, ignore=caches)
        else:
            shutil.copyfile(source, package / name)
    return _new_environment(root / "venv", str(package))


@pytest.fixture(scope="module")
def work(tmp_path_factory, plain_install) -> Path:
    """A scratch folder laid out like the checkout, with the demo's models trained by the plain install."""
    work = tmp_path_factory.mktemp("clean-install-work")
    shutil.copytree(SAMPLE, work / "data" / "sample")
    shutil.copytree(REPO / "data" / "evals", work / "data" / "evals")
    for command in MODEL_COMMANDS:
        _run([str(plain_install), *command], work)
    return work


def test_a_plain_install_imports_every_module_outside_the_extras(plain_install, tmp_path):
    assert int(_run([str(plain_install), "-c", IMPORT_EVERY_MODULE], tmp_path)) > 50
    # What an extra brings is asked for by name where it is missing.
    command = [
        str(plain_install),
        "-m",
        "tokenmill",
        "curate",
        "--recipe",
        str(REPO / "configs/curate/web.yaml"),
    ]
    command += ["--input", str(SAMPLE / "*"), "--output", str(tmp_path / "out"), "--runner", "dask"]
    result = subprocess.run(
        command, capture_output=True, text=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}
    )
    assert result.returncode == 2 and "pip install 'tokenmill[dask]'" in result.stderr, result.stderr
    export = [str(plain_install), "-m", "tokenmill", "export", "hf", "--run", str(tmp_path / "run")]
    export += ["--output", str(tmp_path / "hf")]
    result = subprocess.run(
        export, capture_output=True, text=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin"}
    )
    assert result.returncode == 2 and "pip install 'tokenmill[train]'" in result.stderr, result.stderr


def test_a_plain_install_curates_the_sample_with_every_shipped_recipe(plain_install, work):
    assert {recipe.stem for recipe in RECIPES} >= {"web", "mixed", "demo", "warc"}
    read = {}
    for recipe in RECIPES:
        inputs = ["data/sample/*"]
        if recipe.stem == "warc":
            # A crawl's WARC file beside the sample: pages through FastWARC, isal and Resiliparse.
            (work / "crawl").mkdir(exist_ok=True)
            inputs.append(str(write_warc(work / "crawl" / "crawl-000.warc.gz", good_records())))
        counts = _curate(plain_install, work, recipe, inputs, f"out/{recipe.stem}")
        read[recipe.stem] = counts["read"]
    pages = read.pop("warc") - read["web"]
    assert pages == 2, f"the WARC file's two pages were not both read ({pages})"
    assert len(set(read.values())) == 1, f"the recipes read the same input differently: {read}"
    # The curated cells go on to a tokenizer and token shards with the same install.
    curated = "out/demo/curated"
    _run(
        [str(plain_install), "-m", "tokenmill", "tokenizer", "train", "--input", curated]
        + ["--vocab-size", "1024", "--output", "out/tokenizer.json"],
        work,
    )
    _run(
        [str(plain_install), "-m", "tokenmill", "tokenize", "--input", curated, "--output", "out/tokens"]
        + ["--tokenizer", "out/tokenizer.json"],
        work,
    )
    counts = json.loads((work / "out" / "tokens" / "counts.json").read_text())
    assert counts, "tokenize wrote an empty catalog"


def test_a_worker_installing_the_shipped_wheel_curates(plain_install, work, tmp_path):
    # What a Dataflow launch ships (--extra_package): the wheel built from the plain install, which a
    # worker installs with its requirements and no extras.
    wheel = _run(
        [
            str(plain_install),
            "-c",
            "from tokenmill.pipelines.worker_package import build_worker_wheel as b; "
            f"print(b({str(tmp_path / 'wheel')!r}))",
        ],
        tmp_path,
    ).strip()
    worker = _new_environment(tmp_path / "worker", wheel)
    _run([str(worker), "-c", IMPORT_EVERY_MODULE], tmp_path)
    expected = _assert_balanced(work / "out" / "demo")
    demo = REPO / "configs" / "curate" / "demo.yaml"
    assert _curate(worker, work, demo, ["data/sample/*"], "out/worker") == expected
