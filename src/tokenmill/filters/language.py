"""Offline language identification.

Two backends: py3langid (its model ships inside the wheel; the default) and a fastText language-id model
given by a local or gs:// path (for example lid.176.bin, which a deployment stores once and names in its
recipe; nothing here fetches it from the internet). Either model is loaded once per worker process (a
`SharedModel`), and a remote one is downloaded once per machine. Only the first `max_chars` characters are
classified: the language of a page is settled long before its end, and the cost then stays flat per
document.

py3langid's scores are taken in float64 without BLAS (`DeterministicIdentifier`): its own float32 product
goes through OpenBLAS, whose kernel (chosen at run time for the CPU: Haswell, SkylakeX, ...) sums in
another order, so the same text got scores that differ in the last digits from one machine to another
(tests/test_sample_outputs.py checks that they no longer do).
"""

from __future__ import annotations

import math

import numpy as np

from tokenmill import storage
from tokenmill.filters.base import DocumentStep, Removal
from tokenmill.filters.classifiers import load_fasttext
from tokenmill.filters.models import SharedModel

PY3LANGID_MODEL = "py3langid"  # the model inside the py3langid wheel


def load_py3langid(_: str):
    """py3langid's bundled model, with probabilities normalized to [0, 1], scored the same on every CPU."""
    from py3langid.langid import MODEL_FILE

    identifier = _deterministic_identifier().from_model_file(MODEL_FILE, norm_probs=True)
    identifier.prepare()
    return identifier


def _deterministic_identifier():
    """py3langid's LanguageIdentifier, scored in a fixed order and with its byte walk done by numpy."""
    from py3langid.langid import RAW_FLOOR, LanguageIdentifier

    if not callable(getattr(LanguageIdentifier, "_raw_score", None)):
        raise RuntimeError(
            "py3langid's LanguageIdentifier has no _raw_score to override (another py3langid version?): "
            "tokenmill.filters.language needs one that scores through it, as py3langid 0.4 does"
        )

    class DeterministicIdentifier(LanguageIdentifier):
        """py3langid's model and decisions, with the same feature counts taken faster and scored the same
        on every CPU.

        Scores: py3langid takes `log1p(counts) @ table[features]` in float32 through OpenBLAS, whose kernel
        (and so its order of summation) depends on the CPU. Here each feature's row is scaled and the rows
        are added one after another, in the order the features first occur in the text (IEEE products and
        sums, in an order that no SIMD width changes), and log1p is libm's. The softmax that follows then
        runs in float64, where numpy's SIMD exp differs from libm's by an ulp at most: far below the
        float32 that curated/ stores and the 4 decimals of a removal's detail. Cost: one float64 copy of
        the document's feature rows (features x languages).

        Feature counts: py3langid walks its automaton one byte at a time in Python, 1.4 ms for a
        2.4 KB document, more than half of the step. The automaton is Aho-Corasick over byte n-grams (its
        state after a text is the longest suffix of the text that is a node of the n-gram trie), and no
        node is deeper than `window` bytes, so the state after byte i is the state reached from the start
        by the `window` bytes ending at i. numpy takes that walk for every position at once, `window`
        gathers over the whole text (0.15 ms); the counts are the same integers in the same order
        (tests/test_filters.py compares them with py3langid's own walk). With the scores' log1p read from
        a table, the step takes 1.0 ms a document instead of 2.6.
        """

        def prepare(self) -> None:
            """The automaton as numpy arrays (its transitions are not copied) and its window: once per
            model, 0.3 s."""
            self._transitions = np.asarray(self.tk_nextmove)
            self._row_offsets = np.asarray(self.tk_row, dtype=np.int64) << 8
            self._outputs = np.asarray(self.tk_output, dtype=np.int64)
            self._window = _automaton_depth(self._transitions, self._row_offsets)
            self._log1p = np.array([math.log1p(count) for count in range(1 << 16)], dtype=np.float64)

        def _raw_score(self, text: bytes) -> np.ndarray:
            features = self._features(text)
            if features.size == 0:
                fill = 0.0 if self._norm_probs else RAW_FLOOR
                return np.full(len(self.nb_classes), fill, dtype=np.float32)
            present, first, counts = np.unique(features, return_index=True, return_counts=True)
            order = np.argsort(first, kind="stable")
            return self._score(present[order], counts[order])

        def _features(self, text: bytes) -> np.ndarray:
            """The feature of every position that emits one, in text order (py3langid's `visit_counts`)."""
            data = np.frombuffer(text, dtype=np.uint8)
            transitions, row_offsets, window = self._transitions, self._row_offsets, self._window
            states = np.zeros(len(data), dtype=np.int64)
            # Each pass moves every position one byte on: after the pass for `back`, states[i] is the state
            # reached from the start by data[i - window + 1 .. i - back] (clipped at the text's start).
            for back in range(min(window, len(data)) - 1, -1, -1):
                states[back:] = transitions[row_offsets[states[back:]] + data[: len(data) - back]]
            features = self._outputs[states]
            return features[features >= 0]

        def _score(self, features: np.ndarray, counts: np.ndarray) -> np.ndarray:
            if counts.max() < len(self._log1p):
                weights = self._log1p[counts]
            else:
                weights = np.array([math.log1p(count) for count in counts.tolist()], dtype=np.float64)
            rows = self.nb_ptc[features].astype(np.float64)
            rows *= weights[:, None]
            return rows.sum(axis=0) + self.nb_pc

    return DeterministicIdentifier


def _automaton_depth(transitions: np.ndarray, row_offsets: np.ndarray) -> int:
    """How many bytes decide the automaton's state: the depth of its deepest state, breadth first from
    the start (in an Aho-Corasick automaton the shortest input that reaches a state is the state's own
    n-gram). States share transition rows, so each level reads the rows of its states once. py3langid's
    model: 6, over 104,583 states and 38,346 rows, in about 0.3 s."""
    seen = np.zeros(len(row_offsets), dtype=bool)
    seen[0] = True
    frontier = np.zeros(1, dtype=np.int64)
    every_byte = np.arange(256, dtype=np.int64)
    level = 0
    while True:
        rows = np.unique(row_offsets[frontier])
        reached = np.zeros(len(row_offsets), dtype=bool)
        reached[transitions[(rows[:, None] + every_byte).ravel()]] = True
        reached &= ~seen
        if not reached.any():
            return level
        seen |= reached
        frontier = np.flatnonzero(reached)
        level += 1


class LanguageFilter(DocumentStep):
    """Label `language`/`language_score`; remove documents outside `languages` or below `min_score`."""

    stage = "language"

    def __init__(
        self,
        languages: list[str] | None = None,
        min_score: float = 0.5,
        backend: str = "py3langid",
        model_path: str | None = None,
        max_chars: int = 4000,
    ):
        if backend not in ("py3langid", "fasttext"):
            raise ValueError(f"language backend must be py3langid or fasttext, not {backend!r}")
        if backend == "fasttext" and not model_path:
            raise ValueError("language backend fasttext needs model_path (a lid .bin file, local or gs://)")
        if backend == "fasttext" and not storage.exists(model_path):
            raise ValueError(f"language model_path not found: {model_path}")
        self.languages = set(languages) if languages else None
        self.min_score = min_score
        self.backend = backend
        self.model_path = model_path
        self.max_chars = max_chars
        if backend == "py3langid":
            self._shared_model = SharedModel(load_py3langid, PY3LANGID_MODEL)
        else:
            self._shared_model = SharedModel(load_fasttext, model_path)
        self._model = None

    def setup(self) -> None:
        self._model = self._shared_model.get()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_model": None}  # a copy finds the model in its own process

    def identify(self, texts: list[str]) -> list[tuple[str, float]]:
        if self._model is None:
            self.setup()
        heads = [text[: self.max_chars] for text in texts]
        if self.backend == "py3langid":
            return [(language, float(score)) for language, score in map(self._model.classify, heads)]
        labels, scores = self._model.predict([head.replace("\n", " ") for head in heads], k=1)
        return [(label[0].removeprefix("__label__"), float(score[0])) for label, score in zip(labels, scores)]

    def apply(self, documents: list[dict]) -> list[Removal | None]:
        results: list[Removal | None] = []
        for document, (language, score) in zip(documents, self.identify([d["text"] for d in documents])):
            document["language"] = language
            document["language_score"] = score
            if self.languages is not None and language not in self.languages:
                results.append(Removal("language_not_kept", {"language": language, "score": round(score, 4)}))
            elif score < self.min_score:
                results.append(
                    Removal("low_language_score", {"language": language, "score": round(score, 4)})
                )
            else:
                results.append(None)
        return results
