"""Inline SVG charts for the dashboard: a line over iterations with points one can
hover, and bars of iteration times with the paused ones marked. Plain strings,
no library and nothing fetched: the page works offline and the browser draws it.

Up to MAX_POINTS points are drawn one by one (each a circle with its value in a
<title> and in data attributes); a longer series is drawn as the means of
consecutive runs of iterations, and the chart says so.
"""
from __future__ import annotations

from html import escape

MAX_POINTS = 2000
WIDTH, HEIGHT = 640, 170
LEFT, RIGHT, TOP, BOTTOM = 52, 10, 10, 22   # room for the axis labels

# Event type -> colour of its mark (the timeline uses the same).
COLOURS = {"preemption": "#d62728", "fenced": "#8c564b", "failover": "#ff7f0e", "reconfigure": "#2ca02c",
           "redo": "#9467bd", "rollback": "#7b4173", "mode": "#17becf", "notice": "#bcbd22", "drain": "#7f7f7f",
           "start": "#1f77b4"}


def thin(points: list[tuple[int, float]], limit: int = MAX_POINTS) -> tuple[list[tuple[float, float]], int]:
    """At most `limit` points: the means of runs of k consecutive ones; (points, k)."""
    k = max(1, -(-len(points) // limit))
    if k == 1:
        return [(float(x), y) for x, y in points], 1
    runs = [points[i:i + k] for i in range(0, len(points), k)]
    return [(sum(x for x, _ in r) / len(r), sum(y for _, y in r) / len(r)) for r in runs], k


class Frame:
    """Maps (iteration, value) to the chart's pixels."""

    def __init__(self, xs: list[float], ys: list[float], zero: bool = False):
        self.x0, self.x1 = min(xs), max(xs)
        self.y0, self.y1 = (0.0 if zero else min(ys)), max(ys)
        if self.x1 == self.x0:
            self.x1 = self.x0 + 1
        if self.y1 == self.y0:
            self.y1 = self.y0 + (abs(self.y0) or 1.0) * 0.1
            self.y0 = self.y0 - (0 if zero else (abs(self.y0) or 1.0) * 0.1)

    def x(self, v: float) -> float:
        return round(LEFT + (v - self.x0) / (self.x1 - self.x0) * (WIDTH - LEFT - RIGHT), 1)

    def y(self, v: float) -> float:
        return round(TOP + (self.y1 - v) / (self.y1 - self.y0) * (HEIGHT - TOP - BOTTOM), 1)

    def axes(self, fmt: str, unit: str) -> str:
        bottom = HEIGHT - BOTTOM
        return (f'<line class="axis" x1="{LEFT}" y1="{TOP}" x2="{LEFT}" y2="{bottom}"/>'
                f'<line class="axis" x1="{LEFT}" y1="{bottom}" x2="{WIDTH - RIGHT}" y2="{bottom}"/>'
                f'<text class="tick" x="{LEFT - 4}" y="{TOP + 8}" text-anchor="end">{self.y1:{fmt}}</text>'
                f'<text class="tick" x="{LEFT - 4}" y="{bottom}" text-anchor="end">{self.y0:{fmt}}</text>'
                f'<text class="tick" x="{LEFT}" y="{HEIGHT - 6}">{self.x0:.0f}</text>'
                f'<text class="tick" x="{WIDTH - RIGHT}" y="{HEIGHT - 6}" text-anchor="end">'
                f'{self.x1:.0f} ({escape(unit)})</text>')


def _marks(frame: Frame, marks: list[tuple[int, str]]) -> str:
    """A vertical line at the iteration of each event (the start of the job left out)."""
    out = []
    for it, kind in marks:
        if kind == "start" or not frame.x0 <= it <= frame.x1:
            continue
        x = frame.x(it)
        out.append(f'<line class="mark mark-{kind}" x1="{x}" x2="{x}" y1="{TOP}" y2="{HEIGHT - BOTTOM}" '
                   f'stroke="{COLOURS.get(kind, "#999")}"><title>{kind} at iteration {it}</title></line>')
    return "".join(out)


def _svg(name: str, label: str, body: str) -> str:
    return (f'<svg class="chart" id="chart-{name}" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
            f'aria-label="{escape(label)}">{body}</svg>')


def empty(name: str, label: str) -> str:
    return _svg(name, label, f'<text class="tick" x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">'
                             f'no {escape(label)} yet</text>')


def line(name: str, label: str, points: list[tuple[int, float]], marks: list[tuple[int, str]] = (),
         extra: list[tuple[int, float]] = (), fmt: str = ".4g", zero: bool = False) -> str:
    """`points` as a line with a circle per point (class `point`, data-it and
    data-v hold the iteration and the exact value); `extra` (validation losses)
    as diamonds of their own class; `marks` as event lines."""
    if not points:
        return empty(name, label)
    drawn, k = thin(points)
    extra_drawn, _ = thin(list(extra))
    frame = Frame([x for x, _ in drawn + extra_drawn], [y for _, y in drawn + extra_drawn], zero)
    path = " ".join(f"{frame.x(x)},{frame.y(y)}" for x, y in drawn)
    body = [frame.axes(fmt, "iteration"), _marks(frame, list(marks)),
            f'<polyline class="series series-{name}" points="{path}" data-count="{len(points)}" '
            f'data-per-point="{k}"/>']
    if k == 1:
        body += [f'<circle class="point point-{name}" cx="{frame.x(x)}" cy="{frame.y(y)}" r="2.2" '
                 f'data-it="{x:.0f}" data-v="{y!r}"><title>iteration {x:.0f}: {label} {y:{fmt}}</title></circle>'
                 for x, y in drawn]
    else:
        body.append(f'<text class="tick" x="{WIDTH - RIGHT}" y="{TOP + 8}" text-anchor="end">'
                    f'each point: the mean of {k} iterations</text>')
    body += [f'<rect class="extra extra-{name}" x="{frame.x(x) - 3}" y="{frame.y(y) - 3}" width="6" height="6" '
             f'data-it="{x:.0f}" data-v="{y!r}"><title>iteration {x:.0f}: {y:{fmt}}</title></rect>'
             for x, y in extra_drawn]
    return _svg(name, label, "".join(body))


def bars(name: str, label: str, points: list[tuple[int, float]], paused: dict[int, float],
         marks: list[tuple[int, str]] = ()) -> str:
    """Iteration times as bars from zero; an iteration that paused (`paused`:
    iteration -> seconds beyond the usual) is drawn in the pause colour."""
    if not points:
        return empty(name, label)
    drawn, k = thin(points)
    frame = Frame([x for x, _ in drawn], [y for _, y in drawn], zero=True)
    step = (WIDTH - LEFT - RIGHT) / max(1, len(drawn))
    body = [frame.axes(".3g", "iteration"), _marks(frame, list(marks))]
    for x, y in drawn:
        pause = paused.get(int(x), 0.0) if k == 1 else 0.0
        cls = "bar paused" if pause > 0.5 * (y - pause) and pause > 0.05 else "bar"
        body.append(f'<rect class="{cls}" x="{frame.x(x) - step / 2:.1f}" y="{frame.y(y)}" '
                    f'width="{max(1.0, step - 1):.1f}" height="{max(0.5, frame.y(frame.y0) - frame.y(y)):.1f}" '
                    f'data-it="{x:.0f}" data-v="{y!r}">'
                    f'<title>iteration {x:.0f}: {y:.3f} s' + (f", a pause of {pause:.3f} s" if pause else "")
                    + '</title></rect>')
    return _svg(name, label, "".join(body))
