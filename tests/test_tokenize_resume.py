"""`tokenmill tokenize` killed partway (SIGKILL to its process group, Beam workers included), then run again,
ends with the same bytes as a run that was never stopped; while it is stopped nothing counts the partial work.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, tree_bytes
from test_tokenize import WORDS, write_cell_file

from tokenmill.cli import main
from tokenmill.tokenize import ShardError, TokenCatalog

FILES = 8


def long_prose(rng: np.random.Generator) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), size=int(rng.integers(200, 800))))


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("resume")
    curated = root / "curated"
    rng = np.random.default_rng(7)
    for n in range(FILES):
        write_cell_file(curated, "web", 2, n, FILES, [long_prose(rng) for _ in range(300)])
    tokenizer = root / "tokenizer.json"
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--input",
                str(curated),
                "--vocab-size",
                "600",
                "--output",
                str(tokenizer),
                "--max-documents",
                "200",
            ]
        )
        == 0
    )
    return curated, tokenizer


def tokenize_args(curated: Path, output: Path, tokenizer: Path, workers: int) -> list[str]:
    return [
        "tokenize",
        "--input",
        str(curated),
        "--output",
        str(output),
        "--tokenizer",
        str(tokenizer),
        "--workers",
        str(workers),
        "--progress-seconds",
        "0",
        "--batch-documents",
        "16",
    ]


def test_killed_run_resumes_to_the_same_bytes(setup, tmp_path):
    curated, tokenizer = setup
    clean = tmp_path / "clean"
    assert main(tokenize_args(curated, clean, tokenizer, workers=1)) == 0

    killed = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "tokenmill", *tokenize_args(curated, killed, tokenizer, 2)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    cell = killed / "domain=web/quality=2"
    deadline = time.monotonic() + 120
    try:
        while not list(cell.glob("*.done.json")):
            assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
            assert time.monotonic() < deadline, "no shard finished in 120 s"
            time.sleep(0.02)
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the group this test started: the driver and its workers
        process.wait()

    done = len(list(cell.glob("*.done.json")))
    assert 1 <= done < FILES, f"the kill came too late to test anything ({done} of {FILES} shards done)"
    # A stopped run has no catalog: its partial shards are not counted anywhere.
    assert not (killed / "counts.json").exists() and not (cell / "manifest.json").exists()
    with pytest.raises(ShardError, match="counts.json: missing"):
        TokenCatalog(str(killed))

    assert main([*tokenize_args(curated, killed, tokenizer, workers=1), "--resume"]) == 0
    assert tree_bytes(killed) == tree_bytes(clean)
    assert TokenCatalog(str(killed), verify=True).total_tokens == TokenCatalog(str(clean)).total_tokens
