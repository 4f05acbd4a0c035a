"""The keys and the join that every dedupe step shares: a text's exact-duplicate hash, a document's node
in the near-duplicate graph, and the join by id that brings each document together with its decision.

Beam-free and below the dedupe stages (exact_dedupe, fuzzy_dedupe, dedupe_index, dedupe_clusters), so that
each of them can use these without importing another stage.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from tokenmill.corpora.records import DuplicateIdError
from tokenmill.pipelines.sinks import stable_hash

#: Tags of the values of a join by id: the document, and what was decided about it.
DOCUMENT, DECISION = 0, 1
_HASH_DIGITS = 16


def text_hash(text: str) -> str:
    """The 128-bit exact-duplicate key of a normalized text."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def node_key(identifier: str) -> str:
    """A document's node in the graph: the 64-bit stable hash of its id in hex, then the id."""
    return f"{stable_hash(identifier):016x}{identifier}"


def node_id(key: str) -> str:
    """The document id of a node key."""
    return key[_HASH_DIGITS:]


def document_and_decision(
    stage: str, identifier: str, values: Iterable[tuple[int, Any]]
) -> tuple[dict | None, Any]:
    """The values a join by id grouped under one id, tagged DOCUMENT and DECISION: (the document, the
    decision), either None where absent. Two documents with one id fail the run (DuplicateIdError): a
    dedupe stage keeps or removes by id. Memory: the two values of one id."""
    document = decision = None
    for tag, value in values:
        if tag == DOCUMENT:
            if document is not None:
                raise DuplicateIdError(
                    f"{stage}: two documents have the id {identifier!r} (sources "
                    f"{document.get('source')!r} and {value.get('source')!r}); ids must be unique, and "
                    "dedupe keeps or removes by id"
                )
            document = value
        else:
            decision = value
    return document, decision
