"""Files on local disk or any fsspec filesystem (gs://, s3://, memory://), written atomically.

Every stage writes through `atomic_write`: the bytes go to a temporary name beside the target and are
renamed into place, so a reader never sees half a file and a killed job leaves only temporary names,
which `remove_temporaries` clears on the next run. Object stores have no rename, but an object only
appears once its upload completes, so there the target is written directly.
"""

from __future__ import annotations

import contextlib
import glob as globlib
import json
import os
import uuid
from collections.abc import Iterator
from typing import IO, Any

import fsspec

TEMPORARY_PREFIX = ".tmp-"


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def join(base: str, *parts: str) -> str:
    if is_local(base):
        return os.path.join(local_path(base), *parts)
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])


def open_file(path: str, mode: str = "rb") -> IO[Any]:
    """Open a local or remote file (no compression is inferred)."""
    if is_local(path):
        return open(local_path(path), mode)
    return fsspec.open(path, mode).open()


def exists(path: str) -> bool:
    if is_local(path):
        return os.path.exists(local_path(path))
    fs, fs_path = fsspec.core.url_to_fs(path)
    return fs.exists(fs_path)


def make_dirs(path: str) -> None:
    if is_local(path):
        os.makedirs(local_path(path), exist_ok=True)


def expand_glob(pattern: str) -> list[str]:
    """Files matching a path or glob, sorted; directories are not returned."""
    if is_local(pattern):
        pattern = local_path(pattern)
        if os.path.isdir(pattern):
            return []
        return sorted(p for p in globlib.glob(pattern, recursive=True) if os.path.isfile(p))
    fs, fs_path = fsspec.core.url_to_fs(pattern)
    protocol = pattern.split("://", 1)[0]
    return sorted(f"{protocol}://{p}" for p in fs.glob(fs_path) if fs.isfile(p))


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb") -> Iterator[IO[Any]]:
    """Write `path` so that it either appears complete or not at all."""
    if not is_local(path):
        with fsspec.open(path, mode) as handle:
            yield handle
        return
    path = local_path(path)
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, exist_ok=True)
    temporary = os.path.join(directory, f"{TEMPORARY_PREFIX}{uuid.uuid4().hex}-{os.path.basename(path)}")
    try:
        with open(temporary, mode) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(temporary)
        raise


def write_bytes(path: str, data: bytes) -> None:
    with atomic_write(path, "wb") as handle:
        handle.write(data)


def write_json(path: str, value: Any) -> None:
    """Write JSON deterministically (sorted keys, fixed indentation, trailing newline)."""
    write_bytes(path, (json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode())


def read_json(path: str) -> Any:
    with open_file(path, "rb") as handle:
        return json.loads(handle.read())


def file_sha256(path: str, chunk_bytes: int = 1 << 20) -> str:
    """sha256 of a file's bytes, read in chunks (checksums in manifests, model cards, data hashes)."""
    import hashlib

    digest = hashlib.sha256()
    with open_file(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def remove_temporaries(root: str) -> int:
    """Delete temporary files left below `root` by killed writers; returns how many were removed."""
    if not is_local(root) or not os.path.isdir(local_path(root)):
        return 0
    removed = 0
    for directory, _, files in os.walk(local_path(root)):
        for name in files:
            if name.startswith(TEMPORARY_PREFIX):
                os.remove(os.path.join(directory, name))
                removed += 1
    return removed
