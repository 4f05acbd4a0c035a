"""Decontamination against evaluation sets: the index and the `decontam` curation stage.

Training on the test set makes every published number worthless, so curation flags or removes documents
that hold evaluation records, including records copied with light edits (case, punctuation, a word or two
changed). docs/decontam.md explains the choices and shows the measured trade-off. One module per job,
each importing only those above it in this list:

* `hashing`: normalization and vectorized word and window hashes;
* `eval_sets`: evaluation sets read from JSON Lines, JSON and Parquet in the common benchmark layouts;
* `index`: the index file (anchors, record words, short-record hashes) and `build_index`;
* `matching`: candidate alignments from anchors, verified word by word (coverage);
* `stage`: the `Decontaminate` step (recipe stage `decontam`), its annotation and per-set counts.

`tokenmill decontam index` (tokenmill.filters.commands) builds the index.
"""

from tokenmill.filters.decontam.eval_sets import (
    LAYOUTS,
    DecontamError,
    EvalSet,
    EvalSetSource,
    FieldSpec,
    eval_set_sources,
    load_sets_file,
    read_eval_set,
    read_eval_sets,
)
from tokenmill.filters.decontam.hashing import (
    extract_ngrams,
    hash_words,
    normalize_for_matching,
    text_hash,
    window_hashes,
)
from tokenmill.filters.decontam.index import (
    FORMAT_VERSION,
    DecontamIndex,
    build_index,
    load_index,
    read_index_header,
)
from tokenmill.filters.decontam.matching import Matcher
from tokenmill.filters.decontam.stage import Decontaminate
from tokenmill.formats.documents import split_paragraphs

__all__ = [
    "FORMAT_VERSION",
    "LAYOUTS",
    "DecontamError",
    "DecontamIndex",
    "Decontaminate",
    "EvalSet",
    "EvalSetSource",
    "FieldSpec",
    "Matcher",
    "build_index",
    "eval_set_sources",
    "extract_ngrams",
    "hash_words",
    "load_index",
    "load_sets_file",
    "normalize_for_matching",
    "read_eval_set",
    "read_eval_sets",
    "read_index_header",
    "split_paragraphs",
    "text_hash",
    "window_hashes",
]
