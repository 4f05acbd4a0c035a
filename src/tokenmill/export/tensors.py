"""Safetensors files without torch: a model's tensors written in size-bounded shards, one shard at a time,
with the index that Hugging Face loaders read (`model.safetensors.index.json`), and read back.

The shards are planned from the tensors' shapes before any is made: a tensor comes from a callable and is
built only when its shard is written, so memory holds one shard's tensors (and its serialised bytes) at a
time. Each shard is written to a temporary name and renamed into place (tokenmill.storage.atomic_write; on
gs:// one upload), so a folder never holds a half-written shard under its final name.

bfloat16 is NumPy's `ml_dtypes.bfloat16` (JAX's own), rounded to nearest even from fp32. The reader parses
the format itself (an 8-byte little-endian header length, a JSON header, the raw bytes), because
safetensors' NumPy API writes BF16 but cannot read it back.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from tokenmill import storage

INDEX = "model.safetensors.index.json"
# Hugging Face's default shard bound (save_pretrained's max_shard_size="5GB" counts in 10^9 bytes).
DEFAULT_SHARD_BYTES = 5_000_000_000
DTYPES = {"fp32": np.dtype(np.float32), "bf16": np.dtype(ml_dtypes.bfloat16)}
SAFETENSORS_DTYPES = {"F32": np.float32, "BF16": ml_dtypes.bfloat16, "F16": np.float16, "I64": np.int64}
FLOATS = ("F32", "BF16", "F16")


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its name in the folder, its shape, and how to make it (fp32, that shape).
    `fp32`: kept in fp32 whatever the folder's dtype (the router, which tokenmill and transformers both run
    in fp32: a rounded router bias would change which experts tokens choose)."""

    name: str
    shape: tuple[int, ...]
    make: Callable[[], np.ndarray]
    fp32: bool = False

    def dtype(self, dtype: str) -> np.dtype:
        return DTYPES["fp32"] if self.fp32 else DTYPES[dtype]


def plan_shards(specs: Sequence[TensorSpec], dtype: str, max_bytes: int) -> list[list[TensorSpec]]:
    """The specs cut, in order, into shards of at most `max_bytes` (a tensor larger than that alone)."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = int(np.prod(spec.shape, dtype=np.int64)) * spec.dtype(dtype).itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    return shards


def write_sharded(
    specs: Sequence[TensorSpec], folder: str, dtype: str = "fp32", max_bytes: int = DEFAULT_SHARD_BYTES
) -> list[str]:
    """Write `specs` as model-0000i-of-0000n.safetensors in `folder` and the index; returns the files written
    (shards, then the index). Memory grows with one shard: its tensors and their serialised bytes."""
    from safetensors.numpy import save

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    names = [spec.name for spec in specs]
    if len(set(names)) != len(names):
        raise ValueError("tensor names repeat")
    shards = plan_shards(specs, dtype, max_bytes)
    weight_map: dict[str, str] = {}
    written = []
    total = 0
    for number, shard in enumerate(shards, start=1):
        filename = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for spec in shard:
            array = np.asarray(spec.make(), np.float32)
            if array.shape != spec.shape:
                raise ValueError(f"{spec.name}: made {array.shape}, planned {spec.shape}")
            tensors[spec.name] = np.ascontiguousarray(array.astype(spec.dtype(dtype)))
            weight_map[spec.name] = filename
            total += tensors[spec.name].nbytes
        data = save(tensors, metadata={"format": "pt"})
        del tensors
        with storage.atomic_write(storage.join(folder, filename), "wb") as handle:
            handle.write(data)
        written.append(filename)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    storage.write_json(storage.join(folder, INDEX), index)
    return [*written, INDEX]


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of one safetensors file, as float32 (or its integer type) NumPy arrays."""
    with storage.open_file(path, "rb") as handle:
        data = handle.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    body = memoryview(data)[8 + length :]
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if entry["dtype"] not in SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: {name} has dtype {entry['dtype']}, which tokenmill does not read")
        start, end = entry["data_offsets"]
        array = np.frombuffer(body[start:end], SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])
        tensors[name] = array.astype(np.float32) if entry["dtype"] in FLOATS else array.copy()
    return tensors


def read_folder_tensors(folder: str) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of a sharded folder (its index) or of a single model.safetensors."""
    index_path = storage.join(folder, INDEX)
    if storage.exists(index_path):
        files = sorted(set(storage.read_json(index_path)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    for filename in files:
        yield from read_safetensors(storage.join(folder, filename)).items()
