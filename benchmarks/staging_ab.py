"""Staged weight-gradient accumulation, A/B in one process: captured direct placement with each stage's
staging depth bounded by its live tape bound K (`pipeline.wgrad_staging_by_liveness = true`), with
every stage at `pipeline.wgrad_staging` (a graph per staging slot and fold), bounded by liveness at depth
at most 2, and unstaged (each dW added into the fp32 gradient as it comes).

Variants run in interleaved rounds (A B C A B C ...), each round building, warming up and timing every
variant again with the profile's own timer (`qeffect.profile.matrix.time_runner`). Per variant: the median
of its round medians with min-max, peak allocated memory, arena bytes, graphs per rank and capture host
time; ratios are the median of per-round ratios against the first variant. Losses must be identical across
variants (the depth changes no bits). `--made-regions NAME,...`: those variants make their arenas' fp32
regions at build, as before lazy regions (`contracts.arena`), for an A/B of that memory at the same depth.
`--unlinked NAME,...`: those variants are built without hand-off buffers between stages (`graphs.handoff`),
so every F and dI replay copies its activation or gradient in, as before; the rows give the host's queue
time beside the step time, for an A/B of the copies' host cost.

On the GPU machine (from the repository root):

    source .gpu-kit/setup.sh
    QEFFECT_GIT_REVISION=<rev> python3 benchmarks/staging_ab.py --config examples/configs/h4096.toml \
        --out $OUT/staging-ab-h4096-te.json

A CPU dry run: `--config src/qeffect/configs/tiny.toml --device cpu --path eager --steps 2 --warmup 1
--rounds 1`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from qeffect.cli.common import write_json
from qeffect.config import apply_sets, load_config
from qeffect.profile.matrix import (
    ConfigSpec,
    PipelineRunner,
    device_name_of,
    git_revision,
    initial_weights_drawn_once,
    merge_rounds,
    release_memory,
    te_version,
    time_runner,
)
from qeffect.profile.report import ConfigResult
from qeffect.runtime import build as build_mod

VARIANTS = ("by-liveness=pipeline.wgrad_staging=8,pipeline.wgrad_staging_by_liveness=true;"
            "fixed=pipeline.wgrad_staging=8,pipeline.wgrad_staging_by_liveness=false;"
            "by-liveness-2=pipeline.wgrad_staging=2,pipeline.wgrad_staging_by_liveness=true;"
            "unstaged=pipeline.wgrad_staging=0")


def parse_variants(text: str) -> list[tuple[str, list[str]]]:
    """``name=key=value,key=value;name=...`` -> [(name, ["key=value", ...])]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, eq, sets = part.partition("=")
        if not eq or not name:
            raise SystemExit(f"--variants: expected name=section.field=value,... in {part!r}")
        out.append((name, [s.strip() for s in sets.split(",") if s.strip()]))
    return out


def _runner(cfg: Any, device: torch.device, spec: ConfigSpec, made_regions: bool,
            unlinked: bool = False) -> PipelineRunner:
    """The profile's runner; `made_regions`: every rank's arena makes its regions now (a region asked for);
    `unlinked`: the stages get no hand-off buffers (each replay copies its input in)."""
    with mock.patch.object(build_mod, "link_stages", lambda ranks: 0) if unlinked else nullcontext():
        run = PipelineRunner(cfg, device, spec)
    for rank in run.pipe.ranks if made_regions else ():
        if rank.arena.accumulate:
            rank.arena.region(next(iter(rank.arena.specs)))
    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--path", default="captured-direct")
    ap.add_argument("--variants", default=VARIANTS, help="name=section.field=value,...;name=... (first: the base)")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--made-regions", default="", help="variants whose arenas make their regions at build")
    ap.add_argument("--unlinked", default="", help="variants built without hand-off buffers between stages")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    made = set(filter(None, a.made_regions.split(",")))
    unlinked = set(filter(None, a.unlinked.split(",")))
    cfg = load_config(a.config)
    over = {k: v for k, v in {"fp8.backend": a.backend, "train.device": a.device}.items() if v}
    cfg = cfg.with_overrides(**over) if over else cfg
    device = torch.device(cfg.train.device)
    variants = [(name, apply_sets(cfg, sets, source="--variants")) for name, sets in parse_variants(a.variants)]
    spec = ConfigSpec(a.path, "A/B of the staging depth", path=a.path)
    by: dict[str, list[ConfigResult]] = {name: [] for name, _ in variants}
    with initial_weights_drawn_once(cfg, device, print):
        for k in range(a.rounds):
            for name, c in variants:
                r = ConfigResult(name=name, description=f"{a.path}, {name}", status="ok",
                                 schedule=c.pipeline.schedule, path=a.path)
                print(f"round {k + 1}/{a.rounds}: {name}", flush=True)
                time_runner(r, lambda c=c, name=name: _runner(c, device, spec, name in made, name in unlinked),
                            device, steps=a.steps, warmup=a.warmup)
                by[name].append(r)
                release_memory(device)
    results = [merge_rounds(rs) for rs in by.values()]
    base = results[0]
    rows: list[dict[str, Any]] = []
    for (name, c), r in zip(variants, results, strict=True):
        ratios = [x / b for x, b in zip(r.round_medians, base.round_medians, strict=True)]
        rows.append({"name": name, "pipeline": c.pipeline.model_dump(), "median_step_seconds": r.median_step_seconds,
                     "round_medians": r.round_medians, "ratio_vs_first_by_round": ratios,
                     "ratio_vs_first": statistics.median(ratios), "peak_allocated_bytes": r.peak_allocated_bytes,
                     "arena_bytes": r.arena_bytes, "graphs_per_rank": r.graphs_per_rank,
                     "capture_host_seconds": r.capture_host_seconds, "host_median_seconds": r.host_median_seconds,
                     "host_phase_medians": r.host_phase_medians(),
                     "unlinked": name in unlinked, "losses_equal_first": r.losses == base.losses,
                     "result": r.model_dump(mode="json")})
        peak = (r.peak_allocated_bytes or 0) / 2**30
        print(f"{name}: median {r.median_step_seconds * 1e3:.2f} ms (rounds "
              f"{', '.join(f'{x * 1e3:.2f}' for x in r.round_medians)}), x{statistics.median(ratios):.3f} vs "
              f"{base.name}; host {(r.host_median_seconds or 0) * 1e3:.2f} ms; peak {peak:.2f} GiB, arena {(r.arena_bytes or 0) / 2**20:.0f} MiB, graphs per rank "
              f"{r.graphs_per_rank}", flush=True)
    same = all(row["losses_equal_first"] for row in rows)
    report = {"kind": "staging-ab", "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
              "git_revision": git_revision(), "device": device_name_of(device), "torch_version": torch.__version__,
              "te_version": te_version(), "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
              "config_path": a.config, "config": cfg.model_dump(), "path": a.path, "steps": a.steps,
              "warmup": a.warmup, "rounds": a.rounds, "losses_identical": same, "variants": rows}
    print(f"losses identical: {same}")
    if a.out:
        write_json(Path(a.out), report)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
