"""While the TTFT model is cold (`RouterConfig.cold_observations`), a replica's queue is at
least what its engine says waits there. The rates learned from a cold start's first few first
tokens drained kvgate's predicted queues far too fast: on prefix-tree (offline replay) one
replica holding the hot prefixes had 20-34 requests and ~30,000 prompt tokens queued while the
router saw its queue as empty, and the first seconds' TTFT p99 was 1.4x the oracle's."""

from __future__ import annotations

import pytest

from routing.config import RouterConfig
from routing.router import Router
from routing.types import ReplicaView

from .helpers import feats

PROMPT = "the shared instructions of this tenant, at length. " * 120


def _pick(config: RouterConfig, warm: bool = False) -> str:
    router = Router(config)
    f = feats(PROMPT + "and now the question")
    # replica a holds the prompt's prefix; ten requests kvgate sent there long ago still wait
    # for their first token (its predicted queue has drained away with time)
    held = feats(PROMPT + "an earlier question")
    router.record_route("a", held, 0.0)
    router.record_first_token("a", held, 0.5, 0.5)
    for i in range(10):
        router.record_route("a", feats(f"another prompt {i} " * 300), 1.0)
    if warm:  # the model has seen enough first tokens to be trusted
        for i in range(int(config.cold_observations) * 2):
            other = feats(f"warming {i} " * 50)
            router.record_route("b", other, 2.0)
            router.record_first_token("b", other, 0.05, 2.05)
    views = [
        # the engine says ten requests wait on a (a fresh scrape)
        ReplicaView(id="a", pool="p", waiting=10, running=0, scrape_age_s=0.0, inflight=10,
                    inflight_prefill=10, inflight_prefill_tokens=10 * 3_000),
        ReplicaView(id="b", pool="p", waiting=0, running=0, scrape_age_s=0.0),
    ]
    return router.pick(f, views, 30.0).replica


def test_a_cold_model_counts_the_engines_waiting_requests() -> None:
    assert _pick(RouterConfig()) == "b"


def test_off_the_drained_queue_keeps_the_holder() -> None:
    # (what the router did before: the holder, behind ten waiting requests)
    assert _pick(RouterConfig(cold_observations=0)) == "a"


def test_a_warm_model_trusts_its_own_queue() -> None:
    assert _pick(RouterConfig(), warm=True) == "a"


def test_a_negative_setting_is_refused() -> None:
    with pytest.raises(ValueError, match="cold_observations"):
        RouterConfig(cold_observations=-1.0)
