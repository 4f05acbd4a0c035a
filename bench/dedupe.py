"""Benchmark: fuzzy dedupe against datasketch (quality, signature speed) and datatrove (whole stage).

One corpus with known truth: distinct documents (sentences of words drawn with the frequencies of the
standard library's prose, the sample corpus's source), and for a fifth of them 1-3 near copies made with
the sample corpus's own editor (tokenmill.samples.text: 1-30% of words replaced, deleted or
inserted). Ids are shuffled, so the original is not always the smallest id.

1. Precision and recall of duplicate pairs (pairs of documents that the method puts in one group),
   against the planted truth, for tokenmill's stage (the Beam pipeline, without and with verification),
   for datasketch's MinHashLSH with the same parameters (word 5-grams, 14 bands x 8 rows, 112
   permutations; groups are the connected components of its query results) and for datatrove's
   pipeline; with recall by edit size, and recall on the planted pairs whose true 5-gram Jaccard is at
   least 0.8 (where LSH at 14 x 8 finds a pair with 92% probability or more).
2. Signature throughput, one process, documents per CPU second (a shared machine's load weighs less on
   CPU time than on wall time; the two are measured in turns): tokenmill.filters.minhash against
   datasketch's MinHash, both from text to signature (datasketch: the same words, 5-gram shingles as
   bytes, `update_batch`, permutations built once and shared, which is datasketch at its fastest).
3. Whole stage, documents per second from process start to written output, on the same cores:
   `tokenmill curate` with only the fuzzy dedupe stage against datatrove's minhash pipeline
   (MinhashDedupSignature -> MinhashDedupBuckets -> MinhashDedupCluster -> MinhashDedupFilter, each with
   LocalPipelineExecutor, same n-grams, bands and rows; sha1 shingle hashing, since datatrove's default
   xxhash is not installed).

    python bench/dedupe.py [--documents 8000] [--workers 2]

The last line is `dedupe ratio=X.XX target=10 baseline=datasketch_minhash`: tokenmill's signature
throughput over datasketch's. The whole-stage ratio (target 1) is printed just before it.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from itertools import combinations
from pathlib import Path

import numpy as np

from tokenmill.filters.minhash import BLOCK_ROWS, MinHasher, jaccard, words
from tokenmill.formats.stats import STATS, read_stats
from tokenmill.samples import text as sample

NGRAM, BANDS, ROWS = 5, 14, 8
EDIT_BUCKETS = ((0.0, 0.05), (0.05, 0.10), (0.10, 0.20), (0.20, 0.31))
SIMILAR = 0.8  # planted pairs at least this similar (true 5-gram Jaccard) are found with >= 92% probability


def make_corpus(documents: int, seed: int = 11) -> tuple[list[dict], dict[str, str], dict[str, float]]:
    """(records, id -> truth cluster, copy id -> edit fraction)."""
    rng = random.Random(seed)
    counts = Counter(
        word for paragraph in sample.prose_paragraphs() for word in re.findall(r"[A-Za-z']+", paragraph)
    )
    vocab = sorted(counts)
    cumulative = []
    total = 0
    for word in vocab:
        total += counts[word]
        cumulative.append(total)

    def document() -> str:
        sentences = []
        for _ in range(rng.randint(4, 40)):
            chosen = rng.choices(vocab, cum_weights=cumulative, k=rng.randint(6, 24))
            sentences.append(" ".join([chosen[0].capitalize(), *chosen[1:]]) + ".")
        return " ".join(sentences)

    texts: list[tuple[str, str, float | None]] = []  # (text, cluster, edit fraction of a copy)
    base_count = int(documents / 1.4)  # a fifth get 1-3 copies: about 0.4 copies per original
    for number in range(base_count):
        text = document()
        cluster = f"c{number}"
        texts.append((text, cluster, None))
        if rng.random() < 0.2:
            for _ in range(rng.randint(1, 3)):
                fraction = rng.uniform(0.01, 0.30)
                texts.append((sample.near_duplicate(rng, text, fraction), cluster, fraction))
    order = list(range(len(texts)))
    rng.shuffle(order)
    records, truth, edits = [], {}, {}
    for position, index in enumerate(order):
        text, cluster, fraction = texts[index]
        identifier = f"d{position:07d}"
        records.append({"id": identifier, "text": text})
        truth[identifier] = cluster
        if fraction is not None:
            edits[identifier] = fraction
    return records, truth, edits


def write_jsonl(records: list[dict], directory: Path, files: int) -> None:
    directory.mkdir(parents=True)
    per_file = -(-len(records) // files)
    for index in range(files):
        chunk = records[index * per_file : (index + 1) * per_file]
        (directory / f"part-{index:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chunk))


def pairs_of(groups: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {
        pair for members in groups.values() if len(members) > 1 for pair in combinations(sorted(members), 2)
    }


def true_groups(truth: dict[str, str]) -> dict[str, set[str]]:
    groups: dict[str, set[str]] = defaultdict(set)
    for identifier, cluster in truth.items():
        groups[cluster].add(identifier)
    return groups


def similar_pairs(
    records: list[dict], truth: dict[str, str], edits: dict[str, float], at_least: float
) -> set:
    """(original, copy) pairs whose true 5-gram Jaccard similarity is at least `at_least`."""
    hasher = MinHasher(NGRAM, BANDS, ROWS)
    texts = {r["id"]: r["text"] for r in records}
    originals = {truth[i]: i for i in truth if i not in edits}
    pairs = set()
    for copy in edits:
        original = originals[truth[copy]]
        if jaccard(hasher.shingles(texts[copy]), hasher.shingles(texts[original])) >= at_least:
            pairs.add(tuple(sorted((copy, original))))
    return pairs


def quality(
    predicted: set, truth_pairs: set, similar: set, truth: dict[str, str], edits: dict[str, float]
) -> str:
    hits = len(predicted & truth_pairs)
    precision = hits / len(predicted) if predicted else 1.0
    recall = hits / len(truth_pairs) if truth_pairs else 1.0
    originals = {truth[i]: i for i in truth if i not in edits}
    by_edit = []
    for low, high in EDIT_BUCKETS:
        copies = [c for c, fraction in edits.items() if low <= fraction < high]
        caught = sum(1 for c in copies if tuple(sorted((c, originals[truth[c]]))) in predicted)
        by_edit.append(f"{low:.0%}-{min(high, 0.30):.0%}: {caught / max(len(copies), 1):.2f}")
    return (
        f"precision {precision:.3f} recall {recall:.3f}, recall at Jaccard >= {SIMILAR} "
        f"{len(predicted & similar) / max(len(similar), 1):.3f} ({len(predicted):,} pairs; recall by edit "
        f"size " + ", ".join(by_edit) + ")"
    )


def union_find_groups(pairs: list[tuple[str, str]]) -> dict[str, set[str]]:
    parent: dict[str, str] = {}

    def find(node: str) -> str:
        while parent.setdefault(node, node) != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for a, b in pairs:
        root_a, root_b = find(a), find(b)
        if root_a != root_b:
            parent[max(root_a, root_b)] = min(root_a, root_b)
    groups: dict[str, set[str]] = defaultdict(set)
    for node in parent:
        groups[find(node)].add(node)
    return groups


def datasketch_shingles(text: str) -> set[bytes]:
    tokens = words(text)
    if len(tokens) < NGRAM:
        return {" ".join(tokens).encode()} if tokens else set()
    return {" ".join(tokens[i : i + NGRAM]).encode() for i in range(len(tokens) - NGRAM + 1)}


def datasketch_signatures(texts: list[str]) -> list:
    from datasketch import MinHash

    template = MinHash(num_perm=BANDS * ROWS, seed=1)
    signatures = []
    for text in texts:
        minhash = MinHash(num_perm=BANDS * ROWS, permutations=template.permutations, scheme=template.scheme)
        minhash.update_batch(datasketch_shingles(text))
        signatures.append(minhash)
    return signatures


def datasketch_groups(records: list[dict]) -> dict[str, set[str]]:
    from datasketch import MinHashLSH

    lsh = MinHashLSH(num_perm=BANDS * ROWS, params=(BANDS, ROWS))
    signatures = datasketch_signatures([r["text"] for r in records])
    for record, signature in zip(records, signatures, strict=True):
        lsh.insert(record["id"], signature)
    pairs = []
    for record, signature in zip(records, signatures, strict=True):
        pairs.extend((record["id"], other) for other in lsh.query(signature) if other != record["id"])
    return union_find_groups(pairs)


def signature_throughput(texts: list[str], repeats: int = 3) -> tuple[float, float, float]:
    """Documents per CPU second, from text to signature: tokenmill (batches of 256), datasketch (a quarter
    of the texts) and the limit of tokenmill's arithmetic: the permutations' 64-bit multiplies alone
    (num_perm per shingle, the same blocks), which numpy runs one at a time on a CPU without AVX-512's
    64-bit vector multiply, and which any a*x+b MinHash over 64-bit shingle hashes must do. Measured in
    turns and the best of `repeats` kept, so that other work on a shared machine weighs on all alike."""
    hasher = MinHasher(NGRAM, BANDS, ROWS)
    hasher.signatures(texts[:300])  # warm-up: the Unicode table, numpy's first calls
    subset = texts[: max(200, len(texts) // 4)]
    datasketch_signatures(subset[:20])
    batches = [texts[start : start + 256] for start in range(0, len(texts), 256)]
    shingles = [hasher.shingle_batch(batch)[0] for batch in batches]
    block = np.empty((hasher.num_perm, BLOCK_ROWS), np.uint64)
    multipliers = hasher.a[:, None]

    def multiplies_alone() -> None:
        for hashes in shingles:
            for low in range(0, len(hashes), BLOCK_ROWS):
                part = hashes[None, low : low + BLOCK_ROWS]
                np.multiply(multipliers, part, out=block[:, : part.shape[1]])

    ours = theirs = limit = float("inf")
    for _ in range(repeats):
        started = time.process_time()
        for batch in batches:
            hasher.signatures(batch)
        ours = min(ours, time.process_time() - started)
        started = time.process_time()
        datasketch_signatures(subset)
        theirs = min(theirs, time.process_time() - started)
        started = time.process_time()
        multiplies_alone()
        limit = min(limit, time.process_time() - started)
    return len(texts) / ours, len(subset) / theirs, len(texts) / limit


def run_tokenmill(input_dir: Path, output: Path, workers: int, verify: str) -> float:
    recipe = output.parent / f"recipe-{verify}.yaml"
    recipe.write_text(
        f"name: bench-dedupe\nstages:\n  - fuzzy_dedupe: {{ngram: {NGRAM}, bands: {BANDS}, rows: {ROWS}, "
        f"verify: {verify}}}\n"
    )
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "tokenmill", "curate", "--recipe", str(recipe), "--input",
         str(input_dir / "*.jsonl"), "--output", str(output), "--workers", str(workers)],
        check=True, capture_output=True,
    )  # fmt: skip
    return time.perf_counter() - started


def tokenmill_groups(output: Path) -> dict[str, set[str]]:
    """The stage's duplicate groups: each kept root with the documents removed as its near duplicates."""
    import pyarrow.parquet as pq

    groups: dict[str, set[str]] = defaultdict(set)
    # Documents only: curate also writes its dedupe index (dedupe-index/) as Parquet.
    paths = [*(output / "curated").rglob("*.parquet"), *(output / "removed").rglob("*.parquet")]
    for path in sorted(paths):
        for row in pq.read_table(path, columns=["id", "dup_cluster"]).to_pylist():
            identifier, cluster = row["id"].split(":", 1)[1], row["dup_cluster"]
            if cluster is None:
                continue
            root = cluster.split(":", 1)[1]
            # Only the root of a component is kept with a dup_cluster (the others are removed).
            if "removed" in path.parts or identifier == root:
                groups[root].add(identifier)
    return groups


DATATROVE_SCRIPT = """
import sys
from datatrove.executor import LocalPipelineExecutor
from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets, MinhashDedupCluster,
                                               MinhashDedupFilter, MinhashDedupSignature)
from datatrove.pipeline.readers import JsonlReader
from datatrove.pipeline.writers import JsonlWriter
from datatrove.utils.hashing import HashConfig

input_dir, output, workers, files, ngram, bands, rows = sys.argv[1:3] + [int(a) for a in sys.argv[3:]]
config = MinhashConfig(n_grams=ngram, num_buckets=bands, hashes_per_bucket=rows,
                       hash_config=HashConfig(precision=64, hash_fc="sha1"))
def run(pipeline, tasks, name):
    LocalPipelineExecutor(pipeline=pipeline, tasks=tasks, workers=min(workers, tasks),
                          logging_dir=f"{output}/logs/{name}").run()
run([JsonlReader(input_dir), MinhashDedupSignature(output_folder=f"{output}/signatures", config=config)],
    files, "signatures")
run([MinhashDedupBuckets(input_folder=f"{output}/signatures", output_folder=f"{output}/buckets",
                         config=config)], bands, "buckets")
run([MinhashDedupCluster(input_folder=f"{output}/buckets", output_folder=f"{output}/remove_ids",
                         config=config, save_cluster_id=True)], 1, "clusters")
run([JsonlReader(input_dir),
     MinhashDedupFilter(input_folder=f"{output}/remove_ids", load_cluster_ids=True,
                        exclusion_writer=JsonlWriter(f"{output}/removed")),
     JsonlWriter(f"{output}/kept")], files, "filter")
"""


def run_datatrove(input_dir: Path, output: Path, workers: int, files: int) -> float:
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", DATATROVE_SCRIPT, str(input_dir), str(output), str(workers), str(files),
         str(NGRAM), str(BANDS), str(ROWS)],
        check=True, capture_output=True,
    )  # fmt: skip
    return time.perf_counter() - started


def datatrove_groups(output: Path) -> dict[str, set[str]]:
    groups: dict[str, set[str]] = defaultdict(set)
    for folder in ("kept", "removed"):
        for path in sorted((output / folder).glob("*.jsonl.gz")):
            for line in gzip.decompress(path.read_bytes()).splitlines():
                record = json.loads(line)
                cluster = record["metadata"].get("minhash_cluster_id", -1)
                if cluster != -1:
                    groups[str(cluster)].add(record["id"])
    return groups


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--documents", type=int, default=8000, help="documents in the corpus, copies included"
    )
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    records, truth, edits = make_corpus(args.documents)
    truth_pairs = pairs_of(true_groups(truth))
    similar = similar_pairs(records, truth, edits, SIMILAR)
    words_per_document = sum(len(r["text"].split()) for r in records) / len(records)
    print(
        f"corpus: {len(records):,} documents ({len(edits):,} planted near copies, 1-30% of words edited), "
        f"{words_per_document:.0f} words each on average; {len(truth_pairs):,} true duplicate pairs "
        f"({len(similar):,} original-copy pairs with true 5-gram Jaccard >= {SIMILAR})"
    )
    print(f"parameters: word {NGRAM}-grams, {BANDS} bands x {ROWS} rows; workers: {args.workers}")

    with tempfile.TemporaryDirectory() as temporary:
        root = Path(temporary)
        write_jsonl(records, root / "input", args.files)
        # datatrove first and last, tokenmill between: the faster datatrove run is its time.
        datatrove_times = [run_datatrove(root / "input", root / "datatrove", args.workers, args.files)]
        tokenmill_time = run_tokenmill(root / "input", root / "tokenmill", args.workers, "none")
        verified_time = run_tokenmill(root / "input", root / "tokenmill-verified", args.workers, "jaccard")
        datatrove_times.append(run_datatrove(root / "input", root / "datatrove-2", args.workers, args.files))
        datatrove_time = min(datatrove_times)
        stats = read_stats(str(root / "tokenmill" / STATS)).stages["fuzzy_dedupe"]
        ours = pairs_of(tokenmill_groups(root / "tokenmill"))
        ours_verified = pairs_of(tokenmill_groups(root / "tokenmill-verified"))
        theirs_datatrove = pairs_of(datatrove_groups(root / "datatrove"))

    theirs = pairs_of(datasketch_groups(records))
    print("duplicate pairs against the planted truth:")
    for name, pairs in (
        ("tokenmill fuzzy_dedupe, no verification", ours),
        ("tokenmill fuzzy_dedupe, verified edges, estimated Jaccard >= 0.7", ours_verified),
    ):
        print(f"  {name}: {quality(pairs, truth_pairs, similar, truth, edits)}")
    print(f"  datasketch MinHashLSH, same parameters: {quality(theirs, truth_pairs, similar, truth, edits)}")
    print(f"  datatrove minhash pipeline: {quality(theirs_datatrove, truth_pairs, similar, truth, edits)}")
    print(
        f"  tokenmill and datasketch agree on {len(ours & theirs):,} pairs; "
        f"{len(ours - theirs):,} only tokenmill, {len(theirs - ours):,} only datasketch"
    )
    print(
        f"  stage stats: candidate pairs {stats['candidate_pairs']:,}, components {stats['components']:,}, "
        f"sizes {stats['component_sizes']}, rounds that changed edges {stats['rounds_that_changed_edges']}"
    )

    ours_rate, theirs_rate, limit_rate = signature_throughput([r["text"] for r in records])
    print(
        f"signatures, one process, per CPU second: tokenmill {ours_rate:,.0f} docs/s, datasketch MinHash "
        f"{theirs_rate:,.0f} docs/s "
        f"({ours_rate / theirs_rate:.1f}x)"
    )
    print(
        f"signature limit: the {BANDS * ROWS} 64-bit multiplies per shingle alone run at {limit_rate:,.0f} "
        f"docs/s ({limit_rate / theirs_rate:.1f}x datasketch); tokenmill's whole signature (shingling, "
        f"multiply, add, minimum per document) is at {ours_rate / limit_rate:.2f} of it"
    )
    stage_ratio = datatrove_time / tokenmill_time
    print(
        f"whole stage, {args.workers} workers, process start to written output: tokenmill curate "
        f"{tokenmill_time:.1f}s ({len(records) / tokenmill_time:,.0f} docs/s; with verification "
        f"{verified_time:.1f}s, {len(records) / verified_time:,.0f} docs/s), datatrove minhash "
        f"{datatrove_time:.1f}s ({len(records) / datatrove_time:,.0f} docs/s; runs "
        f"{', '.join(f'{t:.1f}s' for t in datatrove_times)})"
    )
    print(f"stage ratio={stage_ratio:.2f} target=1 baseline=datatrove_minhash_pipeline")
    print(f"dedupe ratio={ours_rate / theirs_rate:.2f} target=10 baseline=datasketch_minhash")
    return 0


if __name__ == "__main__":
    sys.exit(main())
