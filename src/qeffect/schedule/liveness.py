"""Per-stage tape liveness and the slot count K for binding tapes to a bounded pool.

A stage's tape for microbatch m is *live* from its F until both its dI and its dW have run (or its B, in
the native full-backward program), in the program order of the rank that owns the stage. A tape pool with
K slots per stage binds microbatch m to slot ``m % K``; that is only safe when, at every F(s, m), no other
microbatch bound to the same slot is still live, because the previous occupant's release (its dW) comes
later in the *same* rank's program, so waiting for it would deadlock.

The rule (`slots_for`): K(s) is the smallest K >= `max_live(s)` for which ``m % K`` never reuses a slot
whose occupant is still live. K = M (one slot per microbatch) is always conflict-free, so K(s) <= M, and any
K below the live peak conflicts by pigeonhole, so K(s) >= `max_live(s)`. When dW runs in ascending order
and shortly after its dI, K equals the live peak; with out-of-order or long-deferred dW, ``m % K`` can
conflict at K = peak (a young microbatch wants the slot of an old one whose dW is still pending), and
K grows past the peak until the first conflict-free value.

Pure analysis over the IR: no torch, no runtime.
"""

from __future__ import annotations

from dataclasses import dataclass

from .ir import Action, ActionKind, Schedule

__all__ = [
    "SlotConflict",
    "live_peaks",
    "max_live",
    "slot_conflict",
    "slots_for",
]

_F, _DI, _DW, _B = ActionKind.F, ActionKind.DI, ActionKind.DW, ActionKind.B


@dataclass(frozen=True, slots=True)
class SlotConflict:
    """`action` (an F) on `rank`, at `position` in that rank's program, wants slot `slot` of its stage
    while microbatch `occupant` (bound to the same slot earlier) is still live."""

    rank: int
    position: int
    action: Action
    slot: int
    occupant: int

    def __str__(self) -> str:
        return (f"rank {self.rank} position {self.position}: {self.action} wants slot {self.slot} of stage "
                f"{self.action.stage}, still held by live microbatch {self.occupant}")


def _stage_events(schedule: Schedule) -> dict[int, list[tuple[int, int, Action]]]:
    """stage -> [(rank, position in the rank's program, action)] in that rank's program order."""
    events: dict[int, list[tuple[int, int, Action]]] = {s: [] for s in range(schedule.num_stages)}
    for rank, program in enumerate(schedule.programs):
        for position, action in enumerate(program):
            events.setdefault(action.stage, []).append((rank, position, action))
    return events


def _walk(events: list[tuple[int, int, Action]], modulus: int | None) -> tuple[int, SlotConflict | None]:
    """Walk one stage's events: (live peak, first slot conflict under ``m % modulus``; None if modulus None)."""
    live: dict[int, set[ActionKind]] = {}  # microbatch -> backward kinds still owed
    peak = 0
    for rank, position, action in events:
        m = action.microbatch
        if action.kind is _F:
            if modulus is not None:
                slot = m % modulus
                occupants = sorted(o for o in live if o != m and o % modulus == slot)
                if occupants:
                    return peak, SlotConflict(rank, position, action, slot, occupants[0])
            live[m] = {_DI, _DW}
            peak = max(peak, len(live))
        elif m in live:
            owed = live[m]
            if action.kind is _B:  # full backward: input and weight gradient at once
                owed.clear()
            else:
                owed.discard(action.kind)
            if not owed:
                del live[m]
    return peak, None


def live_peaks(schedule: Schedule) -> dict[int, int]:
    """Per stage: the most microbatches whose tape is live at once (F done, dI or dW still to run)."""
    return {s: _walk(ev, None)[0] for s, ev in sorted(_stage_events(schedule).items())}


def max_live(schedule: Schedule, stage: int) -> int:
    """The live peak of one stage."""
    return _walk(_stage_events(schedule).get(stage, []), None)[0]


def slot_conflict(schedule: Schedule, slots: int | dict[int, int]) -> SlotConflict | None:
    """The first F (stage by stage ascending, then program order) whose slot ``m % K`` is still held by a
    live microbatch, or None when the assignment is safe. `slots`: one K for every stage, or K per stage."""
    for stage, events in sorted(_stage_events(schedule).items()):
        k = slots if isinstance(slots, int) else slots[stage]
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"slot count for stage {stage} must be a positive integer, got {k!r}")
        conflict = _walk(events, k)[1]
        if conflict is not None:
            return conflict
    return None


def slots_for(schedule: Schedule) -> dict[int, int]:
    """K per stage: the smallest K >= the stage's live peak for which ``m % K`` is conflict-free."""
    out: dict[int, int] = {}
    for stage, events in sorted(_stage_events(schedule).items()):
        peak = _walk(events, None)[0]
        k = max(peak, 1)
        while _walk(events, k)[1] is not None:
            k += 1  # terminates: at k = number of distinct microbatches no two share a slot
        out[stage] = k
    return out
