"""Where a whole `tokenmill curate` run spends its CPU: cProfile in the launcher and in every worker process.

`profiled_env(folder)` gives a subprocess an environment in which every Python process it starts (the
launcher and Beam's SDK worker processes, which inherit it) profiles all of its threads with cProfile, in
CPU time per thread (a thread waiting on a queue costs nothing), and writes `folder/<pid>.prof` every
couple of seconds and at exit (its exit handlers, or `os._exit`, which a worker ends with).
It works through a `sitecustomize` module on PYTHONPATH, so nothing in tokenmill
knows about it. `load(folder)` reads the profiles back; `mechanisms()` splits self time into what does
the work (word splitting, datatrove's rules, ...) and what carries it (executor and serialisation, I/O),
builtins counted with the code that called them; `cumulative()` gives the time inside named functions.
"""

from __future__ import annotations

import atexit
import cProfile
import marshal
import os
import pstats
import sys
import threading
import time
from pathlib import Path

PROFILE_DIR = "TOKENMILL_PROFILE_DIR"
_EXIT = os._exit
DUMP_EVERY_SECONDS = 2.0

#: (bucket, needles in "file:function"): the first bucket with a matching needle takes a function's time.
#: Builtins and standard-library functions not named here (str methods, regex, Counter, heapq) take the
#: bucket of the code that called them.
BUCKETS: list[tuple[str, tuple[str, ...]]] = [
    ("word splitting (spaCy, shared split)", ("spacy/", "heuristics.py:split")),
    ("datatrove filter rules", ("datatrove/",)),
    ("normalize", ("filters/normalize.py",)),
    ("language id", ("filters/language.py", "py3langid", "fasttext")),
    ("dedupe", ("exact_dedupe.py", "fuzzy_dedupe.py", "minhash.py", "dedupe_clusters.py")),
    ("classifiers", ("filters/classifiers.py", "filters/models.py", "domains/")),
    (
        "I/O: read, parse, write",
        (
            "corpora/readers.py",
            "corpora/records.py",
            "corpora/paths.py",
            "pipelines/sinks.py",
            "tokenmill/formats/",
            "tokenmill/storage",
            "pyarrow",
            "fsspec",
            "json/",
            "zstd",
            "gzip.py",
            "_compression.py",
            "posix.",
            "io.",
        ),
    ),
    (
        "executor and serialisation (Beam, gRPC, pickling, threads)",
        (
            "apache_beam/",
            "grpc",
            "google/protobuf",
            "pickle",
            "dill",
            "threading.py",
            "queue.py",
            "concurrent/",
            "_thread.",
            "pipelines/local_runner.py",
            "pipelines/curate.py",
            "filters/base.py",
            "heuristics.py:apply",  # HeuristicFilter.apply: the per-document loop around datatrove
        ),
    ),
    ("start-up, imports and other libraries", ("<frozen", "importlib", "site-packages/")),
]
#: Functions of heuristics.py above this line are the shared word splitting (set by `mechanisms`).
_SPLITTING_ENDS: list[int] = []


def profiled_env(folder: Path, extra_path: Path) -> dict[str, str]:
    """The environment for a profiled run: `extra_path` gets a sitecustomize that starts the profiler."""
    extra_path.mkdir(parents=True, exist_ok=True)
    (extra_path / "sitecustomize.py").write_text("import run_profile\nrun_profile.start_if_asked()\n")
    here = str(Path(__file__).resolve().parent)
    path = os.pathsep.join([str(extra_path), here, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    folder.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "PYTHONPATH": path, PROFILE_DIR: str(folder)}


def start_if_asked() -> None:
    """Profile every thread of this process when PROFILE_DIR is set (called from sitecustomize); a
    process forked from it (a warm pool's workers) profiles itself into its own file from the fork on."""
    folder = os.environ.get(PROFILE_DIR)
    if not folder:
        return
    _start_profiling(Path(folder))

    def restart_in_child() -> None:
        sys.setprofile(None)  # the parent's profile of the forking thread: its time is the parent's
        os._exit = _EXIT  # not the parent's last dump, which would write the parent's file
        _start_profiling(Path(folder))

    os.register_at_fork(after_in_child=restart_in_child)


def _start_profiling(folder: Path) -> None:
    profiles: list[cProfile.Profile] = []
    lock = threading.Lock()
    target = folder / f"{os.getpid()}.prof"
    command = " ".join(getattr(sys, "orig_argv", sys.argv))

    def dump() -> None:
        merged: dict = {}
        with lock:
            for profile in list(profiles):
                profile.snapshot_stats()  # reads what it has recorded; recording goes on
                for func, (cc, nc, tt, ct, callers) in profile.stats.items():
                    if func in merged:
                        old = merged[func]
                        joined = dict(old[4])
                        for caller, numbers in callers.items():
                            previous = joined.get(caller)
                            joined[caller] = (
                                tuple(a + b for a, b in zip(previous, numbers)) if previous else numbers
                            )
                        merged[func] = (old[0] + cc, old[1] + nc, old[2] + tt, old[3] + ct, joined)
                    else:
                        merged[func] = (cc, nc, tt, ct, callers)
        temporary = target.with_name(f".{target.name}.tmp")
        with open(temporary, "wb") as handle:
            marshal.dump({"command": command, "stats": merged}, handle)
        os.replace(temporary, target)

    def dump_periodically() -> None:
        while True:
            threading.Event().wait(DUMP_EVERY_SECONDS)
            try:
                dump()
            except Exception:  # a profile that changes while it is read: the next dump gets it
                continue

    threading.Thread(target=dump_periodically, daemon=True, name="profile-dump").start()

    def dump_then_exit(status: int) -> None:
        # Workers (and the launcher, after its exit handlers) end with os._exit: the last dump is taken
        # here rather than left to the thread's last round, which a worker's end may cut off.
        for _attempt in range(3):
            try:
                dump()
                break
            except Exception:  # a profile that changed while it was read (another thread): read again
                continue
        _EXIT(status)

    os._exit = dump_then_exit

    def start_thread_profile(*_args) -> None:
        sys.setprofile(None)
        profile = cProfile.Profile(time.thread_time)
        with lock:
            profiles.append(profile)
        profile.enable()

    main = cProfile.Profile(time.thread_time)
    profiles.append(main)
    threading.setprofile(start_thread_profile)  # threads started from now on
    main.enable()
    atexit.register(dump)


def load(folder: Path) -> list[tuple[str, pstats.Stats]]:
    """(command line, stats) of every process profiled into `folder`."""
    runs = []
    for path in sorted(folder.glob("*.prof")):
        with open(path, "rb") as handle:
            record = marshal.load(handle)
        stats = pstats.Stats()
        stats.stats = record["stats"]
        stats.get_top_level_stats()
        runs.append((record["command"], stats))
    return runs


def _where(func: tuple) -> str:
    filename, line, name = func
    if filename.endswith("filters/heuristics.py") and _SPLITTING_ENDS and line < _SPLITTING_ENDS[0]:
        return f"{filename}:split {name}"
    return f"{filename}:{name}" if filename != "~" else name


def _named_bucket(func: tuple) -> str | None:
    where = _where(func)
    for bucket, needles in BUCKETS[:-1]:
        if any(needle in where for needle in needles):
            return bucket
    return None


def _transparent(func: tuple) -> bool:
    """Builtins and standard-library code: their time belongs to whoever called them."""
    filename = func[0]
    return filename == "~" or ("/lib/python3" in filename and "site-packages" not in filename)


def mechanisms(stats: pstats.Stats) -> dict[str, float]:
    """Self time per bucket; builtins and standard-library code count with the code that called them."""
    if not _SPLITTING_ENDS:
        import inspect

        from tokenmill.filters import heuristics

        _SPLITTING_ENDS.append(inspect.getsourcelines(heuristics.HeuristicFilter)[1])
    resolved: dict[tuple, str] = {}

    def bucket_of(func: tuple, depth: int = 0) -> str:
        if func in resolved:
            return resolved[func]
        bucket = _named_bucket(func)
        if bucket is None and _transparent(func) and depth < 20:
            callers = stats.stats.get(func, (0, 0, 0, 0, {}))[4]
            if callers:  # the caller that spent most time in it
                caller = max(callers, key=lambda c: callers[c][2])
                bucket = bucket_of(caller, depth + 1)
        if bucket is None:
            fallback, needles = BUCKETS[-1]
            bucket = fallback if any(n in _where(func) for n in needles) else "other"
        resolved[func] = bucket
        return bucket

    totals: dict[str, float] = {}
    for func, (_cc, _nc, tt, _ct, callers) in stats.stats.items():
        if _named_bucket(func) is None and _transparent(func) and callers:
            for caller, numbers in callers.items():  # split among its callers by their share
                bucket = bucket_of(caller)
                totals[bucket] = totals.get(bucket, 0.0) + numbers[2]
        else:
            bucket = bucket_of(func)
            totals[bucket] = totals.get(bucket, 0.0) + tt
    return totals


def cumulative(stats: pstats.Stats, file_part: str, name: str) -> float:
    """Time inside functions called `name` in files matching `file_part` (outermost calls only)."""
    return sum(entry[3] for func, entry in stats.stats.items() if file_part in func[0] and func[2] == name)


def is_worker(command: str) -> bool:
    """A local runner's SDK worker process: tokenmill's worker main, or Beam's own."""
    from tokenmill.pipelines.warm_workers import WORKER_MODULE

    return WORKER_MODULE in command or "sdk_worker_main" in command
