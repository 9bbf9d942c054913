"""Release mode does not offload groups whose backward follows their forward within fewer than
`train.offload_min_window` other actions (`offload.plan.short_window_groups`): on the fake device such a
group gets no slot and no copies, autograd keeps its saved tensors, and the other groups still round-trip
their bytes; the real schedules' short groups are the last virtual stage's."""

from __future__ import annotations

import pytest
import torch

from qeffect.config import load_config
from qeffect.offload.fake import FakeDevice
from qeffect.offload.group import GroupState, OffloadManager, OffloadStateError
from qeffect.offload.plan import backward_order, short_window_groups
from qeffect.runtime.build import schedule_of
from qeffect.schedule import ActionKind, global_order

KINDS = {ActionKind.F: "F", ActionKind.DI: "B", ActionKind.DW: "E"}


def schedule_events(schedule: str, microbatches: int = 4) -> list[tuple[str, tuple[int, int]]]:
    cfg = load_config().with_overrides(**{"pipeline.schedule": schedule, "pipeline.microbatches": microbatches})
    return [(KINDS[a.kind], (a.stage, a.microbatch)) for _, a in global_order(schedule_of(cfg))]


def test_short_window_hand_examples() -> None:
    # other actions between F and B: a one (F b), b two (B a, E a), c none
    ev = [("F", "a"), ("F", "b"), ("B", "a"), ("E", "a"), ("B", "b"), ("E", "b"), ("F", "c"), ("B", "c"),
          ("E", "c")]
    assert short_window_groups(ev, 0) == set()
    assert short_window_groups(ev, 1) == {"c"}
    assert short_window_groups(ev, 2) == {"a", "c"}
    assert short_window_groups(ev, 3) == {"a", "b", "c"}
    with pytest.raises(ValueError, match="min_window"):
        short_window_groups(ev, -1)
    with pytest.raises(ValueError, match="without a complete"):
        short_window_groups([("F", "a"), ("B", "a")], 1)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_the_default_window_leaves_the_last_stage_on_the_device(schedule: str) -> None:
    """PP=2 x 2 chunks, M=4 (the default and h2048 shapes): the last virtual stage's input gradient comes
    within one action of its forward, every other group's after many; the default (2) names exactly the
    last stage's groups, 0 names none."""
    events = schedule_events(schedule)
    assert load_config().train.offload_min_window == 2
    assert short_window_groups(events, 2) == {(3, m) for m in range(4)}
    assert short_window_groups(events, 0) == set()


def _release_run(events, min_window: int, steps: int = 3, seed: int = 0):
    """Release mode on the fake device over the schedule's events: F writes a pattern into each offloaded
    group's first view, E reads it back. Returns the manager (closed) and its groups by event key."""
    dev = FakeDevice(seed, granularity=64 * 1024, progress=2)
    mgr = OffloadManager("release", device="cpu", driver=dev.driver(), streams=dev, min_window=min_window)
    names = sorted({g for _, g in events})
    groups = {g: mgr.group(f"s{g[0]}.m{g[1]}") for g in names}
    for k, g in enumerate(names):
        groups[g].discover(torch.empty(5 + k % 3, 7, dtype=torch.float32))
    mgr.allocate([groups[g] for g in backward_order(events)], events=[(kind, groups[g]) for kind, g in events])
    try:
        for step in range(steps):
            for kind, g in events:
                grp, val = groups[g], float(1000 * step + names.index(g))
                if kind == "F":
                    grp.before_forward()
                    if grp.offloaded:
                        view = grp.views[0]
                        dev.launch(dev.compute, lambda v=view, x=val: v.fill_(x), f"F{g}", touches=[view])
                    grp.after_forward()
                elif kind == "B":
                    grp.before_backward()
                else:
                    if grp.offloaded:
                        view, seen = grp.views[0], []
                        dev.launch(dev.compute, lambda v=view, s=seen: s.append(v.clone()), f"E{g}", touches=[view])
                        dev.synchronize()
                        assert torch.equal(seen[0], torch.full_like(seen[0], val)), f"{g} step {step} read foreign bytes"
                    grp.after_backward()
            dev.synchronize()
    finally:
        mgr.close()
    return mgr, groups


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_short_window_groups_get_no_slot_and_no_copies(schedule: str) -> None:
    events = schedule_events(schedule)
    short = short_window_groups(events, 2)
    mgr, groups = _release_run(events, 2)
    n, steps = len(groups), 3
    assert {k for k, g in groups.items() if not g.offloaded} == short
    assert [g.name for g in mgr.not_offloaded] == [groups[k].name for k in backward_order(events) if k in short]
    assert all(groups[k].slot is None and groups[k].va is None and groups[k].host is None for k in short)
    st = mgr.stats
    assert st.d2h_copies == steps * (n - len(short)) and st.h2d_copies <= steps * (n - len(short))
    everything, _ = _release_run(events, 0)
    assert everything.not_offloaded == [] and everything.stats.d2h_copies == steps * n


def test_resident_mode_ignores_the_window() -> None:
    events = schedule_events("interleaved")
    dev = FakeDevice(0, granularity=64 * 1024)
    mgr = OffloadManager("resident", device="cpu", driver=dev.driver(), streams=dev, min_window=5)
    groups = {g: mgr.group(f"s{g[0]}.m{g[1]}") for g in sorted({g for _, g in events})}
    for g in groups.values():
        g.discover(torch.empty(3, 3))
    mgr.allocate([groups[g] for g in backward_order(events)], events=[(k, groups[g]) for k, g in events])
    assert mgr.not_offloaded == [] and all(g.offloaded and g.slot is not None for g in groups.values())
    mgr.close()
    with pytest.raises(ValueError, match="min_window"):
        OffloadManager("release", device="cpu", driver=dev.driver(), streams=dev, min_window=-1)


def test_a_not_offloaded_group_leaves_autograd_alone_and_backward_is_bitwise() -> None:
    """Its capture hooks store nothing in a slot: autograd keeps its own saved tensors, and its gradients
    are the plain run's, bit for bit; its hooks still check the order (a second after_backward raises)."""
    gen = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 5, generator=gen))
    x = torch.randn(4, 6, generator=gen, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ w).sin()

    ref = torch.autograd.grad(f(x).sum(), (x, w))
    dev = FakeDevice(0, granularity=64 * 1024)
    mgr = OffloadManager("release", device="cpu", driver=dev.driver(), streams=dev, min_window=1)
    a, b = mgr.group("a"), mgr.group("b")
    for g in (a, b):
        with g.discovery_hooks():
            f(x)
    # a's backward follows its forward at once: not offloaded; b's window holds a's three actions
    events = [("F", b), ("F", a), ("B", a), ("E", a), ("B", b), ("E", b)]
    mgr.allocate([a, b], events=events)
    assert not a.offloaded and b.offloaded and a.slot is None and a.views == [] and b.slot is not None
    a.before_forward()
    with dev.host_compute(), a.capture_hooks():
        y = f(x)
    a.after_forward()
    calls = len(dev.trace)
    a.before_backward()
    got = torch.autograd.grad(y.sum(), (x, w))
    a.after_backward()
    assert len(dev.trace) == calls and a.state is GroupState.MAPPED
    assert all(torch.equal(p, q) for p, q in zip(got, ref, strict=True))
    with pytest.raises(OffloadStateError, match="after_backward"):
        a.after_backward()
    mgr.close()


def test_config_reaches_the_manager(monkeypatch) -> None:
    from qeffect.runtime import build as build_mod

    made = {}

    class _Manager:
        def __init__(self, mode, **kw) -> None:
            made.update(kw, mode=mode)

    monkeypatch.setattr(build_mod, "OffloadManager", _Manager)
    cfg = load_config().with_overrides(**{"train.offload_min_window": 7})
    build_mod.make_offload_manager("release", "cpu", cfg.train.offload_banks, cfg.train.offload_reap,
                                   cfg.train.offload_skip_kept_d2h, cfg.train.offload_min_window)
    assert made["min_window"] == 7 and made["mode"] == "release"
    with pytest.raises(Exception, match="offload_min_window"):
        load_config().with_overrides(**{"train.offload_min_window": -1})
