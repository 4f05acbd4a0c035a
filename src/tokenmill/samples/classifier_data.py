"""The labelled data the bundled domain and quality classifiers are trained on (data/classifiers/).

Nothing is downloaded, and every domain label is backed by real text of that kind that a tokenmill
install carries; a label with no such text at hand is not shipped (so there is no `web`, `math`,
`science` or `conversation`: the only text of those kinds here would be made up from word lists).

Domain (`domain.jsonl`, field `label`), one rule per label:
- reference: documentation prose: pydoc's language reference and library topics (pydoc_data) and the
  docstrings of common standard-library modules, 1 to 3 paragraphs a document.
- code: chunks of 40 to 80 lines of the standard library's Python sources (tests excluded), at most one
  chunk per file.
- legal: license texts: Python's LICENSE.txt and the license files that tokenmill's core dependencies
  (what `pip install tokenmill` installs, no extras) ship in their .dist-info folders (MIT, BSD, Apache,
  PSF, MPL, ...), cut into chunks of whole paragraphs.
- other: text in languages other than English: the example sentences spaCy ships for each of its
  languages (spacy/lang/<code>/examples.py, read as data, not imported), 2 to 4 sentences a document.

Quality (`quality.jsonl`, `label` hq or lq): hq is the real text of code, legal and reference above,
as found. lq is GENERATED from it, and documented as such: word salad (the words of a real document
shuffled), fragments (a few words cut from one), keyword lists (words sampled from one), plus keyword
spam and page boilerplate from tokenmill.samples.text's word lists. lq therefore teaches "not well-formed
text", not any real kind of bad page.

Every pool loses its exact copies (many packages ship the same MIT or Apache text) before anything is
drawn, and `calibration.jsonl` is drawn from a disjoint part of each pool: no calibration document is a
training text. Near copies (the MIT license with another copyright line) are left for `tokenmill
classifier train` to remove before its held-out split and before calibration, which its card counts.
Calibration mixes both qualities (70% as found, 30% corrupted as above) and keeps each document's
domain, on which the quality score is cut into five buckets per domain.

The same Python, versions of the core dependencies and seed give the same bytes, whatever else is
installed; other versions give other, equally valid text (what pydoc, the standard library and the
packages hold differs between versions).

    python -m tokenmill.samples.classifier_data --output data/classifiers
    (or scripts/make_classifier_data.py)
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import random
import re
import sys
import sysconfig
import unicodedata
from pathlib import Path

from tokenmill.samples.text import boilerplate_doc, prose_paragraphs, spam_doc

DOMAINS = ("code", "legal", "reference", "other")
#: The domains whose text is the quality model's good text (other-language text is not what the English
#: quality model judges).
QUALITY_DOMAINS = ("code", "legal", "reference")
LICENSE_NAME = re.compile(r"^(licen[cs]e|copying|notice)", re.IGNORECASE)
REQUIREMENT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
#: Words in a legal chunk: whole paragraphs are joined up to about this many.
LEGAL_CHUNK_WORDS = (40, 260)
CALIBRATION_FRACTION = 1 / 3
CORRUPTED_CALIBRATION = 0.3


def reference_documents(rng: random.Random) -> list[str]:
    """Documentation prose, 1-3 paragraphs a document, each paragraph used once."""
    paragraphs = prose_paragraphs()
    documents, position = [], 0
    while position < len(paragraphs):
        take = rng.randint(1, 3)
        documents.append("\n\n".join(paragraphs[position : position + take]))
        position += take
    return documents


def code_documents(rng: random.Random) -> list[str]:
    """One chunk of 40-80 lines from each standard-library source of some size (tests excluded)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    excluded = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
    files = sorted(
        path
        for path in stdlib.rglob("*.py")
        if not excluded & set(path.relative_to(stdlib).parts) and path.stat().st_size > 3000
    )
    documents = []
    for path in files:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        start = rng.randrange(0, max(1, len(lines) - 80))
        chunk = "\n".join(lines[start : start + rng.randint(40, 80)])
        if len(chunk.split()) >= 40:
            documents.append(chunk)
    return documents


def core_distributions() -> list[importlib.metadata.Distribution]:
    """The distributions a plain `pip install tokenmill` installs: tokenmill's own requirements and theirs,
    transitively, without any extra's. What else is installed (the dev, test and train extras, a tool
    added by hand) must not change the training text: a test tool's license joining the legal pool
    would change every classifier and every cell of the demo."""
    found: dict[str, importlib.metadata.Distribution] = {}
    queue = ["tokenmill"]
    while queue:
        name = canonical_name(queue.pop())
        if name in found:
            continue
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement whose marker leaves it out here
        found[name] = distribution
        for requirement in distribution.requires or []:
            requirement_name, _, marker = requirement.partition(";")
            if "extra" in marker:
                continue
            queue.append(REQUIREMENT_NAME.match(requirement_name.strip()).group(0))
    found.pop("tokenmill", None)
    return [found[name] for name in sorted(found)]


def canonical_name(name: str) -> str:
    """A distribution's name as pip compares them (PEP 503: case, runs of -_. folded to one -)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def license_texts() -> list[str]:
    """Python's LICENSE.txt and the license files of tokenmill's core dependencies, by name."""
    texts = []
    python_license = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if python_license.exists():
        texts.append(python_license.read_text(errors="replace"))
    for distribution in core_distributions():
        for file in sorted(distribution.files or [], key=str):
            if ".dist-info" in str(file) and LICENSE_NAME.match(file.name):
                try:
                    texts.append(Path(distribution.locate_file(file)).read_text(errors="replace"))
                except OSError:
                    continue
    return texts


def legal_documents(rng: random.Random) -> list[str]:
    """License texts cut into chunks of whole paragraphs (about 40-260 words)."""
    documents = []
    for text in license_texts():
        chunk: list[str] = []
        words = 0
        limit = rng.randint(*LEGAL_CHUNK_WORDS)
        for block in re.split(r"\n\s*\n", text):
            block = "\n".join(line.rstrip() for line in block.strip("\n").splitlines())
            if not block.strip():
                continue
            chunk.append(block)
            words += len(block.split())
            if words >= limit:
                documents.append("\n\n".join(chunk))
                chunk, words, limit = [], 0, rng.randint(*LEGAL_CHUNK_WORDS)
        if words >= LEGAL_CHUNK_WORDS[0]:
            documents.append("\n\n".join(chunk))
    return documents


def spacy_example_sentences() -> dict[str, list[str]]:
    """spaCy's example sentences per language (not English), read from the files as data: importing
    spacy.lang.<code> would load tokenizer dependencies some languages need."""
    spec = importlib.util.find_spec("spacy")
    if spec is None or not spec.submodule_search_locations:
        return {}
    root = Path(next(iter(spec.submodule_search_locations))) / "lang"
    sentences: dict[str, list[str]] = {}
    for path in sorted(root.glob("*/examples.py")):
        language = path.parent.name
        if language in ("en", "xx"):  # English is not other; xx mixes languages
            continue
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == "sentences" for target in node.targets
            ):
                values = ast.literal_eval(node.value)
                sentences[language] = [value for value in values if isinstance(value, str) and value.strip()]
    return sentences


def other_documents(rng: random.Random) -> list[str]:
    """Non-English text, 2-4 of one language's example sentences a document, each sentence used once."""
    documents = []
    for _, sentences in sorted(spacy_example_sentences().items()):
        position = 0
        while position + 1 < len(sentences):
            take = rng.randint(2, 4)
            documents.append(" ".join(sentences[position : position + take]))
            position += take
    return documents


def normalized_key(text: str) -> bytes:
    """Exact-copy key: NFKC, case-folded, whitespace collapsed (tokenmill.filters.classifiers'
    normalized_text; the samples sit below the stages and do not import them)."""
    normalized = " ".join(unicodedata.normalize("NFKC", text).casefold().split())
    return hashlib.blake2b(normalized.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def real_documents(
    rng: random.Random, report: dict[str, dict[str, int]] | None = None
) -> dict[str, list[str]]:
    """Each domain's pool of real documents without exact copies (many packages ship the same license
    text), shuffled; `report` receives, per domain, how many were found and how many exact copies went.
    Near copies (a license with another copyright line) stay: training removes them, and says so."""
    makers = {
        "code": code_documents,
        "legal": legal_documents,
        "reference": reference_documents,
        "other": other_documents,
    }
    pools = {}
    for domain in DOMAINS:
        documents = makers[domain](rng)
        seen: set[bytes] = set()
        unique = []
        for text in documents:
            key = normalized_key(text)
            if key not in seen:
                seen.add(key)
                unique.append(text)
        rng.shuffle(unique)
        pools[domain] = unique
        if report is not None:
            report[domain] = {"found": len(documents), "exact_copies": len(documents) - len(unique)}
    return pools


def low_quality(rng: random.Random, good: str) -> str:
    """A generated corruption of a real document (or keyword spam, or page boilerplate)."""
    words = good.split()
    roll = rng.random()
    if roll < 0.3:
        rng.shuffle(words)  # word salad: the right words, no sentences
        return " ".join(words)
    if roll < 0.5:
        start = rng.randrange(max(1, len(words) - 6))
        return " ".join(words[start : start + rng.randint(2, 6)])  # a fragment
    if roll < 0.7:
        return spam_doc(rng)
    if roll < 0.85:
        return boilerplate_doc(rng)
    return ", ".join(rng.sample(words, min(len(words), rng.randint(5, 15))))  # a keyword list


def make_data(
    per_domain: int, seed: int, report: dict[str, dict[str, int]] | None = None
) -> dict[str, list[dict]]:
    """Records per output name (domain, quality, calibration), in file order."""
    rng = random.Random(seed)
    pools = real_documents(rng, report)
    domain, calibration = [], []
    for label, pool in pools.items():
        held = min(int(per_domain * CALIBRATION_FRACTION), len(pool) // 4)
        for text in pool[:held]:
            corrupted = rng.random() < CORRUPTED_CALIBRATION
            calibration.append({"text": low_quality(rng, text) if corrupted else text, "domain": label})
        domain += [{"text": text, "label": label} for text in pool[held : held + per_domain]]
    good = [record for record in domain if record["label"] in QUALITY_DOMAINS]
    quality = [{"text": record["text"], "label": "hq"} for record in good]
    quality += [{"text": low_quality(rng, rng.choice(good)["text"]), "label": "lq"} for _ in range(len(good))]
    for records in (domain, quality, calibration):
        rng.shuffle(records)
    return {"domain": domain, "quality": quality, "calibration": calibration}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="data/classifiers")
    parser.add_argument("--per-domain", type=int, default=300, help="at most this many per domain label")
    parser.add_argument("--seed", type=int, default=4321)
    args = parser.parse_args(argv)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    report: dict[str, dict[str, int]] = {}
    data = make_data(args.per_domain, args.seed, report)
    for domain, numbers in report.items():
        print(
            f"{domain}: {numbers['found']} real documents found, "
            f"{numbers['exact_copies']} exact copies dropped",
            file=sys.stderr,
        )
    for name, records in data.items():
        path = output / f"{name}.jsonl"
        temporary = path.with_name(f".tmp-{path.name}")
        temporary.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
        os.replace(temporary, path)
        print(f"wrote {len(records)} records to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
