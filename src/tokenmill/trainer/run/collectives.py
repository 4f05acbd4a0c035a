"""What one compiled train step communicates: the bytes each collective moves per device, read from the
optimised HLO text of the executable (`compiled.as_text()`), split by what it serves, and how long that
takes at a link bandwidth next to the step's compute at an MFU. `tokenmill model compile` prints it
(run/compile.py); docs/trainer.md, "Compiling ahead of time", has the conventions and measured numbers.

Bytes per device and execution, for a collective over groups of n devices (the ring algorithms' count of
what each device sends, which is also what it receives):

- all-gather: B x (n-1)/n, B the gathered output's bytes;
- reduce-scatter: B x (n-1)/n, B the input's bytes (n x the output's);
- all-reduce: 2 x B x (n-1)/n (a reduce-scatter, then an all-gather);
- all-to-all: B x (n-1)/n, B the operand's bytes (the 1/n addressed to the device itself stays);
- ragged-all-to-all: the same of its input buffer, an upper bound (what is really sent depends on the
  routing: the send sizes are data);
- collective-permute: B, every device that sends sends its whole operand.

A collective inside a `while` loop counts once per trip, the trip count read from XLA's `known_trip_count`
(backend_config) or else from the loop's induction bound (`i < N` in its condition, i from a constant with
a constant step); nested loops multiply. A loop whose trips cannot be read counts once, and a
`conditional` counts its most communicating branch (the guard's update, the health metrics' sampled step):
both are listed under `unattributed`, as are ragged upper bounds and groups that cannot be read.

What each collective serves (`classify`), from its op metadata first: the named scopes the model and the
step put around their collectives (`expert_dispatch` in model/moe.py and model/expert_parallel.py,
`optimizer_update` and `gradient_reduction` in run/step.py), then from its shapes against the parameters'
(`ParameterShapes`): an all-gather of a parameter's shape is a weight gather (fsdp), a reduce-scatter or an
all-reduce of one in the backward pass (op_name `transpose(...)`) is a gradient reduction. The rest (the
loss, the router's load and histogram, the embedding's reshard of the tokens, activations the partitioner
chose to move) is `other`, listed with the source line of the model code that made it.

Dtypes. XLA:CPU has no bf16 collectives: it widens a bf16 operand to f32 to move it (`convert(convert(x)
-> bf16) -> f32` feeding the collective). `bytes_per_device` counts such an array at bf16, the program's
dtype and what a GPU moves; `bytes_per_device_as_compiled` counts what this HLO moves. An array moved at
f32 whose every use converts it to bf16 at once (the partitioner gathered an fp32 weight shard before the
program's cast) counts at f32, as it is moved, and is listed under `narrowed_after_moving` with what it
would be as bf16.

The HLO text, its loops' trip counts and how often each computation runs are read by model/hlo.py, the
parser the FLOP count shares. Memory: that parse (a few times the HLO text, 14 MB of text for the 535B's
step, read in about 2 s); nothing else grows with the model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

# Named scopes (`jax.named_scope`) that mark what a collective is for in its op_name.
from tokenmill.trainer.model.expert_parallel import DISPATCH_SCOPE
from tokenmill.trainer.model.hlo import (
    DTYPE_BYTES,
    Computation,
    HloModule,
    Instruction,
    array_bytes,
    array_shapes,
    multiplicities,
    parse_module,
    source_line,
)
from tokenmill.trainer.run.step import GRADIENT_SCOPE, OPTIMIZER_SCOPE

#: The collectives counted, by their HLO opcode (async `-start` forms count as their op; `-done` do not).
KINDS = (
    "all-gather",
    "reduce-scatter",
    "all-reduce",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
)
#: What a collective serves, in the report's order.
CATEGORIES = ("expert_dispatch", "weight_gather", "gradient_reduction", "optimizer", "other")


# Link bandwidth per device and direction (bytes/s) and the chip's dense bf16 peak (FLOP/s), by preset.
# - gb200-nvl72: fifth-generation NVLink, 1.8 TB/s per GPU both directions together, so 900 GB/s each way
#   (nvidia.com/en-us/data-center/gb200-nvl72: "1.8 TB/s GPU-to-GPU interconnect"); 2.5 PFLOP/s dense
#   bf16 per GPU (the same page: 180 PFLOPS FP16/BF16 for 72 GPUs without sparsity, 360 with it).
# - h100-node / h200-node: fourth-generation NVLink, 900 GB/s per GPU both directions, 450 GB/s each way,
#   inside an 8-GPU HGX board (the H100 and H200 data sheets, SXM: "NVLink: 900GB/s"); 989 TFLOP/s dense
#   bf16 (the data sheets' 1,979 TFLOPS is with sparsity).
# - ib-400g: between nodes, one 400 Gb/s NDR InfiniBand (ConnectX-7) port per GPU as in a DGX H100, i.e.
#   50 GB/s each way per GPU; H100 compute.
LINK_PRESETS: dict[str, dict[str, Any]] = {
    "gb200-nvl72": {"bandwidth": 900e9, "peak_flops": 2.5e15, "link": "NVLink 5 within an NVL72 rack"},
    "h100-node": {"bandwidth": 450e9, "peak_flops": 989e12, "link": "NVLink 4 within an 8-GPU node"},
    "h200-node": {"bandwidth": 450e9, "peak_flops": 989e12, "link": "NVLink 4 within an 8-GPU node"},
    "ib-400g": {"bandwidth": 50e9, "peak_flops": 989e12, "link": "400 Gb/s InfiniBand per GPU, across nodes"},
}
DEFAULT_LINK = "gb200-nvl72"
DEFAULT_MFU = 0.4


# --- collectives, groups and loops --------------------------------------------------------------------------


def group_size(attributes: str, num_partitions: int | None) -> int | None:
    """Devices per group of a collective's `replica_groups`, in any of XLA's three spellings: explicit
    `{{0,1},{2,3}}` (empty: every device), iota `[2,4]<=[8]` (groups of the last size) and the mesh form
    `mesh['axis_0'=8,'axis_1'=1] {'axis_0'}` (the product of the named axes, a sub-axis `'a':(1)2` by its
    size). None when there are no groups to read."""
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\][^{]*\{([^}]*)\}", attributes)
    if mesh:
        sizes = {name: int(size) for name, size in re.findall(r"'([^']*)'=(\d+)", mesh.group(1))}
        size = 1
        for name, sub in re.findall(r"'([^']*)'(?::\(\d+\)(\d+))?", mesh.group(2)):
            if name not in sizes:
                return None
            size *= int(sub) if sub else sizes[name]
        return size
    iota = re.search(r"replica_groups=\[([0-9,]+)\]<=", attributes)
    if iota:
        return int(iota.group(1).split(",")[-1])
    explicit = re.search(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)?\}", attributes)
    if explicit:
        if not explicit.group(1):
            return num_partitions
        return len([d for d in explicit.group(1).split("}")[0].strip("{").split(",") if d])
    return None


@dataclass(frozen=True)
class Element:
    """One array a collective moves (a combined collective moves several): its dtype as compiled and the
    dtype of the value it carries (`payload`: bf16 where XLA:CPU widened a bf16 value to f32 only to move
    it), its bytes per device and execution under the module docstring's convention at each, what it
    serves, and `narrowed` when what arrives is only ever used narrower (the partitioner gathered an fp32
    weight shard that the program casts to bf16 right after: bf16 would have carried the same)."""

    dtype: str
    payload: str
    dims: tuple[int, ...]
    bytes: float  # at the payload's dtype
    compiled_bytes: float  # at the dtype XLA compiled the collective with
    category: str
    narrowed: str | None = None  # the dtype every user converts the result to at once, when narrower


@dataclass(frozen=True)
class Collective:
    """A collective instruction of the compiled step: where it is, how many devices take part, its arrays,
    and how many times one step runs it (its computation's multiplicity)."""

    computation: str
    name: str
    kind: str
    group: int | None
    elements: tuple[Element, ...]
    op_name: str
    source: str
    executions: float
    upper_bound: bool  # ragged: the buffer, not what the routing sends

    @property
    def bytes(self) -> float:
        return sum(element.bytes for element in self.elements)


def _kind(opcode: str) -> str | None:
    base = opcode[: -len("-start")] if opcode.endswith("-start") else opcode
    return base if base in KINDS else None


# Per device and execution, as a multiple of B (the module docstring), for a group of n.
_FACTORS: dict[str, Callable[[int], float]] = {
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: float(n - 1),  # of the output, which is B / n
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-to-all": lambda n: (n - 1) / n,
    "ragged-all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}


def _moved_arrays(
    module: HloModule, computation: Computation, instruction: Instruction, kind: str
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(compiled dtype, payload dtype, dims) of each array the collective moves: its result's arrays (an
    async all-gather-start's outputs, a collective-permute-start's operand, a ragged-all-to-all's input
    buffer), each with the dtype its operand held before any widening convert."""
    arrays = array_shapes(instruction.shape)
    sources = [name for name in instruction.operands if name in computation.instructions]
    if instruction.opcode.endswith("-start") and kind in ("all-gather", "collective-permute"):
        # all-gather-start: (operands, outputs); collective-permute-start: (operand, output, contexts).
        operands = [array for name in sources for array in array_shapes(computation.instructions[name].shape)]
        arrays = arrays[len(operands) :][: len(operands)] if kind == "all-gather" else operands
    if kind == "ragged-all-to-all" and sources:
        sources = sources[:1]
        arrays = array_shapes(computation.instructions[sources[0]].shape)
    if len(sources) != len(arrays):
        sources = sources[:1] * len(arrays) if len(arrays) == 1 else [""] * len(arrays)
    return [
        (dtype, _payload_dtype(module, computation, source, dtype), dims)
        for (dtype, dims), source in zip(arrays, sources, strict=True)
    ]


_PASS_THROUGH = ("bitcast", "copy", "reshape", "transpose", "slice", "dynamic-slice", "get-tuple-element")


def _payload_dtype(module: HloModule, computation: Computation, name: str, dtype: str) -> str:
    """The dtype of the value an operand carries: XLA:CPU moves bf16 collectives as f32, widening their
    operand with a convert (`convert(convert(x) -> bf16) -> f32` in a fusion); when the operand (or its
    fusion's root, through layout ops) is a widening convert, the narrower dtype it came from."""
    instruction = computation.instructions.get(name)
    for _ in range(16):
        if instruction is None:
            return dtype
        if instruction.opcode == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", instruction.attributes)
            computation = module.computations.get(called.group(1)) if called else None
            if computation is None or computation.root is None:
                return dtype
            instruction = computation.instructions[computation.root]
        elif instruction.opcode in _PASS_THROUGH and instruction.operands:
            instruction = computation.instructions.get(instruction.operands[0])
        elif instruction.opcode == "convert" and instruction.operands:
            source = computation.instructions.get(instruction.operands[0])
            arrays = array_shapes(source.shape) if source is not None else []
            narrow = arrays[0][0] if len(arrays) == 1 else dtype
            return narrow if DTYPE_BYTES[narrow] < DTYPE_BYTES[dtype] else dtype
        else:
            return dtype
    return dtype


# --- what a collective serves -------------------------------------------------------------------------------


class ParameterShapes:
    """The shapes a parameter can take on the way through the step: each dimension between its shard (what a
    device holds) and its global size, the leading layer-repeat axis of a stacked leaf optional (the scan
    body sees one slice), the last two dimensions either way round (transposed layouts), size-1 dimensions
    dropped. Built from the state's abstract parameters with their shardings; one entry per leaf."""

    def __init__(self, leaves: Iterable[tuple[tuple[int, ...], tuple[int, ...], bool]]):
        self.leaves = []
        for global_dims, shard_dims, stacked in leaves:
            dims = list(zip(shard_dims, global_dims, strict=True))
            self.leaves.append((dims, stacked))
            if len(dims) - stacked >= 2:
                self.leaves.append(([*dims[:-2], dims[-1], dims[-2]], stacked))

    @classmethod
    def from_params(cls, abstract_params: Any) -> ParameterShapes:
        """From a pytree of `jax.ShapeDtypeStruct`s with shardings (the state's "params"); leaves under
        "layers" are stacked by layer repeat."""
        import jax

        leaves = []
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract_params)[0]:
            stacked = any(getattr(key, "key", None) == "layers" for key in path)
            shard = tuple(leaf.sharding.shard_shape(leaf.shape)) if leaf.sharding is not None else leaf.shape
            leaves.append((tuple(leaf.shape), shard, stacked and len(leaf.shape) > 0))
        return cls(leaves)

    def matches(self, dims: Sequence[int]) -> bool:
        """Whether an array of these dimensions is some parameter (whole, partly or not gathered)."""
        wanted = [d for d in dims if d != 1]
        return any(_fits(wanted, leaf, stacked) for leaf, stacked in self.leaves)

    def is_shard(self, dims: Sequence[int]) -> bool:
        """Whether an array of these dimensions is a parameter's device shard (or one layer's slice of it):
        a gradient of that shape has nothing left to scatter."""
        wanted = [d for d in dims if d != 1]
        return any(
            _fits(wanted, [(shard, shard) for shard, _ in leaf], stacked) for leaf, stacked in self.leaves
        )


def _fits(wanted: list[int], leaf: list[tuple[int, int]], stacked: bool) -> bool:
    """wanted (size-1 dims dropped) against (shard, global) pairs: each dim d with shard | d | global, a pair
    skipped when its shard is 1 (a dim that may be 1 here) or it is the optional leading repeat axis."""

    def walk(i: int, j: int) -> bool:
        if j == len(leaf):
            return i == len(wanted)
        shard, whole = leaf[j]
        if (shard == 1 or (stacked and j == 0)) and walk(i, j + 1):
            return True
        return i < len(wanted) and wanted[i] % shard == 0 and whole % wanted[i] == 0 and walk(i + 1, j + 1)

    return walk(0, 0)


def phase(op_name: str) -> str:
    """Which part of the step an op belongs to, from its op_name: the forward pass (`jvp(...)`), its
    recomputation under remat (`rematted_computation`), the backward pass (`transpose(...)`), the update
    (the optimizer's scope), or the rest of the step."""
    if _has_scope(op_name, OPTIMIZER_SCOPE):
        return "update"
    if "rematted_computation" in op_name:
        return "forward (recomputed)"
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return "step"


def _has_scope(op_name: str, scope: str) -> bool:
    return re.search(rf"(^|[/(]){re.escape(scope)}([/)]|$)", op_name) is not None


def classify(kind: str, op_name: str, dims: Sequence[int], params: ParameterShapes | None) -> str:
    """What one moved array serves (the module docstring): named scopes first, then parameter shapes."""
    if _has_scope(op_name, DISPATCH_SCOPE):
        return "expert_dispatch"
    if _has_scope(op_name, OPTIMIZER_SCOPE):
        return "optimizer"
    if _has_scope(op_name, GRADIENT_SCOPE) and kind in ("all-reduce", "reduce-scatter"):
        return "gradient_reduction"
    if params is None:
        return "other"
    if kind == "all-gather" and params.matches(dims):
        return "weight_gather"
    if kind in ("all-reduce", "reduce-scatter") and "transpose(" in op_name and params.matches(dims):
        return "gradient_reduction"
    return "other"


def _users(computation: Computation, cache: dict[str, dict[str, list[Instruction]]]) -> dict:
    """The instructions that use each instruction of a computation (built once per computation)."""
    if computation.name not in cache:
        users: dict[str, list[Instruction]] = {}
        for instruction in computation.instructions.values():
            for operand in instruction.operands:
                users.setdefault(operand, []).append(instruction)
        cache[computation.name] = users
    return cache[computation.name]


def _narrowed_by_users(
    module: HloModule, computation: Computation, name: str, dtype: str, cache: dict, depth: int = 0
) -> str | None:
    """The dtype narrower than `dtype` that every use of `name` converts it to first (through layout ops
    and into fusions), or None when some use reads it at full width."""
    users = _users(computation, cache).get(name, [])
    if not users or depth > 12:
        return None
    found = set()
    for user in users:
        if user.opcode == "convert":
            arrays = array_shapes(user.shape)
            narrow = arrays[0][0] if len(arrays) == 1 else dtype
            result = narrow if DTYPE_BYTES[narrow] < DTYPE_BYTES[dtype] else None
        elif user.opcode in _PASS_THROUGH or user.opcode.endswith("-done"):
            result = _narrowed_by_users(module, computation, user.name, dtype, cache, depth + 1)
        elif user.opcode == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", user.attributes)
            fused = module.computations.get(called.group(1)) if called else None
            position = user.operands.index(name)
            parameter = next(
                (
                    inner.name
                    for inner in (fused.instructions.values() if fused else [])
                    if inner.opcode == "parameter" and inner.arguments.strip() == str(position)
                ),
                None,
            )
            result = (
                _narrowed_by_users(module, fused, parameter, dtype, cache, depth + 1)
                if fused is not None and parameter is not None
                else None
            )
        else:
            result = None
        if result is None:
            return None
        found.add(result)
    return found.pop() if len(found) == 1 else None


def _result_names(computation: Computation, instruction: Instruction, count: int) -> list[str | None]:
    """The names that carry each of a collective's `count` results: itself for one array, else its
    get-tuple-element users by index (None where an element is not read that way)."""
    if count == 1 and not instruction.shape.startswith("("):
        return [instruction.name]
    by_index: dict[int, str] = {}
    for user in computation.instructions.values():
        if user.opcode == "get-tuple-element" and user.operands == [instruction.name]:
            index = re.search(r"index=(\d+)", user.attributes)
            if index:
                by_index[int(index.group(1))] = user.name
    return [by_index.get(i) for i in range(count)]


def collectives(text: str, params: ParameterShapes | None = None) -> tuple[list[Collective], dict]:
    """Every collective of a compiled module's text with its bytes per device and execution, its
    category and its runs per step; and notes on what could not be read (see `communication`)."""
    module = parse_module(text)
    found: dict[str, list[tuple[Instruction, str, int, list[Element]]]] = {}
    unreadable = []
    users: dict[str, dict[str, list[Instruction]]] = {}
    for computation in module.computations.values():
        for instruction in computation.instructions.values():
            kind = _kind(instruction.opcode)
            if kind is None:
                continue
            if kind == "collective-permute":
                n = 2 if "source_target_pairs" in instruction.attributes else None
            else:
                n = group_size(instruction.attributes, module.num_partitions)
            if n is None or n < 1:
                unreadable.append(f"{computation.name}/{instruction.name}")
                continue
            factor = _FACTORS[kind](n)
            scattered = re.search(r"dimensions=\{(\d+)\}", instruction.attributes)
            arrays = [] if n == 1 else _moved_arrays(module, computation, instruction, kind)
            results = _result_names(computation, instruction, len(arrays))
            elements = []
            for (dtype, payload, dims), result in zip(arrays, results, strict=True):
                shape = dims
                if kind == "reduce-scatter" and scattered:  # classified by its input: the scattered dim x n
                    shape = tuple(d * n if i == int(scattered.group(1)) else d for i, d in enumerate(dims))
                category = classify(kind, instruction.op_name, shape, params)
                moved, compiled = (array_bytes(t, dims) * factor for t in (payload, dtype))
                narrowed = None
                if payload == dtype and result is not None and kind != "collective-permute":
                    narrowed = _narrowed_by_users(module, computation, result, dtype, users)
                elements.append(Element(dtype, payload, dims, moved, compiled, category, narrowed))
            found.setdefault(computation.name, []).append((instruction, kind, n, elements))
    own = {name: sum(e.bytes for item in items for e in item[3]) for name, items in found.items()}
    runs, notes = multiplicities(module, lambda name: own.get(name, 0.0))
    notes["unreadable_groups"] = unreadable
    result = [
        Collective(
            computation,
            instruction.name,
            kind,
            n,
            tuple(elements),
            instruction.op_name,
            source_line(module, instruction.stack_frame),
            runs.get(computation, 0.0),
            kind == "ragged-all-to-all",
        )  # fmt: skip
        for computation, items in found.items()
        for instruction, kind, n, elements in items
    ]
    notes["loop_bodies_counted_once_bytes"] = sum(
        c.bytes * c.executions for c in result if c.computation in notes["loops_without_trip_count"]
    )
    return result, notes


def communication(text: str, params: ParameterShapes | None = None, largest: int = 8) -> dict:
    """Per step and device: bytes by category and by kind, collective counts, the largest collectives, and
    what could not be attributed (the dict under `communication` in `model compile --json`)."""
    found, notes = collectives(text, params)
    by_category = dict.fromkeys(CATEGORIES, 0.0)
    compiled = dict.fromkeys(CATEGORIES, 0.0)
    by_kind = dict.fromkeys(KINDS, 0.0)
    table: dict[str, dict[str, float]] = {category: {} for category in CATEGORIES}
    groups: dict[tuple, dict] = {}
    sharded_all_reduce = 0.0
    narrowed = {"bytes": 0.0, "at_the_narrow_dtype": 0.0}
    for collective in found:
        for element in collective.elements:
            moved = element.bytes * collective.executions
            if element.narrowed:
                narrowed["bytes"] += moved
                narrowed["at_the_narrow_dtype"] += (
                    moved * DTYPE_BYTES[element.narrowed] / DTYPE_BYTES[element.payload]
                )
            by_category[element.category] += moved
            compiled[element.category] += element.compiled_bytes * collective.executions
            by_kind[collective.kind] += moved
            cell = table[element.category]
            cell[collective.kind] = cell.get(collective.kind, 0.0) + moved
            if (
                element.category == "gradient_reduction"
                and collective.kind == "all-reduce"
                and collective.group
                and params is not None
                and not params.is_shard(element.dims)
            ):
                sharded_all_reduce += moved
        for category in {element.category for element in collective.elements}:
            key = (collective.kind, category, collective.op_name, collective.source)
            entry = groups.setdefault(
                key,
                {"kind": collective.kind, "category": category, "phase": phase(collective.op_name),
                 "op_name": collective.op_name, "source": collective.source, "group_size": collective.group,
                 # XLA's combiner merged several ops into this one: op_name lists them, source is one's.
                 "combined": re.search(r"\([^()]*:[^()]*\)$", collective.op_name) is not None,
                 "bytes": 0.0, "executions": 0.0},
            )  # fmt: skip
            entry["bytes"] += sum(e.bytes for e in collective.elements if e.category == category) * (
                collective.executions
            )
            entry["executions"] += collective.executions
    total = sum(by_category.values())
    ragged = sum(c.bytes * c.executions for c in found if c.upper_bound)
    return {
        "bytes_per_device": {**by_category, "total": total},
        # What XLA:CPU's collectives move: bf16 values widened to f32 count 4 bytes an element here.
        "bytes_per_device_as_compiled": {**compiled, "total": sum(compiled.values())},
        "bytes_per_device_by_kind": by_kind,
        "bytes_per_device_by_category_and_kind": {k: v for k, v in table.items() if v},
        "collectives": len(found),
        "executions": sum(c.executions for c in found),
        # Gradient all-reduces of parameters sharded over the group, of which each device keeps a slice:
        # XLA:CPU leaves them so, XLA:GPU's reduce-scatter creator makes them reduce-scatters (half).
        "gradient_all_reduce_of_sharded_parameters": sharded_all_reduce,
        # Moved wide and converted narrower by every use at once (an fp32 weight shard gathered, then
        # cast to bf16): what those bytes are, and what they would be if the cast came first.
        "narrowed_after_moving": narrowed,
        "largest": sorted(groups.values(), key=lambda entry: -entry["bytes"])[:largest],
        "unattributed": {
            "other_bytes": by_category["other"],
            "loops_without_trip_count": len(notes["loops_without_trip_count"]),
            "loop_bodies_counted_once_bytes": notes["loop_bodies_counted_once_bytes"],
            "conditionals_counted_by_heaviest_branch": notes["conditionals_counted_by_heaviest_branch"],
            "ragged_upper_bound_bytes": ragged,
            "unreadable_groups": notes["unreadable_groups"],
        },
    }


# --- time at a bandwidth ------------------------------------------------------------------------------------


def parse_link(text: str) -> tuple[str | None, float, float | None]:
    """'gb200-nvl72' (a preset) or a number of GB/s per device and direction ('450', '50GB/s') ->
    (preset name or None, bytes/s, the preset chip's peak FLOP/s or None)."""
    key = text.strip().lower()
    if key in LINK_PRESETS:
        preset = LINK_PRESETS[key]
        return key, float(preset["bandwidth"]), float(preset["peak_flops"])
    match = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)\s*(?:gb/s|gbps|gb)?", key)
    if not match or float(match.group(1)) <= 0:
        presets = ", ".join(LINK_PRESETS)
        raise ValueError(f"--link-bandwidth {text!r}: a number of GB/s per device or one of {presets}")
    return None, float(match.group(1)) * 1e9, None


def estimate_times(
    bytes_per_device: dict[str, float],
    bandwidth: float,
    model_flops_per_step: float,
    devices: int,
    peak_flops: float,
    mfu: float,
) -> dict:
    """Seconds per step: each category's bytes over the link's bandwidth (one link per device, every byte
    at that speed, nothing overlapped within the communication), and the compute at `mfu` of
    `peak_flops` per device for the step's MFU-convention FLOPs (model_flops_per_step, all devices)."""
    compute = model_flops_per_step / (devices * peak_flops * mfu)
    communication = {key: value / bandwidth for key, value in bytes_per_device.items()}
    return {
        "communication_seconds": communication,
        "compute_seconds": compute,
        "communication_over_compute": communication["total"] / compute if compute else None,
    }
