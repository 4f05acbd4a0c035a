"""Gopher repetition's n-gram counts (tokenmill.filters.repetition) are datatrove's, number for number."""

from __future__ import annotations

import pytest
from datatrove.data import Document
from datatrove.pipeline.filters.gopher_repetition_filter import (
    GopherRepetitionFilter,
    find_all_duplicate,
    find_top_duplicate,
    get_n_grams,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from test_filters import sample_texts

from tokenmill.filters.heuristics import HeuristicFilter, shared_word_tokenizer
from tokenmill.filters.repetition import PREFIX_CHARS, GopherRepetition, WordNgrams

N_VALUES = range(1, 13)


def assert_datatroves_numbers(words: list[str], n_values: range = N_VALUES, descending: bool = True) -> None:
    ngrams = WordNgrams(words)
    for n in n_values:
        grams = get_n_grams(words, n)
        assert ngrams.top_duplicate_chars(n) == (find_top_duplicate(grams) if grams else None), (n, words)
    for n in n_values:
        assert ngrams.duplicated_chars(n) == find_all_duplicate(words, n), (n, words)
    if not descending:
        return
    backwards = WordNgrams(words)  # a smaller n asked after a larger one recomputes what may repeat
    for n in reversed(n_values):
        assert backwards.duplicated_chars(n) == find_all_duplicate(words, n), (n, words)


def test_the_samples_words_give_datatroves_numbers():
    words = shared_word_tokenizer()
    texts = [document["text"] for document in sample_texts()]
    assert len(texts) > 1000
    for start in range(0, len(texts), 256):
        words.prime(texts[start : start + 256])
        for text in texts[start : start + 256]:
            # datatrove's n, in the filter's order (the generated lists below ask in both orders)
            assert_datatroves_numbers(words.word_tokenize(text), range(2, 11), descending=False)


@pytest.mark.parametrize(
    "words",
    [
        # "".join is not one-to-one: ("ab", "c", ...) and ("a", "bc", ...) are one string, a repeat
        ["ab", "c", "d", "e", "f", "x", "a", "bc", "d", "e", "f"],
        # one-character words: every n-gram is shorter than the prefix that sorts positions out
        list("abababababababababab"),
        # equal prefixes, different n-grams; then the same n-gram after a skipped first sighting
        ["abcdefghijklmnop", "q", "r", "s", "t", "abcdefghijklmnop", "z", "r", "s", "t"] * 3,
        # words with spaces: " ".join is no longer one-to-one (("a b", "c") and ("a", "b c"))
        ["a b", "c", "a", "b c", "a b", "c", "a", "b c"],
        ["x" * 40, "y" * 40] * 20 + ["x" * 40],
        [],
        ["only"],
    ],
)
def test_adversarial_word_lists_give_datatroves_numbers(words):
    assert_datatroves_numbers(words)


def test_the_concatenation_repeat_is_counted():
    words = ["ab", "c", "d", "e", "f", "x", "a", "bc", "d", "e", "f"]
    assert WordNgrams(words).duplicated_chars(5) == len("abcdef") > 0  # no tuple repeats; a string does


#: Words that are prefixes of each other, hold spaces, or are as long as the prefix that sorts positions out
WORDS = st.sampled_from(
    ["a", "ab", "b", "ba", "abc", "c", ".", "a b", "b a", "the", "then", "x" * PREFIX_CHARS]
)


@settings(max_examples=400, deadline=None)
@given(st.lists(WORDS, max_size=60) | st.lists(st.text(alphabet="ab ", min_size=1, max_size=4), max_size=40))
def test_any_word_list_gives_datatroves_numbers(words):
    assert_datatroves_numbers(words)


STORY_WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "."]


def _repetitive_text(draw_words: list[str], lines: list[int]) -> str:
    return "\n".join(" ".join(draw_words[start : start + 7]) for start in lines)


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.sampled_from(STORY_WORDS), min_size=20),
    st.lists(st.integers(0, 15), min_size=1, max_size=12),
    st.sampled_from([{}, {"top_n_grams": ((2, 0.05), (3, 0.04)), "dup_n_grams": ((5, 0.02), (7, 0.01))}]),
)
def test_the_filter_gives_datatroves_verdicts_and_reasons(words, lines, params):
    text = _repetitive_text(words, lines)
    shared = shared_word_tokenizer()
    shared.prime([text])
    shared.focus(text)
    ours = GopherRepetition(language=shared, **params).filter(Document(text=text, id="x"))
    theirs = GopherRepetitionFilter(**params).filter(Document(text=text, id="x"))
    assert ours == theirs


def test_the_step_uses_the_cheaper_counts_only_with_shared_words():
    shared = HeuristicFilter("gopher_repetition", {})
    shared.setup()
    assert type(shared._filter) is GopherRepetition
    alone = HeuristicFilter("gopher_repetition", {}, shared_words=False)
    alone.setup()
    assert type(alone._filter) is GopherRepetitionFilter  # datatrove's own, as the reference
