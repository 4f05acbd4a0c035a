"""Reading XLA's HLO text: a compiled program's computations and instructions, their shapes, where each op
came from in the model code, and how many times one run of the program runs each computation (while loops
by their trip counts, nested loops multiplied, a conditional by its heaviest branch).

One parser for everything tokenmill reads from a compiled step: the matmul FLOPs per loop trip
(model/flops.py, `xla_flops`) and the bytes each collective moves (run/collectives.py). It reads the text
`compiled.as_text()` prints after XLA's optimisations.

Memory: the parse holds every instruction of the module, a few times the HLO text (14 MB of text for the
535B's step, read in about 2 s); nothing else grows with the model.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

#: Bytes per element of each HLO element type.
DTYPE_BYTES = {
    "pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
    "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 0.5, "u4": 0.5, "s2": 0.25, "u2": 0.25,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3b11fnuz": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1,
    "f8e3m4": 1, "f8e8m0fnu": 1, "f4e2m1fn": 0.5, "token": 0,
}  # fmt: skip


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
    shape, rest = split_shape(value)
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


def split_shape(value: str) -> tuple[str, str]:
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


# --- loops and how often each computation runs ----------------------------------------------------------


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


def multiplicities(
    module: HloModule, weight: Callable[[str], float], per_trip: bool = True
) -> tuple[dict[str, float], dict]:
    """How many times one run of the entry runs each computation: while bodies x their trips (once each
    with `per_trip` False, as XLA's cost analysis counts them), the branch of each conditional that
    `weight` (a computation's own cost, callees included) says is the heaviest, every other callee once.
    Returns (name -> runs, notes on what could not be read)."""
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
                trips = loop.trips if loop.trips is not None and per_trip else 1
                edges[computation.name].append((loop.body, float(trips)))
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


def dot_flops(module: HloModule) -> dict[str, float]:
    """The FLOPs of each computation's own dot instructions: 2 x output elements x contracted size."""
    flops = dict.fromkeys(module.computations, 0.0)
    for computation in module.computations.values():
        for instruction in computation.instructions.values():
            if instruction.opcode != "dot" or not instruction.operands:
                continue
            lhs = computation.instructions.get(instruction.operands[0])
            contracting = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", instruction.attributes)
            output, lhs_arrays = array_shapes(instruction.shape), array_shapes(lhs.shape) if lhs else []
            if not output or not lhs_arrays or not contracting:
                continue
            lhs_dims = lhs_arrays[0][1]
            contracted = math.prod(lhs_dims[int(d)] for d in contracting.group(1).split(",") if d)
            flops[computation.name] += 2.0 * math.prod(output[0][1]) * contracted
    return flops
