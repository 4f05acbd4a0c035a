"""A planted personal-data set: real text with e-mail addresses, phone numbers, IP addresses, card numbers
and IBANs put at known places, beside hard negatives that look like them (version strings, timestamps,
dates, hex digests, code, URLs, UUIDs, ISBNs, MAC addresses, big numbers). For the `pii` stage's
evaluation (bench/pii_eval.py, tests/test_pii.py) and its throughput bench (bench/pii.py).

Host text holds no personal data by construction: a paragraph is used only when a loose net (an `@`, a
run of 8 digits and separators, a dotted quad, a colon-separated hex run) finds nothing in it, and every
kind needs one of those. So a find outside the planted spans is a false positive, whatever it is.

Every value is made up with a seeded `random.Random`: addresses at invented names, numbers in the
formats each plan writes (NANP, UK, French, German, E.164), public IPv4 and IPv6 addresses, card
numbers with an issuer's prefix and a Luhn check digit, IBANs with their country's length and mod-97
check digits. Only `score` compares finds with the truth; it takes plain spans, so that this module, as
the rest of tokenmill.samples, imports no stage.
"""

from __future__ import annotations

import random
import re
import string
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

KINDS = ("email", "phone", "ip", "credit_card", "iban")
NEGATIVES = (
    "version",
    "timestamp",
    "date",
    "hex_digest",
    "code",
    "url",
    "uuid",
    "isbn",
    "mac_address",
    "number",
)
_LOOSE_NET = re.compile(
    r"@|[0-9][0-9 ().+/-]{6,}[0-9]|[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}|[0-9A-Fa-f]{0,4}::"
    r"|(?:[0-9A-Fa-f]{1,4}:){3}"
)


@dataclass
class PlantedDocument:
    id: str
    text: str
    #: (kind, start, end): personal data planted here; kind in KINDS.
    truth: list[tuple[str, int, int]] = field(default_factory=list)
    #: (negative type, start, end): look-alikes planted here that are not personal data.
    negatives: list[tuple[str, int, int]] = field(default_factory=list)


def clean_hosts(texts: Iterable[str], min_chars: int = 200, max_chars: int = 4000) -> list[str]:
    """Texts the loose net finds nothing in (so they hold no personal data), cut to `max_chars` at a
    paragraph or line break."""
    hosts = []
    for text in texts:
        text = text[:max_chars].rsplit("\n", 1)[0] if len(text) > max_chars else text
        if len(text) >= min_chars and not _LOOSE_NET.search(text):
            hosts.append(text)
    return hosts


# ----------------------------------------------------------------------------------------- positives

_FIRST = [
    "anna",
    "li",
    "maria",
    "jose",
    "wei",
    "fatima",
    "olga",
    "james",
    "priya",
    "kenji",
    "lucas",
    "emma",
    "noah",
    "sofia",
    "omar",
    "chloe",
    "dmitri",
    "aisha",
    "jan",
    "ines",
]
_LAST = [
    "smith",
    "garcia",
    "mueller",
    "dubois",
    "tanaka",
    "okafor",
    "kowalski",
    "nguyen",
    "rossi",
    "silva",
    "jensen",
    "ivanova",
    "patel",
    "haddad",
    "oconnor",
    "schmidt",
    "martin",
    "kim",
    "novak",
    "costa",
]
_DOMAINS = [
    "gmail.com",
    "yahoo.co.uk",
    "outlook.com",
    "web.de",
    "orange.fr",
    "proton.me",
    "mail.uni-bonn.de",
    "cs.stanford.edu",
    "acme-widgets.io",
    "example.com",
    "example.org",
    "post.harvard.edu",
    "company.co.jp",
    "gmx.net",
    "icloud.com",
]


def _email(rng: random.Random) -> str:
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    local = rng.choice(
        [
            f"{first}.{last}",
            f"{first[0]}{last}",
            f"{first}_{last}{rng.randint(1, 99)}",
            f"{first}+news",
            f"{last}.{first}",
            f"{first}{rng.randint(1970, 2005)}",
            f"{first}-{last}",
        ]
    )
    return f"{local}@{rng.choice(_DOMAINS)}"


def _digits(rng: random.Random, count: int) -> str:
    return "".join(rng.choice(string.digits) for _ in range(count))


def _nanp(rng: random.Random) -> tuple[str, str, str]:
    npa = f"{rng.randint(2, 9)}{rng.randint(0, 8)}{rng.randint(0, 9)}"
    while npa[1:] == "11":
        npa = f"{rng.randint(2, 9)}{rng.randint(0, 8)}{rng.randint(0, 9)}"
    nxx = f"{rng.randint(2, 9)}{_digits(rng, 2)}"
    while nxx[1:] == "11":
        nxx = f"{rng.randint(2, 9)}{_digits(rng, 2)}"
    return npa, nxx, _digits(rng, 4)


def _phone(rng: random.Random) -> str:
    form = rng.randrange(14)
    if form < 4:  # NANP
        npa, nxx, line = _nanp(rng)
        return [
            f"({npa}) {nxx}-{line}",
            f"{npa}-{nxx}-{line}",
            f"{npa}.{nxx}.{line}",
            f"1-{npa}-{nxx}-{line}",
        ][form]
    if form == 4:
        npa, nxx, line = _nanp(rng)
        return rng.choice([f"+1 {npa} {nxx} {line}", f"+1 ({npa}) {nxx}-{line}", f"+1{npa}{nxx}{line}"])
    if form == 5:  # UK national
        return rng.choice(
            [
                f"020 {rng.randint(3, 8)}{_digits(rng, 3)} {_digits(rng, 4)}",
                f"0161 {_digits(rng, 3)} {_digits(rng, 4)}",
                f"01632 {_digits(rng, 3)} {_digits(rng, 3)}",
                f"07{rng.randint(4, 9)}{_digits(rng, 2)} {_digits(rng, 6)}",
                f"(020) {rng.randint(3, 8)}{_digits(rng, 3)} {_digits(rng, 4)}",
            ]
        )
    if form == 6:  # UK international
        return rng.choice(
            [
                f"+44 20 {rng.randint(3, 8)}{_digits(rng, 3)} {_digits(rng, 4)}",
                f"+44 (0)20 {_digits(rng, 4)} {_digits(rng, 4)}",
                f"+44 7{rng.randint(4, 9)}{_digits(rng, 2)} {_digits(rng, 6)}",
            ]
        )
    if form == 7:  # France
        pairs = [f"{rng.randint(1, 7)}"] + [_digits(rng, 2) for _ in range(4)]
        separator = rng.choice([" ", ".", "-"])
        return "0" + pairs[0] + separator + separator.join(pairs[1:])
    if form == 8:
        return "+33 " + str(rng.randint(1, 7)) + " " + " ".join(_digits(rng, 2) for _ in range(4))
    if form == 9:  # Germany
        area = rng.choice(["30", "40", "89", "221", "69", "711", "351", "151", "172", "6221"])
        subscriber = _digits(rng, 11 - len(area) - rng.randint(0, 2))
        subscriber = str(rng.randint(1, 9)) + subscriber[1:]
        return rng.choice([f"0{area} {subscriber}", f"0{area}/{subscriber}", f"(0{area}) {subscriber}"])
    if form == 10:
        area = rng.choice(["30", "40", "89", "221", "69"])
        return f"+49 {area} {rng.randint(1, 9)}{_digits(rng, 6)}"
    # Other countries in E.164 form.
    return rng.choice(
        [
            f"+61 2 {_digits(rng, 4)} {_digits(rng, 4)}",
            f"+81 3-{_digits(rng, 4)}-{_digits(rng, 4)}",
            f"+91 9{_digits(rng, 4)} {_digits(rng, 5)}",
            f"+86 10 {_digits(rng, 4)} {_digits(rng, 4)}",
            f"+34 91 {_digits(rng, 3)} {_digits(rng, 2)} {_digits(rng, 2)}",
            f"+39 06 {_digits(rng, 4)} {_digits(rng, 4)}",
            f"+31 20 {_digits(rng, 3)} {_digits(rng, 4)}",
            f"+55 11 9{_digits(rng, 4)}-{_digits(rng, 4)}",
        ]
    )


def _public_ipv4(rng: random.Random) -> str:
    while True:
        octets = [rng.randint(1, 223), rng.randint(0, 255), rng.randint(0, 255), rng.randint(1, 254)]
        first, second = octets[0], octets[1]
        private = first in (10, 127) or (first == 172 and 16 <= second <= 31) or (first, second) == (192, 168)
        special = first in (0, 100, 169, 192, 198, 203)
        if not private and not special:
            return ".".join(map(str, octets))


def _ip(rng: random.Random) -> str:
    form = rng.randrange(5)
    if form < 3:
        return _public_ipv4(rng) + (f":{rng.randint(1024, 65535)}" if form == 2 else "")
    groups = [f"{rng.randint(0, 0xFFFF):x}" for _ in range(8)]
    groups[0] = f"2{rng.randint(0, 0xFFF):03x}"
    if form == 3:
        return ":".join(groups)
    cut = rng.randint(3, 6)
    return ":".join(groups[:cut]) + "::" + groups[-1]


def luhn_digit(partial: str) -> str:
    """The Luhn check digit that completes `partial`."""
    total = 0
    for position, character in enumerate(reversed(partial)):
        value = int(character)
        if position % 2 == 0:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return str((10 - total % 10) % 10)


def _card(rng: random.Random) -> str:
    prefix, length = rng.choice(
        [
            ("4", 16),
            ("4", 16),
            ("51", 16),
            ("55", 16),
            ("2221", 16),
            ("34", 15),
            ("37", 15),
            ("6011", 16),
            ("65", 16),
            ("3530", 16),
            ("36", 14),
            ("62", 16),
        ]
    )
    partial = prefix + _digits(rng, length - len(prefix) - 1)
    number = partial + luhn_digit(partial)
    style = rng.randrange(3)
    if style == 0:
        return number
    separator = " " if style == 1 else "-"
    if length == 15:
        return separator.join([number[:4], number[4:10], number[10:]])
    if length == 14:
        return separator.join([number[:4], number[4:10], number[10:]])
    return separator.join(number[i : i + 4] for i in range(0, length, 4))


_IBAN_FORMATS = {
    "DE": "8n10n",
    "GB": "4a14n",
    "FR": "10n11c2n",
    "ES": "20n",
    "IT": "1a10n12c",
    "NL": "4a10n",
    "BE": "12n",
    "CH": "5n12c",
    "AT": "16n",
    "PL": "24n",
}


def _iban(rng: random.Random) -> str:
    country = rng.choice(sorted(_IBAN_FORMATS))
    bban = ""
    for count, kind in re.findall(r"(\d+)([nac])", _IBAN_FORMATS[country]):
        alphabet = {
            "n": string.digits,
            "a": string.ascii_uppercase,
            "c": string.digits + string.ascii_uppercase,
        }
        bban += "".join(rng.choice(alphabet[kind]) for _ in range(int(count)))
    numeric = int("".join(str(int(c, 36)) for c in bban + country + "00"))
    iban = f"{country}{98 - numeric % 97:02d}{bban}"
    return iban if rng.random() < 0.4 else " ".join(iban[i : i + 4] for i in range(0, len(iban), 4))


_POSITIVES = {"email": _email, "phone": _phone, "ip": _ip, "credit_card": _card, "iban": _iban}
_CARRIERS = {
    "email": [
        "Write to {} for a copy.",
        "Contact: {}",
        "Questions go to {} or the list.",
        "(reported by {})",
    ],
    "phone": [
        "Call {} for support.",
        "or ring {} after six.",
        "Tel. {}",
        "The office is on {} today.",
        "Reach us at {}, weekdays.",
    ],
    "ip": [
        "The server at {} answered.",
        "Blocked {} after five attempts.",
        "connect to {} first.",
        "from host {} (the proxy)",
    ],
    "credit_card": ["Card {} was charged.", "paid with {} on file.", "card number: {}"],
    "iban": ["Transfer to {} by Friday.", "IBAN: {}", "account {} (current)"],
}

# ----------------------------------------------------------------------------------------- negatives


def _hex(rng: random.Random, count: int) -> str:
    return "".join(rng.choice("0123456789abcdef") for _ in range(count))


def _isbn13(rng: random.Random) -> str:
    body = "978" + _digits(rng, 9)
    check = (10 - sum(int(d) * (1 if i % 2 == 0 else 3) for i, d in enumerate(body)) % 10) % 10
    number = body + str(check)
    return rng.choice([f"{number[:3]}-{number[3]}-{number[4:7]}-{number[7:12]}-{number[12]}", number])


def _negative(rng: random.Random, kind: str) -> str:
    year, month, day = rng.randint(1990, 2030), rng.randint(1, 12), rng.randint(1, 28)
    hour, minute, second = rng.randint(0, 23), rng.randint(0, 59), rng.randint(0, 59)
    if kind == "version":
        return rng.choice(
            [
                f"version {rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 9)}.{rng.randint(0, 99)}",
                f"v{rng.randint(1, 9)}.{rng.randint(0, 20)}.{rng.randint(0, 30)}",
                f"10.0.{rng.randint(10000, 22999)}.{rng.randint(100, 4000)}",
                f"1.3.6.1.4.1.{rng.randint(1, 60000)}.{rng.randint(1, 9)}",
                f"release {rng.randint(1, 9)}.{rng.randint(0, 9)}.{rng.randint(0, 9)}.{rng.randint(0, 9)}",
                f"{rng.randint(1, 4)}.{rng.randint(0, 12)}.{rng.randint(0, 9)}"
                f"-rc.{rng.randint(1, 5)}+build.{rng.randint(1, 999)}",
                f"section {rng.randint(1, 9)}.{rng.randint(1, 9)}.{rng.randint(1, 9)}.{rng.randint(1, 9)}",
            ]
        )
    if kind == "timestamp":
        return rng.choice(
            [
                f"{year}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}Z",
                f"{year}-{month:02d}-{day:02d} {hour:02d}:{minute:02d}:{second:02d}.{_digits(rng, 6)}",
                f"{year}-{month:02d}-{day:02d}T{hour:02d}:{minute:02d}:{second:02d}+05:30",
                f"{hour:02d}:{minute:02d}:{second:02d}",
                str(rng.randint(1_000_000_000, 1_900_000_000)),
                str(rng.randint(1_000_000_000_000, 1_900_000_000_000)),
                f"Mon, {day:02d} Jan {year} {hour:02d}:{minute:02d}:{second:02d} +0000",
            ]
        )
    if kind == "date":
        return rng.choice(
            [
                f"{day:02d}/{month:02d}/{year}",
                f"{year}/{month:02d}/{day:02d}",
                f"{month:02d}-{day:02d}-{year}",
                f"{day:02d}.{month:02d}.{year}",
                f"{year}-{month:02d}-{day:02d}",
                f"{day:02d} {month:02d} {year}",
                f"{year}{month:02d}{day:02d}",
                f"{year}-{year + 3}",
            ]
        )
    if kind == "hex_digest":
        return _hex(rng, rng.choice([7, 12, 32, 40, 64]))
    if kind == "code":
        return rng.choice(
            [
                "0x7fffffff",
                "a[1::2]",
                "std::vector<int>",
                "x = y @ w",
                "@property",
                "1e-10",
                "arr[10::3]",
                "os.chmod(path, 0o755)",
                "shape == (3, 224, 224)",
                "icon@2x.png",
                "@types/node@18.11.9",
                "Foo::Bar::baz()",
                f"0x{_hex(rng, 16)}",
                "range(0, 1000000, 5)",
                f"seed = {_digits(rng, 9)}",
                'printf("%d.%d.%d.%d", a, b, c, d)',
            ]
        )
    if kind == "url":
        return rng.choice(
            [
                f"https://docs.python.org/3.{rng.randint(8, 13)}/library/ipaddress.html",
                f"https://github.com/psf/requests/commit/{_hex(rng, 40)}",
                f"https://example.org/releases/v{rng.randint(1, 9)}.{rng.randint(0, 9)}.{rng.randint(0, 9)}/",
                f"https://medium.com/@writer/a-post-{_hex(rng, 12)}",
                f"https://www.youtube.com/watch?v={_hex(rng, 11)}",
                f"https://arxiv.org/abs/{rng.randint(1500, 2412)}.{_digits(rng, 5)}",
                f"https://en.wikipedia.org/wiki/ISO_{rng.randint(1000, 9999)}",
            ]
        )
    if kind == "uuid":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "isbn":
        return rng.choice([_isbn13(rng), f"ISBN 0-{_digits(rng, 3)}-{_digits(rng, 5)}-{rng.randint(0, 9)}"])
    if kind == "mac_address":
        return ":".join(f"{rng.randint(0, 255):02X}" for _ in range(6))
    return rng.choice(
        [
            f"{rng.randint(1, 999)},{_digits(rng, 3)},{_digits(rng, 3)}",
            f"${rng.randint(1, 9)},{_digits(rng, 3)}.99",
            "3.14159265358979",
            "18446744073709551615",
            "9223372036854775807",
            "4294967295",
            f"{rng.uniform(-90, 90):.4f}, {rng.uniform(-180, 180):.4f}",
            f"{rng.randint(10000, 99999)}-{_digits(rng, 4)}",
            f"RFC {rng.randint(700, 9999)}",
            f"{rng.randint(1, 99)}.{rng.randint(0, 9)}%",
            f"PO {_digits(rng, 10)}",
        ]
    )


_NEGATIVE_CARRIERS = [
    "See {} for the details.",
    "It was {} then.",
    "(fixed in {})",
    "The value {} is kept.",
    "noted: {}.",
]


def planted_documents(
    hosts: Sequence[str], documents: int, seed: int = 34, positives: int = 3, negatives: int = 4
) -> list[PlantedDocument]:
    """`documents` documents, each a host text with `positives` personal-data values (kinds taken in turn,
    so each is planted about equally often) and `negatives` look-alikes, each in a carrier sentence put
    at a sentence end of the host."""
    rng = random.Random(seed)
    made = []
    turn = 0
    for number in range(documents):
        host = hosts[rng.randrange(len(hosts))]
        inserts: list[tuple[str, str, bool]] = []
        for _ in range(positives):
            kind = KINDS[turn % len(KINDS)]
            turn += 1
            inserts.append((kind, rng.choice(_CARRIERS[kind]).format("\x00") + " ", True))
        for _ in range(negatives):
            inserts.append(
                (rng.choice(NEGATIVES), rng.choice(_NEGATIVE_CARRIERS).format("\x00") + " ", False)
            )
        rng.shuffle(inserts)
        # Sentence ends of the host (after ". "), where the carriers go; the start if there are none.
        ends = [0] + [match.end() for match in re.finditer(r"\. ", host)]
        places = sorted(rng.choice(ends) for _ in inserts)
        document = PlantedDocument(id=f"planted-{number:05d}", text="")
        cursor = 0
        parts: list[str] = []
        length = 0
        for place, (kind, carrier, positive) in zip(places, inserts, strict=True):
            parts.append(host[cursor:place])
            length += place - cursor
            cursor = place
            value = _POSITIVES[kind](rng) if positive else _negative(rng, kind)
            before, after = carrier.split("\x00")
            start = length + len(before)
            (document.truth if positive else document.negatives).append((kind, start, start + len(value)))
            parts.append(before + value + after)
            length += len(before) + len(value) + len(after)
        parts.append(host[cursor:])
        document.text = "".join(parts)
        made.append(document)
    return made


@dataclass
class KindScore:
    planted: int = 0
    found: int = 0
    true_positives: int = 0
    exact: int = 0  # true positives whose span is the planted span exactly

    @property
    def precision(self) -> float:
        return self.true_positives / self.found if self.found else 1.0

    @property
    def recall(self) -> float:
        return self.true_positives / self.planted if self.planted else 1.0


def score(
    documents: Sequence[PlantedDocument], finds: Sequence[Sequence[tuple[str, int, int]]]
) -> tuple[dict[str, KindScore], dict[str, int]]:
    """Per kind, the planted values, the finds and those that overlap a planted value of their kind; and
    per negative type, how many of its look-alikes some find overlapped (false positives by cause)."""
    scores = {kind: KindScore() for kind in KINDS}
    negatives_hit = dict.fromkeys(NEGATIVES, 0)
    for document, found in zip(documents, finds, strict=True):
        for kind, _, _ in document.truth:
            scores[kind].planted += 1
        matched: set[int] = set()
        for kind, start, end in found:
            scores[kind].found += 1
            for position, (true_kind, true_start, true_end) in enumerate(document.truth):
                if true_kind == kind and start < true_end and true_start < end and position not in matched:
                    matched.add(position)
                    scores[kind].true_positives += 1
                    scores[kind].exact += (start, end) == (true_start, true_end)
                    break
        for negative, start, end in document.negatives:
            if any(start < f_end and f_start < end for _, f_start, f_end in found):
                negatives_hit[negative] += 1
    return scores, negatives_hit
