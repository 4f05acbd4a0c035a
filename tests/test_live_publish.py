"""The live run page: `tokenmill train --logging.publish` republishes run.html and data/run/ while training.

An observer thread polls the published folder (local and on the GCS emulator) during a tiny run and checks
every observation: a complete page, parseable JSON beside it, metrics that are whole rows; it must see
several distinct versions, ending with the finished one. A publisher whose every write fails, and one that
is slow, neither stop nor slow the step loop. In headless Chromium a live page reloads itself and shows the
next version. The rows carry the telemetry keys (docs/formats.md, "Runs").
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from test_trainer import config, tiny

from tokenmill.cli import build_parser
from tokenmill.formats.runs import parse_metrics_line
from tokenmill.trainer.commands.train import run_config_of
from tokenmill.trainer.data.batch import Batch, SyntheticSource
from tokenmill.trainer.run import publish
from tokenmill.trainer.run.config import Phase, resolve_run_config
from tokenmill.trainer.run.loop import train
from tokenmill.trainer.run.publish import LivePublisher, PublishError, check_destination
from tokenmill.trainer.run.telemetry import StepTimer, Telemetry, device_memory

# One schedule for every run here, test_trainer's: the jitted step is compiled once per process and reused.
PHASES = [Phase("pretraining", 0, 60)]
TELEMETRY_KEYS = {
    "timestamp", "devices", "device_kind", "tokens_per_second_per_device", "step_seconds", "data_seconds",
    "compute_seconds", "checkpoint_seconds", "publish_seconds", "host_memory_bytes",
}  # fmt: skip


class PacedSource(SyntheticSource):
    """Synthetic batches, each a little late, so that a tiny run lasts long enough to be watched."""

    def __init__(self, delay: float):
        cfg = tiny()
        super().__init__(cfg.vocab_size, cfg.sequence_length, 4, 0, active_vocab=64)
        self.delay = delay

    def batch(self, step: int) -> Batch:
        time.sleep(self.delay)
        return super().batch(step)


def page_step(page: bytes) -> int:
    match = re.search(r"at step ([\d,]+)\.", page.decode("utf-8"))
    assert match, "no step on the page"
    return int(match.group(1).replace(",", ""))


def check_version(page: bytes, status: bytes, metrics: bytes) -> int:
    """One observation of the published folder, read in the reverse of the publisher's write order (page,
    then status, then metrics), so that each file read is at least as new as the one before; checked whole.
    The step of the page."""
    text = page.decode("utf-8")
    assert text.startswith("<!doctype html>") and text.rstrip().endswith("</html>"), text[-200:]
    assert 'id="follow"' in text and 'data-chart="Training loss"' in text
    state = json.loads(status)
    assert metrics.endswith(b"\n")
    rows = [parse_metrics_line(line, "published metrics") for line in metrics.splitlines()]
    assert [row.step for row in rows] == list(range(len(rows)))
    step = page_step(page)
    assert step <= state["step"] <= len(rows)
    return step


def observe(read: Callable[[str], bytes], stop: threading.Event) -> _Watch:
    """Poll the published files until `stop` (in a thread); `finish` gives the distinct pages seen."""
    versions: dict[int, dict] = {}
    errors: list[str] = []

    def loop() -> None:
        while not stop.is_set():
            try:
                page = read(publish.PAGE)
                status, metrics = read(publish.STATUS), read("data/run/metrics.jsonl")
            except FileNotFoundError:
                time.sleep(0.01)
                continue
            try:
                step = check_version(page, status, metrics)
            except Exception as error:  # noqa: BLE001 - reported by `finish`
                errors.append(repr(error))
                return
            if step == json.loads(status)["step"]:
                versions.setdefault(step, json.loads(status))
            time.sleep(0.005)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return _Watch(thread, versions, errors)


class _Watch:
    def __init__(self, thread: threading.Thread, versions: dict[int, dict], errors: list[str]):
        self.thread, self.versions, self.errors = thread, versions, errors

    def finish(self, stop: threading.Event) -> list[dict]:
        stop.set()
        self.thread.join(10)
        assert not self.errors, self.errors
        return [self.versions[v] for v in sorted(self.versions)]


def watched_run(tmp_path: Path, destination: str, read: Callable[[str], bytes]) -> tuple[list[dict], list]:
    stop = threading.Event()
    watch = observe(read, stop)
    cfg = config(
        tmp_path, logging__publish=destination, logging__publish_every=6, checkpoint__every=10,
        logging__publish_refresh=5,
    )  # fmt: skip
    rows = train(resolve_run_config(cfg, PHASES), PacedSource(0.03))
    # The final version is written before train() returns; give the observer a last look at it.
    time.sleep(0.3)
    return watch.finish(stop), rows


def test_live_page_in_a_local_folder_is_republished_whole_during_the_run(tmp_path: Path) -> None:
    site = tmp_path / "site"
    versions, rows = watched_run(tmp_path, str(site), lambda relative: (site / relative).read_bytes())
    assert len(rows) == 60
    assert len(versions) >= 3, versions
    steps = [v["step"] for v in versions]
    assert steps == sorted(steps) and len(set(steps)) == len(steps)
    assert any(v["state"] == "training" for v in versions)
    assert versions[-1]["state"] == "finished" and versions[-1]["step"] == 60
    assert versions[-1]["checkpoint_step"] == 60
    # The last version is the run: metrics byte for byte, config and plan beside the page, the log's tail.
    run = tmp_path / "run"
    assert (site / "data/run/metrics.jsonl").read_bytes() == (run / "metrics.jsonl").read_bytes()
    assert json.loads((site / "data/run/config.json").read_text())["model"]["d_model"] == 32
    assert "step 59 loss" in (site / "data/run/train.log").read_text()
    page = (site / "run.html").read_text()
    assert 'http-equiv="refresh"' not in page  # finished: nothing more to wait for
    assert "step 60 of 60 (100.0%)" in page and "phase finished" in page
    assert "step 59 loss" in page  # the log tail
    assert "step 60 (run/checkpoints/60)" in page  # the latest checkpoint, found on disk
    assert 'href="index.html"' not in page  # no overview beside it (yet)
    assert not [p for p in site.rglob("*") if p.name.startswith(".tmp-")]

    # Telemetry in every row; a CPU keeps no device memory statistics and has no NVML: keys left out.
    for row in rows:
        assert TELEMETRY_KEYS <= set(row), TELEMETRY_KEYS - set(row)
        parts = sum(row[f"{part}_seconds"] for part in ("data", "compute", "checkpoint", "publish"))
        assert parts <= row["step_seconds"] + 1e-6
    assert rows[0]["device_kind"] == "cpu" and rows[-1]["host_memory_bytes"] > 10 << 20
    assert not {"device_memory_bytes", "gpu_utilization"} & set(rows[-1])
    assert rows[-1]["tokens_per_second_per_device"] == pytest.approx(rows[-1]["tokens_per_second"])
    # The checkpoint started after 10 steps is timed in the row of step 10 (the interval it fell in).
    assert rows[10]["checkpoint_seconds"] > 0 and rows[9]["checkpoint_seconds"] == 0
    # Handing a snapshot over is all the step loop does for a publish.
    assert max(row["publish_seconds"] for row in rows) < 0.05
    written = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert written[5]["step_seconds"] == rows[5]["step_seconds"]


def test_live_page_on_gcs(tmp_path: Path, gcs) -> None:
    fs = gcs.filesystem()
    prefix = f"{gcs.bucket}/live-page/site"

    def read(relative: str) -> bytes:
        return fs.cat_file(f"{prefix}/{relative}")

    versions, rows = watched_run(tmp_path, gcs.url("live-page", "site"), read)
    assert len(rows) == 60 and len(versions) >= 3, versions
    assert versions[-1]["state"] == "finished"
    info = fs.info(f"{prefix}/run.html")
    # Served as a page by a static host, and never cached: a follower's reload gets the new version.
    assert info["contentType"].startswith("text/html")
    assert info.get("cacheControl") == "no-cache"
    assert read("data/run/metrics.jsonl") == (tmp_path / "run" / "metrics.jsonl").read_bytes()


def test_a_failing_or_slow_publisher_never_stops_or_slows_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls = []

    def broken(path: str, data: bytes) -> None:
        calls.append(path)
        time.sleep(0.2)  # slow, and then it fails
        raise OSError("503 Service Unavailable (injected)")

    monkeypatch.setattr(publish, "put", broken)
    monkeypatch.setattr(publish, "FINAL_TIMEOUT_SECONDS", 1.0)
    cfg = config(tmp_path, logging__publish=str(tmp_path / "site"), logging__publish_every=2)
    with caplog.at_level(logging.WARNING, logger="tokenmill"):
        rows = train(resolve_run_config(cfg, PHASES), PacedSource(0.01))
    assert [row["step"] for row in rows] == list(range(60))
    assert len(calls) >= 2  # retried
    assert "failed: OSError: 503 Service Unavailable (injected)" in caplog.text
    assert "was not published" in caplog.text
    assert max(row["publish_seconds"] for row in rows) < 0.05
    assert not (tmp_path / "site" / "run.html").exists()


def test_a_publish_that_fails_is_retried_and_then_lands(tmp_path: Path, monkeypatch) -> None:
    real_put = publish.put
    failures = iter(range(3))

    def flaky(path: str, data: bytes) -> None:
        if next(failures, None) is not None:
            raise OSError("connection reset (injected)")
        real_put(path, data)

    monkeypatch.setattr(publish, "put", flaky)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 5.0}) + "\n")
    publisher = LivePublisher(run, str(tmp_path / "site"), every=1, retry_seconds=0.05)
    publisher.submit(1, (run / "metrics.jsonl").stat().st_size)
    stopped = "TrainingError: loss is nan at step 0"
    assert publisher.close(
        1, (run / "metrics.jsonl").stat().st_size, state="stopped", message=stopped, timeout=20
    )
    assert publisher.failures == 3 and publisher.published >= 1
    assert json.loads((tmp_path / "site" / publish.STATUS).read_text())["state"] == "stopped"
    page = (tmp_path / "site" / publish.PAGE).read_text()
    assert stopped in page and 'http-equiv="refresh"' not in page


def test_destination_and_flags(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "metrics.jsonl").write_text("{}")
    with pytest.raises(PublishError, match="not empty and holds no run page"):
        check_destination(str(tmp_path / "runs"))
    check_destination(str(tmp_path / "new"))  # a new folder is fine
    args = build_parser().parse_args(
        [
            "train",
            "--data.synthetic",
            "--logging.publish",
            "gs://b/live",
            "--logging.publish_every",
            "7",
            "--logging.publish_refresh",
            "0",
        ]
    )
    logging_cfg = run_config_of(args).logging
    assert (logging_cfg.publish, logging_cfg.publish_every, logging_cfg.publish_refresh) == (
        "gs://b/live",
        7,
        0,
    )


def test_telemetry_reads_what_the_backend_has() -> None:
    class Gpu:
        device_kind = "NVIDIA H100 80GB HBM3"

        def __init__(self, used: int):
            self.used = used

        def memory_stats(self) -> dict:
            return {"bytes_in_use": self.used, "peak_bytes_in_use": self.used * 2, "bytes_limit": 80 << 30}

    class Cpu:
        device_kind = "cpu"

        def memory_stats(self) -> None:
            return None

    assert device_memory([Gpu(1 << 30), Gpu(3 << 30)]) == {
        "device_memory_bytes": 3 << 30,
        "device_memory_peak_bytes": 6 << 30,
        "device_memory_limit_bytes": 80 << 30,
    }
    assert device_memory([Cpu()]) == {}
    sample = Telemetry([Cpu()]).sample()
    assert sample["device_kind"] == "cpu" and sample["host_memory_bytes"] > 0
    assert "gpu_utilization" not in sample  # nvidia-ml-py may be installed; no NVIDIA driver here
    timer = StepTimer()
    with timer.part("data"):
        time.sleep(0.01)
    row = timer.take(0.5)
    assert row["step_seconds"] == 0.5 and row["data_seconds"] >= 0.01 and row["publish_seconds"] == 0
    assert timer.take(0.1)["data_seconds"] == 0


@pytest.mark.slow  # the default suite's 15-minute budget; make test-slow runs it
@pytest.mark.browser
def test_live_page_reloads_itself_in_the_browser(tmp_path: Path) -> None:
    from tokenmill.reports.browser import headless_chromium, missing_browser

    missing = missing_browser()
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not found: run `make browser` (Debian's chromium and chromium-driver)"
        )
    run = tmp_path / "run"
    run.mkdir()
    metrics = run / "metrics.jsonl"

    def log_steps(steps: range) -> int:
        with metrics.open("a") as handle:
            for step in steps:
                handle.write(json.dumps({"step": step, "phase": "pretraining", "loss": 6 - step / 10}) + "\n")
        return metrics.stat().st_size

    site = tmp_path / "site"
    publisher = LivePublisher(run, str(site), every=1, refresh_seconds=1)
    publisher.submit(5, log_steps(range(5)), state="training")
    deadline = time.time() + 20
    while not (site / publish.PAGE).exists() and time.time() < deadline:
        time.sleep(0.05)
    with headless_chromium("tokenmill-live-") as driver:
        driver.get((site / publish.PAGE).as_uri())
        first = driver.find_element("id", "last-updated").text
        assert "at step 5." in first and "reloads itself every 1 s" in first
        publisher.close(9, log_steps(range(5, 9)), state="finished", timeout=20)
        deadline = time.time() + 15
        text = first
        while time.time() < deadline:
            time.sleep(0.25)
            try:
                text = driver.find_element("id", "last-updated").text
            except Exception:  # noqa: BLE001 - mid-reload
                continue
            if "at step 9." in text:
                break
        assert "at step 9." in text, text
        assert driver.find_element("id", "run-state").text == "phase finished"
        errors = [e for e in driver.get_log("browser") if e.get("level") in ("SEVERE", "ERROR")]
        assert not errors, errors


def test_live_page_shows_the_plan_and_the_final_report_takes_its_place(tmp_path: Path) -> None:
    """The demo's layout: the trainer publishes into the folder the final `tokenmill report` writes."""
    from tokenmill.cli import main
    from tokenmill.samples.report_inputs import make_report_inputs, report_args

    inputs = make_report_inputs(tmp_path / "inputs")
    config_path = inputs.run / "config.json"
    run_config = json.loads(config_path.read_text())
    plan = json.loads(inputs.plan.read_text())
    config_path.write_text(json.dumps({**run_config, "plan": plan}))  # as the trainer records it
    middle = plan["phases"][1]
    metrics = inputs.run / "metrics.jsonl"
    metrics.write_text(
        "".join(
            json.dumps(
                {
                    "step": step,
                    "phase": "pretraining" if step < middle["start_step"] else "midtraining",
                    "loss": 5 - step / 100,
                    "step_seconds": 2.0,
                    "timestamp": 1.8e9 + 2 * step,
                }
            )
            + "\n"
            for step in range(middle["start_step"] + 3)
        )  # fmt: skip
    )
    live_rows = b"".join(line + b"\n" for line in metrics.read_bytes().splitlines()[:-1])
    done = middle["start_step"] + 2

    site = tmp_path / "site"
    publisher = LivePublisher(inputs.run, str(site), every=1, refresh_seconds=30)
    publisher.submit(done, len(live_rows), target_step=middle["end_step"])
    assert publisher.close(timeout=30)
    page = (site / "run.html").read_text()
    assert '<meta http-equiv="refresh" content="30">' in page
    assert (site / "data/run/metrics.jsonl").read_bytes() == live_rows
    assert json.loads((site / "data/run/plan.json").read_text()) == plan
    # The second phase's boundary on the progress bar, its sources with their weights, and an ETA from the
    # measured throughput.
    assert f"midtraining from step {middle['start_step']:,}" in page
    assert "Mixture sampled in phase midtraining" in page
    for source in middle["sources"]:
        assert f"{100 * source['weight']:.1f}%" in page and source["name"] in page
    left = 2.0 * (middle["end_step"] - done)
    assert f"reaches step {middle['end_step']:,} in {left:.0f} s" in page
    assert f"step {done:,} of {plan['phases'][-1]['end_step']:,}" in page

    assert main(report_args(inputs, site)) == 0
    page = (site / "run.html").read_text()
    assert 'http-equiv="refresh"' not in page and 'href="index.html"' in page
    assert (site / "index.html").exists() and not (site / publish.STATUS).exists()
    assert (site / "data/run/metrics.jsonl").read_bytes() == metrics.read_bytes()


def test_the_ladder_forecast_is_drawn_against_the_live_loss(tmp_path: Path, capsys) -> None:
    import numpy as np
    from test_ladder import TARGET, synthetic_curve, synthetic_runs, write_run

    from tokenmill.cli import main

    runs = synthetic_runs(tmp_path / "ladder", 0.02, 3, True)
    target = write_run(
        tmp_path / "target",
        synthetic_curve("target", 1000, TARGET / 1000, 0.02, np.random.default_rng(4), True),
    )
    fit = tmp_path / "ladder" / "ladder.json"
    assert main(["ladder", "fit", *map(str, runs), "--target", "2.7e24", "--bootstrap", "20",
                 "--output", str(fit)]) == 0  # fmt: skip
    capsys.readouterr()
    metrics = target / "metrics.jsonl"
    live = b"".join(line + b"\n" for line in metrics.read_bytes().splitlines()[:400])  # 40% trained
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(PublishError, match="not a ladder fit"):
        LivePublisher(target, str(tmp_path / "site"), every=1, ladder=str(tmp_path / "bad.json"))
    publisher = LivePublisher(target, str(tmp_path / "site"), every=1, ladder=str(fit))
    publisher.submit(400, len(live))
    assert publisher.close(timeout=30)
    page = (tmp_path / "site" / "run.html").read_text()
    assert 'id="ladder-forecast"' in page and 'data-chart="Forecast against this run"' in page
    assert (tmp_path / "site" / "data/run/ladder.json").read_bytes() == fit.read_bytes()
    args = build_parser().parse_args(
        ["train", "--data.synthetic", "--logging.publish", "x", "--logging.publish_ladder", str(fit)]
    )
    assert run_config_of(args).logging.publish_ladder == str(fit)


def test_nvml_readings_per_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML through a stand-in for nvidia-ml-py (no NVIDIA driver here): the GPUs CUDA_VISIBLE_DEVICES
    names, watts from milliwatts, and a driver that stops answering leaves the keys out."""
    import types

    from tokenmill.trainer.run.telemetry import Nvml

    class Readings:
        def __init__(self, index: int):
            self.index = index

    fake = types.SimpleNamespace(
        NVML_TEMPERATURE_GPU=0,
        broken=False,
        shut=[],
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: fake.shut.append(True),
        nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=Readings,
    )

    def utilization(handle: Readings):
        if fake.broken:
            raise RuntimeError("NVMLError_GpuIsLost")
        return types.SimpleNamespace(gpu=90 + handle.index, memory=10)

    fake.nvmlDeviceGetUtilizationRates = utilization
    fake.nvmlDeviceGetPowerUsage = lambda h: utilization(h) and 300_000 + 1000 * h.index
    fake.nvmlDeviceGetTemperature = lambda h, sensor: utilization(h) and 60 + h.index
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    nvml = Nvml.open()
    assert nvml is not None
    assert nvml.sample() == {
        "gpu_utilization": [92.0, 93.0],
        "gpu_power_watts": [302.0, 303.0],
        "gpu_temperature_c": [62.0, 63.0],
    }
    fake.broken = True
    assert nvml.sample() == {} and nvml.sample() == {}  # given up on, after one warning
    nvml.close()
    assert fake.shut == [True]

    def no_driver() -> None:
        raise RuntimeError("NVMLError_LibraryNotFound")

    fake.nvmlInit = no_driver
    assert Nvml.open() is None
