"""Exact dedupe (tokenmill.pipelines.exact_dedupe) without hot keys: the smallest id wins, a text with 50,000
copies leaves exactly one, no group of the pipeline ever holds two documents, and ids that repeat fail.

`group_probe` is also used by tests/test_fuzzy_dedupe.py: it watches every GroupByKey of a transform
while the pipeline runs (what each group really holds), so that a regression to grouping documents by
their text, or by anything else, fails here rather than on a worker at scale."""

from __future__ import annotations

import json
import random
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.pipeline import PipelineVisitor
from apache_beam.runners.portability.fn_api_runner import FnApiRunner

from tokenmill.corpora.records import DuplicateIdError
from tokenmill.pipelines.dedupe_keys import text_hash
from tokenmill.pipelines.exact_dedupe import GROUP_SIZE, ExactDedupe


def count_documents(value) -> int:
    """How many documents (dicts with a text) a grouped value holds, looking inside tuples and lists."""
    if isinstance(value, dict):
        return 1 if "text" in value else 0
    if isinstance(value, tuple | list):
        return sum(count_documents(item) for item in value)
    return 0


class _Dump(beam.DoFn):
    def __init__(self, path: str):
        self.path = path

    def process(self, items):
        Path(self.path).write_text(json.dumps(items, sort_keys=True, default=str))


def _max_pair(pairs):
    values = documents = 0
    for pair_values, pair_documents in pairs:
        values, documents = max(values, pair_values), max(documents, pair_documents)
    return values, documents


def _sum_pair(pairs):
    values = documents = 0
    for pair_values, pair_documents in pairs:
        values, documents = values + pair_values, documents + pair_documents
    return values, documents


def group_probe(pipeline: beam.Pipeline, under: str, path: Path) -> None:
    """Watch every GroupByKey inside the transforms labelled `under`: when the pipeline has run, `path`
    holds {GroupByKey's label: [most values under one key, most documents under one key]}.

    Each GroupByKey's input is also fed to a counter of values and documents per key, so this sees what
    the groups hold at run time, whatever transform (CoGroupByKey, CombinePerKey, Distinct) made them.
    """

    class FindGroups(PipelineVisitor):
        def __init__(self):
            self.found = []

        def visit_transform(self, node):
            if isinstance(node.transform, beam.GroupByKey) and node.full_label.startswith(f"{under}/"):
                self.found.append((node.full_label, node.inputs[0]))

    finder = FindGroups()
    pipeline.visit(finder)
    assert finder.found, f"no GroupByKey under {under}"
    per_group = []
    for label, keyed in finder.found:
        name = label.replace("/", "|")
        per_group.append(
            keyed
            | f"Probe {name}"
            >> beam.Map(lambda pair, label=label: ((label, repr(pair[0])), (1, count_documents(pair[1]))))
            | f"PerKey {name}" >> beam.CombinePerKey(_sum_pair)
            | f"ByGroup {name}" >> beam.Map(lambda element: (element[0][0], element[1]))
        )
    (
        tuple(per_group)
        | "ProbeAll" >> beam.Flatten()
        | "ProbeMax" >> beam.CombinePerKey(_max_pair)
        | "ProbeList" >> beam.combiners.ToList()
        | "ProbeDump" >> beam.ParDo(_Dump(str(path)))
    )


def read_probe(path: Path) -> dict[str, tuple[int, int]]:
    """{GroupByKey label (below the probed transform): (most values, most documents) under one key}."""
    return {label.split("/", 1)[1]: tuple(pair) for label, pair in json.loads(path.read_text())}


def run(documents: list[dict], tmp_path: Path, transform: beam.PTransform) -> tuple[dict, dict, dict]:
    """The transform on the in-memory runner, probed: (kept by id, removed by id, probe)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    options = PipelineOptions(["--direct_num_workers=1", "--direct_running_mode=in_memory"])
    pipeline = beam.Pipeline(runner=FnApiRunner(), options=options)
    result = (
        pipeline
        | beam.Create([None])
        | beam.FlatMap(lambda _: documents)  # Create would infer a type from every document first
        | "Dedupe" >> transform
    )
    group_probe(pipeline, "Dedupe", tmp_path / "probe.json")
    for name in ("kept", "removed"):
        (
            result[name]
            | f"List{name}" >> beam.combiners.ToList()
            | f"Dump{name}" >> beam.ParDo(_Dump(str(tmp_path / f"{name}.json")))
        )
    pipeline.run().wait_until_finish()
    kept, removed = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("kept", "removed"))
    kept_by_id = {document["id"]: document for document in kept}
    removed_by_id = {document["id"]: document for document in removed}
    assert len(kept_by_id) == len(kept) and len(removed_by_id) == len(removed)
    return kept_by_id, removed_by_id, read_probe(tmp_path / "probe.json")


def test_the_smallest_id_of_each_text_is_kept_and_the_others_name_it(tmp_path):
    texts = ["alpha text", "beta text", "gamma text", "delta text"]
    rng = random.Random(1)
    documents = []
    for index in range(40):
        text = texts[index % 4] if index < 30 else f"unique {index}"
        documents.append({"id": f"src:{rng.randrange(10**6):06d}-{index}", "text": text, "source": "src"})
    rng.shuffle(documents)
    kept, removed, probe = run(documents, tmp_path, ExactDedupe())
    first = {}
    for document in sorted(documents, key=lambda document: document["id"]):
        first.setdefault(document["text"], document["id"])
    assert set(kept) == set(first.values())
    assert set(removed) == {document["id"] for document in documents} - set(first.values())
    for identifier, row in removed.items():
        assert (row["stage"], row["reason"]) == ("exact_dedupe", "exact_duplicate")
        assert json.loads(row["detail"]) == {
            "kept_id": first[row["text"]],
            "text_hash": text_hash(row["text"]),
        }
        assert row["source"] == "src" and row["id"] == identifier
    # Whole documents meet nothing but their own verdict: one document per group, in one GroupByKey.
    carrying = {label: documents for label, (_, documents) in probe.items() if documents}
    assert carrying == {"JoinById": 1}


def test_fifty_thousand_copies_of_one_text_leave_one_and_no_group_holds_them(tmp_path):
    boilerplate = "Cookie notice. This site uses cookies to improve your experience. Accept all."
    rng = random.Random(2)
    copies = [
        {"id": f"page-{rng.randrange(10**9):09d}-{index}", "text": boilerplate} for index in range(50_000)
    ]
    unique = [
        {"id": f"doc-{index:05d}", "text": f"An ordinary document, number {index}."} for index in range(2000)
    ]
    documents = copies + unique
    rng.shuffle(documents)
    kept, removed, probe = run(documents, tmp_path, ExactDedupe())
    smallest = min(copy["id"] for copy in copies)
    assert set(kept) == {smallest} | {document["id"] for document in unique}
    assert len(removed) == 49_999 and smallest not in removed
    assert {json.loads(row["detail"])["kept_id"] for row in removed.values()} == {smallest}
    # No group holds two documents; the ids of the hot text are spread over salted groups of about
    # GROUP_SIZE (50 of them here), and the combiner's group is ids only.
    assert all(documents <= 1 for _, documents in probe.values())
    assert probe["JoinById"] == (2, 1)  # a document and its verdict
    most_ids, _ = probe["GroupSalted"]
    assert GROUP_SIZE // 2 < most_ids < 1.5 * GROUP_SIZE


class _GroupCopiesByHash(beam.PTransform):
    """The dedupe this module replaced: every copy of a text in one group. The probe must catch it."""

    def expand(self, documents):
        grouped = (
            documents
            | beam.Map(lambda document: (text_hash(document["text"]), document))
            | "GroupByText" >> beam.GroupByKey()
        )
        return {
            "kept": grouped | "First" >> beam.Map(lambda group: min(group[1], key=lambda d: d["id"])),
            "removed": grouped | "None" >> beam.FlatMap(lambda group: []),
        }


def test_the_probe_catches_documents_grouped_by_their_text(tmp_path):
    documents = [
        {"id": f"d{index}", "text": "same text" if index < 3 else f"text {index}"} for index in range(6)
    ]
    _, _, probe = run(documents, tmp_path, _GroupCopiesByHash())
    assert probe["GroupByText"] == (3, 3)


def test_two_documents_with_one_id_fail_naming_it(tmp_path):
    documents = [
        {"id": "a.jsonl:7", "text": "first text", "source": "a.jsonl"},
        {"id": "a.jsonl:7", "text": "second text", "source": "b/a.jsonl"},
        {"id": "a.jsonl:8", "text": "third text", "source": "a.jsonl"},
    ]
    with pytest.raises(
        DuplicateIdError, match=r"two documents have the id 'a\.jsonl:7' \(sources '(b/)?a\.jsonl' and"
    ):
        run(documents, tmp_path, ExactDedupe())


def test_group_size_is_checked():
    with pytest.raises(ValueError, match="group_size must be a positive integer"):
        ExactDedupe(group_size=0)


def _words(rng: random.Random, count: int) -> str:
    vocabulary = (
        "the and of to with that have river stone garden window letter market winter harbour lantern "
        "orchard meadow village bridge kitchen library morning evening valley forest castle candle"
    ).split()
    return " ".join(rng.choice(vocabulary) for _ in range(count)) + "."


def test_curate_names_a_kept_document_when_the_kept_copy_is_removed_later(tmp_path):
    """30 copies of a page whose kept copy (the smallest id) fuzzy dedupe removes for an edited twin, and
    20 copies of a short page whose kept copy gopher_quality removes: every removal still filed under a
    dedupe stage names a document of curated/, and the cluster sizes add up."""
    from tokenmill.cli import main
    from tokenmill.formats.documents import curated_dataset, removed_dataset
    from tokenmill.pipelines.dedupe_keys import node_key

    rng = random.Random(5)
    page = _words(rng, 300)
    copies = [f"copy-{index:02d}" for index in range(30)]
    first_copy = f"docs.jsonl:{copies[0]}"
    # The twin's node must be smaller than the kept copy's, so that fuzzy dedupe keeps the twin.
    twin = next(
        name
        for name in (f"twin-{index}" for index in range(1000))
        if node_key(f"docs.jsonl:{name}") < node_key(first_copy)
    )
    words = page.split()
    words[150] = "zeppelin"
    short = "the short notice of the harbour and the river."
    records = (
        [{"id": name, "text": page} for name in copies]
        + [{"id": twin, "text": " ".join(words)}]
        + [{"id": f"short-{index:02d}", "text": short} for index in range(20)]
        + [{"id": f"unique-{index:02d}", "text": _words(rng, 120)} for index in range(20)]
    )
    rng.shuffle(records)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "docs.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "name: chains\nstages:\n  - exact_dedupe: {}\n  - fuzzy_dedupe: {max_rounds: 4}\n"
        "  - gopher_quality: {min_doc_words: 50}\n"
    )
    output = tmp_path / "out"
    arguments = ["curate", "--recipe", str(recipe), "--input", str(tmp_path / "in" / "*.jsonl")]
    assert main([*arguments, "--output", str(output), "--workers", "1"]) == 0
    stats = json.loads((output / "stats.json").read_text())
    curated = curated_dataset(str(output / "curated")).to_table().to_pylist()
    removed = removed_dataset(str(output / "removed")).to_table().to_pylist()
    sizes = {row["id"]: row["dup_cluster_size"] for row in curated}
    assert stats["balanced"] and stats["read"]["documents"] == len(records) == len(curated) + len(removed)
    assert stats["kept"]["documents"] == len(curated) == 1 + 20
    dedupe = [row for row in removed if row["stage"] in ("exact_dedupe", "fuzzy_dedupe")]
    assert dedupe and all(json.loads(row["detail"])["kept_id"] in sizes for row in dedupe)
    twin_id = f"docs.jsonl:{twin}"
    details = {row["id"]: json.loads(row["detail"]) for row in removed}
    assert details[first_copy]["kept_id"] == twin_id  # fuzzy dedupe's own removal
    for name in copies[1:]:
        assert details[f"docs.jsonl:{name}"]["kept_id"] == twin_id
        assert details[f"docs.jsonl:{name}"]["matched_id"] == first_copy
    assert sizes[twin_id] == 31 and sum(sizes.values()) == len(curated) + len(dedupe)
    # The short page's kept copy failed gopher_quality; its 19 copies went with it, under that reason.
    short_removed = [row for row in removed if row["id"].startswith("docs.jsonl:short-")]
    assert {(row["stage"], row["reason"]) for row in short_removed} == {
        ("gopher_quality", "gopher_short_doc")
    }
    assert {details[row["id"]].get("removed_with") for row in short_removed} == {"docs.jsonl:short-00", None}
    assert stats["removed_by_reason"]["gopher_quality/gopher_short_doc"]["documents"] == 20
    assert stats["stages"]["dedupe_clusters"]["removed_with_representative"] == 19
    assert stats["stages"]["dedupe_clusters"]["kept_id_moved"] == 29
