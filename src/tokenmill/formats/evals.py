"""Evaluation records (docs/formats.md, "Evaluation"): `runs/<name>/eval.jsonl`, one JSON object per
evaluation set, per dispatch, per evaluation point of a run, and the same records printed by `tokenmill eval`.

A record says how well the model predicts one evaluation set: `loss` is the mean negative log-likelihood
per scored token in nats, and `bits_per_byte` is the summed negative log-likelihood in bits over the UTF-8
bytes of the tokens scored (exact: the bytes are counted from the text, not estimated from a mean token
length). The sums are kept too (`nll_nats`, `tokens`, `bytes`), so that any average can be recomputed.

Averages over sets are records of their own, with `average` set:
  micro          the sums over every set (total bits over total bytes)
  macro          the mean of the sets' values, every set weighing the same
  heldout_macro  the mean over the held-out slices only (the per-domain average a mixture is judged by)
Their `set` is the average's name. Records of one evaluation point share its `step`, `tokens` (training
tokens seen) and `dispatch` (`dropless`, or `capacity` when the run also evaluates the way it trains).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Literal

from pydantic import ConfigDict

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.formats.base import Count, FormatModel, parse

EVAL = "eval.jsonl"
Dispatch = Literal["dropless", "capacity"]
Average = Literal["micro", "macro", "heldout_macro"]
AVERAGES: tuple[str, ...] = ("micro", "macro", "heldout_macro")


class EvalRecord(FormatModel):
    """One evaluation of one set (or one average over sets) at one point of a run."""

    model_config = ConfigDict(extra="forbid")

    step: Count  # the global step the parameters are at (steps trained)
    phase: str | None = None
    tokens_trained: Count | None = None  # training tokens seen at that step
    set: str  # the evaluation set's name (heldout/domain=web, paloma-c4, ...) or the average's
    kind: Literal["heldout", "external", "average"]
    average: Average | None = None
    dispatch: Dispatch = "dropless"
    loss: float  # nats per scored token
    bits_per_byte: float
    nll_nats: float | None = None  # summed over the scored tokens (null for macro averages)
    tokens: Count | None = None  # scored tokens
    bytes: Count | None = None  # UTF-8 bytes of the scored tokens
    sequences: Count | None = None
    sets: Count | None = None  # for an average: how many sets it averages
    drop_fraction: float | None = None  # routed assignments dropped (0 when dropless)
    seconds: float | None = None  # wall time of this evaluation point (all its sets)

    def metric(self, name: str) -> float | None:
        """`loss` or `bits_per_byte` by name."""
        return getattr(self, name, None)


def set_record(
    *,
    step: int,
    name: str,
    kind: Literal["heldout", "external"],
    nll_nats: float,
    tokens: int,
    num_bytes: int,
    sequences: int,
    dispatch: str = "dropless",
    phase: str | None = None,
    tokens_trained: int | None = None,
    drop_fraction: float | None = None,
) -> EvalRecord:
    """The record of one set from its sums (nats over tokens, bits over bytes)."""
    if tokens <= 0 or num_bytes <= 0:
        raise ValueError(f"evaluation set {name}: nothing scored ({tokens} tokens, {num_bytes} bytes)")
    return EvalRecord(
        step=step,
        phase=phase,
        tokens_trained=tokens_trained,
        set=name,
        kind=kind,
        dispatch=dispatch,
        loss=nll_nats / tokens,
        bits_per_byte=nll_nats / math.log(2) / num_bytes,
        nll_nats=nll_nats,
        tokens=tokens,
        bytes=num_bytes,
        sequences=sequences,
        drop_fraction=drop_fraction,
    )


def averages(records: Sequence[EvalRecord]) -> list[EvalRecord]:
    """The micro, macro and held-out macro averages of one evaluation point's set records (one step, one
    dispatch); an average over no sets (no held-out slice) is left out."""
    if not records:
        return []
    first = records[0]
    if any((r.step, r.dispatch) != (first.step, first.dispatch) or r.kind == "average" for r in records):
        raise ValueError("averages are taken over the set records of one step and one dispatch")
    common = {"step": first.step, "phase": first.phase, "tokens_trained": first.tokens_trained}
    out = []
    nll, tokens, num_bytes = (
        sum(getattr(r, key) for r in records) for key in ("nll_nats", "tokens", "bytes")
    )
    out.append(
        EvalRecord(
            **common,
            set="micro",
            kind="average",
            average="micro",
            dispatch=first.dispatch,
            loss=nll / tokens,
            bits_per_byte=nll / math.log(2) / num_bytes,
            nll_nats=nll,
            tokens=tokens,
            bytes=num_bytes,
            sets=len(records),
        )
    )
    for average, members in (
        ("macro", records),
        ("heldout_macro", [r for r in records if r.kind == "heldout"]),
    ):
        if members:
            out.append(
                EvalRecord(
                    **common,
                    set=average,
                    kind="average",
                    average=average,
                    dispatch=first.dispatch,
                    loss=sum(r.loss for r in members) / len(members),
                    bits_per_byte=sum(r.bits_per_byte for r in members) / len(members),
                    sets=len(members),
                )
            )
    return out


def eval_line(record: EvalRecord | Mapping[str, Any]) -> str:
    """A record as its line of eval.jsonl, checked first."""
    if not isinstance(record, EvalRecord):
        record = parse(EvalRecord, dict(record), EVAL)
    return json.dumps(record.to_json()) + "\n"


def iter_eval(path: str) -> Iterator[tuple[int, EvalRecord]]:
    """(line number, record) for each line of an eval.jsonl; FormatError names the file and line."""
    with storage.open_file(path, "rb") as handle:
        yield from iter_eval_lines(handle.read(), path)


def iter_eval_lines(data: bytes, origin: str) -> Iterator[tuple[int, EvalRecord]]:
    """(line number, record) for each line of `data`, the bytes of an eval.jsonl read from `origin`."""
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{origin}: line {number}"
        try:
            value = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise FormatError(where, f"not JSON ({error})") from None
        yield number, parse(EvalRecord, value, where)


def latest_records(records: Iterable[EvalRecord]) -> list[EvalRecord]:
    """The records in (step, dispatch, set) order; a point evaluated again after a resume keeps its
    latest records."""
    latest: dict[tuple[int, str, str], EvalRecord] = {}
    for record in records:
        latest[(record.step, record.dispatch, record.set)] = record
    return [latest[key] for key in sorted(latest)]


def read_eval(path: str) -> list[EvalRecord]:
    """Every record of an eval.jsonl, in (step, dispatch, set) order; a point evaluated again after a
    resume keeps its latest records."""
    return latest_records(record for _, record in iter_eval(path))


def parse_eval(data: bytes, origin: str) -> list[EvalRecord]:
    """`read_eval` of the bytes of an eval.jsonl (a reader that follows a run being written passes only
    its whole lines)."""
    return latest_records(record for _, record in iter_eval_lines(data, origin))


def series(records: Iterable[EvalRecord], name: str, metric: str, dispatch: str = "dropless") -> list[tuple]:
    """(step, tokens_trained, value) of one set or average's `metric`, in step order."""
    return sorted(
        (r.step, r.tokens_trained, r.metric(metric))
        for r in records
        if r.set == name and r.dispatch == dispatch and r.metric(metric) is not None
    )
