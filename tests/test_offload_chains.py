"""Release offload of captured pipelines against native eager, bitwise, on a CPU: graph chains bounded by the
schedule's liveness (a group per chain, serving each of its microbatches in turn) and one chain per microbatch.

Two fakes stand in for the GPU, the rest is the real code (build, planning, offload manager, captured actions,
verify-state's oracle). `ExecManager` (tests/test_graph_binding_bitwise.py) replays a graph by re-running the
body it captured; here a forward's replay runs under its group's slot stores, as the captured graph writes
its saved tensors into the group's slot. `FakeDevice` (`offload.fake`) is the VMM driver and the streams: an
unmapped slot reads as poison bytes, and copies run on queued streams in a seeded random interleaving. A
backward that reads a slot before its restore, or a microbatch's bytes overwritten by the next one of its
chain, changes the numbers the oracle compares."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import pytest

from qeffect.config import load_config
from qeffect.offload.fake import FakeDevice
from qeffect.offload.group import OffloadGroup, OffloadManager
from qeffect.offload.planning import plan_chains
from qeffect.runtime import build as build_mod
from qeffect.runtime.adamw import TritonAdamW
from qeffect.runtime.build import schedule_of
from qeffect.schedule.liveness import slots_for
from qeffect.verify import state as state_mod
from qeffect.verify.state import run_verify_state
from test_graph_binding_bitwise import BASE, ExecManager, _fake_captured_build


@dataclass
class OffloadExecManager(ExecManager):
    """`ExecManager` on a fake device: bodies run as the compute stream's work (after what is queued on it,
    such as the wait for a restore), a forward's under its group's slot stores."""

    device: FakeDevice = field(default_factory=FakeDevice)
    f_groups: dict[str, OffloadGroup] = field(default_factory=dict)  # F graph name -> its chain's group
    offload: OffloadManager | None = None
    # slot -> (its mapping's count, its bytes) when the last capture that saw it mapped ended
    captured_bytes: dict = field(default_factory=dict)

    def capture(self, name, fn, **kw):
        """A GPU capture runs nothing, so what a slot holds then does not matter, but it must be mapped for a
        kernel that checks its pointers (Triton's); this one runs its body, where an unmapped slot reads as
        poison. With `offload.map_slots = "forward"` the build maps a slot afresh for each capture that uses
        it, so the bytes the last capture left there are put back first."""
        slots = self.offload.slots() if self.offload is not None and self.offload._allocated else []
        for s in slots:
            if s.mapped and s in self.captured_bytes and self.captured_bytes[s][0] != s.maps:
                s.bytes().copy_(self.captured_bytes[s][1])
        try:
            with self.device.host_compute():
                return super().capture(name, fn, **kw)
        finally:
            self.captured_bytes.update({s: (s.maps, s.bytes().clone()) for s in slots if s.mapped})

    def dry_capture(self, fn):
        with self.device.host_compute():
            return fn()

    def replay(self, action, dynamic=None):
        group = self.f_groups.get(action.name)
        with self.device.host_compute(), group.slot_stores() if group is not None else nullcontext():
            return super().replay(action, dynamic)


def _offload_build(seed: int):
    """`build_single_process` for captured paths on the fakes, with the config's `[offload]` section."""
    def offload(cfg, mgr: OffloadExecManager) -> OffloadManager:
        mgr.offload = OffloadManager(cfg.offload, device="cpu", driver=mgr.device.driver(), streams=mgr.device)
        return mgr.offload

    fake = _fake_captured_build(build_mod.build_single_process, offload=offload,
                                manager=lambda: OffloadExecManager(device=FakeDevice(seed, granularity=64 << 10)))

    def build(cfg, **kw):
        pipe = fake(cfg, **kw)
        if pipe.offload is not None:  # each F graph replays under its chain's group's slot stores
            pipe.manager.f_groups = {f"s{act.stage}.F{c}": g for r in pipe.ranks for act in r.actions.values()
                                     for c, g in act.groups.items()}
        return pipe
    return build


@pytest.fixture
def offload_fakes(monkeypatch: pytest.MonkeyPatch):
    """verify-state's captured builds on the fakes (seed 0 unless a test sets another)."""
    def use(seed: int = 0) -> None:
        monkeypatch.setattr(state_mod, "build_single_process", _offload_build(seed))
    monkeypatch.setattr(TritonAdamW, "use_graph", lambda self, enabled=True: None)
    use()
    return use


def _config(schedule: str, microbatches: int, **offload):
    return load_config().with_overrides(**{**BASE, "pipeline.schedule": schedule,
                                          "pipeline.microbatches": microbatches, "offload.mode": "release",
                                          **{f"offload.{k}": v for k, v in offload.items()}})


@pytest.mark.parametrize(("schedule", "path", "seed"), [("interleaved", "captured-direct", 0),
                                                        ("zbv", "captured-copy", 3)])
def test_release_with_chains_bounded_by_liveness_keeps_native_eager_bits(offload_fakes, schedule: str, path: str,
                                                                         seed: int) -> None:
    """Every group offloaded (`min_window = 0`), and every backward waits for its copy-out, releases the slot
    and restores it (`release_at_backward`): each microbatch's saved tensors go to the host and back through
    the slot its chain's next microbatch rewrites. Fewer groups than forwards, one per chain."""
    offload_fakes(seed)
    cfg = _config(schedule, 6, min_window=0, release_at_backward=True)
    report = run_verify_state(cfg, steps=2, path=path)
    assert report.passed, report.first_divergence
    o = report.graphs["offload"]
    chains = sum(slots_for(schedule_of(cfg)).values())
    stages = cfg.pipeline.pp * cfg.pipeline.chunks_per_rank
    assert chains <= o["groups"] < stages * 6 and o["not_offloaded"] == []
    forwards = 2 * stages * 6
    assert o["d2h_copies"] == forwards and o["h2d_copies"] == forwards and o["unmaps"] >= forwards


def test_release_with_the_default_knobs_keeps_native_eager_bits(offload_fakes) -> None:
    """The config's defaults (short windows left in place, look-ahead, a backward reading a slot whose copy-out
    is not seen done in place) on bounded chains; with `release_chains = "microbatch"` a chain and a group per
    microbatch, planned from the events (slots shared)."""
    cfg = _config("interleaved", 6)
    report = run_verify_state(cfg, steps=2, path="captured-direct")
    assert report.passed, report.first_divergence
    o = report.graphs["offload"]
    assert o["groups"] < 4 * 6 and o["not_offloaded"] and o["d2h_copies"] > 0 and o["shared_slots"] == []
    assert o["h2d_copies"] + o["kept_at_backward"] == o["d2h_copies"]  # each copy-out comes back or is read in place
    pipe = _offload_build(0)(_config("interleaved", 6, release_chains="microbatch"), native=False,
                             path="captured-direct")
    assert len(pipe.offload.groups) == 4 * 6 and pipe.offload.shared


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_release_with_slots_mapped_at_forward_keeps_native_eager_bits(offload_fakes, schedule: str) -> None:
    """`map_slots = "forward"`: the build maps one slot at a time (each while a capture of its chain uses it)
    and leaves every slot released; the first forward of each group maps it afresh (poison until written). With
    one pending copy-out and reaping, slots come and go all step long; the bits stay native eager's."""
    cfg = _config(schedule, 6, min_window=0, map_slots="forward", max_pending_copies=1, reap=True)
    pipe = _offload_build(0)(cfg, native=False, path="captured-direct")
    mgr = pipe.offload
    slots = mgr.slots()
    assert len(slots) > 1 and not any(s.mapped for s in slots)
    assert mgr.stats.peak_mapped_bytes == max(s.size for s in slots)  # one at a time, never two
    report = run_verify_state(cfg, steps=2, path="captured-direct")
    assert report.passed, report.first_divergence
    o = report.graphs["offload"]
    assert o["not_offloaded"] == [] and o["d2h_copies"] > 0 and o["maps"] >= o["groups"]
    assert o["unmaps"] >= o["d2h_copies"]  # each copy-out's slot released (pending or reaped)


def test_a_restore_that_never_copies_is_caught(offload_fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness can fail: restores that map the slot but copy nothing leave poison bytes for the backward
    (the loss's saved targets first: indices far out of range)."""
    def no_copy(self, g, under, chunk_waits):
        g.state = type(g.state).MAPPED

    monkeypatch.setattr(OffloadManager, "_copy_in", no_copy)
    cfg = _config("interleaved", 6, min_window=0, release_at_backward=True)
    with pytest.raises(IndexError, match="out of bounds"):
        run_verify_state(cfg, steps=1, path="captured-direct")


def test_one_slot_shared_by_two_live_microbatches_is_caught(offload_fakes, monkeypatch: pytest.MonkeyPatch) -> None:
    """Chains one below the liveness bound: the tape pool refuses the forward that would rewrite a chain
    (and its group's slot) while its previous microbatch still awaits its backward."""
    from qeffect.contracts import TapeViolation

    real = build_mod.slots_for
    monkeypatch.setattr(build_mod, "slots_for", lambda sch: {s: max(1, k - 1) for s, k in real(sch).items()})
    with pytest.raises(TapeViolation, match="premature slot reuse"):
        run_verify_state(_config("interleaved", 6, min_window=0), steps=1, path="captured-copy")


def test_plan_chains_judges_each_window_and_links_each_group_to_its_successor() -> None:
    """Groups that repeat (one per chain): a group is left out when any of its windows is short; look-ahead
    links each group to the group whose backward follows its first; resident mode is refused."""
    from qeffect.config import OffloadConfig
    from qeffect.errors import UserError
    from qeffect.offload.planning import StepInputs
    from qeffect.schedule import Action, ActionKind

    dev = FakeDevice(0, granularity=64 << 10)
    mgr = OffloadManager(OffloadConfig(mode="release", min_window=2), device="cpu", driver=dev.driver(), streams=dev)
    a, b = mgr.group("c0"), mgr.group("c1")
    for g in (a, b):
        g.adopt_specs([])
    F, B, E = ActionKind.F, ActionKind.DI, ActionKind.DW
    # microbatches 0 and 2 in chain a, 1 in chain b; a's second window (F2 .. B2) holds no other action
    order = [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(E, 0, 0), Action(F, 0, 2), Action(B, 0, 2),
             Action(B, 0, 1), Action(E, 0, 1), Action(E, 0, 2)]
    step = StepInputs(order=order, groups={(0, 0): a, (0, 1): b, (0, 2): a}, elements={0: 1}, tokens=1)
    plan = plan_chains(mgr, step)
    assert plan.backward == [a, a, b] and mgr.not_offloaded == [a] and b.offloaded
    assert a.next_backward is b and b.next_backward is None
    with pytest.raises(UserError, match="offload.mode = resident"):
        res = OffloadManager(OffloadConfig(mode="resident"), device="cpu", driver=dev.driver(), streams=dev)
        res.group("c0"), res.group("c1")
        plan_chains(res, step)
    mgr.close()
