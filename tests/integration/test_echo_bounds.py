"""A client's model name echoed in an error is bounded as everywhere else
(`gateway.errors.shown_name`: the first `NAME_CHARS` characters and the name's length), not
sent back whole: real gateway, the official openai client."""

from __future__ import annotations

import openai

from gateway.errors import NAME_CHARS
from tests.support.gateway import gateway_proc
from tests.support.procs import free_port


def test_a_long_model_name_is_not_echoed_whole_while_no_replica_answered() -> None:
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens: its served name stays unknown
    gw, base = gateway_proc(upstreams=[down], ready=False)
    model = "m" * 100_000
    with gw:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        try:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        except openai.APIStatusError as exc:
            assert exc.status_code == 503
            message = exc.response.json()["error"]["message"]
        else:
            raise AssertionError("answered")
    assert "No ready replica for the model" in message
    assert len(message) < NAME_CHARS + 400, len(message)
    assert f"... ({len(model)} characters)" in message
