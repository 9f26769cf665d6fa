"""The remote retention policy (pure): which protected checkpoints of a run stay restorable.

Property-tested: deterministic; pins and the newest checkpoint always kept; rules add up as
restic's do (a checkpoint any rule keeps is kept); applying the policy to what it kept keeps
all of it; no policy keeps everything.
"""
from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.core.retention import Policy, Protected, kept, to_forget

T0 = datetime(2026, 1, 5, 0, 0, tzinfo=UTC)  # a Monday


def at(hours: float) -> datetime:
    return T0 + timedelta(hours=hours)


def run_of(n: int, every_hours: float = 0.5, metric=lambda i: 1.0 / (i + 1)) -> list[Protected]:
    return [Protected(i + 1, (i + 1) * 100, at(i * every_hours), metrics={"eval_loss": metric(i)}) for i in range(n)]


def test_keep_last_and_calendar_rules_like_restic():
    items = run_of(24 * 4 * 2)  # four days, every 30 minutes
    policy = Policy(keep_last=3, daily=2)
    keep = kept(items, policy)
    newest = sorted(items, key=lambda c: c.step, reverse=True)
    assert {c.id for c in newest[:3]} <= set(keep)
    # daily 2: the newest checkpoint of each of the last two days that have one
    last_of_day = {c.saved_at.date(): c.id for c in sorted(items, key=lambda c: c.saved_at)}
    days = sorted(last_of_day, reverse=True)[:2]
    assert {last_of_day[d] for d in days} <= set(keep)
    assert len(keep) == 4  # the newest of today is both "last" and "daily"
    assert keep[newest[0].id] == ["newest", "last", "daily"]


def test_every_n_steps_and_best_by_metric():
    items = run_of(20, metric=lambda i: [5, 1, 4, 1.5, 3][i % 5] + i / 100)
    keep = kept(items, Policy(keep_every=500, best=2, metric="eval_loss", mode="min"))
    assert {c.id for c in items if c.step % 500 == 0} <= set(keep)
    losses = sorted(items, key=lambda c: c.metrics["eval_loss"])
    assert {losses[0].id, losses[1].id} <= set(keep)
    maxed = kept(items, Policy(best=1, metric="eval_loss", mode="max"))
    assert max(items, key=lambda c: c.metrics["eval_loss"]).id in maxed


def test_checkpoints_without_the_metric_are_not_best_but_the_newest_is_kept():
    items = [Protected(1, 100, at(0), metrics={"eval_loss": 0.5}), Protected(2, 200, at(1)),
             Protected(3, 300, at(2), metrics={"eval_loss": float("nan")})]
    assert set(kept(items, Policy(best=1, metric="eval_loss"))) == {1, 3}


def test_no_policy_keeps_everything():
    items = run_of(10)
    assert to_forget(items, Policy()) == [] and not Policy().is_set
    assert "every protected checkpoint is kept" in Policy().describe()


def test_of_two_saves_of_one_step_the_one_completed_last_is_the_newest_by_step():
    """Found by the property below: a re-save of step 0 detected before the save it replaced (a
    lower id) was forgotten, while the older save of that step was kept as the run's newest by step."""
    items = [Protected(1, None, at(1), False, {}), Protected(3, None, at(0), False, {}),
             Protected(2, 0, at(0.5), False, {}), Protected(4, 0, at(0), False, {})]
    assert 2 not in to_forget(items, Policy(0, 0, 0, 0, 0, 0, 1, "eval_loss", "min"))


# -- properties -----------------------------------------------------------------------------

protected = st.builds(
    Protected,
    st.integers(1, 10_000),
    st.none() | st.integers(0, 5000),
    st.integers(0, 24 * 120).map(lambda h: at(h / 2)),
    st.booleans(),  # pinned
    st.fixed_dictionaries({}, optional={"eval_loss": st.floats(0, 10), "accuracy": st.floats(0, 1)}),
)
runs = st.lists(protected, max_size=40, unique_by=lambda c: c.id)
policies = st.builds(Policy, st.integers(0, 6), st.sampled_from([0, 0, 100, 500]), st.integers(0, 4),
                     st.integers(0, 4), st.integers(0, 3), st.integers(0, 3), st.integers(0, 3),
                     st.sampled_from(["eval_loss", "accuracy", "missing"]), st.sampled_from(["min", "max"]))


@settings(max_examples=300, deadline=None)
@given(runs, policies, st.randoms(use_true_random=False))
def test_deterministic_whatever_the_order(items, policy, rnd):
    shuffled = list(items)
    rnd.shuffle(shuffled)
    assert {k: sorted(v) for k, v in kept(items, policy).items()} == \
        {k: sorted(v) for k, v in kept(shuffled, policy).items()}
    assert to_forget(items, policy) == to_forget(shuffled, policy)


@settings(max_examples=300, deadline=None)
@given(runs, policies)
def test_pins_and_the_newest_are_always_kept(items, policy):
    forgotten = set(to_forget(items, policy))
    assert not any(c.pinned for c in items if c.id in forgotten)
    if items:
        newest = max(items, key=lambda c: (c.step is not None, c.step or 0, c.saved_at, c.id))
        assert newest.id not in forgotten
    assert forgotten | set(kept(items, policy)) == {c.id for c in items}
    assert not forgotten & set(kept(items, policy))


RULES = ("keep_last", "keep_every", "hourly", "daily", "weekly", "monthly", "best")


@settings(max_examples=300, deadline=None)
@given(runs, policies, policies)
def test_rules_add_up(items, a, b):
    """Keeping with two rule sets together keeps exactly what either keeps (restic's union)."""
    a = dataclasses.replace(a, **dict.fromkeys(RULES[::2], 0))       # a: every N, daily, monthly
    b = dataclasses.replace(b, **dict.fromkeys(RULES[1::2], 0))      # b: last, hourly, weekly, best
    both = dataclasses.replace(b, **{r: getattr(a, r) for r in RULES[1::2]})
    if not (a.is_set and b.is_set):
        return
    assert set(kept(items, both)) == set(kept(items, a)) | set(kept(items, b))


@settings(max_examples=300, deadline=None)
@given(runs, policies)
def test_applying_the_policy_again_keeps_what_it_kept(items, policy):
    survivors = [c for c in items if c.id in kept(items, policy)]
    assert to_forget(survivors, policy) == []


@settings(max_examples=200, deadline=None)
@given(runs, policies, st.sampled_from(RULES))
def test_a_larger_count_never_forgets_more(items, policy, rule):
    more = dataclasses.replace(policy, **{rule: getattr(policy, rule) + 1}) if rule != "keep_every" else policy
    if not policy.is_set:
        return
    assert set(to_forget(items, more)) <= set(to_forget(items, policy))


def test_the_final_model_without_a_step_is_the_newest_and_kept():
    """HF ``trainer.save_model()`` writes model.safetensors after checkpoint-300: no step in its
    name, but the most recently completed save. ``keep_last 2`` keeps it and checkpoint-300."""
    items = [Protected(1, 100, at(0)), Protected(2, 200, at(1)), Protected(3, 300, at(2)), Protected(4, None, at(3))]
    assert to_forget(items, Policy(keep_last=2)) == [1, 2]
    assert to_forget(items, Policy(keep_last=1)) == [1, 2]  # 3 stays too: the newest by step


def test_lightning_last_ckpt_rewritten_after_the_top_k_is_the_newest():
    """``ModelCheckpoint(save_top_k=2, save_last=True)`` once the metric stops improving: the
    top-k files (steps 2 and 4) stay old, last.ckpt (no step in its name) is rewritten at step 10."""
    items = [Protected(1, 2, at(0)), Protected(2, 4, at(1)), Protected(3, None, at(5))]
    assert "newest" in kept(items, Policy(keep_last=1))[3]
    assert to_forget(items, Policy(keep_last=1)) == [1]
