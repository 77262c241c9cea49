"""Requests a client may send that vLLM answers one way and kvgate once answered another: a
file upload (`multipart/form-data`) to a JSON route, and vLLM's operational pages asked with a
trailing slash. A real `kvgate serve` in front of a simulated replica, over loopback."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import orjson
import pytest

from tests.support.gateway import gateway_proc, inflight, wait_for
from tests.support.procs import Proc

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
SimFactory = Callable[..., tuple[Proc, str]]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings"])
def test_a_multipart_body_is_a_415_saying_so(sim_factory: SimFactory, path: str) -> None:
    """`curl -F` / a form upload: vLLM refuses a body not declared JSON with a 415; kvgate said
    400 "The request body is not valid JSON: no digit after sign" (the form's boundary line)."""
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw, httpx.Client(base_url=base, timeout=30) as c:
        resp = c.post(path, data={"model": MODEL}, files={"file": ("a.wav", b"RIFF....")})
        assert resp.status_code == 415, resp.text
        err = resp.json()["error"]
        assert err == {"message": f"{path} takes a JSON body (Content-Type: application/json), "
                                  "not multipart/form-data (file uploads go to "
                                  "/v1/audio/transcriptions and /v1/audio/translations).",
                       "type": "UnsupportedMediaTypeError", "param": None, "code": 415}
        # JSON declared as a url-encoded form (curl's `-d`) is still read as the JSON it is,
        # and the connection still serves
        ok = c.post("/v1/chat/completions", content=orjson.dumps(CHAT),
                    headers={"Content-Type": "application/x-www-form-urlencoded"})
        assert ok.status_code == 200, ok.text
        wait_for(lambda: inflight(base) == 0, what="in-flight back to 0")


def test_vllms_pages_with_a_trailing_slash_are_served(sim_factory: SimFactory) -> None:
    """vLLM (FastAPI) redirects `/health/` to `/health` and probes follow the redirect; kvgate
    answered a 404 "Unknown path /health/.", failing a probe written that way."""
    _, sim = sim_factory("--time-scale", "50")
    gw, base = gateway_proc(upstreams=[sim])
    with gw, httpx.Client(base_url=base, timeout=30) as c:
        for page in ("/health", "/version", "/ping", "/healthz", "/readyz"):
            plain, slashed = c.get(page), c.get(f"{page}/")
            assert slashed.status_code == plain.status_code == 200, (page, slashed.text)
            assert slashed.headers["content-type"] == plain.headers["content-type"]
            if page != "/readyz":  # (its staleness moves)
                assert slashed.content == plain.content
        assert c.post("/ping/").status_code == 200  # SageMaker's probe, as vLLM's /ping
        assert c.get("/metrics/").text.startswith("# HELP")
        wrong = c.post("/health/")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "GET, HEAD"
        unknown = c.get("/nope/")
        assert unknown.status_code == 404
        assert unknown.json()["error"]["message"] == "Unknown path /nope/."
