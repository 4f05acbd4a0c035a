"""`line_boilerplate`: the recipe stage that removes lines repeated across many documents of one source.

What a line is, which lines count and how a document is edited: tokenmill.filters.boilerplate. This
module is the corpus-wide half, two passes in Beam, and the stage's report of what it removed:

    documents -> ((source, line hash), 1) per distinct line of a document
      -> CombinePerKey(sum)                     combiner lifting: one count per distinct (source, line)
                                                per bundle leaves a worker
      -> keep counts >= min_documents           candidates: most lines occur once and stop here
      -> CoGroupByKey by source, with the       (source -> its document count, from a second combine)
         source's document count                only candidates travel, a few per source
      -> source -> frequent line hashes         count >= max(min_documents, min_fraction x documents),
                   and the top_lines most       each of those with its count and a stride (below)
                   repeated
    documents -> edit with the frequent lines of their source (side input, AsDict) -> kept / removed
      -> per source: documents, characters, lines and characters removed   CombinePerKey(sum)
      -> ((source, line hash), the line as written, cut to line_chars)     CombinePerKey(min), sent only
                                                by about TEXT_CARRIERS of the documents holding a top line
      -> CoGroupByKey by source -> one record per source with boilerplate -> Top.Of(top_sources) by the
         characters removed -> stats.json `stages.line_boilerplate.sources`

Memory and shuffle at 10 TB on 1,000 workers (about 10^10 documents, 3 x 10^11 lines, 10^7 sources):
the first combine shuffles one (source hash, line hash, count) of about 24 bytes per distinct line per
bundle, so up to about 7 TB when nearly every line is unique (it is the stage's cost: as much shuffle
as the text itself); a worker holds one accumulator per distinct (source, line) of its bundle. The cap
is `sample_every: n`: only the lines of a stable-hash sample of 1 document in n are counted, which
divides that shuffle by n (1 in 16 still finds a line on 5% of a site's pages once the site has a few
hundred); a count-min sketch per worker that lets through only lines it puts above `min_documents`
would be the other cap (not built). The frequent table (candidates
after `min_documents`) is small: navigation lines, some tens per site, about 10^8 x 16 bytes = 2 GB at
10^7 sites, plus the top_lines (hash, count, stride) of each site, 10^7 x 10 x 24 bytes = 2.4 GB more at
the default of 10; Dataflow serves an AsDict side input by key lookups with a cache, so a worker holds
the entries of the sources it meets, not the table. Documents themselves are never shuffled by this stage
(the edit is a ParDo on the documents as they come), and no key is hot: a source with 10^8 pages is
one count per distinct line, and its one CoGroupByKey group holds only its candidate lines.

The report costs little beside that. Text travels only for the top lines, and not from every document
that holds one: a document sends a top line's text when a hash of its id is 0 modulo the line's stride,
(documents counted x sample_every) // TEXT_CARRIERS, so about 16 copies of each (at most
10^7 x 10 x 16 x 216 bytes = 350 GB at a 200-character cap, against the first combine's 7 TB), combined
to one per bundle before they leave a worker. Of a line with more than TEXT_CARRIERS documents the text
can be missed (no document drawn: a chance of about e^-16); the report then gives the line without its
text (null). The per-source numbers are one (source hash, six counts) per document of a source with
boilerplate, about 20 bytes (the source's name rides only with the documents edited), combined per
bundle: at worst, when every bundle meets every source once, 10^10 x 20 bytes = 200 GB. The final
Top.Of holds `top_sources` records of at most top_lines x line_chars characters (200 KB at the
defaults) on one worker.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, NamedTuple

import apache_beam as beam

from tokenmill.filters.boilerplate import (
    BY_SOURCE,
    REASON,
    STAGE,
    BoilerplateLines,
    document_line_hashes,
)
from tokenmill.pipelines.sinks import stable_hash

#: About this many of the documents that hold one of a source's top lines send its text for the report.
TEXT_CARRIERS = 16
#: The per-source numbers of the report, in the order they travel: documents and characters the stage
#: saw (before the edit), lines and characters removed, documents edited and removed whole.
SOURCE_NUMBERS = (
    "documents",
    "characters",
    "lines_removed",
    "characters_removed",
    "documents_edited",
    "documents_removed",
)


def _sampled(document: dict, editor: BoilerplateLines, sample_every: int) -> bool:
    """Whether the document's lines are counted: every document of a counted domain, or with
    sample_every = n, the 1 in n whose id hashes to 0 mod n (the same ones in every run)."""
    if not editor.counted(document):
        return False
    return sample_every == 1 or stable_hash(str(document["id"])) % sample_every == 0


def _source_hash(document: dict, editor: BoilerplateLines) -> int:
    """8 bytes in the shuffle, whatever the length of the source's path or host."""
    return stable_hash(editor.key(document))


def _line_entries(document: dict, editor: BoilerplateLines, sample_every: int):
    if _sampled(document, editor, sample_every):
        source = _source_hash(document, editor)
        for digest in document_line_hashes(document["text"]):
            yield (source, digest), 1


def _source_documents(document: dict, editor: BoilerplateLines, sample_every: int):
    if _sampled(document, editor, sample_every):
        yield _source_hash(document, editor), 1


class SourceLines(NamedTuple):
    """A source's frequent lines as the documents meet them (the side input's value): `lines`, the keys
    to remove, and `top`, the `top_lines` most repeated as (key, documents counted holding it, stride of
    the documents that send its text)."""

    lines: frozenset[int]
    top: tuple[tuple[int, int, int], ...]


def _frequent_lines(
    element: tuple[int, dict[str, Iterable]],
    min_documents: int,
    min_fraction: float,
    top_lines: int,
    sample_every: int,
) -> Iterable[tuple[int, SourceLines]]:
    """source -> ({documents: [n]}, {lines: [(hash, count), ...]}) => (source, its frequent lines)."""
    source, grouped = element
    documents = sum(grouped["documents"])
    threshold = max(min_documents, min_fraction * documents)
    frequent = [(digest, count) for digest, count in grouped["lines"] if count >= threshold]
    if not frequent:
        return
    ranked = sorted(frequent, key=lambda entry: (-entry[1], entry[0]))[:top_lines]
    # count x sample_every documents hold the line; a stride of that / TEXT_CARRIERS leaves about 16.
    top = tuple((digest, count, max(1, count * sample_every // TEXT_CARRIERS)) for digest, count in ranked)
    yield source, SourceLines(frozenset(digest for digest, _ in frequent), top)


def _carrier(document: dict) -> int:
    """The hash that picks which documents send a top line's text (salted: not the sample's hash)."""
    return stable_hash(f"line_boilerplate:{document['id']}")


class _Strip(beam.DoFn):
    """Documents edited with their source's frequent lines: kept (main), removed ('removed') when only
    boilerplate was left, the stage's numbers ('stats'), and for the report the per-source numbers
    ('sources') and the text of top lines ('lines')."""

    def __init__(self, editor: BoilerplateLines, line_chars: int):
        self.editor = editor
        self.line_chars = line_chars

    def process(self, document: dict, frequent: dict[int, SourceLines]):
        source = _source_hash(document, self.editor)
        lines = frequent.get(source)
        if lines is None or not self.editor.counted(document):
            yield document
            return
        carrier = _carrier(document)
        wanted = [digest for digest, _, stride in lines.top if carrier % stride == 0]
        characters = len(document["text"])
        stripped = self.editor.edit(document, lines.lines, wanted)
        if stripped is None:  # the source's name travels with the edited documents only
            yield beam.pvalue.TaggedOutput("sources", (source, ("", (1, characters, 0, 0, 0, 0))))
            yield document
            return
        for digest, text in sorted(stripped.examples.items()):
            yield beam.pvalue.TaggedOutput("lines", ((source, digest), text[: self.line_chars]))
        stats = {"lines_removed": stripped.lines_removed, "characters_removed": stripped.characters_removed}
        edited = bool(stripped.text.strip())
        removed = (stripped.lines_removed, stripped.characters_removed)
        numbers = (1, characters, *removed, int(edited), int(not edited))
        yield beam.pvalue.TaggedOutput("sources", (source, (self.editor.key(document), numbers)))
        if edited:
            yield beam.pvalue.TaggedOutput("stats", (STAGE, {**stats, "documents_edited": 1}))
            yield document
            return
        yield beam.pvalue.TaggedOutput("stats", (STAGE, {**stats, "documents_removed": 1}))
        yield beam.pvalue.TaggedOutput(
            "removed",
            {
                **document,
                "stage": STAGE,
                "reason": REASON,
                "detail": json.dumps({"lines_removed": stripped.lines_removed}, sort_keys=True),
            },
        )


def _sum_source(values: Iterable[tuple[str, tuple[int, ...]]]) -> tuple[str, tuple[int, ...]]:
    """One source's numbers summed, and its name (sent by the edited documents; "" by the others; the
    smallest, should two names share a hash)."""
    names, total = [], [0] * len(SOURCE_NUMBERS)
    for name, numbers in values:
        if name:
            names.append(name)
        total = [a + b for a, b in zip(total, numbers, strict=True)]
    return min(names, default=""), tuple(total)


def _source_report(element: tuple[int, dict[str, Iterable]]) -> Iterable[dict[str, Any]]:
    """source -> its numbers, counted documents, frequent lines and top lines' texts => one record, for
    the sources that had boilerplate."""
    _, grouped = element
    numbers = list(grouped["numbers"])
    ranked = list(grouped["top"])
    if not numbers or not ranked:
        return
    name, values = numbers[0]
    frequent_lines, top = ranked[0]
    texts = dict(grouped["texts"])
    yield {
        "source": name,
        **dict(zip(SOURCE_NUMBERS, values, strict=True)),
        "documents_counted": sum(grouped["counted"]),
        "frequent_lines": frequent_lines,
        "top_lines": [{"text": texts.get(digest), "documents": count} for digest, count, _ in top],
    }


def _sources_stats(records: list[dict[str, Any]]) -> tuple[str, dict]:
    """The reported sources as one stats entry: {"sources": {source: record}} (reported once, so that the
    texts pass through the summing of stage statistics as they are)."""
    return STAGE, {
        "sources": {
            record["source"]: {key: value for key, value in record.items() if key != "source"}
            for record in records
        }
    }


class LineBoilerplate(beam.PTransform):
    """Remove lines that at least `min_documents` documents of a source, and at least `min_fraction` of
    its documents, contain (the module docstring gives the passes and their cost at 10 TB).

    `by`: `source` (the input file) or `url_host` (the host of the document's url; without one, its
    input file). `skip_domains`: documents of these domains (set by an earlier domain_classifier) are
    neither counted nor edited. `sample_every`: count the lines of 1 document in n only (chosen by a
    stable hash of the id; both thresholds then apply to the sample), which divides the counting
    shuffle by n; every document is still edited.

    The report (stats.json, `stages.line_boilerplate.sources`): for the `top_sources` sources with the
    most characters removed, what the stage removed there and its `top_lines` most repeated lines, each
    with the documents counted that hold it and its text cut to `line_chars` characters.
    """

    stage = STAGE

    def __init__(
        self,
        min_documents: int = 10,
        min_fraction: float = 0.01,
        by: str = BY_SOURCE,
        skip_domains: list[str] | tuple[str, ...] = ("code",),
        sample_every: int = 1,
        top_lines: int = 10,
        top_sources: int = 100,
        line_chars: int = 200,
    ):
        super().__init__()
        if not isinstance(sample_every, int) or sample_every < 1:
            raise ValueError(f"sample_every must be a positive integer, got {sample_every!r}")
        self.sample_every = sample_every
        if not isinstance(min_documents, int) or min_documents < 2:
            raise ValueError(
                f"min_documents must be an integer >= 2 (a line in one document is its own), "
                f"got {min_documents!r}"
            )
        if not 0.0 <= float(min_fraction) <= 1.0:
            raise ValueError(f"min_fraction must be in [0, 1], got {min_fraction!r}")
        for name, value, least in (("top_lines", top_lines, 0), ("top_sources", top_sources, 0),
                                   ("line_chars", line_chars, 1)):  # fmt: skip
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        self.min_documents = min_documents
        self.min_fraction = float(min_fraction)
        self.top_lines, self.top_sources, self.line_chars = top_lines, top_sources, line_chars
        self.editor = BoilerplateLines(by, skip_domains)

    def expand(self, documents):
        editor, min_documents, min_fraction = self.editor, self.min_documents, self.min_fraction
        sample_every, top_lines = self.sample_every, self.top_lines
        candidates = (
            documents
            | "LineHashes" >> beam.FlatMap(_line_entries, editor, sample_every)
            | "CountLines" >> beam.CombinePerKey(sum)
            | "Candidates" >> beam.Filter(lambda element: element[1] >= min_documents)
            | "BySource" >> beam.Map(lambda element: (element[0][0], (element[0][1], element[1])))
        )
        source_documents = (
            documents
            | "SourceKeys" >> beam.FlatMap(_source_documents, editor, sample_every)
            | "CountDocuments" >> beam.CombinePerKey(sum)
        )
        frequent = (
            {"documents": source_documents, "lines": candidates}
            | "JoinSource" >> beam.CoGroupByKey()
            | "Frequent"
            >> beam.FlatMap(_frequent_lines, min_documents, min_fraction, top_lines, sample_every)
        )
        result = documents | "Strip" >> beam.ParDo(
            _Strip(editor, self.line_chars), frequent=beam.pvalue.AsDict(frequent)
        ).with_outputs("removed", "stats", "sources", "lines", main="kept")
        table_stats = frequent | "TableStats" >> beam.Map(
            lambda element: (STAGE, {"frequent_lines": len(element[1].lines), "sources_with_boilerplate": 1})
        )
        counted_stats = source_documents | "CountedStats" >> beam.Map(
            lambda element: (STAGE, {"documents_counted": element[1]})
        )
        stats_parts = [result.stats, table_stats, counted_stats]
        if self.top_sources:
            stats_parts.append(self._report(result, frequent, source_documents))
        stats = tuple(stats_parts) | "AllStats" >> beam.Flatten()
        return {"kept": result.kept, "removed": result.removed, "stats": stats}

    def _report(self, result, frequent, source_documents):
        """(STAGE, {"sources": ...}): the `top_sources` sources with the most characters removed."""
        numbers = result.sources | "SumSources" >> beam.CombinePerKey(_sum_source)
        texts = (
            result.lines
            | "OneText" >> beam.CombinePerKey(min)
            | "TextBySource" >> beam.Map(lambda element: (element[0][0], (element[0][1], element[1])))
        )
        top = frequent | "TopLines" >> beam.Map(
            lambda element: (element[0], (len(element[1].lines), element[1].top))
        )
        return (
            {"numbers": numbers, "top": top, "texts": texts, "counted": source_documents}
            | "JoinReport" >> beam.CoGroupByKey()
            | "SourceReport" >> beam.FlatMap(_source_report)
            | "TopSources"
            >> beam.combiners.Top.Of(
                self.top_sources, key=lambda record: (record["characters_removed"], record["source"])
            )
            | "ReportStats" >> beam.Map(_sources_stats)
        )
