"""A real Google Cloud Storage emulator on loopback, for the gs:// tests.

`gcp-storage-emulator` (PyPI) serves the GCS JSON API that gcsfs speaks (uploads, ranged reads, listings
with prefixes, deletes) from memory. It runs as a subprocess on 127.0.0.1 on a free port; gcsfs reaches
it through STORAGE_EMULATOR_HOST, which the production code honours as it is (no test switch in it).

The environment the clients get (`GcsEmulator.env`), and why:
- STORAGE_EMULATOR_HOST: gcsfs sends every request to the emulator instead of storage.googleapis.com.
- FSSPEC_GS_TOKEN=anon: fsspec's per-protocol default, so gcsfs sends no credentials and never looks
  for any (Application Default Credentials would otherwise probe the GCE metadata server, off loopback).
- GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false: gcsfs otherwise asks the Storage Control gRPC API for each
  bucket's layout (zonal or hierarchical); the emulator speaks only the JSON API, so every lookup would
  fail and be retried. Plain buckets behave the same with or without it.
- TENSORSTORE_GCS_HTTP_URL and GOOGLE_AUTH_TOKEN_FOR_TESTING: orbax reads and writes a checkpoint's
  arrays through TensorStore's own GCS driver, not gcsfs. The first sends its requests to the emulator;
  the second is TensorStore's fixed bearer token for tests: without it TensorStore looks for Application
  Default Credentials and then waits on the GCE metadata server, which is not there (a restore hung).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

BUCKET = "tokenmill-test"
START_TIMEOUT_S = 30
# The emulator serves one request at a time from a listen backlog of 5 (socketserver's default); the
# connections of many concurrent requests (gcsfs's ranged reads: tokenmill.trainer.data.remote) overflowed it
# and waited out TCP's one-second SYN retransmit. Same server, a deeper backlog: they queue instead.
SERVE = (
    "import socketserver, sys; socketserver.TCPServer.request_queue_size = 1024; "
    "from gcp_storage_emulator.__main__ import main; main(sys.argv[1:])"
)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class GcsEmulator:
    endpoint: str  # http://127.0.0.1:<port>
    bucket: str

    @property
    def env(self) -> dict[str, str]:
        """Environment for a client (this process or a `tokenmill` subprocess) to use the emulator."""
        return {
            "STORAGE_EMULATOR_HOST": self.endpoint,
            "FSSPEC_GS_TOKEN": "anon",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
            "TENSORSTORE_GCS_HTTP_URL": self.endpoint,
            "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        }

    def url(self, *parts: str) -> str:
        return "/".join([f"gs://{self.bucket}", *parts])

    def filesystem(self):
        """A gcsfs filesystem on the emulator, set up explicitly (whatever this process's environment)."""
        from gcsfs.core import GCSFileSystem

        return GCSFileSystem(endpoint_url=self.endpoint, token="anon", use_listings_cache=False)

    def upload(self, local: Path, *parts: str) -> str:
        """Copy a local file, or every file below a local folder, to gs://bucket/parts...; returns the URL."""
        fs = self.filesystem()
        target = self.url(*parts)
        files = [local] if local.is_file() else sorted(p for p in local.rglob("*") if p.is_file())
        for path in files:
            relative = "" if path == local else "/" + path.relative_to(local).as_posix()
            fs.put_file(str(path), target.removeprefix("gs://") + relative)
        return target

    def tree_bytes(self, *parts: str) -> dict[str, bytes]:
        """Every object below gs://bucket/parts..., by path relative to it (as conftest.tree_bytes)."""
        fs = self.filesystem()
        root = self.url(*parts).removeprefix("gs://").rstrip("/") + "/"
        return {path[len(root) :]: fs.cat_file(path) for path in sorted(fs.find(root))}


def _healthy(endpoint: str, bucket: str) -> bool:
    try:
        with urllib.request.urlopen(f"{endpoint}/storage/v1/b/{bucket}", timeout=1) as response:
            return response.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def running_emulator(bucket: str = BUCKET) -> Iterator[GcsEmulator]:
    """Start the emulator (in memory, one bucket), wait until it serves the bucket, stop it at the end."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-c",
        SERVE,
        "start",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--in-memory",
        "--default-bucket",
        bucket,
        "--quiet",
    ]
    # Its log goes to a file, not a pipe: a pipe nobody reads would block the server once full.
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not _healthy(endpoint, bucket):
            if process.poll() is not None:
                log.seek(0)
                raise RuntimeError(f"the GCS emulator exited ({process.returncode}): {log.read().decode()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the GCS emulator did not serve {endpoint} within {START_TIMEOUT_S} s")
            time.sleep(0.1)
        yield GcsEmulator(endpoint=endpoint, bucket=bucket)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


@contextlib.contextmanager
def emulator_environment(emulator: GcsEmulator) -> Iterator[None]:
    """Point this process's gcsfs at the emulator (environment and fsspec's defaults), restored after."""
    import fsspec.config

    saved_env = {key: os.environ.get(key) for key in emulator.env}
    saved_conf = fsspec.config.conf.get("gs")
    os.environ.update(emulator.env)
    # fsspec read FSSPEC_* variables when it was imported; its defaults for gs:// are set here directly.
    fsspec.config.conf["gs"] = {**(saved_conf or {}), "token": "anon"}
    try:
        yield
    finally:
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if saved_conf is None:
            fsspec.config.conf.pop("gs", None)
        else:
            fsspec.config.conf["gs"] = saved_conf
