"""The offline replay's flow control bounds a replica's requests in flight as the gateway
does: the policy's ``pools.<p>.max_inflight`` for the replayed pool, or ``kvgate replay
--flow-max-inflight N`` (the gateway's ``flow.max_inflight``). The replay took the config's
rule alone, without such a bound, and had no flag for it: a fleet whose replicas take two
requests at a time replayed as if they took 64 (a burst of short prompts queued nothing).
"""

from __future__ import annotations

import json
from pathlib import Path

from gateway.cli import main as kvgate
from gateway.policy_doc import PoolConfig
from loadtest.replay.flow import FlowDriver, FlowSpec, default_policy
from loadtest.replay.offline import FleetSpec, replay_offline
from loadtest.replay.workload import ReplayRequest
from routing.router import RouterConfig

BURST = 20  # short prompts arriving together at one replica


def _burst() -> list[ReplayRequest]:
    return [ReplayRequest(arrival_s=0.0, prompt_tokens=200, output_tokens=50,
                          block_ids=(1000 + i,)) for i in range(BURST)]


def test_the_policys_in_flight_bound_for_the_pool_holds_the_burst() -> None:
    fleet = FleetSpec(replicas=1, kv_tokens=65_536)
    policy = default_policy().model_copy(
        update={"pools": {fleet.pool: PoolConfig(replicas=["http://127.0.0.1:1"], max_inflight=2)}})
    driver = FlowDriver(FlowSpec(policy=policy))
    result = replay_offline(_burst(), fleet, RouterConfig(), flow=driver)
    assert driver.queued == BURST - 2  # two went at once, the rest waited their turn
    assert len(result.outcomes) == BURST and not driver.shed


def test_the_cli_flag_bounds_each_replica(tmp_path: Path) -> None:
    trace = tmp_path / "burst.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 0, "input_length": 200,
                                         "output_length": 50, "hash_ids": [1000 + i]}) + "\n"
                             for i in range(BURST)))
    out = tmp_path / "s.json"
    assert kvgate(["replay", str(trace), "--offline", "--replicas", "1", "--flow-control",
                   "on", "--flow-max-inflight", "2", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    flow = (summary[0] if isinstance(summary, list) else summary)["flow"]
    assert flow["queued"] == BURST - 2
