"""Offload plans from a pipeline schedule (`offload.plan`), checked against the offload state machine
on the fake device: with the planned banks, resident ping-pong runs a real schedule's F / dI / dW order
and every backward reads its own forward's bytes; with banks by position (mod 2) it cannot."""

from __future__ import annotations

import pytest
import torch

from qeffect.config import load_config
from qeffect.offload.fake import FakeDevice
from qeffect.offload.group import OffloadManager, OffloadStateError
from qeffect.offload.plan import assign_banks, backward_order, check_events, conflicts
from qeffect.runtime.build import schedule_of
from qeffect.schedule import ActionKind, global_order

KINDS = {ActionKind.F: "F", ActionKind.DI: "B", ActionKind.DW: "E"}


def schedule_events(schedule: str, microbatches: int) -> list[tuple[str, tuple[int, int]]]:
    cfg = load_config().with_overrides(**{"pipeline.schedule": schedule, "pipeline.microbatches": microbatches})
    return [(KINDS[a.kind], (a.stage, a.microbatch)) for _, a in global_order(schedule_of(cfg))]


def test_hand_example() -> None:
    # a's backward window [B a, E a] contains b's forward: a and b conflict; c only follows a in backward.
    ev = [("F", "a"), ("B", "a"), ("F", "b"), ("E", "a"), ("F", "c"), ("B", "c"), ("E", "c"), ("B", "b"),
          ("E", "b")]
    assert conflicts(ev) == {"a": {"b", "c"}, "b": {"a", "c"}, "c": {"a", "b"}}
    assert backward_order(ev) == ["a", "c", "b"]
    banks = assign_banks(ev)
    assert banks["a"] != banks["b"] and banks["a"] != banks["c"] and banks["b"] != banks["c"]


def test_events_must_be_complete() -> None:
    with pytest.raises(ValueError, match="'a': B after 'nothing'"):
        check_events([("B", "a")])
    with pytest.raises(ValueError, match="without a complete"):
        check_events([("F", "a"), ("B", "a")])


def _run(events, banks: list[int] | None, steps: int = 2, seed: int = 0) -> None:
    """Resident mode on the fake device: F writes a pattern into its group's view; E checks it."""
    dev = FakeDevice(seed, granularity=64 * 1024, progress=2)
    mgr = OffloadManager("resident", device="cpu", driver=dev.driver(), streams=dev)
    names = sorted({g for _, g in events})
    groups = {g: mgr.group(f"s{g[0]}.m{g[1]}") for g in names}
    for k, g in enumerate(names):
        groups[g].discover(torch.empty(5 + k % 3, 7, dtype=torch.float32))
    order = backward_order(events)
    mgr.allocate([groups[g] for g in order], banks=banks)
    try:
        for step in range(steps):
            for kind, g in events:
                grp, val = groups[g], float(1000 * step + names.index(g))
                view = grp.views[0]
                if kind == "F":
                    grp.before_forward()
                    dev.launch(dev.compute, lambda v=view, x=val: v.fill_(x), f"F{g}", touches=[view])
                    grp.after_forward()
                elif kind == "B":
                    grp.before_backward()
                else:
                    seen = []
                    dev.launch(dev.compute, lambda v=view, s=seen: s.append(v.clone()), f"E{g}", touches=[view])
                    dev.synchronize()
                    assert torch.equal(seen[0], torch.full_like(seen[0], val)), f"{g} step {step} read foreign bytes"
                    grp.after_backward()
            dev.synchronize()
    finally:
        mgr.close()


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
@pytest.mark.parametrize("microbatches", [4, 8])
@pytest.mark.parametrize("min_banks", [2, 3, 6])
def test_planned_banks_run_the_schedule(schedule: str, microbatches: int, min_banks: int) -> None:
    events = schedule_events(schedule, microbatches)
    plan = assign_banks(events, min_banks=min_banks)
    banks = [plan[g] for g in backward_order(events)]
    assert max(banks) + 1 >= min_banks and max(banks) + 1 < len(plan)  # ping-pong: fewer banks than groups
    assert len(set(banks)) == max(banks) + 1  # every bank is used (least recently used first)
    for seed in range(3):
        _run(events, banks, seed=seed)


def test_min_banks_is_checked() -> None:
    with pytest.raises(ValueError, match="min_banks"):
        assign_banks(schedule_events("interleaved", 4), min_banks=0)


def test_banks_by_position_fail_on_zbv() -> None:
    """Why the plan exists: ZB-V defers dW, so a forward needs a bank that a backward still reads."""
    events = schedule_events("zbv", 4)
    with pytest.raises(OffloadStateError, match="is busy"):
        _run(events, None)
