"""Benchmark: the `pii` stage's throughput against a plain regular-expression scan of the same kinds.

The corpus: real text this machine carries (bench/pii_eval.py's hosts: man pages, Debian's license texts,
the standard library's docstrings, pydoc's topics), most documents without personal data, one in four with
planted values and look-alikes (tokenmill.samples.pii), as a web crawl has them. Both sides mask every find
in every document, in one process, timed in CPU seconds, best of three:

- tokenmill: `PersonalData().apply` on batches of 256, the stage as curate runs it: every kind, the checks
  (Luhn, mod 97, issuer prefixes, NANP rules, version cues, reserved names), overlaps settled, the
  text rewritten, the `pii` counts and the stage's statistics;
- baseline (`plain_regex_scan`): one unchecked pattern per kind, as the simplest PII taggers write them
  (dolma's e-mail, phone and IP expressions, plus a 13-19 digit run and an IBAN shape), each
  `re.sub`-ed over every document with its placeholder.

    python bench/pii.py [--documents 8000]

Ends with `pii ratio=X.XX target=0.5 baseline=plain_regex_scan`: the baseline's CPU seconds over
tokenmill's. The target: the stage checks every candidate and scans for more formats than the baseline
(five phone layouts, IPv6, a cued form), and may cost up to twice the bare scan, because that cost is
small beside curate's other stages (the sample's 550 kept documents took 0.09 CPU seconds in `pii`
against 1.67 in `gopher_repetition`); below 0.5 it would start to matter.
"""

from __future__ import annotations

import argparse
import random
import re
import time

from pii_eval import host_texts

from tokenmill.filters.pii import PLACEHOLDERS, PersonalData
from tokenmill.samples.pii import planted_documents

#: What a plain scan looks like: dolma's patterns for e-mail, phone and IPv4, and the bare shapes of the
#: other two, no checks.
PLAIN_PATTERNS = {
    "email": re.compile(r"[\w.+-]+@[\w-]+\.[\w.-]+"),
    "phone": re.compile(r"\s+\(?(\d{3})\)?[-\. ]*(\d{3})[-. ]?(\d{4})"),
    "ip": re.compile(
        r"(?:(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)\.){3}(?:25[0-5]|2[0-4][0-9]|[01]?[0-9][0-9]?)"
    ),
    "credit_card": re.compile(r"\b(?:\d[ -]?){12,18}\d\b"),
    "iban": re.compile(r"\b[A-Z]{2}\d{2}(?: ?[A-Z0-9]{4}){2,7}(?: ?[A-Z0-9]{1,3})?\b"),
}


def plain_scan(texts: list[str]) -> int:
    """Mask every match of the plain patterns; the number of matches."""
    matches = 0
    for text in texts:
        for kind, pattern in PLAIN_PATTERNS.items():
            text, count = pattern.subn(PLACEHOLDERS[kind], text)
            matches += count
    return matches


def stage_scan(texts: list[str]) -> int:
    step = PersonalData()
    finds = 0
    for begin in range(0, len(texts), 256):
        batch = [{"id": str(i), "text": text} for i, text in enumerate(texts[begin : begin + 256])]
        step.apply(batch)
        finds += sum(sum(document["pii"].values()) for document in batch)
    return finds


def best_cpu(function, texts: list[str], repeats: int = 3) -> tuple[float, int]:
    times = []
    result = 0
    for _ in range(repeats):
        started = time.process_time()
        result = function(texts)
        times.append(time.process_time() - started)
    return min(times), result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--documents", type=int, default=8000)
    parser.add_argument("--seed", type=int, default=34)
    args = parser.parse_args()
    hosts = host_texts()
    rng = random.Random(args.seed)
    planted = planted_documents(hosts, args.documents // 4, seed=args.seed)
    texts = [document.text for document in planted] + [
        hosts[rng.randrange(len(hosts))] for _ in range(args.documents - len(planted))
    ]
    rng.shuffle(texts)
    megabytes = sum(len(text.encode()) for text in texts) / 1e6
    print(f"corpus: {len(texts):,} documents, {megabytes:.1f} MB, {len(planted):,} with planted values")
    baseline, plain_matches = best_cpu(plain_scan, texts)
    tokenmill, finds = best_cpu(stage_scan, texts)
    print(
        f"plain regex scan: {baseline:.3f} CPU-s ({megabytes / baseline:.1f} MB/s), {plain_matches:,} matches"
    )
    print(f"tokenmill pii:    {tokenmill:.3f} CPU-s ({megabytes / tokenmill:.1f} MB/s), {finds:,} finds")
    print(f"tokenmill: {len(texts) / tokenmill:,.0f} documents per CPU second")
    print(f"pii ratio={baseline / tokenmill:.2f} target=0.5 baseline=plain_regex_scan")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
