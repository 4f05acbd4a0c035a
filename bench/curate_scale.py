"""Benchmark: does `tokenmill curate` scale flat? The web recipe (fuzzy dedupe included) at 10k, 40k and 160k.

Each size is a corpus of unique web-like documents (1-5 KB of English prose, 2.5 KB on average;
every sentence reworded so that no two documents share long word runs), with the duplicates a crawl
carries: 4% exact copies (one boilerplate page copied 1,000 times among them: a hot key),
8% near-duplicates, and a near-duplicate chain. The same command as a user's runs with `--runner`
(local: Beam's FnApiRunner with bounded bundles, tokenmill.pipelines.local_runner; dask: a local
dask.distributed cluster) and `--workers` processes. While it runs, the resident memory and CPU time of
every process in its tree are sampled: the table shows the peak of the worker processes (Beam's SDK
workers, or Dask's), what a Dataflow worker holds, apart from the launcher (which also holds the local
runner's shuffle: on Dataflow that is the shuffle service's job, not a worker's).

    python bench/curate_scale.py [--sizes 10000,40000,160000] [--workers 2] [--runner local|dask]

Throughput is printed twice: documents/s/core by the clock, and documents per CPU-second of the run's
processes (launcher included), which is what documents/s/core would be on an idle machine and what a
bill follows; on a shared machine only the second is stable, so the ratio uses it. The targets (issue:
curate at web scale): cost per document flat, documents per CPU-second at 160k within 20% of 10k (ratio
>= 0.8), and worker peak memory that does not grow with the corpus (160k over 10k at most 1.2). The last
two lines are `curate_scale memory_ratio=X.XX target=1.2 baseline=10k_worker_peak` and
`curate_scale ratio=X.XX target=0.8 baseline=10k_docs_per_core`: the largest size over the smallest.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

from tokenmill.formats.stats import STATS, read_stats
from tokenmill.pipelines.warm_workers import WORKER_MODULE
from tokenmill.samples import text as sample

REPO = Path(__file__).resolve().parents[1]


FILES_PER_10K = 8
FILLER_WORDS = np.array(
    ["the", "a", "of", "and", "to", "in", "is", "that", "for", "it", "with", "as", "on", "this"], dtype=object
)


def _prose(rng: np.random.Generator, sentences: list[list[str]], vocabulary: np.ndarray) -> str:
    """3-8 paragraphs of 4 sentences, about a third of their words swapped for others (a filler word or
    one of the vocabulary's): unique 5-grams, still prose-like. Drawn by numpy a document at a time, so
    that writing the 160k corpus takes seconds, not a minute."""
    paragraphs = int(rng.integers(3, 9))
    picked = [sentences[index] for index in rng.integers(len(sentences), size=4 * paragraphs).tolist()]
    words = [word for sentence in picked for word in sentence]
    swapped = np.flatnonzero(rng.random(len(words)) < 0.35)
    filler = rng.random(len(swapped)) < 0.4
    replacements = np.where(
        filler,
        FILLER_WORDS[rng.integers(len(FILLER_WORDS), size=len(swapped))],
        vocabulary[rng.integers(len(vocabulary), size=len(swapped))],
    )
    for position, word in zip(swapped.tolist(), replacements.tolist()):
        words[position] = word
    ends = np.cumsum([len(sentence) for sentence in picked]).tolist()
    sentence_texts = [" ".join(words[start:end]) for start, end in zip([0, *ends[:-1]], ends)]
    return "\n\n".join(" ".join(sentence_texts[i : i + 4]) for i in range(0, len(sentence_texts), 4))


def make_corpus(directory: Path, documents: int, seed: int = 11) -> dict[str, int]:
    """Write `documents` JSON Lines records into directory/shard-*/part.jsonl; returns what was planted."""
    rng = random.Random(seed)
    words_rng = np.random.default_rng(seed)
    sentences = [s.strip() + "." for p in sample.prose_paragraphs() for s in p.split(". ") if len(s) > 40]
    vocabulary = np.array(
        sorted({word for s in sentences for word in s.split() if word.isalpha()}), dtype=object
    )
    sentence_words = [sentence.split() for sentence in sentences]
    boilerplate = "\n".join(rng.choice(sentences) for _ in range(40))
    records: list[dict] = []
    planted = {"exact_copies": 0, "near_duplicates": 0, "hot_key_copies": 0, "chain": 0}
    chain_length = 200
    for number in range(documents):
        roll = rng.random()
        if roll < 0.04 and records:
            text = rng.choice(records)["text"]
            planted["exact_copies"] += 1
        elif roll < 0.12 and records:
            text = sample.near_duplicate(rng, rng.choice(records)["text"], 0.03)
            planted["near_duplicates"] += 1
        else:
            text = _prose(words_rng, sentence_words, vocabulary)
        records.append({"id": f"d{number:08d}", "text": text})
    # A hot key: one boilerplate page copied 1,000 times; a near-duplicate chain of 200 links.
    for index in rng.sample(range(documents), min(1000, documents // 10)):
        records[index]["text"] = boilerplate
        planted["hot_key_copies"] += 1
    link = records[0]["text"]
    for index in rng.sample(range(documents), chain_length):
        link = sample.near_duplicate(rng, link, 0.02)
        records[index]["text"] = link
        planted["chain"] += 1
    files = max(1, FILES_PER_10K * documents // 10_000)
    per_file = -(-documents // files)
    for index in range(files):
        folder = directory / f"shard-{index:03d}"
        folder.mkdir(parents=True)
        chunk = records[index * per_file : (index + 1) * per_file]
        (folder / "part.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chunk))
    return planted


class TreeMemory:
    """Peak resident memory and CPU time of every process below a root process, sampled on a thread."""

    def __init__(self, root_pid: int, every_seconds: float = 0.2):
        self.root = psutil.Process(root_pid)
        self.every_seconds = every_seconds
        self.peak: dict[int, int] = {}
        self.cpu: dict[int, float] = {}  # user + system seconds, as last seen
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                processes = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            for process in processes:
                try:
                    rss = process.memory_info().rss
                    times = process.cpu_times()
                    self.cpu[process.pid] = times.user + times.system
                    self.names.setdefault(process.pid, " ".join(process.cmdline()))
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                self.peak[process.pid] = max(self.peak.get(process.pid, 0), rss)
            self._stop.wait(self.every_seconds)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def is_worker(self, pid: int) -> bool:
        """The local runner's SDK worker processes (tokenmill's worker main, or Beam's), or the Dask
        worker processes a LocalCluster's nannies spawn (multiprocessing children; its resource tracker
        is not a worker)."""
        name = self.names.get(pid, "")
        if name.startswith("/bin/sh"):  # the shell that Beam starts a cold SDK worker through
            return False
        return (
            WORKER_MODULE in name
            or "sdk_worker" in name
            or ("spawn_main" in name and "resource_tracker" not in name)
        )

    def workers_peak(self) -> int:
        """The largest peak among the worker processes."""
        return max((rss for pid, rss in self.peak.items() if self.is_worker(pid)), default=0)

    def worker_count(self) -> int:
        return sum(1 for pid in self.peak if self.is_worker(pid))

    def cpu_seconds(self) -> float:
        """CPU seconds of the whole tree (launcher, workers, and the rest), up to the last sample."""
        return sum(self.cpu.values())

    def workers_cpu_seconds(self) -> float:
        """CPU seconds of the worker processes alone (what Dataflow's workers would spend; the launcher's
        share is this runner's shuffle, a separate service there)."""
        return sum(seconds for pid, seconds in self.cpu.items() if self.is_worker(pid))

    def launcher_peak(self) -> int:
        return self.peak.get(self.root.pid, 0)


def bench_recipe(directory: Path, target_file_bytes: str) -> Path:
    """The web recipe with a smaller output file target.

    A writer holds one output file's rows (they are sorted before the file is written), so a worker's
    memory grows with the file, up to `target_file_bytes`, and then stays flat however large the corpus.
    At 10 TB every file is at the target; here the corpus is smaller than one 256 MB file, so the bench
    sets a target that makes every size write many files, as a real run does.
    """
    text = (REPO / "configs" / "curate" / "web.yaml").read_text()
    recipe = directory / "web-bench.yaml"
    recipe.write_text(text.replace("target_file_bytes: 256M", f"target_file_bytes: {target_file_bytes}"))
    assert recipe.read_text() != text, "configs/curate/web.yaml no longer sets target_file_bytes: 256M"
    return recipe


def run_curate(
    input_dir: Path, output: Path, runner: str, workers: int, recipe: Path, beam_options: list[str]
) -> tuple[float, TreeMemory, dict]:
    started = time.perf_counter()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenmill",
            "curate",
            "--recipe",
            str(recipe),
            "--input",
            str(input_dir / "*" / "*.jsonl"),
            "--output",
            str(output),
            "--runner",
            runner,
            "--workers",
            str(workers),
            *(f"--beam_option={option}" for option in beam_options),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    memory = TreeMemory(process.pid)
    stdout, stderr = process.communicate()
    elapsed = time.perf_counter() - started
    memory.stop()
    if process.returncode != 0:
        raise SystemExit(f"tokenmill curate failed ({process.returncode}):\n{stdout}\n{stderr[-4000:]}")
    return elapsed, memory, read_stats(str(output / STATS))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,40000,160000", help="comma-separated document counts")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument(
        "--target-file-bytes", default="4M", help="the recipe's output file target (web.yaml: 256M)"
    )
    parser.add_argument("--runner", choices=("local", "dask"), default="local", help="curate's --runner")
    parser.add_argument(
        "--beam-option", action="append", default=[], help="passed to curate as --beam_option (repeatable)"
    )
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        recipe = bench_recipe(root, args.target_file_bytes)
        print(
            f"web recipe, target_file_bytes {args.target_file_bytes}, runner {args.runner}, "
            f"{args.workers} worker processes {' '.join(args.beam_option)}",
            flush=True,
        )
        for size in sizes:
            planted = make_corpus(root / f"input-{size}", size)
            elapsed, memory, stats = run_curate(
                root / f"input-{size}",
                root / f"output-{size}",
                args.runner,
                args.workers,
                recipe,
                args.beam_option,
            )
            per_core = size / elapsed / args.workers
            # The machine may be shared: documents per CPU-second of the run's processes is docs/s/core as
            # an idle machine would show it, and the cost per document that a cloud bill follows.
            per_cpu_second = size / max(memory.cpu_seconds(), 1e-9)
            fuzzy = stats.stages.get("fuzzy_dedupe", {})
            rows.append((size, elapsed, per_cpu_second, memory.workers_peak(), memory.launcher_peak()))
            removed = {key: entry.documents for key, entry in stats.removed_by_reason.items()}
            print(
                f"{size:>7,} documents: {elapsed:7.1f}s, {per_core:6.0f} docs/s/core by the clock, "
                f"{per_cpu_second:6.0f} per CPU-second ({memory.cpu_seconds():.0f} CPU-s, workers "
                f"{memory.workers_cpu_seconds():.0f}), worker peak "
                f"{memory.workers_peak() / 2**20:6.0f} MiB (of {memory.worker_count()}), launcher peak "
                f"{memory.launcher_peak() / 2**20:6.0f} MiB; kept {stats.kept.documents:,}, "
                f"balanced {stats.balanced}",
                flush=True,
            )
            print(f"          planted {planted}; removed {removed}", flush=True)
            if fuzzy:
                print(
                    f"          fuzzy: {fuzzy.get('candidate_pairs', 0):,} candidate pairs, "
                    f"largest component {fuzzy.get('largest_component', 0):,}, rounds that changed edges "
                    f"{fuzzy.get('rounds_that_changed_edges', '-')}",
                    flush=True,
                )
            if not stats.balanced:
                raise SystemExit("stats not balanced: documents read != kept + removed + rejected")
    smallest, largest = rows[0], rows[-1]
    growth = largest[3] / max(smallest[3], 1)
    print(
        f"cost per document: {largest[2] / smallest[2]:.2f}x the documents per CPU-second at {largest[0]:,} "
        f"as at {smallest[0]:,}; worker peak memory {growth:.2f}x for "
        f"{largest[0] / smallest[0]:.0f}x the corpus"
    )
    # Memory must not grow with the corpus: the largest worker peak over the smallest's, at most 1.2.
    print(f"curate_scale memory_ratio={growth:.2f} target=1.2 baseline=10k_worker_peak")
    print(f"curate_scale ratio={largest[2] / smallest[2]:.2f} target=0.8 baseline=10k_docs_per_core")
    return 0


if __name__ == "__main__":
    sys.exit(main())
