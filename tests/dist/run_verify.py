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
    ap.add_argument("--vocab-size", type=int, default=None, help="model.vocab_size (default: the config's)")
    ap.add_argument("--nccl-order-fault", action="store_true",
                    help="the transport as it was: receive in the own program's order, tags ignored (NCCL's matching)")
    a = ap.parse_args()
    if a.nccl_order_fault:
        from qeffect.runtime.distributed import P2PTransport

        def get_in_own_order(self, kind, stage, m):  # noqa: ANN001, ANN202
            if (kind, stage, m) in self._local:
                return self._local.pop((kind, stage, m))
            return self._recv(self.schedule.stage_to_rank[stage], (kind, stage, m))

        P2PTransport._tag = lambda self, kind, stage, m: 0
        P2PTransport.get = get_in_own_order
        def finish_unchecked(self):  # noqa: ANN001, ANN202
            for w, _ in self._sends:
                w.wait()
            self._sends.clear()
            self._sent = dict.fromkeys(self._sent, 0)  # (the sends keep their checked order)

        P2PTransport.finish = finish_unchecked
    cfg = load_config().with_overrides(**{"pipeline.schedule": a.schedule, "pipeline.dp": a.dp})
    if a.vocab_size is not None:
        cfg = cfg.with_overrides(**{"model.vocab_size": a.vocab_size})
    init_from_env("cpu")
    report = run_verify_distributed(cfg, steps=a.steps, injection=a.inject)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            f.write(report.model_dump_json(indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
