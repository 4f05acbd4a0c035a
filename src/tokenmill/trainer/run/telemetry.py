"""Hardware telemetry for metrics.jsonl, the step's time split into its parts, and the trainer's log lines
kept in the run folder (runs/NAME/train.log), so that the run page can show a follower what the machines
are doing, not only the loss.

Every reading is optional: a backend without memory statistics (CPU), a host without NVIDIA devices or
without the NVML bindings (`pip install 'tokenmill[gpu]'`, nvidia-ml-py) leaves its keys out of the row
rather than failing the run. The keys are documented in docs/formats.md ("Runs").

Cost per step: one `memory_stats()` call per local device (a lookup in the runtime's allocator, no device
sync), one RSS read, and with NVML three queries per local GPU (microseconds each), so that telemetry on
every step stays well under a millisecond next to steps that take seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tokenmill.formats.runs import LOG

log = logging.getLogger(__name__)

#: Parts of the interval between two logged steps, logged as `<part>_seconds`.
STEP_PARTS = ("data", "compute", "checkpoint", "publish")


class StepTimer:
    """Wall time spent in each part of the interval between two logged rows.

    A row's parts cover the interval that its `tokens_per_second` is measured over: from the previous
    row's write to this one's. So the checkpoint saved and the page published after step N-1 (at the
    boundary "after N steps") count in row N, next to that step's data wait and compute.
    """

    def __init__(self) -> None:
        self._spent = dict.fromkeys(STEP_PARTS, 0.0)

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            self._spent[name] += time.perf_counter() - started

    def take(self, interval: float) -> dict[str, float]:
        """The parts spent since the last call, and the whole interval (`step_seconds`); starts over."""
        row = {"step_seconds": interval, **{f"{name}_seconds": spent for name, spent in self._spent.items()}}
        self._spent = dict.fromkeys(STEP_PARTS, 0.0)
        return row


def device_memory(devices: Sequence[Any]) -> dict[str, int]:
    """Bytes in use, peak and limit on the fullest local device; {} where the backend keeps no statistics
    (`memory_stats()` is None on CPU). The fullest device is the one that runs out first."""
    stats = []
    for device in devices:
        try:
            found = device.memory_stats()
        except Exception:  # some backends raise rather than return None; the run goes on without them
            found = None
        if found and "bytes_in_use" in found:
            stats.append(found)
    if not stats:
        return {}
    fullest = max(stats, key=lambda s: s["bytes_in_use"])
    row = {
        "device_memory_bytes": int(fullest["bytes_in_use"]),
        "device_memory_peak_bytes": int(max(s.get("peak_bytes_in_use", s["bytes_in_use"]) for s in stats)),
    }
    limits = [s["bytes_limit"] for s in stats if s.get("bytes_limit")]
    if limits:
        row["device_memory_limit_bytes"] = int(min(limits))
    return row


def host_memory_bytes(process: Any = None) -> int | None:
    """This process's resident set size: psutil where installed (`process`: a psutil.Process to reuse),
    else /proc (Linux); None elsewhere."""
    if process is None:
        try:
            import psutil
        except ImportError:
            pass
        else:
            process = psutil.Process()
    if process is not None:
        return int(process.memory_info().rss)
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class Nvml:
    """Utilisation, power and temperature of this process's NVIDIA GPUs through NVML (nvidia-ml-py).

    `Nvml.open()` is None without the bindings or without an NVIDIA driver (CPU, TPU): nothing to read.
    The GPUs are those CUDA_VISIBLE_DEVICES names when it lists indices, else every GPU of the host.
    """

    def __init__(self, pynvml: Any, handles: list[Any]):
        self.pynvml = pynvml
        self.handles = handles
        self._failed = False

    @classmethod
    def open(cls) -> Nvml | None:
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
        except Exception as error:  # NVMLError_LibraryNotFound / DriverNotLoaded on a machine without GPUs
            log.debug("NVML unavailable: %s", error)
            return None
        indices = list(range(count))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible:
            try:
                indices = [int(part) for part in visible.split(",") if part.strip()]
            except ValueError:
                pass  # GPU UUIDs: read every GPU of the host rather than guess the mapping
        handles = []
        for index in indices:
            try:
                handles.append(pynvml.nvmlDeviceGetHandleByIndex(index))
            except Exception as error:
                log.debug("NVML: no GPU %d: %s", index, error)
        if not handles:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            return None
        return cls(pynvml, handles)

    def sample(self) -> dict[str, list[float]]:
        """One value per GPU under each key; a query that fails leaves its key out (and is not tried
        again after a failure of every GPU, so a broken driver does not cost every step an exception)."""
        if self._failed:
            return {}
        nv = self.pynvml
        readers = {
            "gpu_utilization": lambda h: float(nv.nvmlDeviceGetUtilizationRates(h).gpu),
            "gpu_power_watts": lambda h: nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "gpu_temperature_c": lambda h: float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
        }
        row: dict[str, list[float]] = {}
        for key, read in readers.items():
            try:
                row[key] = [read(handle) for handle in self.handles]
            except Exception as error:
                log.debug("NVML: %s failed: %s", key, error)
        if not row:
            self._failed = True
            log.warning("NVML readings failed on every GPU; leaving them out of metrics.jsonl")
        return row

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.pynvml.nvmlShutdown()


class Telemetry:
    """Readings for one metrics row: device and host memory, NVML when there is one, the device kind."""

    def __init__(self, devices: Sequence[Any], nvml: bool = True):
        self.devices = list(devices)
        self.device_kind = str(self.devices[0].device_kind) if self.devices else "unknown"
        self.nvml = Nvml.open() if nvml else None
        try:
            import psutil

            self.process: Any = psutil.Process()
        except ImportError:
            self.process = None

    def sample(self) -> dict[str, Any]:
        row: dict[str, Any] = {"device_kind": self.device_kind, **device_memory(self.devices)}
        rss = host_memory_bytes(self.process)
        if rss is not None:
            row["host_memory_bytes"] = rss
        if self.nvml is not None:
            row.update(self.nvml.sample())
        return row

    def close(self) -> None:
        if self.nvml is not None:
            self.nvml.close()
            self.nvml = None


class _LogCapture(logging.FileHandler):
    """A file handler that `capture_log` recognises as its own."""


LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def capture_log(run_dir: str | os.PathLike[str], logger_name: str = "tokenmill") -> logging.Handler:
    """Append the trainer's log lines (the `tokenmill` loggers, INFO and up) to run_dir/train.log, for the
    run page's tail; `release_log` undoes it. A capture left by an earlier run in this process (one that
    failed before releasing it) is replaced, so lines are never written twice."""
    logger = logging.getLogger(logger_name)
    for handler in list(logger.handlers):
        if isinstance(handler, _LogCapture):
            release_log(handler, logger_name)
    handler = _LogCapture(os.path.join(os.fspath(run_dir), LOG), encoding="utf-8")
    handler.setLevel(logging.INFO)
    # UTC, with the date: a follower reads these lines from anywhere, and a run lasts more than a day.
    formatter = logging.Formatter(LOG_FORMAT, datefmt="%Y-%m-%dT%H:%M:%SZ")
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    # The handler sees only what the logger lets through: without a configured level (a library caller,
    # the tests) that is WARNING and up, so the trainer's own INFO lines would be lost.
    handler.previous_level = logger.level  # type: ignore[attr-defined]
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    return handler


def release_log(handler: logging.Handler, logger_name: str = "tokenmill") -> None:
    logger = logging.getLogger(logger_name)
    if handler in logger.handlers:
        logger.removeHandler(handler)
        logger.setLevel(getattr(handler, "previous_level", logger.level))
    handler.close()
