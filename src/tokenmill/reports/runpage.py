"""The run page's content: curves from runs/<name>/metrics.jsonl and a summary of its config.json.

Metric keys are those fixed in docs/formats.md. Keys a run did not log (MFU on a CPU, router metrics in a
dense model) give an empty chart rather than an error, so one page serves every kind of run.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

from tokenmill import storage
from tokenmill.errors import FormatError
from tokenmill.formats.runs import CONFIG, METRICS, read_metrics, read_run_record
from tokenmill.reports import svg
from tokenmill.reports.inputs import InputError, read_json_file
from tokenmill.units import format_count

MAX_LAYER_SERIES = 8
CONFIG_ROWS = 300


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


def build_run(run_dir: str, ladder_path: str | None = None) -> dict[str, Any]:
    """Charts, summary and config rows for one run folder, and the ladder forecast when there is one.

    ladder_path: a `tokenmill ladder fit` output; by default the run folder's own ladder.json, if any.
    """
    metrics_path = storage.join(run_dir, METRICS)
    if not storage.exists(metrics_path):
        raise InputError(f"{metrics_path}: no metrics.jsonl in the run folder")
    config_path = storage.join(run_dir, CONFIG)
    try:
        # Rows as JSON objects: the page draws a chart per key, whatever keys a run logged.
        rows = [row.to_json() for row in read_metrics(metrics_path)]
        config = read_run_record(config_path).to_json() if storage.exists(config_path) else None
    except FormatError as error:
        raise InputError(str(error)) from error
    if not rows:
        raise InputError(f"{metrics_path}: no metrics logged")
    vlines = phase_lines(rows)
    step = svg.Axis("step")
    charts = []

    def add(title: str, series: list[svg.Series], y: svg.Axis, note: str = "") -> None:
        charts.append(
            {
                "title": title,
                "note": note,
                "svg": svg.line_chart(series, title=title, x=step, y=y, vlines=vlines),
            }
        )

    add("Training loss", [_series(rows, "loss")], svg.Axis("loss"))
    add("Learning rate", [_series(rows, "lr")], svg.Axis("learning rate"))
    add("Throughput", [_series(rows, "tokens_per_second", "tokens / s")], svg.Axis("tokens per second"))
    add("Model FLOPs utilization", [_series(rows, "mfu", "MFU")], svg.Axis("MFU", low=0.0))
    layers = _per_layer(rows, "expert_load")
    load_series = _layer_series(rows, "expert_load", expert_imbalance)
    if layers > MAX_LAYER_SERIES:
        load_series.append(
            svg.Series(
                "max over all layers",
                [
                    (
                        float(r["step"]),
                        max(
                            (
                                v
                                for v in (expert_imbalance(x) for x in r.get("expert_load") or [])
                                if v is not None
                            ),
                            default=None,
                        ),
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
    add("Gradient norm", [_series(rows, "grad_norm", "grad norm")], svg.Axis("norm"))
    add("Router bias norm", _layer_series(rows, "router_bias_norm", _number), svg.Axis("norm"))

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

    last = rows[-1]
    losses = [v for v in (_number(r.get("loss")) for r in rows) if v is not None]
    speeds = [v for v in (_number(r.get("tokens_per_second")) for r in rows) if v is not None]
    tail = speeds[len(speeds) // 2 :] if speeds else []
    summary = [
        ("run", os.path.basename(run_dir.rstrip("/")) or run_dir),
        ("logged steps", f"{len(rows):,}"),
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
            _duration(_number(last.get("time"))) if _number(last.get("time")) else "–",
        ),
        (
            "phases",
            ", ".join(dict.fromkeys(str(r.get("phase")) for r in rows if r.get("phase") is not None)) or "–",
        ),
    ]
    config_rows = flatten_config(config) if config is not None else []
    if ladder_path is None and storage.exists(storage.join(run_dir, "ladder.json")):
        ladder_path = storage.join(run_dir, "ladder.json")
    ladder = (
        build_ladder(read_ladder(ladder_path), ladder_path, rows, config, run_dir) if ladder_path else None
    )
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
    return ladder


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
    ladder: dict[str, Any], ladder_path: str, rows: list[dict[str, Any]], config: Any, run_dir: str
) -> dict[str, Any]:
    """The forecast section of the run page: loss against compute (log-log), and the forecast against this
    run when this run is the ladder's target."""
    fit = ladder["fit"]
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
    compute_chart = svg.line_chart(
        series,
        title="Loss against training compute",
        # Room right of the target for its marker's label.
        x=svg.Axis("training FLOPs", log=True, high=target_flops * 1.8),
        y=svg.Axis("loss", log=True),
        vlines=[svg.VLine(target_flops, "target")],
        height=300,
    )
    charts = [
        {
            "title": "Loss against training compute",
            "svg": compute_chart,
            "note": "Each rung's smoothed loss at matched fractions of its training (points) and the fitted "
            "L(C) = E + A_f C^-alpha for each fraction (lines), extended to the target's compute; the dashed "
            f"lines are the {level} band of the final fraction's curve and the black bar the forecast.",
        }
    ]

    this_run_is_target = _is_target(ladder, run_dir, rows, config)
    if this_run_is_target:
        per_step = next(
            (float(r["flops"]) / (r["step"] + 1) for r in rows if _number(r.get("flops")) and "step" in r),
            None,
        )
        if per_step:
            bars = [
                (float(f["flops"]) / per_step - 1, f["low"], f["loss"], f["high"]) for f in ladder["forecast"]
            ]
            run_series = [
                _series(rows, "loss", "this run"),
                svg.Series(
                    f"forecast ({level} band)", _error_bars(bars), FORECAST_COLOR, markers=True, width=2.0
                ),
            ]
            if actual:
                run_series.append(
                    svg.Series(
                        "smoothed at the same fractions",
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
                        y=svg.Axis("loss"),
                        vlines=phase_lines(rows),
                        height=300,
                    ),
                    "note": "This run is the ladder's target: its loss, the forecast at each fraction of its "
                    "planned steps, and its own loss smoothed the way the rungs' were.",
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
        ("target", f"{name}" + (f", {format_count(tokens)} tokens" if tokens else "")),
        ("target compute", f"{target_flops:.3e} FLOPs"),
        (
            "forecast final loss",
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
        "summary": summary,
        "charts": charts,
        "forecast_rows": forecast_rows,
        "has_actual": bool(actual),
        "warnings": [str(w) for w in ladder.get("warnings") or []],
        "runs": runs,
    }


def _duration(seconds: float) -> str:
    """Seconds as the unit a person reads at that size: 48 s, 12.5 min, 3.20 h."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.2f} h"
