"""Bench: planning the reference mixture over 200 cells must take under a second.

Two mixtures over one catalog of 200 cells (40 clusters x 5 quality buckets):

* `reference`: mixtures/marin-535b-a23b.yaml as shipped, the reference run's 200-cell mixture (one
  source per cell, 200 weights in each phase, 390,251 steps), over its own cells and declared counts;
* `wide`: the older worst case, 18.75T tokens, 4,096 x 8,192, blocks of 2,048, 80/20 phases, with one
  source per cell and equal weights, under shortfall: redistribute.

Each is timed end to end in process (read and validate the YAML, resolve, plan, `to_json`): one cold
run, then the median of several. `yaml.safe_load` of the wide file is timed in the same run for scale,
and the whole command line (`tokenmill mixture plan --json`, a fresh interpreter) once.

The last line is `mixture_plan ratio=X.XX target=1 baseline=1s_budget`: ratio = the 1-second budget /
the median time of the wide plan, so ratio >= 1 meets the target.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
BUDGET_SECONDS = 1.0
REPEATS = 7


def catalog() -> dict:
    """The reference's 200 cells with the token counts it declares (Marin's published available tokens)."""
    from tokenmill.mixtures import load_mixture

    reference = load_mixture(REPO / "mixtures" / "marin-535b-a23b.yaml")
    cells = {
        source.selectors[0].text: {"tokens": source.declared_tokens, "documents": 1}
        for source in reference.sources.values()
    }
    assert len(cells) == 200
    # A catalog written by hand for planning (formats.tokens.TokenCounts): cells' tokens only. A tokenizer
    # entry names the tokenizer.json the shards were made with (its sha256 and vocabulary size), and no
    # shards exist here, so there is none to name.
    return {"format_version": 1, "cells": cells}


def wide_spec(cells: list[str]) -> str:
    weight = 1 / len(cells)
    weights = "\n".join(f"      {cell}: {weight!r}" for cell in cells)
    return (
        "name: wide\ntokenizer: marin-community/marin-tokenizer\ntotal_tokens: 18.75T\n"
        "sequence_length: 4096\n"
        "batch_size: 8192\nblock_size: 2048\nmax_epochs: 16\nshortfall: redistribute\nphases:\n"
        f"  - name: pretraining\n    share: 0.8\n    normalize: true\n    weights:\n{weights}\n"
        f"  - name: midtraining\n    share: 0.2\n    normalize: true\n    weights:\n{weights}\n"
    )


def timed(function) -> tuple[float, list[float]]:
    started = time.perf_counter()
    function()
    cold = time.perf_counter() - started
    runs = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        function()
        runs.append(time.perf_counter() - started)
    return cold, runs


def main() -> int:
    from tokenmill.mixtures import load_counts, load_mixture, plan_mixture

    with tempfile.TemporaryDirectory() as folder:
        counts_path = os.path.join(folder, "counts.json")
        with open(counts_path, "w") as handle:
            json.dump(catalog(), handle)
        wide_path = os.path.join(folder, "wide.yaml")
        with open(wide_path, "w") as handle:
            handle.write(wide_spec(sorted(catalog()["cells"])))
        reference_path = str(REPO / "mixtures" / "marin-535b-a23b.yaml")

        def plan(path: str):
            def run():
                result = plan_mixture(load_mixture(path), load_counts(counts_path))
                result.to_json()
                return result

            return run

        results = {}
        for label, path in (("reference", reference_path), ("wide", wide_path)):
            cold, runs = timed(plan(path))
            result = plan(path)()
            results[label] = statistics.median(runs)
            cells = sum(len(source.cells) for source in result.sources.values())
            print(
                f"{label}: {len(result.sources)} sources over {cells} cells, {len(result.phases)} phases, "
                f"{result.total_steps:,} steps; cold {cold * 1000:.1f} ms, "
                f"median {results[label] * 1000:.1f} ms, max {max(runs) * 1000:.1f} ms over {REPEATS} runs"
            )

        text = Path(wide_path).read_text()
        _, yaml_runs = timed(lambda: yaml.safe_load(text))
        print(f"yaml.safe_load of the wide spec alone: median {statistics.median(yaml_runs) * 1000:.1f} ms")

        tokenmill = Path(sys.executable).with_name("tokenmill")
        command = [str(tokenmill), "mixture", "plan", wide_path, "--counts", counts_path, "--json"]
        started = time.perf_counter()
        completed = subprocess.run(command, capture_output=True, text=True, check=False)
        cli_seconds = time.perf_counter() - started
        status = (
            "ok" if completed.returncode == 0 else f"exit {completed.returncode}: {completed.stderr.strip()}"
        )
        print(f"command line, fresh interpreter, wide spec: {cli_seconds * 1000:.0f} ms ({status})")

    ratio = BUDGET_SECONDS / results["wide"]
    print(f"mixture_plan ratio={ratio:.2f} target=1 baseline=1s_budget")
    return 0


if __name__ == "__main__":
    sys.exit(main())
