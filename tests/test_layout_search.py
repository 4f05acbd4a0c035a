"""The layout chooser (`tokenmill model compile --search`, run/layouts.py): which layouts of N devices it
lists and refuses, how it walks a mesh's microbatch counts and ranks what fits, and the command end to end
on 8 simulated devices, its best layout checked against a plain `model compile --mesh` of it.

The command runs as a user runs it, from a plain process that has not set XLA_FLAGS (as in
test_model_compile.py); the candidate and ranking tests are pure Python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tokenmill.trainer.commands.model import format_layout_search, parse_mesh_axes
from tokenmill.trainer.model.shape import ModelConfig, MoEConfig
from tokenmill.trainer.run import layouts
from tokenmill.trainer.run.layouts import candidate_layouts, meshes, microbatch_counts, search_layouts

REPO = Path(__file__).resolve().parents[1]


def shape(**moe_fields) -> ModelConfig:
    fields = dict(n_experts=8, top_k=2, expert_hidden=16)
    fields.update(moe_fields)
    return ModelConfig(name="t", vocab_size=64, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8,
                       sequence_length=8, moe=MoEConfig(**fields))  # fmt: skip


# --- candidate_layouts: pure Python -------------------------------------------------------------------------


def test_every_mesh_of_the_devices_is_listed_once():
    found = meshes(8)
    # 8 = 2^3 over three axes: (3+2 choose 2) = 10 ordered triples; 64 = 2^6: 28; 12 = 2^2 x 3: 6 x 3.
    assert len(found) == 10 and len(meshes(64)) == 28 and len(meshes(12)) == 18
    assert len({tuple(mesh.values()) for mesh in found}) == 10
    assert all(mesh["data"] * mesh["fsdp"] * mesh["expert"] == 8 for mesh in found)
    assert {"data": 1, "fsdp": 8, "expert": 1} in found and {"data": 8, "fsdp": 1, "expert": 1} in found
    # Each is what `model compile --mesh` reads back.
    for mesh in found:
        assert parse_mesh_axes(layouts.mesh_text(mesh), 8) == mesh


def test_experts_divisible_by_eight_make_every_mesh_a_candidate():
    candidates, refused = candidate_layouts(shape(), 8, batch_size=64, max_microbatches=16)
    assert refused == [] and len(candidates) == 10
    # 8 rows per device: the powers of two that divide 8, up to 16.
    assert all(candidate.microbatches == [1, 2, 4, 8] for candidate in candidates)
    capped, _ = candidate_layouts(shape(), 8, batch_size=64, max_microbatches=2)
    assert all(candidate.microbatches == [1, 2] for candidate in capped)


def test_expert_axes_that_do_not_divide_the_experts_are_refused_with_the_reason():
    candidates, refused = candidate_layouts(shape(n_experts=6, top_k=2), 8, batch_size=16)
    # 6 experts split over an expert axis of 1 or 2, not 4 or 8: the 3 + 1 meshes with those are refused.
    assert sorted(item.mesh["expert"] for item in refused) == [4, 4, 8]
    assert len(candidates) == 7 and {candidate.mesh["expert"] for candidate in candidates} == {1, 2}
    assert {item.reason for item in refused} == {
        "6 experts do not split over an expert axis of 4",
        "6 experts do not split over an expert axis of 8",
    }
    # Without expert parallelism the stacks would stay whole on every expert shard: refused the same.
    _, off = candidate_layouts(shape(n_experts=6, expert_parallel=False), 8, batch_size=16)
    assert len(off) == 3


def test_exact_quantile_balancing_refuses_an_expert_axis_under_expert_parallelism():
    exact = shape(balancing="quantile", bias_space="logit")
    candidates, refused = candidate_layouts(exact, 8, batch_size=8)
    assert {candidate.mesh["expert"] for candidate in candidates} == {1} and len(candidates) == 4
    assert len(refused) == 6 and all("quantile_bins" in item.reason for item in refused)
    # With a histogram (Marin's 10,000 bins), or with the experts left to the partitioner, all ten run.
    assert len(candidate_layouts(shape(balancing="quantile", quantile_bins=64), 8, 8)[0]) == 10
    assert len(candidate_layouts(shape(balancing="quantile", expert_parallel=False), 8, 8)[0]) == 10


def test_a_batch_that_does_not_split_over_the_devices_refuses_every_mesh():
    candidates, refused = candidate_layouts(shape(), 8, batch_size=12)
    assert candidates == [] and len(refused) == 10
    assert "a batch of 12 rows does not split over 8 devices" in refused[0].reason
    with pytest.raises(ValueError):
        candidate_layouts(shape(), 8, batch_size=8, max_microbatches=0)


def test_microbatch_counts_are_the_powers_of_two_dividing_the_rows_per_device():
    assert microbatch_counts(16, 16) == [1, 2, 4, 8, 16]
    assert microbatch_counts(16, 4) == [1, 2, 4]
    assert microbatch_counts(12, 16) == [1, 2, 4]  # 3, 6 and 12 are not powers of two; 8 does not divide
    assert microbatch_counts(5, 16) == [1]
    assert microbatch_counts(1, 16) == [1]
    candidates, _ = candidate_layouts(shape(), 4, batch_size=48, max_microbatches=16)
    assert all(candidate.microbatches == [1, 2, 4] for candidate in candidates)


# --- search_layouts' walk and ranking, on a stand-in for the compile ----------------------------------------


def fake_report(mesh: dict, microbatches: int, total: float, communication: float, compute: float) -> dict:
    """The fields of compile_report's dict that the search reads."""
    return {
        "mesh": dict(mesh), "microbatches": microbatches, "dispatch": "capacity", "optimizer": "adamw",
        "bytes_per_device": {"total": total, "host": 0}, "fits": None, "margin_bytes": None,
        "model_flops_executed": 1.0, "compile_seconds": 0.1,
        "communication": {
            "bytes_per_device": {"weight_gather": communication * 1e9, "total": communication * 1e9},
            "communication_seconds": {"weight_gather": communication, "total": communication},
            "compute_seconds": compute, "communication_over_compute": communication / compute,
            "link": {"preset": None, "bandwidth_bytes_per_second": 1e9, "peak_flops_per_device": 1e15,
                     "mfu": 0.4},
        },
    }  # fmt: skip


def test_the_search_stops_at_the_first_count_that_fits_and_ranks_by_step_time(monkeypatch):
    """Totals shrink with the count, fastest where fsdp is largest; data=8 fits at no count."""
    calls = []

    def compile_report(cfg, mesh, batch_size, sequence_length, device_memory, **options):
        assert options["probe_microbatches"] is False and options["count_communication"] is True
        count = options["microbatches"]
        calls.append((layouts.mesh_text(mesh), count))
        total = 100 * mesh["data"] / count  # bytes per device: replicas over data, activations over counts
        report = fake_report(mesh, count, total, communication=1.0 / mesh["fsdp"] + 0.1 * count, compute=0.5)
        report["fits"], report["margin_bytes"] = total <= device_memory, device_memory - total
        return report

    monkeypatch.setattr("tokenmill.trainer.run.compile.compile_report", compile_report)
    lines = []
    result = search_layouts(shape(), 8, 32, None, device_memory=60, max_microbatches=4, progress=lines.append)
    by_mesh: dict[str, list[int]] = {}
    for name, count in calls:
        by_mesh.setdefault(name, []).append(count)
    # Ascending per mesh, stopping at the first that fits: 100 x data / count <= 60.
    assert by_mesh["data=1,fsdp=8,expert=1"] == [1, 2]
    assert by_mesh["data=2,fsdp=4,expert=1"] == [1, 2, 4]
    assert by_mesh["data=4,fsdp=2,expert=1"] == [1, 2, 4]  # 400 / 4 = 100: never fits
    assert by_mesh["data=8,fsdp=1,expert=1"] == [1, 2, 4]
    assert result["compiles"] == len(calls) == sum(len(counts) for counts in by_mesh.values())
    assert len(lines) == 2 * len(calls)  # one progress line before and one after each compile
    fitting = [entry for entry in result["candidates"] if entry["fits"]]
    assert [entry["rank"] for entry in fitting] == list(range(1, len(fitting) + 1))
    steps = [entry["step_seconds"] for entry in fitting]
    assert steps == sorted(steps)
    for entry in result["candidates"]:
        seconds = entry["communication_seconds"]["total"]
        assert entry["step_seconds"] == pytest.approx(entry["compute_seconds"] + seconds)
        assert entry["step_seconds_overlapped"] == pytest.approx(max(entry["compute_seconds"], seconds))
    assert result["best"] is fitting[0]
    # The unranked rest, after the fitting ones: every count of the meshes that never fit, and the
    # counts tried before a mesh fitted.
    assert all(entry["rank"] is None for entry in result["candidates"][len(fitting) :])
    text = format_layout_search(result)
    assert f"best: --mesh {layouts.mesh_text(fitting[0]['mesh'])} --microbatches" in text
    never = text.split("fit at no microbatch count tried (up to 4):")[1]
    assert "data=8,fsdp=1,expert=1: total per device by microbatches 1: 800 B, 2: 400 B, 4: 200 B" in never
    before = text.split("did not fit before a larger count did:")[1].split("fit at no")[0]
    assert "data=2,fsdp=4,expert=1: total per device by microbatches 1: 200 B, 2: 100 B" in before


def test_a_layout_that_fails_to_compile_is_reported_and_the_search_goes_on(monkeypatch):
    def compile_report(cfg, mesh, batch_size, sequence_length, device_memory, **options):
        if mesh["data"] == 8:
            raise RuntimeError("XLA said no")
        report = fake_report(mesh, options["microbatches"], 1.0, communication=1.0, compute=1.0)
        report["fits"], report["margin_bytes"] = True, device_memory - 1.0
        return report

    monkeypatch.setattr("tokenmill.trainer.run.compile.compile_report", compile_report)
    result = search_layouts(shape(), 8, 8, None, device_memory=10, progress=lambda line: None)
    assert result["failed"] == [
        {"mesh": {"data": 8, "fsdp": 1, "expert": 1}, "microbatches": 1, "error": "XLA said no"}
    ]
    assert len(result["candidates"]) == 9 and "failed to compile" in format_layout_search(result)


# --- the command, on 8 simulated devices ------------------------------------------------------------------

# A model whose parameters outweigh its activations, so the data axis's replicas decide what fits: 2 experts
# (expert axes of 4 and 8 are refused, 7 meshes compile), 4,096 words of vocabulary at width 64, one row of
# 16 tokens per device (a single microbatch count: the walk over counts is tested above).
SEARCH_SHAPE = dict(
    name="search-tiny", vocab_size=4096, d_model=64, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=32,
    sequence_length=16, moe=dict(n_experts=2, top_k=1, expert_hidden=64, dispatch="capacity"),
)  # fmt: skip
# Between the meshes without replicas (data=1: about 4.0 MB per device with AdamW's state on the device,
# measured) and those with four or eight (data=4: 7.0 MB, data=8: 11.3 MB).
SEARCH_MEMORY = 6_000_000


def run_compile(*arguments: str) -> dict:
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    # Unoptimised CPU code generation, as in test_expert_parallel.py: these steps only compile.
    env["XLA_FLAGS"] = "--xla_backend_optimization_level=0"
    command = [sys.executable, "-m", "tokenmill", "model", "compile", *arguments, "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)
    report["stderr"] = done.stderr
    return report


@pytest.mark.slow  # make test-slow: seven compiles, about 40 s on 2 cores (the ranking is tested above)
def test_search_on_eight_devices_ranks_what_fits_and_agrees_with_a_plain_compile(tmp_path):
    config = tmp_path / "search-tiny.yaml"
    config.write_text(yaml.safe_dump(SEARCH_SHAPE))
    common = ["--devices", "8", "--batch-size", "8", "--optimizer", "adamw", "--compute-dtype", "float32",
              "--device-memory", str(SEARCH_MEMORY)]  # fmt: skip
    result = run_compile(str(config), *common, "--search")
    assert [item["mesh"]["expert"] for item in result["refused"]] == [8, 4, 4]
    assert all("2 experts do not split" in item["reason"] for item in result["refused"])
    assert result["failed"] == [] and result["compiles"] == 7 == len(result["candidates"])
    assert result["stderr"].count("layout search: mesh ") == 7  # progress, one line per compile
    fitting = [entry for entry in result["candidates"] if entry["fits"]]
    others = [entry for entry in result["candidates"] if not entry["fits"]]
    # Some fit and some do not; what fits is within the device's memory, what does not is over it.
    assert fitting and others
    assert all(entry["bytes_per_device_total"] <= SEARCH_MEMORY for entry in fitting)
    assert all(entry["bytes_per_device_total"] > SEARCH_MEMORY for entry in others)
    assert all(entry["margin_bytes"] == SEARCH_MEMORY - entry["bytes_per_device_total"] for entry in fitting)
    # The replicas decide: no mesh with data=1 is over, data=8 is.
    assert all(entry["mesh"]["data"] > 1 for entry in others)
    assert any(entry["mesh"]["data"] == 8 for entry in others)
    # Ranked by the estimated step time, compute + communication.
    assert [entry["rank"] for entry in fitting] == list(range(1, len(fitting) + 1))
    steps = [entry["step_seconds"] for entry in fitting]
    assert steps == sorted(steps)
    for entry in fitting:
        seconds = entry["communication_seconds"]
        assert entry["step_seconds"] == pytest.approx(entry["compute_seconds"] + seconds["total"])
        assert seconds["total"] > 0 and entry["compute_seconds"] > 0
        assert sum(value for key, value in seconds.items() if key != "total") == pytest.approx(
            seconds["total"]
        )
    # The chosen layout, compiled on its own, needs the same bytes per device.
    best = result["best"]
    assert best == fitting[0]
    alone = run_compile(str(config), *common, "--mesh", layouts.mesh_text(best["mesh"]),
                        "--microbatches", str(best["microbatches"]))  # fmt: skip
    assert alone["mesh"] == best["mesh"] and alone["fits"]
    assert alone["bytes_per_device"]["total"] == best["bytes_per_device_total"]
    assert alone["communication"]["communication_seconds"]["total"] == pytest.approx(
        best["communication_seconds"]["total"]
    )
    # What the command prints without --json: the table, the refused, the best as flags.
    text = format_layout_search(result)
    assert "rank" in text and "step" in text and "refused before compiling" in text
    assert f"best: --mesh {layouts.mesh_text(best['mesh'])} --microbatches 1" in text
    table = [line for line in text.splitlines() if line.startswith("  ") and line.split()[0].isdigit()]
    assert len(table) == len(fitting)


def test_search_refuses_mesh_and_microbatches_naming_the_flags(tmp_path, capsys):
    """Usage errors, before JAX starts: the search's own choices given by hand, its limit without it, and a
    batch no mesh can split."""
    from tokenmill.cli import main

    config = tmp_path / "search-tiny.yaml"
    config.write_text(yaml.safe_dump(SEARCH_SHAPE))
    base = ["model", "compile", str(config), "--devices", "8", "--batch-size", "8"]
    assert main([*base, "--search", "--mesh", "fsdp=8"]) == 2
    error = capsys.readouterr().err
    assert "--mesh with --search" in error
    assert main([*base, "--search", "--microbatches", "2", "--mesh", "fsdp=8"]) == 2
    assert "--mesh and --microbatches with --search" in capsys.readouterr().err
    assert main([*base, "--microbatches-max", "4"]) == 2
    assert "give it with --search" in capsys.readouterr().err
    assert main(["model", "compile", str(config), "--devices", "8", "--batch-size", "12", "--search"]) == 2
    assert "a batch of 12 rows does not split over 8 devices" in capsys.readouterr().err


def test_a_process_whose_jax_has_other_devices_reruns_the_search_with_its_flags(monkeypatch):
    """_rerun_with_devices forwards --search and --microbatches-max, and no --mesh or --microbatches."""
    from tokenmill.cli import build_parser
    from tokenmill.trainer.commands import model

    argv = ["model", "compile", "c.yaml", "--devices", "8", "--batch-size", "64", "--search",
            "--microbatches-max", "4", "--link-bandwidth", "ib-400g", "--json"]  # fmt: skip
    ran = []
    monkeypatch.setattr(model.subprocess, "run", lambda command, **_: ran.append(command) or
                        subprocess.CompletedProcess(command, 0))  # fmt: skip
    assert model._rerun_with_devices(build_parser().parse_args(argv)) == 0
    forwarded = ran[0][ran[0].index("tokenmill") + 1 :]
    assert "--search" in forwarded and "--json" in forwarded
    assert forwarded[forwarded.index("--microbatches-max") + 1] == "4"
    assert forwarded[forwarded.index("--link-bandwidth") + 1] == "ib-400g"
    assert "--mesh" not in forwarded and "--microbatches" not in forwarded
    # The child parses the same command.
    again = build_parser().parse_args(forwarded)
    assert again.search and again.microbatches_max == 4 and again.mesh is None and again.microbatches is None


# --- a real rung -------------------------------------------------------------------------------------------


@pytest.mark.slow  # make test-slow: eleven compiles of the rung, about seven minutes on 2 shared cores
def test_search_on_the_first_rung():
    """The ladder's first rung (1.6B-A61M, configs/models/marin-d768.yaml) at 16 rows of 4,096 per device
    on 8 devices, as "Compiling ahead of time" measures it (bf16, MuonH state on the host): every mesh is a
    candidate (384 experts, a 10,000-bin histogram) and fits a GB200, those with an expert axis without
    accumulation (about 52 GB per device when measured; the meshes without one need 180 GB and more)."""
    result = run_compile(
        "configs/models/marin-d768.yaml", "--devices", "8", "--batch-size", "128",
        "--sequence-length", "4096", "--optimizer-state", "pinned_host", "--search",
    )  # fmt: skip
    print(format_layout_search(result))
    assert result["refused"] == [] and result["failed"] == []
    fitting = [entry for entry in result["candidates"] if entry["fits"]]
    assert sorted(layouts.mesh_text(entry["mesh"]) for entry in fitting) == sorted(
        layouts.mesh_text(mesh) for mesh in meshes(8)
    )
    assert all(entry["bytes_per_device_total"] <= 186e9 for entry in fitting)
    assert all(entry["microbatches"] == 1 for entry in fitting if entry["mesh"]["expert"] > 1)
    # What did not fit is a smaller count of a mesh that fits at a larger one (the walk went on), over 186 GB.
    fitted_at = {layouts.mesh_text(entry["mesh"]): entry["microbatches"] for entry in fitting}
    for entry in result["candidates"]:
        if not entry["fits"]:
            assert entry["bytes_per_device_total"] > 186e9
            assert entry["microbatches"] < fitted_at[layouts.mesh_text(entry["mesh"])]
    steps = [entry["step_seconds"] for entry in fitting]
    assert steps == sorted(steps)
    # Every mesh computes the same MFU-counted FLOPs on the same devices: the ranking is the communication's.
    assert len({round(entry["compute_seconds"], 12) for entry in fitting}) == 1


def test_the_search_names_the_axes_the_mesh_has():
    # layouts.AXES is sharding.AXES without JAX (the command line reads meshes before JAX starts).
    from tokenmill.trainer.model.sharding import AXES
    from tokenmill.trainer.run import layouts

    assert layouts.AXES == AXES
