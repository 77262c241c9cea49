"""A replica that restarts comes back with an empty prefix cache. Its engine counters, scraped
from /metrics, go back to zero: the router must forget the prefixes it remembered there
(else it keeps predicting hits that are misses, and sends prefixes that another replica
still holds to the cold one), and learn them again from the next requests."""

from __future__ import annotations

import json
import re
import time
from contextlib import ExitStack

import httpx
import openai

from tests.support.gateway import gateway_proc, metric_values, wait_for
from tests.support.procs import Proc, free_port, sim_proc

MODEL = "sim-model"
SYSTEM = " ".join(f"rule {i}: answer precisely and cite the section." for i in range(60))


def _ask(client: openai.OpenAI, turn: str) -> tuple[str, str]:
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=2,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": turn}])
    raw.parse()
    return raw.headers["x-kvgate-replica"].split("/", 1)[1], raw.headers["x-kvgate-route"]


def _entries(base: str, replica: str) -> float:
    found = metric_values(base, "kvgate_affinity_index_entries")
    return sum(v for labels, v in found.items() if f'replica="{replica}"' in labels)


def test_a_restarted_replica_is_not_thought_to_hold_its_old_prefixes() -> None:
    ports = [free_port(), free_port()]
    with ExitStack() as stack:
        sims = [stack.enter_context(sim_proc(port, "--time-scale", "50", model=MODEL)[0])
                for port in ports]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        gw, base = gateway_proc(upstreams=urls, args=["--policy", "cache_aware"],
                                env={"KVGATE_ROUTING__SCRAPE_INTERVAL_MS": "100"})
        stack.enter_context(gw)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        holder, _ = _ask(client, "first")
        assert _ask(client, "second") == (holder, "prefix-hit")
        assert _entries(base, holder) > 0
        i = urls.index(f"http://{holder}")
        # the engine counted the prefix-cache queries: a restart shows as counters going back
        wait_for(lambda: "vllm:prefix_cache_queries_total" in httpx.get(f"{urls[i]}/metrics").text)

        sims[i].stop()  # restarted on the same port, with an empty cache
        stack.enter_context(sim_proc(ports[i], "--time-scale", "50", model=MODEL)[0])
        wait_for(lambda: _entries(base, holder) == 0, what="the restarted replica forgotten")
        # and its prefixes are learned again from the next requests
        wait_for(lambda: _ask(client, "third")[1] == "prefix-hit", what="a prefix hit again")


def test_a_replica_restarted_without_counters_is_not_thought_to_hold_its_old_prefixes() -> None:
    """vLLM started with ``--disable-log-stats`` exports no counters: a restart shows only as
    nothing listening at its address meanwhile (its /health refused). Its prefixes were
    still predicted as hits there after it came back empty ("prefix-hit" routes, 11 blocks
    remembered)."""
    ports = [free_port(), free_port()]
    args = ("--time-scale", "50", "--disable-log-stats")
    with ExitStack() as stack:
        sims = [stack.enter_context(sim_proc(port, *args, model=MODEL)[0]) for port in ports]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        gw, base = gateway_proc(upstreams=urls, args=["--policy", "cache_aware"])
        stack.enter_context(gw)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        holder, _ = _ask(client, "first")
        assert _ask(client, "second") == (holder, "prefix-hit")
        assert _entries(base, holder) > 0
        i = urls.index(f"http://{holder}")

        sims[i].stop()
        healthy = f'{{pool="default",replica="{holder}"}}'
        wait_for(lambda: metric_values(base, "kvgate_replica_healthy")[healthy] == 0,
                 what="the stopped replica found down")
        stack.enter_context(sim_proc(ports[i], *args, model=MODEL)[0])  # an empty cache
        wait_for(lambda: metric_values(base, "kvgate_replica_healthy")[healthy] == 1,
                 what="the restarted replica back")
        assert _entries(base, holder) == 0
        assert _ask(client, "third")[1] != "prefix-hit"


def _said(gw: Proc, msg: str, replica: str) -> bool:
    """Whether the gateway logged ``msg`` about ``replica`` (one JSON object a line)."""
    lines = (json.loads(line) for line in gw.output(None).splitlines() if line.startswith("{"))
    return any(e.get("msg", "").startswith(msg) and e.get("replica") == replica for e in lines)


def _engine_counted(url: str) -> bool:
    """Whether the engine's page counts prompt tokens (its counter is past 0)."""
    page = httpx.get(f"{url}/metrics").text
    found = re.search(r"^vllm:prompt_tokens_total(?:\{[^}]*\})? (\S+)$", page, re.M)
    return found is not None and float(found.group(1)) > 0


def _scrape_age(base: str, replica: str) -> float:
    ages = metric_values(base, "kvgate_replica_scrape_age_seconds")
    return min((v for labels, v in ages.items() if f'replica="{replica}"' in labels),
               default=float("inf"))


def test_a_replica_found_gone_is_logged_gone_and_restarted_once_back() -> None:
    """A replica whose process stopped (nothing listening at its address) was logged "replica
    restarted: its prefix cache starts empty" at the first scrape after its /health was
    refused, while it was still gone: an operator read a restart that had not happened. It
    is logged gone then, and restarted when a new engine answers (its counters went back)."""
    port = free_port()
    with ExitStack() as stack:
        sim = stack.enter_context(sim_proc(port, "--time-scale", "50", model=MODEL)[0])
        url = f"http://127.0.0.1:{port}"
        gw, base = gateway_proc(upstreams=[url],
                                env={"KVGATE_ROUTING__SCRAPE_INTERVAL_MS": "100"})
        stack.enter_context(gw)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        replica = _ask(client, "first")[0]  # the engine's counters count something
        wait_for(lambda: _engine_counted(url), what="the engine's counters counted it")
        # ... and the gateway scraped them: a restart is told by counters that went back,
        # which a last good scrape taken before they counted cannot show (a loaded machine's
        # scrape lagged the answer, and no "restarted" ever came)
        since = time.monotonic()
        wait_for(lambda: _scrape_age(base, replica) < time.monotonic() - since,
                 what="a scrape of the gateway's after the engine counted")

        sim.stop()
        wait_for(lambda: _said(gw, "replica gone", replica), what="the replica logged gone")
        assert not _said(gw, "replica restarted", replica), gw.output()

        stack.enter_context(sim_proc(port, "--time-scale", "50", model=MODEL)[0])
        wait_for(lambda: _said(gw, "replica restarted", replica),
                 what="the replica logged restarted once back")


def test_a_replica_never_up_is_not_logged_gone() -> None:
    """A replica down from the start (nothing ever listened at its address) was logged
    "replica gone (nothing listens at its address): its prefix cache is lost" beside its
    "replica down": there was no cache to lose, and an operator read that it had been up."""
    never = free_port()
    with ExitStack() as stack:
        sim, sim_url = sim_proc(None, "--time-scale", "50", model=MODEL)
        stack.enter_context(sim)
        replica = f"127.0.0.1:{never}"
        gw, base = gateway_proc(upstreams=[sim_url, f"http://{replica}"],
                                env={"KVGATE_ROUTING__SCRAPE_INTERVAL_MS": "100"})
        stack.enter_context(gw)
        wait_for(lambda: _said(gw, "replica down", replica), what="the replica logged down")

        def failed_scrapes() -> float:
            errors = metric_values(base, "kvgate_scrape_errors_total")
            return sum(v for labels, v in errors.items() if f'replica="{replica}"' in labels)

        # a "gone" is logged at the first scrape after the probe: two more have failed since
        counted = failed_scrapes()
        wait_for(lambda: failed_scrapes() >= counted + 2, what="two more failed scrapes")
        assert not _said(gw, "replica gone", replica), gw.output()
