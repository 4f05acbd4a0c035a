"""datatrove's heuristic filters (Gopher quality, Gopher repetition, C4, FineWeb quality), used as they are.

Each filter runs as its own step, on a fresh datatrove `Document` per document: C4's filter rewrites the
text it is given (it drops lines), and that rewrite must not leak into the next filter or into what is
kept. Filters decide; they do not edit. The kept text is the normalized input text.

Word splitting dominates the cost of these filters. datatrove splits a text with a full spaCy pipeline
(tokenizer plus sentencizer) inside a memory zone per call; a five-entry cache spares a second split only
while one document passes through every filter before the next. Here every filter of a worker
shares one `SharedWordTokenizer`: the first filter to see a batch splits every text in it once, with
spaCy's tokenizer alone (same tokens: the sentencizer only marks sentence starts), and later filters hit
the cache. datatrove accepts a `WordTokenizer` in place of a language code, so its filters stay
unmodified and give identical results; the tests compare against datatrove called directly.

Nothing downloads: these four filters need only spaCy's blank English pipeline, which ships with spaCy.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from datatrove.data import Document
from datatrove.utils.word_tokenizers import SpaCyTokenizer, WordTokenizer, load_word_tokenizer, strip_strings

from tokenmill.filters.base import DocumentStep, Removal

FILTER_CLASSES = {
    "gopher_quality": "datatrove.pipeline.filters.gopher_quality_filter.GopherQualityFilter",
    "gopher_repetition": "datatrove.pipeline.filters.gopher_repetition_filter.GopherRepetitionFilter",
    "c4": "datatrove.pipeline.filters.c4_filters.C4QualityFilter",
    "fineweb_quality": "datatrove.pipeline.filters.fineweb_quality_filter.FineWebQualityFilter",
}


def datatrove_filter_class(kind: str) -> type:
    import importlib

    if kind not in FILTER_CLASSES:
        raise ValueError(f"unknown heuristic filter {kind!r}; known: {', '.join(sorted(FILTER_CLASSES))}")
    module_name, class_name = FILTER_CLASSES[kind].rsplit(".", 1)
    return getattr(importlib.import_module(module_name), class_name)


class SharedWordTokenizer(WordTokenizer):
    """datatrove's spaCy word splitting, computed once per text and shared by every filter of a worker.

    `prime(texts)` splits a whole batch up front; `word_tokenize` answers from the cache and falls back to
    datatrove's own tokenizer for any text it has not seen. Sentence spans (C4's sentence count) are
    delegated to datatrove's tokenizer and cached the same way.
    """

    def __init__(self, language: str = "en", cache_size: int = 64):
        super().__init__(language)
        self.cache_size = cache_size  # for texts met outside prime(); a primed batch is always held whole
        self._reference = load_word_tokenizer(language)
        if not isinstance(self._reference, SpaCyTokenizer):
            raise ValueError(
                f"shared word splitting supports spaCy languages; {language!r} uses "
                f"{type(self._reference).__name__}"
            )
        self._words: OrderedDict[str, list[str]] = OrderedDict()
        self._spans: OrderedDict[str, list[tuple[int, int]]] = OrderedDict()

    def _remember(self, cache: OrderedDict, text: str, value: Any) -> None:
        cache[text] = value
        if len(cache) > self.cache_size:
            cache.popitem(last=False)

    def prime(self, texts: list[str]) -> None:
        """Split a batch up front. The cache then holds exactly this batch, so memory stays one batch."""
        missing = [text for text in dict.fromkeys(texts) if text not in self._words]
        if not missing:
            return
        kept = {text: self._words[text] for text in texts if text in self._words}
        self._words = OrderedDict(kept)
        self._spans.clear()
        nlp = self._reference.tokenizer  # datatrove's blank spaCy pipeline
        # spaCy interns every new token string in the vocabulary for the life of the process; on web text
        # (every URL, number and typo a new string) that grows a worker's memory with the corpus. Inside a
        # memory zone the strings of this batch are released when it ends; the words are copied out first.
        with nlp.memory_zone():
            try:
                docs = list(nlp.tokenizer.pipe(missing))
            except Exception:
                return  # let word_tokenize fall back to datatrove, which knows spaCy's quirks
            for text, doc in zip(missing, docs):
                self._words[text] = strip_strings([token.text for token in doc])

    def word_tokenize(self, text: str) -> list[str]:
        words = self._words.get(text)
        if words is None:
            words = self._reference.word_tokenize(text)
            self._remember(self._words, text, words)
        return words

    def sent_tokenize(self, text: str) -> list[str]:
        return self._reference.sent_tokenize(text)

    def span_tokenize(self, text: str) -> list[tuple[int, int]]:
        spans = self._spans.get(text)
        if spans is None:
            spans = self._reference.span_tokenize(text)
            self._remember(self._spans, text, spans)
        return spans


_SHARED: dict[str, SharedWordTokenizer] = {}


def shared_word_tokenizer(language: str = "en") -> SharedWordTokenizer:
    """The worker-wide tokenizer for `language` (one per process, so that all filters share its cache)."""
    if language not in _SHARED:
        _SHARED[language] = SharedWordTokenizer(language)
    return _SHARED[language]


class HeuristicFilter(DocumentStep):
    """One datatrove heuristic filter; `params` are its constructor arguments, as datatrove names them."""

    def __init__(
        self, kind: str, params: dict | None = None, language: str = "en", shared_words: bool = True
    ):
        datatrove_filter_class(kind)  # fail at recipe load, not on a worker
        self.kind = kind
        self.stage = kind
        self.params = dict(params or {})
        self.language = language
        self.shared_words = shared_words
        self._filter = None
        self._words: SharedWordTokenizer | None = None

    def setup(self) -> None:
        language: str | WordTokenizer = self.language
        if self.shared_words:
            self._words = shared_word_tokenizer(self.language)
            language = self._words
        self._filter = datatrove_filter_class(self.kind)(language=language, **self.params)

    def apply(self, documents: list[dict]) -> list[Removal | None]:
        if self._filter is None:
            self.setup()
        if self._words is not None:
            self._words.prime([document["text"] for document in documents])
        results: list[Removal | None] = []
        for document in documents:
            fresh = Document(text=document["text"], id=document["id"], metadata={})
            verdict = self._filter.filter(fresh)
            keep, reason = verdict if isinstance(verdict, tuple) else (verdict, None)
            results.append(None if keep else Removal(reason or self.kind, {"filter": self.kind}))
        return results
