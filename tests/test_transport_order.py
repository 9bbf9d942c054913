"""The point-to-point hand-offs' order (`runtime.distributed.send_order`): what NCCL's in-order matching
needs, since it ignores tags. No process group here: the orders are a function of the schedule."""

from __future__ import annotations

import pytest

from qeffect.runtime.distributed import send_order
from qeffect.schedule import ActionKind, build_schedule, native_with_placement


def _wanted_order(schedule, src: int, dst: int) -> list[tuple[str, int, int]]:
    """What `dst` asks `src` for, in `dst`'s own program order (the order it used to receive in)."""
    out = []
    for a in schedule.programs[dst]:
        s, m = a.stage, a.microbatch
        if a.kind is ActionKind.F and s > 0 and schedule.stage_to_rank[s - 1] == src:
            out.append(("act", s - 1, m))
        elif (a.kind in (ActionKind.DI, ActionKind.B) and s < schedule.num_stages - 1
              and schedule.stage_to_rank[s + 1] == src):
            out.append(("grad", s + 1, m))
    return out


@pytest.mark.parametrize("name", ["interleaved", "zbv"])
@pytest.mark.parametrize("microbatches", [4, 8])
def test_every_wanted_hand_off_is_sent_once(name: str, microbatches: int) -> None:
    for sched in (build_schedule(name, 2, 2, microbatches), native_with_placement(build_schedule(name, 2, 2, microbatches))):
        for src, dst in ((0, 1), (1, 0)):
            sent = send_order(sched, src, dst)
            assert len(sent) == len(set(sent))
            assert sorted(sent) == sorted(_wanted_order(sched, src, dst))


def test_zbv_receives_out_of_the_senders_order() -> None:
    """Why the transport drains in the sender's order: with ZB-V, rank 1 wants some hand-off from rank 0
    before one rank 0 sent earlier (Interleaved happens to want them in the order they are sent)."""
    zbv, inter = build_schedule("zbv", 2, 2, 4), build_schedule("interleaved", 2, 2, 4)
    assert any(send_order(zbv, a, b) != _wanted_order(zbv, a, b) for a, b in ((0, 1), (1, 0)))
    assert all(send_order(inter, a, b) == _wanted_order(inter, a, b) for a, b in ((0, 1), (1, 0)))


def _eval_walk(schedule, rank: int, batches: int, wanted: bool) -> list[tuple[int, int]]:
    """`runtime.train.evaluate` on one process: batches in order, its stages in order; the (stage, batch)
    hand-offs it sends (`wanted=False`: to the next stage) or wants (`wanted=True`: from the previous)."""
    out = []
    for i in range(batches):
        for s in sorted(schedule.stages_of(rank)):
            if wanted and s > 0:
                out.append((s - 1, i, schedule.stage_to_rank[s - 1]))
            if not wanted and s < schedule.num_stages - 1:
                out.append((s, i, schedule.stage_to_rank[s + 1]))
    return out


@pytest.mark.parametrize("name", ["interleaved", "zbv"])
def test_evaluation_hand_offs_are_wanted_in_the_order_they_are_sent(name: str) -> None:
    """Evaluation keeps plain receives: on every pair of ranks it wants them in the order they were sent."""
    sched = build_schedule(name, 2, 2, 4)
    for src, dst in ((0, 1), (1, 0)):
        sent = [(s, i) for s, i, to in _eval_walk(sched, src, 3, wanted=False) if to == dst]
        wanted = [(s, i) for s, i, frm in _eval_walk(sched, dst, 3, wanted=True) if frm == src]
        assert sent == wanted and sent
