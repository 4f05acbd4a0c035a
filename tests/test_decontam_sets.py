"""Evaluation sets as benchmarks ship them: JSON Lines, JSON arrays and Parquet, in the common layouts, named,
with field mappings per set, and contamination counted per benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tokenmill.cli import main
from tokenmill.filters.commands import LAYOUT_NAMES
from tokenmill.filters.decontam import (
    LAYOUTS,
    DecontamError,
    Decontaminate,
    FieldSpec,
    eval_set_sources,
    load_sets_file,
    read_eval_sets,
)

MMLU = [
    {
        "question": "Which of the following best describes the role of the mitochondria in a eukaryotic "
        "cell?",
        "subject": "biology",
        "choices": ["Protein synthesis", "Energy production", "Lipid storage", "Cell division"],
        "answer": 1,
    },
    {
        "question": "A train leaves the station at noon travelling at sixty miles per hour; how far has it "
        "gone?",
        "subject": "math",
        "choices": ["Thirty miles by one", "Sixty miles by one", "Ninety miles by one", "Cannot be known"],
        "answer": 3,
    },
]
ARC = {
    "id": "Mercury_7175875",
    "question": "An astronomer observes that a planet rotates faster after a meteorite impact. Which is the "
    "most likely effect of this increase in rotation?",
    "choices": {
        "text": ["Planetary density will decrease.", "Planetary years will become longer.", "Days shorter."],
        "label": ["A", "B", "C"],
    },
    "answerKey": "C",
}
HELLASWAG = {
    "ctx": "A man is sitting on a roof. He starts pulling up roofing on a roof and",
    "endings": [
        "is using wrap to wrap a pair of skis.",
        "is ripping level tiles off.",
        "holds a rubik's cube.",
    ],
    "label": "1",
}
HUMANEVAL = {
    "task_id": "HumanEval/0",
    "prompt": 'def has_close_elements(numbers, threshold):\n    """Check if in given list of numbers, are '
    'any two numbers closer to each other than given threshold."""\n',
    "canonical_solution": "    for idx, elem in enumerate(numbers):\n        return True\n",
    "test": "def check(candidate): pass",
}
SQUAD = {
    "id": "5733be284776f41900661182",
    "context": "Architecturally, the school has a Catholic character. Atop the Main Building's gold dome is "
    "a golden statue of the Virgin Mary.",
    "question": "What sits on top of the Main Building at Notre Dame?",
    "answers": {"text": ["a golden statue of the Virgin Mary"], "answer_start": [92]},
}
BOOLQ = {
    "passage": "Persian language is spoken in Iran, Afghanistan and Tajikistan by about seventy million "
    "people.",
    "question": "do iran and afghanistan speak the same language",
    "answer": True,
}


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def texts_of(path: Path, fields: str = "auto") -> tuple[str, list[str], list[str]]:
    (eval_set,) = read_eval_sets(eval_set_sources([str(path)], FieldSpec.parse(fields)))
    return eval_set.layout, eval_set.resolved, eval_set.texts


def test_layouts_are_recognized_and_answers_that_point_into_choices_add_nothing(tmp_path):
    pq.write_table(pa.Table.from_pylist(MMLU), tmp_path / "mmlu.parquet")
    layout, fields, texts = texts_of(tmp_path / "mmlu.parquet")
    assert layout == "question-choices-answer"
    assert fields == ["question=question", "choices=choices", "answer=answer"]
    assert texts[0].endswith(
        "eukaryotic cell protein synthesis energy production lipid storage cell division"
    )
    layout, fields, texts = texts_of(write_jsonl(tmp_path / "arc.jsonl", [ARC]))
    assert fields == ["question=question", "choices=choices", "answer=answerKey"]
    assert texts[0].endswith(
        "increase in rotation planetary density will decrease planetary years will become longer days shorter"
    )
    layout, fields, texts = texts_of(write_jsonl(tmp_path / "hellaswag.jsonl", [HELLASWAG]))
    assert fields == ["question=ctx", "choices=endings", "answer=label"]
    assert texts[0].endswith(
        "on a roof and is using wrap to wrap a pair of skis is ripping level tiles off holds a rubik s cube"
    )
    layout, fields, texts = texts_of(write_jsonl(tmp_path / "humaneval.jsonl", [HUMANEVAL]))
    assert layout == "prompt-completion" and fields == ["prompt=prompt", "completion=canonical_solution"]
    assert texts[0].startswith("def has close elements numbers threshold check if")
    assert texts[0].endswith("for idx elem in enumerate numbers return true")
    layout, fields, texts = texts_of(write_jsonl(tmp_path / "squad.jsonl", [SQUAD]))
    assert layout == "passage-question" and fields == [
        "passage=context",
        "question=question",
        "answer=answers",
    ]
    assert texts[0].endswith(
        "virgin mary what sits on top of the main building at notre dame"
    )  # span: nothing
    layout, fields, texts = texts_of(write_jsonl(tmp_path / "boolq.jsonl", [BOOLQ]))
    assert texts[0].endswith("seventy million people do iran and afghanistan speak the same language true")
    # A free answer (GSM8K's worked solution) is text of its own.
    gsm = {
        "question": "Natalia sold clips to 48 of her friends in April.",
        "answer": "She sold 48 clips. #### 48",
    }
    assert texts_of(write_jsonl(tmp_path / "gsm8k.jsonl", [gsm]))[2] == [
        "natalia sold clips to 48 of her friends in april she sold 48 clips 48"
    ]


def test_a_named_set_of_parquet_shards_reports_file_and_row(tmp_path):
    shards = tmp_path / "mmlu" / "all"
    shards.mkdir(parents=True)
    pq.write_table(
        pa.Table.from_pylist(MMLU[:1] * 3), shards / "test-00000-of-00002.parquet", row_group_size=1
    )
    pq.write_table(pa.Table.from_pylist([MMLU[0], MMLU[1]]), shards / "test-00001-of-00002.parquet")
    index = tmp_path / "evals.index"
    pattern = f"mmlu={shards}/test-*.parquet"
    assert main(["decontam", "index", "--evals", pattern, "--output", str(index)]) == 0
    step = Decontaminate(str(index), action="flag")
    choices = "\n".join(f"{label}. {text}" for label, text in zip("ABCD", MMLU[1]["choices"], strict=True))
    leaked = f"Practice test.\n\n{MMLU[1]['question']}\n{choices}\nAnswer: D\n\nGood luck."
    documents = [
        {"text": leaked, "metadata": None},
        {"text": "Mitochondria are organelles.", "metadata": None},
    ]
    step.apply(documents)
    contamination = json.loads(documents[0]["metadata"])["contamination"]
    assert contamination["eval_sets"] == ["mmlu"] and documents[1]["metadata"] is None
    match = contamination["matches"][0]
    # Duplicates are indexed once, at their first place: the second item is row 2 of the second shard.
    assert match["file"].endswith("test-00001-of-00002.parquet") and match["line"] == 2
    assert match["paragraph"] == 1 and match["coverage"] >= 0.7
    assert step.drain_stats()["eval_sets"]["mmlu"]["documents"] == 1


def test_json_arrays_and_a_sets_file_with_field_mappings(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "hs.json").write_text(json.dumps([{"context": HELLASWAG["ctx"], **HELLASWAG}]))
    write_jsonl(tmp_path / "data" / "custom.jsonl", [{"problem": {"text": "one two three four five six"}}])
    pq.write_table(pa.Table.from_pylist(MMLU), tmp_path / "data" / "mmlu.parquet")
    sets_file = tmp_path / "sets.yaml"
    sets_file.write_text(
        "sets:\n"
        "  - name: hellaswag\n"
        "    files: data/hs.json\n"
        "    fields: {question: ctx, choices: endings, answer: label}\n"
        "  - {name: custom, files: [data/custom.jsonl], fields: [problem.text]}\n"
        "  - {name: mmlu, files: 'data/*.parquet', layout: question-choices-answer}\n"
    )
    sources = load_sets_file(str(sets_file))
    assert [(s.name, s.fields.layout) for s in sources] == [
        ("hellaswag", "question-choices-answer"),
        ("custom", ""),
        ("mmlu", "question-choices-answer"),
    ]
    sets = read_eval_sets(sources)
    # Mapped explicitly, the context field wins over the passage-like `context` that auto would take.
    assert sets[0].texts[0].startswith("a man is sitting on a roof") and sets[0].line_numbers == [1]
    assert sets[1].texts == ["one two three four five six"]
    assert len(sets[2].texts) == 2
    output = tmp_path / "out.index"
    assert main(["decontam", "index", "--sets", str(sets_file), "--output", str(output)]) == 0
    assert (
        main(
            [
                "decontam",
                "index",
                "--sets",
                str(sets_file),
                "--evals",
                f"mmlu={tmp_path}/data/*.parquet",
                "--output",
                str(output),
            ]
        )
        == 2
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("sets: [{name: a, files: data/x.jsonl, layout: mcq}]", r"sets\.0\.layout: .*unknown layout 'mcq'"),
        ("sets: [{name: a, files: data/x.jsonl, colour: red}]", r"sets\.0\.colour: Extra inputs"),
        ("sets: [{name: a, files: data/none-*.jsonl}]", r"sets\[0\] \(a\): --evals .* matches no file"),
        (
            "sets: [{name: a, files: data/x.jsonl, layout: prompt-completion, fields: [q]}]",
            r"sets\[0\] \(a\): give a layout with a role mapping, or a list of fields",
        ),
        (
            "sets: [{name: a, files: data/x.jsonl, layout: prompt-completion, fields: {question: q}}]",
            r"layout prompt-completion has no role question",
        ),
        ("sets: [{name: a, files: data/x.jsonl}, {name: a, files: data/x.jsonl}]", "listed twice"),
        ("sets: [", "not valid YAML"),
    ],
)
def test_a_bad_sets_file_names_file_and_set(tmp_path, content, message):
    (tmp_path / "data").mkdir()
    write_jsonl(tmp_path / "data" / "x.jsonl", [{"question": "q"}])
    (tmp_path / "sets.yaml").write_text(content + "\n")
    with pytest.raises(DecontamError, match=rf"sets\.yaml: .*{message}"):
        load_sets_file(str(tmp_path / "sets.yaml"))


def test_bad_records_name_file_and_row(tmp_path):
    pq.write_table(pa.Table.from_pylist([MMLU[0], {**MMLU[1], "question": None}]), tmp_path / "mmlu.parquet")
    with pytest.raises(DecontamError, match=r"mmlu\.parquet: row 2: missing field 'question'"):
        texts_of(tmp_path / "mmlu.parquet")
    (tmp_path / "broken.parquet").write_bytes(b"PAR1 this is not parquet")
    with pytest.raises(DecontamError, match=r"broken\.parquet: not a readable Parquet file"):
        texts_of(tmp_path / "broken.parquet")
    (tmp_path / "array.json").write_text('[{"question": "fine"}, 3]')
    with pytest.raises(DecontamError, match=r"array\.json: record 2: expected a JSON object, got int"):
        texts_of(tmp_path / "array.json")
    (tmp_path / "notes.txt").write_text("question")
    with pytest.raises(DecontamError, match=r"notes\.txt: not an evaluation file"):
        texts_of(tmp_path / "notes.txt")
    write_jsonl(tmp_path / "a.jsonl", [{"question": "q"}])
    with pytest.raises(DecontamError, match="evaluation set 'x' is named twice"):
        eval_set_sources([f"x={tmp_path}/a.jsonl", f"x={tmp_path}/mmlu.parquet"])


def test_field_specs_parse():
    assert FieldSpec.parse("auto") == FieldSpec()
    assert FieldSpec.parse("passage-question") == FieldSpec(layout="passage-question")
    assert FieldSpec.parse("question,answer?") == FieldSpec(layout="", paths=("question", "answer?"))
    assert FieldSpec.parse("question=ctx,choices=endings") == FieldSpec(
        layout="question-choices-answer", mapping=(("choices", "endings"), ("question", "ctx"))
    )
    assert FieldSpec.parse("passage-question:passage=article").layout == "passage-question"
    assert FieldSpec.parse("passage=article,question=q").layout == "passage-question"
    with pytest.raises(DecontamError, match="unknown layout 'qa'"):
        FieldSpec.parse("qa:question=q")
    with pytest.raises(DecontamError, match="no layout has the roles completion, passage"):
        FieldSpec.parse("passage=p,completion=c")
    assert set(LAYOUT_NAMES) == set(LAYOUTS)  # the command's help names every layout
