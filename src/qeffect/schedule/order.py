"""Dependencies between actions, one global interleaving of all ranks, and liveness peaks.

The single-process executor runs every rank's program in one process, so it needs one total order that
respects cross-rank data flow; the lock-step simulation here finds it (or proves there is none).
"""

from __future__ import annotations

from .ir import Action, ActionKind, Schedule, ScheduleError

F, DI, DW, B = ActionKind.F, ActionKind.DI, ActionKind.DW, ActionKind.B


def dependencies(action: Action, num_stages: int) -> list[Action]:
    """Upstream actions whose output `action` consumes (what an executor must receive before running it).

    F(s,m) consumes F(s-1,m)'s output activation; dI(s,m) consumes dI(s+1,m)'s input gradient and
    B(s,m) consumes B(s+1,m)'s. The first stage's F reads data and the last stage's dI/B starts from
    the loss, so they consume nothing from another stage. dW consumes only its own tape.
    """
    s, m = action.stage, action.microbatch
    if action.kind is F:
        return [Action(F, s - 1, m)] if s > 0 else []
    if action.kind in (DI, B):
        return [Action(action.kind, s + 1, m)] if s + 1 < num_stages else []
    return []


def prerequisites(action: Action, num_stages: int) -> list[Action]:
    """Everything that must have run before `action`: `dependencies` plus the same-stage tape order.

    dI(s,m) and B(s,m) need F(s,m) (its tape); dW(s,m) needs dI(s,m) (the retained weight-gradient work).
    """
    same_stage: list[Action] = []
    if action.kind in (DI, B):
        same_stage = [Action(F, action.stage, action.microbatch)]
    elif action.kind is DW:
        same_stage = [Action(DI, action.stage, action.microbatch)]
    return same_stage + dependencies(action, num_stages)


def global_order(schedule: Schedule) -> list[tuple[int, Action]]:
    """One valid interleaving of all ranks' programs, as (rank, action).

    Lock-step simulation: rounds over ranks 0..pp-1; in each round every rank whose next action has all
    prerequisites done runs exactly that one action. Deterministic. Raises `ScheduleError` ("deadlock: ...")
    naming each rank's blocked next action when no rank can progress.
    """
    programs = schedule.programs
    num_stages = schedule.num_stages
    cursor = [0] * len(programs)
    done: set[Action] = set()
    order: list[tuple[int, Action]] = []
    remaining = sum(len(p) for p in programs)
    while remaining:
        progressed = False
        for rank, program in enumerate(programs):
            if cursor[rank] >= len(program):
                continue
            action = program[cursor[rank]]
            if all(p in done for p in prerequisites(action, num_stages)):
                done.add(action)
                order.append((rank, action))
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ScheduleError("deadlock: " + "; ".join(_blocked(schedule, cursor, done)))
    return order


def _blocked(schedule: Schedule, cursor: list[int], done: set[Action]) -> list[str]:
    parts = []
    for rank, program in enumerate(schedule.programs):
        if cursor[rank] >= len(program):
            parts.append(f"rank {rank} finished")
            continue
        action = program[cursor[rank]]
        missing = [str(p) for p in prerequisites(action, schedule.num_stages) if p not in done]
        parts.append(f"rank {rank} waits at {action} (position {cursor[rank]}) for {', '.join(missing)}")
    return parts


def _per_stage_microbatches(
    schedule: Schedule, kinds: tuple[ActionKind, ...]
) -> dict[tuple[int, str], list[int]]:
    seq: dict[tuple[int, str], list[int]] = {}
    for _, action in schedule.actions():
        if action.kind in kinds:
            seq.setdefault((action.stage, action.kind.value), []).append(action.microbatch)
    return seq


def per_stage_orders_ascending(schedule: Schedule) -> bool:
    """True when, on every stage, F runs microbatches in ascending order and so does dI (or B).

    The numerical core relies on it: FP8 amax histories roll once per F/dI, so the reference and every
    qeffect mode must visit microbatches in the same (ascending) order per stage to stay bitwise equal.
    """
    seq = _per_stage_microbatches(schedule, (F, DI, B))
    return all(ms == sorted(ms) for ms in seq.values())


def dw_follows_di_order(schedule: Schedule) -> bool:
    """True when, on every stage, dW drains microbatches in the order dI produced them.

    Transformer Engine's retained weight-gradient store is a FIFO per module (`backward_dw()` pops the
    oldest), so a split schedule is only runnable on that backend when this holds.
    """
    seq = _per_stage_microbatches(schedule, (DI, DW))
    stages = {stage for stage, _ in seq}
    return all(seq.get((s, DI.value), []) == seq.get((s, DW.value), []) for s in stages)


def dw_in_order(schedule: Schedule, rank: int) -> bool:
    """True when every stage of `rank` runs dW for its microbatches in ascending order: the condition
    for the accumulating gradient arena (one region per parameter; dW(m > 0) adds into it)."""
    stages = set(schedule.stages_of(rank))
    seq = _per_stage_microbatches(schedule, (DW,))
    return all(ms == sorted(ms) for (stage, _), ms in seq.items() if stage in stages)


def _peak(program: tuple[Action, ...], up: tuple[ActionKind, ...], down: tuple[ActionKind, ...]) -> int:
    live = peak = 0
    for action in program:
        if action.kind in up:
            live += 1
            peak = max(peak, live)
        elif action.kind in down:
            live -= 1
    return peak


def max_live_tapes(schedule: Schedule) -> dict[int, int]:
    """Per rank: peak count of F done whose dW (or B) is not yet done; bounds the tape pool."""
    return {rank: _peak(program, (F,), (DW, B)) for rank, program in enumerate(schedule.programs)}


def max_pending_dw(schedule: Schedule) -> dict[int, int]:
    """Per rank: peak count of dI done whose dW is not yet done; bounds retained dW work and arena slots."""
    return {rank: _peak(program, (DI,), (DW,)) for rank, program in enumerate(schedule.programs)}
