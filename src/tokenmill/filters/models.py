"""Read-only models shared by every step instance of a worker process: loaded once per process.

A runner makes many instances of one DoFn in a worker process: Beam's SDK harness one per thread and
again after a failed bundle, the Dask runner one per task. Each would load its own copy of a fastText
model, a language-id model or a decontamination index (hundreds of MB to a few GB). A `SharedModel` is
made by the step's constructor, so every pickled copy of the step carries the same
`apache_beam.utils.shared.Shared` handle: the first copy that calls `get()` in a process loads the model
and every later copy in that process receives the same object.

Shared holds weak references, so a model lives while some step instance holds it; `get()` keeps a strong
reference in the instance that called it (dropped when the step is pickled). Remote paths (gs://...) are
read through `tokenmill.storage.local_copy`, which downloads a file once per machine.

Memory: one copy per worker process and model, whatever the number of threads, DoFn instances or
bundles; at 1,000 workers, 1,000 copies, each loaded once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

from tokenmill.filters.base import DocumentStep

Model = TypeVar("Model")


class _Held:
    """A box that accepts weak references: Shared keeps only weak ones, and not every model type does
    (a numpy array does, a dict does not)."""

    __slots__ = ("__weakref__", "model")

    def __init__(self, model: Any):
        self.model = model


class SharedModel(Generic[Model]):
    """A handle to `loader(path)`, loaded at most once per worker process however often it is pickled.

    `loader` must pickle by reference (a module-level function), as the handle travels with the step.
    """

    def __init__(self, loader: Callable[[str], Model], path: str):
        from apache_beam.utils.shared import Shared  # Beam is imported only by steps that load models

        self.loader = loader
        self.path = path
        self._handle = Shared()
        self._held: _Held | None = None

    def get(self) -> Model:
        """The model: loaded by the first caller in this process, the same object for every later one."""
        if self._held is None:
            # The tag reloads the model if two handles ever shared a key with different paths.
            self._held = self._handle.acquire(lambda: _Held(self.loader(self.path)), tag=self.path)
        return self._held.model

    def __getstate__(self) -> dict:
        # The loaded model never travels: a copy loads (or finds) it in its own process.
        return {"loader": self.loader, "path": self.path, "_handle": self._handle, "_held": None}


class SharedModelStep(DocumentStep):
    """A step that applies a model held through `self._shared_model` (a SharedModel): `setup` takes the
    worker process's copy, and a pickled step travels without it, finding the model again in its process."""

    _shared_model: SharedModel
    _model: Any = None

    def setup(self) -> None:
        self._model = self._shared_model.get()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_model": None}
