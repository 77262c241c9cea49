"""Through Envoy as through the HTTP edge, vLLM's 501 (a feature its engine lacks) reaches the
official openai client with ``x-should-retry: false``: relayed by the picker as a plain 5xx,
the SDK sent it twice more (three requests for one unsupported feature). Real Envoy, picker
and HTTP gateway over one replica answering vLLM's 501."""

from __future__ import annotations

import openai
import pytest

from tests.integration.test_sdk_retry_hints import FailingReplica
from tests.support.epp import both_edges


@pytest.mark.parametrize("edge", ["http", "envoy"])
def test_a_501_is_not_retried_by_the_sdk_at_either_edge(edge: str) -> None:
    with FailingReplica() as replica, both_edges(replica.url, "m", {}) as bases:
        client = openai.OpenAI(base_url=f"{bases[edge]}/v1", api_key="none", max_retries=2,
                               timeout=30)
        with pytest.raises(openai.APIStatusError) as caught:
            client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2, n=3)
        assert caught.value.status_code == 501
        assert caught.value.response.headers.get("x-should-retry") == "false"
        assert replica.posts == 1
