"""The labelled data the bundled domain and quality classifiers are trained on (data/classifiers/).

Nothing is downloaded: text comes from what every Python install carries (pydoc's language reference,
docstrings, the standard library's source, Python's LICENSE) and from small generators below. The labels
follow written rules, one per generator, so anyone can check or change them:

Domain (`domain.jsonl`, field `label`):
- reference: pydoc topics and docstring paragraphs (documentation prose).
- code: chunks of the standard library's Python source.
- legal: paragraphs of Python's LICENSE text, and clauses generated from legal phrasing.
- math: generated worked problems (equations, sums, derivatives) with their steps.
- science: generated descriptions of experiments and measurements.
- conversation: generated dialogues (turns prefixed by a speaker) built from documentation sentences.
- web: generated news, reviews and travel notes.
- other: text in other languages, keyword spam and page boilerplate.

Quality (`quality.jsonl`, `label` hq or lq): hq is well-formed text of any domain above (whole paragraphs,
complete code chunks, complete dialogues); lq is spam, boilerplate, word salad (the words of a good
paragraph shuffled), fragments (a few words cut from a paragraph) and keyword lists.

`calibration.jsonl` is a separate draw of documents of every domain (with their domain), mixing both
qualities, on which the quality score is cut into five equal buckets per domain.

    python -m tokenmill.samples.classifier_data --output data/classifiers
    (or scripts/make_classifier_data.py)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import sysconfig
from pathlib import Path

from tokenmill.samples.text import (
    OTHER_LANGUAGES,
    boilerplate_doc,
    code_chunks,
    other_language_doc,
    prose_paragraphs,
    spam_doc,
)

DOMAINS = ("web", "code", "math", "science", "legal", "reference", "conversation", "other")

LEGAL_PARTIES = ["the Licensee", "the Licensor", "the Company", "the Contractor", "each Party", "the Tenant"]
LEGAL_ACTIONS = [
    "shall indemnify and hold harmless",
    "shall not assign or transfer",
    "may terminate",
    "shall be liable for",
    "hereby grants a non-exclusive license to",
    "shall give written notice to",
]
LEGAL_OBJECTS = [
    "any claim arising under this Agreement",
    "the rights granted in Section 2",
    "this Agreement upon thirty (30) days notice",
    "all damages resulting from a breach",
    "the Software and its documentation",
    "the other Party in accordance with Section 9",
]
SCIENCE_SUBJECTS = [
    "The enzyme activity",
    "The photon flux",
    "Cell proliferation",
    "The reaction rate",
    "Soil nitrogen",
    "The measured spectrum",
    "Gene expression",
    "The sample temperature",
]
SCIENCE_VERBS = [
    "increased linearly with",
    "was inversely proportional to",
    "remained stable despite",
    "was measured as a function of",
    "correlated strongly with",
    "decreased after",
]
SCIENCE_OBJECTS = [
    "substrate concentration",
    "the applied magnetic field",
    "exposure to ultraviolet light",
    "the incubation time",
    "ambient humidity",
    "the catalyst loading",
    "the pH of the buffer",
]
WEB_OPENERS = [
    "Last weekend we visited",
    "I finally tried",
    "The city council approved",
    "Our review of",
    "Local residents gathered at",
    "The new season of",
]
WEB_THINGS = [
    "the old harbour market",
    "a small family restaurant downtown",
    "a plan for new bike lanes",
    "the latest budget phone",
    "the community garden",
    "the river walk festival",
]
WEB_COMMENTS = [
    "and it was worth every minute",
    "although parking was difficult",
    "and the prices were fair",
    "which surprised many visitors",
    "and we will certainly return",
    "though the weather did not cooperate",
]
SPEAKERS = [("User", "Assistant"), ("Q", "A"), ("Alice", "Bob")]


def sentence(rng: random.Random, *parts: list[str]) -> str:
    text = " ".join(rng.choice(part) for part in parts)
    return text[0].upper() + text[1:] + "."


def legal_doc(rng: random.Random, license_paragraphs: list[str]) -> str:
    if license_paragraphs and rng.random() < 0.5:
        return rng.choice(license_paragraphs)
    clauses = [
        f"{rng.randint(1, 12)}.{rng.randint(1, 9)} "
        + sentence(rng, LEGAL_PARTIES, LEGAL_ACTIONS, LEGAL_OBJECTS)
        for _ in range(rng.randint(3, 8))
    ]
    return "\n".join(clauses)


def math_doc(rng: random.Random) -> str:
    a, b, c = rng.randint(2, 19), rng.randint(1, 50), rng.randint(1, 9)
    x = rng.randint(1, 20)
    total = a * x + b
    n = rng.randint(5, 60)
    return (
        f"Problem: solve {a}x + {b} = {total} for x.\n"
        f"Subtract {b} from both sides: {a}x = {total - b}. Divide by {a}: x = {x}.\n"
        f"Check: {a} * {x} + {b} = {total}, so the solution is correct.\n"
        f"Next, the sum of the first {n} integers is n(n + 1)/2 = {n * (n + 1) // 2}.\n"
        f"Finally, the derivative of f(x) = {c}x^3 is f'(x) = {3 * c}x^2, and f'({x}) = {3 * c * x * x}."
    )


def science_doc(rng: random.Random) -> str:
    sentences = [
        sentence(rng, SCIENCE_SUBJECTS, SCIENCE_VERBS, SCIENCE_OBJECTS) for _ in range(rng.randint(4, 9))
    ]
    sentences.append(
        f"Each measurement was repeated {rng.randint(3, 12)} times (n = {rng.randint(20, 400)}, "
        f"p < 0.0{rng.randint(1, 5)})."
    )
    return " ".join(sentences)


def web_doc(rng: random.Random) -> str:
    return " ".join(sentence(rng, WEB_OPENERS, WEB_THINGS, WEB_COMMENTS) for _ in range(rng.randint(4, 9)))


def conversation_doc(rng: random.Random, paragraphs: list[str]) -> str:
    first, second = rng.choice(SPEAKERS)
    turns = []
    for _ in range(rng.randint(2, 4)):
        question = rng.choice(paragraphs).split(". ")[0].rstrip(".")
        turns.append(f"{first}: Can you explain this? {question}?")
        turns.append(f"{second}: {rng.choice(paragraphs)}")
    return "\n".join(turns)


def other_doc(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.5:
        return other_language_doc(rng, rng.choice(sorted(OTHER_LANGUAGES)))
    return spam_doc(rng) if roll < 0.75 else boilerplate_doc(rng)


def license_paragraphs() -> list[str]:
    path = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if not path.exists():
        return []
    blocks = [" ".join(block.split()) for block in path.read_text(errors="replace").split("\n\n")]
    return [block for block in blocks if len(block.split()) > 25]


def domain_documents(
    rng: random.Random, per_domain: int, domains: tuple[str, ...] | list[str] = DOMAINS
) -> list[dict]:
    paragraphs = prose_paragraphs()
    code = code_chunks(rng, 400)
    licenses = license_paragraphs()
    makers = {
        "reference": lambda: "\n\n".join(rng.sample(paragraphs, rng.randint(1, 3))),
        "code": lambda: rng.choice(code),
        "legal": lambda: legal_doc(rng, licenses),
        "math": lambda: math_doc(rng),
        "science": lambda: science_doc(rng),
        "conversation": lambda: conversation_doc(rng, paragraphs),
        "web": lambda: web_doc(rng),
        "other": lambda: other_doc(rng),
    }
    return [{"text": makers[domain](), "label": domain} for domain in domains for _ in range(per_domain)]


def low_quality(rng: random.Random, good: str) -> str:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="data/classifiers")
    parser.add_argument("--per-domain", type=int, default=300)
    parser.add_argument("--seed", type=int, default=4321)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    domain = domain_documents(rng, args.per_domain)
    good = [record for record in domain if record["label"] != "other"]
    quality = [{"text": record["text"], "label": "hq"} for record in good]
    quality += [{"text": low_quality(rng, rng.choice(good)["text"]), "label": "lq"} for _ in range(len(good))]
    calibration = []
    for record in domain_documents(random.Random(args.seed + 1), args.per_domain // 3):
        text = record["text"] if rng.random() < 0.7 else low_quality(rng, record["text"])
        calibration.append({"text": text, "domain": record["label"]})
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    for name, records in (("domain", domain), ("quality", quality), ("calibration", calibration)):
        rng.shuffle(records)
        path = output / f"{name}.jsonl"
        temporary = path.with_name(f".tmp-{path.name}")
        temporary.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))
        os.replace(temporary, path)
        print(f"wrote {len(records)} records to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
