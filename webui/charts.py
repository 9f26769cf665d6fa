"""Server-rendered SVG charts (no scripts or assets from the internet). Pure functions."""
from __future__ import annotations

from html import escape
from typing import Any

W, H, PAD = 720, 220, 40


def transfers_chart(transfers: list[dict[str, Any]]) -> str:
    """Bars: throughput (MB/s) of recent stores (blue) and restores (green); dots: time to
    protection of each store (seconds, right axis)."""
    if not transfers:
        return ('<svg class="chart" viewBox="0 0 720 60" role="img" aria-label="no transfers yet">'
                '<text x="10" y="35">No store or restore has finished yet.</text></svg>')
    n = len(transfers)
    top_rate = max(t["mb_per_s"] for t in transfers) or 1.0
    ttps = [t["time_to_protection_s"] for t in transfers if t["time_to_protection_s"] is not None]
    top_ttp = max(ttps) if ttps else 1.0
    top_ttp = top_ttp or 1.0
    slot = (W - 2 * PAD) / n
    parts = [f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" '
             f'aria-label="throughput and time to protection of the last {n} transfers">',
             f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" class="axis"/>',
             f'<text x="4" y="14" class="label">{top_rate:,.0f} MB/s</text>',
             f'<text x="{W - PAD - 60}" y="14" class="label">{top_ttp:,.1f} s</text>']
    for i, t in enumerate(transfers):
        h = (H - 2 * PAD) * t["mb_per_s"] / top_rate
        x = PAD + i * slot + slot * 0.15
        cls = "bar-store" if t["kind"] == "store" else "bar-restore"
        title = (f'{t["kind"]} job {t["job_id"]}: {t["bytes"] / 1e6:,.1f} MB in {t["seconds"]:,.2f} s '
                 f'= {t["mb_per_s"]:,.1f} MB/s')
        if t["time_to_protection_s"] is not None:
            title += f'; written to verified in {t["time_to_protection_s"]:,.1f} s'
        parts.append(f'<rect class="{cls}" x="{x:.1f}" y="{H - PAD - h:.1f}" width="{slot * 0.7:.1f}" '
                     f'height="{max(h, 1):.1f}"><title>{escape(title)}</title></rect>')
        if t["time_to_protection_s"] is not None:
            y = H - PAD - (H - 2 * PAD) * t["time_to_protection_s"] / top_ttp
            parts.append(f'<circle class="ttp" cx="{x + slot * 0.35:.1f}" cy="{y:.1f}" r="4">'
                         f'<title>{escape(title)}</title></circle>')
    parts.append(f'<text x="{PAD}" y="{H - 10}" class="label">oldest</text>'
                 f'<text x="{W - PAD - 40}" y="{H - 10}" class="label">newest</text></svg>')
    return "".join(parts)


def capacity_chart(history: list[dict[str, Any]], limit: int | None = None) -> str:
    """Lines over time: bytes the storage workers hold (blue) and the control plane's stored
    copies (green); a dashed line at the high watermark when it is known."""
    if len(history) < 2:
        return ('<svg class="chart" viewBox="0 0 720 60" role="img" aria-label="no usage history yet">'
                '<text x="10" y="35">The usage history starts with the scheduler (a sample every 10 minutes).'
                '</text></svg>')
    t0, t1 = history[0]["at"], history[-1]["at"]
    span = max(1.0, (t1 - t0).total_seconds())
    top = max(max(h["used"], h["stored"]) for h in history)
    top = max(top, limit or 0) or 1

    def xy(h: dict[str, Any], key: str) -> str:
        x = PAD + (W - 2 * PAD) * (h["at"] - t0).total_seconds() / span
        y = H - PAD - (H - 2 * PAD) * h[key] / top
        return f"{x:.1f},{y:.1f}"

    parts = [f'<svg class="chart" viewBox="0 0 {W} {H}" role="img" aria-label="cluster usage over time">',
             f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" class="axis"/>',
             f'<text x="4" y="14" class="label">{top / 1e9:,.1f} GB</text>']
    for key, cls in (("used", "line-used"), ("stored", "line-stored")):
        points = " ".join(xy(h, key) for h in history)
        parts.append(f'<polyline class="{cls}" fill="none" points="{points}"><title>{key}</title></polyline>')
    if limit:
        y = H - PAD - (H - 2 * PAD) * limit / top
        parts.append(f'<line class="watermark" x1="{PAD}" y1="{y:.1f}" x2="{W - PAD}" y2="{y:.1f}">'
                     f'<title>high watermark: {limit / 1e9:,.1f} GB</title></line>')
    parts.append(f'<text x="{PAD}" y="{H - 10}" class="label">{escape(t0.strftime("%Y-%m-%d %H:%M"))}</text>'
                 f'<text x="{W - PAD - 110}" y="{H - 10}" class="label">{escape(t1.strftime("%Y-%m-%d %H:%M"))}'
                 '</text></svg>')
    return "".join(parts)
