"""The routes stream wiped (`FLUSHALL`, a Redis restarted without persistence, the stream
evicted) while a gateway had not yet read a peer's last records: the peer's "request ended"
record is lost with it. The peer then heartbeats with its non-zero loads only, so the lost
zero was never said again and the reader counted the peer's finished stream as in flight
for as long as the peer lived (the bounded-load rule and the cost model with it). Real
processes: Redis, the simulator, two gateways, the openai client streaming."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable

import openai
from openai.types.chat import ChatCompletionChunk

from tests.support.gateway import AUTH_SECRET, admin_client, gateway_proc, wait_for
from tests.support.procs import Proc, redis_proc

ADMIN = "wiped-stream-admin-token-0123456789"


def _inflight(base: str, field: str = "inflight_fleet") -> int:
    """Requests in flight on every replica as `base` sees the fleet (its own and its peers'),
    or its own (`field` "inflight")."""
    with admin_client(base, ADMIN) as admin:
        pools = admin.get("/replicas").json()["data"]
    return sum(r[field] for p in pools for r in p["replicas"])


def _stream_entries(port: int) -> int:
    out = subprocess.run(["redis-cli", "-p", str(port), "XLEN", "kvgate:routes"],
                         capture_output=True, text=True, timeout=10, check=True)
    return int(out.stdout.strip() or 0)


def _open(base: str, key: str) -> openai.Stream[ChatCompletionChunk]:
    """A stream held open (the replica hangs after two tokens), its first chunk read."""
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model="llama", messages=[{"role": "user", "content": "a long story"}], max_tokens=50,
        stream=True)
    next(iter(stream))
    return stream


def test_a_peer_load_whose_end_was_wiped_unread_is_not_kept(
    sim_factory: Callable[..., tuple[Proc, str]], procs: list[Proc],
) -> None:
    _, sim = sim_factory("--hang-after-tokens", "2", model="m")  # streams held open
    store, url = redis_proc()
    procs.append(store.start())
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    config = {"pools": {"p": {"served_model": "m", "replicas": [sim]}},
              "models": {"llama": {"default": "p"}},
              # a peer stays live however long the reader below is stopped (a loaded machine)
              "sync": {"stale_after_s": 60}}
    env = {"KVGATE_REDIS_URL": url, "KVGATE_SALT_SECRET": AUTH_SECRET,
           "KVGATE_ADMIN_TOKEN": ADMIN}
    (reader, a), (writer, b) = (gateway_proc(config=config, env=env, auth=True)
                                for _ in range(2))
    procs.extend([reader.start(), writer.start()])
    with admin_client(a, ADMIN) as admin:
        assert admin.post("/tenants", json={"id": "t", "tier": "default"}).status_code == 201
        key = admin.post("/tenants/t/keys").json()["key"]
    wait_for(lambda: _inflight(a) == 0, 30, "the key known to both")
    # a stream through the reader too: a gateway with requests in flight reads with its own
    # batches, once per flush interval, and no blocking read waits at Redis for the next entry
    busy = _open(a, key)
    stream = _open(b, key)
    with busy, stream:
        wait_for(lambda: _inflight(a) == 2, 30, "the peer's stream seen by the reader")
        assert reader.popen is not None
        reader.popen.send_signal(signal.SIGSTOP)  # it reads nothing from now on
    # the client left: the stream ended on the writer, its zero record is in Redis, unread
    wait_for(lambda: _inflight(b, "inflight") == 0, 30, "the stream's end on the writer")
    before = _stream_entries(port)
    wait_for(lambda: _stream_entries(port) > before, 30, "the writer's records since")
    subprocess.run(["redis-cli", "-p", str(port), "FLUSHALL"], check=True, timeout=10,
                   capture_output=True)
    reader.popen.send_signal(signal.SIGCONT)
    wait_for(lambda: _inflight(a, "inflight") == 0, 30, "the reader's own stream's end")
    wait_for(lambda: _inflight(a) == 0, 20, "the finished streams gone from the reader")
