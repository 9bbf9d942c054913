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
  action of one extra, untimed step), the bytes mapped by the offload slots; each offload mode's peak drop
  against `off` (both above what was allocated before the mode's build) beside `saved_bytes`, every byte
  the step's stage actions save for backward (target for `release`: a drop of at least half of them);
- release: the driver-level free memory just before and just after every unmap of a group's slot
  between its forward and its backward in that extra step; returned = sum of those increases / sum of
  the groups' slot sizes (target >= 0.9). Groups release mode does not offload (their window is shorter
  than `offload.min_window` actions) have no slot: `returned_fraction_all_groups` counts their
  bytes as not returned. An unmap made by the group's own backward (its D2H was not
  found done before) returns memory only until the restore right after it: `returned_fraction` leaves
  those out, `returned_fraction_incl_backward` counts them. The counters over all steps (timed ones
  included) say how often each happened: `released_live`, `released_at_backward` (only with
  `offload.release_at_backward = true`), `kept_at_backward` (the default: that backward read the bytes
  still in its slot, which was not released that step). The measured step
  samples memory after every action, which slows the host, so it may find more copies done in time.

`--modes` takes `resident` for resident offload with the searched bank plan (the default,
`offload.bank_plan = "search"`; `resident@K`: within the colouring's memory with K banks,
`offload.search_banks`), `resident-colour` (also `resident-colour@K`) for the greedy colouring with at
least K banks (`offload.bank_plan = "colour"`, `offload.banks`; the A/B),
`release-keep` for release offload that keeps consumed slots mapped (`offload.reap = false`, the
default), `release-reap` for release offload that also releases them after their backward
(`offload.reap = true`; the A/B) and
`resident-copyall` (also `resident-copyall@K`) for resident offload that copies every group to the host,
even those the plan keeps in their bank (`offload.skip_kept_d2h = false`; the A/B of the skip), and
`release-per-microbatch` for release offload with a captured chain and group per microbatch
(`offload.release_chains = "microbatch"`; the A/B of chains bounded by liveness), `release-all` and
`resident-all` (also `resident-all@K`) for offload of every group, short windows included
(`offload.min_window = 0`; the A/B of not offloading them), `resident-memory` (also `resident-memory@K`)
for the search preferring less bank memory to fewer bytes copied among plans as fast
(`offload.search_prefer = "memory"`; the A/B), `release-defaults` for release with every other `[offload]`
field at the library's default, whatever the config file sets; `VARIANTS` lists them. Any mode takes a `/laN` suffix
(`release/la2`, `resident@6/la3`): `offload.lookahead = N`, the offloaded groups each backward restores ahead (0: none; the A/B), and a `/mwN` suffix (`resident/mw12`):
`offload.min_window = N`, groups with fewer other actions between their forward and backward stay
on the device (the trade of memory for time).
A `+section.field=VALUE` suffix (repeatable) overrides a config field for that mode
(`resident+offload.skip_futile_restores=false`: look-ahead restores a forward evicts before their backward
are started anyway; `off+runtime.rank_streams=false`; VALUE as JSON, `true`, `3`, `0.5`, or text, `nested`;
bank lists as `0:1:0`). Nothing reads a switch from the environment: a `+VAR=VALUE` suffix is refused,
naming the field that replaced it where there is one (`REPLACED_SWITCHES`). A `#N` suffix repeats a mode
under its own name (`off#2` at the end: did the step time drift while the modes ran? `release#2`: how far
apart are two runs of one configuration?). Each mode's report holds its `+` overrides (`config_overrides`)
and its whole `[offload]` section (`offload_config`).

`--chained` (with `--interleave`) queues each mode's steps of a round back to back and synchronizes the
device once per round: the steady-state step of a loop that does not wait for each loss (`qeffect train`
waits, so the default synchronizes around every step). The losses and final state are compared as always.

`--interleave BLOCK` builds and warms up every mode first (all alive at once: the device must hold them
all), then times them in rounds of BLOCK steps each, the order of the modes rotated every round, so that a
slow spell of a shared host falls on every mode alike; `paired_step_ratio_vs_off` is then the median over
rounds of each round's median against off's in the same round. Memory is taken above what was allocated
(used, at the driver) before the mode was built; its peak allocation is the warm-up's (other modes run
after it). Without it (the default), one mode after the other, each torn down before the next is built.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from qeffect.checkpoint.state import local_view, tensor_state
from qeffect.cli.common import write_json
from qeffect.config import OffloadConfig, apply_sets, load_config
from qeffect.graphs.handshake import git_revision, run_settings
from qeffect.graphs.stats import GraphStats
from qeffect.profile.matrix import te_version
from qeffect.runtime.build import build_single_process, forward_groups
from qeffect.verify.state import synthetic_batches


def _final_state(pipe) -> dict[str, torch.Tensor]:
    """Parameters, optimizer and FP8 state by checkpoint key, copied off the device."""
    return {k: v.detach().cpu().clone() for k, v in tensor_state(local_view(pipe)).items()}


# a mode name -> (offload.mode, the config overrides it stands for)
VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "release-keep": ("release", {"offload.reap": False}),  # consumed slots stay mapped (the default)
    "release-reap": ("release", {"offload.reap": True}),  # consumed slots released after their backward
    "release-all": ("release", {"offload.min_window": 0}),  # every group offloaded, short windows too
    # a captured chain and a group per microbatch (default: chains bounded by liveness)
    "release-per-microbatch": ("release", {"offload.release_chains": "microbatch"}),
    "resident-all": ("resident", {"offload.min_window": 0}),
    "resident-copyall": ("resident", {"offload.skip_kept_d2h": False}),  # every group copied out
    "resident-colour": ("resident", {"offload.bank_plan": "colour"}),  # the greedy colouring
    # the search preferring less bank memory among plans as fast (default: fewer bytes copied)
    "resident-memory": ("resident", {"offload.search_prefer": "memory"}),
    # release with every other [offload] field at the library's default, whatever the config file sets
    "release-defaults": ("release", {f"offload.{k}": v for k, v in OffloadConfig().model_dump().items()
                                     if k != "mode"}),
}

# environment switches that config fields replaced: a mode's `+VAR=VALUE` naming one is refused with its field
REPLACED_SWITCHES = {
    "QEFFECT_OFFLOAD_CHUNK_MIB": "offload.copy_chunk_mib", "QEFFECT_OFFLOAD_STORE_BATCH_MIB": "offload.store_batch_mib",
    "QEFFECT_OFFLOAD_SHARE_SLOTS": "offload.share_slots", "QEFFECT_OFFLOAD_SLOT_MEMBERS": "offload.slot_members",
    "QEFFECT_OFFLOAD_SHARE_GAP": "offload.share_gap", "QEFFECT_OFFLOAD_RELEASE_AT_BACKWARD": "offload.release_at_backward",
    "QEFFECT_OFFLOAD_LAUNCH_FIRST": "offload.launch_first", "QEFFECT_OFFLOAD_SEARCH_TRIES": "offload.search_tries",
    "QEFFECT_OFFLOAD_BANKS": "offload.explicit_banks", "QEFFECT_SKIP_FUTILE_RESTORES": "offload.skip_futile_restores",
    "QEFFECT_OFFLOAD_DRIVER_STREAMS": "offload.driver_streams", "QEFFECT_RANK_STREAMS": "runtime.rank_streams",
}


def override_value(text: str) -> object:
    """A `+section.field=VALUE` suffix's value: a bank list `0:1:0`, else JSON (`true`, `3`, `0.5`), else the text."""
    parts = text.split(":")
    if len(parts) > 1 and all(p.isdigit() for p in parts):
        return [int(p) for p in parts]
    try:
        return json.loads(text)
    except ValueError:
        return text


def label_switches(label: str) -> tuple[str, dict[str, object]]:
    """`label`'s mode name (with its `#N`) and the config overrides of its `+section.field=VALUE` suffixes."""
    name, *switches = label.split("+")
    overrides: dict[str, object] = {}
    for switch in switches:
        key, eq, value = switch.partition("=")
        if not eq or "." not in key:
            field = REPLACED_SWITCHES.get(key)
            raise ValueError(f"mode {label!r}: +{switch}: " + (
                f"{key} is the config field {field} now (+{field}=VALUE)" if field else
                "expected +section.field=VALUE (nothing reads a switch from the environment)"))
        overrides[key] = override_value(value.partition("#")[0])
        name += value[len(value.partition("#")[0]):]  # a repeat's #N may follow the last suffix
    return name, overrides


def mode_config(cfg, label: str):
    """(offload.mode, `cfg` with the overrides `label` stands for: its variant, `@K`, `/laN`, `/mwN` and its
    `+section.field=VALUE` suffixes, those last)."""
    # "#N": a repeat; "/laN": offload.lookahead = N; "/mwN": offload.min_window = N
    name, given = label_switches(label)
    base, *suffixes = name.partition("#")[0].split("/")
    depth = window = None
    for suffix in suffixes:
        if suffix[:2] not in ("la", "mw") or not suffix[2:].isdigit():
            raise ValueError(f"mode {label!r}: unknown suffix /{suffix} (expected /laN or /mwN)")
        if suffix.startswith("la"):
            depth = int(suffix[2:])
        else:
            window = int(suffix[2:])
    name, _, banks = base.partition("@")
    mode, overrides = VARIANTS.get(name, (name, {}))
    # @K: the search's memory budget (resident with the searched plan), else the colouring's bank count
    searched = mode == "resident" and {**overrides, **given}.get("offload.bank_plan") != "colour"
    # the suffixes over the variant's own overrides, where given (a None would drop the variant's value:
    # `release-all`'s min_window = 0 once ran at the default)
    suffixed = {"offload.banks": int(banks) if banks and not searched else None,
                "offload.search_banks": int(banks) if banks and searched else None,
                "offload.lookahead": depth, "offload.min_window": window}
    cfg = cfg.with_overrides(**{"offload.mode": mode, **overrides,
                                **{k: v for k, v in suffixed.items() if v is not None}})
    return mode, cfg.with_overrides(**given) if given else cfg


def group_uses(pipe) -> dict[int, int]:
    """Each offload group's forwards per step, by `id`: the microbatches of the chain it serves."""
    return dict(Counter(id(g) for g in forward_groups(pipe.ranks).values()))


class ModeRun:
    """One mode's captured pipeline: built (and warmed up) on creation, stepped, then measured and torn down.

    Several may be alive at once (`--interleave`): each keeps its own step counter (so its own data), and
    its memory figures are taken above what was allocated (used, at the driver) before it was built.
    """

    sequential = True  # False: other modes stepped between this one's warm-up and its end (run_interleaved)

    def __init__(self, cfg, label: str, path: str, warmup: int, dev: torch.device) -> None:
        self.overrides = label_switches(label)[1]
        self.label, self.dev, self.warmup = label, dev, warmup
        self.mode, self.cfg = mode_config(cfg, label)
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        self.baseline = torch.cuda.memory_allocated(dev)  # what earlier modes left (or, interleaved, hold)
        free, total = torch.cuda.mem_get_info(dev)
        self.baseline_driver_used = total - free
        t0 = time.perf_counter()
        self.pipe = build_single_process(self.cfg, native=False, device=dev, path=path)
        torch.cuda.synchronize(dev)
        self.setup = time.perf_counter() - t0
        self.losses: list[torch.Tensor] = []
        # allocated memory after each timed step: the manager's own marks start at its warm-up, before the
        # modes built after this one (interleaved), whose builds would read as this mode's growth
        self.growth = GraphStats()
        self.times: list[float] = []
        self.host_times: list[float] = []
        self.drv = self.pipe.offload.driver if self.pipe.offload is not None else None
        for _ in range(warmup):
            self.step(timed=False)
        # the driver's counters and the offload manager's host wait when the timed steps begin
        self.calls0 = (self.drv.call_counts.copy(), self.drv.call_seconds.copy()) if self.drv else (Counter(), Counter())
        self.wait0 = self.pipe.offload.stats.host_wait_seconds if self.pipe.offload is not None else 0.0
        self.peak_alloc = torch.cuda.max_memory_allocated(self.dev)  # the warm-up reached the steady peak

    def step(self, timed: bool = True) -> None:
        """One step on this pipeline's next batch, the device synchronized before and after it."""
        self.chain(1, timed)

    def chain(self, n: int, timed: bool = True) -> None:
        """`n` steps queued back to back, the device synchronized only before the first and after the last
        (n > 1: a training loop that does not wait for each step's loss before queueing the next); each
        step's time is the chain's over `n`. The batches are made before the chain; a loss with a later step
        of the chain after it is copied (a captured step's loss may live in a buffer the next replay
        rewrites). The allocated bytes after each step are the caching allocator's host-side count: read
        without a synchronization. Not `timed` (warm-up): losses only."""
        start = len(self.losses)
        batches = [synthetic_batches(self.cfg, start + i, self.dev) for i in range(n)]
        losses, allocated = [], []
        torch.cuda.synchronize(self.dev)
        t = time.perf_counter()
        for i, b in enumerate(batches):
            loss = self.pipe.step(b).detach().float().reshape(1)
            losses.append(loss.clone() if i < n - 1 else loss)
            allocated.append(self.pipe.manager.mark_step())  # (the allocator's count, read once)
        t_host = time.perf_counter()  # the host has queued the chain (what it waited for inside included)
        torch.cuda.synchronize(self.dev)
        t_end = time.perf_counter()
        if timed:
            self.times += [(t_end - t) / n] * n
            self.host_times += [(t_host - t) / n] * n
            for a in allocated:
                self.growth.mark_step(a)
        self.losses += [x.to("cpu", copy=True) for x in losses]  # off the buffer the next step may rewrite

    def finish(self) -> tuple[dict, torch.Tensor, dict[str, torch.Tensor]]:
        """The mode's report, losses and final state; one extra, untimed, sampled step; then the teardown."""
        res, final = self._measure()
        res.update(mode=self.label, config_overrides=self.overrides, offload_config=self.cfg.offload.model_dump())
        return res, torch.cat(self.losses), final

    def _measure(self) -> tuple[dict, dict[str, torch.Tensor]]:
        pipe, dev, drv, steps, mode = self.pipe, self.dev, self.drv, len(self.times), self.mode
        driver_calls = None
        if drv is not None:  # per timed step: how many of each driver call, and the host time they took
            driver_calls = {c: {"per_step": (n - self.calls0[0][c]) / steps,
                                "host_ms_per_step": 1e3 * (drv.call_seconds[c] - self.calls0[1][c]) / steps}
                            for c, n in sorted(drv.call_counts.items()) if n > self.calls0[0][c]}
        # sequential: the peak over the timed steps too; interleaved: other modes ran since, so the warm-up's
        peak_alloc = max(self.peak_alloc, torch.cuda.max_memory_allocated(dev)) if self.sequential else self.peak_alloc
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
                orig_bwd = g.before_backward

                def before_backward(g=g, orig=orig_bwd) -> None:
                    in_backward.add(g.name)
                    try:
                        orig()
                    finally:
                        in_backward.discard(g.name)
                g.before_backward = before_backward
            for slot, members in mgr.release_slots():  # a shared slot once: its members' bytes leave together
                def unmap(*a, slot=slot, members=members, orig=slot.unmap, **kw) -> None:
                    if not any(g.live for g in members):  # a consumed group's reap: not the forward-to-backward release
                        return orig(*a, **kw)
                    before = torch.cuda.mem_get_info(dev)[0]
                    orig(*a, **kw)
                    returned.append((slot.name, slot.size, torch.cuda.mem_get_info(dev)[0] - before,
                                     any(g.name in in_backward for g in members)))
                slot.unmap = unmap
        pipe.step(synthetic_batches(self.cfg, len(self.losses), dev),
                  observer=lambda a, r: free_samples.append(torch.cuda.mem_get_info(dev)[0]))
        torch.cuda.synchronize(dev)
        total = torch.cuda.mem_get_info(dev)[1]
        cfg = self.cfg
        res = {
            "mode": self.label, "offload_banks": cfg.offload.banks,
            "offload_skip_kept_d2h": cfg.offload.skip_kept_d2h, "offload_min_window": cfg.offload.min_window,
            # the look-ahead depth the manager ran with
            "offload_lookahead": mgr.lookahead if mgr is not None else None, "setup_seconds": self.setup, "step_seconds": self.times,
            "median_step_seconds": statistics.median(self.times),
            "host_step_seconds": self.host_times, "median_host_step_seconds": statistics.median(self.host_times),
            "driver_calls": driver_calls,
            # the main thread's time blocked on offload per timed step (a release it waited for)
            "offload_host_wait_ms_per_step": (1e3 * (pipe.offload.stats.host_wait_seconds - self.wait0) / steps
                                              if pipe.offload is not None else None),
            "peak_allocated_bytes": peak_alloc, "baseline_allocated_bytes": self.baseline,
            "peak_driver_used_bytes": total - min(free_samples),
            "baseline_driver_used_bytes": self.baseline_driver_used,
            "graph_count": pipe.manager.stats.graph_count,
            "persistent_growth_bytes_per_step": self.growth.persistent_growth_per_step(),
        }
        if mgr is not None:
            st = mgr.stats
            uses = group_uses(pipe)  # a chain's group holds each of its microbatches in turn
            # release: the short-window groups' bytes, per step
            not_offloaded = sum(g.nbytes * uses.get(id(g), 1) for g in mgr.not_offloaded)
            res["offload"] = {
                "groups": len(mgr.groups), "group_bytes": sum(g.nbytes for g in mgr.groups),
                # what the step's forwards save for backward: each group's bytes once per forward it holds
                "saved_bytes_per_step": sum(g.nbytes * uses.get(id(g), 1) for g in mgr.groups),
                "banks": len(mgr.banks), "bank_plan": mgr.bank_plan, "mapped_bytes_now": mgr.mapped_bytes(),
                # release: slots (a shared one once) and the groups sharing one (offload.share_slots)
                "slots": len(mgr.slots()), "shared_slots": [[g.name for g in run] for run in mgr.shared],
                "bank_plan_kind": mgr.config.bank_plan, "bank_search": None if mgr.bank_search is None else {
                    "seconds": mgr.bank_search.seconds, "plans_tried": mgr.bank_search.tried,
                    "budget_bytes": mgr.bank_search.budget_bytes, "simulated_ratio": mgr.bank_search.best.ratio,
                    "colour_simulated_ratio": mgr.bank_search.colour.ratio, "colour_plan": list(mgr.bank_search.colour.plan)},
                "host_bytes": mgr.host_bytes(), "kept_groups": [g.name for g in mgr.kept],
                "not_offloaded_groups": [g.name for g in mgr.not_offloaded],
                "not_offloaded_bytes": not_offloaded,
                **{k: getattr(st, k) for k in ("d2h_copies", "d2h_bytes", "d2h_skipped", "h2d_copies", "h2d_bytes", "maps", "unmaps",
                                               "released_live", "released_at_backward", "kept_at_backward", "reaped", "prefetches", "prefetches_wasted", "prefetches_skipped", "prefetches_futile",
                                               "reloads_skipped", "evictions")}}
            if mode == "release":
                # each slot once per forward of a group in it (a shared slot's members run once each)
                slot = sum(s.size * max(uses.get(id(g), 1) for g in members) for s, members in mgr.release_slots())
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
        self.pipe = None
        if mgr is not None:
            mgr.close()
        gc.collect()
        torch.cuda.empty_cache()
        res["leftover_allocated_bytes"] = torch.cuda.memory_allocated(dev)  # above the baseline: a leak
        return res, final


def run_sequential(cfg, labels: list[str], path: str, steps: int, warmup: int, dev: torch.device):
    """Each mode alone: built, warmed up, timed, measured and torn down before the next is built."""
    for label in labels:
        run = ModeRun(cfg, label, path, warmup, dev)
        for _ in range(steps):
            run.step()
        yield run.finish()


def run_interleaved(cfg, labels: list[str], path: str, steps: int, warmup: int, block: int, dev: torch.device,
                    chained: bool = False):
    """Every mode built and warmed up first, then timed in rounds of `block` steps each, the order of the
    modes rotated every round, so that a slow spell of the host falls on all of them alike. Torn down in
    the reverse of the build order (so each one's baseline is still what it was when it was built).
    `chained`: each mode's steps of a round are queued back to back (`ModeRun.chain`)."""
    runs = [ModeRun(cfg, label, path, warmup, dev) for label in labels]
    for r in range(-(-steps // block)):
        k = r % len(runs)
        for run in runs[k:] + runs[:k]:
            n = min(block, steps - r * block)
            if chained:
                run.chain(n)
                continue
            for _ in range(n):
                run.step()
    results = {}
    for run in reversed(runs):
        run.sequential = False
        results[run.label] = run.finish()
    for label in labels:
        yield results[label]


def step_ratio(r: dict) -> float:
    """A mode's step against off's: round by round where the modes ran in alternating rounds, else the
    ratio of the medians."""
    return r.get("paired_step_ratio_vs_off", r["step_ratio_vs_off"])


TARGETS = {  # issue 7: (mode label, value of that mode's result, threshold, "max" or "min")
    "resident-step-ratio": ("resident", step_ratio, 1.03, "max"),
    "release-step-ratio": ("release", step_ratio, 1.10, "max"),
    "release-returned-fraction": ("release", lambda r: r["offload"]["release"]["returned_fraction"], 0.9, "min"),
    # the same over every group's bytes, those the plan does not offload counted as not returned
    "release-returned-fraction-all-groups": ("release", lambda r: r["offload"]["release"]["returned_fraction_all_groups"],
                                             0.9, "min"),
    # the peak allocation `release` saves against `off`, over every byte the step's stage actions save for
    # backward (all groups, offloaded or not): "offload that pays" asks for at least half
    "release-peak-drop-of-saved": ("release", lambda r: r.get("peak_drop_fraction_of_saved"), 0.5, "min"),
}


def round_ratios(times: list[float], off_times: list[float], block: int) -> list[float]:
    """Each round's (this mode's median step / off's median step in the same round), the rounds `block`
    steps long (`--interleave`)."""
    return [statistics.median(times[i:i + block]) / statistics.median(off_times[i:i + block])
            for i in range(0, len(times), block)]


def paired_ratio(times: list[float], off_times: list[float], block: int) -> float:
    """The median over rounds of `round_ratios`."""
    return statistics.median(round_ratios(times, off_times, block))


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
                    help="comma list of off, release, release-keep, release-reap, release-all (every group offloaded), "
                         "release-per-microbatch (a chain and group per microbatch), resident, "
                         "resident@K (the searched plan within the colouring's memory with K banks), resident-colour, "
                         "resident-colour@K (the colouring, at least K banks), resident-copyall, resident-copyall@K "
                         "(no D2H skipped), resident-all, resident-all@K (short windows offloaded too), resident-memory, "
                         "resident-memory@K (the search preferring less memory to fewer copies); "
                         "any with /laN (offload.lookahead = N), /mwN (offload.min_window = N), #N "
                         "(a repeat under its own name) and +section.field=VALUE (a config override)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--interleave", type=int, default=0, metavar="BLOCK",
                    help="build every mode first, then time them in rounds of BLOCK steps each, the order rotated "
                         "every round (a noisy host's slow spells then fall on every mode alike); 0: one mode "
                         "after the other (the default)")
    ap.add_argument("--chained", action="store_true",
                    help="with --interleave: each mode's steps of a round queued back to back, the device "
                         "synchronized once per round (steady-state throughput; default: around every step, "
                         "as `qeffect train` waits for each step's loss)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="a config override for every mode, as `qeffect train --set` takes it; repeatable")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.chained and a.interleave <= 0:
        ap.error("--chained needs --interleave BLOCK (the steps each chain queues back to back)")
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = apply_sets(load_config(a.config).with_overrides(**{"train.device": "cuda", "fp8.backend": a.backend,
                                                             "pipeline.schedule": a.schedule}), a.set)
    modes = a.modes.split(",")
    if modes[0] != "off":
        modes = ["off"] + [m for m in modes if m != "off"]
    report = {"command": " ".join(["python3"] + sys.argv), "git_revision": git_revision() or "unknown",
              "settings": run_settings(cfg),
              "device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
              "python": platform.python_version(), "config": a.config, "backend": cfg.fp8.backend,
              "schedule": cfg.pipeline.schedule, "path": a.path, "steps": a.steps, "warmup": a.warmup,
              "interleave": a.interleave, "chained": a.chained, "transformer_engine": te_version(), "modes": {}}
    ref_losses = ref_final = None
    ok = True
    runs = (run_interleaved(cfg, modes, a.path, a.steps, a.warmup, a.interleave, dev, a.chained) if a.interleave > 0
            else run_sequential(cfg, modes, a.path, a.steps, a.warmup, dev))
    for mode, (res, losses, final) in zip(modes, runs, strict=True):
        if mode == "off":
            ref_losses, ref_final = losses, final
        else:
            diff = [k for k in ref_final if not torch.equal(ref_final[k], final.get(k, torch.empty(0)))]
            res["bitwise_vs_off"] = {
                "losses_equal": bool(torch.equal(ref_losses, losses)), "tensors_compared": len(ref_final),
                "tensors_differing": len(diff), "first_differing": diff[:5],
                "same_keys": sorted(ref_final) == sorted(final)}
            res["step_ratio_vs_off"] = res["median_step_seconds"] / report["modes"]["off"]["median_step_seconds"]
            if a.interleave > 0:  # each round's median against off's in the same round, the median of those
                res["paired_step_ratio_vs_off"] = paired_ratio(res["step_seconds"],
                                                               report["modes"]["off"]["step_seconds"], a.interleave)
            ok &= res["bitwise_vs_off"]["losses_equal"] and not diff and res["bitwise_vs_off"]["same_keys"]
            if res.get("offload"):  # each mode's peak above what was allocated before its build: its own footprint
                off = report["modes"]["off"]
                res["saved_bytes"] = res["offload"]["saved_bytes_per_step"]
                res["peak_drop_vs_off_bytes"] = ((off["peak_allocated_bytes"] - off["baseline_allocated_bytes"])
                                                 - (res["peak_allocated_bytes"] - res["baseline_allocated_bytes"]))
                res["peak_drop_fraction_of_saved"] = res["peak_drop_vs_off_bytes"] / max(res["saved_bytes"], 1)
        report["modes"][mode] = res
        line = (f"{mode}: median {res['median_step_seconds'] * 1e3:.2f} ms{' (chained)' if a.chained else ''} (host queued it in "
                f"{res['median_host_step_seconds'] * 1e3:.2f} ms), peak alloc "
                f"{(res['peak_allocated_bytes'] - res['baseline_allocated_bytes']) / 2**30:.2f} GiB above the "
                f"{res['baseline_allocated_bytes'] / 2**30:.2f} GiB it started from, peak driver used "
                f"{res['peak_driver_used_bytes'] / 2**30:.2f} GiB ({(res['peak_driver_used_bytes'] - res['baseline_driver_used_bytes']) / 2**30:.2f} "
                f"above the driver's use before its build), left allocated {res['leftover_allocated_bytes'] / 2**30:.2f} GiB")
        if res["driver_calls"]:
            line += ", driver calls per step (host ms): " + ", ".join(
                f"{c} {d['per_step']:.1f} ({d['host_ms_per_step']:.2f})" for c, d in res["driver_calls"].items())
            line += f", host blocked on offload {res['offload_host_wait_ms_per_step']:.2f} ms per step"
        if mode != "off":
            b = res["bitwise_vs_off"]
            if "paired_step_ratio_vs_off" in res:
                line += f", x{res['paired_step_ratio_vs_off']:.3f} vs off round by round"
            line += (f", x{res['step_ratio_vs_off']:.3f} vs off, bitwise: losses {b['losses_equal']}, "
                     f"{b['tensors_differing']}/{b['tensors_compared']} tensors differ")
            o = res.get("offload")
            if o is None:  # a repeat of off (off#2): the drift control
                print(line, flush=True)
                continue
            line += (f", groups {o['groups']} ({o['saved_bytes_per_step'] / 2**20:.0f} MiB saved for backward per step; peak "
                     f"{res['peak_drop_vs_off_bytes'] / 2**20:.0f} MiB below off's, "
                     f"{res['peak_drop_fraction_of_saved']:.3f} of them), banks {o['banks']}")
            if o.get("bank_search"):
                b = o["bank_search"]
                line += (f" (searched {b['plans_tried']} plans in {b['seconds']:.2f} s: simulated x{b['simulated_ratio']:.3f}"
                         f", the colouring's x{b['colour_simulated_ratio']:.3f})")
            if o["banks"]:
                line += (f", kept {len(o['kept_groups'])}, D2H {o['d2h_copies']} copied / {o['d2h_skipped']} skipped, "
                         f"H2D {o['h2d_copies']}, reloads skipped {o['reloads_skipped']}")
            if "release" in o:
                r = o["release"]
                line += (f", slots {o['slots']} ({len(o['shared_slots'])} shared), "
                         f"not offloaded {len(o['not_offloaded_groups'])} ({o['not_offloaded_bytes'] / 2**20:.0f} MiB), "
                         f"returned {r['returned_fraction']:.3f} of slot bytes before the backward "
                         f"({r['returned_fraction_incl_backward']:.3f} with the backward's own releases; "
                         f"{r['returned_fraction_all_groups']:.3f} of all groups' bytes), backwards before "
                         f"their slot went: {o['kept_at_backward']} read in place, {o['released_at_backward']} "
                         f"released and restored (of {o['d2h_copies']} groups' forwards)")
        print(line, flush=True)
    report["passed_bitwise"] = ok
    report["targets"] = targets(report["modes"])
    for name, t in report["targets"].items():
        print(f"target {name}: {t['value']:.3f} vs {t['threshold']} -> {'met' if t['met'] else 'MISSED'}")
    write_json(Path(a.out), report)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
