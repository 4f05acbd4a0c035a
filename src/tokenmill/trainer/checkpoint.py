"""Orbax checkpoints of the whole train state: step, parameters, optimizer state and router bias.

Saves are asynchronous (training continues while the arrays are written) and atomic (a checkpoint that was
interrupted mid-write is never listed), and only the newest `keep` are kept. Next to the arrays each
checkpoint stores a small JSON record: the phase it belongs to and the global step, which is all that
resuming needs, since the data source is a pure function of the step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orbax.checkpoint as ocp


class Checkpointer:
    """A thin wrapper over orbax's CheckpointManager for one run's checkpoints/ directory."""

    def __init__(
        self, directory: str | Path, keep: int = 3, async_save: bool = True, read_only: bool = False
    ):
        self.directory = Path(directory).absolute()
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

    def restore(self, step: int, target: Any) -> tuple[Any, dict]:
        """The state saved at `step`, laid out like `target` (ShapeDtypeStructs with shardings); its meta."""
        restored = self.manager.restore(
            step,
            args=ocp.args.Composite(state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore()),
        )
        return restored["state"], dict(restored["meta"])

    def path(self, step: int) -> Path:
        return self.directory / str(step)

    def wait(self) -> None:
        """Block until every started save is on disk."""
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
