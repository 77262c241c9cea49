"""The status a Responses API failure event stands for (`gateway.sse.responses_error`).

A code kvgate did not know was a 500: a fault of the request (``invalid_image``,
``image_too_large``, ``context_length_exceeded``, an error naming its ``param``) was then tried
again on another replica when first, or charged to its replica mid-stream; and a code of
three digits was that status whatever it was (``"999"``, ``"200"``).
"""

from __future__ import annotations

import orjson
import pytest

from gateway.sse import StreamScanner, responses_error


def _error(code: object, param: object = None) -> bytes:
    return orjson.dumps({"type": "error", "code": code, "message": "m", "param": param,
                         "sequence_number": 2})


def _failed(code: object) -> bytes:
    return orjson.dumps({"type": "response.failed", "sequence_number": 2, "response": {
        "status": "failed", "error": {"code": code, "message": "m"}}})


@pytest.mark.parametrize("code", [
    "invalid_image", "invalid_image_url", "invalid_base64_image", "image_too_large",
    "image_too_small", "image_parse_error", "image_content_policy_violation",
    "image_file_not_found", "unsupported_image_media_type", "empty_image_file",
    "failed_to_download_image", "context_length_exceeded", "invalid_prompt",
    "invalid_request_error"])
def test_a_fault_of_the_request_is_a_400(code: str) -> None:
    assert responses_error(_error(code)) == (400, "m")
    assert responses_error(_failed(code)) == (400, "m")


def test_an_error_naming_a_param_is_a_400() -> None:
    assert responses_error(_error("some_new_code", param="input")) == (400, "m")
    assert responses_error(_error(None, param="tools")) == (400, "m")


@pytest.mark.parametrize(("code", "status"), [
    ("rate_limit_exceeded", 429), ("server_error", 500), ("vector_store_timeout", 500),
    ("something_else", 500), (None, 500), ("404", 404), (503, 503), ("429", 429)])
def test_known_and_unknown_codes(code: object, status: int) -> None:
    assert responses_error(_error(code)) == (status, "m")


@pytest.mark.parametrize("code", ["999", 999, "200", 200, 100, "302", 600, True])
def test_a_number_that_is_no_error_status_is_a_500(code: object) -> None:
    assert responses_error(_error(code)) == (500, "m")


def test_a_chat_error_event_code_that_is_no_error_status_is_a_500() -> None:
    scanner = StreamScanner(False, 1 << 20)
    scanner.feed(b'data: {"error": {"message": "m", "code": 999}}\n\n')
    assert scanner.error_code == 500
