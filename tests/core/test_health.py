"""GPU health from NVML probes, on fake time (integer microseconds, no sleeping)."""

from __future__ import annotations

import random

import pytest

from gpud.core.health import GpuHealth, HealthEffect, HealthyAgain, Probe, Unhealthy, hung_reason

I = 100_000  # the monitor interval: 0.1 s in microseconds


def run_until(h: GpuHealth, until: int, now: int) -> tuple[int, list[tuple[int, HealthEffect]]]:
    """Drive ``advance`` the way the shell does: at each ``next_deadline``, up to ``until``."""
    seen: list[tuple[int, HealthEffect]] = []
    while (deadline := h.next_deadline()) is not None and deadline <= until:
        now = max(now, deadline)
        seen += [(now, e) for e in h.advance(now)]
    return now, seen


def test_every_gpu_is_probed_at_once_then_once_per_interval() -> None:
    h = GpuHealth([0, 1], interval_us=I, now=0)
    assert h.next_deadline() == 0
    assert h.advance(0) == [Probe(0), Probe(1)]
    assert h.advance(0) == []
    assert h.finished(0, 2_000) == [] and h.finished(1, 3_000) == []
    assert h.next_deadline() == I
    assert h.advance(I - 1) == []
    assert h.advance(I) == [Probe(0), Probe(1)]
    assert h.view(0).probes == 2 and h.view(0).last_result_at == 2_000


def test_no_second_probe_while_one_hangs_and_the_other_gpus_keep_their_cadence() -> None:
    h = GpuHealth([0, 1], interval_us=I, now=0)
    h.advance(0)
    h.finished(0, 1_000)  # GPU 1's call never returns
    probes: list[tuple[int, int]] = []
    now = 0
    for _ in range(100):  # ten seconds of ticks
        now += I
        for e in h.advance(now):
            if isinstance(e, Probe):
                probes.append((now, e.gpu))
                h.finished(e.gpu, now + 1_000)
    assert [gpu for _, gpu in probes] == [0] * 100
    assert h.view(1).probes == 1 and h.view(1).probe_out_since == 0


def test_a_hung_call_makes_its_gpu_unhealthy_after_one_and_a_half_intervals() -> None:
    h = GpuHealth([0, 1], interval_us=I, now=0)
    h.advance(0)
    h.finished(0, 500)
    assert h.next_deadline() == I  # GPU 0 is due
    assert h.advance(I) == [Probe(0)]
    h.finished(0, I + 500)
    assert h.next_deadline() == 3 * I // 2  # GPU 1's probe turns hung
    assert h.advance(3 * I // 2 - 1) == []
    assert h.healthy(1)
    assert h.advance(3 * I // 2) == [Unhealthy(1, hung_reason(3 * I // 2), 3 * I // 2)]
    assert hung_reason(150_000) == "its NVML call has not returned for 0.15 s"
    assert hung_reason(5_400_000_000) == "its NVML call has not returned for 5400 s"
    assert not h.healthy(1) and h.healthy(0)
    assert h.view(1).reason == hung_reason(150_000) and h.view(1).failures == 1
    later = []
    for now in range(2 * I, 50 * I, I):  # reported once, however long it hangs
        later += h.advance(now)
        h.finished(0, now + 500)
    assert later == [Probe(0)] * 48


@pytest.mark.parametrize("returned_at", [1, I // 2, I - 1])
def test_a_hang_is_reported_within_three_intervals_of_its_beginning(returned_at: int) -> None:
    """Worst case: the GPU stops answering just after a probe returned."""
    h = GpuHealth([0], interval_us=I, now=0)
    h.advance(0)
    h.finished(0, returned_at)
    hang_began = returned_at
    _, seen = run_until(h, 10 * I, returned_at)  # the next probe never returns
    verdicts = [(t, e) for t, e in seen if isinstance(e, Unhealthy)]
    assert len(verdicts) == 1
    at, verdict = verdicts[0]
    assert at - hang_began <= 5 * I // 2 < 3 * I
    assert verdict.hung_us == 3 * I // 2


def test_a_hung_gpu_whose_call_returns_is_healthy_again_and_probed_again() -> None:
    h = GpuHealth([0], interval_us=I, now=0)
    h.advance(0)
    now, seen = run_until(h, 7 * I, 0)
    assert [e for _, e in seen] == [Unhealthy(0, hung_reason(3 * I // 2), 3 * I // 2)]
    assert h.finished(0, 7 * I) == [HealthyAgain(0, 7 * I - 3 * I // 2)]
    assert h.healthy(0) and h.view(0).reason is None and h.view(0).probe_out_since is None
    assert h.next_deadline() == I  # overdue since: probed at the next advance
    assert h.advance(7 * I) == [Probe(0)]
    assert h.finished(0, 7 * I + 10) == []


def test_a_gpu_whose_call_raises_is_unhealthy_until_a_call_returns() -> None:
    h = GpuHealth([0, 1], interval_us=I, now=0)
    h.advance(0)
    h.finished(0, 10)
    assert h.finished(1, 20, "GPU is lost") == [Unhealthy(1, "GPU is lost")]
    assert not h.healthy(1) and h.view(1).reason == "GPU is lost"
    h.advance(I)
    h.finished(0, I + 10)
    assert h.finished(1, I + 20, "GPU is lost") == []  # still lost: nothing new to say
    h.advance(2 * I)
    assert h.finished(1, 2 * I + 20, "Unknown Error") == []
    assert h.view(1).reason == "Unknown Error" and h.view(1).failures == 3
    h.advance(3 * I)
    assert h.finished(1, 3 * I + 20) == [HealthyAgain(1, 3 * I)]
    assert h.healthy(1) and h.healthy(0)


def test_a_hung_call_that_ends_in_an_error_leaves_the_gpu_unhealthy_with_that_error() -> None:
    h = GpuHealth([0], interval_us=I, now=0)
    h.advance(0)
    assert h.advance(2 * I) == [Unhealthy(0, hung_reason(2 * I), 2 * I)]
    assert h.finished(0, 5 * I, "GPU is lost") == []
    assert h.view(0).reason == "GPU is lost" and h.view(0).failures == 1  # one probe, one failure
    h.advance(5 * I)
    assert h.finished(0, 5 * I + 1) == [HealthyAgain(0, 3 * I + 1)]


def test_an_erroring_gpu_whose_next_call_hangs_stays_unhealthy_without_a_second_report() -> None:
    h = GpuHealth([0], interval_us=I, now=0)
    h.advance(0)
    assert h.finished(0, 5, "Unknown Error") == [Unhealthy(0, "Unknown Error")]
    h.advance(I)
    assert h.advance(I + 3 * I // 2) == []
    assert h.view(0).reason == hung_reason(3 * I // 2)


def test_a_shorter_interval_applies_at_once() -> None:
    h = GpuHealth([0, 1], interval_us=10 * I, now=0)
    h.advance(0)
    h.finished(0, 5)
    assert h.next_deadline() == 10 * I
    h.set_interval(I)  # a reload
    assert h.next_deadline() == I
    assert h.advance(I) == [Probe(0)]
    assert h.advance(3 * I // 2) == [Unhealthy(1, hung_reason(3 * I // 2), 3 * I // 2)]


def test_refused_calls_change_nothing() -> None:
    h = GpuHealth([0], interval_us=I, now=0)
    with pytest.raises(ValueError, match="no probe out"):
        h.finished(0, 5)
    with pytest.raises(ValueError, match="unknown GPU 3"):
        h.finished(3, 5)
    with pytest.raises(ValueError, match="at least 1 us"):
        h.set_interval(0)
    assert h.interval_us == I and h.view(0).probes == 0 and h.advance(0) == [Probe(0)]
    with pytest.raises(ValueError, match="unknown GPU 1"):
        h.view(1)


def test_no_gpus_no_deadline() -> None:
    h = GpuHealth([], interval_us=I, now=0)
    assert h.next_deadline() is None and h.advance(10**9) == []


def test_random_hangs_and_errors_keep_the_rules() -> None:
    """Seeded runs: never two probes out for one GPU; every hang reported within three
    intervals of its beginning; the health shown is what the last probe said."""
    for seed in range(30):
        rnd = random.Random(seed)
        gpus = [0, 1, 2]
        h = GpuHealth(gpus, interval_us=I, now=0)
        out: dict[int, int] = {}  # gpu -> when its probe returns (None-like: never)
        outcome: dict[int, str | None] = {}
        healthy = dict.fromkeys(gpus, True)
        hang_began: dict[int, int] = {}
        now = 0
        for _ in range(400):
            returns = min(out.values(), default=None)
            deadline = h.next_deadline()
            now = min(t for t in (returns, deadline) if t is not None)
            for gpu in [g for g, t in out.items() if t == now]:
                del out[gpu]
                hang_began.pop(gpu, None)
                effects = h.finished(gpu, now, outcome[gpu])
                if outcome[gpu] is None:
                    assert [(type(e), e.gpu) for e in effects] == ([] if healthy[gpu] else [(HealthyAgain, gpu)])
                    healthy[gpu] = True
                else:
                    assert effects == ([Unhealthy(gpu, outcome[gpu] or "")] if healthy[gpu] else [])
                    healthy[gpu] = False
            for e in h.advance(now):
                match e:
                    case Probe(gpu=gpu):
                        assert gpu not in out, "a second probe while one is out"
                        kind = rnd.choice(["ok", "ok", "ok", "error", "slow", "hang"])
                        took = {
                            "ok": rnd.randrange(1, I // 10),
                            "error": 50,
                            "slow": rnd.randrange(I, 20 * I),
                            "hang": 10**12,
                        }[kind]
                        out[gpu] = now + took
                        outcome[gpu] = "Unknown Error" if kind == "error" else None
                        if took > 3 * I // 2:
                            hang_began[gpu] = now
                    case Unhealthy(gpu=gpu, hung_us=hung):
                        assert healthy[gpu] and hung is not None and gpu in hang_began
                        assert now - hang_began[gpu] <= 3 * I // 2
                        healthy[gpu] = False
                    case HealthyAgain():
                        raise AssertionError("healthy again without a probe returning")
            for gpu in gpus:
                assert h.healthy(gpu) == healthy[gpu]
                if gpu in hang_began and now - hang_began[gpu] >= 3 * I // 2:
                    assert not h.healthy(gpu)
            if all(t >= 10**12 for t in out.values()) and len(out) == len(gpus):
                break  # every GPU hangs for ever: nothing more happens
