"""Final kept ids and cluster sizes (tokenmill.pipelines.dedupe_clusters): every dedupe removal names a
kept document, chains through exact and fuzzy dedupe end at the last kept one, a chain that ends at a
document a filter removed goes with it, cluster sizes sum to the documents they stand for, and a kept id
with thousands of removals pointing at it is spread over salted groups."""

from __future__ import annotations

import json
import random
from pathlib import Path

import apache_beam as beam
import pytest
from apache_beam.options.pipeline_options import PipelineOptions
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from test_exact_dedupe import group_probe, read_probe

from tokenmill.pipelines.dedupe_clusters import CLUSTER_SIZE, DEDUPE_STAGES, DedupeClusters

STAGES = ["normalize", "exact_dedupe", "fuzzy_dedupe", "gopher_quality"]


class _Dump(beam.DoFn):
    def __init__(self, path: str):
        self.path = path

    def process(self, items):
        Path(self.path).write_text(json.dumps(items, sort_keys=True, default=str))


class _FromTagged(beam.PTransform):
    """(part, document) records -> DedupeClusters over (kept, removed part 0, part 1, ...): lets one
    Create feed the transform's tuple input."""

    def __init__(self, stages: list[str], group_size: int):
        super().__init__()
        self.stages = stages
        self.group_size = group_size

    def expand(self, tagged):
        parts = tagged | beam.Partition(lambda record, count: record[0], len(self.stages) + 1)
        documents = [
            part | f"Untag{index}" >> beam.Map(lambda record: record[1]) for index, part in enumerate(parts)
        ]
        return tuple(documents) | DedupeClusters(self.stages, self.group_size)


def run(
    tagged: list[tuple[int, dict]], tmp_path: Path, stages=STAGES, group_size: int = 1000, probe: bool = True
):
    """DedupeClusters on the in-memory runner, every GroupByKey probed: (kept, removed, stats, probe)."""
    options = PipelineOptions(["--direct_num_workers=1", "--direct_running_mode=in_memory"])
    pipeline = beam.Pipeline(runner=FnApiRunner(), options=options)
    result = (
        pipeline
        | beam.Create([None])
        | beam.FlatMap(lambda _: tagged)
        | "Clusters" >> _FromTagged(stages, group_size)
    )
    if probe:
        group_probe(pipeline, "Clusters", tmp_path / "probe.json")
    for name in ("kept", "removed", "stats"):
        collection = result[name]
        if isinstance(collection, tuple):  # the removals come as one PCollection per part
            collection = collection | f"Flatten{name}" >> beam.Flatten(pipeline=pipeline)
        (
            collection
            | f"List{name}" >> beam.combiners.ToList()
            | f"Dump{name}" >> beam.ParDo(_Dump(str(tmp_path / f"{name}.json")))
        )
    pipeline.run().wait_until_finish()
    kept, removed, stats = (
        json.loads((tmp_path / f"{name}.json").read_text()) for name in ("kept", "removed", "stats")
    )
    assert len(stats) == 1 and stats[0][0] == "dedupe_clusters"
    return (
        {d["id"]: d for d in kept},
        {d["id"]: d for d in removed},
        stats[0][1],
        read_probe(tmp_path / "probe.json") if probe else {},
    )


def _document(identifier: str, **fields) -> dict:
    return {"id": identifier, "text": f"text of {identifier}", "source": "s", **fields}


def _removal(identifier: str, stage: str, reason: str, **detail) -> dict:
    return _document(identifier, stage=stage, reason=reason, detail=json.dumps(detail, sort_keys=True))


def _corpus(copies: int, rng: random.Random) -> tuple[list[tuple[int, dict]], int]:
    """Kept documents and removals as the stages of STAGES would leave them, in shuffled order:

    - `copies` exact copies of a boilerplate text name b0000, which fuzzy dedupe removed for f-root;
    - f-root has three exact copies of its own and a near duplicate f-near;
    - 40 exact copies of a short text name q0, which gopher_quality removed;
    - a near duplicate of q-near-root, which gopher_quality removed too;
    - 50 kept documents without duplicates.
    """
    part = {stage: index + 1 for index, stage in enumerate(STAGES)}  # 0 is kept
    records = [(0, _document("f-root")), *((0, _document(f"plain{i:03d}")) for i in range(50))]
    records.append(
        (part["fuzzy_dedupe"], _removal("b0000", "fuzzy_dedupe", "near_duplicate", kept_id="f-root"))
    )
    for index in range(1, copies):
        removal = _removal(
            f"b{index:04d}", "exact_dedupe", "exact_duplicate", kept_id="b0000", text_hash="h1"
        )
        records.append((part["exact_dedupe"], removal))
    for index in range(3):
        removal = _removal(f"f-root-copy{index}", "exact_dedupe", "exact_duplicate", kept_id="f-root")
        records.append((part["exact_dedupe"], removal))
    records.append(
        (part["fuzzy_dedupe"], _removal("f-near", "fuzzy_dedupe", "near_duplicate", kept_id="f-root"))
    )
    records.append((part["gopher_quality"], _removal("q0", "gopher_quality", "gopher_short_doc")))
    for index in range(1, 40):
        removal = _removal(f"q{index}", "exact_dedupe", "exact_duplicate", kept_id="q0", text_hash="h2")
        records.append((part["exact_dedupe"], removal))
    records.append((part["gopher_quality"], _removal("q-near-root", "gopher_quality", "gopher_short_doc")))
    records.append(
        (part["fuzzy_dedupe"], _removal("q-near", "fuzzy_dedupe", "near_duplicate", kept_id="q-near-root"))
    )
    rng.shuffle(records)
    return records, len(records)


def test_chains_end_at_a_kept_document_or_go_with_the_filtered_representative(tmp_path):
    records, total = _corpus(copies=200, rng=random.Random(3))
    kept, removed, stats, _ = run(records, tmp_path)
    assert len(kept) + len(removed) == total
    # Every removal still filed under a dedupe stage names a kept document.
    for row in removed.values():
        if row["stage"] in DEDUPE_STAGES:
            assert json.loads(row["detail"])["kept_id"] in kept, row
    # The 199 exact copies of b0000 (removed by fuzzy dedupe) end at f-root, and say whom they matched.
    details = {identifier: json.loads(row["detail"]) for identifier, row in removed.items()}
    for index in range(1, 200):
        assert details[f"b{index:04d}"] == {"kept_id": "f-root", "matched_id": "b0000", "text_hash": "h1"}
    assert details["b0000"] == {"kept_id": "f-root"} and details["f-root-copy0"] == {"kept_id": "f-root"}
    # f-root stands for itself, its 3 copies, f-near, b0000 and b0000's 199 copies.
    assert kept["f-root"][CLUSTER_SIZE] == 1 + 3 + 1 + 1 + 199
    assert {kept[f"plain{i:03d}"][CLUSTER_SIZE] for i in range(50)} == {1}
    # The copies of q0 and the near duplicate of q-near-root go with their representative, to its reason.
    for identifier in [f"q{index}" for index in range(1, 40)] + ["q-near"]:
        row = removed[identifier]
        assert (row["stage"], row["reason"]) == ("gopher_quality", "gopher_short_doc")
        assert "kept_id" not in details[identifier]
    assert details["q7"] == {
        "matched_id": "q0",
        "removed_with": "q0",
        "dedupe_stage": "exact_dedupe",
        "dedupe_reason": "exact_duplicate",
        "text_hash": "h2",
    }
    assert (
        details["q-near"]["removed_with"] == "q-near-root"
        and details["q-near"]["dedupe_stage"] == "fuzzy_dedupe"
    )
    # Cluster sizes sum to the kept documents plus every removal that is still a dedupe removal.
    still_dedupe = sum(1 for row in removed.values() if row["stage"] in DEDUPE_STAGES)
    assert sum(document[CLUSTER_SIZE] for document in kept.values()) == len(kept) + still_dedupe
    assert stats == {
        "removals_followed": 199 + 1 + 3 + 1 + 39 + 1,
        "kept_id_moved": 199,
        "removed_with_representative": 40,
        "clusters": 1,
        "documents_in_clusters": 205,
        "largest_cluster": 205,
        "cluster_sizes": {"129-256": 1},
    }


def test_a_kept_id_with_thousands_of_removals_is_spread_over_salted_groups(tmp_path):
    records, _ = _corpus(copies=5000, rng=random.Random(4))
    kept, removed, stats, probe = run(records, tmp_path, group_size=100)
    assert kept["f-root"][CLUSTER_SIZE] == 1 + 3 + 1 + 1 + 4999
    assert {json.loads(removed[f"b{index:04d}"]["detail"])["kept_id"] for index in range(1, 5000)} == {
        "f-root"
    }
    # No group holds two documents; whole documents meet only their own final, one per group.
    assert all(documents <= 1 for _, documents in probe.values())
    carrying = {label.split("/")[-1] for label, (_, documents) in probe.items() if documents}
    assert carrying == {"JoinRemovedById", "JoinKeptById"}
    assert all(values <= 2 for label, (values, _) in probe.items() if label.endswith("ById"))
    # The 4,999 pointers to b0000 are in ~50 salted groups of about 100, each with b0000's own final.
    salted = [values for label, (values, _) in probe.items() if label.endswith("GroupSalted")]
    assert len(salted) == 2  # one join per dedupe stage
    assert 50 < max(salted) < 160


def test_without_dedupe_stages_every_kept_document_is_its_own_cluster(tmp_path):
    stages = ["normalize", "gopher_quality"]
    records = [(0, _document("a")), (0, _document("b")), (2, _removal("c", "gopher_quality", "short"))]
    kept, removed, stats, _ = run(records, tmp_path, stages=stages, probe=False)
    assert {identifier: row[CLUSTER_SIZE] for identifier, row in kept.items()} == {"a": 1, "b": 1}
    assert set(removed) == {"c"} and stats["removals_followed"] == 0


def test_a_removal_without_kept_id_fails_naming_it(tmp_path):
    records = [(0, _document("a")), (2, _removal("b", "exact_dedupe", "exact_duplicate"))]
    with pytest.raises(Exception, match=r"exact_dedupe removal of 'b' has no detail.kept_id"):
        run(records, tmp_path)


def _write_cell(path: Path, sizes: dict[str, int | None]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tokenmill.formats.documents import DOCUMENT_SCHEMA

    rows = [
        {
            "id": identifier,
            "text": f"Document {identifier}: " + " ".join(f"word{(index * 7) % 13}" for index in range(40)),
            "source": "s.jsonl",
            "metadata": "{}",
            "domain": "web",
            "quality": 0,
            "n_chars": 100,
            CLUSTER_SIZE: size,
        }
        for identifier, size in sorted(sizes.items())
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=DOCUMENT_SCHEMA), path)


def test_the_overview_scan_counts_cluster_sizes_per_cell(tmp_path):
    from tokenmill.reports.inputs import scan_cell

    cell = tmp_path / "curated" / "domain=web" / "quality=0"
    _write_cell(cell / "part-00000-of-00002.parquet", {"a": 1, "b": 2, "c": 7, "d": None})
    _write_cell(cell / "part-00001-of-00002.parquet", {"e": 1, "f": 300, "g": 8})
    scan = scan_cell("domain=web/quality=0", sorted(str(p) for p in cell.iterdir()), samples=0, seed=1)
    assert scan.cluster_sizes == {"1": 3, "2": 1, "5-8": 2, "257-512": 1}  # a null (older files) is 1
    assert scan.represented == 1 + 2 + 7 + 1 + 1 + 300 + 8 and scan.documents == 7


def test_tokenize_repeats_each_document_by_its_capped_cluster_size(tmp_path):
    import numpy as np

    from tokenmill.cli import main

    curated = tmp_path / "curated"
    _write_cell(
        curated / "domain=web" / "quality=0" / "part-00000-of-00001.parquet", {"a": 1, "b": 3, "c": 10}
    )
    tokenizer = tmp_path / "tokenizer.json"
    assert (
        main(
            ["tokenizer", "train", "--input", str(curated), "--vocab-size", "300", "--output", str(tokenizer)]
        )
        == 0
    )
    common = ["tokenize", "--input", str(curated), "--tokenizer", str(tokenizer), "--heldout-fraction", "0"]
    assert main([*common, "--output", str(tmp_path / "once"), "--workers", "1"]) == 0
    flags = ["--repeat-by-cluster-size", "4", "--workers", "1"]
    assert main([*common, "--output", str(tmp_path / "repeated"), *flags]) == 0

    def documents(output: Path) -> list[list[int]]:
        cell = output / "domain=web" / "quality=0"
        ends = np.fromfile(cell / "part-00000.idx", dtype="<u8")
        manifest = json.loads((cell / "manifest.json").read_text())
        tokens = np.fromfile(cell / "part-00000.bin", dtype=manifest["dtype"])
        return [tokens[start:end].tolist() for start, end in zip([0, *ends[:-1]], ends, strict=True)]

    once, repeated = documents(tmp_path / "once"), documents(tmp_path / "repeated")
    # a once, b three times, c four (its 10 capped at 4), each copy right after the document.
    assert repeated == [once[0], *[once[1]] * 3, *[once[2]] * 4]
    counts = json.loads((tmp_path / "repeated" / "counts.json").read_text())
    assert counts["cells"]["domain=web/quality=0"]["tokens"] == sum(len(document) for document in repeated)
    # A resumed run with another cap does not keep the shard made with this one.
    assert main([*common, "--output", str(tmp_path / "repeated"), "--resume", "--workers", "1"]) == 0
    assert documents(tmp_path / "repeated") == once
