"""A refusal that passes within a minute is left to the SDKs' retries; one whose wait is
longer than the window says ``x-should-retry: false`` (`RateLimitedBeyondWindow`)."""

from __future__ import annotations

from gateway.tenancy.limits import Admission


def _hint(wait_s: float) -> bytes | None:
    exc = Admission(allowed=False, tenant_id="t", reason="tpm", retry_after_s=wait_s).error()
    assert exc.status == 429
    return dict(exc.headers()).get(b"x-should-retry")


def test_a_wait_within_the_window_is_left_to_the_sdks_retries() -> None:
    assert _hint(0.5) is None and _hint(60.0) is None


def test_a_wait_past_the_window_is_not_retried() -> None:
    assert _hint(60.5) == b"false" and _hint(3600.0) == b"false"
