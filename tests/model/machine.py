"""The lifecycle as a hypothesis state machine: each rule is one thing a trainer, a user, the
system or a fault does (tests.model.world.World), and the invariants of issue 27 are checked
after every rule. Indices pick among what exists (modulo its length), so shrinking moves toward
the first save, the first message (delivery in order) and the first copy."""
from __future__ import annotations

from pathlib import Path
from typing import ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.model.world import RUNS, Save, World, WorldStats
from tests.model.writers import KINDS
from tests.processes import StorageWorker as WorkerProcess

runs = st.sampled_from(RUNS)
index = st.integers(min_value=0, max_value=63)
#: Where a restore writes: a new directory, one that exists, the checkpoint's own path, its run,
#: and a path through a symlink that leaves the restore roots.
RESTORE_TARGETS = ("fresh", "existing", "in_place", "run", "through_link")


class Lifecycle(RuleBasedStateMachine):
    #: Set by the test before it runs the machine.
    workers: ClassVar[list[WorkerProcess]] = []
    base: ClassVar[Path] = Path("/nonexistent")
    totals: ClassVar[WorldStats] = WorldStats()
    examples: ClassVar[int] = 0

    def __init__(self) -> None:
        super().__init__()
        type(self).examples += 1
        self.world = World(self.base / f"ex{self.examples}", self.workers)

    def teardown(self) -> None:
        try:
            if not self.world.violations:  # a history that failed already is reported as it is
                self.world.finish()
        finally:
            self._count_and_close()

    def _count_and_close(self) -> None:
        w, t = self.world.stats, type(self).totals
        t.steps += w.steps
        t.messages += w.messages
        t.restores += w.restores
        t.removed_by_system += w.removed_by_system
        t.longest = max(t.longest, w.steps)
        self.world.close()

    # -- picking ---------------------------------------------------------------------

    def _writing(self) -> list[Save]:
        return [s for s in self.world.saves if s.complete_at is None and not s.killed]

    def _complete(self) -> list[Save]:
        return [s for s in self.world.saves if s.version is not None and not s.destroyed]

    def _old(self) -> list[Save]:
        """Complete saves the trainer may delete: not the newest of their run."""
        out = []
        for s in self._complete():
            newer = [o for o in self._complete() if o.run == s.run and (o.complete_at or 0) > (s.complete_at or 0)]
            if newer and s.path.exists():
                out.append(s)
        return out

    def _any(self) -> list[Save]:
        return [s for s in self.world.saves if s.version is not None]

    # -- the trainer -----------------------------------------------------------------

    @initialize(first=st.lists(st.tuples(runs, st.sampled_from(KINDS), st.booleans(), st.booleans()),
                               min_size=1, max_size=4),
                keep_last=st.integers(0, 3), remote_keep_last=st.integers(0, 2))
    def training_started(self, first: list[tuple[str, str, bool, bool]], keep_last: int,
                         remote_keep_last: int) -> None:
        self.world.set_keep_last(keep_last)
        for run in RUNS:
            self.world.set_remote_keep_last(run, remote_keep_last)
        for run, kind, slow, sharded in first:
            self.world.save(run, kind, slow=slow, sharded=sharded)

    @rule(run=runs, kind=st.sampled_from(KINDS), slow=st.booleans(), sharded=st.booleans())
    def save(self, run: str, kind: str, slow: bool, sharded: bool) -> None:
        self.world.save(run, kind, slow=slow, sharded=sharded)

    @rule(run=runs, kind=st.sampled_from(KINDS), sharded=st.booleans())
    def save_atomic(self, run: str, kind: str, sharded: bool) -> None:
        """(Most saves are written at once: a second rule makes them as likely as the rest.)"""
        self.world.save(run, kind, slow=False, sharded=sharded)

    @precondition(lambda self: self._writing())
    @rule(i=index)
    def progress(self, i: int) -> None:
        w = self._writing()
        self.world.progress(w[i % len(w)])

    @precondition(lambda self: self._writing())
    @rule(i=index)
    def kill(self, i: int) -> None:
        w = self._writing()
        self.world.kill(w[i % len(w)])

    @precondition(lambda self: self._complete())
    @rule(i=index, slow=st.booleans(), sharded=st.booleans())
    def resave(self, i: int, slow: bool, sharded: bool) -> None:
        c = self._complete()
        self.world.resave(c[i % len(c)], slow=slow, sharded=sharded)

    @rule(run=runs, improved=st.booleans())
    def lightning_epoch(self, run: str, improved: bool) -> None:
        self.world.lightning_epoch(run, improved)

    @precondition(lambda self: [s for s in self._complete() if s.written.is_dir])
    @rule(i=index, written=st.integers(0, 3), scan=st.booleans())
    def resave_killed_then_restore(self, i: int, written: int, scan: bool) -> None:
        """A restart saves again into a protected folder and dies halfway; the user restores
        the path: (c) says it refuses or gives back the files on disk."""
        c = [s for s in self._complete() if s.written.is_dir and self.world.protected(s)]
        if not c:
            return
        s = c[i % len(c)]
        again = self.world.resave(s, slow=True)
        for _ in range(written):
            self.world.progress(again)
        if again.complete_at is None:
            self.world.kill(again)
        if scan:
            self.world.scan()
        self.world.restore(s, "fresh", overwrite=False)

    @precondition(lambda self: self._old())
    @rule(i=index)
    def trainer_delete(self, i: int) -> None:
        o = self._old()
        self.world.trainer_delete(o[i % len(o)])

    @rule(run=runs)
    def user_delete_run(self, run: str) -> None:
        self.world.user_delete_run(run)

    # -- the user --------------------------------------------------------------------

    @precondition(lambda self: self._any())
    @rule(i=index)
    def pin(self, i: int) -> None:
        a = self._any()
        self.world.pin(a[i % len(a)])

    @precondition(lambda self: self._any())
    @rule(i=index)
    def forget(self, i: int) -> None:
        a = self._any()
        self.world.forget(a[i % len(a)])

    @precondition(lambda self: self.world.saves)
    @rule(i=index)
    def protect(self, i: int) -> None:
        self.world.protect(self.world.saves[i % len(self.world.saves)])

    @rule(k=st.integers(0, 3))
    def set_keep_last(self, k: int) -> None:
        self.world.set_keep_last(k)

    @rule(run=runs, k=st.integers(0, 2))
    def set_remote_keep_last(self, run: str, k: int) -> None:
        self.world.set_remote_keep_last(run, k)

    @precondition(lambda self: self._any())
    @rule(i=index, where=st.sampled_from(RESTORE_TARGETS), overwrite=st.booleans())
    def restore(self, i: int, where: str, overwrite: bool) -> None:
        a = self._any()
        self.world.restore(a[i % len(a)], where, overwrite=overwrite)

    # -- the system ------------------------------------------------------------------

    @rule()
    def scan(self) -> None:
        self.world.scan()

    @rule()
    def restart_watcher(self) -> None:
        self.world.restart_watcher()

    @precondition(lambda self: self.world.pending)
    @rule(i=index)
    def deliver(self, i: int) -> None:
        self.world.deliver(i)

    @precondition(lambda self: self.world.pending)
    @rule(i=index)
    def deliver_duplicate(self, i: int) -> None:
        self.world.deliver(i, keep=True)

    @precondition(lambda self: self.world.pending)
    @rule(i=index)
    def drop(self, i: int) -> None:
        self.world.drop(i)

    @rule()
    def drain(self) -> None:
        self.world.drain()

    @rule()
    def settle(self) -> None:
        self.world.settle()

    @rule()
    def expire_leases(self) -> None:
        self.world.expire_leases()

    @rule()
    def tick(self) -> None:
        self.world.tick()

    @rule()
    def rotation(self) -> None:
        self.world.rotation()

    @rule()
    def retention(self) -> None:
        self.world.retention()

    @rule()
    def repair_sweep(self) -> None:
        self.world.repair_sweep()

    @rule()
    def gc(self) -> None:
        self.world.gc()

    @rule()
    def scrub(self) -> None:
        self.world.scrub()

    # -- faults ----------------------------------------------------------------------

    @rule(i=index, how=st.sampled_from(["lose", "truncate"]))
    def damage(self, i: int, how: str) -> None:
        self.world.damage(i, how)

    # -- the checker -----------------------------------------------------------------

    @invariant()
    def invariants_hold(self) -> None:
        self.world.check()
