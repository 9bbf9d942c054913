"""Check a schedule against the action contract before anything runs it.

Cheap, local checks come first so that the error names the offending action precisely; the cross-rank
data flow, which no single program can show, is checked last by asking `order.global_order` for one
valid interleaving.
"""

from __future__ import annotations

from .ir import Action, ActionKind, Schedule, ScheduleError
from .order import global_order, prerequisites

__all__ = ["ScheduleError", "expected_kinds", "validate"]


def expected_kinds(schedule: Schedule) -> tuple[ActionKind, ...]:
    """F and B for the native reference program, F, dI and dW for every split-backward schedule."""
    if schedule.full_backward:
        return (ActionKind.F, ActionKind.B)
    return (ActionKind.F, ActionKind.DI, ActionKind.DW)


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` naming the first offending action; return None for a valid schedule."""
    _check_shape(schedule)
    kinds = expected_kinds(schedule)
    positions = _check_actions(schedule, kinds)
    _check_complete(schedule, kinds, positions)
    _check_local_order(schedule, positions)
    global_order(schedule)  # raises ScheduleError("deadlock: ...") when ranks wait on each other


def _check_shape(sch: Schedule) -> None:
    if sch.pp < 1 or sch.stages_per_rank < 1 or sch.microbatches < 1:
        raise ScheduleError(
            f"pp, stages_per_rank and microbatches must be >= 1, got {sch.pp}, {sch.stages_per_rank}, "
            f"{sch.microbatches}"
        )
    if len(sch.programs) != sch.pp:
        raise ScheduleError(f"schedule has {len(sch.programs)} rank programs, expected pp={sch.pp}")
    if sch.num_stages != sch.pp * sch.stages_per_rank:
        raise ScheduleError(
            f"stage_to_rank places {sch.num_stages} stages, expected pp*stages_per_rank="
            f"{sch.pp * sch.stages_per_rank}"
        )
    for rank in range(sch.pp):
        owned = sch.stages_of(rank)
        if len(owned) != sch.stages_per_rank:
            raise ScheduleError(
                f"rank {rank} owns stages {list(owned)}, expected {sch.stages_per_rank} stage(s) per rank"
            )
    bad = [r for r in sch.stage_to_rank if not 0 <= r < sch.pp]
    if bad:
        raise ScheduleError(f"stage_to_rank names rank {bad[0]} outside 0..{sch.pp - 1}")


def _check_actions(sch: Schedule, kinds: tuple[ActionKind, ...]) -> dict[Action, tuple[int, int]]:
    """Per-action checks; returns each action's (rank, position)."""
    positions: dict[Action, tuple[int, int]] = {}
    for rank, program in enumerate(sch.programs):
        for pos, action in enumerate(program):
            where = f"{action} on rank {rank} at position {pos}"
            if not isinstance(action, Action):
                raise ScheduleError(f"rank {rank} position {pos}: {action!r} is not an Action")
            if action.kind not in kinds:
                allowed = ", ".join(k.value for k in kinds)
                raise ScheduleError(
                    f"{where}: kind {action.kind.value} not allowed in {sch.name!r} ({allowed})"
                )
            if not 0 <= action.stage < sch.num_stages:
                raise ScheduleError(f"{where}: stage outside 0..{sch.num_stages - 1}")
            if not 0 <= action.microbatch < sch.microbatches:
                raise ScheduleError(f"{where}: microbatch outside 0..{sch.microbatches - 1}")
            owner = sch.stage_to_rank[action.stage]
            if owner != rank:
                raise ScheduleError(f"{where}: stage {action.stage} belongs to rank {owner}")
            if action in positions:
                r0, p0 = positions[action]
                raise ScheduleError(f"duplicate {where}: already on rank {r0} at position {p0}")
            positions[action] = (rank, pos)
    return positions


def _check_complete(
    sch: Schedule, kinds: tuple[ActionKind, ...], positions: dict[Action, tuple[int, int]]
) -> None:
    missing = [
        Action(kind, s, m)
        for s in range(sch.num_stages)
        for m in range(sch.microbatches)
        for kind in kinds
        if Action(kind, s, m) not in positions
    ]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ScheduleError(f"missing {missing[0]} on rank {sch.stage_to_rank[missing[0].stage]}{more}")


def _check_local_order(sch: Schedule, positions: dict[Action, tuple[int, int]]) -> None:
    """Precedence that one rank's program shows on its own: same stage F < dI < dW, and any
    cross-stage prerequisite that lives on the same rank (e.g. F(s) < F(s+1) with both stages local)."""
    for rank, program in enumerate(sch.programs):
        for pos, action in enumerate(program):
            for pre in prerequisites(action, sch.num_stages):
                pre_rank, pre_pos = positions[pre]
                if pre_rank == rank and pre_pos > pos:
                    raise ScheduleError(
                        f"{action} on rank {rank} at position {pos} runs before {pre} (position {pre_pos}), "
                        "which it needs"
                    )
