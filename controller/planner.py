"""The controller's plan: prompts, strict JSON parsing, and the host's validation.

The controller model answers one JSON object:

    {"restore": ["u...", ...], "pin": ["u...", ...], "evict_first": ["u...", ...]}

(and, for the second, finer call, {"units": ["u...", ...]}). Parsing is strict: one object, only
these keys, lists of strings, nothing else; anything else is rubbish and the host evicts nothing
because of it. IDs are opaque to the host: it checks them against the session's units and drops
unknown, duplicate and conflicting ones; it never reads their text. Pins, the budget, the tail and
leases are enforced afterwards by the pager.

Depends on contextd.wire (PageState), controller.pager and controller.units; no model code, no
language-specific logic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from contextd.wire import PageState
from controller.pager import Pager, Plan
from controller.units import UnitIndex

PLAN_KEYS = ("restore", "pin", "evict_first")
MAX_IDS = 64


class PlanError(ValueError):
    """The controller's answer is not a plan (the turn runs on the default retention)."""


@dataclass
class UnitPlan:
    restore: list[str] = field(default_factory=list)
    pin: list[str] = field(default_factory=list)
    evict_first: list[str] = field(default_factory=list)


def _extract_object(text: str) -> str:
    """The first top-level JSON object in a model's answer (models like to wrap it in prose)."""
    start = text.find("{")
    if start < 0:
        raise PlanError("no JSON object in the answer")
    depth = 0
    in_string = escaped = False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    raise PlanError("the JSON object is truncated")


def _id_list(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PlanError(f"{key!r} must be a list of strings")
    if len(value) > MAX_IDS:
        raise PlanError(f"{key!r} names {len(value)} ids; at most {MAX_IDS}")
    return list(value)


def parse_plan(text: str) -> UnitPlan:
    try:
        data = json.loads(_extract_object(text))
    except json.JSONDecodeError as exc:
        raise PlanError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise PlanError("the plan must be a JSON object")
    unknown = set(data) - set(PLAN_KEYS)
    if unknown:
        raise PlanError(f"unknown keys {sorted(unknown)}")
    return UnitPlan(*(_id_list(data.get(k, []), k) for k in PLAN_KEYS))


def parse_units(text: str) -> list[str]:
    try:
        data = json.loads(_extract_object(text))
    except json.JSONDecodeError as exc:
        raise PlanError(f"not JSON: {exc}") from None
    if not isinstance(data, dict) or set(data) != {"units"}:
        raise PlanError('the answer must be {"units": [...]}')
    return _id_list(data["units"], "units")


@dataclass
class Validation:
    plan: Plan
    dropped: list[str]


def validate(unit_plan: UnitPlan, units: UnitIndex, pager: Pager) -> Validation:
    """Opaque unit IDs -> page indices. Unknown, duplicate and conflicting IDs are dropped (and
    reported); a unit named in `pin` is never in `evict_first`, a hard-pinned page never either."""
    dropped: list[str] = []
    seen: set[str] = set()

    def known(ids: list[str], key: str) -> list[str]:
        out = []
        for unit_id in ids:
            if unit_id not in units.units:
                dropped.append(f"{key}: unknown id {unit_id[:24]!r}")
            elif unit_id in seen:
                dropped.append(f"{key}: duplicate id {unit_id}")
            else:
                seen.add(unit_id)
                out.append(unit_id)
        return out

    pin = known(unit_plan.pin, "pin")
    restore = known(unit_plan.restore, "restore")
    evict_first = known(unit_plan.evict_first, "evict_first")
    hard = {p.index for p in pager.pages if p.pin is not None}
    evict_pages = []
    for page in units.pages_of(evict_first):
        if page in hard:
            dropped.append("evict_first: page of a pinned unit")
            continue
        evict_pages.append(page)
    restore_pages = [p for p in units.pages_of(restore) if pager.pages[p].state is PageState.COLD]
    return Validation(Plan(restore=restore_pages, pin=units.pages_of(pin), evict_first=evict_pages), dropped)


def plan_prompt(incoming: str, units: UnitIndex, limit_units: int) -> str:
    """The one foreground question: which units matter for what is about to happen. Closed
    clusters appear by their summary alone (the refining call looks inside one), units of the
    open cluster one by one, so the prompt stays short however long the session grows."""
    lines = []
    for cluster in units.clusters.values():
        if cluster.closed:
            lines.append(f"cluster {cluster.cluster_id}: {cluster.summary or '(no summary yet)'}")
            continue
        for unit_id in cluster.unit_ids:
            lines.append(f"unit {unit_id}: {units.units[unit_id].summary or '(no summary yet)'}")
    catalogue = "\n".join(lines) or "(no units yet)"
    return (
        "You manage the memory of a coding agent. Earlier parts of the session are stored as units, "
        "older ones grouped in clusters; each has an id and a short summary.\n\n"
        f"{catalogue}\n\n"
        f"The next message is:\n{incoming[:2000]}\n\n"
        f"Which units (or a cluster to look inside) should be brought back into memory for it (at most "
        f"{limit_units}), which must stay pinned, and which can be evicted first? Answer with one JSON object "
        'and nothing else, for example {"restore": ["<id>"], "pin": [], "evict_first": ["<id>"]}'
    )


def refine_prompt(incoming: str, units: UnitIndex, cluster_id: str, limit_units: int) -> str:
    """The second call: pick units inside one cluster that looked relevant but coarse."""
    cluster = units.clusters[cluster_id]
    lines = [f"unit {u}: {units.units[u].summary or '(no summary yet)'}" for u in cluster.unit_ids]
    return (
        "These units belong to one part of a coding agent's session:\n" + "\n".join(lines) +
        f"\n\nThe next message is:\n{incoming[:2000]}\n\n"
        f"Which of these units does it need (at most {limit_units})? Answer with one JSON object and "
        'nothing else: {"units": ["<unit id>"]}'
    )


def summary_prompt(text: str) -> str:
    return ("Summarise this part of a coding session in one sentence, keeping names, numbers and "
            f"identifiers exactly as written:\n\n{text[:6000]}\n\nSummary:")
