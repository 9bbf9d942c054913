"""torchrun worker: `run_verify_distributed` on the tiny config, report written by rank 0 (with an
optional injection, to show the distributed oracle can fail)."""

from __future__ import annotations

import argparse

import torch.distributed as dist

from qeffect.config import load_config
from qeffect.runtime.distributed import init_from_env
from qeffect.verify.distributed import run_verify_distributed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="interleaved")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--inject", default=None)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    cfg = load_config().with_overrides(**{"pipeline.schedule": a.schedule, "pipeline.dp": a.dp})
    init_from_env("cpu")
    report = run_verify_distributed(cfg, steps=a.steps, injection=a.inject)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            f.write(report.model_dump_json(indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
