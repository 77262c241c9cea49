"""A replica whose engine decodes several times slower than its pool's others at a batch as
large, and that still starts enough requests to be judged: its engine is slow (a slower GPU,
another quantization), not decode-bound. It was named decode-bound too, with "lower
--max-num-batched-tokens", which does nothing for a slower GPU."""

from __future__ import annotations

from gateway.doctor.classify import classify
from gateway.doctor.findings import Context, Finding
from gateway.doctor.thresholds import Thresholds
from gateway.doctor.window import GatewayStats, ReplicaStats, Window
from tests.unit.doctor.test_rules import pool, replica

TH = Thresholds()
LONG = {"prompt_tokens": 200_000.0, "queries": 200_000.0, "hits": 0.0}  # 2,000-token prompts


def _findings(*replicas: ReplicaStats) -> list[Finding]:
    p = pool(*replicas)
    w = Window(10, 10, 0, 10, 40, list(p.replicas), [p], GatewayStats(cpu_share=0.1), [], 0)
    return classify(w, TH, Context())


def test_a_slower_engine_at_the_same_batch_is_named_slow_not_decode_bound() -> None:
    fast = replica("fast", itl_mean=0.012, running_mean=4.0, **LONG)
    # as much time per request as its peer (no imbalance for the pool to name)
    slow = replica("slow", itl_mean=0.08, running_mean=4.0, requests=40.0, inflight_mean=1.6,
                   **LONG)
    on_slow = [f for f in _findings(fast, slow) if f.replica == "slow"]
    assert [f.cls for f in on_slow] == ["routing"], on_slow
    (f,) = on_slow
    assert "6.7x slower than its peers'" in f.summary, f.summary
    assert "--max-num-batched-tokens" not in f.action.replace(
        "whatever --max-num-batched-tokens", "")
    assert "GPU" in f.action
    # named by the pool (its time per request), it is named once, by the pool's finding
    held = replica("slow", itl_mean=0.08, running_mean=4.0, requests=40.0, **LONG)
    (f,) = [f for f in _findings(fast, held) if f.replica == "slow"]
    assert f.summary.startswith("imbalance") and "x slower than its peers'" in f.action, f


def test_a_larger_batch_or_a_pool_slow_everywhere_is_still_decode_bound() -> None:
    """The peers decode faster only because they hold fewer sequences; or every replica is
    as slow: the batch (or the prefill chunks) is the cause, as before."""
    fast = replica("fast", itl_mean=0.012, running_mean=4.0, **LONG)
    big = replica("big", itl_mean=0.08, running_mean=40.0, **LONG)
    assert [f.cls for f in _findings(fast, big) if f.replica == "big"] == ["decode-bound"]
    both = [replica(r, itl_mean=0.08, running_mean=6.0, **LONG) for r in ("a", "b")]
    decode = [f for f in _findings(*both) if f.cls == "decode-bound"]
    assert len(decode) == 2 and all(
        f.action.startswith("lower --max-num-batched-tokens") for f in decode)
