"""Choosing a layout: `tokenmill model compile --search` compiles every layout of N devices that can run a
step and ranks those that fit a device's memory by their estimated step time.

A layout is a mesh (data, fsdp, expert; run.compile.compile_report's axes, product N) and a gradient
accumulation count (optimizer.microbatches). `candidate_layouts` lists them without JAX, and says why the
others are refused before anything is compiled: the experts do not split over the expert axis, quantile
balancing without a histogram under expert parallelism (model/router.py refuses it while tracing), a
batch whose rows do not split over the devices. `search_layouts` compiles them with
run.compile.compile_report and ranks what fits.

Cost: one compile per (mesh, microbatch count) tried, each as long as `model compile` of that layout
(seconds for a tiny shape; tens of seconds for a ladder rung on 8 simulated devices, and about a minute for
the 535B on 64, on 2 CPU cores). A mesh's counts are compiled ascending and its search stops at the first
that fits, so a mesh that fits without accumulation costs one compile, and N = 2^a 3^b ... devices give
(a+2 choose 2)(b+2 choose 2)... meshes (10 for 8 devices, 28 for 64) times at most log2(max) + 1 counts.

The step time is an estimate from compile_report's `communication` (run/collectives.py): every
collective's bytes per device over one link bandwidth, plus the compute of the step's MFU-convention FLOPs
at an MFU. `step_seconds` is their sum, nothing overlapped (an upper bound); `step_seconds_overlapped` is
the larger of the two (perfect overlap, a lower bound). The compute term is the same for every layout of
the same devices (the MFU count does not depend on the layout), so the ranking is the communication's;
what a layout changes in the work itself (capacity padding, the single-device dispatch's einsums: the
report's `model_flops_executed`) is listed, not priced.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

#: The mesh's axes in model/sharding.py's order (its AXES), here without importing JAX: the command line
#: reads and prints meshes before JAX starts.
AXES = ("data", "fsdp", "expert")
DEFAULT_MAX_MICROBATCHES = 16


@dataclass
class Candidate:
    """A mesh that can run the step and the microbatch counts to try on it, ascending."""

    mesh: dict[str, int]
    microbatches: list[int]

    @property
    def name(self) -> str:
        return mesh_text(self.mesh)


@dataclass
class Refused:
    """A mesh of the devices that cannot run the step, and why: nothing of it is compiled."""

    mesh: dict[str, int]
    reason: str

    @property
    def name(self) -> str:
        return mesh_text(self.mesh)


def mesh_text(mesh: dict[str, int]) -> str:
    """{data: 1, fsdp: 8, expert: 1} -> 'data=1,fsdp=8,expert=1', the form `model compile --mesh` reads."""
    return ",".join(f"{axis}={mesh[axis]}" for axis in AXES)


def meshes(devices: int) -> list[dict[str, int]]:
    """Every (data, fsdp, expert) whose product is `devices`, data then fsdp ascending."""
    divisors = [size for size in range(1, devices + 1) if devices % size == 0]
    found = []
    for data in divisors:
        for fsdp in divisors:
            if (devices // data) % fsdp == 0:
                found.append({"data": data, "fsdp": fsdp, "expert": devices // (data * fsdp)})
    return found


def microbatch_counts(rows_per_device: int, max_microbatches: int) -> list[int]:
    """The powers of two up to `max_microbatches` that divide the rows a device runs: each microbatch then
    gives every device the same whole number of rows (run/step.py takes rows i, i+N, ... of each device's
    block). Other divisors (3, 6, ...) are left out: they change memory in steps between the powers'."""
    counts = []
    count = 1
    while count <= max_microbatches and rows_per_device % count == 0:
        counts.append(count)
        count *= 2
    return counts


def candidate_layouts(
    cfg: Any, devices: int, batch_size: int, max_microbatches: int = DEFAULT_MAX_MICROBATCHES
) -> tuple[list[Candidate], list[Refused]]:
    """The meshes of `devices` that can run a step of `cfg` (a model/shape.py ModelConfig) on `batch_size`
    sequences, each with its microbatch counts, and the meshes refused with the reason. Pure Python.

    The batch's rows are split over every mesh axis (sharding.batch_sharding), so rows divide by
    data x fsdp x expert x microbatches, the devices x the count. Refused:
    - every mesh, when the rows do not split over the devices;
    - an expert axis that does not divide the experts: expert parallelism refuses it
      (model/expert_parallel.py), and without it the expert stacks would stay whole on every expert shard,
      a data axis that only costs memory;
    - an expert axis > 1 under expert parallelism with quantile balancing but no quantile_bins: the exact
      quantile needs the whole batch's margins on one device (model/router.py refuses it).
    Raises ValueError when devices, batch size or max_microbatches is not positive."""
    if devices <= 0 or batch_size <= 0 or max_microbatches <= 0:
        raise ValueError(
            f"devices ({devices}), batch size ({batch_size}) and the most microbatches ({max_microbatches}) "
            "must be positive"
        )
    moe = cfg.moe
    expert_parallel = getattr(moe, "expert_parallel", False)
    candidates: list[Candidate] = []
    refused: list[Refused] = []
    for mesh in meshes(devices):
        expert = mesh["expert"]
        if batch_size % devices:
            reason = (
                f"a batch of {batch_size} rows does not split over {devices} devices (rows are split over "
                "data x fsdp x expert)"
            )
        elif expert > 1 and moe.n_experts % expert:
            reason = f"{moe.n_experts} experts do not split over an expert axis of {expert}"
        elif expert > 1 and expert_parallel and moe.balancing == "quantile" and not moe.quantile_bins:
            reason = (
                "quantile balancing without quantile_bins needs the whole batch's margins on one device, "
                "which expert parallelism never gathers (set moe.quantile_bins)"
            )
        else:
            counts = microbatch_counts(batch_size // devices, max_microbatches)
            candidates.append(Candidate(mesh, counts))
            continue
        refused.append(Refused(mesh, reason))
    return candidates, refused


def search_layouts(
    cfg: Any,
    devices: int,
    batch_size: int,
    sequence_length: int | None,
    device_memory: int,
    max_microbatches: int = DEFAULT_MAX_MICROBATCHES,
    remat: str | None = None,
    optimizer: str | None = None,
    optimizer_state: str = "device",
    compute_dtype: str = "bfloat16",
    link: str | None = None,
    mfu: float | None = None,
    peak_flops: float | None = None,
    progress: Callable[[str], None] = log.info,
) -> dict:
    """Compile the candidate layouts of `cfg` on the current JAX devices (which must number `devices`) and
    rank those that fit `device_memory` by estimated step time: the dict `model compile --search --json`
    prints.

    Each mesh's microbatch counts are compiled ascending and the first that fits ends that mesh's search:
    more accumulation only shrinks the activations, while the per-microbatch traffic (fsdp's weight gathers,
    the experts' gradient reduction inside the accumulation loop) runs once more per microbatch and the
    rest (the update's) stays, so a larger count of the same mesh is not estimated faster. Keys:
    - `candidates`: every compile, the fitting ones first by `step_seconds` (`rank` 1, 2, ...; `best` is
      the first), then those that fit at no count by their total (`rank` None);
    - `refused`: the meshes not compiled, with the reason (candidate_layouts);
    - `failed`: compiles that raised, with the error (the search goes on without them).
    `progress` gets one line before and after each compile (the command logs them on stderr)."""
    from tokenmill.trainer.run.collectives import DEFAULT_LINK, DEFAULT_MFU
    from tokenmill.trainer.run.compile import compile_report

    link = link or DEFAULT_LINK
    mfu = mfu or DEFAULT_MFU
    candidates, refused = candidate_layouts(cfg, devices, batch_size, max_microbatches)
    compiled: list[dict] = []
    failed: list[dict] = []
    started = time.perf_counter()
    for index, candidate in enumerate(candidates, 1):
        for count in candidate.microbatches:
            where = f"{candidate.name} at {count} microbatch{'es' if count > 1 else ''}"
            progress(f"layout search: mesh {index} of {len(candidates)}, compiling {where}")
            try:
                report = compile_report(
                    cfg, candidate.mesh, batch_size, sequence_length, device_memory,
                    remat=remat, optimizer=optimizer, optimizer_state=optimizer_state,
                    compute_dtype=compute_dtype, microbatches=count, probe_microbatches=False,
                    link=link, mfu=mfu, peak_flops=peak_flops, count_communication=True,
                )  # fmt: skip
            except Exception as error:  # one layout the compiler rejects must not end a long search
                log.warning("layout search: %s failed: %s", where, error)
                failed.append({"mesh": dict(candidate.mesh), "microbatches": count, "error": str(error)})
                break
            entry = layout_entry(report)
            compiled.append(entry)
            verdict = "fits" if entry["fits"] else "does not fit"
            progress(
                f"layout search: {where}: {entry['bytes_per_device_total'] / 1e9:.2f} GB per device, "
                f"{verdict}; step {entry['step_seconds'] * 1e3:,.1f} ms estimated "
                f"(compiled in {report['compile_seconds']:.1f} s)"
            )
            _release_compile_caches()
            if entry["fits"]:
                break
    ranked = rank(compiled)
    first = ranked[0] if ranked and ranked[0]["fits"] else None
    return {
        "model": cfg.name,
        "devices": devices,
        "batch_size": batch_size,
        "sequence_length": sequence_length or cfg.sequence_length,
        "device_memory": device_memory,
        "max_microbatches": max_microbatches,
        "optimizer_state": optimizer_state,
        "compute_dtype": compute_dtype,
        "link": compiled[0]["link"] if compiled else None,
        "best": first,
        "candidates": ranked,
        "refused": [{"mesh": dict(item.mesh), "reason": item.reason} for item in refused],
        "failed": failed,
        "compiles": len(compiled) + len(failed),
        "search_seconds": round(time.perf_counter() - started, 2),
    }


def layout_entry(report: dict) -> dict:
    """One compile's line of the search, from compile_report's dict (with its `communication`)."""
    comm = report["communication"]
    seconds = comm["communication_seconds"]
    compute = comm["compute_seconds"]
    return {
        "mesh": dict(report["mesh"]),
        "microbatches": report["microbatches"],
        "dispatch": report["dispatch"],
        "optimizer": report["optimizer"],
        "bytes_per_device_total": report["bytes_per_device"]["total"],
        "bytes_per_device_host": report["bytes_per_device"]["host"],
        "fits": report["fits"],
        "margin_bytes": report["margin_bytes"],
        "communication_bytes_per_device": dict(comm["bytes_per_device"]),
        "communication_seconds": dict(seconds),
        "compute_seconds": compute,
        "step_seconds": compute + seconds["total"],
        "step_seconds_overlapped": max(compute, seconds["total"]),
        "communication_over_compute": comm["communication_over_compute"],
        "model_flops_executed": report["model_flops_executed"],
        "compile_seconds": report["compile_seconds"],
        "link": comm["link"],
        "rank": None,
    }


def rank(entries: list[dict]) -> list[dict]:
    """Fitting entries by step time (ties: fewer bytes per device, then fewer microbatches), numbered from
    1 in `rank`; then the others by their total bytes, unranked."""
    fitting = sorted(
        (entry for entry in entries if entry["fits"]),
        key=lambda entry: (entry["step_seconds"], entry["bytes_per_device_total"], entry["microbatches"]),
    )
    others = sorted(
        (entry for entry in entries if not entry["fits"]), key=lambda entry: entry["bytes_per_device_total"]
    )
    for position, entry in enumerate(fitting, 1):
        entry["rank"] = position
    for entry in others:
        entry["rank"] = None
    return [*fitting, *others]


def _release_compile_caches() -> None:
    """Drop JAX's caches of the last compile's traced and lowered step: a search at real sizes compiles tens
    of steps in one process, and each one's cached jaxprs and executables would otherwise stay."""
    import jax

    jax.clear_caches()
