"""Live publishing of the run page while training
(`tokenmill train --logging.publish DEST --logging.publish_every N`).

Every N steps and after every checkpoint the step loop hands a `Snapshot` (how far metrics.jsonl holds
whole rows, the step, the latest checkpoint) to a `LivePublisher` and goes on at once; a background thread
rebuilds the run page from it with the report's own builder (`tokenmill.reports.runpage.build_run`, the
page `tokenmill report --run` writes) and writes it into DEST, a local folder or gs://BUCKET/PATH:

    DEST/run.html                  the page (written last, so that it never links to files not yet there)
    DEST/data/run/metrics.jsonl    the metrics the page was drawn from, byte for byte
    DEST/data/run/config.json, plan.json, ladder.json (when the run folder has one), train.log (last lines)
    DEST/data/run/status.json      state, step, checkpoint, version and time of this version

Only the newest snapshot waits: one that arrives while a publish is running replaces the one waiting, so a
slow upload costs the step loop nothing and the page skips versions instead of falling behind. A failing
publish is logged and retried with a growing delay (or with the next snapshot, whichever comes first);
training never waits for it and never stops because of it. The final version, when training ends (or
stops on an error), gets a bounded wait.

Every file is written whole: locally to a temporary name renamed into place (tokenmill.storage), on GCS as
one upload, which appears complete or not at all. GCS objects get a content type (a static host serves
run.html as a page) and `Cache-Control: no-cache`, or public objects would be cached for an hour and the
page would not move.

Memory: the publisher keeps the parsed metrics rows (the page is drawn from all of them), read
incrementally: each publish parses only the rows added since the last one, but copies metrics.jsonl
whole. Both grow with the logged steps (about 1 KB per row with 8 MoE layers); choose
--logging.publish_every so
that a publish takes a fraction of the interval (the log says when one is slow).
"""

from __future__ import annotations

import json
import logging
import mimetypes
import os
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from tokenmill import storage
from tokenmill.formats.runs import CONFIG, METRICS, read_run_record
from tokenmill.reports.inputs import InputError
from tokenmill.reports.render import is_earlier_page
from tokenmill.reports.runpage import LiveStatus, RunInputs, build_run, parse_metrics, read_ladder
from tokenmill.reports.site import render_run_page

log = logging.getLogger(__name__)

STATUS = "data/run/status.json"
PAGE = "run.html"
#: A publish slower than this is logged (it means versions are being skipped).
SLOW_SECONDS = 30.0
#: How long the end of training waits for the final version before giving up on it.
FINAL_TIMEOUT_SECONDS = 120.0


class PublishError(ValueError):
    """The destination cannot take the run page (a folder holding something else)."""


@dataclass(frozen=True)
class Snapshot:
    """What a version of the page shows: metrics.jsonl up to `metrics_bytes` (whole rows only)."""

    step: int  # steps trained
    metrics_bytes: int
    state: str = "training"  # "training", "finished" or "stopped"
    target_step: int | None = None
    checkpoint_step: int | None = None
    message: str = ""
    time: float = 0.0  # Unix time it was taken; 0: when it is published


def check_destination(destination: str) -> None:
    """Refuse a local folder that holds files but no page of ours (a run folder given by mistake, say)."""
    if not storage.is_local(destination):
        return
    path = storage.local_path(destination)
    if os.path.isfile(path):
        raise PublishError(f"--logging.publish {destination}: is a file; give a folder")
    if not os.path.isdir(path) or not os.listdir(path):
        return
    if any(is_earlier_page(os.path.join(path, page)) for page in (PAGE, "index.html")):
        return
    raise PublishError(
        f"--logging.publish {destination}: folder is not empty and holds no run page or report; "
        "choose an empty or new folder (or the folder of an earlier `tokenmill report`)"
    )


def put(path: str, data: bytes) -> None:
    """Write one published file whole (see the module docstring)."""
    if storage.is_local(path):
        storage.write_bytes(path, data)
        return
    fs, fs_path = storage.filesystem(path)
    protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
    if "gs" not in protocols and "gcs" not in protocols:
        storage.write_bytes(path, data)
        return
    kind = content_type(path)
    fs.pipe_file(fs_path, data, content_type=kind, fixed_key_metadata={"cache_control": "no-cache"})


def content_type(path: str) -> str:
    name = path.rsplit("/", 1)[-1]
    if name.endswith((".jsonl", ".log")):
        return "text/plain; charset=utf-8"
    guessed = mimetypes.guess_type(name)[0] or "application/octet-stream"
    return f"{guessed}; charset=utf-8" if guessed.startswith("text/") or guessed.endswith("json") else guessed


class LivePublisher:
    """A background thread that publishes the newest snapshot it was given (see the module docstring)."""

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        destination: str,
        *,
        every: int,
        ladder: str | None = None,
        refresh_seconds: int = 60,
        retry_seconds: float = 2.0,
        max_retry_seconds: float = 300.0,
    ):
        if every <= 0:
            raise PublishError(f"--logging.publish_every {every}: must be a positive number of steps")
        check_destination(destination)
        if ladder is not None:
            try:
                read_ladder(ladder)  # a bad file now, not a publish failing at every step later
            except InputError as error:
                raise PublishError(f"--logging.publish_ladder {error}") from error
        self.run_dir = os.fspath(run_dir)
        self.destination = destination
        self.every = every
        self.ladder = ladder
        self.refresh_seconds = refresh_seconds
        self.retry_seconds = retry_seconds
        self.max_retry_seconds = max_retry_seconds
        self.published = 0  # versions written
        self.failures = 0  # publishes that raised (each retried)
        self.skipped = 0  # snapshots replaced by a newer one before they were published
        self._rows: list[Any] = []
        self._parsed_bytes = 0
        self._parsed_lines = 0
        self._has_overview: bool | None = None
        self._condition = threading.Condition()
        self._pending: Snapshot | None = None
        self._closing = False
        self._abandoned = False
        self._thread = threading.Thread(target=self._loop, name="tokenmill-publish", daemon=True)
        self._thread.start()

    def due(self, done: int, checkpointed: bool) -> bool:
        """Whether the boundary after `done` steps gets a version: every N steps and at every checkpoint."""
        return checkpointed or done % self.every == 0

    def submit(self, step: int, metrics_bytes: int, **fields: Any) -> None:
        """Hand over a snapshot (`Snapshot`'s fields) and return at once; it replaces one still waiting."""
        # The page says when its numbers were taken, not when a slow upload finished.
        self.submit_snapshot(Snapshot(step, metrics_bytes, **{"time": time.time(), **fields}))

    def submit_snapshot(self, snapshot: Snapshot) -> None:
        with self._condition:
            if self._pending is not None:
                self.skipped += 1
            self._pending = snapshot
            self._condition.notify_all()

    def close(
        self,
        step: int | None = None,
        metrics_bytes: int = 0,
        *,
        timeout: float | None = None,
        **fields: Any,
    ) -> bool:
        """Publish the final version (when any rows were written: `metrics_bytes` > 0), waiting up to
        `timeout` seconds with its retries, and stop the thread; whether everything handed over was
        published."""
        with self._condition:
            if step is not None and metrics_bytes > 0:
                self.submit(step, metrics_bytes, **fields)
            self._closing = True
            self._condition.notify_all()
        timeout = FINAL_TIMEOUT_SECONDS if timeout is None else timeout
        self._thread.join(timeout)
        if self._thread.is_alive():
            with self._condition:
                self._abandoned = True
                self._condition.notify_all()
            log.warning(
                "the final run page was not published to %s within %.0f s; the last version there is older",
                self.destination,
                timeout,
            )
            return False
        return True

    def _loop(self) -> None:
        while True:
            with self._condition:
                self._condition.wait_for(lambda: self._pending is not None or self._closing)
                if self._pending is None or self._abandoned:
                    return
                snapshot, self._pending = self._pending, None
            attempt = 0
            while True:
                try:
                    self._publish(snapshot)
                    break
                except Exception as error:  # any failure of a publish is the publisher's, never the run's
                    self.failures += 1
                    delay = min(self.max_retry_seconds, self.retry_seconds * 2**attempt)
                    attempt += 1
                    log.warning(
                        "publishing the run page (step %d) to %s failed: %s: %s; retrying in %.0f s "
                        "or with the next version",
                        snapshot.step,
                        self.destination,
                        type(error).__name__,
                        error,
                        delay,
                    )
                    with self._condition:
                        self._condition.wait_for(
                            lambda: self._pending is not None or self._abandoned, timeout=delay
                        )
                        if self._abandoned:
                            return
                        if self._pending is not None:
                            snapshot, self._pending = self._pending, None

    def _publish(self, snapshot: Snapshot) -> None:
        started = time.perf_counter()
        if snapshot.time == 0.0:
            snapshot = replace(snapshot, time=time.time())
        metrics = self._metrics(snapshot.metrics_bytes)
        config_path = os.path.join(self.run_dir, CONFIG)
        config = config_bytes = None
        if os.path.exists(config_path):
            with open(config_path, "rb") as handle:
                config_bytes = handle.read()
            config = read_run_record(config_path).to_json()
        live = LiveStatus(
            state=snapshot.state,
            updated=snapshot.time,
            version=self.published + 1,
            target_step=snapshot.target_step,
            checkpoint_step=snapshot.checkpoint_step,
            message=snapshot.message,
            refresh_seconds=self.refresh_seconds,
        )
        page = build_run(
            self.run_dir,
            self.ladder,
            inputs=RunInputs(self._rows, metrics, config, config_bytes),
            live=live,
        )
        if self._has_overview is None:
            self._has_overview = storage.exists(storage.join(self.destination, "index.html"))
        html = render_run_page(page, has_overview=self._has_overview)
        status = {**live.to_json(), "step": snapshot.step, "run": page["name"]}
        files = [(relative, payload) for relative, payload, _ in page["files"]]
        files.append((STATUS, (json.dumps(status, indent=2, sort_keys=True) + "\n").encode("utf-8")))
        for relative, payload in files:
            put(storage.join(self.destination, *relative.split("/")), payload)
        put(storage.join(self.destination, PAGE), html)
        self.published += 1
        took = time.perf_counter() - started
        if took > SLOW_SECONDS:
            log.warning(
                "publishing the run page to %s took %.0f s (%d versions skipped so far); a larger "
                "--logging.publish_every publishes less often",
                self.destination,
                took,
                self.skipped,
            )
        else:
            log.debug("published the run page at step %d in %.2f s", snapshot.step, took)

    def _metrics(self, size: int) -> bytes:
        """metrics.jsonl's first `size` bytes; the rows added since the last publish are parsed into the
        cache (a resumed run's writer truncates the file before the publisher starts, so it only grows)."""
        with open(os.path.join(self.run_dir, METRICS), "rb") as handle:
            data = handle.read(size)
        if len(data) < size:
            raise OSError(f"{METRICS} holds {len(data)} bytes, the snapshot {size}")
        if size < self._parsed_bytes:  # rewritten under us (not by this trainer): start over
            self._rows, self._parsed_bytes, self._parsed_lines = [], 0, 0
        fresh = data[self._parsed_bytes :]
        origin = os.path.join(self.run_dir, METRICS)
        self._rows.extend(
            row.to_json() for row in parse_metrics(fresh, origin, first_line=self._parsed_lines + 1)
        )
        self._parsed_lines += fresh.count(b"\n")
        self._parsed_bytes = size
        return data
