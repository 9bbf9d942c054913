"""Offload planning at capture, behind one call: `plan(manager, step)`.

Why one call: what a captured pipeline offloads, and where, follows from one step's order and the
manager's `OffloadConfig` alone: the events (each group's forward, backward start and last reader), the
groups whose window is too short to offload (`offload.min_window`), resident mode's banks (given by hand,
`offload.explicit_banks`; searched over the simulated step, `offload.timing.search_banks`, from estimated
costs; or the colouring, `offload.plan.assign_banks`) and the kept groups and shared slots that
`OffloadManager.allocate` derives from them. The builder (`runtime.build.capture_ranks`) says what the step
is (`StepInputs`: its actions in order, each captured forward's group, each stage's weight-matrix elements,
the tokens of a microbatch) and calls `plan` once; nothing here knows ranks or pipelines.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from qeffect.errors import UserError
from qeffect.offload.group import OffloadGroup, OffloadManager
from qeffect.offload.plan import Event, assign_banks, backward_order, explicit_banks
from qeffect.offload.timing import SearchResult, StepCosts, search_banks
from qeffect.schedule import Action, ActionKind

# an action's offload event (`offload.plan.Event`): its group's forward, backward start, last reader
EVENT_KINDS = {ActionKind.F: "F", ActionKind.DI: "B", ActionKind.DW: "E"}

# Action durations for the bank search, from a chunk's matrix FLOPs: ESTIMATE_FLOPS plus ESTIMATE_ACTION_MS
# per action fit the per-layer action times the simulation was calibrated with (h2048 and h4096, each from its
# measured step); the rest of the step (optimizer, embedding) is taken as ESTIMATE_TAIL of the actions' time.
# The plans found are not very sensitive to them: timed with the calibrated durations, with them scaled by
# 0.6 or 1.6, or with another weight for the last stage, the estimate's plan ran about as fast as a plan
# searched with those durations, and ahead of the colouring (`scripts/offload_sim.py --robustness CONFIG`).
ESTIMATE_FLOPS = 1e15
ESTIMATE_ACTION_MS = 0.09
ESTIMATE_TAIL = 0.4


@dataclass(frozen=True)
class StepInputs:
    """What offload planning needs of one step, from whoever built the pipeline that runs it."""

    order: Sequence[Action]  # the step's actions in execution order (every rank's that this manager serves)
    groups: Mapping[tuple[int, int], OffloadGroup]  # each captured forward's group, by (stage, microbatch)
    elements: Mapping[int, int]  # each stage's weight-matrix elements (`matrix_elements` of its chunk)
    tokens: int  # tokens per microbatch (microbatch_size * seq_len)


@dataclass(frozen=True)
class OffloadPlan:
    """What `plan` decided (the manager holds the same after `allocate`)."""

    events: list[Event]  # of the groups (`plan_chains`: of each (stage, microbatch))
    backward: list[OffloadGroup]  # the groups in the order their backwards start (`plan_chains`: with repeats)
    banks: list[int] | None  # resident: each group's bank, in backward order; release: None
    search: SearchResult | None  # resident, `bank_plan = "search"`: the search's result


def named_events(order: Iterable[tuple[int, Action]]) -> list[Event]:
    """One step's offload events as `step_events` gives them, each group named (stage, microbatch): for the
    plans made from a schedule alone (tests, `scripts/offload_sim.py`), before any pipeline exists."""
    return [(EVENT_KINDS[a.kind], (a.stage, a.microbatch)) for _, a in order]


def step_events(order: Iterable[Action], groups: Mapping[tuple[int, int], Hashable]) -> list[Event]:
    """One step's offload events in execution order: F, backward start (dI) and last reader (dW) of each
    group in `groups` (an action whose (stage, microbatch) has none is passed over)."""
    return [(EVENT_KINDS[a.kind], groups[a.stage, a.microbatch]) for a in order
            if (a.stage, a.microbatch) in groups]


def matrix_elements(chunk: torch.nn.Module) -> int:
    """Elements of a chunk's weight matrices: its GEMMs take 2 FLOPs per element and token, per action
    (forward, input gradient, weight gradient). Embedding tables are lookups, not GEMMs."""
    return sum(p.numel() for m in chunk.modules() if not isinstance(m, torch.nn.Embedding)
               for p in m.parameters(recurse=False) if p.dim() == 2)


def estimated_costs(nbytes: Mapping[Hashable, int], elements: Mapping[Hashable, int], tokens: int) -> StepCosts:
    """`offload.timing.StepCosts` from each group's slot bytes and its chunk's `matrix_elements`: every
    action of the group takes `ESTIMATE_ACTION_MS` plus its GEMMs at `ESTIMATE_FLOPS`; the rest of the
    step `ESTIMATE_TAIL` of the actions' time."""
    action_ms = {g: (ESTIMATE_ACTION_MS + 2 * tokens * n / ESTIMATE_FLOPS * 1e3,) * 3 for g, n in elements.items()}
    return StepCosts(nbytes, action_ms, ESTIMATE_TAIL * sum(sum(t) for t in action_ms.values()))


def estimate_costs(manager: OffloadManager, events: Sequence[Event], step: StepInputs) -> StepCosts:
    """The step's `estimated_costs` for the capture-time bank search: the groups of `events`, each with its
    stage's weights; a group `manager` does not offload (a short window) counts as empty."""
    stage_of = {g: stage for (stage, _), g in step.groups.items()}
    groups = {g for _, g in events}
    short = manager.short_window(events)  # not offloaded: no bank, no copies
    nbytes = {g: 0 if g in short else manager.layout(g.specs)[1] for g in groups}
    return estimated_costs(nbytes, {g: step.elements[stage_of[g]] for g in groups}, step.tokens)


def resident_banks(manager: OffloadManager, events: Sequence[Event],
                   step: StepInputs) -> tuple[list[int], SearchResult | None]:
    """Resident mode's bank of each group in backward order, by `manager.config`: the explicit banks, else the
    searched plan (`bank_plan = "search"`, with its result) or the colouring with at least `banks` banks."""
    config = manager.config
    if config.explicit_banks:
        try:
            return explicit_banks(events, config.explicit_banks), None
        except ValueError as err:  # the config's banks do not fit this schedule
            raise UserError(str(err)) from None
    if config.bank_plan == "search":
        found = search_banks(events, estimate_costs(manager, events, step), config)
        return list(found.best.plan), found
    colour = assign_banks(events, min_banks=config.banks)
    return [colour[g] for g in backward_order(events)], None


def plan(manager: OffloadManager, step: StepInputs) -> OffloadPlan:
    """Plan one step's offload with `manager.config` and allocate `manager` (outside any capture, once every
    group is discovered): the step's events name the short-window groups and, in release mode, the shared
    slots; resident mode also gets its banks (`resident_banks`) and, from them, the kept groups and the
    futile look-ahead restores. The groups must all appear in `step`'s events. A group that serves several
    microbatches (a chain bounded by liveness): `plan_chains`."""
    if len({id(g) for g in step.groups.values()}) < len(step.groups):
        return plan_chains(manager, step)
    events = step_events(step.order, step.groups)
    backward = backward_order(events)
    banks, search = resident_banks(manager, events, step) if manager.mode == "resident" else (None, None)
    manager.bank_search = search
    manager.allocate(backward, banks=banks, events=events)
    return OffloadPlan(events, backward, banks, search)


def plan_chains(manager: OffloadManager, step: StepInputs) -> OffloadPlan:
    """`plan` where groups repeat: a captured chain's group holds the saved tensors of each microbatch the
    chain runs, one after another (its tape slot refuses a forward before the previous one's last reader).
    Release mode only: a resident bank is planned per forward-to-backward window of one group. Each window
    is judged on its own (`events` are named by (stage, microbatch)): a group is left out if any of its
    windows is too short (`offload.min_window`), since its one slot serves them all. No shared slots (a
    run's members would have to leave and come back together in every window), no kept groups."""
    if manager.mode != "release":
        raise UserError(f"offload.mode = {manager.mode} plans one group per microbatch; graph chains that serve "
                        "several microbatches need offload.mode = release")
    events = step_events(step.order, {key: key for key in step.groups})
    short = {step.groups[key] for key in manager.short_window(events)}
    backward = [step.groups[key] for key in backward_order(events)]  # with repeats: one per microbatch
    manager.bank_search = None
    manager.allocate(backward, not_offloaded=short)
    return OffloadPlan(events, backward, None, None)


__all__ = ["ESTIMATE_ACTION_MS", "ESTIMATE_FLOPS", "ESTIMATE_TAIL", "EVENT_KINDS", "OffloadPlan", "StepInputs",
           "estimate_costs", "estimated_costs", "matrix_elements", "named_events", "plan", "plan_chains",
           "resident_banks", "step_events"]
