"""run_state_counts: each run's current checkpoints counted by state, kept as data

The overview, ``/metrics``, ``ckpt status`` and the alerts read, per run, how many current
checkpoints are in each state and how many bytes they hold, split by whether their local copy is
there. Grouping the checkpoints for that read every row of every run (100k checkpoints: ~80 ms
each time). This table holds the answer instead: one row per (run, state, local copy present)
with the number of current checkpoints and the sum of their ``total_bytes``.

Triggers on ``checkpoints`` keep it in the same transaction as any change of a checkpoint's
state (``pipeline.db.transitions`` copies a store job's state onto its checkpoint), of
``current`` (a new version supersedes it), of ``local_present`` (rotated, vanished, re-detected),
of its bytes or run, and as rows are inserted or deleted: whichever code path writes, the counts
cannot drift from a recount (tests/unit/test_run_state_counts.py). Rows whose count falls to zero
stay (readers skip them): there are only as many as a run has states.

Existing data: filled from a recount of the checkpoints.

Jobs are counted by kind and state (``/metrics``) along a new index ``(kind, state)``, which
replaces the index on ``kind`` alone (``(kind, checkpoint_id, id)`` and this one serve what it did):
~85 ms to ~8 ms at 100k jobs.

SQLite's batch mode rebuilds a table by copy, drop and rename, which drops its triggers: a later
revision that alters ``checkpoints`` in batch mode must create them again
(``create_triggers``); the recount test fails if it does not.

Revision ID: 0016
Revises: 0014
Create Date: 2026-11-25 22:20:00
"""
from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

#: The columns whose change moves a checkpoint between counts.
WATCHED = "run, current, store_state, local_present, total_bytes"
KEY = "run = {r}.run AND store_state = {r}.store_state AND local_present = {r}.local_present"

SQLITE_TRIGGERS = [
    f"""CREATE TRIGGER run_state_counts_{name} AFTER {event} ON checkpoints
    BEGIN
        {body}
    END"""
    for name, event, body in [
        ("insert", "INSERT", "{add}"),
        ("delete", "DELETE", "{sub}"),
        ("update", f"UPDATE OF {WATCHED}", "{sub}\n        {add}"),
    ]
]
SQLITE_SUB = (f"UPDATE run_state_counts SET checkpoints = checkpoints - 1, bytes = bytes - OLD.total_bytes "
              f"WHERE {KEY.format(r='OLD')} AND OLD.current AND OLD.store_state IS NOT NULL;")
SQLITE_ADD = ("INSERT INTO run_state_counts (run, store_state, local_present, checkpoints, bytes) "
              "SELECT NEW.run, NEW.store_state, NEW.local_present, 1, NEW.total_bytes "
              "WHERE NEW.current AND NEW.store_state IS NOT NULL "
              "ON CONFLICT (run, store_state, local_present) DO UPDATE SET "
              "checkpoints = checkpoints + 1, bytes = bytes + excluded.bytes;")

POSTGRES_FUNCTION = f"""
CREATE FUNCTION run_state_counts_apply() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP <> 'INSERT' THEN
        IF OLD.current AND OLD.store_state IS NOT NULL THEN
            UPDATE run_state_counts SET checkpoints = checkpoints - 1, bytes = bytes - OLD.total_bytes
            WHERE {KEY.format(r='OLD')};
        END IF;
    END IF;
    IF TG_OP <> 'DELETE' THEN
        IF NEW.current AND NEW.store_state IS NOT NULL THEN
            INSERT INTO run_state_counts (run, store_state, local_present, checkpoints, bytes)
            VALUES (NEW.run, NEW.store_state, NEW.local_present, 1, NEW.total_bytes)
            ON CONFLICT (run, store_state, local_present) DO UPDATE SET
                checkpoints = run_state_counts.checkpoints + 1,
                bytes = run_state_counts.bytes + EXCLUDED.bytes;
        END IF;
    END IF;
    RETURN NULL;
END $$"""
POSTGRES_TRIGGER = (f"CREATE TRIGGER run_state_counts_apply AFTER INSERT OR DELETE OR UPDATE OF {WATCHED} "
                    "ON checkpoints FOR EACH ROW EXECUTE FUNCTION run_state_counts_apply()")


def create_triggers() -> None:
    """The triggers that keep ``run_state_counts`` equal to a recount of ``checkpoints``."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute(POSTGRES_FUNCTION)
        op.execute(POSTGRES_TRIGGER)
        return
    for sql in SQLITE_TRIGGERS:
        op.execute(sql.format(add=SQLITE_ADD, sub=SQLITE_SUB))


def drop_triggers() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER IF EXISTS run_state_counts_apply ON checkpoints")
        op.execute("DROP FUNCTION IF EXISTS run_state_counts_apply()")
        return
    for name in ("insert", "delete", "update"):
        op.execute(f"DROP TRIGGER IF EXISTS run_state_counts_{name}")


def upgrade() -> None:
    op.create_table(
        "run_state_counts",
        sa.Column("run", sa.String(length=4096), nullable=False),
        sa.Column("store_state", sa.String(length=16), nullable=False),
        sa.Column("local_present", sa.Boolean(), nullable=False),
        sa.Column("checkpoints", sa.BigInteger(), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("run", "store_state", "local_present", name=op.f("pk_run_state_counts")),
    )
    op.execute("INSERT INTO run_state_counts (run, store_state, local_present, checkpoints, bytes) "
               "SELECT run, store_state, local_present, count(*), coalesce(sum(total_bytes), 0) FROM checkpoints "
               "WHERE current AND store_state IS NOT NULL GROUP BY run, store_state, local_present")
    create_triggers()
    op.create_index("ix_jobs_kind_state", "jobs", ["kind", "state"])
    op.drop_index("ix_jobs_kind", table_name="jobs")


def downgrade() -> None:
    op.create_index("ix_jobs_kind", "jobs", ["kind"])
    op.drop_index("ix_jobs_kind_state", table_name="jobs")
    drop_triggers()
    op.drop_table("run_state_counts")
