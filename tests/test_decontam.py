"""Decontamination: the evaluation-set index, the `decontam` curate stage and `tokenmill decontam index`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from conftest import SAMPLE

from tokenmill.cli import main
from tokenmill.filters.decontam import (
    FORMAT_VERSION,
    DecontamError,
    Decontaminate,
    DecontamIndex,
    FieldSpec,
    build_index,
    eval_set_sources,
    extract_ngrams,
    hash_words,
    normalize_for_matching,
    read_eval_sets,
    read_index_header,
    split_paragraphs,
    text_hash,
    window_hashes,
)
from tokenmill.pipelines.recipe import RecipeError, load_recipe

# A reading-comprehension-like set: long questions, short answers.
SCIENCE = [
    (
        "Which gas do green plants take in from the air during photosynthesis so that they can build sugars "
        "and starches for growth?",
        "Carbon dioxide",
    ),
    (
        "When a ball is thrown straight up into the air and reaches the highest point of its path, what is "
        "its vertical velocity at that exact moment?",
        "Zero",
    ),
    (
        "A student places a thermometer in a glass of ice water and records the temperature every minute "
        "while the ice melts; what does the reading do?",
        "It stays near zero degrees until the ice is gone",
    ),
    (
        "Which layer of the atmosphere contains the ozone that absorbs most of the ultraviolet radiation "
        "coming from the sun before it reaches the surface?",
        "The stratosphere",
    ),
    (
        "Why does a metal spoon left in a pot of hot soup feel hotter to the touch than a wooden spoon left "
        "in the same pot for the same time?",
        "Metal conducts heat better than wood",
    ),
    (
        "What happens to the volume of a fixed amount of gas in a sealed flexible container when its "
        "temperature rises while the pressure stays the same?",
        "The volume increases",
    ),
]
# A word-problem set that shares a long prompt template (the n-grams of the template are dropped).
TEMPLATE = "Read the problem carefully and give the final answer as a single number with no units at all."
MATH = [
    (
        f"{TEMPLATE} {name} has {a} marbles and buys {b} more bags with {c} marbles in each bag at the shop. "
        f"How many marbles does {name} have now?",
        str(a + b * c),
    )
    for name, a, b, c in [
        ("Maria", 12, 3, 5),
        ("Tomas", 7, 4, 6),
        ("Aiko", 30, 2, 9),
        ("Femi", 5, 8, 3),
        ("Lena", 18, 5, 4),
        ("Ravi", 9, 6, 7),
        ("Sofia", 21, 3, 8),
        ("Kwame", 14, 7, 2),
        ("Ines", 3, 9, 5),
        ("Omar", 25, 4, 4),
        ("Yuki", 16, 2, 11),
        ("Priya", 8, 5, 9),
    ]
]
# Short items: fewer than 13 words with the answer, matched whole.
TRIVIA = [
    ("Which planet in our solar system has the most moons?", "Saturn"),
    ("Who painted the ceiling of the Sistine Chapel?", "Michelangelo"),
    ("What is the chemical symbol for gold?", "Au"),
    ("How many bones are in the adult human body?", "206"),
    ("Yes?", "No"),  # two words: under min_words, skipped and counted
]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def clean_documents() -> list[str]:
    """Documentation prose from the bundled sample: text that must not be flagged."""
    texts = []
    for line in (SAMPLE / "web-002.jsonl").read_bytes().splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(record.get("text"), str) and len(record["text"].split()) >= 20:
            texts.append(record["text"])
    return texts


@pytest.fixture(scope="module")
def evals(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("evals")
    write_jsonl(folder / "science.jsonl", [{"question": q, "answer": a} for q, a in SCIENCE])
    write_jsonl(folder / "math.jsonl", [{"problem": q, "solution": {"final": a}} for q, a in MATH])
    write_jsonl(folder / "trivia.jsonl", [{"question": q, "answer": a} for q, a in TRIVIA])
    return folder


@pytest.fixture(scope="module")
def index_path(evals) -> Path:
    path = evals / "decontam.index"
    assert (
        main(
            [
                "decontam",
                "index",
                "--evals",
                str(evals / "*.jsonl"),
                "--output",
                str(path),
                "--set-fields",
                "math=problem,solution.final",
            ]
        )
        == 0
    )
    return path


@pytest.fixture(scope="module")
def step(index_path) -> Decontaminate:
    step = Decontaminate(str(index_path), action="flag")
    step.setup()
    return step


def judge(step: Decontaminate, texts: list[str]) -> list[dict | None]:
    """The `contamination` annotation of each text (None when it passed)."""
    documents = [{"text": text, "metadata": json.dumps({"kept": "yes"})} for text in texts]
    assert step.apply(documents) == [None] * len(texts)  # flag mode keeps everything
    return [json.loads(document["metadata"]).get("contamination") for document in documents]


def test_normalization_ignores_case_punctuation_and_spacing():
    assert normalize_for_matching("  Hello,   WORLD!\n\nIt's -- 3.5 °C_x ") == "hello world it s 3 5 c x"
    assert normalize_for_matching("Cafe\u0301 naïve") == "café naïve"  # NFC first
    assert normalize_for_matching("...") == ""


def test_window_hashes_are_positional_and_stable():
    words, counts = hash_words(["a b c d e f", "c d e"])
    assert counts.tolist() == [6, 3]
    windows = window_hashes(words, 3)
    # The same three words hash alike wherever they are, and like the whole text "c d e".
    assert windows[2] == windows[6] == text_hash("c d e")
    assert len(set(windows[:4].tolist())) == 4
    # Pinned: an index built on one machine must match documents on another.
    assert text_hash("the quick brown fox") == 11735024277982860500
    assert [len(h) for h in extract_ngrams(["one two three", "", "a b c d e"], n=3)] == [1, 0, 3]


def test_planted_cases_are_found_and_clean_documents_pass(step):
    clean = clean_documents()
    assert len(clean) > 100
    page = clean[0]
    page_paragraphs = len(split_paragraphs(page))
    long_paragraph = " ".join(clean[1:4]).replace("\n", " ")
    middle = len(long_paragraph) // 2
    middle = long_paragraph.index(". ", middle) + 2
    q, a = SCIENCE[0]
    # Upper case, other punctuation, one word changed.
    edited_q = SCIENCE[4][0].replace("spoon", "ladle", 1).upper().replace("?", " ...")
    planted = {
        "whole": f"{page}\n\n{q} {a}\n\n{clean[5]}",
        "embedded": f"{page}\n\n{long_paragraph[:middle]}{SCIENCE[2][0]} {SCIENCE[2][1]}. "
        f"{long_paragraph[middle:]}",
        "edited": f"{clean[6]}\n\nQuiz: {edited_q} Answer: {SCIENCE[4][1]}",
        "short": f"{long_paragraph[:middle]}Who painted the ceiling of the SISTINE chapel? Michelangelo! "
        f"{long_paragraph[middle:]}",
        "math": f"{clean[7]}\n\nMaria has 12 marbles and buys 3 more bags with 5 marbles in each bag at the "
        "shop. How many marbles does Maria have now? 27",
        # The item is split across paragraphs: no paragraph holds enough of it, the document does.
        "split": "\n\n".join(" ".join(SCIENCE[5][0].split()[i : i + 6]) for i in range(0, 30, 6)),
    }
    found = judge(step, list(planted.values()))
    for kind, contamination in zip(planted, found, strict=True):
        assert contamination is not None, kind
    by_kind = dict(zip(planted, found, strict=True))
    assert by_kind["whole"]["eval_sets"] == ["science"]
    words = len(normalize_for_matching(f"{q} {a}").split())
    assert by_kind["whole"]["matches"][0] == {
        "eval_set": "science",
        "file": str(step.index_path.rsplit("/", 1)[0] + "/science.jsonl"),
        "line": 1,
        "match": "verbatim",
        "coverage": 1.0,
        "words": words,
        "of": words,
        "paragraph": page_paragraphs,
    }
    assert by_kind["embedded"]["matches"][0]["line"] == 3
    assert by_kind["embedded"]["matches"][0]["paragraph"] == page_paragraphs
    # The same item twice in one paragraph: its words are counted once.
    (twice,) = judge(step, [f"{q} {a} {q} {a}"])
    assert twice["matches"][0]["words"] == words and twice["coverage"] == 1.0
    edited = by_kind["edited"]["matches"][0]
    assert edited["match"] == "edited" and edited["line"] == 5 and 0.7 <= edited["coverage"] < 1.0
    assert by_kind["short"]["matches"] == [
        {
            "eval_set": "trivia",
            "file": str(step.index_path.rsplit("/", 1)[0] + "/trivia.jsonl"),
            "line": 2,
            "match": "verbatim",
            "coverage": 1.0,
            "words": 9,
            "of": 9,
            "paragraph": 0,
        }
    ]
    assert by_kind["math"]["eval_sets"] == ["math"] and by_kind["math"]["matches"][0]["line"] == 1
    # An item laid out over five paragraphs is still one run of words; it starts in the first. Its
    # answer was left out, so it is not all there.
    split = by_kind["split"]["matches"][0]
    assert split["paragraph"] == 0 and split["match"] == "edited" and split["coverage"] >= 0.7
    # Clean prose, the bare template shared by every math item, another question, and half an item pass.
    negatives = [
        *clean,
        TEMPLATE + " " + clean[8],
        "What is the chemical symbol for silver? Ag",
        " ".join(SCIENCE[3][0].split()[:14]) + " and then something else entirely, said nobody.",
    ]
    assert judge(step, negatives) == [None] * len(negatives)
    stats = step.drain_stats()
    assert stats == {
        "documents": len(planted) + 1 + len(negatives),
        "contaminated": len(planted) + 1,
        "eval_sets": {
            "science": {"documents": 5, "verbatim": 3, "edited": 2},
            "trivia": {"documents": 1, "verbatim": 1},
            # Without its template, whose last words count (they start the problem's own 4-grams).
            "math": {"documents": 1, "edited": 1},
        },
    }
    assert step.drain_stats() == {}


def test_matches_do_not_cross_documents(step):
    # Each item split over two neighbouring documents of one batch: neither holds it.
    short = f"{TRIVIA[1][0]} {TRIVIA[1][1]}".split()
    long = f"{SCIENCE[3][0]} {SCIENCE[3][1]}".split()
    texts = [
        " ".join(short[:4]),
        " ".join(short[4:]),
        "filler " + " ".join(long[:12]),
        " ".join(long[12:]),
        " ".join(short),  # and whole, at the very start and end of a document, it is found
    ]
    assert [found is not None for found in judge(step, texts)] == [False, False, False, False, True]


def test_remove_mode_names_the_sets(index_path):
    step = Decontaminate(str(index_path))
    documents = [
        {"text": "Nothing to see here, just words.", "metadata": "{}"},
        {"text": f"{MATH[1][0]} {MATH[1][1]}\n\n{TRIVIA[2][0]} {TRIVIA[2][1]}", "metadata": None},
    ]
    verdicts = step.apply(documents)
    assert verdicts[0] is None
    assert verdicts[1].reason == "contaminated"
    assert verdicts[1].detail["eval_sets"] == ["math", "trivia"]
    assert verdicts[1].detail["coverage"] == 1.0
    assert json.loads(documents[1]["metadata"])["contamination"]["eval_sets"] == ["math", "trivia"]
    assert documents[0]["metadata"] == "{}"


def test_index_round_trips(index_path, tmp_path):
    index = DecontamIndex.load(str(index_path))
    header = index.header
    assert header["format_version"] == FORMAT_VERSION and header["long_words"] == 13
    sets = {entry["name"]: entry for entry in header["sets"]}
    assert list(sets) == ["math", "science", "trivia"]
    assert sets["science"]["long_records"] == 6 and sets["science"]["records"] == 6
    assert sets["science"]["layout"] == "question-choices-answer"
    assert sets["science"]["fields"] == ["question=question", "answer=answer"]
    assert sets["trivia"]["short_records"] == 4 and sets["trivia"]["too_short"] == 1
    assert sets["math"]["fields"] == ["problem", "solution.final"] and sets["math"]["layout"] == ""
    assert sets["math"]["template_anchors"] > 0  # the shared instruction sentence
    assert sets["math"]["files"][0]["rows"] == len(MATH)
    hashes = np.asarray(index.arrays["anchor_hash"])
    assert np.all(hashes[1:] >= hashes[:-1])
    # Saved again, the same bytes; built again from the same files, the same bytes.
    copy = tmp_path / "copy.index"
    DecontamIndex(dict(header), {k: np.asarray(v) for k, v in index.arrays.items()}).save(str(copy))
    assert copy.read_bytes() == index_path.read_bytes()
    again = tmp_path / "again.index"
    assert (
        main(
            [
                "decontam",
                "index",
                "--evals",
                str(index_path.parent / "*.jsonl"),
                "--output",
                str(again),
                "--set-fields",
                "math=problem,solution.final",
            ]
        )
        == 0
    )
    assert again.read_bytes() == index_path.read_bytes()
    loaded = DecontamIndex.load(str(copy))
    for name, array in index.arrays.items():
        assert np.array_equal(loaded.arrays[name], array), name


def test_index_of_other_version_or_truncated_is_refused(index_path, tmp_path):
    data = index_path.read_bytes()
    stale = tmp_path / "stale.index"
    stale.write_bytes(data.replace(b'"format_version":2', b'"format_version":9', 1))
    with pytest.raises(DecontamError, match="format version 9"):
        Decontaminate(str(stale))
    truncated = tmp_path / "truncated.index"
    truncated.write_bytes(data[: len(data) - 100])
    with pytest.raises(DecontamError, match="truncated"):
        read_index_header(str(truncated))
    other = tmp_path / "other.index"
    other.write_bytes(b"PAR1 not an index")
    with pytest.raises(DecontamError, match="not a tokenmill decontamination index"):
        read_index_header(str(other))


@pytest.mark.parametrize(
    ("lines", "fields", "message"),
    [
        (
            ['{"question": "fine", "answer": "x"}', '{"question": "broken"'],
            "auto",
            r"bad\.jsonl:2: not valid JSON",
        ),
        (
            ['{"question": "fine", "answer": "x"}', "", '{"question": "no answer"}'],
            "question,answer",
            r"bad\.jsonl:3: missing field 'answer'",
        ),
        (
            ['{"question": "fine", "answer": "x"}', '{"answer": "no question"}'],
            "auto",
            r"bad\.jsonl:2: missing field 'question' \(the question of layout question-choices-answer",
        ),
        (
            ['{"title": "t", "body": "b"}'],
            "auto",
            r"bad\.jsonl:1: the record's fields \(body, title\) fit no",
        ),
        (['["a", "list"]'], "auto", r"bad\.jsonl:1: expected a JSON object"),
        (['{"question": {"nested": 1}, "answer": "x"}'], "auto", r"bad\.jsonl:1: field 'question' is a dict"),
    ],
)
def test_malformed_evaluation_file_fails_naming_file_and_line(tmp_path, capsys, lines, fields, message):
    (tmp_path / "good.jsonl").write_text('{"question": "fine question", "answer": "y"}\n')
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    output = tmp_path / "out.index"
    arguments = ["decontam", "index", "--evals", str(tmp_path / "*.jsonl"), "--fields", fields]
    assert main([*arguments, "--output", str(output)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(DecontamError, match=message):
        read_eval_sets(eval_set_sources([str(tmp_path / "*.jsonl")], FieldSpec.parse(fields)))
    assert not output.exists()


def test_optional_fields_and_unknown_set_names(tmp_path):
    path = write_jsonl(
        tmp_path / "qa.jsonl",
        [
            {"question": "one two three four five six"},
            {"question": "seven", "answer": "eight nine ten eleven twelve"},
        ],
    )
    (eval_set,) = read_eval_sets(eval_set_sources([str(path)], FieldSpec.parse("question,answer?")))
    assert eval_set.texts == ["one two three four five six", "seven eight nine ten eleven twelve"]
    with pytest.raises(DecontamError, match="names no evaluation set: nope"):
        eval_set_sources([str(path)], set_fields={"nope": FieldSpec()})
    assert build_index([eval_set]).header["sets"][0]["short_records"] == 2


def test_recipe_fails_at_load_when_the_index_is_missing(tmp_path, index_path, capsys):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"name: t\nstages:\n  - decontam: {{index: {tmp_path / 'missing.index'}}}\n")
    with pytest.raises(RecipeError, match=r"recipe\.yaml: stages\[0\].*index not found: .*missing\.index"):
        load_recipe(recipe)
    # The command fails before any pipeline starts: nothing is written.
    corpus = write_jsonl(tmp_path / "corpus.jsonl", [{"text": "a document"}])
    output = tmp_path / "out"
    assert main(["curate", "--recipe", str(recipe), "--input", str(corpus), "--output", str(output)]) == 2
    assert "missing.index" in capsys.readouterr().err
    assert not output.exists()
    recipe.write_text(f"name: t\nstages:\n  - decontam: {{index: {index_path}, action: delete}}\n")
    with pytest.raises(RecipeError, match="action must be remove or flag"):
        load_recipe(recipe)


def curate_with(tmp_path: Path, index_path: Path, action: str, documents: list[dict]) -> tuple[Path, dict]:
    corpus = write_jsonl(tmp_path / "corpus.jsonl", documents)
    recipe = tmp_path / f"{action}.yaml"
    recipe.write_text(
        f"name: decontam-{action}\nstages:\n  - decontam: {{index: {index_path}, action: {action}}}\n"
    )
    output = tmp_path / f"out-{action}"
    assert (
        main(
            [
                "curate",
                "--recipe",
                str(recipe),
                "--input",
                str(corpus),
                "--output",
                str(output),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    return output, json.loads((output / "stats.json").read_text())


def test_curate_removes_or_flags_and_counts(tmp_path, index_path):
    clean = clean_documents()[:40]
    documents = [{"id": f"clean-{i}", "text": text} for i, text in enumerate(clean)]
    documents += [
        {"id": "dirty-science", "text": f"{clean[0]}\n\n{SCIENCE[1][0]} {SCIENCE[1][1]}"},
        {"id": "dirty-trivia", "text": f"{clean[1]} {TRIVIA[0][0]} {TRIVIA[0][1]}. {clean[2]}"},
    ]
    output, stats = curate_with(tmp_path, index_path, "remove", documents)
    assert stats["balanced"] and stats["kept"]["documents"] == len(clean)
    assert stats["removed_by_reason"]["decontam/contaminated"]["documents"] == 2
    # Per evaluation set, summed over workers, in stats.json (the report reads it from there).
    assert stats["stages"]["decontam"] == {
        "documents": len(documents),
        "contaminated": 2,
        "eval_sets": {"science": {"documents": 1, "verbatim": 1}, "trivia": {"documents": 1, "verbatim": 1}},
    }
    removed = pq.read_table(output / "removed" / "stage=decontam" / "reason=contaminated").to_pylist()
    assert {row["id"].split(":")[-1]: json.loads(row["detail"])["eval_sets"] for row in removed} == {
        "dirty-science": ["science"],
        "dirty-trivia": ["trivia"],
    }

    output, stats = curate_with(tmp_path, index_path, "flag", documents)
    assert stats["kept"]["documents"] == len(documents) and stats["removed"]["documents"] == 0
    rows = [
        row
        for path in sorted((output / "curated").rglob("*.parquet"))
        for row in pq.read_table(path).to_pylist()
    ]
    flagged = {
        row["id"].split(":")[-1]: json.loads(row["metadata"])["contamination"]["eval_sets"]
        for row in rows
        if "contamination" in json.loads(row["metadata"])
    }
    assert flagged == {"dirty-science": ["science"], "dirty-trivia": ["trivia"]}


def test_hot_anchors_and_long_passages(tmp_path):
    """A page that repeats an anchor a hundred thousand times is judged in bounded time and memory and is
    not an item; a long passage quoted in part is a partial match; a phrase in many records of many sets
    is no anchor."""
    passage = " ".join(clean_documents()[:40]).split()[:3000]
    chorus = "the chorus goes la la la la la la la la and then the singer bows to the crowd twice"
    stock = [
        {"question": f"Item {set_number}-{number}: the function returns a new list of the values {number}"}
        for set_number in range(8)
        for number in range(9)
    ]
    write_jsonl(tmp_path / "songs.jsonl", [{"question": chorus}, {"question": " ".join(passage)}])
    for set_number in range(8):
        write_jsonl(tmp_path / f"stock{set_number}.jsonl", stock[set_number * 9 : set_number * 9 + 9])
    index = build_index(read_eval_sets(eval_set_sources([str(tmp_path / "*.jsonl")])))
    assert index.header["common_anchors"] > 0  # "returns a new list" is in 72 records of 8 sets
    index.save(str(tmp_path / "index"))
    step = Decontaminate(str(tmp_path / "index"), action="flag")
    started = time.monotonic()
    (repeated,) = judge(step, ["la " * 100_000])
    assert repeated is None and time.monotonic() - started < 20
    quoted = " ".join(passage[1000:1060])
    (partial,) = judge(step, [f"As the manual says: {quoted} And so on."])
    assert partial["matches"][0]["match"] == "partial" and partial["matches"][0]["words"] >= 55
    assert partial["coverage"] < 0.05


def test_records_hash_alike_in_any_chunk():
    from tokenmill.filters.decontam.index import _hash_records

    texts = [normalize_for_matching(q + " " + a) for q, a in SCIENCE + TRIVIA + MATH]
    whole = _hash_records(texts, 13, 6)
    for chunk in (1, 2, 7):
        for mine, theirs in zip(_hash_records(texts, 13, 6, chunk=chunk), whole, strict=True):
            assert np.array_equal(mine, theirs)
