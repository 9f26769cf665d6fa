"""The watcher: turns checkpoints that appear under the roots into ``detected`` jobs.

watchdog reports file events so a run is rescanned at once; a periodic scan catches what
events miss (network filesystems, a watcher started late). At start, the disk is
reconciled with the database: new checkpoints are detected, and checkpoints whose local
copy vanished are marked so.

The scan only reads headers; a checkpoint found complete is hashed and recorded by a small
pool, each run in its own lane (pipeline.detection.hashpool), so a big checkpoint of one run
never holds up another's. Any error under a run is that run's or that entry's: reported once
and looked at again with backoff (pipeline.detection.faults); the watcher never dies of one.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError

from pipeline import failpoints
from pipeline.core.layouts import Entry, Verdict, judge, nested_run, resave_in_progress
from pipeline.core.savegroups import index_names, is_index, save_group
from pipeline.db import hosts
from pipeline.db.engine import session_scope
from pipeline.db.models import Checkpoint
from pipeline.db.transitions import now
from pipeline.detection import catalog, claims, completeness, faults, ondisk, parts, problems, roots, waits
from pipeline.detection.events import Watches
from pipeline.detection.hashpool import Apply, HashPool, Staged, Work, raising
from pipeline.detection.reports import Reports, shown
from pipeline.errors import RefusedRecord, SourceChanged, UnreadableEntry
from pipeline.service.readiness import mark_ready
from pipeline.settings import RootOptions, Settings
from pipeline.steps import Send
from pipeline.store import trash
from pipeline.store.early import EarlySends

log = logging.getLogger("ckpt.watcher")
#: Said once of a symlink found inside a recorded checkpoint folder.
LINK_INSIDE = ("a symlink inside a checkpoint is never followed: its target is not part of the protected checkpoint"
               " (replace the link by the file to protect it)")
#: How often a watcher reports its host in (pipeline.status judges a host silent after several).
HOST_REPORT_SECONDS = 10.0



@dataclasses.dataclass(frozen=True)
class Hashed:
    """A complete checkpoint hashed on a pool thread, to be recorded with its batch."""

    run: Path
    found: completeness.Examined
    layout: str
    detected: catalog.Detected
    started: datetime
    #: the copies sent while it was hashed (pipeline.store.early)
    sent: list[int]


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
        #: path -> (newest change, reason's kind) as last written to ``detection_waits`` (waits.py)
        self._waits_written: dict[str, tuple[int, str]] = {}
        self.reports = Reports(settings)        # what is not protected, and why: each said once
        self._hashing: HashPool | None = None
        self._scan_error: str | None = None     # the error the last scan failed with, as logged
        self.refused: set[str] = set()          # runs refused: a glob reaches them only through a link out
        self.dirty: set[Path] = set()
        self.wake = threading.Event()
        self.stopping = threading.Event()
        self.watches = Watches(self.poke, self._new_run) if use_events else None
        self.new_runs = False

    # -- events ------------------------------------------------------------------------

    def poke(self, run: Path) -> None:
        self.dirty.add(run)
        self.wake.set()

    def _new_run(self) -> None:
        self.new_runs = True
        self.wake.set()

    @property
    def hashing(self) -> HashPool:
        """The pool hashing what the scan found complete (started at its first use)."""
        if self._hashing is None:
            self._hashing = HashPool(self.settings.hash_threads, done=lambda run: self.poke(Path(run)),
                                     record=self._record_all, batch_bytes=self.settings.shard_size)
        return self._hashing

    def close(self) -> None:
        """Stop the hashing threads (a hash under way is dropped; found again at the next start)."""
        if self._hashing is not None:
            self._hashing.close()
            self._hashing = None

    # -- reconciliation ----------------------------------------------------------------

    def reconcile(self) -> None:
        """Startup sweep: remember what is recorded; mark vanished local copies. Problems are
        found again by the first scan (those of entries fixed meanwhile are forgotten)."""
        host = self.settings.host_id
        with session_scope(self.settings.db_url) as s:
            problems.clear_all(s, host)
            self.changes.load(s)
            # How long each entry has waited goes on across a restart (its files unchanged).
            waited = waits.load(s, host)
            waits.clear(s, host, [p for p in waited if not os.path.lexists(p)])
            self.waiting.update({p: w for p, w in waited.items() if os.path.lexists(p)})
            self._waits_written.update({p: (ns, "") for p, (ns, _since) in self.waiting.items()})
            # Locked (PostgreSQL): a rotation deciding right now commits first, then is seen.
            # Only this host's: another host's checkpoints are on a disk this one cannot see.
            for ckpt in s.scalars(select(Checkpoint).where(Checkpoint.local_present.is_(True), catalog.on_host(host))
                                  .order_by(Checkpoint.current, Checkpoint.id).with_for_update()):
                if faults.gone(ckpt.path) and not trash.put_back(ckpt.path, catalog.file_sig(ckpt)):
                    catalog.mark_vanished(s, ckpt)
                    log.warning("local copy of checkpoint %d vanished: %s", ckpt.id, ckpt.path)
                    continue
                self.known[ckpt.path] = catalog.file_sig(ckpt)
            for part in parts.held(s, host):  # and the parts it holds of other hosts' checkpoints
                if faults.gone(part.path) and not trash.put_back(part.path, parts.file_sig(part)):
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

    def scan(self, only: set[Path] | None = None, *, wait: bool = True) -> float:
        """Scan runs (all, or ``only``); returns seconds until something needs a new look.

        One run or entry never stops the others: whatever goes wrong with it is reported
        (once), looked at again with backoff, and the scan goes on with the rest. Checkpoints
        found complete are hashed by the pool; ``wait``: return once they are recorded (a
        one-shot scan; the service loop does not wait, it applies them as they end).
        """
        self.report_in()
        next_look = min(self.settings.scan_interval, self._apply_finished())
        found, refused = roots.expand(self.settings.roots)
        self._watch([run for _root, run, _base in found])
        if only is None:
            self._refused_runs(refused)
        runs_real = frozenset(os.path.realpath(run) for _root, run, _base in found)
        for root, run, base in found:
            if only is not None and run not in only:
                continue
            left = self.reports.backoff.wait(str(run))
            if left is not None:  # failed a moment ago: looked at again later, the others now
                next_look = min(next_look, left)
                continue
            try:
                next_look = min(next_look, self._scan_run(root, run, base, runs_real))
            except Exception as exc:  # the run's own fault (unreadable, EIO): never the others'
                next_look = min(next_look, self.reports.failed(run, str(run), exc))
            else:
                self.reports.recovered(str(run))
        if wait and self._hashing is not None:
            self._hashing.wait_idle()
            next_look = min(next_look, self._apply_finished())
        return next_look

    def _scan_run(self, root: str, run: Path, base: Path, runs_real: frozenset[str]) -> float:
        """Consider every entry of ``run``; seconds until one needs a new look. Raises when the
        run itself cannot be listed (nothing in it is then taken as vanished)."""
        options = self.settings.options_for(root)
        next_look = self.settings.scan_interval
        present = set()
        paths, links_out = roots.entries_in(run, base, runs_real)
        for out in links_out:  # listed in "not protected" for as long as it leads out
            present.add(shown(out.path))
            self.reports.problem(run, shown(out.path), out.reason)
        for path in paths:
            key = shown(str(path))
            present.add(key)
            if self._hashing is not None and self._hashing.busy(key):
                continue  # being hashed: the pool tells when it is done
            left = self.reports.backoff.wait(str(path))
            if left is not None:
                next_look = min(next_look, left)
                continue
            try:
                wait = self._consider(run, path, options, self.hashing)
            except Exception as exc:  # the entry's own fault: never the others'
                wait = self.reports.failed(run, str(path), exc)
            else:
                self.reports.recovered(str(path))
            if wait is not None:
                next_look = min(next_look, wait)
        self._vanished(run, present)
        return next_look

    def _apply_finished(self) -> float:
        """Apply what the pool finished hashing (on this thread: the watcher's state is its
        own); seconds until one of those entries needs a new look.

        Every entry taken from the pool is applied: a control-plane error of one (raised by
        Reports.failed: it ends the scan) is raised only once the others are, else they would be
        lost (recorded, but unknown to this watcher: hashed again, whole, at the next scan)."""
        next_look = self.settings.scan_interval
        if self._hashing is None:
            return next_look
        control_plane: SQLAlchemyError | None = None
        for run, key, apply in self._hashing.finished():
            try:
                wait = apply()
            except Exception as exc:
                try:
                    wait = self.reports.failed(Path(run), key, exc)
                except SQLAlchemyError as err:  # the entry is hashed again once the control plane is back
                    control_plane = control_plane or err
                    continue
            else:
                self.reports.recovered(key)
            if wait is not None:
                next_look = min(next_look, wait)
        if control_plane is not None:
            raise control_plane
        return next_look

    def _watch(self, runs: list[Path]) -> None:
        """Add the file watches new runs need; report the directories that get no events (a
        watch failed) and forget those reported that do again, or are no longer runs."""
        alive = {str(run) for run in runs}
        failed: dict[str, str] = {}
        if self.watches is not None:
            parents = roots.run_parents(self.settings.roots)
            self.watches.cover(parents, runs)
            alive |= {str(p) for p in parents}
            self.watches.forget(alive)
            failed = self.watches.failed
        self.reports.unwatched(alive, failed)

    def _refused_runs(self, refused: list[roots.Refused]) -> None:
        """Report runs a glob reaches only through a link out of its root; forget those that
        are no longer refused."""
        now_refused = {shown(r.path) for r in refused}
        for r in refused:
            self.reports.problem(Path(r.run), shown(r.path), r.reason)
        gone = self.refused - now_refused
        self.refused = now_refused
        if gone:
            with session_scope(self.settings.db_url) as s:
                for path in gone:
                    self.reports.reported.pop(path, None)
                    problems.clear(s, path, self.settings.host_id)

    def _vanished(self, run: Path, present: set[str]) -> None:
        gone = [p for p in self.known if os.path.dirname(p) == str(run) and p not in present]
        parts_gone = [p for p in self.parts if os.path.dirname(p) == str(run) and p not in present]
        fixed = [p for p in self.reports.reported if os.path.dirname(p) == str(run) and p not in present]
        self._unwait([p for p in self.waiting if os.path.dirname(p) == str(run) and p not in present])
        if not gone and not fixed and not parts_gone:
            return
        with session_scope(self.settings.db_url) as s:
            for path in fixed:
                self.reports.reported.pop(path, None)
                self.reports.faults.pop(path, None)
                self.reports.backoff.succeeded(path)
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
                                      .order_by(Checkpoint.id).with_for_update()):
                    if trash.put_back(path, catalog.file_sig(ckpt)):  # a rotation crashed before it committed
                        log.warning("%s was in the trash of a rotation that did not commit; put back", path)
                        continue
                    catalog.mark_vanished(s, ckpt)
                    log.warning("local copy of checkpoint %d vanished: %s", ckpt.id, path)

    def consider(self, run: Path, path: Path, options: RootOptions | None = None) -> float | None:
        """Detect ``path`` if it is complete and settled (hashed and recorded on the caller's
        thread); seconds to wait if it may be soon. Raises what reading it raised, but for its
        vanishing or changing meanwhile (then: seconds to wait)."""
        return self._consider(run, path, options or self.settings.options_for(roots.root_of(run, self.settings.roots)))

    def _consider(self, run: Path, path: Path, options: RootOptions, pool: HashPool | None = None) -> float | None:
        """:meth:`consider`; the hashing by ``pool`` when given (returns at once; the pool
        tells when it is done)."""
        key = str(path)
        if self._unchanged_file(path, self.known.get(key)):  # the recorded version, from one stat
            self.changes.seen(key, None)
            self._unwait([key])
            return None
        if (nested := self._nested_run(run, path)) is not None:  # said once (Reports), never recorded
            self._unwait([key])
            self.reports.problem(run, key, nested)
            return None
        try:
            # A symlinked entry is here only if it stays inside its root (roots.entries_in).
            found = completeness.examine(path, commit_marker=options.commit_marker, follow_link=path.is_symlink())
        except UnreadableEntry as exc:
            self.reports.problem(run, exc.path, exc.reason)
            return None  # looked at again when it changes (an event) or at the next full scan
        except OSError as exc:
            if faults.changed_while_read(exc):
                return self.settings.settle_seconds  # vanished or changed while looking
            raise  # cannot be read: the entry's fault (Watcher._failed)
        entries = found.entries
        sig = catalog.signature(entries)
        recorded = self.known.get(key)
        if recorded is not None and recorded != sig:
            recorded = self._recorded(key)  # `ckpt store` may have recorded a version since
        if recorded == sig:
            self.changes.seen(key, None)  # the files on disk are the recorded version
            self._unwait([key])
            return None
        verdict, remote = found.verdict, None
        if verdict.kind == "incomplete" and verdict.layout == "torch-dcp":
            rels = [e.relpath for e in found.entries]
            if parts.is_part(rels):
                return self._part(run, path, found, options, pool)
            if ".metadata" in rels:  # a collective save's .metadata naming other hosts' files
                verdict, remote = self._with_parts(path, found, options, sig)
        if recorded is not None and verdict.kind != "malformed":
            # Saved again over a recorded version: complete only once the writer's last file is new too.
            facts = tuple(e.facts for e in entries if e.facts is not None)
            again = resave_in_progress(Entry(path.name, path.is_dir(), facts, commit_marker=found.commit_marker),
                                       {rel: (size, ns) for rel, size, ns in recorded},
                                       by_quiet=verdict.kind == "quiet") or self._index_not_yet(path)
            if again:
                verdict, remote = Verdict("incomplete", verdict.layout, again), None
        if verdict.kind == "malformed":  # no more writing can fix it: say so now, once
            self._unwait([key])
            self.reports.problem(run, key, verdict.reason)
            return None
        age = time.time() - found.newest_ns / 1e9
        if verdict.kind == "incomplete" or (verdict.kind == "quiet" and age < options.quiet_seconds):
            if recorded is not None:  # the path's recorded version is not what is on disk: say so
                self.changes.seen(key, f"{', '.join(ondisk.changed_files(recorded, sig)[:3]) or 'its files'} "
                                       f"changed; the new save is not complete: {verdict.reason}")
            # A writer still at work. One that makes no progress for a whole quiet period is reported.
            first = self.waiting.setdefault(key, (found.newest_ns, time.time()))
            if first[0] != found.newest_ns:
                first = self.waiting[key] = (found.newest_ns, time.time())
            elif verdict.kind == "incomplete" and time.time() - first[1] >= max(options.quiet_seconds,
                                                                              self.settings.settle_seconds):
                self.reports.problem(run, key, f"incomplete for {time.time() - first[1]:.0f} s: {verdict.reason}")
            self._wait(run, key, first, verdict,
                       found.newest_ns / 1e9 + options.quiet_seconds if verdict.kind == "quiet" else None)
            if verdict.kind == "quiet":
                return max(0.05, options.quiet_seconds - age)
            return max(self.settings.settle_seconds, 0.05)
        tree_ns = completeness.tree_mtime_ns(path)
        if not completeness.settled(entries, self.settings.settle_seconds, tree_ns=tree_ns):
            newest = max(max(e.mtime_ns for e in entries), tree_ns) / 1e9
            return max(0.05, self.settings.settle_seconds - (time.time() - newest))
        if (why := self._too_costly(entries)) is not None:
            self.reports.problem(run, key, why)
            return None
        if claims.held(self.settings.home, self.settings.host_id, key):
            return max(self.settings.settle_seconds, 1.0)  # a trainer's recorder hashes it now: look after
        if recorded is None and self._recorded(key) == sig:  # recorded by another process (declared)
            self.changes.seen(key, None)
            self._unwait([key])
            return None
        return self._hash(run, key, functools.partial(self._hash_and_record, run, path, found, verdict, remote,
                                                      options, tree_ns), pool, completeness.total_size(entries))

    @staticmethod
    def _unchanged_file(path: Path, recorded: catalog.Signature | None) -> bool:
        """Whether ``path`` is a plain file (not a link) whose size and modification time are
        the recorded version's: what examining it would compare, known without opening it.
        Every scan looks at every entry of a run; a run of a thousand saves is then a thousand
        stats, not a thousand header reads."""
        if recorded is None or len(recorded) != 1 or recorded[0][0] != "":
            return False
        try:
            st = os.lstat(path)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and (st.st_size, st.st_mtime_ns) == recorded[0][1:]

    def _index_not_yet(self, path: Path) -> str | None:
        """Why ``path``, a file of a save written side by side into its run (``save_pretrained(run,
        max_shard_size=...)``: pipeline.core.savegroups.save_group) that changed over its recorded
        version, is a new save still being written: its index, which the writer writes last, is
        still the recorded one. Each file is a checkpoint of its own, so without this a save
        killed after its first shard would replace that shard of the newest complete save."""
        group = save_group(path.name)
        if not group or is_index(path.name) or path.is_dir():
            return None
        index = next((i for i in (path.with_name(n) for n in index_names(group)) if os.path.lexists(i)), None)
        if index is None or not self._unchanged_file(index, self.known.get(str(index))):
            return None
        return (f"saved again over its recorded version but not yet {index.name}, which its writer "
                "(save_pretrained) writes last")

    @staticmethod
    def _nested_run(run: Path, path: Path) -> str | None:
        """Why the entry ``path`` is a run one level down (pipeline.core.layouts.nested_run)."""
        try:
            subdirs = [e.name for e in os.scandir(path) if e.is_dir(follow_symlinks=False)]
        except (NotADirectoryError, FileNotFoundError):
            return None
        return nested_run(path.name, subdirs, str(run))

    def _too_costly(self, entries: tuple[completeness.FileEntry, ...]) -> str | None:
        return completeness.too_costly(entries, max_bytes=self.settings.max_hash_bytes,
                                       sparse_ratio=self.settings.sparse_ratio)

    def _hash(self, run: Path, key: str, work: Work, pool: HashPool | None, size: int) -> float | None:
        """Do ``work`` (hashing ``size`` bytes) here (no pool) or hand it to ``pool``'s lane of ``run``."""
        if pool is None:
            done = work()
            return (self._record_all([done.item])[0] if isinstance(done, Staged) else done)()
        pool.submit(str(run), key, work, size)
        return None

    def _settle(self) -> float:
        return self.settings.settle_seconds

    def _hash_and_record(self, run: Path, path: Path, found: completeness.Examined, verdict: Verdict,
                         remote: tuple[list[catalog.PartFile], list[int]] | None, options: RootOptions,
                         tree_ns: int) -> Apply | Staged:
        """Hash a complete checkpoint, to be recorded with its batch (:meth:`_record_all`). Runs on
        a pool thread: the watcher's own state changes only in the function the record returns,
        which the watcher applies on its thread."""
        started = now()
        try:
            with EarlySends(self.settings, self.send, options.replication, started,
                            rf=self.settings.rf_for(str(run)),
                            total_bytes=completeness.total_size(found.entries)) as early:
                detected = catalog.hash_checkpoint(run, path, found.entries, shard_size=self.settings.shard_size,
                                                   layout=verdict.layout,
                                                   completed_by="structure" if verdict.complete else "quiet",
                                                   on_shard=early.on_shard)
        except (OSError, SourceChanged) as exc:
            if faults.changed_while_read(exc):
                return self._settle
            raise  # cannot be read: the entry's fault
        if remote is not None:
            detected = dataclasses.replace(detected, remote=tuple(remote[0]), parts=tuple(remote[1]))
        if completeness.tree_mtime_ns(path) != tree_ns:  # an entry came or went while hashing
            return self._settle
        return Staged(Hashed(run, found, verdict.layout, detected, started, early.sent))

    def _record_all(self, batch: list[Hashed]) -> list[Apply]:
        """Record hashed checkpoints of one run, in the order found, in one transaction (a run's
        backlog costs one, and one send); each in a savepoint of its own: one that cannot be
        recorded is that entry's fault, reported on the watcher's thread, and never the others'."""
        applies: list[Apply] = []
        created: list[tuple[Hashed, int, int]] = []
        with session_scope(self.settings.db_url) as s:
            for h in batch:
                try:
                    with s.begin_nested():
                        ckpt, job, new = catalog.record(s, h.detected, lease_seconds=self.settings.lease_seconds,
                                                        detail="detected by the watcher", host=self.settings.host_id,
                                                        started_at=h.started)
                        problems.clear(s, str(h.detected.path), self.settings.host_id)
                except SQLAlchemyError as exc:  # this save's own: a control plane away fails the commit too
                    applies.append(raising(RefusedRecord(exc)))
                    continue
                except Exception as exc:
                    applies.append(raising(exc))
                    continue
                if new:
                    created.append((h, job.id, ckpt.id))
                applies.append(functools.partial(self._recorded_one, h))
        for h, job_id, ckpt_id in created:
            log.info("detected %s as checkpoint %d (%s, job %d)", h.detected.path, ckpt_id, h.layout, job_id)
        if created:
            failpoints.hit("watch.recorded")  # committed, not yet enqueued
            self.send([Send("shard", (job_id, h.sent)) for h, job_id, _ckpt_id in created])
        return applies

    def _recorded_one(self, h: Hashed) -> None:
        """What recording ``h`` changes in the watcher's own state (on its thread)."""
        key = str(h.detected.path)
        self.known[key] = catalog.signature(h.found.entries)
        self.changes.forget(key)  # record() cleared the flag
        for rel in h.found.links:  # recorded without them: say so, once
            self.reports.problem(h.run, f"{key}/{rel}", LINK_INSIDE)
        self._unwait([key])
        self.reports.reported.pop(key, None)

    def _wait(self, run: Path, key: str, first: tuple[int, float], verdict: Verdict, ready_at: float | None) -> None:
        """Write the wait of ``key`` (pipeline.detection.waits) when it starts, its files change or
        its reason changes kind: never at every scan."""
        reason = verdict.reason or "complete once nothing in it changed for the root's quiet period"
        written = (first[0], problems.kind_of(reason))
        if self._waits_written.get(key) == written:
            return
        with session_scope(self.settings.db_url) as s:
            waits.record(s, self.settings.host_id, key, str(run), reason, first[0], first[1], ready_at)
        self._waits_written[key] = written

    def _unwait(self, keys: list[str]) -> None:
        """``keys`` wait no longer (recorded, malformed, gone): forget them, and their rows."""
        for key in keys:
            self.waiting.pop(key, None)
        written = [key for key in keys if self._waits_written.pop(key, None) is not None]
        if written:
            with session_scope(self.settings.db_url) as s:
                waits.clear(s, self.settings.host_id, written)

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

    def _part(self, run: Path, path: Path, found: completeness.Examined, options: RootOptions,
              pool: HashPool | None = None) -> float | None:
        """A DCP rank's files without ``.metadata``: announced as this host's part of the step
        another host records (pipeline.detection.parts), once settled."""
        key, sig = str(path), catalog.signature(found.entries)
        known = self.parts.get(key)
        if known is not None and known[0] == sig:
            with session_scope(self.settings.db_url) as s:
                taken = parts.claimed(s, key, self.settings.host_id) is not None
                if taken and key in self.reports.reported:
                    problems.clear(s, key, self.settings.host_id)
            if taken:
                self.reports.reported.pop(key, None)
                return None
            waited = time.time() - known[1]
            if waited >= max(options.quiet_seconds, self.settings.settle_seconds):
                self.reports.problem(run, key, f"torch DCP rank files without any metadata, announced as this host's"
                                               f" part {waited:.0f} s ago: no host has recorded a step whose .metadata"
                                               " names them (a collective save's coordinator writes .metadata, maybe"
                                               " on another host: is it watched?; a save without collectives writes"
                                               " __<rank>.metadata here, last)")
            return None
        tree_ns = completeness.tree_mtime_ns(path)
        if not completeness.settled(found.entries, self.settings.settle_seconds, tree_ns=tree_ns):
            newest = max(max(e.mtime_ns for e in found.entries), tree_ns) / 1e9
            return max(0.05, self.settings.settle_seconds - (time.time() - newest))
        if (why := self._too_costly(found.entries)) is not None:
            self.reports.problem(run, key, why)
            return None
        return self._hash(run, key, functools.partial(self._hash_part, run, path, found), pool,
                          completeness.total_size(found.entries))

    def _hash_part(self, run: Path, path: Path, found: completeness.Examined) -> Apply:
        """Hash a DCP rank's files and announce them (on a pool thread, as :meth:`_hash_and_record`)."""
        key, sig = str(path), catalog.signature(found.entries)
        try:
            detected = catalog.hash_checkpoint(run, path, found.entries, shard_size=self.settings.shard_size,
                                               layout="torch-dcp-part")
        except (OSError, SourceChanged) as exc:
            if faults.changed_while_read(exc):
                return self._settle
            raise  # cannot be read: the entry's fault
        with session_scope(self.settings.db_url) as s:
            part = parts.announce(s, detected, self.settings.host_id)
            log.info("announced %s as this host's part %d (%d files)", path, part.id, len(found.entries))
        announced = time.time()

        def held() -> None:
            self.parts[key] = (sig, announced)
        return held

    # -- loop --------------------------------------------------------------------------

    def run(self) -> None:
        from pipeline.service.warmth import warm_codec

        # Its early sends upload frames while a checkpoint is hashed (pipeline.store.early).
        warm_codec(self.settings)
        self.reconcile()
        if self.watches is not None:
            self.watches.start()
        try:
            # Ready once the first scan looked at every run and handed what it found complete to
            # the pool; never waiting for those hashes (a big checkpoint at start would leave every
            # other run unlooked-at, and `ckpt up` unready, until it ends): they are applied as
            # they end, while the loop scans on.
            wait = self._scan(None)
            mark_ready(self.settings, "watcher")
            deadline = time.monotonic() + self.settings.scan_interval
            while not self.stopping.is_set():
                self.wake.wait(timeout=max(0.01, wait))
                self.wake.clear()
                if self.stopping.is_set():
                    break
                if time.monotonic() >= deadline:
                    wait = self._scan(None)
                    deadline = time.monotonic() + self.settings.scan_interval
                else:
                    dirty, self.dirty = self.dirty, set()
                    full, self.new_runs = self.new_runs, False
                    wait = self._scan(dirty if dirty and not full else None)
        finally:
            if self.watches is not None:
                self.watches.stop()
            self.close()

    def _scan(self, only: set[Path] | None) -> float:
        """A scan of the service loop, which never waits for its hashes and never ends the
        watcher: an error outside any run (the control plane away) is logged once and the scan
        tried again at the next interval."""
        try:
            next_look = self.scan(only, wait=False)
        except Exception as exc:
            what = f"{type(exc).__name__}: {exc}"
            if problems.kind_of(what) != problems.kind_of(self._scan_error or ""):
                log.exception("a scan failed (tried again every %s s until it works)", self.settings.scan_interval)
            self._scan_error = what
            return self.settings.scan_interval
        if self._scan_error is not None:
            log.info("scans work again")
            self._scan_error = None
        return next_look

    def stop(self) -> None:
        self.stopping.set()
        self.wake.set()
