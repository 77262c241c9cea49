"""A body declared ``application/x-www-form-urlencoded`` through both edges (`kvgate serve`;
`kvgate epp` behind a real Envoy), over a real simulator. Form fields (``model=...&prompt=...``)
are the HTTP edge's 415 naming JSON (`errors.FormBody`: vLLM answers 415 to any body not
declared JSON); the picker answered them 400 "The request body is not valid JSON". A JSON body
declared a form (``curl -d '{...}'``) is read as JSON at both."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.support.epp import both_edges
from tests.support.gateway import inflight
from tests.support.procs import sim_proc

MODEL = "sim-model"
EDGES = ["http", "envoy"]
FORM = {"content-type": "application/x-www-form-urlencoded"}


@pytest.fixture(scope="module")
def edges() -> Iterator[dict[str, str]]:
    sim, url = sim_proc(None, "--time-scale", "20", model=MODEL)
    with sim, both_edges(url, MODEL, {}) as every:
        yield every


@pytest.mark.parametrize("edge", EDGES)
def test_form_fields_are_the_415_naming_json(edges: dict[str, str], edge: str) -> None:
    resp = httpx.post(f"{edges[edge]}/v1/completions", headers=FORM, timeout=20,
                      content=f"model={MODEL}&prompt=hi&max_tokens=2".encode())
    assert resp.status_code == 415, resp.text
    assert resp.json() == {"error": {
        "message": "/v1/completions takes a JSON body (Content-Type: application/json), not "
                   "form fields (application/x-www-form-urlencoded).",
        "type": "UnsupportedMediaTypeError", "param": None, "code": 415}}
    assert resp.headers["x-request-id"]
    assert inflight(edges[f"{edge}-metrics"]) == 0


@pytest.mark.parametrize("edge", EDGES)
def test_json_declared_a_form_is_served(edges: dict[str, str], edge: str) -> None:
    body = orjson.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2})
    resp = httpx.post(f"{edges[edge]}/v1/completions", headers=FORM, content=body, timeout=20)
    assert resp.status_code == 200, resp.text
    assert resp.json()["object"] == "text_completion"
