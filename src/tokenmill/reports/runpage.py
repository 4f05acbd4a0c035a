"""The run page's content: curves from runs/<name>/metrics.jsonl, the evaluation records of its eval.jsonl
(tokenmill.formats.evals) and a summary of its config.json.

Metric keys are those fixed in docs/formats.md. Keys a run did not log (MFU on a CPU, router metrics in a
dense model) give an empty chart rather than an error, so one page serves every kind of run.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.formats.evals import EVAL, EvalRecord, parse_eval
from tokenmill.formats.events import EVENTS, Event, read_events
from tokenmill.formats.runs import CONFIG, LOG, METRICS, parse_metrics_line, read_run_record
from tokenmill.reports import svg
from tokenmill.reports.inputs import InputError, read_json_file
from tokenmill.units import format_count, format_duration

MAX_LAYER_SERIES = 8
CONFIG_ROWS = 300
# The most rows a chart draws. A 390,000-step run logs a row per step; drawing every one would make each
# publish take minutes and each chart megabytes, so longer runs are drawn from evenly spaced rows.
MAX_CHART_ROWS = 2000


def chart_rows(rows: list[dict[str, Any]], limit: int = MAX_CHART_ROWS) -> list[dict[str, Any]]:
    """At most about `limit` rows, evenly spaced, always with the first and the last row and the first row
    of each phase (so phase boundaries and the latest value are exact); all rows when there are few."""
    if len(rows) <= limit:
        return rows
    stride = math.ceil(len(rows) / limit)
    keep = set(range(0, len(rows), stride)) | {len(rows) - 1}
    keep.update(i for i in range(1, len(rows)) if rows[i].get("phase") != rows[i - 1].get("phase"))
    return [rows[i] for i in sorted(keep)]


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def _series(rows: list[dict[str, Any]], key: str, name: str = "", x_key: str = "step") -> svg.Series:
    return svg.Series(
        name or key,
        [(float(r[x_key]), _number(r.get(key))) for r in rows if _number(r.get(x_key)) is not None],
    )


def phase_lines(rows: list[dict[str, Any]]) -> list[svg.VLine]:
    """A marker at the first step of every phase after the first."""
    lines = []
    previous = rows[0].get("phase") if rows else None
    for row in rows[1:]:
        if row.get("phase") != previous:
            lines.append(svg.VLine(float(row["step"]), str(row.get("phase"))))
            previous = row.get("phase")
    return lines


# The events drawn on the loss and norm charts, and their colours; checkpoints are only counted.
EVENT_COLORS = {
    "skip": "#d97706", "excluded": "#9ca3af", "rollback": "#dc2626", "preemption": "#2563eb",
    "watchdog": "#7c3aed", "stop": "#991b1b", "restart": "#059669", "change": "#0891b2",
}  # fmt: skip
MAX_EVENT_MARKERS = 300
MAX_EVENT_ROWS = 200


def read_run_events(run_dir: str) -> tuple[list[Event], bytes | None]:
    """The run folder's events.jsonl (docs/formats.md, "Run events") and its whole lines; [] and None when
    the run has none. InputError names the file and line of a bad event."""
    path = storage.join(run_dir, EVENTS)
    if not storage.exists(path):
        return [], None
    with storage.open_file(path, "rb") as handle:
        data = handle.read()
    data = data[: data.rfind(b"\n") + 1]  # a line being appended waits for the next version
    try:
        return read_events(path), data
    except FormatError as error:
        raise InputError(str(error)) from error


def _event_kind(item: Event) -> str:
    """An event's kind as the page shows it: a start after an earlier command is a restart."""
    if item.kind == "start":
        return "restart" if item.previous is not None else "start"
    return item.kind


def event_lines(events: list[Event]) -> list[svg.VLine]:
    """A marker per drawn event (the latest MAX_EVENT_MARKERS), labelled where it is a rare one."""
    lines = []
    for item in events:
        kind = _event_kind(item)
        if kind in EVENT_COLORS and item.step is not None:
            label = kind if kind in ("rollback", "preemption", "watchdog", "restart", "stop") else ""
            lines.append(svg.VLine(float(item.step), label, event=kind, color=EVENT_COLORS[kind]))
    return lines[-MAX_EVENT_MARKERS:]


def build_events(events: list[Event]) -> dict[str, Any]:
    """The events table (newest first, checkpoints counted, not listed) and counts per kind."""
    shown = [item for item in events if item.kind != "checkpoint"]
    checkpoints = [item.checkpoint for item in events if item.kind == "checkpoint"]
    counts: dict[str, int] = {}
    for item in shown:
        counts[_event_kind(item)] = counts.get(_event_kind(item), 0) + 1
    rows = [
        {
            "kind": _event_kind(item),
            "step": "–" if item.step is None else f"{item.step:,}",
            "time": item.time.replace("T", " ")[:19],
            "message": item.message,
            "color": EVENT_COLORS.get(_event_kind(item), "#6b7280"),
        }  # fmt: skip
        for item in reversed(shown)
    ]
    return {
        "rows": rows[:MAX_EVENT_ROWS],
        "more": max(0, len(rows) - MAX_EVENT_ROWS),
        "counts": sorted(counts.items()),
        "checkpoints": len(checkpoints),
        "latest_checkpoint": checkpoints[-1] if checkpoints else None,
    }


def _per_layer(rows: list[dict[str, Any]], key: str) -> int:
    return max((len(r[key]) for r in rows if isinstance(r.get(key), list)), default=0)


def _layer_series(
    rows: list[dict[str, Any]], key: str, value: Callable[[Any], float | None]
) -> list[svg.Series]:
    """A series per layer (the first MAX_LAYER_SERIES) of the per-layer list `key`, entries via `value`."""

    def at(row: dict[str, Any], layer: int) -> float | None:
        entries = row.get(key)
        return value(entries[layer]) if isinstance(entries, list) and len(entries) > layer else None

    return [
        svg.Series(f"layer {layer}", [(float(r["step"]), at(r, layer)) for r in rows])
        for layer in range(min(_per_layer(rows, key), MAX_LAYER_SERIES))
    ]


def expert_imbalance(load: Any) -> float | None:
    """max expert fraction x number of experts: 1.0 when the router balances perfectly."""
    if not isinstance(load, list) or not load:
        return None
    values = [_number(v) for v in load]
    if any(v is None for v in values):
        return None
    total = sum(values)  # type: ignore[arg-type]
    return max(values) * len(values) / total if total > 0 else None  # type: ignore[type-var, operator]


IMBALANCE = "\0expert_imbalance"  # a row's per-layer imbalance, kept in the row once computed


def _imbalances(row: dict[str, Any]) -> list[float | None]:
    """`expert_imbalance` of each MoE layer of the row. Kept in
    the row: the live publisher draws the same rows again at every publish, and this is most of the cost."""
    found = row.get(IMBALANCE)
    if found is None:
        written, load = row.get("expert_imbalance"), row.get("expert_load")
        if isinstance(written, list):
            found = [_number(value) for value in written]
        else:  # rows written before the trainer logged it
            found = [expert_imbalance(layer) for layer in load] if isinstance(load, list) else []
        row[IMBALANCE] = found
    return found


def _at(values: list[float | None], index: int) -> float | None:
    return values[index] if index < len(values) else None


def flatten_config(value: Any, prefix: str = "", depth: int = 0) -> list[tuple[str, str]]:
    """Dotted keys and short values, enough to see what a run was without reading the JSON."""
    if isinstance(value, dict) and depth < 5:
        rows: list[tuple[str, str]] = []
        for key in sorted(value):
            rows.extend(flatten_config(value[key], f"{prefix}.{key}" if prefix else str(key), depth + 1))
        return rows
    if isinstance(value, list):
        if all(not isinstance(v, dict | list) for v in value) and len(value) <= 8:
            return [(prefix, json.dumps(value, ensure_ascii=False))]
        return [(prefix, f"[{len(value)} items]")]
    if isinstance(value, dict):
        return [(prefix, f"{{{len(value)} keys}}")]
    text = json.dumps(value, ensure_ascii=False)
    return [(prefix, text if len(text) <= 200 else text[:200] + "…")]


@dataclass
class RunInputs:
    """What the run page is built from: the metrics rows (as JSON objects: the page draws a chart per key,
    whatever keys a run logged) and the bytes behind them, which the site copies beside the page."""

    rows: list[dict[str, Any]]
    metrics: bytes
    config: dict[str, Any] | None = None
    config_bytes: bytes | None = None
    # eval.jsonl's records and bytes; None: read them from the run folder when the page is built (the live
    # publisher hands over only the metrics, and the trainer appends evaluations as it goes).
    evals: list[EvalRecord] | None = None
    eval_bytes: bytes | None = None


def read_run(run_dir: str) -> RunInputs:
    """A run folder's metrics.jsonl and config.json; InputError names the file and line that is wrong."""
    metrics_path = storage.join(run_dir, METRICS)
    if not storage.exists(metrics_path):
        raise InputError(f"{metrics_path}: no metrics.jsonl in the run folder")
    config_path = storage.join(run_dir, CONFIG)
    try:
        with storage.open_file(metrics_path, "rb") as handle:
            metrics = handle.read()
        rows = [row.to_json() for row in parse_metrics(metrics, metrics_path)]
        config_bytes = None
        config = None
        if storage.exists(config_path):
            with storage.open_file(config_path, "rb") as handle:
                config_bytes = handle.read()
            config = read_run_record(config_path).to_json()
    except FormatError as error:
        raise InputError(str(error)) from error
    evals, eval_bytes = read_evals(run_dir)
    return RunInputs(rows, metrics, config, config_bytes, evals, eval_bytes)


def read_evals(run_dir: str) -> tuple[list[EvalRecord], bytes | None]:
    """The run folder's evaluation records and the bytes they came from ([] and None without eval.jsonl).

    Only whole lines count: a trainer may be appending the next evaluation point while the live page is
    built, and its unfinished line waits for the next version. InputError names the file and line."""
    path = storage.join(run_dir, EVAL)
    if not storage.exists(path):
        return [], None
    with storage.open_file(path, "rb") as handle:
        data = handle.read()
    data = data[: data.rfind(b"\n") + 1]
    try:
        return parse_eval(data, path), data
    except FormatError as error:
        raise InputError(str(error)) from error


def parse_metrics(data: bytes, origin: str, first_line: int = 1) -> list[Any]:
    """The metrics rows in `data` (whole lines of a metrics.jsonl), in step order; FormatError names
    `origin` and the line."""
    rows = [
        parse_metrics_line(line, f"{origin}: line {number}")
        for number, line in enumerate(data.splitlines(), start=first_line)
        if line.strip()
    ]
    return sorted(rows, key=lambda row: row.step)


def build_run(
    run_dir: str,
    ladder_path: str | None = None,
    *,
    inputs: RunInputs | None = None,
    live: LiveStatus | None = None,
) -> dict[str, Any]:
    """Charts, summary and config rows for one run folder, the follower's view (progress against the plan,
    the mixture being sampled, the latest checkpoint, hardware, the log's last lines) and the ladder
    forecast when there is one. The same page serves `tokenmill report --run` and the trainer's live
    publishing (`tokenmill train --publish`).

    ladder_path: a `tokenmill ladder fit` output; by default the run folder's own ladder.json, if any.
    inputs: the metrics and config to draw (the live publisher hands over a snapshot); by default read from
    the run folder.
    live: set by the live publisher: when this version was made and whether training goes on.
    """
    metrics_path = storage.join(run_dir, METRICS)
    config_path = storage.join(run_dir, CONFIG)
    if inputs is None:
        inputs = read_run(run_dir)
    rows, config = inputs.rows, inputs.config
    if not rows:
        raise InputError(f"{metrics_path}: no metrics logged")
    evals, eval_bytes = inputs.evals, inputs.eval_bytes
    if evals is None:
        evals, eval_bytes = read_evals(run_dir)
    vlines = phase_lines(rows)
    events, events_bytes = read_run_events(run_dir)
    # Skips, rollbacks, restarts, preemptions and hangs are marked where a person looks for their cause.
    marked = [*vlines, *event_lines(events)]
    step = svg.Axis("step")
    charts = []
    all_rows, rows = rows, chart_rows(rows)

    def add(title: str, series: list[svg.Series], y: svg.Axis, note: str = "", events: bool = False) -> None:
        lines = marked if events else vlines
        charts.append(
            {
                "title": title,
                "note": note,
                "svg": svg.line_chart(series, title=title, x=step, y=y, vlines=lines),
            }
        )

    event_note = "Solid lines mark the run's events (table below)." if events else ""
    add("Training loss", [_series(rows, "loss")], svg.Axis("loss"), event_note, events=True)
    add("Learning rate", [_series(rows, "lr")], svg.Axis("learning rate"))
    add("Throughput", [_series(rows, "tokens_per_second", "tokens / s")], svg.Axis("tokens per second"))
    add("Model FLOPs utilization", [_series(rows, "mfu", "MFU")], svg.Axis("MFU", low=0.0))
    layers = max((len(_imbalances(r)) for r in rows), default=0)
    load_series = [
        svg.Series(f"layer {layer}", [(float(r["step"]), _at(_imbalances(r), layer)) for r in rows])
        for layer in range(min(layers, MAX_LAYER_SERIES))
    ]
    if layers > MAX_LAYER_SERIES:
        load_series.append(
            svg.Series(
                "max over all layers",
                [
                    (
                        float(r["step"]),
                        max((v for v in _imbalances(r) if v is not None), default=None),
                    )
                    for r in rows
                ],
                color="#111827",
                dashed=True,
            )
        )
    add(
        "Expert load imbalance",
        load_series,
        svg.Axis("max load ÷ mean load"),
        "Busiest expert's share of routed tokens times the number of experts, per MoE layer; 1.0 is perfectly"
        " balanced."
        + (
            f" First {MAX_LAYER_SERIES} layers shown, plus the maximum over all."
            if layers > MAX_LAYER_SERIES
            else ""
        ),
    )
    add(
        "Dropped assignments",
        [_series(rows, "drop_fraction", "drop fraction")],
        svg.Axis("fraction dropped", low=0.0),
        "Routed assignments dropped by expert capacity, over all MoE layers.",
    )
    add("Gradient norm", [_series(rows, "grad_norm", "grad norm")], svg.Axis("norm"), event_note, events=True)
    add("Router bias norm", _layer_series(rows, "router_bias_norm", _number), svg.Axis("norm"), event_note,
        events=True)  # fmt: skip

    final_load = next(
        (r["expert_load"] for r in reversed(rows) if isinstance(r.get("expert_load"), list)), None
    )
    load_map = None
    if final_load:
        experts = max(len(layer) for layer in final_load if isinstance(layer, list)) if final_load else 0
        cells = []
        values = []
        for li, layer in enumerate(final_load):
            for ei, fraction in enumerate(layer if isinstance(layer, list) else []):
                value = _number(fraction) or 0.0
                values.append(value)
                cells.append(
                    svg.HeatCell(
                        f"layer {li}",
                        f"e{ei}",
                        value,
                        "",
                        f"layer {li}, expert {ei}: {100 * value:.2f}% of tokens",
                    )
                )
        scale = svg.ColorScale(
            min((v for v in values if v > 0), default=0.0), max(values, default=1.0), False
        )
        load_map = {
            "svg": svg.heatmap(
                [f"layer {i}" for i in range(len(final_load))],
                [f"e{e}" for e in range(experts)],
                cells,
                scale=scale,
                title="Expert load at the last logged step",
                row_label="MoE layer",
                column_label="expert",
                cell_width=22 if experts > 16 else 40,
                cell_height=18,
                show_labels=False,
            ),
            "legend": svg.color_legend(
                scale, label="share of routed tokens", gradient_id="load-gradient", fraction=True
            ),
            "experts": experts,
            "uniform": f"{100 / experts:.2f}%" if experts else "",
        }

    last = all_rows[-1]
    losses = [v for v in (_number(r.get("loss")) for r in all_rows) if v is not None]
    speeds = [v for v in (_number(r.get("tokens_per_second")) for r in all_rows) if v is not None]
    tail = speeds[len(speeds) // 2 :] if speeds else []
    summary = [
        ("run", os.path.basename(run_dir.rstrip("/")) or run_dir),
        ("logged steps", f"{len(all_rows):,}"),
        ("last step", f"{int(last['step']):,}"),
        ("tokens seen", format_count(_number(last.get("tokens")) or 0)),
        ("final loss", f"{losses[-1]:.4f}" if losses else "–"),
        ("lowest loss", f"{min(losses):.4f}" if losses else "–"),
        (
            "throughput (median, second half)",
            f"{format_count(sorted(tail)[len(tail) // 2])} tokens/s" if tail else "–",
        ),
        (
            "last MFU",
            f"{100 * _number(last.get('mfu')):.1f}%" if _number(last.get("mfu")) is not None else "–",
        ),
        ("FLOPs", format_count(_number(last.get("flops")) or 0) if _number(last.get("flops")) else "–"),
        (
            "wall time",
            format_duration(_number(last.get("time"))) if _number(last.get("time")) else "–",
        ),
        (
            "phases",
            ", ".join(dict.fromkeys(str(r.get("phase")) for r in all_rows if r.get("phase") is not None))
            or "–",
        ),
    ]
    config_rows = flatten_config(config) if config is not None else []
    if ladder_path is None and storage.exists(storage.join(run_dir, "ladder.json")):
        ladder_path = storage.join(run_dir, "ladder.json")
    ladder = (
        build_ladder(read_ladder(ladder_path), ladder_path, rows, config, run_dir, evals)
        if ladder_path
        else None
    )
    evaluation = build_evaluation(evals, all_rows, config, ladder)
    if evaluation:
        summary.extend(evaluation["summary"])
    log_lines = read_log_tail(storage.join(run_dir, LOG), LOG_COPY_LINES) if storage.is_local(run_dir) else []
    files = [(f"{DATA}/metrics.jsonl", inputs.metrics, "run metrics")]
    if eval_bytes is not None:
        files.append((f"{DATA}/{EVAL}", eval_bytes, "evaluation records"))
    if events_bytes is not None:
        files.append((f"{DATA}/{EVENTS}", events_bytes, "run events"))
    if inputs.config_bytes is not None:
        files.append((f"{DATA}/config.json", inputs.config_bytes, "run config"))
    plan = (config or {}).get("plan")
    if isinstance(plan, dict):
        files.append((f"{DATA}/plan.json", _json_bytes(plan), "the run's mixture plan"))
    if ladder:
        with storage.open_file(ladder_path, "rb") as handle:  # type: ignore[arg-type]
            files.append((f"{DATA}/ladder.json", handle.read(), "scaling-ladder fit"))
    if log_lines:
        files.append((f"{DATA}/{LOG}", "".join(line + "\n" for line in log_lines).encode(), "training log"))
    return {
        "name": summary[0][1],
        "summary": summary,
        "charts": charts,
        "load_map": load_map,
        "config_rows": config_rows[:CONFIG_ROWS],
        "config_truncated": max(0, len(config_rows) - CONFIG_ROWS),
        "metrics_path": metrics_path,
        "config_path": config_path if config is not None else None,
        "ladder": ladder,
        "evaluation": evaluation,
        "events": build_events(events) if events else None,
        "follow": build_follow(all_rows, config, run_dir, live, log_lines),
        "hardware": build_hardware(rows, vlines),
        "live": live,
        "files": files,
    }


# --- evaluation (eval.jsonl, tokenmill.formats.evals; docs/reports.md, "Evaluation") ----------------------

MEASURES = (("bits_per_byte", "bits per byte"), ("loss", "loss (nats per token)"))
MAX_SET_SERIES = 12  # sets per chart; more sets are drawn over several charts, each with the average
MARKED_POINTS = 60  # evaluation points drawn with markers, when a series has no more than this
EVAL_CHART_POINTS = 400  # the most points a series of an evaluation chart draws (min/max decimated)
AVERAGE_COLOR = "#111827"
KINDS = (
    # kind, chart title, the average drawn with the sets
    ("heldout", "Held-out", "heldout_macro"),
    ("external", "Evaluation sets", "macro"),
)


def eval_phase_lines(
    rows: list[dict[str, Any]], records: list[EvalRecord]
) -> tuple[list[svg.VLine], list[svg.VLine]]:
    """Phase boundaries against step and against training tokens: the first metrics row of each phase
    after the first (the evaluation records' phases when the metrics name none)."""
    by_step, by_tokens = [], []
    previous = rows[0].get("phase") if rows else None
    for row in rows[1:]:
        if row.get("phase") != previous:
            by_step.append(svg.VLine(float(row["step"]), str(row.get("phase"))))
            tokens = _number(row.get("tokens"))
            if tokens is not None:
                by_tokens.append(svg.VLine(tokens, str(row.get("phase"))))
            previous = row.get("phase")
    if by_step or not any(r.phase for r in records):
        return by_step, by_tokens
    points = sorted({(r.step, r.tokens_trained, r.phase) for r in records if r.phase}, key=lambda p: p[0])
    for (_, _, before), (step, tokens, phase) in zip(points, points[1:]):
        if phase != before:
            by_step.append(svg.VLine(float(step), str(phase)))
            if tokens is not None:
                by_tokens.append(svg.VLine(float(tokens), str(phase)))
    return by_step, by_tokens


def build_evaluation(
    records: list[EvalRecord],
    rows: list[dict[str, Any]],
    config: dict[str, Any] | None,
    ladder: dict[str, Any] | None,
) -> dict[str, Any] | None:
    """The evaluation section: every set's bits per byte and loss against step and against training
    tokens (held-out slices with their macro average, external sets with the macro average over every
    set), dropless against capacity when the run evaluated both ways, and the latest point's table."""
    if not records:
        return None
    _, _, per_step = _phases(config)

    def tokens_of(record: EvalRecord) -> float | None:
        if record.tokens_trained is not None:
            return float(record.tokens_trained)
        return float(record.step * per_step) if per_step else None

    dispatches = [d for d in ("dropless", "capacity") if any(r.dispatch == d for r in records)]
    main = dispatches[0]
    by_key: dict[tuple[str, str], list[EvalRecord]] = {}
    for record in records:  # read_eval's order: by step
        by_key.setdefault((record.set, record.dispatch), []).append(record)
    sets = {kind: sorted({r.set for r in records if r.kind == kind}) for kind, _, _ in KINDS}
    step_lines, token_lines = eval_phase_lines(rows, records)
    axes = (
        ("step", svg.Axis("step (steps trained)"), lambda r: float(r.step), step_lines),
        ("tokens", svg.Axis("training tokens"), tokens_of, token_lines),
    )

    def series(
        name: str, measure: str, x_of: Callable, dispatch: str, label: str = "", **style
    ) -> svg.Series:
        points = [
            (x, r.metric(measure)) for r in by_key.get((name, dispatch), []) if (x := x_of(r)) is not None
        ]
        # Markers show where the evaluations were; past a few dozen points they only add bytes.
        return svg.Series(label or name, points, markers=len(points) <= MARKED_POINTS, **style)

    charts = []
    for kind, heading, average in KINDS:
        names = sets[kind]
        if not names:
            continue
        if average == "macro" and not sets["heldout"]:
            average_label = "macro average"
        elif average == "macro":
            average_label = f"macro over all {len(sets['heldout']) + len(names)} sets"
        else:
            average_label = "held-out macro"
        chunks = [names[i : i + MAX_SET_SERIES] for i in range(0, len(names), MAX_SET_SERIES)]
        for measure, measure_label in MEASURES:
            for axis_name, axis, x_of, lines in axes:
                for index, chunk in enumerate(chunks):
                    part = f", sets {index * MAX_SET_SERIES + 1}–{index * MAX_SET_SERIES + len(chunk)}"
                    title = f"{heading} {measure_label.split(' (')[0]} by {axis_name}" + (
                        part if len(chunks) > 1 else ""
                    )
                    drawn = [series(name, measure, x_of, main) for name in chunk]
                    if (average, main) in by_key:
                        drawn.append(
                            series(
                                average, measure, x_of, main, average_label, color=AVERAGE_COLOR, width=2.6
                            )
                        )
                    charts.append(
                        {
                            "title": title,
                            "kind": kind,
                            "measure": measure,
                            "axis": axis_name,
                            "sets": list(chunk),
                            "note": "",
                            "svg": svg.line_chart(
                                drawn,
                                title=title,
                                x=axis,
                                y=svg.Axis(measure_label),
                                vlines=lines,
                                max_points=EVAL_CHART_POINTS,
                            ),
                        }
                    )
    if len(dispatches) > 1:
        averages = [a for a in ("heldout_macro", "macro") if (a, main) in by_key]
        for measure, measure_label in MEASURES:
            title = f"Dropless and capacity {measure_label.split(' (')[0]}"
            drawn = []
            for index, average in enumerate(averages):
                color = svg.category_color(index)
                for dispatch in dispatches:
                    drawn.append(
                        series(
                            average,
                            measure,
                            axes[0][2],
                            dispatch,
                            f"{average} {dispatch}",
                            color=color,
                            dashed=dispatch == "capacity",
                        )
                    )
            charts.append(
                {
                    "title": title,
                    "kind": "average",
                    "measure": measure,
                    "axis": "step",
                    "sets": averages,
                    "note": "The same sets evaluated without dropping (every token reaches its experts) and "
                    "with the run's expert capacity (dashed): capacity-limited evaluation drops tokens of "
                    "batches that crowd an expert and reads higher.",
                    "svg": svg.line_chart(
                        drawn,
                        title=title,
                        x=axes[0][1],
                        y=svg.Axis(measure_label),
                        vlines=step_lines,
                        max_points=EVAL_CHART_POINTS,
                    ),
                }
            )

    last_step = max(r.step for r in records if r.dispatch == main)
    steps = sorted({r.step for r in records if r.dispatch == main})
    before = steps[-2] if len(steps) > 1 else None
    at = {(r.set, r.dispatch): r for r in records if r.step == last_step}
    previous = {r.set: r for r in records if r.step == before and r.dispatch == main}
    order = [*sets["heldout"], *sets["external"], *(a for a in ("heldout_macro", "macro", "micro"))]
    table = []
    for name in order:
        record = at.get((name, main))
        if record is None:
            continue
        earlier = previous.get(name)
        capacity = at.get((name, "capacity"))
        table.append(
            {
                "set": name,
                "kind": record.average if record.kind == "average" else record.kind,
                "bits_per_byte": f"{record.bits_per_byte:.4f}",
                "loss": f"{record.loss:.4f}",
                "change": f"{record.bits_per_byte - earlier.bits_per_byte:+.4f}" if earlier else "–",
                "tokens": format_count(record.tokens) if record.tokens is not None else "–",
                "bytes": format_count(record.bytes) if record.bytes is not None else "–",
                "capacity": f"{capacity.bits_per_byte:.4f}" if capacity else "–",
            }
        )
    headline = at.get(("heldout_macro", main)) or at.get(("macro", main))
    summary = [("evaluation points", f"{len(steps)} (last at step {last_step:,})")]
    if headline is not None:
        what = "held-out macro" if headline.set == "heldout_macro" else "macro"
        summary.append(
            (
                f"last {what}",
                f"{headline.bits_per_byte:.4f} bits per byte, loss {headline.loss:.4f} ({main})",
            )
        )
    forecast = None
    if ladder is not None:
        forecast = ladder["metric"]["label"]
    return {
        "charts": charts,
        "table": table,
        "last_step": last_step,
        "dispatch": main,
        "dispatches": dispatches,
        "has_capacity": "capacity" in dispatches,
        "heldout": sets["heldout"],
        "external": sets["external"],
        "summary": summary,
        "forecast_metric": forecast,
    }


# --- the scaling-ladder forecast (`tokenmill ladder fit` writes ladder.json; docs/ladder.md) ----------------

LADDER_KEYS = ("fractions", "points", "fit", "target", "forecast", "final", "curve", "band")
FORECAST_COLOR = "#111827"
ACTUAL_COLOR = "#db2777"
BAND_COLOR = "#6b7280"


def read_ladder(path: str) -> dict[str, Any]:
    """ladder.json as `tokenmill ladder fit` writes it; InputError names the file and what is missing."""
    ladder = read_json_file(path, "ladder fit")
    if not isinstance(ladder, dict):
        raise InputError(f"{path}: a ladder fit is a JSON object")
    missing = [key for key in LADDER_KEYS if key not in ladder]
    if missing:
        raise InputError(f"{path}: not a ladder fit (`tokenmill ladder fit` output): no {', '.join(missing)}")
    metric = ladder.get("metric")
    if metric is None:  # a fit from before ladder fits named their metric: training loss
        ladder["metric"] = dict(TRAINING_LOSS)
    elif not isinstance(metric, dict) or not all(isinstance(metric.get(k), str) for k in ("name", "label")):
        raise InputError(f"{path}: metric: an object with the metric's name and label")
    return ladder


TRAINING_LOSS = {"name": "loss", "label": "training loss", "source": "metrics.jsonl"}


def _metric_series(
    metric: dict[str, Any], rows: list[dict[str, Any]], evals: list[EvalRecord], name: str
) -> svg.Series:
    """The page's run's own curve of the ladder's metric: training loss from the metrics rows, an
    evaluation set's (or average's) measure from eval.jsonl."""
    if metric.get("source") != "eval.jsonl":
        return _series(rows, "loss", name)
    measure, dispatch = metric.get("measure") or "loss", metric.get("dispatch") or "dropless"
    points = [
        (float(r.step), r.metric(measure))
        for r in evals
        if r.set == metric.get("set") and r.dispatch == dispatch
    ]
    return svg.Series(name, points, markers=True)


def _percent(fraction: float) -> str:
    return f"{100 * fraction:.0f}%"


def _error_bars(items: list[tuple[float, float, float, float]]) -> list[tuple[float, float | None]]:
    """Vertical bars (x, low, value, high), one series: a gap between bars keeps them apart."""
    points: list[tuple[float, float | None]] = []
    for x, low, value, high in items:
        if points:
            points.append((x, None))
        points.extend([(x, low), (x, value), (x, high)])
    return points


def _is_target(ladder: dict[str, Any], run_dir: str, rows: list[dict[str, Any]], config: Any) -> bool:
    """Whether the page's run is the ladder's target: named by the fit, or planned to the target's compute."""
    named = ladder["target"].get("run")
    if named and storage.is_local(run_dir) and os.path.realpath(named) == os.path.realpath(run_dir):
        return True
    first = next((r for r in rows if _number(r.get("flops")) and isinstance(r.get("step"), int)), None)
    config = config if isinstance(config, dict) else {}
    planned = (config.get("plan") or {}).get("total_steps") or (config.get("schedule") or {}).get(
        "total_steps"
    )
    target = _number(ladder["target"].get("flops"))
    if first is None or not planned or not target:
        return False
    flops = float(first["flops"]) / (first["step"] + 1) * planned
    return abs(flops / target - 1) < 0.01


def build_ladder(
    ladder: dict[str, Any],
    ladder_path: str,
    rows: list[dict[str, Any]],
    config: Any,
    run_dir: str,
    evals: list[EvalRecord] | None = None,
) -> dict[str, Any]:
    """The forecast section of the run page: the fitted metric (training loss, or an evaluation metric
    such as the held-out macro bits per byte) against compute (log-log), and the forecast against this
    run's own curve of that metric when this run is the ladder's target."""
    fit = ladder["fit"]
    metric = ladder["metric"]
    evaluated = metric.get("source") == "eval.jsonl"
    fractions = [float(f) for f in ladder["fractions"]]
    target = ladder["target"]
    target_flops = float(target["flops"])
    points = ladder["points"]
    smallest = min((float(p["flops"]) for p in points), default=target_flops)

    series: list[svg.Series] = []
    for i, fraction in enumerate(fractions):
        color = svg.category_color(i)
        mine = sorted(
            (float(p["flops"]), float(p["loss"])) for p in points if float(p["fraction"]) == fraction
        )
        marked: list[tuple[float, float | None]] = []
        for x, y in mine:
            if marked:
                marked.append((x, None))
            marked.append((x, y))
        series.append(svg.Series(f"rungs at {_percent(fraction)}", marked, color, markers=True))
        coefficient = _number((fit.get("A") or {}).get(str(fraction)))
        if coefficient is not None:
            end = fraction * target_flops
            grid = [smallest * (end / smallest) ** (k / 47) for k in range(48)] if end > smallest else []
            alpha = (fit.get("alphas") or {}).get(str(fraction), fit["alpha"])  # per fraction: Marin's fit
            curve = [(c, fit["E"] + coefficient * c**-alpha) for c in grid]
            series.append(svg.Series(f"fit at {_percent(fraction)}", curve, color, width=1.2, legend=False))
    level = _percent(float(ladder["band"].get("level", 0.95)))
    series.append(
        svg.Series(
            f"{level} band",
            [(float(c["flops"]), _number(c.get("high"))) for c in ladder["curve"]],
            BAND_COLOR,
            dashed=True,
            width=1.0,
        )
    )
    series.append(
        svg.Series(
            "",
            [(float(c["flops"]), _number(c.get("low"))) for c in ladder["curve"]],
            BAND_COLOR,
            dashed=True,
            width=1.0,
            legend=False,
        )
    )
    final = ladder["final"]
    series.append(
        svg.Series(
            "forecast",
            _error_bars([(float(final["flops"]), final["low"], final["loss"], final["high"])]),
            FORECAST_COLOR,
            markers=True,
            width=2.0,
        )
    )
    actual = ladder.get("actual") or []
    if actual:
        series.append(
            svg.Series(
                "target run",
                [(float(a["flops"]), float(a["loss"])) for a in actual],
                ACTUAL_COLOR,
                markers=True,
                width=1.0,
            )
        )
    label = str(metric["label"])
    compute_title = (
        f"{label[:1].upper()}{label[1:]} against training compute"
        if evaluated
        else ("Loss against training compute")
    )
    compute_chart = svg.line_chart(
        series,
        title=compute_title,
        # Room right of the target for its marker's label.
        x=svg.Axis("training FLOPs", log=True, high=target_flops * 1.8),
        y=svg.Axis(metric["label"], log=True),
        vlines=[svg.VLine(target_flops, "target")],
        height=300,
    )
    charts = [
        {
            "title": compute_title,
            "svg": compute_chart,
            "note": f"Each rung's {metric['label']} at matched fractions of its training (points"
            + ("" if evaluated else ", smoothed")
            + ") and the fitted L(C) = E + A_f C^-alpha for each fraction (lines), extended to the target's "
            f"compute; the dashed lines are the {level} band of the final fraction's curve and the black bar "
            "the forecast.",
        }
    ]

    this_run_is_target = _is_target(ladder, run_dir, rows, config)
    if this_run_is_target:
        per_step = next(
            (float(r["flops"]) / (r["step"] + 1) for r in rows if _number(r.get("flops")) and "step" in r),
            None,
        )
        if per_step:
            # Metrics rows count steps from 0, evaluation records by steps trained.
            offset = 0 if evaluated else 1
            bars = [
                (float(f["flops"]) / per_step - offset, f["low"], f["loss"], f["high"])
                for f in ladder["forecast"]
            ]
            run_series = [
                _metric_series(metric, rows, evals or [], "this run"),
                svg.Series(
                    f"forecast ({level} band)", _error_bars(bars), FORECAST_COLOR, markers=True, width=2.0
                ),
            ]
            if actual:
                run_series.append(
                    svg.Series(
                        "at the same fractions" if evaluated else "smoothed at the same fractions",
                        [(float(a["step"]), float(a["loss"])) for a in actual],
                        ACTUAL_COLOR,
                        markers=True,
                        width=1.0,
                    )
                )
            charts.append(
                {
                    "title": "Forecast against this run",
                    "svg": svg.line_chart(
                        run_series,
                        title="Forecast against this run",
                        x=svg.Axis("step"),
                        y=svg.Axis(metric["label"]),
                        vlines=phase_lines(rows),
                        height=300,
                    ),
                    "note": f"This run is the ladder's target: its {metric['label']}, the forecast at each "
                    "fraction of its planned steps, and its own value at the same fractions taken the way "
                    "the rungs' were.",
                }
            )

    actual_by_fraction = {float(a["fraction"]): a for a in actual}
    forecast_rows = []
    for item in ladder["forecast"]:
        got = actual_by_fraction.get(float(item["fraction"]))
        forecast_rows.append(
            (
                _percent(float(item["fraction"])),
                f"{float(item['flops']):.3e}",
                f"{item['loss']:.4f}",
                f"{item['low']:.4f} – {item['high']:.4f}",
                f"{got['loss']:.4f}" if got else "–",
            )
        )
    runs = sorted({str(p["run"]) for p in points})
    coefficients = ", ".join(
        f"A@{_percent(float(f))} = {float(value):.4g}" for f, value in (fit.get("A") or {}).items()
    )
    name = target.get("name") or "the target"
    tokens = _number(target.get("tokens"))
    summary = [
        ("metric", f"{metric['label']} ({metric['name']})"),
        ("target", f"{name}" + (f", {format_count(tokens)} tokens" if tokens else "")),
        ("target compute", f"{target_flops:.3e} FLOPs"),
        (
            f"forecast final {metric['label']}",
            f"{final['loss']:.4f} ({level} band {final['low']:.4f} – {final['high']:.4f})",
        ),
        ("rungs", f"{len(runs)} runs, {len(points)} points at " + ", ".join(_percent(f) for f in fractions)),
        (
            "fit",
            f"E = {fit['E']:.4f}, alpha = {fit['alpha']:.4f}; {coefficients}",
        ),
        (
            "residuals",
            (f"sd {fit['residual_sd']:.4g}, " if _number(fit.get("residual_sd")) is not None else "")
            + f"{fit.get('dof', '?')} degrees of freedom",
        ),
        (
            "band",
            f"{ladder['band'].get('method', '')} ({ladder['band'].get('replicates', '?')} replicates)",
        ),
    ]
    return {
        "path": ladder_path,
        "metric": metric,
        "summary": summary,
        "charts": charts,
        "forecast_rows": forecast_rows,
        "has_actual": bool(actual),
        "warnings": [str(w) for w in ladder.get("warnings") or []],
        "runs": runs,
    }


# --- what a follower of a live run needs (`tokenmill train --publish`; docs/reports.md, "Live run page") ---

DATA = "data/run"  # where the site keeps the files behind the run page
LOG_COPY_LINES = 500  # the log's last lines copied beside the page
LOG_SHOWN_LINES = 40  # ...and shown on it
ETA_ROWS = 50  # the rows whose median step time gives the ETA
GIB = float(1 << 30)


@dataclass(frozen=True)
class LiveStatus:
    """What only the training process knows about a version of the page it publishes."""

    state: str  # "training", "finished" (the phase's last step is done) or "stopped" (error, interruption)
    updated: float  # Unix time this version was made
    version: int = 0  # counts the versions published by this process
    target_step: int | None = None  # the step this phase trains up to
    checkpoint_step: int | None = None  # the latest checkpoint this process started saving
    message: str = ""  # why training stopped
    refresh_seconds: int = 0  # the browser reloads the page this often while training goes on

    def to_json(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "updated": _utc(self.updated),
            "updated_unix": self.updated,
            "version": self.version,
            "target_step": self.target_step,
            "checkpoint_step": self.checkpoint_step,
            "message": self.message,
        }


def _json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def _utc(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(unix))


def read_log_tail(path: str, lines: int, max_bytes: int = 1 << 16) -> list[str]:
    """The last `lines` lines of a local log file (reading at most its last `max_bytes`); [] if absent."""
    try:
        with open(storage.local_path(path), "rb") as handle:
            handle.seek(0, os.SEEK_END)
            size = handle.tell()
            handle.seek(max(0, size - max_bytes))
            data = handle.read()
    except OSError:
        return []
    text = data.decode("utf-8", errors="replace").splitlines()
    if size > max_bytes and text:
        text = text[1:]  # the first line was cut by the seek
    return text[-lines:] if lines > 0 else []


def latest_checkpoint(run_dir: str) -> int | None:
    """The newest finished checkpoint in run_dir/checkpoints (orbax names each by its step and renames it
    into place only when complete); None if there is none or the folder is not local."""
    folder = storage.join(run_dir, "checkpoints")
    if not storage.is_local(folder) or not os.path.isdir(storage.local_path(folder)):
        return None
    steps = [int(name) for name in os.listdir(storage.local_path(folder)) if name.isdigit()]
    return max(steps, default=None)


def _phases(config: dict[str, Any] | None) -> tuple[list[dict[str, Any]], int | None, int | None]:
    """The plan's phases (name, start_step, end_step, sources), its total steps and tokens per step; for a
    run without a plan, one phase over the schedule's steps."""
    config = config or {}
    plan = config.get("plan")
    if isinstance(plan, dict) and isinstance(plan.get("phases"), list) and plan["phases"]:
        phases = [p for p in plan["phases"] if isinstance(p, dict)]
        total = plan.get("total_steps") or max((int(p.get("end_step") or 0) for p in phases), default=None)
        return phases, total, plan.get("tokens_per_step")
    schedule = config.get("schedule") or {}
    total = schedule.get("total_steps")
    data = config.get("data") or {}
    per_step = (data.get("batch_size") or 0) * (data.get("sequence_length") or 0) or None
    if not total:
        return [], None, per_step
    return [{"name": data.get("phase") or "pretraining", "start_step": 0, "end_step": total}], total, per_step


def _seconds_per_step(rows: list[dict[str, Any]], tokens_per_step: int | None) -> float | None:
    """The median over the last ETA_ROWS rows (the median passes over a compile or a checkpoint stall)."""
    recent = rows[-ETA_ROWS:]
    times = [v for v in (_number(r.get("step_seconds")) for r in recent) if v and v > 0]
    if not times and tokens_per_step:
        times = [tokens_per_step / v for v in (_number(r.get("tokens_per_second")) for r in recent) if v]
    return sorted(times)[len(times) // 2] if times else None


def build_follow(
    rows: list[dict[str, Any]],
    config: dict[str, Any] | None,
    run_dir: str,
    live: LiveStatus | None,
    log_lines: list[str],
) -> dict[str, Any]:
    """Where the run is: phase and step against the plan with an ETA, the mixture sampled at this step, the
    latest checkpoint, when the numbers were taken, and the log's last lines."""
    last = rows[-1]
    done = int(last["step"]) + 1  # steps trained
    phase_name = last.get("phase")
    phases, total, tokens_per_step = _phases(config)
    phase = next((p for p in phases if p.get("name") == phase_name), None)
    if phase is None and phases:
        phase = next((p for p in phases if p["start_step"] <= done - 1 < p["end_step"]), phases[-1])
    phase_end = int(phase["end_step"]) if phase else None
    target = live.target_step if live and live.target_step else phase_end

    timestamp = _number(last.get("timestamp"))
    if live is not None:
        updated = f"Last updated {_utc(live.updated)}, at step {done:,}."
    elif timestamp is not None:
        updated = f"Metrics as of {_utc(timestamp)} (step {done:,})."
    else:
        updated = f"Metrics up to step {done:,}."

    if live is not None:
        state = {"training": "training", "finished": "phase finished", "stopped": "stopped"}.get(
            live.state, live.state
        )
    elif total and done >= total:
        state = "finished"
    elif target and done >= target:
        state = "phase finished"
    else:
        state = "in progress or stopped"  # a report cannot tell which; the live page can
    training = live is not None and live.state == "training"

    progress = None
    if total:
        boundaries = [
            {
                "at": 100 * int(p["start_step"]) / total,
                "label": f"{p['name']} from step {int(p['start_step']):,}",
            }
            for p in phases[1:]
        ]
        seconds = _seconds_per_step(rows, tokens_per_step)
        eta = []
        if seconds and (training or (live is None and done < (target or 0))):
            now = live.updated if live else timestamp
            if target and target > done:
                left = (target - done) * seconds
                at = f" (about {_utc(now + left)})" if now else ""
                eta.append(f"phase {phase_name} reaches step {target:,} in {format_duration(left)}{at}")
            if total > done and (not target or total > target):
                left = (total - done) * seconds
                at = f" (about {_utc(now + left)})" if now else ""
                eta.append(f"the plan's last step ({total:,}) in {format_duration(left)}{at}")
        progress = {
            "done": done,
            "total": total,
            "percent": min(100.0, 100 * done / total),
            "label": f"step {done:,} of {total:,} ({100 * done / total:.1f}%)"
            if done <= total
            else f"step {done:,}, past the plan's {total:,}",
            "boundaries": boundaries,
            "phase": phase_name,
            "phase_range": f"steps {int(phase['start_step']):,}–{int(phase['end_step']):,}" if phase else "",
            "eta": "; ".join(eta),
            "seconds_per_step": f"{seconds:.3g} s per step (median of the last {min(len(rows), ETA_ROWS)})"
            if seconds
            else "",
        }

    mixture = None
    sources = (phase or {}).get("sources")
    if isinstance(sources, list) and sources:
        steps_in = max(0, done - int(phase["start_step"])) if phase else 0  # type: ignore[index]
        segments = []
        table = []
        for index, source in enumerate(sources):
            weight = _number(source.get("weight")) or 0.0
            sampled = weight * steps_in * (tokens_per_step or 0)
            available = _number(source.get("tokens_available"))
            segments.append(
                svg.Segment(
                    str(source.get("name")), weight, f"{100 * weight:.1f}%", svg.category_color(index)
                )
            )
            table.append(
                (
                    str(source.get("name")),
                    svg.category_color(index),
                    f"{100 * weight:.1f}%",
                    str(source.get("block_sequences") or "–"),
                    format_count(sampled) if tokens_per_step else "–",
                    format_count(_number(source.get("tokens")) or 0),
                    f"{sampled / available:.3f}" if available and tokens_per_step else "–",
                )
            )
        mixture = {
            "phase": phase_name,
            "bar": svg.stacked_bar(segments, width=880, height=18),
            "rows": table,
            "steps_in": steps_in,
        }

    checkpoint = latest_checkpoint(run_dir)
    if live is not None and live.checkpoint_step is not None and (checkpoint or -1) < live.checkpoint_step:
        checkpoint_text = f"step {live.checkpoint_step:,} (being written)"
    elif checkpoint is not None:
        where = storage.join(os.path.basename(run_dir.rstrip("/")), "checkpoints", str(checkpoint))
        checkpoint_text = f"step {checkpoint:,} ({where})"
    else:
        checkpoint_text = "none yet"

    facts = [
        ("state", state),
        ("phase", f"{phase_name}" + (f", {progress['phase_range']}" if progress else "")),
    ]
    if live is not None and live.message:
        facts.append(("why it stopped", live.message))
    facts.append(("latest checkpoint", checkpoint_text))
    if progress and progress["seconds_per_step"]:
        facts.append(("pace", progress["seconds_per_step"]))
    kinds = list(dict.fromkeys(str(r["device_kind"]) for r in rows if r.get("device_kind")))
    if kinds:
        devices = _number(last.get("devices"))
        facts.append(("devices", (f"{int(devices)} x " if devices else "") + ", then ".join(kinds)))
    return {
        "state": state,
        "training": training,
        "updated": updated,
        "progress": progress,
        "mixture": mixture,
        "facts": facts,
        "log": log_lines[-LOG_SHOWN_LINES:],
        "log_total": len(log_lines),
        "refresh": live.refresh_seconds if training and live else 0,
    }


def _by_kind(rows: list[dict[str, Any]], key: str, scale: float = 1.0) -> list[svg.Series]:
    """One series of `key` per device kind (a run resumed on other hardware shows both)."""
    kinds = list(dict.fromkeys(str(r.get("device_kind")) for r in rows if r.get("device_kind")))
    if not kinds:
        return [svg.Series(key, [(float(r["step"]), _scaled(r.get(key), scale)) for r in rows])]
    return [
        svg.Series(
            kind,
            [
                (float(r["step"]), _scaled(r.get(key), scale) if r.get("device_kind") == kind else None)
                for r in rows
            ],
        )
        for kind in kinds
    ]


def _scaled(value: Any, scale: float) -> float | None:
    number = _number(value)
    return None if number is None else number * scale


def _per_gpu(rows: list[dict[str, Any]], key: str) -> list[svg.Series]:
    gpus = _per_layer(rows, key)

    def at(row: dict[str, Any], index: int) -> float | None:
        values = row.get(key)
        return _number(values[index]) if isinstance(values, list) and len(values) > index else None

    return [
        svg.Series(f"GPU {index}", [(float(r["step"]), at(r, index)) for r in rows])
        for index in range(min(gpus, MAX_LAYER_SERIES))
    ]


def build_hardware(rows: list[dict[str, Any]], vlines: list[svg.VLine]) -> dict[str, Any]:
    """Charts of the telemetry a run logged (docs/formats.md, "Runs"); a reading no row has is left out
    and named, so a CPU run's page says there was no device memory or NVML rather than drawing nothing."""
    step = svg.Axis("step")
    charts = []
    missing = []

    def add(title: str, series: list[svg.Series], y: svg.Axis, note: str, what: str) -> None:
        if not any(p[1] is not None for s in series for p in s.points):
            missing.append(what)
            return
        charts.append(
            {
                "title": title,
                "note": note,
                "svg": svg.line_chart(series, title=title, x=step, y=y, vlines=vlines),
            }
        )

    parts = ["step", "data", "compute", "checkpoint", "publish"]
    add(
        "Step time",
        [_series(rows, f"{part}_seconds", "whole step" if part == "step" else part) for part in parts],
        # Logarithmic: the first step (compilation) takes thousands of times longer than the rest.
        svg.Axis("seconds", log=True),
        "Wall time since the previous logged step, and its parts: waiting for the batch, the step on the "
        "devices, starting a checkpoint, handing the page to the publisher (log scale; zero is not drawn).",
        "the step-time breakdown",
    )
    add(
        "Throughput per device",
        _by_kind(rows, "tokens_per_second_per_device"),
        svg.Axis("tokens per second per device", low=0.0),
        "Tokens per second divided by the devices of the mesh, one line per device type.",
        "throughput per device",
    )
    add(
        "MFU by device type",
        _by_kind(rows, "mfu"),
        svg.Axis("MFU", low=0.0),
        "Model FLOPs utilization against the peak of the run's devices, one line per device type.",
        "MFU",
    )
    add(
        "Device memory",
        [
            _series_scaled(rows, "device_memory_bytes", "in use", 1 / GIB),
            _series_scaled(rows, "device_memory_peak_bytes", "peak", 1 / GIB),
            svg.Series(
                "limit",
                [(float(r["step"]), _scaled(r.get("device_memory_limit_bytes"), 1 / GIB)) for r in rows],
                dashed=True,
            ),
        ],
        svg.Axis("GiB", low=0.0),
        "The fullest local device of process 0, from the runtime's allocator (jax memory_stats).",
        "device memory (the backend keeps no statistics, e.g. CPU)",
    )
    add(
        "Host memory",
        [_series_scaled(rows, "host_memory_bytes", "resident set", 1 / GIB)],
        svg.Axis("GiB", low=0.0),
        "Resident memory of the training process (process 0).",
        "host memory",
    )
    add(
        "GPU utilisation",
        _per_gpu(rows, "gpu_utilization"),
        svg.Axis("percent", low=0.0, high=100.0),
        "NVML: percent of the time a kernel ran, per GPU of process 0.",
        "NVIDIA readings (no NVIDIA GPU, or nvidia-ml-py not installed)",
    )
    if charts and charts[-1]["title"] == "GPU utilisation":
        add(
            "GPU power",
            _per_gpu(rows, "gpu_power_watts"),
            svg.Axis("watts", low=0.0),
            "NVML, per GPU.",
            "power",
        )
        add(
            "GPU temperature",
            _per_gpu(rows, "gpu_temperature_c"),
            svg.Axis("°C"),
            "NVML, per GPU.",
            "temperature",
        )
    last = rows[-1]
    facts = []
    for key, label in (
        ("device_memory_bytes", "device memory in use"),
        ("device_memory_peak_bytes", "device memory peak"),
        ("device_memory_limit_bytes", "device memory limit"),
        ("host_memory_bytes", "host memory (RSS)"),
    ):
        value = _number(last.get(key))
        if value is not None:
            facts.append((label, f"{value / GIB:.2f} GiB"))
    for key, label, unit in (
        ("gpu_utilization", "GPU utilisation", "%"),
        ("gpu_power_watts", "GPU power", " W"),
        ("gpu_temperature_c", "GPU temperature", " °C"),
    ):
        values = [v for v in (_number(x) for x in last.get(key) or []) if v is not None]
        if values:
            facts.append((label, ", ".join(f"{v:.0f}{unit}" for v in values)))
    return {"charts": charts, "missing": missing, "facts": facts}


def _series_scaled(rows: list[dict[str, Any]], key: str, name: str, scale: float) -> svg.Series:
    return svg.Series(name, [(float(r["step"]), _scaled(r.get(key), scale)) for r in rows])
