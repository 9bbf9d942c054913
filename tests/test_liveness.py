"""Per-stage tape liveness and the slot count K (tapes bound to slot m % K) for both split schedules."""

from __future__ import annotations

import pytest

from qeffect.schedule import Action, ActionKind, Schedule, build_native_schedule, build_schedule, validate
from qeffect.schedule.liveness import SlotConflict, live_peaks, max_live, slot_conflict, slots_for

F, DI, DW, B = ActionKind.F, ActionKind.DI, ActionKind.DW, ActionKind.B
PP, CHUNKS = 2, 2
M_RANGE = range(2, 17)


def prog(text: str) -> tuple[Action, ...]:
    """Compact literal: 'F0.1 dI0.0 dW0.0' = kind, stage '.' microbatch."""
    out = []
    for tok in text.split():
        kind = next(k for k in (DI, DW, F, B) if tok.startswith(k.value))
        stage, micro = tok[len(kind.value):].split(".")
        out.append(Action(kind, int(stage), int(micro)))
    return tuple(out)


def one_stage(text: str, microbatches: int) -> Schedule:
    sch = Schedule(name="hand", pp=1, stages_per_rank=1, microbatches=microbatches, stage_to_rank=(0,),
                   programs=(prog(text),))
    validate(sch)
    return sch


def accepted(name: str) -> dict[int, Schedule]:
    """M -> schedule for every M in 2..16 the builder accepts (torch rejects some M for interleaved)."""
    out = {}
    for m in M_RANGE:
        try:
            out[m] = build_schedule(name, PP, CHUNKS, m)
        except ValueError:
            continue
    return out


def brute_peaks(sch: Schedule) -> dict[int, int]:
    """Independent oracle: at every program position, count per stage the F done whose dI or dW is not."""
    peaks = {s: 0 for s in range(sch.num_stages)}
    for program in sch.programs:
        for i in range(len(program)):
            done = set(program[: i + 1])
            for s in range(sch.num_stages):
                live = {a.microbatch for a in done if a.kind is F and a.stage == s
                        and not (Action(DI, s, a.microbatch) in done and Action(DW, s, a.microbatch) in done)}
                peaks[s] = max(peaks[s], len(live))
    return peaks


def with_stage(slots: dict[int, int], stage: int, k: int) -> dict[int, int]:
    return {**slots, stage: k}


@pytest.mark.parametrize("name", ["interleaved", "zbv"])
def test_slots_bounded_safe_and_minimal(name: str) -> None:
    schedules = accepted(name)
    assert 2 in schedules and 16 in schedules, f"{name}: builder rejected M=2 or M=16"
    for m, sch in schedules.items():
        k = slots_for(sch)
        truth = brute_peaks(sch)
        assert live_peaks(sch) == truth, f"{name} M={m}"
        assert set(k) == set(range(PP * CHUNKS)), f"{name} M={m}: {k}"
        for stage, ks in k.items():
            assert max_live(sch, stage) == truth[stage]
            assert 1 <= ks <= m, f"{name} M={m} stage {stage}: K={ks}"
            assert ks >= truth[stage], f"{name} M={m} stage {stage}: K={ks} < live peak {truth[stage]}"
            # minimal: one slot fewer is either below the live peak or reuses a live slot
            fewer = ks - 1
            assert fewer < truth[stage] or slot_conflict(sch, with_stage(k, stage, fewer)) is not None, (
                f"{name} M={m} stage {stage}: K={ks} is not minimal")
            if 1 <= fewer:
                assert slot_conflict(sch, with_stage(k, stage, fewer)) is not None, (
                    f"{name} M={m} stage {stage}: K-1={fewer} is conflict-free")
        assert slot_conflict(sch, k) is None, f"{name} M={m}: {slot_conflict(sch, k)}"
        assert slot_conflict(sch, m) is None  # one slot per microbatch never conflicts


@pytest.mark.parametrize("name", ["interleaved", "zbv"])
def test_slots_stop_growing_with_microbatches(name: str) -> None:
    table = {m: slots_for(sch) for m, sch in accepted(name).items()}
    text = "\n".join(f"M={m:2d}: " + " ".join(f"s{s}={k}" for s, k in sorted(ks.items()))
                     for m, ks in table.items())
    steady = table[2 * PP]
    for m, ks in table.items():
        if m >= 2 * PP:
            assert ks == steady, f"{name}: K grows with M beyond M=2*pp\n{text}"
    # the bound is small: at most the depth of the V / interleave warm-up, never M
    assert max(steady.values()) <= PP * CHUNKS, f"{name}: K table\n{text}"


def test_interleaved_k_is_live_peak_and_matches_native() -> None:
    for m, sch in accepted("interleaved").items():
        assert slots_for(sch) == live_peaks(sch), f"M={m}"
        assert live_peaks(build_native_schedule(PP, CHUNKS, m)) == live_peaks(sch), f"M={m}"


def test_premature_reuse_detected_at_first_conflicting_f() -> None:
    # F0.2 reuses slot 0 (K=2) while microbatch 0 is done; F0.3 wants slot 1, still held by live 1
    sch = one_stage("F0.0 dI0.0 dW0.0 F0.1 F0.2 F0.3 dI0.1 dW0.1 dI0.2 dW0.2 dI0.3 dW0.3", 4)
    assert live_peaks(sch) == {0: 3}
    conflict = slot_conflict(sch, 2)
    assert conflict == SlotConflict(rank=0, position=5, action=Action(F, 0, 3), slot=1, occupant=1)
    assert str(conflict) == ("rank 0 position 5: F(s=0,m=3) wants slot 1 of stage 0, "
                             "still held by live microbatch 1")
    assert slot_conflict(sch, 3) is None
    assert slots_for(sch) == {0: 3}


def test_out_of_order_dw_needs_more_slots_than_the_live_peak() -> None:
    # dW0.1 runs before dW0.0: at F0.2 only microbatch 0 is live (peak 2), yet 2 % 2 == 0 is its slot
    sch = one_stage("F0.0 F0.1 dI0.0 dI0.1 dW0.1 F0.2 dW0.0 dI0.2 dW0.2", 3)
    assert live_peaks(sch) == {0: 2}
    assert slot_conflict(sch, {0: 2}) == SlotConflict(0, 5, Action(F, 0, 2), 0, 0)
    assert slots_for(sch) == {0: 3}


def test_tape_stays_live_until_both_di_and_dw() -> None:
    # the pending dW of microbatch 0 keeps its tape (and slot) live after its dI
    sch = one_stage("F0.0 dI0.0 F0.1 dW0.0 dI0.1 dW0.1", 2)
    assert live_peaks(sch) == {0: 2}
    assert slot_conflict(sch, 1) == SlotConflict(0, 2, Action(F, 0, 1), 0, 0)
    assert slots_for(sch) == {0: 2}


def test_bad_slot_count_rejected() -> None:
    sch = one_stage("F0.0 dI0.0 dW0.0", 1)
    with pytest.raises(ValueError, match=r"^slot count for stage 0 must be a positive integer, got 0$"):
        slot_conflict(sch, 0)
    with pytest.raises(ValueError, match=r"^slot count for stage 0 must be a positive integer, got True$"):
        slot_conflict(sch, {0: True})
