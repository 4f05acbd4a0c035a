"""WARC input: pages with known content become the expected documents; damaged and unwanted records are
rejected with their reason; curate over WARC balances, filters URLs with datatrove's shipped lists, and
fetches nothing."""

from __future__ import annotations

import gzip
import json
import random
import uuid
import zlib
from pathlib import Path

import pytest
from conftest import REPO, offline_env, rejected_rows, run_tokenmill
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenmill.corpora import warc
from tokenmill.corpora.readers import input_format, read_file
from tokenmill.corpora.records import DuplicateIdError, InputFields
from tokenmill.corpora.warc import Undecodable, decode_html
from tokenmill.filters.url_filter import UrlFilter

WARC_RECIPE = REPO / "configs" / "curate" / "warc.yaml"
FIELDS = InputFields()

PARAGRAPHS = [
    "The river town grew slowly around its mill, and for most of a century the families who worked there "
    "kept careful records of every harvest, every flood and every new road that reached the valley.",
    "Engineers who study old bridges often begin with the drawings, but the drawings rarely match what was "
    "built, because the workers adjusted each span to the stone they found on the site that season.",
    "A good field notebook records the weather, the time and the exact place of each observation, so that "
    "another person can return to the same spot years later and compare what has changed since then.",
    "When the library moved to its new building, the volunteers packed the books by subject and numbered "
    "every box, and the whole collection was back on the shelves within three weeks of the move.",
    "Bakers in the region still use a slow method for bread: the dough rests overnight in a cool room, "
    "which gives the loaf a thicker crust and a flavour that many visitors remember long afterwards.",
    "The survey counted the birds along the coast twice a year, and the numbers showed that the wetlands "
    "restored ten years ago now hold more nesting pairs than any other part of the shoreline.",
]
NAV = ["Home", "World news", "Sport results", "Weather today", "Subscribe now", "Sign in"]
FOOTER = "Copyright 2024 Example Media Group. All rights reserved. Privacy policy. Cookie settings."
AD = "Sponsored: cheap flights to anywhere, book before midnight"


def page(
    paragraphs: list[str],
    title: str = "A page",
    heading: str = "About the valley",
    extra_main: str = "",
    charset_meta: str | None = None,
) -> str:
    """An HTML page: known paragraphs inside navigation, an ad, a sidebar and a footer."""
    meta = f'<meta charset="{charset_meta}">' if charset_meta else ""
    nav = "".join(f'<li><a href="/{i}">{item}</a></li>' for i, item in enumerate(NAV))
    main = "".join(f"<p>{text}</p>" for text in paragraphs)
    return (
        f"<!DOCTYPE html><html><head>{meta}<title>{title}</title><script>var x = 1;</script>"
        f"<style>p {{ color: black }}</style></head><body>"
        f'<header><nav class="menu"><ul>{nav}</ul></nav></header>'
        f'<div class="cookie-banner">We use cookies. Accept all</div>'
        # Lists fewer than three levels below <body> count as global navigation to Resiliparse; real
        # pages wrap their content, as this one does.
        f'<div class="container"><main><article><h1>{heading}</h1>{main}{extra_main}</article></main></div>'
        f'<aside class="sidebar"><div class="ad"><a href="/ad">{AD}</a></div></aside>'
        f"<footer><p>{FOOTER}</p></footer></body></html>"
    )


def http(
    body: bytes, content_type: str = "text/html; charset=utf-8", status: str = "200 OK", headers: str = ""
) -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n{headers}\r\n"
    ).encode() + body


def record(
    url: str | None,
    payload: bytes,
    warc_type: str = "response",
    length: int | None = None,
    record_id: str | None = None,
    content_type: str = "application/http; msgtype=response",
    headers: str = "",
) -> bytes:
    """One WARC record's bytes; `length` overrides the Content-Length (to make it wrong)."""
    record_id = record_id or f"urn:uuid:{uuid.UUID(int=random.getrandbits(128))}"
    head = (
        f"WARC/1.0\r\nWARC-Type: {warc_type}\r\nWARC-Record-ID: <{record_id}>\r\n"
        f"WARC-Date: 2024-03-04T05:06:07Z\r\n"
        + (f"WARC-Target-URI: {url}\r\n" if url else "")
        + f"{headers}Content-Type: {content_type}\r\n"
        f"Content-Length: {len(payload) if length is None else length}\r\n\r\n"
    )
    return head.encode() + payload + b"\r\n\r\n"


def write_warc(path: Path, records: list[bytes]) -> Path:
    """Plain, or (.gz) one gzip member per record as Common Crawl writes them."""
    data = (
        b"".join(gzip.compress(r, mtime=0) for r in records)
        if path.name.endswith(".gz")
        else b"".join(records)
    )
    path.write_bytes(data)
    return path


def read(path: Path) -> tuple[list[dict], list[dict]]:
    records = list(read_file(str(path), FIELDS))
    return ([r for r in records if r["kind"] == "document"], [r for r in records if r["kind"] == "rejected"])


@pytest.fixture(autouse=True)
def _seed():
    random.seed(1234)


def good_records() -> list[bytes]:
    return [
        record(None, b"software: tokenmill tests\r\n", "warcinfo", content_type="application/warc-fields"),
        record(
            "https://valley.example/a",
            b"GET /a HTTP/1.1\r\nHost: valley.example\r\n\r\n",
            "request",
            content_type="application/http; msgtype=request",
        ),
        record(
            "https://valley.example/a",
            http(page(PARAGRAPHS[:3], title="Valley A").encode()),
            record_id="urn:uuid:00000000-0000-0000-0000-00000000000a",
        ),
        record(
            "https://valley.example/a",
            b"fetchTimeMs: 12\r\n",
            "metadata",
            content_type="application/warc-fields",
        ),
        record(
            "https://valley.example/b",
            http(page(PARAGRAPHS[3:], title="Valley B").encode()),
            record_id="urn:uuid:00000000-0000-0000-0000-00000000000b",
        ),
    ]


@pytest.mark.parametrize(
    "name, expected",
    [
        ("a.warc", "warc"),
        ("CC-MAIN-1.warc.gz", "warc.gz"),
        ("A.WARC.GZ", "warc.gz"),
        ("a.arc", None),
        ("a.warc.zst", None),
        ("a.warc.wet.gz", None),
    ],
)
def test_input_format_recognizes_warc(name, expected):
    assert input_format(name) == expected


@pytest.mark.parametrize("name", ["crawl.warc", "crawl.warc.gz"])
def test_pages_become_documents_with_their_main_text_url_and_metadata(tmp_path, name):
    documents, rejected = read(write_warc(tmp_path / name, good_records()))
    assert rejected == []  # warcinfo, request and metadata records are bookkeeping, skipped uncounted
    assert [d["id"] for d in documents] == [
        f"{name}:urn:uuid:00000000-0000-0000-0000-00000000000a",
        f"{name}:urn:uuid:00000000-0000-0000-0000-00000000000b",
    ]
    first, second = documents
    assert first["url"] == "https://valley.example/a" and first["source"] == name
    assert first["text"] == "\n\n".join(["About the valley", *PARAGRAPHS[:3]])
    assert second["text"] == "\n\n".join(["About the valley", *PARAGRAPHS[3:]])
    for document in documents:
        for boilerplate in [*NAV, FOOTER, AD, "cookies", "var x"]:
            assert boilerplate not in document["text"]
    metadata = json.loads(first["metadata"])
    assert metadata == {
        "warc_record_id": "urn:uuid:00000000-0000-0000-0000-00000000000a",
        "fetch_date": "2024-03-04T05:06:07Z",
        "content_type": "text/html",
        "charset": "utf_8",
        "charset_source": "http",
        "http_status": 200,
        "title": "Valley A",
        "warc_offset": metadata["warc_offset"],
    }
    offsets = [json.loads(d["metadata"])["warc_offset"] for d in documents]
    raw = (tmp_path / name).read_bytes()
    for offset, document in zip(offsets, documents):
        # The offset is where the record starts in the file as stored: a gzip member, or the record itself.
        start = gzip.decompress(raw[offset:])[:200] if name.endswith(".gz") else raw[offset : offset + 200]
        assert start.startswith(b"WARC/1.0\r\nWARC-Type: response")
        assert json.loads(document["metadata"])["warc_record_id"].encode() in start


def test_headings_lists_and_code_stay_readable(tmp_path):
    extra = (
        "<h2>Steps</h2><ul><li>Measure the span before cutting any stone for the bridge</li>"
        "<li>Mark every block with its place in the arch, on two faces of the stone</li></ul>"
        "<pre><code>def span(width):\n    return width * 2\n</code></pre>"
    )
    path = write_warc(
        tmp_path / "code.warc.gz",
        [record("https://b.example/", http(page(PARAGRAPHS[:2], extra_main=extra).encode()))],
    )
    (document,), _ = read(path)
    lines = document["text"].split("\n")
    assert lines[0] == "About the valley"
    assert "Steps" in lines
    assert "  • Measure the span before cutting any stone for the bridge" in lines
    assert "def span(width):" in lines and "    return width * 2" in lines  # indentation kept


def test_records_that_are_not_pages_are_rejected_with_their_reason(tmp_path):
    records = [
        record("https://a.example/logo.png", http(b"\x89PNG\r\n\x1a\n" + bytes(range(256)), "image/png")),
        record("https://a.example/doc.pdf", http(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n", "application/pdf")),
        record(
            "https://a.example/old",
            http(b"", "text/html", "301 Moved Permanently", "Location: https://a.example/new\r\n"),
        ),
        record("https://a.example/gone", http(b"<h1>Not found</h1>", "text/html", "404 Not Found")),
        record("https://a.example/empty", http(b"")),
        record("https://a.example/blank", http(b"  \r\n  ")),
        record("https://a.example/again", b"HTTP/1.1 200 OK\r\n\r\n", "revisit"),
        record(
            "https://a.example/nav-only", http(b"<html><body><nav><a href='/'>Home</a></nav></body></html>")
        ),
        record("https://a.example/ok", http(page(PARAGRAPHS[:2]).encode())),
    ]
    documents, rejected = read(write_warc(tmp_path / "mixed.warc.gz", records))
    assert [d["url"] for d in documents] == ["https://a.example/ok"]
    assert [r["error_kind"] for r in rejected] == [
        "not_html",
        "not_html",
        "redirect",
        "http_error",
        "empty_body",
        "empty_body",
        "revisit",
        "no_text",
    ]
    assert [r["line"] for r in rejected] == [1, 2, 3, 4, 5, 6, 7, 8]  # the record's number in the file
    assert "redirect to https://a.example/new" in rejected[2]["error"]
    assert "image/png" in rejected[0]["error"] and "404" in rejected[3]["error"]
    for item in rejected:
        assert item["file"] == str(tmp_path / "mixed.warc.gz") and item["offset"] is not None
        assert str(item["line"]) in item["error"]


def test_truncated_warc_gz_keeps_the_pages_before_the_cut(tmp_path):
    records = [
        record(f"https://t.example/{i}", http(page([PARAGRAPHS[i % 6], PARAGRAPHS[(i + 1) % 6]]).encode()))
        for i in range(6)
    ]
    whole = b"".join(gzip.compress(r, mtime=0) for r in records)
    # Cut inside the fifth record's gzip member: four pages, then the cut record.
    fifth = len(b"".join(gzip.compress(r, mtime=0) for r in records[:4]))
    cut = tmp_path / "cut.warc.gz"
    cut.write_bytes(whole[: fifth + 300])
    documents, rejected = read(cut)
    assert [d["url"] for d in documents] == [f"https://t.example/{i}" for i in range(4)]
    (damage,) = rejected
    assert damage["error_kind"] == "truncated_record" and damage["line"] == 5 and damage["offset"] == fifth
    assert "gzip stream ends" in damage["error"]
    # Cut inside the last member's trailer: every page decodes, and the damaged file is still reported.
    trailer = tmp_path / "trailer.warc.gz"
    trailer.write_bytes(whole[:-4])
    documents, rejected = read(trailer)
    assert len(documents) == 6
    assert [r["error_kind"] for r in rejected] == ["truncated"]
    # A plain .warc cut inside a record.
    plain = tmp_path / "cut.warc"
    plain.write_bytes(b"".join(records)[: len(records[0]) + 500])
    documents, rejected = read(plain)
    assert len(documents) == 1 and [r["error_kind"] for r in rejected] == ["truncated_record"]


def test_zlib_reads_what_isal_reads(tmp_path, monkeypatch):
    """Where ISA-L has no wheel, zlib inflates: same documents, same damage reports."""
    records = [record(f"https://z.example/{i}", http(page(PARAGRAPHS[i : i + 2]).encode())) for i in range(4)]
    whole = b"".join(gzip.compress(r, mtime=0) for r in records)
    (tmp_path / "z.warc.gz").write_bytes(whole[: len(whole) - 100])
    with_isal = read(tmp_path / "z.warc.gz")
    monkeypatch.setattr(warc, "_inflate", zlib)
    assert read(tmp_path / "z.warc.gz") == with_isal
    assert [r["error_kind"] for r in with_isal[1]] == ["truncated_record"] and len(with_isal[0]) == 3


@pytest.mark.parametrize("name", ["length.warc", "length.warc.gz"])
@pytest.mark.parametrize("wrong", ["smaller", "larger"])
def test_a_wrong_content_length_costs_that_record_only(tmp_path, name, wrong):
    body = http(page(PARAGRAPHS[1:3]).encode())
    length = len(body) - 200 if wrong == "smaller" else len(body) + 700
    records = [
        record("https://c.example/1", http(page(PARAGRAPHS[:2]).encode())),
        record("https://c.example/bad", body, length=length),
        record("https://c.example/3", http(page(PARAGRAPHS[2:4]).encode())),
        record("https://c.example/4", http(page(PARAGRAPHS[4:6]).encode())),
    ]
    documents, rejected = read(write_warc(tmp_path / name, records))
    assert [d["url"] for d in documents] == [
        "https://c.example/1",
        "https://c.example/3",
        "https://c.example/4",
    ]
    (bad,) = rejected
    assert bad["error_kind"] == "bad_content_length" and bad["line"] == 2
    assert f"Content-Length is {length:,}" in bad["error"]


def test_latin1_and_shift_jis_pages_decode(tmp_path):
    french = "Le café du marché ouvre à l'aube; les élèves y déjeunent près de la fenêtre."
    japanese = "東京の図書館は新しい建物に移転しました。利用者は以前より多くの本を借りています。"
    records = [
        record(
            "https://fr.example/", http(page([french]).encode("latin-1"), "text/html; charset=ISO-8859-1")
        ),
        record(
            "https://jp.example/meta",
            http(page([japanese], charset_meta="Shift_JIS").encode("shift_jis"), "text/html"),
        ),
        record("https://jp.example/undeclared", http(page([japanese * 3]).encode("shift_jis"), "text/html")),
        # Declared UTF-8 but sent as Latin-1: the declaration fails, detection finds windows-1252.
        record("https://fr.example/mislabelled", http(page([french]).encode("latin-1"))),
    ]
    documents, rejected = read(write_warc(tmp_path / "charsets.warc.gz", records))
    assert rejected == []
    texts = [d["text"].split("\n\n")[1] for d in documents]
    assert texts == [french, japanese, japanese * 3, french]
    charsets = [
        (json.loads(d["metadata"])["charset"], json.loads(d["metadata"])["charset_source"]) for d in documents
    ]
    assert charsets[0] == ("cp1252", "http")  # ISO-8859-1 means windows-1252 on the web
    assert charsets[1] == ("cp932", "meta")  # and Shift_JIS its Windows superset
    assert charsets[2][1] == "detected" and charsets[3] == ("cp1252", "detected")


def test_undecodable_bytes_are_replaced_or_the_page_rejected(tmp_path):
    rng = random.Random(3)
    noise = bytes(rng.getrandbits(8) for _ in range(4000))
    few_bad = page(PARAGRAPHS[:3]).encode().replace(b"careful", b"care\xffful")
    records = [
        record("https://n.example/noise", http(b"<html><body><p>" + noise + b"</p></body></html>")),
        record("https://n.example/few", http(few_bad)),
    ]
    documents, rejected = read(write_warc(tmp_path / "noise.warc", records))
    assert [r["error_kind"] for r in rejected] == ["undecodable"]
    assert "undecodable bytes" in rejected[0]["error"]
    assert rejected[0]["raw_base64"]  # the record's bytes are kept for inspection
    (document,) = documents
    assert "care\ufffdful" in document["text"]
    assert json.loads(document["metadata"])["decode_replacements"] == 1


@settings(max_examples=150, deadline=None)
@given(
    st.binary(max_size=3000),
    st.sampled_from(
        [
            None,
            "utf-8",
            "latin-1",
            "shift_jis",
            "bogus",
            "utf-16",
            "utf-7",
            "x-user-defined",
            "iso-2022-kr",
            "windows-874",
            "x-mac-cyrillic",
            "replacement",
            "",
        ]
    ),
)
def test_decoding_never_raises_anything_but_undecodable(data, declared):
    try:
        text, codec, origin, replaced = decode_html(data, declared)
    except Undecodable:
        return
    assert (
        isinstance(text, str) and replaced >= 0 and origin in ("bom", "http", "meta", "default", "detected")
    )


def test_garbage_between_records_is_skipped_and_reported(tmp_path):
    records = [
        record("https://g.example/1", http(page(PARAGRAPHS[:2]).encode())),
        b"this is not a WARC record at all\r\n\r\n",
        record("https://g.example/2", http(page(PARAGRAPHS[2:4]).encode())),
    ]
    documents, rejected = read(write_warc(tmp_path / "garbage.warc", records))
    assert [d["url"] for d in documents] == ["https://g.example/1", "https://g.example/2"]
    assert [r["error_kind"] for r in rejected] == ["bad_record"]


def test_resource_records_and_chunked_gzip_responses_are_pages(tmp_path):
    html = page(PARAGRAPHS[:2]).encode()
    compressed = gzip.compress(html, mtime=0)
    chunked = (
        b"".join(
            f"{len(part):x}\r\n".encode() + part + b"\r\n" for part in (compressed[:100], compressed[100:])
        )
        + b"0\r\n\r\n"
    )
    records = [
        record("https://r.example/file.html", html, "resource", content_type="text/html; charset=utf-8"),
        record(
            "https://r.example/chunked",
            b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nTransfer-Encoding: "
            b"chunked\r\nContent-Encoding: gzip\r\n\r\n" + chunked,
        ),
    ]
    documents, rejected = read(write_warc(tmp_path / "kinds.warc.gz", records))
    assert rejected == []
    assert [d["text"] for d in documents] == ["\n\n".join(["About the valley", *PARAGRAPHS[:2]])] * 2


def test_url_filter_step_blocks_domains_and_words_and_keeps_pages_without_url():
    step = UrlFilter(use_integrated_lists=False, extra_domains=["blocked-site.com"], banned_words=["casino"])
    documents = [
        {"id": "1", "url": "https://www.blocked-site.com/page"},
        {"id": "2", "url": "https://fine.org/"},
        {"id": "3", "url": "https://x.org/best-casino-offers"},
        {"id": "4", "url": None},
    ]
    verdicts = step.apply(documents)
    assert [v.reason if v else None for v in verdicts] == ["domain", None, "hard_blacklisted", None]
    assert verdicts[0].detail == {"filter": "url_filter", "url": "https://www.blocked-site.com/page"}
    strict = UrlFilter(use_integrated_lists=False, missing_url="remove")
    assert strict.apply([{"id": "4", "url": None}])[0].reason == "missing_url"
    with pytest.raises(ValueError):
        UrlFilter(missing_url="maybe")


def test_curate_reads_warc_with_the_network_blocked_and_balances(tmp_path):
    """The warc recipe end to end, offline: shipped block lists, bundled suffix list, stats that balance."""
    inputs = tmp_path / "in"
    inputs.mkdir()
    rng = random.Random(7)
    pages = []
    for number in range(8):
        chosen = rng.sample(PARAGRAPHS, 4)
        pages.append(
            record(
                f"https://news{number}.example/story/{number}",
                http(page(chosen, heading=f"Story number {number}").encode()),
            )
        )
    pages.append(
        record("http://airtellotterywinners.com/claim", http(page(PARAGRAPHS[:4]).encode()))
    )  # on the list
    pages.append(record("https://pharmacy.example/buy-viagra-online", http(page(PARAGRAPHS[1:5]).encode())))
    pages.append(record("https://news0.example/logo.png", http(b"\x89PNG" + bytes(300), "image/png")))
    pages.append(record("https://news0.example/old", http(b"", "text/html", "302 Found", "Location: /\r\n")))
    write_warc(inputs / "crawl-00000.warc.gz", pages)
    broken = gzip.compress(record("https://cut.example/", http(page(PARAGRAPHS[:3]).encode())), mtime=0)
    (inputs / "crawl-00001.warc.gz").write_bytes(broken[: len(broken) // 2])

    env, log = offline_env(tmp_path)
    env["TLDEXTRACT_CACHE"] = str(tmp_path / "tld")
    output = tmp_path / "out"
    result = run_tokenmill(
        "curate",
        "--recipe",
        str(WARC_RECIPE),
        "--input",
        str(inputs / "*.warc.gz"),
        "--output",
        str(output),
        "--workers",
        "1",
        env=env,
    )
    assert "balanced: True" in result.stdout
    assert not log.exists(), log.read_text()  # nothing tried to reach the network
    assert not (tmp_path / "tld").exists()  # and tldextract neither downloaded nor cached a suffix list

    stats = json.loads((output / "stats.json").read_text())
    assert stats["balanced"] is True
    assert stats["read"]["documents"] == 13  # 12 response records and 1 cut record
    assert stats["rejected_by_error"] == {
        "not_html": {"documents": 1},
        "redirect": {"documents": 1},
        "truncated_record": {"documents": 1},
    }
    assert stats["removed_by_reason"]["url_filter/domain"]["documents"] == 1
    assert stats["removed_by_reason"]["url_filter/hard_blacklisted"]["documents"] == 1
    assert stats["kept"]["documents"] + stats["removed"]["documents"] == 10
    assert stats["kept"]["documents"] == 8  # the eight stories: distinct English prose
    assert {r["error_kind"] for r in rejected_rows(output)} == {"not_html", "redirect", "truncated_record"}
    assert stats["sources"]["crawl-00001.warc.gz"]["rejected"] == 1


@pytest.mark.parametrize("name", ["big.warc", "big.warc.gz"])
def test_a_record_over_max_record_bytes_is_stepped_over_and_the_rest_read(tmp_path, name):
    filler = "".join(f"<p>{PARAGRAPHS[i % 6]} {i}</p>" for i in range(2000))  # about 400 kB of page
    records = [
        record("https://big.example/1", http(page(PARAGRAPHS[:2]).encode())),
        record("https://big.example/huge", http(page(PARAGRAPHS[:2], extra_main=filler).encode())),
        record("https://big.example/2", http(page(PARAGRAPHS[2:4]).encode())),
    ]
    path = write_warc(tmp_path / name, records)
    records_read = list(read_file(str(path), FIELDS, max_record_bytes=100_000))
    documents = [r for r in records_read if r["kind"] == "document"]
    rejected = [r for r in records_read if r["kind"] == "rejected"]
    assert [d["url"] for d in documents] == ["https://big.example/1", "https://big.example/2"]
    assert [(r["error_kind"], r["line"]) for r in rejected] == [("record_too_large", 2)]
    assert "max_record_bytes (100,000)" in rejected[0]["error"]
    # The default limit (64 MiB) reads the same page.
    assert len([r for r in read_file(str(path), FIELDS) if r["kind"] == "document"]) == 3


def test_a_resync_over_megabytes_of_damage_holds_one_chunk(tmp_path, monkeypatch):
    garbage = bytes(random.getrandbits(8) for _ in range(4096)).replace(b"\n", b" ") * 2500  # 10 MB
    records = [
        record("https://r.example/1", http(page(PARAGRAPHS[:2]).encode())),
        b"WARC/1.0\r\nWARC-Type: response\r\n\r\n" + garbage + b"\r\n\r\n",  # no Content-Length: resync
        record("https://r.example/2", http(page(PARAGRAPHS[2:4]).encode())),
    ]
    path = write_warc(tmp_path / "damaged.warc", records)
    largest = []
    fill = warc._Source._fill

    def watched_fill(self):
        result = fill(self)
        largest.append(len(self.buffer))
        return result

    monkeypatch.setattr(warc._Source, "_fill", watched_fill)
    documents, rejected = read(path)
    assert [d["url"] for d in documents] == ["https://r.example/1", "https://r.example/2"]
    assert [r["error_kind"] for r in rejected] == ["bad_record"]
    assert rejected[0]["raw_truncated"] and f"{len(records[1]):,} bytes" in rejected[0]["error"]
    assert max(largest) < 3 * warc.READ_CHUNK  # not the 10 MB of damage


def test_sources_and_ids_are_relative_to_the_input_root_and_unique_per_file(tmp_path):
    folder = tmp_path / "CC-MAIN-2024" / "segment-1"
    folder.mkdir(parents=True)
    path = write_warc(folder / "crawl.warc.gz", good_records())
    documents = [r for r in read_file(str(path), FIELDS, str(tmp_path)) if r["kind"] == "document"]
    assert [d["source"] for d in documents] == ["CC-MAIN-2024/segment-1/crawl.warc.gz"] * 2
    assert documents[0]["id"] == (
        "CC-MAIN-2024/segment-1/crawl.warc.gz:urn:uuid:00000000-0000-0000-0000-00000000000a"
    )
    same_id = "urn:uuid:00000000-0000-0000-0000-0000000000ff"
    twice = [
        record("https://d.example/1", http(page(PARAGRAPHS[:2]).encode()), record_id=same_id),
        record("https://d.example/2", http(page(PARAGRAPHS[2:4]).encode()), record_id=same_id),
    ]
    path = write_warc(tmp_path / "twice.warc", twice)
    with pytest.raises(DuplicateIdError, match=f"{same_id}.*record 1 and record 2"):
        list(read_file(str(path), FIELDS))
