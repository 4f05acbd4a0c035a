"""Dedupe against earlier runs: the index a curate run writes of what it kept, the cross-run matching that a
later run's `exact_dedupe` and `fuzzy_dedupe` do with `--dedupe-against`, and merging indexes.

Writing (`WriteDedupeIndex`, after the stages, on the final kept documents):

    kept documents -> (id, text hash[, band keys, compact signature, shingle count])   one row each
      -> shard = hash(id) mod m, m from the row count        every shard written, empty or not
      -> GroupByKey(shard) -> part-<n>-of-<m>.parquet, sorted by id, atomic; (file, rows, sha256)
      -> manifest.json from the file list (paths and hashes only, never rows)

Matching (`earlier_exact_pairs` inside ExactDedupe, `EarlierNearDuplicates` before FuzzyDedupe's own
graph): an earlier document is only ever a value that this run's documents are compared with; it is never
kept, removed or a node of this run's graph. Exact: the earlier (text hash, marker) pairs join the
combiner that picks each text's kept id, and a marker sorts before every id, so every copy of a text
that an earlier run kept is removed as `earlier_duplicate`. Near: this run's band keys meet the earlier
index's band keys by key; a bucket with more than `group_size` earlier members is salted into
ceil(members / group_size) groups by a hash of the earlier id, and this run's members of that bucket are
sent to each salt, so a group holds at most about `group_size` earlier members (its current members are
streamed past them in chunks). A current document matched by a verified pair (the fuzzy stage's own
estimate and threshold) is removed as `earlier_near_duplicate`, naming the earlier document with the
most equal signature rows (ties: the smallest (run, id)).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import apache_beam as beam
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.filters.minhash import (
    MinHasher,
    compact_signatures,
    containment_from_jaccard,
    distinct_counts,
    estimated_jaccard_from_agreement,
)
from tokenmill.formats import dedupe_index as index_format
from tokenmill.formats.dedupe_index import (
    INDEX_DIR,
    INDEX_SCHEMA,
    NORMALIZATION,
    SIGNATURE,
    TEXT_HASH,
    DedupeIndexManifest,
    IndexFile,
    IndexRun,
    MinHashParams,
)
from tokenmill.pipelines.dedupe_keys import DECISION, DOCUMENT, document_and_decision, node_id, text_hash
from tokenmill.pipelines.sinks import PARQUET_ROW_GROUP_ROWS, part_name, stable_hash

EARLIER_EXACT = "earlier_duplicate"
EARLIER_NEAR = "earlier_near_duplicate"
#: Earlier members per salted group of one band bucket, and bytes of index per row (for shard counts).
GROUP_SIZE = 1000
ROW_BYTES = 700
DEFAULT_SHARD_BYTES = 256 * 10**6
#: Current members compared with a group's earlier members in one vectorized step.
_CHUNK = 1024
#: An earlier document as a value of the exact combiner: sorts before every id (ids never start with NUL).
_MARKER = "\x00"
_EARLIER, _CURRENT = 0, 1


class DedupeIndexError(ValueError):
    """An index that cannot be used for this run: the message names the index and the parameter."""


def earlier_marker(run: str, identifier: str) -> str:
    return f"{_MARKER}{run}{_MARKER}{identifier}"


def is_earlier(value: str) -> bool:
    return value.startswith(_MARKER)


def parse_marker(value: str) -> tuple[str, str]:
    """(run, id) of an earlier marker."""
    _, run, identifier = value.split(_MARKER, 2)
    return run, identifier


@dataclass(frozen=True)
class EarlierIndex:
    """An index folder that this run dedupes against, with its manifest read and checked."""

    path: str
    manifest: DedupeIndexManifest

    def files(self) -> list[tuple[str, str]]:
        """(full path, run id) of every shard."""
        return [
            (storage.join(self.path, entry.path), run.id) for run in self.manifest.runs for entry in run.files
        ]


def load_indexes(paths: Sequence[str]) -> list[EarlierIndex]:
    """Each --dedupe-against folder's manifest, checked for the text hash and normalization this version
    uses; DedupeIndexError naming the folder otherwise."""
    indexes = []
    for path in paths:
        path = path.rstrip("/")
        try:
            manifest = index_format.read_manifest(path)
        except (FileNotFoundError, FormatError) as error:
            raise DedupeIndexError(str(error)) from None
        for name, value, expected in (
            ("text_hash", manifest.text_hash, TEXT_HASH),
            ("normalization", manifest.normalization, NORMALIZATION),
            ("signature", manifest.signature, SIGNATURE),
        ):
            if value != expected:
                raise DedupeIndexError(
                    f"dedupe index {path}: its {name} is {value!r}, this version's is {expected!r}; its "
                    "hashes cannot match this run's"
                )
        indexes.append(EarlierIndex(path, manifest))
    return indexes


def check_minhash(indexes: Sequence[EarlierIndex], params: MinHashParams, where: str) -> None:
    """Refuse an index whose band keys and signatures were made with other MinHash parameters."""
    for index in indexes:
        theirs = index.manifest.minhash
        if theirs is None:
            raise DedupeIndexError(
                f"dedupe index {index.path} has no MinHash part (its run had no fuzzy_dedupe stage), so "
                f"{where} cannot dedupe against it; drop fuzzy_dedupe or use an index written with it"
            )
        for name in ("ngram", "bands", "rows", "seed"):
            if getattr(theirs, name) != getattr(params, name):
                raise DedupeIndexError(
                    f"dedupe index {index.path} was made with {name}={getattr(theirs, name)}, but {where} "
                    f"has {name}={getattr(params, name)}; band keys and signatures only match with equal "
                    "ngram, bands, rows and seed"
                )


def fuzzy_params(transform: Any) -> MinHashParams:
    return MinHashParams(
        ngram=transform.ngram, bands=transform.bands, rows=transform.rows, seed=transform.seed
    )


def attach_earlier_indexes(steps: Sequence[Any], indexes: Sequence[EarlierIndex]) -> None:
    """Give the recipe's dedupe stages the earlier indexes (set as `against` on their transforms); every
    fuzzy_dedupe stage's parameters are checked against every index."""
    if not indexes:
        return
    dedupe = [step for step in steps if getattr(step, "stage", None) in ("exact_dedupe", "fuzzy_dedupe")]
    if not dedupe:
        raise DedupeIndexError(
            "--dedupe-against needs a recipe with an exact_dedupe or fuzzy_dedupe stage, which does the "
            "matching; this recipe has neither"
        )
    for step in dedupe:
        if step.stage == "fuzzy_dedupe":
            check_minhash(indexes, fuzzy_params(step.transform), "the recipe's fuzzy_dedupe stage")
        step.transform.against = tuple(indexes)


class _ReadIndexFile(beam.DoFn):
    """(index file, run id) -> its rows as `columns` dicts, one Parquet row group at a time: memory of one
    row group (16,384 rows), whatever the index's size."""

    def __init__(self, columns: Sequence[str]):
        self.columns = list(columns)

    def process(self, element: tuple[str, str]):
        path, run = element
        with storage.open_file(path, "rb") as handle:
            parquet = pq.ParquetFile(handle)
            for batch in parquet.iter_batches(columns=self.columns):
                for row in batch.to_pylist():
                    yield run, row


def read_earlier(pipeline, indexes: Sequence[EarlierIndex], columns: Sequence[str], label: str):
    """(run id, row) of every row of the indexes, each file read by one worker."""
    files = sorted({file for index in indexes for file in index.files()})
    return (
        pipeline
        | f"{label}Files" >> beam.Create(files)
        | f"{label}Spread" >> beam.Reshuffle()
        | f"{label}Read" >> beam.ParDo(_ReadIndexFile(columns))
    )


def earlier_exact_pairs(pipeline, indexes: Sequence[EarlierIndex], label: str):
    """(text hash, earlier marker) for every document of the indexes: what ExactDedupe's combiner adds."""
    return read_earlier(pipeline, indexes, ("id", "text_hash"), label) | f"{label}Markers" >> beam.Map(
        lambda element: (element[1]["text_hash"], earlier_marker(element[0], element[1]["id"]))
    ).with_output_types(tuple[str, str])


# --- near duplicates of earlier documents ----------------------------------------------------------------


def _earlier_members(element: tuple[str, dict]):
    run, row = element
    if not row["band_keys"]:
        return
    member = (run, row["id"], row["signature"], row["shingles"])
    for key in row["band_keys"]:
        yield key, member


def _salted_earlier(element: tuple[bytes, tuple], salts: dict[bytes, int]):
    key, member = element
    count = salts.get(key, 1)
    salt = stable_hash(f"{member[0]}\x00{member[1]}") % count if count > 1 else 0
    return (key, salt), (_EARLIER, member)


def _salted_current(element: tuple[bytes, tuple], salts: dict[bytes, int]):
    key, member = element
    for salt in range(salts.get(key, 1)):
        yield (key, salt), (_CURRENT, member)


class _MatchEarlier(beam.DoFn):
    """One salted group of a band bucket -> (current node, (equal rows, run, earlier id)) for each current
    member similar to an earlier member of the group (the best such one).

    Two passes over the values: the earlier members (about `group_size`, the salts see to it) are held, the
    current ones streamed past them in chunks of `_CHUNK`; memory O(group_size + _CHUNK)."""

    def __init__(self, num_perm: int, metric: str | None, threshold: float):
        self.num_perm = num_perm
        self.metric = metric
        self.threshold = threshold

    def process(self, element):
        _, values = element
        earlier = sorted(value for tag, value in values if tag == _EARLIER)
        if not earlier:
            return
        signatures = np.frombuffer(b"".join(member[2] for member in earlier), "<u2").reshape(len(earlier), -1)
        sizes = np.array([member[3] for member in earlier], np.int64)
        chunk: list = []
        for tag, member in values:
            if tag == _CURRENT:
                chunk.append(member)
                if len(chunk) == _CHUNK:
                    yield from self._match(chunk, earlier, signatures, sizes)
                    chunk = []
        if chunk:
            yield from self._match(chunk, earlier, signatures, sizes)

    def _match(self, chunk, earlier, signatures, sizes):
        if self.metric is None:  # verify: none, as the stage: every candidate is a duplicate
            first = earlier[0]
            for member in chunk:
                yield member[0], (0, first[0], first[1])
            return
        current = np.frombuffer(b"".join(member[1] for member in chunk), "<u2").reshape(len(chunk), -1)
        current_sizes = np.array([member[2] for member in chunk], np.int64)
        equal_rows = (current[:, None, :] == signatures[None, :, :]).sum(axis=2)
        similarity = estimated_jaccard_from_agreement(equal_rows, self.num_perm)
        if self.metric == "containment":
            small = np.minimum(current_sizes[:, None], sizes[None, :])
            large = np.maximum(current_sizes[:, None], sizes[None, :])
            similarity = containment_from_jaccard(similarity, small, large)
        similar = similarity >= self.threshold
        for row, member in enumerate(chunk):
            matches = np.flatnonzero(similar[row])
            if len(matches):
                # Most equal rows, then the smallest (run, id): an integer order, the same on every machine.
                best = min(matches, key=lambda index: (-int(equal_rows[row, index]), earlier[index][:2]))
                yield member[0], (int(equal_rows[row, best]), earlier[best][0], earlier[best][1])


def _better(first: tuple, second: tuple) -> tuple:
    return first if (-first[0], first[1:]) <= (-second[0], second[1:]) else second


class _BestMatch(beam.CombineFn):
    def create_accumulator(self):
        return None

    def add_input(self, accumulator, match):
        return match if accumulator is None else _better(accumulator, match)

    def merge_accumulators(self, accumulators):
        best = None
        for accumulator in accumulators:
            if accumulator is not None:
                best = accumulator if best is None else _better(best, accumulator)
        return best

    def extract_output(self, accumulator):
        return accumulator


class _DecideEarlier(beam.DoFn):
    """id -> its document and its best earlier match (if any): kept or removed ('removed')."""

    def __init__(self, stage: str, num_perm: int):
        self.stage = stage
        self.num_perm = num_perm

    def process(self, element):

        identifier, values = element
        document, match = document_and_decision(self.stage, identifier, values)
        if document is None:  # cannot happen: every match comes from a document's band keys
            raise RuntimeError(f"{self.stage}: an earlier match for {identifier!r}, which has no document")
        if match is None:
            yield document
            return
        equal_rows, run, earlier_id = match
        detail = {
            "earlier_id": earlier_id,
            "earlier_run": run,
            "signature_rows_equal": equal_rows,
            "signature_rows": self.num_perm,
        }
        yield beam.pvalue.TaggedOutput("stats", {"earlier_near_duplicates": 1})
        yield beam.pvalue.TaggedOutput(
            "removed",
            {
                **document,
                "stage": self.stage,
                "reason": EARLIER_NEAR,
                "detail": json.dumps(detail, sort_keys=True),
            },
        )


class EarlierNearDuplicates(beam.PTransform):
    """Remove the documents that have a verified near duplicate in earlier runs' indexes (see the module
    docstring); {"kept", "removed", "stats"}.

    `band_keys` is a transform from documents to (band key, (node key, compact signature, shingles)), the
    fuzzy stage's own (_BandKeys), so that both sides are made by one code path.

    Memory and shuffle at 10 TB on 1,000 workers: this run's band keys with their members (20 x ~280 bytes
    a document) and the earlier index's (the same per earlier document) are shuffled once by (band key,
    salt); a band bucket with k earlier members has ceil(k / group_size) salts and its current members are
    sent to each (so a 10^6-member earlier boilerplate bucket costs its current members 1,000 copies: the
    price of comparing each with every earlier member, k_current x k_earlier comparisons). Counting earlier
    members per band key is one combined shuffle of (key, 1). Matches leave as at most one per current
    document and band, combined per document; whole documents are shuffled once more, by id. Per worker:
    one group's ~group_size earlier members and one chunk of current ones.
    """

    def __init__(
        self,
        stage: str,
        indexes: Sequence[EarlierIndex],
        band_keys: beam.PTransform,
        num_perm: int,
        metric: str | None,
        threshold: float,
        group_size: int = GROUP_SIZE,
    ):
        super().__init__()
        self.stage = stage
        self.indexes = list(indexes)
        self.band_keys = band_keys
        self.num_perm = num_perm
        self.metric = metric
        self.threshold = threshold
        self.group_size = group_size

    def expand(self, documents):
        pipeline = documents.pipeline
        group_size = self.group_size
        current = documents | "EarlierBandKeys" >> self.band_keys
        earlier = read_earlier(
            pipeline, self.indexes, ("id", "band_keys", "signature", "shingles"), "EarlierIndex"
        ) | "EarlierMembers" >> beam.FlatMap(_earlier_members).with_output_types(tuple[bytes, Any])
        salts = (
            earlier
            | "EarlierOnes" >> beam.Map(lambda element: (element[0], 1)).with_output_types(tuple[bytes, int])
            | "EarlierPerKey" >> beam.CombinePerKey(sum)
            | "HotEarlier" >> beam.Filter(lambda element: element[1] > group_size)
            | "EarlierSalts" >> beam.Map(lambda element: (element[0], math.ceil(element[1] / group_size)))
        )
        salt_side = beam.pvalue.AsDict(salts)
        matches = (
            (
                earlier | "SaltEarlier" >> beam.Map(_salted_earlier, salts=salt_side),
                current | "SaltCurrent" >> beam.FlatMap(_salted_current, salts=salt_side),
            )
            | "EarlierAndCurrent" >> beam.Flatten()
            | "GroupEarlierBuckets" >> beam.GroupByKey()
            | "MatchEarlier" >> beam.ParDo(_MatchEarlier(self.num_perm, self.metric, self.threshold))
            | "BestEarlier" >> beam.CombinePerKey(_BestMatch())
        )
        decided = (
            (
                documents | "EarlierKeyById" >> beam.Map(lambda d: (d["id"], (DOCUMENT, d))),
                matches | "MatchesById" >> beam.Map(lambda m: (node_id(m[0]), (DECISION, m[1]))),
            )
            | "DocumentsAndMatches" >> beam.Flatten()
            | "JoinEarlierById" >> beam.GroupByKey()
            | "DecideEarlier"
            >> beam.ParDo(_DecideEarlier(self.stage, self.num_perm)).with_outputs(
                "removed", "stats", main="kept"
            )
        )
        index_rows = sum(index.manifest.documents for index in self.indexes)
        stats = (
            pipeline
            | "EarlierStatsZero"
            >> beam.Create(
                [
                    {
                        "earlier_near_duplicates": 0,
                        "earlier_index_documents": index_rows,
                        "earlier_salted_buckets": 0,
                    }
                ]
            ),
            decided.stats,
            salts | "HotEarlierStats" >> beam.Map(lambda _: {"earlier_salted_buckets": 1}),
        ) | "EarlierStats" >> beam.Flatten()
        return {"kept": decided.kept, "removed": decided.removed, "stats": stats}


# --- writing a run's index -------------------------------------------------------------------------------


def _hasher(params: MinHashParams | None) -> MinHasher | None:
    """The index's MinHasher (None for an index without signatures)."""
    return None if params is None else MinHasher(params.ngram, params.bands, params.rows, params.seed)


class _IndexRows(beam.DoFn):
    """A batch of kept documents -> compact index rows (id, text hash, MinHash signature as little-endian
    uint32 bytes or None, distinct shingles or None), the signature computed as the fuzzy stage computes
    it. A tuple of four objects crosses the shuffle instead of the stored row (20 band keys and a compact
    signature derived from the same signature): about a third of the bytes, a tenth of the objects."""

    def __init__(self, params: MinHashParams | None):
        self.params = params

    def setup(self):
        self.hasher = _hasher(self.params)

    def process(self, batch: list[dict]):
        if self.hasher is None:
            for document in batch:
                yield document["id"], text_hash(document["text"]), None, None
            return
        shingles, offsets = self.hasher.shingle_batch([document["text"] for document in batch])
        signatures, present = self.hasher.signatures_from_shingles(shingles, offsets)
        signatures = np.ascontiguousarray(signatures, dtype="<u4")
        sizes = distinct_counts(shingles, offsets)
        for index, document in enumerate(batch):
            has = bool(present[index])
            yield (
                document["id"],
                text_hash(document["text"]),
                signatures[index].tobytes() if has else None,
                int(sizes[index]) if has else None,
            )


class _WriteShard(beam.DoFn):
    """One shard's compact rows -> its Parquet file (INDEX_SCHEMA, sorted by id, atomic) and (path, rows,
    sha256).

    Memory: the shard's compact rows (about 700 bytes each in Python with 100 MinHash hashes; a shard is
    sized for the recipe's `target_file_bytes` of index), plus one Parquet row group's stored rows at a
    time: band keys and compact signatures are made per row group, never for the whole shard."""

    def __init__(self, index_dir: str, params: MinHashParams | None):
        self.index_dir = index_dir
        self.params = params

    def setup(self):
        self.hasher = _hasher(self.params)

    def _table(self, rows: list[tuple]) -> pa.Table:
        ids, hashes, band_keys, signatures, shingles = [], [], [], [], []
        for id_, hashed, signature, size in rows:
            ids.append(id_)
            hashes.append(hashed)
            shingles.append(size)
            if signature is None:
                band_keys.append(None)
                signatures.append(None)
            else:
                values = np.frombuffer(signature, dtype="<u4")
                band_keys.append(self.hasher.band_keys(values))
                signatures.append(compact_signatures(values).astype("<u2").tobytes())
        return pa.Table.from_arrays(
            [
                pa.array(ids, pa.string()),
                pa.array(hashes, pa.string()),
                pa.array(band_keys, pa.list_(pa.binary())),
                pa.array(signatures, pa.binary()),
                pa.array(shingles, pa.int64()),
            ],
            schema=INDEX_SCHEMA,
        )

    def process(self, element):
        (position, count), rows = element
        rows = sorted((row for row in rows if row is not None), key=lambda row: row[0])
        buffer = io.BytesIO()
        with pq.ParquetWriter(buffer, INDEX_SCHEMA, compression="zstd") as writer:
            for start in range(0, len(rows), PARQUET_ROW_GROUP_ROWS):
                writer.write_table(self._table(rows[start : start + PARQUET_ROW_GROUP_ROWS]))
        data = buffer.getvalue()
        name = part_name(position, count, ".parquet")
        storage.write_bytes(storage.join(self.index_dir, name), data)
        yield name, len(rows), hashlib.sha256(data).hexdigest()


def _write_manifest(_, files: list, index_dir: str, recipe: str, params: MinHashParams | None):
    entries = [IndexFile(path=path, rows=rows, sha256=sha) for path, rows, sha in sorted(files)]
    digest = index_format.content_hash(entries)
    documents = sum(entry.rows for entry in entries)
    run = IndexRun(
        id=f"{recipe}-{digest[:16]}", recipe=recipe, documents=documents, content_hash=digest, files=entries
    )
    manifest = DedupeIndexManifest(
        format_version=index_format.FORMAT_VERSION,
        text_hash=TEXT_HASH,
        normalization=NORMALIZATION,
        signature=SIGNATURE,
        minhash=params,
        runs=[run],
    )
    index_format.write_manifest(index_dir, manifest)
    yield f"{INDEX_DIR}/{index_format.MANIFEST}", documents


class WriteDedupeIndex(beam.PTransform):
    """Kept documents -> `<output>/dedupe-index/`: shards and manifest (see the module docstring); outputs
    one (manifest path relative to the output, documents) once the manifest is written.

    Memory and shuffle at 10 TB on 1,000 workers: one compact row per kept document (id, text hash, with
    MinHash its signature, 4 bytes a hash, and shingle count) shuffled once, by shard; a stored row (with
    20 band keys of 21 bytes and a 200-byte compact signature: ~700 bytes before zstd) is made only as
    its file's row group is written. Shards are sized for `shard_bytes` of stored rows (curate passes
    the recipe's `target_file_bytes`, the bound every writer of the run holds to), so a worker holds one
    shard's compact rows whatever the corpus. The signatures are computed again here (the fuzzy stage's
    CPU once more, on the kept documents only). The manifest step gets the file list (names and hashes)
    as a side input, never rows.
    """

    def __init__(
        self,
        output: str,
        recipe: str,
        params: MinHashParams | None,
        batch_size: int = 256,
        shard_bytes: int = DEFAULT_SHARD_BYTES,
    ):
        super().__init__()
        self.index_dir = storage.join(output, INDEX_DIR)
        self.recipe = recipe
        self.params = params
        self.batch_size = batch_size
        self.shard_bytes = shard_bytes

    def expand(self, kept):
        index_dir, shard_bytes = self.index_dir, self.shard_bytes
        rows = (
            kept
            | "IndexBatches"
            >> beam.BatchElements(min_batch_size=self.batch_size, max_batch_size=self.batch_size)
            | "IndexRows" >> beam.ParDo(_IndexRows(self.params))
        )
        shards = (
            rows
            | "IndexRowCount" >> beam.combiners.Count.Globally()
            | "IndexShards" >> beam.Map(lambda count: max(1, math.ceil(count * ROW_BYTES / shard_bytes)))
        )
        every_shard = shards | "EveryShard" >> beam.FlatMap(
            lambda count: [((position, count), None) for position in range(count)]
        )
        assigned = rows | "AssignShard" >> beam.Map(
            lambda row, count: ((stable_hash(row[0]) % count, count), row),
            count=beam.pvalue.AsSingleton(shards),
        )
        files = (
            (assigned, every_shard)
            | "IndexShardRows" >> beam.Flatten()
            | "GroupByShard" >> beam.GroupByKey()
            | "WriteShards" >> beam.ParDo(_WriteShard(index_dir, self.params))
        )
        return (
            kept.pipeline
            | "IndexManifestOnce" >> beam.Create([None])
            | "WriteIndexManifest"
            >> beam.FlatMap(_write_manifest, beam.pvalue.AsList(files), index_dir, self.recipe, self.params)
        )


def index_params(steps: Sequence[Any]) -> tuple[bool, MinHashParams | None]:
    """(whether the recipe dedupes at all, the MinHash parameters of its last fuzzy_dedupe stage or None)."""
    stages = [step for step in steps if getattr(step, "stage", None) in ("exact_dedupe", "fuzzy_dedupe")]
    fuzzy = [step for step in stages if step.stage == "fuzzy_dedupe"]
    return bool(stages), (fuzzy_params(fuzzy[-1].transform) if fuzzy else None)


# --- merging ---------------------------------------------------------------------------------------------


def _copy(source: str, target: str, chunk_bytes: int = 1 << 22) -> None:
    with storage.open_file(source, "rb") as reader, storage.atomic_write(target) as writer:
        while chunk := reader.read(chunk_bytes):
            writer.write(chunk)


def merge_indexes(paths: Sequence[str], output: str) -> DedupeIndexManifest:
    """The union of the indexes at `paths`, written to `output`: each run's files copied (checked against
    their sha256) into `output/<run id>/`, one entry per run (a run in two inputs is taken once, by its
    content hash); the MinHash parameters must be equal. Copies stream in 4 MiB chunks; the manifest is
    written last, so a merge cut short leaves no index. Idempotent: a rerun rewrites the same bytes."""
    indexes = load_indexes(paths)
    if not indexes:
        raise DedupeIndexError("merge needs at least one index")
    first = indexes[0]
    for index in indexes[1:]:
        if (index.manifest.minhash is None) != (first.manifest.minhash is None):
            without = index.path if index.manifest.minhash is None else first.path
            raise DedupeIndexError(
                f"dedupe index {without} has no MinHash part (its run had no fuzzy_dedupe stage) and the "
                "other indexes have one: they cannot be merged"
            )
        if first.manifest.minhash is not None:
            check_minhash([index], first.manifest.minhash, f"dedupe index {first.path}")
    runs: dict[str, IndexRun] = {}
    for index in indexes:
        for run in index.manifest.runs:
            if run.content_hash in {seen.content_hash for seen in runs.values()}:
                continue
            files = []
            for entry in run.files:
                source = storage.join(index.path, entry.path)
                name = f"{run.id}/{os.path.basename(entry.path)}"
                target = storage.join(output, name)
                _copy(source, target)
                if storage.file_sha256(target) != entry.sha256:
                    raise DedupeIndexError(f"{source}: sha256 differs from its manifest's {entry.sha256}")
                files.append(IndexFile(path=name, rows=entry.rows, sha256=entry.sha256))
            runs[run.id] = IndexRun(
                id=run.id,
                recipe=run.recipe,
                documents=run.documents,
                content_hash=run.content_hash,
                files=files,
            )
    manifest = DedupeIndexManifest(
        format_version=index_format.FORMAT_VERSION,
        text_hash=TEXT_HASH,
        normalization=NORMALIZATION,
        signature=SIGNATURE,
        minhash=first.manifest.minhash,
        runs=[runs[key] for key in sorted(runs)],
    )
    index_format.write_manifest(output, manifest)
    return manifest
