"""The heuristic filters keep exactly what datatrove's filters keep when called directly on the same text."""

from __future__ import annotations

import collections
import copy
import functools
import importlib.util
import json
import math
import subprocess
import sys
import types

import numpy as np
import pyarrow.compute as pc
import pytest
from conftest import SAMPLE
from datatrove.data import Document
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.corpora.readers import read_file
from tokenmill.corpora.records import InputFields
from tokenmill.filters import heuristics
from tokenmill.filters.heuristics import HeuristicFilter, datatrove_filter_class
from tokenmill.filters.language import LanguageFilter
from tokenmill.filters.normalize import Normalize
from tokenmill.formats.documents import curated_dataset, removed_dataset
from tokenmill.pipelines.recipe import RecipeError, build_steps, load_recipe

KINDS = ["gopher_repetition", "gopher_quality", "fineweb_quality", "c4"]


@functools.cache
def _normalized_sample() -> tuple[dict, ...]:
    documents = []
    for path in sorted(SAMPLE.iterdir()):
        documents.extend(r for r in read_file(str(path), InputFields()) if r["kind"] == "document")
    Normalize().apply(documents)
    return tuple(documents)


def sample_texts() -> list[dict]:
    """The sample's documents as curate normalizes them (read and normalized once; each call a fresh copy)."""
    return copy.deepcopy(list(_normalized_sample()))


#: datatrove's verdict, (keep, reason), by (kind, its parameters as JSON, text): datatrove's own splitting
#: of a text is the slow part, and every test here asks the same questions of the same sample texts.
_VERDICTS: dict[tuple[str, str, str], tuple[bool, str | None]] = {}


@functools.cache
def _datatrove_filter(kind: str, params_json: str):
    return datatrove_filter_class(kind)(**json.loads(params_json))


def datatrove_keeps(kind: str, params: dict, text: str) -> tuple[bool, str | None]:
    """What datatrove's filter of this kind, called directly, says of the text."""
    key = (kind, json.dumps(params, sort_keys=True), text)
    if key not in _VERDICTS:
        verdict = _datatrove_filter(*key[:2]).filter(Document(text=text, id="x"))
        _VERDICTS[key] = verdict if isinstance(verdict, tuple) else (verdict, None)
    return _VERDICTS[key]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shared_words", [True, False])
def test_each_filter_matches_datatrove_called_directly(kind, shared_words):
    documents = sample_texts()
    step = HeuristicFilter(kind, {}, shared_words=shared_words)
    step.setup()
    for start in range(0, len(documents), 256):
        batch = documents[start : start + 256]
        verdicts = step.apply(batch)
        for document, removal in zip(batch, verdicts):
            keep, reason = datatrove_keeps(kind, {}, document["text"])
            assert (removal is None) == keep, (document["id"], removal, reason)
            if removal is not None and reason:
                assert removal.reason == reason


def test_c4_edits_do_not_leak_into_the_kept_text():
    text = (
        "This line is long enough and ends well.\n" * 6
    ) + "Accept cookies to continue using javascript here.\n"
    documents = [{"id": "a", "text": text}]
    assert HeuristicFilter("c4", {"min_num_sentences": 1}).apply(documents) == [None]
    assert documents[0]["text"] == text  # datatrove's C4 filter dropped lines in its own copy only


def test_the_curated_sample_is_what_datatrove_keeps(web_sample_run):
    """The whole web recipe through the pipeline against the same rules applied by hand with datatrove."""
    output, _ = web_sample_run  # conftest's curate of the sample with the web recipe, shared
    kept_by_pipeline = set(curated_dataset(str(output / "curated")).to_table().column("id").to_pylist())

    recipe = load_recipe(SAMPLE.parent.parent / "configs" / "curate" / "web.yaml")
    language = LanguageFilter(**recipe.stage_list()[0][1])
    documents = [d for d in sample_texts() if d["text"].strip() and len(d["text"]) <= 1_000_000]
    documents = [d for d, v in zip(documents, language.apply(documents)) if v is None]
    first_copy: dict[str, str] = {}
    for document in sorted(documents, key=lambda d: d["id"]):
        first_copy.setdefault(document["text"], document["id"])
    documents = [d for d in documents if first_copy[d["text"]] == d["id"]]
    expected = set()
    filters = [(kind, params) for kind, params in recipe.stage_list() if kind in KINDS]
    for document in documents:
        if all(datatrove_keeps(kind, params, document["text"])[0] for kind, params in filters):
            expected.add(document["id"])
    # The recipe's fuzzy dedupe removes near copies, which the rules applied here by hand do not.
    near = removed_dataset(str(output / "removed")).to_table(filter=pc.field("stage") == "fuzzy_dedupe")
    near = set(near.column("id").to_pylist())
    assert 0 < len(near) < 50
    assert kept_by_pipeline == expected - near
    assert len(expected) > 100


def test_language_filter_labels_and_removes():
    documents = [
        {"text": "The committee published its annual report on water quality in the northern lakes today."},
        {"text": "Le gouvernement présente un nouveau jardin pour les habitants de la ville."},
    ]
    verdicts = LanguageFilter(languages=["en"], min_score=0.5).apply(documents)
    assert verdicts[0] is None and documents[0]["language"] == "en" and documents[0]["language_score"] > 0.9
    assert verdicts[1].reason == "language_not_kept" and verdicts[1].detail["language"] == "fr"


@functools.cache
def _py3langid() -> types.SimpleNamespace:
    from py3langid.langid import MODEL_FILE, LanguageIdentifier

    from tokenmill.filters.language import load_py3langid

    return types.SimpleNamespace(
        ours=load_py3langid(""), theirs=LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
    )


def _their_counts_and_scores(text: str) -> tuple[dict, np.ndarray]:
    """py3langid's own byte walk, and the scores tokenmill took from it before the walk went to numpy."""
    from py3langid.langid import visit_counts

    model = _py3langid().ours
    encoded = model._encode(text)
    visits = visit_counts(model.tk_nextmove, model._rowbase, model.tk_output, encoded) or {}
    if not visits:
        return visits, np.zeros(len(model.nb_classes), dtype=np.float32)
    rows = model.nb_ptc[np.fromiter(visits.keys(), dtype=np.intp)].astype(np.float64)
    rows *= np.array([math.log1p(count) for count in visits.values()])[:, None]
    return visits, rows.sum(axis=0) + model.nb_pc


def _assert_same_language_features(text: str) -> None:
    model = _py3langid().ours
    visits, scores = _their_counts_and_scores(text)
    encoded = model._encode(text)
    counts = collections.Counter(model._features(encoded).tolist())
    assert list(counts.items()) == list(visits.items()), text[:80]  # same counts, same first-seen order
    assert model._raw_score(encoded).tobytes() == scores.tobytes(), text[:80]


def test_language_features_are_py3langids_own_on_the_sample_and_awkward_text():
    """The numpy walk counts what py3langid's byte-at-a-time walk counts, and scores it bit for bit as
    before; the verdicts are py3langid's."""
    texts = [document["text"][:4000] for document in _normalized_sample()][:400]
    texts += ["", "a", "ab", "abcde", "abcdef", "HELLO WORLD", "ÄÖÜ äöü", "日本語のテキストです"]
    texts += ["\x00\uffff", "x" * 9000]
    for text in texts:
        _assert_same_language_features(text)
    theirs = _py3langid().theirs
    for text in texts[:100]:
        language, score = _py3langid().ours.classify(text)
        their_language, their_score = theirs.classify(text)
        assert language == their_language and score == pytest.approx(their_score, abs=1e-4)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=60) | st.text(alphabet="abc \n.", max_size=60))
def test_language_features_match_py3langid_on_any_text(text):
    _assert_same_language_features(text)


@pytest.mark.slow  # the default suite's 15-minute budget; make test-slow runs it
def test_py3langids_automaton_is_aho_corasick_over_at_most_six_bytes():
    """What the numpy walk rests on, checked on every transition of the shipped model: a state stands
    for its n-gram (the shortest input that reaches it), and each transition goes to the longest suffix
    of that n-gram plus the byte that is itself a state's n-gram. Then the state after a text is the
    longest suffix of the text that is a state's n-gram, which is never longer than the deepest state:
    the bytes before the last `window` do not matter."""
    from tokenmill.filters.language import _automaton_depth

    model = _py3langid().ours
    transitions = np.asarray(model.tk_nextmove).astype(np.int64)
    row_offsets = np.asarray(model.tk_row, dtype=np.int64) << 8
    states = len(row_offsets)
    window = _automaton_depth(transitions, row_offsets)
    assert window == model._window == 6
    # Each state's n-gram, breadth first: value (big-endian bytes) and length.
    value = np.full(states, -1, dtype=np.int64)
    length = np.full(states, -1, dtype=np.int64)
    value[0] = length[0] = 0
    frontier = np.zeros(1, dtype=np.int64)
    every_byte = np.arange(256, dtype=np.int64)
    while frontier.size:
        targets = transitions[row_offsets[frontier][:, None] + every_byte]
        parents = np.broadcast_to(frontier[:, None], targets.shape).ravel()
        symbols = np.broadcast_to(every_byte, targets.shape).ravel()
        targets = targets.ravel()
        new = length[targets] < 0
        targets, first = np.unique(targets[new], return_index=True)
        value[targets] = value[parents[new][first]] * 256 + symbols[new][first]
        length[targets] = length[parents[new][first]] + 1
        frontier = targets
    assert (length >= 0).all() and length.max() == window
    keys = value * 8 + length  # one n-gram, one key
    order = np.argsort(keys)
    sorted_keys = keys[order]
    assert (np.diff(sorted_keys) > 0).all()  # no two states stand for one n-gram
    for byte in range(256):
        extended = value * 256 + byte
        expected = np.full(states, -1, dtype=np.int64)
        for size in range(window + 1, -1, -1):  # the longest suffix that is a state's n-gram wins
            candidate = (extended % (256**size)) * 8 + size
            fits = (length + 1 >= size) & (expected < 0)
            position = np.minimum(np.searchsorted(sorted_keys, candidate), states - 1)
            found = fits & (sorted_keys[position] == candidate)
            expected[found] = order[position[found]]
        assert (transitions[row_offsets + byte] == expected).all(), byte


def test_recipe_errors_name_the_file_and_the_problem(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: r\nstages:\n  - not_a_stage: {}\n")
    with pytest.raises(RecipeError, match=r"r\.yaml: stages: .*unknown stage 'not_a_stage'"):
        load_recipe(path)
    path.write_text("name: r\nstages:\n  - language: {languages: [en], bogus: 1}\n")
    with pytest.raises(RecipeError, match=r"stages\[0\]: bad parameters for language"):
        load_recipe(path)
    path.write_text("name: r\ntarget_file_bytes: lots\n")
    with pytest.raises(RecipeError, match="target_file_bytes"):
        load_recipe(path)
    with pytest.raises(RecipeError, match="recipe not found"):
        load_recipe(tmp_path / "missing.yaml")


def test_recipe_builds_steps_in_order():
    recipe = load_recipe(SAMPLE.parent.parent / "configs" / "curate" / "web.yaml")
    steps = build_steps(recipe)
    names = [step if isinstance(step, str) else step.stage for step in steps]
    assert names == recipe.stage_names()
    assert json.dumps(recipe.model_dump())  # the recipe serializes (it is recorded with the run)


def test_shared_word_splitting_does_not_grow_the_vocabulary_with_the_corpus():
    """Every new token spaCy meets is interned for the life of the worker unless split in a memory zone:
    on web text (URLs, numbers, typos) that is memory growing with the corpus. A worker keeps the strings
    of its first batches (up to `permanent_strings`, so common words hit spaCy's cache) and no more."""
    import random

    from tokenmill.filters.heuristics import SharedWordTokenizer

    words = SharedWordTokenizer("en", permanent_strings=3000)
    strings = words._nlp.vocab.strings
    before = len(strings)
    rng = random.Random(3)
    held = []  # strings held as each batch starts: the last batch's zone has ended by then
    for _ in range(20):
        texts = [
            " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(9)) for _ in range(40))
            for _ in range(50)
        ]
        words.prime(texts)
        held.append(len(strings) - before)
        assert [len(words.word_tokenize(text)) for text in texts] == [40] * 50  # split as asked
    # 40,000 distinct words were split (each adds its form, lowercase, shape, prefix and suffix): the
    # strings of the batches before the bound was crossed stay, no later batch's do.
    assert 3000 <= held[1] == held[-1] < 3000 + 2 * 2000 * 5
    assert len(set(held[1:])) == 1 and not words.permanent()


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed: nothing to hide"
)
def test_spacy_loads_without_importing_torch_and_torch_still_imports_after(tmp_path):
    """thinc imports torch whenever it is installed (2.6 CPU-s of each worker's start); word splitting
    needs none of it. In a fresh process, as in a worker: no torch after spaCy loads, and torch imports
    normally afterwards."""
    script = (
        "import sys\n"
        "from tokenmill.filters.heuristics import shared_word_tokenizer\n"
        "words = shared_word_tokenizer('en')\n"
        "assert words.word_tokenize('Two words.') == ['Two', 'words', '.']\n"
        "assert 'torch' not in sys.modules, 'spaCy imported torch'\n"
        "import thinc.compat\n"
        "assert not thinc.compat.has_torch\n"
        "import torch\n"
        "assert torch.zeros(2).sum().item() == 0.0\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=tmp_path, timeout=120)


def test_spacy_keeps_torch_when_it_was_loaded_first():
    """A process that already uses torch (a training job) keeps thinc's torch support: nothing is hidden."""
    from tokenmill.filters.heuristics import torch_hidden

    marker = object()
    saved = sys.modules.get("torch", marker)
    sys.modules["torch"] = types.ModuleType("torch")
    try:
        with torch_hidden():
            assert sys.modules["torch"] is not None
    finally:
        if saved is marker:
            del sys.modules["torch"]
        else:
            sys.modules["torch"] = saved


def _tricky_texts() -> list[str]:
    return [
        "Hello world.  Next one!\n\n  indented line here... yes? no.\tTab\u00a0nbsp. end",
        'a.b. c. (d.) "e." f\nDr. Smith went. U.S.A. is big! Really?!? Yes.\n\n\n',
        "Lines [1] with citations [edit] stay.\nhttp://example.com/a.b?c=d. Then 3.5 km... ok!",
        "",
        "   \n \t \n",
    ]


def test_sentences_from_the_shared_split_are_spacys_sentencizer_line_by_line():
    """C4 counts the sentences of each kept line; the shared split answers from the document's tokens
    exactly what datatrove's spaCy pipeline gives for the line alone, and for the whole text."""
    from tokenmill.filters.heuristics import SharedWordTokenizer

    texts = [d["text"] for d in sample_texts()] + _tricky_texts()
    words = SharedWordTokenizer("en")
    reference = words._reference
    lines = 0
    previous: list[str] = []
    for start in range(0, len(texts), 256):
        batch = texts[start : start + 256]
        words.prime(batch)
        splits = words.splits
        assert splits == words.splits  # nothing is split before a filter asks
        for text in batch:
            assert words.word_tokenize(text) == reference.word_tokenize(text)
            assert words.span_tokenize(text) == reference.span_tokenize(text)
            words.focus(text)
            for line in text.splitlines():
                if line.strip():
                    lines += 1
                    assert words.span_tokenize(line.strip()) == reference.span_tokenize(line.strip()), line
        # every answer came from one split per distinct text, made when first asked (a text the last
        # batch had is kept from it)
        assert words.splits - splits == len(set(batch) - set(previous))
        previous = batch
    assert lines > 5000


#: Gopher repetition's rules that read lines and paragraphs only: a document they remove needs no words.
LINE_RULES = {"empty", "dup_para_frac", "dup_para_char_frac", "dup_line_frac", "dup_line_char_frac"}


def test_the_whole_chain_splits_each_document_once_and_only_where_a_filter_asks(monkeypatch):
    """Four filters, at most one spaCy split per document (a text repeated within a batch is split once),
    none for a document removed on its lines alone, and datatrove's own split only for a few lines that
    C4 asks about and the document's split does not answer (a line it edited, or one whose whitespace
    spaCy tokenizes apart from the line's words)."""
    documents = sample_texts()
    # A worker-wide tokenizer of its own: one an earlier test primed would still hold that test's last
    # batch, and texts it shares with this test's first batch would not be split again.
    monkeypatch.setattr(heuristics, "_SHARED", {})
    steps = [HeuristicFilter(kind, {}) for kind in KINDS]
    for step in steps:
        step.setup()
    words = steps[0]._words
    assert all(step._words is words for step in steps)
    datatrove_splits = []
    for method in ("word_tokenize", "span_tokenize"):
        original = getattr(words._reference, method)
        monkeypatch.setattr(
            words._reference,
            method,
            lambda text, original=original: datatrove_splits.append(text) or original(text),
        )
    before = words.splits
    asked = 0  # distinct texts of a batch that reached a rule on words, less those the last batch split
    previous: set[str] = set()
    on_lines = 0
    for start in range(0, len(documents), 256):
        batch = documents[start : start + 256]
        for position, step in enumerate(steps):
            verdicts = step.apply(batch)
            if position == 0:
                texts = set()
                for document, verdict in zip(batch, verdicts):
                    if verdict is not None and verdict.reason in LINE_RULES:
                        on_lines += 1
                    else:
                        texts.add(document["text"])
                asked += len(texts - previous)
                previous = texts
            batch = [d for d, verdict in zip(batch, verdicts) if verdict is None]
    assert on_lines > 0  # the sample has documents of repeated lines
    assert words.splits - before - len(datatrove_splits) == asked  # each asked text split once, no other
    assert all("\n" not in text for text in datatrove_splits)  # lines only, never a whole document
    assert len(datatrove_splits) <= len(documents) // 100
    assert len(documents) > len(
        {d["text"] for d in documents}
    )  # the sample repeats texts: split once a batch
