"""Tokenizers, the token shard writer and reader, and the token-count catalog.

`TokenShards` (one cell, memory-mapped), `TokenCatalog` (all cells, through tokens/counts.json) and
`EvalShards` (an evaluation set: a cell's held-out slice or an external set, with its documents' UTF-8
bytes) are the readers the trainer and the reports use; they are imported lazily so that
`tokenmill --help` stays quick.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EvalShards", "ShardChecksumError", "ShardError", "TokenCatalog", "TokenShards"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from tokenmill.tokenize import shards

        return getattr(shards, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
