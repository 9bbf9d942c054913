"""Staged weight-gradient accumulation, A/B in one process: captured direct placement with
`pipeline.wgrad_staging` = 0 (add each microbatch's dW into the fp32 region as it comes) against
staged groups (one fused fold per group), on the same model and data.

    source .gpu-kit/setup.sh
    QEFFECT_GIT_REVISION=<rev> python3 benchmarks/staging_ab.py --config examples/configs/h4096.toml \
        --staging 0,4,8 --out $OUT/staging-ab-h4096-te-h200.json

Per setting: median step time (warm-up excluded), spread, peak allocated memory, arena bytes, and the
losses (which must be identical across settings: the fold has the same bits). Ratios are against the
first setting. A CPU dry run: `--device cpu --config src/qeffect/configs/tiny.toml --path eager`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from qeffect.cli.common import write_json
from qeffect.config import load_config
from qeffect.graphs.handshake import git_revision
from qeffect.profile.matrix import ConfigSpec, PipelineRunner, device_name_of, te_version, time_runner
from qeffect.profile.report import ConfigResult


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--path", default="captured-direct")
    ap.add_argument("--staging", default="0,4", help="comma-separated wgrad_staging values")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = load_config(args.config)
    over = {k: v for k, v in {"fp8.backend": args.backend, "train.device": args.device}.items() if v}
    cfg = cfg.with_overrides(**over) if over else cfg
    device = torch.device(cfg.train.device)
    values = [int(v) for v in args.staging.split(",")]
    spec = ConfigSpec("captured-direct", "A/B of wgrad_staging", path=args.path)
    rows = []
    for g in values:
        c = cfg.with_overrides(**{"pipeline.wgrad_staging": g})
        res = ConfigResult(name=f"staging={g}", description=spec.description, status="ok", schedule="interleaved",
                           path=args.path)
        time_runner(res, lambda c=c: PipelineRunner(c, device, spec), device, steps=args.steps, warmup=args.warmup)
        rows.append({"wgrad_staging": g, "median_step_seconds": res.median_step_seconds,
                     "step_seconds": res.step_seconds, "warmup_seconds": res.warmup_seconds,
                     "peak_allocated_bytes": res.peak_allocated_bytes, "arena_bytes": res.arena_bytes,
                     "persistent_growth_bytes_per_step": res.persistent_growth_bytes_per_step,
                     "losses": res.losses})
        print(f"wgrad_staging={g}: median {res.median_step_seconds * 1e3:.2f} ms, peak "
              f"{(res.peak_allocated_bytes or 0) / 2**30:.2f} GiB, arena {(res.arena_bytes or 0) / 2**20:.0f} MiB",
              flush=True)
    base = rows[0]["median_step_seconds"]
    for r in rows:
        r["ratio_vs_first"] = r["median_step_seconds"] / base
    same_losses = all(r["losses"] == rows[0]["losses"] for r in rows)
    report = {"command": " ".join(sys.argv), "git_revision": git_revision(), "device": device_name_of(device),
              "torch_version": torch.__version__, "te_version": te_version(), "config_path": args.config,
              "backend": cfg.fp8.backend, "path": args.path, "steps": args.steps, "warmup": args.warmup,
              "fused_fold": _fused_note(device), "losses_identical": same_losses, "settings": rows}
    print(json.dumps({"losses_identical": same_losses,
                      "ratios": {r["wgrad_staging"]: round(r["ratio_vs_first"], 4) for r in rows}}))
    if args.out:
        write_json(Path(args.out), report)
    return 0 if same_losses else 1


def _fused_note(device: torch.device) -> str:
    from qeffect.stage.accumulate import fused_available

    probe = torch.zeros(1, device=device)
    return "triton kernel" if fused_available(probe) else "copy_/add_ sequence"


if __name__ == "__main__":
    sys.exit(main())
