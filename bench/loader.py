"""Bench: tokens per second of the uniform sampler against a sequential read of the same memory maps.

Builds a token directory (three cells of random ids with end-of-text every ~500 tokens, written as the
tokenize stage writes them, manifests and counts.json by its own functions), plans a three-source mixture
over it with the real planner, and times `MixtureSource.batch(step)` (tokens and segment ids, int32, one
process) against the I/O limit: the same number of tokens read front to back from the same memory maps
into an int32 buffer, in batch-sized pieces. Defaults: 384Mi tokens (768 MB), sequences of 4,096, 256
rows a step (1M tokens: one host's share of a big batch).

* cold: the shard files are dropped from the page cache first (fsync + posix_fadvise DONTNEED, on these
  files only, nothing else on the machine; with every memory map of them closed, as the kernel keeps
  mapped pages), then `--cold-tokens` are loaded; each side is timed from cold `--repeats` times,
  alternating, and the medians compared. Sides: the sampler as the trainer gets it (`reader="auto"`:
  direct reads where the system allows them; read-ahead and a prefetch thread), the same on the
  caller's thread alone, the sampler through memory maps (`reader="mmap"`), the sampler with the block
  shuffle, and the sequential read. For reference, the disk's random-read ceiling: the same windows'
  reads handed to a `DirectReader` all at once, with no sampling work (what no sampler can beat).
* warm: every page is in memory; `--warm-seconds` of batches, on the caller's thread alone (the one-core
  target) and as the trainer gets it, for both readers (direct reads do not use the page cache, so
  their warm rate is their cold one).
* remote: a smaller token directory (`--remote-tokens`, default 48Mi) uploaded to a GCS emulator on
  loopback (gcp-storage-emulator, the tests' emulator, started here) and read as gs:// shards with
  ranged requests (`tokenmill.trainer.data.remote`), `--remote-steps` batches from step 0 (read-ahead starting
  cold, as a run starts), against the local reader on the same directory and steps: tokens/s, and
  requests (local: O_DIRECT reads) per batch. Sides: the defaults (256 KiB coalescing gap), no
  coalescing, the block shuffle, and a local cache large enough for every shard. The emulator serves one
  request at a time from a single Python thread (about 0.3-0.7 ms each), so its tokens/s say more about
  the emulator than about GCS; requests per batch, and what a reference host needs (docs/sampler.md,
  "Shards in object storage"), carry over. Skipped (with a note) when the emulator is not installed.

Numbers depend on the disk and on whatever else runs. Run it niced.

The last line is `loader ratio=X.XX target=0.5 baseline=sequential_memmap_read`: cold sampler tokens/s
over cold sequential tokens/s. The line before it gives warm tokens/s against the 10M target. With
`--sections remote` alone it is `loader_remote ratio=X.XX target=1.0 baseline=reference_host_at_1s_step`:
remote tokens/s over what one host of the reference run needs at a step a second (128 rows of 4,097).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenmill.formats.plan import MixturePlan

WARM_TARGET = 10e6
COLD_TARGET = 0.5
# The reference run: 11,264 sequences of 4,096 tokens a step over 88 hosts of 8 devices: 128 rows a host.
REFERENCE_HOST_ROWS = 11_264 // 88
REMOTE_TARGET = 1.0
SECTIONS = {"cold", "warm", "remote"}
# The sampler on the caller's thread alone: no read-ahead, no batches assembled ahead.
HELPERS_OFF = {"readahead_tokens": 0, "prefetch_batches": 0}
EOS = 0
VOCAB = 50_000
SHARD_TOKENS = 64 << 20  # tokens per shard file (128 MB of uint16)
CELLS = {"domain=web/quality=3": 0.6, "domain=code/quality=2": 0.25, "domain=math/quality=1": 0.15}


def build_tokens(root: Path, total_tokens: int) -> None:
    """Cells of random token ids in shards of SHARD_TOKENS, through the writer's manifest and counts code."""
    from tokenmill.tokenize.tokenizer import TokenizerInfo
    from tokenmill.tokenize.writer import write_counts, write_manifest, write_shard

    info = TokenizerInfo(name="bench-bpe", sha256="b" * 64, vocab_size=VOCAB, eos_id=EOS, eos_token="<eos>")
    rng = np.random.default_rng(0)
    summaries = []
    for cell, share in CELLS.items():
        remaining, markers, n = int(total_tokens * share), [], 0
        while remaining > 0:
            size = min(SHARD_TOKENS, remaining)
            ids = rng.integers(1, VOCAB, size=size, dtype=np.uint16)
            ends = np.union1d(np.flatnonzero(rng.random(size, dtype=np.float32) < 1 / 500), [size - 1])
            ids[ends] = EOS
            markers.append(write_shard(str(root), cell, n, ids, ends + 1, info, [f"part-{n:05d}.parquet"]))
            remaining -= size
            n += 1
        summaries.append(write_manifest(str(root), cell, markers, info))
    write_counts(str(root), summaries, info)


def make_plan(tokens_dir: Path, sequence_length: int, batch_size: int, block_size: int) -> MixturePlan:
    from tokenmill.mixtures import load_counts, load_mixture_text, plan_mixture

    counts = load_counts(tokens_dir / "counts.json")
    spec = f"""
name: bench
tokenizer: bench-bpe
total_tokens: {counts.total_tokens}
sequence_length: {sequence_length}
batch_size: {batch_size}
block_size: {block_size}
max_epochs: 4
sources:
  web: domain=web/*
  code: domain=code/*
  math: domain=math/*
phases:
  - name: pretraining
    share: 1
    weights: {{web: 0.5, code: 0.3, math: 0.2}}
"""
    return plan_mixture(load_mixture_text(spec), counts)


def bin_files(tokens_dir: Path) -> list[Path]:
    """The shard files in stream order: cell by cell as the plan lists them, shards in order."""
    return [path for cell in CELLS for path in sorted((tokens_dir / cell).glob("*.bin"))]


def evict(tokens_dir: Path) -> None:
    """Drop these files' pages from the page cache: clean pages only (so fsync first), and only pages no
    process has mapped, so every memory map of them must be closed before (see cold_*)."""
    gc.collect()
    for path in bin_files(tokens_dir):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def resident_fraction(tokens_dir: Path) -> float:
    """Fraction of the shard files' pages in the page cache (mincore on a fresh read-only map)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    resident = pages = 0
    for path in bin_files(tokens_dir):
        with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
            view = np.frombuffer(mapping, dtype=np.uint8)
            count = -(-len(mapping) // mmap.PAGESIZE)
            vector = np.zeros(count, dtype=np.uint8)
            if libc.mincore(view.ctypes.data, len(mapping), vector.ctypes.data) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            resident += int((vector & 1).sum())
            pages += count
            del view
    return resident / pages


def open_source(plan: MixturePlan, tokens: str, prefetch_batches: int | None = None, **options):
    """The sampler as the trainer gets it: `MixtureSource.from_plan`, wrapped in `PrefetchedBatches`
    (DEFAULT_PREFETCH_BATCHES, or `prefetch_batches`; 0: none, everything on the caller's thread)."""
    from tokenmill.trainer.data.sampler import DEFAULT_PREFETCH_BATCHES, MixtureSource, PrefetchedBatches

    source = MixtureSource.from_plan(plan, "pretraining", tokens, 0, **options)
    batches = DEFAULT_PREFETCH_BATCHES if prefetch_batches is None else prefetch_batches
    return PrefetchedBatches(source, batches) if batches else source


def sampler_run(source, first_step: int, steps: int) -> tuple[int, float]:
    tokens = 0
    start = time.perf_counter()
    for step in range(first_step, first_step + steps):
        tokens += source.batch(step).tokens.size
    return tokens, time.perf_counter() - start


def cold_sampler(
    tokens_dir: Path, plan: MixturePlan, first_step: int, steps: int, **options
) -> tuple[int, float]:
    """From an empty page cache and fresh memory maps (opening them is not timed)."""
    evict(tokens_dir)
    source = open_source(plan, str(tokens_dir), **options)
    try:
        return sampler_run(source, first_step, steps)
    finally:
        source.close()
        del source
        gc.collect()


def cold_random_reads(
    tokens_dir: Path, plan: MixturePlan, first_step: int, steps: int
) -> tuple[int, float] | None:
    """The disk's random-read ceiling: the staged reads of the sampler's windows for these steps, all
    handed to one DirectReader at once (no sampling, no copying out), from an empty page cache. None
    where direct reads are unavailable."""
    from tokenmill.trainer.data.direct_io import DirectIOUnavailable, DirectReader, aligned_buffer
    from tokenmill.trainer.data.sampler import MixtureSource

    source = MixtureSource.from_plan(plan, "pretraining", str(tokens_dir), 0, reader="mmap")
    stream = source._stream
    begins = [source._begin(source.draws(s)) for s in range(first_step, first_step + steps)]
    source.close()
    del source
    try:
        reader = DirectReader()
    except DirectIOUnavailable:
        return None
    try:
        for path in stream.paths:
            reader.open(path)
    except DirectIOUnavailable:
        reader.close()
        return None
    batches = [stream.staged_reads(begin, reader.align) for begin in begins]
    buffers = [aligned_buffer(reads.buffer_bytes) for reads in batches]
    evict(tokens_dir)
    start = time.perf_counter()
    done = [
        reader.submit(stream.paths, r.path_index, r.offsets, r.sizes, b, r.buffer_offsets, r.needed)
        for r, b in zip(batches, buffers)
    ]
    for future in done:
        future.result()
    seconds = time.perf_counter() - start
    reader.close()
    return steps * len(batches[0].row_offsets) * stream.width, seconds


def cold_sequential(tokens_dir: Path, tokens: int, piece: int, first: int = 0) -> tuple[int, float]:
    """Read `tokens` front to back from fresh memory maps of the shards, from stream offset `first` on
    (wrapping round at the end), `piece` tokens at a time, into an int32 buffer (the sampler's output
    type), from an empty page cache.

    Each run starts where the last one stopped, as each sampler run draws other steps: re-reading the
    same stretch ran twice as fast on the development machine's virtual disk, the host's cache under it
    still holding it. The maps are marked MADV_SEQUENTIAL, as a sequential reader's should be (the kernel
    then reads further ahead on each fault), so that the baseline is the disk's rate, not fault latency."""
    evict(tokens_dir)
    maps = [np.memmap(path, dtype="<u2", mode="r") for path in bin_files(tokens_dir)]
    for part in maps:
        part._mmap.madvise(mmap.MADV_SEQUENTIAL)
    # The stream from `first`: the rest of the map it falls in, the maps after it, then round again.
    ends = np.cumsum([len(part) for part in maps])
    first %= int(ends[-1])
    at = int(np.searchsorted(ends, first, side="right"))
    offset = first - (int(ends[at - 1]) if at else 0)
    stretches = [maps[at][offset:], *maps[at + 1 :], *maps[:at], maps[at][:offset]]
    buffer = np.empty(piece, dtype=np.int32)
    done = 0
    start = time.perf_counter()
    while done < tokens:
        for part in stretches:
            for offset in range(0, len(part), piece):
                chunk = part[offset : offset + min(piece, tokens - done)]
                buffer[: len(chunk)] = chunk
                done += len(chunk)
                if done >= tokens:
                    break
            if done >= tokens:
                break
    seconds = time.perf_counter() - start
    del maps, stretches, part, chunk
    gc.collect()
    return done, seconds


def warm_sequential(tokens_dir: Path, piece: int) -> tuple[int, float]:
    maps = [np.memmap(path, dtype="<u2", mode="r") for path in bin_files(tokens_dir)]
    buffer = np.empty(piece, dtype=np.int32)
    best = None
    for _ in range(2):  # the first pass brings everything in
        done, start = 0, time.perf_counter()
        for part in maps:
            for offset in range(0, len(part), piece):
                chunk = part[offset : offset + piece]
                buffer[: len(chunk)] = chunk
                done += len(chunk)
        best = (done, time.perf_counter() - start)
    return best


def cold_section(args: argparse.Namespace, tokens_dir: Path, plan: MixturePlan) -> float:
    """Cold sides, alternating, each from an empty page cache on other steps each time; returns the
    ratio of the sampler's median tokens/s to the sequential read's."""
    from tokenmill.trainer.data.permutations import BlockShuffle
    from tokenmill.trainer.data.sampler import MixtureSource

    batch_tokens = args.batch_size * (args.sequence_length + 1)
    cold_steps = max(1, args.cold_tokens // batch_tokens)
    sides = {
        "sampler": {},
        "sampler_one_thread": HELPERS_OFF,
        "sampler_mmap": {"reader": "mmap"},
        "sampler_block_shuffle": {"block_shuffle": BlockShuffle()},
    }
    runs: dict[str, list[float]] = {name: [] for name in [*sides, "sequential", "random_read_ceiling"]}
    reader = MixtureSource.from_plan(plan, "pretraining", str(tokens_dir), 0).reader
    for repeat in range(args.repeats):
        for n, (name, options) in enumerate(sides.items()):
            first = (n * args.repeats + repeat) * cold_steps
            tokens, seconds = cold_sampler(tokens_dir, plan, first, cold_steps, **options)
            runs[name].append(tokens / seconds)
            if repeat == 0 and n == 0:
                evict(tokens_dir)
                print(f"after eviction {resident_fraction(tokens_dir):.1%} of the shard pages are in memory")
        done, seconds = cold_sequential(tokens_dir, tokens, batch_tokens, first=repeat * tokens)
        runs["sequential"].append(done / seconds)
        ceiling = cold_random_reads(
            tokens_dir, plan, (len(sides) * args.repeats + repeat) * cold_steps, cold_steps
        )
        if ceiling is not None:
            runs["random_read_ceiling"].append(ceiling[0] / ceiling[1])
    runs = {name: values for name, values in runs.items() if values}
    median = {name: statistics.median(values) for name, values in runs.items()}
    print(f"cold, {cold_steps * batch_tokens / 1e6:.1f}M tokens a run, median of {args.repeats} (runs):")
    for name, values in runs.items():
        each = ", ".join(f"{x / 1e6:.1f}M" for x in values)
        print(f"  {name:22s} {median[name] / 1e6:8.1f}M tokens/s  ({each})")
    print(f"  (sampler: {reader} reads; the ceiling: the same reads, all queued at once, no sampling)")
    if "random_read_ceiling" in median:
        ceiling = median["random_read_ceiling"]
        print(
            f"cold sampler at {median['sampler'] / ceiling:.2f} of the disk's random-read ceiling, "
            f"which is {ceiling / median['sequential']:.2f} of the sequential read"
        )
    return median["sampler"] / median["sequential"]


def warm_section(args: argparse.Namespace, tokens_dir: Path, plan: MixturePlan) -> None:
    """Everything in memory. The target is for one core: no helper threads."""
    from tokenmill.trainer.data.sampler import MixtureSource

    batch_tokens = args.batch_size * (args.sequence_length + 1)
    reader = MixtureSource.from_plan(plan, "pretraining", str(tokens_dir), 0).reader
    tokens, seconds = warm_sequential(tokens_dir, batch_tokens)
    sequential_warm = tokens / seconds
    warm = {}
    warm_sides = {
        "sampler_one_thread": HELPERS_OFF,
        "sampler": {},
        "sampler_mmap_one_thread": {"reader": "mmap", **HELPERS_OFF},
        "sampler_mmap": {"reader": "mmap"},
    }
    for name, options in warm_sides.items():
        source = open_source(plan, str(tokens_dir), **options)
        sampler_run(source, 0, 3)
        steps, tokens, seconds = 0, 0, 0.0
        while seconds < args.warm_seconds:
            more, took = sampler_run(source, 3 + steps, 10)
            steps, tokens, seconds = steps + 10, tokens + more, seconds + took
        source.close()
        warm[name] = tokens / seconds
        print(
            f"warm: {name:24s} {warm[name] / 1e6:8.1f}M tokens/s ({steps} batches of {batch_tokens:,} "
            f"tokens, {seconds / steps * 1e3:.2f} ms a batch)"
        )
    print(f"warm: {'sequential':24s} {sequential_warm / 1e6:8.1f}M tokens/s")
    one_core = warm["sampler_one_thread"]
    print(
        f"warm sampler {one_core / 1e6:.1f}M tokens/s on one core (no helper threads, {reader} reads): "
        f"{'meets' if one_core >= WARM_TARGET else 'MISSES'} the {WARM_TARGET / 1e6:.0f}M target"
    )


# --- remote: gs:// shards on a GCS emulator on loopback ---------------------------------------------------

# The emulator serves one request at a time; a deep listen backlog lets concurrent requests queue instead
# of waiting out TCP's SYN retransmit (as tests/gcs_emulator.py starts it).
EMULATOR = (
    "import socketserver, sys; socketserver.TCPServer.request_queue_size = 1024; "
    "from gcp_storage_emulator.__main__ import main; main(sys.argv[1:])"
)
BUCKET = "tokenmill-bench"


@contextlib.contextmanager
def gcs_emulator() -> Iterator[str]:
    """Start gcp-storage-emulator on a free loopback port (in memory, one bucket) and point this
    process's gcsfs at it; yields the bucket's gs:// URL. Must run before gcsfs is imported (gcsfs reads
    GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT then; the emulator speaks only the JSON API)."""
    import fsspec.config

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-c", EMULATOR, "start", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--in-memory", "--default-bucket", BUCKET, "--quiet"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{BUCKET}", timeout=1):
                    break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the GCS emulator did not start on {endpoint}") from None
                time.sleep(0.1)
        os.environ.update(
            {
                "STORAGE_EMULATOR_HOST": endpoint,
                "FSSPEC_GS_TOKEN": "anon",
                "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            }
        )
        fsspec.config.conf["gs"] = {**fsspec.config.conf.get("gs", {}), "token": "anon"}
        yield f"gs://{BUCKET}"
    finally:
        process.terminate()
        process.wait()


def local_reads_per_batch(plan: MixturePlan, tokens_dir: Path, steps: int) -> float:
    """The O_DIRECT reads a batch of the local direct reader takes (4 KiB-aligned, touching ones merged)."""
    from tokenmill.trainer.data.sampler import MixtureSource

    source = MixtureSource.from_plan(
        plan, "pretraining", str(tokens_dir), 0, reader="mmap", readahead_tokens=0
    )
    reads = [
        len(source._stream.staged_reads(source._begin(source.draws(s)), 4096).offsets) for s in range(steps)
    ]
    return sum(reads) / steps


def remote_section(args: argparse.Namespace) -> float | None:
    """Remote sides against the local reader on the same (smaller) token directory and steps; returns
    the remote default's tokens/s over a reference host's need at a step a second, None when skipped."""
    try:
        import gcp_storage_emulator  # noqa: F401
    except ImportError:
        print("remote: skipped (gcp-storage-emulator is not installed: pip install -e '.[dev]')")
        return None
    from tokenmill.trainer.data.permutations import BlockShuffle
    from tokenmill.trainer.data.remote import RemoteOptions

    scratch = Path(tempfile.mkdtemp(prefix="tokenmill-bench-remote-"))
    try:
        tokens_dir = scratch / "tokens"
        build_tokens(tokens_dir, args.remote_tokens)
        plan = make_plan(tokens_dir, args.sequence_length, args.batch_size, args.block_size)
        steps = args.remote_steps
        batch_tokens = args.batch_size * (args.sequence_length + 1)
        with gcs_emulator() as bucket:
            import fsspec

            t0 = time.perf_counter()
            fs = fsspec.filesystem("gs")
            files = sorted(p for p in tokens_dir.rglob("*") if p.is_file())
            for path in files:
                fs.put_file(str(path), f"{bucket}/tokens/{path.relative_to(tokens_dir).as_posix()}")
            url = f"{bucket}/tokens"
            size = sum(p.stat().st_size for p in files)
            print(
                f"remote: {args.remote_tokens:,} tokens ({size / 1e6:.0f} MB, "
                f"{len(bin_files(tokens_dir))} shards) uploaded to the GCS emulator on loopback in "
                f"{time.perf_counter() - t0:.1f}s; "
                f"{steps} batches of {args.batch_size} x {args.sequence_length + 1} from step 0"
            )
            local = open_source(plan, str(tokens_dir))
            tokens, seconds = sampler_run(local, 0, steps)
            reader = local.source.reader
            local.close()
            rates = {f"local ({reader} reads)": tokens / seconds}
            per_batch = {f"local ({reader} reads)": (local_reads_per_batch(plan, tokens_dir, steps), 0.0)}
            cache = str(scratch / "cache")
            sides = {
                "remote": {},
                "remote, no coalescing": {"remote": RemoteOptions(coalesce_gap_bytes=0)},
                "remote, block shuffle": {"block_shuffle": BlockShuffle()},
                "remote, cache on": {"remote": RemoteOptions(cache_bytes=2 * size, cache_dir=cache)},
            }
            for name, options in sides.items():
                t0 = time.perf_counter()
                source = open_source(plan, url, **options)
                opened = time.perf_counter() - t0
                tokens, seconds = sampler_run(source, 0, steps)
                stats = source.source.reads.stats
                source.close()
                rates[name] = tokens / seconds
                per_batch[name] = (stats.requests / stats.batches, stats.request_bytes / stats.batches)
                extra = (
                    f", {stats.downloads} shards cached, {stats.cached_reads} cached reads"
                    if stats.downloads
                    else ""
                )
                print(
                    f"  {name:24s} checks before training {opened:.2f}s; {stats.batches} batches requested "
                    f"(read-ahead included), {stats.retries} retries{extra}"
                )
        local_rate = rates[f"local ({reader} reads)"]
        for name, rate in rates.items():
            requests, request_bytes = per_batch[name]
            moved = f", {request_bytes / 1e6:.2f} MB requested" if request_bytes else ""
            print(
                f"  {name:24s} {rate / 1e6:8.2f}M tokens/s ({rate / local_rate:.3f} of local)  "
                f"{requests:7.1f} requests a batch of {args.batch_size} windows{moved}"
            )
        need = REFERENCE_HOST_ROWS * (args.sequence_length + 1)
        print(
            f"remote: a reference-run host reads {REFERENCE_HOST_ROWS} windows a step "
            f"({need / 1e3:.0f}K tokens): at a step a second {REFERENCE_HOST_ROWS} requests/s; the "
            "emulator's remote reader gives "
            f"{rates['remote'] / need:.1f}x that (batch of {batch_tokens:,} tokens here)"
        )
        return rates["remote"] / need
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens-dir", help="reuse (or build and keep) the bench's token directory here")
    parser.add_argument("--total-tokens", type=int, default=384 << 20, help="tokens to build (default 384Mi)")
    parser.add_argument("--sequence-length", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=256, help="rows a step (default 256)")
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument(
        "--cold-tokens",
        type=int,
        default=128 << 20,
        help="tokens per cold run (default 128Mi: long enough that the first batch's wait and the "
        "read-ahead still in flight at the end, which a training run has once, are small against it)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="cold runs per side (default 5)")
    parser.add_argument("--warm-seconds", type=float, default=3.0)
    parser.add_argument(
        "--sections",
        default="cold,warm,remote",
        help="which parts to run, comma-separated (default: cold,warm,remote)",
    )
    parser.add_argument(
        "--remote-tokens",
        type=int,
        default=48 << 20,
        help="tokens of the remote part's directory (default 48Mi)",
    )
    parser.add_argument("--remote-steps", type=int, default=24, help="batches per remote side (default 24)")
    args = parser.parse_args()

    sections = set(args.sections.split(","))
    if sections - SECTIONS or not sections:
        parser.error(f"--sections: expected some of {','.join(sorted(SECTIONS))}")
    from tokenmill.trainer.data.sampler import MixtureSource

    cold_ratio = None
    if sections & {"cold", "warm"}:
        scratch = None
        if args.tokens_dir:
            tokens_dir = Path(args.tokens_dir)
        else:
            scratch = tempfile.mkdtemp(prefix="tokenmill-bench-loader-")
            tokens_dir = Path(scratch)
        try:
            if not (tokens_dir / "counts.json").exists():
                t0 = time.perf_counter()
                build_tokens(tokens_dir, args.total_tokens)
                print(f"built {args.total_tokens:,} tokens in {tokens_dir} ({time.perf_counter() - t0:.1f}s)")
            plan = make_plan(tokens_dir, args.sequence_length, args.batch_size, args.block_size)
            source = MixtureSource.from_plan(plan, "pretraining", str(tokens_dir), 0)
            total = sum(src.stream.num_tokens for src in source.sources)
            print(source)
            windows = ", ".join(f"{s.name} {s.num_windows:,}" for s in source.sources)
            print(f"{total:,} tokens in {len(bin_files(tokens_dir))} shards; windows: {windows}")
            del source
            if "cold" in sections:
                cold_ratio = cold_section(args, tokens_dir, plan)
            if "warm" in sections:
                warm_section(args, tokens_dir, plan)
        finally:
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
    remote_ratio = remote_section(args) if "remote" in sections else None
    if cold_ratio is not None:
        print(f"loader ratio={cold_ratio:.2f} target={COLD_TARGET} baseline=sequential_memmap_read")
    elif remote_ratio is not None:
        print(
            f"loader_remote ratio={remote_ratio:.2f} target={REMOTE_TARGET} "
            "baseline=reference_host_at_1s_step"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
