"""alerts: kept open through a short clear, one per filesystem, with what they were about

Two columns on `alerts` (pipeline/alerts.py): `cleared_at`, the first evaluation that no longer
found an open alert's condition (it is resolved only once that has lasted `alert_clear_seconds`;
found again meanwhile, it is the same occurrence), and `evidence`, what the condition was about at
its newest evaluation (the workers on a full disk, the lost checkpoints, the under-replicated
contents), so its resolution can say what really became of them.

Existing data: open rows hold as of the last evaluation (`cleared_at` NULL). A `disk_full` alert
was one per storage worker (subject: the worker id); it is now one per filesystem (subject: the
identity the workers report, `worker:<id>` for one that does not say, as pipeline/capacity.py
groups them). Each open `disk_full` row is moved to its worker's filesystem with that worker as its
evidence; where several open rows share a filesystem (`ckpt up`'s three local workers), the oldest
is kept with all their workers, and the others are resolved as merged into it.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-25 21:45:00
"""
from __future__ import annotations

import hashlib

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

alerts = sa.table("alerts", sa.column("id", sa.Integer), sa.column("key", sa.String), sa.column("alert", sa.String),
                  sa.column("subject", sa.Text), sa.column("since", sa.DateTime(timezone=True)),
                  sa.column("last_seen", sa.DateTime(timezone=True)),
                  sa.column("resolved_at", sa.DateTime(timezone=True)), sa.column("resolution", sa.Text),
                  sa.column("evidence", sa.JSON))
workers = sa.table("storage_workers", sa.column("id", sa.String), sa.column("filesystem", sa.String))


def _key(alert: str, subject: str) -> str:
    """pipeline.alerts.key_of, as of this revision."""
    return f"{alert}:{hashlib.sha256(subject.encode()).hexdigest()[:40]}"


def upgrade() -> None:
    with op.batch_alter_table("alerts") as batch:
        batch.add_column(sa.Column("cleared_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("evidence", sa.JSON(), nullable=True))
    conn = op.get_bind()
    fs_of = dict(conn.execute(sa.select(workers.c.id, workers.c.filesystem)).all())
    rows = conn.execute(sa.select(alerts.c.id, alerts.c.subject, alerts.c.since, alerts.c.last_seen)
                        .where(alerts.c.alert == "disk_full", alerts.c.resolved_at.is_(None))
                        .order_by(alerts.c.since, alerts.c.id)).all()
    groups: dict[str, list[tuple[int, str, object]]] = {}
    for rid, worker, _since, last_seen in rows:
        groups.setdefault(fs_of.get(worker) or f"worker:{worker}", []).append((rid, worker, last_seen))
    for fs, members in groups.items():
        (keep, _worker, _seen), *merged = members
        for rid, _w, seen in merged:  # resolved first: one open row per key
            conn.execute(sa.update(alerts).where(alerts.c.id == rid).values(
                resolved_at=seen, resolution=f"merged into alert {keep}: one alert per filesystem"))
        conn.execute(sa.update(alerts).where(alerts.c.id == keep).values(
            subject=fs, key=_key("disk_full", fs), evidence=sorted(w for _r, w, _s in members)))


def downgrade() -> None:
    with op.batch_alter_table("alerts") as batch:
        batch.drop_column("evidence")
        batch.drop_column("cleared_at")
