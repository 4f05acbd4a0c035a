"""`tokenmill model info` and `tokenmill model compile`: what a model shape (configs/models/*.yaml) counts and
computes, and whether one train step of it fits a device, found ahead of time on simulated devices.

The compile itself is tokenmill.trainer.run.compile, and `model compile --search`'s choice of a layout
(every mesh and microbatch count, ranked by estimated step time) is tokenmill.trainer.run.layouts; here are
the flags, the simulated devices (XLA_FLAGS set before JAX starts, or the command re-run in a fresh process
when JAX has started with other devices) and the printed reports.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys

from tokenmill.errors import UsageError
from tokenmill.trainer.run.layouts import AXES, DEFAULT_MAX_MICROBATCHES, mesh_text
from tokenmill.units import format_bytes, format_count, format_duration, parse_count


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `tokenmill model` to the `tokenmill` parser."""
    parser = subparsers.add_parser("model", help="inspect model shapes (configs/models/*.yaml)")
    model_sub = parser.add_subparsers(dest="model_command", metavar="ACTION")
    info = model_sub.add_parser(
        "info",
        help="parameter counts (total, active, stored) and the compute of a model shape",
        description="Counts follow Marin's convention: total = projection matrices with the embedding and "
        "head, active = those one token uses without them, stored = every number a checkpoint holds. "
        "Compute at --tokens (default: the shape's reference run): forecast_compute = C as Marin's "
        "ladder forecast prices it (no head, attention over the full span), train_flops = C + the head. "
        "flops_per_token is the MFU convention. See docs/trainer.md.",
    )
    info.add_argument("config", help="a model shape, e.g. configs/models/marin-535b-a23b.yaml")
    info.add_argument(
        "--tokens", help="training tokens, e.g. 18.75T (default: the shape's reference_run, if it has one)"
    )
    info.add_argument("--sequence-length", type=int, help="training sequence length (default: the model's)")
    info.add_argument("--json", action="store_true", help="print JSON (exact integers)")
    info.set_defaults(handler=_model_info)
    compile_ = model_sub.add_parser(
        "compile",
        help="compile one train step ahead of time on N simulated devices: memory per device and FLOPs",
        description="Lowers and compiles one full train step (forward, backward, optimizer, router-bias "
        "update) for --devices simulated host devices with abstract arrays (nothing is allocated), and "
        "prints XLA's bytes per device (arguments, outputs, temporaries, their total, and the optimizer "
        "state kept in pinned host memory), XLA's FLOPs per step summed over devices next to the model's "
        "own count, the bytes per device the step's collectives move by what they serve with their time "
        "at --link-bandwidth against the compute at --mfu, the compile time, and whether it fits "
        "--device-memory. With --search, every mesh of the devices is compiled at growing microbatch counts "
        "until it fits, and the layouts that fit are ranked by estimated step time. See docs/trainer.md.",
    )
    compile_.add_argument("config", help="a model shape, e.g. configs/models/marin-535b-a23b.yaml")
    compile_.add_argument("--devices", type=int, required=True, help="simulated devices (the mesh's size)")
    compile_.add_argument(
        "--mesh",
        help="axis sizes, e.g. fsdp=8,expert=8 (axes data, fsdp, expert; unnamed ones are 1, one may be -1; "
        "default: every device on fsdp)",
    )
    compile_.add_argument("--batch-size", type=int, required=True, help="sequences per step (global)")
    compile_.add_argument("--sequence-length", type=int, help="tokens per sequence (default: the model's)")
    compile_.add_argument(
        "--microbatches",
        type=int,
        help="gradient accumulation (optimizer.microbatches): the batch runs as N microbatches of "
        "batch-size/N sequences, then one update; activations shrink about N-fold (default 1)",
    )
    compile_.add_argument(
        "--search",
        action="store_true",
        help="compile every mesh of --devices (data x fsdp x expert) at microbatch counts 1, 2, 4, ... up to "
        "--microbatches-max, each mesh until one fits, and rank the layouts that fit by estimated step time "
        "(compute + communication); one compile per layout tried. Replaces --mesh and --microbatches",
    )
    compile_.add_argument(
        "--microbatches-max",
        type=int,
        help=f"with --search: the most microbatches tried (default {DEFAULT_MAX_MICROBATCHES})",
    )
    compile_.add_argument(
        "--device-memory",
        default="186GB",
        help="memory of one device to compare against, e.g. 186GB (GB200, the default), 80GiB, 141GB",
    )
    compile_.add_argument("--remat", choices=["none", "full", "dots_saveable", "offload"], help=(
        "rematerialisation policy (default: the model config's remat)"
    ))  # fmt: skip
    compile_.add_argument(
        "--optimizer", choices=["adamw", "muon", "muonh"], help="default: as `tokenmill train` picks it"
    )
    compile_.add_argument(
        "--optimizer-state",
        choices=["device", "pinned_host"],
        default="device",
        help="where the optimizer state lives between steps (pinned_host: as the reference run)",
    )
    compile_.add_argument(
        "--compute-dtype", choices=["float32", "bfloat16"], default="bfloat16", help="matmul precision"
    )
    compile_.add_argument(
        "--link-bandwidth",
        default="gb200-nvl72",
        help="link bandwidth per device and direction for the communication time: GB/s (e.g. 450) or a "
        "preset: gb200-nvl72 (900, the default), h100-node, h200-node (450), ib-400g (50)",
    )
    compile_.add_argument(
        "--mfu", type=float, default=0.4, help="model FLOPs utilisation for the step's compute time (0.4)"
    )
    compile_.add_argument(
        "--peak-flops",
        help="dense peak FLOP/s of one device for the compute time, e.g. 989T (default: the preset's chip; "
        "a GB200's 2.5P for a plain bandwidth)",
    )
    compile_.add_argument("--json", action="store_true", help="print JSON")
    compile_.set_defaults(handler=_model_compile)
    parser.set_defaults(handler=lambda args: parser.print_help() or 2)


def _model_info(args: argparse.Namespace) -> int:
    from tokenmill.trainer.model.flops import model_info
    from tokenmill.trainer.model.shape import load_model_config

    try:
        cfg = load_model_config(args.config)
        tokens = parse_count(args.tokens) if args.tokens else None
    except ValueError as error:
        raise UsageError(str(error)) from error
    info = model_info(cfg, tokens, args.sequence_length)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    moe = cfg.moe
    kv = f"{cfg.n_kv_heads} kv"
    if cfg.global_kv_heads is not None:
        kv = f"kv {cfg.n_kv_heads} local / {cfg.global_kv_heads} global, {cfg.stored_kv_heads} stored"
    n_global = sum(cfg.is_global(layer) for layer in range(cfg.n_layers))
    attention = f"{n_global} of them global" if cfg.sliding_window else "all global"
    latent = f" in a {moe.latent_dim} latent" if moe.latent_dim else ""
    print(
        f"{cfg.name}: {format_count(info['total_params'], 4)} total, "
        f"{format_count(info['active_params'], 4)} active "
        f"({info['total_params']:,} with the embedding and head; {info['active_params']:,} without)"
    )
    print(
        f"  {cfg.n_layers} layers ({attention}), d_model {cfg.d_model}, {cfg.n_heads} heads ({kv}) x "
        f"{cfg.head_dim}, {moe.n_experts} experts top-{moe.top_k} x {moe.expert_hidden}{latent} + "
        f"{moe.n_shared_experts} shared x {moe.shared_expert_hidden}, vocab {cfg.vocab_size}"
    )
    print(
        f"  stored {info['stored_params']:,} (embedding + head {info['embedding_params']:,}; norms, gates, "
        f"SConv and the router bias {info['other_stored_params']:,})"
    )
    if info["tokens"] is not None:
        run = info["reference_run"]
        from_run = run and not tokens
        source = (
            f" ({run['steps']:,} steps x {run['batch_size']:,} x {info['sequence_length']:,})"
            if from_run
            else ""
        )
        print(
            f"  {info['tokens']:,} tokens{source}: forecast compute {info['forecast_compute']:.4e} "
            f"(no head, attention over the full span), with the head {info['train_flops']:.4e}"
        )
    print(
        f"  MFU FLOPs per token {info['flops_per_token']:.4g} (6 x matmul weights + causal attention "
        f"{info['attention_flops_per_token']:.4g} at sequence_length {info['sequence_length']}; "
        f"head {info['head_flops_per_token']:.4g} apart)"
    )
    return 0


# --- model compile ------------------------------------------------------------------------------------------

_BYTE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def parse_bytes(text: str) -> int:
    """'186GB' (decimal), '80GiB' (binary) or a plain number of bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([KMGT]I?B|B)?\s*", text.upper())
    if not match:
        raise ValueError(f"not a memory size: {text!r} (expected e.g. 186GB or 80GiB)")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2) or ""])


def parse_mesh_axes(text: str | None, devices: int) -> dict[str, int]:
    """'fsdp=8,expert=8' -> {data: 1, fsdp: 8, expert: 8}; their product must be the device count."""
    if not text:
        return {"data": 1, "fsdp": devices, "expert": 1}
    sizes = dict.fromkeys(AXES, 1)
    for part in text.split(","):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in AXES or not value.strip().lstrip("-").isdigit():
            raise ValueError(f"--mesh {text!r}: expected AXIS=SIZE pairs with axes {', '.join(AXES)}")
        sizes[name] = int(value)
    free = [name for name, size in sizes.items() if size == -1]
    if len(free) > 1 or any(size == 0 or size < -1 for size in sizes.values()):
        raise ValueError(f"--mesh {text!r}: sizes must be positive, one of them may be -1")
    known = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if devices % known:
            raise ValueError(f"--mesh {text!r} does not divide {devices} devices")
        sizes[free[0]] = devices // known
    if math.prod(sizes.values()) != devices:
        raise ValueError(f"--mesh {text!r} has {math.prod(sizes.values())} devices, not --devices {devices}")
    return sizes


def _model_compile(args: argparse.Namespace) -> int:
    from tokenmill.trainer.model.shape import load_model_config
    from tokenmill.trainer.run.collectives import parse_link

    if args.search:
        given = [flag for flag, value in (("--mesh", args.mesh), ("--microbatches", args.microbatches))
                 if value is not None]  # fmt: skip
        if given:
            raise UsageError(
                f"{' and '.join(given)} with --search: the search tries every mesh of --devices and the "
                "microbatch counts up to --microbatches-max; give one or the other"
            )
    if args.microbatches_max is not None and not args.search:
        raise UsageError("--microbatches-max is the search's limit: give it with --search")
    microbatches = 1 if args.microbatches is None else args.microbatches
    max_microbatches = DEFAULT_MAX_MICROBATCHES if args.microbatches_max is None else args.microbatches_max
    try:
        cfg = load_model_config(args.config)
        device_memory = parse_bytes(args.device_memory)
        mesh = None if args.search else parse_mesh_axes(args.mesh, args.devices)
        parse_link(args.link_bandwidth)
        peak_flops = parse_count(args.peak_flops) if args.peak_flops else None
    except ValueError as error:
        raise UsageError(str(error)) from error
    if not 0 < args.mfu <= 1 or peak_flops == 0:
        raise UsageError("--mfu must be in (0, 1] and --peak-flops positive")
    if args.devices <= 0 or args.batch_size <= 0 or microbatches <= 0 or max_microbatches <= 0:
        raise UsageError("--devices, --batch-size, --microbatches and --microbatches-max must be positive")
    if args.search:
        return _model_compile_search(args, cfg, device_memory, max_microbatches, peak_flops)
    if args.batch_size % (args.devices * microbatches):
        raise UsageError(
            f"--batch-size {args.batch_size} does not split into {microbatches} microbatches over "
            f"{args.devices} devices"
        )
    if not _simulated_devices_ready(args.devices):
        return _rerun_with_devices(args)
    from tokenmill.trainer.run.compile import compile_report

    report = compile_report(
        cfg,
        mesh,
        args.batch_size,
        args.sequence_length,
        device_memory,
        remat=args.remat,
        optimizer=args.optimizer,
        optimizer_state=args.optimizer_state,
        compute_dtype=args.compute_dtype,
        microbatches=microbatches,
        link=args.link_bandwidth,
        mfu=args.mfu,
        peak_flops=peak_flops,
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_compile_report(report))
    return 0


def _model_compile_search(
    args: argparse.Namespace, cfg: object, device_memory: int, max_microbatches: int, peak_flops: float | None
) -> int:
    """`model compile --search`: the candidate layouts compiled and ranked (run/layouts.py); a usage error,
    before JAX starts, when no mesh of the devices can run the step at all."""
    from tokenmill.trainer.run.layouts import candidate_layouts, search_layouts

    candidates, refused = candidate_layouts(cfg, args.devices, args.batch_size, max_microbatches)
    if not candidates:
        reasons = sorted({item.reason for item in refused})
        raise UsageError(f"no mesh of {args.devices} devices can run this step: " + "; ".join(reasons))
    if not _simulated_devices_ready(args.devices):
        return _rerun_with_devices(args)
    result = search_layouts(
        cfg,
        args.devices,
        args.batch_size,
        args.sequence_length,
        device_memory,
        max_microbatches=max_microbatches,
        remat=args.remat,
        optimizer=args.optimizer,
        optimizer_state=args.optimizer_state,
        compute_dtype=args.compute_dtype,
        link=args.link_bandwidth,
        mfu=args.mfu,
        peak_flops=peak_flops,
    )
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_layout_search(result))
    return 0


def _simulated_devices_ready(devices: int) -> bool:
    """Make sure JAX will start with `devices` CPU devices: set XLA_FLAGS before it starts; False when it
    has already started with another device set (the caller then re-runs the command in a new process)."""
    if "jax" in sys.modules:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            import jax

            return jax.default_backend() == "cpu" and jax.device_count() == devices
    flags = [
        flag for flag in os.environ.get("XLA_FLAGS", "").split() if not flag.startswith(_DEVICE_COUNT_FLAG)
    ]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{_DEVICE_COUNT_FLAG}={devices}"])
    # Simulated devices are host devices: an accelerator here would be used instead and is not what is asked.
    os.environ["JAX_PLATFORMS"] = "cpu"
    return True


def _rerun_with_devices(args: argparse.Namespace) -> int:
    """JAX already runs with other devices in this process (a notebook, a test): run the same command in a
    fresh interpreter, whose JAX starts with the simulated devices."""
    argv = ["model", "compile", args.config, "--devices", str(args.devices),
            "--batch-size", str(args.batch_size), "--device-memory", args.device_memory,
            "--optimizer-state", args.optimizer_state, "--compute-dtype", args.compute_dtype,
            "--link-bandwidth", args.link_bandwidth, "--mfu", str(args.mfu)]  # fmt: skip
    for flag, value in (("--mesh", args.mesh), ("--sequence-length", args.sequence_length),
                        ("--microbatches", args.microbatches), ("--remat", args.remat),
                        ("--optimizer", args.optimizer), ("--peak-flops", args.peak_flops),
                        ("--microbatches-max", args.microbatches_max)):  # fmt: skip
        if value is not None:
            argv += [flag, str(value)]
    for flag, given in (("--search", args.search), ("--json", args.json)):
        if given:
            argv.append(flag)
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    done = subprocess.run([sys.executable, "-m", "tokenmill", *argv], env=env, check=False)
    return done.returncode


def format_compile_report(report: dict) -> str:
    """The human-readable form of `compile_report`'s dict."""
    from tokenmill.trainer.run.compile import FLOPS_TOLERANCE

    gb = 1e9
    memory = report["bytes_per_device"]
    mesh = ",".join(f"{axis}={size}" for axis, size in report["mesh"].items())
    lines = [
        f"{report['model']}: one train step on {report['devices']} devices (mesh {mesh}), "
        f"{report['batch_size']:,} x {report['sequence_length']:,} tokens in {report['microbatches']} "
        f"microbatch{'es' if report['microbatches'] > 1 else ''}, dispatch {report['dispatch']}, "
        f"remat {report['remat']}, {report['optimizer']} with its state on {report['optimizer_state']}, "
        f"{report['compute_dtype']} compute",
        f"  compile_seconds      {report['compile_seconds']:.1f}",
        "  bytes_per_device     "
        + ", ".join(
            f"{key} {memory[key] / gb:.2f} GB" for key in ("arguments", "outputs", "temps", "total", "host")
        ),
        f"  xla_flops_per_step   {report['xla_flops_per_step']:.4e} (summed over devices; XLA's cost "
        f"analysis alone, loop bodies once: {report['xla_cost_analysis_flops_per_step']:.4e})",
        f"  model_flops_per_step {report['model_flops_per_step']:.4e} (the MFU count: 6 x active params + "
        f"causal attention, no head; XLA / this = {report['flops_ratio']:.3f})",
        f"  model_flops_executed {report['model_flops_executed']:.4e} (what the step runs: "
        + ", ".join(f"{key} {value:.3e}" for key, value in report["model_flops_executed_parts"].items())
        + f"; XLA / this = {report['flops_ratio_executed']:.3f}, "
        + ("within" if report["flops_agree"] else "NOT within")
        + f" {FLOPS_TOLERANCE:.0%})",
    ]
    if report.get("communication"):
        lines += format_communication(report["communication"])
    limit = report["device_memory"]
    if report["fits"]:
        lines.append(
            f"  fits: {memory['total'] / gb:.1f} GB of {limit / gb:.0f} GB per device "
            f"({report['margin_bytes'] / gb:.1f} GB to spare)"
        )
    else:
        lines.append(
            f"  DOES NOT FIT: {memory['total'] / gb:.1f} GB per device, "
            f"{-report['margin_bytes'] / gb:.1f} GB over {limit / gb:.0f} GB. Options:"
        )
        lines += [f"    - {tip}" for tip in report["suggestions"]]
    return "\n".join(lines)


def duration(seconds: float) -> str:
    """A time of up to hours in the unit that reads best: 36.2 ms, 1.07 s, 2m 05s."""
    if seconds >= 100:
        return format_duration(seconds)
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


def format_communication(comm: dict) -> list[str]:
    """The lines of `format_compile_report` on what the step's collectives move and how long it takes."""
    moved, seconds, link = comm["bytes_per_device"], comm["communication_seconds"], comm["link"]

    def listed(values: dict, show) -> str:
        return ", ".join(f"{key} {show(value)}" for key, value in values.items() if key != "total" and value)

    where = f"{link['preset']}, {link['description']}" if link["preset"] else "as given"
    ratio = comm["communication_over_compute"]
    compiled = format_bytes(comm["bytes_per_device_as_compiled"]["total"])
    bandwidth = link["bandwidth_bytes_per_second"] / 1e9
    lines = [
        f"  communication/step   per device {format_bytes(moved['total'])}: "
        f"{listed(moved, format_bytes) or 'none'} ({comm['executions']:.0f} collectives run; as XLA:CPU "
        f"compiled them, bf16 values widened to f32: {compiled})",
        f"    by kind            {listed(comm['bytes_per_device_by_kind'], format_bytes) or 'none'}",
        f"    time               {duration(seconds['total'])} at {bandwidth:.0f} GB/s "
        f"({where}; {listed(seconds, duration) or 'nothing'}) against compute "
        f"{duration(comm['compute_seconds'])} at "
        f"{link['mfu']:.0%} MFU of {link['peak_flops_per_device']:.3g} FLOP/s: communication / compute "
        + (f"{ratio:.2f}" if ratio is not None else "n/a"),
    ]
    sharded = comm["gradient_all_reduce_of_sharded_parameters"]
    if sharded:
        lines.append(
            f"    gradients          {format_bytes(sharded)} of the gradient reduction are all-reduces of "
            "fsdp-sharded parameters, each device keeping its slice (XLA:GPU would make them "
            "reduce-scatters, half the bytes)"
        )
    narrowed = comm["narrowed_after_moving"]
    if narrowed["bytes"]:
        narrow = format_bytes(narrowed["at_the_narrow_dtype"])
        lines.append(
            f"    narrowed           {format_bytes(narrowed['bytes'])} of it arrive wider than every use "
            f"reads them (moved wide, then cast narrower: fp32 to bf16 under bf16 compute): {narrow} if the "
            "cast came first"
        )
    unattributed = comm["unattributed"]
    notes = [f"other {format_bytes(unattributed['other_bytes'])}"]
    if unattributed["loops_without_trip_count"]:
        notes.append(
            f"{unattributed['loops_without_trip_count']} loops of unknown trip count counted once "
            f"({format_bytes(unattributed['loop_bodies_counted_once_bytes'])})"
        )
    if unattributed["conditionals_counted_by_heaviest_branch"]:
        notes.append(
            f"{unattributed['conditionals_counted_by_heaviest_branch']} conditionals counted by their "
            "heaviest branch"
        )
    if unattributed["ragged_upper_bound_bytes"]:
        notes.append(
            f"ragged all-to-alls at their buffers {format_bytes(unattributed['ragged_upper_bound_bytes'])}"
        )
    if unattributed["unreadable_groups"]:
        notes.append(f"{len(unattributed['unreadable_groups'])} collectives with unreadable groups left out")
    lines.append("    not attributed     " + "; ".join(notes))
    lines.append("    largest            per step and device, with the model code that made them:")
    for entry in comm["largest"][:6]:
        lines.append(
            f"      {format_bytes(entry['bytes']):>9} {entry['kind']} ({entry['category']}, "
            f"{entry['phase']}, groups of {entry['group_size']}, {entry['executions']:.0f} runs) "
            f"{entry['source'] or entry['op_name']}"
            + (" (XLA combined several ops into it; the line is one's)" if entry.get("combined") else "")
        )
    return lines


# Communication categories in the search's table, with their column headings (run/collectives.py's order).
_SEARCH_COLUMNS = {"expert_dispatch": "dispatch", "weight_gather": "gathers", "gradient_reduction": "grads",
                   "optimizer": "optimizer", "other": "other"}  # fmt: skip


def format_layout_search(result: dict) -> str:
    """The human-readable form of run.layouts.search_layouts's dict: the fitting layouts ranked by estimated
    step time in a table, then the meshes that fit at no microbatch count, the refused and the failed."""
    link = result["link"] or {}
    fitting = [entry for entry in result["candidates"] if entry["fits"]]
    where = link.get("preset") or f"{link.get('bandwidth_bytes_per_second', 0) / 1e9:.0f} GB/s"
    # One unit for every time in the table, the one that reads best for the slowest step.
    unit, scale = _time_unit(max((entry["step_seconds"] for entry in fitting), default=1.0))
    lines = [
        f"{result['model']}: {len(fitting)} of {len(result['candidates'])} layouts compiled fit "
        f"{format_bytes(result['device_memory'])} per device: {result['devices']} devices, "
        f"{result['batch_size']:,} x {result['sequence_length']:,} tokens, {result['optimizer_state']} "
        f"optimizer state, {result['compute_dtype']} compute; {result['compiles']} compiles in "
        f"{duration(result['search_seconds'])}",
    ]
    if link:
        lines.append(
            f"  times in {unit} per step: communication at "
            f"{link['bandwidth_bytes_per_second'] / 1e9:.0f} GB/s ({where}), compute at {link['mfu']:.0%} "
            f"MFU of {link['peak_flops_per_device']:.3g} FLOP/s; "
            "step = compute + communication (no overlap, an upper bound), overlapped = the larger"
        )
    header = ["rank", "mesh (data,fsdp,expert)", "microbatches", "dispatch", "total/device", "margin",
              *_SEARCH_COLUMNS.values(), "comm", "compute", "step", "overlapped"]  # fmt: skip
    rows = []
    for entry in fitting:
        seconds = entry["communication_seconds"]
        mesh = entry["mesh"]
        rows.append([
            str(entry["rank"]), f"{mesh['data']},{mesh['fsdp']},{mesh['expert']}", str(entry["microbatches"]),
            entry["dispatch"], format_bytes(entry["bytes_per_device_total"]),
            format_bytes(entry["margin_bytes"]),
            *(f"{seconds.get(key, 0.0) / scale:,.1f}" for key in _SEARCH_COLUMNS),
            f"{seconds['total'] / scale:,.1f}", f"{entry['compute_seconds'] / scale:,.1f}",
            f"{entry['step_seconds'] / scale:,.1f}", f"{entry['step_seconds_overlapped'] / scale:,.1f}",
        ])  # fmt: skip
    if rows:
        widths = [max(len(row[column]) for row in [header, *rows]) for column in range(len(header))]
        # Text columns left-aligned, numbers right-aligned.
        left = {0, 1, 3}
        for row in [header, *rows]:
            cells = [cell.ljust(width) if i in left else cell.rjust(width)
                     for i, (cell, width) in enumerate(zip(row, widths, strict=True))]  # fmt: skip
            lines.append("  " + "  ".join(cells).rstrip())
        best = result["best"]
        lines.append(f"  best: --mesh {mesh_text(best['mesh'])} --microbatches {best['microbatches']}")
    else:
        lines.append("  no layout fits: the closest are listed below")
    fitted_meshes = {mesh_text(entry["mesh"]) for entry in fitting}
    # The compiles that did not fit, by mesh: those of meshes that fit at a larger count, then the rest.
    over: dict[str, list[dict]] = {}
    for entry in result["candidates"]:
        if not entry["fits"]:
            over.setdefault(mesh_text(entry["mesh"]), []).append(entry)
    never = f"fit at no microbatch count tried (up to {result['max_microbatches']})"
    for heading, fitted in (("did not fit before a larger count did", True), (never, False)):
        names = [name for name in over if (name in fitted_meshes) == fitted]
        if names:
            lines.append(f"  {heading}:")
        for name in names:
            totals = ", ".join(
                f"{entry['microbatches']}: {format_bytes(entry['bytes_per_device_total'])}"
                for entry in sorted(over[name], key=lambda entry: entry["microbatches"])
            )
            lines.append(f"    {name}: total per device by microbatches {totals}")
    if result["refused"]:
        lines.append("  refused before compiling:")
        lines += [f"    {mesh_text(item['mesh'])}: {item['reason']}" for item in result["refused"]]
    if result["failed"]:
        lines.append("  failed to compile:")
        lines += [
            f"    {mesh_text(item['mesh'])} at {item['microbatches']} microbatches: {item['error']}"
            for item in result["failed"]
        ]
    return "\n".join(lines)


def _time_unit(seconds: float) -> tuple[str, float]:
    """The unit in which `seconds` reads as at least 10 of it: s, ms or us, with its size in seconds."""
    for name, scale in (("s", 1.0), ("ms", 1e-3)):
        if seconds >= 10 * scale:
            return name, scale
    return "us", 1e-6
