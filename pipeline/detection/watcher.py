"""The watcher: turns checkpoints that appear under the roots into ``detected`` jobs.

watchdog reports file events so a run is rescanned at once; a periodic scan catches what
events miss (network filesystems, a watcher started late). At start, the disk is
reconciled with the database: new checkpoints are detected, and checkpoints whose local
copy vanished are marked so.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sqlalchemy import select
from watchdog.events import (
    DirCreatedEvent,
    DirDeletedEvent,
    DirModifiedEvent,
    DirMovedEvent,
    FileClosedEvent,
    FileCreatedEvent,
    FileDeletedEvent,
    FileModifiedEvent,
    FileMovedEvent,
    FileSystemEvent,
    FileSystemEventHandler,
)
from watchdog.observers import Observer

from pipeline import failpoints
from pipeline.core.layouts import Entry, Verdict, judge, resave_in_progress
from pipeline.db import hosts
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint
from pipeline.db.transitions import now
from pipeline.detection import catalog, completeness, ondisk, parts, problems, roots
from pipeline.errors import SourceChanged, UnreadableEntry
from pipeline.service.readiness import mark_ready
from pipeline.settings import RootOptions, Settings
from pipeline.steps import Send
from pipeline.store import trash
from pipeline.store.early import EarlySends

log = logging.getLogger("ckpt.watcher")
#: How often a watcher reports its host in (pipeline.status judges a host silent after several).
HOST_REPORT_SECONDS = 10.0


def shown(path: str) -> str:
    """``path`` as it can be recorded and printed (a name that is not UTF-8 gets U+FFFD)."""
    return path.encode("utf-8", "surrogateescape").decode("utf-8", "replace")

#: Events that can change what a run holds. Not opens and closes without a write: the
#: watcher opens every checkpoint it looks at, and its own reads woke it up again at once,
#: in a loop that kept one core busy for as long as a checkpoint was in a run.
CHANGES = [FileCreatedEvent, FileDeletedEvent, FileModifiedEvent, FileMovedEvent, FileClosedEvent,
           DirCreatedEvent, DirDeletedEvent, DirModifiedEvent, DirMovedEvent]


class _Events(FileSystemEventHandler):
    def __init__(self, watcher: Watcher, run: Path) -> None:
        self.watcher, self.run = watcher, run

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.watcher.poke(self.run)  # only CHANGES arrive: the observer filters (event_filter)


class _NewRuns(FileSystemEventHandler):
    """A directory appeared where a root's glob finds runs: a new run, looked at now (not at
    the next full scan), so its first checkpoint is detected as fast as the others."""

    def __init__(self, watcher: Watcher) -> None:
        self.watcher = watcher

    def on_any_event(self, event: FileSystemEvent) -> None:
        self.watcher.new_runs = True
        self.watcher.wake.set()


class Watcher:
    def __init__(self, settings: Settings, send: Callable[[list[Send]], None], *, use_events: bool = True) -> None:
        self.settings, self.send, self.use_events = settings, send, use_events
        self._reported_at = float("-inf")
        self.known: dict[str, tuple[tuple[str, int, int], ...]] = {}  # path -> signature already recorded
        #: paths whose files changed since their recorded version, the new content not recorded
        self.changes = ondisk.DiskChanges(settings.db_url, settings.host_id)
        #: path -> (signature, when announced) of the parts this host announced (pipeline.detection.parts)
        self.parts: dict[str, tuple[tuple[tuple[str, int, int], ...], float]] = {}
        #: path -> (newest change seen, when it was first seen): writers at work, and stalled ones
        self.waiting: dict[str, tuple[int, float]] = {}
        self.reported: dict[str, str] = {}      # path -> last problem reported
        self.refused: set[str] = set()          # runs refused: a glob reaches them only through a link out
        self.dirty: set[Path] = set()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.observer = Observer() if use_events else None
        self.watched: set[Path] = set()
        self.new_runs = False

    # -- events ------------------------------------------------------------------------

    def poke(self, run: Path) -> None:
        self.dirty.add(run)
        self.wake.set()

    def _watch_new_runs(self, runs: list[Path]) -> None:
        if self.observer is None:
            return
        for parent in roots.run_parents(self.settings.roots):
            if parent not in self.watched:
                self.observer.schedule(_NewRuns(self), str(parent), recursive=False,
                                       event_filter=[DirCreatedEvent, DirMovedEvent])
                self.watched.add(parent)
        for run in runs:
            if run not in self.watched:
                self.observer.schedule(_Events(self, run), str(run), recursive=True, event_filter=CHANGES)
                self.watched.add(run)

    # -- reconciliation ----------------------------------------------------------------

    def reconcile(self) -> None:
        """Startup sweep: remember what is recorded; mark vanished local copies. Problems are
        found again by the first scan (those of entries fixed meanwhile are forgotten)."""
        host = self.settings.host_id
        with session_scope(self.settings.db_url) as s:
            problems.clear_all(s, host)
            self.changes.load(s)
            # Locked (PostgreSQL): a rotation deciding right now commits first, then is seen.
            # Only this host's: another host's checkpoints are on a disk this one cannot see.
            for ckpt in s.scalars(select(Checkpoint).where(Checkpoint.local_present.is_(True), catalog.on_host(host))
                                  .order_by(Checkpoint.current, Checkpoint.id).with_for_update()):
                if not os.path.lexists(ckpt.path) and not trash.put_back(ckpt.path, catalog.file_sig(ckpt)):
                    catalog.mark_vanished(s, ckpt)
                    log.warning("local copy of checkpoint %d vanished: %s", ckpt.id, ckpt.path)
                    continue
                self.known[ckpt.path] = catalog.file_sig(ckpt)
            for part in parts.held(s, host):  # and the parts it holds of other hosts' checkpoints
                if not os.path.lexists(part.path) and not trash.put_back(part.path, parts.file_sig(part)):
                    parts.vanished(s, part)
                    log.warning("this host's part of %s vanished", part.path)
                    continue
                sig = tuple((f["relpath"], f["size"], f["mtime_ns"]) for f in part.files)
                self.parts[part.path] = (sig, part.announced_at.timestamp())

    def report_in(self) -> None:
        """Say this host is alive (at most every few seconds): a checkpoint waiting for its
        host's steps shows whether that host has gone silent."""
        if time.monotonic() - self._reported_at < HOST_REPORT_SECONDS:
            return
        try:
            with session_scope(self.settings.db_url) as s:
                hosts.report_in(s, self.settings.host_id, self.settings.host_label)
            self._reported_at = time.monotonic()
        except Exception as exc:  # the control plane is unreachable: detection goes on, reported later
            log.warning("could not report this host in: %s", exc)

    def scan(self, only: set[Path] | None = None) -> float:
        """Scan runs (all, or ``only``); returns seconds until something needs a new look.

        One entry never stops the others: whatever goes wrong with it is reported (once)
        and the scan goes on with the rest of the run and the other runs.
        """
        self.report_in()
        found, refused = roots.expand(self.settings.roots)
        self._watch_new_runs([run for _root, run, _base in found])
        if only is None:
            self._refused_runs(refused)
        runs_real = frozenset(os.path.realpath(run) for _root, run, _base in found)
        next_look = self.settings.scan_interval
        for root, run, base in found:
            if only is not None and run not in only:
                continue
            options = self.settings.options_for(root)
            present = set()
            paths, links_out = roots.entries_in(run, base, runs_real)
            for out in links_out:  # listed in "not protected" for as long as it leads out
                present.add(shown(out.path))
                self._problem(run, shown(out.path), out.reason)
            for path in paths:
                present.add(shown(str(path)))
                try:
                    wait = self.consider(run, path, options)
                except Exception as exc:  # a bug on one entry must not stop detection of the others
                    log.exception("detection of %s failed", shown(str(path)))
                    self._problem(run, shown(str(path)), f"detection failed: {type(exc).__name__}: {exc}")
                    wait = self.settings.scan_interval
                if wait is not None:
                    next_look = min(next_look, wait)
            self._vanished(run, present)
        return next_look

    def _refused_runs(self, refused: list[roots.Refused]) -> None:
        """Report runs a glob reaches only through a link out of its root; forget those that
        are no longer refused."""
        now_refused = {shown(r.path) for r in refused}
        for r in refused:
            self._problem(Path(r.run), shown(r.path), r.reason)
        gone = self.refused - now_refused
        self.refused = now_refused
        if gone:
            with session_scope(self.settings.db_url) as s:
                for path in gone:
                    self.reported.pop(path, None)
                    problems.clear(s, path, self.settings.host_id)

    def _vanished(self, run: Path, present: set[str]) -> None:
        gone = [p for p in self.known if os.path.dirname(p) == str(run) and p not in present]
        parts_gone = [p for p in self.parts if os.path.dirname(p) == str(run) and p not in present]
        fixed = [p for p in self.reported if os.path.dirname(p) == str(run) and p not in present]
        for path in [p for p in self.waiting if os.path.dirname(p) == str(run) and p not in present]:
            self.waiting.pop(path, None)
        if not gone and not fixed and not parts_gone:
            return
        with session_scope(self.settings.db_url) as s:
            for path in fixed:
                self.reported.pop(path, None)
                problems.clear(s, path, self.settings.host_id)
            for path in parts_gone:
                self.parts.pop(path, None)
                for part in parts.held(s, self.settings.host_id, path=path):
                    if trash.put_back(path, parts.file_sig(part)):  # a part's rotation crashed before it committed
                        log.warning("%s was in the trash of a rotation that did not commit; put back", path)
                        continue
                    parts.vanished(s, part)
                    log.warning("this host's part of %s vanished", path)
            for path in gone:
                self.known.pop(path, None)
                self.changes.forget(path)
                for ckpt in s.scalars(select(Checkpoint).where(Checkpoint.path == path,
                                                               Checkpoint.local_present.is_(True),
                                                               catalog.on_host(self.settings.host_id))
                                      .with_for_update()):
                    if trash.put_back(path, catalog.file_sig(ckpt)):  # a rotation crashed before it committed
                        log.warning("%s was in the trash of a rotation that did not commit; put back", path)
                        continue
                    catalog.mark_vanished(s, ckpt)
                    log.warning("local copy of checkpoint %d vanished: %s", ckpt.id, path)

    def consider(self, run: Path, path: Path, options: RootOptions | None = None) -> float | None:
        """Detect ``path`` if it is complete and settled; seconds to wait if it may be soon."""
        options = options or self.settings.options_for(roots.root_of(run, self.settings.roots))
        key = str(path)
        try:
            # A symlinked entry is here only if it stays inside its root (roots.entries_in).
            found = completeness.examine(path, commit_marker=options.commit_marker, follow_link=path.is_symlink())
        except UnreadableEntry as exc:
            self._problem(run, exc.path, exc.reason)
            return None  # looked at again when it changes (an event) or at the next full scan
        except OSError:
            return self.settings.settle_seconds  # vanished or changed while looking
        entries = found.entries
        sig = catalog.signature(entries)
        recorded = self.known.get(key)
        if recorded is not None and recorded != sig:
            recorded = self._recorded(key)  # `ckpt store` may have recorded a version since
        if recorded == sig:
            self.changes.seen(key, None)  # the files on disk are the recorded version
            return None
        verdict, remote = found.verdict, None
        if verdict.kind == "incomplete" and verdict.layout == "torch-dcp":
            rels = [e.relpath for e in found.entries]
            if parts.is_part(rels):
                return self._part(run, path, found, options)
            if ".metadata" in rels:  # a collective save's .metadata naming other hosts' files
                verdict, remote = self._with_parts(path, found, options, sig)
        if recorded is not None and verdict.kind != "malformed":
            # Saved again over a recorded version: complete only once the writer's last file is new too.
            facts = tuple(e.facts for e in entries if e.facts is not None)
            again = resave_in_progress(Entry(path.name, path.is_dir(), facts, commit_marker=found.commit_marker),
                                       {rel: (size, ns) for rel, size, ns in recorded},
                                       by_quiet=verdict.kind == "quiet")
            if again:
                verdict, remote = Verdict("incomplete", verdict.layout, again), None
        if verdict.kind == "malformed":  # no more writing can fix it: say so now, once
            self._problem(run, key, verdict.reason)
            return None
        age = time.time() - found.newest_ns / 1e9
        if verdict.kind == "incomplete" or (verdict.kind == "quiet" and age < options.quiet_seconds):
            if recorded is not None:  # the path's recorded version is not what is on disk: say so
                self.changes.seen(key, f"{', '.join(ondisk.changed_files(recorded, sig)[:3]) or 'its files'} "
                                       f"changed; the new save is not complete: {verdict.reason}")
            # A writer still at work. One that makes no progress for a whole quiet period is reported.
            first = self.waiting.setdefault(key, (found.newest_ns, time.time()))
            if first[0] != found.newest_ns:
                self.waiting[key] = (found.newest_ns, time.time())
            elif verdict.kind == "incomplete" and time.time() - first[1] >= max(options.quiet_seconds,
                                                                              self.settings.settle_seconds):
                self._problem(run, key, f"incomplete for {time.time() - first[1]:.0f} s: {verdict.reason}")
            if verdict.kind == "quiet":
                return max(0.05, options.quiet_seconds - age)
            return max(self.settings.settle_seconds, 0.05)
        tree_ns = completeness.tree_mtime_ns(path)
        if not completeness.settled(entries, self.settings.settle_seconds, tree_ns=tree_ns):
            newest = max(max(e.mtime_ns for e in entries), tree_ns) / 1e9
            return max(0.05, self.settings.settle_seconds - (time.time() - newest))
        started = now()
        try:
            with EarlySends(self.settings, self.send, options.replication, started) as early:
                detected = catalog.hash_checkpoint(run, path, entries, shard_size=self.settings.shard_size,
                                                   layout=verdict.layout,
                                                   completed_by="structure" if verdict.complete else "quiet",
                                                   on_shard=early.shard)
        except (SourceChanged, OSError):
            return self.settings.settle_seconds
        if remote is not None:
            detected = dataclasses.replace(detected, remote=tuple(remote[0]), parts=tuple(remote[1]))
        if completeness.tree_mtime_ns(path) != tree_ns:  # an entry came or went while hashing
            return self.settings.settle_seconds
        with session_scope(self.settings.db_url) as s:
            ckpt, job, created = catalog.record(s, detected, lease_seconds=self.settings.lease_seconds,
                                                detail="detected by the watcher", host=self.settings.host_id,
                                                started_at=started)
            problems.clear(s, key, self.settings.host_id)
            job_id = job.id
        self.known[key] = sig
        self.changes.forget(key)  # record() cleared the flag
        for rel in found.links:  # recorded without them: say so, once
            self._problem(run, f"{key}/{rel}", "a symlink inside a checkpoint is never followed: its target is not "
                                               "part of the protected checkpoint (replace the link by the file to "
                                               "protect it)")
        self.waiting.pop(key, None)
        self.reported.pop(key, None)
        if created:
            log.info("detected %s as checkpoint %d (%s, job %d)", path, ckpt.id, verdict.layout, job_id)
            failpoints.hit("watch.recorded")  # committed, not yet enqueued
            self.send([Send("shard", (job_id, early.sent))])
        return None

    def _recorded(self, key: str) -> catalog.Signature | None:
        """The signature of the current version at ``key`` on this host, from the database
        (another process, `ckpt store`, may have recorded one since this watcher did); a new
        one resets what this watcher flagged there."""
        with session_scope(self.settings.db_url, readonly=True) as s:
            ckpt = s.scalar(select(Checkpoint).where(Checkpoint.path == key, Checkpoint.current.is_(True),
                                                     Checkpoint.local_present.is_(True),
                                                     catalog.on_host(self.settings.host_id))
                            .order_by(Checkpoint.id.desc()).limit(1))
            sig = catalog.file_sig(ckpt) if ckpt is not None else None
            flagged = ckpt is not None and ckpt.disk_changed_at is not None
        if sig is None:
            return self.known.get(key)
        if sig != self.known.get(key) or not flagged:
            self.changes.forget(key)  # what the database says now, not what this watcher wrote
        self.known[key] = sig
        return sig

    def _with_parts(self, path: Path, found: completeness.Examined, options: RootOptions, sig: catalog.Signature
                    ) -> tuple[Verdict, tuple[list[catalog.PartFile], list[int]] | None]:
        """A DCP step whose ``.metadata`` names files this host does not hold: complete with the
        parts other hosts announced at the same path, if together they hold them all (never
        with a part of the version this save replaces: parts.for_new_save)."""
        with session_scope(self.settings.db_url) as s:
            offered = parts.for_new_save(s, parts.offered(s, str(path), self.settings.host_id), sig)
            facts, files, used = parts.covering(offered, (e.relpath for e in found.entries))
        if not files:
            v = found.verdict
            return Verdict(v.kind, v.layout, v.reason + " (on this host; no other host announced it: a multi-host"
                                                         " step needs a watcher on every rank's host)"), None
        local = tuple(e.facts for e in found.entries if e.facts is not None)
        merged = judge(Entry(path.name, True, local + tuple(facts), commit_marker=options.commit_marker))
        return merged, ((files, used) if merged.complete else None)

    def _part(self, run: Path, path: Path, found: completeness.Examined, options: RootOptions) -> float | None:
        """A DCP rank's files without ``.metadata``: announced as this host's part of the step
        another host records (pipeline.detection.parts), once settled."""
        key, sig = str(path), catalog.signature(found.entries)
        known = self.parts.get(key)
        if known is not None and known[0] == sig:
            with session_scope(self.settings.db_url) as s:
                taken = parts.claimed(s, key, self.settings.host_id) is not None
                if taken and key in self.reported:
                    problems.clear(s, key, self.settings.host_id)
            if taken:
                self.reported.pop(key, None)
                return None
            waited = time.time() - known[1]
            if waited >= max(options.quiet_seconds, self.settings.settle_seconds):
                self._problem(run, key, f"torch DCP rank files without any metadata, announced as this host's part"
                                        f" {waited:.0f} s ago: no host has recorded a step whose .metadata names"
                                        " them (a collective save's coordinator writes .metadata, maybe on"
                                        " another host: is it watched?; a save without collectives writes"
                                        " __<rank>.metadata here, last)")
            return None
        tree_ns = completeness.tree_mtime_ns(path)
        if not completeness.settled(found.entries, self.settings.settle_seconds, tree_ns=tree_ns):
            newest = max(max(e.mtime_ns for e in found.entries), tree_ns) / 1e9
            return max(0.05, self.settings.settle_seconds - (time.time() - newest))
        try:
            detected = catalog.hash_checkpoint(run, path, found.entries, shard_size=self.settings.shard_size,
                                               layout="torch-dcp-part")
        except (SourceChanged, OSError):
            return self.settings.settle_seconds
        with session_scope(self.settings.db_url) as s:
            part = parts.announce(s, detected, self.settings.host_id)
            log.info("announced %s as this host's part %d (%d files)", path, part.id, len(found.entries))
        self.parts[key] = (sig, time.time())
        return None

    def _problem(self, run: Path, path: str, reason: str) -> None:
        """Report once (log, and the row status, the UI and /metrics show) why ``path`` is skipped.

        Logged again only when the problem changes its kind (:func:`problems.kind_of`), not when
        a number in it does ("incomplete for 60 s" then "for 90 s"); the row keeps the latest words.
        """
        before = self.reported.get(path)
        if before == reason:
            return
        self.reported[path] = reason
        if before is None or problems.kind_of(before) != problems.kind_of(reason):
            log.error("not protecting %s: %s", path, reason)
        try:
            with session_scope(self.settings.db_url) as s:
                problems.report(s, path, str(run), reason, self.settings.host_id)
        except Exception:  # the control plane may be away: the log line above stands
            log.exception("could not record the problem of %s", path)


    # -- loop --------------------------------------------------------------------------

    def run(self) -> None:
        self.reconcile()
        if self.observer is not None:
            self.observer.start()
        try:
            wait = self.scan()
            mark_ready(self.settings, "watcher")
            deadline = time.monotonic() + self.settings.scan_interval
            while not self.stopping.is_set():
                self.wake.wait(timeout=max(0.01, wait))
                self.wake.clear()
                if self.stopping.is_set():
                    break
                if time.monotonic() >= deadline:
                    wait = self.scan()
                    deadline = time.monotonic() + self.settings.scan_interval
                else:
                    dirty, self.dirty = self.dirty, set()
                    full, self.new_runs = self.new_runs, False
                    wait = self.scan(only=dirty) if dirty and not full else self.scan()
        finally:
            if self.observer is not None:
                self.observer.stop()
                self.observer.join(timeout=5)

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
