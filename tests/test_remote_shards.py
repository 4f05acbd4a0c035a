"""Token shards in object storage (tokenmill.trainer.data.remote, issue 23), against the GCS emulator on
loopback (conftest's `gcs`): batches read with ranged requests equal the local reader's for every step and
host, flaky requests are retried without changing a batch, missing, truncated and corrupted shards stop
the run before training naming the shard, the local cache stays in its bound, and a tiny `tokenmill train`
from gs:// has the losses of the same run from local shards."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from test_sampler import SPEC, make_tokens
from test_trainer_cli import MIXTURE, TINY, read_metrics, write_tokens

from tokenmill import storage
from tokenmill.cli import main
from tokenmill.formats.plan import MixturePlan, write_plan
from tokenmill.mixtures import load_counts, load_mixture_text, plan_mixture
from tokenmill.tokenize.shards import ShardChecksumError, ShardError
from tokenmill.trainer.data.remote import RemoteOptions, ShardCache
from tokenmill.trainer.data.sampler import MixtureSource, PrefetchedBatches

# Quick retries: the tests inject failures, they need not wait them out.
FAST = {"attempts": 3, "backoff_seconds": 0.001}


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory) -> Path:
    return make_tokens(tmp_path_factory.mktemp("tokens"))


@pytest.fixture(scope="module")
def plan(tokens_dir) -> MixturePlan:
    return plan_mixture(load_mixture_text(SPEC), load_counts(tokens_dir / "counts.json"))


@pytest.fixture(scope="module")
def tokens_url(gcs, tokens_dir) -> str:
    """The fixture's shards in the bucket, never changed (tests that damage shards upload their own)."""
    return gcs.upload(tokens_dir, "remote", "tokens")


def assert_same_batches(expected: MixtureSource, remote, steps) -> None:
    for step in steps:
        a, b = expected.batch(step), remote.batch(step)
        assert np.array_equal(a.tokens, b.tokens), f"step {step}"
        assert np.array_equal(a.segment_ids, b.segment_ids), f"step {step}"


# --- batches ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("processes", [1, 2, 4])
def test_batches_from_gs_equal_batches_from_disk_for_every_step_and_host(
    plan, tokens_dir, tokens_url, processes
):
    for phase in ("pretraining", "midtraining"):
        local = MixtureSource.from_plan(plan, phase, str(tokens_dir), 7, reader="mmap")
        rows = plan.batch_size // processes
        hosts = [
            MixtureSource.from_plan(plan, phase, tokens_url, 7, i, processes, remote=RemoteOptions(**FAST))
            for i in range(processes)
        ]
        assert all(host.reader == "remote" for host in hosts)
        # In order, on past the phase's end, back (a resume) and forward again.
        for step in [*range(40), local.steps - 1, local.steps + 3, 3, 2, 41]:
            whole = local.batch(step)
            for i, host in enumerate(hosts):
                batch = host.batch(step)
                assert np.array_equal(batch.tokens, whole.tokens[i * rows : (i + 1) * rows]), (phase, step, i)
                assert np.array_equal(batch.segment_ids, whole.segment_ids[i * rows : (i + 1) * rows])
        for host in hosts:
            stats = host.reads.stats
            assert stats.retries == 0 and stats.windows == stats.batches * rows
            # Pieces of one shard within the gap share a request: fewer requests than windows.
            assert stats.requests < stats.windows
            host.close()


def test_coalescing_the_prefetch_wrapper_and_a_filesystem_without_async(plan, tokens_dir, tokens_url):
    local = MixtureSource.from_plan(plan, "pretraining", str(tokens_dir), 3, reader="mmap")
    steps = [*range(30), 12, 13, 50]
    # Without coalescing nearly every window is its own request (two for one that spans two shards).
    # (Only windows that touch or overlap, neighbours and repeats, share one.) No read-ahead here, so that
    # the requests are those of the steps asked for.
    apart, together = (
        MixtureSource.from_plan(
            plan,
            "pretraining",
            tokens_url,
            3,
            readahead_tokens=0,
            remote=RemoteOptions(coalesce_gap_bytes=gap, **FAST),
        )
        for gap in (0, 256 << 10)
    )
    for source in (apart, together):
        assert_same_batches(local, source, steps)
    assert apart.reads.stats.windows == together.reads.stats.windows == len(steps) * plan.batch_size
    assert apart.reads.stats.requests > 0.9 * apart.reads.stats.windows
    # The fixture's shards are at most 18 KB: with a 256 KiB gap a batch is one request per shard it touches.
    stream = together._stream
    touched = 0
    for step in steps:
        begin = together._begin(together.draws(step))
        first = np.searchsorted(stream.starts, begin, side="right") - 1
        last = np.searchsorted(stream.starts, begin + stream.width - 1, side="right") - 1
        touched += len(set(first.tolist()) | set(last.tolist()))
    assert together.reads.stats.requests == touched < 0.7 * apart.reads.stats.requests
    assert together.reads.stats.request_bytes > apart.reads.stats.request_bytes  # the gaps are read too
    # Assembled ahead on a helper thread, from requests made steps ahead: the same batches.
    prefetched = PrefetchedBatches(
        MixtureSource.from_plan(plan, "pretraining", tokens_url, 3, remote=RemoteOptions(**FAST)), batches=3
    )
    assert_same_batches(local, prefetched, steps)
    prefetched.close()
    # memory:// has no async API: its requests run on a thread pool.
    storage.remove_tree("memory://remote-tokens")
    for path in sorted(p for p in tokens_dir.rglob("*") if p.is_file()):
        storage.write_bytes(
            f"memory://remote-tokens/{path.relative_to(tokens_dir).as_posix()}", path.read_bytes()
        )
    threaded = MixtureSource.from_plan(
        plan, "pretraining", "memory://remote-tokens", 3, remote=RemoteOptions()
    )
    assert_same_batches(local, threaded, steps)
    for source in (apart, together, threaded):
        source.close()


def test_flaky_range_reads_are_retried_and_leave_the_batches_unchanged(
    plan, tokens_dir, tokens_url, monkeypatch
):
    # Imported once the emulator is up: gcsfs reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT when imported.
    from gcsfs.retry import HttpError

    local = MixtureSource.from_plan(plan, "midtraining", str(tokens_dir), 5, reader="mmap")
    fs = storage.filesystem(tokens_url)[0]  # fsspec hands out one instance per set of options
    cat_file = fs._cat_file
    calls = {"count": 0, "failed": 0}
    failed_once = set()
    failures = [
        lambda: ConnectionResetError(104, "Connection reset by peer"),
        lambda: aiohttp.ClientPayloadError("Response payload is not completed"),
        lambda: HttpError({"code": 503, "message": "Service Unavailable"}),
        lambda: TimeoutError(),
        None,  # a body cut short without an error
    ]

    async def flaky_cat_file(path, start=None, end=None, **kwargs):
        calls["count"] += 1
        data = await cat_file(path, start=start, end=end, **kwargs)
        if calls["count"] % 3 == 0 and (path, start, end) not in failed_once:  # every third request, once
            failed_once.add((path, start, end))
            failure = failures[calls["failed"] % len(failures)]
            calls["failed"] += 1
            if failure is None:
                return data[: len(data) // 2]
            raise failure()
        return data

    monkeypatch.setattr(fs, "_cat_file", flaky_cat_file)
    remote = PrefetchedBatches(
        MixtureSource.from_plan(plan, "midtraining", tokens_url, 5, remote=RemoteOptions(**FAST))
    )
    assert_same_batches(local, remote, range(local.steps))
    remote.close()
    stats = remote.source.reads.stats
    assert calls["failed"] >= 2 * len(failures) and stats.retries == calls["failed"]

    # A request that keeps failing fails the batch after the last attempt, naming the shard: it never
    # yields a different batch.
    async def broken_cat_file(path, start=None, end=None, **kwargs):
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(fs, "_cat_file", broken_cat_file)
    broken = MixtureSource.from_plan(plan, "midtraining", tokens_url, 5, remote=RemoteOptions(**FAST))
    with pytest.raises(OSError, match=r"gs://.*/part-\d+\.bin bytes \[\d+, \d+\).*after 3 attempts"):
        broken.batch(0)
    assert broken.reads.stats.retries >= 2
    broken.close()

    # A missing object is not retried.
    async def missing_cat_file(path, start=None, end=None, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr(fs, "_cat_file", missing_cat_file)
    gone = MixtureSource.from_plan(plan, "midtraining", tokens_url, 5, remote=RemoteOptions(**FAST))
    with pytest.raises(OSError, match=r"part-\d+\.bin bytes .*FileNotFoundError") as error:
        gone.batch(0)
    assert "attempts" not in str(error.value) and gone.reads.stats.retries == 0
    gone.close()


# --- shards that do not match their manifests ------------------------------------------------------------


def damaged_copy(gcs, tokens_dir: Path, name: str) -> tuple[str, str]:
    """A fresh copy of the fixture's shards in the bucket; returns (tokens url, the first web shard's url)."""
    url = gcs.upload(tokens_dir, "remote", name, "tokens")
    return url, f"{url}/domain=web/quality=3/part-00001.bin"


def test_missing_truncated_and_corrupted_shards_stop_the_run_before_training(gcs, plan, tokens_dir, tmp_path):
    fs = gcs.filesystem()
    url, shard = damaged_copy(gcs, tokens_dir, "missing")
    fs.rm_file(shard.removeprefix("gs://"))
    with pytest.raises(ShardError, match=f"{shard}: missing \\(listed in .*manifest.json\\)"):
        MixtureSource.from_plan(plan, "pretraining", url, 0)
    with pytest.raises(ValueError, match="reader 'direct' reads local shards; .* is in object storage"):
        MixtureSource.from_plan(plan, "pretraining", url, 0, reader="direct")

    url, shard = damaged_copy(gcs, tokens_dir, "truncated")
    data = fs.cat_file(shard.removeprefix("gs://"))
    storage.write_bytes(shard, data[:-2])
    with pytest.raises(ShardChecksumError, match=f"{shard}: {len(data) - 2} bytes, but the manifest says"):
        MixtureSource.from_plan(plan, "pretraining", url, 0)

    # The same size with other bytes: found by the checksums, when asked for...
    url, shard = damaged_copy(gcs, tokens_dir, "corrupted")
    storage.write_bytes(shard, bytes([data[0] ^ 1]) + data[1:])
    with pytest.raises(ShardChecksumError, match=f"{shard}: checksum mismatch"):
        MixtureSource.from_plan(plan, "pretraining", url, 0, verify_shards=True)
    # ...by the one process of two whose share (every other shard) holds it...
    found = []
    for process in (0, 1):
        try:
            MixtureSource.from_plan(plan, "pretraining", url, 0, process, 2, verify_shards=True).close()
        except ShardChecksumError as error:
            found.append(str(error))
    assert len(found) == 1 and f"{shard}: checksum mismatch" in found[0]
    # ...and, mid-run, when the cache downloads it: the next batch stops the run.
    cached = MixtureSource.from_plan(
        plan,
        "pretraining",
        url,
        0,
        remote=RemoteOptions(cache_bytes=1 << 20, cache_dir=str(tmp_path / "cache"), **FAST),
    )
    with pytest.raises(ShardChecksumError, match=f"{shard}: .* but its manifest says"):
        for step in range(cached.steps):
            cached.batch(step)
    cached.close()
    assert not list((tmp_path / "cache").glob(f"{storage.TEMPORARY_PREFIX}*"))

    # From the command line: refused before anything is compiled or written.
    write_plan(str(tmp_path / "plan.json"), plan)
    run = tmp_path / "run"
    url, shard = damaged_copy(gcs, tokens_dir, "cli")
    fs.rm_file(shard.removeprefix("gs://"))
    argv = ["train", "--data.plan", str(tmp_path / "plan.json"), "--data.tokens", url, "--model", TINY]
    assert main([*argv, "--output", str(run), "--schedule.steps", "2"]) == 2
    assert not (run / "metrics.jsonl").exists()


# --- the local cache -------------------------------------------------------------------------------------


def folder_bytes(folder: Path) -> int:
    """Bytes of the files in a folder that the cache's event loop thread changes meanwhile."""
    total = 0
    for entry in os.scandir(folder):
        try:
            total += entry.stat().st_size
        except FileNotFoundError:
            pass  # evicted since the listing
    return total


def test_the_cache_keeps_shards_read_repeatedly_within_its_bound(plan, tokens_dir, tokens_url, tmp_path):
    local = MixtureSource.from_plan(plan, "pretraining", str(tokens_dir), 2, reader="mmap")
    folder = tmp_path / "cache"
    sizes = sorted((p.stat().st_size for p in tokens_dir.rglob("*.bin")), reverse=True)
    bound = sizes[0] + sizes[1]  # room for two of the seven shards: the rest are read remotely
    # Requests as dear as 4 KB: a shard is downloaded after its ranged reads cost that much.
    options = RemoteOptions(cache_bytes=bound, cache_dir=str(folder), request_cost_bytes=4096, **FAST)
    first = MixtureSource.from_plan(plan, "pretraining", tokens_url, 2, remote=options)
    peak = 0
    for step in range(first.steps):
        assert_same_batches(local, first, [step])
        peak = max(peak, folder_bytes(folder))
    stats = first.reads.stats
    assert stats.downloads >= 2 and stats.cached_reads > 0 and stats.requests > 0
    assert peak <= bound and first.reads.cache.used_bytes <= bound
    first.close()
    # What is left is whole shards under the names of their checksums, within the bound.
    for path in folder.iterdir():
        assert path.name[:64] == hashlib.sha256(path.read_bytes()).hexdigest() and path.suffix == ".bin"
    assert folder_bytes(folder) <= bound

    # Room for everything: after a while every shard is local, and a later run on the host starts with
    # them: not one request.
    roomy = RemoteOptions(cache_bytes=1 << 20, cache_dir=str(folder), request_cost_bytes=4096, **FAST)
    warm = MixtureSource.from_plan(plan, "pretraining", tokens_url, 2, remote=roomy)
    assert_same_batches(local, warm, range(warm.steps))
    warm.close()
    assert len(list(folder.iterdir())) == 7
    again = MixtureSource.from_plan(plan, "midtraining", tokens_url, 2, remote=roomy)
    assert_same_batches(MixtureSource.from_plan(plan, "midtraining", str(tokens_dir), 2), again, range(20))
    assert again.reads.stats.requests == 0 and again.reads.stats.cached_reads > 0
    again.close()
    # A smaller bound evicts the least recently used when it starts.
    assert ShardCache(str(folder), sizes[0]).used_bytes <= sizes[0]
    assert folder_bytes(folder) <= sizes[0] and 1 <= len(list(folder.iterdir())) < 7


# --- the trainer ------------------------------------------------------------------------------------------


def test_a_tiny_run_from_gs_has_the_losses_of_the_run_from_local_shards(gcs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))  # counts.json's local copy
    tokens = write_tokens(tmp_path / "tokens", vocab_size=4096)
    url = gcs.upload(tokens, "remote", "train", "tokens")
    mixture = tmp_path / "mixture.yaml"
    mixture.write_text(MIXTURE)
    common = [
        "train",
        "--data.mixture",
        str(mixture),
        "--model",
        TINY,
        "--schedule.steps",
        "4",
        "--logging.peak_flops",
        "1e9",
    ]
    assert main([*common, "--data.tokens", str(tokens), "--output", str(tmp_path / "local")]) == 0
    remote = tmp_path / "remote"
    assert main([*common, "--data.tokens", url, "--output", str(remote), "--data.shard_cache", "1M"]) == 0
    losses = [row["loss"] for row in read_metrics(tmp_path / "local")]
    assert len(losses) == 4 and [row["loss"] for row in read_metrics(remote)] == losses
    config = json.loads((remote / "config.json").read_text())
    assert config["data"]["tokens"] == url and config["data"]["shard_cache"] == 1_000_000
    assert os.listdir(tmp_path / "cache" / "remote-files" / "token-shards")  # the cache was used
    capsys.readouterr()
