"""The bundled sample corpus (data/sample/): a few thousand documents in every input format curate reads.

English prose from the standard library's docstrings, code from its source files, other languages, spam
and boilerplate (`tokenmill.samples.text`), and documents of the other domains drawn with the generators
of `tokenmill.samples.generated` (word lists and templates, not found text). Exact duplicates (the same
text in several files and formats) and near duplicates (a few words edited, inserted or deleted) are
planted, and a few lines that are not documents, so that every curation stage has something to do. The
output is deterministic for a given Python version: a fixed seed, sorted module lists, gzip without a
timestamp, zstd at a fixed level.

    python -m tokenmill.samples.corpus --output data/sample    (or scripts/make_sample_corpus.py)
"""

from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import zstandard

from tokenmill.samples.generated import generated_documents
from tokenmill.samples.text import (
    OTHER_LANGUAGES,
    boilerplate_doc,
    code_chunks,
    near_duplicate,
    other_language_doc,
    prose_paragraphs,
    spam_doc,
)

# Input that is not a document: it must land in rejected/ with the line and the error.
BAD_LINES = (
    b'{"id": "bad-json", "text": "an unterminated object"\n'
    b'{"id": "no-text", "body": "the text is under another field"}\n'
    b'{"id": "bad-utf8", "text": "caf\xe9 latin-1 bytes"}\n'
)


def make_corpus(seed: int = 1234) -> dict[str, list[dict]]:
    """Records per output file name."""
    rng = random.Random(seed)
    paragraphs = prose_paragraphs()
    rng.shuffle(paragraphs)
    articles = []
    position = 0
    while position < len(paragraphs):
        take = rng.randint(1, 4)
        articles.append("\n\n".join(paragraphs[position : position + take]))
        position += take

    records: list[dict] = []
    for number, text in enumerate(articles):
        records.append(
            {
                "id": f"doc-{number:05d}",
                "text": text,
                "url": f"https://docs.example.org/a/{number}",
                "kind": "prose",
            }
        )
    # Exact duplicates: the same text again under another id (some spread into other files below).
    for number, source in enumerate(rng.sample(articles, len(articles) // 10)):
        records.append({"id": f"dup-{number:05d}", "text": source, "url": None, "kind": "exact_duplicate"})
    # Near duplicates: 1-30% of words edited.
    for number, source in enumerate(rng.sample(articles, len(articles) // 10)):
        records.append(
            {
                "id": f"near-{number:05d}",
                "text": near_duplicate(rng, source, rng.uniform(0.01, 0.3)),
                "url": None,
                "kind": "near_duplicate",
            }
        )
    for number in range(60):
        records.append({"id": f"spam-{number:05d}", "text": spam_doc(rng), "kind": "spam"})
    for number in range(60):
        records.append({"id": f"boiler-{number:05d}", "text": boilerplate_doc(rng), "kind": "boilerplate"})
    for number, language in enumerate(sorted(OTHER_LANGUAGES) * 30):
        records.append(
            {
                "id": f"{language}-{number:05d}",
                "text": other_language_doc(rng, language),
                "kind": f"language_{language}",
            }
        )
    # Other kinds, generated from word lists and templates (tokenmill.samples.generated; another seed).
    for domain in ("web", "math", "science", "legal", "conversation"):
        for number, record in enumerate(generated_documents(random.Random(seed + 7), 40, [domain])):
            records.append({"id": f"{domain}-{number:05d}", "text": record["text"], "kind": domain})
    rng.shuffle(records)

    code = [
        {"id": f"code-{number:05d}", "text": chunk, "kind": "code"}
        for number, chunk in enumerate(code_chunks(rng, 160))
    ]

    third = len(records) // 3
    return {
        "web-000.jsonl.zst": records[:third],
        "web-001.jsonl.gz": records[third : 2 * third],
        "web-002.jsonl": records[2 * third :],
        # Some exact duplicates of web text inside the Parquet file: dedupe works across inputs and formats.
        "mixed-000.parquet": code + [{**record, "id": f"x{record['id']}"} for record in records[:40]],
    }


def encode_jsonl(records: list[dict]) -> bytes:
    return b"".join(
        json.dumps(record, ensure_ascii=False, sort_keys=True).encode() + b"\n" for record in records
    )


def write_corpus(output: Path, files: dict[str, list[dict]]) -> None:
    output.mkdir(parents=True, exist_ok=True)
    for name, records in files.items():
        path = output / name
        if name.endswith(".parquet"):
            buffer = io.BytesIO()
            table = pa.Table.from_pylist(
                records,
                schema=pa.schema(
                    [("id", pa.string()), ("text", pa.string()), ("url", pa.string()), ("kind", pa.string())]
                ),
            )
            pq.write_table(table, buffer, compression="zstd")
            data = buffer.getvalue()
        elif name.endswith(".zst"):
            data = zstandard.ZstdCompressor(level=10).compress(encode_jsonl(records))
        elif name.endswith(".gz"):
            data = gzip.compress(encode_jsonl(records), compresslevel=9, mtime=0)
        else:
            data = encode_jsonl(records) + BAD_LINES
        temporary = path.with_name(f".tmp-{name}")
        temporary.write_bytes(data)
        os.replace(temporary, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="data/sample", help="output folder (default: data/sample)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    files = make_corpus(args.seed)
    write_corpus(Path(args.output), files)
    total = sum(len(records) for records in files.values())
    print(f"wrote {total} records in {len(files)} files to {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
