"""Fixed evaluation sequences: what the trainer scores on each evaluation set, and its exact UTF-8 bytes.

A set (a group of cells' held-out slices, or an external set) is laid out as one token stream: an
end-of-text id, then whole documents, each followed by its end-of-text id, taken from the set's readers
in round-robin order (document 0 of each reader in order, then document 1, ...), so that a domain's set
draws from all its cells. Documents are taken while they fit whole in `sequences x sequence_length`
scored tokens; the first that does not fit ends the set. The stream is cut into windows of
`sequence_length + 1` tokens with a stride of `sequence_length` (window j is stream[jS : jS + S + 1]),
so every token after the leading end-of-text is scored exactly once: every token of every document taken,
end-of-text included, and nothing else. The last window is padded with end-of-text ids that the mask
leaves out.

Because only whole documents are scored, the set's bytes are the sum of those documents' `.bytes` entries
(the UTF-8 length of their text, written by tokenize): bits per byte is exact, not a mean token length.

The sequences depend only on the set's shards, the sequence length and the number of sequences: the same
at every evaluation of a run and across runs of the same sets. Nothing here imports the model or the run.

Evaluation sets on gs:// are read whole through a local mirror (`local_sets_folder`): they are small by
construction (a held-out slice is capped per cell, 4M tokens by default), while training shards stay remote.

Memory: a set holds its `sequences x (sequence_length + 1)` int32 tokens, segment ids and a mask on the
host (1,024 sequences of 4,096 tokens: 48 MiB per set); each process keeps all of them and hands the
device only its rows of each batch.
"""

from __future__ import annotations

import hashlib
import math
import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from tokenmill import storage
from tokenmill.formats.plan import EvalSetPlan, MixturePlan
from tokenmill.formats.tokens import COUNTS, EVAL_DIR, HELDOUT_DIR, MANIFEST, read_counts
from tokenmill.tokenize.shards import EvalShards, TokenCatalog
from tokenmill.trainer.data.batch import process_rows, segments_from_eos


@dataclass(frozen=True)
class EvalBatch:
    """This process's rows of one evaluation batch: tokens and segment ids [rows, S + 1] int32 as in a
    training batch, and mask [rows, S] float32, 1 where the target tokens[:, 1:] is scored."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    mask: np.ndarray


@dataclass(frozen=True)
class EvalSequences:
    """The fixed sequences of one evaluation set and what they score."""

    name: str
    kind: str  # heldout | external
    tokens: np.ndarray  # [rows, S + 1] int32
    segment_ids: np.ndarray  # [rows, S + 1] int32
    mask: np.ndarray  # [rows, S] float32
    documents: int  # documents scored (whole)
    scored_tokens: int  # = mask.sum(): the documents' tokens and their end-of-text ids
    num_bytes: int  # UTF-8 bytes of the documents scored
    tokenizer_sha256: str

    @property
    def sequences(self) -> int:
        return int(self.tokens.shape[0])

    def batches(self, rows: int, process_index: int = 0, process_count: int = 1) -> Iterator[EvalBatch]:
        """The set in batches of `rows` sequences (the last filled up with fully masked rows), this
        process's slice of each: every batch has the same shape, so one compiled step scores them all."""
        local = process_rows(rows, process_index, process_count)
        width = self.tokens.shape[1]
        for first in range(0, self.sequences, rows):
            tokens = np.full((rows, width), self.tokens[0, 0], np.int32)
            segments = np.zeros((rows, width), np.int32)
            mask = np.zeros((rows, width - 1), np.float32)
            count = min(rows, self.sequences - first)
            tokens[:count] = self.tokens[first : first + count]
            segments[:count] = self.segment_ids[first : first + count]
            mask[:count] = self.mask[first : first + count]
            yield EvalBatch(
                tokens[local.start : local.stop],
                segments[local.start : local.stop],
                mask[local.start : local.stop],
            )

    def num_batches(self, rows: int) -> int:
        return math.ceil(self.sequences / rows)


def round_robin(readers: Sequence[EvalShards]) -> Iterator[tuple[EvalShards, int]]:
    """(reader, document) in the order a set takes them: document i of every reader, then i + 1."""
    longest = max((len(reader) for reader in readers), default=0)
    for i in range(longest):
        for reader in readers:
            if i < len(reader):
                yield reader, i


def build_sequences(
    name: str, kind: str, readers: Sequence[EvalShards], sequence_length: int, sequences: int
) -> EvalSequences:
    """The fixed sequences of one set from its readers (see the module docstring for the layout).

    Raises ValueError when the readers disagree on the tokenizer or end-of-text id, or when not even the
    set's first document fits in `sequences` windows."""
    if not readers:
        raise ValueError(f"evaluation set {name}: no shards")
    first = readers[0]
    for reader in readers[1:]:
        if (reader.tokenizer_sha256, reader.eos_id) != (first.tokenizer_sha256, first.eos_id):
            raise ValueError(
                f"evaluation set {name}: {reader.path} has tokenizer sha256 {reader.tokenizer_sha256} "
                f"(eos {reader.eos_id}), {first.path} has {first.tokenizer_sha256} (eos {first.eos_id})"
            )
    eos, budget = first.eos_id, sequences * sequence_length
    pieces = [np.array([eos], np.int64)]
    scored = documents = num_bytes = 0
    for reader, i in round_robin(readers):
        doc = reader.document(i)
        if scored + len(doc) + 1 > budget:
            break
        pieces += [np.asarray(doc, np.int64), np.array([eos], np.int64)]
        scored += len(doc) + 1
        documents += 1
        num_bytes += reader.document_bytes(i)
    if documents == 0:
        total = sum(len(reader) for reader in readers)
        detail = "it has no documents" if total == 0 else "its first document is longer than that"
        raise ValueError(
            f"evaluation set {name}: nothing fits in {sequences} sequences of {sequence_length} tokens "
            f"({detail}); raise evaluation.sequences"
        )
    stream = np.concatenate(pieces)
    rows = math.ceil(scored / sequence_length)
    padded = np.full(rows * sequence_length + 1, eos, np.int64)
    padded[: len(stream)] = stream
    starts = np.arange(rows)[:, None] * sequence_length
    tokens = padded[starts + np.arange(sequence_length + 1)].astype(np.int32)
    # Target t of row j is stream[jS + t + 1]: scored while that is inside the stream.
    mask = ((starts + np.arange(sequence_length) + 1) < len(stream)).astype(np.float32)
    return EvalSequences(
        name=name,
        kind=kind,
        tokens=tokens,
        segment_ids=segments_from_eos(tokens, eos),
        mask=mask,
        documents=documents,
        scored_tokens=scored,
        num_bytes=num_bytes,
        tokenizer_sha256=first.tokenizer_sha256,
    )


def local_sets_folder(tokens_dir: str) -> str:
    """The tokens folder to read evaluation sets from: `tokens_dir` itself when local; for gs://, a local
    mirror holding its counts.json, every cell's held-out slice and every external set, each file a link
    to its `storage.local_copy` (downloaded once per machine, keyed by the object's version, so a changed
    set is fetched again). Lists only the cells' heldout/ folders and eval/, never the training shards."""
    if storage.is_local(tokens_dir):
        return storage.local_path(tokens_dir)
    counts = read_counts(storage.join(tokens_dir, COUNTS))
    prefixes = [f"{cell}/{HELDOUT_DIR}" for cell in sorted(counts.cells)] + [EVAL_DIR]
    files = [COUNTS] + [
        f"{prefix}/{relative}"
        for prefix in prefixes
        for relative in storage.list_files(storage.join(tokens_dir, prefix), relative=True)
    ]
    mirror = os.path.join(
        storage.cache_dir(), "tokens-" + hashlib.sha256(tokens_dir.encode()).hexdigest()[:16]
    )
    for relative in files:
        target = os.path.join(mirror, *relative.split("/"))
        os.makedirs(os.path.dirname(target), exist_ok=True)
        # A new link under a temporary name, then renamed over the old one: a reader never sees none.
        temporary = f"{target}.{uuid.uuid4().hex}.tmp"
        os.symlink(storage.local_copy(storage.join(tokens_dir, relative)), temporary)
        os.replace(temporary, target)
    return mirror


def open_set(plan_set: EvalSetPlan, tokens_dir: str, tokenizer_sha256: str | None = None) -> list[EvalShards]:
    """The readers of one planned evaluation set, its manifests relative to the tokens folder."""
    return [
        EvalShards(os.path.dirname(os.path.join(tokens_dir, manifest)), tokenizer_sha256)
        for manifest in plan_set.manifests
    ]


def set_readers(
    plan: MixturePlan | None,
    tokens_dir: str,
    names: Sequence[str] | None = None,
    tokenizer_sha256: str | None = None,
) -> list[tuple[str, str, list[EvalShards]]]:
    """(name, kind, readers) of the plan's evaluation sets, or of those named, in the order named: a set of
    the plan, else an external set of the tokens folder (`eval/<name>`), else a cell's held-out slice
    (`heldout/<cell>`). Shards made with another tokenizer than `tokenizer_sha256` are refused (ShardError,
    naming both hashes); a name found nowhere is a KeyError that lists the plan's sets."""
    planned = {entry.name: entry for entry in (plan.evaluation if plan is not None else [])}
    if not names:
        return [(e.name, e.kind, open_set(e, tokens_dir, tokenizer_sha256)) for e in planned.values()]
    out = []
    for name in names:
        if name in planned:
            out.append((name, planned[name].kind, open_set(planned[name], tokens_dir, tokenizer_sha256)))
            continue
        catalog = TokenCatalog(tokens_dir, tokenizer_sha256)
        cell = name.removeprefix("heldout/")
        if name.startswith("heldout/") and cell in catalog.counts.cells:
            out.append((name, "heldout", [catalog.heldout(cell)]))
        elif os.path.exists(os.path.join(catalog.path, EVAL_DIR, name, MANIFEST)):
            out.append((name, "external", [catalog.eval_set(name)]))
        else:
            raise KeyError(
                f"evaluation set {name}: not in the plan (it has: {', '.join(planned) or 'none'}), not an "
                f"external set {os.path.join(catalog.path, EVAL_DIR, name)}, not heldout/<a cell>"
            )
    return out


def load_sequences(
    plan: MixturePlan | None,
    tokens_dir: str,
    sequence_length: int,
    sequences: int,
    names: Sequence[str] | None = None,
    tokenizer_sha256: str | None = None,
) -> list[EvalSequences]:
    """Every evaluation set of the plan (or those named, see `set_readers`), as fixed sequences."""
    return [
        build_sequences(name, kind, readers, sequence_length, sequences)
        for name, kind, readers in set_readers(plan, tokens_dir, names, tokenizer_sha256)
    ]
