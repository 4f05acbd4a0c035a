"""Keyed permutations: the pure functions the sampler draws with (docs/sampler.md, "Inside a source").

`permute(index, size, key)` is element i's place in a keyed permutation of range(size): a Feistel network
over the next power of two with cycle walking, vectorised over arrays of (index, size, key). `mix64` and
`derive_key` make the keys; `BlockShuffle` trades uniformity for contiguous reads.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FEISTEL_ROUNDS = 6
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


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


def granular_permute(index: np.ndarray, size: int, key: int | np.ndarray, granule: int) -> np.ndarray:
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
