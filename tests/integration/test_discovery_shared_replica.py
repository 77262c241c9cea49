"""Two pools naming one replica: a static pool lists a simulated replica and a DNS-discovered
pool finds the same host:port. Both pools got a replica object for it, and the static pool's
was never scraped again (scrapes are keyed by host:port: the discovered one took its place),
its load frozen at nothing, with no error anywhere. A replica belongs to one pool: the
discovered pool is refused it, says so in /readyz and the log, and the replica stays scraped
and served in the pool that had it. A real gateway, a real simulated replica."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import openai
import pytest

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]


def test_a_replica_discovered_in_a_second_pool_stays_the_first_pools(
    sim_factory: SimFactory,
) -> None:
    _, url = sim_factory("--time-scale", "50")
    port = int(url.rsplit(":", 1)[1])
    replica = f"127.0.0.1:{port}"
    discovery = {"dns": {"name": "127.0.0.1", "port": port, "interval_seconds": 0.2}}
    config = {"pools": {"a": {"served_model": "sim-model", "replicas": [url]},
                        "b": {"served_model": "sim-model", "discovery": discovery}},
              "models": {"ma": {"default": "a"}, "mb": {"default": "b"}},
              "routing": {"scrape_interval_ms": 100}}
    gw, base = gateway_proc(config=config)
    with gw:
        wait_for(lambda: "b" in httpx.get(f"{base}/readyz").json().get("not_ready", {}),
                 what="pool b not ready")
        why = httpx.get(f"{base}/readyz").json()["not_ready"]["b"]
        assert f"{replica}: a replica of pool a" in why, why
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
        raw = client.chat.completions.with_raw_response.create(
            model="ma", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert raw.headers["x-kvgate-replica"] == f"a/{replica}"
        # the pool that has it keeps it scraped; the other pool has no replica object for it
        wait_for(lambda: f'{{pool="a",replica="{replica}"}}' in metric_values(
            base, "kvgate_replica_waiting"), what="pool a's replica scraped")
        assert list(metric_values(base, "kvgate_replica_healthy")) == [
            f'{{pool="a",replica="{replica}"}}']
        with pytest.raises(openai.APIStatusError) as refused:  # pool b has no replica
            client.chat.completions.create(
                model="mb", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert refused.value.status_code == 503
        logged = [json.loads(line) for line in gw.output(None).splitlines()
                  if line.startswith("{")]
        assert any(e.get("pool") == "b" and e.get("owner") == "a" and e.get("level") == "error"
                   for e in logged), gw.output()
