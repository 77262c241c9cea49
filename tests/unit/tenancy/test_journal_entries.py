"""The key journal read back from Redis (`changed_keys`): an entry whose generation is not
ASCII digits makes the journal unusable (None: the caller reloads every key), not a crash."""

from __future__ import annotations

from gateway.tenancy.redis_records import changed_keys


def test_a_whole_journal_names_the_changed_keys() -> None:
    journal = ["3 key k3", "2 key k2", "1 key k1"]
    assert changed_keys(journal, 1, 3, "1 key k1") == ["k3", "k2"]


def test_a_generation_in_other_digits_makes_it_unusable() -> None:
    # str.isdigit takes a superscript two, which int() refuses (a ValueError before)
    for odd in ("\u00b2", "\u0663", "\uff13"):
        assert changed_keys([f"{odd} key k3", "2 key k2", "1 key k1"], 1, 3, "1 key k1") is None
