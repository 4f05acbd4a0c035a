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

    return _deterministic_identifier().from_model_file(MODEL_FILE, norm_probs=True)


def _deterministic_identifier():
    """py3langid's LanguageIdentifier with its one BLAS call replaced by arithmetic of a fixed order."""
    from py3langid.langid import LanguageIdentifier

    if not callable(getattr(LanguageIdentifier, "_sparse_score", None)):
        raise RuntimeError(
            "py3langid's LanguageIdentifier has no _sparse_score to override (another py3langid version?): "
            "tokenmill.filters.language needs one that scores through it, as py3langid 0.4 does"
        )

    class DeterministicIdentifier(LanguageIdentifier):
        """Naive Bayes scores in float64 without BLAS: the same bits on every CPU.

        py3langid takes `log1p(counts) @ table[features]` in float32 through OpenBLAS, whose kernel (and so
        its order of summation) depends on the CPU. Here each feature's row is scaled and the rows are
        added one after another (IEEE products and sums, in an order that no SIMD width changes), and
        log1p is libm's. The softmax that follows then runs in float64, where numpy's SIMD exp differs
        from libm's by an ulp at most: far below the float32 that curated/ stores and the 4 decimals of a
        removal's detail. Cost: one float64 copy of the document's feature rows (features x languages).
        """

        def _sparse_score(self, visits, table):
            features = np.fromiter(visits.keys(), dtype=np.intp, count=len(visits))
            weights = np.array([math.log1p(count) for count in visits.values()], dtype=np.float64)
            rows = table[features].astype(np.float64)
            rows *= weights[:, None]
            return rows.sum(axis=0) + self.nb_pc

    return DeterministicIdentifier


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
