"""Shared fixtures: the repository paths, a way to run `tokenmill` commands in-process, and one JAX
compilation cache for the session."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import zstandard

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample"
WEB_RECIPE = REPO / "configs" / "curate" / "web.yaml"


def _share_compiled_programs() -> None:
    """JAX's persistent compilation cache in a new folder for this session, for this process and every
    process it starts (`tokenmill train`, the swarm's workers): a program that many tests compile the same
    (the tiny model's train and eval steps, under other settings) is compiled once and loaded after.

    A cached executable is the one XLA would have compiled again (its key is the program and the options),
    so no test sees other numbers; the folder starts empty, so a session never reuses an earlier one's work.
    The swarm's workers use the same cache in production (tokenmill.swarm.runner). A JAX_COMPILATION_CACHE_DIR
    set by the caller is left as it is. Set here, at import, because jax reads these when it is imported."""
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    folder = tempfile.mkdtemp(prefix="tokenmill-tests-xla-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"


_share_compiled_programs()


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def gcs():
    """A GCS emulator on loopback (tests/gcs_emulator.py), one for the whole session, with this process's
    gcsfs pointed at it; tests keep apart by their object prefixes."""
    from gcs_emulator import emulator_environment, running_emulator

    with running_emulator() as emulator, emulator_environment(emulator):
        yield emulator


@pytest.fixture(scope="session")
def web_sample_run(tmp_path_factory) -> tuple[Path, dict]:
    """`tokenmill curate` of data/sample with configs/curate/web.yaml on 2 workers: (output, stats.json).

    Run once for the session: every test that only reads this run shares it (and must not change it)."""
    from test_curate import curate

    output = tmp_path_factory.mktemp("web-sample") / "out"
    return output, curate(output, str(SAMPLE / "*"), workers=2)


def run_tokenmill(
    *args: str, check: bool = True, env: dict | None = None, timeout: float = 600, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """Run the `tokenmill` command line in a fresh process, as a user would."""
    full_env = {**os.environ, **(env or {})}
    result = subprocess.run(
        [sys.executable, "-m", "tokenmill", *args],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        cwd=cwd,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"tokenmill {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"
        )
    return result


def run_on_simulated_devices(script: str, *args: str, devices: int = 8, timeout: float = 600) -> dict:
    """Run a Python script in a fresh process whose JAX starts with `devices` simulated CPU devices (XLA
    reads the count when JAX is first imported, which this process may have done already), and return the
    JSON it prints on its line starting with "RESULT ", with the process's stderr under "stderr" (what JAX
    warned). Unoptimised CPU code generation: these programs run once on tiny shapes, and compiling them at
    LLVM's default level took twice the time."""
    flags = f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    done = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return {**json.loads(line.removeprefix("RESULT ")), "stderr": done.stderr}


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file below root, by relative path: for byte-for-byte comparisons of outputs."""
    return {
        str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()
    }


# Loaded by every Python process of the run (the CLI and Beam's worker processes) through PYTHONPATH:
# any connection or name lookup beyond loopback is refused and written down.
BLOCK_NETWORK = textwrap.dedent(
    """
    import os, socket

    LOG = os.environ["TOKENMILL_NETWORK_LOG"]
    LOCAL = ("127.", "::1", "localhost", "0.0.0.0")

    def _refuse(what):
        with open(LOG, "a") as log:
            log.write(repr(what) + "\\n")
        raise OSError("network blocked by the test: " + repr(what))

    _connect = socket.socket.connect
    _getaddrinfo = socket.getaddrinfo

    def connect(self, address):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not str(address[0]).startswith(LOCAL):
            _refuse(address)
        return _connect(self, address)

    def getaddrinfo(host, *args, **kwargs):
        if host is not None and not str(host).startswith(LOCAL):
            _refuse(host)
        return _getaddrinfo(host, *args, **kwargs)

    socket.socket.connect = connect
    socket.getaddrinfo = getaddrinfo
    """
)


def offline_env(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """Environment for a `tokenmill` run with every non-loopback connection refused and logged, and empty
    home and cache folders (nothing may be fetched into them either); returns (env, log path)."""
    site = tmp_path / "offline-site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCK_NETWORK)
    log = tmp_path / "network.log"
    env = {
        "PYTHONPATH": str(site),
        "TOKENMILL_NETWORK_LOG": str(log),
        "HOME": str(tmp_path / "home"),
        "XDG_CACHE_HOME": str(tmp_path / "cache"),
        "HF_HOME": str(tmp_path / "hf"),
    }
    return env, log


def rejected_rows(output: Path) -> list[dict]:
    """Every record under OUTPUT/rejected/, in file order."""
    rows = []
    for path in sorted((output / "rejected").glob("*.jsonl.zst")):
        data = zstandard.ZstdDecompressor().stream_reader(path.read_bytes()).read()
        rows.extend(json.loads(line) for line in data.splitlines())
    return rows
