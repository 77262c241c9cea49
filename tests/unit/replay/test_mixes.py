"""The salted-tenants and decode-mix shapes (`loadtest.replay.mixes`): seeded, and their shape."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from loadtest.replay.draws import BLOCK
from loadtest.replay.mixes import (
    DecodeMixSpec,
    SaltedSpec,
    decode_mix,
    decode_mix_drawn,
    salted_tenants,
)
from loadtest.replay.reference import pooled_reference_hit_rate

REPLICA = 262_144  # one replica's KV tokens at the smaller size


def test_salted_tenants_send_one_text_that_only_their_salt_tells_apart() -> None:
    s = SaltedSpec()
    reqs = salted_tenants(s)
    system = reqs[0].block_ids[: s.system_tokens[0] // BLOCK]
    assert all(r.block_ids[: len(system)] == system for r in reqs)  # one text for all
    tenants = Counter(r.tenant for r in reqs)
    assert len(tenants) >= s.tenants * 3 // 4  # dozens of tenants seen
    top = [n for _, n in tenants.most_common()]
    assert top[0] > 4 * top[9] > 0  # Zipf: a few hot tenants, a long tail
    # the salt is what makes copies: the same requests unsalted share far more of the cache
    # (one copy of each text), so a placement that treated the text as one prefix would be
    # told apart from one that holds a copy per tenant
    fleet = 8 * REPLICA
    salted = pooled_reference_hit_rate(reqs, REPLICA // 4)
    unsalted = pooled_reference_hit_rate([replace(r, tenant="default") for r in reqs],
                                          REPLICA // 4)
    assert unsalted > salted + 0.1
    assert pooled_reference_hit_rate(reqs, fleet) > 0.85  # the fleet holds every copy


def test_decode_mix_splits_decode_heavy_from_prefill_heavy() -> None:
    s = DecodeMixSpec()
    reqs, heavy = decode_mix_drawn(s)
    assert reqs == decode_mix(s)
    decode = [r for r, h in zip(reqs, heavy, strict=True) if h]
    prefill = [r for r, h in zip(reqs, heavy, strict=True) if not h]
    assert len(decode) / len(reqs) == pytest.approx(s.decode_probability, abs=0.03)
    assert all(r.output_tokens >= s.long_output_tokens[0] for r in decode)
    assert all(r.prompt_tokens <= s.system_tokens[1] + s.chat_tokens[1] + 2 * BLOCK
               for r in decode)
    assert all(r.output_tokens <= s.short_output_tokens[1] for r in prefill)
    assert all(r.prompt_tokens >= s.document_tokens[0] for r in prefill)
    # the decode-heavy requests ask for most of the decoding, the others for most of the prefill
    out_share = sum(r.output_tokens for r in decode) / sum(r.output_tokens for r in reqs)
    in_share = sum(r.prompt_tokens for r in prefill) / sum(r.prompt_tokens for r in reqs)
    assert out_share > 0.95 and in_share > 0.9
    # the documents repeat (Zipf): their prefill is mostly a cache hit for a placement keeping
    # them; the decode-heavy requests share only their short system prompts
    assert len({r.block_ids[0] for r in prefill}) < len(prefill) / 4
    assert len({r.block_ids[0] for r in decode}) == s.system_prompts
