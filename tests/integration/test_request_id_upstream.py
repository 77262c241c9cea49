"""Two requests with one client X-Request-Id at once, through kvgate to one replica: vLLM takes
the header for its own request id, and an engine from before it made those unique inside
refuses the second one ("Request id ... already running") or mixes their outputs. kvgate
forwarded the client's id as it was; the replica now gets it with a kvgate id appended, a
different one per request, while the client's answers carry its own id.

A real gateway, the official openai client, a simulated replica (its `/sim/requests` shows the
headers it got).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable

import httpx
import openai

from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

MODEL = "sim-model"
RID = "client-fixed-id"


async def _ask_twice(base: str) -> list[openai.types.chat.ChatCompletion]:
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=30)
    async with client:
        raws = await asyncio.gather(*(client.chat.completions.with_raw_response.create(
            model=MODEL, messages=[{"role": "user", "content": f"question {i}"}],
            max_tokens=12, extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Id": RID}) for i in range(2)))
    assert [raw.headers["x-request-id"] for raw in raws] == [RID, RID]  # the client's own
    return [raw.parse() for raw in raws]


def test_one_client_id_on_two_requests_reaches_the_replica_as_two_ids(
    sim_factory: Callable[..., tuple[Proc, str]],
) -> None:
    _, sim = sim_factory(model=MODEL)
    gw, base = gateway_proc(upstreams=[sim])
    with gw:
        answers = asyncio.run(_ask_twice(base))
        lines = [json.loads(ln) for ln in gw.output(None).splitlines() if '"msg":"request"' in ln]
    got = [item["headers"]["x-request-id"]
           for item in httpx.get(f"{sim}/sim/requests", timeout=5).json()["requests"]]
    assert len(got) == 2 and got[0] != got[1], got
    assert all(re.fullmatch(f"{RID}-[0-9a-f]{{32}}", rid) for rid in got), got
    # each answer is its own request's: vLLM's id is `chatcmpl-` + the id it was sent
    assert sorted(a.id for a in answers) == sorted(f"chatcmpl-{rid}" for rid in got)
    # kvgate's request lines name both: the client's id and the one its replica got
    assert [line["request_id"] for line in lines] == [RID, RID]
    assert sorted(line["upstream_request_id"] for line in lines) == sorted(got)
    for answer in answers:
        assert answer.choices[0].message.content
        assert answer.usage is not None and answer.usage.completion_tokens == 12
