"""Benchmark: `tokenmill curate` against datatrove's LocalPipelineExecutor, same filters, input and cores.

Both run the same datatrove heuristic chain (Gopher repetition, Gopher quality, FineWeb quality, C4; C4
last, because datatrove passes C4's edited text on to the next filter while tokenmill does not) over the
same JSON Lines files with the same number of worker processes, and the kept sets are compared. tokenmill
does more I/O than the datatrove baseline: it writes removed documents and stats as well as kept ones.

    python bench/curate.py [--documents 24000] [--files 16] [--workers 2] [--profile-files 4]

Each side runs twice, in turns (datatrove, tokenmill, datatrove, tokenmill), and each side's faster run
is compared: the shared machine's speed drifts by up to a fifth over minutes. Beam's local runner costs a
few seconds to start its worker processes and to run its last small stages; the default corpus is large
enough that this fixed cost does not dominate, as it does not at scale.

Besides the times, the bench prints where tokenmill's time goes, so that the next regression says where
it is: CPU per step (tokenmill's own counters, from the timed run); a profile of a whole run over the
first `--profile-files` files (cProfile in the launcher and in every worker process, bench/run_profile.py)
split by mechanism (word splitting, datatrove's rules, executor and serialisation, I/O, ...); and the
filters alone in one process against datatrove's, with the limit they cannot pass (one spaCy split per
document that a rule asks words of, plus datatrove's own rule code) and the ratio to it. CPU seconds
are the process trees' (on a machine shared with other work, CPU is steadier than the clock; both
ratios are printed).

The last line is `curate ratio=X.XX target=2.5 baseline=datatrove_local_executor`, where ratio is
tokenmill's documents per second over datatrove's (both from process start to finished output).
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import json
import os
import pstats
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import run_profile
from curate_scale import TreeMemory

from tokenmill.samples import text as sample

CHAIN = [("gopher_repetition", {}), ("gopher_quality", {}), ("fineweb_quality", {}), ("c4", {})]


def make_corpus(directory: Path, documents: int, files: int, seed: int = 7) -> None:
    """Distinct documents in the sample's proportions: mostly prose, some spam, boilerplate and code."""
    rng = random.Random(seed)
    paragraphs = sample.prose_paragraphs()
    code = sample.code_chunks(rng, 200)
    records = []
    for number in range(documents):
        roll = rng.random()
        if roll < 0.75:
            text = "\n\n".join(rng.sample(paragraphs, rng.randint(2, 6)))
        elif roll < 0.85:
            text = sample.spam_doc(rng)
        elif roll < 0.92:
            text = sample.boilerplate_doc(rng)
        else:
            text = rng.choice(code)
        records.append({"id": f"d{number:07d}", "text": text})
    directory.mkdir(parents=True)
    per_file = -(-documents // files)
    for index in range(files):
        chunk = records[index * per_file : (index + 1) * per_file]
        (directory / f"part-{index:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chunk))


def _run(command: list[str], env: dict | None = None) -> tuple[float, float, str]:
    """(seconds, CPU seconds of the whole process tree, stdout) of a command that must succeed; the tree
    is sampled (datatrove's pool workers are not waited for, so rusage would miss them)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    tree = TreeMemory(process.pid)
    stdout, stderr = process.communicate()
    elapsed = time.perf_counter() - started
    tree.stop()
    if process.returncode != 0:
        raise SystemExit(f"{command[:4]} failed ({process.returncode}):\n{stderr[-4000:]}")
    return elapsed, tree.cpu_seconds(), stdout


def run_tokenmill(
    input_dir: Path, output: Path, workers: int, pattern: str = "*.jsonl", env: dict | None = None
) -> tuple[float, float, set[str], str]:
    """(seconds, CPU seconds of the process tree, kept ids, curate's stdout)."""
    recipe = output.parent / "bench-recipe.yaml"
    stages = "\n".join(f"  - {kind}: {json.dumps(params)}" for kind, params in CHAIN)
    recipe.write_text(f"name: bench\nstages:\n{stages}\n")
    elapsed, cpu, stdout = _run(
        [
            sys.executable,
            "-m",
            "tokenmill",
            "curate",
            "--recipe",
            str(recipe),
            "--input",
            str(input_dir / pattern),
            "--output",
            str(output),
            "--workers",
            str(workers),
        ],
        env,
    )
    from tokenmill.formats.documents import curated_dataset

    ids = curated_dataset(str(output / "curated")).to_table(columns=["id"]).column("id").to_pylist()
    return elapsed, cpu, {identifier.split(":", 1)[1] for identifier in ids}, stdout


def step_seconds(stdout: str) -> dict[str, float]:
    """curate's `CPU seconds inside each step` line (its counters, summed over workers)."""
    match = re.search(r"CPU seconds inside each step: (.*)", stdout)
    steps = {}
    for part in match.group(1).split(", ") if match else []:
        name, value = part.rsplit(" ", 1)
        steps[name] = float(value)
    return steps


DATATROVE_SCRIPT = """
import sys
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.pipeline.filters import (GopherRepetitionFilter, GopherQualityFilter, FineWebQualityFilter,
                                        C4QualityFilter)
input_dir, output, workers = sys.argv[1], sys.argv[2], int(sys.argv[3])
LocalPipelineExecutor(
    pipeline=[JsonlReader(input_dir), GopherRepetitionFilter(), GopherQualityFilter(), FineWebQualityFilter(),
              C4QualityFilter(), JsonlWriter(output + "/kept")],
    tasks=workers, workers=workers, logging_dir=output + "/logs",
).run()
"""


def run_datatrove(input_dir: Path, output: Path, workers: int) -> tuple[float, float, set[str]]:
    elapsed, cpu, _ = _run(
        [sys.executable, "-c", DATATROVE_SCRIPT, str(input_dir), str(output), str(workers)]
    )
    ids = set()
    for path in (output / "kept").glob("*.jsonl.gz"):
        ids.update(json.loads(line)["id"] for line in gzip.decompress(path.read_bytes()).splitlines())
    return elapsed, cpu, ids


def _profile(work) -> pstats.Stats:
    profile = cProfile.Profile()
    profile.enable()
    work()
    profile.disable()
    return pstats.Stats(profile)


def _share(stats: pstats.Stats, needles: tuple[str, ...]) -> float:
    cumulative = max(
        (
            entry[3]
            for func, entry in stats.stats.items()
            if any(needle in f"{func[0]}:{func[2]}" for needle in needles)
        ),
        default=0.0,
    )
    return cumulative / stats.total_tt


def _summed_share(stats: pstats.Stats, file_part: str, names: tuple[str, ...]) -> float:
    """The share of the profile inside the named functions of one file (none of them calls another)."""
    cumulative = sum(
        entry[3] for func, entry in stats.stats.items() if file_part in func[0] and func[2] in names
    )
    return cumulative / stats.total_tt


#: datatrove's Gopher repetition helpers: the n-gram and duplicate counting, on words already split.
NGRAM_FUNCTIONS = ("get_n_grams", "find_duplicates", "find_top_duplicate", "find_all_duplicate")
FILTERS_TARGET = 0.4  # tokenmill's filter CPU over datatrove's, at most


def filters_alone(input_dir: Path, limit: int = 2000) -> tuple[list[str], float]:
    """One process, the same documents: tokenmill's steps against datatrove's filters called per document
    the way its pipeline calls them (CPU without a profiler, then one profiled pass each for the spaCy
    share), and the limit: one spaCy split per document plus datatrove's own rule code."""
    from datatrove.data import Document

    from tokenmill.corpora.readers import read_file
    from tokenmill.corpora.records import InputFields
    from tokenmill.filters.heuristics import HeuristicFilter, datatrove_filter_class
    from tokenmill.filters.normalize import Normalize

    documents = []
    for path in sorted(input_dir.glob("*.jsonl")):
        documents.extend(read_file(str(path), InputFields()))
        if len(documents) >= limit:
            break
    documents = documents[:limit]
    Normalize().apply(documents)
    steps = [HeuristicFilter(kind, params) for kind, params in CHAIN]
    filters = [datatrove_filter_class(kind)(**params) for kind, params in CHAIN]
    for step in steps:
        step.setup()
    words = steps[0]._words
    filters[0].filter(Document(text=documents[0]["text"], id="warm-up"))

    def tokenmill_steps():
        for start in range(0, len(documents), 256):
            batch = documents[start : start + 256]
            for step in steps:
                batch = [d for d, verdict in zip(batch, step.apply(batch)) if verdict is None]

    def datatrove_filters():
        for document in documents:
            doc = Document(text=document["text"], id=document["id"])
            for filter_ in filters:
                verdict = filter_.filter(doc)
                if not (verdict[0] if isinstance(verdict, tuple) else verdict):
                    break

    splits, split_seconds = words.splits, words.split_seconds
    started = time.process_time()
    tokenmill_steps()
    ours = time.process_time() - started
    splits, split_seconds = words.splits - splits, words.split_seconds - split_seconds
    started = time.process_time()
    datatrove_filters()
    theirs = time.process_time() - started
    # The limit: datatrove's rules alone (the words already split, not timed) plus one split per document
    # that a rule asks words of (what tokenmill's run split).
    shared = [datatrove_filter_class(kind)(language=words, **params) for kind, params in CHAIN]
    rules = 0.0
    for start in range(0, len(documents), 256):
        batch = documents[start : start + 256]
        words.prime([d["text"] for d in batch])
        for document in batch:  # split before the clock starts: the rules alone are timed
            words.word_tokenize(document["text"])
        started = time.process_time()
        for document in batch:
            words.focus(document["text"])
            for filter_ in shared:
                verdict = filter_.filter(Document(text=document["text"], id=document["id"]))
                if not (verdict[0] if isinstance(verdict, tuple) else verdict):
                    break
        rules += time.process_time() - started
    limit = split_seconds + rules
    our_stats, their_stats = _profile(tokenmill_steps), _profile(datatrove_filters)
    spacy = ("spacy", "word_tokenize", "span_tokenize", "prime")
    # Ours: tokenmill's counts (which call datatrove's functions where they fall back, inside their own
    # time) and datatrove's paragraph and line duplicates, as in datatrove's share below.
    ngrams = _summed_share(our_stats, "filters/repetition.py", ("top_duplicate_chars", "duplicated_chars"))
    ngrams += _summed_share(our_stats, "gopher_repetition_filter", ("find_duplicates",))
    ratio = ours / theirs
    lines = [
        f"  filters alone, one process, {len(documents):,} documents: tokenmill {ours:.2f}s CPU, datatrove "
        f"{theirs:.2f}s CPU: ratio {ratio:.2f} (target <= {FILTERS_TARGET})",
        f"  spaCy splits: tokenmill {splits / len(documents):.2f} per document, {split_seconds:.2f}s = "
        f"{split_seconds / ours:.0%} of its filter CPU; datatrove's filters spend "
        f"{_share(their_stats, spacy):.0%} of theirs in spaCy (profiled)",
        f"  Gopher repetition's n-gram counts: {ngrams:.0%} of tokenmill's filter CPU "
        f"(tokenmill.filters.repetition, datatrove's answers), "
        f"{_summed_share(their_stats, 'gopher_repetition_filter', NGRAM_FUNCTIONS):.0%} of datatrove's "
        "(its functions), profiled",
        f"  limit with datatrove's rule code as it is: one spaCy split per document a rule asks words of "
        f"({split_seconds:.2f}s) + datatrove's rules on split words ({rules:.2f}s) = {limit:.2f}s, "
        f"{limit / theirs:.2f}x datatrove; tokenmill's filters take {ours / limit:.2f}x that (their "
        "n-gram counts cost less than datatrove's)",
    ]
    return lines, ratio


def _bar(seconds: float, total: float) -> str:
    return f"{seconds:7.2f}s {seconds / max(total, 1e-9):4.0%}"


def whole_run_profile(input_dir: Path, output: Path, workers: int, files: int) -> list[str]:
    """A profiled curate over the first `files` input files: CPU by mechanism, launcher and workers."""
    inputs = sorted(input_dir.glob("*.jsonl"))[:files]
    subset = output / "input"
    subset.mkdir(parents=True)
    for path in inputs:
        (subset / path.name).symlink_to(path)
    folder = output / "profiles"
    env = run_profile.profiled_env(folder, output / "site")
    elapsed, _, _, _ = run_tokenmill(subset, output / "out", workers, env=env)
    runs = run_profile.load(folder)
    launcher = [
        stats for command, stats in runs if "tokenmill" in command and not run_profile.is_worker(command)
    ]
    workers_ = [stats for command, stats in runs if run_profile.is_worker(command)]
    lines = [
        f"  whole run under cProfile ({len(inputs)} files, {elapsed:.0f}s; the profiler slows Python code "
        f"several times, so read the shares): {len(launcher)} launcher, {len(workers_)} worker processes"
    ]
    # Each worker and the template they are forked from; one worker runs inside the launcher.
    expected = workers + 1 if workers >= 2 else 0
    if len(workers_) < expected:
        lines.append(
            f"  (profiles of {expected - len(workers_)} of {expected} worker processes are missing: the "
            "workers' split below is partial)"
        )
    for label, group in (("launcher", launcher), ("workers", workers_)):
        totals: dict[str, float] = {}
        for stats in group:
            for bucket, seconds in run_profile.mechanisms(stats).items():
                totals[bucket] = totals.get(bucket, 0.0) + seconds
        total = sum(totals.values())
        lines.append(f"  {label}, by mechanism ({total:.1f} CPU-s profiled):")
        lines.extend(
            f"    {bucket:<60} {_bar(seconds, total)}"
            for bucket, seconds in sorted(totals.items(), key=lambda item: -item[1])
            if seconds >= 0.005 * total
        )
    worker_total = sum(stats.total_tt for stats in workers_)
    lines.append(f"  workers, steps outside the per-document ones (of {worker_total:.1f} CPU-s profiled):")
    for label, file_part, name in (
        ("read (readers.read_file: open, decompress, parse, ids)", "corpora/readers.py", "read_file"),
        ("write (sinks._WriteFile: sort, Parquet, rename)", "pipelines/sinks.py", "process"),
        ("stats.json (curate.build_stats)", "pipelines/curate.py", "build_stats"),
    ):
        seconds = sum(run_profile.cumulative(stats, file_part, name) for stats in workers_)
        lines.append(f"    {label:<60} {_bar(seconds, worker_total)}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=24000)
    parser.add_argument("--files", type=int, default=16)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--profile-files", type=int, default=4, help="files in the profiled run (0: none)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        make_corpus(root / "input", args.documents, args.files)
        # datatrove, tokenmill, datatrove, tokenmill: this shared machine's speed drifts by a fifth over
        # minutes, so each side's faster run of two, taken in turns, is what is compared.
        datatrove_runs, tokenmill_runs = [], []
        for run in (1, 2):
            datatrove_runs.append(run_datatrove(root / "input", root / f"datatrove-{run}", args.workers))
            tokenmill_runs.append(run_tokenmill(root / "input", root / f"tokenmill-{run}", args.workers))
        datatrove_time, datatrove_cpu, datatrove_ids = min(datatrove_runs)
        tokenmill_time, tokenmill_cpu, tokenmill_ids, stdout = min(tokenmill_runs, key=lambda run: run[0])
        same = all(run[2] == datatrove_ids for run in tokenmill_runs) and all(
            run[2] == datatrove_ids for run in datatrove_runs
        )
        print(f"documents: {args.documents:,} in {args.files} files; workers: {args.workers}")
        print(
            f"datatrove LocalPipelineExecutor: {datatrove_time:.2f}s "
            f"({args.documents / datatrove_time:,.0f} docs/s, {datatrove_cpu:.1f} CPU-s), "
            f"runs {', '.join(f'{t:.2f}s' for t, _, _ in datatrove_runs)}"
        )
        print(
            f"tokenmill curate (Beam FnApiRunner): {tokenmill_time:.2f}s "
            f"({args.documents / tokenmill_time:,.0f} docs/s, {tokenmill_cpu:.1f} CPU-s), "
            f"runs {', '.join(f'{run[0]:.2f}s' for run in tokenmill_runs)}"
        )
        print(
            f"kept: tokenmill {len(tokenmill_ids):,}, datatrove {len(datatrove_ids):,}; "
            f"identical sets: {same}"
        )
        steps = step_seconds(stdout)
        inside = sum(steps.values())
        print(f"where tokenmill's CPU goes ({tokenmill_cpu:.1f} CPU-s, launcher and workers, timed run):")
        for name, seconds in sorted(steps.items(), key=lambda item: -item[1]):
            print(f"    step {name:<55} {_bar(seconds, tokenmill_cpu)}")
        print(
            f"    {'outside the steps (read, executor, serialisation, write, start-up)':<60} "
            f"{_bar(tokenmill_cpu - inside, tokenmill_cpu)}"
        )
        if args.profile_files:
            print(
                "\n".join(
                    whole_run_profile(root / "input", root / "profiled", args.workers, args.profile_files)
                )
            )
        print("where the filter time goes (one process):")
        lines, _ = filters_alone(root / "input")
        print("\n".join(lines))
        ratio = datatrove_time / tokenmill_time
        cpu_ratio = datatrove_cpu / tokenmill_cpu
        # The limit of this executor: the CPU of its steps alone (datatrove's rules and one split per
        # document), no start-up, no shuffle, no I/O; compared in CPU, which the machine's load does not skew.
        limit = datatrove_cpu / inside if inside else float("inf")
        print(
            f"CPU ratio (datatrove CPU-s over tokenmill's) {cpu_ratio:.2f}; limit if tokenmill spent only "
            f"its steps' CPU ({inside:.1f}s of its {tokenmill_cpu:.1f}s): CPU ratio {limit:.2f}; this run is "
            f"at {cpu_ratio / limit:.2f} of that limit"
        )
        print(f"curate ratio={ratio:.2f} target=2.5 baseline=datatrove_local_executor")
        return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
