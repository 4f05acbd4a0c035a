"""Benchmark: fuzzy dedupe on real documents this machine carries, against datatrove's MinHash pipeline.

The corpus: man pages (/usr/share/man/man*/, decompressed troff source), Debian copyright files
(/usr/share/doc/*/copyright) and the docstrings of Python's standard library (modules, classes and
functions of at least 30 words), sampled with a fixed seed, plus planted near copies of some of them
(0.2 to 5% of words replaced, deleted or inserted) whose true word 5-gram Jaccard similarity to their
original is computed. Real documents bring what a synthetic corpus lacks: hundreds of pages generated
from one template, licence texts repeated with small changes, and exact copies.

Both sides see the same JSON Lines input, with word 5-grams. tokenmill runs `tokenmill curate` with only
the `fuzzy_dedupe` stage: its default (20 bands x 5 rows, verified edges at estimated Jaccard 0.7), the
same verification on datatrove's banding (14 x 8), and 14 x 8 without verification; datatrove runs
MinhashDedupSignature -> Buckets -> Cluster -> Filter at 14 x 8 (sha1 shingle hashing: its default
xxhash is not installed). For each, on tokenmill's shingles:

- recall at J >= 0.8: of the planted (original, copy) pairs with true Jaccard >= 0.8, the share that
  ends in one duplicate cluster (so at most one of the two survives);
- kept twins: kept documents that still have another kept document at true Jaccard >= 0.8 (exact, by
  prefix filtering over all kept documents, not a sample);
- wrongly removed: removed documents whose best kept match has Jaccard and containment below 0.5 (that
  is, containment below 0.5, which Jaccard cannot exceed), as a share of the input;
- CPU seconds of the whole run (user + system of the process and its workers, start-up included);
- one pass: what `tokenmill curate` with the same stage removes from its own curated output.

    python bench/dedupe_real.py [--documents 12000] [--planted 400] [--workers 1]

Ends with `dedupe_real ratio=X.XX target=5 baseline=datatrove_minhash_cpu`: datatrove's CPU seconds over
tokenmill's (default recipe).
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import math
import os
import random
import resource
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

# bench/ is first on sys.path when this script runs: the same datatrove pipeline as bench/dedupe.py.
from dedupe import DATATROVE_SCRIPT, write_jsonl

from tokenmill.filters.minhash import MinHasher, jaccard, words
from tokenmill.formats.stats import STATS, read_stats

NGRAM, BANDS, ROWS = 5, 14, 8
TWIN = 0.8  # kept pairs at least this similar are duplicates that survived
WRONG = 0.5  # removed documents with no kept match at least this similar (Jaccard or containment)
MAX_CHARS = 200_000
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
DEFAULT = "tokenmill default (20x5, verified edges J >= 0.7)"


# ------------------------------------------------------------------------------------------- the corpus


def man_pages() -> list[tuple[str, str]]:
    pages = []
    for path in sorted(Path("/usr/share/man").glob("man*/*.gz")):
        if path.is_symlink():
            continue
        try:
            pages.append((f"man:{path.name}", gzip.decompress(path.read_bytes()).decode("utf-8", "replace")))
        except (OSError, EOFError):
            continue
    return pages


def copyright_files() -> list[tuple[str, str]]:
    return [
        (f"copyright:{path.parent.name}", path.read_text("utf-8", "replace"))
        for path in sorted(Path("/usr/share/doc").glob("*/copyright"))
        if path.is_file() and not path.is_symlink()
    ]


def stdlib_docstrings(min_words: int = 30) -> list[tuple[str, str]]:
    found = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in path.parts or "site-packages" in path.parts:
            continue
        try:
            tree = ast.parse(path.read_text("utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                docstring = ast.get_docstring(node)
                if docstring and len(docstring.split()) >= min_words:
                    found.append((f"py:{path.name}:{getattr(node, 'name', '')}:{node_line(node)}", docstring))
    return found


def node_line(node: ast.AST) -> int:
    return getattr(node, "lineno", 0)


def edit_words(rng: random.Random, text_words: list[str], fraction: float) -> list[str]:
    edited = list(text_words)
    for _ in range(max(1, round(len(edited) * fraction))):
        position = rng.randrange(len(edited))
        roll = rng.random()
        if roll < 0.4:
            edited[position] = rng.choice(edited)
        elif roll < 0.7:
            del edited[position]
        else:
            edited.insert(position, rng.choice(edited))
    return edited


def make_corpus(documents: int, planted: int, seed: int = 30) -> tuple[list[dict], list[tuple[str, str]]]:
    """(records, planted (original id, copy id) pairs). Real documents up to `documents` in all."""
    rng = random.Random(seed)
    copyrights, docstrings, pages = copyright_files(), stdlib_docstrings(), man_pages()
    real = copyrights + docstrings
    wanted = documents - planted
    # Man pages fill what the others leave, and at least half of a small corpus.
    real += rng.sample(pages, min(max(wanted - len(real), wanted // 2), len(pages)))
    real = [(name, text[:MAX_CHARS]) for name, text in real if len(words(text)) >= 20]
    real = rng.sample(real, min(wanted, len(real)))
    records = [{"id": f"d{index:06d}", "text": text, "name": name} for index, (name, text) in enumerate(real)]
    bases = [record for record in records if 100 <= len(record["text"].split()) <= 5000]
    pairs = []
    for number, base in enumerate(rng.sample(bases, min(planted, len(bases)))):
        fraction = rng.uniform(0.002, 0.05)
        copy = {"id": f"p{number:05d}", "text": " ".join(edit_words(rng, base["text"].split(), fraction))}
        copy["name"] = f"planted:{base['name']}"
        records.append(copy)
        pairs.append((base["id"], copy["id"]))
    order = list(range(len(records)))
    rng.shuffle(order)
    return [records[index] for index in order], pairs


# --------------------------------------------------------------------------------- exact similarities


class ShingleIndex:
    """Every document's distinct 5-gram hashes, ordered rarest first (by document frequency over the
    corpus, then hash): what prefix filtering needs to find every pair above a threshold exactly."""

    def __init__(self, texts: dict[str, str]):
        hasher = MinHasher(NGRAM, BANDS, ROWS)
        self.ids = sorted(texts)
        self.sets = [hasher.shingles(texts[identifier]) for identifier in self.ids]
        self.position = {identifier: index for index, identifier in enumerate(self.ids)}
        every = np.concatenate(self.sets) if self.sets else np.empty(0, np.uint64)
        self.vocabulary, counts = np.unique(every, return_counts=True)
        self.rank_of_count = counts
        self.ordered = []
        for shingles in self.sets:
            frequency = counts[np.searchsorted(self.vocabulary, shingles)]
            self.ordered.append(shingles[np.lexsort((shingles, frequency))])

    def prefix(self, index: int, threshold: float) -> np.ndarray:
        ordered = self.ordered[index]
        return ordered[: len(ordered) - math.ceil(threshold * len(ordered)) + 1]


def postings(keys: np.ndarray, owners: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    """The owners of every occurrence of `tokens` in the sorted (keys, owners) index."""
    low = np.searchsorted(keys, tokens, "left")
    high = np.searchsorted(keys, tokens, "right")
    lengths = high - low
    total = int(lengths.sum())
    if total == 0:
        return np.empty(0, owners.dtype)
    starts = np.repeat(low - np.cumsum(lengths) + lengths, lengths) + np.arange(total)
    return owners[starts]


def build(index: ShingleIndex, members: list[int], threshold: float | None) -> tuple[np.ndarray, np.ndarray]:
    """(sorted tokens, their documents) of the members' prefixes (threshold) or whole sets (None)."""
    parts = [index.prefix(m, threshold) if threshold else index.sets[m] for m in members]
    tokens = np.concatenate(parts) if parts else np.empty(0, np.uint64)
    owners = np.repeat(np.array(members, np.int64), [len(part) for part in parts])
    order = np.argsort(tokens, kind="stable")
    return tokens[order], owners[order]


def kept_twins(index: ShingleIndex, kept: list[str]) -> int:
    """Kept documents that have another kept document at Jaccard >= TWIN (prefix filtering: two sets at
    Jaccard t or more share a token in their prefixes of |x| - ceil(t |x|) + 1 rarest tokens)."""
    members = [index.position[identifier] for identifier in kept]
    keys, owners = build(index, members, TWIN)
    sizes = np.array([len(s) for s in index.sets])
    twins = set()
    for member in members:
        if member in twins:
            continue
        candidates = np.unique(postings(keys, owners, index.prefix(member, TWIN)))
        size = sizes[member]
        for other in candidates:
            if other == member or not TWIN * size <= sizes[other] <= size / TWIN:
                continue
            if jaccard(index.sets[member], index.sets[other]) >= TWIN:
                twins.update((member, int(other)))
                break
    return len(twins)


def wrongly_removed(index: ShingleIndex, removed: list[str], kept: list[str]) -> int:
    """Removed documents whose containment in every kept document is below WRONG (and so their Jaccard
    similarity too): a kept document containing half of a removed one shares a token of its prefix of
    |x| - ceil(|x| / 2) + 1 rarest tokens."""
    keys, owners = build(index, [index.position[identifier] for identifier in kept], None)
    wrong = 0
    for identifier in removed:
        member = index.position[identifier]
        mine = index.sets[member]
        hits = postings(keys, owners, index.prefix(member, WRONG))
        candidates, counts = np.unique(hits, return_counts=True)
        found = False
        for other in candidates[np.argsort(-counts, kind="stable")]:
            common = len(np.intersect1d(mine, index.sets[other], assume_unique=True))
            if common >= WRONG * len(mine):
                found = True
                break
        wrong += not found
    return wrong


# --------------------------------------------------------------------------------------------- the runs


def children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _tree_cpu(root: int, seen: dict[int, float]) -> None:
    """Record the user + system seconds of `root` and all its descendants (from /proc) into `seen`."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    tree, frontier = {root}, [root]
    while frontier:
        node = frontier.pop()
        for child, parent in parents.items():
            if parent == node and child not in tree:
                tree.add(child)
                frontier.append(child)
    for pid in tree:
        if pid in times:
            seen[pid] = max(seen.get(pid, 0.0), times[pid])


def run_measured(command: list[str]) -> float:
    """Run a command; its CPU seconds (user + system) with every process it starts. Beam's and
    datatrove's worker processes are not all waited for by their parents (so getrusage's children
    miss them): the process tree is sampled from /proc every 50 ms, and the larger of that sum and
    getrusage is taken."""
    before = children_cpu()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seen: dict[int, float] = {}
    while process.poll() is None:
        _tree_cpu(process.pid, seen)
        time.sleep(0.05)
    stderr = process.stderr.read().decode("utf-8", "replace") if process.stderr else ""
    if process.returncode:
        raise RuntimeError(f"{command[:4]} failed ({process.returncode}):\n{stderr[-3000:]}")
    return max(sum(seen.values()), children_cpu() - before)


def run_tokenmill(inputs: str, output: Path, workers: int, parameters: str) -> float:
    """CPU seconds of `tokenmill curate` with only the fuzzy dedupe stage."""
    recipe = output.parent / f"recipe-{output.name}.yaml"
    recipe.write_text(
        f"name: bench-dedupe-real\nstages:\n  - fuzzy_dedupe: {{ngram: {NGRAM}, {parameters}}}\n"
    )
    return run_measured(
        [sys.executable, "-m", "tokenmill", "curate", "--recipe", str(recipe), "--input", inputs,
         "--output", str(output), "--workers", str(workers)]
    )  # fmt: skip


def tokenmill_outcome(output: Path) -> tuple[set[str], set[str], dict[str, str]]:
    """(kept ids, removed ids, id -> duplicate cluster), ids as in the input (curate prefixes the file)."""
    import pyarrow.parquet as pq

    kept, removed, cluster = set(), set(), {}
    # Documents only: curate also writes its dedupe index (dedupe-index/) as Parquet.
    paths = [*(output / "curated").rglob("*.parquet"), *(output / "removed").rglob("*.parquet")]
    for path in sorted(paths):
        for row in pq.read_table(path, columns=["id", "dup_cluster"]).to_pylist():
            identifier = row["id"].split(":", 1)[1]
            (removed if "removed" in path.parts else kept).add(identifier)
            if row["dup_cluster"]:
                cluster[identifier] = row["dup_cluster"]
    return kept, removed, cluster


def datatrove_outcome(output: Path) -> tuple[set[str], set[str], dict[str, str]]:
    kept, removed, cluster = set(), set(), {}
    for folder, into in (("kept", kept), ("removed", removed)):
        for path in sorted((output / folder).glob("*.jsonl.gz")):
            for line in gzip.decompress(path.read_bytes()).splitlines():
                record = json.loads(line)
                into.add(record["id"])
                number = record["metadata"].get("minhash_cluster_id", -1)
                if number != -1:
                    cluster[record["id"]] = str(number)
    return kept, removed, cluster


def measure(index, pairs, similar_pairs, total, kept, removed, cluster) -> dict:
    caught = sum(1 for a, b in similar_pairs if a in cluster and cluster.get(a) == cluster.get(b))
    return {
        "removed": len(removed),
        "recall": caught / max(len(similar_pairs), 1),
        "twins": kept_twins(index, sorted(kept)),
        "wrong": wrongly_removed(index, sorted(removed), sorted(kept)),
        "total": total,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=12_000, help="documents, planted copies included")
    parser.add_argument("--planted", type=int, default=400)
    parser.add_argument("--files", type=int, default=4)
    # One worker each: CPU time counts every process, and a second one adds only its start-up.
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--skip-datatrove", action="store_true", help="tokenmill only (while iterating)")
    args = parser.parse_args()
    records, pairs = make_corpus(args.documents, args.planted)
    texts = {record["id"]: record["text"] for record in records}
    index = ShingleIndex(texts)
    similar_pairs = [
        (a, b)
        for a, b in pairs
        if jaccard(index.sets[index.position[a]], index.sets[index.position[b]]) >= TWIN
    ]
    sources = defaultdict(int)
    for record in records:
        sources[record["name"].split(":", 1)[0]] += 1
    print(
        f"corpus: {len(records):,} documents "
        f"({', '.join(f'{k} {v:,}' for k, v in sorted(sources.items()))}), "
        f"{sum(len(t) for t in texts.values()) / 1e6:.1f}M characters; {len(pairs)} planted copies, "
        f"{len(similar_pairs)} of them at true 5-gram Jaccard >= {TWIN}"
    )
    print(f"input itself: {kept_twins(index, sorted(texts)):,} documents with a twin at Jaccard >= {TWIN}")
    print(f"parameters: word {NGRAM}-grams; datatrove {BANDS} bands x {ROWS} rows; workers: {args.workers}")

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        write_jsonl([{"id": r["id"], "text": r["text"]} for r in records], root / "input", args.files)
        inputs = str(root / "input" / "*.jsonl")
        for number, (name, parameters) in enumerate(
            (
                (DEFAULT, "bands: 20, rows: 5, verify: jaccard, threshold: 0.7"),
                (
                    "tokenmill 14x8, verified edges J >= 0.7",
                    "bands: 14, rows: 8, verify: jaccard, threshold: 0.7",
                ),
                ("tokenmill 14x8, verify: none", "bands: 14, rows: 8, verify: none"),
            )
        ):
            output = root / f"tokenmill-{number}"
            cpu = run_tokenmill(inputs, output, args.workers, parameters)
            results[name] = {
                **measure(index, pairs, similar_pairs, len(records), *tokenmill_outcome(output)),
                "cpu": cpu,
            }
            stats = read_stats(str(output / STATS)).stages["fuzzy_dedupe"]
            results[name]["stats"] = stats
            if name == DEFAULT:
                again = root / "tokenmill-again"
                run_tokenmill(str(output / "curated" / "**" / "*.parquet"), again, args.workers, parameters)
                results[name]["second_pass"] = len(tokenmill_outcome(again)[1])
        if not args.skip_datatrove:
            cpu = run_measured(
                [sys.executable, "-c", DATATROVE_SCRIPT, str(root / "input"), str(root / "datatrove"),
                 str(args.workers), str(args.files), str(NGRAM), str(BANDS), str(ROWS)]
            )  # fmt: skip
            name = "datatrove MinHash (5-grams, 14x8)"
            results[name] = {
                **measure(index, pairs, similar_pairs, len(records), *datatrove_outcome(root / "datatrove")),
                "cpu": cpu,
            }

    print(
        f"\n| | removed | recall J>={TWIN} | kept with a kept twin J>={TWIN} "
        f"| removed, best kept match J and C < {WRONG} | CPU s |"
    )
    print("|---|---|---|---|---|---|")
    for name, result in results.items():
        print(
            f"| {name} | {result['removed']:,} | {result['recall']:.3f} | {result['twins']:,} | "
            f"{result['wrong']:,} ({result['wrong'] / result['total']:.2%}) | {result['cpu']:.1f} |"
        )
    default = results[DEFAULT]
    stats = default["stats"]
    print(
        f"\ntokenmill default: {stats['colliding_buckets']:,} colliding buckets "
        f"(largest {stats['largest_bucket']:,}), "
        f"{stats['verified_pairs']:,} pairs verified, {stats['similar_pairs']:,} similar, "
        f"{stats['candidate_pairs']:,} edges, {stats['components']:,} components (largest "
        f"{stats['largest_component']:,}), capped buckets {stats['capped_buckets']}"
    )
    print(
        f"one pass: rerunning the default on its own curated output removes {default['second_pass']} "
        "documents"
    )
    if "datatrove MinHash (5-grams, 14x8)" in results:
        theirs = results["datatrove MinHash (5-grams, 14x8)"]
        print(
            f"recall ratio={default['recall'] / max(theirs['recall'], 1e-9):.2f} target=1 "
            "baseline=datatrove_minhash_recall"
        )
        print(
            f"dedupe_real ratio={theirs['cpu'] / default['cpu']:.2f} target=5 baseline=datatrove_minhash_cpu"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
