"""The retry budget a pool's requests share (`upstream.retry_budget_ratio`, `retry_budget_min`)."""

from __future__ import annotations

from gateway.errors import KvgateError, RetryBudgetExhausted

__all__ = ["RetryBudget", "budget_spent", "try_failed"]


def budget_spent(failure: KvgateError | None) -> RetryBudgetExhausted:
    """The 503 of a request whose retry the pool's budget does not allow: its try's failure
    and the budget named (it said "The replicas are busy or failing; try again shortly.")."""
    why = "" if failure is None else f"{try_failed(failure)}, and "
    return RetryBudgetExhausted(
        f"{why}{'t' if why else 'T'}he pool's retry budget (upstream.retry_budget_ratio, "
        "upstream.retry_budget_min: retries are spent faster than requests arrive, its replicas "
        "busy or failing) allows no retry now; retry after 1s.")


def try_failed(failure: KvgateError) -> str:
    """A refused retry's answer opens with its try's failure (this budget's, flow control's
    in-flight bound: `FlowPump.retry_refused`)."""
    why = failure.message.rstrip(".")
    return f"The replica that took this request failed ({why[:1].lower()}{why[1:]})"


class RetryBudget:
    """Retries may not amplify an outage: each request deposits `ratio` tokens, each retry
    spends one; `reserve` tokens are there from the start (for low traffic). Clock-free."""

    __slots__ = ("_cap", "_ratio", "tokens")

    def __init__(self, ratio: float, reserve: int) -> None:
        self._ratio = ratio
        self._cap = float(max(reserve, 1) * 10)
        self.tokens = float(reserve)

    def deposit(self) -> None:
        self.tokens = min(self._cap, self.tokens + self._ratio)

    def try_spend(self) -> bool:
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False
