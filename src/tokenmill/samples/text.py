"""Text generators for the sample data, from what every Python install carries and small word lists.

English prose comes from the standard library's documentation (pydoc's topics, module docstrings), code
from its source files; other languages, keyword spam and page boilerplate are generated from the word
lists below, and `near_duplicate` edits a text as the near-duplicate detector must still catch it. The
same Python version, seed and imported modules give the same text (see `prose_paragraphs`).
`tokenmill.samples.corpus` and `tokenmill.samples.classifier_data` build on these; the benchmarks draw
their documents from them too.
"""

from __future__ import annotations

import importlib
import inspect
import random
import re
import sysconfig
from pathlib import Path

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


def prose_paragraphs() -> list[str]:
    """Paragraphs that read as English prose (sentences, not signatures or tables): the language
    reference and library topics that pydoc ships (pydoc_data.topics), then the docstrings of
    common modules."""
    # Which paragraphs a package's members give, and the order they are first seen in, depend on what the
    # process has imported so far (a package lists its imported submodules among its members). The bundled
    # data were made with these two loaded: loading them first keeps the corpus's and the classifier data's
    # bytes. A caller that has imported much more (a test session) gets other, equally valid text; the
    # bundled bytes come from a fresh process (`python -m tokenmill.samples.corpus`, the scripts).
    from pydoc_data.topics import topics

    import pyarrow.parquet  # noqa: F401
    import zstandard  # noqa: F401

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
