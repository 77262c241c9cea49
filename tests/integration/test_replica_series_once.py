"""A replica listed again under another URL of the same host:port (a policy version turning
`http://vllm-0:8000` into `https://vllm-0:8000`, or adding a path prefix) while a request is
still in flight on the old entry: the old entry drains, the new one serves, and both are the
replica `vllm-0:8000` of the pool. /metrics describes it once: real gateway, real simulator,
the admin API's `PUT /policy`, the page parsed by prometheus_client's own parser."""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
TOKEN = "admin-" + secrets.token_urlsafe(16)


def _policy(url: str) -> dict[str, object]:
    return {"pools": {"p": {"served_model": "sim-model", "replicas": [url]}},
            "models": {"sim-model": {"default": "p"}}, "tiers": {"default": {}}}


def _replica_samples(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]:
    """(sample name, labels) -> its values, of every family with a `replica` label."""
    out: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}
    text = httpx.get(f"{base}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "replica" in s.labels:
                out.setdefault((s.name, tuple(sorted(s.labels.items()))), []).append(s.value)
    return out


def _policy_version(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text)
                if f.name == "kvgate_policy_version" for s in f.samples)


def test_a_replica_relisted_under_another_url_while_draining_is_one_series(
    sim_factory: SimFactory,
) -> None:
    _, url = sim_factory()  # real time: the stream below runs for minutes
    port = url.rsplit(":", 1)[1]
    # `localhost` and `LOCALHOST`: two URLs, one host:port (the replica id `localhost:<port>`)
    gw, base = gateway_proc(config=_policy(f"http://localhost:{port}"),
                            env={"KVGATE_ADMIN_TOKEN": TOKEN})
    with gw, httpx.Client(base_url=base, timeout=30) as client:
        body = {"model": "sim-model", "stream": True, "max_tokens": 30000, "ignore_eos": True,
                "messages": [{"role": "user", "content": "a long one"}]}
        with client.stream("POST", "/v1/chat/completions", json=body) as held:
            assert held.status_code == 200
            chunks = held.iter_bytes()  # (kept: a dropped iterator closes the stream)
            next(chunks)  # in flight on the first entry
            version = _policy_version(base)
            httpx.put(f"{base}/admin/policy", json=_policy(f"http://LOCALHOST:{port}"),
                      headers={"authorization": f"Bearer {TOKEN}"},
                      timeout=10).raise_for_status()
            key = ("kvgate_inflight_requests",
                   (("pool", "p"), ("replica", f"localhost:{port}")))

            wait_for(lambda: _policy_version(base) > version, timeout=20,
                     what="the policy applied")
            samples = _replica_samples(base)
            twice = {k: v for k, v in samples.items() if len(v) > 1}
            assert not twice, f"series exported more than once: {twice}"
            # the request still running on the draining entry is counted on the one series
            assert samples[key] == [1.0]
        wait_for(lambda: _replica_samples(base)[key] == [0.0], timeout=20,
                 what="in flight back to 0")
        counts = Counter(name for name, _ in _replica_samples(base))
        assert counts["kvgate_replica_healthy"] == 1
