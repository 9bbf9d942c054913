"""torchrun worker for tests/test_checkpoint_dist.py: multi-process save, quiescence and resume.

1. A premature checkpoint: global rank 0 alone holds a live tape; every process must refuse (the reasons
   are gathered) and nothing may be written.
2. Train `--save-at` steps, save with DCP from every process, train on to `--steps`.
3. Build a fresh pipeline in the same processes, load the checkpoint, train the same steps: every tensor
   (parameters, AdamW state, FP8 state) must equal the uninterrupted pipeline's bit for bit.
Each rank writes its findings to `<out>/rank<N>.json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch.distributed as dist

from qeffect.checkpoint import load_checkpoint, save_checkpoint
from qeffect.checkpoint.inspect import compare_tensors
from qeffect.checkpoint.state import local_view, tensor_state
from qeffect.config import load_config
from qeffect.contracts import CommitViolation
from qeffect.runtime.distributed import DistributedPipeline, init_from_env
from qeffect.verify.state import synthetic_batches


def snapshot(pipe: DistributedPipeline) -> dict:
    """Every tensor this process holds (`tensor_state` is empty on replicas other than 0: they save nothing)."""
    view = local_view(pipe)
    view.dp_rank = 0
    return {k: v.detach().clone() for k, v in tensor_state(view).items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--schedule", default="interleaved")
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--save-at", type=int, default=1)
    a = ap.parse_args()
    out = Path(a.out)
    cfg = load_config().with_overrides(**{"model.vocab_size": 256, "pipeline.schedule": a.schedule,
                                          "pipeline.pp": a.pp, "pipeline.dp": a.dp})
    init_from_env("cpu")
    me = dist.get_rank()
    result: dict = {}

    def batches(pipe: DistributedPipeline, step: int):
        return synthetic_batches(cfg, step + 1000 * pipe.topo.dp_rank, "cpu")

    # 1. premature checkpoint, refused everywhere
    early = DistributedPipeline(cfg)
    if me == 0:
        action = early.program[0]
        early.rank.run(action, batches(early, 0), early.transport)
    try:
        save_checkpoint(early, out / "premature", cfg)
        result["premature"] = "written"
    except CommitViolation as err:
        result["premature"] = err.relation
    dist.barrier()
    result["premature_written"] = any(p.name.startswith("premature") for p in out.iterdir())

    # 2. uninterrupted, with a save on the way
    pipe = DistributedPipeline(cfg)
    for step in range(a.save_at):
        pipe.step(batches(pipe, step))
    save_checkpoint(pipe, out / "ck", cfg)
    for step in range(a.save_at, a.steps):
        pipe.step(batches(pipe, step))

    # 3. fresh pipeline, load, same steps
    fresh = DistributedPipeline(cfg)
    payload = load_checkpoint(fresh, out / "ck", cfg)
    result["loaded_step"] = payload.step
    result["e_W"] = fresh.rank.clock.e_W
    for step in range(a.save_at, a.steps):
        fresh.step(batches(fresh, step))
    ref, got = snapshot(pipe), snapshot(fresh)
    result["keys"] = len(ref)
    result["same_keys"] = sorted(ref) == sorted(got)
    result["differing"] = [d.key for d in compare_tensors(ref, got)]
    (out / f"rank{me}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
