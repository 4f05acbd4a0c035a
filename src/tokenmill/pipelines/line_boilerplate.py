"""`line_boilerplate`: the recipe stage that removes lines repeated across many documents of one source.

What a line is, which lines count and how a document is edited: tokenmill.filters.boilerplate. This
module is the corpus-wide half, two passes in Beam:

    documents -> ((source, line hash), 1) per distinct line of a document
      -> CombinePerKey(sum)                     combiner lifting: one count per distinct (source, line)
                                                per bundle leaves a worker
      -> keep counts >= min_documents           candidates: most lines occur once and stop here
      -> CoGroupByKey by source, with the       (source -> its document count, from a second combine)
         source's document count                only candidates travel, a few per source
      -> source -> frequent line hashes         count >= max(min_documents, min_fraction x documents)
    documents -> edit with the frequent lines of their source (side input, AsDict) -> kept / removed

Memory and shuffle at 10 TB on 1,000 workers (about 10^10 documents, 3 x 10^11 lines, 10^7 sources):
the first combine shuffles one (source hash, line hash, count) of about 24 bytes per distinct line per
bundle, so up to about 7 TB when nearly every line is unique (it is the stage's cost: as much shuffle
as the text itself); a worker holds one accumulator per distinct (source, line) of its bundle. The cap
is `sample_every: n`: only the lines of a stable-hash sample of 1 document in n are counted, which
divides that shuffle by n (1 in 16 still finds a line on 5% of a site's pages once the site has a few
hundred); a count-min sketch per worker that lets through only lines it puts above `min_documents`
would be the other cap (not built). The frequent table (candidates
after `min_documents`) is small: navigation lines, some tens per site, about 10^8 x 16 bytes = 2 GB at
10^7 sites; Dataflow serves an AsDict side input by key lookups with a cache, so a worker holds the
entries of the sources it meets, not the table. Documents themselves are never shuffled by this stage
(the edit is a ParDo on the documents as they come), and no key is hot: a source with 10^8 pages is
one count per distinct line, and its one CoGroupByKey group holds only its candidate lines.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import apache_beam as beam

from tokenmill.filters.boilerplate import (
    BY_SOURCE,
    REASON,
    STAGE,
    BoilerplateLines,
    document_line_hashes,
)
from tokenmill.pipelines.sinks import stable_hash


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


def _frequent_lines(
    element: tuple[int, dict[str, Iterable]], min_documents: int, min_fraction: float
) -> Iterable[tuple[int, frozenset[int]]]:
    """source -> ({documents: [n]}, {lines: [(hash, count), ...]}) => (source, frequent hashes)."""
    source, grouped = element
    documents = sum(grouped["documents"])
    threshold = max(min_documents, min_fraction * documents)
    frequent = frozenset(digest for digest, count in grouped["lines"] if count >= threshold)
    if frequent:
        yield source, frequent


class _Strip(beam.DoFn):
    """Documents edited with their source's frequent lines: kept (main), removed ('removed') when only
    boilerplate was left, and the stage's numbers ('stats')."""

    def __init__(self, editor: BoilerplateLines):
        self.editor = editor

    def process(self, document: dict, frequent: dict[int, frozenset[int]]):
        stripped = self.editor.edit(document, frequent.get(_source_hash(document, self.editor)))
        if stripped is None:
            yield document
            return
        stats = {"lines_removed": stripped.lines_removed, "characters_removed": stripped.characters_removed}
        if stripped.text.strip():
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


class LineBoilerplate(beam.PTransform):
    """Remove lines that at least `min_documents` documents of a source, and at least `min_fraction` of
    its documents, contain (the module docstring gives the passes and their cost at 10 TB).

    `by`: `source` (the input file) or `url_host` (the host of the document's url; without one, its
    input file). `skip_domains`: documents of these domains (set by an earlier domain_classifier) are
    neither counted nor edited. `sample_every`: count the lines of 1 document in n only (chosen by a
    stable hash of the id; both thresholds then apply to the sample), which divides the counting
    shuffle by n; every document is still edited.
    """

    stage = STAGE

    def __init__(
        self,
        min_documents: int = 10,
        min_fraction: float = 0.01,
        by: str = BY_SOURCE,
        skip_domains: list[str] | tuple[str, ...] = ("code",),
        sample_every: int = 1,
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
        self.min_documents = min_documents
        self.min_fraction = float(min_fraction)
        self.editor = BoilerplateLines(by, skip_domains)

    def expand(self, documents):
        editor, min_documents, min_fraction = self.editor, self.min_documents, self.min_fraction
        sample_every = self.sample_every
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
            | "Frequent" >> beam.FlatMap(_frequent_lines, min_documents, min_fraction)
        )
        result = documents | "Strip" >> beam.ParDo(
            _Strip(editor), frequent=beam.pvalue.AsDict(frequent)
        ).with_outputs("removed", "stats", main="kept")
        table_stats = frequent | "TableStats" >> beam.Map(
            lambda element: (STAGE, {"frequent_lines": len(element[1]), "sources_with_boilerplate": 1})
        )
        counted_stats = source_documents | "CountedStats" >> beam.Map(
            lambda element: (STAGE, {"documents_counted": element[1]})
        )
        stats = (result.stats, table_stats, counted_stats) | "AllStats" >> beam.Flatten()
        return {"kept": result.kept, "removed": result.removed, "stats": stats}
