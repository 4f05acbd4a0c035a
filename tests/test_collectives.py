"""What a compiled step communicates (trainer/run/collectives.py): the HLO parser on a hand-written module,
and `tokenmill model compile` on 8 simulated devices against hand counts of what fsdp and expert
parallelism must move.

The hand-written module has every kind of collective, in XLA's three spellings of replica groups, inside a
while loop with a known trip count that holds one whose trips only its induction bound says, a
conditional, a loop whose trips cannot be read, and an operand XLA:CPU widened from bf16.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import pytest
import yaml

from tokenmill.trainer.commands.model import format_compile_report
from tokenmill.trainer.model import transformer
from tokenmill.trainer.model.shape import ModelConfig
from tokenmill.trainer.run import collectives
from tokenmill.trainer.run.collectives import ParameterShapes

MODULE = """HloModule jit_step, is_scheduled=true, num_partitions=8

FileNames
1 "/work/src/tokenmill/trainer/model/moe.py"
2 "/work/site-packages/jax/_src/lax/parallel.py"

FunctionNames
1 "capacity_dispatch"
2 "all_to_all"

FileLocations
1 {file_name_id=1 function_name_id=1 line=104 end_line=104 column=4 end_column=9}
2 {file_name_id=2 function_name_id=2 line=55 end_line=55 column=4 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=0}
2 {file_location_id=2 parent_frame_id=2}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %sum = f32[] add(%a, %b)
}

%widen (p: bf16[16,64]) -> f32[16,64] {
  %p = bf16[16,64]{1,0} parameter(0)
  ROOT %wide = f32[16,64]{1,0} convert(%p)
}

%inner_body (state: (s32[], f32[128,64])) -> (s32[], f32[128,64]) {
  %state = (s32[], f32[128,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %x = f32[128,64]{1,0} get-tuple-element(%state), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %grad = f32[128,64]{1,0} all-reduce(%x), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, \
to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/while/body/dot_general"}
  ROOT %out = (s32[], f32[128,64]{1,0}) tuple(%next, %grad)
}

%inner_cond (state: (s32[], f32[128,64])) -> pred[] {
  %state = (s32[], f32[128,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %limit = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}

%outer_body (state: (s32[], f32[16,64])) -> (s32[], f32[16,64]) {
  %state = (s32[], f32[16,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %w = f32[16,64]{1,0} get-tuple-element(%state), index=1
  %gathered = f32[128,64]{1,0} all-gather(%w), channel_id=1, \
replica_groups=mesh['axis_0'=8,'axis_1'=1] {'axis_0'}, dimensions={0}, use_global_device_ids=true, \
metadata={op_name="jit(step)/jvp()/while/body/dot_general"}
  %zero = s32[] constant(0)
  %init = (s32[], f32[128,64]{1,0}) tuple(%zero, %gathered)
  %loop = (s32[], f32[128,64]{1,0}) while(%init), condition=%inner_cond, body=%inner_body
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], f32[16,64]{1,0}) tuple(%next, %w)
}

%outer_cond (state: (s32[], f32[16,64])) -> pred[] {
  %state = (s32[], f32[16,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %limit = s32[] constant(5)
  ROOT %lt = pred[] compare(%i, %limit), direction=LT
}

%loose_body (state: (s32[], f32[64])) -> (s32[], f32[64]) {
  %state = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %v = f32[64]{0} get-tuple-element(%state), index=1
  %pair = f32[64]{0} all-gather(%v), channel_id=7, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}
  ROOT %out = (s32[], f32[64]{0}) tuple(%i, %pair)
}

%loose_cond (state: (s32[], f32[64])) -> pred[] {
  %state = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%state), index=0
  %n = s32[] get-tuple-element(%state), index=0
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%narrow_it (x: f32[128,64]) -> bf16[128,64] {
  %x = f32[128,64]{1,0} parameter(0)
  %relaid = f32[128,64]{0,1} copy(%x)
  ROOT %narrow = bf16[128,64]{1,0} convert(%relaid)
}

%heavy (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %sum = f32[1024]{0} all-reduce(%x), channel_id=4, replica_groups={}, to_apply=%add
}

%light (x: f32[1024]) -> f32[1024] {
  ROOT %x = f32[1024]{0} parameter(0)
}

ENTRY %main (w: f32[16,64], u: f32[64]) -> f32[16,64] {
  %w = f32[16,64]{1,0} parameter(0)
  %u = f32[64]{0} parameter(1)
  %h = bf16[16,64]{1,0} convert(%w)
  %g = f32[16,64]{1,0} add(%w, %w)
  %flag = pred[] constant(true)
  %zero_f = f32[] constant(0)
  %v = f32[1024]{0} broadcast(%zero_f), dimensions={}
  %p = f32[8,8]{1,0} broadcast(%zero_f), dimensions={}
  %r = f32[32,64]{1,0} broadcast(%zero_f), dimensions={}
  %q = f32[48,64]{1,0} broadcast(%zero_f), dimensions={}
  %zero = s32[] constant(0)
  %o = s32[8]{0} broadcast(%zero), dimensions={}
  %init = (s32[], f32[16,64]{1,0}) tuple(%zero, %w)
  %layers = (s32[], f32[16,64]{1,0}) while(%init), condition=%outer_cond, body=%outer_body, \
backend_config={"known_trip_count":{"n":"5"}}
  %scattered = f32[4,64]{1,0} reduce-scatter(%g), channel_id=3, replica_groups=[2,4]<=[8], dimensions={0}, \
to_apply=%add, metadata={op_name="jit(step)/transpose(jvp())/dot_general"}
  %wide = f32[16,64]{1,0} fusion(%h), kind=kLoop, calls=%widen
  %sent = f32[16,64]{1,0} all-to-all(%wide), channel_id=5, replica_groups=[1,8]<=[8], dimensions={0}, \
metadata={op_name="jit(step)/jvp()/shard_map/expert_dispatch/all_to_all" stack_frame_id=2}
  %branch = f32[1024]{0} conditional(%flag, %v, %v), branch_computations={%light, %heavy}
  %moved = f32[8,8]{1,0} collective-permute(%p), channel_id=6, source_target_pairs={{0,1},{1,2},{2,3}}
  %ragged = f32[48,64]{1,0} ragged-all-to-all(%r, %q, %o, %o, %o, %o), channel_id=8, \
replica_groups={{0,1,2,3,4,5,6,7}}
  %cast_late = f32[128,64]{1,0} all-gather(%w), channel_id=9, replica_groups=[1,8]<=[8], dimensions={0}
  %bf16_weight = bf16[128,64]{1,0} fusion(%cast_late), kind=kLoop, calls=%narrow_it
  %loose_init = (s32[], f32[64]{0}) tuple(%zero, %u)
  %loose = (s32[], f32[64]{0}) while(%loose_init), condition=%loose_cond, body=%loose_body
  ROOT %result = f32[16,64]{1,0} get-tuple-element(%layers), index=1
}
"""


def test_the_parser_counts_a_hand_written_module():
    # One parameter, a [128, 64] matrix sharded 8 ways on its first dimension.
    params = ParameterShapes([((128, 64), (16, 64), False)])
    found, notes = collectives.collectives(MODULE, params)
    by_name = {collective.name: collective for collective in found}
    f32 = 4
    # all-gather in a loop of 5 (known_trip_count): the gathered output B x 7/8, a weight gather.
    gathered = by_name["gathered"]
    assert (gathered.group, gathered.executions) == (8, 5)
    assert gathered.bytes == 128 * 64 * f32 * 7 / 8
    assert gathered.elements[0].category == "weight_gather" and gathered.elements[0].narrowed is None
    # Gathered in f32 and only ever read as bf16 (cast after the gather, not before).
    late = by_name["cast_late"]
    assert late.elements[0].narrowed == "bf16" and late.bytes == gathered.bytes
    # all-reduce in a loop of 3 (its induction bound, from 0 by 1) inside the loop of 5: 2 B x 3/4.
    grad = by_name["grad"]
    assert (grad.group, grad.executions) == (4, 15)
    assert grad.bytes == 2 * 128 * 64 * f32 * 3 / 4
    assert grad.elements[0].category == "gradient_reduction"
    # reduce-scatter over iota groups of 4: the input (4 x the output) x 3/4; classified by its input.
    scattered = by_name["scattered"]
    assert scattered.group == 4 and scattered.bytes == 16 * 64 * f32 * 3 / 4
    assert scattered.elements[0].category == "gradient_reduction"
    # all-to-all of a bf16 value widened to f32 to be moved: counted at bf16, the dispatch by its scope,
    # and the model line found above JAX's own frame.
    sent = by_name["sent"]
    assert sent.elements[0].payload == "bf16" and sent.elements[0].dtype == "f32"
    assert sent.bytes == 16 * 64 * 2 * 7 / 8 and sent.elements[0].compiled_bytes == 16 * 64 * f32 * 7 / 8
    assert sent.elements[0].category == "expert_dispatch"
    assert sent.source == "trainer/model/moe.py:104 capacity_dispatch"
    # The conditional counts its heavier branch once; replica_groups={} is every device.
    assert by_name["sum"].executions == 1 and by_name["sum"].group == 8
    # collective-permute: every sender sends its operand; ragged: its input buffer x 7/8, an upper bound.
    assert by_name["moved"].bytes == 8 * 8 * f32
    assert by_name["ragged"].bytes == 32 * 64 * f32 * 7 / 8 and by_name["ragged"].upper_bound
    # A loop whose bound is not a constant counts once and is reported.
    assert by_name["pair"].executions == 1 and by_name["pair"].bytes == 64 * f32 / 2
    assert notes["loops_without_trip_count"] == ["loose_body"]

    report = collectives.communication(MODULE, params)
    moved = report["bytes_per_device"]
    assert moved["weight_gather"] == 5 * gathered.bytes + late.bytes
    assert report["narrowed_after_moving"] == {"bytes": late.bytes, "at_the_narrow_dtype": late.bytes / 2}
    assert moved["gradient_reduction"] == 15 * grad.bytes + scattered.bytes
    assert moved["expert_dispatch"] == sent.bytes
    assert moved["other"] == by_name["sum"].bytes + by_name["moved"].bytes + by_name["ragged"].bytes + (
        by_name["pair"].bytes
    )
    assert moved["total"] == pytest.approx(sum(c.bytes * c.executions for c in found))
    widened = report["bytes_per_device_as_compiled"]["total"] - moved["total"]
    assert widened == pytest.approx(16 * 64 * 2 * 7 / 8)
    # The all-reduce of the whole [128, 64] gradient of a sharded parameter could be a reduce-scatter.
    assert report["gradient_all_reduce_of_sharded_parameters"] == 15 * grad.bytes
    unattributed = report["unattributed"]
    assert unattributed["loops_without_trip_count"] == 1
    assert unattributed["loop_bodies_counted_once_bytes"] == 64 * f32 / 2
    assert unattributed["conditionals_counted_by_heaviest_branch"] == 1
    assert unattributed["ragged_upper_bound_bytes"] == by_name["ragged"].bytes
    assert report["largest"][0]["kind"] == "all-reduce" and report["largest"][0]["phase"] == "backward"


def test_replica_groups_parameter_shapes_and_links():
    size = collectives.group_size
    assert size("replica_groups=mesh['axis_0'=2,'axis_1'=4,'axis_2'=8] {'axis_1','axis_2'}", 64) == 32
    assert size("replica_groups=mesh['axis_0'=8] {'axis_0':(2)4}", 8) == 4  # a sub-axis
    assert size("replica_groups=[16,4]<=[4,16]T(1,0)", 64) == 4
    assert size("replica_groups={{0,2},{1,3}}", 4) == 2 and size("replica_groups={}", 4) == 4
    assert size("channel_id=1", 4) is None
    # A stacked expert weight [repeats 4, E 8, d 128, h 256]: experts over 2, d over 4.
    params = ParameterShapes([((4, 8, 128, 256), (4, 4, 32, 256), True)])
    assert params.matches((4, 128, 256))  # one layer's slice with d gathered
    assert params.matches((8, 256, 128)) and params.matches((1, 4, 32, 256))  # transposed; with the repeat
    assert not params.matches((3, 128, 256)) and not params.matches((4096, 256))
    assert params.is_shard((4, 32, 256)) and not params.is_shard((4, 128, 256))
    assert collectives.parse_link("ib-400g")[1] == 50e9
    assert collectives.parse_link("450")[1:] == (450e9, None)
    with pytest.raises(ValueError):
        collectives.parse_link("fast")
    times = collectives.estimate_times({"total": 9e9}, 900e9, 8 * 2.5e15 * 0.4 * 0.02, 8, 2.5e15, 0.4)
    assert times["communication_seconds"]["total"] == pytest.approx(0.01)
    assert times["compute_seconds"] == pytest.approx(0.02)
    assert times["communication_over_compute"] == pytest.approx(0.5)


def compile_tiny(tmp_path, shape: dict, mesh: str, batch: int, *extra: str) -> dict:
    """`tokenmill model compile --json` on 8 simulated devices, from a plain process."""
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump(shape))
    env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    command = [sys.executable, "-m", "tokenmill", "model", "compile", str(config), "--devices", "8",
               "--mesh", mesh, "--batch-size", str(batch), "--optimizer", "adamw",
               "--compute-dtype", "float32", "--json", *extra]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


# Sizes chosen so that no activation has a parameter's shape: 48 tokens a device, d_model 64.
SHAPE = dict(
    name="collectives-tiny", vocab_size=160, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16,
    sequence_length=24, moe=dict(n_experts=8, top_k=2, expert_hidden=96, n_shared_experts=1,
                                 dispatch="capacity", capacity_factor=1.0),
)  # fmt: skip


EXPERT_STACKS = ("['w_gate']", "['w_up']", "['w_down']")


def matrix_bytes() -> dict[str, int]:
    """fp32 bytes of every SHAPE leaf with two or more dimensions per layer (the sharded ones), by path;
    the embedding apart: it is looked up by moving the tokens instead."""
    cfg = ModelConfig(**SHAPE)
    leaves = jax.tree_util.tree_flatten_with_path(
        jax.eval_shape(lambda key: transformer.init_params(key, cfg), jax.random.key(0))
    )[0]
    sizes = {}
    for path, leaf in leaves:
        stacked = any(getattr(key, "key", None) == "layers" for key in path)
        if leaf.ndim - stacked >= 2 and jax.tree_util.keystr(path) != "['embed']":
            sizes[jax.tree_util.keystr(path)] = math.prod(leaf.shape) * 4
    return sizes


def test_fsdp_moves_the_parameters_twice_and_reduces_their_gradients(tmp_path):
    """fsdp=8, one microbatch, no remat: every sharded matrix is gathered for the forward pass and again for
    the backward pass (B x 7/8 each), and its gradient is all-reduced over the 8 (2 B x 7/8); the
    embedding is looked up by moving the tokens instead."""
    report = compile_tiny(tmp_path, SHAPE, "fsdp=8", 16)
    matrices = sum(matrix_bytes().values())
    moved = report["communication"]["bytes_per_device"]
    assert moved["weight_gather"] == pytest.approx(2 * matrices * 7 / 8, rel=0.02)
    assert moved["gradient_reduction"] == pytest.approx(2 * matrices * 7 / 8, rel=0.03)
    assert moved["expert_dispatch"] == 0 and moved["other"] < 0.05 * moved["total"]
    comm = report["communication"]
    assert comm["gradient_all_reduce_of_sharded_parameters"] <= moved["gradient_reduction"]
    # The default link: a GB200's NVLink, against its compute at 40% MFU.
    assert comm["link"]["preset"] == "gb200-nvl72" and comm["link"]["mfu"] == 0.4
    assert comm["communication_seconds"]["total"] == pytest.approx(moved["total"] / 900e9)
    compute = report["model_flops_per_step"] / (8 * 2.5e15 * 0.4)
    assert comm["compute_seconds"] == pytest.approx(compute)
    text = format_compile_report(report)
    assert "communication/step" in text and "weight_gather" in text and "gb200-nvl72" in text


def test_expert_parallel_moves_each_routed_copy_out_and_back(tmp_path):
    """expert=8: each MoE layer sends every routed copy of its tokens to the expert's device and back, in
    the forward pass and (transposed) in the backward pass: tokens x d_model x 4 bytes x k x 7/8 per
    layer per direction, four directions a layer. Capacity 1.0 with 48 x 2 copies over 8 experts: the
    cells hold exactly the copies."""
    report = compile_tiny(tmp_path, SHAPE, "expert=8", 16, "--link-bandwidth", "ib-400g")
    assert report["dispatch"] == "expert_parallel/capacity"
    tokens_per_device = 16 * SHAPE["sequence_length"] // 8
    m = SHAPE["moe"]
    per_direction = tokens_per_device * SHAPE["d_model"] * 4 * m["top_k"] * 7 / 8
    comm = report["communication"]
    assert comm["bytes_per_device"]["expert_dispatch"] == pytest.approx(
        SHAPE["n_layers"] * 4 * per_direction, rel=1e-6
    )
    assert comm["bytes_per_device_by_category_and_kind"]["expert_dispatch"].keys() == {"all-to-all"}
    # The dense matrices are split over the expert axis as fsdp splits them (sharding._dense_axes), and the
    # routed experts stay whole on their device. A layer's matrices are gathered for the forward and again
    # for the backward pass; the router (fp32, read before the layer's loop body) and the head once, their
    # gathered copies kept for the backward pass.
    dense = {name: size for name, size in matrix_bytes().items() if not name.endswith(EXPERT_STACKS)}
    once = sum(size for name, size in dense.items() if name.endswith(("['router']", "['lm_head']")))
    gathered = 2 * (sum(dense.values()) - once) * 7 / 8 + once * 7 / 8
    assert comm["bytes_per_device"]["weight_gather"] == pytest.approx(gathered, rel=1e-6)
    assert comm["link"]["bandwidth_bytes_per_second"] == 50e9


def test_bytes_print_in_decimal_units():
    from tokenmill.units import format_bytes

    assert format_bytes(0) == "0 B" and format_bytes(999) == "999 B"
    assert format_bytes(26_295_808) == "26.3 MB" and format_bytes(45e9) == "45.0 GB"
    assert format_bytes(999.9e6) == "1.00 GB" and format_bytes(9.996e9) == "10.0 GB"
    assert format_bytes(1.5e13) == "15.0 TB"
