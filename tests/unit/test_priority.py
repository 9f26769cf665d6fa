"""Background priority settings: what is accepted, what is refused with the fix named, and that
a thread lowered to it runs there (pipeline/priority.py)."""
from __future__ import annotations

import threading

import pytest

from pipeline import priority
from pipeline import settings as settings_mod
from pipeline.errors import ConfigError


@pytest.mark.parametrize(("text", "parsed"), [("best-effort:7", ("best-effort", 7)),
                                              ("Best-Effort:0", ("best-effort", 0)), ("idle", ("idle", 0)),
                                              ("none", None), ("", None)])
def test_io_classes_a_user_writes(text, parsed):
    assert priority.parse_io(text) == parsed


@pytest.mark.parametrize("env", [{"CKPT_IONICE": "best-effort:8"}, {"CKPT_IONICE": "realtime:0"},
                                 {"CKPT_IONICE": "low"}, {"CKPT_NICE": "20"}, {"CKPT_NICE": "-5"}])
def test_a_bad_value_is_refused_when_the_settings_load(tmp_path, env):
    with pytest.raises(ConfigError, match="nice must be"):
        settings_mod.load(environ={"CKPT_HOME": str(tmp_path), **env})


def test_a_thread_lowered_runs_below_the_others_and_so_do_the_threads_it_starts():
    seen = {}
    mine = priority.of_process(threading.get_native_id())

    def lowered():
        assert priority.lower(priority.of(17, "best-effort:6")) == []
        child = threading.Thread(target=lambda: seen.update(child=priority.of_process(threading.get_native_id())))
        child.start()
        child.join()
        seen["self"] = priority.of_process(threading.get_native_id())

    t = threading.Thread(target=lowered)
    t.start()
    t.join()
    assert seen == dict.fromkeys(("self", "child"), priority.Priority(17, ("best-effort", 6)))
    assert priority.of_process(threading.get_native_id()) == mine  # the caller's own thread is untouched


def test_what_cannot_be_lowered_is_said_and_the_caller_is_untouched(monkeypatch):
    monkeypatch.setattr(priority.platform, "machine", lambda: "loongarch64")  # no ioprio number known
    mine = priority.of_process(threading.get_native_id())
    assert priority.check(priority.of(10, "best-effort:7")) == ["ionice: unknown syscall number on loongarch64"]
    assert priority.check(priority.of(10, "none")) == []
    assert priority.of_process(threading.get_native_id()) == mine


def test_ckpt_ups_consumers_poll_as_the_setting_says_unless_dramatiq_is_told_directly(tmp_path, monkeypatch):
    """An idle consumer polling every 100 ms cost an idle `ckpt up` 2 s of CPU a minute, taken
    from training on its host: the default is 500 ms, and CKPT_POLL_MS sets it."""
    from pipeline.service.supervisor import Supervisor

    monkeypatch.delenv("dramatiq_worker_timeout", raising=False)
    s = settings_mod.load({"home": tmp_path, "roots": (str(tmp_path / "runs"),)}, environ={})
    assert Supervisor(s, processes=0)._env()["dramatiq_worker_timeout"] == "500"
    s = settings_mod.load({"home": tmp_path, "roots": (str(tmp_path / "runs"),)}, environ={"CKPT_POLL_MS": "100"})
    assert Supervisor(s, processes=0)._env()["dramatiq_worker_timeout"] == "100"
    monkeypatch.setenv("dramatiq_worker_timeout", "250")
    assert Supervisor(s, processes=0)._env()["dramatiq_worker_timeout"] == "250"
    with pytest.raises(ConfigError, match="poll_ms must be at least 10"):
        settings_mod.load({"home": tmp_path}, environ={"CKPT_POLL_MS": "0"})
