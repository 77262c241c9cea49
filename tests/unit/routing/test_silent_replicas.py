"""A replica whose requests wait with nothing heard from it (`ReplicaView.silent_s`) is no
candidate while another is (`RouterConfig.silent_min_s`, `silent_factor`). The cost model's
predicted queue drains with time alone, so a frozen replica holding dozens of unanswered
requests looked idle and drew most new ones (30 of 40 in a live run) until health ejected it."""

from __future__ import annotations

from collections import Counter

import pytest

from routing.config import RouterConfig
from routing.policies import REGISTRY
from routing.router import Router
from routing.types import ReplicaView

from .helpers import feats


def _views(silent_s: float, frozen_inflight: int = 30, tokens: int = 3_000) -> list[ReplicaView]:
    # the frozen replica's requests all await their first token (none decodes): the cost
    # model's view of an idle replica once its predicted queue has drained
    return [
        ReplicaView(id="frozen", pool="p", inflight=frozen_inflight,
                    inflight_prefill=frozen_inflight, inflight_prefill_tokens=tokens,
                    silent_s=silent_s),
        ReplicaView(id="working", pool="p", inflight=3, inflight_prefill=1,
                    inflight_prefill_tokens=100),
    ]


def _picks(router: Router, views: list[ReplicaView], n: int = 40) -> Counter[str]:
    return Counter(router.pick(feats(f"prompt {i} " * 60), views, 100.0 + i).replica
                   for i in range(n))


@pytest.mark.parametrize("policy", sorted(REGISTRY))
def test_a_silent_replica_takes_no_request_while_another_can(policy: str) -> None:
    router = Router(RouterConfig(policy=policy))
    assert _picks(router, _views(silent_s=5.0))["frozen"] == 0


def test_silence_within_the_predicted_ttft_is_no_sign() -> None:
    # 3 x the TTFT predicted for one of 30 prompts of 100,000 tokens (a long prefill) is far
    # above 5 s
    router = Router(RouterConfig(policy="round_robin"))
    assert _picks(router, _views(silent_s=5.0, tokens=3_000_000))["frozen"] == 20
    # below silent_min_s, whatever the prediction
    assert _picks(router, _views(silent_s=0.4))["frozen"] == 20


def test_when_every_candidate_is_silent_none_is_left_out() -> None:
    router = Router(RouterConfig(policy="round_robin"))
    both = [ReplicaView(id=f"r{i}", pool="p", inflight=5, inflight_prefill=5,
                        inflight_prefill_tokens=500, silent_s=9.0) for i in range(2)]
    assert set(_picks(router, both)) == {"r0", "r1"}


def test_off_with_silent_min_s_0() -> None:
    router = Router(RouterConfig(policy="round_robin", silent_min_s=0.0))
    assert _picks(router, _views(silent_s=60.0))["frozen"] == 20


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="silent"):
        RouterConfig(silent_min_s=-1.0)
    with pytest.raises(ValueError, match="silent"):
        RouterConfig(silent_factor=0.5)


@pytest.mark.parametrize("policy", ["cache_aware", "consistent_hash"])
def test_the_load_bound_still_counts_the_silent_replicas(policy: str) -> None:
    """Two of four replicas silent (a slow first answer on a loaded machine looks the same):
    a burst of one prompt spreads within the bound taken over all four, not over the two
    left (over two, the bound admits the holder whatever its load: 16 of 16 on it)."""
    router = Router(RouterConfig(policy=policy))
    f = feats("the same question " * 80)
    load = {"a": 0, "b": 0}
    silent = [ReplicaView(id=f"s{i}", pool="p", inflight=1, inflight_prefill=1,
                          inflight_prefill_tokens=500, silent_s=9.0) for i in range(2)]
    for i in range(16):
        views = [*silent, *(ReplicaView(id=r, pool="p", inflight=n, inflight_prefill=n,
                                        inflight_prefill_tokens=320 * n) for r, n in load.items())]
        replica = router.pick(f, views, 100.0 + i * 0.001).replica
        router.record_route(replica, f, 100.0 + i * 0.001)
        load[replica] += 1
    cfg = router.config
    assert max(load.values()) <= cfg.load_factor * (16 + 2) / 4 + cfg.load_slack, load
