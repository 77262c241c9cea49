"""When the supervisor kills the workers still alive after a stop (`gateway.workers._Stuck`).

Two stop signals within one poll of the supervisor were seen as one first signal: a fast
double Ctrl-C got the first signal's deadline (grace + 10 s), not 10 s after the second. And
the margin was 10 s whatever Redis timeouts a worker's shutdown may wait on: a healthy worker
saying its goodbyes to a slow Redis could be killed (`kill_margin`). The clock is given.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from pydantic import SecretStr

from gateway.config import KvgateConfig
from gateway.workers import KILL_AFTER_S, _Stuck, kill_margin


class _Proc:
    pid = 4242

    @staticmethod
    def is_alive() -> bool:
        return True


@pytest.fixture
def killed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    kills: list[int] = []
    monkeypatch.setattr(os, "kill", lambda pid, _sig: kills.append(pid))
    return kills


def _workers() -> Any:
    return {0: (_Proc(), None)}


def test_a_second_signal_within_one_poll_has_its_own_deadline(killed: list[int]) -> None:
    stuck = _Stuck(600.0)
    signals = [100.0, 100.1]  # a fast double Ctrl-C: both seen at the next poll
    stuck.kill_late(_workers(), signals, now=100.2)
    stuck.kill_late(_workers(), signals, now=100.1 + KILL_AFTER_S - 0.01)
    assert killed == []
    stuck.kill_late(_workers(), signals, now=100.1 + KILL_AFTER_S)
    assert killed == [4242]


def test_one_signal_waits_the_grace_and_the_margin(killed: list[int]) -> None:
    stuck = _Stuck(30.0)
    stuck.kill_late(_workers(), [5.0], now=5.0 + 30 + KILL_AFTER_S - 0.01)
    assert killed == []
    stuck.kill_late(_workers(), [5.0], now=5.0 + 30 + KILL_AFTER_S)
    assert killed == [4242]


def test_a_late_second_signal_does_not_postpone_the_deadline(killed: list[int]) -> None:
    stuck = _Stuck(1.0)
    stuck.kill_late(_workers(), [0.0, 5.0], now=1.0 + KILL_AFTER_S)
    assert killed == [4242]


def _cfg(**over: Any) -> KvgateConfig:
    cfg = KvgateConfig(redis_url=SecretStr("redis://127.0.0.1:6379/0"))
    for section, values in over.items():
        setattr(cfg, section, getattr(cfg, section).model_copy(update=values))
    return cfg


def test_the_margin_covers_the_redis_timeouts_of_a_worker_s_shutdown() -> None:
    assert kill_margin(KvgateConfig()) == KILL_AFTER_S
    assert kill_margin(_cfg()) == KILL_AFTER_S  # the defaults: well under 10 s
    assert kill_margin(_cfg(tenancy={"redis_timeout_s": 6.0})) == 4 * 6.0
    assert kill_margin(_cfg(sync={"timeout_s": 5.0})) == 4 * 5.0
    assert kill_margin(_cfg(sync={"timeout_s": 5.0, "enabled": False})) == KILL_AFTER_S


def test_a_slow_redis_worker_is_not_killed_at_ten_seconds(killed: list[int]) -> None:
    stuck = _Stuck(1.0, kill_margin(_cfg(tenancy={"redis_timeout_s": 6.0})))
    stuck.kill_late(_workers(), [0.0], now=1.0 + KILL_AFTER_S + 1)
    assert killed == []
    stuck.kill_late(_workers(), [0.0], now=1.0 + 24.0)
    assert killed == [4242]
