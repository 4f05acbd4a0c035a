"""Shared fixtures: the repository paths and a way to run `tokenmill` commands in-process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data" / "sample"
WEB_RECIPE = REPO / "configs" / "curate" / "web.yaml"


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO


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


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file below root, by relative path: for byte-for-byte comparisons of outputs."""
    return {
        str(path.relative_to(root)): path.read_bytes() for path in sorted(root.rglob("*")) if path.is_file()
    }
