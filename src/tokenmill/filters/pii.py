"""Personal data in documents: e-mail addresses, phone numbers, IP addresses, credit-card numbers and IBANs
found, then masked, flagged or the document removed (recipe stage `pii`).

Found by compiled regular expressions and checked by the rule each kind carries; no model, nothing
fetched. Presidio (the usual library) needs a spaCy language model downloaded for its recognizers, and
Google's phonenumbers, the best validator of phone numbers, would be a new core dependency of curate
(whose license files then also join the classifier data, changing every bundled model and cell), and is
slow per call; the rules below are the parts of their checks this stage needs. Where each pattern
comes from:

- e-mail: the dot-atom form of RFC 5322 section 3.4.1 (local part) with an ASCII subset of its atext
  (letters, digits, `_ % + -`), at a domain of RFC 1035 section 2.3.1 labels (letters, digits, inner
  hyphens, at most 63 characters) ending in an alphabetic top-level label. Quoted local parts, comments,
  address literals and internationalized addresses (RFC 6531) are not found. A domain ending in an image
  extension (`icon@2x.png`, a retina asset's name) is not an address.
- IPv4: four dec-octets of RFC 3986 section 3.2.2 (0-255, no leading zeros), not inside a longer dotted
  run (`1.3.6.1.4.1`, an SNMP OID; `10.0.19045.3803`, a Windows build) and not right after a version or
  section word (`version 1.2.3.4`, `release 2.0.1.7`, `section 1.2.3.4`): a dotted quad there is a
  version, anywhere else an address.
- IPv6: the text forms of RFC 4291 section 2.2 (eight groups, `::` compression, an IPv4 tail), found as
  runs of hex digits and colons and parsed by the standard library's `ipaddress`. A run needs three
  groups, or two with a hex letter, so that slices (`a[1::2]`), times (`12:30:45`) and MAC addresses
  (six groups without `::`, which RFC 4291 does not allow) are not addresses.
- phone numbers: international numbers as ITU-T E.164 writes them (`+`, a country code, 8 to 15 digits
  in all, in groups); the national formats with their trunk prefix and grouping: NANP (`(415) 555-0132`,
  `415-555-0132`, `415.555.0132`, `1-800-555-0199`; NPA and exchange 2-9 first and N11 service codes
  excluded, as the NANP numbering plan does), the UK (Ofcom's 0 + 9 or 10 digits: `020 7946 0958`,
  `0161 496 0000`, `01632 960 123`, `07700 900123`), France (ARCEP's ten digits in pairs: `01 23 45 67
  89`), Germany (0 + area code + subscriber, 9 to 12 digits: `030 12345678`, `089/1234567`, `0151
  2345 6789`); and any 7 to 15 digits right after `tel`, `phone`, `fax`, `mobile` or `cell`. Dates,
  times, ISBNs, UUIDs and version strings do not have these shapes (tests/test_pii.py has each).
- credit cards: 13 to 19 digits, contiguous or in the printed groups (4-4-4-4, 4-6-5, 4-4-4-4-3), with
  an issuer's prefix and length (ISO/IEC 7812 IINs of Visa, Mastercard, Amex, Discover, JCB, Diners,
  UnionPay, Maestro) and the Luhn check digit (ISO/IEC 7812-1 annex B).
- IBAN: ISO 13616: a country code, two check digits and the country's BBAN length from the IBAN
  registry (SWIFT), printed contiguous or in groups of four; the whole passes mod 97 = 1 (ISO 7064).

Where two finds overlap, the stronger kind keeps the span (IBAN, e-mail, card, IP, phone): a card
number is never also a phone number.

Reserved names: e-mail addresses at the domains RFC 2606 and RFC 6761 reserve for documentation and
testing (`example.com`, `.test`, `.invalid`, ...) and IP addresses that name no host on the internet
(loopback, unspecified, the documentation ranges of RFC 5737 and RFC 3849, link-local, multicast,
netmasks) are still found; `keep_reserved: true` counts them as `reserved` and leaves them in the text.

Memory and shuffle at 10 TB on 1,000 workers: none; a per-document step. A worker holds the compiled
patterns (kilobytes) and one masked copy of the document it is editing.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from dataclasses import dataclass

from tokenmill.filters.base import DocumentStep, Removal
from tokenmill.filters.normalize import count_words
from tokenmill.formats.documents import PII_KINDS

STAGE = "pii"
#: The kinds, strongest first: where two finds overlap, the earlier kind here keeps the span.
KINDS = ("iban", "email", "credit_card", "ip", "phone")
#: What a masked find becomes (dolma's placeholders).
PLACEHOLDERS = {
    "email": "|||EMAIL_ADDRESS|||",
    "phone": "|||PHONE_NUMBER|||",
    "ip": "|||IP_ADDRESS|||",
    "credit_card": "|||CREDIT_CARD|||",
    "iban": "|||IBAN|||",
}
ACTIONS = ("mask", "flag", "remove")
#: The removal reason of a document that holds a `remove` kind above the density threshold.
REASON = "pii_density"

# --------------------------------------------------------------------------------------------- e-mail

_EMAIL = re.compile(
    r"(?<![\w.%+-])"
    r"[A-Za-z0-9_%+-]+(?:\.[A-Za-z0-9_%+-]+)*"  # RFC 5322 dot-atom, ASCII atext subset
    r"@"
    r"((?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+"  # RFC 1035 labels
    r"[A-Za-z]{2,63})"  # an alphabetic top-level label
    r"(?![\w-]|\.[A-Za-z0-9])"
)
_IMAGE_SUFFIXES = frozenset({"png", "jpg", "jpeg", "gif", "svg", "webp", "ico", "bmp", "tif", "tiff", "avif"})
#: RFC 2606 (example.com/.net/.org, .example, .test, .invalid, .localhost) and RFC 6761/6762 (.local).
_RESERVED_DOMAINS = frozenset({"example.com", "example.net", "example.org"})
_RESERVED_TLDS = frozenset({"example", "test", "invalid", "localhost", "local"})


def _email_reserved(domain: str) -> bool:
    domain = domain.lower()
    last = domain.rsplit(".", 1)[-1]
    return last in _RESERVED_TLDS or any(
        domain == reserved or domain.endswith("." + reserved) for reserved in _RESERVED_DOMAINS
    )


def _find_emails(text: str) -> Iterator[tuple[int, int, bool]]:
    if "@" not in text:
        return
    for match in _EMAIL.finditer(text):
        domain = match.group(1)
        if domain.rsplit(".", 1)[-1].lower() in _IMAGE_SUFFIXES:
            continue
        yield match.start(), match.end(), _email_reserved(domain)


# ------------------------------------------------------------------------------------------ IP addresses

_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"  # RFC 3986 dec-octet
_IPV4 = re.compile(rf"(?<![\w.])(?:{_OCTET}\.){{3}}{_OCTET}(?![\w-]|\.[\w])")
#: Words after which a dotted quad is a version or a section number, not an address.
_VERSION_CUE = re.compile(
    r"(?:\b(?:version|versions|ver|v|release|rel|revision|rev|build|firmware|fw|kernel|update|patch|"
    r"section|sections|sec|chapter|clause|paragraph|figure|fig|table|step|oid|isbn)|§)[\s.:#-]{0,3}$",
    re.IGNORECASE,
)
# RFC 4291 text forms: hex groups and colons, optionally a dotted IPv4 tail; parsed by ipaddress.
_IPV6 = re.compile(
    r"(?<![\w:.])(?=[0-9A-Fa-f]{0,4}:[0-9A-Fa-f]{0,4}:)[0-9A-Fa-f:]+(?:\.[0-9.]+)?(?![\w:]|\.\w)"
)
_HEX_LETTER = re.compile(r"[A-Fa-f]")


def _ip_reserved(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """An address that names no host on the internet: loopback, unspecified, documentation ranges,
    link-local, multicast, or a netmask (255.255.255.0)."""
    if address.is_loopback or address.is_unspecified or address.is_link_local or address.is_multicast:
        return True
    if isinstance(address, ipaddress.IPv4Address):
        value = int(address)
        inverted = ~value & 0xFFFFFFFF
        netmask = value != 0 and (inverted & (inverted + 1)) == 0  # ones then zeros
        documentation = any(
            address in network
            for network in (_TEST_NET_1, _TEST_NET_2, _TEST_NET_3)  # RFC 5737
        )
        return netmask or documentation or address == ipaddress.IPv4Address("255.255.255.255")
    return address in _IPV6_DOCUMENTATION  # RFC 3849


_TEST_NET_1 = ipaddress.IPv4Network("192.0.2.0/24")
_TEST_NET_2 = ipaddress.IPv4Network("198.51.100.0/24")
_TEST_NET_3 = ipaddress.IPv4Network("203.0.113.0/24")
_IPV6_DOCUMENTATION = ipaddress.IPv6Network("2001:db8::/32")


def _find_ips(text: str) -> Iterator[tuple[int, int, bool]]:
    # IPv6 first: an address with an IPv4 tail (::ffff:192.0.2.128) is one find, not its tail.
    if "::" in text or text.count(":") >= 7:
        for match in _IPV6.finditer(text):
            candidate = match.group()
            groups = [group for group in candidate.split(":") if group]
            if len(groups) < 3 and not (len(groups) == 2 and _HEX_LETTER.search(candidate)):
                continue
            try:
                address = ipaddress.IPv6Address(candidate)
            except ValueError:
                continue
            yield match.start(), match.end(), _ip_reserved(address)
    if "." in text:
        for match in _IPV4.finditer(text):
            if _VERSION_CUE.search(text, max(0, match.start() - 16), match.start()):
                continue
            yield match.start(), match.end(), _ip_reserved(ipaddress.IPv4Address(match.group()))


# --------------------------------------------------------------------------------------- phone numbers

_PHONE_START = r"(?<![\w+.,/-])"
_PHONE_END = r"(?![\w]|[-./]\d)"
_PHONE = re.compile(
    _PHONE_START + r"(?:"
    # E.164 as written: +, country code, groups (a "(0)" trunk digit allowed after the country code).
    r"(?P<e164>\+[1-9][0-9]{0,2}(?:[ ]?\(0\))?(?:[ .-]?\(?[0-9]{1,5}\)?){1,6})"
    # NANP: optional 1, NPA [2-9][0-8][0-9] (not N11), exchange [2-9]xx, line xxxx; one separator kind.
    r"|(?P<nanp>(?:1[ .-])?(?:\([2-9][0-8][0-9]\)[ ]?|[2-9][0-8][0-9](?P<sep>[ .-]))"
    r"[2-9][0-9]{2}(?(sep)(?P=sep)|[ .-])[0-9]{4})"
    # UK: 0 + 9 or 10 digits as Ofcom groups them (2+4+4 after 0, 3+3+4, 4+3+3, 4+6).
    r"|(?P<uk>\(?0[1235789][0-9]\)?[ -]?[0-9]{4}[ -]?[0-9]{4}"
    r"|\(?0[1235789][0-9]{2}\)?[ -]?[0-9]{3}[ -]?[0-9]{4}"
    r"|\(?0[1235789][0-9]{3}\)?[ -]?[0-9]{3}[ -]?[0-9]{3}"
    r"|\(?0[1235789][0-9]{3}\)?[ -]?[0-9]{6})"
    # France: 0 + 9 digits in pairs, one separator kind.
    r"|(?P<fr>0[1-9](?P<frsep>[ .-])[0-9]{2}(?:(?P=frsep)[0-9]{2}){3})"
    # Germany: 0 + area code (2-5 digits) + subscriber, separated by space, slash or hyphen.
    r"|(?P<de>\(?0[1-9][0-9]{1,4}\)?(?:[ ]?/[ ]?|[ -])[0-9]{3,9}(?:-[0-9]{1,5}|[ ][1-9][0-9]{0,4})?)"
    r")" + _PHONE_END
)
# Any 7-15 digits after a telephone word ("Tel.: 0301234567", "phone 4155550132").
_PHONE_CUED = re.compile(
    r"\b(?:tel|telephone|phone|ph|fax|mobile|mob|cell|whatsapp)\b\.?(?:[ ]?(?:no|number|nr)\b\.?)?"
    r"[ ]?[:.#]?[ ]?"
    r"(?P<number>\+?\(?[0-9](?:[0-9]|[ ./-](?=[0-9])|\)[ ]?|[ ]?\()*[0-9])(?![\w]|[-./]\d)",
    re.IGNORECASE,
)
_DIGITS = re.compile(r"[0-9]")


_DIGIT_RUN = re.compile(r"[0-9]+")


def _find_phones(text: str) -> Iterator[tuple[int, int, bool]]:
    for match in _PHONE.finditer(text):
        digits = len(_DIGITS.findall(match.group()))
        if match.group("e164") is not None:
            value = match.group("e164")
            compact = not any(separator in value for separator in " .-()")
            groups = _DIGIT_RUN.findall(value)[1:]
            # E.164: at most 15 digits. Written in groups, a number has at least two of two digits or more
            # (+33 1 23 45 67 89); "+1 2 3 4 5 6 7 8" is arithmetic.
            if digits - value.count("(0)") > 15 or digits < (10 if compact else 8):
                continue
            if not compact and sum(len(group) >= 2 for group in groups) < 2:
                continue
        elif match.group("nanp") is not None:
            number = "".join(_DIGITS.findall(match.group()))[-10:]
            if number[1:3] == "11" or number[4:6] == "11":  # N11 service codes are neither NPA nor NXX
                continue
        elif match.group("de") is not None and not 9 <= digits <= 12:
            continue
        yield match.start(), match.end(), False
    for match in _PHONE_CUED.finditer(text):
        digits = len(_DIGITS.findall(match.group("number")))
        if 7 <= digits <= 15:
            yield match.start("number"), match.end("number"), False


# ------------------------------------------------------------------------------------ credit-card numbers

_CARD = re.compile(
    r"(?<![\w.,-])(?:"
    r"[0-9]{4}(?P<s1>[ -])[0-9]{4}(?P=s1)[0-9]{4}(?P=s1)[0-9]{4}(?:(?P=s1)[0-9]{3})?"  # 4-4-4-4(-3)
    r"|[0-9]{4}(?P<s2>[ -])[0-9]{6}(?P=s2)[0-9]{4,5}"  # Amex 4-6-5, Diners 4-6-4
    r"|[0-9]{13,19}"
    r")(?![\w]|[.,-][0-9])"
)


def luhn_valid(digits: str) -> bool:
    """The Luhn check (ISO/IEC 7812-1 annex B): every second digit from the right doubled."""
    total = 0
    for position, character in enumerate(reversed(digits)):
        value = ord(character) - 48
        if position % 2:
            value *= 2
            if value > 9:
                value -= 9
        total += value
    return total % 10 == 0


def card_issuer_valid(digits: str) -> bool:
    """An issuer's prefix (IIN range) with one of its lengths: Visa, Mastercard, Amex, Discover, JCB,
    Diners Club, UnionPay, Maestro."""
    length = len(digits)
    two, three, four, six = int(digits[:2]), int(digits[:3]), int(digits[:4]), int(digits[:6])
    if digits[0] == "4":  # Visa
        return length in (13, 16, 19)
    if 51 <= two <= 55 or 222100 <= six <= 272099:  # Mastercard
        return length == 16
    if two in (34, 37):  # American Express
        return length == 15
    if four == 6011 or two == 65 or 644 <= three <= 649 or 622126 <= six <= 622925:  # Discover
        return 16 <= length <= 19
    if 3528 <= four <= 3589:  # JCB
        return 16 <= length <= 19
    if 300 <= three <= 305 or two in (36, 38, 39) or four == 3095:  # Diners Club
        return 14 <= length <= 19
    if two == 62:  # UnionPay
        return 16 <= length <= 19
    if two in (50, 56, 57, 58) or two == 67 or two == 63:  # Maestro
        return 12 <= length <= 19
    return False


def _find_cards(text: str) -> Iterator[tuple[int, int, bool]]:
    for match in _CARD.finditer(text):
        digits = match.group().replace(" ", "").replace("-", "")
        if 13 <= len(digits) <= 19 and card_issuer_valid(digits) and luhn_valid(digits):
            yield match.start(), match.end(), False


# ------------------------------------------------------------------------------------------------ IBANs

#: ISO 13616 country codes and IBAN lengths, from the SWIFT IBAN registry.
IBAN_LENGTHS = {
    "AD": 24, "AE": 23, "AL": 28, "AT": 20, "AZ": 28, "BA": 20, "BE": 16, "BG": 22, "BH": 22, "BI": 27,
    "BR": 29, "BY": 28, "CH": 21, "CR": 22, "CY": 28, "CZ": 24, "DE": 22, "DJ": 27, "DK": 18, "DO": 28,
    "EE": 20, "EG": 29, "ES": 24, "FI": 18, "FK": 18, "FO": 18, "FR": 27, "GB": 22, "GE": 22, "GI": 23,
    "GL": 18, "GR": 27, "GT": 28, "HR": 21, "HU": 28, "IE": 22, "IL": 23, "IQ": 23, "IS": 26, "IT": 27,
    "JO": 30, "KW": 30, "KZ": 20, "LB": 28, "LC": 32, "LI": 21, "LT": 20, "LU": 20, "LV": 21, "LY": 25,
    "MC": 27, "MD": 24, "ME": 22, "MK": 19, "MN": 20, "MR": 27, "MT": 31, "MU": 30, "NI": 28, "NL": 18,
    "NO": 15, "OM": 23, "PK": 24, "PL": 28, "PS": 29, "PT": 25, "QA": 29, "RO": 24, "RS": 22, "RU": 33,
    "SA": 24, "SC": 31, "SD": 18, "SE": 24, "SI": 19, "SK": 24, "SM": 27, "SO": 23, "ST": 25, "SV": 28,
    "TL": 23, "TN": 24, "TR": 26, "UA": 29, "VA": 22, "VG": 24, "XK": 20, "YE": 30,
}  # fmt: skip
_IBAN = re.compile(r"(?<![\w])[A-Z]{2}[0-9]{2}(?:[ ]?[A-Z0-9]{4}){2,7}(?:[ ]?[A-Z0-9]{1,3})?(?![\w])")


def iban_valid(compact: str) -> bool:
    """ISO 13616: the country's length and ISO 7064 mod 97-10 (the first four characters moved to the
    end, letters as 10-35, the number mod 97 is 1)."""
    if IBAN_LENGTHS.get(compact[:2]) != len(compact):
        return False
    rearranged = compact[4:] + compact[:4]
    return int("".join(str(int(character, 36)) for character in rearranged)) % 97 == 1


def _find_ibans(text: str) -> Iterator[tuple[int, int, bool]]:
    for match in _IBAN.finditer(text):
        value = match.group()
        compact = value.replace(" ", "")
        if iban_valid(compact):
            yield match.start(), match.end(), False
            continue
        # A trailing group that belongs to the next words ("... 1234 5678 90 ABCD"): try shorter ends.
        length = IBAN_LENGTHS.get(compact[:2])
        if length and len(compact) > length:
            end, kept = match.start(), 0
            for position, character in enumerate(value):
                if character != " ":
                    kept += 1
                if kept == length:
                    end = match.start() + position + 1
                    break
            if iban_valid(text[match.start() : end].replace(" ", "")) and not text[end : end + 1].isalnum():
                yield match.start(), end, False


_FINDERS = {
    "iban": _find_ibans,
    "email": _find_emails,
    "credit_card": _find_cards,
    "ip": _find_ips,
    "phone": _find_phones,
}


@dataclass(frozen=True)
class Find:
    """One piece of personal data in a text: its kind, span, and whether it is a reserved name."""

    kind: str
    start: int
    end: int
    reserved: bool = False


def find_pii(text: str, kinds: tuple[str, ...] = KINDS) -> list[Find]:
    """Every find of the given kinds in `text`, in text order, without overlaps (the stronger kind of
    KINDS keeps a contested span)."""
    taken: list[tuple[int, int]] = []
    finds: list[Find] = []
    for kind in KINDS:
        if kind not in kinds:
            continue
        for start, end, reserved in _FINDERS[kind](text):
            if any(start < other_end and other_start < end for other_start, other_end in taken):
                continue
            taken.append((start, end))
            finds.append(Find(kind, start, end, reserved))
    finds.sort(key=lambda find: find.start)
    return finds


def mask(text: str, finds: list[Find]) -> str:
    """`text` with each find replaced by its kind's placeholder (finds in text order, not overlapping)."""
    parts = []
    cursor = 0
    for find in finds:
        parts.append(text[cursor : find.start])
        parts.append(PLACEHOLDERS[find.kind])
        cursor = find.end
    parts.append(text[cursor:])
    return "".join(parts)


class PersonalData(DocumentStep):
    """Find personal data (recipe stage `pii`) and, per kind, `mask` it (the placeholder replaces it),
    `flag` it (counted, the text left as it is) or `remove` the document when that kind is dense: at
    least `remove_min_matches` finds and more than `remove_density` per 1,000 characters (a contact list,
    a leaked table); below that a `remove` kind is masked. A removed document's text is kept with every
    find masked (reason `pii_density`, its counts in `detail`). Every document gets the `pii` column: its
    finds per kind (reserved names left in the text by `keep_reserved` not counted there). The stage
    edits the text it keeps (as line_boilerplate does): `n_chars` and `n_words` are the masked text's.

    Memory and shuffle at 10 TB on 1,000 workers: none; per document, one masked copy of its text.
    """

    stage = STAGE

    def __init__(
        self,
        email: str = "mask",
        phone: str = "mask",
        ip: str = "mask",
        credit_card: str = "mask",
        iban: str = "mask",
        remove_density: float = 1.0,
        remove_min_matches: int = 5,
        keep_reserved: bool = False,
    ):
        self.actions = {"email": email, "phone": phone, "ip": ip, "credit_card": credit_card, "iban": iban}
        for kind, action in self.actions.items():
            if action not in ACTIONS:
                raise ValueError(f"pii {kind}: the action is one of {', '.join(ACTIONS)}, not {action!r}")
        if remove_density < 0:
            raise ValueError(f"pii remove_density must be at least 0, not {remove_density}")
        if not isinstance(remove_min_matches, int) or remove_min_matches < 1:
            raise ValueError(f"pii remove_min_matches must be an integer >= 1, not {remove_min_matches!r}")
        self.remove_density = float(remove_density)
        self.remove_min_matches = remove_min_matches
        self.keep_reserved = bool(keep_reserved)
        self._stats: dict = {}

    def judge(self, document: dict) -> Removal | None:
        """Annotate (and mask) one document; a Removal when a `remove` kind is dense in it."""
        text = document["text"]
        finds = find_pii(text)
        stats = self._stats
        stats["documents"] = stats.get("documents", 0) + 1
        if self.keep_reserved:
            for find in finds:
                if find.reserved:
                    _count(stats, find.kind, "reserved")
            finds = [find for find in finds if not find.reserved]
        counts = dict.fromkeys(PII_KINDS, 0)
        for find in finds:
            counts[find.kind] += 1
        document["pii"] = counts
        if not finds:
            return None
        stats["documents_with_pii"] = stats.get("documents_with_pii", 0) + 1
        per_1000 = 1000 / max(1, len(text))
        dense = [
            kind
            for kind, count in counts.items()
            if self.actions[kind] == "remove"
            and count >= self.remove_min_matches
            and count * per_1000 > self.remove_density
        ]
        if dense:
            stats["documents_removed"] = stats.get("documents_removed", 0) + 1
            for kind, count in counts.items():
                if count:
                    _count(stats, kind, "removed", count)
            # removed/ keeps the document with every find masked: what is removed is still published as
            # an example on the overview page.
            document["text"] = mask(text, finds)
            return Removal(
                REASON,
                {
                    "kinds": sorted(dense),
                    "counts": {kind: count for kind, count in counts.items() if count},
                    "per_1000_chars": round(max(counts[kind] for kind in dense) * per_1000, 3),
                    "remove_density": self.remove_density,
                },
            )
        masked = [find for find in finds if self.actions[find.kind] != "flag"]
        for find in finds:
            _count(stats, find.kind, "flagged" if self.actions[find.kind] == "flag" else "masked")
        if masked:
            document["text"] = mask(text, masked)
            document["n_chars"] = len(document["text"])
            document["n_words"] = count_words(document["text"])
            stats["documents_masked"] = stats.get("documents_masked", 0) + 1
        return None

    def apply(self, documents: list[dict]) -> list[Removal | None]:
        return [self.judge(document) for document in documents]

    def drain_stats(self) -> dict:
        """Counts since the last call, then reset: `documents` (checked), `documents_with_pii`,
        `documents_masked`, `documents_removed`, and per kind the finds `masked`, `flagged`, `removed`
        (in removed documents) and `reserved` (left in the text by keep_reserved)."""
        stats, self._stats = self._stats, {}
        return stats


def _count(stats: dict, kind: str, outcome: str, count: int = 1) -> None:
    kind_stats = stats.setdefault(kind, {})
    kind_stats[outcome] = kind_stats.get(outcome, 0) + count
