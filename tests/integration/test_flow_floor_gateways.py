"""A lower band's minimum share holds with other gateways live while the top band stays
backlogged.

With peers, a band below the top one takes room only once the pool has had room for two
records' lags (a premium request queued on another gateway gets a slot that freed here),
and the top band's own requests queued here go meanwhile, even past a lower band owed its
floor. While premium requests kept waiting here, every slot that freed was theirs at once:
the pool never had room for two lags, and the owed free band never got a turn (measured, one
replica at ``max_inflight: 2``, premium and free clients closed-loop on two gateways, floor
0.1: free was served 2.5 % of the tokens, 12 % with one gateway). Now an owed band waits the
two lags once, from when it was first held owed, then takes its turn.

The stack of `test_flow_tiers_gateways` (one replica whose streams hang after two tokens,
``max_inflight: 1`` fleet-wide, ``peer_lag_ms`` 500, the free band's floor 0.9).
"""

from __future__ import annotations

import socket
import struct
import time
from functools import partial

import pytest

from tests.integration.test_flow_tiers_gateways import (  # noqa: F401 - `fleet`: a fixture
    _depth,
    _prompts,
    _queued,
    _send,
    _taken,
    fleet,
)
from tests.support.gateway import wait_for

pytestmark = pytest.mark.slow


def _cut(sock: socket.socket) -> None:
    """The client leaves with a reset: its stream's slot frees at once."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_an_owed_lower_band_gets_its_turn_while_the_top_band_stays_backlogged(
        fleet: tuple[list[str], str, dict[str, str]]) -> None:  # noqa: F811
    (a, _), sim, keys = fleet
    pad = " word" * 400  # (as there: the cut streams keep the credit their prompts earned)
    running = _send(a, keys["prem"], "p-run-1" + pad)
    assert running.recv(4096).startswith(b"HTTP/1.1 200")
    time.sleep(1.5)  # its pick is past the unseen-sends window
    queued = {"f-1": _send(a, keys["free"], "f-1" + pad)}
    wait_for(lambda: _depth(a) == 1, 10, "the free request to queue")
    for n in range(2, 7):  # premium stays backlogged here throughout
        queued[f"p-{n}"] = _send(a, keys["prem"], f"p-{n}" + pad)
        wait_for(partial(_queued, a, n), 10, f"premium request {n} to queue")
    order = ["p-run-1"]
    for slot in range(2, 6):
        _cut(running)
        wait_for(partial(_taken, sim, slot), 20, f"slot {slot} to be taken")
        order.append(_prompts(sim)[-1].split()[0])
        running = queued.pop(order[-1])
        time.sleep(1.5)  # two lags pass (a peer's premium request would have been picked)
    # p-2 and p-3 went (the band owed its floor after them), p-4 took the slot while the owed
    # band waited its two lags; the next slot is the free band's, premium still waiting
    assert order == ["p-run-1", "p-2", "p-3", "p-4", "f-1"], order
    assert _depth(a) == 2
    for sock in (running, *queued.values()):
        sock.close()
