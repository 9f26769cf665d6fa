"""Sortable list columns: ``?sort=<column>&dir=asc|desc`` in the URL, sorted by the server.

The lists are paginated, so the server sorts (a page sorted in the browser would be the
wrong rows in the right order). A header is a link: clicking it (or Enter on it) sorts by
that column, again reverses; the sort stays in the URL and in every pager link. Ties, and an
unsorted list, keep each list's own order (newest first).
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from flask import request, url_for

from pipeline.db.models import Checkpoint, Job
from webui.data import PAGE

#: Column name in the URL -> what it sorts by (SQL columns for the lists read by pages).
CHECKPOINTS: Mapping[str, Any] = {"name": Checkpoint.name, "run": Checkpoint.run, "step": Checkpoint.step,
                                  "written": Checkpoint.mtime, "size": Checkpoint.total_bytes,
                                  "state": Checkpoint.store_state}
RUN: Mapping[str, Any] = {k: v for k, v in CHECKPOINTS.items() if k != "run"}
JOBS: Mapping[str, Any] = {"id": Job.id, "kind": Job.kind, "state": Job.state, "attempts": Job.attempts,
                           "started": Job.created_at}
#: The workers list is read whole: its keys are the fields of webui.data.workers' rows.
WORKERS: Mapping[str, str] = {"id": "id", "address": "url", "zone": "zone", "source": "source", "state": "state",
                              "last_seen": "last_seen", "shards": "shards", "disk": "used_bytes"}


@dataclass(frozen=True)
class Sort:
    """The sort a list page was asked for (``key`` None: the list's own order)."""

    key: str | None = None
    desc: bool = False

    def order(self, columns: Mapping[str, Any]) -> tuple[Any, ...]:
        """SQL ORDER BY terms, empty rows (a checkpoint without a step) last either way."""
        if self.key is None:
            return ()
        col = columns[self.key]
        return ((col.desc() if self.desc else col.asc()).nulls_last(),)

    def rows(self, rows: list[dict[str, Any]], columns: Mapping[str, str]) -> list[dict[str, Any]]:
        """``rows`` (a list read whole) sorted, empty values last either way."""
        if self.key is None:
            return rows
        field = columns[self.key]
        present = sorted((r for r in rows if r.get(field) is not None), key=lambda r: r[field], reverse=self.desc)
        return present + [r for r in rows if r.get(field) is None]

    def args(self) -> dict[str, str]:
        """The sort as URL arguments (for pager and filter links), empty when unsorted."""
        return {"sort": self.key, "dir": "desc" if self.desc else "asc"} if self.key else {}

    def url(self, key: str) -> str:
        """This page sorted by ``key``: ascending, or reversed when it is already sorted by it;
        from the first page (a new order's pages are not the old one's)."""
        args: dict[str, Any] = {k: v for k, v in request.args.items() if k not in ("sort", "dir", "page", "before")}
        desc = not self.desc if key == self.key else False
        args.update(request.view_args or {}, sort=key, dir="desc" if desc else "asc")
        return url_for(request.endpoint or "", **args)


def requested(columns: Mapping[str, Any]) -> Sort:
    """The sort in the request's URL; an unknown column is the list's own order."""
    key = request.args.get("sort")
    if key not in columns:
        return Sort()
    return Sort(key, request.args.get("dir") == "desc")


def listing(fetch: Callable[..., list[dict[str, Any]]], columns: Mapping[str, Any]
            ) -> tuple[list[dict[str, Any]], Sort, int, bool]:
    """A page of a list paged by id (``fetch(before=)``), or, sorted, by offset (``?page=``,
    ``fetch(order=, offset=, limit=)``): its rows, the sort, the page number, whether there is more."""
    sort, number = requested(columns), max(0, request.args.get("page", 0, type=int))
    if sort.key:
        rows = fetch(order=sort.order(columns), offset=number * PAGE, limit=PAGE + 1)
        return rows[:PAGE], sort, number, len(rows) > PAGE
    rows = fetch(before=request.args.get("before", type=int))
    return rows, sort, number, len(rows) == PAGE
