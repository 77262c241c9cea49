"""What the peers hold of this gateway's own load, per replica, and which of it the next batch
carries (`PublishedLoad.changes`): the loads changed since the last batch; every non-zero one,
as a sign of life, once per heartbeat; after Redis failed us, all of them, zeros included; and
a replica that left our pools, as gone. A heartbeat's and a re-send's batch carries every
non-zero load of ours (`whole`): a reader takes the replicas it leaves out as zero."""

from __future__ import annotations

from collections.abc import Mapping

from routing.peers import ZERO, ReplicaLoad

__all__ = ["PublishedLoad"]

_NONE = ReplicaLoad(-1)  # "never published"


class PublishedLoad:
    def __init__(self, heartbeat_s: float) -> None:
        self._heartbeat_s = heartbeat_s
        self.published: dict[str, ReplicaLoad] = {}  # what peers believe of our load
        # Redis failed us since our last batch: peers may hold a load of ours we have since
        # cleared (a zero record lost, or never written while Redis was down), so the next
        # batch carries our load on every replica, zeros included (`changes`)
        self.resend_all = False
        self.last_beat = float("-inf")
        # the last `changes` carried our whole non-zero load (a heartbeat, a re-send): a
        # reader that missed a zero record (the stream wiped before it read it) learns of it
        # from the next heartbeat, not never (zeros are sent once: heartbeats skip them)
        self.whole = False

    def changes(self, loads: Mapping[str, ReplicaLoad], now: float,
                routes: bool) -> dict[str, ReplicaLoad] | None:
        """The loads the next batch carries (now recorded as published); None when a batch
        would carry nothing: no `routes`, no load changed and no heartbeat due."""
        beat = now - self.last_beat >= self._heartbeat_s
        self.whole = beat or self.resend_all
        if self.resend_all:  # after an outage: all of it, what went to zero meanwhile too
            self.resend_all = False
            changed = dict(loads)
            self.last_beat = now
        elif beat:  # everything peers should hold, and a sign of life
            changed = {k: v for k, v in loads.items() if v or k in self.published}
            self.last_beat = now
        else:
            changed = {k: v for k, v in loads.items() if self.published.get(k, _NONE) != v
                       and (v or k in self.published)}
        if not self.published.keys() <= loads.keys():
            # a replica that left our pools (drained and reaped, removed by a policy change)
            # between two batches: its last published load would stay in peers' views for
            # as long as we live, heartbeats and all, if we did not say it is gone
            changed.update(dict.fromkeys(self.published.keys() - loads.keys(), ZERO))
        if not (routes or changed or beat):
            return None
        for k, v in changed.items():
            if v:
                self.published[k] = v
            else:
                self.published.pop(k, None)
        return changed

    def forget(self) -> None:
        """A batch failed: peers may hold none of it; the next one re-sends the whole load."""
        self.published.clear()
        self.last_beat = float("-inf")
