"""Make the bundled sample corpus (data/sample/) from text every Python install carries.

English prose comes from the standard library's docstrings, code from its source files; other languages,
spam and boilerplate are generated from small word lists below. Exact duplicates (the same text in
several files and formats) and near duplicates (a few words edited, inserted or deleted) are planted, so
that every curation stage has something to do. The output is deterministic for a given Python version:
a fixed seed, sorted module lists, gzip without a timestamp, zstd at a fixed level.

    python scripts/make_sample_corpus.py --output data/sample
"""

from __future__ import annotations

import argparse
import gzip
import importlib
import inspect
import io
import json
import os
import random
import re
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import zstandard  # noqa: E402

PROSE_MODULES = sorted(
    [
        "argparse",
        "asyncio",
        "base64",
        "bisect",
        "calendar",
        "collections",
        "concurrent.futures",
        "configparser",
        "contextlib",
        "copy",
        "csv",
        "dataclasses",
        "datetime",
        "decimal",
        "difflib",
        "email",
        "enum",
        "fractions",
        "ftplib",
        "functools",
        "gettext",
        "glob",
        "gzip",
        "hashlib",
        "heapq",
        "hmac",
        "html",
        "http.client",
        "http.cookiejar",
        "http.server",
        "imaplib",
        "inspect",
        "io",
        "ipaddress",
        "itertools",
        "json",
        "locale",
        "logging",
        "lzma",
        "mailbox",
        "mimetypes",
        "multiprocessing",
        "numbers",
        "operator",
        "optparse",
        "os",
        "pathlib",
        "pickle",
        "pkgutil",
        "platform",
        "plistlib",
        "poplib",
        "pprint",
        "queue",
        "random",
        "re",
        "sched",
        "secrets",
        "selectors",
        "shelve",
        "shlex",
        "shutil",
        "signal",
        "smtplib",
        "socket",
        "sqlite3",
        "ssl",
        "statistics",
        "string",
        "struct",
        "subprocess",
        "tarfile",
        "tempfile",
        "textwrap",
        "threading",
        "timeit",
        "tokenize",
        "traceback",
        "types",
        "typing",
        "unittest",
        "urllib.parse",
        "urllib.request",
        "uuid",
        "warnings",
        "weakref",
        "xml.dom.minidom",
        "xml.etree.ElementTree",
        "zipfile",
        "zoneinfo",
    ]
)

OTHER_LANGUAGES = {
    "de": (
        ["Die Stadt", "Der Verein", "Unsere Schule", "Die Regierung", "Das Museum", "Der Bauer"],
        ["plant", "eröffnet", "verbessert", "untersucht", "beschreibt", "verkauft"],
        [
            "einen neuen Park für alle Bürger",
            "die Ausstellung über die Geschichte der Region",
            "den Unterricht mit modernen Mitteln",
            "die Ursachen des Hochwassers im Frühjahr",
            "frisches Gemüse auf dem Wochenmarkt",
            "die Pläne für den Bahnhof",
        ],
    ),
    "fr": (
        ["La ville", "Le gouvernement", "Notre école", "Le musée", "La société", "Le chercheur"],
        ["présente", "prépare", "améliore", "étudie", "ouvre", "vend"],
        [
            "un nouveau jardin pour les habitants",
            "une exposition sur l'histoire de la région",
            "les cours avec des outils modernes",
            "les causes de la sécheresse de l'été",
            "des légumes frais au marché du samedi",
            "le projet de la nouvelle gare",
        ],
    ),
    "es": (
        ["La ciudad", "El gobierno", "Nuestra escuela", "El museo", "La empresa", "El investigador"],
        ["presenta", "prepara", "mejora", "estudia", "abre", "vende"],
        [
            "un nuevo parque para los vecinos",
            "una exposición sobre la historia de la región",
            "las clases con herramientas modernas",
            "las causas de la sequía del verano",
            "verduras frescas en el mercado del sábado",
            "el proyecto de la nueva estación",
        ],
    ),
}
CONNECTIVES = {
    "de": ["Außerdem", "Deshalb", "Trotzdem", "Heute"],
    "fr": ["En outre", "Donc", "Pourtant", "Aujourd'hui"],
    "es": ["Además", "Por eso", "Sin embargo", "Hoy"],
}
SPAM_WORDS = [
    "buy",
    "cheap",
    "best",
    "price",
    "casino",
    "bonus",
    "free",
    "click",
    "now",
    "discount",
    "pills",
    "win",
    "offer",
    "deal",
    "crypto",
    "loans",
]
BOILERPLATE = [
    "Home | About | Contact | Blog",
    "Accept all cookies",
    "Sign in",
    "Subscribe to our newsletter",
    "Privacy Policy",
    "Terms of Use",
    "Share on Facebook",
    "Tweet",
    "Next page",
    "Back to top",
    "© 2024 All rights reserved",
    "Menu",
    "Search",
    "Log out",
]


def _prose_blocks(doc: str):
    for block in re.split(r"\n\s*\n", doc):
        text = " ".join(line.strip() for line in block.splitlines())
        words = text.split()
        if len(words) < 12 or not text.endswith("."):
            continue
        if sum(ch in "{}[]()=<>_*" for ch in text) > len(text) * 0.04:
            continue
        yield text


# Input that is not a document: it must land in rejected/ with the line and the error.
BAD_LINES = (
    b'{"id": "bad-json", "text": "an unterminated object"\n'
    b'{"id": "no-text", "body": "the text is under another field"}\n'
    b'{"id": "bad-utf8", "text": "caf\xe9 latin-1 bytes"}\n'
)


def prose_paragraphs() -> list[str]:
    """Paragraphs that read as English prose (sentences, not signatures or tables): the language
    reference and library topics that pydoc ships (pydoc_data.topics), then the docstrings of
    common modules."""
    from pydoc_data.topics import topics

    paragraphs: list[str] = []
    seen: set[str] = set()
    for name in sorted(topics):
        for text in _prose_blocks(topics[name]):
            if text not in seen:
                seen.add(text)
                paragraphs.append(text)
    for module_name in PROSE_MODULES:
        try:
            module = importlib.import_module(module_name)
        except Exception:
            continue
        objects = [module] + [member for _, member in sorted(inspect.getmembers(module), key=lambda m: m[0])]
        for obj in objects:
            try:
                doc = inspect.getdoc(obj)
            except Exception:
                continue
            if not doc:
                continue
            for text in _prose_blocks(doc):
                if text not in seen:
                    seen.add(text)
                    paragraphs.append(text)
    return paragraphs


def code_chunks(rng: random.Random, count: int) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 4000)
    chunks = []
    for path in rng.sample(files, min(count, len(files))):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        start = rng.randrange(0, max(1, len(lines) - 80))
        chunks.append("\n".join(lines[start : start + rng.randint(40, 80)]))
    return chunks


def other_language_doc(rng: random.Random, language: str) -> str:
    subjects, verbs, objects = OTHER_LANGUAGES[language]
    sentences = []
    for _ in range(rng.randint(8, 16)):
        sentence = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}."
        if rng.random() < 0.3:
            sentence = f"{rng.choice(CONNECTIVES[language])} {sentence[0].lower()}{sentence[1:]}"
        sentences.append(sentence)
    return " ".join(sentences)


def spam_doc(rng: random.Random) -> str:
    phrase = " ".join(rng.sample(SPAM_WORDS, 5))
    return "\n".join(f"{phrase} {phrase}!!! {rng.choice(SPAM_WORDS)}" for _ in range(rng.randint(15, 40)))


def boilerplate_doc(rng: random.Random) -> str:
    return "\n".join(rng.choice(BOILERPLATE) for _ in range(rng.randint(10, 30)))


def near_duplicate(rng: random.Random, text: str, edit_fraction: float) -> str:
    words = text.split(" ")
    for _ in range(max(1, int(len(words) * edit_fraction))):
        position = rng.randrange(len(words))
        operation = rng.random()
        if operation < 0.4:
            words[position] = rng.choice(["also", "often", "then", "usually", "simply", "still"])
        elif operation < 0.7 and len(words) > 10:
            del words[position]
        else:
            words.insert(position, rng.choice(["indeed", "here", "now", "really"]))
    return " ".join(words)


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
    # Other domains, drawn with the generators the bundled classifiers are trained on (another seed).
    import make_classifier_data as labelled

    for domain in ("web", "math", "science", "legal", "conversation"):
        for number, record in enumerate(labelled.domain_documents(random.Random(seed + 7), 40, [domain])):
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
