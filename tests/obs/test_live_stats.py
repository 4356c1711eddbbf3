"""The dashboard's numbers from a real ServerMetrics registry: rates, windowed
percentiles (PromQL's histogram_quantile arithmetic), hit rate, speculative
acceptance; and the lanes timeline's gaps."""

from __future__ import annotations

import pytest

from laneserve.obs.lane_times import LaneClock, LaneLog
from laneserve.obs.live_feed import LiveFeed, timeline
from laneserve.obs.live_stats import bucket_delta, derive, quantile, read_registry
from laneserve.obs.metrics import RequestTimes, ServerMetrics
from laneserve.protocol import LaneTimes


def test_quantile_matches_promql_arithmetic() -> None:
    inf = float("inf")
    # 10 observations: 4 in (0, 0.1], 4 in (0.1, 0.5], 2 in (0.5, 1]
    b = [(0.1, 4.0), (0.5, 8.0), (1.0, 10.0), (inf, 10.0)]
    assert quantile(0.5, b) == pytest.approx(0.1 + 0.4 * (5 - 4) / 4)
    assert quantile(0.2, b) == pytest.approx(0.1 * 2 / 4)
    assert quantile(0.99, b) == pytest.approx(0.5 + 0.5 * (9.9 - 8) / 2)
    assert quantile(0.5, [(0.1, 0.0), (inf, 0.0)]) is None
    assert quantile(0.99, [(0.1, 1.0), (inf, 5.0)]) == 0.1  # in +Inf: the top finite bound
    assert bucket_delta([(1.0, 5.0), (inf, 7.0)], [(1.0, 2.0), (inf, 2.0)]) == [
        (1.0, 3.0),
        (inf, 5.0),
    ]


def _request(m: ServerMetrics, ttft: float, e2e: float, reason: str = "stop") -> None:
    m.observe_request(RequestTimes(0.0, 0.0, ttft, e2e, num_prompt=5, num_output=3, reason=reason))


def test_derive_rates_and_window() -> None:
    m = ServerMetrics("m")
    old = read_registry(m.registry, 100.0)
    _request(m, 0.03, 0.9)  # before the window's base: not in the window
    base = read_registry(m.registry, 110.0)
    for ttft in (0.015, 0.015, 0.03, 0.07):
        _request(m, ttft, 1.2)
    _request(m, 0.015, 1.2, reason="length")
    m.label(m.prompt_tokens).inc(500)
    m.label(m.generation_tokens).inc(100)
    m.label(m.prefix_queries).inc(40)
    m.label(m.prefix_hits).inc(10)
    m.label(m.spec_num_drafts).inc(10)
    m.label(m.spec_accepted).inc(12)
    for pos, n in enumerate((8, 4)):
        m.spec_per_pos.labels(model_name="m", engine="0", position=str(pos)).inc(n)
    new = read_registry(m.registry, 120.0)
    p = derive(new, base, base)
    assert p["prompt_tps"] == pytest.approx(50.0) and p["gen_tps"] == pytest.approx(10.0)
    assert p["fin_stop"] == pytest.approx(0.4) and p["fin_length"] == pytest.approx(0.1)
    assert p["prefix_hit_rate"] == pytest.approx(0.25)
    # five TTFTs in the window: 3 in (0.01, 0.02], 1 in (0.02, 0.04], 1 in (0.06, 0.08]
    assert p["ttft"][0] == pytest.approx(0.01 + 0.01 * 2.5 / 3)
    assert p["spec_accept"] == [pytest.approx(0.8), pytest.approx(0.4)]
    assert p["spec_mean_len"] == pytest.approx(2.2)
    wide = derive(new, old, old)  # the request before `base` counts in a wider window
    assert wide["fin_stop"] == pytest.approx(5 / 20)


def test_empty_window_is_none_not_zero() -> None:
    m = ServerMetrics("m")
    a, b = read_registry(m.registry, 1.0), read_registry(m.registry, 2.0)
    p = derive(b, a, a)
    assert p["ttft"] == [None, None, None] and p["prefix_hit_rate"] is None
    assert p["spec_accept"] == [] and p["spec_mean_len"] is None
    assert p["gen_tps"] == 0.0


def test_feed_samples_every_sample_s() -> None:
    m = ServerMetrics("m")
    feed = LiveFeed(m.registry, sample_s=5.0)
    due = [feed.tick(1000.0 + s) is not None for s in range(12)]
    assert due == [True] + [False] * 4 + [True] + [False] * 4 + [True, False]
    assert len(feed.recent(0)) == 12 and len(feed.recent(1005.0)) == 6


def _lt(prep: int, dev: int, out: int, d: int = 10) -> LaneTimes:
    return LaneTimes(prepare=(prep, prep + d), device=(dev, dev + d), output=(out, out + d))


def test_timeline_gaps_only_between_consecutive_steps() -> None:
    rows = timeline([(1, _lt(0, 1000, 3000)), (2, _lt(500, 4000, 6000)), (4, _lt(0, 9000, 9500))])
    assert [r["gap_us"] for r in rows] == [None, (4000 - 1010) / 1000, None]
    assert rows[1]["device"] == [4.0, 4.01]


def test_lane_clock_and_log() -> None:
    clock = LaneClock(True)
    clock.mark(7, "prepare", 1, 2)
    clock.mark(7, "device", 3, 4)
    clock.mark(7, "output", 5, 6)
    clock.mark(8, "prepare", 7, 8)  # a step whose device stage failed
    assert clock.take(7) == LaneTimes(prepare=(1, 2), device=(3, 4), output=(5, 6))
    assert clock.take(7) is None and clock.take(8) is None and clock._open == {}
    off = LaneClock(False)
    off.mark(1, "device", 1, 2)
    assert off.take(1) is None
    log = LaneLog(size=4)
    for step in range(10):
        log.add(step, _lt(step, step, step))
    assert [s for s, _ in log.recent(3)] == [7, 8, 9]
    assert [s for s, _ in log.recent(100)] == [6, 7, 8, 9] and log.recent(0) == []
