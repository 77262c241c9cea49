"""The 503 of a request whose retry the pool's retry budget does not allow names the try's
failure and the budget, with Retry-After: it said "The replicas are busy or failing; try
again shortly." whatever happened."""

from __future__ import annotations

from gateway.errors import UpstreamError
from gateway.retry_budget import budget_spent


def test_the_answer_names_the_failure_and_the_budget() -> None:
    err = budget_spent(UpstreamError("The replica did not answer.", reason="connect"))
    assert err.status == 503 and err.retry_after == 1
    assert err.message == (
        "The replica that took this request failed (the replica did not answer), and the "
        "pool's retry budget (upstream.retry_budget_ratio, upstream.retry_budget_min: retries "
        "are spent faster than requests arrive, its replicas busy or failing) allows no retry "
        "now; retry after 1s.")
    assert budget_spent(None).message.startswith("The pool's retry budget (")
