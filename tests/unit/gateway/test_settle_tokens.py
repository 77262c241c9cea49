"""What a request is charged against its tenant's TPM when it ends (`settle_tokens`), what flow
control keeps of it (`spent_tokens`), and the streamed output both are estimated from
(`output_chars`): table-driven, no I/O."""

from __future__ import annotations

import pytest

from gateway.body import ParsedBody
from gateway.request import ProxiedRequest
from gateway.sse import output_chars
from gateway.tenancy.limits import Admission

CHAT = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"%s"}}]}\n\n'


@pytest.mark.parametrize(
    ("block", "chars"),
    [
        (CHAT % b"", 0),  # vLLM's role-only first chunk
        (CHAT % b"abcd", 4),
        (CHAT % b"ab" + CHAT % b"cdefgh", 8),  # two events in one read
        (CHAT % b'a\\"b', 4),  # an escaped quote does not end the string
        (b'data: {"choices":[{"delta":{"reasoning":"think"}}]}\n\n', 5),
        (b'data: {"choices":[{"text":"xyz","index":0}]}\n\n', 3),  # completions
        (b'data: {"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"{}"}}]}}]}\n\n',
         2),
        (b'event: response.output_text.delta\ndata: {"delta":"hello"}\n\n', 5),
        # a Responses stream's end repeats its text: counted once, from the deltas
        (b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", '
         b'"delta": "hi"}\n\n'
         b'event: response.output_text.done\ndata: {"type": "response.output_text.done", '
         b'"text": "hello"}\n\n'
         b'event: response.content_part.done\ndata: {"type": "response.content_part.done", '
         b'"part": {"type": "output_text", "text": "hello"}}\n\n', 2),
        (b'data: {"type":"response.function_call_arguments.done","arguments":"{}"}\n\n', 0),
        (b": keep-alive\n\n", 0),
        (b"data: [DONE]\n\n", 0),
    ],
)
def test_output_chars(block: bytes, chars: int) -> None:
    assert output_chars(block) == chars


def _req(*, replica: str = "r1", used: int | None = None, streamed: int | None = None,
         status: int = 200, reserved: int = 410) -> ProxiedRequest:
    req = ProxiedRequest("/v1/chat/completions", "chat", b"id", 0.0)
    req.parsed = ParsedBody({}, "m", True, 10)  # a prompt of 10 tokens (estimated)
    req.replica, req.used, req.streamed, req.status = replica, used, streamed, status
    req.adm = Admission(allowed=True, tenant_id="t", limit_tokens=1000, reserved_tokens=reserved)
    return req


@pytest.mark.parametrize(
    ("req", "tokens"),
    [
        (_req(used=57), 57),  # the replica's usage, whatever else is known
        (_req(replica="none", status=499), 0),  # left before any replica had it
        (_req(status=499, streamed=0), 10),  # left before the first event: its prompt
        (_req(status=499, streamed=21), 16),  # ... after 21 characters: 6 tokens of output
        (_req(status=502, streamed=40), 20),  # a stream cut short
        (_req(status=499), 10),  # a whole answer whose client left: nothing reached it
        (_req(status=400), 10),  # refused by its replica before any output
        (_req(status=504, streamed=10_000), 410),  # never more than was reserved
    ],
)
def test_settle_tokens(req: ProxiedRequest, tokens: int) -> None:
    assert req.settle_tokens() == tokens


def test_nothing_to_settle_without_an_admission() -> None:
    req = _req(status=499, streamed=8)
    req.adm = None
    assert req.settle_tokens() is None


@pytest.mark.parametrize(
    ("req", "tokens"),
    [
        (_req(used=57), 57),
        (_req(replica="none", status=499), 0),
        (_req(status=499, streamed=21), 16),
        # no reservation bounds it (flow control keeps at most what it charged at the send)
        (_req(status=504, streamed=10_000), 2510),
    ],
)
def test_spent_tokens_without_an_admission(req: ProxiedRequest, tokens: int) -> None:
    """What flow control's fair share keeps of a request (`FlowGate._done`), with or without
    a TPM admission."""
    req.adm = None
    assert req.spent_tokens() == tokens
