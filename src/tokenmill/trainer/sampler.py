"""Uniform sampling from a mixture plan: the trainer's real data source, deterministic and resumable.

`MixtureSource.from_plan(plan, phase, tokens_dir, seed, process_index, process_count).batch(step)` returns
this process's rows of global batch `step` of a phase (docs/sampler.md), `plan` being the mixture plan as
`tokenmill.formats.plan` reads it. Three layers, each a pure function:

* **Windows.** A source's cells, their shards in order, form one token stream. Window i is tokens
  [i * L, i * L + L + 1) for sequence length L: L + 1 tokens (the model reads the first L and predicts the
  last L), consecutive windows sharing one token, so that every token is predicted once per epoch and a
  source's windows are its tokens / L, the unit the planner counts in. No padding: the stream's tail that
  does not fill a window is never read. Segment ids come from end-of-text, so attention stays in a document.
* **Uniform draws inside a source.** The source's d-th draw over the whole run is window
  P_e(d mod n) of epoch e = d // n, P_e a keyed permutation of the n windows (a Feistel network with cycle
  walking) keyed by (seed, source, epoch): without replacement inside an epoch, a new order each epoch.
  Draws count on across phases, so a source that is in two phases continues its epoch rather than
  restarting it. In a slice of a bigger run the n windows are a fixed keyed subset of the source's.
* **Mixing.** Sequence s of a phase lies in mixture block s // B at position s % B (B: the plan's
  block_size). Each block holds exactly the plan's `block_sequences` of each source: position p takes
  slot P_block(p) of the block, a keyed permutation of range(B) per (seed, phase, block), and slots are
  dealt to the sources in runs of their counts. Which draw of the source the slot is follows from the
  block number and the slot, so the rows of any batch are computed without looking at any other batch.

Batch `step` is rows [step x batch_size, (step + 1) x batch_size) of the phase's sequences, this process
taking its `process_rows`. Nothing is carried from one call to the next: resuming needs only the step.
An optional block shuffle (`BlockShuffle`, off by default) trades uniformity for contiguous reads. How the
windows are read from the shards changes no batch: local shards with O_DIRECT or memory maps
(`tokenmill.trainer.windows`), shards in gs:// with ranged requests (`tokenmill.trainer.remote`), both
requested steps ahead; `PrefetchedBatches` also assembles the next batches on a helper thread.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np

from tokenmill import storage
from tokenmill.formats.plan import MixturePlan, PhasePlan, SourcePlan
from tokenmill.tokenize.shards import ShardError, TokenCatalog, TokenShards
from tokenmill.trainer.data import Batch, process_rows
from tokenmill.trainer.remote import RemoteCatalog, RemoteCell, RemoteOptions, RemoteReads, check_shards
from tokenmill.trainer.windows import DirectReads, MappedReads, WindowStream, open_reads

log = logging.getLogger(__name__)

FEISTEL_ROUNDS = 6
# Request windows this many of the process's tokens ahead, at most so many batches. Announcing to the
# page cache costs no memory of ours (64 MB of uint16 ahead); direct reads hold their staging buffers, and
# a few batches ahead keep the disk's queue full. Remote reads hold their buffers too (64 MB of uint32),
# and go further ahead: an object store's slow requests (a second, now and then) must not stall a step.
DEFAULT_READAHEAD_TOKENS = {"mmap": 32 << 20, "direct": 4 << 20, "remote": 16 << 20}
READAHEAD_MAX_BATCHES = 64
# Batches assembled ahead on a helper thread: the next one is ready when the trainer asks for it.
DEFAULT_PREFETCH_BATCHES = 2
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


# --- keyed permutations ---------------------------------------------------------------------------------


def mix64(x: np.ndarray | int) -> np.ndarray:
    """splitmix64's finalizer on uint64 words: a bijection; every output bit depends on every input bit."""
    # At least 1-D: numpy wraps uint64 products silently on arrays but warns on 0-d ones.
    z = np.array(x, dtype=np.uint64, ndmin=1)
    z ^= z >> _S30
    z *= _M1
    z ^= z >> _S27
    z *= _M2
    z ^= z >> _S31
    return z.reshape(np.shape(x))


def derive_key(*parts: int | str) -> int:
    """A 64-bit key from ints and strings (typed, so that 1 and "1" differ); the same on every machine."""
    digest = hashlib.blake2b(digest_size=8, person=b"tokenmill-sample")
    for part in parts:
        digest.update(f"{type(part).__name__}:{part}\x00".encode())
    return int.from_bytes(digest.digest(), "little")


def _bit_length(values: np.ndarray) -> np.ndarray:
    """int.bit_length of non-negative int64s (exact below 2**53; above, at worst one more: still a cover)."""
    return np.frexp(values.astype(np.float64))[1].astype(np.uint64)


def _feistel(x: np.ndarray, bits: int | np.ndarray, round_keys: list[np.ndarray]) -> np.ndarray:
    """A Feistel network on `bits`-bit words (per element, or one for all): a bijection of range(2 ** bits).

    Unbalanced when bits is odd: the word is (left, right) with right the smaller half; a round maps it
    to (right, left ^ F(right)), so the halves trade sizes every round and the word keeps its width.
    F is splitmix64's finalizer of right ^ round key, cut to the left half's width.
    """
    one = np.uint64(1)
    bits = np.asarray(bits, dtype=np.uint64)
    right_bits = bits >> one
    for key in round_keys:
        left_bits = bits - right_bits
        left, right = x >> right_bits, x & ((one << right_bits) - one)
        f = right ^ key
        f ^= f >> _S30
        f *= _M1
        f ^= f >> _S27
        f *= _M2
        f ^= f >> _S31
        x = (right << left_bits) | (left ^ (f & ((one << left_bits) - one)))
        right_bits = left_bits
    return x


def permute(
    index: np.ndarray | Sequence[int] | int,
    size: int | np.ndarray,
    key: int | np.ndarray,
    rounds: int = FEISTEL_ROUNDS,
) -> np.ndarray:
    """Position of each `index` under the keyed pseudo-random permutation of range(size).

    A Feistel network over the bits of size - 1 (at least 2) is a bijection of range(2 ** bits); cycle
    walking (apply it again while the result is >= size) restricts it to a bijection of range(size), and
    as that range is under twice size, it takes under 2 passes on average. `size` and `key` are one for
    all elements or arrays the shape of `index`: each element is permuted by its own (size, key), so one
    call serves many permutations. Returns int64 of index's shape; nothing of `size` elements is built.
    """
    shape = np.shape(index)
    x = np.array(index, dtype=np.int64, ndmin=1).reshape(-1)
    sizes = np.asarray(size, dtype=np.int64)
    if sizes.ndim:
        sizes = np.broadcast_to(sizes, shape).reshape(-1)
    if (sizes < 1).any():
        raise ValueError(f"cannot permute range({int(sizes.min())})")
    if x.size and ((x < 0).any() or (x >= sizes).any()):
        raise IndexError(f"index out of the permuted range (sizes up to {int(sizes.max())})")
    if sizes.ndim:
        bits = np.maximum(_bit_length(sizes - 1), np.uint64(2))
    else:
        bits = max(2, (int(sizes) - 1).bit_length())
    keys = np.array(key, dtype=np.uint64, ndmin=1)
    if keys.size > 1:
        keys = np.broadcast_to(keys, shape).reshape(-1)
    # Round r's function is the mix of right ^ key ^ constant_r: distinct constants keep rounds apart.
    round_keys = [keys ^ np.uint64(((r + 1) * _GOLDEN) & _MASK64) for r in range(rounds)]
    limit = sizes.astype(np.uint64)
    out = _feistel(x.astype(np.uint64), bits, round_keys)
    walking = np.flatnonzero(out >= limit)
    while walking.size:
        walk_keys = [k[walking] if k.size > 1 else k for k in round_keys]
        walk_bits = bits[walking] if sizes.ndim else bits
        out[walking] = _feistel(out[walking], walk_bits, walk_keys)
        walking = walking[out[walking] >= (limit[walking] if sizes.ndim else limit)]
    return out.astype(np.int64).reshape(shape)


def _granular_permute(index: np.ndarray, size: int, key: int | np.ndarray, granule: int) -> np.ndarray:
    """A keyed permutation of range(size) that moves runs of `granule` aligned indices together."""
    if granule <= 1:
        return permute(index, size, key)
    granules = -(-size // granule)
    out = permute(index // granule, granules, key) * granule + index % granule
    # Only the last granule can be short; its missing indices walk on to real ones.
    walking = np.flatnonzero(out >= size)
    keys = np.asarray(key, dtype=np.uint64)
    while walking.size:
        walk_key = keys[walking] if keys.ndim else keys
        out[walking] = permute(out[walking] // granule, granules, walk_key) * granule + out[walking] % granule
        walking = walking[out[walking] >= size]
    return out


@dataclass(frozen=True)
class BlockShuffle:
    """Draw windows in contiguous blocks, for storage where random small reads are slow (object stores).

    A source's windows are cut into blocks of `block_windows` consecutive windows; an epoch visits the
    blocks in a keyed random order, `buffer_blocks` at a time, and shuffles the windows of those blocks
    among themselves (as a shuffle buffer would). A reader fetches whole blocks, at the price of
    uniformity: windows drawn close together come from at most `buffer_blocks` places in the stream.
    Still a bijection per epoch: every window once per epoch.
    """

    block_windows: int = 64
    buffer_blocks: int = 16

    def __post_init__(self) -> None:
        if self.block_windows < 1 or self.buffer_blocks < 1:
            raise ValueError("BlockShuffle needs block_windows >= 1 and buffer_blocks >= 1")

    def order(self, index: np.ndarray, size: int, keys: np.ndarray) -> np.ndarray:
        """The window at each position `index` of the epoch keyed by `keys` (one per index)."""
        width = self.block_windows
        blocks = -(-size // width)
        buffer = self.buffer_blocks * width
        full_buffers = blocks // self.buffer_blocks
        last_buffer = (blocks - full_buffers * self.buffer_blocks) * width
        block_keys = mix64(keys ^ np.uint64(0x5BD1E995))

        def step(x: np.ndarray, k: np.ndarray, bk: np.ndarray) -> np.ndarray:
            # A bijection of range(blocks x width): position -> (buffer, place) -> shuffled place -> block.
            buf, place = x // buffer, x % buffer
            buffer_keys = mix64(k ^ mix64(buf.astype(np.uint64)))
            full = buf < full_buffers
            shuffled = np.empty_like(place)
            if full.any():
                shuffled[full] = permute(place[full], buffer, buffer_keys[full])
            if (~full).any():
                shuffled[~full] = permute(place[~full], last_buffer, buffer_keys[~full])
            slot = buf * self.buffer_blocks + shuffled // width
            return permute(slot, blocks, bk) * width + shuffled % width

        out = step(index, keys, block_keys)
        walking = np.flatnonzero(out >= size)
        while walking.size:
            out[walking] = step(out[walking], keys[walking], block_keys[walking])
            walking = walking[out[walking] >= size]
        return out


@dataclass
class SampledSource:
    """One source of the phase: its windows and how its draws map to them."""

    name: str
    cells: list[str]
    block_sequences: int
    draw_offset: int  # the source's draws in the phases before this one
    stream: WindowStream
    num_windows: int  # windows drawn from: all of the stream's, or a slice's fixed subset
    key: int
    subset_key: int
    block_shuffle: BlockShuffle | None = None

    def windows(self, draws: np.ndarray) -> np.ndarray:
        """The stream window of each draw (0-based, counted over the whole run)."""
        epochs = draws // self.num_windows
        keys = mix64(np.uint64(self.key) ^ mix64(epochs.astype(np.uint64)))
        place = draws % self.num_windows
        if self.block_shuffle is None:
            picked = permute(place, self.num_windows, keys)
        else:
            picked = self.block_shuffle.order(place, self.num_windows, keys)
        if self.num_windows < self.stream.num_windows:
            # A slice: the subset is the first num_windows of one fixed permutation of all windows (in
            # whole blocks under a block shuffle, to keep its reads contiguous).
            granule = self.block_shuffle.block_windows if self.block_shuffle else 1
            picked = _granular_permute(picked, self.stream.num_windows, self.subset_key, granule)
        return picked


@dataclass(frozen=True)
class Draws:
    """Where each row of a batch comes from: arrays over this process's rows."""

    rows: np.ndarray  # global row numbers in the batch
    source: np.ndarray  # index into MixtureSource.sources
    draw: np.ndarray  # the source's draw number over the run
    epoch: np.ndarray  # draw // the source's window count
    window: np.ndarray  # window number in the source's stream


def segment_ids(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """The same ids as `tokenmill.trainer.data.segments_from_eos`, about ten times faster on real text.

    0 for a row's first document, +1 after every end-of-text token. A cumulative sum over every token
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


# --- the trainer's source -------------------------------------------------------------------------------


class MixtureSource:
    """Batches of a mixture plan's phase from token shards: `batch(step)` is a pure function of the step.

    Built by `from_plan`, which checks the plan against the shards; the constructor takes the checked
    parts. `batch(step)` draws the step's rows (`draws`), requests the reads of the coming steps
    (read-ahead), and gathers the step's windows (`assemble`), all on the caller's thread but for the
    reads; `PrefetchedBatches` assembles the next batches on a helper thread as well. One caller thread
    at a time.
    """

    def __init__(
        self,
        *,
        phase: PhasePlan,
        seed: int,
        sequence_length: int,
        batch_size: int,
        block_size: int,
        rows: range,
        sources: list[SampledSource],
        eos_id: int,
        vocab_size: int,
        tokenizer_sha256: str | None,
        stream: WindowStream,
        reads: MappedReads | DirectReads | RemoteReads,
        block_shuffle: BlockShuffle | None = None,
        readahead_tokens: int | None = None,
    ) -> None:
        self.phase = phase
        self.phase_name: str = phase.name
        self.seed = int(seed)
        self.sequence_length = sequence_length
        self.batch_size = batch_size
        self.block_size = block_size
        self.rows = rows
        self.steps = phase.steps
        self.sources = sources
        self.eos_id = eos_id
        self.vocab_size = vocab_size
        self.tokenizer_sha256 = tokenizer_sha256
        self.block_shuffle = block_shuffle
        # All sources' streams end to end, so that a batch is gathered (and announced) in one pass over
        # the shards rather than one per source: source i's window w starts at _base[i] + w x L.
        self._stream = stream
        self._base = np.cumsum([0, *(src.stream.num_tokens for src in sources[:-1])]).astype(np.int64)
        # Slots [bounds[i], bounds[i + 1]) of every block belong to self.sources[i].
        self._bounds = np.cumsum([0, *(s.block_sequences for s in sources)])
        # Per source, indexed by the source of each row.
        self._per_block = np.array([s.block_sequences for s in sources], dtype=np.int64)
        self._offsets = np.array([s.draw_offset for s in sources], dtype=np.int64)
        self._windows = np.array([s.num_windows for s in sources], dtype=np.int64)
        self._full_windows = np.array([s.stream.num_windows for s in sources], dtype=np.int64)
        self._keys = np.array([s.key for s in sources], dtype=np.uint64)
        self._subset_keys = np.array([s.subset_key for s in sources], dtype=np.uint64)
        self._phase_key = derive_key(self.seed, "phase", self.phase_name)
        self.reads = reads
        self.reader: str = reads.kind
        if readahead_tokens is None:
            readahead_tokens = DEFAULT_READAHEAD_TOKENS[self.reader]
        row_tokens = len(self.rows) * (self.sequence_length + 1)
        self.readahead_batches = (
            min(READAHEAD_MAX_BATCHES, -(-readahead_tokens // row_tokens))
            if readahead_tokens > 0 and row_tokens
            else 0
        )
        # Draws of the steps requested ahead, kept for when they are asked for (they are pure, so a cache).
        self._ahead: dict[int, Draws] = {}
        self._requested = -1

    @classmethod
    def from_plan(
        cls,
        plan: MixturePlan,
        phase: str,
        tokens_dir: str,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
        *,
        block_shuffle: BlockShuffle | None = None,
        reader: str = "auto",
        readahead_tokens: int | None = None,
        remote: RemoteOptions | None = None,
        verify_shards: bool = False,
    ) -> MixtureSource:
        """The source of a plan's phase over the token shards in `tokens_dir`, checked before any batch.

        plan: the mixture plan (`plan_mixture`'s, or a plan file's read with `formats.plan.read_plan`,
        which names the field that breaks the format: it is not re-parsed here); phase: the phase's
        name; tokens_dir: the token shards (with counts.json), a local folder or gs://... ; seed: keys
        every permutation; process_index and process_count: this process's slice of each batch
        (`process_rows`). block_shuffle: None (uniform, the default) or a `BlockShuffle`. reader, for
        local shards: "auto" (direct reads where O_DIRECT works, else memory maps), "direct" or "mmap"
        (`tokenmill.trainer.windows`); shards in object storage are read with ranged requests
        (`tokenmill.trainer.remote`, set up by `remote`). readahead_tokens: how far ahead of the batch
        asked for to start reading windows, in this process's tokens (default: DEFAULT_READAHEAD_TOKENS
        of the reader), at most READAHEAD_MAX_BATCHES batches; 0 turns it off. verify_shards: check
        every shard's sha256 against its manifest first (reads all of them; in object storage each
        process checks its share). None of these changes any batch.

        Raises ValueError (ShardError for the shards) when the plan and the shards do not fit together:
        an unknown phase or cell, a source with no windows, mixed tokenizers, a shard missing or not
        the size (or with verify_shards, the sha256) its manifest says.
        """
        names = [p.name for p in plan.phases]
        if phase not in names:
            raise ValueError(f"phase {phase!r} is not in the plan (phases: {', '.join(names) or 'none'})")
        index = names.index(phase)
        sequence_length, batch_size = plan.sequence_length, plan.batch_size
        block_size = plan.block_size or batch_size
        if sequence_length < 1 or batch_size < 1 or block_size < 1:
            raise ValueError(
                f"the plan's sequence_length {sequence_length}, batch_size {batch_size} and "
                f"block_size {block_size} must be positive"
            )
        rows = process_rows(batch_size, process_index, process_count)
        in_object_storage = not storage.is_local(tokens_dir)
        if in_object_storage and reader not in ("auto", RemoteReads.kind):
            raise ValueError(
                f"reader {reader!r} reads local shards; {tokens_dir} is in object storage, read with "
                "ranged requests (reader 'auto')"
            )
        catalog: TokenCatalog | RemoteCatalog = (
            RemoteCatalog(tokens_dir) if in_object_storage else TokenCatalog(tokens_dir, verify=verify_shards)
        )
        planned_sha = plan.tokenizer_sha256
        if planned_sha and planned_sha != catalog.tokenizer_sha256:
            raise ShardError(
                f"the plan was made for tokenizer sha256 {planned_sha}, but the shards in {tokens_dir} were "
                f"made with tokenizer sha256 {catalog.tokenizer_sha256}; re-plan against their counts.json"
            )
        sources, cells, eos_id = _sampled_sources(plan, index, catalog, tokens_dir, int(seed), block_shuffle)
        whole = WindowStream(cells, sequence_length)
        reads: MappedReads | DirectReads | RemoteReads
        if in_object_storage:
            check_shards(
                [cell for cell in cells if isinstance(cell, RemoteCell)],
                verify=verify_shards,
                process_index=process_index,
                process_count=process_count,
            )
            reads = RemoteReads(whole, remote)
        else:
            reads = open_reads(whole, reader, helpers=readahead_tokens != 0)
        return cls(
            phase=plan.phases[index],
            seed=seed,
            sequence_length=sequence_length,
            batch_size=batch_size,
            block_size=block_size,
            rows=rows,
            sources=sources,
            eos_id=eos_id,
            vocab_size=catalog.tokenizer.vocab_size,
            tokenizer_sha256=catalog.tokenizer_sha256,
            stream=whole,
            reads=reads,
            block_shuffle=block_shuffle,
            readahead_tokens=readahead_tokens,
        )

    def __repr__(self) -> str:
        mix = ", ".join(f"{s.name} {s.block_sequences}/{self.block_size}" for s in self.sources)
        return (
            f"MixtureSource(phase {self.phase_name}, {self.batch_size} x {self.sequence_length + 1}, rows "
            f"{self.rows.start}..{self.rows.stop - 1}, blocks of {self.block_size}: {mix}; "
            f"{self.reader} reads)"
        )

    def draws(self, step: int) -> Draws:
        """Which source, draw and window fill each of this process's rows of batch `step`."""
        if step < 0:
            raise ValueError(f"step {step} is negative; steps count from the phase's start")
        rows = np.arange(self.rows.start, self.rows.stop, dtype=np.int64)
        sequence = step * self.batch_size + rows
        block, position = sequence // self.block_size, sequence % self.block_size
        block_keys = mix64(np.uint64(self._phase_key) ^ mix64(block.astype(np.uint64)))
        slot = permute(position, self.block_size, block_keys)
        source = np.searchsorted(self._bounds, slot, side="right") - 1
        rank = slot - self._bounds[source]
        draw = self._offsets[source] + block * self._per_block[source] + rank
        sizes = self._windows[source]
        epoch = draw // sizes
        if self.block_shuffle is None:
            # Every source at once: permute() takes a (size, key) per element. The same windows as
            # SampledSource.windows, which the block shuffle goes through.
            keys = mix64(self._keys[source] ^ mix64(epoch.astype(np.uint64)))
            window = permute(draw - epoch * sizes, sizes, keys)
            sliced = np.flatnonzero(self._full_windows[source] > sizes)
            if sliced.size:
                chosen = source[sliced]
                window[sliced] = permute(
                    window[sliced], self._full_windows[chosen], self._subset_keys[chosen]
                )
        else:
            window = np.empty_like(draw)
            for i, src in enumerate(self.sources):
                sel = np.flatnonzero(source == i)
                if sel.size:
                    window[sel] = src.windows(draw[sel])
        return Draws(rows=rows, source=source, draw=draw, epoch=epoch, window=window)

    def batch(self, step: int) -> Batch:
        """This process's rows of batch `step` (0-based within the phase): tokens and segment ids, int32."""
        where = self.advance(step)
        return self.assemble(where, self.ticket(step))

    def advance(self, step: int) -> Draws:
        """The draws of batch `step`, after requesting the reads of the next readahead_batches steps (each
        once, so that their reads overlap); a first call, a resume or a jump starts over from `step`."""
        where = self._ahead.pop(step, None) or self.draws(step)
        for old in [s for s in self._ahead if s < step]:
            del self._ahead[old]
        if not self.readahead_batches:
            return where
        if not step <= self._requested <= step + self.readahead_batches:
            self._ahead.clear()
            self.reads.cancel()
            self.reads.request(step, self._begin(where))
            self._requested = step
        while self._requested < step + self.readahead_batches:
            self._requested += 1
            self.reads.request(self._requested, self._begin(self.draws_ahead(self._requested)))
        self.reads.forget(step)
        return where

    def draws_ahead(self, step: int) -> Draws:
        """The draws of a coming step, kept until that step is asked for."""
        if step not in self._ahead:
            self._ahead[step] = self.draws(step)
        return self._ahead[step]

    def ticket(self, step: int) -> Any:
        """What `assemble` waits on for step's reads requested ahead; None when they were not."""
        return self.reads.ticket(step)

    def assemble(self, where: Draws, ticket: Any = None) -> Batch:
        """The batch of these draws: windows read from the shards, segment ids from end-of-text.

        `ticket`: the reads of these draws requested ahead (waited for here); None reads them now.
        Only reads shared data, so a helper thread may run it (`PrefetchedBatches`).
        """
        tokens = np.empty((len(where.rows), self.sequence_length + 1), dtype=np.int32)
        self.reads.gather(ticket, self._begin(where), tokens)
        return Batch(tokens=tokens, segment_ids=segment_ids(tokens, self.eos_id))

    def _begin(self, where: Draws) -> np.ndarray:
        return self._base[where.source] + where.window * self.sequence_length

    def close(self) -> None:
        """Stop the readers' helper threads (also done when the source is garbage-collected). A later
        batch() works, starting them again."""
        self.reads.close()
        self._requested = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the modules may be gone
            pass


class PrefetchedBatches:
    """A `MixtureSource` whose next `batches` batches are assembled on a helper thread while the trainer
    runs the current step: the batch asked for is usually ready. Changes no batch.

    Only the copying runs there (numpy releases the GIL in its copy loops, and page faults and waits for
    reads happen there rather than on the trainer's thread); draws are computed on the caller's thread,
    so the helper only reads shared data. After a jump (a resume, steps out of order) what was assembled
    ahead is dropped. Memory: `batches` batches of int32 tokens and segment ids.
    """

    def __init__(self, source: MixtureSource, batches: int = DEFAULT_PREFETCH_BATCHES) -> None:
        self.source = source
        self.batches = max(0, int(batches))
        self._pending: dict[int, Future[Batch]] = {}
        self._assembler: ThreadPoolExecutor | None = None

    @property
    def vocab_size(self) -> int:
        return self.source.vocab_size

    @property
    def tokenizer_sha256(self) -> str | None:
        return self.source.tokenizer_sha256

    def __repr__(self) -> str:
        return f"{self.source!r}, {self.batches} batches assembled ahead"

    def batch(self, step: int) -> Batch:
        """This process's rows of batch `step`: the same as `MixtureSource.batch(step)`."""
        pending = self._pending.pop(step, None)
        for other in [s for s in self._pending if pending is None or s < step]:
            del self._pending[other]
        where = self.source.advance(step)
        if self.batches:
            if self._assembler is None:
                self._assembler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-assemble")
            for ahead in range(step + 1, step + 1 + self.batches):
                if ahead not in self._pending:
                    self._pending[ahead] = self._assembler.submit(
                        self.source.assemble, self.source.draws_ahead(ahead), self.source.ticket(ahead)
                    )
        if pending is not None:
            return pending.result()
        return self.source.assemble(where, self.source.ticket(step))

    def close(self) -> None:
        """Stop the helper thread and the source's readers; a later batch() starts them again."""
        self._pending.clear()
        if self._assembler is not None:
            self._assembler.shutdown(wait=True)
            self._assembler = None
        self.source.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # at interpreter exit the modules may be gone
            pass


def _sampled_sources(
    plan: MixturePlan,
    index: int,
    catalog: TokenCatalog | RemoteCatalog,
    tokens_dir: str,
    seed: int,
    block_shuffle: BlockShuffle | None,
) -> tuple[list[SampledSource], list[TokenShards | RemoteCell], int]:
    """The phase's sources that it draws from, their cells end to end (the sources in order, each its
    cells in order), and the end-of-text id they share; errors name the source and cell."""
    phase = plan.phases[index]
    sequence_length, batch_size = plan.sequence_length, plan.batch_size
    block_size = plan.block_size or batch_size
    sources: list[SampledSource] = []
    every_cell: list[TokenShards | RemoteCell] = []
    eos_ids: dict[int, str] = {}
    for source, count in zip(phase.sources, _block_sequences(phase, block_size), strict=True):
        if count == 0:
            continue  # listed with weight 0, or rounded away: never drawn in this phase
        name = source.name
        total = plan.sources.get(name)
        cells = list(source.cells or (total.cells if total else []))
        if not cells:
            raise ValueError(
                f"source {name} of phase {phase.name} has no cells (a declared token count only), so "
                "it cannot be sampled; give it cells and plan against counts.json"
            )
        opened: list[TokenShards | RemoteCell] = []
        for cell in cells:
            if cell not in catalog:
                raise ValueError(
                    f"source {name}: cell {cell} is not in {storage.join(tokens_dir, 'counts.json')} "
                    "(the plan was made against other shards)"
                )
            try:
                opened.append(catalog[cell])
            except ShardError as error:
                raise ShardError(f"source {name}, cell {cell}: {error}") from error
            eos_ids.setdefault(opened[-1].eos_id, cell)
        if len(eos_ids) > 1:
            raise ShardError(f"cells disagree on the end-of-text id: {eos_ids}")
        stream = WindowStream(opened, sequence_length)
        if stream.num_windows == 0:
            raise ValueError(
                f"source {name} has {stream.num_tokens} tokens, too few for one window of "
                f"{sequence_length + 1} tokens"
            )
        sources.append(
            SampledSource(
                name=name,
                cells=cells,
                block_sequences=count,
                draw_offset=_draws_before(plan.phases[:index], name, batch_size, block_size),
                stream=stream,
                num_windows=_windows_drawn(plan, name, stream),
                key=derive_key(seed, "source", name),
                subset_key=derive_key(seed, "slice", name),
                block_shuffle=block_shuffle,
            )
        )
        every_cell.extend(opened)
        _check_tokens(source, stream, plan)
    return sources, every_cell, next(iter(eos_ids))


def _block_sequences(phase: PhasePlan, block_size: int) -> list[int]:
    """Each source's sequences per block: the plan's, or (older plans) its weights by largest remainder."""
    if not phase.sources:
        raise ValueError(f"phase {phase.name} has no sources")
    planned = [s.block_sequences for s in phase.sources]
    if all(count is not None for count in planned):
        counts = [int(count) for count in planned if count is not None]
    else:
        from tokenmill.mixtures.plan import block_counts

        counts = block_counts([s.weight for s in phase.sources], block_size)
    if sum(counts) != block_size or min(counts) < 0:
        raise ValueError(
            f"phase {phase.name}: block_sequences {counts} do not sum to the block size {block_size}"
        )
    return counts


def _draws_before(phases: Sequence[PhasePlan], name: str, batch_size: int, block_size: int) -> int:
    """How many windows the earlier phases draw from source `name`: this phase's draws continue from there."""
    total = 0
    for phase in phases:
        blocks = phase.blocks if phase.blocks is not None else phase.steps * batch_size // block_size
        counts = _block_sequences(phase, block_size)
        for source, count in zip(phase.sources, counts, strict=True):
            if source.name == name:
                total += blocks * count
    return total


def _windows_drawn(plan: MixturePlan, name: str, stream: WindowStream) -> int:
    """All the stream's windows, or in a slice of a bigger run the fixed share the plan gives the source."""
    if plan.slice is None:
        return stream.num_windows
    total = plan.sources.get(name)
    if total is not None and total.tokens_available_full:
        share = Fraction(total.tokens_available, total.tokens_available_full)
    else:
        share = Fraction(str(plan.slice.fraction))
    return max(1, min(stream.num_windows, int(stream.num_windows * share)))


def _check_tokens(source: SourcePlan, stream: WindowStream, plan: MixturePlan) -> None:
    """Warn when the plan counted other tokens than the shards hold: its epochs are then not what is drawn."""
    planned = source.tokens_available
    total = plan.sources.get(source.name)
    if plan.slice is not None and total is not None:
        planned = total.tokens_available_full
    if planned != stream.num_tokens:
        log.warning(
            "source %s: the plan counts %d tokens available, the shards hold %d; its epochs will differ "
            "from the plan's (re-plan against this counts.json)",
            source.name,
            planned,
            stream.num_tokens,
        )
