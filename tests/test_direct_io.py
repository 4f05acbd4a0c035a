"""Tests for tokenmill.trainer.data.direct_io: O_DIRECT reads through Linux native AIO, on real files."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tokenmill.trainer.data.direct_io import PAGE, DirectIOUnavailable, DirectReader, aligned_buffer


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    """Three files of random bytes, one not a multiple of the block size (reads past its end are short)."""
    root = tmp_path_factory.mktemp("direct")
    rng = np.random.default_rng(0)
    paths = []
    for n, size in enumerate([1 << 20, 3 * PAGE + 1234, 200_000]):
        path = root / f"file-{n}.bin"
        path.write_bytes(rng.integers(0, 256, size=size, dtype=np.uint8).tobytes())
        paths.append(str(path))
    return paths


@pytest.fixture
def reader(files):
    try:
        reader = DirectReader(queue_depth=16)
        reader.open(files[0])
    except DirectIOUnavailable as error:
        pytest.skip(f"O_DIRECT with native AIO is not available here: {error}")
    yield reader
    reader.close()


def random_reads(files: list[str], align: int, count: int, seed: int):
    """Aligned reads at random places of the files, each into its own page-aligned slot."""
    rng = np.random.default_rng(seed)
    sizes_on_disk = [os.path.getsize(p) for p in files]
    path_index = rng.integers(0, len(files), size=count)
    blocks = np.array([sizes_on_disk[i] // align for i in path_index])
    offsets = rng.integers(0, blocks) * align
    sizes = rng.integers(1, 6, size=count) * align
    available = np.array([sizes_on_disk[i] for i in path_index]) - offsets
    needed = np.minimum(sizes, available)
    slots = -(-sizes // PAGE) * PAGE
    buffer_offsets = np.concatenate([[0], np.cumsum(slots)[:-1]])
    return path_index, offsets, sizes, needed, buffer_offsets, int(slots.sum())


@pytest.mark.parametrize("thread", [True, False])
def test_reads_land_byte_for_byte(files, thread):
    try:
        reader = DirectReader(queue_depth=8, thread=thread)  # fewer slots than reads: they queue
    except DirectIOUnavailable as error:
        pytest.skip(str(error))
    try:
        for path in files:
            reader.open(path)
        assert reader.align in (512, PAGE)
        contents = [open(p, "rb").read() for p in files]
        for seed in range(3):
            path_index, offsets, sizes, needed, buffer_offsets, total = random_reads(
                files, reader.align, 100, seed
            )
            buffer = aligned_buffer(total)
            assert buffer.ctypes.data % PAGE == 0
            done = reader.submit(files, path_index, offsets, sizes, buffer, buffer_offsets, needed)
            done.result(timeout=30)
            for i in range(len(offsets)):
                at, got = int(buffer_offsets[i]), int(needed[i])
                expected = contents[path_index[i]][offsets[i] : offsets[i] + got]
                assert buffer[at : at + got].tobytes() == expected
    finally:
        reader.close()


def test_many_requests_in_flight_complete_independently(files, reader):
    futures, buffers = [], []
    for seed in range(10):
        reads = random_reads(files, reader.align, 20, seed)
        path_index, offsets, sizes, needed, buffer_offsets, total = reads
        buffers.append(aligned_buffer(total))
        futures.append(reader.submit(files, path_index, offsets, sizes, buffers[-1], buffer_offsets, needed))
    assert all(f.result(timeout=30) is None for f in futures)


def test_a_short_read_fails_naming_the_file_and_offset(files, reader):
    path = files[1]  # 3 pages + 1234 bytes
    offset = (os.path.getsize(path) // reader.align) * reader.align
    buffer = aligned_buffer(PAGE)
    one = np.zeros(1, dtype=np.int64)
    future = reader.submit([path], one, one + offset, one + reader.align, buffer, one, one + reader.align)
    with pytest.raises(OSError, match=rf"{os.path.basename(path)} at byte {offset}: read \d+ of"):
        future.result(timeout=30)
    # The reader is still usable after a failed read.
    ok = reader.submit([path], one, one, one + reader.align, buffer, one, one + reader.align)
    assert ok.result(timeout=30) is None
    assert buffer[: reader.align].tobytes() == open(path, "rb").read(reader.align)


def test_a_file_that_refuses_o_direct_is_named(reader):
    # procfs, like some FUSE filesystems, refuses O_DIRECT: the caller falls back to memory maps.
    with pytest.raises(DirectIOUnavailable, match="/proc/self/status"):
        reader.open("/proc/self/status")


def test_close_waits_for_reads_in_flight_and_refuses_new_ones(files):
    try:
        reader = DirectReader(queue_depth=4)
    except DirectIOUnavailable as error:
        pytest.skip(str(error))
    reader.open(files[0])
    path_index, offsets, sizes, needed, buffer_offsets, total = random_reads(files[:1], reader.align, 64, 7)
    buffer = aligned_buffer(total)
    future = reader.submit(files[:1], path_index, offsets, sizes, buffer, buffer_offsets, needed)
    reader.close()
    assert future.done()  # finished (or failed as not started): never left pending
    with pytest.raises(RuntimeError, match="closed"):
        reader.submit(files[:1], path_index, offsets, sizes, buffer, buffer_offsets, needed)
