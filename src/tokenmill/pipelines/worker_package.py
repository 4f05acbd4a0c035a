"""The tokenmill package for remote workers: a wheel built at launch from the installed distribution.

Dataflow, and portable runners whose workers are containers (Flink, Spark), run tokenmill's code on
machines that do not have it. Beam installs every `--extra_package` on every worker, with its
dependencies. At launch tokenmill builds that wheel from what is installed where it runs: the files of
the imported `tokenmill` package and the installed distribution's metadata (importlib.metadata). So it
works the same from `pip install tokenmill`, from a wheel, and from an editable checkout, with no build
tool, no network and no setup.py (a checkout path computed from a source file does not exist in an
installed package).

The wheel's requirements are the distribution's core requirements (which hold everything a curate or
tokenize stage imports, gcsfs for gs:// included) plus those of its `dataflow` extra (apache-beam[gcp]),
made unconditional: Beam installs an extra package without extras. The `train` extra (jax, optax,
orbax-checkpoint) and the `dask` extra stay optional, so workers never install the trainer.
tests/test_clean_install.py installs this wheel into a new environment, as a worker does, and curates.

The wheel's bytes are a function of those files (entries sorted, timestamps fixed); it is written to a
folder named by its sha256, so a relaunch of unchanged code reuses the same file.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import io
import os
import re
import tempfile
import zipfile
from pathlib import Path

from tokenmill import storage

DISTRIBUTION = "tokenmill"
#: Extras whose requirements every worker needs (Beam installs an extra package without extras).
WORKER_EXTRAS = ("dataflow",)
#: The package's files: its code and the package data that pyproject.toml ships.
PACKAGE_SUFFIXES = (".py", ".yaml", ".html", ".css", ".js", ".j2")
_ZIP_DATE = (1980, 1, 1, 0, 0, 0)  # fixed (the earliest a zip entry holds), so equal files give equal bytes
_WHEEL = (
    "Wheel-Version: 1.0\n"
    "Generator: tokenmill.pipelines.worker_package\n"
    "Root-Is-Purelib: true\n"
    "Tag: py3-none-any\n"
)
_REQUIREMENT = re.compile(r"^Requires-Dist:\s*(?P<requirement>[^;]+?)\s*;\s*(?P<marker>.+?)\s*$")


class PackageError(RuntimeError):
    """The installed tokenmill cannot be packaged for the workers; the message says what to do."""


def installed_distribution() -> importlib.metadata.Distribution:
    """The installed tokenmill distribution, checked to be the one this process imported."""
    import tokenmill

    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise PackageError(
            f"tokenmill is imported from {Path(tokenmill.__file__).parent} but not installed (no "
            "distribution metadata): `pip install .` (or `pip install -e .` in a checkout), or ship a "
            "package yourself with --extra_package or --setup_file"
        ) from None
    if distribution.version != tokenmill.__version__:
        raise PackageError(
            f"the installed tokenmill distribution is version {distribution.version}, but the imported "
            f"package ({Path(tokenmill.__file__).parent}) is {tokenmill.__version__}: reinstall it"
        )
    return distribution


def package_files() -> dict[str, bytes]:
    """The imported `tokenmill` package's files, by their path inside a wheel (no caches)."""
    import tokenmill

    root = Path(tokenmill.__file__).resolve().parent
    return {
        f"tokenmill/{path.relative_to(root).as_posix()}": path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts and path.suffix in PACKAGE_SUFFIXES
    }


def worker_metadata(metadata: str, extras: tuple[str, ...] = WORKER_EXTRAS) -> str:
    """Core METADATA with the requirements of `extras` made unconditional (other extras stay extras)."""
    lines = []
    for line in metadata.splitlines(keepends=True):
        match = _REQUIREMENT.match(line.rstrip("\n"))
        if match:
            marker = match["marker"]
            for extra in extras:
                condition = f'extra == "{extra}"'
                if marker == condition:
                    line = f"Requires-Dist: {match['requirement']}\n"
                elif marker.endswith(f" and {condition}"):
                    line = f"Requires-Dist: {match['requirement']}; {marker[: -len(condition) - 5]}\n"
        lines.append(line)
    return "".join(lines)


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def wheel_bytes() -> tuple[str, bytes]:
    """(file name, bytes) of the worker wheel of the installed tokenmill."""
    distribution = installed_distribution()
    version = distribution.version
    dist_info = f"{DISTRIBUTION}-{version}.dist-info"
    files = package_files()
    if "tokenmill/__init__.py" not in files:
        raise PackageError(f"no tokenmill package files found beside {files}")
    metadata = distribution.read_text("METADATA")
    if not metadata:
        raise PackageError(f"the installed tokenmill {version} has no METADATA: reinstall it")
    files[f"{dist_info}/METADATA"] = worker_metadata(metadata).encode()
    entry_points = distribution.read_text("entry_points.txt")
    if entry_points:
        files[f"{dist_info}/entry_points.txt"] = entry_points.encode()
    files[f"{dist_info}/WHEEL"] = _WHEEL.encode()
    record = "".join(f"{path},{_record_hash(data)},{len(data)}\n" for path, data in files.items())
    files[f"{dist_info}/RECORD"] = (record + f"{dist_info}/RECORD,,\n").encode()

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for path, data in files.items():  # package files sorted, then dist-info with RECORD last
            entry = zipfile.ZipInfo(path, date_time=_ZIP_DATE)
            entry.external_attr = 0o644 << 16
            entry.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(entry, data)
    return f"{DISTRIBUTION}-{version}-py3-none-any.whl", buffer.getvalue()


def default_directory() -> str:
    return os.path.join(tempfile.gettempdir(), "tokenmill-worker-package")


def build_worker_wheel(directory: str | None = None) -> str:
    """Write the worker wheel under `directory` (a folder per content hash) and return its path."""
    name, data = wheel_bytes()
    folder = os.path.join(directory or default_directory(), hashlib.sha256(data).hexdigest()[:16])
    path = os.path.join(folder, name)
    if not (os.path.isfile(path) and os.path.getsize(path) == len(data)):
        storage.write_bytes(path, data)
    return path
