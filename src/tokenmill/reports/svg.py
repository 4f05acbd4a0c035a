"""Inline SVG charts for the report pages, generated in Python.

The pages must open offline, from disk or a bucket, and the same inputs must give the same bytes, so the
charts are plain SVG strings: no chart library, no JavaScript, coordinates printed at fixed precision.
Every piece of text that reaches the SVG goes through `escape`, since labels come from input data
(source names, phase names).

`line_chart` is the reusable piece: the run page draws its curves with it, and a scaling-ladder forecast
(log-log axes, dashed extrapolations, marked points) can be drawn with the same call. `scatter_chart` shares
its axes (the swarm page's predicted-against-measured plots).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from markupsafe import Markup, escape

from tokenmill.units import format_count

# A sequential palette (ColorBrewer YlGnBu): light for few tokens, dark for many; readable in print
# and for the common kinds of color blindness.
SEQUENTIAL = (
    "#ffffd9",
    "#edf8b1",
    "#c7e9b4",
    "#7fcdbb",
    "#41b6c4",
    "#1d91c0",
    "#225ea8",
    "#253494",
    "#081d58",
)
EMPTY_COLOR = "#f1f3f5"
# A diverging palette (ColorBrewer RdBu, reversed) for signed values: blue below zero, white at it, red above.
DIVERGING = (
    "#2166ac",
    "#4393c3",
    "#92c5de",
    "#d1e5f0",
    "#f7f7f7",
    "#fddbc7",
    "#f4a582",
    "#d6604d",
    "#b2182b",
)
# Categorical colors for lines and stacked bars, distinct enough side by side.
CATEGORICAL = (
    "#2563eb",
    "#dc2626",
    "#16a34a",
    "#9333ea",
    "#ea580c",
    "#0891b2",
    "#4b5563",
    "#ca8a04",
    "#db2777",
    "#65a30d",
)
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, 'Helvetica Neue', Arial, sans-serif"
CHAR_WIDTH = 6.4  # rough width of one 11px character, to lay out labels without measuring text


def category_color(index: int) -> str:
    return CATEGORICAL[index % len(CATEGORICAL)]


def _f(value: float) -> str:
    """A coordinate at fixed precision, so output bytes do not depend on float noise."""
    text = f"{value:.1f}"
    return "0" if text == "-0.0" else text.removesuffix(".0")


def _open(kind: str, width: float, height: float, label: str, extra: str = "") -> str:
    """The opening <svg> tag with its accessible name; the viewBox lets CSS scale the chart."""
    return (
        f'<svg class="chart {kind}" xmlns="http://www.w3.org/2000/svg"'
        f' viewBox="0 0 {_f(width)} {_f(height)}" width="{_f(width)}" height="{_f(height)}"'
        f' role="img" aria-label="{escape(label)}" font-family="{FONT}" font-size="11"{extra}>'
    )


def _text(x: float, y: float, content: str, anchor: str = "start", attrs: str = "") -> str:
    """A <text> element; `content` is escaped here, `attrs` is trusted markup from this module."""
    return f'<text x="{_f(x)}" y="{_f(y)}" text-anchor="{anchor}"{attrs}>{escape(content)}</text>'


def _line(x1: float, x2: float, y1: float, y2: float, stroke: str, attrs: str = "") -> str:
    return f'<line x1="{_f(x1)}" x2="{_f(x2)}" y1="{_f(y1)}" y2="{_f(y2)}" stroke="{stroke}"{attrs}/>'


def _hex_to_rgb(color: str) -> tuple[int, int, int]:
    return int(color[1:3], 16), int(color[3:5], 16), int(color[5:7], 16)


def interpolate(palette: Sequence[str], t: float) -> str:
    """The color at position t (0..1) along a palette, linearly interpolated in RGB."""
    t = min(1.0, max(0.0, t))
    position = t * (len(palette) - 1)
    low = min(int(position), len(palette) - 2)
    frac = position - low
    a, b = _hex_to_rgb(palette[low]), _hex_to_rgb(palette[low + 1])
    return "#" + "".join(f"{round(x + (y - x) * frac):02x}" for x, y in zip(a, b, strict=True))


def text_color_for(background: str) -> str:
    """Dark text on light cells, white on dark ones (relative luminance threshold)."""
    r, g, b = (c / 255 for c in _hex_to_rgb(background))
    luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
    return "#111827" if luminance > 0.55 else "#ffffff"


def format_tick(value: float) -> str:
    """Axis labels: counts with suffixes, small numbers in short scientific form."""
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude >= 1000:
        return format_count(value)
    if magnitude < 0.01:
        mantissa, exponent = f"{value:.1e}".split("e")
        return f"{mantissa.removesuffix('.0')}e{int(exponent)}"
    return f"{value:.3g}"


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 5 x 10^k steps) covering [low, high]."""
    if not (math.isfinite(low) and math.isfinite(high)):
        return []
    if high <= low:
        return [low]
    raw = (high - low) / max(1, count)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 2.5, 5, 10) if m * power >= raw)
    first = math.ceil(low / step - 1e-9)
    ticks = []
    k = first
    while k * step <= high + step * 1e-9:
        ticks.append(round(k * step, 12))
        k += 1
    return ticks


@dataclass(frozen=True)
class ColorScale:
    """Maps token counts to the sequential palette; logarithmic when the counts span orders of magnitude."""

    low: float
    high: float
    log: bool

    @classmethod
    def for_values(cls, values: Sequence[float]) -> ColorScale:
        positive = [v for v in values if v > 0]
        if not positive:
            return cls(0.0, 1.0, False)
        low, high = min(positive), max(positive)
        return cls(float(low), float(high), high / low > 20)

    def position(self, value: float) -> float:
        if value <= 0:
            return 0.0
        if self.high <= self.low:
            return 1.0
        if self.log:
            return (math.log10(value) - math.log10(self.low)) / (math.log10(self.high) - math.log10(self.low))
        return value / self.high

    def color(self, value: float) -> str:
        return EMPTY_COLOR if value <= 0 else self.gradient(self.position(value))

    def gradient(self, t: float) -> str:
        """The color at position t (0..1) of the scale, for its legend."""
        return interpolate(SEQUENTIAL, 0.08 + 0.92 * t)

    def ticks(self) -> list[float]:
        if self.log:
            start, stop = math.ceil(math.log10(self.low) - 1e-9), math.floor(math.log10(self.high) + 1e-9)
            decades = [10.0**k for k in range(start, stop + 1)]
            return sorted({self.low, *decades, self.high})
        return sorted({self.low, *(t for t in nice_ticks(0, self.high, 4) if t > self.low), self.high})


@dataclass(frozen=True)
class DivergingScale:
    """Maps signed values (fitted effects, say) to the diverging palette, symmetric around zero: values at or
    beyond `bound` in magnitude take the end colors."""

    bound: float
    log = False  # for `color_legend`, which names a log scale

    @classmethod
    def for_values(cls, values: Sequence[float]) -> DivergingScale:
        finite = [abs(v) for v in values if math.isfinite(v)]
        return cls(max(finite, default=0.0) or 1.0)

    def position(self, value: float) -> float:
        return 0.5 + 0.5 * min(1.0, max(-1.0, value / self.bound))

    def color(self, value: float) -> str:
        return self.gradient(self.position(value))

    def gradient(self, t: float) -> str:
        return interpolate(DIVERGING, t)

    def ticks(self) -> list[float]:
        return sorted({-self.bound, *(t for t in nice_ticks(-self.bound, self.bound, 4)), self.bound})


@dataclass(frozen=True)
class HeatCell:
    row: str
    column: str
    value: float
    label: str
    title: str
    href: str = ""
    key: str = ""


def heatmap(
    rows: Sequence[str],
    columns: Sequence[str],
    cells: Sequence[HeatCell],
    *,
    scale: ColorScale | DivergingScale,
    title: str,
    row_label: str,
    column_label: str,
    row_hrefs: dict[str, str] | None = None,
    cell_width: float = 78.0,
    cell_height: float = 26.0,
    show_labels: bool = True,
) -> Markup:
    """A rows x columns grid of colored cells with their values printed, each a link with a tooltip.

    Every (row, column) pair gets a rect with class `heat-cell`, empty ones included, so a reader sees at
    a glance which cells hold no data.
    """
    row_hrefs = row_hrefs or {}
    by_key = {(c.row, c.column): c for c in cells}
    label_width = max(60.0, min(220.0, CHAR_WIDTH * max((len(r) for r in rows), default=4) + 16))
    cell_w, cell_h, top = cell_width, cell_height, 36.0
    width = label_width + cell_w * len(columns) + 8
    height = top + cell_h * len(rows) + 8
    out = [
        _open("heatmap", width, height, title),
        f"<title>{escape(title)}</title>",
        _text(label_width + cell_w * len(columns) / 2, 12, column_label, "middle", ' fill="#4b5563"'),
        _text(4, top - 8, row_label, "start", ' fill="#4b5563"'),
    ]
    for j, column in enumerate(columns):
        x = label_width + cell_w * j + cell_w / 2
        out.append(
            _text(x, top - 8, column, "middle", f' font-weight="600" font-size="{11 if cell_w >= 30 else 8}"')
        )
    for i, row in enumerate(rows):
        y = top + cell_h * i
        out.append(f'<g class="heat-row" data-row="{escape(row)}">')
        label = _text(label_width - 8, y + cell_h / 2 + 4, row, "end")
        if row in row_hrefs:
            label = f'<a href="{escape(row_hrefs[row])}">{label}</a>'
        out.append(label)
        for j, column in enumerate(columns):
            x = label_width + cell_w * j
            cell = by_key.get((row, column))
            fill = scale.color(cell.value) if cell else EMPTY_COLOR
            rect = (
                f'<rect class="heat-cell" data-cell="{escape(cell.key if cell else "")}"'
                f' data-row="{escape(row)}" data-column="{escape(column)}" x="{_f(x + 1)}" y="{_f(y + 1)}"'
                f' width="{_f(cell_w - 2)}" height="{_f(cell_h - 2)}" rx="3" fill="{fill}">'
                f"<title>{escape(cell.title if cell else f'{row} / {column}: no data')}</title></rect>"
            )
            attrs = f' fill="{text_color_for(fill)}" pointer-events="none"'
            label_text = cell.label if cell else "—"
            text = (
                _text(x + cell_w / 2, y + cell_h / 2 + 4, label_text, "middle", attrs) if show_labels else ""
            )
            if cell and cell.href:
                out.append(f'<a href="{escape(cell.href)}">{rect}{text}</a>')
            else:
                out.append(rect + text)
        out.append("</g>")
    out.append("</svg>")
    return Markup("".join(out))


def color_legend(
    scale: ColorScale | DivergingScale,
    *,
    label: str,
    width: float = 320,
    gradient_id: str = "legend-gradient",
    fraction: bool = False,
) -> Markup:
    """A horizontal gradient bar with tick labels, matching the scale's `color` (with the empty cells' key
    for a `ColorScale`, whose zero is empty)."""
    height, bar_top, bar_h, pad = 46.0, 18.0, 12.0, 10.0
    bar_w = width - 2 * pad
    stops = "".join(
        f'<stop offset="{_f(100 * k / 16)}%" stop-color="{scale.gradient(k / 16)}"/>' for k in range(17)
    )
    out = [
        _open("legend", width, height, label),
        f'<defs><linearGradient id="{escape(gradient_id)}" x1="0" x2="1" y1="0" y2="0">{stops}'
        "</linearGradient></defs>",
        _text(pad, 12, label + (" (log scale)" if scale.log else ""), "start", ' fill="#4b5563"'),
        f'<rect x="{_f(pad)}" y="{_f(bar_top)}" width="{_f(bar_w)}" height="{_f(bar_h)}" rx="2"'
        f' fill="url(#{escape(gradient_id)})" stroke="#d1d5db"/>',
    ]
    last_x = -1e9
    for tick in scale.ticks():
        x = pad + bar_w * scale.position(tick)
        out.append(_line(x, x, bar_top + bar_h, bar_top + bar_h + 4, "#6b7280"))
        text = f"{100 * tick:.1f}%" if fraction else format_tick(tick)
        if x - last_x >= CHAR_WIDTH * (len(text) + 1):
            anchor = "start" if x < pad + 8 else "end" if x > width - pad - 8 else "middle"
            out.append(_text(x, bar_top + bar_h + 15, text, anchor, ' fill="#374151"'))
            last_x = x
    if isinstance(scale, ColorScale):
        out.append(
            f'<rect x="{_f(width - pad - 52)}" y="1" width="12" height="12" fill="{EMPTY_COLOR}"'
            ' stroke="#d1d5db"/>' + _text(width - pad - 36, 11, "empty", "start", ' fill="#4b5563"')
        )
    out.append("</svg>")
    return Markup("".join(out))


@dataclass(frozen=True)
class Segment:
    label: str
    value: float
    title: str = ""
    color: str = ""


def stacked_bar(segments: Sequence[Segment], *, width: float = 320, height: float = 14) -> Markup:
    """One horizontal bar split by share, e.g. a domain's tokens by quality bucket."""
    total = sum(max(0.0, s.value) for s in segments)
    label = ", ".join(f"{s.label}: {s.title or s.value}" for s in segments)
    out = [_open("bar", width, height, label, ' preserveAspectRatio="none"')]
    if total <= 0:
        out.append(f'<rect width="{_f(width)}" height="{_f(height)}" fill="{EMPTY_COLOR}"/>')
    x = 0.0
    for index, segment in enumerate(segments):
        if segment.value <= 0 or total <= 0:
            continue
        w = width * segment.value / total
        color = segment.color or category_color(index)
        tip = f"{segment.label}: {segment.title or format_tick(segment.value)}"
        out.append(
            f'<rect x="{_f(x)}" y="0" width="{_f(max(w, 0.5))}" height="{_f(height)}" fill="{color}">'
            f"<title>{escape(tip)}</title></rect>"
        )
        x += w
    out.append("</svg>")
    return Markup("".join(out))


@dataclass(frozen=True)
class Bar:
    label: str
    value: float
    annotation: str = ""
    color: str = ""  # the chart's color when empty


def bar_chart(
    bars: Sequence[Bar], *, title: str, width: float = 640, color: str = "#2563eb", log: bool = False
) -> Markup:
    """Horizontal bars with their labels and annotations, e.g. documents left after each curation stage."""
    label_width = max(80.0, min(260.0, CHAR_WIDTH * max((len(b.label) for b in bars), default=4) + 16))
    annotation_width = max(60.0, CHAR_WIDTH * max((len(b.annotation) for b in bars), default=4) + 12)
    bar_h, gap, top = 20.0, 6.0, 6.0
    height = top + (bar_h + gap) * len(bars) + 4
    plot_w = max(40.0, width - label_width - annotation_width)
    high = max((b.value for b in bars), default=0.0)

    def length(value: float) -> float:
        if value <= 0 or high <= 0:
            return 0.0
        if log:
            return plot_w * math.log10(1 + value) / math.log10(1 + high)
        return plot_w * value / high

    out = [_open("bars", width, height, title), f"<title>{escape(title)}</title>"]
    for i, bar in enumerate(bars):
        y = top + (bar_h + gap) * i
        w = length(bar.value)
        tip = f"{bar.label}: {bar.annotation}" if bar.label else bar.annotation
        out.append(
            _text(label_width - 8, y + bar_h / 2 + 4, bar.label, "end")
            + f'<rect x="{_f(label_width)}" y="{_f(y)}" width="{_f(max(w, 1))}" height="{_f(bar_h)}" rx="2"'
            f' fill="{bar.color or color}"><title>{escape(tip)}</title></rect>'
            + _text(label_width + w + 6, y + bar_h / 2 + 4, bar.annotation, "start", ' fill="#374151"')
        )
    out.append("</svg>")
    return Markup("".join(out))


@dataclass(frozen=True)
class Span:
    label: str
    start: float
    end: float
    detail: str = ""


def timeline(spans: Sequence[Span], *, title: str, width: float = 880, unit: str = "step") -> Markup:
    """Consecutive spans on one axis, e.g. the mixture's phases over training steps."""
    height, bar_top, bar_h, pad = 64.0, 8.0, 30.0, 8.0
    total = max((s.end for s in spans), default=0.0)
    start = min((s.start for s in spans), default=0.0)
    span_w = width - 2 * pad
    out = [_open("timeline", width, height, title), f"<title>{escape(title)}</title>"]

    def x_of(value: float) -> float:
        return pad + (span_w * (value - start) / (total - start) if total > start else 0.0)

    for i, span in enumerate(spans):
        x0, x1 = x_of(span.start), x_of(span.end)
        color = category_color(i)
        label = span.label if (x1 - x0) > CHAR_WIDTH * (len(span.label) + 2) else ""
        out.append(
            f'<rect x="{_f(x0)}" y="{_f(bar_top)}" width="{_f(max(1.0, x1 - x0))}" height="{_f(bar_h)}"'
            f' fill="{color}" fill-opacity="0.85"><title>{escape(span.label)}: {escape(span.detail)}</title>'
            "</rect>"
            + _text(
                (x0 + x1) / 2, bar_top + bar_h / 2 + 4, label, "middle", ' fill="#ffffff" font-weight="600"'
            )
        )
    boundaries = sorted({s.start for s in spans} | {s.end for s in spans})
    for k, value in enumerate(boundaries):
        x = x_of(value)
        anchor = "start" if k == 0 else "end" if k == len(boundaries) - 1 else "middle"
        out.append(
            _line(x, x, bar_top, bar_top + bar_h + 6, "#111827")
            + _text(
                x,
                bar_top + bar_h + 18,
                f"{unit} {int(value):,}" if value < 1e6 else f"{unit} {format_count(value)}",
                anchor,
                ' fill="#374151"',
            )
        )
    out.append("</svg>")
    return Markup("".join(out))


@dataclass(frozen=True)
class Series:
    """One line on a chart. `points` are (x, y); points with a missing or non-finite y are gaps."""

    name: str
    points: Sequence[tuple[float, float | None]]
    color: str = ""
    dashed: bool = False
    markers: bool = False
    width: float = 1.6
    # False keeps a helper series (the lower edge of a band, a curve that shares its points' color) out of
    # the legend.
    legend: bool = True


@dataclass(frozen=True)
class VLine:
    """A vertical marker, e.g. a phase boundary or the step a forecast starts from."""

    x: float
    label: str = ""
    # A run's event (docs/formats.md, "Run events"): drawn solid in its colour, with the kind as data-event.
    event: str = ""
    color: str = ""


@dataclass(frozen=True)
class Axis:
    label: str = ""
    log: bool = False
    low: float | None = None
    high: float | None = None
    format: Callable[[float], str] = field(default=format_tick)


def decimate(points: Sequence[tuple[float, float | None]], limit: int) -> list[tuple[float, float | None]]:
    """At most about `limit` points, keeping each bucket's minimum and maximum so that spikes survive."""
    if len(points) <= limit or limit < 4:
        return list(points)
    buckets = limit // 2
    size = len(points) / buckets
    kept: list[tuple[float, float | None]] = []
    for b in range(buckets):
        chunk = points[int(b * size) : int((b + 1) * size)]
        finite = [p for p in chunk if p[1] is not None and math.isfinite(p[1])]
        if not finite:
            if chunk:
                kept.append(chunk[0])
            continue
        low = min(finite, key=lambda p: p[1])
        high = max(finite, key=lambda p: p[1])
        kept.extend(sorted({low, high}, key=lambda p: p[0]))
    if points[-1] not in kept:
        kept.append(points[-1])
    return kept


def _log_ticks(low: float, high: float) -> list[float]:
    start, stop = math.floor(math.log10(low)), math.ceil(math.log10(high))
    if stop - start < 1:
        return nice_ticks(low, high, 4)
    stride = max(1, math.ceil((stop - start) / 6))
    ticks = [10.0**k for k in range(start, stop + 1, stride) if low <= 10.0**k <= high]
    if len(ticks) < 3:
        ticks = [t * 10.0**k for k in range(start, stop + 1) for t in (1, 2, 5) if low <= t * 10.0**k <= high]
    if len(ticks) < 3 and high < 10 * low:
        # Within a decade (losses between 2 and 4, say), evenly spaced round values read better than one tick.
        ticks = [t for t in nice_ticks(low, high, 4) if t > 0]
    return ticks


def _bounds(values: list[float], axis: Axis) -> tuple[float, float]:
    """An axis's range: its own low and high where given, else the values'; never empty."""
    low = axis.low if axis.low is not None else min(values)
    high = axis.high if axis.high is not None else max(values)
    if axis.log:
        low, high = max(low, 1e-300), max(high, 1e-300)
        if high <= low:
            low, high = low / 2, high * 2
    elif high <= low:
        pad = abs(low) * 0.05 or 1.0
        low, high = low - pad, high + pad
    return low, high


def _position(value: float, low: float, high: float, log: bool) -> float:
    if log:
        return (math.log10(value) - math.log10(low)) / (math.log10(high) - math.log10(low))
    return (value - low) / (high - low)


def _legend_layout(names: Sequence[str], width: float) -> tuple[list[tuple[float, int]], int]:
    """Each legend item's (x offset, row), wrapping rows to the chart's width, and the number of rows."""
    positions: list[tuple[float, int]] = []
    cursor, row = 0.0, 0
    for name in names:
        item_w = 26 + CHAR_WIDTH * len(name) + 12
        if cursor + item_w > width - 70 and cursor > 0:
            cursor, row = 0.0, row + 1
        positions.append((cursor, row))
        cursor += item_w
    return positions, row + 1 if names else 0


@dataclass(frozen=True)
class _Plot:
    """The plotting area of a chart with axes: where a value lands, and its frame, grid, ticks and labels."""

    left: float
    top: float
    width: float
    height: float
    x: Axis
    y: Axis
    x_lo: float
    x_hi: float
    y_lo: float
    y_hi: float

    def px(self, value: float) -> float:
        return self.left + self.width * _position(value, self.x_lo, self.x_hi, self.x.log)

    def py(self, value: float) -> float:
        return self.top + self.height * (1 - _position(value, self.y_lo, self.y_hi, self.y.log))

    def frame(self, chart_height: float) -> list[str]:
        left, top, plot_w, plot_h = self.left, self.top, self.width, self.height
        out = [
            f'<rect x="{_f(left)}" y="{_f(top)}" width="{_f(plot_w)}" height="{_f(plot_h)}" fill="#ffffff"'
            ' stroke="#d1d5db"/>'
        ]
        y_ticks = _log_ticks(self.y_lo, self.y_hi) if self.y.log else nice_ticks(self.y_lo, self.y_hi, 4)
        for tick in y_ticks:
            ty = self.py(tick)
            out.append(
                _line(left, left + plot_w, ty, ty, "#eef0f3")
                + _text(left - 6, ty + 4, self.y.format(tick), "end", ' fill="#4b5563"')
            )
        x_ticks = _log_ticks(self.x_lo, self.x_hi) if self.x.log else nice_ticks(self.x_lo, self.x_hi, 5)
        for tick in x_ticks:
            tx = self.px(tick)
            out.append(
                _line(tx, tx, top + plot_h, top + plot_h + 4, "#9ca3af")
                + _text(tx, top + plot_h + 16, self.x.format(tick), "middle", ' fill="#4b5563"')
            )
        if self.x.label:
            out.append(_text(left + plot_w / 2, chart_height - 6, self.x.label, "middle", ' fill="#374151"'))
        if self.y.label:
            out.append(
                f'<text transform="translate(12 {_f(top + plot_h / 2)}) rotate(-90)" text-anchor="middle"'
                f' fill="#374151">{escape(self.y.label)}</text>'
            )
        return out


def line_chart(
    series: Sequence[Series],
    *,
    title: str,
    x: Axis | None = None,
    y: Axis | None = None,
    vlines: Sequence[VLine] = (),
    width: float = 560,
    height: float = 260,
    max_points: int = 800,
) -> Markup:
    """A line chart with axes, ticks, a legend when there are several series, and vertical markers.

    Log axes drop non-positive values. Long series are decimated (min/max per bucket) to `max_points`.
    """
    x = x or Axis()
    y = y or Axis()
    series = [
        Series(
            s.name,
            decimate(
                [
                    (
                        float(px),
                        None if py is None or not math.isfinite(py) or (y.log and py <= 0) else float(py),
                    )
                    for px, py in s.points
                    if math.isfinite(px) and not (x.log and px <= 0)
                ],
                max_points,
            ),
            s.color or category_color(i),
            s.dashed,
            s.markers,
            s.width,
            s.legend,
        )
        for i, s in enumerate(series)
    ]
    xs = [p[0] for s in series for p in s.points if p[1] is not None]
    ys = [p[1] for s in series for p in s.points if p[1] is not None]
    xs += [v.x for v in vlines if math.isfinite(v.x) and not (x.log and v.x <= 0)]
    in_legend = [s for s in series if s.legend] if sum(s.legend for s in series) > 1 else []
    positions, legend_rows = _legend_layout([s.name for s in in_legend], width)
    left, right, bottom = 60.0, 26.0, 40.0
    top = 26.0 + 16.0 * legend_rows
    plot_w, plot_h = width - left - right, height - top - bottom
    out = [
        _open("line-chart", width, height, title),
        f"<title>{escape(title)}</title>",
        _text(left, 14, title, "start", ' font-weight="600" font-size="12.5" fill="#111827"'),
    ]
    for (cursor, row), s in zip(positions, in_legend):
        ly = 28 + 16 * row
        dash = ' stroke-dasharray="5 3"' if s.dashed else ""
        out.append(
            _line(left + cursor, left + cursor + 20, ly - 4, ly - 4, s.color, f' stroke-width="2"{dash}')
            + _text(left + cursor + 25, ly, s.name, "start", ' fill="#374151"')
        )
    if not xs or not ys:
        out.append(_text(width / 2, top + plot_h / 2, "no data", "middle", ' fill="#6b7280"') + "</svg>")
        return Markup("".join(out))

    x_lo, x_hi = _bounds(xs, x)
    y_lo, y_hi = _bounds(ys, y)
    if not y.log and y.low is None and y.high is None:
        # Headroom so that the line does not touch the frame.
        margin = (y_hi - y_lo) * 0.05
        y_lo, y_hi = y_lo - margin, y_hi + margin
        if min(ys) >= 0 > y_lo:
            y_lo = 0.0
    plot = _Plot(left, top, plot_w, plot_h, x, y, x_lo, x_hi, y_lo, y_hi)
    px, py = plot.px, plot.py
    out.extend(plot.frame(height))
    for v in vlines:
        if not math.isfinite(v.x) or (x.log and v.x <= 0) or not (x_lo <= v.x <= x_hi):
            continue
        vx = px(v.x)
        if v.event:
            out.append(
                f'<line class="vline event" data-event="{escape(v.event)}" data-step="{_f(v.x)}"'
                f' x1="{_f(vx)}" x2="{_f(vx)}" y1="{_f(top)}" y2="{_f(top + plot_h)}"'
                f' stroke="{escape(v.color or "#6b7280")}" stroke-width="1.5" opacity="0.8">'
                f"<title>{escape(v.event)} at step {_f(v.x)}</title></line>"
            )
        else:
            out.append(
                f'<line class="vline" x1="{_f(vx)}" x2="{_f(vx)}" y1="{_f(top)}" y2="{_f(top + plot_h)}"'
                ' stroke="#6b7280" stroke-dasharray="3 3"/>'
            )
        if v.label:
            out.append(_text(vx + 4, top + 12, v.label, "start", ' fill="#4b5563"'))
    for s in series:
        runs: list[list[tuple[float, float]]] = [[]]
        for point_x, point_y in s.points:
            if point_y is None:
                if runs[-1]:
                    runs.append([])
                continue
            runs[-1].append((px(point_x), py(point_y)))
        dash = ' stroke-dasharray="6 4"' if s.dashed else ""
        for run in runs:
            if len(run) >= 2:
                d = "M" + " L".join(f"{_f(a)} {_f(b)}" for a, b in run)
                out.append(
                    f'<path d="{d}" fill="none" stroke="{s.color}" stroke-width="{_f(s.width)}"'
                    f' stroke-linejoin="round"{dash}><title>{escape(s.name)}</title></path>'
                )
            if s.markers or len(run) == 1:
                out.extend(f'<circle cx="{_f(a)}" cy="{_f(b)}" r="3" fill="{s.color}"/>' for a, b in run)
    out.append("</svg>")
    return Markup("".join(out))


@dataclass(frozen=True)
class Points:
    """One group of points on a scatter chart, each with its tooltip (which proxy it is, say)."""

    name: str
    points: Sequence[tuple[float, float]]
    titles: Sequence[str] = ()  # one per point; a point without one is named by its group and values
    color: str = ""


def scatter_chart(
    groups: Sequence[Points],
    *,
    title: str,
    x: Axis | None = None,
    y: Axis | None = None,
    diagonal: bool = False,
    width: float = 420,
    height: float = 340,
) -> Markup:
    """Points of one or more groups on shared axes (those of `line_chart`), a legend when there are several.

    With `diagonal`, both axes cover the same range and the dashed line y = x is drawn: predictions against
    the measured values then read at a glance (on the line: exact; above it: predicted too high). Points
    with a non-finite value, or a non-positive one on a log axis, are left out.
    """
    x = x or Axis()
    y = y or Axis()

    def plottable(value: float, axis: Axis) -> bool:
        return math.isfinite(value) and not (axis.log and value <= 0)

    kept: list[tuple[str, str, list[tuple[float, float, str]]]] = []
    for i, group in enumerate(groups):
        titles = [*group.titles, *[""] * (len(group.points) - len(group.titles))]
        points = [
            (float(a), float(b), tip or f"{group.name}: {format_tick(a)}, {format_tick(b)}")
            for (a, b), tip in zip(group.points, titles)
            if plottable(a, x) and plottable(b, y)
        ]
        kept.append((group.name, group.color or category_color(i), points))
    xs = [a for _, _, points in kept for a, _, _ in points]
    ys = [b for _, _, points in kept for _, b, _ in points]
    names = [name for name, _, _ in kept] if len(kept) > 1 else []
    positions, legend_rows = _legend_layout([*names, "y = x"] if diagonal and names else names, width)
    left, right, bottom = 60.0, 26.0, 40.0
    top = 26.0 + 16.0 * legend_rows
    plot_w, plot_h = width - left - right, height - top - bottom
    out = [
        _open("scatter-chart", width, height, title),
        f"<title>{escape(title)}</title>",
        _text(left, 14, title, "start", ' font-weight="600" font-size="12.5" fill="#111827"'),
    ]
    for k, (cursor, row) in enumerate(positions):
        ly = 28 + 16 * row
        if k < len(names):
            swatch = f'<circle cx="{_f(left + cursor + 10)}" cy="{_f(ly - 4)}" r="3.5" fill="{kept[k][1]}"/>'
        else:
            swatch = _line(
                left + cursor, left + cursor + 20, ly - 4, ly - 4, "#9ca3af", ' stroke-dasharray="4 3"'
            )
        label = names[k] if k < len(names) else "y = x"
        out.append(swatch + _text(left + cursor + 25, ly, label, "start", ' fill="#374151"'))
    if not xs:
        out.append(_text(width / 2, top + plot_h / 2, "no data", "middle", ' fill="#6b7280"') + "</svg>")
        return Markup("".join(out))

    x_lo, x_hi = _bounds(xs, x)
    y_lo, y_hi = _bounds(ys, y)
    if diagonal:
        x_lo = y_lo = min(x_lo, y_lo)
        x_hi = y_hi = max(x_hi, y_hi)
    # Headroom on linear axes without a given range, so that no point sits on the frame.
    if not x.log and x.low is None and x.high is None:
        margin = (x_hi - x_lo) * 0.05
        x_lo, x_hi = x_lo - margin, x_hi + margin
    if not y.log and y.low is None and y.high is None:
        margin = (y_hi - y_lo) * 0.05
        y_lo, y_hi = y_lo - margin, y_hi + margin
    plot = _Plot(left, top, plot_w, plot_h, x, y, x_lo, x_hi, y_lo, y_hi)
    out.extend(plot.frame(height))
    if diagonal:
        low, high = max(x_lo, y_lo), min(x_hi, y_hi)
        out.append(
            f'<line class="diagonal" x1="{_f(plot.px(low))}" x2="{_f(plot.px(high))}" y1="{_f(plot.py(low))}"'
            f' y2="{_f(plot.py(high))}" stroke="#9ca3af" stroke-dasharray="4 3"><title>y = x</title></line>'
        )
    for name, color, points in kept:
        out.append(f'<g class="points" data-group="{escape(name)}">')
        out.extend(
            f'<circle cx="{_f(plot.px(a))}" cy="{_f(plot.py(b))}" r="3.5" fill="{color}" fill-opacity="0.8">'
            f"<title>{escape(tip)}</title></circle>"
            for a, b, tip in points
        )
        out.append("</g>")
    out.append("</svg>")
    return Markup("".join(out))
