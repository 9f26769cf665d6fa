"""The trainer's recorder as real trainers run it (pipeline/recorder.py, docs/design.md
"Explicit completion" and "Background priority").

Each test runs a small trainer script in its own process against a home with no ``ckpt up``:
the recorder's answer is then "no `ckpt up` is running for home ...", which proves that the
child started, read the declaration and answered; anything else (a hang, "the recorder
process ... ended", a traceback) is the recorder failing the trainer. Given a trainer started
before its ``ckpt up``, from a directory holding its own ``pipeline/`` package, at nice 15,
with CKPT_NICE=0, with fds 0-2 closed, with a forked helper outliving it, with workers forked
after its first save that protect their own, with no interpreter to start the child, Ctrl-C
while it starts, or gone before an answer is written, Then the recorder still answers with the
settings of the moment, below (never above) the trainer, ends with it, leaks nothing and
prints no traceback.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.processes import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]
REPO = Path(__file__).resolve().parents[2]
ANSWERED = "no `ckpt up` is running for home"

#: A trainer's save hook: protect ARGV[1], wait for the record, print one JSON line on a pipe of its own
#: (REPORT_FD; its stdout may be closed) with the outcome and the recorder's pid and nice value.
TRAINER = textwrap.dedent("""
    import json, os, sys
    import pipeline
    from pipeline import api

    REPORT = int(os.environ['REPORT_FD'])


    def save_and_report(path):
        try:
            pipeline.protect(path).result(20)
            outcome = "ok"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        children = list(api.protector().record._children.values())
        pid = children[0].proc.pid if children else None
        nice = None
        if pid is not None and children[0].proc.poll() is None:
            nice = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[16])
        return {"outcome": outcome, "pid": pid, "nice": nice, "my_nice": os.getpriority(os.PRIO_PROCESS, 0)}
""")


@pytest.fixture
def home(tmp_path: Path) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "step_1.bin").write_bytes(b"x" * 100)
    return h


def script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "scripts" / "train.py"
    path.parent.mkdir(exist_ok=True)
    path.write_text(TRAINER + textwrap.dedent(body) + "os._exit(0)  # no 60 s drain: what is declared has its answer\n")
    return path


def run_trainer(path: Path, home: Path, *, cwd: Path | None = None, env: dict[str, str] | None = None,
                prefix: tuple[str, ...] = (), timeout: float = 120,
                during: Callable[[subprocess.Popen], object] | None = None) -> tuple[dict, str]:
    """Run the trainer script to its end (``during`` acts on it meanwhile); its report (read from
    its report pipe) and its stderr."""
    r, w = os.pipe()
    base = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    log = home.parent / "trainer.err"  # a file: a recorder that lives on must not hold the test up
    with open(log, "w") as err_file:
        p = subprocess.Popen([*prefix, sys.executable, str(path), str(home.parent / "run" / "step_1.bin")],
                             cwd=cwd or home.parent, env={**base, "CKPT_HOME": str(home), "PYTHONPATH": str(REPO),
                                                          "REPORT_FD": str(w), **(env or {})},
                             stdout=subprocess.DEVNULL, stderr=err_file, pass_fds=(w,), start_new_session=True)
    os.close(w)
    try:
        if during is not None:
            during(p)
        p.wait(timeout)
        with os.fdopen(r) as report:
            text = report.read()
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    err = log.read_text()
    assert text, f"the trainer reported nothing (exit {p.returncode}):\n{err[-3000:]}"
    return json.loads(text.splitlines()[-1]), err


def report_line(expr: str = "save_and_report(sys.argv[1])") -> str:
    return f"os.write(REPORT, (json.dumps({expr}) + '\\n').encode())\n"


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def test_a_ckpt_up_started_after_the_first_save_is_used_by_the_next(tmp_path, home):
    """docs/design.md: a save outside the roots is noted as degraded and "each save tries
    again, since `ckpt up` may start with the right roots". The trainer started first; its
    recorder (started at the first save) must record the next save with the settings ``ckpt up``
    published since (its roots), as the trainer now sees them, not with those of its start."""
    train = script(tmp_path, textwrap.dedent("""
        from pipeline import effective, settings
        first = save_and_report(sys.argv[1])
        # `ckpt up --root RUN/..` starts now and publishes its settings, as it does
        effective.write(settings.load({"home": os.environ["CKPT_HOME"],
                                       "roots": (os.path.dirname(os.path.dirname(sys.argv[1])) + "/*",)}), {})
        then = save_and_report(sys.argv[1])
        os.write(REPORT, (json.dumps({"first": first["outcome"], "outcome": then["outcome"]}) + "\\n").encode())
    """))
    report, err = run_trainer(train, home)
    assert ANSWERED in report["first"], (report, err[-2000:])
    # past the roots: recorded in the control plane; only the broker of the `ckpt up` is missing
    assert "is recorded, but the broker of `ckpt up` does not answer" in report["outcome"], (report, err[-2000:])


def test_a_trainer_started_beside_its_own_pipeline_package_is_still_protected(tmp_path, home):
    """A project with its own ``pipeline/`` package (a common name), its training script in
    ``scripts/``, run from the project's root: the trainer imports ckpt's ``pipeline`` (the
    script's directory comes first), and so must the recorder, whatever the cwd holds."""
    project = tmp_path / "project"
    (project / "pipeline").mkdir(parents=True)
    (project / "pipeline" / "__init__.py").write_text("")  # the user's data pipeline
    train = script(tmp_path, report_line())
    report, err = run_trainer(train, home, cwd=project)
    assert ANSWERED in report["outcome"], (report, err[-2000:])
    assert "Traceback" not in err and "No module named" not in err, err[-2000:]


def test_the_recorder_of_a_trainer_at_nice_15_never_runs_above_it(tmp_path, home):
    """A trainer started at nice 15 as root (training containers run as root, and root may
    raise a thread's priority): its recorder must not run at +10, above it."""
    train = script(tmp_path, report_line())
    report, err = run_trainer(train, home, prefix=("nice", "-n", "15"))
    assert ANSWERED in report["outcome"], (report, err[-2000:])
    assert report["my_nice"] == 15 and report["nice"] >= 15, report


def test_ckpt_nice_0_runs_the_recorder_at_the_trainers_priority(tmp_path, home):
    """docs/design.md: a host can set CKPT_NICE=0 / CKPT_IONICE=none; the recorder then runs at
    the trainer's own nice value, not at the +10 the protector thread used to take."""
    train = script(tmp_path, report_line())
    report, err = run_trainer(train, home, env={"CKPT_NICE": "0", "CKPT_IONICE": "none"})
    assert ANSWERED in report["outcome"], (report, err[-2000:])
    assert report["nice"] == report["my_nice"], report


def test_a_trainer_with_fds_0_to_2_closed_is_answered(tmp_path, home):
    """A daemonised trainer (``<&- >&- 2>&-``): the answer pipe must not land on fd 0-2, where
    the child's own stdin/stdout would replace it and the protector thread would wait for ever."""
    train = script(tmp_path, "for fd in (0, 1, 2):\n    os.close(fd)\n" + report_line())
    report, _ = run_trainer(train, home)
    assert ANSWERED in report["outcome"], report


def test_the_recorder_ends_with_the_trainer_even_when_a_forked_helper_lives_on(tmp_path, home):
    """A trainer forks a helper after its first save (a DataLoader worker, a logger) that
    outlives it: the helper holds a copy of the recorder's stdin, so its end never comes; the
    recorder must still end once the trainer is gone."""
    train = script(tmp_path, textwrap.dedent("""
        import time
        report = save_and_report(sys.argv[1])
        helper = os.fork()
        if helper == 0:
            os.close(2), os.close(REPORT)
            time.sleep(60)
            os._exit(0)
        os.write(REPORT, (json.dumps({**report, "helper": helper}) + "\\n").encode())
    """))
    report, err = run_trainer(train, home)
    try:
        assert ANSWERED in report["outcome"], (report, err[-2000:])
        wait_for(lambda: gone(report["pid"]), 20, "the recorder outlived its trainer")
    finally:
        for pid in (report["pid"], report["helper"]):
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_recorder_that_cannot_start_leaks_no_descriptor_per_save(tmp_path, home):
    """Every save of a trainer whose interpreter cannot be started again (moved venv, EAGAIN)
    fails, said once; it must not cost a file descriptor each time, or after enough saves the
    trainer's own ``open()`` fails (EMFILE) and training dies."""
    train = script(tmp_path, textwrap.dedent("""
        sys.executable = os.path.join(os.path.dirname(sys.argv[1]), "no-such-python")
        fds = lambda: len(os.listdir("/proc/self/fd"))
        first = save_and_report(sys.argv[1])
        before = fds()
        for _ in range(20):
            last = save_and_report(sys.argv[1])
        os.write(REPORT, (json.dumps({"outcome": last["outcome"], "leaked": fds() - before}) + "\\n").encode())
    """))
    report, err = run_trainer(train, home)
    assert "no-such-python" in report["outcome"], report
    assert report["leaked"] == 0, report


def test_a_recorder_whose_trainer_is_gone_before_the_answer_exits_quietly(tmp_path, home):
    """The trainer died (or left after its 60 s drain) while a save was being recorded: the
    recorder finishes, finds no one to answer, and ends without a traceback in the job's log."""
    r, w = os.pipe()
    os.close(r)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CKPT_")}
    try:
        p = subprocess.run([sys.executable, "-m", "pipeline.recorder", str(w)], pass_fds=(w,), cwd=REPO,
                           input=json.dumps({"path": str(home.parent / "run" / "step_1.bin")}) + "\n",
                           env={**env, "CKPT_HOME": str(home), "PYTHONPATH": str(REPO)},
                           capture_output=True, text=True, timeout=60)
    finally:
        os.close(w)
    assert (p.returncode, p.stderr) == (0, ""), p.stderr[-2000:]


def test_ctrl_c_while_the_recorder_starts_is_the_trainers_alone(tmp_path, home):
    """Ctrl-C reaches the terminal's foreground process group. A trainer that catches it to
    save and protect a last checkpoint must still be answered, even when the Ctrl-C comes while
    its recorder is still starting (an interpreter on a shared filesystem takes seconds), before
    the recorder could ignore SIGINT."""
    slow = tmp_path / "slow-site"
    slow.mkdir()
    started = tmp_path / "recorder-starting"
    (slow / "sitecustomize.py").write_text(textwrap.dedent(f"""
        import os, time
        if os.environ.get("SLOW_RECORDER_START"):
            open({str(started)!r}, "w").close()
            time.sleep(3)
    """))
    train = script(tmp_path, textwrap.dedent("""
        import time
        os.environ["SLOW_RECORDER_START"] = "1"  # only the recorder, started from now on
        d = pipeline.protect(sys.argv[1])
        while True:
            try:
                d.result(20)
                outcome = "ok"
                break
            except KeyboardInterrupt:  # the trainer's own Ctrl-C handling: keep waiting for the last save
                continue
            except Exception as exc:
                outcome = f"{type(exc).__name__}: {exc}"
                break
        os.write(REPORT, (json.dumps({"outcome": outcome}) + "\\n").encode())
    """))

    def ctrl_c(p: subprocess.Popen) -> None:
        wait_for(started.exists, 60, "the recorder to start")
        os.killpg(p.pid, signal.SIGINT)  # the terminal's Ctrl-C: to every process of the foreground group

    report, err = run_trainer(train, home, env={"PYTHONPATH": f"{slow}{os.pathsep}{REPO}"}, during=ctrl_c)
    assert ANSWERED in report["outcome"], (report, err[-2000:])
    assert "KeyboardInterrupt" not in err, err[-2000:]


def test_a_process_forked_after_a_save_protects_its_own_saves(tmp_path, home):
    """A trainer protects a save, then forks workers (``multiprocessing`` with the fork start
    method, the Linux default before 3.14) that save and protect shards of their own: each gets
    its own protector and recorder, not a copy of the parent's whose thread does not exist in it
    (its declarations would wait for ever, unsaid)."""
    train = script(tmp_path, textwrap.dedent("""
        import multiprocessing
        first = save_and_report(sys.argv[1])

        def worker(path, answers):
            answers.put(save_and_report(path)["outcome"])

        ctx = multiprocessing.get_context("fork")
        answers = ctx.Queue()
        w = ctx.Process(target=worker, args=(sys.argv[1], answers))
        w.start()
        outcome = answers.get(timeout=60)
        w.join(60)
        os.write(REPORT, (json.dumps({"first": first["outcome"], "outcome": outcome}) + "\\n").encode())
    """))
    report, err = run_trainer(train, home)
    assert ANSWERED in report["first"], (report, err[-2000:])
    assert ANSWERED in report["outcome"], (report, err[-2000:])


def test_a_recorder_stopped_while_recording_is_replaced_and_the_failure_said(settings, tmp_path, monkeypatch):
    """SIGSTOP on the recorder alone (not on the trainer) left every later save unrecorded, silently."""
    from pipeline import recorder as recorder_mod
    from pipeline.errors import CkptError

    monkeypatch.setattr(recorder_mod, "STOPPED_SLICE", 0.2)
    monkeypatch.setattr(recorder_mod, "STOPPED_SECONDS", 1.0)
    settings.home.mkdir(parents=True)
    path = tmp_path / "run" / "step_1.bin"
    path.parent.mkdir()
    path.write_bytes(b"x" * 100)
    rec = recorder_mod.Recorder()
    with pytest.raises(recorder_mod.RecordFailed, match="not a checkpoint in a run"):  # started, and answers
        rec(str(path), settings)
    [first] = rec._children.values()
    os.kill(first.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(CkptError, match=r"was stopped \(SIGSTOP\?\) for 1 s while recording"):
            rec(str(path), settings)
        assert first.proc.poll() is not None  # killed, not left behind
        with pytest.raises(recorder_mod.RecordFailed, match="not a checkpoint in a run"):  # the next: another
            rec(str(path), settings)
        [second] = rec._children.values()
        assert second.proc.pid != first.proc.pid
    finally:
        for child in rec._children.values():
            child.close()
            child.proc.wait(30)
        if first.proc.poll() is None:
            first.proc.kill()
            first.proc.wait()
