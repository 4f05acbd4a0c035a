"""A source's token stream cut into windows, and the two ways of reading windows from the shards.

`WindowStream` lays cells' shards end to end and cuts the stream into windows of L + 1 tokens at stride L
(docs/sampler.md). A batch's windows are read one of two ways, both giving the same tokens:

* `DirectReads` (the default where the system allows it): each batch's windows are read with O_DIRECT
  into a staging buffer through Linux native AIO (`direct_io.DirectReader`), many reads in flight from
  one helper thread, then copied out as int32. Random windows from data larger than memory are read at
  the disk's random-read limit, and the page cache is left alone.
* `MappedReads`: gathered from the shards' memory maps, the windows of coming batches announced to the
  kernel ahead (`posix_fadvise(WILLNEED)`, on an `Announcer` thread) so that their reads overlap. Used
  where O_DIRECT is refused (some FUSE filesystems, tmpfs before Linux 6.6, other systems) or asked for.

Shards in object storage (gs://) are read by a third, `tokenmill.trainer.data.remote.RemoteReads`: ranged
requests planned by the same `staged_reads`, many in flight.

A reads object (`WindowReads`) serves one `MixtureSource`; none keeps a batch's data longer than until it
is gathered.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tokenmill import storage
from tokenmill.tokenize.shards import TokenShards
from tokenmill.trainer.data.direct_io import PAGE, DirectIOUnavailable, DirectReader, aligned_buffer

log = logging.getLogger(__name__)

READERS = ("auto", "direct", "mmap")


class ShardCell(Protocol):
    """What a stream needs of a cell: its folder, its shards (manifest entries) and their token type.
    `TokenShards` (local, memory-mapped) and `tokenmill.trainer.data.remote.RemoteCell` (object storage)."""

    path: str
    shards: list[dict[str, Any]]
    dtype: np.dtype


class WindowStream:
    """Cells' shards as one token stream cut into windows of L + 1 tokens at stride L (no padding).

    From the memory maps, `gather_at` copies the windows inside one shard with a single fancy index over
    a sliding-window view of the shard (C speed, no per-window Python), the few that span two shards
    piece by piece; `byte_ranges_at` names their bytes for `advise`. For direct and remote reads,
    `staged_reads` plans the reads that bring windows into a staging buffer and `gather_staged` copies
    them out. Cells in object storage have no memory maps: their stream has `paths` but no `parts`.
    """

    def __init__(self, cells: Sequence[ShardCell], sequence_length: int) -> None:
        if sequence_length < 1:
            raise ValueError(f"sequence length {sequence_length} must be positive")
        self.sequence_length = sequence_length
        self.width = sequence_length + 1
        self.parts: list[np.ndarray] = []  # memory-map views, local cells only
        self.paths: list[str] = []
        self.shards: list[dict[str, Any]] = []  # each path's manifest entry (tokens, sha256)
        itemsizes = []
        starts = [0]
        dtypes = set()
        for cell in cells:
            offset = 0
            for shard in cell.shards:
                tokens = int(shard["tokens"])
                if tokens:
                    if isinstance(cell, TokenShards):
                        # A view of the shard's memory map (no copy): tokens() stays inside one shard here.
                        self.parts.append(cell.tokens(offset, offset + tokens))
                    self.paths.append(storage.join(cell.path, shard["name"] + ".bin"))
                    self.shards.append(shard)
                    itemsizes.append(cell.dtype.itemsize)
                    dtypes.add(cell.dtype)
                    starts.append(starts[-1] + tokens)
                offset += tokens
        self.starts = np.array(starts, dtype=np.int64)
        self.itemsizes = np.array(itemsizes, dtype=np.int64)
        self.num_tokens = int(self.starts[-1])
        self.num_windows = max(0, (self.num_tokens - 1) // sequence_length)
        self._views = [
            np.lib.stride_tricks.sliding_window_view(part, self.width) if len(part) >= self.width else None
            for part in self.parts
        ]
        # Staged (direct, remote) reads copy out of one buffer, so they need one token type across shards.
        self.dtype: np.dtype | None = dtypes.pop() if len(dtypes) == 1 else None

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of the stream, across shard boundaries."""
        pieces = [self.parts[part][first : first + count] for part, first, count in self.pieces(start, stop)]
        return np.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Tokens [start, stop) of the stream as (shard, first token in it, tokens), shard by shard."""
        pieces = []
        part = int(np.searchsorted(self.starts, start, side="right")) - 1
        while start < stop:
            end = min(stop, int(self.starts[part + 1]))
            pieces.append((part, start - int(self.starts[part]), end - start))
            start, part = end, part + 1
        return pieces

    def byte_ranges(self, windows: np.ndarray) -> list[tuple[str, list[int], list[int]]]:
        """The windows' bytes as (shard file, starts, stops): sorted, overlapping and adjacent ones merged."""
        return self.byte_ranges_at(np.asarray(windows, dtype=np.int64) * self.sequence_length)

    def byte_ranges_at(self, begin: np.ndarray) -> list[tuple[str, list[int], list[int]]]:
        """byte_ranges of the L + 1 tokens from each stream offset in `begin`."""
        if not len(begin):
            return []
        begin = np.sort(begin)
        end = begin + self.width
        first = np.searchsorted(self.starts, begin, side="right") - 1
        last = np.searchsorted(self.starts, end - 1, side="right") - 1
        ranges = []
        for part in np.unique(np.concatenate([first, last])).tolist():
            keep = (first <= part) & (last >= part)
            itemsize = int(self.itemsizes[part])
            lo = (np.maximum(begin[keep], self.starts[part]) - self.starts[part]) * itemsize
            hi = (np.minimum(end[keep], self.starts[part + 1]) - self.starts[part]) * itemsize
            # Sorted by start: a range opens a new one where it starts past every earlier range's end.
            reach = np.maximum.accumulate(hi)
            opens = np.concatenate([[True], lo[1:] > reach[:-1]])
            stops = reach[np.concatenate([np.flatnonzero(opens)[1:] - 1, [len(lo) - 1]])]
            ranges.append((self.paths[part], lo[opens].tolist(), stops.tolist()))
        return ranges

    def gather(self, windows: np.ndarray, out: np.ndarray, rows: np.ndarray) -> None:
        """Write window windows[i] into out[rows[i]] (out: [n, L + 1], any integer dtype)."""
        self.gather_at(np.asarray(windows, dtype=np.int64) * self.sequence_length, out, rows)

    def gather_at(self, begin: np.ndarray, out: np.ndarray, rows: np.ndarray) -> None:
        """Write the L + 1 tokens from stream offset begin[i] into out[rows[i]]."""
        # In stream order: the memory maps are then read forward, which the kernel's readahead likes.
        order = np.argsort(begin, kind="stable")
        begin, rows = begin[order], np.asarray(rows)[order]
        part = np.searchsorted(self.starts, begin, side="right") - 1
        local = begin - self.starts[part]
        inside = local + self.width <= self.starts[part + 1] - self.starts[part]
        within = np.flatnonzero(inside)
        if within.size:
            # `part` is sorted, so each shard's windows are one run.
            parts, firsts = np.unique(part[within], return_index=True)
            bounds = [*firsts.tolist(), within.size]
            for p, lo, hi in zip(parts.tolist(), bounds[:-1], bounds[1:], strict=True):
                sel = within[lo:hi]
                out[rows[sel]] = self._views[p][local[sel]]
        for i in np.flatnonzero(~inside).tolist():
            out[rows[i]] = self.read(int(begin[i]), int(begin[i]) + self.width)

    def staged_reads(self, begin: np.ndarray, align: int, gap: int = 0) -> StagedReads:
        """The reads that bring the windows at stream offsets `begin` into one staging buffer.

        Each window's bytes (a window that spans two shards: its piece in each), widened to `align` (the
        device's block for O_DIRECT), in stream order; pieces of one shard whose widened ranges touch,
        overlap (neighbours, repeats, block-shuffled runs) or lie at most `gap` bytes apart share one
        read, the bytes between them read too (a remote request costs more than a few hundred KB more of
        transfer). Reads never span two shards.
        """
        if self.dtype is None:
            raise ValueError("staged reads need one token type across the shards")
        begin = np.asarray(begin, dtype=np.int64)
        itemsize = self.dtype.itemsize
        part = np.searchsorted(self.starts, begin, side="right") - 1
        local = begin - self.starts[part]
        inside = local + self.width <= self.starts[part + 1] - self.starts[part]
        # Pieces: (shard, first token in it, tokens, window). One per window, a few for the rare window
        # that spans shards (one per shard boundary in the whole stream).
        rows = np.flatnonzero(inside)
        piece_part, piece_local, piece_count = part[rows], local[rows], np.full(rows.size, self.width)
        piece_row = rows
        spanning = np.flatnonzero(~inside)
        if spanning.size:
            extra = [
                (*piece, i)
                for i in spanning.tolist()
                for piece in self.pieces(int(begin[i]), int(begin[i]) + self.width)
            ]
            extra_part, extra_local, extra_count, extra_row = np.array(extra, dtype=np.int64).T
            piece_part = np.concatenate([piece_part, extra_part])
            piece_local = np.concatenate([piece_local, extra_local])
            piece_count = np.concatenate([piece_count, extra_count])
            piece_row = np.concatenate([piece_row, extra_row])
        order = np.lexsort((piece_local, piece_part))
        piece_part, piece_local = piece_part[order], piece_local[order]
        piece_count, piece_row = piece_count[order], piece_row[order]
        row_offsets = np.full(len(begin), -1, dtype=np.int64)
        if not order.size:
            empty = np.zeros(0, dtype=np.int64)
            return StagedReads(empty, empty, empty, empty, empty, 0, row_offsets, {})
        # Byte positions on one axis for all shards: each shard's bytes from `base`, shards more than
        # align + gap apart, so that ranges of two shards never merge.
        sizes = np.diff(self.starts) * itemsize
        spacing = -(-sizes // align) * align + align + -(-gap // align) * align
        base = np.concatenate([[0], np.cumsum(spacing)[:-1]])
        lo = base[piece_part] + piece_local * itemsize
        hi = lo + piece_count * itemsize
        first_byte = lo // align * align  # base is a multiple of align
        last_byte = -(-hi // align) * align
        reach = np.maximum.accumulate(last_byte)
        opens = np.concatenate([[True], first_byte[1:] > reach[:-1] + gap])
        firsts = np.flatnonzero(opens)
        lasts = np.concatenate([firsts[1:] - 1, [len(lo) - 1]])
        run = np.cumsum(opens) - 1
        run_start = first_byte[firsts]
        run_bytes = reach[lasts] - run_start
        needed = np.maximum.reduceat(hi, firsts) - run_start
        run_part = piece_part[firsts]
        buffer_offsets = np.concatenate([[0], np.cumsum(-(-run_bytes // PAGE) * PAGE)])
        position = (buffer_offsets[run] + lo - run_start[run]) // itemsize
        whole = piece_count == self.width
        row_offsets[piece_row[whole]] = position[whole]
        pieces: dict[int, list[tuple[int, int]]] = {}
        for i in np.flatnonzero(~whole).tolist():  # in stream order, so a window's pieces are in order
            pieces.setdefault(int(piece_row[i]), []).append((int(position[i]), int(piece_count[i])))
        return StagedReads(
            path_index=run_part,
            offsets=run_start - base[run_part],
            sizes=run_bytes,
            needed=needed,
            buffer_offsets=buffer_offsets[:-1],
            buffer_bytes=int(buffer_offsets[-1]),
            row_offsets=row_offsets,
            pieces=pieces,
        )

    def gather_staged(self, reads: StagedReads, buffer: np.ndarray, out: np.ndarray) -> None:
        """Fill out[i] with the i-th window of `staged_reads` from the staging buffer its reads landed in."""
        staged = buffer[: reads.buffer_bytes].view(self.dtype)
        whole = np.flatnonzero(reads.row_offsets >= 0)
        if whole.size:
            view = np.lib.stride_tricks.sliding_window_view(staged, self.width)
            out[whole] = view[reads.row_offsets[whole]]
        for row, pieces in reads.pieces.items():
            out[row] = np.concatenate([staged[at : at + count] for at, count in pieces])


@dataclass(frozen=True)
class StagedReads:
    """WindowStream.staged_reads: reads of shard bytes into a staging buffer, and where each window lands."""

    path_index: np.ndarray  # per read: the shard, an index into WindowStream.paths
    offsets: np.ndarray  # per read: byte offset in the shard (aligned)
    sizes: np.ndarray  # per read: bytes asked for (aligned; may run past the shard's end)
    needed: np.ndarray  # per read: bytes it must return (up to the end of its last window)
    buffer_offsets: np.ndarray  # per read: where it lands in the staging buffer (page multiples)
    buffer_bytes: int
    row_offsets: np.ndarray  # per window: its first token's index in the staging buffer, -1 if in pieces
    pieces: dict[int, list[tuple[int, int]]]  # windows that span shards: (token index, tokens) per piece


def advise(ranges: list[tuple[str, list[int], list[int]]]) -> int:
    """Ask the kernel to start reading these byte ranges into the page cache (posix_fadvise WILLNEED).

    Returns the number of ranges announced. It does not wait for the reads (though it can wait for room
    in the disk's queue). Errors are ignored: it is only a hint, and gather() reads the pages either way.
    `MappedReads` calls it through an `Announcer`, on a helper thread.
    """
    announced = 0
    for path, starts, stops in ranges:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            for start, stop in zip(starts, stops, strict=True):
                os.posix_fadvise(fd, start, stop - start, os.POSIX_FADV_WILLNEED)
                announced += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return announced


class Announcer:
    """Announces batches' byte ranges (`advise`) on one helper thread, step after step in the given order.

    posix_fadvise(WILLNEED) queues its reads without waiting for them, but waits for room in the disk's
    queue once that is full. Called on the caller's thread, announcing a batch far ahead therefore held
    the batch asked for until the disk had finished nearly everything announced before: a cold run read
    the read-ahead distance more than it used, all before returning. Here the caller only hands the
    ranges over. Batches are gathered only once their own announcement is made (the `future` is the
    batch's ticket): a page faulted in before its read is queued makes the kernel read around it (the
    disk's read-ahead, megabytes) instead of the window. One thread is enough: a single announcing thread
    keeps the disk's queue full (more threads, or blocking reads from 16-128 threads, read no faster on
    the development machine's disk; see docs/sampler.md, "Speed").
    """

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._announced: dict[int, Future[int]] = {}

    def submit(self, step: int, ranges: list[tuple[str, list[int], list[int]]]) -> None:
        """Announce step's ranges after all submitted before (the helper thread starts on first use)."""
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenmill-announce")
        self._announced[step] = self._executor.submit(advise, ranges)

    def future(self, step: int) -> Future[int] | None:
        """Done when step's reads are queued; None when it was never announced (or is forgotten)."""
        return self._announced.get(step)

    def wait(self, step: int) -> None:
        """Return once step's announcement is made (at once when it was never submitted or was cancelled)."""
        announced = self._announced.get(step)
        if announced is not None:
            wait([announced])

    def forget(self, step: int) -> None:
        """Drop the bookkeeping of steps before `step`."""
        for old in [s for s in self._announced if s < step]:
            del self._announced[old]

    def cancel(self) -> None:
        """Drop every announcement not started yet (after a jump they are no longer wanted)."""
        for announced in self._announced.values():
            announced.cancel()
        self._announced.clear()

    def close(self) -> None:
        """Cancel what is queued and stop the helper thread (a later submit starts a new one)."""
        self.cancel()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


# --- the two ways of reading a batch's windows ----------------------------------------------------------


class MappedReads:
    """Windows gathered from the memory maps; batches requested ahead are announced to the kernel first.

    A batch is gathered only once its own announcement is made (see `Announcer`). Without `announce`,
    `request` does nothing and every window is read by page faults on the gathering thread.
    """

    kind = "mmap"

    def __init__(self, stream: WindowStream, *, announce: bool = True) -> None:
        self.stream = stream
        self._announce = announce
        self._announcer = Announcer()

    def request(self, step: int, begin: np.ndarray) -> None:
        if self._announce:
            self._announcer.submit(step, self.stream.byte_ranges_at(begin))

    def ticket(self, step: int) -> Future[int] | None:
        return self._announcer.future(step)

    def gather(self, ticket: Future[int] | None, begin: np.ndarray, out: np.ndarray) -> None:
        if ticket is not None:
            wait([ticket])
        self.stream.gather_at(begin, out, np.arange(len(begin)))

    def forget(self, step: int) -> None:
        self._announcer.forget(step)

    def cancel(self) -> None:
        self._announcer.cancel()

    def close(self) -> None:
        self._announcer.close()


@dataclass
class StagedBatch:
    """One batch's staged (direct or remote) reads in flight: the plan, the buffer they fill, and the
    future that completes when every read has landed (its error names the shard and byte range)."""

    reads: StagedReads
    buffer: np.ndarray
    done: Future[None]


class WindowReads(Protocol):
    """What a `MixtureSource` reads windows through: `MappedReads`, `DirectReads` or
    `tokenmill.trainer.data.remote.RemoteReads`. `request(step, begin)` starts reading a batch's windows
    (stream offsets `begin`), `ticket(step)` is what the assembler waits on (None: nothing requested),
    `gather(ticket, begin, out)` fills the batch, `forget(step)` drops what is kept for earlier steps,
    `cancel()` drops what was requested ahead (after a jump), `close()` stops the helpers."""

    kind: str

    def request(self, step: int, begin: np.ndarray) -> None: ...

    def ticket(self, step: int) -> Any: ...

    def gather(self, ticket: Any, begin: np.ndarray, out: np.ndarray) -> None: ...

    def forget(self, step: int) -> None: ...

    def cancel(self) -> None: ...

    def close(self) -> None: ...


class DirectReads:
    """Windows read with O_DIRECT into a staging buffer per batch (`DirectReader`), then copied out.

    `request` hands a batch's reads to the reader at once (they run while earlier batches are used);
    `gather` waits for them. A batch never requested is read when it is gathered. The staging buffer
    (the windows' bytes, widened to the device's alignment) lives from `request` to `gather`.
    """

    kind = "direct"

    def __init__(self, stream: WindowStream, *, helpers: bool = True) -> None:
        if stream.dtype is None:
            raise DirectIOUnavailable("the shards mix token types")
        self.stream = stream
        self._helpers = helpers
        self._reader: DirectReader | None = None
        self._staged: dict[int, StagedBatch] = {}
        self._open()  # a system or filesystem that refuses O_DIRECT says so here, not mid-run

    def _open(self) -> DirectReader:
        if self._reader is None:
            reader = DirectReader(thread=self._helpers)
            try:
                for path in self.stream.paths:
                    reader.open(path)
            except BaseException:
                reader.close()
                raise
            self._reader = reader
        return self._reader

    def request(self, step: int, begin: np.ndarray) -> None:
        self._staged[step] = self._start(begin)

    def ticket(self, step: int) -> StagedBatch | None:
        return self._staged.get(step)

    def gather(self, ticket: StagedBatch | None, begin: np.ndarray, out: np.ndarray) -> None:
        staged = ticket if ticket is not None else self._start(begin)
        staged.done.result()  # raises the read's OSError, naming the shard and offset
        self.stream.gather_staged(staged.reads, staged.buffer, out)

    def forget(self, step: int) -> None:
        for old in [s for s in self._staged if s < step]:
            del self._staged[old]

    def cancel(self) -> None:
        # Reads in flight finish into buffers the reader holds until then; their results are dropped.
        self._staged.clear()

    def close(self) -> None:
        """Wait for the reads in flight and stop the helper thread (a later read starts a new one)."""
        self._staged.clear()
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _start(self, begin: np.ndarray) -> StagedBatch:
        reader = self._open()
        reads = self.stream.staged_reads(begin, reader.align)
        buffer = aligned_buffer(max(reads.buffer_bytes, PAGE))
        done = reader.submit(
            self.stream.paths,
            reads.path_index,
            reads.offsets,
            reads.sizes,
            buffer,
            reads.buffer_offsets,
            reads.needed,
        )
        return StagedBatch(reads, buffer, done)


def open_reads(stream: WindowStream, reader: str, *, helpers: bool) -> WindowReads:
    """The reads object for `reader` ("auto", "direct" or "mmap"); with `helpers` false, no helper thread.

    "auto" takes direct reads where the system and the shards' filesystem allow them, else memory maps
    (and logs why); "direct" raises DirectIOUnavailable instead.
    """
    if reader not in READERS:
        raise ValueError(f"reader {reader!r}: expected one of {', '.join(READERS)}")
    if reader in ("auto", "direct"):
        try:
            return DirectReads(stream, helpers=helpers)
        except DirectIOUnavailable as error:
            if reader == "direct":
                raise
            log.info("reading windows through memory maps: direct reads are unavailable (%s)", error)
    return MappedReads(stream, announce=helpers)
