"""The planner's picture: each planned rank's memory over time against the card's capacity, as SVG.

Written by hand (no plotting library is a dependency of the project): an .svg file, or an .html
page holding the SVG, the same memory over the planned time on the card (when the plan timed its
steps: docs/time_on_the_card.md) and the per-rank table. The y axis spans the ranks' memory; a capacity far
above it is named at the top of the chart instead of flattening the curves.
"""

import html
from typing import Dict

WIDTH, HEIGHT = 760, 360
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 50
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
SUFFIXES = (".svg", ".html")
FAILED = "FAILED: figures up to the failure"  # how every report marks a rank that did not run to the end


def _size(value: float) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value:.0f} B"


def _nice_step(span: float) -> float:
    raw = span / 5
    magnitude = 2 ** int(raw).bit_length() if raw >= 1 else 1
    for factor in (0.125, 0.25, 0.5, 1):
        if magnitude * factor >= raw:
            return magnitude * factor
    return magnitude


def _planned_time_axis(report: Dict) -> Dict:
    """The report with each rank's timeline on the card's planned seconds (time_model's memory
    points: allocated bytes at each launch's end), for the chart's time axis."""
    ranks = {}
    for rank, entry in report["ranks"].items():
        points = (entry.get("time") or {}).get("memory") or []
        ranks[rank] = {**entry, "timeline": [(t, t, a, a) for t, a in points]}
    return {**report, "ranks": ranks}


def svg(report: Dict, planned_time: bool = False) -> str:
    """The chart of `report` (the planner's JSON report) as an SVG document: memory over the
    card's allocation events, or (planned_time) over the planned seconds on the card."""
    if planned_time:
        report = _planned_time_axis(report)
    ranks = report["ranks"]
    capacity = report["capacity"]
    top_value = max([r["peak_reserved"] for r in ranks.values()] + [1])
    capacity_on_chart = capacity <= top_value * 1.5
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    legend_h = 16 * len(ranks) + 12
    # Head-room so that the highest curve stays below the legend.
    y_max = max((capacity if capacity_on_chart else top_value) * 1.08, top_value / (1 - legend_h / plot_h))
    # x: the card's allocation events, not seconds: a step's pattern stays visible next to a slow
    # start-up, and a plan draws the same picture as the real run.
    t_max = max([p[0] for r in ranks.values() for p in r["timeline"]] + [1e-9 if planned_time else 1])

    def x(t):
        return LEFT + plot_w * t / t_max

    def y(v):
        return TOP + plot_h * (1 - v / y_max)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
             f'<text x="{LEFT}" y="20" font-size="14" font-weight="bold">Memory per rank, {report["world_size"]} '
             f'cards ({html.escape(report["script"])})</text>']
    step = _nice_step(y_max)
    value = 0.0
    while value <= y_max:
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(value):.1f}" y2="{y(value):.1f}" stroke="#eee"/>'
                     f'<text x="{LEFT - 6}" y="{y(value) + 4:.1f}" text-anchor="end">{_size(value)}</text>')
        value += step
    parts.append(f'<line x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + plot_h}" stroke="black"/>'
                 f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{TOP + plot_h}" y2="{TOP + plot_h}" stroke="black"/>'
                 f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 12}" text-anchor="middle">'
                 + (f'planned time on the card, 0 to {t_max * 1e3:,.1f} ms (allocated bytes only)' if planned_time
                    else f'allocations and frees on the card, 0 to {t_max:,}') + '</text>')
    if capacity_on_chart:
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(capacity):.1f}" y2="{y(capacity):.1f}" '
                     f'stroke="black" stroke-dasharray="6,4"/><text x="{WIDTH - RIGHT}" y="{y(capacity) - 4:.1f}" '
                     f'text-anchor="end">capacity {_size(capacity)}</text>')
    else:
        parts.append(f'<text x="{WIDTH - RIGHT}" y="{TOP - 6}" text-anchor="end">capacity {_size(capacity)}: '
                     f'{capacity / top_value:.0f}x the highest rank, above the chart</text>')
    for i, (rank, entry) in enumerate(sorted(ranks.items(), key=lambda item: int(item[0]))):
        colour = COLOURS[i % len(COLOURS)]
        line = " ".join(f"{x(t):.1f},{y(a):.1f}" for t, _, a, _ in entry["timeline"])
        reserved = " ".join(f"{x(t):.1f},{y(r):.1f}" for t, _, _, r in entry["timeline"])
        parts.append(f'<polyline points="{reserved}" fill="none" stroke="{colour}" stroke-opacity="0.35"/>'
                     f'<polyline points="{line}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
        label = (f'rank {rank}: peak {_size(entry["peak_allocated"])} allocated ({entry["peak_phase"]}), '
                 f'{_size(entry["peak_reserved"])} reserved{", OUT OF MEMORY" if entry["oom"] else ""}'
                 f'{", " + FAILED if entry.get("failure") else ""}')
        parts.append(f'<line x1="{LEFT + 10}" x2="{LEFT + 30}" y1="{TOP + 14 + 16 * i}" y2="{TOP + 14 + 16 * i}" '
                     f'stroke="{colour}" stroke-width="2"/><text x="{LEFT + 36}" y="{TOP + 18 + 16 * i}">'
                     f'{html.escape(label)}</text>')
    parts.append(f'<text x="{WIDTH - RIGHT}" y="{HEIGHT - 12}" text-anchor="end" fill="#777">'
                 f'dark: allocated, light: reserved</text></svg>')
    return "\n".join(parts)


def _step_time(time) -> str:
    """A rank's planned step time on its card and MFU (docs/time_on_the_card.md), or a dash."""
    if not time or time.get("step_seconds") is None:
        return "-"
    return f"{time['step_seconds'] * 1e3:.1f} ms on {html.escape(time['card'])} ({time['mfu']:.0%})"


def write(report: Dict, path: str) -> None:
    """Writes the chart to `path` (.svg, or .html with the chart and a table)."""
    chart = svg(report)
    if path.endswith(".svg"):
        content = chart
    else:
        rows = "".join(
            f"<tr><td>{rank}</td><td>{_size(r['peak_allocated'])}</td><td>{_size(r['peak_reserved'])}</td>"
            f"<td>{html.escape(r['peak_phase'])}</td><td>{'yes' if r['oom'] else 'no'}</td>"
            f"<td>{sum(c['count'] for c in r['collectives'])}</td><td>{_step_time(r.get('time'))}</td>"
            f"<td>{FAILED if r.get('failure') else 'to the end'}</td></tr>"
            for rank, r in sorted(report["ranks"].items(), key=lambda item: int(item[0])))
        timed = any((r.get("time") or {}).get("memory") for r in report["ranks"].values())
        chart += svg(report, planned_time=True) if timed else ""
        content = (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>supa_emu plan</title></head><body>"
                   f"{chart}<table border='1' cellpadding='4'><tr><th>rank</th><th>peak allocated</th>"
                   f"<th>peak reserved</th><th>phase of the peak</th><th>out of memory</th>"
                   f"<th>collective calls</th><th>planned step (MFU)</th><th>ran</th></tr>{rows}</table></body></html>")
    with open(path, "w") as out:
        out.write(content)
