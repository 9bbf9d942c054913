"""Offload plans from a pipeline schedule (`offload.plan`), checked against the offload state machine
on the fake device: with the planned banks, resident ping-pong runs a real schedule's F / dI / dW order
and every backward reads its own forward's bytes; with banks by position (mod 2) it cannot. The groups
`kept_groups` keeps are exactly those the state machine never evicts, and skipping their D2H keeps
every byte right. In release mode the groups `short_window_groups` names (the last virtual stage's) get
no slot and no copies, autograd keeps their saved tensors, and the other groups' bytes stay right."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qeffect.config import OffloadConfig, load_config
from qeffect.offload.fake import FakeDevice
from qeffect.offload.group import GroupState, OffloadManager, OffloadStateError, OffloadStats
from qeffect.offload.plan import (
    assign_banks,
    backward_order,
    check_events,
    conflicts,
    explicit_banks,
    kept_groups,
    shared_slots,
    short_window_groups,
)
from qeffect.offload.planning import named_events
from qeffect.runtime.build import schedule_of
from qeffect.schedule import global_order


def manager(mode: str, dev: FakeDevice, **kw) -> OffloadManager:
    """A manager on the fake device whose config has `kw` over these tests' base: consumed slots reaped and
    every group offloaded (`reap`, `min_window` 0) unless given: the state machine's paths, not a run's."""
    config = OffloadConfig(mode=mode, **{"reap": True, "min_window": 0, **kw})
    return OffloadManager(config, device="cpu", driver=dev.driver(), streams=dev)


def schedule_events(schedule: str, microbatches: int) -> list[tuple[str, tuple[int, int]]]:
    cfg = load_config().with_overrides(**{"pipeline.schedule": schedule, "pipeline.microbatches": microbatches})
    return named_events(global_order(schedule_of(cfg)))


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


def _run(events, banks: list[int] | None, steps: int = 2, seed: int = 0, *, plan: bool = False,
         skip: bool = True, mode: str = "resident", min_window: int = 0,
         share: bool = False, reap: bool = True, members: int = 2,
         at_backward: bool = True) -> tuple[OffloadStats, set, set]:
    """`mode` (resident by default) on the fake device: F writes a pattern into its group's view; E checks
    it. `plan`: the manager gets the events (resident: kept groups, with `skip`; release: groups not
    offloaded, with `min_window`; both modes). `at_backward`: release's `release_at_backward` (a backward before
    its slot went waits and restores: every group goes out and back). Returns the stats, the groups the manager keeps (resident) or does not
    offload (release), and the groups found not evicted (d2h pending or kept) at their backward in every step."""
    dev = FakeDevice(seed, granularity=64 * 1024, progress=2)
    mgr = manager(mode, dev, skip_kept_d2h=skip, min_window=min_window, share_slots="any" if share else "off",
                  reap=reap, slot_members=members, release_at_backward=at_backward, share_gap=0)
    names = sorted({g for _, g in events})
    groups = {g: mgr.group(f"s{g[0]}.m{g[1]}") for g in names}
    for k, g in enumerate(names):
        groups[g].discover(torch.empty(5 + k % 3, 7, dtype=torch.float32))
    order = backward_order(events)
    mgr.allocate([groups[g] for g in order], banks=banks,
                 events=[(kind, groups[g]) for kind, g in events] if plan else None)
    in_bank = set(names)
    try:
        for step in range(steps):
            for kind, g in events:
                grp, val = groups[g], float(1000 * step + names.index(g))
                view = grp.views[0] if grp.offloaded else None  # a group release mode leaves alone has none
                if kind == "F":
                    grp.before_forward()
                    if view is not None:
                        dev.launch(dev.compute, lambda v=view, x=val: v.fill_(x), f"F{g}", touches=[view])
                    grp.after_forward()
                elif kind == "B":
                    if grp.state not in (GroupState.RESIDENT_D2H_PENDING, GroupState.RESIDENT_KEPT):
                        in_bank.discard(g)
                    grp.before_backward()
                else:
                    if view is not None:
                        seen = []
                        dev.launch(dev.compute, lambda v=view, s=seen: s.append(v.clone()), f"E{g}", touches=[view])
                        dev.synchronize()
                        assert torch.equal(seen[0], torch.full_like(seen[0], val)), f"{g} step {step} read foreign bytes"
                    grp.after_backward()
            dev.synchronize()
    finally:
        mgr.close()
    chosen = mgr.kept if mode == "resident" else mgr.not_offloaded
    return mgr.stats, {g for g in names if groups[g] in chosen}, in_bank


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


# ------------------------------------------------------------------------------------ kept groups
def test_kept_groups_hand_examples() -> None:
    # a layer stack on two banks: a's window holds b's F and B (bank 1), b's window nothing: both kept
    stack = [("F", "a"), ("F", "b"), ("B", "b"), ("E", "b"), ("B", "a"), ("E", "a")]
    assert kept_groups(stack, {"a": 0, "b": 1}) == {"a", "b"}
    # three groups, a and c share bank 0: c's F evicts a; b (bank 1) sees only bank-0 events
    three = [("F", "a"), ("F", "b"), ("F", "c"), ("B", "c"), ("E", "c"), ("B", "b"), ("E", "b"), ("B", "a"),
             ("E", "a")]
    assert kept_groups(three, {"a": 0, "b": 1, "c": 0}) == {"b", "c"}
    # a restore is a claim too: g's F evicts h (one bank), then h's B restores h over g's bytes
    restore = [("F", "h"), ("F", "g"), ("B", "h"), ("E", "h"), ("B", "g"), ("E", "g")]
    assert kept_groups(restore, {"h": 0, "g": 0}) == set()
    assert kept_groups(restore, {"h": 0, "g": 1}) == {"h", "g"}
    # events after B (the backward window up to E, the next forward of a later group) do not matter
    late = [("F", "a"), ("B", "a"), ("F", "b"), ("E", "a"), ("B", "b"), ("E", "b")]
    assert kept_groups(late, {"a": 0, "b": 0}) == {"a", "b"}
    # an empty group (no bank) claims nothing and is not kept; banks of unknown groups are refused
    assert kept_groups(three, {"a": 0, "b": 1}) == {"a", "b"}
    with pytest.raises(ValueError, match="without events"):
        kept_groups(stack, {"a": 0, "z": 1})
    with pytest.raises(ValueError, match="complete"):
        kept_groups([("F", "a")], {"a": 0})


def test_kept_groups_match_the_state_machine_on_hand_banks() -> None:
    """The one-bank restore case on the fake device: the kept set is what the manager does not evict."""
    ev = [("F", (0, 0)), ("F", (0, 1)), ("B", (0, 0)), ("E", (0, 0)), ("B", (0, 1)), ("E", (0, 1))]
    for banks, kept in (([0, 0], set()), ([0, 1], {(0, 0), (0, 1)})):
        stats, planned, in_bank = _run(ev, banks, steps=3, plan=True, skip=False)
        assert planned == set() and in_bank == kept == kept_groups(ev, dict(zip(backward_order(ev), banks,
                                                                               strict=True)))


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
@pytest.mark.parametrize("microbatches", [4, 8])
@pytest.mark.parametrize("min_banks", [2, 3, 6])
def test_kept_groups_are_exactly_the_groups_never_evicted(schedule: str, microbatches: int, min_banks: int) -> None:
    """Real schedules, 3 steps: without skipping, the groups the manager never evicts are `kept_groups`;
    with skipping, those (and only those) skip their D2H, nothing else changes, and every byte is right."""
    events = schedule_events(schedule, microbatches)
    plan = assign_banks(events, min_banks=min_banks)
    banks = [plan[g] for g in backward_order(events)]
    kept = kept_groups(events, plan)
    steps, n = 3, len(plan)
    base, none_kept, in_bank = _run(events, banks, steps=steps, plan=True, skip=False)
    assert none_kept == set() and in_bank == kept
    assert base.d2h_copies == steps * n and base.d2h_skipped == 0 and base.reloads_skipped == steps * len(kept)
    for seed in range(2):
        st, planned, in_bank = _run(events, banks, steps=steps, seed=seed, plan=True)
        assert planned == in_bank == kept
        assert st.d2h_skipped == steps * len(kept) and st.d2h_copies == steps * (n - len(kept))
        assert (st.h2d_copies, st.evictions, st.reloads_skipped) == (base.h2d_copies, base.evictions,
                                                                     base.reloads_skipped)
    if min_banks == 6:
        assert kept  # more banks than the colouring needs: some groups are never evicted


def test_a_claim_off_the_plan_raises_instead_of_evicting_a_kept_group() -> None:
    """The plan comes from one order; hooks in another order would evict a kept group (its bytes exist
    nowhere else): the claim raises, naming both groups and the bank."""
    events = schedule_events("zbv", 4)
    plan = assign_banks(events, min_banks=6)
    kept = kept_groups(events, plan)
    g = next(iter(sorted(kept)))
    other = next(h for h in sorted(plan) if h != g and plan[h] == plan[g])
    dev = FakeDevice(0, granularity=64 * 1024)
    mgr = manager("resident", dev)
    groups = {h: mgr.group(f"s{h[0]}.m{h[1]}") for h in sorted(plan)}
    for grp in groups.values():
        grp.discover(torch.empty(4, 4))
    mgr.allocate([groups[h] for h in backward_order(events)], banks=[plan[h] for h in backward_order(events)],
                 events=[(kind, groups[h]) for kind, h in events])
    groups[g].before_forward()
    groups[g].after_forward()
    assert groups[g].state is GroupState.RESIDENT_KEPT
    with pytest.raises(OffloadStateError, match=f"bank {plan[g]}") as err:
        groups[other].before_forward()  # off the plan: other's forward would overwrite g's bank
    msg = str(err.value)
    assert f"bank {plan[g]}" in msg and groups[g].name in msg and groups[other].name in msg and "skipped" in msg
    assert groups[g].state is GroupState.RESIDENT_KEPT and groups[g].bank.owner is groups[g]  # nothing changed
    groups[g].before_backward()  # g's own backward still reads its bytes
    groups[g].after_backward()
    dev.synchronize()
    mgr.close()


# ------------------------------------------------------------------------------ wiring from config
class _Act:
    def __init__(self, stage: int, groups: dict) -> None:
        self.stage, self.groups, self.offload, self.captured = stage, groups, None, 0
        self.chunk = torch.nn.Linear(8, 8 * (1 + stage))  # the bank search's duration estimate reads its weights

    def chain(self, m: int) -> int:  # one chain (and group) per microbatch
        return m

    def prepare(self, microbatches: int, microbatch_size: int, seq_len: int) -> None:
        self.plan = SimpleNamespace(per_microbatch=[None] * microbatches)
        for g in self.groups.values():
            if not g.specs:
                g.discover(torch.empty(3 + self.stage, 4))

    def capture_graphs(self) -> None:
        self.captured += 1


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_config_switch_reaches_the_manager_and_capture_passes_the_events(monkeypatch, schedule: str,
                                                                         skip: bool) -> None:
    """`offload.skip_kept_d2h` goes through `make_offload_manager` (in the one config, as `offload.banks` and
    `offload.reap` do) and `capture_ranks` plans with the step's events: the resident manager keeps
    exactly `kept_groups` of the planned banks, or nothing with the switch off."""
    cfg = load_config().with_overrides(**{"pipeline.schedule": schedule, "offload.skip_kept_d2h": skip,
                                          "offload.banks": 3, "offload.bank_plan": "colour",
                                          "offload.min_window": 0})  # every group offloaded
    assert load_config().offload.skip_kept_d2h is True
    mgr, made, acts, order = _captured(monkeypatch, cfg)
    assert made == cfg.offload.model_copy(update={"mode": "resident"}) and mgr.config is made
    assert mgr.skip_kept_d2h is skip and mgr.num_banks >= 3
    events = named_events(order)
    plan = assign_banks(events, min_banks=3)
    names = {g.name for g in mgr.kept}
    want = {f"s{s}.m{m}" for s, m in kept_groups(events, plan)} if skip else set()
    assert names == want and (want or not skip)
    assert all(a.captured == 1 for a in acts.values())
    mgr.close()


# h2048's Interleaved order (4 microbatches): `scripts/offload_sim.py --banks 4 --search 200` found these banks
SEARCHED = "0:3:0:1:0:3:2:1:0:2:0:3:2:1:0:2"


def test_banks_given_by_hand_reach_the_manager_and_run_the_schedule(monkeypatch) -> None:
    """`offload.explicit_banks` overrides the bank plan; banks that do not fit the schedule are a config error
    at capture, naming the field."""
    from qeffect.errors import UserError

    given = [int(b) for b in SEARCHED.split(":")]
    mgr, _, _, order = _captured(monkeypatch, load_config().with_overrides(**{"offload.explicit_banks": given}))
    assert mgr.bank_plan == given and mgr.num_banks == 4 and mgr.bank_search is None
    mgr.close()
    with pytest.raises(UserError, match=r"offload\.explicit_banks=.*expected 16 bank indices"):
        _captured(monkeypatch, load_config().with_overrides(**{"offload.explicit_banks": [0, 1]}))
    events = schedule_events("interleaved", 4)
    for seed in range(3):
        _run(events, given, seed=seed, plan=True)  # every backward reads its own forward's bytes


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_the_default_plan_is_the_search_and_runs_the_schedule(monkeypatch, schedule: str) -> None:
    """`offload.bank_plan = "search"` (the default): `capture_ranks` allocates the plan that
    `offload.timing.search_banks` finds over the step's events and the estimated costs, no slower in the
    simulation and no larger than the colouring with `offload.search_banks` banks, and with it every
    backward reads its own forward's bytes on the fake device."""
    from qeffect.offload.timing import simulate

    cfg = load_config().with_overrides(**{"pipeline.schedule": schedule})
    assert cfg.offload.bank_plan == "search" and cfg.offload.search_banks == 6
    mgr, _, acts, order = _captured(monkeypatch, cfg)
    found = mgr.bank_search
    assert found is not None and mgr.bank_plan == list(found.best.plan) and found.seconds > 0
    assert found.best.step_ms <= found.colour.step_ms and found.best.mapped_bytes <= found.budget_bytes
    events, costs = _estimate(mgr, acts, order)
    assert simulate(events, costs, found.best.plan, mgr.config).step_ms == found.best.step_ms  # what it found
    assert found.colour.plan == tuple(assign_banks(events, min_banks=6)[g] for g in backward_order(events))
    mgr.close()
    named = schedule_events(schedule, 4)
    for seed in range(3):
        _run(named, list(found.best.plan), seed=seed, plan=True)  # every backward reads its own forward's bytes


def test_banks_given_by_hand_are_checked() -> None:
    events = schedule_events("interleaved", 4)
    assert explicit_banks(events, SEARCHED) == [int(b) for b in SEARCHED.split(":")]
    with pytest.raises(ValueError, match="expected bank indices separated by"):
        explicit_banks(events, "0,one")
    with pytest.raises(ValueError, match="expected 16 bank indices >= 0"):
        explicit_banks(events, "0,1")
    with pytest.raises(ValueError, match=r"conflict .* but share bank 0"):
        explicit_banks(events, ",".join(["0"] * 16))
    assert explicit_banks(events, [int(b) for b in SEARCHED.split(":")]) == explicit_banks(events, SEARCHED)
    with pytest.raises(ValueError, match=r"offload\.explicit_banks='0:1': expected 16"):
        explicit_banks(events, [0, 1])


def _captured(monkeypatch, cfg):
    """`make_offload_manager` and `capture_ranks` for `cfg` in resident mode over stand-in actions on the fake
    device: (the manager, the config it was made with, the actions, the schedule's order)."""
    from qeffect.runtime import build as build_mod

    dev = FakeDevice(0, granularity=64 * 1024)
    made = []

    def fake_manager(config, **kw):
        made.append(config)
        return OffloadManager(config, device="cpu", driver=dev.driver(), streams=dev)

    monkeypatch.setattr(build_mod, "OffloadManager", fake_manager)
    cfg = cfg.with_overrides(**{"offload.mode": "resident"})
    mgr = build_mod.make_offload_manager(build_mod.offload_config(cfg), "cpu")
    sched = schedule_of(cfg)
    order = global_order(sched)
    acts = {s: _Act(s, {m: mgr.group(f"s{s}.m{m}") for m in range(sched.microbatches)})
            for s in range(sched.num_stages)}
    for a in acts.values():
        a.offload = mgr

    class _Rank:
        def __init__(self, r: int) -> None:
            self.microbatches = sched.microbatches
            self.actions = {s: acts[s] for s in range(sched.num_stages) if sched.stage_to_rank[s] == r}

    ranks = [_Rank(r) for r in range(sched.pp)]
    build_mod.capture_ranks(ranks, order, mgr, 1, 8)
    return mgr, made[0], acts, order


def _estimate(mgr: OffloadManager, acts: dict, order) -> tuple[list, object]:
    """The events and estimated costs `offload.planning.plan` searched with for `_captured`'s pipeline."""
    from qeffect.offload.planning import estimate_costs, step_events
    from qeffect.runtime.build import offload_step

    step = offload_step([type("R", (), {"actions": acts})()], order, 1, 8)
    events = step_events(step.order, step.groups)
    return events, estimate_costs(mgr, events, step)


# ------------------------------------------------------------------- release: short windows
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
def test_the_windows_name_the_late_stages_groups(schedule: str) -> None:
    """PP=2 x 2 chunks, M=4 (the default and h2048 shapes): the last virtual stage's input gradient comes
    within one action of its forward, every other group's after many; 2 names exactly the last stage's
    groups, 0 names none. The default (12) also names the third virtual stage's short ones: all four in
    Interleaved (5 to 11 actions between forward and input gradient), microbatches 0 and 3 in ZB-V (5 and
    7; 1 and 2 have 13)."""
    events = schedule_events(schedule, 4)
    last = {(3, m) for m in range(4)}
    assert short_window_groups(events, 2) == last
    assert short_window_groups(events, 0) == set()
    assert load_config().offload.min_window == 12
    third = {(2, m) for m in (range(4) if schedule == "interleaved" else (0, 3))}
    assert short_window_groups(events, 12) == last | third


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_short_window_groups_get_no_slot_and_no_copies(schedule: str) -> None:
    """Release mode over the real schedule, 3 steps: the groups the plan names get no slot and no D2H,
    the others still read their own bytes back; with `min_window = 0` every group is offloaded."""
    events, steps = schedule_events(schedule, 4), 3
    short = short_window_groups(events, 2)
    st, not_offloaded, _ = _run(events, None, steps, plan=True, mode="release", min_window=2)
    n = len({g for _, g in events})
    assert not_offloaded == short and st.d2h_copies == steps * (n - len(short))
    assert st.h2d_copies <= steps * (n - len(short))
    st, not_offloaded, _ = _run(events, None, steps, plan=True, mode="release", min_window=0)
    assert not_offloaded == set() and st.d2h_copies == steps * n


def test_resident_mode_leaves_the_windows_groups_out_and_off_mode_ignores_it() -> None:
    events = schedule_events("interleaved", 4)
    short = short_window_groups(events, 5)
    assert short and len(short) < 16
    dev = FakeDevice(0, granularity=64 * 1024)
    mgr = manager("resident", dev, min_window=5)
    groups = {g: mgr.group(f"s{g[0]}.m{g[1]}") for g in sorted({g for _, g in events})}
    for g in groups.values():
        g.discover(torch.empty(3, 3))
    mgr.allocate([groups[g] for g in backward_order(events)], events=[(k, groups[g]) for k, g in events])
    assert {g.name for g in mgr.not_offloaded} == {groups[g].name for g in short}
    assert all(g.offloaded == (k not in short) and (g.bank is None) == (k in short) for k, g in groups.items())
    mgr.close()
    mgr = manager("off", dev, min_window=5)
    assert mgr.short_window(events) == set()
    mgr.close()
    with pytest.raises(ValueError, match="min_window"):
        OffloadConfig(mode="release", min_window=-1)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_resident_with_a_window_leaves_the_short_groups_on_the_device(schedule: str) -> None:
    """`min_window = 2` in resident mode (`offload.min_window`): the last stage's groups get no
    slot, no bank and no copies; the others still read their own bytes back (three seeds), and the banks
    are sized by the offloaded groups alone."""
    events, steps = schedule_events(schedule, 4), 3
    short = short_window_groups(events, 2)
    assert short == {(3, m) for m in range(4)}
    plan = assign_banks(events, min_banks=2)
    banks = [plan[g] for g in backward_order(events)]
    for seed in range(3):
        st, kept, _ = _run(events, banks, steps, seed=seed, plan=True, min_window=2)
        assert not kept & short and st.d2h_copies + st.d2h_skipped == steps * (16 - len(short))
    dev = FakeDevice(0, granularity=64 * 1024)
    mgr = manager("resident", dev, min_window=2)
    groups = {g: mgr.group(f"s{g[0]}.m{g[1]}") for g in sorted({g for _, g in events})}
    for g, grp in groups.items():
        grp.discover(torch.empty(1 << (16 + 2 * (g[0] == 3)), dtype=torch.uint8))  # the last stage's 4x larger
    mgr.allocate([groups[g] for g in backward_order(events)], banks=banks,
                 events=[(k, groups[g]) for k, g in events])
    assert {g.name for g in mgr.not_offloaded} == {f"s3.m{m}" for m in range(4)}
    assert all(groups[g].slot is None and groups[g].bank is None for g in short)
    assert all(b.slot.size == 1 << 16 for b in mgr.banks)  # no bank holds a 256 KiB group
    mgr.close()


def test_the_resident_window_comes_from_the_config(monkeypatch) -> None:
    """`offload.min_window` (default 12) reaches the resident manager `capture_ranks` builds: the last
    two stages' groups are not offloaded (Interleaved, M=4), with 2 the last stage's; 0 offloads every group
    (the A/B)."""
    mgr, made, _, _ = _captured(monkeypatch, load_config())
    late = {f"s{s}.m{m}" for s in (2, 3) for m in range(4)}
    assert made.min_window == 12 and {g.name for g in mgr.not_offloaded} == late
    mgr.close()
    mgr, made, _, _ = _captured(monkeypatch, load_config().with_overrides(**{"offload.min_window": 2}))
    assert made.min_window == 2 and {g.name for g in mgr.not_offloaded} == {f"s3.m{m}" for m in range(4)}
    mgr.close()
    mgr, made, _, _ = _captured(monkeypatch, load_config().with_overrides(**{"offload.min_window": 0}))
    assert made.min_window == 0 and mgr.not_offloaded == [] and all(g.bank is not None for g in mgr.groups)
    mgr.close()


@pytest.mark.parametrize("prefer", ["copies", "memory"])
def test_capture_searches_with_the_preference_of_the_config(monkeypatch, prefer: str) -> None:
    """`offload.search_prefer` (default "copies") reaches `capture_ranks`' search: its plan is the one
    `search_banks` finds for the same events, estimate and config, and the two preferences differ here."""
    from qeffect.offload.timing import search_banks

    cfg = load_config()
    assert cfg.offload.search_prefer == "copies"
    mgr, made, acts, order = _captured(monkeypatch, cfg.with_overrides(**{"offload.search_prefer": prefer}))
    assert made.search_prefer == mgr.config.search_prefer == prefer
    events, costs = _estimate(mgr, acts, order)
    want = {p: search_banks(events, costs, made.model_copy(update={"search_prefer": p})).best
            for p in ("copies", "memory")}
    assert mgr.bank_search.best == want[prefer]
    assert want["copies"].d2h_bytes < want["memory"].d2h_bytes  # the two differ here: the test can fail
    mgr.close()


def test_the_search_tries_come_from_the_config(monkeypatch) -> None:
    """`offload.search_tries` reaches the capture-time search; 0 keeps the colouring with `search_banks` banks."""
    mgr, made, acts, order = _captured(monkeypatch, load_config().with_overrides(**{"offload.search_tries": 0}))
    found = mgr.bank_search
    assert made.search_tries == 0 and found.tried == 1 and found.best == found.colour
    events, _ = _estimate(mgr, acts, order)
    assert mgr.bank_plan == [assign_banks(events, min_banks=6)[g] for g in backward_order(events)]
    mgr.close()


def test_one_planning_call_allocates_a_release_manager_from_its_config() -> None:
    """`offload.planning.plan` in release mode: no banks and no search; the config's window names the groups
    left on the device, its sharing rule the runs of the others that share a slot."""
    from qeffect.offload.planning import StepInputs, plan

    cfg = load_config()
    events = schedule_events("interleaved", 4)
    dev = FakeDevice(0, granularity=64 * 1024)
    mgr = OffloadManager(OffloadConfig(mode="release"), device="cpu", driver=dev.driver(), streams=dev)
    groups = {g: mgr.group(f"s{g[0]}.m{g[1]}") for g in sorted({g for _, g in events})}
    for grp in groups.values():
        grp.discover(torch.empty(4, 4))
    order = [a for _, a in global_order(schedule_of(cfg))]
    got = plan(mgr, StepInputs(order=order, groups=groups, elements=dict.fromkeys(range(4), 1), tokens=8))
    assert got.banks is None and got.search is None and mgr.bank_search is None
    assert got.events == [(k, groups[g]) for k, g in events] and got.backward == mgr.backward_order
    short = short_window_groups(events, cfg.offload.min_window)
    assert {g.name for g in mgr.not_offloaded} == {groups[g].name for g in short}
    runs = shared_slots(events, [g for g in backward_order(events) if g not in short], cfg.offload.slot_members,
                        min_gap=cfg.offload.share_gap)
    assert runs and [[g.name for g in run] for run in mgr.shared] == [[groups[g].name for g in run] for run in runs]
    mgr.close()


def test_the_search_leaves_the_short_groups_out_of_the_banks(monkeypatch) -> None:
    """With the resident window (the default), the capture-time search sees the short groups as empty (no
    bank, no copies) and its plan runs: the manager maps banks for the offloaded groups only."""
    mgr, _, acts, order = _captured(monkeypatch, load_config())
    assert {g.name for g in mgr.not_offloaded} == {f"s{s}.m{m}" for s in (2, 3) for m in range(4)}
    assert mgr.bank_search is not None and mgr.banks and all(g.bank is None for g in mgr.not_offloaded)
    _, costs = _estimate(mgr, acts, order)
    assert {g.name for g, n in costs.nbytes.items() if n == 0} == {g.name for g in mgr.not_offloaded}
    mgr.close()


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
    mgr = manager("release", dev, min_window=1)
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
        def __init__(self, config, **kw) -> None:
            made.update(config=config, **kw)

    monkeypatch.setattr(build_mod, "OffloadManager", _Manager)
    assert load_config().offload.lookahead == 1
    cfg = load_config().with_overrides(**{"offload.mode": "release", "offload.min_window": 7, "offload.lookahead": 3})
    build_mod.make_offload_manager(build_mod.offload_config(cfg), "cpu")
    assert made["config"] is cfg.offload and list(made) == ["config", "device"]  # one model, nothing else
    assert build_mod.offload_config(cfg, native=True) == cfg.offload.model_copy(update={"mode": "off"})
    from qeffect.errors import UserError

    for field in ("min_window", "lookahead"):
        with pytest.raises(UserError, match=rf"invalid configuration: offload\.{field}: Input should be greater"):
            load_config().with_overrides(**{f"offload.{field}": -1})


def test_a_not_offloaded_group_backward_still_starts_the_next_restore() -> None:
    """Look-ahead: the group after a not-offloaded one in backward order is restored during that group's
    backward, as it would be during an offloaded one's."""
    dev = FakeDevice(0, granularity=64 * 1024)
    mgr = manager("release", dev, min_window=1)
    a, b = mgr.group("a"), mgr.group("b")
    for g in (a, b):
        g.discover(torch.empty(4, 4))
    events = [("F", b), ("F", a), ("B", a), ("E", a), ("B", b), ("E", b)]  # a: no window, b: three actions
    mgr.allocate([a, b], events=events)
    assert mgr.not_offloaded == [a] and a.next_backward is b
    b.before_forward()
    b.after_forward()
    a.before_forward()
    a.after_forward()
    dev.synchronize()
    assert mgr.reap(block=True) == 1 and b.state is GroupState.UNMAPPED  # b's bytes are on the host only
    a.before_backward()
    a.backward_launched()
    assert mgr.stats.prefetches == 1 and b.state is GroupState.MAPPED and b._restore_pending
    a.after_backward()
    b.before_backward()
    b.backward_launched()
    b.after_backward()
    assert mgr.stats.h2d_copies == 1
    mgr.close()


def test_shared_slots_hand_examples() -> None:
    stack = [("F", "a"), ("F", "b"), ("F", "c"), ("B", "c"), ("E", "c"), ("B", "b"), ("E", "b"), ("B", "a"), ("E", "a")]
    assert shared_slots(stack) == [["c", "b"]]  # (b, a) would do as well: one slot saved, forwards as close
    assert shared_slots(stack, max_members=3) == shared_slots(stack, max_members=3, nested=True) == [["c", "b", "a"]]
    assert shared_slots(stack, max_members=1) == []
    assert shared_slots(stack, groups={"a", "b"}) == [["b", "a"]]
    fifo = [("F", "a"), ("F", "b"), ("B", "a"), ("E", "a"), ("B", "b"), ("E", "b")]  # not nested, both forwards first
    assert shared_slots(fifo) == [["a", "b"]] and shared_slots(fifo, nested=True) == []
    one_f_one_b = [("F", "a"), ("B", "a"), ("E", "a"), ("F", "b"), ("B", "b"), ("E", "b")]  # b's forward too late
    assert shared_slots(one_f_one_b) == []
    with pytest.raises(ValueError, match="max_members"):
        shared_slots(stack, max_members=0)
    with pytest.raises(ValueError, match="F/B/E"):
        shared_slots(stack[:-1])


def test_shared_slots_min_gap() -> None:
    """`min_gap`: a run needs that many events between its last forward and its first backward (the time its
    last D2H has to finish and be seen), else its members get slots of their own."""
    fifo = [("F", "a"), ("F", "b"), ("F", "c"), ("B", "a"), ("E", "a"), ("B", "b"), ("E", "b"), ("B", "c"), ("E", "c")]
    assert shared_slots(fifo) == shared_slots(fifo, min_gap=1) == [["a", "b"]]  # [a, b]: F c between
    assert shared_slots(fifo, min_gap=2) == [["b", "c"]]  # [b, c]: B a and E a between
    assert shared_slots(fifo, min_gap=3) == []
    assert shared_slots(fifo, groups={"a", "b"}, min_gap=1) == [["a", "b"]]  # (F c counts, offloaded or not)
    with pytest.raises(ValueError, match="min_gap"):
        shared_slots(fifo, min_gap=-1)
    # h2048 Interleaved (PP=2 x 2 chunks, M=4, the last stage left on the device): stage 2's microbatches 0 and
    # 1 share a slot with three actions between the second's forward and the first's backward; with
    # min_gap=4 they do not, and the plan takes one slot more
    events = schedule_events("interleaved", 4)
    keep = {g for _, g in events} - short_window_groups(events, 2)
    assert [(2, 0), (2, 1)] in shared_slots(events, keep)
    gapped = shared_slots(events, keep, min_gap=4)
    assert all((2, 0) not in run for run in gapped) and len(gapped) == len(shared_slots(events, keep)) - 1
    first = {g: i for i, (k, g) in enumerate(events) if k == "F"}
    start = {g: i for i, (k, g) in enumerate(events) if k == "B"}
    assert all(start[run[0]] - max(first[g] for g in run) - 1 >= 4 for run in gapped)


def test_shared_slots_prefer_the_closer_forwards() -> None:
    """Of two partitions with as many slots, the one whose members' forwards are closer together (the shared
    slot waits less for its last forward before it can go)."""
    ev = [("F", "a"), ("F", "x"), ("F", "y"), ("F", "b"), ("B", "b"), ("E", "b"), ("B", "a"), ("E", "a"),
          ("B", "y"), ("E", "y"), ("B", "x"), ("E", "x")]
    # backward order b, a, y, x: every pair fits (all forwards first); (b, a) and (y, x), forwards 3 and 1
    # apart, against (a, y) 2 apart with b and x alone (more slots)
    assert shared_slots(ev) == [["b", "a"], ["y", "x"]]
    ev = [("F", "x"), ("F", "a"), ("F", "q"), ("B", "q"), ("E", "q"), ("F", "b"), ("B", "b"), ("E", "b"),
          ("B", "a"), ("E", "a"), ("B", "x"), ("E", "x")]
    # backward order q, b, a, x (b's forward after q's backward: q fits no run): one pair among b, a, x;
    # (b, a) forwards 4 apart, (a, x) 1 apart: the closer wins
    assert shared_slots(ev) == [["a", "x"]]


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_shared_slots_of_the_real_schedules(schedule: str) -> None:
    """h2048's pipeline (PP=2, two virtual stages per rank, 4 microbatches), the last stage not offloaded:
    12 offloaded groups need 6 slots (8 or 7 with nested groups only, 4 with three groups to a slot)."""
    events = schedule_events(schedule, 4)
    keep = {g for _, g in events} - short_window_groups(events, 2)
    want = {"interleaved": [[(2, 0), (2, 1)], [(1, 0), (0, 0)], [(1, 1), (0, 1)], [(2, 2), (2, 3)], [(1, 2), (0, 2)],
                            [(1, 3), (0, 3)]],
            "zbv": [[(2, 0), (1, 0)], [(0, 0), (2, 1)], [(1, 1), (0, 1)], [(2, 2), (1, 2)], [(2, 3), (0, 2)],
                    [(1, 3), (0, 3)]]}
    assert shared_slots(events, keep) == want[schedule]
    nested = {"interleaved": [[(1, 0), (0, 0)], [(1, 1), (0, 1)], [(2, 3), (1, 2)], [(1, 3), (0, 3)]],
              "zbv": [[(1, 0), (0, 0)], [(2, 1), (1, 1)], [(2, 2), (1, 2)], [(2, 3), (0, 2)], [(1, 3), (0, 3)]]}
    assert shared_slots(events, keep, nested=True) == nested[schedule]
    assert [len(r) for r in shared_slots(events, keep, 3)] == [3] * 4


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
@pytest.mark.parametrize("microbatches", [4, 8])
@pytest.mark.parametrize("members", [2, 3])
def test_shared_slots_run_the_schedule(schedule: str, microbatches: int, members: int) -> None:
    """Release over the real F / dI / dW order with shared slots (consumed slots kept mapped, the config's
    default), 3 steps, several interleavings: every backward reads its own forward's bytes (checked at each
    dW), each group is copied out and back once a step, and each slot, not each group, is unmapped and
    mapped once a step (with `release_at_backward`). With consumed slots reaped too, the bytes are still right;
    without `release_at_backward` too (a backward before its slot went reads the bytes in place)."""
    events, steps = schedule_events(schedule, microbatches), 3
    n = len({g for _, g in events}) - len(short_window_groups(events, 2))
    runs = shared_slots(events, {g for _, g in events} - short_window_groups(events, 2), members)
    slots = n - sum(len(r) - 1 for r in runs)
    assert slots <= n // 2 + 1
    for seed in range(3):
        st, _, _ = _run(events, None, steps, seed, plan=True, mode="release", min_window=2, share=True, reap=False,
                        members=members)
        assert st.d2h_copies == st.h2d_copies == steps * n and st.reloads_skipped == 0
        assert st.maps == st.unmaps == steps * slots
        st, _, _ = _run(events, None, steps, seed, plan=True, mode="release", min_window=2, share=True,
                        members=members)
        assert st.d2h_copies == st.h2d_copies == steps * n
        st, _, _ = _run(events, None, steps, seed, plan=True, mode="release", min_window=2, share=True, reap=False,
                        members=members, at_backward=False)
        assert st.d2h_copies == st.h2d_copies + st.kept_at_backward == steps * n
        assert st.maps == st.unmaps <= steps * slots
    st, _, _ = _run(events, None, steps, plan=True, mode="release", min_window=2, reap=False)
    assert st.maps == st.unmaps == steps * n
