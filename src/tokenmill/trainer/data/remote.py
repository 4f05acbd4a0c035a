"""Token shards in object storage (gs://, or any fsspec filesystem): checked before training, read with
byte-range requests, the shards read over and over kept whole on local disk.

At the reference run's scale the shards live in a bucket (18T tokens of uint32 are about 72 TB), and a
host reads only its rows' windows of each batch: 128 windows of 16 KB a step on each of 88 hosts. Nothing
is copied to the hosts first:

* `RemoteCatalog` reads counts.json and the cells' manifests with `tokenmill.formats.tokens` (which
  checks the format version and every field) and checks them as `TokenCatalog` checks local ones
  (tokenizer, totals). `check_shards` then
  lists each cell's folder once and refuses a shard that is missing or not the size its manifest says,
  naming it; with `verify` each of the job's processes also hashes its share of the shards against the
  manifest's sha256. This runs when the source is built, before the trainer compiles anything.
* `RemoteReads` reads a batch's windows as ranged GETs planned by `WindowStream.staged_reads` (the
  direct reader's plan, without the O_DIRECT alignment): the pieces of one shard that lie within
  `coalesce_gap_bytes` of each other are one request, bytes between them included. Requests run on
  fsspec's event loop (gcsfs is asynchronous), `max_in_flight` at a time, in the order the batches were
  requested, so the read-ahead of coming steps keeps the pipe full; filesystems without an asynchronous
  API are read from a thread pool instead. A transient error (a reset connection, a timeout, a 5xx or
  429 that gcsfs gave up on, a body cut short) is retried with exponential backoff; after
  `attempts` the batch fails with an error naming the shard and byte range. A batch is either exactly
  the bytes of the shards or an error: never something else.
* `ShardCache` keeps whole shards on local disk, at most `cache_bytes` of them, least recently used out.
  A shard is downloaded once reading it window by window has cost as much as reading it whole would
  have (its ranged reads' bytes, plus `request_cost_bytes` for each request, reach its size: the
  break-even rule of renting against buying, never more than twice the cost of knowing the future), so
  small sources drawn many times a step end up local and the bulk of a 72 TB dataset never is. A
  download is checked against the manifest's size and sha256 before it is used; a shard whose bytes do
  not match stops the run with an error naming it.

Memory per host: the staging buffers of the batches read ahead (about `readahead_tokens` x the token
size, plus at most one gap per window when windows coalesce), and the responses in flight
(`max_in_flight` x the largest request). The cache is on disk and costs no memory of ours.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import hashlib
import logging
import os
import re
import time
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import fsspec.asyn
import numpy as np

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.formats.tokens import (
    COUNTS,
    MANIFEST,
    CellManifest,
    TokenCounts,
    TokenizerEntry,
    read_counts,
    read_manifest,
)
from tokenmill.tokenize.shards import (
    DTYPES,
    ShardChecksumError,
    ShardError,
    catalog_tokenizer,
    check_tokenizer,
)
from tokenmill.trainer.data.windows import StagedBatch, StagedReads, WindowStream

log = logging.getLogger(__name__)

#: Ranged requests in flight per process: gcsfs's HTTP session holds 100 connections.
DEFAULT_MAX_IN_FLIGHT = 64
#: Pieces of one shard at most this far apart are one request. Reading a hole costs less than a request
#: while it is shorter than time to first byte x bandwidth (Arrow's rule for its range coalescing): tens
#: of ms x 100+ MB/s per stream, a few MB on GCS. 256 KiB stays well under that, so that a small dataset,
#: where a batch's windows lie close together, is not read many times over for the sake of fewer requests.
DEFAULT_COALESCE_GAP_BYTES = 256 << 10
#: What one request costs in bytes of transfer, for the cache's break-even rule.
DEFAULT_REQUEST_COST_BYTES = 1 << 20
#: Whole-shard downloads into the cache at a time (each a stream of the shard's bytes to local disk).
DOWNLOADS_IN_FLIGHT = 2
#: Reads of cached shards, hashing of downloads and (for filesystems without an async API) the requests.
LOCAL_THREADS = 8
#: Threads hashing shards before training (`check_shards(verify=True)`).
VERIFY_THREADS = 8
_CACHED_NAME = re.compile(r"^[0-9a-f]{64}\.bin$")
_STALE_TEMPORARY_SECONDS = 24 * 3600


def default_cache_dir() -> str:
    """Where the shard cache lives unless told: token-shards/ beside `storage.local_copy`'s downloads."""
    return os.path.join(storage.cache_dir(), "token-shards")


@dataclass(frozen=True)
class RemoteOptions:
    """How shards in object storage are read. None of these changes a batch.

    cache_bytes: local disk for whole shards read repeatedly (0: no cache); cache_dir: where (default
    `default_cache_dir()`). max_in_flight: ranged requests at a time. coalesce_gap_bytes: pieces of a
    shard this close are one request. request_cost_bytes: what a request costs in bytes of transfer,
    for the cache's break-even rule. attempts, backoff_seconds: tries of a request and the first wait
    between them (doubled each time), as `tokenmill.storage` retries its reads.
    """

    cache_bytes: int = 0
    cache_dir: str | None = None
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    coalesce_gap_bytes: int = DEFAULT_COALESCE_GAP_BYTES
    request_cost_bytes: int = DEFAULT_REQUEST_COST_BYTES
    attempts: int = storage.READ_ATTEMPTS
    backoff_seconds: float = storage.READ_BACKOFF_SECONDS

    def __post_init__(self) -> None:
        if self.cache_bytes < 0 or self.max_in_flight < 1 or self.coalesce_gap_bytes < 0 or self.attempts < 1:
            raise ValueError(
                f"remote reads need cache_bytes >= 0, max_in_flight >= 1, coalesce_gap_bytes >= 0 and "
                f"attempts >= 1 (got {self.cache_bytes}, {self.max_in_flight}, {self.coalesce_gap_bytes}, "
                f"{self.attempts})"
            )


# --- the catalog, checked before training ---------------------------------------------------------------


class RemoteCell:
    """One cell's manifest in object storage, checked as `TokenShards` checks a local one (no maps)."""

    def __init__(self, path: str, expected_tokenizer_sha256: str | None = None) -> None:
        self.path = path.rstrip("/")
        manifest_path = storage.join(self.path, MANIFEST)
        try:
            self.manifest: CellManifest = read_manifest(manifest_path)
        except FileNotFoundError:
            raise ShardError(
                f"{manifest_path}: missing (not a token cell, or its tokenize run did not finish)"
            ) from None
        except FormatError as error:
            raise ShardError(str(error)) from error
        tokenizer = self.manifest.tokenizer
        check_tokenizer(tokenizer.sha256, expected_tokenizer_sha256, manifest_path, tokenizer.name)
        self.manifest_path = manifest_path
        self.cell: str = self.manifest.cell
        self.dtype: np.dtype = DTYPES[self.manifest.dtype]
        self.eos_id: int = self.manifest.eos_id
        self.tokenizer_sha256: str = tokenizer.sha256
        self.vocab_size: int = tokenizer.vocab_size
        # As JSON objects, as `TokenShards.shards`: the window readers take either kind of cell.
        self.shards: list[dict[str, Any]] = [shard.to_json() for shard in self.manifest.shards]
        self.num_tokens = sum(shard.tokens for shard in self.manifest.shards)
        self.num_documents = sum(shard.documents for shard in self.manifest.shards)
        if self.num_documents != self.manifest.documents or self.num_tokens != self.manifest.tokens:
            raise ShardError(f"{manifest_path}: cell totals do not equal the sum of its shards")

    def shard_bytes(self, shard: dict[str, Any]) -> int:
        return int(shard["tokens"]) * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"RemoteCell({self.path!r}: {self.num_tokens} tokens, {len(self.shards)} shards)"


class RemoteCatalog:
    """All cells of a tokens/ folder in object storage, through counts.json (as `TokenCatalog`)."""

    def __init__(self, tokens_dir: str, expected_tokenizer_sha256: str | None = None) -> None:
        self.path = tokens_dir.rstrip("/")
        counts_path = storage.join(self.path, COUNTS)
        try:
            self.counts: TokenCounts = read_counts(counts_path)
        except FileNotFoundError:
            raise ShardError(f"{counts_path}: missing (run `tokenmill tokenize` to the end first)") from None
        except FormatError as error:
            raise ShardError(str(error)) from error
        self.tokenizer: TokenizerEntry = catalog_tokenizer(self.counts, counts_path)
        check_tokenizer(self.tokenizer.sha256, expected_tokenizer_sha256, counts_path, self.tokenizer.name)
        self.tokenizer_sha256: str = self.tokenizer.sha256
        self._counts_path = counts_path
        self._open: dict[str, RemoteCell] = {}

    @property
    def cells(self) -> list[str]:
        return sorted(self.counts.cells)

    def __contains__(self, cell: object) -> bool:
        return cell in self.counts.cells

    def __getitem__(self, cell: str) -> RemoteCell:
        if cell not in self._open:
            if cell not in self.counts.cells:
                raise KeyError(f"{cell!r} is not in {self._counts_path}")
            entry = self.counts.cells[cell]
            manifest = storage.join(self.path, self.counts.manifest_path(cell))
            opened = RemoteCell(manifest.rsplit("/", 1)[0], expected_tokenizer_sha256=self.tokenizer_sha256)
            if opened.num_tokens != entry.tokens or opened.num_documents != entry.documents:
                raise ShardError(
                    f"{self._counts_path}: lists {entry.tokens} tokens / {entry.documents} documents "
                    f"for {cell}, but its manifest has {opened.num_tokens} / {opened.num_documents}"
                )
            self._open[cell] = opened
        return self._open[cell]


def check_shards(
    cells: list[RemoteCell], *, verify: bool = False, process_index: int = 0, process_count: int = 1
) -> int:
    """Refuse missing or wrongly sized shards (and with `verify`, shards whose sha256 differs from their
    manifest's), naming them; returns the number of shards checked.

    Sizes: one listing per cell folder (in parallel), so a cell of thousands of shards costs a few
    listing pages, not a request per shard. Checksums read every byte, so with `verify` each process
    hashes only shards i with i % process_count == process_index (72 TB over 88 hosts: about 820 GB a
    host, minutes at a few GB/s); a process that finds a bad shard fails, and with it the job.
    """
    unique = list({cell.path: cell for cell in cells}.values())
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(unique)))) as pool:
        listings = list(pool.map(_sizes_in, [cell.path for cell in unique]))
    problems = []
    shards = []
    for cell, sizes in zip(unique, listings, strict=True):
        for shard in cell.shards:
            name = shard["name"] + ".bin"
            url, expected = storage.join(cell.path, name), cell.shard_bytes(shard)
            shards.append((url, shard))
            found = sizes.get(name)
            if found is None:
                problems.append(f"{url}: missing (listed in {cell.manifest_path})")
            elif found != expected:
                problems.append(
                    f"{url}: {found} bytes, but the manifest says {shard['tokens']} x {cell.dtype.itemsize} "
                    f"= {expected} (a truncated or damaged shard)"
                )
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ShardChecksumError("; ".join(problems[:5]) + more)
    if verify:
        mine = [item for i, item in enumerate(shards) if i % process_count == process_index]
        with ThreadPoolExecutor(max_workers=VERIFY_THREADS) as pool:
            digests = pool.map(lambda item: storage.file_sha256(item[0]), mine)
            for (url, shard), digest in zip(mine, digests, strict=True):
                if digest != shard["bin_sha256"]:
                    raise ShardChecksumError(
                        f"{url}: checksum mismatch (sha256 {digest}, manifest says {shard['bin_sha256']}); "
                        "the object is corrupted: rerun `tokenmill tokenize` to rewrite it"
                    )
    return len(shards)


def _sizes_in(folder: str) -> dict[str, int]:
    """Size of every file directly in `folder`, by base name (one listing)."""
    fs, fs_path = storage.filesystem(folder)
    try:
        entries = fs.ls(fs_path.rstrip("/"), detail=True)
    except FileNotFoundError:
        return {}
    return {
        entry["name"].rstrip("/").rsplit("/", 1)[-1]: int(entry["size"])
        for entry in entries
        if entry.get("type") == "file"
    }


# --- the local cache of whole shards --------------------------------------------------------------------


class ShardCache:
    """Whole shards on local disk, at most `max_bytes`, least recently used out (see the module docstring).

    Files are named by the sha256 their manifest gives and only get that name once their bytes are
    checked against it, so a file in the folder is always a whole, correct shard, whichever run or
    process put it there: a later run on the host starts with them. Several processes may share the
    folder; each keeps it under its own `max_bytes` (a shard another one evicts is read remotely again).
    Every method runs on the reads' event loop thread, so there are no locks.
    """

    def __init__(self, directory: str, max_bytes: int, request_cost_bytes: int = DEFAULT_REQUEST_COST_BYTES):
        self.directory = directory
        self.max_bytes = int(max_bytes)
        self.request_cost_bytes = int(request_cost_bytes)
        os.makedirs(directory, exist_ok=True)
        self._files: OrderedDict[str, int] = OrderedDict()  # sha256 -> bytes, least recently used first
        self._file_bytes = 0
        self._queued: dict[str, int] = {}  # downloads waiting for a slot: nothing on disk yet
        self._active: dict[str, int] = {}  # downloads writing their temporary files
        self._cost: dict[str, int] = {}  # what the shard's ranged reads have cost so far, in bytes
        now = time.time()
        found = []
        for entry in os.scandir(directory):
            if _CACHED_NAME.match(entry.name):
                stat = entry.stat()
                found.append((stat.st_mtime, entry.name[:64], stat.st_size))
            elif entry.name.startswith(storage.TEMPORARY_PREFIX):
                # A download that a killed process left; a fresh one may be another process's, in flight.
                if now - entry.stat().st_mtime > _STALE_TEMPORARY_SECONDS:
                    _remove(entry.path)
        for _, sha, size in sorted(found):
            self._files[sha] = size
            self._file_bytes += size
        self._make_room(0)

    @property
    def used_bytes(self) -> int:
        """Bytes of the cached shards and of the downloads being written: at most max_bytes."""
        return self._file_bytes + sum(self._active.values())

    def path(self, sha256: str) -> str:
        return os.path.join(self.directory, f"{sha256}.bin")

    def lookup(self, sha256: str) -> str | None:
        """The local file of a cached shard (now the most recently used), or None."""
        if sha256 not in self._files:
            return None
        self._files.move_to_end(sha256)
        return self.path(sha256)

    def charge(self, sha256: str, size: int, read_bytes: int) -> bool:
        """Count a ranged read of `read_bytes` from a shard of `size` bytes; True when the shard should
        now be downloaded (its reads have cost as much as the whole shard, and it fits at all)."""
        if sha256 in self._files or sha256 in self._queued or sha256 in self._active or size > self.max_bytes:
            return False
        cost = self._cost.get(sha256, 0) + read_bytes + self.request_cost_bytes
        self._cost[sha256] = cost
        return cost >= size

    def reserve(self, sha256: str, size: int) -> bool:
        """Queue a download; False when the downloads already queued or running leave it no room."""
        if sum(self._queued.values()) + sum(self._active.values()) + size > self.max_bytes:
            return False
        self._queued[sha256] = size
        return True

    def begin(self, sha256: str) -> None:
        """A queued download starts writing: make room for it now, evicting the least recently used
        shards (not when it was queued, so that a download cancelled before it starts evicts nothing)."""
        size = self._queued.pop(sha256)
        self._make_room(size)
        self._active[sha256] = size

    def commit(self, sha256: str) -> None:
        size = self._active.pop(sha256)
        self._files[sha256] = size
        self._file_bytes += size
        self._cost.pop(sha256, None)

    def abandon(self, sha256: str) -> None:
        self._queued.pop(sha256, None)
        self._active.pop(sha256, None)
        self._cost.pop(sha256, None)

    def forget(self, sha256: str) -> None:
        """A cached file that vanished (another process evicted it): read remotely from now on."""
        self._file_bytes -= self._files.pop(sha256, 0)

    def _make_room(self, size: int) -> None:
        while self._files and self.used_bytes + size > self.max_bytes:
            sha, evicted = self._files.popitem(last=False)
            self._file_bytes -= evicted
            _remove(self.path(sha))


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _read_local(path: str, offset: int, target: np.ndarray) -> None:
    """Read len(target) bytes of a cached shard at `offset` into `target`."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        got = os.preadv(fd, [target], offset)
    finally:
        os.close(fd)
    if got != len(target):
        raise OSError(errno.EIO, f"{path} at byte {offset}: read {got} of {len(target)} bytes")


def _sha256_and_size(path: str) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


# --- ranged reads ---------------------------------------------------------------------------------------


class ShortRead(OSError):
    """A ranged read that returned fewer bytes than asked (a body cut short, or a shard shortened)."""


def is_transient(error: BaseException) -> bool:
    """Whether a failed request may succeed when repeated: `storage.is_transient` (any OSError but a
    missing or forbidden object: resets, timeouts, a body cut short) or what gcsfs itself retries (HTTP
    5xx, 408 and 429, aiohttp client errors) once gcsfs has given up on it."""
    if storage.is_transient(error):
        return True
    from gcsfs.retry import is_retriable  # a dependency; imported late, as gcsfs reads its config on import

    return bool(is_retriable(error))


@dataclass
class RemoteStats:
    """What the remote reads did (the bench's requests per batch; the tests' retries)."""

    batches: int = 0  # batches requested (counted on the caller's thread)
    windows: int = 0
    requests: int = 0  # ranged requests made, each counted once however often it was retried
    request_bytes: int = 0
    retries: int = 0
    cached_reads: int = 0  # reads served from the local cache instead
    downloads: int = 0  # shards downloaded whole into the cache
    download_bytes: int = 0


class RemoteReads:
    """Windows read from shards in object storage with ranged requests into a staging buffer per batch.

    A `windows.WindowReads`, like `windows.DirectReads`: a
    batch's requests start at `request` and run while earlier batches are used; `gather` waits for them
    and copies the windows out. See the module docstring for coalescing, retries and the cache.
    """

    kind = "remote"

    def __init__(self, stream: WindowStream, options: RemoteOptions | None = None) -> None:
        if stream.dtype is None:
            raise ValueError("remote reads need one token type across the shards")
        if not stream.paths:
            raise ValueError("remote reads need at least one shard")
        self.stream = stream
        self.options = options or RemoteOptions()
        self.stats = RemoteStats()
        self._fs, _ = storage.filesystem(stream.paths[0])
        self._fs_paths = [self._fs._strip_protocol(path) for path in stream.paths]
        self._async = bool(getattr(self._fs, "async_impl", False))
        self._loop: asyncio.AbstractEventLoop = self._fs.loop if self._async else fsspec.asyn.get_loop()
        self.cache: ShardCache | None = None
        if self.options.cache_bytes:
            self.cache = ShardCache(
                self.options.cache_dir or default_cache_dir(),
                self.options.cache_bytes,
                self.options.request_cost_bytes,
            )
        self._threads: ThreadPoolExecutor | None = None
        self._slots: asyncio.Semaphore | None = None  # made on the loop, on first use
        self._download_slots: asyncio.Semaphore | None = None
        self._downloads: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None  # a download whose bytes do not match the manifest
        self._staged: dict[int, StagedBatch] = {}

    def request(self, step: int, begin: np.ndarray) -> None:
        self._staged[step] = self._start(begin)

    def ticket(self, step: int) -> StagedBatch | None:
        return self._staged.get(step)

    def gather(self, ticket: StagedBatch | None, begin: np.ndarray, out: np.ndarray) -> None:
        staged = ticket if ticket is not None and not ticket.done.cancelled() else self._start(begin)
        try:
            staged.done.result()  # raises the request's error, naming the shard and byte range
        except (concurrent.futures.CancelledError, asyncio.CancelledError):
            # Dropped by a jump (cancel) while this batch was being assembled ahead: read it now.
            staged = self._start(begin)
            staged.done.result()
        self.stream.gather_staged(staged.reads, staged.buffer, out)

    def forget(self, step: int) -> None:
        for old in [s for s in self._staged if s < step]:
            del self._staged[old]

    def cancel(self) -> None:
        """Drop the batches requested ahead (after a jump): their requests not yet made are not made."""
        for staged in self._staged.values():
            staged.done.cancel()
        self._staged.clear()

    def close(self) -> None:
        """Cancel what is in flight (downloads too) and stop the threads; a later request starts again."""
        self.cancel()
        if self._downloads and self._loop.is_running():
            # Waited for, so that no download writes into the cache folder after close() (bounded: at
            # interpreter exit the loop's thread may be gone).
            cancelled = asyncio.run_coroutine_threadsafe(self._cancel_downloads(), self._loop)
            with contextlib.suppress(concurrent.futures.TimeoutError):
                cancelled.result(timeout=10)
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None

    def __repr__(self) -> str:
        cache = f", cache {self.cache.max_bytes:,} bytes in {self.cache.directory}" if self.cache else ""
        return f"RemoteReads({len(self.stream.paths)} shards, {self.options.max_in_flight} in flight{cache})"

    # --- on the caller's thread -------------------------------------------------------------------------

    def _start(self, begin: np.ndarray) -> StagedBatch:
        if self._failure is not None:
            raise self._failure
        reads = self.stream.staged_reads(
            begin, int(self.stream.dtype.itemsize), gap=self.options.coalesce_gap_bytes
        )
        buffer = np.empty(reads.buffer_bytes, dtype=np.uint8)
        self.stats.batches += 1
        self.stats.windows += len(begin)
        done = asyncio.run_coroutine_threadsafe(self._read_batch(reads, buffer), self._loop)
        return StagedBatch(reads, buffer, done)

    def _executor(self) -> ThreadPoolExecutor:
        if self._threads is None:
            workers = LOCAL_THREADS if self._async else max(LOCAL_THREADS, self.options.max_in_flight)
            self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tokenmill-remote")
        return self._threads

    # --- on the event loop ------------------------------------------------------------------------------

    async def _cancel_downloads(self) -> None:
        tasks = list(self._downloads)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _read_batch(self, reads: StagedReads, buffer: np.ndarray) -> None:
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.options.max_in_flight)
            self._download_slots = asyncio.Semaphore(DOWNLOADS_IN_FLIGHT)
        tasks = [
            asyncio.ensure_future(
                self._read_piece(
                    int(reads.path_index[i]),
                    int(reads.offsets[i]),
                    buffer[int(reads.buffer_offsets[i]) : int(reads.buffer_offsets[i] + reads.needed[i])],
                )
            )
            for i in range(len(reads.offsets))
        ]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise

    async def _read_piece(self, part: int, offset: int, target: np.ndarray) -> None:
        shard = self.stream.shards[part]
        sha = shard.get("bin_sha256")
        if self.cache is not None and sha:
            local = self.cache.lookup(sha)
            if local is not None:
                try:
                    await self._loop.run_in_executor(self._executor(), _read_local, local, offset, target)
                    self.stats.cached_reads += 1
                    return
                except FileNotFoundError:
                    self.cache.forget(sha)
            size = int(shard["tokens"]) * int(self.stream.itemsizes[part])
            if self.cache.charge(sha, size, len(target)) and self.cache.reserve(sha, size):
                task = asyncio.ensure_future(self._download(part, sha, size))
                self._downloads.add(task)
                task.add_done_callback(self._downloads.discard)
        self.stats.requests += 1
        self.stats.request_bytes += len(target)
        what = f"bytes [{offset}, {offset + len(target)})"
        await self._retrying(part, what, self._slots, self._get_range, part, offset, target)

    async def _get_range(self, part: int, offset: int, target: np.ndarray) -> None:
        path, end = self._fs_paths[part], offset + len(target)
        if self._async:
            data = await self._fs._cat_file(path, start=offset, end=end)
        else:
            call = functools.partial(self._fs.cat_file, path, start=offset, end=end)
            data = await self._loop.run_in_executor(self._executor(), call)
        if len(data) != len(target):
            raise ShortRead(
                errno.EIO,
                f"read {len(data)} of {len(target)} bytes (the object is shorter than its manifest says: "
                "a truncated shard?)",
            )
        target[:] = np.frombuffer(data, dtype=np.uint8)

    async def _retrying(self, part: int, what: str, slots: asyncio.Semaphore | None, operation, *args) -> Any:
        """Run `operation(*args)` holding one of `slots` (if any), retrying transient errors with backoff."""
        url = self.stream.paths[part]
        attempts = self.options.attempts
        for attempt in range(attempts):
            try:
                async with slots or contextlib.nullcontext():
                    return await operation(*args)
            except asyncio.CancelledError:
                raise
            except Exception as error:
                if not is_transient(error) or attempt + 1 == attempts:
                    tried = f" after {attempt + 1} attempts" if attempt else ""
                    raise OSError(f"{url} {what}: {error.__class__.__name__}: {error}{tried}") from error
                self.stats.retries += 1
                delay = self.options.backoff_seconds * 2**attempt
                log.warning(
                    "%s %s: %s: %s; retrying in %.2f s (attempt %d of %d)",
                    url,
                    what,
                    error.__class__.__name__,
                    error,
                    delay,
                    attempt + 2,
                    attempts,
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _download(self, part: int, sha: str, size: int) -> None:
        """Fetch a whole shard into the cache, checked against its manifest before it gets its name."""
        assert self.cache is not None
        url = self.stream.paths[part]
        temporary = os.path.join(self.cache.directory, f"{storage.TEMPORARY_PREFIX}{uuid.uuid4().hex}")
        try:
            async with self._download_slots:
                self.cache.begin(sha)
                await self._retrying(part, "download", None, self._get_file, part, temporary)
                digest, got = await self._loop.run_in_executor(self._executor(), _sha256_and_size, temporary)
                if got != size or digest != sha:
                    raise ShardChecksumError(
                        f"{url}: {got} bytes with sha256 {digest}, but its manifest says {size} bytes "
                        f"with sha256 {sha}: the object no longer matches its manifest (rerun `tokenmill "
                        "tokenize`)"
                    )
                os.replace(temporary, self.cache.path(sha))
                self.cache.commit(sha)
            self.stats.downloads += 1
            self.stats.download_bytes += size
        except ShardChecksumError as error:
            self.cache.abandon(sha)
            self._failure = error  # the next batch stops the run: the shard is not what was planned on
        except asyncio.CancelledError:
            self.cache.abandon(sha)
            raise
        except Exception as error:  # only the cache is lost: the windows are still read remotely
            self.cache.abandon(sha)
            log.warning("%s: not cached (%s); its windows are read with ranged requests", url, error)
        finally:
            _remove(temporary)

    async def _get_file(self, part: int, local: str) -> None:
        if self._async:
            await self._fs._get_file(self._fs_paths[part], local)
        else:
            await self._loop.run_in_executor(self._executor(), self._fs.get_file, self._fs_paths[part], local)
