"""Offline language identification.

Two backends, both local: py3langid (its model ships inside the wheel; the default) and a fastText
language-id model given by path (for example lid.176.bin, which a deployment downloads once and names
in its recipe; nothing here fetches it). Only the first `max_chars` characters are classified: the
language of a page is settled long before its end, and the cost then stays flat per document.
"""

from __future__ import annotations

from tokenmill.filters.base import DocumentStep, Removal


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
            raise ValueError("language backend fasttext needs model_path (a local lid .bin file)")
        self.languages = set(languages) if languages else None
        self.min_score = min_score
        self.backend = backend
        self.model_path = model_path
        self.max_chars = max_chars
        self._model = None

    def setup(self) -> None:
        if self.backend == "py3langid":
            from py3langid.langid import MODEL_FILE, LanguageIdentifier

            self._model = LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
        else:
            import fasttext

            self._model = fasttext.load_model(self.model_path)

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
