"""Activation offload on CPU: the driver wrapper, VMM slots and offload groups against a fake GPU.

`FakeDevice` simulates VMM on host memory (poison in unmapped ranges, physical bytes that move with
their allocation, free-memory accounting, a current context per thread) and runs stream queues in a
random legal interleaving per seed, so missing fences show up as wrong bytes or faults. Nothing here
touches CUDA; tests/test_offload_gpu.py runs the real thing.
"""

from __future__ import annotations

import contextlib
import gc
import threading

import pytest
import torch

from qeffect.cli.app import main
from qeffect.config import DEFAULT_COPY_CHUNK_MIB, DEFAULT_SHARE_GAP, DEFAULT_STORE_BATCH_MIB, OffloadConfig
from qeffect.offload import (
    CudaDriverError,
    GroupState,
    OffloadManager,
    OffloadStateError,
    VmmDriver,
    VmmSlot,
    default_eligible,
    round_up,
    wrap_pointer,
)
from qeffect.offload.fake import MIB, POISON, CUcontext, CUresult, FakeDevice, FakeDeviceFault
from qeffect.offload.group import OffloadGroup

KIB = 1 << 10
GRAN = 64 * KIB  # a small fake granularity keeps the simulated memory cheap


def fake(seed: int = 0, **kw) -> tuple[FakeDevice, VmmDriver]:
    dev = FakeDevice(seed, granularity=kw.pop("granularity", GRAN), **kw)
    return dev, dev.driver()


def config(mode: str = "release", **kw) -> OffloadConfig:
    """These tests' manager config: `kw` over consumed slots reaped and every group offloaded (`reap`,
    `min_window` 0): the state machine's paths under test, not a training run's defaults."""
    return OffloadConfig(mode=mode, **{"reap": True, "min_window": 0, **kw})


def cu_calls(trace: list[tuple]) -> list[str]:
    """Driver calls, without the context bookkeeping that precedes each one."""
    return [e[0] for e in trace if e[0].startswith("cu") and e[0] not in ("cuCtxGetCurrent", "cuCtxSetCurrent")]


# -------------------------------------------------------------------------------- rounding, wrap
@pytest.mark.parametrize("n, want", [(0, 2 * MIB), (1, 2 * MIB), (2 * MIB, 2 * MIB), (2 * MIB + 1, 4 * MIB),
                                     (7 * MIB, 8 * MIB)])
def test_round_up_to_granularity(n: int, want: int) -> None:
    assert round_up(n, 2 * MIB) == want


def test_round_up_rejects_bad_granularity() -> None:
    with pytest.raises(ValueError, match="granularity"):
        round_up(10, 0)


def test_slot_size_and_va_are_granularity_multiples() -> None:
    dev, drv = fake(granularity=2 * MIB)
    assert drv.granularity == 2 * MIB
    for n, want in ((1, 2 * MIB), (2 * MIB, 2 * MIB), (2 * MIB + 1, 4 * MIB)):
        slot = VmmSlot(drv, n, device="cpu")
        assert slot.size == want and slot.va % (2 * MIB) == 0
        reserve = [e for e in dev.trace if e[0] == "cuMemAddressReserve"][-1]
        assert reserve[1:] == (want, 2 * MIB)  # size, alignment
        slot.close()
    with pytest.raises(ValueError, match="multiple of the VMM granularity"):
        drv.reserve(3 * MIB)


def test_wrap_cpu_pointer_aliases_without_owning() -> None:
    base = torch.arange(64, dtype=torch.float32)
    t = wrap_pointer(base.data_ptr(), base.numel() * 4, "cpu", torch.float32, (8, 8))
    assert t.data_ptr() == base.data_ptr() and t.shape == (8, 8) and t.device.type == "cpu"
    assert torch.equal(t.flatten(), base)
    t[1, 2] = -1.0
    assert base[10] == -1.0  # the same memory
    i = wrap_pointer(base.data_ptr() + 16, 32, "cpu", torch.int32, (2, 2), stride=(1, 2))  # offset, strided
    assert i.data_ptr() == base.data_ptr() + 16 and i.stride() == (1, 2)
    assert torch.equal(i, base[4:8].view(torch.int32).view(2, 2).t())
    h = wrap_pointer(base.data_ptr(), 16, "cpu", torch.bfloat16, (8,))
    assert torch.equal(h, base[:4].view(torch.bfloat16))
    del t, i, h
    gc.collect()
    assert torch.equal(base[:10], torch.arange(10, dtype=torch.float32))  # nothing freed, nothing changed


def test_wrap_rejects_short_or_misaligned() -> None:
    base = torch.zeros(16, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs 68 bytes"):
        wrap_pointer(base.data_ptr(), 64, "cpu", torch.float32, (17,))
    with pytest.raises(ValueError, match="not aligned"):
        wrap_pointer(base.data_ptr() + 2, 32, "cpu", torch.float32, (4,))


# ------------------------------------------------------------------------------- driver wrapper
def _prepare(drv: VmmDriver, call: str) -> tuple:
    """Bring the fake to a state where `call` would succeed; return the VmmDriver method and args."""
    g = drv.granularity
    if call == "cuMemAddressReserve":
        return drv.reserve, (g,)
    if call == "cuMemCreate":
        return drv.create, (g,)
    va = drv.reserve(g)
    if call == "cuMemAddressFree":
        return drv.free_address, (va, g)
    h = drv.create(g)
    if call == "cuMemMap":
        return drv.map, (va, g, h)
    if call == "cuMemRelease":
        return drv.release, (h,)
    drv.map(va, g, h)
    if call == "cuMemSetAccess":
        return drv.set_access, (va, g)
    if call == "cuMemUnmap":
        return drv.unmap, (va, g)
    if call == "cuCtxSynchronize":
        return drv.synchronize, ()
    if call == "cuMemGetInfo":
        return drv.mem_get_info, ()
    if call == "cuCtxSetCurrent":
        return drv.make_current, ()
    raise AssertionError(call)


@pytest.mark.parametrize("call", ["cuMemAddressReserve", "cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap",
                                  "cuMemRelease", "cuMemAddressFree", "cuCtxSynchronize", "cuMemGetInfo",
                                  "cuCtxSetCurrent"])
@pytest.mark.parametrize("code", [CUresult.CUDA_ERROR_OUT_OF_MEMORY, CUresult.CUDA_ERROR_INVALID_VALUE])
def test_every_call_is_checked_and_named(call: str, code: CUresult) -> None:
    dev, drv = fake()
    method, args = _prepare(drv, call)
    if call == "cuCtxSetCurrent":
        dev.cu.cuCtxSetCurrent(CUcontext(0))  # unbind, so that the next call must bind again
    dev.cu.fail_next[call] = code
    with pytest.raises(CudaDriverError) as exc:
        method(*args)
    err = exc.value
    assert (err.call, err.code, err.name) == (call, int(code), code.name)
    assert str(err).startswith(f"{call} failed: {code.name} ({int(code)}): fake driver")


def test_error_with_unknown_code_still_names_call_and_code() -> None:
    dev, drv = fake()
    dev.cu.cuMemGetInfo = lambda: (999, None, None)
    with pytest.raises(CudaDriverError, match=r"cuMemGetInfo failed: CUresult 999 \(999\)"):
        drv.mem_get_info()


def test_binding_that_does_not_return_a_tuple_is_rejected() -> None:
    dev, drv = fake()
    dev.cu.cuMemGetInfo = lambda: 0
    with pytest.raises(TypeError, match=r"cuMemGetInfo returned 0"):
        drv.mem_get_info()


def test_init_failure_raises_at_construction() -> None:
    dev = FakeDevice(0)
    dev.cu.fail_next["cuDevicePrimaryCtxRetain"] = CUresult.CUDA_ERROR_INVALID_VALUE
    with pytest.raises(CudaDriverError, match="cuDevicePrimaryCtxRetain failed"):
        dev.driver()


def test_any_thread_gets_the_primary_context() -> None:
    dev, drv = fake()
    slot = VmmSlot(drv, 1, device="cpu")
    out: dict[str, object] = {}

    def worker() -> None:
        out["raw"] = dev.cu.cuMemGetInfo()[0]  # a raw call from a thread with no context fails ...
        slot.remap()  # ... the wrapper binds the primary context first
        out["ctx"] = dev.cu.current_context_of_this_thread()
        out["va"] = slot.va

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert out["raw"] == CUresult.CUDA_ERROR_INVALID_CONTEXT
    assert out["ctx"] == drv.context and out["va"] == slot.va and slot.mapped and slot.maps == 2


def test_vmm_calls_make_no_context_lookup_once_the_thread_has_one() -> None:
    """The hot path's VMM calls go straight to the driver on a thread with a context; a thread without
    one gets CUDA_ERROR_INVALID_CONTEXT once per call site (nothing done), binds the primary context and
    calls again; the context-bound calls (free memory, synchronize) always bind it first."""
    dev, drv = fake()
    slot = VmmSlot(drv, 2 * GRAN, device="cpu")
    start = len(dev.cu.trace)
    slot.unmap(wait=lambda: None)  # the offload groups wait on their copy's event, not the context
    slot.map()
    names = [t[0] for t in dev.cu.trace[start:]]
    assert names == ["cuMemUnmap", "cuMemRelease", "cuMemCreate", "cuMemMap", "cuMemSetAccess"]
    start = len(dev.cu.trace)
    drv.mem_get_info()
    drv.synchronize()
    names = [t[0] for t in dev.cu.trace[start:]]
    assert names == ["cuCtxGetCurrent", "cuMemGetInfo", "cuCtxGetCurrent", "cuCtxSynchronize"]
    out: dict[str, list[str]] = {}

    def worker() -> None:
        begin = len(dev.cu.trace)
        slot.unmap(wait=lambda: None)
        slot.map()
        out["names"] = [t[0] for t in dev.cu.trace[begin:]]

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert out["names"] == ["cuMemUnmap", "cuCtxGetCurrent", "cuCtxSetCurrent", "cuMemUnmap", "cuMemRelease",
                            "cuMemCreate", "cuMemMap", "cuMemSetAccess"]
    assert slot.mapped and dev.cu.free == dev.cu.total - slot.size


def test_other_errors_are_not_retried_and_a_context_that_stays_missing_raises() -> None:
    dev, drv = fake()
    slot = VmmSlot(drv, GRAN, device="cpu", map_now=False)
    dev.cu.fail_next["cuMemCreate"] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    start = len(dev.cu.trace)
    with pytest.raises(CudaDriverError, match="cuMemCreate failed"):
        slot.map()
    assert [t[0] for t in dev.cu.trace[start:]] == ["cuMemCreate"]
    out: dict[str, object] = {}

    def worker() -> None:  # no context here, and binding it does not help: the retry's error is raised
        dev.cu.fail_next["cuCtxSetCurrent"] = CUresult.CUDA_ERROR_INVALID_CONTEXT
        try:
            slot.map()
        except CudaDriverError as err:
            out["err"] = err

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert isinstance(out["err"], CudaDriverError) and out["err"].call == "cuCtxSetCurrent"
    assert not slot.mapped


def test_context_reference_is_released_on_close() -> None:
    dev, drv = fake()
    assert dev.cu.primary_retains == [1]
    drv.close()
    drv.close()  # idempotent
    assert dev.cu.primary_retains == [0]
    with pytest.raises(RuntimeError, match="closed"):
        drv.mem_get_info()


# --------------------------------------------------------------------------------------- slots
def test_slot_remap_keeps_va_and_returns_memory() -> None:
    dev, drv = fake()
    total = dev.cu.total
    slot = VmmSlot(drv, 3 * GRAN, device="cpu", map_now=False)
    assert dev.cu.free == total and not slot.mapped
    view = slot.tensor((slot.size // 4,), torch.int32)
    assert view.data_ptr() == slot.va  # even before mapping
    slot.map()
    assert dev.cu.free == total - slot.size  # drops at cuMemCreate
    for k in range(100):
        view.fill_(k)
        slot.remap()
        assert slot.va == view.data_ptr() == slot.tensor((4,), torch.int32).data_ptr()
        assert not torch.equal(view, torch.full_like(view, k))  # new pages: the old bytes are gone
        assert dev.cu.free == total - slot.size
    assert (slot.maps, slot.unmaps) == (101, 100)
    slot.unmap()
    assert dev.cu.free == total  # back at cuMemRelease
    assert torch.all(slot.bytes() == POISON)  # unmapped (on a GPU: a fault)
    slot.close()
    assert dev.cu.reservations == {} and dev.cu.allocations == {}


def test_slot_grants_access_after_every_map_and_syncs_before_unmap() -> None:
    dev, drv = fake()
    slot = VmmSlot(drv, 1, device="cpu")
    for _ in range(3):
        slot.remap()
    calls = [c for c in cu_calls(dev.trace) if c in ("cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuCtxSynchronize",
                                                     "cuMemCreate", "cuMemRelease")]
    assert calls == ["cuMemCreate", "cuMemMap", "cuMemSetAccess"] + 3 * [
        "cuCtxSynchronize", "cuMemUnmap", "cuMemRelease", "cuMemCreate", "cuMemMap", "cuMemSetAccess"]
    order: list[str] = []
    dev.cu.trace.clear()
    slot.unmap(wait=lambda: order.append("wait"))
    assert order == ["wait"] and cu_calls(dev.trace)[-2:] == ["cuMemUnmap", "cuMemRelease"]
    assert "cuCtxSynchronize" not in cu_calls(dev.trace)  # an explicit wait replaces the device sync


@pytest.mark.parametrize("failing", ["cuMemMap", "cuMemSetAccess"])
def test_failed_map_leaks_nothing(failing: str) -> None:
    dev, drv = fake()
    slot = VmmSlot(drv, 1, device="cpu", map_now=False)
    dev.cu.fail_next[failing] = CUresult.CUDA_ERROR_OUT_OF_MEMORY
    with pytest.raises(CudaDriverError, match=failing):
        slot.map()
    assert not slot.mapped and dev.cu.free == dev.cu.total and dev.cu.allocations == {} and dev.cu.mappings == {}
    slot.map()  # and the slot still works
    assert slot.mapped


def test_the_driver_counts_its_calls_and_their_host_time() -> None:
    _, drv = fake()
    slot = VmmSlot(drv, 1, device="cpu")
    before = drv.call_counts.copy()
    slot.unmap()
    slot.map()
    got = {c: drv.call_counts[c] - before[c] for c in drv.call_counts if drv.call_counts[c] != before[c]}
    assert {c: got.get(c) for c in ("cuMemUnmap", "cuMemRelease", "cuMemCreate", "cuMemMap", "cuMemSetAccess")} == \
        dict.fromkeys(("cuMemUnmap", "cuMemRelease", "cuMemCreate", "cuMemMap", "cuMemSetAccess"), 1)
    assert all(drv.call_seconds[c] > 0 for c in got)
    slot.close()


def test_slot_misuse_is_rejected() -> None:
    _, drv = fake()
    slot = VmmSlot(drv, 1, device="cpu")
    with pytest.raises(RuntimeError, match="already mapped"):
        slot.map()
    with pytest.raises(ValueError, match="outside"):
        slot.tensor((1,), torch.float32, offset=slot.size)
    slot.unmap()
    with pytest.raises(RuntimeError, match="not mapped"):
        slot.unmap()
    slot.close()
    with pytest.raises(RuntimeError, match="after close"):
        slot.tensor((1,), torch.float32)
    with pytest.raises(ValueError, match="positive"):
        VmmSlot(drv, 0, device="cpu")


def test_device_work_on_an_unmapped_slot_faults() -> None:
    dev, drv = fake()
    slot = VmmSlot(drv, 1, device="cpu")
    host = dev.host_buffer(slot.size)
    slot.unmap()
    with pytest.raises(FakeDeviceFault, match="700"):
        dev.copy(host, slot.bytes(), dev.compute)
        dev.synchronize()


# ------------------------------------------------------------------------------------- groups
def pattern(step: int, k: int, i: int, v: torch.Tensor) -> torch.Tensor:
    n = v.numel()
    return (torch.arange(n, dtype=torch.float64).reshape(v.shape) * (k + 1) + 1000 * step + 100 * i).to(v.dtype)


def build(mode: str, seed: int = 0, layers: int = 4, order: list[int] | None = None, program=None, **kw):
    """`program` (a `run_program` program): the manager gets its events (resident: kept groups skip the D2H).
    `kw`: the manager's `timing`, `alignment` and `eligible`, the rest config fields (`config`). Shared slots
    take any run (`share_gap` 0: these programs are short; the gap rule has its own tests)."""
    dev, drv = fake(seed, progress=kw.pop("progress", 2))
    kw.setdefault("share_gap", 0)
    extra = {k: kw.pop(k) for k in ("timing", "alignment", "eligible") if k in kw}
    mgr = OffloadManager(config(mode, **kw), device="cpu", driver=drv, streams=dev, **extra)
    groups = [mgr.group(f"G{k}") for k in range(layers)]
    for k, g in enumerate(groups):
        g.discover(torch.empty(3 + k, 5, dtype=torch.float32))
        g.discover(torch.empty(7, dtype=torch.int64))
    events = [(kind, groups[k]) for kind, k in program_events(program)] if program is not None else None
    mgr.allocate([groups[k] for k in order] if order is not None else None, events=events)
    return dev, mgr, groups


def program_events(program) -> list[tuple[str, int]]:
    """A `run_program` program as plan events: its "B" is both the backward start and the last reader."""
    return [e for op, k in program for e in ([("F", k)] if op == "F" else [("B", k), ("E", k)])]


def run_program(dev: FakeDevice, groups, program, steps: int = 2) -> list:
    """Forward 'graphs' write a known pattern into the views; backward 'graphs' copy the views out."""
    results = {}
    for step in range(steps):
        for op, k in program:
            g = groups[k]
            vs = g.views
            if op == "F":
                g.before_forward()
                dev.launch(dev.compute, lambda vs=vs, k=k, step=step: [v.copy_(pattern(step, k, i, v))
                                                                       for i, v in enumerate(vs)], f"F{k}",
                           touches=vs)
                g.after_forward()
            else:
                g.before_backward()
                out = [torch.empty_like(v) for v in vs]
                dev.launch(dev.compute, lambda vs=vs, out=out: [o.copy_(v) for o, v in zip(out, vs, strict=True)],
                           f"B{k}", touches=vs)
                g.backward_launched()
                g.after_backward()
                results[(step, k)] = out
    dev.synchronize()
    return [(s, k, i) for (s, k), out in results.items() for i, o in enumerate(out) if not torch.equal(o, pattern(s, k, i, o))]


STACK = ([("F", k) for k in range(4)] + [("B", k) for k in reversed(range(4))], [3, 2, 1, 0])
ONE_F_ONE_B = ([("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3)], [0, 1, 2, 3])
# odd warm-up depth: forwards claim the bank the look-ahead has just restored into (a wasted prefetch)
ODD_WARMUP = ([("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("F", 4), ("B", 2), ("B", 3), ("B", 4)],
              [0, 1, 2, 3, 4])
PROGRAMS = {"stack": STACK, "1f1b": ONE_F_ONE_B, "odd-warmup": ODD_WARMUP}


@pytest.mark.parametrize("mode", ["release", "release-at-backward", "resident"])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("lookahead", [True, False])
def test_every_interleaving_restores_the_right_bytes(mode: str, program: str, lookahead: bool) -> None:
    prog, order = PROGRAMS[program]
    strict = mode == "release-at-backward"
    kept = 0
    for seed in range(12):
        dev, mgr, groups = build(mode.removesuffix("-at-backward"), seed, layers=len(order), order=order,
                                 lookahead=lookahead, release_at_backward=strict)
        assert run_program(dev, groups, prog) == [], (mode, program, seed)
        assert mgr.stats.d2h_copies == 2 * len(order)
        if mode == "resident":
            assert mgr.stats.h2d_copies > 0 and mgr.stats.evictions > 0  # banks were really reused
        else:  # each group released between its forward and its backward (by a query or, strict, by its
            # backward's wait) and restored, or its backward came first and read the bytes in place
            assert mgr.stats.h2d_copies == mgr.stats.released_live + mgr.stats.released_at_backward
            assert mgr.stats.h2d_copies + mgr.stats.kept_at_backward == 2 * len(order)
            assert mgr.stats.kept_at_backward == mgr.stats.reloads_skipped
            assert (mgr.stats.kept_at_backward if strict else mgr.stats.released_at_backward) == 0
            kept += mgr.stats.released_at_backward + mgr.stats.kept_at_backward
    if mode != "resident" and program == "stack":  # its last forward's backward comes right after it: some
        assert kept > 0  # seeds' backward came before a hook saw that D2H done, and the path under test ran
    if program == "odd-warmup" and mode == "resident" and lookahead:
        assert mgr.stats.prefetches_wasted > 0


FENCES = [("release", "forward_done"), ("release", "restore_done"), ("resident", "forward_done"),
          ("resident", "restore_done"), ("resident", "d2h_done"), ("resident", "consumed")]


def detected_without(monkeypatch, fence: str, runs) -> int:
    """With every stream wait on an event named `*fence` dropped, how many of 20 seeds of each run
    `(program, order, build keywords)` read wrong bytes or fault."""
    orig = FakeDevice.wait

    def wait(self, stream, event):
        if not event.name.endswith(fence):
            orig(self, stream, event)

    monkeypatch.setattr(FakeDevice, "wait", wait)
    detected = 0
    for prog, order, kw in runs:
        for seed in range(20):
            dev, _, groups = build(seed=seed, layers=len(order), order=order, progress=1, **kw)
            try:
                detected += bool(run_program(dev, groups, prog))
            except FakeDeviceFault:
                detected += 1
    return detected


@pytest.mark.parametrize("mode, fence", FENCES)
def test_each_fence_is_needed(monkeypatch, mode: str, fence: str) -> None:
    """Dropping one kind of stream wait corrupts bytes (or faults) for some interleaving: the test above
    can fail, and every wait the group issues matters."""
    assert detected_without(monkeypatch, fence, [(*p, {"mode": mode}) for p in (STACK, ONE_F_ONE_B)]) > 0


def test_release_mode_offload_order() -> None:
    dev, mgr, (g, *_) = build("release", progress=0)
    g.before_forward()
    dev.trace.clear()
    g.after_forward()
    host, slot = g.host.data_ptr(), g.slot_bytes.data_ptr()
    assert [e for e in dev.trace if not e[0].startswith("cuCtx")] == [
        ("record", "compute", "G0.forward_done"),
        ("wait", "d2h", "G0.forward_done"),  # the copy stream waits on the forward-done event only
        ("copy", "d2h", host, slot, g.nbytes),
        ("record", "d2h", "G0.d2h_done"),
    ]  # and no host wait: the host runs on
    assert g.state is GroupState.RELEASE_D2H_PENDING and g.slot.mapped
    dev.trace.clear()
    assert mgr.reap() == 0  # a query: the copy has not run yet (no progress without a wait)
    assert [e for e in dev.trace if not e[0].startswith("cuCtx")] == [("query", "G0.d2h_done", False)]
    dev.synchronize()
    dev.trace.clear()
    assert mgr.reap() == 1  # the next query finds the copy done: unmap and release
    assert [e for e in dev.trace if not e[0].startswith("cuCtx")] == [
        ("query", "G0.d2h_done", True), ("sync", "G0.d2h_done"), ("cuMemUnmap", g.slot.va, g.slot.size),
        ("cuMemRelease", 1)]
    assert g.state is GroupState.UNMAPPED and not g.slot.mapped and mgr.mapped_bytes() == 3 * GRAN
    assert mgr.stats.released_live == 1
    dev.trace.clear()
    g.before_backward()
    assert [e[0] if e[0].startswith("cu") else e for e in dev.trace if not e[0].startswith("cuCtx")][:7] == [
        "cuMemCreate", "cuMemMap", "cuMemSetAccess",  # same VA, new pages, access granted
        ("wait", "h2d", "G0.d2h_done"),
        ("copy", "h2d", slot, host, g.nbytes),
        ("record", "h2d", "G0.restore_done"),
        ("wait", "compute", "G0.restore_done"),  # the compute stream waits on the restore event
    ]
    assert g.state is GroupState.MAPPED and g.slot.va == g.views[0].data_ptr() - g.offsets[0]


def test_release_backward_before_its_d2h_reads_the_bytes_in_place() -> None:
    """A backward that comes before any hook found its group's D2H done keeps the slot mapped and reads the
    forward's bytes where they are: no driver call, no H2D, no host wait (`kept_at_backward`)."""
    dev, mgr, (g, *_) = build("release", lookahead=False, progress=0)
    g.before_forward()
    g.after_forward()
    dev.trace.clear()
    g.before_backward()
    calls = [e[0] if e[0].startswith("cu") else e for e in dev.trace if not e[0].startswith("cuCtx")]
    assert not [c for c in calls if isinstance(c, str)] and not [c for c in calls if c[0] in ("sync", "copy")]
    assert g.state is GroupState.MAPPED and g.slot.mapped and g not in mgr._d2h_fifo
    assert (mgr.stats.kept_at_backward, mgr.stats.reloads_skipped, mgr.stats.h2d_copies) == (1, 1, 0)
    assert (mgr.stats.released_live, mgr.stats.released_at_backward, mgr.stats.host_wait_seconds) == (0, 0, 0)
    g.after_backward()
    dev.synchronize()
    g.before_forward()  # the next forward writes the still-mapped slot after this backward's reads
    assert mgr.stats.maps == 0
    g.after_forward()
    dev.synchronize()


def test_release_at_backward_waits_for_that_copy_alone() -> None:
    """`release_at_backward`: a backward that comes before any hook found its group's D2H done waits for that
    one copy, releases and restores (counted apart from the releases a query made)."""
    dev, mgr, (g, *_) = build("release", lookahead=False, progress=0, release_at_backward=True)
    g.before_forward()
    g.after_forward()
    dev.trace.clear()
    g.before_backward()
    calls = [e[0] if e[0].startswith("cu") else e for e in dev.trace if not e[0].startswith("cuCtx")]
    assert calls[:3] == [("sync", "G0.d2h_done"), "cuMemUnmap", "cuMemRelease"]  # that one copy, then release
    assert calls[3:6] == ["cuMemCreate", "cuMemMap", "cuMemSetAccess"]  # then the restore, as always
    assert (mgr.stats.released_live, mgr.stats.released_at_backward, mgr.stats.h2d_copies) == (0, 1, 1)
    assert mgr.stats.host_wait_seconds > 0  # that wait is counted as the host's time blocked on offload
    g.after_backward()
    dev.synchronize()


def test_release_mode_frees_device_memory_between_forward_and_backward() -> None:
    dev, mgr, groups = build("release", lookahead=False, progress=0)
    total = dev.cu.total
    assert mgr.mapped_bytes() == 4 * GRAN and dev.cu.free == total - 4 * GRAN
    for g in groups:
        g.before_forward()
        g.after_forward()
    assert mgr.mapped_bytes() == 4 * GRAN  # the copies are queued; nothing waited for them
    assert mgr.reap(block=True) == 4
    assert mgr.mapped_bytes() == 0 and dev.cu.free == total  # everything lives on the host now
    for g in reversed(groups):
        g.before_backward()
        g.after_backward()
    assert mgr.mapped_bytes() == 4 * GRAN
    assert mgr.reap(block=True) == 4  # consumed: released too
    assert mgr.mapped_bytes() == 0 and dev.cu.free == total
    assert all(g.state is GroupState.UNMAPPED and not g.live for g in groups)
    groups[0].before_forward()  # remapped (no H2D) for the next forward
    assert groups[0].state is GroupState.MAPPED and mgr.stats.h2d_copies == 4


def test_resident_mode_makes_no_driver_calls_and_no_host_waits_on_the_hot_path() -> None:
    dev, mgr, groups = build("resident")
    n_cu, n_banks = len(cu_calls(dev.trace)), len(mgr.banks)
    dev.trace.clear()
    assert run_program(dev, groups, STACK[0], steps=3) == []
    hot = [e for e in dev.trace if e[0] != "cuCtxSynchronize"]  # the test's own final synchronize
    assert not [e for e in hot if e[0].startswith("cu")], "driver calls on the hot path"
    assert not [e for e in hot if e[0] == "sync"], "host waits on the hot path"
    assert n_banks == 2 and n_cu > 0 and all(b.slot.mapped for b in mgr.banks)


def test_resident_banks_alternate_along_the_backward_order() -> None:
    _, mgr, groups = build("resident", layers=5, order=[2, 0, 4, 1, 3])
    order = mgr.backward_order
    assert [g.name for g in order] == ["G2", "G0", "G4", "G1", "G3"]
    assert [g.bank.index for g in order] == [0, 1, 0, 1, 0]
    assert all(a.bank is not b.bank for a, b in zip(order, order[1:], strict=False))
    assert [g.next_backward.name if g.next_backward else None for g in order] == ["G0", "G4", "G1", "G3", None]
    for b in mgr.banks:  # a bank is as large as its largest group; groups start at its VA
        members = [g for g in groups if g.bank is b]
        assert b.slot.size == round_up(max(g.nbytes for g in members), GRAN)
        assert all(g.va == b.slot.va for g in members)


def test_resident_bank_reuse_waits_for_last_d2h_and_last_consumer() -> None:
    dev, mgr, (g0, g1, g2) = build("resident", layers=3, order=[2, 1, 0], progress=0)
    assert g0.bank is g2.bank and g1.bank is not g0.bank
    for g in (g0, g1):
        g.before_forward()
        g.after_forward()
    dev.trace.clear()
    g2.before_forward()  # takes g0's bank: waits on g0's D2H (no consumer yet)
    assert [e for e in dev.trace if e[0] == "wait"] == [("wait", "compute", "G0.d2h_done")]
    assert g0.state is GroupState.RESIDENT_RELOAD_PENDING and mgr.stats.evictions == 1
    g2.after_forward()
    assert g2.state is GroupState.RESIDENT_D2H_PENDING
    g2.before_backward()  # the bank still holds g2's bytes: no H2D; look-ahead: g1 still in its bank too
    g2.backward_launched()
    assert g2.state is GroupState.MAPPED and mgr.stats.reloads_skipped == 1 and mgr.stats.h2d_copies == 0
    g2.after_backward()
    dev.trace.clear()
    g1.before_backward()  # g1 is still in its bank; look-ahead restores g0 into the bank g2 just read:
    g1.backward_launched()
    assert [e for e in dev.trace if e[0] == "wait"] == [
        ("wait", "h2d", "G2.d2h_done"), ("wait", "h2d", "G2.consumed"),  # after g2's D2H and g2's backward
        ("wait", "h2d", "G0.d2h_done")]  # and after g0's own bytes reached the host
    assert mgr.stats.h2d_copies == 1 and g0.state is GroupState.MAPPED and g0._restore_pending


def test_resident_restore_into_a_bank_waits_for_its_consumer() -> None:
    dev, mgr, (g0, g1, g2) = build("resident", layers=3, order=[2, 1, 0], progress=0, lookahead=False)
    for g in (g0, g1, g2):
        g.before_forward()
        g.after_forward()
    for g in (g2, g1):
        g.before_backward()
        g.after_backward()
    dev.trace.clear()
    g0.before_backward()
    waits = [e for e in dev.trace if e[0] == "wait"]
    assert waits == [("wait", "h2d", "G2.d2h_done"), ("wait", "h2d", "G2.consumed"), ("wait", "h2d", "G0.d2h_done"),
                     ("wait", "compute", "G0.restore_done")]


def released_stack(**kw):
    """A release-mode stack whose every forward ran and whose every slot is released, trace cleared."""
    dev, mgr, groups = build("release", progress=0, **kw)
    for g in groups:
        g.before_forward()
        g.after_forward()
    mgr.reap(block=True)
    dev.trace.clear()
    return dev, mgr, groups


def test_lookahead_restores_the_next_group_before_the_current_backward_runs() -> None:
    """The order without launch_first (`offload.launch_first = false`); with it, the look-ahead restore
    follows the launch (`test_launch_first_queues_the_lookahead_restore_after_the_backward_launch`)."""
    for lookahead in (True, False):
        dev, mgr, groups = released_stack(lookahead=lookahead, launch_first=False)
        for k in (3, 2):
            groups[k].before_backward()
            dev.launch(dev.compute, lambda: None, f"B{k}")
            groups[k].after_backward()
        h2d = [i for i, e in enumerate(dev.trace) if e[:2] == ("copy", "h2d")]
        launch3 = dev.trace.index(("launch", "compute", "B3"))
        assert len(h2d) == (3 if lookahead else 2)
        # with look-ahead, G2's restore is queued before B3 launches (it runs under B3); without, after
        assert (h2d[1] < launch3) is lookahead
        assert mgr.stats.prefetches == (2 if lookahead else 0)
        dev.synchronize()


def test_deeper_lookahead_queues_the_next_restores_before_the_current_backward_runs() -> None:
    """Depth 2 in a stack: B3 already queues G2's and G1's restores; depth 1 only G2's (G1's comes at B2)."""
    for depth in (1, 2, 3):
        dev, mgr, groups = released_stack(lookahead=depth)
        groups[3].before_backward()
        dev.launch(dev.compute, lambda: None, "B3")
        groups[3].backward_launched()
        restored = [e[3] for e in dev.trace if e[:2] == ("copy", "h2d")]
        assert len(restored) == 1 + min(depth, 3), depth  # its own restore, then `depth` ahead
        assert mgr.stats.prefetches == min(depth, 3)
        groups[3].after_backward()
        dev.synchronize()


@pytest.mark.parametrize("mode", ["release", "release-keep", "resident"])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize(("depth", "first"), [(2, False), (3, False), (1, True), (2, True)])
def test_every_interleaving_restores_the_right_bytes_at_any_lookahead_depth(mode: str, program: str,
                                                                            depth: int, first: bool) -> None:
    """`first`: the manager's launch_first (reaps and look-ahead restores after each launch)."""
    prog, order = PROGRAMS[program]
    keep = {"reap": False} if mode == "release-keep" else {}
    for seed in range(12):
        dev, mgr, groups = build(mode.removesuffix("-keep"), seed, layers=len(order), order=order, lookahead=depth,
                                 banks=3, launch_first=first, **keep)
        assert run_program(dev, groups, prog) == [], (mode, program, seed, depth, first)
        assert mgr.stats.d2h_copies == 2 * len(order)


def test_lookahead_passes_over_groups_without_a_slot_and_a_deep_one_never_evicts() -> None:
    # release: a group with nothing to offload does not use up the depth
    dev, drv = fake(0, progress=0)
    mgr = OffloadManager(config("release", lookahead=1), device="cpu", driver=drv, streams=dev)
    g0, empty, g2 = (mgr.group(n) for n in ("G0", "E1", "G2"))
    g0.discover(torch.empty(4))
    g2.discover(torch.empty(4))
    mgr.allocate([g2, empty, g0])
    for g in (g0, empty, g2):
        g.before_forward()
        g.after_forward()
    mgr.reap(block=True)
    g2.before_backward()
    g2.backward_launched()
    assert mgr.stats.prefetches == 1 and g0._restore_pending  # past the empty group to G0
    g2.after_backward()
    dev.synchronize()
    # resident, G0 and G2 share bank 1: at B3, depth 3 reaches G0, whose restore would evict G2 (live,
    # its backward next): skipped, G2 stays; G0 is restored at its own backward
    dev, drv = fake(0, progress=0)
    mgr = OffloadManager(config("resident", lookahead=3), device="cpu", driver=drv, streams=dev)
    groups = [mgr.group(f"G{k}") for k in range(4)]
    for g in groups:
        g.discover(torch.empty(4))
    mgr.allocate(groups[::-1], banks=[0, 1, 2, 1])
    for g in groups:
        g.before_forward()
        g.after_forward()
    assert groups[0].state is GroupState.RESIDENT_RELOAD_PENDING and groups[0].bank.owner is groups[2]
    groups[3].before_backward()
    groups[3].backward_launched()
    assert mgr.stats.prefetches_skipped == 1 and not groups[0]._restore_pending
    assert groups[0].bank.owner is groups[2] and mgr.stats.evictions == 1
    groups[3].after_backward()
    dev.synchronize()
    with pytest.raises(ValueError, match="lookahead"):
        config("release", lookahead=-1)


def test_a_reap_queries_the_d2h_copies_in_their_order_and_stops_at_the_first_not_done(monkeypatch) -> None:
    """Release (consumed slots kept): the D2Hs run on one stream, so the first one not done means none
    after it is; a reap asks about it alone, and releases the done ones in front of it."""
    dev, mgr, groups = build("release", lookahead=0, progress=0, reap=False)
    asked = []
    orig = FakeDevice.query
    monkeypatch.setattr(FakeDevice, "query", lambda self, e: asked.append(e.name) or orig(self, e))
    for g in groups:
        g.before_forward()
        g.after_forward()
    assert mgr.stats.unmaps == 0 and [g.name for g in mgr._d2h_fifo] == ["G0", "G1", "G2", "G3"]
    asked.clear()
    assert mgr.reap() == 0 and asked == ["G0.d2h_done"]  # a lazy device: nothing ran yet
    dev.synchronize_event(groups[1].d2h_done)  # G0's and G1's copies are done, G2's and G3's not (yet)
    asked.clear()
    done = [g.name for g in groups if orig(dev, g.d2h_done)]
    assert mgr.reap() == len(done) >= 2 and asked[:2] == ["G0.d2h_done", "G1.d2h_done"]
    assert [g.name for g in mgr._d2h_fifo] == [g.name for g in groups if g.name not in done]
    dev.synchronize()
    assert mgr.reap() == 4 - len(done) and mgr._d2h_fifo == [] and mgr.stats.released_live == 4


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_a_host_far_ahead_waits_for_the_oldest_copy_out_beyond_max_pending_copies(keep: int) -> None:
    """A lazy device (nothing runs until waited for), as a host far ahead of the GPU sees it: no query
    finds a copy-out done, so without the bound nothing is released; with `max_pending_copies` the host
    waits for the oldest and at most that many slots stay mapped for their copy-outs."""
    dev, mgr, groups = build("release", lookahead=0, progress=0, reap=False, max_pending_copies=keep)
    for k, g in enumerate(groups):
        g.before_forward()
        g.after_forward()
        assert len(mgr._d2h_fifo) == (k + 1 if keep == 0 else min(k + 1, keep))
    assert mgr.stats.unmaps == (0 if keep == 0 else len(groups) - keep)
    assert mgr.mapped_bytes() == sum(g.slot.size for g in groups if g.slot.mapped)
    dev.synchronize()


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_max_pending_copies_restores_the_right_bytes_in_every_interleaving(program: str) -> None:
    prog, order = PROGRAMS[program]
    released = 0
    for seed in range(12):
        dev, mgr, groups = build("release", seed, layers=len(order), order=order, progress=0, reap=False,
                                 max_pending_copies=1)
        assert run_program(dev, groups, prog) == [], (program, seed)
        assert mgr.stats.h2d_copies == mgr.stats.released_live + mgr.stats.released_at_backward
        released += mgr.stats.released_live
    assert released > 0  # the lazy device released nothing by queries: the waits did


@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("shared", [False, True])
def test_slots_mapped_at_forward_restore_the_right_bytes_in_every_interleaving(program: str, shared: bool) -> None:
    """`map_slots = "forward"`: allocate maps nothing, a capture maps its group's slot only for itself, and
    each first forward maps afresh; the bytes are right in every interleaving, slots shared or not."""
    prog, order = PROGRAMS[program]
    for seed in range(12):
        kw = {"share_slots": "any", "program": prog} if shared else {}
        dev, mgr, groups = build("release", seed, layers=len(order), order=order, progress=0,
                                 map_slots="forward", max_pending_copies=1, **kw)
        assert mgr.mapped_bytes() == 0 and all(g.state is GroupState.UNMAPPED for g in groups)
        for g in groups:
            with g.mapped_for_capture():
                assert g.slot.mapped
                with g.mapped_for_capture():  # nested (a shared slot's other member): no second map
                    pass
                assert g.slot.mapped
            assert not g.slot.mapped
        assert mgr.stats.peak_mapped_bytes == max(g.slot.size for g in groups)
        assert run_program(dev, groups, prog) == [], (program, seed)
        assert mgr.stats.maps >= len(mgr.slots())
    mgr = build("release", layers=1)[1]  # slots mapped at build: capturing maps nothing more
    (g,) = mgr.groups
    with g.mapped_for_capture():
        pass
    assert g.slot.mapped and g.slot.maps == 1


def test_timing_records_which_backward_a_restore_ran_under() -> None:
    dev, mgr, groups = build("release", timing=True, release_at_backward=True)  # (G3's backward restores too)
    assert run_program(dev, groups, STACK[0], steps=1) == []
    recs = [(r.group, r.prefetched_under) for r in mgr.stats.restores]
    assert recs == [("G3", None), ("G2", "G3"), ("G1", "G2"), ("G0", "G1")]
    assert all(r.start.timing and r.end.timing for r in mgr.stats.restores)


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_with_the_plan_no_lookahead_restore_is_evicted_before_its_backward(program: str) -> None:
    """With the step's events, resident look-ahead starts no restore a forward would evict before the
    backward (`offload.plan.futile_restores`): no wasted prefetch, and every interleaving still reads the
    right bytes. Without the events the odd warm-up wastes some (see above), so the rule is what helps."""
    prog, order = PROGRAMS[program]
    for seed in range(8):
        dev, mgr, groups = build("resident", seed, layers=len(order), order=order, program=prog)
        assert run_program(dev, groups, prog) == [], (program, seed)
        assert mgr.stats.prefetches_wasted == 0
    if program == "odd-warmup":
        assert mgr.stats.prefetches_futile > 0 and mgr.futile


def test_futile_restores_are_those_a_forward_of_the_same_bank_evicts() -> None:
    from qeffect.offload.plan import futile_restores

    events = [("F", "a"), ("F", "b"), ("F", "c"), ("B", "c"), ("E", "c"), ("F", "d"), ("B", "b"), ("E", "b"),
              ("B", "a"), ("E", "a"), ("B", "d"), ("E", "d")]
    # backward order c, b, a, d. Bank 0 = a, c, d: F(d) lies between B(c) and B(a), and B(a) (counted as
    # a claim) between B(c) or B(b) and B(d). b (bank 1) has no other group of its bank.
    assert futile_restores(events, {"a": 0, "b": 1, "c": 0, "d": 0}) == {("c", "a"), ("c", "d"), ("b", "d")}
    # d moved to bank 1: now F(d) evicts b's restore started at B(c), and B(b) d's; a keeps bank 0 alone
    assert futile_restores(events, {"a": 0, "b": 1, "c": 0, "d": 1}) == {("c", "b"), ("c", "d")}


# ------------------------------------------------------------------------- chunked resident copies
CHUNKED = {"alignment": 16, "copy_chunk_mib": 48 / MIB}  # chunks of 48 bytes; groups of 120-200: 3 to 5 each


@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("planned", [False, True])
def test_chunked_resident_copies_read_the_right_bytes_in_every_interleaving(program: str, planned: bool) -> None:
    """`copy_chunk_bytes`: each restore chunk waits only for the previous owner's D2H chunk that covers it
    (groups of one bank differ in size, so chunk ends differ); the bytes and the counted copies stay those of
    one copy per group."""
    prog, order = PROGRAMS[program]
    n = len(order)
    for seed in range(12):
        kw = {"layers": n, "order": order, "program": prog if planned else None}
        ref = build("resident", seed, alignment=16, **kw)
        dev, mgr, groups = build("resident", seed, **kw, **CHUNKED)
        assert all(len(g.chunks) >= 3 for g in groups) and all(len(ref_g.chunks) == 1 for ref_g in ref[2])
        assert run_program(ref[0], ref[2], prog) == [] and run_program(dev, groups, prog) == [], (program, seed)
        for f in ("d2h_copies", "d2h_bytes", "h2d_copies", "h2d_bytes", "evictions", "reloads_skipped"):
            assert getattr(mgr.stats, f) == getattr(ref[1].stats, f), f
        assert mgr.stats.h2d_copies > 0


def test_a_chunked_restore_waits_per_chunk_for_the_d2h_chunk_covering_it() -> None:
    dev, mgr, (g0, g1, g2) = build("resident", layers=3, order=[2, 1, 0], progress=0, **CHUNKED)
    assert [g.chunks for g in (g0, g2)] == [[(0, 48), (48, 96), (96, 120)], [(0, 48), (48, 96), (96, 144), (144, 168)]]
    for g in (g0, g1, g2):
        g.before_forward()
        g.after_forward()  # g2 evicts g0 from their bank: its D2H is four chunks, each with its event
    assert [e[2] for e in dev.trace if e[:2] == ("record", "d2h")][-4:] == [
        "G2.d2h_chunk0", "G2.d2h_chunk1", "G2.d2h_chunk2", "G2.d2h_done"]
    g2.before_backward()
    g2.backward_launched()
    g2.after_backward()
    dev.trace.clear()
    g1.before_backward()  # look-ahead restores g0 into the bank: chunk k after G2's D2H chunk k, not after all of it
    g1.backward_launched()
    h2d = [e[0] if e[0] == "copy" else e[2] for e in dev.trace if e[1] == "h2d"]
    assert h2d == ["G2.consumed", "G0.d2h_done", "G2.d2h_chunk0", "copy", "G2.d2h_chunk1", "copy",
                   "G2.d2h_chunk2", "copy", "G0.restore_done"]
    dev.synchronize()
    g1.after_backward()


def test_each_chunk_fence_is_needed(monkeypatch) -> None:
    """Without the per-chunk waits of a restore on the D2H chunks (the first and the last are kept by other
    rules), a restore chunk overwrites bytes the previous owner's D2H has not read yet, for some interleaving."""
    orig = FakeDevice.wait
    monkeypatch.setattr(FakeDevice, "wait",
                        lambda self, stream, event: None if ".d2h_chunk" in event.name else orig(self, stream, event))
    detected = 0
    for prog, order in (STACK, ONE_F_ONE_B):
        for seed in range(20):
            dev, _, groups = build("resident", seed, layers=len(order), order=order, progress=1, **CHUNKED)
            detected += bool(run_program(dev, groups, prog))
    assert detected > 0


def test_chunk_size_comes_from_the_config_and_bad_values_are_refused() -> None:
    """`offload.copy_chunk_mib` in bytes, rounded up to the alignment (0: one copy per group); 2 MiB by
    default; a negative size is refused by the config."""
    assert OffloadManager(OffloadConfig(copy_chunk_mib=0.5)).copy_chunk_bytes == 1 << 19
    assert OffloadManager(OffloadConfig(copy_chunk_mib=0)).copy_chunk_bytes == 0
    assert OffloadManager(OffloadConfig(copy_chunk_mib=100 / MIB)).copy_chunk_bytes == 256  # the alignment's
    assert OffloadManager(OffloadConfig()).copy_chunk_bytes == int(DEFAULT_COPY_CHUNK_MIB * MIB) == 2 << 20
    with pytest.raises(ValueError, match="copy_chunk_mib"):
        OffloadConfig(copy_chunk_mib=-1)


# ------------------------------------------------------------------------------ kept groups (no D2H)
@pytest.mark.parametrize("program", sorted(PROGRAMS))
@pytest.mark.parametrize("lookahead", [True, False])
@pytest.mark.parametrize("num_banks", [2, 3])
def test_kept_groups_skip_the_d2h_and_every_interleaving_still_reads_the_right_bytes(
        program: str, lookahead: bool, num_banks: int) -> None:
    prog, order = PROGRAMS[program]
    n = len(order)
    for seed in range(8):
        ref = build("resident", seed, layers=n, order=order, program=prog, lookahead=lookahead, banks=num_banks,
                    skip_kept_d2h=False)
        assert run_program(ref[0], ref[2], prog) == [] and ref[1].kept == [] and ref[1].stats.d2h_copies == 2 * n
        dev, mgr, groups = build("resident", seed, layers=n, order=order, program=prog, lookahead=lookahead,
                                 banks=num_banks)
        assert run_program(dev, groups, prog) == [], (program, seed)
        k = len(mgr.kept)
        assert all(g.kept == (g in mgr.kept) for g in groups)
        assert (mgr.stats.d2h_copies, mgr.stats.d2h_skipped) == (2 * (n - k), 2 * k)
        assert mgr.stats.d2h_bytes == 2 * sum(g.nbytes for g in groups if not g.kept)
        for f in ("h2d_copies", "evictions", "reloads_skipped", "prefetches", "prefetches_wasted"):
            assert getattr(mgr.stats, f) == getattr(ref[1].stats, f), f  # only the D2H copies change
    if program == "stack" or num_banks == 3:
        assert mgr.kept, program  # the stack on 2 banks keeps its last two forwards; 3 banks keep more
    if program == "stack" and num_banks == 2:
        assert [g.name for g in mgr.kept] == ["G3", "G2"]


def test_a_kept_group_leaves_no_d2h_and_its_bank_next_writer_waits_for_its_backward() -> None:
    dev, mgr, groups = build("resident", order=[3, 2, 1, 0], program=STACK[0], progress=0)
    g0, g1, g2, g3 = groups
    assert mgr.kept == [g3, g2] and g3.bank is g1.bank
    for g in groups:
        g.before_forward()
        g.after_forward()
    assert [g.state for g in groups] == [GroupState.RESIDENT_RELOAD_PENDING] * 2 + [GroupState.RESIDENT_KEPT] * 2
    g3.before_backward()
    g3.backward_launched()
    assert g3.state is GroupState.MAPPED and mgr.stats.h2d_copies == 0 and mgr.stats.reloads_skipped == 1
    g3.after_backward()
    dev.trace.clear()
    g2.before_backward()  # look-ahead restores g1 into the bank g3 just read: after g3's backward
    g2.backward_launched()
    waits = [e for e in dev.trace if e[0] == "wait"]
    assert waits == [("wait", "h2d", "G1.d2h_done"), ("wait", "h2d", "G3.consumed"), ("wait", "h2d", "G1.d2h_done")]
    g2.after_backward()
    for g in (g1, g0):
        g.before_backward()
        g.backward_launched()
        g.after_backward()
    dev.synchronize()
    records = [e[2] for e in dev.trace if e[0] == "record"]
    assert not [r for r in records if r in ("G2.d2h_done", "G3.d2h_done")]
    assert mgr.stats.d2h_skipped == 2 and mgr.stats.d2h_copies == 2


def test_a_kept_group_bank_writer_needs_the_consumed_fence(monkeypatch) -> None:
    """Dropping only the waits on kept groups' `consumed` events corrupts bytes for some interleaving."""
    orig = FakeDevice.wait

    def wait(self, stream, event):
        if event.name not in ("G2.consumed", "G3.consumed"):
            orig(self, stream, event)

    monkeypatch.setattr(FakeDevice, "wait", wait)
    detected = 0
    for seed in range(20):
        dev, mgr, groups = build("resident", seed, order=[3, 2, 1, 0], program=STACK[0], progress=1)
        assert mgr.kept == [groups[3], groups[2]]
        try:
            detected += bool(run_program(dev, groups, STACK[0]))
        except FakeDeviceFault:
            detected += 1
    assert detected > 0


def test_a_claim_off_the_plan_raises_instead_of_evicting_a_kept_group() -> None:
    """The kept groups come from the planned order; a forward or a restore off that order that would
    overwrite a kept group's bank (its bytes exist nowhere else) raises, names both groups and the
    bank, and leaves the kept group's bytes for its backward."""
    dev, mgr, groups = build("resident", order=[3, 2, 1, 0], program=STACK[0])
    g0, g1, g2, g3 = groups

    def forward(k: int) -> None:
        g = groups[k]
        g.before_forward()
        dev.launch(dev.compute, lambda: [v.copy_(pattern(0, k, i, v)) for i, v in enumerate(g.views)], f"F{k}",
                   touches=g.views)
        g.after_forward()

    forward(3)
    assert g3.state is GroupState.RESIDENT_KEPT and g1.bank is g3.bank
    with pytest.raises(OffloadStateError, match=r"bank 0: group 'G1' would evict group 'G3', whose D2H was skipped"):
        g1.before_forward()  # off the plan: G1's forward comes before G3's
    assert g3.state is GroupState.RESIDENT_KEPT and g3.bank.owner is g3 and g1.phase is None and not g1.live
    g3.discard()
    for k in range(4):  # the planned forwards: G1 is evicted by G3's forward
        forward(k)
    assert g1.state is GroupState.RESIDENT_RELOAD_PENDING and g3.state is GroupState.RESIDENT_KEPT
    with pytest.raises(OffloadStateError, match=r"bank 0: group 'G1' would evict group 'G3'"):
        g1.before_backward()  # off the plan: G1's restore before G3's backward
    g3.before_backward()
    out = [torch.empty_like(v) for v in g3.views]
    dev.launch(dev.compute, lambda: [o.copy_(v) for o, v in zip(out, g3.views, strict=True)], "B3", touches=g3.views)
    g3.after_backward()
    dev.synchronize()
    assert all(torch.equal(o, pattern(0, 3, i, o)) for i, o in enumerate(out))


def test_a_kept_group_can_be_discarded_or_abandoned() -> None:
    dev, mgr, (g0, g1, g2, g3) = build("resident", order=[3, 2, 1, 0], program=STACK[0])
    g3.before_forward()
    g3.after_forward()
    assert g3.prefetch() is False  # nothing to restore: the bank holds it
    g3.discard()
    assert g3.state is GroupState.MAPPED and not g3.live
    g1.before_forward()  # the bank is free again: no eviction, no error
    g1.after_forward()
    assert mgr.stats.evictions == 0 and g1.state is GroupState.RESIDENT_D2H_PENDING
    g3.before_forward()  # g1 (not kept) is evicted as usual
    assert g1.state is GroupState.RESIDENT_RELOAD_PENDING
    g3.after_forward()
    g3.before_backward()
    g3.abandon()  # a failed backward replay: consumed is recorded, the bank's next writer waits on it
    assert not g3.live and g3.phase is None and g3.bank.last_consumed is g3.consumed
    g1.before_backward()
    g1.after_backward()
    dev.synchronize()


def test_events_must_match_the_backward_order() -> None:
    dev, drv = fake()
    mgr = OffloadManager(config("resident"), device="cpu", driver=drv, streams=dev)
    a, b, empty = mgr.group("a"), mgr.group("b"), mgr.group("empty")
    a.discover(torch.empty(4))
    b.discover(torch.empty(4))
    ev = [("F", a), ("F", empty), ("F", b), ("B", b), ("E", b), ("B", empty), ("E", empty), ("B", a), ("E", a)]
    with pytest.raises(ValueError, match="backward order"):
        mgr.allocate([a, empty, b], events=ev)
    with pytest.raises(ValueError, match="complete"):
        mgr.allocate([b, empty, a], events=ev[:-1])
    mgr.allocate([b, empty, a], banks=[0, 0, 1], events=ev)
    assert mgr.kept == [b, a] and not empty.kept  # one bank each; the empty group holds none


# -------------------------------------------------------------------------------- state machine
SITUATIONS = ["discovering", "idle", "in_forward", "live", "in_backward", "closed"]
OPS = ["discover", "discovery_hooks", "adopt_specs", "capture_hooks", "before_forward", "after_forward",
       "before_backward", "after_backward", "prefetch", "discard"]
LEGAL = {
    "discovering": {"discover", "discovery_hooks", "adopt_specs"},
    "idle": {"capture_hooks", "before_forward", "prefetch", "discard"},
    "in_forward": {"capture_hooks", "after_forward", "prefetch"},
    "live": {"before_backward", "prefetch", "discard"},
    "in_backward": {"after_backward", "prefetch"},
    "closed": set(),
}


def _situation(mode: str, situation: str):
    dev, drv = fake()
    mgr = OffloadManager(config(mode), device="cpu", driver=drv, streams=dev)
    g, other = mgr.group("G0"), mgr.group("G1")
    for grp in (g, other):
        grp.discover(torch.empty(4, 4))
    if situation == "discovering":
        return mgr, g
    mgr.allocate()
    steps = {"idle": [], "in_forward": ["before_forward"], "live": ["before_forward", "after_forward"],
             "in_backward": ["before_forward", "after_forward", "before_backward"]}
    if situation == "closed":
        mgr.close()
        return mgr, g
    for s in steps[situation]:
        getattr(g, s)()
    return mgr, g


def _do(g, op: str) -> None:
    if op == "discover":
        g.discover(torch.empty(2))
    elif op == "discovery_hooks":
        with g.discovery_hooks():
            pass
    elif op == "adopt_specs":
        g.adopt_specs([])
    elif op == "capture_hooks":
        with g.capture_hooks():
            torch.tanh(torch.ones(4, 4, requires_grad=True) * 2)  # saves one (4, 4) tensor, as discovered
    else:
        getattr(g, op)()


@pytest.mark.parametrize("mode", ["off", "release", "resident"])
@pytest.mark.parametrize("situation", SITUATIONS)
@pytest.mark.parametrize("op", OPS)
def test_every_transition_is_allowed_or_rejected_clearly(mode: str, situation: str, op: str) -> None:
    _, g = _situation(mode, situation)
    if op in LEGAL[situation]:
        _do(g, op)
    else:
        with pytest.raises(OffloadStateError, match="'G0'") as exc:
            _do(g, op)
        assert "'G0'" in str(exc.value) and (op in str(exc.value) or op == "discovery_hooks")


@pytest.mark.parametrize("mode", ["release", "resident"])
def test_states_along_the_lifecycle(mode: str) -> None:
    dev, mgr, (g0, g1, g2) = build(mode, layers=3, order=[2, 1, 0], lookahead=False)
    assert [g.state for g in (g0, g1, g2)] == [GroupState.MAPPED] * 3
    seen = []
    for g in (g0, g1, g2):
        g.before_forward()
        assert g.state is GroupState.MAPPED and g.phase == "forward"
        g.after_forward()
        seen.append(g.state)
    if mode == "release":
        assert seen == [GroupState.RELEASE_D2H_PENDING] * 3  # at its after_forward; later hooks may reap
        mgr.reap(block=True)
        assert [g.state for g in (g0, g1, g2)] == [GroupState.UNMAPPED] * 3
        assert (mgr.stats.released_live, mgr.stats.released_at_backward) == (3, 0)
    else:  # g2 took g0's bank
        assert seen == [GroupState.RESIDENT_D2H_PENDING] * 3
        assert [g.state for g in (g0, g1, g2)] == [GroupState.RESIDENT_RELOAD_PENDING,
                                                     GroupState.RESIDENT_D2H_PENDING, GroupState.RESIDENT_D2H_PENDING]
    for g in (g2, g1, g0):
        g.before_backward()
        assert g.state is GroupState.MAPPED and g.live and g.phase == "backward"
        g.after_backward()
        assert not g.live and g.phase is None
    mgr.close()
    assert all(g.state is GroupState.CLOSED for g in (g0, g1, g2))


def test_manager_misuse() -> None:
    dev, drv = fake()
    with pytest.raises(ValueError, match="mode"):
        config("bogus")
    with pytest.raises(ValueError, match="banks"):
        config("resident", banks=1)
    with pytest.raises(TypeError, match="OffloadConfig"):
        OffloadManager("release", device="cpu", driver=drv, streams=dev)
    with pytest.raises(ValueError, match="power of two"):
        OffloadManager(config(), device="cpu", driver=drv, streams=dev, alignment=48)
    mgr = OffloadManager(config("release"), device="cpu", driver=drv, streams=dev)
    a, b = mgr.group("a"), mgr.group("b")
    with pytest.raises(ValueError, match="already exists"):
        mgr.group("a")
    with pytest.raises(ValueError, match="exactly once"):
        mgr.allocate([a, a])
    with pytest.raises(ValueError, match="exactly once"):
        mgr.allocate([a])
    mgr.allocate([b, a])
    with pytest.raises(OffloadStateError, match="already called"):
        mgr.allocate()
    with pytest.raises(OffloadStateError, match="before allocate"):
        mgr.group("c")


def test_resident_bank_in_use_by_a_running_backward_cannot_be_taken() -> None:
    _, mgr, (g0, g1, g2) = build("resident", layers=3, order=[0, 1, 2], lookahead=False)
    for g in (g0, g1):
        g.before_forward()
        g.after_forward()
    g0.before_backward()  # g0 is reading bank 0 ...
    with pytest.raises(OffloadStateError, match="bank 0 is busy: group 'G0'"):
        g2.before_forward()  # ... which g2 shares


def test_discard_drops_live_activations() -> None:
    dev, mgr, (g0, *_) = build("resident", lookahead=False)
    g0.before_forward()
    g0.after_forward()
    g0.prefetch()  # nothing to do: the bank still holds it
    g0.discard()
    assert not g0.live and g0.state is GroupState.MAPPED
    g0.before_forward()  # usable again
    g0.after_forward()
    dev.synchronize()


def test_empty_group_is_a_no_op() -> None:
    dev, drv = fake()
    mgr = OffloadManager(config("release"), device="cpu", driver=drv, streams=dev)
    g = mgr.group("empty")
    x = torch.ones(3, requires_grad=True)
    with g.discovery_hooks():
        (x * x).sum()  # saves only x, a leaf that requires grad: nothing eligible
    mgr.allocate()
    assert g.nbytes == 0 and g.slot is None and g.va is None
    n = len(dev.trace)
    for op in ("before_forward", "after_forward", "before_backward", "after_backward"):
        getattr(g, op)()
    assert len(dev.trace) == n and g.state is GroupState.MAPPED


def test_off_mode_needs_no_device() -> None:
    mgr = OffloadManager(config("off"), device="cpu")
    assert mgr.driver is None and mgr.streams is None
    g = mgr.group("G0")
    x = torch.ones(4, requires_grad=True)
    with g.discovery_hooks():
        y = torch.tanh(x * 2)
    mgr.allocate()
    with g.capture_hooks():
        y = torch.tanh(x * 2)
    g.before_forward()
    g.after_forward()
    g.before_backward()
    (gx,) = torch.autograd.grad(y.sum(), x)
    g.after_backward()
    assert torch.equal(gx, torch.autograd.grad(torch.tanh(x * 2).sum(), x)[0])
    with pytest.raises(OffloadStateError, match="after_backward"):
        g.after_backward()


def test_close_frees_everything() -> None:
    for mode in ("release", "resident"):
        dev, mgr, groups = build(mode)
        assert run_program(dev, groups, STACK[0], steps=1) == []
        mgr.close()
        mgr.close()
        assert dev.cu.reservations == {} and dev.cu.allocations == {} and dev.cu.free == dev.cu.total
        assert dev.cu.primary_retains == [1]  # a driver passed in is the caller's to close
        with pytest.raises(OffloadStateError, match="closed"):
            groups[0].before_forward()


def test_layout_is_aligned_and_packed() -> None:
    dev, drv = fake()
    mgr = OffloadManager(config("release"), device="cpu", driver=drv, streams=dev)
    g = mgr.group("G0")
    for shape, dt in (((3,), torch.float32), ((5, 7), torch.bfloat16), ((2,), torch.int64)):
        g.discover(torch.empty(shape, dtype=dt))
    mgr.allocate()
    assert g.offsets == [0, 256, 512] and g.nbytes == 512 + 16
    assert [v.data_ptr() - g.va for v in g.views] == g.offsets
    assert [(tuple(v.shape), v.dtype) for v in g.views] == [((3,), torch.float32), ((5, 7), torch.bfloat16),
                                                             ((2,), torch.int64)]
    assert g.slot.size == GRAN and g.host.numel() == g.nbytes


# ---------------------------------------------------------------------------------- autograd
def _model(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.nn.Parameter(torch.randn(6, 8, generator=gen))
    w2 = torch.nn.Parameter(torch.randn(8, 5, generator=gen))
    x = torch.randn(4, 6, generator=gen, requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x @ w1  # saves x (a leaf: not offloaded) and w1 (a parameter: not offloaded)
        t = torch.tanh(torch.nn.functional.gelu(h))  # gelu saves h; tanh saves its output t
        return (t @ w2).sin()  # saves t again (stored once) and the matmul output
    return f, x, (x, w1, w2)


@pytest.mark.parametrize("mode", ["release", "resident"])
@pytest.mark.parametrize("batch, batches", [(None, [3]), (0, []), (80, []), (128, [1]), (129, [3])])
def test_saved_activations_round_trip_through_the_slot_bitwise(monkeypatch, mode: str, batch: int | None,
                                                               batches: list[int]) -> None:
    """Each tensor copied at once, or those under `batch` bytes (h and t are 128 bytes, t @ w2 80) together
    at the group's last saved tensor (the default threshold, 256 KiB: all three in one batch)."""
    sizes = []
    orig = OffloadGroup.store_batch
    monkeypatch.setattr(OffloadGroup, "store_batch", staticmethod(lambda copies: (sizes.append(len(copies)),
                                                                                   orig(copies))[1]))
    f, x, inputs = _model()
    gy = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    ref = torch.autograd.grad(f(x), inputs, gy)
    dev, drv = fake(3)
    batched = {} if batch is None else {"store_batch_mib": batch / MIB}
    mgr = OffloadManager(config(mode, **batched), device="cpu", driver=drv, streams=dev)
    g, mid, other = mgr.group("F0"), mgr.group("F1"), mgr.group("F2")
    with g.discovery_hooks():
        f(x)
    mid.adopt_specs(g.specs)
    other.adopt_specs(g.specs)
    assert [s.shape for s in g.specs] == [(4, 8), (4, 8), (4, 5)]  # h, t (stored once), t @ w2
    mgr.allocate([g, mid, other])  # resident: g and other share bank 0
    g.before_forward()
    with dev.host_compute(), g.capture_hooks():
        y = f(x)
    assert [v.data_ptr() - g.va for v in g.views] == g.offsets == [0, 256, 512]
    assert sizes == batches
    g.after_forward()
    if mode == "release":
        assert mgr.reap(block=True) == 1
        assert torch.all(g.slot_bytes == POISON)  # released: nothing of it left on the device
    other.before_forward()
    with dev.host_compute():
        for v in other.views:
            v.fill_(-3.0)  # another forward overwrites the shared bank
    other.after_forward()
    assert g.state is (GroupState.UNMAPPED if mode == "release" else GroupState.RESIDENT_RELOAD_PENDING)
    g.before_backward()
    with dev.host_compute():
        got = torch.autograd.grad(y, inputs, gy)
    g.after_backward()
    assert mgr.stats.h2d_copies >= 1
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_byte_copies_use_the_widest_word_that_addresses_and_length_allow() -> None:
    """Each saved tensor goes into its view as words of 8, 4, 2 or 1 bytes (whatever divides both addresses
    and its length), one multi-tensor copy per word size, and the view then holds the tensor's bits."""
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(4, 6, generator=gen),  # 96 bytes, aligned: int64
               torch.randn(7, generator=gen)[1:4],  # 12 bytes at a 4-byte offset: int32
               torch.randn(3, generator=gen).to(torch.bfloat16),  # 6 bytes: int16
               torch.randint(0, 255, (5,), generator=gen, dtype=torch.uint8),  # 5 bytes: uint8
               torch.randn(3, 4, generator=gen).t()]  # dense, not contiguous: the same strides in the slot
    dev, drv = fake()
    mgr = OffloadManager(config("release"), device="cpu", driver=drv, streams=dev)
    g = mgr.group("G0")
    for t in tensors:
        assert g.discover(t) is not None
    mgr.allocate()
    copies = [g.byte_copy(i, t) for i, t in enumerate(tensors)]
    assert [d.dtype for d, _ in copies] == [torch.int64, torch.int32, torch.int16, torch.uint8, torch.int64]
    assert all(s.data_ptr() == t.data_ptr() and d.data_ptr() == v.data_ptr()
               for (d, s), t, v in zip(copies, tensors, g.views, strict=True))
    with dev.host_compute():
        g.store_batch(copies)
    assert all(torch.equal(v.contiguous().view(torch.uint8), t.contiguous().view(torch.uint8)) and v.stride() == t.stride()
               for v, t in zip(g.views, tensors, strict=True))


def test_a_batch_is_copied_once_it_holds_store_batch_flush_times_the_threshold(monkeypatch) -> None:
    """Ten saved tensors of 64 bytes under a 65-byte threshold: the first batch goes at 9 x 64 >= 8 x 65
    bytes (the originals are not all kept alive until the group's end), the last tensor alone."""
    from qeffect.offload.group import STORE_BATCH_FLUSH

    sizes = []
    orig = OffloadGroup.store_batch
    monkeypatch.setattr(OffloadGroup, "store_batch", staticmethod(lambda copies: (sizes.append(len(copies)),
                                                                                   orig(copies))[1]))
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(0), requires_grad=True)

    def f(x: torch.Tensor) -> torch.Tensor:
        for _ in range(10):
            x = torch.tanh(x)  # saves its output
        return x

    dev, drv = fake()
    mgr = OffloadManager(config("release", store_batch_mib=65 / MIB), device="cpu", driver=drv, streams=dev)
    g = mgr.group("F0")
    with g.discovery_hooks():
        f(x)
    mgr.allocate()
    g.before_forward()
    with dev.host_compute(), g.capture_hooks():
        y = f(x)
    assert STORE_BATCH_FLUSH == 8 and sizes == [9, 1]
    g.after_forward()
    g.before_backward()
    with dev.host_compute():
        got = torch.autograd.grad(y.sum(), x)
    g.after_backward()
    assert torch.equal(got[0], torch.autograd.grad(f(x).sum(), x)[0])


def test_store_batch_size_comes_from_the_config_and_bad_values_are_refused() -> None:
    """`offload.store_batch_mib` in bytes (0: each saved tensor copied at once); 0.25 MiB by default; a
    negative size is refused by the config."""
    assert OffloadManager(OffloadConfig(store_batch_mib=0)).store_batch_bytes == 0
    assert OffloadManager(OffloadConfig()).store_batch_bytes == int(DEFAULT_STORE_BATCH_MIB * MIB) == 1 << 18
    with pytest.raises(ValueError, match="store_batch_mib"):
        OffloadConfig(store_batch_mib=-1)


def discovered_release_group(f, x: torch.Tensor):
    """A release-mode group that discovered what `f(x)` saves, allocated, inside its forward's hooks."""
    dev, drv = fake()
    mgr = OffloadManager(config("release"), device="cpu", driver=drv, streams=dev)
    g = mgr.group("F0")
    with g.discovery_hooks():
        f(x)
    mgr.allocate()
    g.before_forward()
    return dev, mgr, g


def test_backward_without_restore_reads_poison() -> None:
    """The round trip above can fail: reading the slot after the release gives wrong gradients."""
    f, x, inputs = _model()
    gy = torch.ones(4, 5)
    ref = torch.autograd.grad(f(x), inputs, gy)
    dev, mgr, g = discovered_release_group(f, x)
    with dev.host_compute(), g.capture_hooks():
        y = f(x)
    g.after_forward()
    assert mgr.reap(block=True) == 1  # unmapped: the views now read the poison byte
    got = torch.autograd.grad(y, inputs, gy)
    assert not torch.equal(got[0], ref[0])


def test_capture_keeps_no_saved_original_alive() -> None:
    """Once a saved tensor is copied into its slot, the capture holds nothing of the original: its memory
    goes back to the forward graph's pool during the capture, not only after it."""
    from torch.multiprocessing.reductions import StorageWeakRef

    w = torch.nn.Parameter(torch.randn(6, 8, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(4, 6)
    originals: list[StorageWeakRef] = []

    def f(x: torch.Tensor) -> torch.Tensor:
        h = x @ w
        originals.append(StorageWeakRef(h.untyped_storage()))
        return torch.nn.functional.gelu(h)  # saves h

    dev, _, g = discovered_release_group(f, x)
    with dev.host_compute(), g.capture_hooks():
        y = f(x)
        gc.collect()
        assert originals[-1].expired()  # still inside the capture
        assert [tuple(v.shape) for v in g.views] == [(4, 6), (4, 8)]  # x (saved by the matmul), h
    g.after_forward()
    g.before_backward()
    with dev.host_compute():
        got = torch.autograd.grad(y.sum(), w)[0]
    g.after_backward()
    ref = torch.autograd.grad(f(x).sum(), w)[0]
    assert torch.equal(got, ref)


def test_an_equal_key_after_its_tensor_died_is_a_new_saved_tensor(monkeypatch) -> None:
    """Two different tensors under one key (an address freed and reused): while the first is alive the
    second would be its duplicate, but it is gone by then, so both are stored, in discovery and capture
    alike, and the backward reads the right bytes."""
    import qeffect.offload.group as group_mod

    monkeypatch.setattr(group_mod, "_key", lambda t: tuple(t.shape))  # equal shapes collide
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.nn.Parameter(torch.randn(6, 8, generator=gen)), torch.nn.Parameter(torch.randn(8, 3, generator=gen))
    x = torch.randn(4, 6, generator=gen, requires_grad=True)  # a leaf requiring grad: not offloaded

    def f(x: torch.Tensor) -> torch.Tensor:
        h1 = x @ w1
        y1 = torch.nn.functional.gelu(h1)  # saves h1 (4, 8)
        del h1  # gone before the next save under its key
        return torch.nn.functional.gelu(y1 @ w2)  # the matmul saves y1 (4, 8), gelu its input (4, 3)

    dev, _, g = discovered_release_group(f, x)
    assert [s.shape for s in g.specs] == [(4, 8), (4, 8), (4, 3)]
    with dev.host_compute(), g.capture_hooks():
        y = f(x)
    g.after_forward()
    g.before_backward()
    with dev.host_compute():
        got = torch.autograd.grad(y.sum(), (x, w1, w2))
    g.after_backward()
    ref = torch.autograd.grad(f(x).sum(), (x, w1, w2))
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_capture_must_match_discovery() -> None:
    dev, drv = fake()
    mgr = OffloadManager(config("release"), device="cpu", driver=drv, streams=dev)
    g = mgr.group("G0")
    x = torch.randn(3, 4, requires_grad=True)
    with g.discovery_hooks():
        torch.tanh(x * 2)
    mgr.allocate()
    with pytest.raises(OffloadStateError, match=r"saved tensor #0 differs from discovery: shape"):
        with g.capture_hooks():
            torch.tanh(torch.randn(5, 4, requires_grad=True) * 2)
    with pytest.raises(OffloadStateError, match="more tensors than discovery"):
        with g.capture_hooks():
            torch.tanh(torch.tanh(x * 2))
    with pytest.raises(OffloadStateError, match="saved 0 tensors, discovery 1"):
        with g.capture_hooks():
            x * 2


def test_default_eligibility() -> None:
    p = torch.nn.Parameter(torch.ones(3, 3))
    leaf = torch.ones(3, 3, requires_grad=True)
    act = leaf * 2
    assert default_eligible(act) and default_eligible(act.t())  # dense, any order
    assert not default_eligible(p) and not default_eligible(p.t())  # parameters and their views
    assert not default_eligible(leaf) and not default_eligible(leaf[0])  # static inputs
    assert not default_eligible(torch.ones(3, 1).expand(3, 4))  # overlapping
    assert not default_eligible(torch.ones(4, 4)[:, :2])  # gaps
    assert not default_eligible(torch.ones(0))
    mgr = OffloadManager(config("off"), device="meta")
    assert not mgr._eligible(act)  # another device


# ------------------------------------------------------------------------------------------- CLI
def _cli(capsys, *argv: str) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    return int(exc.value.code or 0), capsys.readouterr().err


def test_cli_without_cuda_is_one_line_exit_2(capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc, err = _cli(capsys, "offload-check")
    assert rc == 2 and err.strip() == "qeffect: error: qeffect offload-check needs a CUDA device; none is available"


def test_cli_without_cuda_bindings_is_one_line_exit_2(capsys, monkeypatch) -> None:
    import qeffect.offload.checks as checks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(checks, "bindings_available", lambda: False)
    rc, err = _cli(capsys, "offload-check", "--json", "/nonexistent/x.json")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "cuda.bindings" in err


def test_cli_rejects_unknown_check(capsys) -> None:
    rc, err = _cli(capsys, "offload-check", "--only", "bogus")
    assert rc == 2 and "unknown --only bogus" in err


@pytest.mark.parametrize("toml", ["", '[offload]\nlookahead = 2\nreap = true\nshare_slots = "nested"\ncopy_chunk_mib = 1.0\n'])
def test_offload_check_builds_its_managers_from_the_config_train_uses(monkeypatch, tmp_path, toml: str) -> None:
    """`qeffect offload-check`, `train` and `verify-state` read one `[offload]` section: for each mode a check
    runs, its managers' config (`check_config` over `offload_check_config`) equals the one the builder of
    `train --offload MODE` (and of verify-state: `path_runtime`) gives its manager, with the same `--config`;
    without one, the defaults (`OffloadConfig()`)."""
    from qeffect.cli.common import config_from_cli
    from qeffect.cli.offload_check import offload_check_config
    from qeffect.offload.checks import check_config
    from qeffect.runtime import build as build_mod

    path = None
    if toml:
        path = tmp_path / "run.toml"
        path.write_text(toml)
    made = []
    monkeypatch.setattr(build_mod, "OffloadManager", lambda config, **kw: made.append(config) or object())
    monkeypatch.setattr(build_mod, "GraphManager", lambda *a, **kw: None)  # (no CUDA here)
    for mode in ("release", "resident"):
        cfg = config_from_cli(path, **{"offload.mode": mode, "train.device": "cuda", "train.path": "captured-direct"})
        build_mod.path_runtime(cfg, "captured-direct", "cuda", native=False, direct=True)
        assert made[-1] == check_config(mode, offload_check_config(path)) == cfg.offload
        assert made[-1] == (OffloadConfig(mode=mode) if not toml else
                            OffloadConfig(mode=mode, lookahead=2, reap=True, share_slots="nested", copy_chunk_mib=1.0))
    assert check_config("release", lookahead=0).lookahead == 0  # a check's own knob over the same base
    with pytest.raises(ValueError, match="lookahead"):
        check_config("release", lookahead=-1)


def test_nothing_under_offload_reads_the_environment() -> None:
    """Every offload knob comes from the config (`OffloadConfig`): no module of the package reads a variable."""
    from pathlib import Path

    import qeffect.offload

    root = Path(qeffect.offload.__file__).parent
    reads = [f"{p.name}:{i}" for p in sorted(root.glob("*.py"))
             for i, line in enumerate(p.read_text().splitlines(), 1) if "environ" in line or "getenv" in line]
    assert reads == []


def test_prefetch_into_a_bank_under_a_running_backward_is_skipped() -> None:
    _, mgr, (g0, g1, g2) = build("resident", layers=3, order=[0, 1, 2], lookahead=False)
    for g in (g0, g1, g2):  # g2 takes g0's bank (bank 0)
        g.before_forward()
        g.after_forward()
    g2.discard()
    g2.before_forward()
    g2.after_forward()
    g1.before_backward()  # bank 1: nothing to restore
    assert g0.state is GroupState.RESIDENT_RELOAD_PENDING
    # g2 owns bank 0 and is not in a backward: the prefetch of g0 may take it
    assert g0.prefetch() and mgr.stats.prefetches == 1
    g1.after_backward()
    g0.before_backward()
    g2_bank_owner = g0.bank.owner
    assert g2_bank_owner is g0 and g2.state is GroupState.RESIDENT_RELOAD_PENDING
    assert not g2.prefetch() and mgr.stats.prefetches_skipped == 1  # bank 0 is being read by g0
    g0.after_backward()
    assert g2.prefetch()


def _param_survives(hooks_of, eligible=None) -> bool:
    """Run y = exp(x @ w) (exp saves its output) under `hooks_of(group)`, drop y and w: is w still alive?"""
    import weakref

    dev, drv = fake()
    mgr = OffloadManager(config("release"), device="cpu", driver=drv, streams=dev, **({"eligible": eligible} if eligible else {}))
    g = mgr.group("G0")
    x = torch.randn(3, 4)
    with g.discovery_hooks():
        (x @ torch.randn(4, 4, requires_grad=True)).exp()
    mgr.allocate()
    w = torch.randn(4, 4, requires_grad=True)
    alive = weakref.ref(w)
    g.before_forward()
    with dev.host_compute(), hooks_of(g):
        y = (x @ w).exp()
    del y, w
    gc.collect()
    return alive() is not None


def test_pack_hooks_leave_no_reference_cycle() -> None:
    """A pack hook that returned a saved output itself kept the whole forward graph (and its parameters)
    alive after the graph was dropped: discovery leaked every warm-up graph of an offloaded pipeline."""
    assert not _param_survives(lambda g: contextlib.nullcontext())  # the control: autograd alone frees it
    assert not _param_survives(lambda g: torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach(), lambda t: t))
    assert _param_survives(lambda g: torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))  # the leak
    # (discovery_hooks: the test below; they are refused after allocate)
    # capture: x and exp's output go to the slot (the hook remembers what it stored) ...
    assert not _param_survives(lambda g: g.capture_hooks())
    # ... or exp's output (requires grad: not eligible here) stays where autograd keeps it
    assert not _param_survives(lambda g: g.capture_hooks(), eligible=lambda t: not t.requires_grad)


def test_discovery_hooks_leave_no_reference_cycle() -> None:
    import weakref

    dev, drv = fake()
    mgr = OffloadManager(config("release"), device="cpu", driver=drv, streams=dev)
    g = mgr.group("G0")
    w = torch.randn(4, 4, requires_grad=True)
    alive = weakref.ref(w)
    with g.discovery_hooks():
        y = (torch.randn(3, 4) @ w).exp()
    assert len(g.specs) == 2  # x and exp's output were discovered
    del y, w
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_release_without_reaping_keeps_consumed_slots_for_the_next_forward(program: str) -> None:
    """`offload.reap = false` (the config's default): a slot stays mapped from its backward
    to its next forward, so the only remaps are the restores; the bytes are still right in every order."""
    prog, order = PROGRAMS[program]
    for seed in range(6):
        dev, mgr, groups = build("release", seed, layers=len(order), order=order, reap=False)
        assert run_program(dev, groups, prog) == [], (program, seed)
        assert mgr.stats.reaped == 0 and mgr.stats.maps == mgr.stats.h2d_copies
        assert mgr.stats.h2d_copies + mgr.stats.kept_at_backward == 2 * len(order)  # (kept: read in place)


@pytest.mark.parametrize("mode", ["release", "release-keep", "release-shared", "resident"])
@pytest.mark.parametrize("fail_in", ["forward", "backward", "live"])
@pytest.mark.parametrize("which", [0, 1])
def test_abandon_after_an_aborted_step_then_every_order_still_restores_the_right_bytes(mode: str, fail_in: str,
                                                                                        which: int) -> None:
    keep = {"reap": False} if mode == "release-keep" else {}
    if mode == "release-shared":  # G1 and G0 share a slot (as G3 and G2): the aborted group is either member
        keep = {"reap": False, "share_slots": "any", "program": STACK[0]}
    for seed in range(6):
        dev, mgr, groups = build(mode.split("-")[0], seed, layers=4, order=[3, 2, 1, 0], **keep)
        assert len(mgr.shared) == (2 if mode == "release-shared" else 0)
        g = groups[which]
        g.before_forward()  # a failed forward replay: after_forward never ran
        if fail_in != "forward":
            g.after_forward()
            if fail_in == "backward":
                g.before_backward()  # a failed backward replay: after_backward never ran
        g.abandon()
        assert not g.live and g.phase is None
        assert run_program(dev, groups, STACK[0]) == [], (mode, fail_in, seed)


def test_begin_step_drops_what_an_aborted_step_left_live() -> None:
    """An aborted step leaves a kept group live in its bank; without `begin_step` the retried step's
    first claim of that bank is refused (the hard check), with it the retry runs."""
    for retry_cleanly in (False, True):
        dev, mgr, groups = build("resident", order=[3, 2, 1, 0], program=STACK[0])
        g3 = groups[3]
        g3.before_forward()
        g3.after_forward()  # the step dies here: G3 stays live, kept in bank 0 (no D2H)
        assert g3.live and g3.state is GroupState.RESIDENT_KEPT
        if retry_cleanly:
            assert mgr.begin_step() == 1 and not g3.live
            assert mgr.begin_step() == 0
            for g in groups:
                g.before_forward()
                g.after_forward()
        else:
            with pytest.raises(OffloadStateError, match="would evict group 'G3'"):
                for g in groups:
                    g.before_forward()
                    g.after_forward()
        dev.synchronize()


def test_a_discarded_pending_group_leaves_the_reap_queue_at_its_next_forward() -> None:
    """Release (consumed slots kept): a group discarded while its D2H was pending keeps its slot mapped and
    must leave the reap queue at its next forward; a stale entry at the front would stop every later reap
    (they break at the first entry not releasable)."""
    dev, mgr, groups = build("release", progress=0, reap=False, lookahead=0)
    g0 = groups[0]
    g0.before_forward()
    g0.after_forward()
    g0.discard()
    assert g0.state is GroupState.RELEASE_D2H_PENDING and mgr._d2h_fifo == [g0]
    g0.before_forward()
    assert g0.state is GroupState.MAPPED and mgr._d2h_fifo == []
    g0.after_forward()
    for g in groups[1:]:
        g.before_forward()
        g.after_forward()
    dev.synchronize()
    assert mgr.reap() == 4 and mgr._d2h_fifo == []


def schedule_program(name: str, microbatches: int = 4) -> tuple[list[tuple[str, int]], list[int]]:
    """One step of a real pipeline schedule (PP=2, two virtual stages per rank) as a `run_program` program:
    group k = stage * microbatches + microbatch, its dI the backward ("B"); the groups in backward order."""
    from qeffect.offload.planning import named_events
    from qeffect.schedule.adapter import build_schedule
    from qeffect.schedule.order import global_order

    events = named_events(global_order(build_schedule(name, 2, 2, microbatches)))
    program = [(kind, stage * microbatches + mb) for kind, (stage, mb) in events if kind != "E"]
    return program, [k for op, k in program if op == "B"]


SHARING = {"stack": STACK, "1f1b": ONE_F_ONE_B, "interleaved": schedule_program("interleaved"),
           "zbv": schedule_program("zbv")}


@pytest.mark.parametrize("program, rule", [(p, "any") for p in sorted(SHARING)] +
                         [(p, "nested") for p in ("stack", "interleaved", "zbv")])
@pytest.mark.parametrize("reap", [False, True])
@pytest.mark.parametrize("lookahead", [0, 1, 2])
@pytest.mark.parametrize("at_backward", [False, True])
def test_shared_slots_restore_the_right_bytes_in_every_interleaving(program: str, rule: str, reap: bool,
                                                                      lookahead: int, at_backward: bool) -> None:
    """Release with `share_slots`: groups whose backwards follow one another (and, with "nested", whose
    forwards ran in reverse) share one slot, which goes out once every member's D2H is done and comes back,
    with every member's bytes, before the first member's backward. Each slot is mapped once a step (without
    reaping), fewer than the groups; every group still comes back bitwise. Without `release_at_backward`, a
    backward that came before its slot could go reads its members' bytes in place instead."""
    prog, order = SHARING[program]
    for seed in range(6):
        dev, mgr, groups = build("release", seed, layers=len(order), order=order, program=prog, share_slots=rule,
                                 reap=reap, lookahead=lookahead, release_at_backward=at_backward)
        assert mgr.shared and all(len(run) == 2 for run in mgr.shared)
        slots = mgr.slots()
        assert len(slots) == len(order) - len(mgr.shared)
        assert run_program(dev, groups, prog) == [], (program, reap, lookahead, seed)
        assert mgr.stats.h2d_copies + mgr.stats.reloads_skipped == 2 * len(order)
        if lookahead <= 1:  # (deeper, a look-ahead may restore an outer member before the inner one's forward: the
            # slot then stays mapped through that forward, whose bytes the backward reads there, `reloads_skipped`)
            kept = 0 if at_backward else mgr.stats.kept_at_backward
            assert mgr.stats.reloads_skipped == kept and mgr.stats.h2d_copies == 2 * len(order) - kept
            assert mgr.stats.released_live + mgr.stats.released_at_backward == 2 * len(order) - kept
            if not reap:
                assert mgr.stats.maps == mgr.stats.unmaps <= 2 * len(slots)
                assert mgr.stats.maps == 2 * len(slots) or not at_backward


def test_shared_slot_layout_and_driver_calls() -> None:
    """Members lie one after another (aligned) in one slot, each view at its group's VA; a stack of four
    groups makes two slots, so a step makes half the unmaps and maps of one slot per group."""
    calls = {}
    for share in (False, True):
        dev, mgr, groups = build("release", order=[3, 2, 1, 0], program=STACK[0], share_slots="any" if share else "off",
                                 reap=False, release_at_backward=True)  # (every slot goes: comparable)
        if share:
            assert [[g.name for g in run] for run in mgr.shared] == [["G3", "G2"], ["G1", "G0"]]
            g3, g2 = groups[3], groups[2]
            assert g3.slot is g2.slot and g3.va == g3.slot.va and g2.va == g3.va + -(-g3.nbytes // 256) * 256
            assert g3.slot.name == "G3+G2" and g3.slot.size >= g2.base + g2.nbytes
            assert all(v.data_ptr() == g.va + o for g in groups for v, o in zip(g.views, g.offsets, strict=True))
        assert run_program(dev, groups, STACK[0]) == []
        calls[share] = (mgr.stats.maps, mgr.stats.unmaps, len(mgr.slots()))
    assert calls == {False: (8, 8, 4), True: (4, 4, 2)}


@pytest.mark.parametrize("fence", ["forward_done", "restore_done"])
def test_each_fence_is_needed_with_shared_slots(monkeypatch, fence: str) -> None:
    """Without one kind of stream wait, some interleaving of shared-slot release reads wrong bytes or faults."""
    kw = {"mode": "release", "share_slots": "any", "reap": False}
    runs = [(*SHARING[name], {**kw, "program": SHARING[name][0]}) for name in ("stack", "interleaved", "1f1b")]
    assert detected_without(monkeypatch, fence, runs) > 0


@pytest.mark.parametrize("reap", [False, True])
def test_a_run_off_the_shared_plan_keeps_a_slot_a_member_still_needs(reap: bool) -> None:
    """Planned from the stack (G1 and G0 share a slot), run one group at a time: at G0's backward G1 has not
    run its forward, so the slot cannot go; G0's bytes never left it and its backward reads them there."""
    prog = [op for k in range(4) for op in (("F", k), ("B", k))]
    for seed in range(6):
        dev, mgr, groups = build("release", seed, order=[3, 2, 1, 0], program=STACK[0], share_slots="any",
                                 reap=reap)
        assert run_program(dev, groups, prog) == [], (reap, seed)
        assert mgr.stats.reloads_skipped > 0


def test_slot_sharing_comes_from_the_config() -> None:
    """`offload.share_slots`: "any" run (the default), "nested" runs only, or "off"; `offload.slot_members`
    (2 by default) bounds a run; an unknown rule or no members is refused by the config."""
    assert OffloadConfig().share_slots == "any" and OffloadConfig().slot_members == 2
    assert build("release")[1].share_slots == "any" and build("release")[1].slot_members == 2
    assert build("release", program=STACK[0], share_slots="off")[1].shared == []
    nested = build("release", program=STACK[0], share_slots="nested")[1]  # a stack's runs nest
    assert nested.share_slots == "nested" and len(nested.shared) == 2
    _, mgr, _ = build("release", program=STACK[0], slot_members=3)
    assert mgr.slot_members == 3 and [len(r) for r in mgr.shared] == [3]
    for bad in ({"share_slots": "1"}, {"slot_members": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            OffloadConfig(**bad)
    _, mgr, _ = build("release", program=STACK[0])  # shared only with the schedule's events
    assert len(mgr.shared) == 2 and not build("release")[1].shared
    _, mgr, _ = build("resident", program=STACK[0])  # and only in release mode
    assert not mgr.shared


def test_share_gap_and_release_at_backward_come_from_the_config() -> None:
    """`offload.share_gap` (4 by default; build's is 0) and `offload.release_at_backward` (off by default)."""
    dev, drv = fake()
    mgr = OffloadManager(config("release"), device="cpu", driver=drv, streams=dev)
    assert mgr.share_gap == DEFAULT_SHARE_GAP == 4 and mgr.release_at_backward is False
    _, mgr, _ = build("release", order=[3, 2, 1, 0], program=STACK[0], share_gap=1)  # STACK: G2's forward,
    assert mgr.share_gap == 1 and [[g.name for g in run] for run in mgr.shared] == [["G2", "G1"]]  # then B3
    assert build("release", order=[3, 2, 1, 0], program=STACK[0], share_gap=0)[1].share_gap == 0
    with pytest.raises(ValueError, match="share_gap"):
        OffloadConfig(share_gap=-1)
    assert build("release", release_at_backward=True)[1].release_at_backward is True


# ------------------------------------------------------------------ driver stream operations (no GPU)
class _RawHandle:
    def __init__(self, h: int) -> None:
        self.h = h


class _FakeCu:
    """The four `cuda.bindings.driver` names `DriverCudaStreams` uses, recording each call."""

    class CUresult:
        CUDA_SUCCESS = 0

    CUstream = CUevent = _RawHandle

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail: str | None = None

    def _ret(self, name: str, *args: object) -> tuple:
        self.calls.append((name, *args))
        return (700 if self.fail == name else 0,)

    def cuEventRecord(self, e, s):  # noqa: N802
        return self._ret("cuEventRecord", e.h, s.h)

    def cuStreamWaitEvent(self, s, e, flags):  # noqa: N802
        return self._ret("cuStreamWaitEvent", s.h, e.h)

    def cuMemcpyAsync(self, dst, src, n, s):  # noqa: N802
        return self._ret("cuMemcpyAsync", dst, src, n, s.h)


class _FakeEvent:
    def __init__(self, h: int) -> None:
        self.cuda_event, self.torch_records = h, 0

    def record(self, stream=None) -> None:
        self.torch_records += 1
        self.cuda_event = self.cuda_event or 99


def _driver_ops():
    """A `DriverCudaStreams` over `_FakeCu`: no CUDA device here, so the attributes __init__ would set."""
    from qeffect.offload.streams import DriverCudaStreams

    ops = object.__new__(DriverCudaStreams)
    ops.cu, ops._ok, ops._streams, ops._events = _FakeCu(), 0, {}, {}
    return ops


def test_driver_stream_operations_pass_the_raw_handles_and_check_each_result() -> None:
    from types import SimpleNamespace

    from qeffect.offload.driver import CudaDriverError

    ops = _driver_ops()
    s, e = SimpleNamespace(cuda_stream=7), _FakeEvent(5)
    ops.record(e, s)
    ops.wait(s, e)
    a, b = torch.zeros(16, dtype=torch.uint8), torch.ones(16, dtype=torch.uint8)
    ops.copy(a, b, s)
    assert ops.cu.calls == [("cuEventRecord", 5, 7), ("cuStreamWaitEvent", 7, 5),
                            ("cuMemcpyAsync", a.data_ptr(), b.data_ptr(), 16, 7)]
    assert len(ops._events) == len(ops._streams) == 1  # wrappers by handle value, made once
    fresh = _FakeEvent(0)  # never recorded: a wait is a no-op (as in CUDA), a record is torch's (it creates it)
    ops.wait(s, fresh)
    ops.record(fresh, s)
    assert fresh.torch_records == 1 and len(ops.cu.calls) == 3
    with pytest.raises(ValueError, match="contiguous tensors of equal size"):
        ops.copy(a[:8], b, s)
    with pytest.raises(ValueError, match="contiguous tensors of equal size"):
        ops.copy(torch.zeros(4, 4, dtype=torch.uint8).t(), b, s)
    ops.cu.fail = "cuStreamWaitEvent"
    with pytest.raises(CudaDriverError, match="cuStreamWaitEvent failed"):
        ops.wait(s, e)


def test_driver_streams_take_the_current_stream_as_its_raw_handle() -> None:
    """current_stream: torch's raw current stream of the device index, as a `RawStream` the other
    operations take."""
    from qeffect.offload.streams import RawStream

    ops = _driver_ops()
    ops.device = torch.device("cuda", 3)
    ops._current_raw = lambda index: 1000 + index
    cur = ops.current_stream()
    assert cur == RawStream(1003) and cur.cuda_stream == 1003
    e = _FakeEvent(5)
    ops.record(e, cur)
    ops.wait(cur, e)
    assert ops.cu.calls == [("cuEventRecord", 5, 1003), ("cuStreamWaitEvent", 1003, 5)]


def test_launch_first_queues_the_lookahead_restore_after_the_backward_launch() -> None:
    """launch_first: B3 is launched before G2's look-ahead restore is queued (which then runs beside it);
    without, the restore is queued first. Either way every group is restored once."""
    for first in (False, True):
        dev, mgr, groups = released_stack(lookahead=1, launch_first=first)
        for k in (3, 2):
            groups[k].before_backward()
            dev.launch(dev.compute, lambda: None, f"B{k}")
            groups[k].backward_launched()
            groups[k].after_backward()
        h2d = [i for i, e in enumerate(dev.trace) if e[:2] == ("copy", "h2d")]
        launch3 = dev.trace.index(("launch", "compute", "B3"))
        assert len(h2d) == 3 and mgr.stats.prefetches == 2
        assert (h2d[1] > launch3) is first  # G2's restore: after B3's launch with launch_first
        dev.synchronize()


def test_launch_first_reaps_after_the_forward_launch() -> None:
    """launch_first: before_forward makes no driver call for other groups (the reap comes in after_forward)."""
    for first in (False, True):
        dev, mgr, groups = build("release", progress=0, launch_first=first)
        groups[0].before_forward()
        dev.launch(dev.compute, lambda: None, "F0")
        groups[0].after_forward()
        dev.synchronize()  # G0's D2H is done: the next hook may release its slot
        unmaps = mgr.stats.unmaps
        groups[1].before_forward()
        assert mgr.stats.unmaps == unmaps + (0 if first else 1)
        dev.launch(dev.compute, lambda: None, "F1")
        groups[1].after_forward()
        assert mgr.stats.unmaps == unmaps + 1
        dev.synchronize()


def test_launch_first_and_the_other_switches_come_from_the_config() -> None:
    """`offload.launch_first`, `skip_futile_restores` and `driver_streams` default on; each reaches the manager."""
    defaults = OffloadConfig()
    assert defaults.launch_first and defaults.skip_futile_restores and defaults.driver_streams
    assert build("release", progress=0)[1].launch_first is True
    assert build("release", progress=0, launch_first=False)[1].launch_first is False
    assert build("resident", skip_futile_restores=False)[1].skip_futile_restores is False


def test_backward_launched_outside_a_backward_is_refused() -> None:
    dev, mgr, groups = build("release", progress=0, launch_first=True)
    groups[0].before_forward()
    with pytest.raises(OffloadStateError, match="backward_launched"):
        groups[0].backward_launched()



def test_the_offload_option_takes_the_modes_of_the_config() -> None:
    """`--offload` (train, verify-state) sets `offload.mode`: its choices are the config's modes."""
    from typing import get_args

    from qeffect.cli.common import Offload

    assert [m.value for m in Offload] == list(get_args(OffloadConfig.model_fields["mode"].annotation))
