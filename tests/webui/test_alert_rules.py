"""docs/alerts.yml: Prometheus alerting rules whose structure is what Prometheus loads, over
metrics /metrics really exports (scraped from the real app on a seeded control plane, with the
labels each rule matches on). `promtool check rules` too, when it is installed."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from pipeline import alerts
from tests.webui.conftest import seed
from tests.webui.test_api import dead_letter

RULES = Path(__file__).resolve().parents[2] / "docs" / "alerts.yml"
DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
#: PromQL words that are not metric names (functions are recognised by their "(").
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan",
            # aggregation operators, which may come before their "(" (sum by (run) (...))
            "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
            "quantile"}


def metric_names(expr: str) -> dict[str, set[str]]:
    """The metric names an expression reads, each with the label names it matches on."""
    out: dict[str, set[str]] = {}
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals hold no names
    text = re.sub(r"\[[^\]]*\]", "", text)  # nor range selectors ([2m], [1h:5m])
    for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?\s*(\()?", text):
        name, matchers, call = m.group(1), m.group(2), m.group(3)
        if call or name.lower() in KEYWORDS or re.fullmatch(r"\d+[smhdwy]", name):
            continue
        labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matchers or ""))
        out.setdefault(name, set()).update(labels)
    # Names inside by (...) / on (...) clauses are labels, not metrics.
    for clause in re.findall(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)", text):
        for label in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", clause):
            out.pop(label, None)
    return out


def scraped(client) -> tuple[set[str], dict[str, set[str]]]:
    """The metric families /metrics declares, and the label names its samples carry."""
    text = client.get("/metrics").get_data(as_text=True)
    families = set(re.findall(r"^# TYPE (\S+) ", text, re.M))
    labels: dict[str, set[str]] = {}
    for name, body in re.findall(r"^([A-Za-z_:][A-Za-z0-9_:]*)\{([^}]*)\}", text, re.M):
        labels.setdefault(name, set()).update(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', body))
    return families, labels


def test_the_rules_file_is_well_formed_and_names_only_exported_metrics(client, web_settings):
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"} and doc["groups"]
    names: set[str] = set()
    used: dict[str, set[str]] = {}
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) == {"alert", "expr", "for", "labels", "annotations"}, rule
            assert re.fullmatch(r"Ckpt[A-Za-z]+", rule["alert"]) and rule["alert"] not in names, rule["alert"]
            names.add(rule["alert"])
            assert isinstance(rule["expr"], str) and rule["expr"].strip()
            assert DURATION.match(str(rule["for"])), rule["for"]
            assert rule["labels"]["severity"] in ("critical", "warning")
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]
            found = metric_names(rule["expr"])
            assert found, f"{rule['alert']} reads no metric"
            for metric, labels in found.items():
                used.setdefault(metric, set()).update(labels)

    # Every condition of pipeline/alerts.py has a rule (by its own metric or ckpt_alert_active).
    assert len(names) >= len(alerts.KINDS)

    # A control plane with something in every family the rules read: workers, shards, a run, a
    # scrub, a dead letter.
    seed(web_settings)
    dead_letter()
    from tests.unit.test_alerts import done_job

    done_job(web_settings, "scrub", [("queued", "scrubbing"), ("scrubbing", "done")], params={"worker_id": "w-0"})
    families, labels = scraped(client)
    for metric, matched in sorted(used.items()):
        assert metric in families, f"docs/alerts.yml reads {metric}, which /metrics does not export"
        assert matched <= labels.get(metric, set()), f"{metric} has no label {matched - labels.get(metric, set())}"

    promtool = shutil.which("promtool")
    if promtool:  # not installed here; checked where it is
        subprocess.run([promtool, "check", "rules", str(RULES)], check=True)


def test_metric_names_are_read_out_of_expressions():
    assert metric_names('ckpt_worker_disk_used_ratio > scalar(ckpt_high_watermark_ratio)') == {
        "ckpt_worker_disk_used_ratio": set(), "ckpt_high_watermark_ratio": set()}
    assert metric_names('sum by (run) (ckpt_run_protection_behind{run=~"a.*"}) > 0 and on(run) x_y') == {
        "ckpt_run_protection_behind": {"run"}, "x_y": set()}
    assert metric_names("time() - ckpt_worker_last_scrub_timestamp_seconds > 2 * 86400") == {
        "ckpt_worker_last_scrub_timestamp_seconds": set()}
    assert metric_names('count_over_time(ckpt_worker_up{state="down"}[2m]) > 0') == {"ckpt_worker_up": {"state"}}


def test_metrics_export_dead_letters_and_the_alerts_that_fired(client, web_settings):
    from pipeline.service.scheduler import dead_letter_summary

    seed(web_settings)
    dead_letter()
    assert dead_letter_summary(web_settings)[0] == 1  # what the scheduler reads, from the real broker
    alerts.refresh(web_settings, dead_letters=dead_letter_summary(web_settings))
    text = client.get("/metrics").get_data(as_text=True)
    assert "ckpt_dead_letters 1.0" in text
    assert 'ckpt_alert_active{alert="dead_letters",severity="warning"} 1.0' in text
    assert 'ckpt_alert_active{alert="worker_down",severity="warning"} 0.0' in text
    assert 'ckpt_high_watermark_ratio 0.9' in text and 'ckpt_worker_disk_used_ratio{worker="w-0"} 0.5' in text
    assert 'ckpt_filesystem_used_ratio{filesystem="worker:w-0",workers="w-0"} 0.5' in text


def seconds(duration: str) -> float:
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}
    return sum(float(n) * units[u] for n, u in re.findall(r"(\d+)(ms|s|m|h|d|w|y)", duration))


def test_the_rules_that_can_flap_wait_and_hold_as_the_control_plane_does():
    """A disk hovering at the mark, a worker answering every other probe: the rule fires after
    the control plane's threshold (``for:``) and reads a window as long as its clear hold."""
    from pipeline.settings import Settings

    defaults = Settings()
    rules = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    for name, threshold in (("CkptStorageWorkerDown", defaults.alert_worker_down_seconds),
                            ("CkptDiskAboveWatermark", defaults.alert_disk_full_seconds)):
        assert seconds(rules[name]["for"]) == threshold, name
        [window] = re.findall(r"\[(\w+)\]", rules[name]["expr"])
        assert seconds(window) == defaults.alert_clear_seconds, name
    assert "ckpt_filesystem_used_ratio" in rules["CkptDiskAboveWatermark"]["expr"]  # one per disk
