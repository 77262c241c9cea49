"""Do a conversation's turns stay on its replica, turns spread at random over the gateways?

    python -m loadtest.bench_sync_turns --gateways 1 --no-redis
    python -m loadtest.bench_sync_turns --gateways 3 --workers 1,2,1

Real processes on loopback: simulated replicas, ``kvgate serve`` gateways (sharing their
routing state through a throwaway redis-server unless ``--no-redis``), the openai client. Each
conversation opens with a short system prompt and question (``--opening short``, ~100
characters: less than a prefix block) or a long one (``long``, several blocks), then sends
``--turns`` turns, each to a gateway picked at random, reading each answer first. Run one
conversation at a time (``sequential``), then ``--concurrent`` at once. Prints per mode how many
conversations had a turn on another replica than their first turn's (JSON)."""

from __future__ import annotations

import argparse
import json
import random
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack

import openai
from openai.types.chat import ChatCompletionMessageParam

from loadtest.fleet import Fleet, environ, redis_server

MODEL = "sim-model"


def _opening(c: int, kind: str) -> list[ChatCompletionMessageParam]:
    if kind == "short":
        system = "You are a helpful assistant."
    else:
        system = f"conversation {c}: " + " ".join(f"rule-{c}-{i}" for i in range(100))
    return [{"role": "system", "content": system},
            {"role": "user", "content": f"User {c} asks: what is topic {c}, and where can I "
                                        "read more?"}]


def conversation(bases: Sequence[str], c: int, turns: int, kind: str) -> list[str]:
    """The replica (x-kvgate-replica) of each turn of conversation ``c``."""
    rng = random.Random(c)
    clients = [openai.OpenAI(base_url=f"{b}/v1", api_key="unused", max_retries=2, timeout=60)
               for b in bases]
    messages = _opening(c, kind)
    seen = []
    for t in range(turns):
        raw = rng.choice(clients).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=rng.randint(4, 24))
        seen.append(raw.headers["x-kvgate-replica"])
        messages += [{"role": "assistant", "content": raw.parse().choices[0].message.content
                      or ""}, {"role": "user", "content": f"And after that, point {t}?"}]
        time.sleep(0.05)  # the client reads its answer
    return seen


def _moved(runs: dict[int, list[str]]) -> int:
    return sum(1 for seen in runs.values() if len(set(seen)) > 1)


def measure(bases: Sequence[str], n: int, turns: int, kind: str, at_once: int) -> dict[str, int]:
    sequential = {c: conversation(bases, c, turns, kind) for c in range(n)}
    concurrent: dict[int, list[str]] = {}

    def run(c: int) -> None:
        concurrent[c] = conversation(bases, c, turns, kind)

    threads = [threading.Thread(target=run, args=(1000 + c,)) for c in range(at_once)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return {"sequential": n, "sequential_moved": _moved(sequential),
            "concurrent": len(concurrent), "concurrent_moved": _moved(concurrent)}


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gateways", type=int, default=3)
    ap.add_argument("--workers", default="", help="server.workers per gateway, e.g. 1,2,1")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--concurrent", type=int, default=16)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--opening", choices=("short", "long"), default="short")
    ap.add_argument("--no-redis", action="store_true")
    a = ap.parse_args(argv)
    workers = [int(w) for w in a.workers.split(",")] if a.workers else [1] * a.gateways
    with ExitStack() as stack:
        fleet = stack.enter_context(Fleet())
        env = {"KVGATE_ROUTING__SCRAPE_INTERVAL_MS": "100"}
        if not a.no_redis:
            env["KVGATE_REDIS_URL"] = stack.enter_context(redis_server())
        sims = [fleet.sim(MODEL) for _ in range(a.replicas)]
        with environ(env):
            bases = [fleet.gateway(sims, "--workers", str(w)) for w in workers[:a.gateways]]
        time.sleep(3)  # the gateways hear from each other (heartbeats every 0.5 s)
        out = measure(bases, a.conversations, a.turns, a.opening, a.concurrent)
    print(json.dumps({"gateways": len(bases), "workers": workers[:a.gateways],
                      "shared": not a.no_redis, "opening": a.opening, "turns": a.turns, **out}))


if __name__ == "__main__":
    main()
