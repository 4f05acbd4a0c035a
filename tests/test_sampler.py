"""Tests for the uniform sampler (trainer/data/sampler.py, issue 7): permutations, mixing, resume, slices.

Fixtures are real token shards: .bin/.idx written here following docs/formats.md, manifests and
counts.json by the tokenize writer's own functions, and plans by the real planner.
"""

from __future__ import annotations

import copy
import json
import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.errors import FormatError
from tokenmill.formats.plan import MixturePlan, plan_from_json, read_plan, write_plan
from tokenmill.mixtures import load_counts, load_mixture, load_mixture_text, plan_mixture
from tokenmill.tokenize.shards import ShardError
from tokenmill.tokenize.tokenizer import TokenizerInfo
from tokenmill.tokenize.writer import write_counts, write_manifest, write_shard
from tokenmill.trainer.data.batch import BatchSource, check_source, segments_from_eos
from tokenmill.trainer.data.direct_io import DirectIOUnavailable, DirectReader
from tokenmill.trainer.data.permutations import BlockShuffle, derive_key, granular_permute, mix64, permute
from tokenmill.trainer.data.sampler import MixtureSource, PrefetchedBatches
from tokenmill.trainer.data.windows import advise, open_reads

SHA = "a" * 64
EOS = 0
CELLS = {
    # cell: tokens per shard (several shards, so windows cross shard boundaries)
    "domain=web/quality=3": [9000, 6000, 77],
    "domain=web/quality=4": [5000],
    "domain=code/quality=2": [4000, 3100],
    "domain=math/quality=1": [2500],
}

SPEC = """
name: fixture
tokenizer: fixture-bpe
total_tokens: 80K
sequence_length: 32
batch_size: 8
block_size: 32
max_epochs: 20
sources:
  web: domain=web/*
  code: domain=code/*
  math: domain=math/*
phases:
  - name: pretraining
    share: 0.75
    weights: {web: 0.6, code: 0.3, math: 0.1}
  - name: midtraining
    share: 0.25
    weights: {web: 0.3, code: 0.3, math: 0.4}
"""


def write_cell(root: Path, cell: str, shard_tokens: list[int], info: TokenizerInfo, seed: int) -> dict:
    """One cell of random documents (each ending in end-of-text), through the writer's manifest code."""
    rng = np.random.default_rng(seed)
    markers = []
    for n, tokens in enumerate(shard_tokens):
        ids = rng.integers(1, info.vocab_size, size=tokens).astype("<u2")
        # Document ends at random places, and always at the shard's end.
        ends = np.flatnonzero(rng.random(tokens) < 1 / 40)
        ends = np.union1d(ends, [tokens - 1])
        ids[ends] = info.eos_id
        source = f"part-{n:05d}-of-{len(shard_tokens):05d}.parquet"
        markers.append(write_shard(str(root), cell, n, ids, ends + 1, info, [source]))
    return write_manifest(str(root), cell, markers, info)


def make_tokens(root: Path, cells: dict[str, list[int]] = CELLS, sha: str = SHA) -> Path:
    info = TokenizerInfo(name="fixture-bpe", sha256=sha, vocab_size=1000, eos_id=EOS, eos_token="<eos>")
    summaries = [write_cell(root, cell, sizes, info, i) for i, (cell, sizes) in enumerate(cells.items())]
    write_counts(str(root), summaries, info)
    return root


@pytest.fixture(scope="module")
def tokens_dir(tmp_path_factory) -> str:
    return str(make_tokens(tmp_path_factory.mktemp("tokens")))


@pytest.fixture(scope="module")
def plan(tokens_dir) -> MixturePlan:
    return plan_mixture(load_mixture_text(SPEC), load_counts(os.path.join(tokens_dir, "counts.json")))


def stream_of(tokens_dir: str, cells: list[str]) -> np.ndarray:
    """A source's token stream the slow way: every shard of every cell, concatenated."""
    parts = []
    for cell in cells:
        manifest = json.loads(Path(tokens_dir, cell, "manifest.json").read_text())
        for shard in manifest["shards"]:
            parts.append(np.fromfile(Path(tokens_dir, cell, shard["name"] + ".bin"), dtype="<u2"))
    return np.concatenate(parts)


def all_draws(source: MixtureSource, steps: int):
    draws = [source.draws(step) for step in range(steps)]
    return {
        key: np.concatenate([getattr(d, key) for d in draws]) for key in ("source", "draw", "epoch", "window")
    }


# --- permutations ---------------------------------------------------------------------------------------

PRIMES = [2, 3, 5, 7, 11, 13, 31, 61, 127, 257, 1021, 4093, 65537]


@settings(max_examples=60, deadline=None)
@given(
    size=st.one_of(st.integers(1, 5000), st.sampled_from([1, *PRIMES, 4095, 4096, 4097, 16384])),
    key=st.integers(0, 2**64 - 1),
)
def test_permutation_is_a_bijection(size, key):
    out = permute(np.arange(size), size, key)
    assert out.dtype == np.int64 and out.shape == (size,)
    assert np.array_equal(np.sort(out), np.arange(size))


@settings(max_examples=25, deadline=None)
@given(size=st.integers(1, 3000), seed=st.integers(0, 2**32))
def test_permutation_with_a_key_per_element_is_a_bijection_per_key(size, seed):
    # Elements keyed apart are permuted as if each key were used alone (the mixer keys per block).
    keys = mix64(np.array([seed, seed + 1], dtype=np.uint64))
    index = np.concatenate([np.arange(size), np.arange(size)])
    per = np.repeat(keys, size)
    out = permute(index, size, per)
    for i, key in enumerate(keys):
        assert np.array_equal(out[i * size : (i + 1) * size], permute(np.arange(size), size, int(key)))
        assert np.array_equal(np.sort(out[i * size : (i + 1) * size]), np.arange(size))


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(1, 700), min_size=1, max_size=6), key=st.integers(0, 2**64 - 1))
def test_one_call_with_a_size_per_element_equals_a_call_per_size(sizes, key):
    index = np.concatenate([np.arange(n) for n in sizes])
    out = permute(index, np.repeat(sizes, sizes), key)
    assert np.array_equal(out, np.concatenate([permute(np.arange(n), n, key) for n in sizes]))


def test_large_domain_without_materializing_it():
    size = 10**12 + 39  # permute() never builds anything of `size` elements
    index = np.array([0, 1, 2, size - 1, 123456789])
    out = permute(index, size, 7)
    assert ((0 <= out) & (out < size)).all() and len(set(out.tolist())) == len(index)
    assert np.array_equal(out, permute(index, size, 7))  # deterministic


def test_permutation_depends_on_the_key_and_looks_uniform():
    size = 1000
    a, b = permute(np.arange(size), size, 1), permute(np.arange(size), size, 2)
    assert not np.array_equal(a, b)
    assert abs(np.corrcoef(np.arange(size), a)[0, 1]) < 0.15
    # Where index 0 lands over many keys: spread over the range (each tenth about 10%).
    landings = np.array([permute(np.array([0]), size, key)[0] for key in range(2000)])
    tenths = np.bincount(landings * 10 // size, minlength=10) / len(landings)
    assert np.all(np.abs(tenths - 0.1) < 0.035), tenths
    with pytest.raises(IndexError):
        permute(np.array([size]), size, 1)


def test_keys_are_stable_and_typed():
    assert derive_key(0, "source", "web") == derive_key(0, "source", "web")
    assert derive_key(1, "web") != derive_key("1", "web")
    # Pinned: a change here changes every batch of every run (resumes across versions would break).
    assert derive_key(0, "pin") == 1950611921227216458
    assert permute(np.arange(8), 8, derive_key(0, "pin")).tolist() == [3, 6, 1, 4, 7, 2, 5, 0]
    assert permute(np.arange(10), 1000, 12345).tolist() == [604, 32, 836, 295, 85, 657, 265, 58, 906, 379]


@settings(max_examples=30, deadline=None)
@given(
    size=st.integers(1, 3000), width=st.integers(1, 40), buffer=st.integers(1, 9), key=st.integers(0, 2**63)
)
def test_block_shuffle_and_granular_subset_are_bijections(size, width, buffer, key):
    shuffle = BlockShuffle(block_windows=width, buffer_blocks=buffer)
    keys = np.full(size, key, dtype=np.uint64)
    out = shuffle.order(np.arange(size), size, keys)
    assert np.array_equal(np.sort(out), np.arange(size))
    out = granular_permute(np.arange(size), size, key, width)
    assert np.array_equal(np.sort(out), np.arange(size))


def test_block_shuffle_reads_contiguous_blocks():
    size, width, buffer = 10_000, 50, 4
    out = BlockShuffle(width, buffer).order(np.arange(size), size, np.full(size, 3, dtype=np.uint64))
    # Every run of buffer x width draws touches `buffer` blocks (one more where the short last block walks).
    touched = [len(np.unique(out[i : i + buffer * width] // width)) for i in range(0, size, buffer * width)]
    assert max(touched) <= buffer + 1 and np.median(touched) == buffer


# --- the mixture source ---------------------------------------------------------------------------------


def test_is_a_batch_source_that_the_trainer_accepts(plan, tokens_dir):
    source = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 0, 0, 1)
    assert isinstance(source, BatchSource)
    assert source.vocab_size == 1000 and source.tokenizer_sha256 == SHA
    check_source(source, model_vocab_size=1000, expected_tokenizer_sha256=SHA)
    batch = source.batch(0)
    assert batch.tokens.shape == (plan.batch_size, plan.sequence_length + 1)
    assert batch.tokens.dtype == np.int32 and batch.segment_ids.dtype == np.int32
    assert np.array_equal(batch.segment_ids, segments_from_eos(batch.tokens, EOS))


def test_rows_are_the_windows_the_draws_name(plan, tokens_dir):
    source = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 5)
    length = plan.sequence_length
    streams = {s.name: stream_of(tokens_dir, s.cells) for s in source.sources}
    for step in range(0, source.steps, 7):
        batch, where = source.batch(step), source.draws(step)
        for row in range(len(where.rows)):
            name = source.sources[where.source[row]].name
            start = int(where.window[row]) * length
            assert np.array_equal(batch.tokens[row], streams[name][start : start + length + 1])
    # Windows are L + 1 tokens at stride L: a source has (tokens - 1) // L of them.
    for s in source.sources:
        assert s.stream.num_windows == (len(streams[s.name]) - 1) // length


def test_windows_across_shard_and_cell_boundaries(tokens_dir, plan):
    source = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 0)
    web = next(s for s in source.sources if s.name == "web")
    stream = stream_of(tokens_dir, web.cells)
    n, length = web.stream.num_windows, plan.sequence_length
    out = np.empty((n, length + 1), dtype=np.int32)
    web.stream.gather(np.arange(n)[::-1], out, np.arange(n))
    expected = np.stack([stream[w * length : w * length + length + 1] for w in range(n)][::-1])
    assert np.array_equal(out, expected)
    assert len(web.stream.parts) == 4  # three shards of one cell and one of the other


def test_every_block_holds_the_planned_counts(plan, tokens_dir):
    for phase in plan.phases:
        source = MixtureSource.from_plan(plan, phase.name, tokens_dir, 11)
        draws = all_draws(source, phase.steps)
        blocks = draws["source"].reshape(-1, plan.block_size)
        assert len(blocks) == phase.blocks
        expected = [s.block_sequences for s in phase.sources if s.block_sequences]
        for block in blocks:
            assert np.bincount(block, minlength=len(expected)).tolist() == expected
        # The order inside blocks is shuffled, and not the same in every block.
        assert len({tuple(b) for b in blocks}) > len(blocks) // 2


@pytest.mark.parametrize(("batch_size", "block_size"), [(8, 32), (24, 8), (12, 8), (16, 16)])
def test_block_counts_hold_whatever_the_batch_and_block_sizes(tmp_path, tokens_dir, batch_size, block_size):
    spec = SPEC.replace("batch_size: 8", f"batch_size: {batch_size}").replace(
        "block_size: 32", f"block_size: {block_size}"
    )
    plan = plan_mixture(load_mixture_text(spec), load_counts(os.path.join(tokens_dir, "counts.json")))
    phase = plan.phases[0]
    source = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 1)
    draws = all_draws(source, phase.steps)
    expected = [s.block_sequences for s in phase.sources]
    for block in draws["source"].reshape(-1, block_size):
        assert np.bincount(block, minlength=3).tolist() == expected


def test_source_frequencies_match_the_weights(plan, tokens_dir):
    for phase in plan.phases:
        source = MixtureSource.from_plan(plan, phase.name, tokens_dir, 2)
        draws = all_draws(source, phase.steps)
        seen = Counter(source.sources[i].name for i in draws["source"].tolist())
        for planned in phase.sources:
            realized = seen[planned.name] / len(draws["source"])
            assert realized == pytest.approx(planned.weight)  # exact: block_sequences / block_size
            assert realized == pytest.approx(planned.weight_requested, abs=1 / plan.block_size)
            # The plan's tokens are exactly what is drawn.
            assert seen[planned.name] * plan.sequence_length == planned.tokens


def test_a_full_epoch_draws_every_window_once(plan, tokens_dir):
    source = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 3)
    draws = all_draws(source, source.steps)
    for i, src in enumerate(source.sources):
        mine = draws["source"] == i
        # The phase's draws of a source are consecutive: 0, 1, ... in some order.
        assert np.array_equal(np.sort(draws["draw"][mine]), np.arange(mine.sum()))
        n = src.num_windows
        assert mine.sum() > n  # the fixture repeats every source
        full_epochs = int(mine.sum()) // n
        for epoch in range(full_epochs):
            in_epoch = mine & (draws["epoch"] == epoch)
            assert np.array_equal(np.sort(draws["window"][in_epoch]), np.arange(n))
        # Each epoch is a new order.
        first = src.windows(np.arange(n))
        second = src.windows(np.arange(n, 2 * n))
        assert np.array_equal(np.sort(second), np.arange(n)) and not np.array_equal(first, second)


def test_midtraining_continues_each_source_where_pretraining_left_it(plan, tokens_dir):
    pre = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 4)
    mid = MixtureSource.from_plan(plan, "midtraining", tokens_dir, 4)
    pre_draws, mid_draws = all_draws(pre, pre.steps), all_draws(mid, mid.steps)
    for i, src in enumerate(mid.sources):
        used = int((pre_draws["source"] == [s.name for s in pre.sources].index(src.name)).sum())
        assert src.draw_offset == used
        mine = mid_draws["draw"][mid_draws["source"] == i]
        assert mine.min() == used and np.array_equal(np.sort(mine), np.arange(used, used + len(mine)))
        # Same windows for the same draw number, whichever phase draws it.
        assert np.array_equal(
            src.windows(np.arange(used)), pre.sources[pre_draws_index(pre, src.name)].windows(np.arange(used))
        )


def pre_draws_index(source: MixtureSource, name: str) -> int:
    return [s.name for s in source.sources].index(name)


def test_resume_from_a_step_gives_equal_batches(plan, tokens_dir):
    first = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 9)
    run = [first.batch(step) for step in range(40)]
    # A new process that starts at step 25, and one that asks in a scrambled order.
    resumed = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 9)
    for step in range(25, 40):
        batch = resumed.batch(step)
        assert np.array_equal(batch.tokens, run[step].tokens)
        assert np.array_equal(batch.segment_ids, run[step].segment_ids)
    scrambled = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 9)
    for step in np.random.default_rng(0).permutation(40).tolist():
        assert np.array_equal(scrambled.batch(step).tokens, run[step].tokens)
    other_seed = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 10)
    assert not np.array_equal(other_seed.batch(0).tokens, run[0].tokens)


@pytest.mark.parametrize("processes", [2, 4, 8])
def test_host_slices_are_disjoint_and_cover_the_batch(plan, tokens_dir, processes):
    whole = MixtureSource.from_plan(plan, "midtraining", tokens_dir, 6)
    hosts = [
        MixtureSource.from_plan(plan, "midtraining", tokens_dir, 6, i, processes) for i in range(processes)
    ]
    for step in (0, 1, 17, whole.steps - 1):
        parts = [host.draws(step) for host in hosts]
        rows = np.concatenate([p.rows for p in parts])
        assert np.array_equal(rows, np.arange(plan.batch_size))  # disjoint, in order, covering
        pairs = {(int(s), int(d)) for p in parts for s, d in zip(p.source, p.draw, strict=True)}
        assert len(pairs) == plan.batch_size  # no draw twice
        tokens = np.concatenate([host.batch(step).tokens for host in hosts])
        assert np.array_equal(tokens, whole.batch(step).tokens)
    with pytest.raises(ValueError, match="divisible"):
        MixtureSource.from_plan(plan, "midtraining", tokens_dir, 6, 0, 3)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 6),
    width=st.integers(1, 70),
    density=st.sampled_from([0.0, 0.01, 0.1, 0.5, 1.0]),
    seed=st.integers(0, 2**32),
)
def test_segment_ids_equal_the_trainers_definition(rows, width, density, seed):
    # The definition (data.batch.Batch): an exclusive cumulative count of end-of-text tokens per row.
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 50, size=(rows, width)).astype(np.int32)
    tokens[rng.random((rows, width)) < density] = EOS
    is_eos = (tokens == EOS).astype(np.int32)
    definition = np.cumsum(is_eos, axis=-1) - is_eos
    assert np.array_equal(segments_from_eos(tokens, EOS), definition)
    assert segments_from_eos(tokens, EOS).dtype == np.int32


def test_segment_ids_change_after_end_of_text(plan, tokens_dir):
    batch = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 0).batch(3)
    for tokens, segments in zip(batch.tokens, batch.segment_ids, strict=True):
        steps = np.flatnonzero(np.diff(segments))
        assert np.array_equal(steps, np.flatnonzero(tokens[:-1] == EOS))
        assert segments[0] == 0


def test_vectorized_draws_equal_each_sources_own_windows(plan, tokens_dir):
    source = MixtureSource.from_plan(plan, "midtraining", tokens_dir, 12)
    draws = all_draws(source, source.steps)
    for i, src in enumerate(source.sources):
        mine = draws["source"] == i
        assert np.array_equal(draws["window"][mine], src.windows(draws["draw"][mine]))


@pytest.mark.parametrize("reader", ["mmap", "direct"])
def test_readahead_and_prefetch_change_no_batch(plan, tokens_dir, reader, request):
    if reader == "direct":
        request.getfixturevalue("direct_reads")
    plain = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 3, reader=reader, readahead_tokens=0)
    ahead = MixtureSource.from_plan(
        plan, "pretraining", tokens_dir, 3, reader=reader, readahead_tokens=1 << 20
    )
    busy = PrefetchedBatches(ahead, batches=3)
    assert plain.reader == ahead.reader == reader
    assert plain.readahead_batches == 0 and ahead.readahead_batches > 0
    assert isinstance(busy, BatchSource) and busy.vocab_size == plain.vocab_size
    # In order, then jumps back and forward (a resume), then in order again.
    for step in [*range(12), 4, 5, 30, 31, 32, 2, 3, 4, 5, 6]:
        a, b = plain.batch(step), busy.batch(step)
        assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.segment_ids, b.segment_ids)
    assert sorted(busy._pending) == [7, 8, 9]
    assert all(s > 6 for s in ahead._ahead) and len(ahead._ahead) <= ahead.readahead_batches + 3
    busy.close()
    assert np.array_equal(busy.batch(40).tokens, plain.batch(40).tokens)  # still works without helpers
    busy.close()


@pytest.fixture(scope="module")
def direct_reads(tokens_dir) -> None:
    """Skips where this system or the test directory's filesystem refuses O_DIRECT with native AIO."""
    try:
        reader = DirectReader()
        try:
            reader.open(next(Path(tokens_dir).rglob("*.bin")).as_posix())
        finally:
            reader.close()
    except DirectIOUnavailable as error:
        pytest.skip(f"direct reads are not available here: {error}")


def spans_a_shard(source: MixtureSource, where) -> np.ndarray:
    """Which rows' windows span two shards (read in two pieces)."""
    begin = source._begin(where)
    stream = source._stream
    part = np.searchsorted(stream.starts, begin, side="right") - 1
    return begin + stream.width > stream.starts[part + 1]


@pytest.mark.parametrize("shuffle", [None, BlockShuffle(4, 2)], ids=["uniform", "block_shuffle"])
def test_direct_reads_give_the_batches_of_the_memory_maps(plan, tokens_dir, direct_reads, shuffle):
    spanning = 0
    for phase in plan.phases:
        name = phase.name
        mapped = MixtureSource.from_plan(plan, name, tokens_dir, 5, reader="mmap", block_shuffle=shuffle)
        direct = MixtureSource.from_plan(plan, name, tokens_dir, 5, reader="direct", block_shuffle=shuffle)
        alone = MixtureSource.from_plan(
            plan,
            name,
            tokens_dir,
            5,
            reader="direct",
            block_shuffle=shuffle,
            readahead_tokens=0,
        )
        assert (mapped.reader, direct.reader, alone.reader) == ("mmap", "direct", "direct")
        assert "direct reads" in repr(direct)
        for step in [*range(direct.steps), 3, 2, direct.steps + 5]:
            a, b, c = mapped.batch(step), direct.batch(step), alone.batch(step)
            assert np.array_equal(a.tokens, b.tokens) and np.array_equal(a.tokens, c.tokens)
            assert np.array_equal(a.segment_ids, b.segment_ids)
            spanning += int(spans_a_shard(direct, direct.draws(step)).sum())
        for source in (mapped, direct, alone):
            source.close()
    assert spanning > 0  # windows that span two shards were read in pieces


def test_staged_reads_are_aligned_and_merge_neighbouring_windows(plan, tokens_dir):
    source = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 0, reader="mmap")
    stream = source._stream
    length, width = stream.sequence_length, stream.width
    everything = stream.read(0, stream.num_tokens)
    rng = np.random.default_rng(0)
    # Every window once (neighbours touch: merged), a window twice, and windows across shard boundaries.
    begin = np.concatenate([np.arange(stream.num_windows) * length, [length * 7]])
    for align in (512, 4096):
        for windows in (begin, rng.permutation(begin)[:40]):
            reads = stream.staged_reads(windows, align)
            assert (reads.offsets % align == 0).all() and (reads.sizes % align == 0).all()
            assert (reads.buffer_offsets % 4096 == 0).all() and reads.buffer_bytes % 4096 == 0
            assert (reads.needed <= reads.sizes).all()
            if windows is begin:
                assert len(reads.offsets) < len(stream.paths) * 2  # contiguous windows: one read a shard
                assert len(reads.pieces) == len(stream.paths) - 1  # one window spans each boundary
            # Do the reads with plain preads, then gather.
            buffer = np.zeros(reads.buffer_bytes, dtype=np.uint8)
            for i in range(len(reads.offsets)):
                with open(stream.paths[reads.path_index[i]], "rb") as handle:
                    data = os.pread(handle.fileno(), int(reads.sizes[i]), int(reads.offsets[i]))
                assert len(data) >= reads.needed[i]
                at = int(reads.buffer_offsets[i])
                buffer[at : at + len(data)] = np.frombuffer(data, dtype=np.uint8)
            out = np.empty((len(windows), width), dtype=np.int32)
            stream.gather_staged(reads, buffer, out)
            expected = np.stack([everything[b : b + width] for b in windows.tolist()])
            assert np.array_equal(out, expected)


def test_auto_falls_back_to_memory_maps_where_o_direct_is_refused(plan, tokens_dir, direct_reads):
    stream = copy.copy(MixtureSource.from_plan(plan, "pretraining", tokens_dir, 0, reader="mmap")._stream)
    # procfs refuses O_DIRECT, as some FUSE filesystems do.
    stream.paths = [*stream.paths[:-1], "/proc/self/status"]
    assert open_reads(stream, "auto", helpers=False).kind == "mmap"
    with pytest.raises(DirectIOUnavailable, match="/proc/self/status"):
        open_reads(stream, "direct", helpers=False)
    with pytest.raises(ValueError, match="reader 'fast'"):
        open_reads(stream, "fast", helpers=False)


def test_byte_ranges_cover_the_windows(plan, tokens_dir):
    web = next(
        s for s in MixtureSource.from_plan(plan, "pretraining", tokens_dir, 0).sources if s.name == "web"
    )
    stream, width = web.stream, web.stream.width
    windows = np.arange(web.stream.num_windows)[::3]
    ranges = stream.byte_ranges(windows)
    covered = {}
    for path, starts, stops in ranges:
        assert starts == sorted(starts) and all(a < b for a, b in zip(starts, stops, strict=True))
        assert all(stop <= os.path.getsize(path) for stop in stops)
        covered[path] = list(zip(starts, stops, strict=True))
    # Every window's bytes lie in the ranges of the shards it spans.
    for window in windows.tolist():
        begin, end = window * stream.sequence_length, window * stream.sequence_length + width
        for part, path in enumerate(stream.paths):
            lo, hi = max(begin, stream.starts[part]), min(end, stream.starts[part + 1])
            if lo < hi:
                lo, hi = (lo - stream.starts[part]) * 2, (hi - stream.starts[part]) * 2
                assert any(a <= lo and hi <= b for a, b in covered[path])
    assert advise(ranges) == sum(len(starts) for _, starts, _ in ranges)


def test_block_shuffle_is_off_by_default_and_changes_only_the_order(plan, tokens_dir):
    uniform = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 0)
    assert all(s.block_shuffle is None for s in uniform.sources)
    shuffled = MixtureSource.from_plan(plan, "pretraining", tokens_dir, 0, block_shuffle=BlockShuffle(8, 2))
    a, b = all_draws(uniform, uniform.steps), all_draws(shuffled, shuffled.steps)
    assert np.array_equal(a["source"], b["source"]) and np.array_equal(a["draw"], b["draw"])
    assert not np.array_equal(a["window"], b["window"])
    for i, src in enumerate(shuffled.sources):
        first = (b["source"] == i) & (b["epoch"] == 0)
        assert np.array_equal(np.sort(b["window"][first]), np.arange(src.num_windows))


# --- slices, errors -------------------------------------------------------------------------------------


def test_a_slice_draws_from_a_fixed_subset(tmp_path, tokens_dir):
    (tmp_path / "parent.yaml").write_text(
        SPEC.replace("80K", "400K").replace("max_epochs: 20", "max_epochs: 99")
    )
    (tmp_path / "slice.yaml").write_text("name: small\nslice_of: parent.yaml\ntotal_tokens: 80K\n")
    plan = plan_mixture(
        load_mixture(tmp_path / "slice.yaml"), load_counts(os.path.join(tokens_dir, "counts.json"))
    )
    assert plan.slice is not None and plan.slice.fraction == pytest.approx(0.2)
    for phase in plan.phases:
        source = MixtureSource.from_plan(plan, phase.name, tokens_dir, 8)
        draws = all_draws(source, phase.steps)
        for i, src in enumerate(source.sources):
            total = plan.sources[src.name]
            assert (
                src.num_windows
                == src.stream.num_windows * total.tokens_available // total.tokens_available_full
            )
            subset = set(src.windows(np.arange(src.num_windows)).tolist())
            assert len(subset) == src.num_windows < src.stream.num_windows
            mine = draws["window"][draws["source"] == i]
            assert set(mine.tolist()) <= subset  # every epoch, every phase: the same subset
            assert len(mine) > src.num_windows  # repeats: more than an epoch
    # The subset is keyed by the seed, like every other choice.
    first, other = (
        MixtureSource.from_plan(plan, "pretraining", tokens_dir, seed).sources[0] for seed in (8, 9)
    )
    assert set(first.windows(np.arange(first.num_windows)).tolist()) != set(
        other.windows(np.arange(other.num_windows)).tolist()
    )


def test_mixed_tokenizers_are_refused_naming_both_hashes(tmp_path, plan):
    root = make_tokens(tmp_path / "tokens")
    other = "b" * 64
    manifest_path = root / "domain=code/quality=2" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tokenizer"]["sha256"] = other
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ShardError) as error:
        MixtureSource.from_plan(plan, "pretraining", str(root), 0)
    assert SHA in str(error.value) and other in str(error.value) and "code" in str(error.value)


def test_a_plan_for_another_tokenizer_is_refused(plan, tokens_dir):
    wrong = plan.model_copy(update={"tokenizer_sha256": "c" * 64})
    with pytest.raises(ShardError, match=f"{'c' * 64}.*{SHA}"):
        MixtureSource.from_plan(wrong, "pretraining", tokens_dir, 0)


def test_plan_errors_are_clear(plan, tokens_dir):
    with pytest.raises(ValueError, match="phase 'cooldown' is not in the plan"):
        MixtureSource.from_plan(plan, "cooldown", tokens_dir, 0)
    missing = plan.to_json()
    missing["phases"][0]["sources"][1]["cells"] = ["domain=code/quality=0"]
    with pytest.raises(ValueError, match="cell domain=code/quality=0 is not in"):
        MixtureSource.from_plan(plan_from_json(missing), "pretraining", tokens_dir, 0)
    with pytest.raises(ValueError, match="negative"):
        MixtureSource.from_plan(plan, "pretraining", tokens_dir, 0).batch(-1)


def test_a_plan_file_reads_back_to_the_same_batches(tmp_path, plan, tokens_dir):
    # `tokenmill train --data.plan` reads the file `tokenmill mixture plan --json` wrote: the same batches.
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan.to_json(), indent=2) + "\n")
    read_back = read_plan(str(path))
    typed, parsed = (MixtureSource.from_plan(p, "midtraining", tokens_dir, 4) for p in (plan, read_back))
    assert np.array_equal(typed.batch(3).tokens, parsed.batch(3).tokens)
    assert typed.phase == parsed.phase == plan.phase("midtraining")
    # A hand-edited plan that breaks the format is refused on read, before any shard is opened, naming the
    # file and the field.
    broken = plan.to_json()
    broken["phases"][1]["sources"][0]["block_sequences"] = "4"
    del broken["batch_size"]
    path.write_text(json.dumps(broken))
    with pytest.raises(
        FormatError, match=r"no 'batch_size'.*phases\[1\]\.sources\[0\]\.block_sequences"
    ) as error:
        read_plan(str(path))
    assert error.value.path == str(path)


def test_plans_without_block_sequences_use_largest_remainder(plan, tokens_dir):
    old = plan.to_json()
    for phase in old["phases"]:
        for source in phase["sources"]:
            source.pop("block_sequences")
            source["weight"] = source.pop("weight_requested")
        phase.pop("blocks")
    new, legacy = (
        MixtureSource.from_plan(plan, "midtraining", tokens_dir, 0),
        MixtureSource.from_plan(plan_from_json(old), "midtraining", tokens_dir, 0),
    )
    assert [s.block_sequences for s in legacy.sources] == [s.block_sequences for s in new.sources]
    assert [s.draw_offset for s in legacy.sources] == [s.draw_offset for s in new.sources]
    assert np.array_equal(legacy.batch(5).tokens, new.batch(5).tokens)


@pytest.mark.slow
def test_the_trainer_trains_on_a_plan_and_resumes(tmp_path, plan, tokens_dir):
    from conftest import run_tokenmill

    write_plan(str(tmp_path / "plan.json"), plan)
    args = [
        "train",
        "--data.plan",
        str(tmp_path / "plan.json"),
        "--data.tokens",
        tokens_dir,
        "--data.phase",
        "pretraining",
    ]
    args += [
        "--model",
        "configs/models/tiny.yaml",
        "--output",
        str(tmp_path / "run"),
        "--checkpoint.every",
        "2",
    ]
    run_tokenmill(*args, "--schedule.steps", "2")
    run_tokenmill(*args, "--schedule.steps", "4")  # resumes from the step-2 checkpoint
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [0, 1, 2, 3]
    assert all(row["tokens"] == (row["step"] + 1) * plan.tokens_per_step for row in rows)
