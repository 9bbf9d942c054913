"""Memory accounting (profile/memory.py) with fake counters and a CPU pipeline, and the memory cap
(`train.memory_fraction`, runtime/memory_cap.py): its validation and its one-line refusal."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qeffect.config import load_config
from qeffect.errors import UserError
from qeffect.profile.memory import (
    CATEGORIES,
    MemorySplit,
    StorageCounter,
    add_native_ratios,
    count_steady,
    graph_pool_bytes,
    graph_pools,
    pool_bytes_from_segments,
    split_peak,
    transient_grad_bytes,
)
from qeffect.runtime.build import build_single_process
from qeffect.runtime.memory_cap import apply_memory_fraction, is_out_of_memory, refusal, refuse_out_of_memory

MB = 1 << 20


# ------------------------------------------------------------------------------------------ arithmetic
def test_captured_split_sums_to_the_peak_and_transient_is_other() -> None:
    counted = {"parameters": 100 * MB, "optimizer_state": 200 * MB, "gradients": 150 * MB, "fp8": 10 * MB,
               "activations": 300 * MB, "graph_pools": 40 * MB}
    steady = sum(counted.values()) + 5 * MB  # 5 MB nobody owns
    s = split_peak(peak=1000 * MB + steady + 20 * MB, baseline=1000 * MB, steady=steady, counted=counted,
                   captured=True)
    assert list(s.categories) == list(CATEGORIES)
    assert s.transient_bytes == 20 * MB and s.categories["other"] == 20 * MB
    assert s.unattributed_bytes == 5 * MB and s.within_tolerance
    assert sum(s.categories.values()) + s.unattributed_bytes == s.own_peak_bytes  # exact, not approximate
    assert s.categories["activations"] == 300 * MB  # the F graphs' pools, not the transient


def test_eager_split_moves_per_step_gradients_out_of_the_transient() -> None:
    counted = {"parameters": 100 * MB, "optimizer_state": 200 * MB}
    s = split_peak(peak=700 * MB, baseline=0, steady=300 * MB, counted=counted, captured=False,
                   transient_grads=100 * MB)
    assert s.categories["gradients"] == 100 * MB and s.categories["activations"] == 300 * MB
    assert s.categories["other"] == 0 and s.unattributed_bytes == 0
    # gradients are capped by the transient bytes (never a negative activation)
    s = split_peak(peak=350 * MB, baseline=0, steady=300 * MB, counted=counted, captured=False,
                   transient_grads=100 * MB)
    assert s.categories["gradients"] == 50 * MB and s.categories["activations"] == 0


@pytest.mark.parametrize(("missing", "ok"), [(0.049, True), (0.051, False), (-0.051, False)])
def test_the_split_must_explain_the_peak_within_five_percent(missing: float, ok: bool) -> None:
    own = 1000 * MB
    unattributed = int(missing * own)
    counted = {"parameters": own - 100 * MB - unattributed}
    s = split_peak(peak=own, baseline=0, steady=own - 100 * MB, counted=counted, captured=True)
    assert s.unattributed_bytes == unattributed and s.within_tolerance is ok
    assert ("over 5%" in s.line()) is not ok


def test_split_refuses_inconsistent_counters_and_unknown_categories() -> None:
    with pytest.raises(ValueError, match="inconsistent counters"):
        split_peak(peak=10, baseline=20, steady=0, counted={}, captured=True)
    with pytest.raises(ValueError, match="inconsistent counters"):
        split_peak(peak=100, baseline=0, steady=200, counted={}, captured=True)
    with pytest.raises(ValueError, match="unknown memory categories \\['tapes'\\]"):
        split_peak(peak=100, baseline=0, steady=50, counted={"tapes": 1}, captured=True)


def test_storages_are_counted_once_first_category_wins() -> None:
    a = torch.zeros(1000)
    c = StorageCounter()
    c.add("parameters", [a, a[10:], a.view(10, 100)])
    c.add("gradients", [a, torch.zeros(10, dtype=torch.float64)])
    assert c.bytes == {"parameters": 4000, "gradients": 80}


def test_graph_pools_split_forward_from_backward_graphs() -> None:
    def act(name: str, a: int, r: int = 0):
        return SimpleNamespace(name=name, memory_allocated_before=0, memory_allocated_after=a,
                               memory_reserved_before=0, memory_reserved_after=r)

    assert graph_pool_bytes([act("s0.F0", 10, 20), act("s0.F4", 5), act("s1.dI0", 7, 8),
                             act("s1.dW3", 3)]) == (15, 10, 28)


def test_graph_pools_are_counted_from_the_allocator_snapshot_by_blocks_in_use() -> None:
    """A capture that frees memory allocated before it (a warm-up's tapes) adds a negative net to the
    allocated bytes; the snapshot counts what the pool holds: its blocks in use, not those another
    category already counted, nothing of other pools or of the default one."""
    def seg(pool, *blocks):
        return {"segment_pool_id": pool, "blocks": [{"address": a, "size": n, "state": st} for a, n, st in blocks]}

    segments = [seg((0, 1), (100, 64, "active_allocated"), (164, 32, "inactive"), (196, 8, "active_allocated")),
                seg((0, 2), (300, 16, "active_allocated"), (316, 4, "active_awaiting_free")),
                seg((0, 0), (500, 1000, "active_allocated")),  # the default pool: tensors outside graphs
                seg((0, 9), (900, 7, "active_allocated"))]     # a pool no capture of ours made
    pools = {(0, 1): "activations", (0, 2): "graph_pools"}
    assert pool_bytes_from_segments(segments, pools, counted=set()) == {"activations": 72, "graph_pools": 16}
    assert pool_bytes_from_segments(segments, pools, counted={196, 300}) == {"activations": 64}

    def act(name: str, pool):
        return SimpleNamespace(name=name, pool=pool)

    assert graph_pools([act("s0.F0", (0, 1)), act("s0.dI0", (0, 2)), act("s0.dW0", (0, 2)), act("s1.F1", (0, 3)),
                        act("opt", (0, 3)), act("s2.F0", object()), act("s2.F1", None)]) == {
        (0, 1): "activations", (0, 2): "graph_pools", (0, 3): "graph_pools"}


def test_native_ratio_uses_native_eager_of_the_same_report() -> None:
    def result(name: str, peak: int):
        s = split_peak(peak=peak, baseline=0, steady=peak, counted={"parameters": peak}, captured=True)
        return SimpleNamespace(name=name, memory_split=s)

    rs = [result("native-eager", 100), result("captured-direct", 173), SimpleNamespace(name="te", memory_split=None)]
    add_native_ratios(rs)
    assert rs[0].memory_split.ratio_to_native == 1.0 and rs[1].memory_split.ratio_to_native == pytest.approx(1.73)
    assert MemorySplit.model_validate_json(rs[1].memory_split.model_dump_json()) == rs[1].memory_split


# ------------------------------------------------------------------------------- object walking (CPU)
def test_a_cpu_pipeline_is_counted_by_category() -> None:
    cfg = load_config().with_overrides(**{"model.vocab_size": 256})
    pipe = build_single_process(cfg, native=False, device="cpu")
    counted, reserved = count_steady(pipe.ranks, pipe.manager)
    params = sum(p.numel() * p.element_size() for r in pipe.ranks for c in r.chunks.values() for p in c.parameters())
    assert counted["parameters"] == params and reserved == 0
    assert counted["gradients"] == sum(r.arena.nbytes for r in pipe.ranks)  # the arena's buffers, once
    native = build_single_process(cfg, native=True, device="cpu")
    assert transient_grad_bytes(native.ranks, native=True) == params
    assert transient_grad_bytes(pipe.ranks, native=False) == 0


def test_an_invalidated_fp8_cache_is_still_counted() -> None:
    """The buffers the optimizer casts FP8 weights into stay allocated while the cache is invalid (after a
    commit, before the next refresh): the split counts what is allocated, not what is valid."""
    cfg = load_config().with_overrides(**{"model.vocab_size": 256})
    pipe = build_single_process(cfg, native=False, device="cpu")
    lins = [lin for r in pipe.ranks for c in r.chunks.values() for lin in c.matrix_linears().values()]
    casts = [lin.weight_cast_target(f"w{i}") for i, lin in enumerate(lins)]
    for lin in lins:
        lin.invalidate_cache()
        assert not lin.cache_valid
    state = sum(t.untyped_storage().nbytes() for r in pipe.ranks for c in r.chunks.values()
                for t in c.fp8_state().values())
    cast = sum(t.untyped_storage().nbytes() for c in casts
               for t in (c.data, c.transpose, c.scale_inv, c.pending_amax) if t is not None)
    counted, _ = count_steady(pipe.ranks, pipe.manager)
    assert cast > 0 and counted["fp8"] == state + cast


# ------------------------------------------------------------------------------------------ memory cap
CAP_CFG = load_config().with_overrides(**{"train.device": "cuda", "train.memory_fraction": 0.3,
                                          "train.path": "captured-direct"})


def test_memory_fraction_is_validated() -> None:
    assert load_config().train.memory_fraction == 0.0
    for bad in (-0.1, 1.5):
        with pytest.raises(UserError, match="memory_fraction"):
            load_config().with_overrides(**{"train.device": "cuda", "train.memory_fraction": bad})
    with pytest.raises(UserError, match="memory_fraction \\(0.5\\) caps CUDA memory: it needs device = cuda"):
        load_config().with_overrides(**{"train.memory_fraction": 0.5})
    h = load_config("examples/configs/h4096-long.toml")
    assert 0 < h.train.memory_fraction < 1 and h.offload.mode == "off"
    assert h.model.seq_len * h.model.microbatch_size > 8 * 256  # activations, not parameters, dominate


def test_without_cuda_a_cap_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError, match="caps CUDA memory: it needs train.device = cuda and a CUDA device"):
        apply_memory_fraction(CAP_CFG)
    assert apply_memory_fraction(load_config()) is None  # no cap: nothing to set


def test_offload_slots_count_against_the_cap_in_force_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """`cap_bytes`: the cap this process applied (`train`), not a config's fraction that nobody applied (a
    benchmark or verification building the same config runs uncapped, its offload included)."""
    from types import SimpleNamespace

    from qeffect.runtime import memory_cap

    set_to: list[tuple[float, int]] = []
    monkeypatch.setattr(memory_cap, "_APPLIED", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: set_to.append((f, i)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=100 * 2**30))
    dev = torch.device("cuda", 0)
    assert memory_cap.cap_bytes(dev) is None  # CAP_CFG names 0.3, but no cap is in force
    assert apply_memory_fraction(CAP_CFG) == 0.3 and set_to == [(0.3, 0)]
    assert memory_cap.cap_bytes(dev) == int(0.3 * 100 * 2**30) == memory_cap.cap_bytes(torch.device("cuda"))
    assert memory_cap.cap_bytes(torch.device("cuda", 1)) is None and memory_cap.cap_bytes(torch.device("cpu")) is None


def test_out_of_memory_is_found_along_the_chain() -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    try:
        try:
            raise oom
        except torch.OutOfMemoryError:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")  # noqa: B904
    except RuntimeError as err:
        outer = err
    assert is_out_of_memory(outer) and is_out_of_memory(oom)
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


def test_a_capped_run_that_does_not_fit_stops_in_one_line() -> None:
    line = refusal(CAP_CFG, 100 * 1024**3)
    assert "\n" not in line
    assert line == ("train.memory_fraction = 0.3: the captured-direct run does not fit in 30.0 GiB of 100.0 GiB "
                    "(out of device memory); set offload.mode = release to lower the peak")
    released = CAP_CFG.with_overrides(**{"offload.mode": "release"})
    assert refusal(released, None).endswith("offload.mode = release does not lower the peak enough: raise the cap")
    with pytest.raises(UserError, match="^train.memory_fraction = 0.3: the captured-direct run does not fit"):
        with refuse_out_of_memory(CAP_CFG):
            raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(torch.OutOfMemoryError):  # no cap: the error passes unchanged
        with refuse_out_of_memory(load_config()):
            raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(ValueError, match="other"):  # not memory: unchanged
        with refuse_out_of_memory(CAP_CFG):
            raise ValueError("other")


def test_offload_slots_count_against_the_cap_with_torchs_reserved_bytes() -> None:
    """`CappedVmm`: a slot that would take torch's reserved bytes plus the live slots over the cap is refused
    as an out-of-memory error before any physical memory is made; torch's own limit follows the live slots."""
    from qeffect.offload.fake import FakeDevice
    from qeffect.runtime.memory_cap import CappedVmm

    dev = FakeDevice(0, granularity=2 * 1024**2)
    driver = dev.driver()
    made = []
    create = driver.create
    driver.create = lambda size: made.append(size) or create(size)
    limits: list[int] = []
    reserved = [10 * 2**20]
    vmm = CappedVmm(driver, 16 * 2**20, reserved=lambda: reserved[0], set_limit=limits.append)
    a = vmm.create(4 * 2**20)
    assert vmm.live_bytes == 4 * 2**20 and limits == [12 * 2**20]
    with pytest.raises(torch.OutOfMemoryError, match="offload slot") as err:
        vmm.create(4 * 2**20)  # 10 reserved + 4 live + 4 > 16
    assert is_out_of_memory(err.value) and made == [4 * 2**20] and vmm.live_bytes == 4 * 2**20
    reserved[0] = 6 * 2**20
    b = vmm.create(4 * 2**20)
    assert vmm.peak_bytes == 8 * 2**20 and limits[-1] == 8 * 2**20
    vmm.release(a)
    vmm.release(b)
    assert vmm.live_bytes == 0 and limits[-1] == 16 * 2**20
    assert vmm.granularity == driver.granularity  # everything else is the driver's


def test_an_offload_manager_over_the_cap_is_refused_in_one_line_and_records_its_mapped_peak() -> None:
    from qeffect.config import OffloadConfig
    from qeffect.offload.fake import FakeDevice
    from qeffect.offload.group import OffloadManager
    from qeffect.runtime.memory_cap import CappedVmm

    def manager(cap: int) -> OffloadManager:
        dev = FakeDevice(0, granularity=2 * 1024**2, progress=2)
        vmm = CappedVmm(dev.driver(), cap, reserved=lambda: 0, set_limit=lambda _: None)
        mgr = OffloadManager(OffloadConfig(mode="release", min_window=0), device="cpu", driver=vmm, streams=dev,
                             owns_driver=True)
        for k in range(3):
            mgr.group(f"G{k}").discover(torch.empty(1024, 1024))  # 4 MiB each
        return mgr

    mgr = manager(64 * 2**20)
    mgr.allocate()
    assert mgr.stats.peak_mapped_bytes == mgr.mapped_bytes() == 12 * 2**20
    mgr.close()
    with pytest.raises(UserError, match="^train.memory_fraction = 0.3: the captured-direct run does not fit"):
        with refuse_out_of_memory(CAP_CFG.with_overrides(**{"offload.mode": "release"})):
            manager(10 * 2**20).allocate()  # the third slot goes over
