"""The recorder: a child process of the trainer that records the checkpoints it declares
complete (docs/design.md, "Explicit completion").

``pipeline.protect()`` hands a path to the protector thread (pipeline/protector.py), which
asks this child to record it: hash while sending early, record, send (``api.record``). The
child runs at the background priority (``nice``/``ionice``, pipeline/priority.py), so its
hashing yields the CPU and the disk to training, never holds the trainer's GIL, and its
memory (the control plane's clients, hashing buffers) is not the trainer's. One child per
control plane the trainer uses, started at the first declaration.

Requests are JSON lines on the child's stdin (``{"path": ..., "env": ...}``: with the settings
the trainer sees at that declaration, as ``Settings.child_env``, so that a ``ckpt up`` started
since counts), answers JSON lines on a pipe of their own (what a library prints on stdout
cannot garble them); its log lines go to the
trainer's stderr. The child ignores Ctrl-C (the trainer decides when to stop) and exits when
its stdin closes or its parent, the trainer, is gone (a process the trainer forked may hold
its stdin open), after the record under way.

    python -P -m pipeline.recorder FD [PID]   the child (FD: where answers go; PID: the trainer)
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from pipeline.errors import CkptError
from pipeline.liveness import stat_fields

if TYPE_CHECKING:
    from pipeline.api import Protected
    from pipeline.settings import Settings

log = logging.getLogger("ckpt.integrations")


#: While a record runs, how often the trainer's side looks whether its recorder was stopped...
STOPPED_SLICE = 5.0
#: ...and how long a stopped recorder is left before it is killed.
STOPPED_SECONDS = 30.0


def _state(pid: int) -> str:
    """The state letter of process ``pid`` (``T``: stopped), '' if it is gone."""
    try:
        return stat_fields(pid)[0]
    except (OSError, IndexError):
        return ""


class RecordFailed(CkptError):
    """What stopped the child recording a path: its cause, said as the child explained it
    (``kind``: the name of the error there, so that each kind is logged once)."""

    def __init__(self, kind: str, cause: str) -> None:
        super().__init__(cause)
        self.kind = kind


def _pipe() -> tuple[int, int]:
    """A pipe whose ends are above 0-2: a trainer that closed its standard fds would otherwise
    get them there, and the child's own stdin/stdout would replace the answer pipe."""
    ends = os.pipe()
    moved: list[int] = []
    try:
        for fd in ends:
            moved.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3))
    except OSError:
        for fd in moved:
            os.close(fd)
        raise
    finally:
        for fd in ends:
            os.close(fd)
    return moved[0], moved[1]


class _Child:
    """One recorder process and its two pipes."""

    def __init__(self, settings: Settings) -> None:
        package_parent = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, **settings.child_env(), "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
        request_r, request_w = _pipe()
        answer_r, answer_w = _pipe()
        try:  # -P: the cwd (it may hold a `pipeline/` of the user's) does not come before ckpt's package
            self.proc = subprocess.Popen([sys.executable, "-P", "-m", "pipeline.recorder", str(answer_w),
                                          str(os.getpid())],
                                         stdin=request_r, stdout=subprocess.DEVNULL, env=env, pass_fds=(answer_w,),
                                         start_new_session=True)  # Ctrl-C to the terminal's group is the trainer's
        except BaseException:
            for fd in (request_w, answer_r):
                os.close(fd)
            raise
        finally:
            for fd in (request_r, answer_w):
                os.close(fd)
        self.requests: IO[str] = os.fdopen(request_w, "w")
        self.answers: IO[str] = os.fdopen(answer_r, "r")

    def ask(self, path: str, settings: Settings) -> dict[str, Any]:
        # with the settings the trainer sees now: a `ckpt up` started since publishes its roots
        self.requests.write(json.dumps({"path": path, "env": settings.child_env()}) + "\n")
        self.requests.flush()
        line = self._answer(path)
        if not line:
            try:
                status = f"exit status {self.proc.wait(5)}"
            except subprocess.TimeoutExpired:  # alive, yet its answers cannot reach us: it is of no use
                self.proc.kill()
                status = f"answer pipe closed; killed, exit status {self.proc.wait()}"
            raise CkptError(f"the recorder process (pid {self.proc.pid}) ended ({status}) before it answered")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def _answer(self, path: str) -> str:
        """The child's answer line ('' at its end); a child stopped (SIGSTOP) ``STOPPED_SECONDS``
        while recording is killed and the declaration fails: waiting would leave every later save
        unrecorded, and nothing said. A slow record (a big checkpoint hashing) is waited for."""
        stopped_since: float | None = None
        while not select.select([self.answers], [], [], STOPPED_SLICE)[0]:
            if _state(self.proc.pid) != "T":
                stopped_since = None
                continue
            stopped_since = stopped_since or time.monotonic()
            if time.monotonic() - stopped_since >= STOPPED_SECONDS:
                self.proc.kill()
                self.proc.wait()
                raise CkptError(f"the recorder process (pid {self.proc.pid}) was stopped (SIGSTOP?) for "
                                f"{STOPPED_SECONDS:.0f} s while recording {path}: killed; the next save starts another")
        return self.answers.readline()

    def close(self) -> None:
        for f in (self.requests, self.answers):
            try:
                f.close()
            except OSError:  # a request the dead child never read
                pass


class Recorder:
    """``record(path, settings)`` in a child process (one per control plane, started on first use,
    started again if it died); what the protector calls."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._children: dict[tuple[str, str], _Child] = {}

    def __call__(self, path: str, settings: Settings) -> Protected:
        from pipeline.api import Protected

        key = (str(settings.home), settings.db_url)
        with self._lock:
            child = self._children.get(key)
            if child is None or child.proc.poll() is not None:
                child = self._children[key] = _Child(settings)
        try:
            answer = child.ask(path, settings)
        except (OSError, ValueError, CkptError):
            with self._lock:
                if self._children.get(key) is child:
                    del self._children[key]
            child.close()
            raise
        if not answer["ok"]:
            raise RecordFailed(answer["kind"], answer["cause"])
        p = answer["protected"]
        return Protected(p["id"], p["path"], p["run"], p["step"], p["state"],
                         datetime.fromisoformat(p["written_at"]), p["job_id"])


def _serve(answers: IO[str], trainer: int | None) -> None:
    from pipeline import priority
    from pipeline import settings as settings_mod

    s = settings_mod.current()
    for problem in priority.lower(priority.of(s.nice, s.ionice)):  # before any thread starts
        log.warning("ckpt: the recorder runs at the trainer's priority: %s", problem)
    from pipeline import api
    from pipeline.detection import claims
    from pipeline.protector import explain

    busy = threading.Lock()
    if trainer is not None:
        threading.Thread(target=_end_with, args=(trainer, busy), name="ckpt-recorder-parent", daemon=True).start()
    for line in sys.stdin:
        with busy:
            request = json.loads(line)
            path = request["path"]
            here = s
            try:
                if "env" in request:
                    here = settings_mod.load(environ=request["env"])
                with claims.claim(here.home, here.host_id, path):  # the watcher does not hash it too
                    p = api.record(path, here)
                reply: dict[str, Any] = {"ok": True, "protected": {
                    "id": p.id, "path": p.path, "run": p.run, "step": p.step, "state": p.state,
                    "written_at": p.written_at.isoformat(), "job_id": p.job_id}}
            except Exception as exc:  # the trainer's side decides what to say and count
                reply = {"ok": False, "kind": type(exc).__name__, "cause": explain(exc, here)}
            answers.write(json.dumps(reply) + "\n")
            answers.flush()


def _end_with(trainer: int, busy: threading.Lock) -> None:
    """End once the trainer is gone, after the record under way: a process it forked (a
    DataLoader worker, a logger) may hold a copy of our stdin and outlive it, so that stdin's
    end may come much later, or never."""
    while os.getppid() == trainer:
        time.sleep(1.0)
    busy.acquire()
    os._exit(0)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the trainer; stdin's end stops us
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    answers = os.fdopen(int(argv[0]), "w")
    try:
        _serve(answers, int(argv[1]) if len(argv) > 1 else None)
    except BrokenPipeError:  # the trainer is gone
        pass
    finally:
        try:
            answers.close()
        except BrokenPipeError:  # what it could not take is still buffered
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
