"""Upstream error bodies re-shaped into OpenAI's, and the Responses-API id -> replica store."""

from __future__ import annotations

import orjson
import pytest

from gateway.errors import RetryBudgetExhausted, UpstreamTimeout
from gateway.responses import ResponseStore, response_id
from gateway.upstream_errors import error_in_success, openai_shaped

NESTED = b'{"error":{"message":"bad","type":"BadRequestError","param":"x","code":400}}'


@pytest.mark.parametrize(
    ("status", "body", "message", "type_"),
    [
        (404, b'{"detail":"Not Found"}', "Not Found", "NotFoundError"),  # FastAPI
        (401, b'{"error":"Unauthorized"}', "Unauthorized", "AuthenticationError"),  # --api-key
        (400, b'{"object":"error","message":"m","type":"BadRequestError","param":null,'
              b'"code":400}', "m", "BadRequestError"),  # vLLM < 0.10.1
        (500, b"Internal Server Error", "The upstream replica answered 500.",
         "InternalServerError"),
        (502, b'Traceback (most recent call last):\n  File "x"', "The upstream replica "
         "answered 502.", "BadGatewayError"),  # never a raw page
        (503, b"", "The upstream replica answered 503.", "ServiceUnavailableError"),
    ],
)
def test_non_openai_bodies_are_reshaped_keeping_the_status(
    status: int, body: bytes, message: str, type_: str,
) -> None:
    shaped = openai_shaped(status, body)
    assert shaped is not None
    err = orjson.loads(shaped)["error"]
    assert (err["message"], err["type"], err["code"]) == (message, type_, status)


def test_an_openai_body_is_kept() -> None:
    assert openai_shaped(400, NESTED) is None


def test_timeout_and_budget_errors() -> None:
    t = UpstreamTimeout("slow")
    assert (t.status, t.type_) == (504, "GatewayTimeoutError")
    b = RetryBudgetExhausted("busy")
    assert b.status == 503 and (b"retry-after", b"1") in b.headers()


def test_response_store_is_per_tenant_and_bounded() -> None:
    store = ResponseStore(capacity=2)
    store.remember("resp_a", "t1", "p", "r1")
    store.remember("resp_b", "t1", "p", "r2")
    assert store.home("resp_a", "t2") is None  # another tenant never reaches it
    assert store.foreign("resp_a", "t2") and not store.foreign("resp_a", "t1")
    assert not store.foreign("resp_unknown", "t2")  # never relayed here: cannot tell
    assert store.home("resp_a", "t1") == ("t1", "p", "r1")  # (and it is now the newest)
    store.remember("resp_c", "t1", "p", "r3")
    assert store.home("resp_b", "t1") is None and len(store) == 2


@pytest.mark.parametrize(
    ("blob", "rid"),
    [(b'{"id":"resp_1a2b","object":"response","output":[{"id":"msg_9"}]}', "resp_1a2b"),
     (b'event: response.created\ndata: {"type":"response.created","response":'
      b'{"id":"resp_xyz","status":"in_progress"}}\n\n', "resp_xyz"),
     (b'data: {"type":"response.output_item.added","item":{"id":"msg_1"}}\n\n', None)],
)
def test_response_id(blob: bytes, rid: str | None) -> None:
    assert response_id(blob) == rid


def test_fastapis_validation_list_names_each_field_never_the_input() -> None:
    detail = [{"type": "int_parsing", "loc": ["body", "messages", 0, "content"],
               "msg": "Input should be a valid string", "input": "prompt text"}] * 5
    err = orjson.loads(openai_shaped(422, orjson.dumps({"detail": detail})) or b"")["error"]
    assert err == {"message": "5 validation errors: " + "; ".join(
        ["messages.0.content: Input should be a valid string"] * 3) + " (and 2 more)",
        "type": "UnprocessableEntityError", "param": "messages.0.content", "code": 422}
    odd = orjson.loads(openai_shaped(422, b'{"detail": [{"loc": 1}]}') or b"")["error"]
    assert (odd["message"], odd["param"]) == ("The upstream replica answered 422.", None)


@pytest.mark.parametrize(("body", "said"), [
    (b'{"error": {"message": "no healthy upstream", "code": 503}}', "no healthy upstream"),
    (b'\n {"object": "error", "message": "busy", "code": 503}', "busy"),
    (b'{"error": "Unauthorized"}', "Unauthorized"),
    # answers, not errors: a Responses API object's `error` is null, and comes after its id
    (b'{"error": null, "id": "resp_1"}', None),
    (b'{"id": "resp_1", "object": "response", "error": {"message": "x"}}', None),
    (b'{"id": "c", "choices": [{"message": {"content": "{\\"error\\": 1}"}}]}', None),
])
def test_an_error_in_a_success_is_told_from_an_answer(body: bytes, said: str | None) -> None:
    assert error_in_success(body) == said
