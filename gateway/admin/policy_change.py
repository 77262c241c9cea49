"""What a refused policy write changed: a spill rule's refusal said only what the new document
is, naming whichever model came first. Removing a model premium spilled from, with an
awq-only model left, was refused as "'awq' is the tier's own pool for model 'embed' (spill
cycle)": a model the operator never touched, and no cycle. Against the policy in force, the
refusal now names the change that broke the rule, or says the problem was there before it.
"""

from __future__ import annotations

from typing import Any

from gateway.policy_doc import PolicyDoc, PolicyValidationError, check_spills, spill_problems

__all__ = ["spill_refusal"]


def spill_refusal(exc: PolicyValidationError, document: Any, in_force: PolicyDoc | None) -> str:
    """The message of a spill refusal of `document` (`check_spills`), with what the change
    did against `in_force`; `exc` as it is for any other refusal."""
    if in_force is None or not exc.field.endswith(".spill_to"):
        return str(exc)
    try:
        check_spills(in_force)
    except PolicyValidationError as old:
        if (old.field, old.message) == (exc.field, exc.message):
            added = _added(document, in_force)
            return (f"{exc} (already so in the policy in force: a write keeping it is "
                    "accepted, but this one adds " + ("; ".join(added) if added else
                                                      "another spill problem") + ")")
        return str(exc)
    try:
        new = PolicyDoc.model_validate(document)
    except ValueError:
        return str(exc)
    tier = exc.field.removeprefix("tiers.").removesuffix(".spill_to")
    changes = _changes(in_force, new, tier)
    return f"{exc}; this change {', '.join(changes)}" if changes else str(exc)


def _changes(old: PolicyDoc, new: PolicyDoc, tier: str) -> list[str]:
    """What `new` changes of `tier`'s spill edges against `old`, in words."""
    out: list[str] = []
    before = old.tiers.get(tier)
    after = new.tiers.get(tier)
    target = after.spill_to if after is not None else None
    if before is None or before.spill_to != target:
        out.append(f"sets tiers.{tier}.spill_to to {target!r}")
    for model in sorted(set(old.models) | set(new.models)):
        was, now = old.pool_for(model, tier), new.pool_for(model, tier)
        if was == now:
            continue
        if model not in new.models:
            out.append(f"removes model {model!r} (tier {tier} was served it from {was!r})")
        elif now is None:
            out.append(f"leaves model {model!r} without a pool for tier {tier}")
        else:
            out.append(f"serves model {model!r} from {now!r} for tier {tier}"
                       + (f" (was {was!r})" if was is not None else ""))
    return out


def _added(document: Any, in_force: PolicyDoc) -> list[str]:
    """The spill problems `document` has that `in_force` has not, as "field: message"."""
    try:
        new = PolicyDoc.model_validate(document)
    except ValueError:
        return []
    before = set(spill_problems(in_force))
    return [f"{f}: {m}" for f, m in spill_problems(new) if (f, m) not in before]
