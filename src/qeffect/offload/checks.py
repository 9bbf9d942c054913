"""`qeffect offload-check`: the offload machinery on a real GPU, one check per claim.

- address-stability: one slot remapped `remaps` times keeps its VA; every tensor view keeps
  data_ptr() == VA, and each new mapping is readable and writable.
- d2h-release-frees: D2H to pinned memory, then unmap + release; the driver's free memory
  (cuMemGetInfo) drops by at least the slot size at cuMemCreate/map and comes back at release; the
  host copy is bitwise the device bytes.
- h2d-replay: a graph captured over a slot, the slot offloaded and remapped (new pages), then H2D and
  replay: the replay reads the right bytes. Control: a replay before the H2D reads the wrong ones.
- pingpong-bitwise: a stack of `layers` (>= 3) captured forward and backward graphs (the backward
  captured with autograd over the forward, as captured stages do), sleeps at their heads to widen any
  race; resident ping-pong and release modes are bitwise equal to no offload over several steps, and
  banks were really reused.
- lookahead-overlap: release mode with the host synchronizing before each backward (a host that is
  not ahead of the device): with look-ahead each prefetched restore runs under the current backward
  graph (event timings), and the gaps between backward graphs are smaller than without look-ahead.
- negative-naive-reload (child process): offload by `del` + `torch.empty` reload; the replay reads the
  bytes of the tensor that took the freed address (foreign bytes), not the reloaded ones: detected.
- negative-unmapped-replay (child process): a replay over an unmapped slot is a hard fault (error
  700, the context dies); the child catches it and reports it.

Every manager here is built from one `OffloadConfig` (`check_config`): `OffloadConfig()` unless the caller
passes the run config's `[offload]` section, so the checks run the defaults `qeffect train` and
`qeffect verify-state` run; a check sets only its mode and the knob it compares (look-ahead on and off).

Every function here needs CUDA and cuda.bindings (`require_gpu`).

Run on the H200 (benchmarks/results/offload-check-h200.json); tests/test_offload_gpu.py runs the same
checks at small sizes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, Field

from qeffect.config import OffloadConfig
from qeffect.fp8.te_compat import cuda_sleep
from qeffect.offload.driver import OffloadUnavailable, VmmDriver, bindings_available
from qeffect.offload.group import OffloadManager, OffloadMode
from qeffect.offload.vmm import VmmSlot

MIB = 1 << 20
CHECKS: tuple[str, ...] = ("address-stability", "d2h-release-frees", "h2d-replay", "pingpong-bitwise",
                           "lookahead-overlap", "negative-naive-reload", "negative-unmapped-replay")
CHILDREN: tuple[str, ...] = ("naive-reload", "unmapped-replay")


class CheckResult(BaseModel):
    name: str
    passed: bool
    detail: str
    seconds: float = 0.0
    metrics: dict[str, Any] = Field(default_factory=dict)


class OffloadCheckReport(BaseModel):
    schema_version: int = 1
    kind: Literal["offload-check"] = "offload-check"
    checks: list[CheckResult]
    passed: bool
    device_name: str | None = None
    torch_version: str | None = None
    cuda_bindings_version: str | None = None
    granularity: int | None = None
    command: str | None = None
    git_revision: str | None = None
    offload_config: dict[str, Any] | None = None  # the `[offload]` section the managers were built from


def check_config(mode: OffloadMode, base: OffloadConfig | None = None, **knobs: Any) -> OffloadConfig:
    """The config a check's manager gets: `base` (the run config's `[offload]` section; default
    `OffloadConfig()`, the defaults of `qeffect train` and `verify-state`) in `mode`, with `knobs` (what the
    check compares) over it; validated like a config file."""
    data = (base or OffloadConfig()).model_dump() | {"mode": mode, **knobs}
    return OffloadConfig.model_validate(data)


def require_gpu() -> None:
    """Raise OffloadUnavailable (one line) unless CUDA and cuda.bindings are both here."""
    if not torch.cuda.is_available():
        raise OffloadUnavailable("qeffect offload-check needs a CUDA device; none is available")
    if not bindings_available():
        raise OffloadUnavailable("qeffect offload-check needs cuda.bindings (the cuda-bindings package, "
                                 "shipped with CUDA builds of PyTorch); it is not importable here")


def _capture(fn: Callable[[], Any], device: torch.device) -> torch.cuda.CUDAGraph:
    """Warm `fn` up on a side stream, then capture it (lazy library init must happen outside capture)."""
    cur = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        fn()
    cur.wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _result(name: str, t0: float, passed: bool, detail: str, **metrics: Any) -> CheckResult:
    return CheckResult(name=name, passed=bool(passed), detail=detail, seconds=round(time.perf_counter() - t0, 3),
                       metrics=metrics)


# ------------------------------------------------------------------------------------------ slots
def check_address_stability(driver: VmmDriver, remaps: int = 100, nbytes: int = 4 * MIB) -> CheckResult:
    t0 = time.perf_counter()
    with VmmSlot(driver, nbytes, name="stability") as slot:
        va, n = slot.va, slot.size // 4
        view = slot.tensor((n,), torch.int32)
        moved = wrong = 0
        for k in range(remaps):
            view.fill_(k)
            wrong += not bool((view == k).all())
            slot.remap()  # unmap (after a context synchronize), release, create, map, set access
            fresh = slot.tensor((n,), torch.int32)
            moved += slot.va != va or view.data_ptr() != va or fresh.data_ptr() != va
        view.fill_(remaps)
        wrong += not bool((view == remaps).all())
        maps = slot.maps
    passed = moved == 0 and wrong == 0 and maps == remaps + 1
    return _result("address-stability", t0, passed,
                   f"{remaps} remaps: VA {va:#x} moved {moved} times, {wrong} wrong reads of a fresh mapping",
                   va=hex(va), remaps=remaps, maps=maps, moved=moved, wrong_reads=wrong, slot_bytes=slot.size)


def check_d2h_release_frees(driver: VmmDriver, nbytes: int = 256 * MIB) -> CheckResult:
    t0 = time.perf_counter()
    dev = driver.torch_device
    stream, done = torch.cuda.Stream(dev), torch.cuda.Event()
    slot = VmmSlot(driver, nbytes, map_now=False, name="release")
    host = torch.empty(slot.size, dtype=torch.uint8, pin_memory=True)
    n = slot.size // 4
    try:
        # the kernel the check launches between its two readings, launched once first: under lazy module
        # loading its first launch loads a module into device memory, which read as 2 MiB not given back
        torch.arange(4, dtype=torch.int32, device=dev)
        torch.cuda.synchronize(dev)
        free_reserved = driver.mem_get_info()[0]
        slot.map()
        free_mapped = driver.mem_get_info()[0]
        view = slot.tensor((n,), torch.int32)
        torch.arange(n, dtype=torch.int32, device=dev, out=view)  # in place: no allocator traffic
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):
            host.copy_(slot.bytes(), non_blocking=True)
            done.record(stream)
        slot.unmap(wait=done.synchronize)  # the host waits for the D2H alone, then unmaps and releases
        free_released = driver.mem_get_info()[0]
        torch_free = torch.cuda.mem_get_info(dev)[0]
    finally:
        slot.close()
    host_ok = torch.equal(host.view(torch.int32), torch.arange(n, dtype=torch.int32))
    drop, back = free_reserved - free_mapped, free_released - free_mapped
    passed = drop >= slot.size and back >= slot.size and host_ok
    return _result("d2h-release-frees", t0, passed,
                   f"free memory -{drop / MIB:.0f} MiB at create/map, +{back / MIB:.0f} MiB at release "
                   f"(slot {slot.size / MIB:.0f} MiB); host copy {'bitwise equal' if host_ok else 'DIFFERS'}",
                   slot_bytes=slot.size, free_reserved=free_reserved, free_mapped=free_mapped,
                   free_released=free_released, torch_mem_get_info_free=torch_free, drop=drop, back=back,
                   host_bitwise=host_ok)


def check_h2d_replay(driver: VmmDriver, nbytes: int = 8 * MIB) -> CheckResult:
    t0 = time.perf_counter()
    dev = driver.torch_device
    cur, copy = torch.cuda.current_stream(dev), torch.cuda.Stream(dev)
    with VmmSlot(driver, nbytes, name="replay") as slot:
        n, va = slot.size // 4, slot.va
        view = slot.tensor((n,), torch.float32)
        a = torch.randn(n, device=dev, generator=torch.Generator(device=dev).manual_seed(0))
        expected = a * 2 + 1
        view.copy_(a)
        out = torch.empty(n, device=dev)
        graph = _capture(lambda: out.copy_(view * 2 + 1), dev)
        host = torch.empty(slot.size, dtype=torch.uint8, pin_memory=True)
        ev = torch.cuda.Event()
        copy.wait_stream(cur)
        with torch.cuda.stream(copy):
            host.copy_(slot.bytes(), non_blocking=True)
            ev.record(copy)
        slot.unmap(wait=ev.synchronize)
        slot.map()  # new physical pages at the same VA
        view.fill_(-7.0)  # what the graph reads if nothing restores the bytes
        graph.replay()
        control_detects = not torch.equal(out, expected)
        copy.wait_stream(cur)  # the H2D lands after the scribble
        with torch.cuda.stream(copy):
            slot.bytes().copy_(host, non_blocking=True)
            ev.record(copy)
        cur.wait_event(ev)
        graph.replay()
        restored = torch.equal(out, expected)
        same_va = slot.va == va and view.data_ptr() == va
    passed = restored and control_detects and same_va
    return _result("h2d-replay", t0, passed,
                   f"after remap + H2D the replay reads {'the right' if restored else 'WRONG'} bytes; "
                   f"without the H2D it reads {'wrong ones (control ok)' if control_detects else 'right ones?!'}",
                   restored_bitwise=restored, control_detects=control_detects, same_va=same_va, slot_bytes=slot.size)


# ---------------------------------------------------------------------------------- layer stack
class ToyStack:
    """`layers` captured layers h = x W1 + b1, a = gelu(h), t = tanh(a), y = t W2 + b2: a forward graph
    per layer (saved h and t go to the layer's offload group) and a backward graph per layer captured
    with autograd over it. `fwd_sleep`/`bwd_sleep` spin at the head of each graph (cycles)."""

    def __init__(self, manager: OffloadManager, layers: int, hidden: int, rows: int, *, seed: int = 0,
                 fwd_sleep: int = 0, bwd_sleep: int = 0) -> None:
        dev = manager.device
        self.manager, self.layers, self.device = manager, layers, dev
        gen = torch.Generator().manual_seed(seed)

        def param(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(dev).requires_grad_()

        self.params = [(param(hidden, hidden, scale=hidden ** -0.5), param(hidden, scale=0.1),
                        param(hidden, hidden, scale=hidden ** -0.5), param(hidden, scale=0.1)) for _ in range(layers)]
        self.x = [torch.zeros(rows, hidden, device=dev, requires_grad=True) for _ in range(layers)]
        self.gy = [torch.zeros(rows, hidden, device=dev) for _ in range(layers)]
        self.groups = [manager.group(f"layer{k}") for k in range(layers)]
        self.fwd_sleep, self.bwd_sleep = fwd_sleep, bwd_sleep
        cur = torch.cuda.current_stream(dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(cur)
        with torch.cuda.stream(side):  # eager warm-up = discovery (autograd unchanged)
            for k in range(layers):
                with self.groups[k].discovery_hooks():
                    y = self._body(k)
                torch.autograd.grad(y, self._inputs(k), self.gy[k])
        cur.wait_stream(side)
        torch.cuda.synchronize(dev)
        manager.allocate(list(reversed(self.groups)))
        self.F, self.y = [], []
        for k in range(layers):
            g = torch.cuda.CUDAGraph()
            with self.groups[k].capture_hooks(), torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):
                if fwd_sleep:
                    cuda_sleep(fwd_sleep)
                y = self._body(k)
            self.F.append(g)
            self.y.append(y)
        self.B, self.grads = [], []
        for k in range(layers):
            g = torch.cuda.CUDAGraph()
            with self.groups[k].mapped_for_capture(), torch.cuda.graph(g, pool=torch.cuda.graph_pool_handle()):
                if bwd_sleep:
                    cuda_sleep(bwd_sleep)
                grads = torch.autograd.grad(self.y[k], self._inputs(k), self.gy[k], retain_graph=True)
            self.B.append(g)
            self.grads.append(grads)
        torch.cuda.synchronize(dev)

    def _inputs(self, k: int) -> tuple[torch.Tensor, ...]:
        return (self.x[k], *self.params[k])

    def _body(self, k: int) -> torch.Tensor:
        w1, b1, w2, b2 = self.params[k]
        h = torch.addmm(b1, self.x[k], w1)
        t = torch.tanh(torch.nn.functional.gelu(h))
        return torch.addmm(b2, t, w2)

    def step(self, x0: torch.Tensor, gy_last: torch.Tensor, *, sync_before_backward: bool = False,
             timing: list | None = None) -> tuple[torch.Tensor, dict[int, list[torch.Tensor]]]:
        """One forward over all layers then one backward; returns the output and every gradient (clones).
        `timing`: appends (layer, start_event, end_event) around each backward replay."""
        cur = torch.cuda.current_stream(self.device)
        with torch.no_grad():
            self.x[0].copy_(x0)
        for k in range(self.layers):
            if k:
                with torch.no_grad():
                    self.x[k].copy_(self.y[k - 1])
            g = self.groups[k]
            g.before_forward()
            self.F[k].replay()
            g.after_forward()
        out = self.y[-1].detach().clone()
        with torch.no_grad():
            self.gy[-1].copy_(gy_last)
        grads: dict[int, list[torch.Tensor]] = {}
        for k in reversed(range(self.layers)):
            if sync_before_backward:  # the whole device: the D2H copies too (then the hooks find them done)
                torch.cuda.synchronize(self.device)
            g = self.groups[k]
            g.before_backward()
            if timing is not None:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(cur)
            self.B[k].replay()
            g.backward_launched()  # the manager's launch-first work, if it defers it to here
            if timing is not None:
                end.record(cur)
                timing.append((k, start, end))
            g.after_backward()
            grads[k] = [t.detach().clone() for t in self.grads[k]]
            if k:
                with torch.no_grad():
                    self.gy[k - 1].copy_(self.grads[k][0])
        return out, grads


def _stack_run(mode: OffloadMode, driver: VmmDriver, *, layers: int, hidden: int, rows: int, steps: int,
               fwd_sleep: int, bwd_sleep: int, config: OffloadConfig | None = None) -> tuple[list, dict]:
    dev = driver.torch_device
    mgr = OffloadManager(check_config(mode, config), device=dev, driver=driver if mode != "off" else None)
    try:
        stack = ToyStack(mgr, layers, hidden, rows, fwd_sleep=fwd_sleep, bwd_sleep=bwd_sleep)
        gen = torch.Generator(device=dev).manual_seed(1)
        results = []
        for _ in range(steps):
            x0 = torch.randn(rows, hidden, device=dev, generator=gen)
            gy = torch.randn(rows, hidden, device=dev, generator=gen)
            results.append(stack.step(x0, gy))
        torch.cuda.synchronize(dev)
        stats = {k: v for k, v in vars(mgr.stats).items() if k != "restores"}
        stats["mapped_bytes_after"] = mgr.mapped_bytes()
        stats["groups_bytes"] = [g.nbytes for g in mgr.groups]
        del stack
        return results, stats
    finally:
        mgr.close()


def _same(a: list, b: list) -> tuple[int, int]:
    """(tensors compared, tensors that differ) between two runs' per-step (output, grads)."""
    n = bad = 0
    for (oa, ga), (ob, gb) in zip(a, b, strict=True):
        pairs = [(oa, ob)] + [(x, y) for k in ga for x, y in zip(ga[k], gb[k], strict=True)]
        n += len(pairs)
        bad += sum(not torch.equal(x, y) for x, y in pairs)
    return n, bad


def check_pingpong_bitwise(driver: VmmDriver, *, layers: int = 4, hidden: int = 512, rows: int = 1024,
                           steps: int = 3, sleep: int = 200_000, config: OffloadConfig | None = None) -> CheckResult:
    t0 = time.perf_counter()
    if layers < 3:
        return _result("pingpong-bitwise", t0, False, f"needs >= 3 layers to reuse a bank, got {layers}")
    kw = dict(layers=layers, hidden=hidden, rows=rows, steps=steps, fwd_sleep=sleep, bwd_sleep=sleep, config=config)
    ref, _ = _stack_run("off", driver, **kw)
    metrics: dict[str, Any] = {"layers": layers, "steps": steps}
    ok = True
    details = []
    for mode in ("resident", "release"):
        got, stats = _stack_run(mode, driver, **kw)
        n, bad = _same(ref, got)
        reused = stats["evictions"] > 0 and stats["h2d_copies"] > 0 if mode == "resident" else stats["h2d_copies"] > 0
        ok &= bad == 0 and reused
        metrics[mode] = {"tensors": n, "differ": bad, **stats}
        details.append(f"{mode}: {bad}/{n} tensors differ, {stats['h2d_copies']} restores, "
                       f"{stats['evictions']} evictions")
    return _result("pingpong-bitwise", t0, ok, "; ".join(details) + " (vs no offload)", **metrics)


def check_lookahead_overlap(driver: VmmDriver, *, layers: int = 4, hidden: int = 1024, rows: int = 4096,
                            sleep: int = 2_000_000, steps: int = 2, config: OffloadConfig | None = None) -> CheckResult:
    """Release mode, host synchronized before every backward; compare look-ahead one group deep and off."""
    t0 = time.perf_counter()
    dev = driver.torch_device
    runs: dict[str, dict[str, Any]] = {}
    for lookahead in (True, False):
        mgr = OffloadManager(check_config("release", config, lookahead=int(lookahead)), device=dev, driver=driver,
                             timing=True)
        try:
            stack = ToyStack(mgr, layers, hidden, rows, bwd_sleep=sleep)
            gen = torch.Generator(device=dev).manual_seed(2)
            for _ in range(steps):  # the last step is the one measured
                x0 = torch.randn(rows, hidden, device=dev, generator=gen)
                gy = torch.randn(rows, hidden, device=dev, generator=gen)
                mgr.stats.restores.clear()
                origin = torch.cuda.Event(enable_timing=True)
                origin.record(torch.cuda.current_stream(dev))
                timing: list = []
                stack.step(x0, gy, sync_before_backward=True, timing=timing)
            torch.cuda.synchronize(dev)
            bwd = {f"layer{k}": (origin.elapsed_time(a), origin.elapsed_time(b)) for k, a, b in timing}
            restores = [(r.group, r.prefetched_under, origin.elapsed_time(r.start), origin.elapsed_time(r.end))
                        for r in mgr.stats.restores]
            order = [f"layer{k}" for k, _, _ in timing]
            gaps = [bwd[b][0] - bwd[a][1] for a, b in zip(order, order[1:], strict=False)]
            overlaps = []
            for group, under, rs, re in restores:
                if under is not None:
                    bs, be = bwd[under]
                    overlaps.append({"restore": group, "under": under, "restore_ms": round(re - rs, 4),
                                     "overlap_ms": round(max(0.0, min(be, re) - max(bs, rs)), 4)})
            runs["lookahead" if lookahead else "serial"] = {
                "restores": len(restores), "prefetched": len(overlaps), "overlaps": overlaps,
                "gaps_ms": [round(g, 4) for g in gaps], "gap_total_ms": round(sum(gaps), 4)}
            del stack
        finally:
            mgr.close()
    la, serial = runs["lookahead"], runs["serial"]
    hidden_ok = la["prefetched"] == layers - 1 and all(o["overlap_ms"] >= 0.5 * o["restore_ms"] > 0
                                                       for o in la["overlaps"])
    faster = la["gap_total_ms"] < serial["gap_total_ms"]
    return _result("lookahead-overlap", t0, hidden_ok and faster and serial["prefetched"] == 0,
                   f"{la['prefetched']} prefetched restores, each >= 50% under the running backward: {hidden_ok}; "
                   f"gaps between backward graphs {la['gap_total_ms']:.3f} ms with look-ahead vs "
                   f"{serial['gap_total_ms']:.3f} ms without", **runs)


# ------------------------------------------------------------------------------ negative (child)
def _child_naive_reload(device: torch.device) -> dict[str, Any]:
    """Offload the way the Megatron PR calls naive: D2H, free, later torch.empty + H2D."""
    n = 1 << 20
    src = torch.randn(n, device=device, generator=torch.Generator(device=device).manual_seed(3))
    box = [src.clone()]  # the "activation" the graph reads; only `box` holds it
    out = torch.empty(n, device=device)
    graph = _capture(lambda: out.copy_(box[0] * 2 + 1), device)
    expected = src * 2 + 1
    captured_ptr = box[0].data_ptr()
    host = torch.empty(n, dtype=torch.float32, pin_memory=True)
    host.copy_(box[0])
    torch.cuda.synchronize(device)
    box.clear()  # offload: the storage goes back to the caching allocator
    interloper = torch.full((n,), 12345.0, device=device)  # the next allocation of that size takes it
    reloaded = torch.empty(n, device=device)  # naive reload: wherever the allocator says
    reloaded.copy_(host)
    graph.replay()
    torch.cuda.synchronize(device)
    right = torch.equal(out, expected)
    foreign = torch.equal(out, interloper * 2 + 1)
    return {"captured_ptr": hex(captured_ptr), "reloaded_ptr": hex(reloaded.data_ptr()),
            "interloper_at_captured_address": interloper.data_ptr() == captured_ptr,
            "reloaded_at_captured_address": reloaded.data_ptr() == captured_ptr,
            "replay_reads_right_bytes": right, "replay_reads_foreign_bytes": foreign}


def _child_unmapped_replay(device: torch.device, json_path: Path) -> dict[str, Any]:
    """A replay over an unmapped slot: expected to kill the context. Reports progress before the fault."""
    driver = VmmDriver(device.index or 0)
    slot = VmmSlot(driver, 2 * MIB, name="unmapped")
    view = slot.tensor((slot.size // 4,), torch.float32)
    view.fill_(1.0)
    out = torch.empty_like(view)
    graph = _capture(lambda: out.copy_(view * 2 + 1), device)
    graph.replay()
    torch.cuda.synchronize(device)
    state: dict[str, Any] = {"mapped_replay_ok": bool((out == 3).all()), "unmapped": False, "fault": None}
    slot.unmap()
    state["unmapped"] = True
    json_path.write_text(json.dumps(state))  # in case the fault takes the process down
    try:
        graph.replay()
        torch.cuda.synchronize(device)
    except Exception as err:  # noqa: BLE001  (torch raises RuntimeError / torch.AcceleratorError)
        state["fault"] = f"{type(err).__name__}: {err}".splitlines()[0]
    return state


def _run_child(which: str, device: torch.device, tmp: Path) -> tuple[dict[str, Any] | None, int, str]:
    """Run `main` in a child process (a fresh interpreter that imports this qeffect first)."""
    json_path = tmp / f"{which}.json"
    src = str(Path(__file__).resolve().parents[2])
    argv = ["--child", which, "--device", str(device), "--json", str(json_path)]
    code = f"import sys; sys.path.insert(0, {src!r}); from qeffect.offload.checks import main; sys.exit(main({argv!r}))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    data = json.loads(json_path.read_text()) if json_path.exists() else None
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
    return data, proc.returncode, tail[0]


def check_negative_naive_reload(device: torch.device, tmp: Path) -> CheckResult:
    t0 = time.perf_counter()
    data, rc, tail = _run_child("naive-reload", device, tmp)
    if data is None or rc != 0:
        return _result("negative-naive-reload", t0, False, f"child exited {rc} without a result: {tail}", rc=rc)
    detected = not data["replay_reads_right_bytes"] and not data["reloaded_at_captured_address"]
    what = "foreign bytes (the tensor that took the freed address)" if data["replay_reads_foreign_bytes"] \
        else "bytes that are not the reloaded activation"
    return _result("negative-naive-reload", t0, detected,
                   f"naive torch.empty reload at {data['reloaded_ptr']} (graph reads {data['captured_ptr']}): replay "
                   + (f"read {what}: detected" if detected else "read the right bytes: NOT detected"), **data)


def check_negative_unmapped_replay(device: torch.device, tmp: Path) -> CheckResult:
    t0 = time.perf_counter()
    data, rc, tail = _run_child("unmapped-replay", device, tmp)
    if data is None or not data.get("unmapped"):
        return _result("negative-unmapped-replay", t0, False, f"child exited {rc} before unmapping: {tail}", rc=rc)
    fault = data.get("fault") or (tail if rc != 0 else None)
    passed = bool(fault) and data.get("mapped_replay_ok", False)
    return _result("negative-unmapped-replay", t0, passed,
                   f"replay over the unmapped slot: {'hard fault caught in the child: ' + fault if fault else 'NO fault'}",
                   rc=rc, **data)


# --------------------------------------------------------------------------------------- suite
def run_offload_checks(*, device: str | torch.device = "cuda", remaps: int = 100, layers: int = 4,
                       release_mib: int = 256, hidden: int = 1024, rows: int = 4096, children: bool = True,
                       only: list[str] | None = None, command: str | None = None,
                       progress: Callable[[str], None] | None = None,
                       config: OffloadConfig | None = None) -> OffloadCheckReport:
    """Run the checks (all, or `only`) on one device; a check that raises is reported as failed. The
    managers' knobs come from `config` (a run config's `[offload]` section; default `OffloadConfig()`),
    each check setting its mode (`check_config`)."""
    config = config or OffloadConfig()
    require_gpu()
    dev = torch.device(device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(dev)
    names = list(only) if only else list(CHECKS)
    unknown = sorted(set(names) - set(CHECKS))
    if unknown:
        raise ValueError(f"unknown offload checks {unknown}; known: {list(CHECKS)}")
    if not children:
        names = [n for n in names if not n.startswith("negative-")]
    driver = VmmDriver(dev.index)
    results: list[CheckResult] = []
    with tempfile.TemporaryDirectory(prefix="qeffect-offload-") as tmpdir:
        tmp = Path(tmpdir)
        runs: dict[str, Callable[[], CheckResult]] = {
            "address-stability": lambda: check_address_stability(driver, remaps),
            "d2h-release-frees": lambda: check_d2h_release_frees(driver, release_mib * MIB),
            "h2d-replay": lambda: check_h2d_replay(driver),
            "pingpong-bitwise": lambda: check_pingpong_bitwise(driver, layers=layers, hidden=max(64, hidden // 2),
                                                               rows=max(64, rows // 4), config=config),
            "lookahead-overlap": lambda: check_lookahead_overlap(driver, layers=layers, hidden=hidden, rows=rows,
                                                                 config=config),
            "negative-naive-reload": lambda: check_negative_naive_reload(dev, tmp),
            "negative-unmapped-replay": lambda: check_negative_unmapped_replay(dev, tmp),
        }
        for name in names:
            if progress:
                progress(name)
            t0 = time.perf_counter()
            try:
                results.append(runs[name]())
            except Exception as err:  # noqa: BLE001  (a crashed check is a failed check, with its reason)
                results.append(_result(name, t0, False, f"raised {type(err).__name__}: {err}".splitlines()[0]))
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()
    granularity = driver.granularity
    driver.close()
    from qeffect.graphs.handshake import git_revision

    return OffloadCheckReport(checks=results, passed=all(r.passed for r in results) and bool(results),
                              device_name=torch.cuda.get_device_name(dev), torch_version=torch.__version__,
                              cuda_bindings_version=_bindings_version(), granularity=granularity,
                              command=command, git_revision=git_revision(), offload_config=config.model_dump())


def _bindings_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("cuda-bindings")
    except Exception:  # noqa: BLE001
        return None


def main(argv: list[str] | None = None) -> int:
    """Child-process entry: `python -m qeffect.offload.checks --child NAME --json PATH`."""
    ap = argparse.ArgumentParser(prog="python -m qeffect.offload.checks", description="offload-check child process")
    ap.add_argument("--child", choices=CHILDREN, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        require_gpu()
    except OffloadUnavailable as err:
        print(f"qeffect.offload.checks: {err}", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.set_device(dev)
    if args.child == "naive-reload":
        args.json.write_text(json.dumps(_child_naive_reload(dev)))
        return 0
    state = _child_unmapped_replay(dev, args.json)
    args.json.write_text(json.dumps(state))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the context is dead after the fault: skip every CUDA destructor


if __name__ == "__main__":
    raise SystemExit(main())
