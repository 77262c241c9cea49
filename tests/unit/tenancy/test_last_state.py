"""The workers' last tenancy state on disk: what one writes another reads back whole, a
file it cannot read is ignored, never half trusted, and of the workers' files the state the
store vouched for last is the one a restarted worker starts from."""

from __future__ import annotations

import os
import stat
import time
from dataclasses import replace
from pathlib import Path

import pytest

from gateway.policy_doc import Limits, parse_policy
from gateway.tenancy.last_state import LastState
from gateway.tenancy.models import KeyRecord, PolicySnapshot, StoreSnapshot, Tenant

POLICY = parse_policy({
    "pools": {"p": {"served_model": "m-p", "replicas": ["http://127.0.0.1:9"]}},
    "models": {"m": {"default": "p"}},
    "tiers": {"free": {"limits": {"rpm": 60}}},
})
SNAP = StoreSnapshot(
    generation=7,
    tenants={"acme": Tenant(id="acme", tier="free", limits=Limits(rpm=5), salt_group="g")},
    keys={"ab" * 32: KeyRecord(key_id="key_0", tenant_id="acme", key_hash="ab" * 32,
                               created_at=1.5)},
    policy=PolicySnapshot(3, POLICY),
    group_epochs={"g": 2},
)


def test_a_saved_state_reads_back_as_it_was(tmp_path: Path) -> None:
    state = LastState(tmp_path, 0)
    state.save(SNAP, "mark-1", time.time())
    saved = LastState(tmp_path, 0).load()  # another worker's
    assert saved is not None
    assert saved.snapshot == SNAP and saved.mark == "mark-1"
    assert saved.snapshot.tenants["acme"].limits.model_fields_set == {"rpm"}  # overrides only
    assert stat.S_IMODE(os.stat(tmp_path / "tenancy-state-0.json").st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["tenancy-state-0.json"]  # no temporary file


def test_its_age_is_since_the_store_last_confirmed_it(tmp_path: Path) -> None:
    state = LastState(tmp_path, 0)
    state.save(SNAP, None, time.time())
    an_hour_ago = time.time() - 3600
    os.utime(tmp_path / "tenancy-state-0.json", (an_hour_ago, an_hour_ago))
    old = state.load()
    assert old is not None and old.age_s >= 3599
    state.confirmed(time.time())
    now = state.load()
    assert now is not None and now.age_s < 3599


def test_no_file_is_no_state(tmp_path: Path) -> None:
    assert LastState(tmp_path, 0).load() is None
    LastState(tmp_path, 0).confirmed(time.time())  # nothing to touch: no error
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", [
    b"", b"{", b"[]", b'{"format": 2}',
    b'{"format": 1, "generation": 1, "mark": null, "tenants": ["{\\"id\\": \\"-bad\\"}"],'
    b' "keys": [], "policy": null, "group_epochs": {}}',
    b'{"format": 1, "generation": 1, "mark": 5, "tenants": [], "keys": [], "policy": null,'
    b' "group_epochs": {}}',
    b'{"format": 1, "generation": 1, "mark": null, "tenants": [], "keys": [], "policy": null,'
    b' "group_epochs": {"g": "2"}}',
    b'{"format": 1, "generation": 1, "mark": null, "tenants": [], "keys": [],'
    b' "policy": [1, "{\\"pools\\": 3}"], "group_epochs": {}}',
    b'{"format": 1, "generation": 1, "mark": null, "tenants": [], "keys": [],'
    b' "policy": [], "group_epochs": {}}',  # an IndexError: it stopped the gateway
    b'{"format": 1, "generation": 1, "mark": null, "tenants": [], "keys": [5],'
    b' "policy": null, "group_epochs": {}}',
    b'{"format": 1, "generation": 1, "mark": null, "tenants": [], "keys": [["a", "b"]],'
    b' "policy": null, "group_epochs": {}}',
    b'{"format": 1, "generation": 1, "mark": null, "tenants": [],'
    b' "keys": [["a", "b", "c", "yesterday"]], "policy": null, "group_epochs": {}}',
])
def test_an_unreadable_file_is_ignored(tmp_path: Path, content: bytes,
                                       caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "tenancy-state-0.json").write_bytes(content)
    assert LastState(tmp_path, 0).load() is None
    assert "unreadable" in caplog.text


def test_a_directory_it_cannot_write_costs_only_the_file(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    LastState(tmp_path / "gone", 0).save(SNAP, None, time.time())
    assert "cannot keep the tenancy state" in caplog.text


async def test_keep_writes_a_state_once(tmp_path: Path) -> None:
    """The periodic whole reload finds the same generation: not written again."""
    state = LastState(tmp_path, 0)
    await state.keep(SNAP, "m", time.time())
    (tmp_path / "tenancy-state-0.json").write_bytes(b"{}")  # so a second write would show
    await state.keep(SNAP, "m", time.time())
    assert (tmp_path / "tenancy-state-0.json").read_bytes() == b"{}"
    await state.keep(SNAP, "another mark", time.time())  # a wiped store re-seeded
    saved = state.load()
    assert saved is not None and saved.mark == "another mark"


async def test_a_key_revoked_by_hand_leaves_the_file_at_the_next_whole_reload(
    tmp_path: Path,
) -> None:
    """A key record deleted in redis-cli leaves the generation as it was; the workers drop
    the key at their next whole reload, and so must the file, or a worker restarted while
    Redis is down admits a key its siblings refuse."""
    state = LastState(tmp_path, 0)
    await state.keep(SNAP, "m", time.time())
    await state.keep(replace(SNAP, keys={}), "m", time.time())  # same generation, same marker
    saved = state.load()
    assert saved is not None and saved.snapshot.keys == {}
    await state.keep(replace(SNAP, tenants={}, keys={}), "m", time.time())  # a tenant deleted
    saved = state.load()
    assert saved is not None and saved.snapshot.tenants == {}


async def test_a_state_it_could_not_write_is_not_vouched_for(tmp_path: Path) -> None:
    """A write that failed (a full disk) leaves the previous state in the file: touching it
    as the store confirms the newer one made that older state (a key revoked since in it)
    look fresh to a worker restarted while Redis is down."""
    state = LastState(tmp_path, 0)
    await state.keep(SNAP, "m", time.time())
    an_hour_ago = time.time() - 3600
    os.utime(tmp_path / "tenancy-state-0.json", (an_hour_ago, an_hour_ago))
    os.mkdir(state._tmp)  # the next write fails
    await state.keep(replace(SNAP, generation=8, keys={}), "m", time.time())  # the key revoked
    state.confirmed(time.time())
    saved = state.load()
    assert saved is not None and saved.snapshot.keys and saved.age_s >= 3599
    os.rmdir(state._tmp)
    await state.keep(replace(SNAP, generation=8, keys={}), "m", time.time())  # written again
    state.confirmed(time.time())
    saved = state.load()
    assert saved is not None and saved.snapshot.keys == {} and saved.age_s < 3599


async def test_a_slow_writers_older_state_never_passes_for_the_newest(tmp_path: Path) -> None:
    """Two workers shared one file: worker 0 read the store, worker 1 read it after a key
    was revoked and wrote that, then worker 0's slow write of the older state replaced it,
    and worker 1's next confirmation made it look fresh: a worker restarted while Redis is
    down admitted the revoked key. Each worker keeps its own file, stamped with when its
    read began; a restarted worker takes the latest stamp."""
    zero, one = LastState(tmp_path, 0), LastState(tmp_path, 1)
    older, newer = SNAP, replace(SNAP, generation=8, keys={})  # the key revoked in between
    read_by_zero = time.time() - 10
    await one.keep(newer, "m", read_by_zero + 1)
    one.confirmed(read_by_zero + 1)
    await zero.keep(older, "m", read_by_zero)  # the slow write lands last
    zero.confirmed(read_by_zero)
    one.confirmed(read_by_zero + 2)  # the store confirms worker 1's state
    saved = LastState(tmp_path, 0).load()  # worker 0 restarted while Redis is down
    assert saved is not None and saved.snapshot.keys == {} and saved.age_s >= 7
    await zero.keep(newer, "m", read_by_zero + 3)  # worker 0 caught up: either file will do
    saved = LastState(tmp_path, 1).load()
    assert saved is not None and saved.snapshot.keys == {} and saved.age_s < 8


async def test_an_unreadable_file_leaves_the_next_latest(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture
                                                        ) -> None:
    await LastState(tmp_path, 1).keep(SNAP, "m", time.time() - 10)
    (tmp_path / "tenancy-state-0.json").write_bytes(b"{")  # the latest stamp
    saved = LastState(tmp_path, 0).load()
    assert saved is not None and saved.snapshot == SNAP and "unreadable" in caplog.text
