"""WARC input for curate: web crawls (Common Crawl's layout) in, one document per HTML page out.

`read_warc(path)` reads a `.warc` or `.warc.gz` file, local or remote (through `tokenmill.storage`), and
yields, like every reader in `tokenmill.corpora.readers`, documents and rejected records. A file is one
Beam element; curate reads many in parallel.

The work per record, and why it is split this way:

* Framing (here, in Python; gzip through ISA-L, zlib-compatible): gzip members are tracked, so
  that each record's offset is the file offset of its gzip member (what Common Crawl's index gives and a
  range request needs), a stream that ends inside a member is caught (FastWARC stops silently there),
  and a wrong `Content-Length` costs one record, not the rest of the file: a record must be followed by
  its blank line, and when it is not, reading resumes at the next `WARC/1.x` header (FastWARC's strict
  mode stops at the first one; its lenient mode skips the damage without saying so).
* Parsing (FastWARC): `WarcRecord.from_bytes` parses each framed response record, its HTTP headers, and
  undoes chunked transfer and gzip/deflate/brotli content encodings.
* Decoding (`decode_html`, which never raises anything but Undecodable): byte-order mark, HTTP charset,
  HTML `<meta>` charset, UTF-8, then uchardet's guess (Resiliparse), each label mapped as browsers map it
  (WHATWG: latin-1 means windows-1252); the first that decodes the page, or all but a stray byte or so
  of it, wins. When none does, the most trusted decodes it with replacement characters, and the page is
  rejected as `undecodable` if more than `MAX_REPLACEMENT_SHARE` of it had to be replaced.
* Extraction (Resiliparse, `EXTRACT_OPTIONS`): main content only, navigation and boilerplate dropped,
  headings and paragraphs on their own lines, list items as bullets, `<pre>` blocks verbatim.
  docs/warc.md gives the measurements behind choosing Resiliparse over Trafilatura.

Only `response`, `resource` and `revisit` records are candidates for documents; `warcinfo`, `request`,
`metadata` and other bookkeeping records are skipped without a count (Common Crawl writes a request and
a metadata record beside every response; they hold no page). Every candidate becomes a document or a
rejected record whose `error_kind` says why (docs/formats.md, "Rejected input"): `not_html`, `redirect`,
`http_error`, `empty_body`, `revisit`, `record_too_large`, `no_text`, `undecodable`, `bad_record`,
`bad_content_length`, `truncated_record`; a gzip stream that breaks between records adds one
`truncated` (or `unreadable`) record for the file, as the JSON Lines reader does. A rejected record's
`line` is the record's number in the file (1-based, bookkeeping records included) and `offset` its file
offset (of its gzip member in a `.warc.gz`).

A document's id is the source (the file's path below the input root, paths.relative_source) and the
WARC-Record-ID (`crawl/CC-MAIN-….warc.gz:urn:uuid:…`; two records of one file with the same id stop the
run, records.DuplicateIdError), its `url` the WARC-Target-URI, and its metadata the record id, fetch
date (WARC-Date), content type, charset used and where it came from, HTTP status, page title and offset.
A record over `max_record_bytes` (the recipe's) is stepped over unbuffered (`record_too_large`), and a
resync after damage holds one read chunk, so no record or damage holds more than the limit in memory.
Storage errors are not caught: they propagate, so the runner retries the bundle.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
import zlib
from bisect import bisect_right
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import IO

from fastwarc.warc import WarcRecord
from isal import isal_zlib as _inflate  # gzip 2.5 times as fast as zlib: a tenth of a page's cost
from resiliparse.extract.html2text import extract_plain_text
from resiliparse.parse.encoding import detect_encoding, map_encoding_to_html5
from resiliparse.parse.html import HTMLTree

from tokenmill import storage
from tokenmill.corpora.paths import relative_source
from tokenmill.corpora.records import DEFAULT_MAX_RECORD_BYTES, RAW_LIMIT, IdLedger, InputFields, rejected

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20
#: Compressed bytes given to zlib at a time (Common Crawl's gzip members are a few kB to a few hundred).
FEED_CHUNK = 64 * 1024
#: Decompressed bytes a refill aims for (several gzip members: see _Source._fill).
INFLATE_BATCH = 512 * 1024
#: Decompressed bytes produced per step, so that a small gzip member cannot expand without bound at once.
INFLATE_CHUNK = 8 << 20
MAX_HEADER_BYTES = 64 * 1024
#: A page decoded with more than this share of replacement characters is rejected as `undecodable`.
MAX_REPLACEMENT_SHARE = 0.02
#: A charset that fails on no more than this share of a page (or one character) is still the page's.
FEW_REPLACEMENTS = 0.001
#: Bytes uchardet looks at (half from each end of the page) when nothing declares the charset.
DETECT_BYTES = 32 * 1024
#: The raw bytes kept with a rejected record of a page that is merely not wanted (headers, not body).
SKIPPED_RAW_BYTES = 4096
HTML_TYPES = frozenset({"text/html", "application/xhtml+xml", "application/xml+html"})
#: Content types that say nothing; the page is then taken as HTML if it starts like HTML.
VAGUE_TYPES = frozenset({"", "application/octet-stream", "text/plain", "unknown/unknown"})
CANDIDATE_TYPES = frozenset({"response", "resource", "revisit"})
#: Resiliparse's `extract_plain_text` options: the same for curate and for bench/extract.py's baseline.
EXTRACT_OPTIONS = {
    "preserve_formatting": True,  # headings, paragraphs, list items and <pre> lines stay lines
    "main_content": True,  # drop navigation, headers, footers, sidebars, ads, cookie banners
    "list_bullets": True,
    "alt_texts": False,  # image descriptions are mostly "logo", "icon", file names
    "links": False,
    "form_fields": False,
    "noscript": False,
    "comments": False,  # reader comments are not the page's text
}
#: WHATWG names Python's codecs for; where the web means a superset, decode with the superset.
_SUPERSETS = {"shift_jis": "cp932", "euc_kr": "cp949", "gb2312": "gbk", "big5": "big5hkscs"}
#: WHATWG's labels for UTF-8 (every other label that maps to UTF-8 is one the table does not know).
_UTF8_LABELS = frozenset(
    {"unicode-1-1-utf-8", "unicode11utf8", "unicode20utf8", "utf-8", "utf8", "x-unicode20utf8"}
)
_CONTENT_LENGTH = re.compile(rb"\ncontent-length[ \t]*:[ \t]*(\d+)[ \t]*\r\n", re.IGNORECASE)
_WARC_TYPE = re.compile(rb"\nwarc-type[ \t]*:[ \t]*([A-Za-z]+)", re.IGNORECASE)
#: Where reading resumes after a damaged record: the next line that starts a WARC header.
_NEXT_HEADER = b"\nWARC/1."
_META_CHARSET = re.compile(rb"""<meta[^>]*?charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)
_HTML_START = re.compile(
    rb"^\s*(<!--.*?-->\s*)*<(!doctype\s+html|html|head|body)\b", re.IGNORECASE | re.DOTALL
)


class _Source:
    """A WARC file's bytes, decompressed, with random access to what is buffered.

    Positions are offsets in the decompressed stream. For gzip, each member's first position and file
    offset are kept, so that a record's file offset can be told; `broken` says why the stream stopped
    early (a member cut off, or corrupt data), after everything before the damage has been read.

    The buffer is immutable bytes, rebuilt at each refill from what is still needed and what was read:
    one copy per byte. (A bytearray that is cut at the front and appended at the back copies everything
    it holds whenever it outgrows its allocation, several times per refill.)
    """

    def __init__(self, raw: IO[bytes], gzipped: bool):
        self.raw = raw
        self.gzipped = gzipped
        self.buffer = b""
        self.base = 0  # stream position of buffer[0]
        self.end = 0  # stream position after the buffer's last byte
        self.eof = False
        self.broken: tuple[str, str] | None = None  # (error_kind, sentence)
        self._released = 0  # what lies before this position is not needed again
        self._members: list[tuple[int, int]] = []  # (stream position, file offset) of each gzip member
        self._inflater = _inflate.decompressobj(wbits=31)
        self._member_open = False
        self._pending = b""
        self._pending_at = 0
        self._file_position = 0

    def _fill(self) -> bool:
        """Add more bytes to the buffer; False at the end of the stream."""
        if self.eof:
            return False
        parts = self._read_gzip() if self.gzipped else self._read_plain()
        if not parts:
            return False
        keep = memoryview(self.buffer)[self._released - self.base :]
        self.buffer = b"".join([keep, *parts])
        self.base = self._released
        self.end = self.base + len(self.buffer)
        return True

    def _read_plain(self) -> list[bytes]:
        chunk = self.raw.read(READ_CHUNK)
        if not chunk:
            self.eof = True
            return []
        return [chunk]

    def _read_gzip(self) -> list[bytes]:
        # Several members at a time: inflating a batch while its tables are hot, then framing and
        # extracting, is measurably faster than alternating per record.
        parts: list[bytes] = []
        produced = 0
        while produced < INFLATE_BATCH:
            if self._pending_at >= len(self._pending):
                self._pending = self.raw.read(READ_CHUNK)
                self._pending_at = 0
                if not self._pending:
                    self.eof = True
                    if self._member_open:
                        self.broken = (
                            "truncated",
                            "the gzip stream ends inside the member that starts at byte "
                            f"{self._members[-1][1]}",
                        )
                    break
            if not self._member_open:
                self._members.append((self.end + produced, self._file_position))
                self._member_open = True
            # A bounded slice: zlib copies what follows a member's end into unused_data, and a whole read
            # chunk each time would make that quadratic in the members per chunk.
            data = memoryview(self._pending)[self._pending_at : self._pending_at + FEED_CHUNK]
            try:
                out = self._inflater.decompress(data, INFLATE_CHUNK)
            except (zlib.error, _inflate.error) as error:
                self.eof = True
                self.broken = (
                    "unreadable",
                    f"gzip data is corrupt in the member that starts at byte {self._members[-1][1]}: {error}",
                )
                break
            if self._inflater.eof:
                left = len(self._inflater.unused_data)
                self._inflater = _inflate.decompressobj(wbits=31)
                self._member_open = False
            else:
                left = len(self._inflater.unconsumed_tail)
            self._pending_at += len(data) - left
            self._file_position += len(data) - left
            if out:
                parts.append(out)
                produced += len(out)
        return parts

    def ensure(self, position: int) -> bool:
        """Buffer the stream up to `position`; False if it ends before."""
        while self.end < position:
            if not self._fill():
                return False
        return True

    def find(self, needle: bytes, start: int, limit: int | None = None) -> int:
        """The stream position of `needle` at or after `start` (and before `limit`), or -1."""
        searched = start
        while True:
            index = self.buffer.find(needle, searched - self.base)
            if index >= 0:
                found = self.base + index
                return found if limit is None or found + len(needle) <= limit else -1
            if limit is not None and self.end >= limit:
                return -1
            searched = max(start, self.end - len(needle) + 1)
            if not self._fill():
                return -1

    def scan(self, needle: bytes, start: int) -> int:
        """Like `find` with no limit, but what has been searched is released as the search goes on: a
        resync over gigabytes of damage holds one read chunk, not the damage. Take what is needed from
        before `start` first."""
        searched = start
        while True:
            index = self.buffer.find(needle, searched - self.base)
            if index >= 0:
                return self.base + index
            searched = max(start, self.end - len(needle) + 1)
            self.release(searched)
            if not self._fill():
                return -1

    def sample(self, start: int) -> bytes:
        """The first RAW_LIMIT + 1 bytes from `start` (fewer at the end of the stream)."""
        self.ensure(start + RAW_LIMIT + 1)
        return self.take(start, start + RAW_LIMIT + 1)

    def take(self, start: int, stop: int) -> bytes:
        return self.buffer[start - self.base : stop - self.base]

    def release(self, position: int) -> None:
        """Nothing before `position` is needed again (it is dropped at the next refill)."""
        self._released = max(self._released, min(position, self.end))

    def skip_to(self, position: int) -> bool:
        """Move past `position` without keeping the bytes; False if the stream ends before."""
        while self.end < position:
            self.release(self.end)
            if not self._fill():
                return False
        self.release(position)
        return True

    def skip_blank(self, position: int) -> int:
        """The first position at or after `position` that is not CR or LF (or the end of the stream)."""
        while True:
            while position < self.end and self.buffer[position - self.base] in (13, 10):
                position += 1
            if position < self.end or not self._fill():
                return position

    def file_offset(self, position: int) -> int:
        """The file offset to start reading at for the record at stream `position`."""
        if not self.gzipped:
            return position
        index = bisect_right(self._members, (position, float("inf"))) - 1
        if index > 0:  # members before the one holding `position` are not needed again
            del self._members[:index]
        return self._members[0][1] if self._members else 0


@dataclass
class _Frame:
    """One WARC record, framed: its number, offset, type, and bytes (header block, then content block)."""

    number: int
    offset: int
    warc_type: str
    data: bytes
    header_length: int

    @property
    def head(self) -> bytes:
        """The header block and the start of the content: what a rejection for an unwanted page keeps."""
        return self.data[: self.header_length + SKIPPED_RAW_BYTES]


def _frames(
    path: str, source: _Source, name: str, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> Iterator[_Frame | dict | str]:
    """Every WARC record of the stream: framed if it may be a page, its type if it is bookkeeping, or a
    rejected record where framing fails. `name` is the file's source name (paths.relative_source).

    Damage costs the damaged record only: after a record whose block is not followed by its blank line,
    or bytes that are no WARC header, reading resumes at the next line that starts one. Memory: one
    record of at most `max_record_bytes` (a longer one is stepped over unbuffered, `record_too_large`),
    and a read chunk while searching for the next header.
    """
    position = 0
    number = 0

    def reject(kind: str, sentence: str, start: int, stop: int, sample: bytes | None = None) -> dict:
        where = f"{path}: record {number} (byte {offset})"
        if sample is None:
            raw = source.take(start, min(stop, start + RAW_LIMIT + 1))
        else:
            raw = sample[: stop - start]
        return rejected(path, kind, f"{where}: {sentence}", raw, line=number, offset=offset, source=name)

    while True:
        position = source.skip_blank(position)
        source.release(position)
        if not source.ensure(position + 1):
            if source.broken:  # the stream broke between records: one record for the file, as readers.py does
                kind, sentence = source.broken
                yield rejected(
                    path,
                    kind,
                    f"{path}: {sentence}, after {number} records",
                    line=number + 1,
                    offset=source.file_offset(position),
                    source=name,
                )
            return
        number += 1
        start = position
        offset = source.file_offset(start)
        header_end = source.find(b"\r\n\r\n", start, start + MAX_HEADER_BYTES)
        if header_end < 0 and source.eof and source.end - start < MAX_HEADER_BYTES:
            yield reject(
                "truncated_record", f"the stream ends inside its header{_why(source)}", start, source.end
            )
            return
        header = source.take(start, header_end + 4) if header_end >= 0 else b""
        is_warc = header.startswith(b"WARC/")
        match = _CONTENT_LENGTH.search(header) if is_warc else None
        if match is None:
            what = "a Content-Length" if is_warc else "a WARC/1.x header line"
            sample = source.sample(start)
            resume = source.scan(_NEXT_HEADER, start)
            stop = resume + 1 if resume >= 0 else source.end
            yield reject(
                "bad_record",
                f"no WARC record here (expected {what}); skipped {stop - start:,} bytes",
                start,
                stop,
                sample,
            )
            if resume < 0:
                return
            position = stop
            continue
        length = int(match.group(1))
        block_start = header_end + 4
        block_end = block_start + length
        match = _WARC_TYPE.search(header)
        warc_type = match.group(1).decode("ascii").lower() if match else ""
        if length > max_record_bytes:  # stepped over unbuffered; counted if it could have been a page
            if warc_type in CANDIDATE_TYPES:
                yield reject(
                    "record_too_large",
                    f"a block of {length:,} bytes, over max_record_bytes ({max_record_bytes:,}); skipped",
                    start,
                    block_start,
                )
            if not source.skip_to(block_end):
                if warc_type not in CANDIDATE_TYPES:
                    yield rejected(
                        path,
                        "truncated_record",
                        f"{path}: record {number} (byte {offset}): the stream ends inside it{_why(source)}",
                        header,
                        line=number,
                        offset=offset,
                        source=name,
                    )
                return
            position = block_end
            continue
        if not source.ensure(block_end):
            # The stream stops inside the block: a cut file, or (when the gzip stream ended cleanly) a
            # Content-Length larger than what follows.
            kind = "truncated_record" if source.broken or not source.gzipped else "bad_content_length"
            yield reject(
                kind,
                f"Content-Length is {length:,} but the stream ends after "
                f"{source.end - block_start:,} bytes of the block{_why(source)}",
                start,
                source.end,
            )
            return
        source.ensure(block_end + 4)
        after = source.take(block_end, block_end + 4)
        if after == b"\r\n\r\n" or (source.end <= block_end + 4 and b"\r\n\r\n".startswith(after)):
            if warc_type in CANDIDATE_TYPES:
                yield _Frame(number, offset, warc_type, source.take(start, block_end), block_start - start)
            else:
                yield warc_type or "untyped"  # bookkeeping (request, metadata, warcinfo): only counted
            position = block_end + len(after)
            continue
        # The block is not followed by its blank line, so the Content-Length is wrong. The record really ends
        # where the next one starts, which may lie inside the declared block (too large) or after it.
        sample = source.sample(start)
        resume = source.scan(_NEXT_HEADER, block_start)
        stop = resume + 1 if resume >= 0 else source.end
        yield reject(
            "bad_content_length",
            f"Content-Length is {length:,} but the next record starts "
            f"{stop - block_start:,} bytes into the block",
            start,
            stop,
            sample,
        )
        if resume < 0:
            return
        position = stop


def _why(source: _Source) -> str:
    return f" ({source.broken[1]})" if source.broken else ""


@lru_cache(maxsize=256)
def _label_codec(label: str | None) -> str | None:
    """The Python codec that a browser would use for a charset label, or None for an unknown label."""
    if not label:
        return None
    label = label.strip().strip("\"'").lower()
    try:  # WHATWG's table, which answers utf-8 for labels it does not know
        name = codecs.lookup(map_encoding_to_html5(label) or "").name
    except LookupError:
        return None
    if name == "utf-8" and label not in _UTF8_LABELS:
        return None
    name = name.replace("-", "_")
    return _SUPERSETS.get(name, name)


def _charset_candidates(payload: bytes, declared: str | None) -> Iterator[tuple[str, str]]:
    """(codec, where it came from), most trusted first; the costly guess only if everything before fails.

    After what the page says about itself (byte-order mark, HTTP header, `<meta>`), UTF-8 comes before
    uchardet's guess: text in another encoding almost never happens to be valid UTF-8, and the check
    costs a tenth of the guess.
    """
    if payload.startswith(codecs.BOM_UTF8):
        yield "utf_8_sig", "bom"
    elif payload.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        yield "utf_16", "bom"
    codec = _label_codec(declared)
    if codec:
        yield codec, "http"
    match = _META_CHARSET.search(payload, 0, 4096)
    codec = _label_codec(match.group(1).decode("ascii")) if match else None
    if codec:
        yield codec, "meta"
    yield "utf_8", "default"
    codec = _label_codec(detect_encoding(payload, max_len=DETECT_BYTES))
    if codec:
        yield codec, "detected"


class Undecodable(ValueError):
    """A page that no charset decodes without replacing too much of it."""


def decode_html(
    payload: bytes, declared: str | None = None, max_replacement_share: float = MAX_REPLACEMENT_SHARE
) -> tuple[str, str, str, int]:
    """(text, codec, where the codec came from, replaced characters) for an HTML page's bytes.

    `declared` is the HTTP charset. Candidates are tried in order (see `_charset_candidates`): the first
    that decodes the page without error wins, and so does one that fails on no more than
    `FEW_REPLACEMENTS` of it (a UTF-8 page with a stray byte is a UTF-8 page, and guessing again would
    garble every other character). Failing all, the most trusted candidate decodes with U+FFFD for what
    it cannot read, and if that is more than `max_replacement_share` of the text, Undecodable is raised.
    Nothing else is raised.
    """
    first: tuple[str, str] | None = None
    tried = set()
    for codec, origin in _charset_candidates(payload, declared):
        if codec in tried:
            continue
        tried.add(codec)
        first = first or (codec, origin)
        try:
            return payload.decode(codec), codec, origin, 0
        except UnicodeDecodeError:
            text = payload.decode(codec, "replace")
            replaced = text.count("\ufffd")
            if replaced <= max(1.0, FEW_REPLACEMENTS * len(text)):
                return text, codec, origin, replaced
    codec, origin = first or ("utf_8", "default")
    text = payload.decode(codec, "replace")
    replaced = text.count("\ufffd")
    if replaced > max_replacement_share * max(len(text), 1):
        raise Undecodable(
            f"no charset decodes it: as {codec} ({origin}), {replaced:,} of {len(text):,} "
            f"characters are undecodable bytes"
        )
    return text, codec, origin, replaced


def extract_text(html: str) -> tuple[str, str | None]:
    """(main text, page title) of an HTML page, with Resiliparse and EXTRACT_OPTIONS."""
    tree = HTMLTree.parse(html)
    title = tree.title.strip() if tree.title else None
    return extract_plain_text(tree, **EXTRACT_OPTIONS), title or None


def _is_html(content_type: str, payload: bytes) -> bool:
    if content_type in HTML_TYPES:
        return True
    return content_type in VAGUE_TYPES and bool(_HTML_START.match(payload[:1024]))


def _page(path: str, frame: _Frame, name: str) -> dict:
    """A document or a rejected record from one framed response, resource or revisit record; `name` is
    the file's source name."""

    def reject(kind: str, sentence: str, raw: bytes) -> dict:
        return rejected(
            path,
            kind,
            f"{path}: record {frame.number} (byte {frame.offset}): {sentence}",
            raw,
            line=frame.number,
            offset=frame.offset,
            source=name,
        )

    if frame.warc_type == "revisit":
        return reject("revisit", "a revisit record (the page is stored in an earlier record)", frame.head)
    try:
        record = WarcRecord.from_bytes(frame.data)
        status = None
        if frame.warc_type == "response":
            record.parse_http(auto_decode="all")
            status = record.http_headers.status_code if record.http_headers is not None else None
            content_type = (record.http_content_type or "").lower()
            declared = record.http_charset
        else:  # a resource record holds the page itself, typed by the WARC Content-Type
            warc_type_header = record.headers.get("Content-Type", "")
            content_type = warc_type_header.split(";")[0].strip().lower()
            match = re.search(r"charset\s*=\s*([^\s;]+)", warc_type_header, re.IGNORECASE)
            declared = match.group(1) if match else None
        payload = record.reader.read()
    except (
        Exception
    ) as error:  # FastWARC raises OSError or ValueError; a damaged record must not stop the file
        return reject("bad_record", f"unreadable HTTP message: {error}", frame.data)
    if frame.warc_type == "response" and status is None:
        return reject("bad_record", "no HTTP status line", frame.head)
    if status is not None and 300 <= status < 400 and status != 304:
        location = record.http_headers.get("Location") or "no Location"
        return reject("redirect", f"HTTP {status} redirect to {location}", frame.head)
    if status is not None and not (200 <= status < 300 or status == 304):
        return reject("http_error", f"HTTP status {status}", frame.head)
    if not payload or payload.isspace():
        return reject("empty_body", f"empty body (HTTP {status})" if status else "empty body", frame.head)
    if not _is_html(content_type, payload):
        return reject("not_html", f"content type {content_type or 'missing'}, not HTML", frame.head)
    try:
        html, codec, origin, replaced = decode_html(payload, declared)
    except Undecodable as error:
        return reject("undecodable", str(error), frame.data)
    try:
        text, title = extract_text(html)
    except Exception as error:  # Resiliparse raises its own parser errors on malformed input
        return reject("bad_record", f"HTML could not be parsed: {error}", frame.data)
    if not text.strip():
        return reject("no_text", "no main text in the page", frame.data)
    warc = record.headers
    record_id = (warc.get("WARC-Record-ID") or "").strip().strip("<>")
    metadata = {  # keys in sorted order, as records.make_document writes them
        "charset": codec,
        "charset_source": origin,
        "content_type": content_type or None,
        "fetch_date": warc.get("WARC-Date"),
        "http_status": status,
        "title": title,
        "warc_offset": frame.offset,
        "warc_record_id": record_id or None,
    }
    if replaced:
        metadata["decode_replacements"] = replaced
    truncated = warc.get("WARC-Truncated")
    if truncated:
        metadata["warc_truncated"] = truncated  # the crawler cut the page, usually at 1 MiB
    # The document as records.make_document makes it (id prefixed with the source), built directly: it
    # is a tenth of what a page costs besides extraction.
    return {
        "kind": "document",
        "id": f"{name}:{record_id}" if record_id else f"{name}:R{frame.number}",
        "text": text,
        "source": name,
        "url": warc.get("WARC-Target-URI") or None,
        "metadata": json.dumps(metadata, sort_keys=True, ensure_ascii=False),
    }


def read_warc(
    path: str,
    fields: InputFields | None = None,
    source: str | None = None,
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
) -> Iterator[dict]:
    """Every page of one WARC file, as documents or rejected records (see the module docstring).

    `fields` is accepted for the readers' common signature; WARC records have no configurable fields.
    `source` names the file in documents and ids (paths.relative_source; its basename when None).
    Storage errors propagate (the runner retries); a record's ids are checked for duplicates per file.
    """
    del fields
    name = source if source is not None else relative_source(path, None)
    ledger = IdLedger(path, "record")
    counts: Counter[str] = Counter()
    with storage.open_file(path, "rb") as raw:
        frames = _frames(path, _Source(raw, gzipped=path.lower().endswith(".gz")), name, max_record_bytes)
        for item in frames:
            if isinstance(item, str):
                counts[f"skipped {item}"] += 1
                continue
            if isinstance(item, _Frame):
                number = item.number
                item = _page(path, item, name)
                if item["kind"] == "document":
                    ledger.claim(item["id"][len(name) + 1 :], number)
            counts[item["kind"] if item["kind"] == "document" else item["error_kind"]] += 1
            yield item
    log.info("%s: %s", name, ", ".join(f"{k}: {n:,}" for k, n in sorted(counts.items())))
