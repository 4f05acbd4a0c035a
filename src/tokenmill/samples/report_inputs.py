"""Report inputs written from scratch, following docs/formats.md, so that the report can be built, tested
and benchmarked without curate, tokenize, the planner or the trainer.

`make_report_inputs` writes curate output (curated/, removed/, rejected/, stats.json), tokenize output
(counts.json and a manifest per cell), a mixture plan and an earlier revision of it, and a run folder
(metrics.jsonl, config.json and eval.jsonl: each domain's held-out slice and an external set). It
scales from a handful of cells to 200 cells and 10,000 samples for the benchmark. With `hostile=True` one
small cell holds documents written to break a page: script tags, a closing textarea, `javascript:` URLs,
broken HTML; the cell is small enough that every one of them is among its samples.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tokenmill.formats.documents import DOCUMENT_SCHEMA, REMOVED_SCHEMA, cluster_size_bin
from tokenmill.formats.evals import EVAL, averages, eval_line, set_record

BASE_DOMAINS = (
    "web",
    "code",
    "math",
    "science",
    "books",
    "news",
    "forum",
    "legal",
    "medical",
    "wiki",
    "patents",
    "finance",
)
WORDS = (
    "the of and to in model data token corpus quality filter train mixture expert router language text "
    "document source sample cell domain phase budget epoch loss rate step batch sequence window shard "
    "manifest count weight curve metric learn value signal noise pattern structure research analysis "
    "system method result theory proof function variable matrix vector network layer attention"
).split()
SOURCES = ("crawl-2024.jsonl.zst", "crawl-2025.jsonl.zst", "books.parquet", "papers.jsonl", "forums.warc.gz")
CHARS_PER_TOKEN = 4.0

# Each of these is a document's text (and URL) written to break a page that pastes it in as HTML.
HOSTILE = (
    (
        "<script>window.__pwned = (window.__pwned || 0) + 1; document.title = 'pwned'</script>HOSTILE-SCRIPT",
        None,
    ),
    (
        "</textarea></pre></div></details></article></section></main><b>broken <i>html <!-- HOSTILE-TEXTAREA",
        "javascript:window.__pwned=1",
    ),
    (
        '<img src=x onerror="window.__pwned=1"> "quotes" & \'ampersands\' {{ 7*7 }} {% raw %} HOSTILE-IMG',
        'https://example.org/a?b=1&c=<2>"onmouseover="window.__pwned=1',
    ),
    (
        "]]></svg><svg onload=window.__pwned=1></svg>\u202eevil\u202c "
        "</script><style>body{display:none}</style>",
        None,
    ),
)
HOSTILE_DOMAIN = "web"
HOSTILE_QUALITY = 0
#: Markup that the page must show as text, in the records beside the documents (a repeated line, a
#: license, a decontam example).
HOSTILE_MARKUP = "<script>window.__pwned=1</script>"
#: Duplicate-cluster sizes of the curated rows, by row number (a cycle: most documents stand for one).
CLUSTER_SIZES = (1, 1, 2, 1, 1, 1, 6, 1, 1, 3, 1, 1, 1, 1, 17)
#: What the fixture's pii stage does with each kind (recipe `pii:`): phones are flagged, the rest masked.
PII_ACTIONS = {
    "email": "masked",
    "phone": "flagged",
    "ip": "masked",
    "credit_card": "masked",
    "iban": "masked",
}
#: The fixture's decontam matches: removed documents (by number) and the one flagged, kept document, each
#: with its matches per evaluation set as (set, kind); stats.json's `stages.decontam` counts these.
DECONTAM_REMOVED = (
    (("gsm8k-test", "verbatim"),),
    (("gsm8k-test", "verbatim"), ("mmlu-test", "partial")),
    (("mmlu-test", "verbatim"),),
)
DECONTAM_FLAGGED = (("gsm8k-test", "edited"),)


@dataclass(frozen=True)
class ReportInputs:
    root: Path
    curate: Path
    tokens: Path
    plan: Path
    previous_plan: Path
    run: Path
    domains: tuple[str, ...]
    cells: tuple[str, ...]


def domain_names(count: int) -> list[str]:
    names = list(BASE_DOMAINS[:count])
    k = 2
    while len(names) < count:
        names.extend(f"{d}-{k}" for d in BASE_DOMAINS[: count - len(names)])
        k += 1
    return names


def _text(rng: random.Random, words: int) -> str:
    paragraphs = []
    remaining = words
    while remaining > 0:
        n = min(remaining, rng.randint(20, 90))
        sentence = " ".join(rng.choice(WORDS) for _ in range(n))
        paragraphs.append(sentence[0].upper() + sentence[1:] + ".")
        remaining -= n
    return "\n\n".join(paragraphs)


def _row(
    doc_id: str, text: str, source: str, url: str | None, domain: str | None, quality: int | None, rng
) -> dict:
    return {
        "id": doc_id,
        "text": text,
        "source": source,
        "url": url,
        "metadata": json.dumps({"crawl": "fixture"}),
        "language": "en",
        "language_score": round(rng.uniform(0.6, 1.0), 3),
        "quality_score": round(rng.uniform(0, 1), 3) if quality is not None else None,
        "quality": quality,
        "domain": domain,
        "domain_score": round(rng.uniform(0.5, 1.0), 3) if domain is not None else None,
        "n_chars": len(text),
        "n_words": len(text.split()),
        "dup_cluster": None,
        "dup_cluster_size": None,
        "pii": None,
    }


def pii_finds(number: int) -> dict[str, int]:
    """The `pii` column of the fixture's curated row `number` in its cell: finds in 1 row of 4."""
    if number % 4 != 1:
        return dict.fromkeys(PII_ACTIONS, 0)
    return {
        "email": 1 + number % 3,
        "phone": number % 2,
        "ip": int(number % 5 == 0),
        "credit_card": 0,
        "iban": 0,
    }


def _contamination(matches: Sequence[tuple[str, str]], action: str) -> dict[str, Any]:
    """The decontam stage's annotation of a document (as in removed/ `detail` and kept `metadata`)."""
    described = [
        {"eval_set": name, "file": f"evals/{name}.jsonl", "line": 7 + i, "match": kind, "coverage": 1.0
         if kind == "verbatim" else 0.8, "words": 20, "of": 20 if kind == "verbatim" else 25, "paragraph": 1}
        for i, (name, kind) in enumerate(matches)
    ]  # fmt: skip
    return {
        "eval_sets": [name for name, _ in matches],
        "coverage": 1.0,
        "matches": described,
        "action": action,
    }


def _write_parquet(path: Path, rows: list[dict], schema: pa.Schema, row_group_size: int = 64) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist(sorted(rows, key=lambda r: r["id"]), schema=schema)
    pq.write_table(table, path, compression="zstd", row_group_size=row_group_size)


def _tokens_for(chars: int) -> int:
    return int(chars // CHARS_PER_TOKEN)


def make_report_inputs(
    root: Path,
    *,
    domains: int = 4,
    docs_per_cell: int = 8,
    words_per_doc: tuple[int, int] = (40, 160),
    hostile: bool = True,
    missing_cells: bool = True,
    seed: int = 0,
    steps: int = 400,
    layers: int = 2,
    experts: int = 8,
    files_per_cell: int = 2,
    names: Sequence[str] | None = None,
) -> ReportInputs:
    """Write a full set of report inputs under `root` and return where each is."""
    rng = random.Random(seed)
    curate = root / "curate"
    tokens_dir = root / "tokens"
    names = list(names) if names else domain_names(domains)  # e.g. topic domains c00, c01, ...
    cells: list[str] = []
    cell_stats: dict[str, dict[str, int]] = {}
    source_stats: dict[str, dict[str, int]] = {
        s: {"read": 0, "kept": 0, "removed": 0, "rejected": 0} for s in SOURCES
    }
    counts_cells: dict[str, dict[str, Any]] = {}
    tokenizer = {"name": "tokenmill-bpe-8k", "sha256": "ab" * 32, "vocab_size": 8192}
    for d_index, domain in enumerate(names):
        for quality in range(5):
            # Leave a few cells empty so that the heatmap shows holes.
            if missing_cells and d_index % 3 == 2 and quality == 1:
                continue
            cell = f"domain={domain}/quality={quality}"
            hostile_cell = hostile and domain == HOSTILE_DOMAIN and quality == HOSTILE_QUALITY
            # Cells differ in size by orders of magnitude, like real data.
            n_docs = len(HOSTILE) if hostile_cell else max(1, int(docs_per_cell * (0.5 + rng.random())))
            rows = []
            for i in range(n_docs):
                source = SOURCES[(d_index + i * (quality + 1)) % len(SOURCES)]
                if hostile_cell:
                    text, url = HOSTILE[i]
                    source = "<b>hostile</b>.jsonl"
                else:
                    text = _text(rng, rng.randint(*words_per_doc))
                    url = f"https://{domain}.example.org/doc/{quality}/{i}" if i % 4 else None
                row = _row(f"{domain}-{quality}-{i:06d}", text, source, url, domain, quality, rng)
                # Not drawn from rng, so that the rows' texts and samples stay what they were.
                row["dup_cluster_size"] = CLUSTER_SIZES[(i + quality) % len(CLUSTER_SIZES)]
                row["pii"] = pii_finds(i)
                if d_index == 0 and quality == 4 and i == 0:  # the decontam stage's flagged document
                    row["text"] = "An opening paragraph.\n\nFLAGGED-DECONTAM " + row["text"]
                    row["n_chars"] = len(row["text"])
                    row["metadata"] = json.dumps(
                        {"contamination": _contamination(DECONTAM_FLAGGED, "flag"), "crawl": "fixture"}
                    )
                rows.append(row)
                source_stats.setdefault(source, {"read": 0, "kept": 0, "removed": 0, "rejected": 0})
                source_stats[source]["read"] += 1
                source_stats[source]["kept"] += 1
            rows.sort(key=lambda r: r["id"])
            parts = max(1, min(files_per_cell, len(rows)))
            per_file = math.ceil(len(rows) / parts)
            for part in range(parts):
                chunk = rows[part * per_file : (part + 1) * per_file]
                if chunk:
                    name = f"part-{part:05d}-of-{parts:05d}.parquet"
                    _write_parquet(curate / "curated" / cell / name, chunk, DOCUMENT_SCHEMA)
            chars = sum(r["n_chars"] for r in rows)
            tokens = sum(_tokens_for(r["n_chars"]) + 1 for r in rows)  # + end-of-text per document
            cell_stats[cell] = {
                "documents": len(rows),
                "characters": chars,
                "tokens_estimated": tokens - len(rows),
            }
            manifest = {
                "format_version": 1,
                "cell": cell,
                "tokenizer": tokenizer,
                "dtype": "uint16",
                "eos_id": 0,
                "documents": len(rows),
                "tokens": tokens,
                "shards": [
                    {
                        "name": "part-00000",
                        "documents": len(rows),
                        "tokens": tokens,
                        "bin_sha256": hex_digest(cell + "bin"),
                        "idx_sha256": hex_digest(cell + "idx"),
                        "source_files": [f"part-{p:05d}-of-{parts:05d}.parquet" for p in range(parts)],
                    }
                ],
            }
            (tokens_dir / cell).mkdir(parents=True, exist_ok=True)
            (tokens_dir / cell / "manifest.json").write_text(
                json.dumps(manifest, indent=2, sort_keys=True) + "\n"
            )
            counts_cells[cell] = {
                "tokens": tokens,
                "documents": len(rows),
                "manifest": f"{cell}/manifest.json",
            }
            cells.append(cell)
    counts = {
        "format_version": 1,
        "tokenizer": tokenizer,
        "total_tokens": sum(c["tokens"] for c in counts_cells.values()),
        "total_documents": sum(c["documents"] for c in counts_cells.values()),
        "cells": dict(sorted(counts_cells.items())),
    }
    (tokens_dir / "counts.json").write_text(json.dumps(counts, indent=2, sort_keys=True) + "\n")

    removed = _write_removed(curate, rng, hostile, source_stats)
    rejected = _write_rejected(curate, hostile, source_stats)

    def finds(folder: Path) -> list[dict]:
        tables = [
            pq.read_table(path, columns=["dup_cluster_size", "pii"])
            for path in sorted(folder.rglob("*.parquet"))
        ]
        return [row for table in tables for row in table.to_pylist()]

    kept_rows, pii_removed = finds(curate / "curated"), finds(curate / "removed" / "stage=pii")
    _provenance(source_stats, hostile)
    _write_stats(
        curate, cell_stats, removed, rejected, source_stats, _stage_stats(kept_rows, pii_removed, hostile)
    )
    plan, previous = make_plans(counts)
    (root / "plan.json").write_text(json.dumps(plan, indent=2, sort_keys=True) + "\n")
    (root / "previous-plan.json").write_text(json.dumps(previous, indent=2, sort_keys=True) + "\n")
    run = _write_run(
        root / "runs" / "fixture-run", plan, steps=steps, layers=layers, experts=experts, seed=seed
    )
    write_eval(run, names, plan, steps=steps, seed=seed)
    return ReportInputs(
        root=root,
        curate=curate,
        tokens=tokens_dir,
        plan=root / "plan.json",
        previous_plan=root / "previous-plan.json",
        run=run,
        domains=tuple(names),
        cells=tuple(cells),
    )


def hex_digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


REMOVAL_REASONS = (
    ("language", "not_english", 9),
    ("heuristics", "too_short", 7),
    ("heuristics", "repetition", 4),
    ("exact_dedupe", "exact_duplicate", 5),
    ("decontam", "contaminated", len(DECONTAM_REMOVED)),
    ("pii", "pii_density", 2),
)


def _write_removed(
    curate: Path, rng: random.Random, hostile: bool, source_stats
) -> dict[str, dict[str, int]]:
    removed = {}
    for stage, reason, n in REMOVAL_REASONS:
        rows = []
        for i in range(n):
            text = _text(rng, rng.randint(5, 40))
            detail = {"filter": reason, "value": round(rng.random(), 3)}
            if stage == "exact_dedupe":
                detail = {"kept_id": f"web-3-{i:06d}"}
            if hostile and i == 0 and stage not in ("decontam", "pii"):
                text = "<script>window.__pwned=1</script>removed HOSTILE-REMOVED"
                detail = {"filter": "</script><script>window.__pwned=1</script>"}
            finds = None
            if stage == "decontam":  # the matched item is the second paragraph
                item = (
                    f"{HOSTILE_MARKUP} HOSTILE-DECONTAM {i}" if hostile else f"Question {i}: what is 6 x 7?"
                )
                text = f"An unrelated opening.\n\n{item}\n\nAnd a closing paragraph."
                detail = _contamination(DECONTAM_REMOVED[i], "remove")
            elif stage == "pii":  # a contact list, its finds masked
                finds = {"email": 8 + i, "phone": 3, "ip": 0, "credit_card": 0, "iban": 0}
                text = "Contacts: " + " ".join(
                    ["|||EMAIL_ADDRESS|||"] * finds["email"] + ["|||PHONE_NUMBER|||"] * 3
                )
                detail = {"kinds": ["email"], "counts": {k: v for k, v in finds.items() if v}}
            source = SOURCES[i % len(SOURCES)]
            row = _row(f"removed-{stage}-{i:05d}", text, source, None, None, None, rng)
            row["detail"] = json.dumps(detail)
            row["pii"] = finds
            rows.append(row)
            source_stats[source]["read"] += 1
            source_stats[source]["removed"] += 1
        _write_parquet(
            curate / "removed" / f"stage={stage}" / f"reason={reason}" / "part-00000-of-00001.parquet",
            rows,
            REMOVED_SCHEMA,
        )
        chars = sum(r["n_chars"] for r in rows)
        removed[f"{stage}/{reason}"] = {
            "stage": stage,
            "reason": reason,
            "documents": n,
            "characters": chars,
            "tokens_estimated": sum(_tokens_for(r["n_chars"]) for r in rows),
        }
    return removed


def _write_rejected(curate: Path, hostile: bool, source_stats) -> dict[str, int]:
    import zstandard

    records = [
        {
            "file": "crawl-2024.jsonl.zst",
            "line": 17,
            "offset": None,
            "error": "line 17 is not JSON",
            "error_kind": "bad_json",
            "raw": '{"text": "unterminated',
        },
        {
            "file": "crawl-2024.jsonl.zst",
            "line": 99,
            "offset": None,
            "error": "line 99 is not JSON",
            "error_kind": "bad_json",
            "raw": "</script><script>window.__pwned=1</script>HOSTILE-REJECTED" if hostile else "{{{",
        },
        {
            "file": "crawl-2025.jsonl.zst",
            "line": 3,
            "offset": None,
            "error": "line 3 is not UTF-8",
            "error_kind": "bad_utf8",
            "raw_base64": "//79",
        },
        {
            "file": "papers.jsonl",
            "line": 5,
            "offset": None,
            "error": "no text field",
            "error_kind": "missing_text",
            "raw": '{"title": "no text here"}',
        },
    ]
    path = curate / "rejected" / "part-00000-of-00001.jsonl.zst"
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records).encode()
    buffer = io.BytesIO()
    buffer.write(zstandard.ZstdCompressor().compress(payload))
    path.write_bytes(buffer.getvalue())
    kinds: dict[str, int] = {}
    for record in records:
        kinds[record["error_kind"]] = kinds.get(record["error_kind"], 0) + 1
        source_stats.setdefault(record["file"], {"read": 0, "kept": 0, "removed": 0, "rejected": 0})
        source_stats[record["file"]]["read"] += 1
        source_stats[record["file"]]["rejected"] += 1
    return kinds


def _stage_stats(kept_rows: list[dict], pii_removed: list[dict], hostile: bool) -> dict[str, Any]:
    """stats.json's `stages`, as the stages would count the fixture's files: decontam per evaluation set,
    pii per kind, dedupe_clusters' sizes, and line_boilerplate's report per source (its repeated lines
    written here: the fixture's texts have none)."""
    per_set: dict[str, dict[str, int]] = {}
    for matches in (*DECONTAM_REMOVED, DECONTAM_FLAGGED):
        for name, kind in matches:
            counts = per_set.setdefault(name, {"documents": 0})
            counts["documents"] += 1
            counts[kind] = counts.get(kind, 0) + 1
    with_pii = [row["pii"] for row in kept_rows if any(row["pii"].values())]
    pii: dict[str, Any] = {
        "documents": len(kept_rows) + len(pii_removed),
        "documents_with_pii": len(with_pii) + len(pii_removed),
        "documents_masked": sum(
            1 for found in with_pii if any(found[k] for k, a in PII_ACTIONS.items() if a == "masked")
        ),
        "documents_removed": len(pii_removed),
    }
    for kind, action in PII_ACTIONS.items():
        for outcome, rows in ((action, with_pii), ("removed", [row["pii"] for row in pii_removed])):
            if sum(found[kind] for found in rows):
                pii.setdefault(kind, {})[outcome] = sum(found[kind] for found in rows)
    sizes = [row["dup_cluster_size"] for row in kept_rows if row["dup_cluster_size"] > 1]
    histogram: dict[str, int] = {}
    for size in sizes:
        histogram[cluster_size_bin(size)] = histogram.get(cluster_size_bin(size), 0) + 1
    repeated = f"{HOSTILE_MARKUP} Accept cookies HOSTILE-LINE" if hostile else "Accept cookies"
    boilerplate_sources = {
        "source:crawl-2024.jsonl.zst": {
            "documents": 120, "characters": 96_000, "documents_counted": 120, "frequent_lines": 14,
            "lines_removed": 1_450, "characters_removed": 21_300, "documents_edited": 110,
            "documents_removed": 4,
            "top_lines": [{"text": "Home | About | Contact", "documents": 118},
                          {"text": repeated, "documents": 97}, {"text": None, "documents": 40}],
        },
        "source:forums.warc.gz": {
            "documents": 60, "characters": 30_000, "documents_counted": 60, "frequent_lines": 2,
            "lines_removed": 80, "characters_removed": 1_900, "documents_edited": 40, "documents_removed": 0,
            "top_lines": [{"text": "Reply · Quote · Report", "documents": 40}],
        },
    }  # fmt: skip
    totals = (
        "frequent_lines",
        "lines_removed",
        "characters_removed",
        "documents_edited",
        "documents_removed",
    )
    return {
        "decontam": {
            # It checks what it removes and what later stages (pii) see.
            "documents": len(kept_rows) + len(pii_removed) + len(DECONTAM_REMOVED),
            "contaminated": len(DECONTAM_REMOVED) + 1,
            "eval_sets": dict(sorted(per_set.items())),
        },
        "pii": pii,
        "dedupe_clusters": {
            "removals_followed": sum(size - 1 for size in sizes),
            "kept_id_moved": 1,
            "removed_with_representative": 0,
            "clusters": len(sizes),
            "documents_in_clusters": sum(sizes),
            "largest_cluster": max(sizes, default=0),
            "cluster_sizes": dict(sorted(histogram.items())),
        },
        "line_boilerplate": {
            "documents_counted": 180,
            "sources_with_boilerplate": len(boilerplate_sources),
            **{key: sum(entry[key] for entry in boilerplate_sources.values()) for key in totals},
            "sources": boilerplate_sources,
        },
    }


def _provenance(source_stats: dict[str, dict[str, Any]], hostile: bool) -> None:
    """License and provenance for some sources, as a recipe's `sources:` table and the records' own license
    field give them (stats.json `sources`); with `hostile`, markup and a javascript: URL among them."""
    source_stats["crawl-2024.jsonl.zst"].update(
        license="CC-BY-4.0", provenance="https://crawl.example.org/2024"
    )
    source_stats["papers.jsonl"].update(
        license="CC-BY-4.0 OR MIT", licenses={"CC-BY-4.0": 3, "MIT": 2, "(other)": 1}
    )
    if hostile:
        source_stats["books.parquet"].update(
            license=f"{HOSTILE_MARKUP}HOSTILE-LICENSE", provenance="javascript:window.__pwned=1"
        )


def _write_stats(curate: Path, cells, removed, rejected, source_stats, stages: dict[str, Any]) -> None:
    def total(entries) -> dict[str, int]:
        return {
            "documents": sum(e["documents"] for e in entries),
            "characters": sum(e["characters"] for e in entries),
            "tokens_estimated": sum(e["tokens_estimated"] for e in entries),
        }

    kept = total(cells.values())
    removed_total = total(removed.values())
    rejected_docs = sum(rejected.values())
    read = {
        "documents": kept["documents"] + removed_total["documents"] + rejected_docs,
        "characters": kept["characters"] + removed_total["characters"],
        "tokens_estimated": kept["tokens_estimated"] + removed_total["tokens_estimated"],
    }
    funnel = [{"stage": "read", **read}]
    left = dict(read)
    left["documents"] -= rejected_docs
    funnel.append({"stage": "parse", **left})
    for stage in dict.fromkeys(s for s, _, _ in REMOVAL_REASONS):
        for entry in removed.values():
            if entry["stage"] == stage:
                for key in ("documents", "characters", "tokens_estimated"):
                    left[key] -= entry[key]
        funnel.append({"stage": stage, **left})
    stats = {
        "format_version": 1,
        "recipe": "configs/curate/web.yaml",
        "inputs": sorted(source_stats),
        "chars_per_token": CHARS_PER_TOKEN,
        "read": read,
        "kept": kept,
        "removed": removed_total,
        "rejected": {"documents": rejected_docs},
        "balanced": read["documents"] == kept["documents"] + removed_total["documents"] + rejected_docs,
        "funnel": funnel,
        "removed_by_reason": removed,
        "rejected_by_error": {k: {"documents": v} for k, v in sorted(rejected.items())},
        "cells": cells,
        "sources": source_stats,
        "stages": stages,
    }
    (curate / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n")


def make_plans(counts: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A two-phase plan over the fixture's cells (80% pretraining, 20% midtraining) and an older revision."""
    cells = sorted(counts["cells"])
    domains = sorted({c.split("/")[0].removeprefix("domain=") for c in cells})
    available = {c: counts["cells"][c]["tokens"] for c in cells}
    total = counts["total_tokens"] * 3
    seq, batch = 256, 8
    tokens_per_step = seq * batch

    def source(name: str, source_cells: list[str], weight: float, budget: int) -> dict[str, Any]:
        have = sum(available[c] for c in source_cells)
        tokens = round(budget * weight)
        return {
            "name": name,
            "cells": source_cells,
            "weight": weight,
            "tokens": tokens,
            "tokens_available": have,
            "epochs": tokens / have if have else 0.0,
        }

    def phases(share_pre: float, hq_boost: float, drop: str | None) -> list[dict[str, Any]]:
        result = []
        start = 0
        for name, share in (("pretraining", share_pre), ("midtraining", 1 - share_pre)):
            budget = round(total * share)
            groups = []
            for d in domains:
                low = [c for c in cells if c.startswith(f"domain={d}/") and c[-1] in "012"]
                high = [c for c in cells if c.startswith(f"domain={d}/") and c[-1] in "34"]
                if low and name == "pretraining" and d != drop:
                    groups.append((f"{d}-lq", low, 1.0))
                if high:
                    groups.append((f"{d}-hq", high, hq_boost if name == "midtraining" else 1.5))
            weight_sum = sum(w for _, _, w in groups)
            srcs = [source(n, c, round(w / weight_sum, 6), budget) for n, c, w in groups]
            steps = budget // tokens_per_step
            result.append(
                {
                    "name": name,
                    "tokens": steps * tokens_per_step,
                    "steps": steps,
                    "start_step": start,
                    "end_step": start + steps,
                    "sources": srcs,
                }
            )
            start += steps
        return result

    plan = {
        "name": "fixture-mix",
        "tokenizer": counts["tokenizer"]["name"],
        "total_tokens": total,
        "sequence_length": seq,
        "batch_size": batch,
        "block_size": 4,
        "tokens_per_step": tokens_per_step,
        "phases": phases(0.8, 3.0, None),
    }
    previous = {
        **plan,
        "name": "fixture-mix",
        "phases": phases(0.85, 2.0, domains[-1] if len(domains) > 1 else None),
    }
    # A planner rounds phases to whole steps; the plan's total is what the phases add up to.
    for revision in (plan, previous):
        revision["total_tokens"] = sum(p["tokens"] for p in revision["phases"])
    return plan, previous


def _write_run(run: Path, plan: dict[str, Any], *, steps: int, layers: int, experts: int, seed: int) -> Path:
    rng = random.Random(seed + 1)
    run.mkdir(parents=True, exist_ok=True)
    boundary = int(steps * 0.8)
    lines = []
    tokens = 0
    for step in range(0, steps + 1, 5):
        warm = min(1.0, step / max(1, steps * 0.05))
        lr = 3e-4 * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        tokens = step * plan["tokens_per_step"]
        load = []
        for layer in range(layers):
            raw = [
                1 + rng.random() * (2.0 if step < steps / 4 else 0.4) + (0.5 if e == layer else 0)
                for e in range(experts)
            ]
            s = sum(raw)
            load.append([round(v / s, 5) for v in raw])
        lines.append(
            {
                "step": step,
                "phase": "pretraining" if step < boundary else "midtraining",
                "loss": round(2.2 + 8.0 * math.exp(-step / (steps / 6)) + rng.gauss(0, 0.05), 5),
                "lr": lr,
                "tokens": tokens,
                "tokens_per_second": round(52000 + rng.gauss(0, 1500), 1),
                "flops": tokens * 6 * 1.6e9,
                "mfu": round(0.38 + rng.gauss(0, 0.01), 4),
                "grad_norm": round(1.0 + 3 * math.exp(-step / 40) + abs(rng.gauss(0, 0.1)), 4),
                "param_norm": round(100 + step * 0.05, 3),
                "router_bias_norm": [round(0.01 * step**0.5 * (1 + layer / 4), 5) for layer in range(layers)],
                "expert_load": load,
                "drop_fraction": round(max(0.0, 0.08 * math.exp(-step / 60) + rng.gauss(0, 0.002)), 5),
                "time": round(step * 1.7, 2),
            }
        )
    (run / "metrics.jsonl").write_text("".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))
    config = {
        "model": {
            "name": "moe-tiny",
            "layers": 4,
            "d_model": 256,
            "experts": experts,
            "top_k": 2,
            "moe_layers": layers,
            "vocab_size": 8192,
        },
        "training": {"seed": seed, "optimizer": "adamw", "peak_lr": 3e-4, "warmup_fraction": 0.05},
        "mixture": plan,
    }
    (run / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return run


EXTERNAL_SET = "paloma-c4"
EVAL_EVERY = 50  # steps between the fixture run's evaluations (plus the phase boundary and the end)


def write_eval(run: Path, domains: Sequence[str], plan: dict[str, Any], *, steps: int, seed: int) -> Path:
    """The fixture run's eval.jsonl: each domain's held-out slice (`heldout/domain=<d>`) and one external
    set, every EVAL_EVERY steps (about 40 times in a longer run), at the phase boundary and at the end,
    dropless and with capacity, with the averages; written through tokenmill.formats.evals. Losses fall
    as the run's training loss does, each set from its own level, so that every curve is distinct."""
    rng = random.Random(seed + 2)
    boundary = int(steps * 0.8)
    every = max(EVAL_EVERY, steps // 40)  # a long run evaluates about 40 times
    points = sorted({*range(every, steps + 1, every), boundary, steps})
    sets = [(f"heldout/domain={d}", "heldout") for d in domains] + [(EXTERNAL_SET, "external")]
    levels = {name: (2.4 + 0.35 * i, 3.6 + 0.3 * rng.random()) for i, (name, _) in enumerate(sets)}
    lines = []
    for step in points:
        phase = "pretraining" if step < boundary else "midtraining"
        for dispatch, inflation in (("dropless", 0.0), ("capacity", 0.07)):
            records = []
            for name, kind in sets:
                floor, bytes_per_token = levels[name]
                loss = floor + 6.0 * math.exp(-step / (steps / 6)) + inflation + rng.gauss(0, 0.01)
                tokens = 4096
                records.append(
                    set_record(
                        step=step,
                        name=name,
                        kind=kind,  # type: ignore[arg-type]
                        nll_nats=loss * tokens,
                        tokens=tokens,
                        num_bytes=round(tokens * bytes_per_token),
                        sequences=16,
                        dispatch=dispatch,
                        phase=phase,
                        tokens_trained=step * plan["tokens_per_step"],
                        drop_fraction=0.0 if dispatch == "dropless" else 0.02,
                    )
                )
            lines.extend(eval_line(record) for record in [*records, *averages(records)])
    path = run / EVAL
    path.write_text("".join(lines))
    return path


def report_args(inputs: ReportInputs, output: Path, *extra: str, run: bool = True) -> list[str]:
    """`tokenmill report` arguments for these inputs (with the run page unless run=False)."""
    args = [
        "report",
        "--curated",
        str(inputs.curate),
        "--tokens",
        str(inputs.tokens),
        "--plan",
        str(inputs.plan),
        "--previous-plan",
        str(inputs.previous_plan),
        "--output",
        str(output),
    ]
    if run:
        args += ["--run", str(inputs.run)]
    return args + list(extra)
