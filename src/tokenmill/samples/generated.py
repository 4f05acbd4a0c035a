"""Generated documents of the kinds the sample corpus plants (data/sample/): web, math, science, legal
clauses, conversation, other.

These are made from short word lists and templates, not found text: the sample corpus uses them so that
its cells have something to hold, and `tokenmill.samples.corpus` must keep making the same bytes. The
bundled classifiers are NOT trained on them (tokenmill.samples.classifier_data trains on real text only);
a kind here is a planted test input, not a claim that the text is of that kind.
"""

from __future__ import annotations

import random
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

KINDS = ("web", "code", "math", "science", "legal", "reference", "conversation", "other")

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


def generated_documents(
    rng: random.Random, per_domain: int, domains: tuple[str, ...] | list[str] = KINDS
) -> list[dict]:
    """`per_domain` documents of each kind in `domains`, as {"text", "label"} (label: the kind)."""
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
