"""Why a replica is out of rotation now, in the doctor's words, and the one change for it:
from kvgate's own reason for it (`Replica.reason`, as ``GET /admin/replicas`` and ``/readyz``
give it).

Some reasons say nothing is broken where the generic "check its process, host and network"
would send an operator: a replica serving another model (its /health says 200), one refusing
kvgate's credentials, one whose engine was put to sleep (vLLM's sleep mode: its process,
host and network are fine; it was named "down" with that generic action), and one found
frozen (nothing at all heard from it while requests waited: a stopped process, a frozen host,
a black-holed network; named as a generic outage).
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.replica_engine import ASLEEP, ASLEEP_ASKED, ASLEEP_SAID

__all__ = ["DownCause", "down_cause"]

_ASLEEP = (ASLEEP, ASLEEP_SAID, ASLEEP_ASKED)
_FROZEN = "no answer from it for "  # `Replica.frozen`'s reason, before its number


@dataclass(frozen=True)
class DownCause:
    label: str  # "down", "asleep", "frozen": the summary's first word after "replica"
    why: str
    action: str
    until: str  # when kvgate takes it back, in words
    deliberate: bool = False  # put out on purpose (asleep): a warning, not critical


_BACK = "it answers again"
_GENERIC = ("check the replica: its vLLM process (GET /health), its host and the network "
            "between; kvgate probes it and takes it back on its own")


def down_cause(reason: str) -> DownCause:
    """The cause of a replica out now (``reason``: kvgate's; "" when not known or back)."""
    if reason.startswith("serves model"):
        return DownCause("down", f"it {reason}",
                         "serve the pool's model there (vLLM --model / --served-model-name) or "
                         "take the replica out of this pool (a wrong Service selector, another "
                         "model rolled out there); kvgate takes it back once its /v1/models "
                         "lists the pool's model", _BACK)
    if reason.startswith("refused the gateway's credentials"):
        return DownCause("down", f"it {reason}",
                         "give the pool the replica's key: the variable its api_key_env names "
                         "must hold the replica's vLLM --api-key; kvgate takes it back once it "
                         "accepts it", _BACK)
    if reason in _ASLEEP:
        return DownCause("asleep", reason,
                         "wake it if it should serve (vLLM's POST /wake_up, a dev-mode server), "
                         "or take it out of the pool while it sleeps; kvgate takes it back once "
                         "it is awake (its KV cache was discarded: its prefixes are computed "
                         "again)", "it wakes", deliberate=True)
    if reason.startswith(_FROZEN):
        return DownCause("frozen", reason,
                         "check whether its vLLM process is stopped (SIGSTOP, a debugger, a "
                         "paused container), its host frozen or the network to it black-holed; "
                         "kvgate probes it and takes it back once it answers", _BACK)
    if reason:
        return DownCause("down", f"kvgate took it out of rotation ({reason})", _GENERIC, _BACK)
    return DownCause("down", "kvgate took it out of rotation, its health checks or requests "
                     "failing", _GENERIC, _BACK)
