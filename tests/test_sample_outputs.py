"""No behaviour change: the demo's data stages on the bundled sample give the outputs they gave before.

The stages run as `make demo` runs them (scripts/demo.sh), in a scratch folder laid out like the checkout:
classifier data and the two classifiers, the topic-domain model, the decontam index of data/evals,
`curate` with configs/curate/demo.yaml (mixed.yaml plus the decontam and domain_clusters stages) on
data/sample, the tokenizer, `tokenize`, and the plan of
mixtures/demo.yaml. Every output file's content checksum must equal tests/fixtures/sample-outputs.json.
That file was last written during issue 20, which meant to change these outputs: the classifiers train on
real text only (duplicates removed before the held-out split), mixed.yaml removes line-level boilerplate
first, and the cells are topic domains (cNN) x quality. Issue 30 wrote it again when the classifier
data's legal text came to be read from the core dependencies' license files only: it had read every
installed distribution's, so installing a test tool (pytest-xdist) changed the classifiers and every cell.
Issue 34 wrote it again: the recipes mask and remove personal data (the `pii` column, the stage in the
funnel), flag the documents that quote data/evals/docs-qa.jsonl (the decontam stage) and name each
source's license, and the stats gain the boilerplate stage's repeated lines. The
same regeneration took the classifiers of a fresh install: the legal pool is read from the core
dependencies' license files, so a release that adds a dependency or edits a license file moves them.

Checksums are of content, not bytes, where the bytes depend on a library's version rather than on what
tokenmill wrote: a Parquet file by its schema (names and types) and rows, a .zst file by what it
decompresses to, a JSON file by its parsed value. Shards, tokenizer and models are compared byte for byte.

Nothing compared may depend on the CPU's float arithmetic, and the outputs are made so, rather than the
checksum made lenient: a float rounded before hashing still flips where a value lies near the rounding
boundary, so no rounding makes a checksum of CPU-dependent numbers hold on every machine. Issue 30 found
7 removed/ files changed on an Intel Xeon: their rows carry language_score, and py3langid took it as a
float32 product through OpenBLAS, whose kernel (SkylakeX, Haswell, ... picked at run time for the CPU)
sums in another order: 60 of the sample's 1,668 scores differed in their last digits between two
kernels, nearly all in documents that prose filters remove (curated/ mostly holds scores of exactly
1.0, which no order changes; here 2 of its files changed too). tokenmill.filters.language now scores
in float64 without BLAS, in an order no SIMD width changes; the float64 softmax then differs between
numpy's SIMD paths by an ulp at most, far below the float32 stored and the 4 decimals of `detail`. The
other floats written are the fastText classifiers' (fastText's own loops, compiled once, no CPU
dispatch) and domain_clusters' (float64 products cast to float32). Rows are in id order within each
file (WritePartitioned sorts them), not in order of arrival.
`test_the_scores_written_do_not_depend_on_the_cpus_simd_path` holds this on the machine at hand: the
sample's language scores with OpenBLAS's generic x86-64 kernel and numpy's baseline loops (every SIMD
dispatch target off) are those of the default run, bit for bit.

A change that is meant to change these outputs regenerates the file, deliberately, and says why:

    .venv/bin/python tests/test_sample_outputs.py --write

(`--of DIR` prints the checksums of a finished demo output folder instead, e.g. `--of out/demo` after
`make demo`, to compare two trees by hand.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import zstandard

REPO = Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "sample-outputs.json"
#: What the stages read from the checkout, copied to the scratch folder under the same names (the
#: recipe's model paths and the mixture's counts: file are relative to it, as in the demo).
CHECKOUT_INPUTS = ("data/sample", "data/evals", "configs/curate/demo.yaml", "mixtures/demo.yaml")
#: The demo's commands (scripts/demo.sh), run from the scratch folder.
STAGES = [
    ("classifier data", ["-m", "tokenmill.samples.classifier_data", "--output", "out/demo/classifier-data"]),
    (
        "domain classifier",
        ["-m", "tokenmill", "classifier", "train", "--kind", "domain"]
        + ["--input", "out/demo/classifier-data/domain.jsonl", "--output", "out/demo/models/domain"],
    ),
    (
        "quality classifier",
        ["-m", "tokenmill", "classifier", "train", "--kind", "quality"]
        + ["--input", "out/demo/classifier-data/quality.jsonl", "--output", "out/demo/models/quality"]
        + ["--calibration", "out/demo/classifier-data/calibration.jsonl"],
    ),
    (
        "topic domains",
        ["-m", "tokenmill", "domains", "train", "--input", "data/sample", "--k", "32", "--domains", "8"]
        + ["--min-share", "0.02", "--output", "out/demo/models/domains"],
    ),
    (
        "decontam index",
        ["-m", "tokenmill", "decontam", "index", "--evals", "data/evals/docs-qa.jsonl"]
        + ["--output", "out/demo/decontam.index"],
    ),
    (
        "curate",
        ["-m", "tokenmill", "curate", "--recipe", "configs/curate/demo.yaml", "--input", "data/sample/*"]
        + ["--output", "out/demo/curate", "--overwrite"],
    ),
    (
        "tokenizer",
        ["-m", "tokenmill", "tokenizer", "train", "--input", "out/demo/curate/curated"]
        + ["--vocab-size", "4096", "--name", "tokenmill-bpe-4k", "--output", "out/demo/tokenizer.json"],
    ),
    (
        "tokenize",
        ["-m", "tokenmill", "tokenize", "--input", "out/demo/curate/curated", "--output", "out/demo/tokens"]
        + ["--tokenizer", "out/demo/tokenizer.json", "--overwrite"]
        + ["--heldout-fraction", "0.05", "--heldout-min-documents", "2"],
    ),
]
PLAN = ["-m", "tokenmill", "mixture", "plan", "mixtures/demo.yaml", "--json"]


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def content_checksum(path: Path) -> str:
    """The sha256 of what a file holds, independent of the writing library's version where that matters."""
    name = path.name
    if name.endswith(".parquet"):
        table = pq.read_table(path)
        schema = [[field.name, str(field.type)] for field in table.schema]
        rows = "".join(json.dumps(row, sort_keys=True) + "\n" for row in table.to_pylist())
        return _sha256(json.dumps(schema).encode() + b"\n" + rows.encode())
    if name.endswith(".zst"):
        return _sha256(zstandard.ZstdDecompressor().stream_reader(path.read_bytes()).read())
    if name.endswith(".json"):
        return _sha256(json.dumps(json.loads(path.read_text()), sort_keys=True).encode())
    return _sha256(path.read_bytes())


def output_checksums(demo: Path) -> dict[str, str]:
    """Every output of the data stages under a demo folder (out/demo), by relative path; the classifier
    training data, an input made by a generator with its own test, is left out."""
    return {
        path.relative_to(demo).as_posix(): content_checksum(path)
        for path in sorted(demo.rglob("*"))
        if path.is_file() and not path.relative_to(demo).as_posix().startswith("classifier-data/")
    }


def run_sample_stages(work: Path) -> Path:
    """Run the demo's data stages in `work` (laid out like the checkout); returns work/out/demo."""
    for relative in CHECKOUT_INPUTS:
        source, target = REPO / relative, work / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target)
        else:
            shutil.copyfile(source, target)
    for stage, args in STAGES:
        result = subprocess.run([sys.executable, *args], cwd=work, capture_output=True, text=True)
        if result.returncode:
            raise AssertionError(f"{stage} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    plan = subprocess.run([sys.executable, *PLAN], cwd=work, capture_output=True, text=True, check=True)
    (work / "out" / "demo" / "plan.json").write_text(plan.stdout)
    return work / "out" / "demo"


@pytest.fixture(scope="module")
def checksums(tmp_path_factory) -> dict[str, str]:
    return output_checksums(run_sample_stages(tmp_path_factory.mktemp("sample-stages")))


@pytest.fixture(scope="module")
def expected() -> dict[str, str]:
    return json.loads(FIXTURE.read_text())


@pytest.mark.parametrize(
    "prefix", ["models/", "curate/curated/", "curate/removed/", "curate/rejected/", "curate/stats", "token"]
)
def test_the_sample_stages_write_what_they_wrote_before(checksums, expected, prefix):
    # One test per stage's folder, so that a failure says which stage changed and in which file.
    mine = {path: sha for path, sha in checksums.items() if path.startswith(prefix)}
    theirs = {path: sha for path, sha in expected.items() if path.startswith(prefix)}
    assert theirs, f"the fixture has no {prefix} files"
    assert sorted(mine) == sorted(theirs), "different files written"
    changed = sorted(path for path in theirs if mine[path] != theirs[path])
    assert not changed, f"content changed: {changed[:10]} (see this file's docstring to regenerate)"


def test_the_plan_is_the_plan_planned_before(checksums, expected):
    assert checksums["plan.json"] == expected["plan.json"]
    assert set(checksums) == set(expected)


#: Scores every sample text with the language stage's model; prints the float32 bits (as curated/ stores
#: them) and the 4-decimal detail values, one JSON line.
LANGUAGE_SCORES = """
import json, pathlib, sys
import numpy as np
from tokenmill.filters.language import LanguageFilter
from tokenmill.filters.normalize import Normalize
from tokenmill.corpora.readers import read_file
from tokenmill.corpora.records import InputFields
paths = sorted(pathlib.Path(sys.argv[1]).iterdir())
documents = [r for path in paths for r in read_file(str(path), InputFields()) if r["kind"] == "document"]
Normalize().apply(documents)
scores = LanguageFilter().identify([document["text"] for document in documents])
print(json.dumps([[label, np.float32(score).tobytes().hex(), round(score, 4)] for label, score in scores]))
"""


def _cpu_dispatch_targets() -> list[str]:
    """numpy's SIMD dispatch targets on this machine (X86_V3, AVX512_SKX, ... by numpy's version)."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__
    except ImportError:  # numpy 1.x
        from numpy.core._multiarray_umath import __cpu_dispatch__
    return list(__cpu_dispatch__)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86-64 kernel names")
def test_the_scores_written_do_not_depend_on_the_cpus_simd_path(tmp_path):
    def scores(env: dict[str, str]) -> list:
        result = subprocess.run(
            [sys.executable, "-c", LANGUAGE_SCORES, str(REPO / "data" / "sample")],
            capture_output=True, text=True, cwd=REPO, env={**os.environ, **env}, check=True,
        )  # fmt: skip
        return json.loads(result.stdout)

    default = scores({})
    # OpenBLAS's kernel for any x86-64 (SSE3) instead of the one picked for this CPU, and numpy without
    # its SIMD loops: the arithmetic of the plainest machine CI may get.
    generic = scores(
        {"OPENBLAS_CORETYPE": "Prescott", "NPY_DISABLE_CPU_FEATURES": " ".join(_cpu_dispatch_targets())}
    )
    assert len(default) > 1000 and any(float(detail) < 0.99 for _, _, detail in default)
    differ = [index for index, (a, b) in enumerate(zip(default, generic, strict=True)) if a != b]
    assert not differ, (
        f"{len(differ)} of {len(default)} scores differ, e.g. {default[differ[0]]} vs {generic[differ[0]]}"
    )


def test_the_sample_generator_still_makes_the_bundled_sample(tmp_path):
    # data/sample is committed; tokenmill.samples.corpus, run as `make sample` runs it, makes the same bytes.
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_sample_corpus.py"), "--output", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    committed = {path.name: path.read_bytes() for path in sorted((REPO / "data" / "sample").iterdir())}
    assert {path.name: path.read_bytes() for path in sorted(tmp_path.iterdir())} == committed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write or print the sample outputs' checksums.")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", action="store_true", help=f"run the stages and write {FIXTURE}")
    what.add_argument("--of", metavar="DIR", help="print the checksums of a demo output folder (out/demo)")
    args = parser.parse_args(argv)
    if args.of:
        print(json.dumps(output_checksums(Path(args.of)), indent=2, sort_keys=True))
        return 0
    with tempfile.TemporaryDirectory() as work:
        checksums = output_checksums(run_sample_stages(Path(work)))
    FIXTURE.write_text(json.dumps(checksums, indent=2, sort_keys=True) + "\n")
    print(f"wrote {len(checksums)} checksums to {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
