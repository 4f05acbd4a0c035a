"""Benchmark: WARC to documents (tokenmill's reader) against the HTML extractor alone; extraction quality.

The pages are made here: known main text (paragraphs of the standard library's docstrings, a heading, a
list, sometimes a code block) wrapped in one of four page templates full of navigation, mega-menus,
cookie banners, ads, sidebars of related links, reader comments, footers, inline scripts and styles.
Templates range from semantic HTML5 (`<nav>`, `<main>`, `<footer>`) through `<div id="sidebar">` and
table layouts to a div soup with meaningless class names, where only link density and text shape tell
boilerplate from content. Pages are served in UTF-8, windows-1252 (HTTP charset), windows-1252 declared
only in a `<meta>` tag, and undeclared; they go into a `.warc.gz` in Common Crawl's layout (warcinfo, then
request, response and metadata records per page, one gzip member per record), with some redirects,
404s and images among them.

Speed: pages per second and MB/s from the .warc.gz to documents (`tokenmill.corpora.readers.read_file`:
gzip, framing, FastWARC parsing, charset detection and decoding, Resiliparse extraction, metadata) against
Resiliparse's `extract_plain_text` called in a loop on the same pages, already decoded, with the same
options. Best of `--repeats` runs each, alternating.

Quality, on the same pages: the share of main-text words recovered, and the share of boilerplate words
left in (words that also occur in the page's main text are not counted as boilerplate). With
`--trafilatura-path DIR` (a folder with trafilatura installed, e.g. by `pip install --target DIR
trafilatura`; it is not a dependency), Trafilatura is measured the same way for comparison.

    python bench/extract.py [--pages 600] [--repeats 3] [--trafilatura-path /tmp/trafi]

The last line is `extract ratio=X.XX target=0.8 baseline=extractor_loop`, where ratio is the WARC
reader's pages per second over the extractor loop's.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import hashlib
import html as htmllib
import io
import random
import re
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

from resiliparse.extract.html2text import extract_plain_text

from tokenmill.corpora.readers import read_file
from tokenmill.corpora.records import InputFields
from tokenmill.corpora.warc import EXTRACT_OPTIONS
from tokenmill.samples import text as sample

NAV_WORDS = [
    "Home",
    "News",
    "Sport",
    "Business",
    "Technology",
    "Science",
    "Health",
    "Travel",
    "Culture",
    "Weather",
    "Video",
    "Podcasts",
    "Shop",
    "Deals",
    "Subscribe",
    "Login",
    "Register",
    "Careers",
    "Advertise",
    "Newsletter",
    "Events",
    "Gallery",
    "Forum",
    "Support",
    "Pricing",
    "Partners",
]
AD_LINES = [
    "Limited offer: premium headphones half price, shop now",
    "Sponsored: refinance your mortgage today",
    "Win a luxury cruise, enter our sweepstakes",
    "Top rated sneakers, free delivery this weekend",
    "Click here for exclusive casino bonuses",
    "Best smartphone bargains, compare prices instantly",
]
RELATED = [
    "Celebrity chef reveals favourite breakfast",
    "Ten gadgets everyone wants this winter",
    "Stock markets rally after surprise announcement",
    "Footballer signs record transfer deal",
    "Holiday destinations trending this summer",
    "Actor shares wedding photographs",
    "Recipe: chocolate brownies in twenty minutes",
    "Quiz: how well do you know geography",
]
COMMENTS = [
    "Great post thanks mate",
    "Totally disagree lol",
    "First!!!",
    "Bookmarked for later, cheers",
    "Anyone else getting a weird popup",
    "Nice write-up, keep going buddy",
]
FOOTER = [
    "About us",
    "Contact",
    "Privacy policy",
    "Terms of service",
    "Cookie settings",
    "Accessibility",
    "Sitemap",
    "Press",
    "Affiliates",
    "Gift cards",
    "Store locator",
    "Help centre",
]
#: How the pages are encoded and where the charset is declared (HTTP header, <meta>, nowhere). Most of
#: the web is UTF-8 (W3Techs counts about 98% of sites); legacy encodings are given more room here.
ENCODINGS = {"utf-8-http": 70, "utf-8-meta": 15, "cp1252-http": 5, "cp1252-meta": 5, "undeclared": 5}
COOKIE = "We and our partners use cookies to personalise advertising and analyse traffic. Accept all cookies"
NEWSLETTER = "Sign up for our weekly newsletter and never miss a bargain again"
COPYRIGHT = "Copyright 2024 Megacorp Media Holdings Limited. All rights reserved. Registered in Delaware."


def _script(rng: random.Random, size: int) -> str:
    """Inline JavaScript of about `size` characters, as trackers and frameworks put in every page."""
    parts = []
    while sum(map(len, parts)) < size:
        name = "".join(rng.choice("abcdefghijklmnop") for _ in range(8))
        parts.append(
            f"function {name}(a,b){{var c=a||{{}};"
            f"for(var i=0;i<b.length;i++){{c[b[i]]=i*{rng.randint(2, 99)};}}"
            f"window.dataLayer=window.dataLayer||[];window.dataLayer.push({{'event':'{name}'}});return c;}}\n"
        )
    return "".join(parts)


def _style(rng: random.Random, size: int) -> str:
    parts = []
    while sum(map(len, parts)) < size:
        parts.append(
            f".c{rng.randint(0, 99999)}{{margin:{rng.randint(0, 40)}px;color:#{rng.randint(0, 0xFFFFFF):06x};"
            f"display:flex;font-family:Helvetica,Arial,sans-serif}}\n"
        )
    return "".join(parts)


UTILITY = [
    "flex",
    "items-center",
    "justify-between",
    "px-4",
    "py-2",
    "text-sm",
    "font-medium",
    "rounded-lg",
    "hover:bg-gray-100",
    "md:px-6",
    "lg:flex",
    "gap-2",
    "text-gray-700",
    "transition",
    "duration-150",
    "w-full",
    "max-w-7xl",
    "mx-auto",
    "grid",
    "grid-cols-2",
    "md:grid-cols-4",
    "border-b",
    "shadow-sm",
]


def _cls(rng: random.Random, base: str) -> str:
    """A class list as CSS frameworks write them: one meaningful name among utility classes."""
    return " ".join([base, *rng.sample(UTILITY, rng.randint(3, 8))])


def _icon(rng: random.Random) -> str:
    paths = "".join(
        f'<path fill-rule="evenodd" d="M{rng.randint(1, 20)} {rng.randint(1, 20)}'
        + "".join(
            f"l{rng.randint(-9, 9)}.{rng.randint(0, 99)} {rng.randint(-9, 9)}.{rng.randint(0, 99)}"
            for _ in range(rng.randint(4, 10))
        )
        + 'z" clip-rule="evenodd"/>'
        for _ in range(rng.randint(1, 3))
    )
    return (
        f'<svg class="icon h-5 w-5" xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" '
        f'aria-hidden="true">'
        f"{paths}</svg>"
    )


def _links(rng: random.Random, words: list[str], count: int, cls: str) -> tuple[str, list[str]]:
    """A menu of links, each with an icon and attributes, some with a submenu (what mega-menus look like)."""
    chosen = []
    items = []
    for index in range(count):
        word = rng.choice(words)
        chosen.append(word)
        slug = word.lower().replace(" ", "-")
        sub = ""
        if rng.random() < 0.25:
            subwords = [rng.choice(words) for _ in range(rng.randint(3, 6))]
            chosen.extend(subwords)
            sub = (
                f'<ul class="{_cls(rng, "submenu")} hidden" role="menu">'
                + "".join(
                    f'<li role="none"><a role="menuitem" class="{_cls(rng, "submenu-link")}" '
                    f'href="/{slug}/{w.lower().replace(" ", "-")}">{htmllib.escape(w)}</a></li>'
                    for w in subwords
                )
                + "</ul>"
            )
        items.append(
            f'<li class="{_cls(rng, cls + "-item")}" data-track="{cls}-{index}">'
            f'<a class="{_cls(rng, cls + "-link")}" href="/{slug}/{rng.randint(1, 999)}" '
            f'aria-label="{htmllib.escape(word)}" data-id="{rng.getrandbits(32):08x}">'
            f'<span class="icon-wrap">{_icon(rng)}</span><span class="label">{htmllib.escape(word)}</span>'
            f"</a>{sub}</li>"
        )
    return f'<ul class="{_cls(rng, cls)}" role="menubar">{"".join(items)}</ul>', chosen


def _inline(rng: random.Random, text: str) -> str:
    """A paragraph's text with some words marked up, as editors and CMSs do."""
    out = []
    for word in htmllib.escape(text).split(" "):
        roll = rng.random()
        if roll < 0.03:
            out.append(f'<a href="/wiki/{rng.getrandbits(24):06x}" class="internal-link">{word}</a>')
        elif roll < 0.05:
            out.append(f"<em>{word}</em>")
        elif roll < 0.06:
            out.append(f"<strong>{word}</strong>")
        else:
            out.append(word)
    return " ".join(out)


def main_content(rng: random.Random, paragraphs: list[str], code: list[str]) -> tuple[str, list[str]]:
    """The article: HTML and its words as a reader would see them."""
    texts = rng.sample(paragraphs, rng.randint(5, 12))
    heading = " ".join(texts[0].split()[:6]).strip(".,:;")
    subheading = " ".join(texts[2].split()[:5]).strip(".,:;")
    items = [" ".join(p.split()[: rng.randint(4, 9)]) for p in rng.sample(paragraphs, rng.randint(3, 6))]
    parts = [f'<h1 class="{_cls(rng, "headline")}">{htmllib.escape(heading)}</h1>']
    words = [heading, subheading, *items]
    for index, text in enumerate(texts):
        if index == 2:
            parts.append(
                f'<h2 id="section-{index}" class="{_cls(rng, "subhead")}">{htmllib.escape(subheading)}</h2>'
            )
            parts.append(
                f'<ul class="{_cls(rng, "prose-list")}">'
                + "".join(f"<li>{htmllib.escape(item)}</li>" for item in items)
                + "</ul>"
            )
        parts.append(
            f'<div class="{_cls(rng, "block")}" data-block="{index}">'
            f'<p class="{_cls(rng, "para")}">{_inline(rng, text)}</p></div>'
        )
        words.append(text)
    if rng.random() < 0.4:
        block = rng.choice(code)
        block = "\n".join(block.splitlines()[:25])
        parts.append(
            f'<pre class="highlight"><code class="language-python">{htmllib.escape(block)}</code></pre>'
        )
        words.append(block)
    return "\n".join(parts), words


def _cards(rng: random.Random, titles: list[str], count: int) -> tuple[str, list[str]]:
    chosen = [rng.choice(titles) for _ in range(count)]
    cards = "".join(
        f'<div class="{_cls(rng, "card")}"><a href="/story/{rng.getrandbits(32):08x}" class="card-link">'
        f'<img src="/img/{rng.getrandbits(32):08x}.jpg" srcset="/img/a-320.jpg 320w, /img/a-640.jpg 640w" '
        f'loading="lazy" alt="" width="320" height="180">'
        f'<h4 class="{_cls(rng, "card-title")}">{htmllib.escape(t)}</h4>'
        f'</a><time datetime="2024-01-0{rng.randint(1, 9)}">{rng.randint(1, 59)} min ago</time></div>'
        for t in chosen
    )
    return f'<div class="{_cls(rng, "cards")}">{cards}</div>', chosen


def boilerplate(rng: random.Random) -> dict[str, tuple[str, list[str]]]:
    nav, nav_words = _links(rng, NAV_WORDS, rng.randint(25, 60), "menu")
    related, related_words = _cards(rng, RELATED, rng.randint(6, 12))
    foot, foot_words = _links(rng, FOOTER, rng.randint(15, 30), "footer")
    ads = [rng.choice(AD_LINES) for _ in range(rng.randint(2, 4))]
    comments = rng.sample(COMMENTS, rng.randint(2, 5))
    share = "".join(
        f'<button class="{_cls(rng, "share-btn")}" aria-label="Share">{_icon(rng)}</button>' for _ in range(5)
    )
    return {
        "nav": (f'{nav}<div class="share-bar">{share}</div>', nav_words),
        "related": (related, ["Related stories", *related_words]),
        "footer": (foot, [*foot_words, COPYRIGHT, NEWSLETTER]),
        "ads": (
            "".join(
                f'<div class="ad-slot" data-ad-unit="/{rng.getrandbits(32)}/top"><a href="https://ads.example/'
                f'{i}" rel="sponsored nofollow">{a}</a></div>'
                for i, a in enumerate(ads)
            ),
            ads,
        ),
        "comments": (
            "".join(
                f'<div class="{_cls(rng, "comment")}"><span class="author">user{rng.randint(1, 999)}</span>'
                f'<p>{c}</p><button class="reply">{_icon(rng)}</button></div>'
                for c in comments
            ),
            comments,
        ),
    }


def page_html(rng: random.Random, template: int, article: str, parts: dict, title: str) -> str:
    script = _script(rng, rng.randint(4_000, 12_000))
    style = _style(rng, rng.randint(2_000, 6_000))
    head = (
        f"<head><meta name=viewport content='width=device-width'><title>{htmllib.escape(title)}</title>"
        f"<style>{style}</style><script>{script}</script>"
        '<script type="application/ld+json">{"@context":"https://schema.org","@type":"NewsArticle"}</script></head>'
    )
    nav, related, footer = parts["nav"][0], parts["related"][0], parts["footer"][0]
    ads, comments = parts["ads"][0], parts["comments"][0]
    if template == 0:  # semantic HTML5
        body = (
            f'<header><div class="logo">Megacorp</div><nav>{nav}</nav></header>'
            f'<div class="cookie-banner">{COOKIE}</div>'
            f"<main><article>{article}</article>"
            f'<section class="comments"><h3>Comments</h3>{comments}</section></main>'
            f'<aside class="sidebar"><h3>Related stories</h3>{related}{ads}</aside>'
            f"<footer><p>{NEWSLETTER}</p>{footer}<p>{COPYRIGHT}</p></footer>"
        )
    elif template == 1:  # div ids and classes
        body = (
            f'<div id="header"><div id="menu" class="navigation">{nav}</div></div>'
            f'<div id="cookie-notice">{COOKIE}</div><div id="wrapper">'
            f'<div id="content" class="post-content">{article}<div id="comments">{comments}</div></div>'
            f'<div id="sidebar"><div class="widget"><h3>Related stories</h3>{related}</div>{ads}</div></div>'
            f'<div id="footer"><p>{NEWSLETTER}</p>{footer}<p>{COPYRIGHT}</p></div>'
        )
    elif template == 2:  # table layout
        body = (
            f'<table width="100%"><tr><td colspan="2">{nav}</td></tr>'
            f'<tr><td valign="top" width="200"><b>Related stories</b>{related}{ads}</td>'
            f"<td valign=top>{article}<hr>{comments}</td></tr>"
            f'<tr><td colspan="2"><small>{COOKIE}</small><br>{NEWSLETTER}{footer}{COPYRIGHT}</td></tr>'
            "</table>"
        )
    else:  # div soup: nothing in the names says what is what

        def c() -> str:
            return "x" + hashlib.md5(str(rng.random()).encode()).hexdigest()[:6]

        body = (
            f'<div class="{c()}"><div class="{c()}">{nav}</div></div><div class="{c()}">{COOKIE}</div>'
            f'<div class="{c()}"><div class="{c()}">{article}</div><div class="{c()}">{comments}</div>'
            f'<div class="{c()}"><div>Related stories</div>{related}{ads}</div></div>'
            f'<div class="{c()}"><div>{NEWSLETTER}</div>{footer}<div>{COPYRIGHT}</div></div>'
        )
    return f'<!DOCTYPE html><html lang="en">{head}<body class="page">{body}</body></html>'


def make_pages(count: int, seed: int = 11) -> list[dict]:
    rng = random.Random(seed)
    paragraphs = sample.prose_paragraphs()
    code = sample.code_chunks(rng, 100)
    pages = []
    for number in range(count):
        article, main_words = main_content(rng, paragraphs, code)
        parts = boilerplate(rng)
        template = number % 4
        html = page_html(rng, template, article, parts, title=f"Page {number} | Megacorp")
        encoding = rng.choices(list(ENCODINGS), weights=list(ENCODINGS.values()))[0]
        if encoding.endswith("-meta"):
            charset = "utf-8" if encoding.startswith("utf-8") else "windows-1252"
            html = html.replace("<head>", f'<head><meta charset="{charset}">', 1)
        body = html.encode("utf-8" if encoding.startswith("utf-8") else "cp1252", "xmlcharrefreplace")
        content_type = {
            "utf-8-http": "text/html; charset=UTF-8",
            "cp1252-http": "text/html; charset=ISO-8859-1",
        }.get(encoding, "text/html")
        boiler_words = [w for _, words in parts.values() for w in words] + [COOKIE]
        pages.append(
            {
                "url": f"https://site{number % 37}.example/{number}",
                "html": html,
                "body": body,
                "content_type": content_type,
                "main": " ".join(main_words),
                "boilerplate": " ".join(boiler_words),
                "template": template,
            }
        )
    return pages


def real_pages(pattern: str, count: int) -> list[dict]:
    """HTML files from disk (speed only: their main text is not known)."""
    paths = sorted(glob.glob(pattern, recursive=True))
    random.Random(3).shuffle(paths)
    pages = []
    for path in paths[:count]:
        body = Path(path).read_bytes()
        pages.append(
            {
                "url": f"file://{path}",
                "html": body.decode("utf-8", "replace"),
                "body": body,
                "content_type": "text/html; charset=UTF-8",
                "main": "",
                "boilerplate": "",
                "template": -1,
            }
        )
    return pages


def _record(warc_type: str, url: str | None, payload: bytes, content_type: str, extra: str = "") -> bytes:
    head = (
        f"WARC/1.0\r\nWARC-Type: {warc_type}\r\nWARC-Date: 2024-02-03T04:05:06Z\r\n"
        f"WARC-Record-ID: <urn:uuid:{uuid.UUID(int=random.getrandbits(128))}>\r\n"
        + (f"WARC-Target-URI: {url}\r\n" if url else "")
        + f"{extra}Content-Type: {content_type}\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return gzip.compress(head.encode() + payload + b"\r\n\r\n", compresslevel=6, mtime=0)


def _http(status: str, content_type: str, body: bytes, extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        f"Server: nginx\r\n{extra}\r\n"
    ).encode() + body


def write_warc(path: Path, pages: list[dict], seed: int = 5) -> int:
    """Common Crawl's layout: warcinfo, then request/response/metadata per page; a few non-pages. Returns
    the uncompressed size."""
    random.seed(seed)
    rng = random.Random(seed)
    out = io.BytesIO()
    raw_size = 0
    members = [_record("warcinfo", None, b"software: tokenmill bench\r\n", "application/warc-fields")]
    for page in pages:
        url = page["url"]
        members.append(
            _record(
                "request",
                url,
                f"GET / HTTP/1.1\r\nHost: {url}\r\n\r\n".encode(),
                "application/http; msgtype=request",
            )
        )
        members.append(
            _record(
                "response",
                url,
                _http("200 OK", page["content_type"], page["body"]),
                "application/http; msgtype=response",
            )
        )
        members.append(_record("metadata", url, b"fetchTimeMs: 120\r\n", "application/warc-fields"))
        roll = rng.random()
        if roll < 0.03:
            members.append(
                _record(
                    "response",
                    url + "/old",
                    _http("301 Moved Permanently", "text/html", b"", f"Location: {url}\r\n"),
                    "application/http; msgtype=response",
                )
            )
        elif roll < 0.05:
            members.append(
                _record(
                    "response",
                    url + "/logo.png",
                    _http("200 OK", "image/png", bytes(rng.getrandbits(8) for _ in range(3000))),
                    "application/http; msgtype=response",
                )
            )
        elif roll < 0.06:
            members.append(
                _record(
                    "response",
                    url + "/missing",
                    _http("404 Not Found", "text/html", b"<h1>404</h1>"),
                    "application/http; msgtype=response",
                )
            )
    for member in members:
        out.write(member)
        raw_size += len(gzip.decompress(member))
    path.write_bytes(out.getvalue())
    return raw_size


_WORD = re.compile(r"[a-z0-9]+")


def words(text: str) -> Counter:
    return Counter(_WORD.findall(text.lower()))


def quality(pages: list[dict], outputs: dict[str, str]) -> tuple[float, float]:
    """(share of main-text words recovered, share of boilerplate words left), over all pages."""
    recovered = main_total = left = boiler_total = 0
    for page in pages:
        main = words(page["main"])
        boiler = words(page["boilerplate"])
        boiler = Counter({w: n for w, n in boiler.items() if w not in main})  # unambiguous words only
        out = words(outputs.get(page["url"], ""))
        recovered += sum(min(n, out[w]) for w, n in main.items())
        main_total += sum(main.values())
        left += sum(min(n, out[w]) for w, n in boiler.items())
        boiler_total += sum(boiler.values())
    return recovered / max(main_total, 1), left / max(boiler_total, 1)


def time_reader(path: Path) -> tuple[float, dict[str, str], Counter]:
    started = time.process_time()
    records = list(read_file(str(path), InputFields()))
    elapsed = time.process_time() - started
    texts = {r["url"]: r["text"] for r in records if r["kind"] == "document"}
    kinds = Counter(r["kind"] if r["kind"] == "document" else r["error_kind"] for r in records)
    return elapsed, texts, kinds


def time_loop(pages: list[dict]) -> tuple[float, dict[str, str]]:
    # Fresh strings for every run, as pages decoded from a crawl are: CPython caches a string's UTF-8 form,
    # which the extractor needs, and a string seen in an earlier run would skip that step.
    htmls = [
        (page["url"], page["html"].encode("utf-8", "surrogatepass").decode("utf-8", "surrogatepass"))
        for page in pages
    ]
    started = time.process_time()
    texts = {url: extract_plain_text(html, **EXTRACT_OPTIONS) for url, html in htmls}
    return time.process_time() - started, texts


def time_plain_loop(path: Path) -> tuple[float, int]:
    """The shortest FastWARC + Resiliparse loop over the same file, for context: every response record,
    the HTTP or detected charset, no checks of framing, no decoding policy, no metadata."""
    from fastwarc.warc import ArchiveIterator, WarcRecordType
    from resiliparse.parse.encoding import bytes_to_str, detect_encoding

    started = time.process_time()
    pages = 0
    with open(path, "rb") as stream:
        for record in ArchiveIterator(stream, record_types=WarcRecordType.response, parse_http=True):
            if record.http_headers.status_code != 200 or record.http_content_type != "text/html":
                continue
            payload = record.reader.read()
            html = bytes_to_str(payload, record.http_charset or detect_encoding(payload))
            extract_plain_text(html, **EXTRACT_OPTIONS)
            pages += 1
    return time.process_time() - started, pages


def report_quality(name: str, pages: list[dict], texts: dict[str, str]) -> None:
    recovered, left = quality(pages, texts)
    per_template = []
    for template in range(4):
        subset = [page for page in pages if page["template"] == template]
        if subset:
            r, b = quality(subset, texts)
            per_template.append(f"{TEMPLATES[template]} {r:.1%}/{b:.1%}")
    print(
        f"{name}: main-text words recovered {recovered:.1%}, boilerplate words left {left:.1%}  "
        f"(by template, recovered/left: {', '.join(per_template)})"
    )


TEMPLATES = ("html5", "div-ids", "tables", "div-soup")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=600)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trafilatura-path", help="a folder with trafilatura installed, for comparison")
    parser.add_argument("--html-glob", help="time real HTML files from disk instead (speed only, no quality)")
    args = parser.parse_args(argv)

    pages = real_pages(args.html_glob, args.pages) if args.html_glob else make_pages(args.pages)
    html_bytes = sum(len(page["body"]) for page in pages)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench-00000.warc.gz"
        raw_size = write_warc(path, pages)
        warc_bytes = path.stat().st_size
        print(
            f"{len(pages)} pages, {html_bytes / len(pages) / 1e3:.0f} kB of HTML each on average; WARC "
            f"{warc_bytes / 1e6:.1f} MB gzipped, {raw_size / 1e6:.1f} MB uncompressed"
        )
        reader_times, loop_times, plain_times = [], [], []
        for _ in range(args.repeats):  # alternating, best of each: the machine is shared
            elapsed, reader_texts, kinds = time_reader(path)
            reader_times.append(elapsed)
            elapsed, loop_texts = time_loop(pages)
            loop_times.append(elapsed)
            elapsed, plain_pages = time_plain_loop(path)
            plain_times.append(elapsed)
    reader, loop, plain = min(reader_times), min(loop_times), min(plain_times)
    documents = kinds["document"]
    print(f"records: {dict(sorted(kinds.items()))}")
    print(
        f"WARC reader (gzip, framing, FastWARC, charset, Resiliparse, metadata): {documents / reader:,.0f} "
        f"pages/s, {warc_bytes / reader / 1e6:.1f} MB/s of .warc.gz ({raw_size / reader / 1e6:.1f} MB/s "
        f"uncompressed)"
    )
    print(
        f"extractor loop (Resiliparse extract_plain_text on the decoded pages): {len(pages) / loop:,.0f} "
        f"pages/s, {html_bytes / loop / 1e6:.1f} MB/s of HTML"
    )
    print(
        f"for context, a bare FastWARC + Resiliparse loop over the same file (no framing checks, no charset "
        f"policy, no metadata): {plain_pages / plain:,.0f} pages/s"
    )
    if not args.html_glob:
        report_quality("Resiliparse, main content (curate)", pages, reader_texts)
        everything = {
            p["url"]: extract_plain_text(p["html"], **{**EXTRACT_OPTIONS, "main_content": False})
            for p in pages
        }
        report_quality("Resiliparse, whole page (reference)", pages, everything)
    if args.trafilatura_path:
        sys.path.append(args.trafilatura_path)  # after the venv's packages, so that they win
        import trafilatura

        started = time.process_time()
        extracted = {
            p["url"]: trafilatura.extract(
                p["html"], include_comments=False, include_tables=True, deduplicate=False
            )
            or ""
            for p in pages
        }
        elapsed = time.process_time() - started
        print(
            f"trafilatura {trafilatura.__version__}: {len(pages) / elapsed:,.0f} pages/s, "
            f"{html_bytes / elapsed / 1e6:.1f} MB/s of HTML"
        )
        if not args.html_glob:
            report_quality(f"trafilatura {trafilatura.__version__}", pages, extracted)
    ratio = (documents / reader) / (len(pages) / loop)
    print(f"extract ratio={ratio:.2f} target=0.8 baseline=extractor_loop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
