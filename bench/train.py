"""Benchmark one training step of the MoE trainer against a plain matmul on the same device.

Measures, in one run:
- tokens/s and achieved FLOP/s of a full train step (forward, backward, AdamW, router-bias update), with
  FLOPs counted by the trainer's convention (6 x active parameters + attention; docs/trainer.md);
- the FLOP/s of plain jitted matmuls on the same device: one square, and one shaped like the step's largest
  matmul (the output head). The best of them is the measured peak, and step FLOP/s / peak is the MFU;
- capacity dispatch against dropless dispatch (ragged_dot) on the same model and batch, with the fraction of
  routed assignments the capacity dispatch dropped;
- one held-out evaluation (run/evaluate.py) at the demo's sizes (configs/models/tiny.yaml, 8 sequences of 128
  tokens a step; 10 evaluation sets of 16 sequences, dropless and capacity, as `make demo` evaluates) against
  one train step of the same model and batch: the cost of an evaluation point in train steps;
- the spike and non-finite guard (run/guard.py) at the demo's sizes: the same step with the guard on and off,
  alternated over several rounds in this run (the fastest round of each), its cost as a share of step time;
- expert parallelism (model/expert_parallel.py): in a child process with 8 simulated CPU devices, the same
  step on a data 1 x fsdp 1 x expert 8 mesh (2 experts a device, the batch split 8 ways, shard_map and
  all-to-all) against the single-device step in that process, for both transports. The devices share the
  machine's cores, so the ratio measures what expert parallelism adds (sorting, all-to-all copies, the
  dropless fallback's larger cells on CPU), not a speed-up.

Runs on CPU by default (fp32); on a GPU or TPU it picks bf16 compute and a larger batch unless told otherwise.
The last two lines are `train_expert_parallel ratio=X.XX target=0.5 baseline=single_device_step`
(single-device step time / expert-parallel step time, capacity transport) and `train ratio=X.XX target=0.1
baseline=jitted_matmul_peak` (the MFU).
Usage: python bench/train.py [--batch 16 --seq 256 --steps 8 --dtype float32 --json out.json] [--guard-only]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp

from tokenmill.trainer.data.batch import SyntheticSource
from tokenmill.trainer.model.flops import count_params, flops_per_token
from tokenmill.trainer.model.shape import ModelConfig, MoEConfig
from tokenmill.trainer.model.sharding import batch_sharding, make_mesh
from tokenmill.trainer.run.config import Phase, RunConfig, resolve_run_config
from tokenmill.trainer.run.step import compile_train_step


def bench_model(dispatch: str, vocab: int) -> ModelConfig:
    """A small MoE that still has the trainer's real structure: 4 layers, 16 experts top-2 + 1 shared."""
    return ModelConfig(
        name=f"bench-{dispatch}",
        vocab_size=vocab,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        head_dim=32,
        sequence_length=1024,
        sliding_window=128,
        sliding_window_layers=[0, 2],
        moe=MoEConfig(n_experts=16, top_k=2, expert_hidden=256, n_shared_experts=1, dispatch=dispatch),
    )


DEMO_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "configs", "models", "tiny.yaml")
DEMO_BATCH, DEMO_SEQ, DEMO_SETS, DEMO_SEQUENCES = 8, 128, 10, 16


def time_evaluation(dtype: str, repeats: int = 3) -> dict:
    """One evaluation point at the demo's sizes against one train step of the same model and batch.

    The sets are synthetic token windows laid out as data/evaluation.py lays out held-out documents (their
    content does not change the cost); the evaluator is the trainer's, compiled once, both dispatches."""
    import numpy as np

    from tokenmill.trainer.data.evaluation import EvalSequences
    from tokenmill.trainer.model.shape import load_model_config
    from tokenmill.trainer.run.evaluate import Evaluator, default_rows

    cfg = load_model_config(DEMO_MODEL)
    step = time_train_step(cfg, DEMO_BATCH, DEMO_SEQ, 6, dtype)
    source = SyntheticSource(cfg.vocab_size, DEMO_SEQ, DEMO_SEQUENCES, seed=1)
    sets = []
    for index in range(DEMO_SETS):
        batch = source.batch(index)
        sets.append(EvalSequences(
            name=f"heldout/domain=c{index:02d}", kind="heldout", tokens=batch.tokens,
            segment_ids=batch.segment_ids, mask=np.ones((DEMO_SEQUENCES, DEMO_SEQ), np.float32),
            documents=1, scored_tokens=DEMO_SEQUENCES * DEMO_SEQ, num_bytes=4 * DEMO_SEQUENCES * DEMO_SEQ,
            tokenizer_sha256="",
        ))  # fmt: skip
    mesh = make_mesh((1, 1, 1))
    with jax.set_mesh(mesh):
        from tokenmill.trainer.model import transformer

        params = transformer.init_params(jax.random.key(0), cfg)
        bias = transformer.init_router_bias(cfg)
        rows = default_rows(DEMO_BATCH, 1, mesh)
        evaluator = Evaluator(cfg, sets, mesh, rows, ("dropless", "capacity"), dtype)
        started = time.perf_counter()
        evaluator.evaluate(params, bias, 0)
        first = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(repeats):
            evaluator.evaluate(params, bias, 0)
        seconds = (time.perf_counter() - started) / repeats
    batches = sum(s.num_batches(rows) for s in sets) * 2
    return {
        "sets": DEMO_SETS, "sequences_per_set": DEMO_SEQUENCES, "rows_per_batch": rows, "batches": batches,
        "dispatches": ["dropless", "capacity"], "compile_and_first_s": first, "evaluation_s": seconds,
        "train_step_s": step["step_s"], "train_steps_per_evaluation": seconds / step["step_s"],
        "compiled": evaluator.compiled_shapes(),
    }  # fmt: skip


def time_matmul(m: int, k: int, n: int, dtype: str, min_seconds: float) -> float:
    """Achieved FLOP/s of a jitted [m, k] @ [k, n]."""
    a = jnp.full((m, k), 0.5, dtype)
    b = jnp.full((k, n), 0.25, dtype)
    matmul = jax.jit(lambda a, b: a @ b)
    matmul(a, b).block_until_ready()
    runs, start = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - start < min_seconds:
        matmul(a, b).block_until_ready()
        runs += 1
    return 2 * m * k * n * runs / (time.perf_counter() - start)


def time_train_step(
    cfg: ModelConfig,
    batch: int,
    seq: int,
    steps: int,
    dtype: str,
    mesh_shape: tuple[int, int, int] = (1, 1, 1),
    settings: dict | None = None,
) -> dict:
    """Compile once, warm up twice, then time `steps` train steps on a data x fsdp x expert mesh.
    `settings`: more run-configuration sections (`{"guard": {"enabled": False}}`).

    The learning rate is zero: the step does all its work (the optimizer still runs; updates are scaled by
    zero), but the router stays as initialised. From scratch at a real learning rate, the first dozens of
    steps collapse the routing (every token's hidden state is dominated by the same unigram direction, so
    all tokens pick the same experts until the model learns context), which would make the drop fraction
    a measurement of that transient rather than of the dispatch.
    """
    phases = [Phase("bench", 0, 1000)]
    data = {"phase": "bench", "batch_size": batch, "sequence_length": seq}
    run = RunConfig(model=cfg, compute_dtype=dtype, data=data, optimizer={"kind": "adamw", "lr": 0.0},
                    **(settings or {}))  # fmt: skip
    run = resolve_run_config(run, phases)
    mesh = make_mesh(mesh_shape)
    source = SyntheticSource(cfg.vocab_size, seq, batch, seed=0)
    sharding = batch_sharding(mesh)
    with jax.set_mesh(mesh):
        init_fn, step_fn, _ = compile_train_step(run, mesh)
        state = init_fn(jax.random.key(0))
        batches = []
        for i in range(steps + 2):
            b = source.batch(i)
            batches.append((jax.device_put(b.tokens, sharding), jax.device_put(b.segment_ids, sharding)))
        compile_start = time.perf_counter()
        state, metrics = step_fn(state, *batches[0])
        jax.block_until_ready(metrics)
        first_step = time.perf_counter() - compile_start
        state, metrics = step_fn(state, *batches[1])
        jax.block_until_ready(metrics)
        start = time.perf_counter()
        drops = []
        for tokens, segments in batches[2:]:
            state, metrics = step_fn(state, tokens, segments)
            drops.append(metrics["drop_fraction"])
        jax.block_until_ready(state)
        elapsed = (time.perf_counter() - start) / steps
    tokens_per_step = batch * seq
    step_flops = flops_per_token(cfg, seq) * tokens_per_step
    return {
        "dispatch": cfg.moe.dispatch,
        "mesh": list(mesh_shape),
        "compile_and_first_step_s": first_step,
        "step_s": elapsed,
        "tokens_per_second": tokens_per_step / elapsed,
        "flops_per_step": step_flops,
        "flops_per_second": step_flops / elapsed,
        "drop_fraction": float(jnp.mean(jnp.stack(drops))),
    }


def time_guard(dtype: str, rounds: int = 5, steps: int = 8) -> dict:
    """The guard's cost at the demo's sizes: the step with the guard on and with it off (health sampling
    off in both), alternated `rounds` times so that both see the same load; the fastest round of each."""
    from tokenmill.trainer.model.shape import load_model_config

    cfg = load_model_config(DEMO_MODEL)
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(rounds):
        for enabled in (True, False):
            settings = {"guard": {"enabled": enabled}, "logging": {"health_every": 0}}
            row = time_train_step(cfg, DEMO_BATCH, DEMO_SEQ, steps, dtype, settings=settings)
            times[enabled].append(row["step_s"])
    on, off = min(times[True]), min(times[False])
    return {"on_s": on, "off_s": off, "cost_fraction": (on - off) / on, "rounds": rounds,
            "steps_per_round": steps, "on_all_s": times[True], "off_all_s": times[False]}  # fmt: skip


def print_guard(guard: dict) -> None:
    print(
        f"  guard at the demo's sizes (batch {DEMO_BATCH} x seq {DEMO_SEQ}, fastest of {guard['rounds']} "
        f"rounds of {guard['steps_per_round']} steps): on {guard['on_s'] * 1e3:.2f} ms, off "
        f"{guard['off_s'] * 1e3:.2f} ms a step: the guard costs {guard['cost_fraction']:.2%} of step time "
        "(target under 2%)"
    )


EXPERT_DEVICES = 8
EXPERT_MESH = (1, 1, EXPERT_DEVICES)


def expert_parallel_steps(batch: int, seq: int, steps: int, vocab: int, dtype: str) -> list[dict]:
    """In this process (started with 8 simulated devices): each dispatch's step on one device and on the
    expert-parallel mesh, in that order."""
    rows = []
    for dispatch in ("capacity", "dropless"):
        for mesh_shape in ((1, 1, 1), EXPERT_MESH):
            rows.append(time_train_step(bench_model(dispatch, vocab), batch, seq, steps, dtype, mesh_shape))
    return rows


def run_expert_parallel_child(batch: int, seq: int, steps: int, vocab: int, dtype: str) -> list[dict]:
    """expert_parallel_steps in a fresh process: XLA fixes the device count when jax is first imported."""
    env = dict(
        os.environ,
        XLA_FLAGS=f"--xla_force_host_platform_device_count={EXPERT_DEVICES}",
        JAX_PLATFORMS="cpu",
    )
    command = [sys.executable, __file__, "--expert-parallel-child", "--batch", str(batch), "--seq", str(seq)]
    command += ["--steps", str(steps), "--vocab", str(vocab), "--dtype", dtype]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"expert-parallel bench failed:\n{done.stderr[-4000:]}")
    line = next(line for line in done.stdout.splitlines() if line.startswith("EXPERT_PARALLEL "))
    return json.loads(line.removeprefix("EXPERT_PARALLEL "))


def main() -> None:
    accelerator = jax.default_backend() != "cpu"
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64 if accelerator else 8)
    parser.add_argument("--seq", type=int, default=1024 if accelerator else 256)
    parser.add_argument("--steps", type=int, default=20 if accelerator else 4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="bfloat16" if accelerator else "float32"
    )
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument(
        "--no-expert-parallel", action="store_true", help="skip the 8-simulated-device expert-parallel steps"
    )
    parser.add_argument("--expert-parallel-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--guard-only", action="store_true", help="measure only the guard's cost")
    args = parser.parse_args()
    if args.guard_only:
        guard = time_guard(args.dtype)
        print_guard(guard)
        print("JSON " + json.dumps({"guard": guard}))
        return
    if args.expert_parallel_child:
        rows = expert_parallel_steps(args.batch, args.seq, args.steps, args.vocab, args.dtype)
        print("EXPERT_PARALLEL " + json.dumps(rows))
        return

    device = jax.devices()[0]
    results: dict = {
        "device": f"{device.platform} {device.device_kind}",
        "machine": platform.processor() or platform.machine(),
        "jax": jax.__version__,
        "batch": args.batch,
        "seq": args.seq,
        "dtype": args.dtype,
    }
    cfg = bench_model("capacity", args.vocab)
    counts = count_params(cfg)
    results["model"] = {
        "active_params": counts.active_params,
        "total_params": counts.total_params,
        "embedding_params": counts.embedding_params,
        "flops_per_token": flops_per_token(cfg, args.seq),
    }
    tokens = args.batch * args.seq
    seconds = 2.0 if not accelerator else 1.0
    square = 2048 if accelerator else 1024
    results["matmul"] = {
        f"square_{square}": time_matmul(square, square, square, args.dtype, seconds),
        f"head_{tokens}x{cfg.d_model}x{cfg.vocab_size}": time_matmul(
            tokens, cfg.d_model, cfg.vocab_size, args.dtype, seconds
        ),
        f"expert_{tokens}x{cfg.d_model}x{cfg.moe.expert_hidden}": time_matmul(
            tokens, cfg.d_model, cfg.moe.expert_hidden, args.dtype, seconds
        ),
    }
    peak = max(results["matmul"].values())
    results["peak_flops_measured"] = peak

    results["steps"] = []
    for dispatch in ("capacity", "dropless"):
        row = time_train_step(bench_model(dispatch, args.vocab), args.batch, args.seq, args.steps, args.dtype)
        row["mfu_vs_measured_peak"] = row["flops_per_second"] / peak
        results["steps"].append(row)

    print(
        f"device {results['device']}, jax {results['jax']}, {args.dtype}, batch {args.batch} x seq {args.seq}"
    )
    print(
        f"model: {counts.active_params / 1e6:.2f}M active / {counts.total_params / 1e6:.2f}M total "
        f"(+{counts.embedding_params / 1e6:.2f}M embeddings), "
        f"{results['model']['flops_per_token']:.3g} FLOPs/token"
    )
    for name, flops in results["matmul"].items():
        print(f"  matmul {name:<28} {flops / 1e9:8.2f} GFLOP/s")
    for row in results["steps"]:
        print(
            f"  train step {row['dispatch']:<9} {row['step_s'] * 1e3:8.1f} ms  "
            f"{row['tokens_per_second']:9.0f} tok/s  "
            f"{row['flops_per_second'] / 1e9:7.2f} GFLOP/s  MFU {row['mfu_vs_measured_peak']:.1%}  "
            f"dropped {row['drop_fraction']:.1%}  (compile+first {row['compile_and_first_step_s']:.1f}s)"
        )
    capacity, dropless = results["steps"]
    print(f"  dropless / capacity step time: {dropless['step_s'] / capacity['step_s']:.2f}x")
    evaluation = results["evaluation"] = time_evaluation(args.dtype)
    print(
        f"  evaluation at the demo's sizes ({evaluation['sets']} sets x {evaluation['sequences_per_set']} "
        f"sequences of {DEMO_SEQ}, dropless + capacity, {evaluation['batches']} batches of "
        f"{evaluation['rows_per_batch']} rows): {evaluation['evaluation_s'] * 1e3:.1f} ms = "
        f"{evaluation['train_steps_per_evaluation']:.2f} train steps of "
        f"{evaluation['train_step_s'] * 1e3:.1f} ms (batch {DEMO_BATCH} x seq {DEMO_SEQ}); "
        f"compile+first {evaluation['compile_and_first_s']:.1f}s, "
        f"programs {evaluation['compiled']}"
    )

    guard = results["guard"] = time_guard(args.dtype)
    print_guard(guard)

    expert_ratio = None
    if not args.no_expert_parallel:
        # Simulated devices are CPU devices: on an accelerator machine the child runs the CPU sizes.
        child = (args.batch, args.seq, args.steps) if not accelerator else (8, 256, 4)
        dtype = args.dtype if not accelerator else "float32"
        results["expert_parallel"] = run_expert_parallel_child(*child, args.vocab, dtype)
        print(f"expert parallelism on {EXPERT_DEVICES} simulated CPU devices (mesh data,fsdp,expert = "
              f"{','.join(map(str, EXPERT_MESH))}), batch {child[0]} x seq {child[1]}:")  # fmt: skip
        for single, parallel in zip(results["expert_parallel"][::2], results["expert_parallel"][1::2]):
            print(
                f"  {single['dispatch']:<9} one device {single['step_s'] * 1e3:8.1f} ms, expert-parallel "
                f"{parallel['step_s'] * 1e3:8.1f} ms ({single['step_s'] / parallel['step_s']:.2f}x), dropped "
                f"{single['drop_fraction']:.1%} / {parallel['drop_fraction']:.1%}  "
                f"(compile+first {parallel['compile_and_first_step_s']:.1f}s)"
            )
        single, parallel = results["expert_parallel"][:2]
        expert_ratio = single["step_s"] / parallel["step_s"]
    print("JSON " + json.dumps(results))
    if expert_ratio is not None:
        # Higher is better: the expert-parallel step's time against the same work on one device.
        print(f"train_expert_parallel ratio={expert_ratio:.2f} target=0.5 baseline=single_device_step")
    # The result line: MFU of the capacity-dispatch step against this machine's measured matmul peak. The
    # target is for a CPU; on accelerators compare with the reference run's 21-23% on GB200 racks.
    print(f"train ratio={capacity['mfu_vs_measured_peak']:.2f} target=0.1 baseline=jitted_matmul_peak")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
