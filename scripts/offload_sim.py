"""Issue 7 on the CPU: resident offload's step time (`qeffect.offload.timing`) for given durations and banks.

    python3 scripts/offload_sim.py --schedule interleaved --json $OUT/offload-sim-h2048.json
    python3 scripts/offload_sim.py --schedule zbv --banks 2,3,4,6 --lookahead 1,2
    python3 scripts/offload_sim.py --banks 4 --search 300   # also search bank plans within the colouring's memory
    python3 scripts/offload_sim.py --banks 6 --search 400 --prefer memory  # ties: less memory, not fewer copies
    python3 scripts/offload_sim.py --plan interleaved=0:3:0:1:0:3:2:1:0:1:0:3:2:1:0:3  # time these banks
    python3 scripts/offload_sim.py --robustness examples/configs/h2048.toml  # the capture-time search's estimate

The simulation (see `qeffect.offload.timing`) runs the real `OffloadManager` with a host of zero cost;
what it reports is the floor that the stream dependencies and the copy bandwidth set, not the GPU's
step. Its durations are inputs (`--f-ms` etc.; the defaults split h2048's measured 9.75 ms step without
offload: 7.1 ms of actions, the rest optimizer and embedding), and so are its answers. `--min-window N`
(default 2: the last stage's; `offload.min_window` defaults to 12) leaves
the groups with fewer than N other actions between their forward and their backward on the device: they
count as empty; 0 offloads every group.

`--robustness CONFIG`: plans searched as `qeffect train` searches them at capture (durations estimated from
the config's matrix FLOPs, `offload.planning.estimate_costs`'s constants, its `[offload]` section),
then timed with the durations given
here, and with them scaled (x0.6, x1.6, the last stage's weight 1.3): how far the estimate's plan is from a
plan searched with those durations, and from the colouring's.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from qeffect.cli.common import write_json
from qeffect.config import DEFAULT_SEARCH_TRIES, OffloadConfig, load_config
from qeffect.graphs.handshake import script_provenance
from qeffect.offload.plan import Event, explicit_banks, short_window_groups
from qeffect.offload.planning import estimated_costs as build_estimated_costs
from qeffect.offload.planning import named_events
from qeffect.offload.timing import MIB, SimResult, StepCosts, search_banks, simulate
from qeffect.profile.flops import HEAD, linear_shapes
from qeffect.schedule.adapter import build_schedule
from qeffect.schedule.order import global_order

# h2048 (offload_bench at 3b60f78): stages 0-2 save 9.8 MiB per microbatch, the last stage (head and loss:
# the logits) 43 MiB; the last stage's actions take about twice a layer's (its head GEMM is as large as the
# layer's), and 7.1 of the 9.75 ms step without offload are the actions (the rest: optimizer, embedding)
H2048_GROUP_MIB = (9.8, 9.8, 9.8, 43.0)
H2048_STAGE_WEIGHT = (1.0, 1.0, 1.0, 2.0)


def step_events(schedule: str, microbatches: int, pp: int = 2, chunks: int = 2) -> list[Event]:
    """One step's offload events, the groups named (stage, microbatch)."""
    return named_events(global_order(build_schedule(schedule, pp, chunks, microbatches)))


def given_costs(events: list[Event], group_mib: tuple[float, ...], stage_weight: tuple[float, ...],
                f_ms: float, i_ms: float, w_ms: float, tail_ms: float, gbps: float,
                min_window: int = 0) -> StepCosts:
    """Costs from the arguments: a group of stage s saves `group_mib[s]` (nothing where `min_window` leaves
    it on the device: `without_short`); its actions take f/i/w times `stage_weight[s]`."""
    groups = {g for _, g in events}
    costs = StepCosts({g: int(group_mib[g[0]] * MIB) for g in groups},
                      {g: (f_ms * stage_weight[g[0]], i_ms * stage_weight[g[0]], w_ms * stage_weight[g[0]])
                       for g in groups}, tail_ms, gbps)
    return without_short(costs, events, min_window)


def estimated_costs(events: list[Event], cfg: Any, group_mib: tuple[float, ...], gbps: float,
                    min_window: int = 0) -> StepCosts:
    """Durations as `offload.planning.estimate_costs` estimates them at capture, from the config's linears
    (each stage's layers; the last also the head) instead of the chunks' weights; bytes as `given_costs`."""
    per_layer = sum(i * o for name, i, o, _ in linear_shapes(cfg) if name != HEAD) * cfg.model.layers_per_chunk
    last = cfg.pipeline.num_stages - 1
    groups = {g for _, g in events}
    elements = {g: per_layer + (cfg.model.hidden * cfg.model.vocab_size if g[0] == last else 0) for g in groups}
    costs = build_estimated_costs({g: int(group_mib[g[0]] * MIB) for g in groups}, elements,
                                  cfg.model.microbatch_size * cfg.model.seq_len)
    return without_short(replace(costs, gbps=gbps), events, min_window)


def without_short(costs: StepCosts, events: list[Event], min_window: int) -> StepCosts:
    """`costs` with the groups no offload mode offloads at `min_window` (`offload.min_window`: the last
    stage's at 2) as empty, as the capture-time search sees them: no bank, no copies."""
    short = short_window_groups(events, min_window)
    return replace(costs, nbytes={g: 0 if g in short else n for g, n in costs.nbytes.items()})


def row(r: SimResult, schedule: str, lookahead: int, events: list[Event], costs: StepCosts) -> dict[str, Any]:
    live, peak = 0, 0  # without offload: the saved bytes alive at once (F to the last reader)
    for kind, g in events:
        live += costs.nbytes[g] if kind == "F" else -costs.nbytes[g] if kind == "E" else 0
        peak = max(peak, live)
    return {"schedule": schedule, "mode": "resident", "banks": r.banks, "lookahead": lookahead,
            "mapped_mib": r.mapped_bytes / MIB, "off_peak_saved_mib": peak / MIB, "step_ms": r.step_ms,
            "off_ms": r.off_ms, "ratio": r.ratio, "kept": r.kept, "d2h_mib_per_step": r.d2h_bytes / MIB,
            "h2d_mib_per_step": r.h2d_bytes / MIB, "compute_stall_ms_per_step": r.stall_ms, "plan": list(r.plan)}


def robustness(cfg_path: Path, schedule: str, given: dict[str, Any], tries: int,
               min_window: int) -> list[dict[str, Any]]:
    """The estimate's plan against plans searched with the given durations, scaled (see the docstring)."""
    cfg = load_config(cfg_path)
    events = step_events(schedule, cfg.pipeline.microbatches, cfg.pipeline.pp, cfg.pipeline.chunks_per_rank)
    search = cfg.offload.model_copy(update={"mode": "resident", "search_tries": tries})  # as at capture
    banks, prefer = search.search_banks, search.search_prefer
    estimate = search_banks(events, estimated_costs(events, cfg, given["group_mib"], given["gbps"], min_window),
                            search)
    w = given["stage_weight"]
    variants = {"given": given, "x0.6": given | {k: given[k] * 0.6 for k in ("f_ms", "i_ms", "w_ms", "tail_ms")},
                "x1.6": given | {k: given[k] * 1.6 for k in ("f_ms", "i_ms", "w_ms", "tail_ms")},
                "last stage x1.3": given | {"stage_weight": (*w[:-1], 1.3)}}
    out = []
    for name, kw in variants.items():
        costs = given_costs(events, **kw, min_window=min_window)
        searched = search_banks(events, costs, search)
        out.append({"config": str(cfg_path), "schedule": schedule, "durations": name, "min_window": min_window,
                    "prefer": prefer,
                    "estimate_plan": list(estimate.best.plan),
                    "estimate_plan_ratio": simulate(events, costs, estimate.best.plan, search).ratio,
                    "searched_plan_ratio": searched.best.ratio, "colour_2_ratio": simulate(events, costs).ratio,
                    f"colour_{banks}_ratio": searched.colour.ratio})
        r = out[-1]
        print(f"{cfg_path.name} {schedule:11s} durations {name:16s}: estimate's plan x{r['estimate_plan_ratio']:.3f}, "
              f"searched with these x{r['searched_plan_ratio']:.3f}, colouring x{r['colour_2_ratio']:.3f} "
              f"(2 banks) x{r[f'colour_{banks}_ratio']:.3f} ({banks})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", default="interleaved,zbv", help="comma-separated: interleaved, zbv")
    ap.add_argument("--banks", default="2,3,4,6", help="comma-separated offload.banks to try")
    ap.add_argument("--lookahead", default="1,2", help="comma-separated look-ahead depths to try")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--group-mib", default=",".join(map(str, H2048_GROUP_MIB)), help="MiB a group saves, per stage")
    ap.add_argument("--stage-weight", default=",".join(map(str, H2048_STAGE_WEIGHT)),
                    help="per stage: its actions' durations relative to --f-ms, --i-ms, --w-ms")
    ap.add_argument("--gbps", type=float, default=52.0, help="copy bandwidth per direction (H200: 50-55 GB/s)")
    ap.add_argument("--f-ms", type=float, default=0.118)
    ap.add_argument("--i-ms", type=float, default=0.118)
    ap.add_argument("--w-ms", type=float, default=0.118)
    ap.add_argument("--tail-ms", type=float, default=2.65, help="per step, outside the actions: the optimizer and the rest")
    ap.add_argument("--min-window", type=int, default=2, metavar="N",
                    help="groups with fewer than N other actions between their F and B stay on the device, as "
                         "offload.min_window does (default 2: the last stage's; the config's default is "
                         "12); 0 offloads every group")
    ap.add_argument("--search", type=int, default=0, metavar="N",
                    help="also search N tries for a better plan within the colouring's memory with each --banks")
    ap.add_argument("--prefer", choices=("memory", "copies"), default="copies",
                    help="--search: among plans as fast, fewer bytes copied (the default) or less bank memory, "
                         "as offload.search_prefer")
    ap.add_argument("--plan", action="append", default=[], metavar="SCHEDULE=B0:B1:...",
                    help="time these banks (one per group in backward order, as offload.explicit_banks) instead of "
                         "--banks; repeatable")
    ap.add_argument("--robustness", type=Path, metavar="CONFIG",
                    help="the capture-time search's estimated durations for CONFIG against these durations")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    if a.min_window < 0:
        ap.error(f"--min-window must be >= 0, got {a.min_window}")
    rows = []
    given = {"group_mib": tuple(float(x) for x in a.group_mib.split(",")),
             "stage_weight": tuple(float(x) for x in a.stage_weight.split(",")), "f_ms": a.f_ms, "i_ms": a.i_ms,
             "w_ms": a.w_ms, "tail_ms": a.tail_ms, "gbps": a.gbps}
    if a.robustness:
        for sched in a.schedule.split(","):
            rows += robustness(a.robustness, sched, given, a.search or DEFAULT_SEARCH_TRIES, a.min_window)
    for spec in a.plan:
        sched, _, text = spec.rpartition("=")
        try:
            events = step_events(sched, a.microbatches)
            banks = explicit_banks(events, text, f"--plan {sched}")
        except ValueError as err:  # an unknown schedule, or banks that do not fit it
            ap.error(str(err))
        costs = given_costs(events, **given, min_window=a.min_window)
        rows.append(row(simulate(events, costs, banks, OffloadConfig(mode="resident", copy_chunk_mib=a.chunk_mib)),
                        sched, 1, events, costs))
        _print(rows[-1], f"{sched:11s} banks {text}")
    for sched in ([] if a.plan or a.robustness else a.schedule.split(",")):
        events = step_events(sched, a.microbatches)
        costs = given_costs(events, **given, min_window=a.min_window)
        for banks in (int(b) for b in a.banks.split(",")):
            for la in (int(x) for x in a.lookahead.split(",")):
                sim = OffloadConfig(mode="resident", banks=banks, lookahead=la, copy_chunk_mib=a.chunk_mib,
                                    search_banks=banks, search_tries=a.search, search_prefer=a.prefer)
                r = simulate(events, costs, config=sim)
                rows.append(row(r, sched, la, events, costs))
                _print(rows[-1], f"{sched:11s} banks {r.banks} (asked {banks}) look-ahead {la}")
                if a.search:
                    found = search_banks(events, costs, sim)
                    rows.append(row(found.best, sched, la, events, costs) | {"searched": found.tried,
                                                                             "max_banks": banks,
                                                                             "prefer": a.prefer})
                    _print(rows[-1], f"{sched:11s} searched, within the colouring's memory with {banks} banks, "
                                     f"look-ahead {la}")
                    print(f"    offload.explicit_banks = {list(found.best.plan)}")
    if a.json:
        write_json(a.json, script_provenance() | {
            "kind": "simulation on the CPU: a host of zero cost, the durations and bandwidth given", "device": "none",
            "torch": torch.__version__, "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
            "results": rows})
    return 0


def _print(r: dict[str, Any], head: str) -> None:
    stall = ", ".join(f"{k} {v:.3f}" for k, v in r["compute_stall_ms_per_step"].items()) or "none"
    print(f"{head}: step {r['step_ms']:.2f} ms, x{r['ratio']:.3f} of {r['off_ms']:.2f}; banks {r['mapped_mib']:.0f} "
          f"MiB (off: {r['off_peak_saved_mib']:.0f} MiB saved at once); kept {r['kept']}, D2H "
          f"{r['d2h_mib_per_step']:.0f} MiB/step; compute stalls (ms/step): {stall}")


if __name__ == "__main__":
    raise SystemExit(main())
