"""Two more shapes routing was not tuned on: one prompt salted per tenant, and a decode/prefill mix.

Seeded and deterministic like `loadtest.replay.shapes` (`loadtest.replay.generators` registers
them):

- `salted_tenants`: a SaaS product whose many tenants all send the same product system prompt
  and the same few tool / few-shot blocks, each tenant with its own secret `cache_salt`
  (`ReplayRequest.tenant`: the replay salts every block per tenant, as the gateway does). The
  text is one; the cache holds a copy per tenant, so there are dozens of equally long prefixes
  of Zipf popularity: the top tenants' need copies for load, the tail's must not be copied.
- `decode_mix`: prefill-heavy requests (a question on a long Zipf-popular document, a short
  answer) beside decode-heavy ones (a short chat prompt on a shared system prompt, an answer of
  thousands of tokens). A decode-heavy request holds its replica's KV memory and decode batch
  for a minute while asking almost no prefill: a placement that weighs only queued prefill
  work piles them up where documents are cached, until the KV cache runs out and evicts them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loadtest.replay.draws import blocks, request, tokens, zipf
from loadtest.replay.workload import IdSource, ReplayRequest

__all__ = ["DecodeMixSpec", "SaltedSpec", "decode_mix", "decode_mix_drawn", "salted_tenants"]


@dataclass(frozen=True, slots=True)
class SaltedSpec:
    requests: int = 6000
    rate_per_s: float = 60.0
    tenants: int = 64
    tenant_zipf: float = 1.0  # the top tenant sends ~1/5 of the requests
    system_tokens: tuple[int, int] = (3072, 6144)  # the product's prompt, one text for all
    tools: int = 6  # tool / few-shot blocks after it, the same texts for every tenant
    tool_tokens: tuple[int, int] = (512, 3072)
    tool_zipf: float = 1.0
    input_tokens: tuple[int, int] = (32, 1024)
    output_tokens: tuple[int, int] = (16, 512)
    seed: int = 31


def salted_tenants(spec: SaltedSpec | None = None) -> list[ReplayRequest]:
    """Each request: a Zipf-drawn tenant, the one system prompt, a Zipf-drawn tool block, a
    new input; the same block ids for every tenant, told apart only by ``tenant`` (the salt)."""
    s = spec or SaltedSpec()
    rng, ids = random.Random(s.seed), IdSource()
    system = ids.take(blocks(tokens(rng, *s.system_tokens)))
    tools = [ids.take(blocks(tokens(rng, *s.tool_tokens))) for _ in range(s.tools)]
    tenant, tool = zipf(rng, s.tenants, s.tenant_zipf), zipf(rng, s.tools, s.tool_zipf)
    out, t = [], 0.0
    for _ in range(s.requests):
        t += rng.expovariate(s.rate_per_s)
        prompt = system + tools[tool()] + ids.take(blocks(tokens(rng, *s.input_tokens)))
        out.append(request(t, prompt, tokens(rng, *s.output_tokens), tenant=f"tenant-{tenant()}"))
    return out


@dataclass(frozen=True, slots=True)
class DecodeMixSpec:
    requests: int = 4000
    rate_per_s: float = 24.0  # busy: 60-70 long answers decoding per replica at once
    decode_probability: float = 0.5  # a decode-heavy request
    system_prompts: int = 3  # the decode-heavy requests' (chat, writing, code)
    system_tokens: tuple[int, int] = (512, 2048)
    chat_tokens: tuple[int, int] = (64, 512)
    long_output_tokens: tuple[int, int] = (1024, 4096)
    documents: int = 300  # the prefill-heavy requests'
    document_tokens: tuple[int, int] = (4096, 24_576)
    zipf: float = 0.9
    question_tokens: tuple[int, int] = (16, 256)
    short_output_tokens: tuple[int, int] = (8, 128)
    seed: int = 32


def decode_mix(spec: DecodeMixSpec | None = None) -> list[ReplayRequest]:
    """A decode-heavy chat request with ``decode_probability``, else a question on a
    document."""
    return decode_mix_drawn(spec)[0]


def decode_mix_drawn(spec: DecodeMixSpec | None = None) -> tuple[list[ReplayRequest], list[bool]]:
    """`decode_mix`'s requests and whether each is decode-heavy."""
    s = spec or DecodeMixSpec()
    rng, ids = random.Random(s.seed), IdSource()
    systems = [ids.take(blocks(tokens(rng, *s.system_tokens))) for _ in range(s.system_prompts)]
    docs = [ids.take(blocks(tokens(rng, *s.document_tokens))) for _ in range(s.documents)]
    doc = zipf(rng, s.documents, s.zipf)
    out, heavy, t = [], [], 0.0
    for _ in range(s.requests):
        t += rng.expovariate(s.rate_per_s)
        decode = rng.random() < s.decode_probability
        if decode:
            prompt = systems[rng.randrange(s.system_prompts)] + ids.take(
                blocks(tokens(rng, *s.chat_tokens)))
            answer = tokens(rng, *s.long_output_tokens)
        else:
            prompt = docs[doc()] + ids.take(blocks(tokens(rng, *s.question_tokens)))
            answer = tokens(rng, *s.short_output_tokens)
        out.append(request(t, prompt, answer))
        heavy.append(decode)
    return out, heavy
