"""The retry budget a pool's requests share (`upstream.retry_budget_ratio`, `retry_budget_min`)."""

from __future__ import annotations

__all__ = ["RetryBudget"]


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
