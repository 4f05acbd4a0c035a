"""A run's bad hours with injected faults: a NaN batch, a spike, K skips in a row (rollback), SIGTERM in the
middle of a step, kill -9 in the middle of a checkpoint, a step that hangs. Each run finishes (after a
rerun where it stopped), its events.jsonl lists exactly what happened, and its final train state equals
bit for bit that of a reference run that skipped the same steps (guard.skip_steps).

Faults come from the data: a batch whose first token is NAN_TOKEN (or SPIKE_TOKEN) multiplies the loss by
NaN (or 1000) inside the model's loss, a token the synthetic source never draws. The faulty and the
reference run compile the same program (the patched loss), so their applied steps are the same arithmetic.
The runs that must die (SIGTERM, kill -9, a hang) run in child processes: this file is also the child
(`python tests/test_run_health.py CHILD.json`), and every run of such a test runs there, so that all of
them compile alike.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_trainer import config, source, tiny

from tokenmill.formats.events import read_events
from tokenmill.trainer.data.batch import Batch
from tokenmill.trainer.model import transformer
from tokenmill.trainer.run import guard
from tokenmill.trainer.run import step as step_module
from tokenmill.trainer.run.checkpoint import Checkpointer
from tokenmill.trainer.run.config import Phase, resolve_run_config
from tokenmill.trainer.run.loop import train
from tokenmill.trainer.run.watchdog import HANG_EXIT, REQUEUE_EXIT, Preempted

NAN_TOKEN, SPIKE_TOKEN = 255, 254
STEPS = 12
# A small window so that spikes are called within a dozen steps; the same for every run here (one program).
GUARD = {"guard__window": 8, "guard__warmup": 4, "guard__sigmas": 6.0}
CHILD_FLAGS = "--xla_backend_optimization_level=0"


def patch_loss() -> None:
    """The model's loss times NaN (or 1000) for a batch whose first token is NAN_TOKEN (SPIKE_TOKEN)."""
    original = transformer.loss_fn

    def loss_fn(params, bias, tokens, segment_ids, cfg, dtype):
        total, (loss, stats) = original(params, bias, tokens, segment_ids, cfg, dtype)
        first = tokens[0, 0]
        factor = jnp.where(first == NAN_TOKEN, jnp.nan, jnp.where(first == SPIKE_TOKEN, 1000.0, 1.0))
        return total * factor, (loss * factor, stats)

    transformer.loss_fn = loss_fn
    step_module._COMPILED_STEPS.clear()


class FaultySource:
    """The tests' synthetic source with faults at chosen steps: {step: "nan" | "spike" | "hang" | "signal"}.
    "signal" writes `marker` and waits a second in the batch, for a signal to arrive while the step runs."""

    def __init__(self, faults: dict[int, str], marker: str | None = None):
        self.inner = source(tiny())
        self.vocab_size, self.tokenizer_sha256 = self.inner.vocab_size, self.inner.tokenizer_sha256
        self.faults, self.marker = faults, marker

    def batch(self, step: int) -> Batch:
        batch = self.inner.batch(step)
        fault = self.faults.get(step)
        if fault in ("nan", "spike"):
            tokens = batch.tokens.copy()
            tokens[0, 0] = NAN_TOKEN if fault == "nan" else SPIKE_TOKEN
            return Batch(tokens=tokens, segment_ids=batch.segment_ids)
        if fault == "hang":
            time.sleep(3600)
        if fault == "signal":
            Path(self.marker).write_text("in the step")
            time.sleep(1.0)
        return batch


def run_once(run_dir: Path, faults: dict, stop_after: int | None = None, marker: str | None = None,
             **overrides) -> list[dict]:  # fmt: skip
    settings = {"checkpoint__every": 4, "logging__health_every": 4, **GUARD, **overrides}
    cfg = config(run_dir, **settings)
    return train(resolve_run_config(cfg, [Phase("pretraining", 0, STEPS)]), FaultySource(faults, marker),
                 stop_after=stop_after)  # fmt: skip


def final_state(run_dir: Path, step: int = STEPS) -> list[np.ndarray]:
    checkpoints = Checkpointer(run_dir / "run" / "checkpoints", read_only=True)
    assert checkpoints.latest_step() == step
    import orbax.checkpoint as ocp

    restored = checkpoints.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    checkpoints.close()
    return [np.asarray(leaf) for leaf in jax.tree.leaves(restored["state"])]


def assert_same_state(a: Path, b: Path) -> None:
    left, right = final_state(a), final_state(b)
    assert len(left) == len(right)
    for x, y in zip(left, right, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x, y, equal_nan=True)


def checkpoints_recorded(run_dir: Path) -> list[int]:
    """The checkpoint events' steps, in order (each recorded once complete on disk, so its place among the
    other events depends on how fast the background write was)."""
    return [
        e.checkpoint for e in read_events(str(run_dir / "run" / "events.jsonl")) if e.kind == "checkpoint"
    ]


def kinds(run_dir: Path) -> list[tuple]:
    """(kind, step, and what else identifies it) for each event of the run but checkpoints."""
    out = []
    for item in read_events(str(run_dir / "run" / "events.jsonl")):
        if item.kind == "checkpoint":
            continue
        if item.kind == "start":
            out.append(("start", item.step, item.resumed_from))
            continue
        extra = {"skip": item.reason, "rollback": (item.checkpoint, item.skipped_to),
                 "excluded": item.skipped_to,
                 "preemption": item.checkpoint, "watchdog": item.first_step}.get(item.kind)  # fmt: skip
        out.append((item.kind, item.step, extra) if extra is not None else (item.kind, item.step))
    return out


def test_guard_rules():
    """Non-finite always skips and never enters the window; a spike is called only after the warm-up."""
    window = guard.init_window(4)
    decide = jax.jit(guard.decide, static_argnums=(3, 4))
    one = lambda w, loss, norm: (decide(w, jnp.float32(loss), jnp.float32(norm), 6.0, 2),)  # noqa: E731
    # Before the warm-up even a huge value is applied; non-finite never is.
    assert int(one(window, 1e9, 1.0)[0]) == guard.APPLIED
    assert int(one(window, np.nan, 1.0)[0]) == guard.NONFINITE_LOSS
    assert int(one(window, 1.0, np.inf)[0]) == guard.NONFINITE_GRAD_NORM
    skipped = guard.record(window, jnp.float32(np.nan), jnp.float32(1.0), jnp.int32(guard.NONFINITE_LOSS))
    assert int(skipped["filled"]) == 0 and int(skipped["consecutive"]) == 1
    for loss, norm in [(2.0, 1.0), (2.1, 1.1), (1.9, 0.9)]:
        window = guard.record(window, jnp.float32(loss), jnp.float32(norm), jnp.int32(guard.APPLIED))
    assert int(window["filled"]) == 3 and int(window["consecutive"]) == 0
    assert int(one(window, 2.2, 1.0)[0]) == guard.APPLIED  # within 6 sigma (sigma ~0.08)
    assert int(one(window, 3.0, 1.0)[0]) == guard.LOSS_SPIKE
    assert int(one(window, 2.0, 5.0)[0]) == guard.GRAD_NORM_SPIKE
    # A ring: the fifth applied value replaces the first.
    for value in (2.0, 3.0):
        window = guard.record(window, jnp.float32(value), jnp.float32(1.0), jnp.int32(guard.APPLIED))
    assert int(window["filled"]) == 4 and np.asarray(window["loss"])[0] == 3.0


@pytest.fixture
def faulty_loss(monkeypatch):
    monkeypatch.setattr(transformer, "loss_fn", transformer.loss_fn)
    monkeypatch.setattr(step_module, "_COMPILED_STEPS", {})
    patch_loss()


def test_nan_and_spike_are_skipped_exactly(tmp_path, faulty_loss):
    rows = run_once(tmp_path / "faulty", {4: "nan", 9: "spike"})
    run_once(tmp_path / "reference", {}, guard__skip_steps=[4, 9])
    assert [r["step"] for r in rows] == list(range(STEPS))
    assert {r["step"]: r["skipped"] for r in rows if "skipped" in r} == {4: "nonfinite_loss", 9: "loss_spike"}
    assert np.isnan(rows[4]["loss"]) and rows[9]["loss"] > 100
    # Health every 4 steps: the groups' norms make up the whole parameter norm; the skipped step 4
    # changed nothing (every update norm exactly 0), the applied step 8 did.
    assert [r["step"] for r in rows if "param_norms" in r] == [0, 4, 8]
    for r in (rows[0], rows[8]):
        total = sum(np.sum(np.square(v)) for v in r["param_norms"].values())
        assert np.sqrt(total) == pytest.approx(r["param_norm"], rel=1e-4)
        assert len(r["param_norms"]["experts"]) == len(r["router_bias_change"]) == 2
        assert len(r["router_z_loss_layers"]) == 2 and min(r["router_z_loss_layers"]) > 0
    assert all(np.all(np.asarray(v) == 0) for v in rows[4]["update_norms"].values())
    assert rows[4]["router_bias_change"] == [0.0, 0.0]
    assert all(np.all(np.asarray(v) > 0) for v in rows[8]["update_norms"].values())
    assert kinds(tmp_path / "faulty") == [
        ("start", 0, None), ("skip", 4, "nonfinite_loss"), ("skip", 9, "loss_spike"), ("finish", 12),
    ]  # fmt: skip
    assert checkpoints_recorded(tmp_path / "faulty") == [4, 8, 12]
    excluded = [k for k in kinds(tmp_path / "reference") if k[0] == "excluded"]
    assert excluded == [("excluded", 4, 4), ("excluded", 9, 9)]
    assert_same_state(tmp_path / "faulty", tmp_path / "reference")
    # metrics.jsonl has the skipped rows, marked.
    written = [json.loads(line) for line in (tmp_path / "faulty/run/metrics.jsonl").read_text().splitlines()]
    assert [r.get("skipped") for r in written][4] == "nonfinite_loss"


def test_rollback_after_skips_in_a_row_and_a_resumed_run_skips_the_same(tmp_path, faulty_loss):
    # NaN at 7 and 8, two in a row: back to checkpoint 4 (8 is after the first skip and is deleted), steps
    # 4..8 never trained; "killed" right after, before any new checkpoint: the rerun must skip them again.
    first = run_once(tmp_path / "faulty", {7: "nan", 8: "nan"}, stop_after=9, guard__rollback_after=2)
    assert [r["step"] for r in first] == list(range(9))
    assert Checkpointer(tmp_path / "faulty/run/checkpoints", read_only=True).all_steps() == [4]
    second = run_once(tmp_path / "faulty", {7: "nan", 8: "nan"}, guard__rollback_after=2)
    assert [r["step"] for r in second] == [9, 10, 11]
    run_once(tmp_path / "reference", {}, guard__skip_steps=[4, 5, 6, 7, 8])
    assert kinds(tmp_path / "faulty") == [
        ("start", 0, None), ("skip", 7, "nonfinite_loss"), ("skip", 8, "nonfinite_loss"),
        ("rollback", 8, (4, 8)), ("start", 4, 4), ("excluded", 4, 8), ("finish", 12),
    ]  # fmt: skip
    # Checkpoint 8 was complete before the rollback deleted it; the rerun wrote 12.
    assert checkpoints_recorded(tmp_path / "faulty") == [4, 8, 12]
    starts = [e for e in read_events(str(tmp_path / "faulty/run/events.jsonl")) if e.kind == "start"]
    assert starts[0].previous is None and starts[1].previous["kind"] == "killed"
    assert_same_state(tmp_path / "faulty", tmp_path / "reference")


@pytest.mark.browser
def test_the_live_page_marks_the_events_and_lists_them(tmp_path, faulty_loss):
    """Headless Chromium on the page the run published as it trained (its final version): the loss and
    norm charts mark the skips and the rollback at their steps, the table lists every event."""
    from tokenmill.reports.browser import headless_chromium, missing_browser

    missing = missing_browser()
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not found: run `make browser` (Debian's chromium and chromium-driver)"
        )
    site = tmp_path / "site"
    run_once(tmp_path / "faulty", {7: "nan", 8: "nan", 10: "nan"}, guard__rollback_after=2,
             logging__publish=str(site), logging__publish_every=4)  # fmt: skip
    with headless_chromium("tokenmill-events-") as driver:
        driver.get((site / "run.html").as_uri())
        markers = driver.execute_script(
            "return Object.fromEntries(['Training loss', 'Gradient norm', 'Learning rate'].map(t => [t,"
            " Array.from(document.querySelectorAll(`figure[data-chart='${t}'] line.event`))"
            "   .map(l => [l.dataset.event, Number(l.dataset.step)])]))"
        )
        expected = [["skip", 7], ["skip", 8], ["rollback", 8], ["skip", 10]]
        assert markers["Training loss"] == markers["Gradient norm"] == expected
        assert markers["Learning rate"] == []
        rows = driver.execute_script(
            "return Array.from(document.querySelectorAll('table.events tbody tr'))"
            ".map(r => [r.dataset.event, r.cells[0].textContent])"
        )
        assert rows == [["finish", "12"], ["skip", "10"], ["rollback", "8"], ["skip", "8"], ["skip", "7"],
                        ["start", "0"]]  # fmt: skip
        assert "checkpoints recorded" in driver.find_element("id", "events").text
        errors = [e for e in driver.get_log("browser") if e.get("level") in ("SEVERE", "ERROR")]
        assert not errors, errors
    assert (site / "data/run/events.jsonl").read_bytes() == (
        tmp_path / "faulty/run/events.jsonl"
    ).read_bytes()


def test_too_many_rollbacks_stop_the_run(tmp_path, faulty_loss):
    from tokenmill.trainer.run.resume import TrainingError

    with pytest.raises(TrainingError, match=r"steps skipped in a row and 1 rollbacks already"):
        run_once(tmp_path / "r", {s: "nan" for s in range(5, STEPS)}, guard__rollback_after=2,
                 guard__max_rollbacks=1)  # fmt: skip
    assert [k[0] for k in kinds(tmp_path / "r")][-1] == "stop"


# ---------------------------------------------------------------------------------------------------------
# Runs that die: in child processes.


def child(
    run_dir: Path,
    faults: dict,
    *,
    expect: int = 0,
    signal_after_marker: int | None = None,
    kill_at_checkpoint: int | None = None,
    timeout: float = 300,
    **overrides,
) -> subprocess.CompletedProcess:
    """One run of `run_once` in a child process (this file), which must exit with `expect`; with
    signal_after_marker, that signal is sent once the faulty batch says the step is under way."""
    spec = {"run_dir": str(run_dir), "faults": {str(k): v for k, v in faults.items()}, "overrides": overrides,
            "kill_at_checkpoint": kill_at_checkpoint, "marker": str(run_dir) + ".marker"}  # fmt: skip
    spec_path = Path(str(run_dir) + ".json")
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, XLA_FLAGS=CHILD_FLAGS, JAX_PLATFORMS="cpu")
    process = subprocess.Popen([sys.executable, __file__, str(spec_path)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    if signal_after_marker is not None:
        marker = Path(spec["marker"])
        deadline = time.monotonic() + timeout
        while not marker.exists():
            assert process.poll() is None and time.monotonic() < deadline, process.communicate()[0]
            time.sleep(0.05)
        process.send_signal(signal_after_marker)
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == expect, output
    return subprocess.CompletedProcess(process.args, process.returncode, output)


def _child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    if spec["kill_at_checkpoint"] is not None:
        save = Checkpointer.save

        def save_then_die(self, step, state, meta):
            save(self, step, state, meta)
            if step == spec["kill_at_checkpoint"]:
                os.kill(os.getpid(), signal.SIGKILL)  # while orbax writes it in the background

        Checkpointer.save = save_then_die
    patch_loss()
    faults = {int(k): v for k, v in spec["faults"].items()}
    try:
        run_once(Path(spec["run_dir"]), faults, marker=spec["marker"], **spec["overrides"])
    except Preempted as error:
        return error.exit_code
    return 0


@pytest.mark.slow
def test_sigterm_mid_step_checkpoints_exits_75_and_resumes_exactly(tmp_path):
    child(tmp_path / "run", {5: "signal"}, expect=REQUEUE_EXIT, signal_after_marker=signal.SIGTERM)
    # The step in flight (5) finished, then the checkpoint of step 6.
    assert Checkpointer(tmp_path / "run/run/checkpoints", read_only=True).latest_step() == 6
    child(tmp_path / "run", {})
    child(tmp_path / "reference", {})
    assert kinds(tmp_path / "run") == [
        ("start", 0, None),
        ("preemption", 6, 6),
        ("start", 6, 6),
        ("finish", 12),
    ]
    assert checkpoints_recorded(tmp_path / "run") == [4, 6, 8, 12]
    starts = [e for e in read_events(str(tmp_path / "run/run/events.jsonl")) if e.kind == "start"]
    assert starts[1].previous["kind"] == "preemption" and starts[1].previous["step"] == 6
    assert_same_state(tmp_path / "run", tmp_path / "reference")


@pytest.mark.slow
def test_kill_9_mid_checkpoint_resumes_from_the_last_complete_one(tmp_path):
    result = child(tmp_path / "run", {}, expect=-signal.SIGKILL, kill_at_checkpoint=8)
    assert "Traceback" not in result.stdout
    assert Checkpointer(tmp_path / "run/run/checkpoints", read_only=True).latest_step() == 4
    child(tmp_path / "run", {})
    child(tmp_path / "reference", {})
    assert kinds(tmp_path / "run") == [("start", 0, None), ("start", 4, 4), ("finish", 12)]
    # 8 was being written when the process died: never recorded, never listed; the rerun wrote it again.
    assert checkpoints_recorded(tmp_path / "run") == [4, 8, 12]
    starts = [e for e in read_events(str(tmp_path / "run/run/events.jsonl")) if e.kind == "start"]
    assert starts[1].previous["kind"] == "killed"
    assert_same_state(tmp_path / "run", tmp_path / "reference")


@pytest.mark.slow
def test_a_hanging_step_dumps_the_stacks_and_exits_76(tmp_path):
    child(tmp_path / "run", {6: "hang"}, expect=HANG_EXIT, watchdog__step_seconds=3)
    log = (tmp_path / "run/run/train.log").read_text()
    assert "no step within 3 s" in log and "in batch" in log  # the hung frame: FaultySource.batch
    child(tmp_path / "run", {})
    child(tmp_path / "reference", {})
    assert kinds(tmp_path / "run") == [
        ("start", 0, None),
        ("watchdog", 6, False),
        ("start", 4, 4),
        ("finish", 12),
    ]
    assert checkpoints_recorded(tmp_path / "run") == [4, 8, 12]
    starts = [e for e in read_events(str(tmp_path / "run/run/events.jsonl")) if e.kind == "start"]
    assert starts[1].previous["kind"] == "watchdog"
    assert_same_state(tmp_path / "run", tmp_path / "reference")


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))


@pytest.mark.slow
def test_two_processes_one_signalled_both_checkpoint_and_exit_75_then_resume(tmp_path):
    """SIGTERM reaches one of two hosts: they agree after the step in flight, save the same checkpoint
    together, both exit 75; the same two commands again resume from it and finish."""
    from test_multihost import environment, free_port
    from test_multihost import train as train_command

    output = tmp_path / "together"

    def start_both() -> list[subprocess.Popen]:
        address = f"127.0.0.1:{free_port()}"
        return [
            subprocess.Popen(
                train_command(
                    output,
                    40,
                    "--coordinator",
                    address,
                    "--num-processes",
                    "2",
                    "--process-id",
                    str(index),
                    "--checkpoint.every",
                    "100",
                ),
                env=environment(2),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for index in range(2)
        ]

    processes = start_both()
    metrics = output / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert all(p.poll() is None for p in processes) and time.monotonic() < deadline
        time.sleep(0.1)
    processes[1].send_signal(signal.SIGTERM)
    logs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [REQUEUE_EXIT, REQUEUE_EXIT], "\n".join(logs)[-4000:]
    preempted = [e for e in read_events(str(output / "events.jsonl")) if e.kind == "preemption"]
    assert len(preempted) == 1 and preempted[0].checkpoint is not None
    at = preempted[0].checkpoint
    assert 3 <= at < 40 and Checkpointer(output / "checkpoints", read_only=True).latest_step() == at

    processes = start_both()
    logs = [p.communicate(timeout=300)[0] for p in processes]
    assert [p.returncode for p in processes] == [0, 0], "\n".join(logs)[-4000:]
    events = read_events(str(output / "events.jsonl"))
    assert [(e.kind, e.step) for e in events if e.kind != "checkpoint"] == [
        ("start", 0), ("preemption", at), ("start", at), ("finish", 40),
    ]  # fmt: skip
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(40))


def test_a_checkpoint_from_before_the_guard_resumes_with_an_empty_window(tmp_path):
    checkpoints = Checkpointer(tmp_path / "checkpoints", async_save=False)
    checkpoints.save(3, {"step": jnp.int32(3), "params": {"w": jnp.arange(4.0)}}, {"step": 3})
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    layout = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
        {"step": jnp.int32(0), "params": {"w": jnp.zeros(4)}, "guard": guard.init_window(8)},
    )
    state, meta = checkpoints.restore(3, layout)
    checkpoints.close()
    assert meta == {"step": 3} and np.array_equal(state["params"]["w"], np.arange(4.0))
    assert jax.tree.map(np.asarray, state["guard"]).keys() == guard.init_window(8).keys()
    assert int(state["guard"]["filled"]) == 0 and state["guard"]["loss"].shape == (8,)
