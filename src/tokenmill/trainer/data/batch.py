"""The trainer's input contract: what a batch is, what a source of batches must offer, and a synthetic one.

The trainer asks a `BatchSource` for batch `step` (counted from the start of the phase) and gets this
process's rows of it. A source must be a pure function of the step: resuming from a checkpoint then needs
only the step, and every host can compute its own slice without talking to the others.

The real source is `tokenmill.trainer.data.sampler.MixtureSource` (the uniform sampler over token shards);
`SyntheticSource` here needs no data and has structure a tiny model learns in a few dozen steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np


@dataclass(frozen=True)
class Batch:
    """This process's rows of one global batch.

    tokens: int32 [rows, sequence_length + 1]; the model reads [:, :-1] and predicts [:, 1:].
    segment_ids: int32 [rows, sequence_length + 1]; equal ids mark one document. A document ends with (and
    includes)
    its end-of-text token, so the id changes just after each end-of-text. Attention never crosses ids.
    """

    tokens: np.ndarray
    segment_ids: np.ndarray

    def __post_init__(self) -> None:
        if self.tokens.shape != self.segment_ids.shape or self.tokens.ndim != 2:
            raise ValueError(
                f"tokens {self.tokens.shape} and segment_ids {self.segment_ids.shape} "
                "must be 2-D and of equal shape"
            )


@runtime_checkable
class BatchSource(Protocol):
    """Anything the trainer can train on.

    vocab_size: the tokenizer's vocabulary size (the trainer refuses a model with a smaller one).
    tokenizer_sha256: sha256 of the tokenizer.json the tokens were made with, or None when there is none.
    batch(step): this process's Batch for step `step` of the phase (0-based), a pure function of the step.
    """

    vocab_size: int
    tokenizer_sha256: str | None

    def batch(self, step: int) -> Batch: ...


def segments_from_eos(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """Segment ids for packed rows [rows, width]: 0 for a row's first document, +1 after every end-of-text.

    A cumulative sum over every token
    costs a few ns each (a chain of dependent adds); documents are hundreds of tokens long, so instead the
    runs between end-of-text tokens are found and each filled with its id (np.repeat). Rows that are
    mostly end-of-text, where runs are short, take the cumulative sum.
    """
    rows, width = tokens.shape
    is_eos = tokens.reshape(-1) == eos_id
    cuts = np.flatnonzero(is_eos) + 1
    if cuts.size * 16 > tokens.size:
        eos = is_eos.reshape(rows, width)
        return np.cumsum(eos, axis=1, dtype=np.int32) - eos
    # Flat positions where a run starts: every row's start, and after each end-of-text but a row's last.
    cuts = cuts[cuts % width != 0]
    starts = np.sort(np.concatenate([np.arange(0, rows * width, width), cuts]))
    run = np.arange(len(starts))
    first_of_row = np.maximum.accumulate(np.where(starts % width == 0, run, 0))
    lengths = np.diff(np.append(starts, rows * width))
    return np.repeat((run - first_of_row).astype(np.int32), lengths).reshape(rows, width)


def process_rows(global_batch: int, process_index: int, process_count: int) -> range:
    """The rows of the global batch that one process loads (contiguous, equal slices)."""
    if global_batch % process_count:
        raise ValueError(f"batch size {global_batch} is not divisible by {process_count} processes")
    per = global_batch // process_count
    return range(process_index * per, (process_index + 1) * per)


class SyntheticSource:
    """Packed documents from a fixed random Markov chain: learnable, deterministic in (seed, step).

    Every token has `branching` possible successors (one table for all steps and seeds, so what is learnt
    carries over), and documents of random length end with end-of-text. A model that learns the table
    reaches a loss of about ln(branching); a uniform guess over the vocabulary is ln(vocab_size).
    Only the first `active_vocab` ids occur, so a tiny model learns the chain in tens of steps even when
    its vocabulary is large.
    """

    tokenizer_sha256: str | None = None

    def __init__(
        self,
        vocab_size: int,
        sequence_length: int,
        batch_size: int,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        eos_id: int = 0,
        branching: int = 4,
        active_vocab: int = 256,
        mean_document_length: int = 48,
    ) -> None:
        self.vocab_size = vocab_size
        self.sequence_length = sequence_length
        self.batch_size = batch_size
        self.seed = seed
        self.eos_id = eos_id
        self.mean_document_length = mean_document_length
        self.rows = process_rows(batch_size, process_index, process_count)
        self.active_vocab = max(2, min(active_vocab, vocab_size))
        table_rng = np.random.default_rng(1234)
        # Successors never include end-of-text; documents end by length instead.
        choices = np.array([t for t in range(self.active_vocab) if t != eos_id])
        self.successors = table_rng.choice(choices, size=(self.active_vocab, branching))
        self.first_tokens = choices

    def batch(self, step: int) -> Batch:
        rows = [self._row(step, row) for row in self.rows]
        tokens = np.stack(rows).astype(np.int32)
        return Batch(tokens=tokens, segment_ids=segments_from_eos(tokens, self.eos_id))

    def _row(self, step: int, row: int) -> np.ndarray:
        # One generator per (seed, step, global row): the same row whichever process draws it.
        rng = np.random.default_rng([self.seed, step, row])
        length = self.sequence_length + 1
        picks = rng.integers(0, self.successors.shape[1], size=length)
        # Each position ends a document with probability 1/mean length.
        ends = rng.random(length) < 1.0 / self.mean_document_length
        out = np.empty(length, np.int64)
        current = rng.choice(self.first_tokens)
        for i in range(length):
            if ends[i]:
                out[i] = self.eos_id
                current = rng.choice(self.first_tokens)
                continue
            out[i] = current
            current = self.successors[current, picks[i]]
        return out


def check_source(source: BatchSource, model_vocab_size: int, expected_tokenizer_sha256: str | None) -> None:
    """Fail fast, before compiling anything, on data the model cannot train on. Raises ValueError."""
    if expected_tokenizer_sha256 and source.tokenizer_sha256 != expected_tokenizer_sha256:
        raise ValueError(
            f"token shards were made with tokenizer sha256 {source.tokenizer_sha256}, but the mixture names "
            f"tokenizer sha256 {expected_tokenizer_sha256}; re-tokenize or fix the mixture's tokenizer"
        )
    if source.vocab_size > model_vocab_size:
        raise ValueError(
            f"the tokenizer's vocabulary ({source.vocab_size}) is larger than the model's "
            f"vocab_size ({model_vocab_size}); token ids past the embedding table would be silently clamped"
        )
