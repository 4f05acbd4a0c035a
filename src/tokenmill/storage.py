"""Files on local disk or any fsspec filesystem (gs://, s3://, memory://), written atomically.

Every stage writes through `atomic_write`: the bytes go to a temporary name beside the target and are
renamed into place, so a reader never sees half a file and a killed job leaves only temporary names,
which `remove_temporaries` clears on the next run. Object stores have no rename, but an object only
appears once its upload completes, so there each file is uploaded in one call once it is complete.

Remote paths go through fsspec; gs:// through gcsfs, one of tokenmill's own dependencies, so that the
launcher and every Dataflow worker (which installs those, not extras) have it. Credentials are
gcsfs's defaults: Application Default Credentials on the launcher, the worker service account on
Dataflow. `STORAGE_EMULATOR_HOST` points gcsfs at a local GCS emulator (the tests do that).
"""

from __future__ import annotations

import contextlib
import glob as globlib
import io
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import IO, Any

import fsspec

log = logging.getLogger(__name__)

TEMPORARY_PREFIX = ".tmp-"


def is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def local_path(path: str) -> str:
    return path[len("file://") :] if path.startswith("file://") else path


def join(base: str, *parts: str) -> str:
    if is_local(base):
        return os.path.join(local_path(base), *parts)
    return "/".join([base.rstrip("/"), *[p.strip("/") for p in parts]])


#: Attempts at one read of a remote file before its error propagates, and the first wait between them
#: (doubled each time: 0.5, 1, 2, 4 s, about 8 s in all before the runner's own retry of the bundle).
READ_ATTEMPTS = 5
READ_BACKOFF_SECONDS = 0.5
#: Storage errors that retrying cannot fix: the object is not there, or not ours to read.
PERMANENT_ERRORS = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
READ_BUFFER_BYTES = 1 << 20


def is_transient(error: BaseException) -> bool:
    """Whether a storage error may go away on a retry: any OSError (connection resets, timeouts, I/O
    errors of the transport) but the permanent ones."""
    return isinstance(error, OSError) and not isinstance(error, PERMANENT_ERRORS)


class RetryingReader(io.RawIOBase):
    """A remote file opened for reading that survives transient storage errors.

    On a transient OSError (`is_transient`) while opening, reading or seeking, the file is reopened and
    sought to the offset that the caller had reached, after an exponential backoff; after READ_ATTEMPTS
    the error propagates, so the runner retries the bundle (and fails the job if it keeps failing): a
    read is never silently cut short. gcsfs retries HTTP errors itself; this covers what breaks below it
    (a reset connection mid-object). Memory: what the underlying fsspec file buffers (its block cache).
    """

    def __init__(
        self,
        path: str,
        attempts: int | None = None,
        backoff_seconds: float | None = None,
    ):
        super().__init__()
        self.path = path
        self.attempts = attempts if attempts is not None else READ_ATTEMPTS
        self.backoff_seconds = backoff_seconds if backoff_seconds is not None else READ_BACKOFF_SECONDS
        self.retries = 0  # transient errors survived, for logs and tests
        self._position = 0
        self._handle: Any = None
        self._retrying(lambda handle: None)  # open now: a missing file fails here, as open() does

    def _retrying(self, operation: Any) -> Any:
        for attempt in range(self.attempts):
            try:
                if self._handle is None:
                    fs, fs_path = filesystem(self.path)
                    handle = fs.open(fs_path, "rb")
                    if self._position:
                        handle.seek(self._position)
                    self._handle = handle
                return operation(self._handle)
            except OSError as error:
                if not is_transient(error) or attempt + 1 == self.attempts:
                    raise
                self._discard()
                self.retries += 1
                delay = self.backoff_seconds * 2**attempt
                log.warning(
                    "%s: %s at byte %d; reopening in %.1f s (attempt %d of %d)",
                    self.path,
                    error.__class__.__name__,
                    self._position,
                    delay,
                    attempt + 2,
                    self.attempts,
                )
                time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _discard(self) -> None:
        handle, self._handle = self._handle, None
        if handle is not None:
            with contextlib.suppress(Exception):
                handle.close()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        data = self._retrying(lambda handle: handle.read(size if size is not None and size >= 0 else -1))
        self._position += len(data)
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        self._position = self._retrying(lambda handle: handle.seek(offset, whence))
        return self._position

    def tell(self) -> int:
        return self._position

    def close(self) -> None:
        self._discard()
        super().close()


def open_file(path: str, mode: str = "rb") -> IO[Any]:
    """Open a local or remote file (no compression is inferred).

    A remote file opened "rb" reads through a RetryingReader (buffered, so lines and small reads are
    cheap): transient errors mid-stream are retried from the offset reached, others propagate.
    """
    if is_local(path):
        return open(local_path(path), mode)
    if mode == "rb":
        return io.BufferedReader(RetryingReader(path), buffer_size=READ_BUFFER_BYTES)
    return fsspec.open(path, mode).open()


def exists(path: str) -> bool:
    if is_local(path):
        return os.path.exists(local_path(path))
    fs, fs_path = filesystem(path)
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
    fs, fs_path = filesystem(pattern)
    protocol = pattern.split("://", 1)[0]
    # detail=True: the listing already says which entries are files (no request per match).
    matches = fs.glob(fs_path, detail=True)
    return sorted(f"{protocol}://{p}" for p, info in matches.items() if info.get("type") == "file")


@contextlib.contextmanager
def atomic_write(path: str, mode: str = "wb") -> Iterator[IO[Any]]:
    """Write `path` so that it either appears complete or not at all."""
    if not is_local(path):
        # Closing an fsspec write handle commits what was written so far, even when the block raised, so
        # the bytes are staged in a local temporary file and uploaded in one call after the block succeeds.
        fs, fs_path = filesystem(path)
        handle_fd, staged = tempfile.mkstemp(prefix=TEMPORARY_PREFIX)
        try:
            with os.fdopen(handle_fd, mode) as handle:
                yield handle
            fs.put_file(staged, fs_path)
        finally:
            os.remove(staged)
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
    if not is_local(path):
        fs, fs_path = filesystem(path)
        fs.pipe_file(fs_path, data)  # one upload: the object appears whole or not at all
        return
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


def filesystem(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem of `path` and the path in its terms (bucket/key for gs://).

    Listings are not cached: the workers of a job write objects that this process must see at once (a
    cached listing of a folder hides them, and a cached size of an object that was since rewritten cuts
    reads short).
    """
    if is_local(path):
        return fsspec.filesystem("file"), local_path(path)
    return fsspec.core.url_to_fs(path, use_listings_cache=False)


def list_files(prefix: str, relative: bool = False) -> list[str]:
    """Every file below the folder `prefix`, at any depth, sorted: full paths named as `prefix` names
    them, or with `relative`, paths relative to `prefix` with "/" separators.

    A missing folder lists as empty. Temporary files of unfinished local writers are included: the caller
    decides what they mean.
    """
    if is_local(prefix):
        root = local_path(prefix)
        found = []
        for directory, _, names in os.walk(root):
            found.extend(os.path.join(directory, name) for name in names)
        if relative:
            return sorted(os.path.relpath(path, root).replace(os.sep, "/") for path in found)
        return sorted(found)
    fs, fs_path = filesystem(prefix)
    root = fs_path.rstrip("/") + "/"
    # The trailing slash keeps `out/curated` from matching `out/curated-old/...`.
    found = [path for path in fs.find(root) if path.startswith(root)]
    if relative:
        return sorted(path[len(root) :] for path in found)
    protocol = prefix.split("://", 1)[0]
    return sorted(f"{protocol}://{path}" for path in found)


def is_dir_nonempty(path: str) -> bool:
    """Whether the folder `path` holds at least one file (at any depth); False if it does not exist."""
    if is_local(path):
        root = local_path(path)
        if not os.path.isdir(root):
            return False
        return any(names for _, _, names in os.walk(root))
    fs, fs_path = filesystem(path)
    try:
        # One listing page of the folder's first level is enough: object stores have no empty folders.
        return bool(fs.ls(fs_path.rstrip("/") + "/", detail=False))
    except FileNotFoundError:
        return False


def remove_file(path: str) -> bool:
    """Delete one file if it exists; returns whether there was one."""
    if is_local(path):
        try:
            os.remove(local_path(path))
        except FileNotFoundError:
            return False
        return True
    fs, fs_path = filesystem(path)
    try:
        fs.rm_file(fs_path)
    except FileNotFoundError:
        return False
    return True


def remove_tree(path: str) -> int:
    """Delete the folder `path` and everything below it (every object under the prefix `path/` on an
    object store; never `path-other/`); returns how many files were removed, 0 if it did not exist."""
    if is_local(path):
        root = local_path(path)
        if not os.path.isdir(root):
            return 0
        count = sum(len(names) for _, _, names in os.walk(root))
        shutil.rmtree(root)
        return count
    files = list_files(path)
    if files:
        fs, _ = filesystem(path)
        fs.rm([filesystem(file)[1] for file in files])
    return len(files)


def cache_dir() -> str:
    """Where `local_copy` keeps its downloads: $TOKENMILL_CACHE_DIR, else $XDG_CACHE_HOME/tokenmill (or
    ~/.cache/tokenmill), under remote-files/."""
    base = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "tokenmill"
    )
    return os.path.join(base, "remote-files")


def local_copy(path: str) -> str:
    """A local path with the bytes of the file `path`: the path itself when local, else a cached download.

    For libraries that can only load from a local path (fastText models, the decontamination index,
    ...). A remote file is downloaded once per machine into `cache_dir()`, under a key made of its path,
    size and version (the object's generation or etag, else its modification time), and keeps its base
    name there (libraries that look at the extension still work). A changed object gets a new key, so a
    stale copy is never returned. The download goes to a temporary name and is renamed into place after
    its size is checked, under a file lock, so the worker processes of one machine download it once
    between them and never see half a file. Raises FileNotFoundError if `path` does not exist.
    """
    if is_local(path):
        local = local_path(path)
        if not os.path.isfile(local):
            raise FileNotFoundError(f"{path}: no such file")
        return local
    import fcntl
    import hashlib

    fs, fs_path = filesystem(path)
    info = fs.info(fs_path)  # FileNotFoundError names the path
    if info.get("type") != "file":
        raise FileNotFoundError(f"{path}: not a file")
    size = int(info["size"])
    version = next(
        (
            str(info[key])
            for key in ("generation", "etag", "ETag", "md5Hash", "mtime", "LastModified", "updated")
            if info.get(key)
        ),
        "",
    )
    key = hashlib.sha256(json.dumps([path, size, version]).encode()).hexdigest()[:32]
    directory = os.path.join(cache_dir(), key)
    target = os.path.join(directory, os.path.basename(fs_path.rstrip("/")) or "file")
    if os.path.isfile(target) and os.path.getsize(target) == size:
        return target
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the lock file closes
        if os.path.isfile(target) and os.path.getsize(target) == size:
            return target  # another process fetched it while this one waited
        temporary = os.path.join(directory, f"{TEMPORARY_PREFIX}{uuid.uuid4().hex}")
        try:
            fs.get_file(fs_path, temporary)
            got = os.path.getsize(temporary)
            if got != size:
                raise OSError(f"{path}: downloaded {got} bytes, the object has {size}")
            os.replace(temporary, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temporary)
    return target
