"""Captured fresh-process resume on the GPU (issue 6): save at step 3, resume in a new process, run to 8.

    python3 scripts/gpu_resume_check.py run --steps 8 --dir D/full          # uninterrupted
    python3 scripts/gpu_resume_check.py run --steps 3 --dir D/part          # first process
    python3 scripts/gpu_resume_check.py run --steps 8 --dir D/resumed --resume D/part/step-3
    python3 scripts/gpu_resume_check.py diff D/full/step-8 D/resumed/step-8 --json OUT.json

Every run is captured (direct placement) on synthetic data per step. A resumed run builds the pipeline
without graphs, loads the checkpoint (numerical state restored before any graph exists, weight caches
invalidated), then captures, then continues.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from qeffect.checkpoint import diff_checkpoints, load_checkpoint, save_checkpoint
from qeffect.config import load_config
from qeffect.runtime.build import build_single_process, capture_graphs
from qeffect.verify.state import synthetic_batches


def run(a: argparse.Namespace) -> None:
    cfg = load_config(a.config).with_overrides(**{"train.device": a.device, "fp8.backend": a.backend,
                                                   "pipeline.schedule": a.schedule})
    torch.manual_seed(cfg.train.seed)  # as `qeffect train` does: the saved RNG state must match
    pipe = build_single_process(cfg, native=False, path=a.path, capture=False)
    start = 0
    if a.resume:
        payload = load_checkpoint(pipe, a.resume, cfg)
        start = payload.step
    capture_graphs(cfg, pipe)
    losses = {}
    for step in range(start, a.steps):
        losses[step + 1] = float(pipe.step(synthetic_batches(cfg, step, a.device)))
    save_checkpoint(pipe, f"{a.dir}/step-{a.steps}", cfg)
    print(json.dumps({"dir": a.dir, "start": start, "losses": losses}))


def diff(a: argparse.Namespace) -> int:
    d = diff_checkpoints(a.a, a.b)
    out = {"identical": d.identical, "tensors_compared": d.tensors_compared,
           "tensors_differing": [t.model_dump() for t in d.tensors_differing][:20],
           "state_differences": d.state_differences,
           "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    print(json.dumps(out))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if d.identical else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--config", default=None)
    r.add_argument("--backend", default="reference")
    r.add_argument("--schedule", default="interleaved")
    r.add_argument("--steps", type=int, required=True)
    r.add_argument("--dir", required=True)
    r.add_argument("--resume", default=None)
    r.add_argument("--device", default="cuda")
    r.add_argument("--path", default="captured-direct")
    d = sub.add_parser("diff")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--json", default=None)
    a = ap.parse_args()
    if a.cmd == "run":
        run(a)
        return 0
    return diff(a)


if __name__ == "__main__":
    sys.exit(main())
