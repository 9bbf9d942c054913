"""VMM activation offload on a real GPU: the `qeffect offload-check` checks at small sizes.

Needs CUDA and cuda.bindings (cuda-bindings ships with CUDA builds of PyTorch); skipped otherwise.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from qeffect.offload.driver import CudaDriverError, VmmDriver, bindings_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(not bindings_available(), reason="needs cuda.bindings (cuda-bindings)")]

MIB = 1 << 20


@pytest.fixture(scope="module")
def driver():
    d = VmmDriver(torch.cuda.current_device())
    yield d
    torch.cuda.synchronize()
    d.close()


def _passed(result) -> None:
    assert result.passed, result.model_dump_json(indent=2)


def test_granularity_is_a_power_of_two_and_rounding_uses_it(driver) -> None:
    g = driver.granularity
    assert g >= 4096 and g & (g - 1) == 0
    assert driver.round_up(1) == g and driver.round_up(g + 1) == 2 * g


def test_wrap_pointer_of_a_cuda_tensor(driver) -> None:
    from qeffect.offload.vmm import wrap_pointer

    base = torch.arange(1024, dtype=torch.float32, device=driver.torch_device)
    t = wrap_pointer(base.data_ptr(), base.numel() * 4, base.device, torch.float32, (32, 32))
    assert t.data_ptr() == base.data_ptr() and t.is_cuda
    assert torch.equal(t.flatten(), base)


def test_address_stability_over_100_remaps(driver) -> None:
    from qeffect.offload.checks import check_address_stability

    _passed(check_address_stability(driver, remaps=100, nbytes=4 * MIB))


def test_d2h_then_release_returns_driver_free_memory(driver) -> None:
    from qeffect.offload.checks import check_d2h_release_frees

    _passed(check_d2h_release_frees(driver, nbytes=64 * MIB))


def test_h2d_then_replay_reads_the_right_bytes(driver) -> None:
    from qeffect.offload.checks import check_h2d_replay

    _passed(check_h2d_replay(driver, nbytes=4 * MIB))


@pytest.mark.parametrize("layers", [3, 4])
def test_pingpong_and_release_bitwise_equal_to_no_offload(driver, layers: int) -> None:
    from qeffect.offload.checks import check_pingpong_bitwise

    _passed(check_pingpong_bitwise(driver, layers=layers, hidden=256, rows=512, steps=3))


def test_lookahead_restores_overlap_the_running_backward(driver) -> None:
    from qeffect.offload.checks import check_lookahead_overlap

    _passed(check_lookahead_overlap(driver, layers=4, hidden=512, rows=4096, sleep=2_000_000))


def test_naive_reload_is_detected_in_a_child(tmp_path: Path) -> None:
    from qeffect.offload.checks import check_negative_naive_reload

    _passed(check_negative_naive_reload(torch.device("cuda", torch.cuda.current_device()), tmp_path))


def test_replay_over_an_unmapped_slot_faults_in_a_child(tmp_path: Path) -> None:
    from qeffect.offload.checks import check_negative_unmapped_replay

    _passed(check_negative_unmapped_replay(torch.device("cuda", torch.cuda.current_device()), tmp_path))


def test_slot_works_from_a_thread_without_a_context(driver) -> None:
    from qeffect.offload.vmm import VmmSlot

    out: dict[str, object] = {}

    def worker() -> None:
        try:
            slot = VmmSlot(driver, 1, name="thread")
            slot.remap()
            out["slot"] = slot
        except BaseException as err:  # noqa: BLE001
            out["error"] = err

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert "error" not in out, out
    slot = out["slot"]
    view = slot.tensor((slot.size // 4,), torch.int32)
    view.fill_(5)
    assert view.data_ptr() == slot.va and bool((view == 5).all())
    slot.close()


def test_a_failing_driver_call_names_itself(driver) -> None:
    # cuMemCreate documents CUDA_ERROR_INVALID_VALUE for a size that is not a multiple of the granularity
    # (cuMemUnmap of a reserved, never-mapped range was tried first: this driver accepts it silently).
    with pytest.raises(CudaDriverError) as exc:
        driver.call("cuMemCreate", driver.granularity + 1, driver.allocation_prop(), 0)
    assert exc.value.call == "cuMemCreate" and exc.value.code != 0
    assert str(exc.value).startswith("cuMemCreate failed: CUDA_ERROR_")


def test_cli_offload_check_json(tmp_path: Path, capsys) -> None:
    from qeffect.cli.app import main

    out = tmp_path / "offload.json"
    with pytest.raises(SystemExit) as exc:
        main(["offload-check", "--only", "address-stability", "--only", "h2d-replay", "--remaps", "10",
              "--json", str(out)])
    assert exc.value.code == 0, capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["passed"] and [c["name"] for c in report["checks"]] == ["address-stability", "h2d-replay"]
    assert report["granularity"] and report["cuda_bindings_version"]


@pytest.mark.parametrize("mode", ["release+pm", "release/la0+pm", "resident", "release+first+pm", "resident+first",
                                  "release+first+shared+pm", "release+first+shared+strict+pm", "release+first",
                                  "release+first+strict", "release/la0"])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_captured_pipeline_with_offload_equals_native_eager(mode: str, schedule: str) -> None:
    """The captured stage actions with their saved activations in VMM groups: 0 mismatches vs native eager.
    `release/la0`: release restoring each group only at its own backward (the default depth is 1).
    `+first`: `offload.launch_first` (reaps and look-ahead restores after the replay's launch; the default),
    the others false. `+shared`: `offload.share_slots = "any"` (groups whose backwards follow one another
    share a slot: fewer unmaps and maps; the default), the others "off". `+strict`:
    `offload.release_at_backward` (a backward before any hook saw its D2H done waits, releases and restores;
    else it reads the bytes in place, `kept_at_backward`, the default). `+pm`: release with a chain and a
    group per microbatch (`offload.release_chains = "microbatch"`); without, release's chains are bounded by
    the schedule's liveness (the default: a group per chain, holding each of its microbatches in turn), here
    with `pipeline.wgrad_staging_by_liveness` so that the direct dW graphs do not split the chains again."""
    from qeffect.config import load_config
    from qeffect.verify.state import run_verify_state

    mode, pm, _ = mode.partition("+pm")
    mode, strict, _ = mode.partition("+strict")
    mode, shared, _ = mode.partition("+shared")
    mode, first, _ = mode.partition("+first")
    mode, _, depth = mode.partition("/la")
    cfg = load_config(None).with_overrides(**{"train.device": "cuda", "offload.mode": mode,
                                              "pipeline.schedule": schedule,
                                              "offload.release_at_backward": bool(strict),
                                              "offload.share_slots": "any" if shared else "off",
                                              "offload.launch_first": bool(first),
                                              "offload.lookahead": int(depth) if depth else None,
                                              "offload.release_chains": "microbatch" if pm else "liveness",
                                              "pipeline.wgrad_staging_by_liveness": mode == "release" and not pm})
    report = run_verify_state(cfg, steps=3, path="captured-direct")
    assert report.passed, report.first_divergence
    o = report.graphs["offload"]  # the offload really ran: every offloaded group copied out every step
    assert o["mode"] == mode and o["group_bytes"] > 0, o
    # the look-ahead depth reached the manager (default 1), and the launch-first switch
    assert o["lookahead"] == (int(depth) if depth else 1) and o["launch_first"] == bool(first), o
    assert o["release_at_backward"] == bool(strict), o
    if mode == "release" and not pm:  # a group per chain (fewer than forwards), no slot shared
        assert o["groups"] < 16 and o["shared_slots"] == [] and o["not_offloaded"], o
        assert o["d2h_copies"] > 0 and o["h2d_copies"] + o["kept_at_backward"] == o["d2h_copies"], o
        assert o["kept_at_backward"] == 0 or not strict, o
        return
    assert o["groups"] == 16, o  # one per microbatch (resident: each copied out or kept in its bank)
    if mode == "release":  # every release group is offloaded, so a look-ahead always has one to restore
        assert (o["prefetches"] > 0) is (o["lookahead"] > 0), o
    # both modes: the groups whose window is short are not offloaded (offload.min_window, default 12:
    # the last two virtual stages' in Interleaved, six in ZB-V), as the schedule's plan names them
    events, short, runs = offload_plan(cfg)
    n = len({g for _, g in events}) - len(short)  # the offloaded groups
    assert o["not_offloaded"] and sorted(o["not_offloaded"]) == sorted(f"s{s}.m{m}" for s, m in short), o
    if mode == "resident":  # the searched plan (the default); the groups it keeps in their bank get no D2H
        assert o["bank_plan_kind"] == "search", o
        assert not set(o["kept"]) & set(o["not_offloaded"]), o
        assert o["d2h_copies"] + o["d2h_skipped"] == 3 * n and o["h2d_copies"] > 0, o
        assert o["d2h_skipped"] == 3 * len(o["kept"]) and o["d2h_copies"] > 0, o
    if mode == "release":  # each group comes back once a step, or (not strict) its backward read it in place
        assert o["h2d_copies"] + o["kept_at_backward"] == 3 * n and o["h2d_copies"] > 0, o
        assert o["kept_at_backward"] == 0 or not strict, o
    if mode == "release" and not shared:
        assert o["d2h_copies"] == 3 * n and o["unmaps"] >= o["h2d_copies"] and o["slots"] == n, o
    if shared:  # runs of two groups share a slot (four actions between a run's last forward and its first
        # backward: offload.share_gap's default), the plan's runs; each group goes out once a step
        assert runs and o["shared_slots"] == [[f"s{s}.m{m}" for s, m in run] for run in runs], o
        assert o["slots"] == n - len(runs) and o["d2h_copies"] == 3 * n, o
        assert o["unmaps"] < 3 * n and (3 * o["slots"] <= o["unmaps"] or not strict), o


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_captured_pipeline_with_slots_mapped_at_forward_equals_native_eager(schedule: str) -> None:
    """`offload.map_slots = "forward"`: each slot mapped only while a capture uses it (Triton checks the
    pointers of kernels launched under a capture), then at each forward; every group offloaded, slots
    released while their copy-out is pending and after their backward. 0 mismatches vs native eager."""
    from qeffect.config import load_config
    from qeffect.verify.state import run_verify_state

    cfg = load_config(None).with_overrides(**{"train.device": "cuda", "offload.mode": "release",
                                              "pipeline.schedule": schedule, "offload.map_slots": "forward",
                                              "offload.min_window": 0, "offload.max_pending_copies": 1,
                                              "offload.reap": True, "pipeline.wgrad_staging_by_liveness": True})
    report = run_verify_state(cfg, steps=3, path="captured-direct")
    assert report.passed, report.first_divergence
    o = report.graphs["offload"]
    assert o["not_offloaded"] == [] and o["groups"] < 16 and o["d2h_copies"] > 0, o
    assert o["maps"] >= o["groups"] and o["unmaps"] > 0, o  # the build left every slot unmapped


def offload_plan(cfg) -> tuple[list, set, list]:  # noqa: ANN001 - a qeffect Config
    """The schedule's offload events of `cfg` ((kind, (stage, microbatch)), one per action), the groups its
    window leaves on the device, and the runs of the others that share a slot by default."""
    from qeffect.offload.plan import shared_slots, short_window_groups
    from qeffect.offload.planning import named_events
    from qeffect.runtime.build import schedule_of
    from qeffect.schedule import global_order

    events = named_events(global_order(schedule_of(cfg)))
    short = short_window_groups(events, cfg.offload.min_window)
    offloaded = [g for g in dict.fromkeys(g for _, g in events) if g not in short]
    return events, short, shared_slots(events, offloaded, cfg.offload.slot_members, min_gap=cfg.offload.share_gap)


@pytest.mark.parametrize("mode", ["off", "release", "resident"])
def test_a_torn_down_offloaded_pipeline_leaves_no_cuda_memory(mode: str) -> None:
    """An offloaded pipeline once left ~2.3 GiB (h2048) allocated after teardown: the offload pack hooks
    made reference cycles through autograd that kept every warm-up graph and its parameters alive."""
    import gc

    from qeffect.config import load_config
    from qeffect.runtime.build import build_single_process
    from qeffect.verify.state import synthetic_batches

    dev = torch.device("cuda", torch.cuda.current_device())
    # h2048: parameters of ~1.3 GB, so a leak of the graphs stands far above the 32 MiB cuBLAS workspace
    cfg = load_config("examples/configs/h2048.toml").with_overrides(**{"train.device": "cuda", "offload.mode": mode})
    gc.collect()
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    pipe = build_single_process(cfg, native=False, device=dev, path="captured-direct")
    params = sum(p.numel() * p.element_size() for r in pipe.ranks for c in r.chunks.values() for p in c.parameters())
    pipe.step(synthetic_batches(cfg, 0, dev))
    torch.cuda.synchronize(dev)
    mgr = pipe.offload
    del pipe
    if mgr is not None:
        mgr.close()
    del mgr
    gc.collect()
    torch.cuda.synchronize(dev)
    left = torch.cuda.memory_allocated(dev) - before
    assert left < 256 * MIB, f"{mode}: {left} bytes still allocated after teardown (parameters: {params})"
