"""Server-rendered SVG charts (no scripts or assets from the internet). Pure functions.

Each chart has one unit on its y axis and time on its x axis (UTC), with labelled ticks.
"""
from __future__ import annotations

import math
from datetime import datetime, timedelta
from html import escape
from typing import Any

W, H = 720, 230
LEFT, RIGHT, TOP, BOTTOM = 64, 16, 30, 40
#: The shortest time a chart spans (a few transfers a second apart still get readable ticks).
MIN_SPAN = timedelta(minutes=2)


def _empty(text: str, label: str) -> str:
    return (f'<svg class="chart" viewBox="0 0 {W} 60" role="img" aria-label="{escape(label)}">'
            f'<text x="10" y="35">{escape(text)}</text></svg>')


def _nice(top: float) -> float:
    """A round number at or above ``top`` for the y axis (1, 2 or 5 times a power of ten)."""
    if top <= 0:
        return 1.0
    exp = 10.0 ** math.floor(math.log10(top))
    return next(m * exp for m in (1, 2, 5, 10) if m * exp >= top * (1 - 1e-9))


class _Frame:
    """Axes of one chart: time from ``t0`` to ``t1`` across, 0 to ``top`` ``unit`` up."""

    def __init__(self, t0: datetime, t1: datetime, top: float, unit: str, label: str) -> None:
        if t1 - t0 < MIN_SPAN:
            pad = (MIN_SPAN - (t1 - t0)) / 2
            t0, t1 = t0 - pad, t1 + pad
        self.t0, self.t1, self.top, self.unit = t0, t1, _nice(top), unit
        self.parts = [f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="{escape(label)}">']
        self._axes()

    def x(self, t: datetime) -> float:
        span = (self.t1 - self.t0).total_seconds()
        return LEFT + (W - LEFT - RIGHT) * (t - self.t0).total_seconds() / span

    def y(self, v: float) -> float:
        return H - BOTTOM - (H - TOP - BOTTOM) * min(v, self.top) / self.top

    def _axes(self) -> None:
        p = self.parts
        for i in range(5):  # y: 0, 1/4 ... top, in the unit
            v = self.top * i / 4
            y = self.y(v)
            p.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}" class="grid"/>')
            p.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" class="label" text-anchor="end">{_num(v)}</text>')
        p.append(f'<text x="{LEFT - 6}" y="14" class="label unit" text-anchor="end">{escape(self.unit)}</text>')
        p.append(f'<line x1="{LEFT}" y1="{H - BOTTOM}" x2="{W - RIGHT}" y2="{H - BOTTOM}" class="axis"/>')
        span = (self.t1 - self.t0).total_seconds()
        fmt = "%H:%M:%S" if span < 600 else "%H:%M" if span < 86400 else "%m-%d %H:%M"
        for i in range(5):  # x: five times across, UTC
            t = self.t0 + timedelta(seconds=span * i / 4)
            x = self.x(t)
            anchor = "start" if i == 0 else "end" if i == 4 else "middle"
            p.append(f'<line x1="{x:.1f}" y1="{H - BOTTOM}" x2="{x:.1f}" y2="{H - BOTTOM + 4}" class="axis"/>')
            p.append(f'<text x="{x:.1f}" y="{H - BOTTOM + 17}" class="label" text-anchor="{anchor}">'
                     f'{escape(t.strftime(fmt))}</text>')
        p.append(f'<text x="{W - RIGHT}" y="{H - 4}" class="label" text-anchor="end">time (UTC)</text>')

    def done(self) -> str:
        return "".join(self.parts) + "</svg>"


def _num(v: float) -> str:
    return f"{v:,.0f}" if v >= 10 or v == 0 else f"{v:,.2g}"


def throughput_chart(transfers: list[dict[str, Any]]) -> str:
    """Bars at the time each recent store (blue) and restore (green) finished: its throughput."""
    if not transfers:
        return _empty("No store or restore has finished yet.", "no transfers yet")
    f = _Frame(transfers[0]["at"], transfers[-1]["at"], max(t["mb_per_s"] for t in transfers), "MB/s",
               f"throughput of the last {len(transfers)} stores and restores")
    width = max(3.0, min(14.0, (W - LEFT - RIGHT) / len(transfers) * 0.6))
    for t in transfers:
        x, y = f.x(t["at"]), f.y(t["mb_per_s"])
        cls = "bar-store" if t["kind"] == "store" else "bar-restore"
        title = (f'{t["kind"]} job {t["job_id"]}: {t["bytes"] / 1e6:,.1f} MB in {t["seconds"]:,.2f} s '
                 f'= {t["mb_per_s"]:,.1f} MB/s')
        f.parts.append(f'<rect class="{cls}" x="{x - width / 2:.1f}" y="{y:.1f}" width="{width:.1f}" '
                       f'height="{max(H - BOTTOM - y, 1):.1f}"><title>{escape(title)}</title></rect>')
    return f.done()


def protection_chart(transfers: list[dict[str, Any]]) -> str:
    """Dots at the time each recent store was verified: seconds from the checkpoint written to verified."""
    stores = [t for t in transfers if t["time_to_protection_s"] is not None]
    if not stores:
        return _empty("No store has been verified yet.", "no stores yet")
    f = _Frame(stores[0]["at"], stores[-1]["at"], max(t["time_to_protection_s"] for t in stores), "seconds",
               f"time from written to verified of the last {len(stores)} stores")
    for t in stores:
        title = f'store job {t["job_id"]}: written to verified in {t["time_to_protection_s"]:,.1f} s'
        f.parts.append(f'<circle class="ttp" cx="{f.x(t["at"]):.1f}" cy="{f.y(t["time_to_protection_s"]):.1f}" '
                       f'r="4"><title>{escape(title)}</title></circle>')
    return f.done()


def capacity_chart(history: list[dict[str, Any]], limit: int | None = None) -> str:
    """Lines over time: bytes the storage workers hold (blue) and the control plane's stored
    copies (green). The axis is scaled to the data, in the unit that suits them (1.3 GB used of a
    700 GB watermark is a curve, not a flat line at the bottom); the high watermark is a dashed
    line when it falls on that scale, else said in words at the top."""
    if len(history) < 2:
        return _empty("The usage history starts with the scheduler (a sample every 10 minutes).",
                      "no usage history yet")
    top = max(max(h["used"], h["stored"]) for h in history)
    near = bool(limit) and (limit or 0) <= 1.5 * top  # the watermark shown on the data's scale
    unit, size = _byte_unit(max(top, limit or 0) if near else top)
    f = _Frame(history[0]["at"], history[-1]["at"], max(top, (limit or 0) if near else 0) / size, unit,
               "cluster usage over time")
    for key, cls in (("used", "line-used"), ("stored", "line-stored")):
        points = " ".join(f'{f.x(h["at"]):.1f},{f.y(h[key] / size):.1f}' for h in history)
        f.parts.append(f'<polyline class="{cls}" fill="none" points="{points}"><title>{key}</title></polyline>')
    if limit and near:
        y = f.y(limit / size)
        f.parts.append(f'<line class="watermark" x1="{LEFT}" y1="{y:.1f}" x2="{W - RIGHT}" y2="{y:.1f}">'
                       f'<title>high watermark: {limit / 1e9:,.1f} GB</title></line>')
    elif limit:
        f.parts.append(f'<text x="{W - RIGHT}" y="14" class="label" text-anchor="end">high watermark at '
                       f'{limit / 1e9:,.1f} GB, far above this scale</text>')
    return f.done()


def _byte_unit(top: float) -> tuple[str, float]:
    """The unit a chart of bytes up to ``top`` reads best in, and its size."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if top >= size:
            return unit, size
    return "kB", 1e3
