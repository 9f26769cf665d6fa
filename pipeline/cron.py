"""When a cron schedule (the nightly scrub, the scheduled collection) last fired."""
from __future__ import annotations

from datetime import datetime, timedelta, tzinfo

from apscheduler.triggers.cron import CronTrigger


def last_fire(cron: str, now: datetime, timezone: tzinfo | None = None) -> datetime | None:
    """The latest time at or before ``now`` when ``cron`` fires (APScheduler's CronTrigger).

    Looks back two days at most: a machine off for a week catches up once, not seven times.
    """
    trigger = CronTrigger.from_crontab(cron, timezone=timezone)
    t = trigger.get_next_fire_time(None, now - timedelta(days=2))
    last = None
    while t is not None and t <= now:
        last = t
        t = trigger.get_next_fire_time(t, t + timedelta(seconds=1))
    return last
