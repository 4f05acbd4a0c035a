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

Memory: the parse holds every instruction of the module, a few times the HLO text (14 MB of text for the
535B's step, read in about 2 s); nothing else grows with the model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

# Named scopes (`jax.named_scope`) that mark what a collective is for in its op_name.
from tokenmill.trainer.model.expert_parallel import DISPATCH_SCOPE
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

DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
}  # fmt: skip

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


# --- the HLO text -------------------------------------------------------------------------------------------


@dataclass
class Instruction:
    """One HLO instruction: its result shape (text), opcode, operand names and the text after them."""

    name: str
    shape: str
    opcode: str
    operands: list[str]
    arguments: str  # the text between the opcode's parentheses (a constant's value)
    attributes: str
    op_name: str = ""
    stack_frame: int | None = None


@dataclass
class Computation:
    name: str
    instructions: dict[str, Instruction] = field(default_factory=dict)
    root: str | None = None


@dataclass
class HloModule:
    """The computations of an HLO module's text, in the printed order (callees before their callers), its
    entry, the partition count and, when the text has them, the stack frames of the op metadata."""

    computations: dict[str, Computation]
    entry: str | None
    num_partitions: int | None
    frames: dict[int, tuple[str, str, int, int]]  # frame id -> (file, function, line, parent frame id)


_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_STACK_FRAME = re.compile(r"stack_frame_id=(\d+)")
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")


def parse_module(text: str) -> HloModule:
    """Parse an HLO module's text (as `compiled.as_text()` prints it) into its computations."""
    computations: dict[str, Computation] = {}
    entry = None
    current: Computation | None = None
    header = re.search(r"num_partitions=(\d+)", text[: text.find("\n") if "\n" in text else len(text)])
    frames = _stack_frames(text)
    for line in text.splitlines():
        if not line.startswith(" "):
            head = _COMPUTATION.match(line)
            if head:
                current = Computation(head.group(2))
                computations[current.name] = current
                if head.group(1):
                    entry = current.name
            elif line.startswith("}"):
                current = None
            continue
        if current is None:
            continue
        match = _INSTRUCTION.match(line)
        if not match:
            continue
        root, name, value = match.groups()
        instruction = _instruction(name, value)
        if instruction is None:
            continue
        current.instructions[name] = instruction
        if root:
            current.root = name
    return HloModule(computations, entry, int(header.group(1)) if header else None, frames)


def _instruction(name: str, value: str) -> Instruction | None:
    shape, rest = _split_shape(value)
    match = re.match(r"\s*([\w\-]+)\(", rest)
    if not match:
        return None
    opcode = match.group(1)
    start = match.end()
    depth, index = 1, start
    while index < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[index], 0)
        index += 1
    arguments = rest[start : index - 1]
    operands = re.findall(r"%([\w.\-]+)", arguments)
    attributes = rest[index:]
    op_name = _OP_NAME.search(attributes)
    frame = _STACK_FRAME.search(attributes)
    return Instruction(
        name, shape, opcode, operands, arguments, attributes,
        op_name.group(1) if op_name else "", int(frame.group(1)) if frame else None,
    )  # fmt: skip


def _split_shape(value: str) -> tuple[str, str]:
    """'f32[2,3]{1,0} dot(...)' -> ('f32[2,3]{1,0}', ' dot(...)'); a tuple shape is taken up to its closing
    parenthesis."""
    if value.startswith("("):
        depth = 0
        for index, char in enumerate(value):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                return value[: index + 1], value[index + 1 :]
        return value, ""
    shape, _, after = value.partition(" ")
    return shape, " " + after


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """The arrays of a shape's text, in order: 'f32[8,128]{1,0}' -> [('f32', (8, 128))]; a tuple gives each
    element (its /*index=N*/ comments and layouts ignored)."""
    shape = re.sub(r"/\*.*?\*/", "", shape)
    shape = re.sub(r"\{[^{}]*\}", "", shape)  # layouts, tilings
    return [
        (dtype, tuple(int(d) for d in dims.split(",") if d))
        for dtype, dims in _ARRAY.findall(shape)
        if dtype in DTYPE_BYTES
    ]


def array_bytes(dtype: str, dims: Sequence[int]) -> float:
    return DTYPE_BYTES[dtype] * math.prod(dims)


def _stack_frames(text: str) -> dict[int, tuple[str, str, int, int]]:
    """The FileNames / FunctionNames / FileLocations / StackFrames tables XLA prints before the module's
    computations, resolved to frame id -> (file, function, line, parent frame id)."""
    tables: dict[str, dict[int, str]] = {}
    table = None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            table = line
            tables[table] = {}
        elif line.startswith(("ENTRY", "%")) or _COMPUTATION.match(line):
            break  # the tables come before the computations
        elif table is not None and line[:1].isdigit():
            number, _, value = line.partition(" ")
            tables[table][int(number)] = value
        else:
            table = None
    if len(tables) < 4:
        return {}

    def field_of(value: str, key: str) -> int:
        found = re.search(rf"\b{key}=(\d+)", value)
        return int(found.group(1)) if found else 0

    files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
    functions = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
    frames = {}
    for frame, value in tables["StackFrames"].items():
        location = tables["FileLocations"].get(field_of(value, "file_location_id"), "")
        frames[frame] = (
            files.get(field_of(location, "file_name_id"), "?"),
            functions.get(field_of(location, "function_name_id"), "?"),
            field_of(location, "line"),
            # The printed parent is one past the parent's row (0: none), as the rows of a chain read in
            # XLA's own dumps: an op's frame, its caller's, ... up to the top of the Python stack.
            field_of(value, "parent_frame_id") - 1,
        )
    return frames


def source_line(module: HloModule, frame: int | None, package: str = "/tokenmill/") -> str:
    """The innermost frame of an op's stack inside `package` (the model's code, not JAX's), as
    'trainer/model/moe.py:118 capacity_dispatch'; '' when the text has no stack frames."""
    seen = set()
    while frame is not None and frame in module.frames and frame not in seen:
        seen.add(frame)
        path, function, line, parent = module.frames[frame]
        if package in path:
            return f"{path.split(package, 1)[1]}:{line} {function}"
        frame = parent
    return ""


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


@dataclass(frozen=True)
class Loop:
    body: str
    trips: int | None
    source: str  # "known_trip_count", "induction bound", or "" when unknown


def while_trips(module: HloModule, caller: Computation, instruction: Instruction) -> Loop:
    """The trip count of a `while` instruction: XLA's known_trip_count when the backend_config has it, else
    its condition's bound `i < N` (or <=) on a tuple element that starts at a constant and grows by a
    constant in the body."""
    body = re.search(r"body=%?([\w.\-]+)", instruction.attributes)
    body_name = body.group(1) if body else ""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.attributes)
    if known:
        return Loop(body_name, int(known.group(1)), "known_trip_count")
    condition = re.search(r"condition=%?([\w.\-]+)", instruction.attributes)
    cond = module.computations.get(condition.group(1)) if condition else None
    trips = None
    if cond is not None and cond.root is not None and body_name in module.computations:
        trips = _induction_trips(module, caller, instruction, cond, module.computations[body_name])
    return Loop(body_name, trips, "induction bound" if trips is not None else "")


def _constant(computation: Computation, name: str) -> int | None:
    instruction = computation.instructions.get(name)
    if instruction is None or instruction.opcode != "constant":
        return None
    value = re.fullmatch(r"\s*(-?\d+)\s*", instruction.arguments)
    return int(value.group(1)) if value else None


def _tuple_index(computation: Computation, name: str) -> int | None:
    """i when `name` is get-tuple-element(a parameter, index=i)."""
    instruction = computation.instructions.get(name)
    if instruction is None or instruction.opcode != "get-tuple-element" or not instruction.operands:
        return None
    source = computation.instructions.get(instruction.operands[0])
    index = re.search(r"index=(\d+)", instruction.attributes)
    if source is None or source.opcode != "parameter" or not index:
        return None
    return int(index.group(1))


def _induction_trips(
    module: HloModule, caller: Computation, loop: Instruction, cond: Computation, body: Computation
) -> int | None:
    compare = cond.instructions[cond.root]
    direction = re.search(r"direction=(\w+)", compare.attributes)
    if compare.opcode != "compare" or len(compare.operands) != 2 or not direction:
        return None
    lhs, rhs = compare.operands
    flipped = {"GT": "LT", "GE": "LE"}
    op = direction.group(1)
    if op in flipped:
        lhs, rhs, op = rhs, lhs, flipped[op]
    index, bound = _tuple_index(cond, lhs), _constant(cond, rhs)
    if op not in ("LT", "LE") or index is None or bound is None:
        return None
    init_step = re.search(r'"known_init_step":\{"init":"(-?\d+)","step":"(-?\d+)"', loop.attributes)
    if init_step:
        start, step = int(init_step.group(1)), int(init_step.group(2))
    else:
        state = caller.instructions.get(loop.operands[0]) if loop.operands else None
        if state is None or state.opcode != "tuple" or index >= len(state.operands):
            return None
        start = _constant(caller, state.operands[index])
        root = body.instructions.get(body.root or "")
        if start is None or root is None or root.opcode != "tuple" or index >= len(root.operands):
            return None
        update = body.instructions.get(root.operands[index])
        if update is None or update.opcode != "add" or len(update.operands) != 2:
            return None
        a, b = update.operands
        if _tuple_index(body, a) == index:
            step = _constant(body, b)
        elif _tuple_index(body, b) == index:
            step = _constant(body, a)
        else:
            return None
    if not step or step < 0:
        return None
    span = bound - start + (1 if op == "LE" else 0)
    return max(0, -(-span // step))


_CALLS = re.compile(r"\b(?:calls|to_apply|called_computations)=(\{[^}]*\}|%?[\w.\-]+)")


def multiplicities(module: HloModule, weight: Callable[[str], float]) -> tuple[dict[str, float], dict]:
    """How many times one run of the entry runs each computation: while bodies x their trips, the branch of
    each conditional that `weight` (a computation's own communication, callees included) says is the
    heaviest, every other callee once. Returns (name -> runs, notes on what could not be read)."""
    edges: dict[str, list[tuple[str, float]]] = {name: [] for name in module.computations}
    notes = {"loops_without_trip_count": [], "conditionals_counted_by_heaviest_branch": 0}
    branches_of: dict[str, list[list[str]]] = {name: [] for name in module.computations}
    for computation in module.computations.values():
        for instruction in computation.instructions.values():
            if instruction.opcode in ("async-done", "async-update"):
                continue  # the computation is the async-start's; counting it again would double it
            if instruction.opcode == "while":
                loop = while_trips(module, computation, instruction)
                if loop.trips is None:
                    notes["loops_without_trip_count"].append(loop.body)
                edges[computation.name].append(
                    (loop.body, float(loop.trips if loop.trips is not None else 1))
                )
                continue
            if instruction.opcode == "conditional":
                names = re.search(r"branch_computations=\{([^}]*)\}", instruction.attributes)
                listed = (
                    re.findall(r"%?([\w.\-]+)", names.group(1))
                    if names
                    else re.findall(r"(?:true|false)_computation=%?([\w.\-]+)", instruction.attributes)
                )
                branches_of[computation.name].append(listed)
                notes["conditionals_counted_by_heaviest_branch"] += 1
                continue
            for names in _CALLS.findall(instruction.attributes):
                edges[computation.name] += [(callee, 1.0) for callee in re.findall(r"%?([\w.\-]+)", names)]

    totals: dict[str, float] = {}

    def total(name: str) -> float:  # the computation's communication, callees included (memoised)
        if name not in totals:
            totals[name] = 0.0  # a cycle (never in valid HLO) stops here
            heaviest = sum(max((total(b) for b in branches), default=0.0) for branches in branches_of[name])
            totals[name] = weight(name) + heaviest + sum(w * total(c) for c, w in edges.get(name, []))
        return totals[name]

    for branches in branches_of.values():
        for listed in branches:
            for branch in listed:
                total(branch)
    for name, lists in branches_of.items():
        for listed in lists:
            if listed:
                edges[name].append((max(listed, key=total), 1.0))

    runs = dict.fromkeys(module.computations, 0.0)
    if module.entry is None:
        return runs, notes
    runs[module.entry] = 1.0
    for name in _callers_first(module.entry, edges):
        for callee, trips in edges.get(name, []):
            if callee in runs:
                runs[callee] += runs[name] * trips
    return runs, notes


def _callers_first(entry: str, edges: dict[str, list[tuple[str, float]]]) -> list[str]:
    """The computations reachable from the entry, every caller before its callees."""
    order: list[str] = []
    state: dict[str, int] = {}
    stack = [(entry, iter(edges.get(entry, [])))]
    state[entry] = 1
    while stack:
        name, children = stack[-1]
        for callee, _ in children:
            if state.get(callee, 0) == 0 and callee in edges:
                state[callee] = 1
                stack.append((callee, iter(edges.get(callee, []))))
                break
        else:
            stack.pop()
            state[name] = 2
            order.append(name)
    return order[::-1]


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
