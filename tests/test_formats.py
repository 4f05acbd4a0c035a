"""tokenmill.formats: every file format's reader refuses a bad file naming the file and the field, and every
writer gives the bytes the format fixes (sorted keys, indent 2), locally and on an fsspec filesystem."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import zstandard

from tokenmill.errors import FormatError
from tokenmill.formats import cards, plan, rejected, runs, stats, tokens


def canonical(value: object) -> bytes:
    """The bytes storage.write_json gives: what every writer wrote before tokenmill.formats existed."""
    return (json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


COUNTS = {
    "format_version": 1,
    "tokenizer": {"name": "bpe-8k", "sha256": "ab" * 32, "vocab_size": 8192},
    "total_tokens": 30,
    "total_documents": 3,
    "cells": {
        "domain=web/quality=3": {
            "tokens": 20,
            "documents": 2,
            "manifest": "domain=web/quality=3/manifest.json",
        },
        "domain=code/quality=0": {
            "tokens": 10,
            "documents": 1,
            "manifest": "domain=code/quality=0/manifest.json",
        },
    },
}
SHARD = {
    "name": "part-00000",
    "documents": 2,
    "tokens": 20,
    "bin_sha256": "b" * 64,
    "idx_sha256": "c" * 64,
    "source_files": ["part-00000-of-00001.parquet"],
}
MANIFEST = {
    "format_version": 1,
    "cell": "domain=web/quality=3",
    "tokenizer": COUNTS["tokenizer"],
    "dtype": "uint16",
    "eos_id": 0,
    "documents": 2,
    "tokens": 20,
    "shards": [SHARD],
}


def write(path: Path, value: object) -> str:
    path.write_text(json.dumps(value))
    return str(path)


# -- token shards' JSON ------------------------------------------------------------------------------------


def test_counts_and_manifest_write_the_bytes_of_the_format_and_read_back(tmp_path: Path) -> None:
    counts = tokens.counts_from_json(COUNTS)
    tokens.write_counts(str(tmp_path / "counts.json"), counts)
    assert (tmp_path / "counts.json").read_bytes() == canonical(COUNTS)
    assert tokens.read_counts(str(tmp_path / "counts.json")) == counts
    manifest = tokens.CellManifest.model_validate(MANIFEST)
    tokens.write_manifest(str(tmp_path / "manifest.json"), manifest)
    assert (tmp_path / "manifest.json").read_bytes() == canonical(MANIFEST)
    assert tokens.read_manifest(str(tmp_path / "manifest.json")).shards[0].tokens == 20


def test_a_marker_is_a_manifest_entry_and_what_it_was_made_with(tmp_path: Path) -> None:
    fields = {
        "format_version": 1,
        "cell": "domain=web/quality=3",
        "tokenizer_sha256": "ab" * 32,
        "dtype": "uint32",
        "eos_id": 2,
        "source_sha256": "d" * 64,
    }
    marker = tokens.ShardMarker.model_validate({**SHARD, **fields})
    path = str(tmp_path / "part-00000.done.json")
    tokens.write_marker(path, marker)
    assert (tmp_path / "part-00000.done.json").read_bytes() == canonical({**SHARD, **fields})
    assert tokens.read_marker(path).entry().to_json() == SHARD


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"cells": {"domain=web/quality=3": {"tokens": -1}}},
            "cells.domain=web/quality=3.tokens: expected a whole",
        ),
        ({"cells": {"domain=web/quality=3": {"tokens": True}}}, "got True"),
        ({"cells": {"domain=web/quality=3": {"tokens": "12"}}}, "got '12'"),
        ({"cells": {"domain=web/quality=3": {"documents": 1}}}, "cells.domain=web/quality=3 has no 'tokens'"),
        ({"format_version": 2}, "format version 2, but this reader expects 1"),
        ({"tokenizer": {"name": "x"}}, "tokenizer has no 'sha256', 'vocab_size'"),
        ({"cells": []}, "cells: Input should be a valid dictionary"),
    ],
)
def test_counts_that_break_the_format_name_the_file_and_field(
    tmp_path: Path, edit: dict, message: str
) -> None:
    path = write(tmp_path / "counts.json", {**COUNTS, **edit})
    with pytest.raises(FormatError) as caught:
        tokens.read_counts(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert message in str(caught.value)


def test_a_file_that_is_not_json_or_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "counts.json").write_bytes(b'{"cells": {\xff')
    with pytest.raises(FormatError, match=r"counts.json: not valid JSON"):
        tokens.read_counts(str(tmp_path / "counts.json"))
    path = write(tmp_path / "list.json", [COUNTS])
    with pytest.raises(FormatError, match=r"list.json: not a JSON object"):
        tokens.read_counts(path)
    with pytest.raises(FileNotFoundError):
        tokens.read_counts(str(tmp_path / "missing.json"))


def test_a_manifest_of_another_token_type_is_refused(tmp_path: Path) -> None:
    path = write(
        tmp_path / "manifest.json", {**MANIFEST, "dtype": "int8", "shards": [{**SHARD, "tokens": 1.5}]}
    )
    with pytest.raises(FormatError) as caught:
        tokens.read_manifest(path)
    assert "dtype: Input should be 'uint16' or 'uint32', got 'int8'" in str(caught.value)
    assert "shards[0].tokens: expected a whole number >= 0, got 1.5" in str(caught.value)


def test_hundreds_of_problems_are_cut_to_the_first_few(tmp_path: Path) -> None:
    bad = {f"domain=d{i}/quality=0": {"tokens": -i - 1} for i in range(500)}
    path = write(tmp_path / "counts.json", {**COUNTS, "cells": bad})
    with pytest.raises(FormatError) as caught:
        tokens.read_counts(path)
    assert str(caught.value).endswith("and 495 more problems")
    assert len(str(caught.value)) < 1000


def test_a_catalog_of_many_cells_reads_quickly(tmp_path: Path) -> None:
    cells = {
        f"domain=d{i}/quality={i % 5}": {"tokens": i, "documents": 1, "manifest": "m"} for i in range(50_000)
    }
    path = write(tmp_path / "counts.json", {**COUNTS, "cells": cells})
    import time

    started = time.perf_counter()
    assert len(tokens.read_counts(path).cells) == 50_000
    assert time.perf_counter() - started < 5


def test_formats_go_through_fsspec_filesystems() -> None:
    counts = tokens.counts_from_json(COUNTS)
    tokens.write_counts("memory://formats-test/tokens/counts.json", counts)
    assert tokens.read_counts("memory://formats-test/tokens/counts.json") == counts


# -- the mixture plan ---------------------------------------------------------------------------------------

OLD_PLAN = {  # the format's first table only: a plan saved before the added fields
    "name": "demo",
    "tokenizer": "bpe",
    "total_tokens": 4096,
    "sequence_length": 128,
    "batch_size": 4,
    "block_size": 4,
    "tokens_per_step": 512,
    "phases": [
        {
            "name": "pretraining",
            "tokens": 4096,
            "steps": 8,
            "start_step": 0,
            "end_step": 8,
            "sources": [
                {"name": "web", "cells": ["domain=web/quality=3"], "weight": 1.0, "tokens": 4096,
                 "tokens_available": 1000, "epochs": 4.096},
            ],
        }
    ],
}  # fmt: skip


def test_an_older_plan_reads_and_writes_back_unchanged(tmp_path: Path) -> None:
    path = write(tmp_path / "plan.json", OLD_PLAN)
    read = plan.read_plan(path)
    assert read.phase("pretraining").source("web").block_sequences is None and read.sources == {}
    assert read.to_json() == OLD_PLAN
    plan.write_plan(str(tmp_path / "again.json"), read)
    assert (tmp_path / "again.json").read_bytes() == canonical(OLD_PLAN)


def test_a_plan_names_every_missing_field_of_an_object_at_once(tmp_path: Path) -> None:
    broken = json.loads(json.dumps(OLD_PLAN))
    del broken["phases"][0]["sources"][0]["cells"], broken["phases"][0]["steps"], broken["batch_size"]
    broken["phases"][0]["sources"][0]["epochs"] = "4"
    path = write(tmp_path / "plan.json", broken)
    with pytest.raises(FormatError) as caught:
        plan.read_plan(path)
    assert str(caught.value) == (
        f"{path}: no 'batch_size'; phases[0] has no 'steps'; phases[0].sources[0] has no 'cells'; "
        "phases[0].sources[0].epochs: Input should be a valid number, got '4'"
    )
    with pytest.raises(FormatError, match="phases: empty"):
        plan.plan_from_json({**OLD_PLAN, "phases": []}, "p.json")


# -- stats.json ---------------------------------------------------------------------------------------------

TOTALS = {"documents": 3, "characters": 30, "tokens_estimated": 7}
STATS = {
    "format_version": 1,
    "recipe": "configs/curate/web.yaml",
    "recipe_name": "web",
    "inputs": ["a.jsonl"],
    "chars_per_token": 4.0,
    "read": TOTALS,
    "kept": TOTALS,
    "removed": {"documents": 0, "characters": 0, "tokens_estimated": 0},
    "rejected": {"documents": 0},
    "balanced": True,
    "funnel": [{"stage": "read", **TOTALS}, {"stage": "heuristics", "removed_documents": 0, **TOTALS}],
    "removed_by_reason": {},
    "rejected_by_error": {},
    "cells": {"domain=web/quality=3": TOTALS},
    "sources": {"a.jsonl": {"read": 3, "kept": 3, "removed": 0, "rejected": 0}},
    "files": {"curated/domain=web/quality=3/part-00000-of-00001.parquet": 3},
    "stages": {"fuzzy_dedupe": {"pairs": 0, "sizes": {"1": 3}}},
}


def test_stats_write_back_byte_for_byte(tmp_path: Path) -> None:
    path = write(tmp_path / "stats.json", STATS)
    read = stats.read_stats(path)
    assert read.funnel[0].removed_documents is None and read.stages["fuzzy_dedupe"]["sizes"] == {"1": 3}
    stats.write_stats(str(tmp_path / "again.json"), read)
    assert (tmp_path / "again.json").read_bytes() == canonical(STATS)


def test_stats_with_a_count_that_is_not_a_count(tmp_path: Path) -> None:
    path = write(tmp_path / "stats.json", {**STATS, "kept": {**TOTALS, "documents": 2.5}})
    with pytest.raises(
        FormatError, match=r"stats.json: kept.documents: expected a whole number >= 0, got 2.5"
    ):
        stats.read_stats(path)


# -- rejected input -----------------------------------------------------------------------------------------

RECORD = {
    "file": "raw/a.jsonl",
    "line": 7,
    "offset": 120,
    "error": "raw/a.jsonl:7: not JSON",
    "error_kind": "bad_json",
    "raw": "{oops",
    "raw_base64": None,
    "raw_truncated": False,
}


def test_rejected_records_round_trip_and_keep_the_writer_bytes(tmp_path: Path) -> None:
    path = str(tmp_path / "part-00000-of-00001.jsonl.zst")
    binary = {**RECORD, "line": None, "raw": None, "raw_base64": "/w==", "error_kind": "bad_utf8"}
    rejected.write_rejected(path, [RECORD, binary])
    lines = zstandard.ZstdDecompressor().decompress(Path(path).read_bytes())
    expected = b"".join(
        json.dumps(r, sort_keys=True, ensure_ascii=False).encode() + b"\n" for r in (RECORD, binary)
    )
    assert lines == expected
    assert [(n, r.to_json()) for n, r in rejected.read_rejected(path)] == [(1, RECORD), (2, binary)]


def test_rejected_files_that_are_cut_short_or_hold_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "part-00000-of-00001.jsonl.zst"
    rejected.write_rejected(str(path), [RECORD] * 2000)
    path.write_bytes(path.read_bytes()[:-7])
    with pytest.raises(FormatError, match="cannot decompress|not JSON"):
        list(rejected.read_rejected(str(path)))
    plain = tmp_path / "part-00000-of-00001.jsonl"
    plain.write_text(json.dumps(RECORD) + "\n\n" + json.dumps({**RECORD, "line": -3}) + "\n")
    with pytest.raises(FormatError, match=r"jsonl: line 3: line: expected a whole number >= 0, got -3"):
        list(rejected.read_rejected(str(plain)))
    with pytest.raises(FormatError, match="error_kind"):
        rejected.write_rejected(str(tmp_path / "bad.jsonl.zst"), [{**RECORD, "error_kind": None}])


# -- runs ----------------------------------------------------------------------------------------------------


def test_metrics_keep_nan_extra_keys_and_the_trainer_line(tmp_path: Path) -> None:
    row = {
        "step": 3,
        "phase": "pretraining",
        "loss": math.nan,
        "lr": 1e-3,
        "expert_load": [[0.5, 0.5]],
        "aux": 2,
    }
    line = runs.metrics_line(row)
    assert line == json.dumps(row) + "\n"
    (tmp_path / "metrics.jsonl").write_text(runs.metrics_line({**row, "step": 4}) + line)
    first, second = runs.read_metrics(str(tmp_path / "metrics.jsonl"))
    assert (first.step, second.step) == (3, 4) and math.isnan(first.loss) and first.value("aux") == 2
    assert first.value("mfu") is None


def test_metrics_rows_that_break_the_format_name_the_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "loss": 1.0}\n{"step": "1", "loss": 1.0}\n')
    with pytest.raises(
        FormatError, match=r"metrics.jsonl: line 2: step: expected a whole number >= 0, got '1'"
    ):
        runs.read_metrics(str(path))
    path.write_text('{"step": 0, "loss": 1.0}\n{"loss": 1.0}\n')
    with pytest.raises(FormatError, match=r"line 2: no 'step'"):
        runs.read_metrics(str(path))
    with pytest.raises(FormatError, match="expert_load"):
        runs.metrics_line({"step": 1, "expert_load": [0.5, 0.5]})


def test_run_record_keeps_every_key_and_checks_the_records(tmp_path: Path) -> None:
    record = {
        "model": {"name": "tiny"},
        "optimizer": {"lr": 0.01},
        "params": {"total_params": 10},
        "plan": None,
    }
    runs.write_run_record(str(tmp_path / "config.json"), record)
    assert (tmp_path / "config.json").read_text() == json.dumps(record, indent=2) + "\n"
    assert runs.read_run_record(str(tmp_path / "config.json")).to_json() == record
    path = write(tmp_path / "bad.json", {**record, "flops_per_token": "many"})
    with pytest.raises(FormatError, match=r"bad.json: flops_per_token: Input should be a valid number"):
        runs.read_run_record(path)


# -- classifier models --------------------------------------------------------------------------------------


def test_calibration_needs_cuts_for_all_domains_and_one_per_quantile(tmp_path: Path) -> None:
    good = {"positive_label": "hq", "quantiles": [0.2, 0.4, 0.6, 0.8], "cuts": {"*": [0.1, 0.2, 0.3, 0.4]},
            "documents": {"web": 30}}  # fmt: skip
    path = write(tmp_path / "calibration.json", good)
    assert cards.read_calibration(path).cuts["*"] == [0.1, 0.2, 0.3, 0.4]
    path = write(tmp_path / "calibration.json", {**good, "cuts": {"web": [0.1, 0.2, 0.3, 0.4]}})
    with pytest.raises(FormatError, match=r"calibration.json: cuts: no '\*' entry"):
        cards.read_calibration(path)
    path = write(tmp_path / "calibration.json", {**good, "cuts": {"*": [0.1, 0.2, 0.3, 0.4], "code": [0.5]}})
    with pytest.raises(FormatError, match="4 cuts per domain expected .* for code"):
        cards.read_calibration(path)


def test_a_model_card_round_trips(tmp_path: Path) -> None:
    card = {
        "name": "domain",
        "kind": "domain",
        "labels": ["code", "web"],
        "positive_label": None,
        "data": {"path": "d.jsonl", "sha256": "e" * 64, "examples": 10, "train": 9, "holdout": 1, "seed": 0},
        "parameters": {"dim": 32, "lr": 0.5, "loss": "softmax", "thread": 1},
        "holdout_metrics": {"accuracy": 1.0, "examples": 1,
                            "labels": {"web": {"precision": 1.0, "recall": 1.0, "support": 1}}},
        "model_sha256": "f" * 64,
    }  # fmt: skip
    cards.write_card(str(tmp_path / "model.json"), cards.ClassifierCard.model_validate(card))
    assert (tmp_path / "model.json").read_bytes() == canonical(card)
    assert cards.read_card(str(tmp_path / "model.json")).kind == "domain"
