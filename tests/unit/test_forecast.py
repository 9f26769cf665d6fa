"""The capacity forecast: from an hour of history or more, never from a first store's minutes."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pipeline.capacity import days_until_full, forecast

T = datetime(2026, 11, 23, tzinfo=UTC)


def test_minutes_of_history_forecast_nothing():
    samples = [(T, 0), (T + timedelta(minutes=3), 2 * 10**8)]  # a first store: 0.2 GB in 3 minutes
    assert days_until_full(samples, 160 * 10**9) is None
    assert forecast(samples, None) == "too little history to forecast yet (an hour of samples)"


def test_a_steady_rate_forecasts_when_it_fills():
    samples = [(T + timedelta(hours=h), h * 10**9) for h in range(25)]  # 24 GB a day
    days = days_until_full(samples, 100 * 10**9)
    assert days is not None and abs(days - 76 / 24) < 1e-6
    assert forecast(samples, days) == "full in 3.2 days at the recent rate"


def test_usage_that_does_not_grow_is_not_filling_up():
    samples = [(T + timedelta(hours=h), 5 * 10**9) for h in range(5)]
    assert days_until_full(samples, 100 * 10**9) is None and forecast(samples, None) == "not filling up"
