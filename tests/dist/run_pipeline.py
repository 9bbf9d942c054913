"""torchrun worker: run the distributed pipeline on synthetic data and save this rank's state.

Launched by tests/test_distributed.py (two-file pattern: this worker under torchrun + a pytest wrapper).
Each data-parallel replica gets its own synthetic batches; after every step the replicas compare their
parameters and FP8 state bit for bit with dp-rank 0 and record the result.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from qeffect.config import load_config
from qeffect.runtime.distributed import DistributedPipeline, init_from_env
from qeffect.verify.state import bits, synthetic_batches


def flat_state(pipe: DistributedPipeline) -> dict[str, torch.Tensor]:
    out = {}
    for s, chunk in pipe.rank.chunks.items():
        for n, p in chunk.named_parameters():
            out[f"s{s}.{n}"] = p.detach().clone()
        for k, v in chunk.fp8_state().items():
            out[f"s{s}.{k}"] = v.detach().clone()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--schedule", default="interleaved")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--config", default=None, help="run config TOML (default: the embedded tiny one)")
    ap.add_argument("--vocab-size", type=int, default=None, help="model.vocab_size (default: the config's)")
    ap.add_argument("--device", default="cpu", help="cpu (gloo) or cuda (NCCL, one GPU per process)")
    ap.add_argument("--path", default="eager", help="eager, captured-copy or captured-direct (cuda)")
    ap.add_argument("--untagged", action="store_true",
                    help="every message with tag 0: gloo then matches a pair's messages in posting order, as NCCL does")
    a = ap.parse_args()
    if a.untagged:
        from qeffect.runtime.distributed import P2PTransport

        P2PTransport._tag = lambda self, kind, stage, m: 0
    cfg = load_config(a.config).with_overrides(**{"pipeline.schedule": a.schedule, "pipeline.pp": a.pp,
                                                  "pipeline.dp": a.dp, "train.device": a.device})
    if a.vocab_size is not None:
        cfg = cfg.with_overrides(**{"model.vocab_size": a.vocab_size})
    init_from_env(a.device)
    pipe = DistributedPipeline(cfg, path=a.path)
    losses, replicas_equal, reductions_done = [], [], []
    for step in range(a.steps):
        batches = synthetic_batches(cfg, step + 1000 * pipe.topo.dp_rank, pipe.device)
        losses.append(pipe.step(batches))
        reductions_done.append(not pipe.reductions.pending())
        if a.dp > 1:  # every replica against dp-rank 0, bit for bit
            ok = True
            for name, t in sorted(flat_state(pipe).items()):
                ref = bits(t).clone()
                dist.broadcast(ref, src=pipe.topo.pp_rank, group=pipe.dp_group)  # dp-rank 0 of this stage
                ok &= torch.equal(ref, bits(t))
            replicas_equal.append(bool(ok))
    state = {k: v.cpu() for k, v in flat_state(pipe).items()}
    torch.save({"losses": [x.cpu() for x in losses], "state": state, "replicas_equal": replicas_equal,
                "reductions_done": reductions_done, "e_W": pipe.rank.clock.e_W,
                "reductions_run": pipe.reductions_run},
               f"{a.out}/rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
