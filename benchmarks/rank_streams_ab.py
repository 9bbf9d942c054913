"""A/B of a runtime switch (`--field`) at h2048 and h4096, in one process: `runtime.rank_streams` (each rank
on its own CUDA stream vs one stream, the default), `runtime.step_graph` (a step's actions as one
recorded graph vs launched one by one), `runtime.graph_pools` (shared vs private graph memory pools) or
`pipeline.wgrad_accumulation` (fused fp32 accumulation vs bf16 GEMM output added; other numerics, so the
losses differ). Each variant's peak allocated and reserved memory are in the report.

The two variants of captured-direct are timed in interleaved rounds (A B A B A B), each round building,
warming up and timing both again (`qeffect.profile.matrix.time_runner`, the profile's own timer: device
synchronized around every step, the host's queue time measured before the closing synchronization). The
result per variant is the median of its round medians; the A/B ratio is the median of the per-round ratios
(off / on: above 1, the switch on is faster). Losses must be equal bit for bit between the variants of a
runtime switch (same arithmetic, only the streams, launches or pools differ).

On the H200 (from the repository root):

    source .gpu-kit/setup.sh
    python3 benchmarks/rank_streams_ab.py --out $OUT --rounds 3 --trace 2

A dry run on a CPU (no rank streams there: both variants run the same eager path):
`--tomls src/qeffect/configs/tiny.toml --device cpu --path eager --steps 2 --warmup 1 --rounds 2 --trace 0`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from qeffect.config import RunConfig, apply_sets, bit_changing_fields, load_config
from qeffect.profile.flops import count_matrix_flops, floor_of
from qeffect.profile.matrix import (
    ConfigSpec,
    PipelineRunner,
    derive_ratios,
    device_name_of,
    device_tag,
    git_revision,
    initial_weights_drawn_once,
    merge_rounds,
    release_memory,
    time_runner,
)
from qeffect.profile.report import ConfigResult

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TOMLS = f"{ROOT / 'examples/configs/h2048.toml'},{ROOT / 'examples/configs/h4096.toml'}"
VARIANTS = {"runtime.rank_streams": (("rank-streams", True), ("one-stream", False)),
            "runtime.step_graph": (("step-graph", True), ("launched", False)),
            "runtime.graph_pools": (("shared-pools", "shared"), ("private-pools", "private")),
            # other numerics (each bitwise equal to its own native eager): losses differ by design
            "pipeline.wgrad_accumulation": (("fused", "fused"), ("add", "add"))}  # (on, off)


def ab(cfg: RunConfig, *, field: str = "runtime.rank_streams", path: str = "captured-direct", steps: int = 20,
       warmup: int = 5, rounds: int = 3, trace_steps: int = 0, say=print) -> dict[str, Any]:
    """Both variants in `rounds` interleaved rounds; the report as a JSON-ready dict."""
    device = torch.device(cfg.train.device)
    variants = VARIANTS[field]
    by: dict[str, list[ConfigResult]] = {name: [] for name, _ in variants}
    with initial_weights_drawn_once(cfg, device, say):
        for k in range(rounds):
            for name, on in variants:
                c = cfg.with_overrides(**{field: on})
                # the profile's runner sets runtime.step_graph from its spec, whatever the config says
                spec = ConfigSpec(path, f"{path}, Interleaved 1F1B", path=path, step_graph=c.runtime.step_graph)
                r = ConfigResult(name=name, description=f"{path}, {field} = {str(on).lower()}",
                                 status="ok", schedule="interleaved", path=path)
                say(f"round {k + 1}/{rounds}: {name}")
                time_runner(r, lambda c=c, spec=spec: PipelineRunner(c, device, spec), device, steps=steps, warmup=warmup,
                            trace_steps=trace_steps if k == rounds - 1 else 0)
                by[name].append(r)
                release_memory(device)
    results = [merge_rounds(rs) for rs in by.values()]
    derive_ratios(results, floor_of([], count_matrix_flops(cfg)))  # host/GPU ratios (no floor measured here)
    on, off = results
    ratios = [b / a for a, b in zip(on.round_medians, off.round_medians, strict=True)]
    return {
        "kind": f"{field.split('.')[1].replace('_', '-')}-ab", "field": field, "git_revision": git_revision(),
        "device": device.type,
        "device_name": device_name_of(device), "torch_version": torch.__version__,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "config": cfg.model_dump(),
        "path": path, "steps": steps, "warmup": warmup, "rounds": rounds, "trace_steps": trace_steps,
        "off_over_on_by_round": ratios, "off_over_on": statistics.median(ratios),
        "losses_equal": on.losses == off.losses,
        "results": [r.model_dump(mode="json") for r in results],
    }


def _line(r: dict[str, Any]) -> str:
    host = r["host_median_seconds"]
    return (f"{r['name']}: median {r['median_step_seconds'] * 1e3:.2f} ms over rounds "
            f"{', '.join(f'{x * 1e3:.2f}' for x in r['round_medians'])}; host queues a step in "
            f"{host * 1e3:.2f} ms (host/GPU {r['host_gpu_ratio']:.2f}, {r['host_gpu_basis']})"
            + ("" if r.get("peak_reserved_bytes") is None else
               f"; peak allocated {r['peak_allocated_bytes'] / 2**30:.2f} GiB, reserved "
               f"{r['peak_reserved_bytes'] / 2**30:.2f} GiB"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tomls", default=DEFAULT_TOMLS, help="comma-separated config files")
    ap.add_argument("--field", default="runtime.rank_streams", choices=sorted(VARIANTS),
                    help="the runtime switch compared, on against off")
    ap.add_argument("--backend", default="te")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--path", default="captured-direct", help="captured-direct, captured-copy (eager: a CPU dry run)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--trace", type=int, default=2, help="profiled steps per variant in the last round (0: none)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="a config override for both variants, as `qeffect train --set` takes it; repeatable")
    ap.add_argument("--tag", default="", help="added to each report's file name (runs with other --set values)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    a = ap.parse_args(argv)
    from qeffect.cli.common import write_json

    ok = True
    for toml in a.tomls.split(","):
        stem = Path(toml).stem
        cfg = apply_sets(load_config(toml).with_overrides(**{"fp8.backend": a.backend, "train.device": a.device}),
                         a.set)
        report = ab(cfg, field=a.field, path=a.path, steps=a.steps, warmup=a.warmup, rounds=a.rounds, trace_steps=a.trace,
                    say=lambda msg, s=stem: print(f"[{s}] {msg}", flush=True))
        tag = f"-{a.tag}" if a.tag else ""
        out = Path(a.out) / f"{report['kind']}-{stem}{tag}-{a.backend}-{device_tag(a.device)}.json"
        write_json(out, report)
        (on, _), (off, _) = VARIANTS[a.field]
        print(f"{stem}: {off} / {on} = {report['off_over_on']:.3f} (by round "
              f"{', '.join(f'{x:.3f}' for x in report['off_over_on_by_round'])}); losses equal: "
              f"{report['losses_equal']} -> {out}", flush=True)
        for r in report["results"]:
            print("  " + _line(r), flush=True)
        ok &= report["losses_equal"] or a.field in bit_changing_fields()  # other numerics: other losses
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
