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
(data/windows.py), shards in gs:// with ranged requests (data/remote.py), both
requested steps ahead; `PrefetchedBatches` also assembles the next batches on a helper thread.
"""

from __future__ import annotations

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
from tokenmill.trainer.data.batch import Batch, process_rows, segments_from_eos
from tokenmill.trainer.data.permutations import BlockShuffle, derive_key, granular_permute, mix64, permute
from tokenmill.trainer.data.remote import RemoteCatalog, RemoteCell, RemoteOptions, RemoteReads, check_shards
from tokenmill.trainer.data.windows import WindowReads, WindowStream, open_reads

log = logging.getLogger(__name__)

# Request windows this many of the process's tokens ahead, at most so many batches. Announcing to the
# page cache costs no memory of ours (64 MB of uint16 ahead); direct reads hold their staging buffers, and
# a few batches ahead keep the disk's queue full. Remote reads hold their buffers too (64 MB of uint32),
# and go further ahead: an object store's slow requests (a second, now and then) must not stall a step.
DEFAULT_READAHEAD_TOKENS = {"mmap": 32 << 20, "direct": 4 << 20, "remote": 16 << 20}
READAHEAD_MAX_BATCHES = 64
# Batches assembled ahead on a helper thread: the next one is ready when the trainer asks for it.
DEFAULT_PREFETCH_BATCHES = 2


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
            picked = granular_permute(picked, self.stream.num_windows, self.subset_key, granule)
        return picked


@dataclass(frozen=True)
class Draws:
    """Where each row of a batch comes from: arrays over this process's rows."""

    rows: np.ndarray  # global row numbers in the batch
    source: np.ndarray  # index into MixtureSource.sources
    draw: np.ndarray  # the source's draw number over the run
    epoch: np.ndarray  # draw // the source's window count
    window: np.ndarray  # window number in the source's stream


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
        reads: WindowReads,
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
        (`tokenmill.trainer.data.windows`); shards in object storage are read with ranged requests
        (`tokenmill.trainer.data.remote`, set up by `remote`). readahead_tokens: how far ahead of the batch
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
        reads: WindowReads
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
        return Batch(tokens=tokens, segment_ids=segments_from_eos(tokens, self.eos_id))

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
