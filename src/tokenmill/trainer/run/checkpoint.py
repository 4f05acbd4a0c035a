"""Orbax checkpoints of the whole train state: step, parameters, optimizer state and router bias, and the
record of what they were trained on.

Saves are asynchronous (training continues while the arrays are written) and atomic (a checkpoint that was
interrupted mid-write is never listed), and only the newest `keep` are kept. Next to the arrays each
checkpoint stores a small JSON record: the phase it belongs to, the global step, the tokens and FLOPs
trained, and the run's identity (`run_identity`): the hashes of the mixture plan and of the model shape,
the seed, the tokenizer's hash, the batch, the mesh and the process count. The data source is a pure
function of (plan, seed, step), so resuming needs only the step, as long as the plan and seed are the ones
the checkpoint was trained with: `identity_changes` says what differs, and the training loop refuses to
resume across a change unless told to (`--allow-data-change`). The mesh and the process count may change
freely (orbax reshards; every process's rows are a function of the global step).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from tokenmill.formats.plan import MixturePlan
from tokenmill.trainer.model.shape import ModelConfig
from tokenmill.trainer.run.config import ResolvedRun

log = logging.getLogger(__name__)

# Plan fields that label a plan without changing the batch any step reads.
PLAN_LABELS = ("name", "description", "warnings", "provenance")
# Model fields that change how a step is computed, or what the shape is called, but not the model trained:
# a resume across them is logged, not refused.
MODEL_EXECUTION = ("name", "reference_run", "remat", "moe.expert_parallel")


STRUCTURE_MISMATCH = ("structure mismatch", "tree structures do not match")


class CheckpointLayoutError(ValueError):
    """A checkpoint's arrays are not laid out as the train state this run builds."""


class Checkpointer:
    """A thin wrapper over orbax's CheckpointManager for one run's checkpoints/ directory."""

    def __init__(
        self, directory: str | Path, keep: int = 3, async_save: bool = True, read_only: bool = False
    ):
        # gs:// stays a URL (orbax writes and reads it through etils' epath); a local path is made absolute.
        remote = "://" in str(directory)
        self.directory = epath.Path(str(directory)) if remote else Path(directory).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=not read_only,
            read_only=read_only,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options)

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start writing the state after `step` updates; returns before the write finishes."""
        self.manager.save(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
            force=True,
        )

    def read_meta(self, step: int) -> dict:
        """The JSON record saved with the checkpoint at `step`, without reading its arrays."""
        restored = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
        return dict(restored["meta"])

    def restore(self, step: int, target: Any) -> tuple[Any, dict]:
        """The state saved at `step`, laid out like `target` (ShapeDtypeStructs with shardings); its meta.

        A checkpoint whose arrays are laid out otherwise (another optimizer, or a state layout of an
        earlier tokenmill) raises CheckpointLayoutError naming the checkpoint and the first difference."""
        try:
            restored = self.manager.restore(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
            )
        except ValueError as error:
            # orbax's two wordings of it, from its two restore paths
            if not any(words in str(error).lower() for words in STRUCTURE_MISMATCH):
                raise
            if isinstance(target, dict) and "guard" in target:
                # Saved before the train state had the guard's window (run/guard.py): the rest, and an
                # empty window, which is what a fresh guard starts from.
                try:
                    state, meta = self.restore(step, {k: v for k, v in target.items() if k != "guard"})
                except CheckpointLayoutError:
                    pass
                else:
                    log.warning("%s has no guard window (saved before it existed): starting an empty one",
                                self.path(step))  # fmt: skip
                    empty = jax.tree.map(
                        lambda leaf: jax.device_put(np.zeros(leaf.shape, leaf.dtype), leaf.sharding),
                        target["guard"],
                    )
                    return {**state, "guard": empty}, meta
            raise CheckpointLayoutError(
                f"checkpoint {self.path(step)} holds a train state laid out otherwise than this run's "
                f"(another optimizer, or saved by an earlier tokenmill whose layout changed since): "
                f"{str(error)[:500]}. It cannot be resumed or continued from as it is: train into a new "
                "--output with the optimizer it was saved with, or start afresh."
            ) from error
        return restored["state"], dict(restored["meta"])

    def saving(self) -> bool:
        """Whether a save started is still being written."""
        return self.manager.is_saving_in_progress()

    def delete(self, step: int) -> None:
        """Remove the checkpoint at `step` (a rollback's abandoned ones)."""
        self.manager.delete(step)

    def path(self, step: int) -> Path | epath.Path:
        return self.directory / str(step)

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def canonical_sha256(value: Any) -> str:
    """sha256 of a JSON value written canonically (sorted keys, no spaces): equal values, equal hashes."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def _without(record: Mapping[str, Any], dotted: tuple[str, ...]) -> dict[str, Any]:
    """A copy of a nested record with the dotted keys left out."""
    record = json.loads(json.dumps(record, default=str))
    for path in dotted:
        node, *rest = path.split(".")
        target = record
        while rest and isinstance(target.get(node), dict):
            target, node, rest = target[node], rest[0], rest[1:]
        if not rest:
            target.pop(node, None)
    return record


def plan_sha256(plan: MixturePlan | None) -> str | None:
    """The hash of what a plan makes the batches of: everything but its labels (PLAN_LABELS)."""
    return None if plan is None else plan_sha256_of(plan.to_json())


def plan_sha256_of(plan: Mapping[str, Any]) -> str:
    """plan_sha256 of a plan as JSON (as config.json records it)."""
    return canonical_sha256(_without(plan, PLAN_LABELS))


def model_record(model: ModelConfig) -> dict[str, Any]:
    """The model shape as the checkpoint records it and hashes it: execution-only fields left out."""
    return _without(model.model_dump(mode="json"), MODEL_EXECUTION)


def run_identity(run: ResolvedRun, mesh: Mapping[str, int], processes: int) -> dict[str, Any]:
    """What a checkpoint is the state of: the plan, seed, tokenizer, model and batch (checked on resume),
    and the mesh and process count (logged when they change)."""
    model = model_record(run.model)
    plan, run = run.plan, run.config
    return {
        "plan_sha256": plan_sha256(plan),
        "seed": run.seed,
        "tokenizer_sha256": run.data.tokenizer_sha256,
        "model_sha256": canonical_sha256(model),
        "model": model,
        "batch_size": run.data.batch_size,
        "sequence_length": run.data.sequence_length,
        "mesh": dict(mesh),
        "processes": processes,
    }


@dataclass(frozen=True)
class Change:
    """One way the run being resumed differs from its checkpoint: `what` changed from `old` to `new`."""

    what: str
    old: Any
    new: Any
    detail: str = ""

    def __str__(self) -> str:
        text = f"{self.what} {_short(self.old)} -> {_short(self.new)}"
        return f"{text} ({self.detail})" if self.detail else text


def _short(value: Any, width: int = 60) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:12]  # a sha256: its first 12 digits name it
    return text if len(text) <= width else text[: width - 3] + "..."


def differences(old: Any, new: Any, path: str = "", limit: int = 6) -> list[str]:
    """'path: old -> new' for each leaf that differs between two JSON values (list items that are
    objects with a name are addressed by it: phases[pretraining].sources[web].weight); at most `limit`."""
    found: list[str] = []

    def walk(a: Any, b: Any, where: str) -> None:
        if len(found) > limit or a == b:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for key in [*a, *(k for k in b if k not in a)]:
                walk(a.get(key), b.get(key), f"{where}.{key}" if where else str(key))
            return
        if isinstance(a, list) and isinstance(b, list):
            named_a, named_b = _by_name(a), _by_name(b)
            if named_a is not None and named_b is not None:
                # Named items (phases, sources) are matched by name: a reordering is no change.
                for name in [*named_a, *(n for n in named_b if n not in named_a)]:
                    walk(named_a.get(name), named_b.get(name), f"{where}[{name}]")
                return
            if len(a) == len(b):
                for index, (x, y) in enumerate(zip(a, b, strict=True)):
                    walk(x, y, f"{where}[{index}]")
                return
        found.append(f"{where or 'value'}: {_short(a, 40)} -> {_short(b, 40)}")

    walk(old, new, path)
    if len(found) > limit:
        found = [*found[:limit], "..."]
    return found


def _by_name(items: list) -> dict[str, Any] | None:
    """A list of objects by their unique `name`s; None if it is not one."""
    names = [item.get("name") if isinstance(item, dict) else None for item in items]
    if not items or None in names or len(set(names)) != len(names):
        return None
    return dict(zip(names, items, strict=True))


def identity_changes(
    saved: Mapping[str, Any],
    current: Mapping[str, Any],
    saved_plan: Mapping[str, Any] | None = None,
    current_plan: Mapping[str, Any] | None = None,
) -> tuple[list[Change], list[Change]]:
    """(changes that make the resumed steps train on other data or another model, changes that do not:
    mesh, processes, execution-only model fields). A record from before identities were kept (no
    `seed`) gives nothing to compare. saved_plan / current_plan, when known, name what changed in the plan."""
    refused: list[Change] = []
    allowed: list[Change] = []
    if "seed" not in saved:
        return refused, allowed
    if saved.get("plan_sha256") != current.get("plan_sha256"):
        detail = ""
        if saved_plan is not None and current_plan is not None:
            found = differences(_without(saved_plan, PLAN_LABELS), _without(current_plan, PLAN_LABELS))
            detail = "; ".join(found) or "the same phases and sources in another order"
        old, new = saved.get("plan_sha256"), current.get("plan_sha256")
        refused.append(Change("plan", old or "none (synthetic data)", new or "none (synthetic data)", detail))
    for key, what in (("seed", "seed"), ("tokenizer_sha256", "tokenizer"), ("batch_size", "batch size"),
                      ("sequence_length", "sequence length")):  # fmt: skip
        if saved.get(key) != current.get(key):
            refused.append(Change(what, saved.get(key), current.get(key)))
    if saved.get("model_sha256") != current.get("model_sha256"):
        old_model, new_model = _filled_model(saved.get("model")), _filled_model(current.get("model"))
        if old_model is None or old_model != new_model:
            detail = "; ".join(differences(saved.get("model"), current.get("model"), "model"))
            refused.append(Change("model", saved.get("model_sha256"), current.get("model_sha256"), detail))
        else:
            # Only fields a later release added, at their defaults: the same model.
            allowed.append(Change("model record", saved.get("model_sha256"), current.get("model_sha256")))
    for key in ("mesh", "processes"):
        if key in saved and saved.get(key) != current.get(key):
            allowed.append(Change(key, saved.get(key), current.get(key)))
    return refused, allowed


def _filled_model(record: Any) -> dict[str, Any] | None:
    """A recorded model shape with the fields it lacks at their defaults (a record from an older release),
    None if it is no longer a valid shape."""
    if not isinstance(record, dict):
        return None
    try:
        return model_record(ModelConfig.model_validate({"name": "recorded", **record}))
    except ValueError:
        return None
