"""Issue 7: captured training without offload vs `release` vs `resident`, in one process, on one GPU.

    source .gpu-kit/setup.sh
    QEFFECT_GIT_REVISION=<rev> python3 benchmarks/offload_bench.py --config examples/configs/h2048.toml \
        --steps 20 --out $OUT/offload-bench-h2048-h200.json

For each mode (same seed, same synthetic data): build the captured pipeline, run `warmup` untimed and
`steps` timed steps (device synchronized around each), and keep every step's loss and, at the end,
every parameter, optimizer state and FP8 state tensor. Then:

- bitwise: every mode against `off` (losses of all steps, every final tensor), `torch.equal`;
- time: median step and its ratio to `off` (targets: resident <= 1.03, release <= 1.10);
- memory: peak allocated (torch) and peak driver-level used memory (`cuMemGetInfo`, sampled after every
  action of one extra, untimed step), the bytes mapped by the offload slots;
- release: the driver-level free memory just before and just after every unmap of a group's slot
  between its forward and its backward in that extra step; returned = sum of those increases / sum of
  the groups' slot sizes (target >= 0.9). Groups release mode does not offload (their window is shorter
  than `train.offload_min_window` actions) have no slot: `returned_fraction_all_groups` counts their
  bytes as not returned. An unmap made by the group's own backward (its D2H was not
  found done before) returns memory only until the restore right after it: `returned_fraction` leaves
  those out, `returned_fraction_incl_backward` counts them. The counters over all steps (timed ones
  included) say how often each happened: `released_live`, `released_at_backward`. The measured step
  samples memory after every action, which slows the host, so it may find more copies done in time.

`--modes` takes `resident` for resident offload with the searched bank plan (the default,
`train.offload_bank_plan = "search"`; `resident@K`: within the colouring's memory with K banks,
`train.offload_search_banks`), `resident-colour` (also `resident-colour@K`) for the greedy colouring with at
least K banks (`train.offload_bank_plan = "colour"`, `train.offload_banks`; the A/B),
`release-keep` for release offload that keeps consumed slots mapped (`train.offload_reap = false`, the
default), `release-reap` for release offload that also releases them after their backward
(`train.offload_reap = true`; the A/B) and
`resident-copyall` (also `resident-copyall@K`) for resident offload that copies every group to the host,
even those the plan keeps in their bank (`train.offload_skip_kept_d2h = false`; the A/B of the skip), and
`release-all` and `resident-all` (also `resident-all@K`) for offload of every group, short windows
included (`train.offload_min_window = 0`; the A/B of not offloading them); `VARIANTS` lists them. Any mode
takes a `/laN` suffix (`release/la2`, `resident@6/la3`): `train.offload_lookahead = N`, the offloaded
groups each backward restores ahead (0: none; the A/B).
A `+VAR=VALUE` suffix (repeatable) sets an environment switch while that mode is built and timed
(`resident+QEFFECT_SKIP_FUTILE_RESTORES=0`: look-ahead restores a forward evicts before their backward are
started anyway). A `#N` suffix repeats a mode under its own name (`off#2` at the end: did the step time drift while the
modes ran? `release#2`: how far apart are two runs of one configuration?).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from qeffect.checkpoint.state import local_view, tensor_state
from qeffect.config import load_config
from qeffect.graphs.handshake import git_revision, qeffect_environment
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import synthetic_batches


def _final_state(pipe) -> dict[str, torch.Tensor]:
    """Parameters, optimizer and FP8 state by checkpoint key, copied off the device."""
    return {k: v.detach().cpu().clone() for k, v in tensor_state(local_view(pipe)).items()}


def run_mode(cfg, label: str, path: str, steps: int, warmup: int, dev: torch.device) -> dict:
    """One mode; `+VAR=VALUE` parts of the label set environment switches for it alone."""
    name, *switches = label.split("+")
    env = dict(s.split("=", 1) for s in switches)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        res, losses, final = run_one(cfg, name, path, steps, warmup, dev)
        res.update(mode=label, environment=env)
        return res, losses, final
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# a mode name -> (train.offload, the config overrides it stands for)
VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "release-keep": ("release", {"train.offload_reap": False}),  # consumed slots stay mapped (the default)
    "release-reap": ("release", {"train.offload_reap": True}),  # consumed slots released after their backward
    "release-all": ("release", {"train.offload_min_window": 0}),  # every group offloaded, short windows too
    "resident-all": ("resident", {"train.offload_min_window": 0}),
    "resident-copyall": ("resident", {"train.offload_skip_kept_d2h": False}),  # every group copied out
    "resident-colour": ("resident", {"train.offload_bank_plan": "colour"}),  # the greedy colouring
}


def run_one(cfg, label: str, path: str, steps: int, warmup: int, dev: torch.device) -> dict:
    base, _, depth = label.partition("#")[0].partition("/la")  # "#N": a repeat; "/laN": train.offload_lookahead = N
    name, _, banks = base.partition("@")
    mode, overrides = VARIANTS.get(name, (name, {}))
    # @K: the search's memory budget (resident with the searched plan), else the colouring's bank count
    searched = mode == "resident" and overrides.get("train.offload_bank_plan") != "colour"
    cfg = cfg.with_overrides(**{"train.offload": mode, **overrides,
                                "train.offload_banks": int(banks) if banks and not searched else None,
                                "train.offload_search_banks": int(banks) if banks and searched else None,
                                "train.offload_lookahead": int(depth) if depth else None})
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    baseline = torch.cuda.memory_allocated(dev)  # what earlier modes left behind (should be ~0)
    t0 = time.perf_counter()
    pipe = build_single_process(cfg, native=False, device=dev, path=path)
    torch.cuda.synchronize(dev)
    setup = time.perf_counter() - t0
    losses, times, host_times = [], [], []
    drv = pipe.offload.driver if pipe.offload is not None else None
    calls0: tuple[Counter, Counter] = (Counter(), Counter())  # the driver's counters when the timed steps begin
    wait0 = 0.0  # the offload manager's host wait when the timed steps begin
    for i in range(warmup + steps):
        if i == warmup and drv is not None:
            calls0 = (drv.call_counts.copy(), drv.call_seconds.copy())
            wait0 = pipe.offload.stats.host_wait_seconds
        batches = synthetic_batches(cfg, i, dev)
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        loss = pipe.step(batches)
        pipe.manager.mark_step()
        t_host = time.perf_counter()  # the host has queued the step (what it waited for inside included)
        torch.cuda.synchronize(dev)
        if i >= warmup:
            times.append(time.perf_counter() - t)
            host_times.append(t_host - t)
        losses.append(loss.detach().float().cpu().reshape(1))
    driver_calls = None
    if drv is not None:  # per timed step: how many of each driver call, and the host time they took
        driver_calls = {c: {"per_step": (n - calls0[0][c]) / steps,
                            "host_ms_per_step": 1e3 * (drv.call_seconds[c] - calls0[1][c]) / steps}
                        for c, n in sorted(drv.call_counts.items()) if n > calls0[0][c]}
    peak_alloc = torch.cuda.max_memory_allocated(dev)
    final = _final_state(pipe)
    # One extra, untimed step: driver-level memory after every action; release: around every unmap.
    free_samples: list[int] = []
    returned: list[tuple[str, int, int, bool]] = []  # group, slot size, driver free increase, by its backward
    mgr = pipe.offload
    if mgr is not None and mode == "release":
        in_backward: set[str] = set()
        for g in mgr.groups:
            if g.slot is None:
                continue
            orig_unmap, orig_bwd = g.slot.unmap, g.before_backward

            def unmap(*a, g=g, orig=orig_unmap, **kw) -> None:
                if not g.live:  # a consumed group's reap: not the forward-to-backward release
                    return orig(*a, **kw)
                before = torch.cuda.mem_get_info(dev)[0]
                orig(*a, **kw)
                returned.append((g.name, g.slot.size, torch.cuda.mem_get_info(dev)[0] - before,
                                 g.name in in_backward))

            def before_backward(g=g, orig=orig_bwd) -> None:
                in_backward.add(g.name)
                try:
                    orig()
                finally:
                    in_backward.discard(g.name)
            g.slot.unmap, g.before_backward = unmap, before_backward
    pipe.step(synthetic_batches(cfg, warmup + steps, dev),
              observer=lambda a, r: free_samples.append(torch.cuda.mem_get_info(dev)[0]))
    torch.cuda.synchronize(dev)
    total = torch.cuda.mem_get_info(dev)[1]
    res = {
        "mode": label, "offload_banks": cfg.train.offload_banks,
        "offload_skip_kept_d2h": cfg.train.offload_skip_kept_d2h, "offload_min_window": cfg.train.offload_min_window,
        "offload_lookahead": cfg.train.offload_lookahead, "setup_seconds": setup, "step_seconds": times,
        "median_step_seconds": statistics.median(times),
        "host_step_seconds": host_times, "median_host_step_seconds": statistics.median(host_times),
        "driver_calls": driver_calls,
        # the main thread's time blocked on offload per timed step (a release it waited for)
        "offload_host_wait_ms_per_step": (1e3 * (pipe.offload.stats.host_wait_seconds - wait0) / steps
                                          if pipe.offload is not None else None),
        "peak_allocated_bytes": peak_alloc, "baseline_allocated_bytes": baseline,
        "peak_driver_used_bytes": total - min(free_samples),
        "graph_count": pipe.manager.stats.graph_count,
        "persistent_growth_bytes_per_step": pipe.manager.persistent_growth_per_step(),
    }
    if mgr is not None:
        st = mgr.stats
        not_offloaded = sum(g.nbytes for g in mgr.not_offloaded)  # release: the short-window groups' bytes
        res["offload"] = {
            "groups": len(mgr.groups), "group_bytes": sum(g.nbytes for g in mgr.groups),
            "banks": len(mgr.banks), "bank_plan": mgr.bank_plan, "mapped_bytes_now": mgr.mapped_bytes(),
            "bank_plan_kind": mgr.bank_plan_kind, "bank_search": None if mgr.bank_search is None else {
                "seconds": mgr.bank_search.seconds, "plans_tried": mgr.bank_search.tried,
                "budget_bytes": mgr.bank_search.budget_bytes, "simulated_ratio": mgr.bank_search.best.ratio,
                "colour_simulated_ratio": mgr.bank_search.colour.ratio, "colour_plan": list(mgr.bank_search.colour.plan)},
            "host_bytes": mgr.host_bytes(), "kept_groups": [g.name for g in mgr.kept],
            "not_offloaded_groups": [g.name for g in mgr.not_offloaded],
            "not_offloaded_bytes": not_offloaded,
            **{k: getattr(st, k) for k in ("d2h_copies", "d2h_bytes", "d2h_skipped", "h2d_copies", "h2d_bytes", "maps", "unmaps",
                                           "released_live", "released_at_backward", "reaped", "prefetches", "prefetches_wasted", "prefetches_skipped", "prefetches_futile",
                                           "reloads_skipped", "evictions")}}
        if mode == "release":
            slot = sum(g.slot.size for g in mgr.groups if g.slot is not None)  # each group's forward runs once
            early = sum(d for _, _, d, by_bwd in returned if not by_bwd)
            total = sum(d for _, _, d, _ in returned)
            res["offload"]["release"] = {
                "unmaps_measured": len(returned), "unmaps_by_backward": sum(b for *_, b in returned),
                "groups": len(mgr.groups), "slot_bytes": slot, "driver_free_increase_bytes": early,
                "returned_fraction": early / slot if slot else None,
                # over every group's bytes, the ones not offloaded counted as not returned
                "returned_fraction_all_groups": early / (slot + not_offloaded) if slot else None,
                "returned_fraction_incl_backward": total / slot if slot else None, "per_group": returned[:64]}
    del pipe
    if mgr is not None:
        mgr.close()
    gc.collect()
    torch.cuda.empty_cache()
    res["leftover_allocated_bytes"] = torch.cuda.memory_allocated(dev)  # after teardown: a leak if > 0
    return res, torch.cat(losses), final


TARGETS = {  # issue 7: (mode label, value of that mode's result, threshold, "max" or "min")
    "resident-step-ratio": ("resident", lambda r: r["step_ratio_vs_off"], 1.03, "max"),
    "release-step-ratio": ("release", lambda r: r["step_ratio_vs_off"], 1.10, "max"),
    "release-returned-fraction": ("release", lambda r: r["offload"]["release"]["returned_fraction"], 0.9, "min"),
    # the same over every group's bytes, those the plan does not offload counted as not returned
    "release-returned-fraction-all-groups": ("release", lambda r: r["offload"]["release"]["returned_fraction_all_groups"],
                                             0.9, "min"),
}


def targets(modes: dict) -> dict:
    """Issue 7's targets from this run: the plain `resident` and `release` modes (not resident@K)."""
    out = {}
    for name, (mode, value_of, threshold, kind) in TARGETS.items():
        value = value_of(modes[mode]) if mode in modes else None
        if value is not None:
            out[name] = {"value": value, "threshold": threshold,
                         "met": value <= threshold if kind == "max" else value >= threshold}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/h2048.toml")
    ap.add_argument("--backend", default=None, help="override fp8.backend")
    ap.add_argument("--schedule", default=None, help="override pipeline.schedule")
    ap.add_argument("--path", default="captured-direct")
    ap.add_argument("--modes", default="off,release,resident",
                    help="comma list of off, release, release-keep, release-reap, release-all (every group offloaded), resident, "
                         "resident@K (the searched plan within the colouring's memory with K banks), resident-colour, "
                         "resident-colour@K (the colouring, at least K banks), resident-copyall, resident-copyall@K "
                         "(no D2H skipped), resident-all, resident-all@K (short windows offloaded too); "
                         "any with /laN (train.offload_lookahead = N) and #N (a repeat under its own name)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = load_config(a.config).with_overrides(**{"train.device": "cuda", "fp8.backend": a.backend,
                                                  "pipeline.schedule": a.schedule})
    modes = a.modes.split(",")
    if modes[0] != "off":
        modes = ["off"] + [m for m in modes if m != "off"]
    report = {"command": " ".join(["python3"] + sys.argv), "git_revision": git_revision() or "unknown",
              "environment": qeffect_environment(),
              "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "python": platform.python_version(), "config": a.config, "backend": cfg.fp8.backend,
              "schedule": cfg.pipeline.schedule, "path": a.path, "steps": a.steps, "warmup": a.warmup, "modes": {}}
    try:
        import transformer_engine

        report["transformer_engine"] = transformer_engine.__version__
    except Exception:  # noqa: BLE001
        report["transformer_engine"] = None
    ref_losses = ref_final = None
    ok = True
    for mode in modes:
        res, losses, final = run_mode(cfg, mode, a.path, a.steps, a.warmup, dev)
        if mode == "off":
            ref_losses, ref_final = losses, final
        else:
            diff = [k for k in ref_final if not torch.equal(ref_final[k], final.get(k, torch.empty(0)))]
            res["bitwise_vs_off"] = {
                "losses_equal": bool(torch.equal(ref_losses, losses)), "tensors_compared": len(ref_final),
                "tensors_differing": len(diff), "first_differing": diff[:5],
                "same_keys": sorted(ref_final) == sorted(final)}
            res["step_ratio_vs_off"] = res["median_step_seconds"] / report["modes"]["off"]["median_step_seconds"]
            ok &= res["bitwise_vs_off"]["losses_equal"] and not diff and res["bitwise_vs_off"]["same_keys"]
        report["modes"][mode] = res
        line = (f"{mode}: median {res['median_step_seconds'] * 1e3:.2f} ms (host queued it in "
                f"{res['median_host_step_seconds'] * 1e3:.2f} ms), peak alloc "
                f"{(res['peak_allocated_bytes'] - res['baseline_allocated_bytes']) / 2**30:.2f} GiB above the "
                f"{res['baseline_allocated_bytes'] / 2**30:.2f} GiB it started from, peak driver used "
                f"{res['peak_driver_used_bytes'] / 2**30:.2f} GiB, left allocated {res['leftover_allocated_bytes'] / 2**30:.2f} GiB")
        if res["driver_calls"]:
            line += ", driver calls per step (host ms): " + ", ".join(
                f"{c} {d['per_step']:.1f} ({d['host_ms_per_step']:.2f})" for c, d in res["driver_calls"].items())
            line += f", host blocked on offload {res['offload_host_wait_ms_per_step']:.2f} ms per step"
        if mode != "off":
            b = res["bitwise_vs_off"]
            line += (f", x{res['step_ratio_vs_off']:.3f} vs off, bitwise: losses {b['losses_equal']}, "
                     f"{b['tensors_differing']}/{b['tensors_compared']} tensors differ")
            o = res.get("offload")
            if o is None:  # a repeat of off (off#2): the drift control
                print(line, flush=True)
                continue
            line += f", groups {o['groups']} ({o['group_bytes'] / 2**20:.0f} MiB), banks {o['banks']}"
            if o.get("bank_search"):
                b = o["bank_search"]
                line += (f" (searched {b['plans_tried']} plans in {b['seconds']:.2f} s: simulated x{b['simulated_ratio']:.3f}"
                         f", the colouring's x{b['colour_simulated_ratio']:.3f})")
            if o["banks"]:
                line += (f", kept {len(o['kept_groups'])}, D2H {o['d2h_copies']} copied / {o['d2h_skipped']} skipped, "
                         f"H2D {o['h2d_copies']}, reloads skipped {o['reloads_skipped']}")
            if "release" in o:
                r = o["release"]
                line += (f", not offloaded {len(o['not_offloaded_groups'])} ({o['not_offloaded_bytes'] / 2**20:.0f} MiB), "
                         f"returned {r['returned_fraction']:.3f} of slot bytes before the backward "
                         f"({r['returned_fraction_incl_backward']:.3f} with the backward's own releases; "
                         f"{r['returned_fraction_all_groups']:.3f} of all groups' bytes)")
        print(line, flush=True)
    report["passed_bitwise"] = ok
    report["targets"] = targets(report["modes"])
    for name, t in report["targets"].items():
        print(f"target {name}: {t['value']:.3f} vs {t['threshold']} -> {'met' if t['met'] else 'MISSED'}")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
