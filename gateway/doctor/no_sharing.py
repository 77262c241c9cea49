"""The action of a pool's in-flight imbalance when its traffic shares no prefixes (the sampled
potential hit rate under ``hit_potential_min``): the bounded-load rule's "hot prefixes" cannot
be the cause there. Seen live: a replica 100 ms further away (network) under unique short
prompts, and the fast replica a cache-aware router sent its first requests to, were both told
to lower ``routing.load_factor``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gateway.doctor.findings import Evidence, cite, fmt_value, known, median_of
from gateway.doctor.window import ReplicaStats

__all__ = ["no_hot_prefixes"]


def no_hot_prefixes(hot: ReplicaStats, peers: Sequence[ReplicaStats], potential: float,
                    ev: list[Evidence]) -> str:
    """What to check instead, its sharing added to the evidence ``ev``."""
    ev.append(cite("kvgate router affinity index (sampled)", "prefix sharing the traffic "
                   "allows", potential, "<", None, unit="%"))
    theirs = [v for r in peers if known(v := r.time_per_request)]
    mine, median = hot.time_per_request, median_of(theirs) if theirs else math.nan
    return (f"the traffic shares no prefixes to pile up on {hot.id} (sampled potential hit "
            f"rate {potential:.0%}), and its engine is no slower: its requests take longer "
            f"there outside the engine (time per request {fmt_value(mine, 's')} vs "
            f"{fmt_value(median, 's')} on its peers: check its host, network and HTTP frontend "
            "against theirs), or the router sent it more while it learned the replicas (short "
            "windows at the start of the load)")
