"""The state a `TenantResolver` keeps (`ResolverBase`): what it loaded and applied, how fresh it
is, what it noticed of the store (wipes, skipped records), and its settings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from gateway.tenancy.last_state import LastState
from gateway.tenancy.models import PolicySnapshot, SkippedRecord, StoreSnapshot
from gateway.tenancy.principal import Principal
from gateway.tenancy.salts import SaltDeriver
from gateway.tenancy.store import TenantStore

__all__ = ["CONFIGURED", "FROM_STORE", "IN_TOUCH_SLACK_S", "LAST_READABLE", "WHOLE_RELOAD_S",
           "WIPE_NOTICE_S", "PolicyCallback", "ResolverBase"]

WIPE_NOTICE_S = 600.0  # how long health() reports a wipe (store_wiped; degraded if not restored)
# A reload reads only what changed (`TenantStore.changes_since`) unless the last whole read is
# older than this, and the store is read whole at least this often even when the generation
# did not change: a record changed behind the store's back without bumping the generation (by
# hand, in redis-cli: a key record deleted to revoke it) is still read within this long.
WHOLE_RELOAD_S = 30.0
# A wiped store is restored only from a state the store confirmed within two checks and this
# slack before the wipe was found (`ResolverRepair._in_touch_s`): a gateway cut off longer
# may hold keys revoked meanwhile, and nothing in a wiped store says which.
IN_TOUCH_SLACK_S = 1.0
PolicyCallback = Callable[[PolicySnapshot], None]


@dataclass(frozen=True, slots=True)
class _State:
    generation: int = 0
    by_key: dict[str, Principal] = field(default_factory=dict)
    by_tenant: dict[str, Principal] = field(default_factory=dict)
    policy: PolicySnapshot | None = None
    group_epochs: dict[str, int] = field(default_factory=dict)
    keyed: frozenset[str] = frozenset()  # the tenants with an API key
    key_counts: dict[str, int] = field(default_factory=dict)  # tenant -> its key records



# where the policy in force came from (`TenantResolver.policy_source`)
FROM_STORE, LAST_READABLE, CONFIGURED = "store", "last readable", "configuration"


class ResolverBase:
    """The resolver's attributes; `resolver.TenantResolver` is the resolver."""

    def __init__(
        self,
        store: TenantStore,
        salts: SaltDeriver,
        *,
        poll_interval_s: float = 0.5,
        max_staleness_s: float | None = 300.0,
        clock: Callable[[], float] = time.monotonic,
        reseed: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self._store = store
        self._reseed = reseed
        # the seeding from configuration postponed at start (`seed_later`), until it is done
        self._seed_due: Callable[[], Awaitable[object]] | None = None
        self._resets = 0
        self._wiped_at = float("-inf")  # when a wipe was last noticed (this clock)
        self._mark: str | None = None  # the store's bootstrap marker our state was read under
        self._wipe_seen: str | None = None  # the marker of the last wipe reported
        self._wipe_restored = False  # the last wipe noticed was restored (by any gateway)
        self._restored: str | None = None  # the marker of the last restore made here
        # when this process, cut off when the store was wiped, began waiting for a gateway in
        # touch with it to restore it (`ResolverRepair._reseeded`)
        self._wipe_wait: float | None = None
        self._applied: StoreSnapshot | None = None  # the state in force, as applied
        self._went_back: tuple[float, str] | None = None  # (when, what) `went_back.went_back`
        self._salts = salts
        self._poll = poll_interval_s
        self._max_stale = max_staleness_s
        self._clock = clock
        self._state = _State()
        self._loaded = False
        self._fresh_at = clock()  # when the last load ended: the staleness served
        # when the last load began: as of when the state read holds the store's writes (the
        # age a wipe is judged by, `ResolverRepair._reseeded`)
        self._confirmed_at = self._fresh_at
        # when the store's uptime first could not be read at a wipe (`_missed_writes`)
        self._uptime_wait: float | None = None
        self._whole_at = float("-inf")  # when the store was last read whole (this clock)
        self._degraded_reason: str | None = "not loaded yet"
        # another reason to report degraded, the store answering (`secret_check`)
        self.also_degraded: Callable[[], str | None] | None = None
        self._answers = False
        self._down_cause = "unreachable"  # `store_cause` of the last failed load
        self._skipped: dict[str, SkippedRecord] = {}  # fingerprint -> record, of the last load
        self._skipped_total: dict[str, int] = {}  # kind -> records skipped since start
        self._dirty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._unsubscribe: Callable[[], None] | None = None
        self._policy_callbacks: list[PolicyCallback] = []
        # the configuration's policy: in force while the stored one is unreadable and no
        # readable one was ever loaded (`Tenancy.start` sets it)
        self.configured_policy: PolicySnapshot | None = None
        # a worker of several (`server.workers`): where the workers keep the state they last
        # loaded, for one started again while the store does not answer (`gateway.workers`)
        self.last_state: LastState | None = None
        self._policy_source: str | None = None
        # one refresh at a time: the sync loop's and an admin write's (`read_your_writes`)
        # must not apply their snapshots out of order. This, not a generation compare, keeps
        # an older read from landing over a newer one: a later read is made after the earlier
        # one landed, and Redis answers it with the newer state. A lower generation is no
        # proof of an older state (the counter deleted by hand and counted again, a restore
        # from a backup): refusing it would keep revoked keys working.
        self._refreshing = asyncio.Lock()

