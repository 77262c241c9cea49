"""`server.workers: 2`: every line a worker logs names its worker (the two workers write to
one stderr, and an operator could not tell which process logged a request or an error); the
supervisor's own lines name none."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import openai
import orjson
import pytest

from tests.support.gateway import gateway_proc, wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.slow

MODEL = "sim-model"


def test_each_worker_names_itself_on_its_lines(
    redis_url: str, sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    upstream = sim_factory()[1]
    proc, base = gateway_proc(config={
        "pools": {"p": {"replicas": [upstream], "served_model": MODEL}},
        "models": {MODEL: {"default": "p"}},
        "server": {"workers": 2, "log_format": "json"},
    }, env={"KVGATE_REDIS_URL": redis_url})
    with proc:
        def request_lines() -> list[dict[str, object]]:
            docs = [orjson.loads(line) for line in proc.output(tail=None).splitlines()
                    if line.startswith("{")]
            return [d for d in docs if d["msg"] == "request"]

        def both_served() -> bool:  # a new connection each: the kernel spreads them
            with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as fresh:
                client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                       timeout=30, http_client=fresh)  # type: ignore[arg-type]
                client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
            return {d.get("worker") for d in request_lines()} >= {0, 1}

        wait_for(both_served, timeout=60, what="requests logged by both workers")
        # the supervisor says "listening on" at its first poll (every POLL_S) that finds every
        # worker serving: a stop before that poll would find no such line to check
        wait_for(lambda: "listening on" in proc.output(tail=None), timeout=30,
                 what="the supervisor's 'listening on' line")
        proc.stop()
        docs = [orjson.loads(line) for line in proc.output(tail=None).splitlines()
                if line.startswith("{")]
    requests = [d for d in docs if d["msg"] == "request"]
    assert {d.get("worker") for d in requests} == {0, 1}, requests
    # the workers' start-up and shutdown lines name them too; the supervisor's do not
    listening = [d for d in docs if str(d["msg"]).startswith("listening on")]
    assert listening and all("worker" not in d for d in listening), listening
    unnamed = [d for d in docs if "worker" not in d and d not in listening]
    assert all(d["logger"] in ("gateway.cli.serve", "gateway.workers") for d in unnamed), unnamed
