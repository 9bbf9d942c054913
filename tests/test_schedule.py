"""Schedule layer: golden orders from torch, validation, global order, liveness peaks."""

from __future__ import annotations

import enum
import importlib
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from qeffect.schedule import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    build_native_schedule,
    build_schedule,
    dependencies,
    dw_follows_di_order,
    expected_placement,
    global_order,
    max_live_tapes,
    max_pending_dw,
    per_stage_orders_ascending,
    prerequisites,
    validate,
)
from qeffect.schedule import adapter as adapter_mod

# the package re-exports the function `validate`, which shadows the submodule attribute
validate_mod = importlib.import_module("qeffect.schedule.validate")

F, DI, DW, B = ActionKind.F, ActionKind.DI, ActionKind.DW, ActionKind.B


def prog(text: str) -> tuple[Action, ...]:
    """Compact literal: 'F0.1 dI2.0 dW2.0 B3.1' = kind, stage '.' microbatch."""
    out = []
    for tok in text.split():
        kind = next(k for k in (DI, DW, F, B) if tok.startswith(k.value))
        stage, micro = tok[len(kind.value) :].split(".")
        out.append(Action(kind, int(stage), int(micro)))
    return tuple(out)


def compact(program: tuple[Action, ...]) -> str:
    return " ".join(f"{a.kind.value}{a.stage}.{a.microbatch}" for a in program)


# ---------------------------------------------------------------- golden orders (torch 2.13 output, translated)
# If torch changes these schedules, these tests fail: re-derive, re-check per_stage_orders_ascending and the
# executors' assumptions, then update the literals.

GOLDEN_INTERLEAVED_PP2_V2_M4 = (
    "F0.0 F0.1 F2.0 F2.1 F0.2 dI2.0 dW2.0 F0.3 dI2.1 dW2.1 F2.2 dI0.0 dW0.0 F2.3 dI0.1 dW0.1 "
    "dI2.2 dW2.2 dI2.3 dW2.3 dI0.2 dW0.2 dI0.3 dW0.3",
    "F1.0 F1.1 F3.0 dI3.0 dW3.0 F3.1 dI3.1 dW3.1 F1.2 dI1.0 dW1.0 F1.3 dI1.1 dW1.1 F3.2 dI3.2 dW3.2 "
    "F3.3 dI3.3 dW3.3 dI1.2 dW1.2 dI1.3 dW1.3",
)
GOLDEN_NATIVE_PP2_V2_M4 = (
    "F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3",
    "F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3",
)
GOLDEN_ZBV_PP2_M4 = (
    "F0.0 F0.1 F0.2 F3.0 dI3.0 dW3.0 F3.1 dI3.1 dW3.1 F0.3 dI0.0 dW0.0 F3.2 dI3.2 dW3.2 dI0.1 dW0.1 "
    "F3.3 dI3.3 dW3.3 dI0.2 dW0.2 dI0.3 dW0.3",
    "F1.0 F2.0 F1.1 F2.1 dI2.0 dW2.0 F1.2 dI1.0 dW1.0 F2.2 dI2.1 dW2.1 F1.3 dI1.1 dW1.1 F2.3 dI2.2 dW2.2 "
    "dI1.2 dI2.3 dI1.3 dW1.2 dW2.3 dW1.3",
)


def golden_cases():
    return [
        (build_schedule("interleaved", 2, 2, 4), "interleaved", (0, 1, 0, 1), GOLDEN_INTERLEAVED_PP2_V2_M4),
        (build_native_schedule(2, 2, 4), "native-interleaved", (0, 1, 0, 1), GOLDEN_NATIVE_PP2_V2_M4),
        (build_schedule("zbv", 2, 2, 4), "zbv", (0, 1, 1, 0), GOLDEN_ZBV_PP2_M4),
    ]


@pytest.mark.parametrize("index", range(3), ids=["interleaved", "native", "zbv"])
def test_golden_orders(index):
    sch, name, placement, golden = golden_cases()[index]
    assert sch.name == name
    assert (sch.pp, sch.stages_per_rank, sch.microbatches, sch.num_stages) == (2, 2, 4, 4)
    assert sch.stage_to_rank == placement
    for rank in range(2):
        assert compact(sch.programs[rank]) == compact(prog(golden[rank])), f"rank {rank} order changed"
    assert sch.programs == tuple(prog(g) for g in golden)


def test_golden_liveness_peaks():
    inter, native, zbv = (case[0] for case in golden_cases())
    assert max_live_tapes(inter) == {0: 5, 1: 3}
    assert max_pending_dw(inter) == {0: 1, 1: 1}
    assert max_live_tapes(native) == {0: 5, 1: 3}
    assert max_pending_dw(native) == {0: 0, 1: 0}
    assert max_live_tapes(zbv) == {0: 4, 1: 4}
    assert max_pending_dw(zbv) == {0: 1, 1: 3}


def test_liveness_counting_by_hand():
    sch = Schedule("zbv", 1, 1, 3, (0,), (prog("F0.0 F0.1 F0.2 dI0.0 dI0.1 dW0.0 dI0.2 dW0.1 dW0.2"),))
    validate(sch)
    assert max_live_tapes(sch) == {0: 3}
    assert max_pending_dw(sch) == {0: 2}
    native = Schedule("native-interleaved", 1, 1, 2, (0,), (prog("F0.0 B0.0 F0.1 B0.1"),))
    validate(native)
    assert max_live_tapes(native) == {0: 1}
    assert max_pending_dw(native) == {0: 0}


# ---------------------------------------------------------------- IR basics


def test_action_str_parse_roundtrip():
    a = Action(DI, 2, 1)
    assert str(a) == "dI(s=2,m=1)"
    assert str(Action(F, 2, 1)) == "F(s=2,m=1)"
    assert Action.parse("dW(s=10,m=3)") == Action(DW, 10, 3)
    assert Action.parse(str(a)) == a
    assert isinstance(ActionKind.DI, str) and ActionKind("dI") is DI
    with pytest.raises(ValueError, match="not an action"):
        Action.parse("I(s=1,m=0)")


def test_json_roundtrip_and_stages_of():
    for sch, *_ in golden_cases():
        text = sch.to_json()
        back = Schedule.from_json(text)
        assert back == sch
        assert back.to_json() == text
    zbv = build_schedule("zbv", 2, 2, 4)
    assert zbv.stages_of(0) == (0, 3) and zbv.stages_of(1) == (1, 2)
    with pytest.raises(ValueError, match="not a qeffect schedule"):
        Schedule.from_json('{"name": "zbv"}')
    with pytest.raises(ValueError, match="malformed"):
        Schedule.from_json('{"format": "qeffect.schedule/1", "name": "zbv"}')


def test_package_import_does_not_import_torch():
    code = "import sys, qeffect.schedule; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------- grid over what torch accepts

INTERLEAVED_GRID = sorted({(pp, v, m) for pp in (1, 2, 4) for v in (1, 2) for m in (pp, 2 * pp, 4)})
ZBV_GRID = [(pp, m) for pp in (1, 2, 4) for m in (2, 4, 8)]


def check_global_order(sch: Schedule) -> None:
    order = global_order(sch)
    expected = [(r, a) for r, a in sch.actions()]
    assert sorted(order, key=str) == sorted(expected, key=str), "global order must hold every action once"
    assert len({a for _, a in order}) == len(order)
    position = {a: i for i, (_, a) in enumerate(order)}
    for i, (rank, action) in enumerate(order):
        assert sch.stage_to_rank[action.stage] == rank
        for pre in prerequisites(action, sch.num_stages):
            assert position[pre] < i, f"{action} placed before its prerequisite {pre}"
    for rank in range(sch.pp):
        assert tuple(a for r, a in order if r == rank) == sch.programs[rank], "rank program order kept"
    assert order == global_order(sch), "deterministic"


@pytest.mark.parametrize("pp,v,m", INTERLEAVED_GRID)
def test_interleaved_grid(pp, v, m):
    for sch in (build_schedule("interleaved", pp, v, m), build_native_schedule(pp, v, m)):
        validate(sch)
        assert sch.stage_to_rank == tuple(s % pp for s in range(pp * v))
        assert per_stage_orders_ascending(sch)
        assert dw_follows_di_order(sch)
        check_global_order(sch)
    split = build_schedule("interleaved", pp, v, m)
    assert all(a.kind in (F, DI, DW) for _, a in split.actions())
    # every B was expanded into dI immediately followed by dW
    for program in split.programs:
        for i, a in enumerate(program):
            if a.kind is DI:
                assert program[i + 1] == Action(DW, a.stage, a.microbatch)


@pytest.mark.parametrize("pp,m", ZBV_GRID)
def test_zbv_grid(pp, m):
    sch = build_schedule("zbv", pp, 2, m)
    validate(sch)
    assert sch.stage_to_rank == expected_placement("zbv", pp, 2)
    for r in range(pp):
        assert sch.stages_of(r) == (r, 2 * pp - 1 - r)
    assert per_stage_orders_ascending(sch)
    assert dw_follows_di_order(sch)
    check_global_order(sch)


def test_builder_rejections_are_readable():
    with pytest.raises(ValueError, match="exactly 2 stages per rank.*stages_per_rank=3"):
        build_schedule("zbv", 2, 3, 4)
    with pytest.raises(ValueError, match="split-backward"):
        build_schedule("zbv", 2, 2, 4, split_backward=False)
    with pytest.raises(ValueError, match=r"interleaved 1F1B with pp=2 .*microbatches=5"):
        build_schedule("interleaved", 2, 2, 5)
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("gpipe", 2, 2, 4)  # type: ignore[arg-type]
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="positive integer"):
            build_schedule("interleaved", 2, 2, bad)  # type: ignore[arg-type]


def test_invalid_torch_output_is_reported(monkeypatch):
    """If torch ever emits an order that breaks the contract, the builder refuses it with a ValueError."""
    real = adapter_mod._torch_pipeline_order

    def broken(name, pp, v, m):
        raw, placement = real(name, pp, v, m)
        return {0: list(reversed(raw[0])), **{r: raw[r] for r in range(1, pp)}}, placement

    adapter_mod._build.cache_clear()
    monkeypatch.setattr(adapter_mod, "_torch_pipeline_order", broken)
    try:
        with pytest.raises(ScheduleError, match="not a valid schedule"):
            build_schedule("interleaved", 2, 2, 4)
    finally:
        adapter_mod._build.cache_clear()


def test_fallback_to_visualizer_gives_same_orders(monkeypatch):
    """A torch whose constructors read more than the duck-typed stage offers falls back to get_schedule_ops."""

    class Bare:
        def __init__(self, *args):
            pass

    adapter_mod._build.cache_clear()
    monkeypatch.setattr(adapter_mod, "_OfflineStage", Bare)
    try:
        for sch, _, _, golden in golden_cases():
            again = (
                build_native_schedule(2, 2, 4) if sch.full_backward else build_schedule(sch.name, 2, 2, 4)  # type: ignore[arg-type]
            )
            assert again.programs == tuple(prog(g) for g in golden)
    finally:
        adapter_mod._build.cache_clear()


def test_translate_defensively():
    class CT(enum.Enum):  # an older/newer torch enum: only the *names* are relied upon
        FORWARD = 1
        FULL_BACKWARD = 2
        BACKWARD_INPUT = 3
        BACKWARD_WEIGHT = 4
        SEND_F = 5
        RECV_B = 6
        MYSTERY = 7

    def act(ct, s, m=None, subs=None):
        return SimpleNamespace(computation_type=ct, stage_index=s, microbatch_index=m, sub_actions=subs)

    raw = [
        act(CT.FORWARD, 0, 0),
        None,
        act(CT.SEND_F, 0, 0),
        act(CT.RECV_B, 0, 0),
        act(CT.FULL_BACKWARD, 0, 0),
        act(CT.BACKWARD_INPUT, 1, 1),
        act(CT.BACKWARD_WEIGHT, 1, 1),
    ]
    split = adapter_mod._translate_program(raw, split_backward=True)
    assert compact(tuple(split)) == "F0.0 dI0.0 dW0.0 dI1.1 dW1.1"
    full = adapter_mod._translate_program(raw, split_backward=False)
    assert compact(tuple(full)) == "F0.0 B0.0 dI1.1 dW1.1"
    overlap = act(CT.MYSTERY, 0, None, subs=(act(CT.FORWARD, 1, 2), act(CT.FULL_BACKWARD, 0, 1)))
    assert compact(tuple(adapter_mod._translate_program([overlap], True))) == "F1.2 dI0.1 dW0.1"
    with pytest.raises(RuntimeError, match="unknown action"):
        adapter_mod._translate(act(CT.MYSTERY, 0, 0))
    with pytest.raises(RuntimeError, match="without microbatch"):
        adapter_mod._translate(act(CT.FORWARD, 0, None))


# ---------------------------------------------------------------- broken schedules are rejected, naming the action


def golden_interleaved() -> Schedule:
    return build_schedule("interleaved", 2, 2, 4)


def with_programs(sch: Schedule, *programs: tuple[Action, ...]) -> Schedule:
    return replace(sch, programs=tuple(programs))


def test_reject_missing_action():
    sch = golden_interleaved()
    r0 = tuple(a for a in sch.programs[0] if a != Action(DW, 0, 3))
    with pytest.raises(ScheduleError, match=r"missing dW\(s=0,m=3\) on rank 0"):
        validate(with_programs(sch, r0, sch.programs[1]))


def test_reject_duplicate():
    sch = golden_interleaved()
    r1 = sch.programs[1] + (Action(F, 1, 2),)
    with pytest.raises(
        ScheduleError, match=r"duplicate F\(s=1,m=2\) on rank 1 at position 24: already on rank 1"
    ):
        validate(with_programs(sch, sch.programs[0], r1))


def test_reject_dw_before_di():
    sch = golden_interleaved()
    r0 = list(sch.programs[0])
    i = r0.index(Action(DI, 2, 1))
    r0[i], r0[i + 1] = r0[i + 1], r0[i]
    with pytest.raises(
        ScheduleError, match=r"dW\(s=2,m=1\) on rank 0 at position 8 runs before dI\(s=2,m=1\)"
    ):
        validate(with_programs(sch, tuple(r0), sch.programs[1]))


def test_reject_di_before_f_and_native_b_before_f():
    sch = Schedule("interleaved", 1, 1, 1, (0,), (prog("dI0.0 F0.0 dW0.0"),))
    with pytest.raises(
        ScheduleError, match=r"dI\(s=0,m=0\) on rank 0 at position 0 runs before F\(s=0,m=0\)"
    ):
        validate(sch)
    native = Schedule("native-interleaved", 1, 1, 1, (0,), (prog("B0.0 F0.0"),))
    with pytest.raises(ScheduleError, match=r"B\(s=0,m=0\) .* runs before F\(s=0,m=0\)"):
        validate(native)


def test_reject_forward_of_later_stage_first_on_one_rank():
    sch = build_schedule("interleaved", 1, 2, 2)  # rank 0 owns stages 0 and 1
    r0 = list(sch.programs[0])
    i, j = r0.index(Action(F, 0, 0)), r0.index(Action(F, 1, 0))
    r0[i], r0[j] = r0[j], r0[i]
    with pytest.raises(ScheduleError, match=r"F\(s=1,m=0\) on rank 0 at position 0 runs before F\(s=0,m=0\)"):
        validate(with_programs(sch, tuple(r0)))


def test_reject_backward_crossing_stages_forward():
    # dI(s,m) must come after dI(s+1,m): with both stages on one rank the program shows it directly
    sch = Schedule("interleaved", 1, 2, 1, (0, 0), (prog("F0.0 F1.0 dI0.0 dI1.0 dW1.0 dW0.0"),))
    with pytest.raises(
        ScheduleError, match=r"dI\(s=0,m=0\) on rank 0 at position 2 runs before dI\(s=1,m=0\)"
    ):
        validate(sch)


def test_reject_action_on_wrong_rank():
    sch = golden_interleaved()
    moved = Action(DW, 3, 0)
    r0 = sch.programs[0] + (moved,)
    r1 = tuple(a for a in sch.programs[1] if a != moved)
    with pytest.raises(
        ScheduleError, match=r"dW\(s=3,m=0\) on rank 0 at position 24: stage 3 belongs to rank 1"
    ):
        validate(with_programs(sch, r0, r1))


def test_reject_wrong_kinds_and_ranges():
    sch = golden_interleaved()
    with pytest.raises(ScheduleError, match=r"B\(s=0,m=0\) .*kind B not allowed in 'interleaved'"):
        validate(with_programs(sch, (Action(B, 0, 0),) + sch.programs[0], sch.programs[1]))
    native = build_native_schedule(2, 2, 4)
    with pytest.raises(ScheduleError, match=r"dI\(s=0,m=0\) .*not allowed in 'native-interleaved'"):
        validate(with_programs(native, (Action(DI, 0, 0),) + native.programs[0], native.programs[1]))
    with pytest.raises(ScheduleError, match=r"F\(s=0,m=4\) .*microbatch outside 0..3"):
        validate(with_programs(sch, sch.programs[0] + (Action(F, 0, 4),), sch.programs[1]))
    with pytest.raises(ScheduleError, match=r"F\(s=9,m=0\) .*stage outside 0..3"):
        validate(with_programs(sch, sch.programs[0] + (Action(F, 9, 0),), sch.programs[1]))
    with pytest.raises(ScheduleError, match="1 rank programs, expected pp=2"):
        validate(with_programs(sch, sch.programs[0]))
    with pytest.raises(ScheduleError, match="rank 0 owns stages"):
        validate(replace(sch, stage_to_rank=(0, 0, 0, 1)))


DEADLOCK = Schedule(
    "interleaved",
    2,
    1,
    2,
    (0, 1),
    (
        prog("F0.0 dI0.0 dW0.0 F0.1 dI0.1 dW0.1"),  # waits for dI(1,0) before sending F(0,1)
        prog("F1.1 F1.0 dI1.0 dW1.0 dI1.1 dW1.1"),  # waits for F(0,1) before doing dI(1,0)
    ),
)


def test_deadlock_is_detected():
    msg = (
        r"deadlock: rank 0 waits at dI\(s=0,m=0\) \(position 1\) for dI\(s=1,m=0\); "
        r"rank 1 waits at F\(s=1,m=1\) \(position 0\) for F\(s=0,m=1\)"
    )
    with pytest.raises(ScheduleError, match=msg):
        global_order(DEADLOCK)
    with pytest.raises(ScheduleError, match=msg):
        validate(DEADLOCK)
    assert validate_mod.ScheduleError is ScheduleError and issubclass(ScheduleError, ValueError)
    fixed = with_programs(DEADLOCK, DEADLOCK.programs[0], prog("F1.0 dI1.0 dW1.0 F1.1 dI1.1 dW1.1"))
    validate(fixed)
    check_global_order(fixed)


def test_global_order_lock_step_on_golden():
    """Pinned interleaving for the golden case: rounds over ranks, at most one action per rank per round,
    an action run earlier in the same round already counts as done."""
    order = global_order(golden_interleaved())
    head = [(r, f"{a.kind.value}{a.stage}.{a.microbatch}") for r, a in order[:10]]
    assert head == [
        (0, "F0.0"),
        (1, "F1.0"),
        (0, "F0.1"),
        (1, "F1.1"),
        (0, "F2.0"),
        (1, "F3.0"),
        (0, "F2.1"),
        (1, "dI3.0"),
        (0, "F0.2"),
        (1, "dW3.0"),
    ]


# ---------------------------------------------------------------- dependencies and per-stage orders


def test_dependencies():
    n = 4
    assert dependencies(Action(F, 0, 3), n) == []
    assert dependencies(Action(F, 2, 1), n) == [Action(F, 1, 1)]
    assert dependencies(Action(DI, 3, 1), n) == []
    assert dependencies(Action(DI, 1, 2), n) == [Action(DI, 2, 2)]
    assert dependencies(Action(B, 1, 2), n) == [Action(B, 2, 2)]
    assert dependencies(Action(B, 3, 0), n) == []
    assert dependencies(Action(DW, 1, 2), n) == []
    assert prerequisites(Action(DW, 1, 2), n) == [Action(DI, 1, 2)]
    assert prerequisites(Action(DI, 1, 2), n) == [Action(F, 1, 2), Action(DI, 2, 2)]
    assert prerequisites(Action(B, 3, 0), n) == [Action(F, 3, 0)]


def test_per_stage_orders_ascending_detects_reordering():
    desc_f = Schedule("zbv", 1, 1, 2, (0,), (prog("F0.1 F0.0 dI0.0 dW0.0 dI0.1 dW0.1"),))
    validate(desc_f)  # a legal schedule, but not one the numerical core accepts
    assert not per_stage_orders_ascending(desc_f)
    desc_di = Schedule("zbv", 1, 1, 2, (0,), (prog("F0.0 F0.1 dI0.1 dI0.0 dW0.0 dW0.1"),))
    validate(desc_di)
    assert not per_stage_orders_ascending(desc_di)
    assert not dw_follows_di_order(desc_di)
    desc_b = Schedule("native-interleaved", 1, 1, 2, (0,), (prog("F0.0 F0.1 B0.1 B0.0"),))
    validate(desc_b)
    assert not per_stage_orders_ascending(desc_b)
    dw_swapped = Schedule("zbv", 1, 1, 2, (0,), (prog("F0.0 F0.1 dI0.0 dI0.1 dW0.1 dW0.0"),))
    assert per_stage_orders_ascending(dw_swapped)
    assert not dw_follows_di_order(dw_swapped)


@pytest.mark.parametrize("microbatches", [4, 8])
def test_native_with_placement_keeps_zbv_placement_and_order(microbatches: int) -> None:
    from qeffect.schedule import native_with_placement

    split = build_schedule("zbv", 2, 2, microbatches)
    native = native_with_placement(split)
    assert native.stage_to_rank == split.stage_to_rank and native.name == "native-zbv"
    for sp, nat in zip(split.programs, native.programs, strict=True):
        want = [(ActionKind.B if a.kind is ActionKind.DI else a.kind, a.stage, a.microbatch)
                for a in sp if a.kind is not ActionKind.DW]
        assert [(a.kind, a.stage, a.microbatch) for a in nat] == want


def test_dw_in_order_selects_the_accumulating_arena() -> None:
    """Both split schedules run dW in microbatch order on every stage (so the pipeline accumulates in
    place); a swapped dW order does not, and falls back to one arena view per microbatch."""
    from qeffect.config import load_config
    from qeffect.graphs.binding import staging_depth
    from qeffect.runtime.build import build_single_process
    from qeffect.schedule import dw_in_order
    from qeffect.schedule.liveness import slots_for
    from qeffect.stage.actions import arena_name
    from qeffect.verify.state import _swap_dw

    for name in ("interleaved", "zbv"):
        for m in (2, 4, 8, 16):
            s = build_schedule(name, 2, 2, m)
            assert all(dw_in_order(s, r) for r in range(s.pp)), (name, m)
    cfg = load_config()
    swapped = _swap_dw(build_schedule("interleaved", 2, 2, cfg.pipeline.microbatches))
    assert not dw_in_order(swapped, 0)
    pipe = build_single_process(cfg.with_overrides(**{"pipeline.wgrad_staging": 0}), native=False)
    assert all(r.arena.accumulate and r.arena.staging == 0 for r in pipe.ranks)
    staged = build_single_process(cfg.with_overrides(**{"pipeline.wgrad_staging_by_liveness": True}),
                                  native=False)  # staging slots (fp32 for the reference) on top
    # each stage stages at the depth that follows its chains: the largest divisor of its K up to the setting
    slots, mb = slots_for(staged.schedule), cfg.pipeline.microbatches
    for r in staged.ranks:
        assert r.arena.accumulate
        expect = 0
        for stage, chunk in r.chunks.items():
            g = staging_depth(cfg.pipeline.wgrad_staging, slots[stage], mb)
            assert 1 <= g <= slots[stage] and slots[stage] % g == 0 or slots[stage] >= mb
            for lname, lin in chunk.matrix_linears().items():
                assert r.arena.depth(arena_name(stage, f"{lname}.weight")) == g
                expect += -(-lin.weight.numel() * 4 // 256) * 256 * (1 + g)  # fp32 region + g fp32 slots
        assert r.arena.nbytes == expect
    per_m = build_single_process(cfg, native=False, accumulate=False)
    assert [r.arena.nbytes for r in per_m.ranks] == [r.arena.nbytes * cfg.pipeline.microbatches for r in pipe.ranks]
