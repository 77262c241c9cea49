"""The admin API's policy routes: the versioned policy document (ETag / If-Match; PUT replaces
it, PATCH merges a JSON merge patch into it, RFC 7396: `merge_patch`). A stored policy this
gateway cannot read is a 409 saying what it runs on meanwhile; a PATCH keeps the stored fields
this kvgate does not know (`gateway.tenancy.unknown`).
"""

# No `from __future__ import annotations`: FastAPI must see the route signatures' real
# annotations, including the `Who` dependency alias the router factory passes in.

import asyncio
import logging
import random
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Body, Header
from fastapi.responses import JSONResponse

from gateway.admin.deps import CHECK_TRIES, AdminContext
from gateway.admin.policy_change import spill_refusal
from gateway.config.selfloop import own_address_lines
from gateway.errors import (
    BadRequest,
    Conflict,
    NotFound,
    PreconditionFailed,
    StaleCheck,
    UnreadableRecord,
    shown_name,
)
from gateway.policy_doc import (
    DEFAULT_TIER,
    PolicyDoc,
    PolicyValidationError,
    parse_policy,
    spill_problems,
)
from gateway.tenancy.models import PolicySnapshot
from gateway.urls import restore_hidden, shown_policy

__all__ = ["merge_patch", "policy_routes"]

log = logging.getLogger(__name__)

PATCH_TRIES = 8  # a policy PATCH without If-Match: merges onto a newer version this often
# after a try another write overtook, a random pause of up to this, doubled each time: patches
# through two gateways in step kept overtaking the same one (16 at once: 2-10 of 480 a 409
# after 8 tries once the audit entry was written by the write's script, one round trip less)
PATCH_BACKOFF_S = 0.002


async def _put_checked(
    ctx: AdminContext, doc: PolicyDoc, expected: int | None, keep_unknown: bool
) -> PolicySnapshot:
    """Store `doc` once no tenant uses a tier it leaves out, checked again while tenants
    keep changing in between."""
    for _ in range(CHECK_TRIES):
        # stored only if no tenant was written since this generation: one put in a tier
        # the document leaves out, meanwhile, would be refused every request (403)
        at = await ctx.store.generation()
        tenants = await ctx.store.list_tenants()
        for tenant in tenants:
            if tenant.tier not in doc.tiers and tenant.tier != DEFAULT_TIER:
                raise BadRequest(
                    f"tiers: tier {tenant.tier!r} is used by tenant {tenant.id!r}",
                    param="tiers")
        await _known_fair_ids(ctx, doc, {t.id for t in tenants})
        try:
            return await ctx.store.put_policy(doc, if_version=expected,
                                              keep_unknown=keep_unknown, tenants_at=at)
        except StaleCheck:
            continue
    raise Conflict("the tenants kept changing while the policy was checked against "
                   "their tiers; retry")


async def _known_fair_ids(ctx: AdminContext, doc: PolicyDoc, tenants: set[str]) -> None:
    """A `fairness.tenants` id this write adds must be a tenant: a typo gave no share, in
    silence. Ids the policy in force holds already stay (a deleted tenant's weight does not
    refuse every later write for a change it did not make)."""
    try:
        snap = await ctx.store.get_policy()
    except UnreadableRecord:
        snap = None
    before = set(snap.doc.fairness.tenants) if snap is not None else set()
    for tid in sorted(set(doc.fairness.tenants) - before - tenants):
        name = shown_name(tid)
        raise BadRequest(
            f"fairness.tenants.{name}: no tenant {name!r}: its weight would give no share "
            "(create the tenant first, or correct the id)", param=f"fairness.tenants.{name}")


MAX_VERSION_DIGITS = 64  # an If-Match version longer than this is no version (int64 has 19)


@dataclass(frozen=True, slots=True)
class IfMatch:
    """An ``If-Match`` header (RFC 9110 13.1.1): ``*`` (`any`), or the policy versions its
    entity-tags name. It uses the strong comparison, so a weak tag (``W/"3"``) matches no
    version: one was taken as ``"3"``, and a write went through on a validator that does not
    promise the same document."""

    any: bool
    versions: frozenset[int]
    weak: bool  # a weak tag was sent (the 412 says why it did not match)

    def check(self, current: int) -> None:
        """412 unless it matches `current` (0: no policy stored, which ``*`` does not match)."""
        if (self.any and current > 0) or current in self.versions:
            return
        if self.any:
            said = "no policy document is stored, which If-Match * does not match"
        else:
            said = f"policy version is {current}"
            if self.versions:
                said += ", not " + " or ".join(str(v) for v in sorted(self.versions))
            if self.weak:
                said += ('; a weak entity-tag (W/"...") never matches: If-Match uses the '
                         'strong comparison, send the ETag as GET /policy gives it')
        raise PreconditionFailed(f"{said}; fetch it again and retry", param="If-Match")


def _parse_if_match(value: str | None) -> IfMatch | None:
    """The ``If-Match`` header (None: none). Its tags must be policy versions, quoted (bare
    digits are taken too), in ASCII digits: `str.isdigit` also takes a superscript two (a
    header byte 0xB2) that `int` refuses, and thousands of digits `int` will not convert --
    each was a 500 with a traceback."""
    if value is None:
        return None
    if value.strip() == "*":
        return IfMatch(any=True, versions=frozenset(), weak=False)
    versions: set[int] = set()
    weak = False
    tags = [item.strip() for item in value.split(",")]
    # empty list elements are ignored (RFC 9110 5.6.1.2), not a header of none
    for tag in [t for t in tags if t] or [""]:
        is_weak = tag.startswith("W/")
        text = tag.removeprefix("W/")
        if len(text) >= 2 and text[0] == text[-1] == '"':
            text = text[1:-1]
        if not (text.isascii() and text.isdigit()) or len(text) > MAX_VERSION_DIGITS:
            raise BadRequest('If-Match: expected a policy version such as "3"',
                             param="If-Match")
        if is_weak:
            weak = True
        else:
            versions.add(int(text))
    return IfMatch(any=False, versions=frozenset(versions), weak=weak)


async def _expected(ctx: AdminContext, if_match: IfMatch | None) -> int | None:
    """The version a PUT is stored over (None: any, or none stored yet), or a 412: one
    version named is checked by the store's own compare-and-set; ``*`` and a list against
    the version read now (then compare-and-set against it)."""
    if if_match is None:
        return None
    if len(if_match.versions) == 1 and not if_match.any:
        return next(iter(if_match.versions))
    try:
        snap = await ctx.store.get_policy()
    except UnreadableRecord:  # stored, unreadable: `*` matches it (the way out), no version
        if if_match.any:
            return None
        raise
    current = 0 if snap is None else snap.version
    if_match.check(current)
    return current


def policy_routes(router: APIRouter, ctx: AdminContext, Who: Any) -> None:
    @router.get("/policy")
    async def get_policy(who: Who) -> JSONResponse:
        try:
            snap = await ctx.store.get_policy()
        except UnreadableRecord as exc:
            raise UnreadableRecord(f"{exc.message}; {ctx.running_on()}") from None
        if snap is None:
            raise NotFound("no policy document has been stored yet")
        doc = snap.doc.model_dump(mode="json", exclude_unset=True)
        return JSONResponse(shown_policy(doc), headers={"etag": f'"{snap.version}"'})

    @router.put("/policy")
    async def put_policy(
        who: Who,
        document: Annotated[dict[str, Any], Body()],
        if_match: Annotated[str | None, Header()] = None,
    ) -> JSONResponse:
        """Replace the whole document: a section or field left out takes its default. A
        replica URL shown with hidden credentials (as GET answers it) gets the stored ones."""
        condition = _parse_if_match(if_match)
        if restore_hidden(document, None) is not None:  # (None: it has such a URL)
            try:
                stored = await ctx.store.get_policy()
            except UnreadableRecord:
                stored = None
            _restore(document, stored.doc.model_dump(mode="json") if stored else None)
        return await _store(ctx, who, document, await _expected(ctx, condition), "policy.put")

    @router.patch("/policy")
    async def patch_policy(
        who: Who,
        patch: Annotated[dict[str, Any], Body()],
        if_match: Annotated[str | None, Header()] = None,
    ) -> JSONResponse:
        """A JSON merge patch (RFC 7396) on the policy in force: objects merge key by key,
        `null` removes a key (its default applies), anything else replaces; the result is
        validated and stored as a PUT of it would be. With If-Match, against that version."""
        expected = _parse_if_match(if_match)
        async with ctx.patching:  # this process's patches in turn: only other gateways race
            return await _patch_in_turn(ctx, who, patch, expected)


async def _store(
    ctx: AdminContext, who: str, document: Any, expected: int | None, action: str,
    keep_unknown: bool = False,
) -> JSONResponse:
    """Validate a whole policy document and store it as the next version (over `expected`
    only, when given)."""
    doc = await _parsed_against(ctx, document)
    if not doc.pools:  # as at start: a policy without pools would serve no model at all
        raise BadRequest("pools: at least one pool is required", param="pools")
    await _refuse_own_address(ctx, doc)
    async with ctx.audited(who, action, "policy") as audit:
        snap = await _put_checked(ctx, doc, expected, keep_unknown)
        audit.add(version=snap.version)
    body = snap.doc.model_dump(mode="json", exclude_unset=True)
    return JSONResponse(shown_policy(body), headers={"etag": f'"{snap.version}"'})


async def _patch_in_turn(
    ctx: AdminContext, who: str, patch: dict[str, Any], expected: IfMatch | None
) -> JSONResponse:
    """Merge onto the version in force and store the result over that version; another
    write landing in between (and no version named by the client) merges again."""
    for attempt in range(PATCH_TRIES):
        if attempt:
            await asyncio.sleep(random.uniform(0, PATCH_BACKOFF_S * 2 ** attempt))
        snap = await ctx.store.get_policy()
        if snap is None:
            raise NotFound("no policy document has been stored yet")
        if expected is not None:
            expected.check(snap.version)
        current = snap.doc.model_dump(mode="json", exclude_unset=True)
        merged = merge_patch(current, patch)
        _restore(merged, current)
        # validated first: `30.0` over a stored 30 compares equal, and was answered 200
        _parsed(merged, snap.doc)
        if merged == current:  # e.g. `{}`: nothing changes, no new version, no audit
            return JSONResponse(shown_policy(current),
                                headers={"etag": f'"{snap.version}"'})
        # stored only over the version it was merged onto, with the fields of that
        # version this kvgate does not know
        try:
            return await _store(ctx, who, merged, snap.version, "policy.patch",
                                keep_unknown=True)
        except PreconditionFailed:
            if expected is not None:  # the client's version is not the latest any more
                raise
            # another write landed after the read: merge onto it (a client that named
            # no version got a 412 for a version it never sent)
    raise Conflict("the policy document kept changing while this patch was merged into "
                   "it; retry")


async def _refuse_own_address(ctx: AdminContext, doc: PolicyDoc) -> None:
    """A replica at this gateway's own address is refused, as `kvgate serve` refuses one at
    start: every request sent to it would come back here, hop after hop. Checked against
    the answering gateway's own host and ports (another gateway checks its own). A name is
    resolved (up to 2 s) in a thread: a policy write pays it, the event loop does not."""
    deps = ctx.deps
    if not deps.own_ports:
        return
    pools = {name: pool.replicas for name, pool in doc.pools.items()}
    loops = await asyncio.to_thread(own_address_lines, pools, deps.listen_host, deps.own_ports)
    if loops:
        raise BadRequest(loops[0], param=loops[0].partition(":")[0])


async def _parsed_against(ctx: AdminContext, document: Any) -> PolicyDoc:
    """`_parsed` against the policy in force, read only when a spill rule refuses it."""
    try:
        return parse_policy(document)
    except PolicyValidationError as exc:
        if not exc.field.endswith(".spill_to"):
            raise BadRequest(str(exc), param=exc.field or None) from None
    try:
        snap = await ctx.store.get_policy()
    except UnreadableRecord:
        snap = None
    return _parsed(document, snap.doc if snap is not None else None)


def _parsed(document: Any, in_force: PolicyDoc | None) -> PolicyDoc:
    """A policy document validated (strict numbers and booleans), or the 400 naming the
    field (a spill rule's refusal also what the document changed of `in_force`)."""
    try:
        return parse_policy(document)
    except PolicyValidationError as exc:
        if (kept := _kept_spill_problems(exc, document, in_force)) is not None:
            return kept
        raise BadRequest(spill_refusal(exc, document, in_force),
                         param=exc.field or None) from None


def _kept_spill_problems(exc: PolicyValidationError, document: Any,
                         in_force: PolicyDoc | None) -> PolicyDoc | None:
    """`document` when its only problems are spill problems the policy in force has already
    (a write changing an unrelated field was refused for them), else None. The spill check
    runs last in `parse_policy`: every other check passed."""
    if in_force is None or not exc.field.endswith(".spill_to"):
        return None
    try:
        doc = PolicyDoc.model_validate(document)
    except ValueError:
        return None
    kept = spill_problems(doc)
    if set(kept) - set(spill_problems(in_force)):
        return None
    for field, message in kept:
        log.warning("policy write accepted with a spill problem already in force: %s: %s",
                    field, message)
    return doc


def _restore(document: Any, stored: dict[str, Any] | None) -> None:
    """Credentials back into replica URLs sent hidden (`restore_hidden`), or a 400."""
    if (hidden := restore_hidden(document, stored)) is not None:
        raise BadRequest(f"{hidden}: a hidden replica URL no stored replica matches; send it "
                         "with its credentials", param="pools")


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7396: ``patch`` applied to ``target`` (neither is changed)."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out
