"""Values a client chooses (the model name) cannot forge log lines: newlines and other control
characters come out escaped in the text format, and JSON lines stay one JSON object each.
(Header values cannot carry them: the HTTP parser refuses control characters there.)"""

from __future__ import annotations

from collections.abc import Callable

import httpx
import orjson
import pytest

from tests.support.gateway import gateway_proc
from tests.support.procs import Proc

SimFactory = Callable[..., tuple[Proc, str]]
FORGED = "2026-01-01 00:00:00,000 ERROR gateway.admin FAKE LOG LINE"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_client_values_cannot_forge_log_lines(sim_factory: SimFactory, fmt: str) -> None:
    _, sim = sim_factory("--time-scale", "50", model="m")
    gw, base = gateway_proc(upstreams=[sim], args=["--log-format", fmt])
    with gw:
        for model in (f"x\n{FORGED}", f"x\r{FORGED}", f"x\u2028{FORGED}", f"x\x85{FORGED}",
                      "abc\x1b[2Jdef\x7f"):
            r = httpx.post(f"{base}/v1/chat/completions", timeout=10,
                           json={"model": model, "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 404, r.text  # no such model; the request line is logged
        assert gw.stop() == 0
        out = gw.output(tail=None)
    lines = out.splitlines()  # Python's line breaks: \n, \r, \x85, \u2028, ...
    assert not [line for line in lines if line.startswith(FORGED)], out
    assert "\x1b" not in out and "\x7f" not in out
    if fmt == "json":
        assert all(orjson.loads(line) for line in lines if line.startswith("{"))
    else:
        # a value with a space is quoted (JSON's escapes), so it reads as one field
        assert 'model="x\\n2026-01-01' in out and 'model="x\\r2026-01-01' in out
        assert 'model="abc\\u001b[2Jdef\\x7f"' in out


def test_a_huge_model_name_is_logged_cut_as_its_404_shows_it(sim_factory: SimFactory) -> None:
    """A 60 KB model name is cut in the request's log line as in its 404 (256 characters and
    the length): the 404 was cut, the log line kept it whole, 60 KB per request."""
    _, sim = sim_factory("--time-scale", "50", model="m")
    gw, base = gateway_proc(upstreams=[sim], args=["--log-format", "json"])
    with gw:
        r = httpx.post(f"{base}/v1/chat/completions", timeout=10, json={
            "model": "a" * 60_000, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 404 and "... (60000 characters)" in r.text, r.text
        assert gw.stop() == 0
        out = gw.output(tail=None)
    line = next(x for x in out.splitlines() if '"msg":"request"' in x)
    assert len(line) < 2_000 and "... (60000 characters)" in line, line[:300]
