"""The `pii` stage: each kind's pattern against the standard it comes from, the hard negatives that must not
be found, the check digits, mask / flag / remove with the document accounting, and the planted evaluation
on a small set (bench/pii_eval.py runs the large one)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tokenmill.filters.pii import (
    PLACEHOLDERS,
    REASON,
    PersonalData,
    card_issuer_valid,
    find_pii,
    iban_valid,
    luhn_valid,
    mask,
)
from tokenmill.formats.documents import DOCUMENT_SCHEMA, PII, PII_KINDS, curated_dataset, removed_dataset
from tokenmill.pipelines.recipe import RecipeError, load_recipe
from tokenmill.samples.pii import clean_hosts, planted_documents, score
from tokenmill.samples.text import prose_paragraphs

REPO = Path(__file__).resolve().parents[1]


def found(text: str) -> list[tuple[str, str]]:
    return [(find.kind, text[find.start : find.end]) for find in find_pii(text)]


# Each positive with where its form comes from; each is found alone, with exactly its span.
POSITIVES = [
    ("email", "john.smith@gmail.com"),  # RFC 5322 3.4.1 dot-atom local part
    ("email", "a.b+tag@mail.example.co.uk"),  # atext '+', RFC 1035 labels, several of them
    ("email", "o_neil-99%x@uni-bonn.de"),  # atext '_', '-', '%'; a hyphen inside a label
    ("email", "team@example.com"),  # RFC 2606 documentation domain: still an address
    ("ip", "8.8.8.8"),  # RFC 3986 3.2.2 dec-octets
    ("ip", "203.0.114.255"),
    ("ip", "2001:0db8:85a3:0000:0000:8a2e:0370:7334"),  # RFC 4291 2.2 (1), the full form
    ("ip", "2a00:1450:4001:82b::200e"),  # RFC 4291 2.2 (2), "::" compression
    ("ip", "fe80::1ff:fe23:4567:890a"),
    ("ip", "::ffff:81.2.69.160"),  # RFC 4291 2.2 (3), an IPv4 tail: one find, not its tail
    ("phone", "+44 20 7946 0958"),  # ITU-T E.164 international form, UK
    ("phone", "+1 (415) 555-0132"),
    ("phone", "+49 30 901820"),
    ("phone", "+33 1 23 45 67 89"),
    ("phone", "+44 (0)20 7946 0958"),  # the UK's bracketed trunk digit after the country code
    ("phone", "+14155552671"),  # E.164 compact
    ("phone", "(415) 555-0132"),  # NANP: NPA [2-9][0-8]x, exchange [2-9]xx
    ("phone", "415-555-0132"),
    ("phone", "415.555.0132"),
    ("phone", "1-800-555-0199"),
    ("phone", "020 7946 0958"),  # Ofcom: 02x + 8 digits
    ("phone", "0161 496 0000"),  # 01xx + 7 digits
    ("phone", "01632 960 123"),  # 01xxx + 6 digits
    ("phone", "07700 900123"),  # mobile
    ("phone", "01 23 45 67 89"),  # ARCEP: ten digits in pairs
    ("phone", "01.23.45.67.89"),
    ("phone", "030 12345678"),  # Germany: 0 + area code + subscriber
    ("phone", "089/1234567"),
    ("phone", "0151 2345 6789"),
    ("credit_card", "4111 1111 1111 1111"),  # ISO/IEC 7812 Visa IIN, Luhn
    ("credit_card", "5555-5555-5555-4444"),  # Mastercard
    ("credit_card", "378282246310005"),  # Amex, 15 digits
    ("credit_card", "3714 496353 98431"),  # Amex's printed 4-6-5 grouping
    ("credit_card", "6011111111111117"),  # Discover
    ("iban", "DE89 3704 0044 0532 0130 00"),  # ISO 13616 printed form, mod 97 = 1
    ("iban", "GB82WEST12345698765432"),  # ISO 13616's own example, electronic form
    ("iban", "FR1420041010050500013M02606"),  # a letter in the BBAN
    ("iban", "NO9386011117947"),  # the shortest (15)
]


@pytest.mark.parametrize(("kind", "value"), POSITIVES)
def test_each_positive_is_found_alone_with_its_span(kind, value):
    assert found(f"See {value} here.") == [(kind, value)]


# Hard negatives: shapes that look like personal data and are not.
NEGATIVES = [
    "version 1.2.3.4",  # a dotted quad after a version word is a version (docs/curate.md)
    "release 2.0.1.7",
    "section 4.2.1.3",
    "10.0.19045.3803",  # a Windows build: five parts
    "1.3.6.1.4.1.311",  # an SNMP OID
    "v1.2.3.4",
    "256.1.1.1",  # not a dec-octet
    "010.001.002.003",  # leading zeros: RFC 3986 has none
    "1.0.0-rc.1+build.5",
    "2024-01-15T10:30:00+05:30",
    "2024-01-15 10:30:45.123456",
    "12:30:45",
    "Mon, 15 Jan 2024 10:30:00 +0000",
    "1700000000123",  # epoch milliseconds: no issuer starts with 1
    "15/01/2024",
    "05/06/2024",
    "01-15-2024",
    "15.01.2024",
    "20240115",
    "0800-1700",  # opening hours
    "d41d8cd98f00b204e9800998ecf8427e",
    "da39a3ee5e6b4b0d3255bfef95601890afd80709",
    "0x7fffffff",
    "a[1::2]",
    "arr[10::3]",
    "std::vector<int>",
    "x = y @ w",
    "icon@2x.png",  # an image's name, not an address
    "@types/node@18.11.9",
    "https://medium.com/@writer/a-post",
    "https://docs.python.org/3.12/library/ipaddress.html",
    "123e4567-e89b-12d3-a456-426614174000",  # UUID
    "12345678-1234-1234-1234-123456789012",  # an all-digit UUID, as the sample holds
    "978-0-306-40615-7",  # ISBN-13
    "ISBN 0-306-40615-2",
    "9780306406157",
    "00:1A:2B:3C:4D:5E",  # a MAC address: six groups without "::"
    "18446744073709551615",
    "9223372036854775807",  # 19 digits, no issuer starts with 9
    "4294967295",
    "4111 1111 1111 1112",  # a Visa prefix that fails Luhn
    "1234 5678 9012 3452",  # Luhn-valid, no issuer's prefix
    "123-456-7890",  # NANP area codes never start with 1
    "911-555-1234",  # N11 is a service code
    "+1 2 3 4 5 6 7 8",  # arithmetic, not a number in groups
    "DE89 3704 0044 0532 0130 01",  # IBAN with a wrong check
    "GB82WEST1234569876543",  # one character short for GB
    "+0530",
    "$1,299.99",
    "51.5074, -0.1278",
]


@pytest.mark.parametrize("value", NEGATIVES)
def test_hard_negatives_are_not_found(value):
    assert found(f"It was {value} then.") == []


def test_check_digits_match_their_standards():
    assert luhn_valid("79927398713") and not luhn_valid("79927398710")  # the Luhn algorithm's own example
    assert card_issuer_valid("4111111111111111") and not card_issuer_valid("1234567890123452")
    assert not card_issuer_valid("411111111111111")  # Visa has 13, 16 or 19 digits
    assert iban_valid("GB82WEST12345698765432") and not iban_valid("GB82WEST12345698765433")
    assert not iban_valid("XX82WEST12345698765432")  # no such country in the registry


def test_the_stronger_kind_keeps_a_contested_span_and_masks_do_not_nest():
    text = "Pay 4111 1111 1111 1111, mail bob@8.8.8.8.example.net and ring +44 20 7946 0958."
    finds = find_pii(text)
    assert [find.kind for find in finds] == ["credit_card", "email", "phone"]
    assert mask(text, finds) == (
        "Pay |||CREDIT_CARD|||, mail |||EMAIL_ADDRESS||| and ring |||PHONE_NUMBER|||."
    )


def documents(*texts: str) -> list[dict]:
    return [{"id": f"d{i}", "text": text, "n_chars": len(text), "n_words": len(text.split())}
            for i, text in enumerate(texts)]  # fmt: skip


def test_mask_flag_and_counts_per_kind():
    text = "Write to ann@gmail.com or call 415-555-0132 from 81.2.69.160."
    masked, flagged = documents(text, text)
    assert PersonalData().apply([masked]) == [None]
    assert masked["text"] == "Write to |||EMAIL_ADDRESS||| or call |||PHONE_NUMBER||| from |||IP_ADDRESS|||."
    assert masked["n_chars"] == len(masked["text"]) and masked["n_words"] == len(masked["text"].split())
    assert masked[PII] == {"email": 1, "phone": 1, "ip": 1, "credit_card": 0, "iban": 0}
    step = PersonalData(email="flag", phone="flag", ip="mask")
    assert step.apply([flagged]) == [None]
    assert flagged["text"] == text.replace("81.2.69.160", PLACEHOLDERS["ip"])
    stats = step.drain_stats()
    assert stats["email"] == {"flagged": 1} and stats["ip"] == {"masked": 1}
    assert stats["documents"] == 1 and stats["documents_with_pii"] == 1
    assert step.drain_stats() == {}  # drained


def test_remove_above_the_density_threshold_and_mask_below_it():
    dense = "Staff: " + ", ".join(f"user{i}@corp.de" for i in range(6)) + "."
    sparse = dense + " " + "Ordinary prose goes on here. " * 300
    few = "Only two: a@corp.de and b@corp.de, in a short note."
    step = PersonalData(email="remove", remove_density=1.0, remove_min_matches=5)
    batch = documents(dense, sparse, few)
    verdicts = step.apply(batch)
    assert verdicts[0].reason == REASON and verdicts[0].detail["kinds"] == ["email"]
    assert verdicts[0].detail["counts"] == {"email": 6}
    assert "@" not in batch[0]["text"]  # removed/ keeps it masked: the page shows removed examples
    assert verdicts[1] is None and verdicts[2] is None  # 6 in 9,000 characters; 2 finds only
    assert batch[1]["text"].count(PLACEHOLDERS["email"]) == 6
    stats = step.drain_stats()
    assert stats["documents_removed"] == 1 and stats["email"] == {"removed": 6, "masked": 8}


def test_reserved_names_are_found_and_optionally_kept():
    text = "Mail test@example.com, ping 127.0.0.1 or 192.0.2.7, and real@gmail.com at 81.2.69.160."
    assert {kind for kind, _ in found(text)} == {"email", "ip"} and len(found(text)) == 5
    kept = documents(text)[0]
    step = PersonalData(keep_reserved=True)
    step.apply([kept])
    assert kept["text"] == (
        "Mail test@example.com, ping 127.0.0.1 or 192.0.2.7, and |||EMAIL_ADDRESS||| at |||IP_ADDRESS|||."
    )
    assert kept[PII]["email"] == 1 and kept[PII]["ip"] == 1
    stats = step.drain_stats()
    assert stats["email"]["reserved"] == 1 and stats["ip"]["reserved"] == 2


def test_bad_parameters_name_the_stage(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: r\nstages:\n  - pii: {email: delete}\n")
    with pytest.raises(RecipeError, match=r"stages\[0\]: bad parameters for pii: .*mask, flag, remove"):
        load_recipe(path)
    path.write_text("name: r\nstages:\n  - pii: {remove_min_matches: 0}\n")
    with pytest.raises(RecipeError, match="remove_min_matches"):
        load_recipe(path)


def test_the_web_recipe_masks_personal_data_last():
    recipe = load_recipe(REPO / "configs" / "curate" / "web.yaml")
    assert recipe.stage_names()[-1] == "pii"
    assert DOCUMENT_SCHEMA.field(PII).type.names == list(PII_KINDS) == list(PLACEHOLDERS)


def test_the_planted_evaluation_meets_its_targets():
    """A small planted set (bench/pii_eval.py's on the paragraphs of the Python install): precision and
    recall per kind at the targets of docs/curate.md, and no hard negative found."""
    paragraphs = prose_paragraphs()
    hosts = clean_hosts("\n\n".join(paragraphs[i : i + 4]) for i in range(0, 800, 4))
    assert len(hosts) > 50
    planted = planted_documents(hosts, 150, seed=7)
    finds = [[(find.kind, find.start, find.end) for find in find_pii(document.text)] for document in planted]
    scores, negatives_hit = score(planted, finds)
    for kind, kind_score in scores.items():
        assert kind_score.planted >= 80, kind
        assert kind_score.precision >= 0.99, (kind, kind_score)
        assert kind_score.recall >= (0.9 if kind == "phone" else 0.95), (kind, kind_score)
    assert sum(negatives_hit.values()) <= 2, negatives_hit


def test_curate_masks_counts_and_accounts(tmp_path):
    """Through the pipeline: the column in curated/ and removed/, stats.json's counts, the removal."""
    from test_curate import curate

    records = [
        {"id": "masked", "text": "Reach Ann at ann@gmail.com or +44 20 7946 0958 any day of the week."},
        {"id": "dense", "text": "Staff list: " + ", ".join(f"person{i}@corp.de" for i in range(8)) + "."},
        {"id": "clean", "text": "Nothing personal is written in this sentence at all."},
    ]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(record) + "\n" for record in records))
    recipe = tmp_path / "pii.yaml"
    recipe.write_text("name: pii\nstages:\n  - pii: {email: remove}\n")
    stats = curate(tmp_path / "out", str(source), recipe=recipe)
    assert stats["balanced"] and stats["removed_by_reason"]["pii/pii_density"]["documents"] == 1
    assert stats["stages"]["pii"]["email"] == {"masked": 1, "removed": 8}
    assert stats["stages"]["pii"]["phone"] == {"masked": 1}
    kept = {
        row["id"]: row for row in curated_dataset(str(tmp_path / "out" / "curated")).to_table().to_pylist()
    }
    assert kept["in.jsonl:masked"]["text"] == (
        "Reach Ann at |||EMAIL_ADDRESS||| or |||PHONE_NUMBER||| any day of the week."
    )
    assert kept["in.jsonl:masked"][PII] == {"email": 1, "phone": 1, "ip": 0, "credit_card": 0, "iban": 0}
    assert kept["in.jsonl:clean"][PII] == dict.fromkeys(PII_KINDS, 0)
    removed = removed_dataset(str(tmp_path / "out" / "removed")).to_table().to_pylist()
    assert [row[PII]["email"] for row in removed] == [8] and "@" not in removed[0]["text"]
    files = sorted((tmp_path / "out" / "curated").rglob("*.parquet"))
    assert pq.read_schema(files[0]).field(PII).type == DOCUMENT_SCHEMA.field(PII).type
