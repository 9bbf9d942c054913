"""AdamW A/B in one process: torch's fused AdamW against qeffect's Triton pass, with and without the fold.

On a configuration's real parameter shapes (every stage's parameters; fp32 masters, bf16 staging slots
of the matrix weights, as the captured te path stages them), the same random gradients feed:

- ``torch-fused``: `torch.optim.AdamW(fused=True)` on gradients already in fp32 (what native runs);
- ``fold+torch-fused``: the staged fold (`stage.accumulate.fold_staged`) then torch's AdamW (what a
  captured qeffect step runs today);
- ``triton``: `runtime.adamw.TritonAdamW` on the fp32 gradients;
- ``fold+triton``: the fold then `TritonAdamW` as two passes;
- ``fold-in-triton``: `TritonAdamW.fold_into_step`, the fold inside the update's pass (what a captured
  qeffect step runs since the fold moved into the optimizer). ``--fold-sweep`` times it per
  ``FOLD_BLOCK`` x ``FOLD_WARPS`` too.

Bits: after every step each variant's parameters and both moments are compared with ``torch-fused``'s
(``torch.equal``), with the config's weight decay and with 0.1. Timings: CUDA events around each variant's whole
update, medians of ``--reps`` after ``--warmup``, and the bytes each moves per second.

    source .gpu-kit/setup.sh
    python3 benchmarks/adamw_ab.py --config examples/configs/h4096.toml --json $OUT/adamw-ab-h4096-h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from functools import partial
from pathlib import Path

import torch

from qeffect.cli.common import write_json
from qeffect.config import load_config
from qeffect.graphs.handshake import script_provenance
from qeffect.profile.matrix import te_version
from qeffect.runtime.adamw import TritonAdamW
from qeffect.runtime.build import build_chunks_for
from qeffect.stage.accumulate import fold_staged


def shapes_of(cfg) -> tuple[list[torch.Size], list[bool]]:
    """Every parameter's shape, and whether it is a matrix weight (staged), from the model on `meta`."""
    chunks = build_chunks_for(cfg.with_overrides(**{"fp8.backend": "reference"}), "meta")
    shapes, matrix = [], []
    for chunk in chunks.values():
        staged = {id(p) for p in chunk.matrix_params().values()}
        for p in chunk.parameters():
            shapes.append(p.shape)
            matrix.append(id(p) in staged)
    return shapes, matrix


class Variant:
    """One optimizer over its own copy of the parameters; ``fold``: its gradients are folded first."""

    def __init__(self, name: str, params: list[torch.Tensor], lr: float, betas: tuple[float, float], eps: float,
                 wd: float) -> None:
        self.name = name
        self.fold = name.startswith("fold")
        self.fused = name == "fold-in-triton"
        self.params = [p.detach().clone().requires_grad_(True) for p in params]
        cls = TritonAdamW if "triton" in name else partial(torch.optim.AdamW, fused=True)
        self.opt = cls(self.params, lr=lr, betas=betas, eps=eps, weight_decay=wd)

    def state(self) -> list[torch.Tensor]:
        return [t for p in self.params for t in (p, self.opt.state[p]["exp_avg"], self.opt.state[p]["exp_avg_sq"])]

    def step(self, grads: list[torch.Tensor], slots: list[torch.Tensor | None], regions: list[torch.Tensor]) -> None:
        for p, g, s, r in zip(self.params, grads, slots, regions, strict=True):
            if self.fused and s is not None:
                p.grad = r
                self.opt.fold_into_step(p, s, s.shape[0], True)
            elif self.fold and s is not None:
                fold_staged(r, s, s.shape[0], True)
                p.grad = r
            else:
                p.grad = g
        self.opt.step()

    def timed_step(self, grads: list[torch.Tensor], slots: list[torch.Tensor | None],
                   regions: list[torch.Tensor]) -> float:
        """One `step` between CUDA events: its device seconds."""
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        self.step(grads, slots, regions)
        e.record()
        e.synchronize()
        return s.elapsed_time(e) * 1e-3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/h4096.toml")
    ap.add_argument("--bit-steps", type=int, default=4, help="steps compared bit for bit per weight decay")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--fold-sweep", action="store_true", help="also time fold-in-triton per block x warps")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = load_config(a.config)
    o = cfg.optim
    shapes, matrix = shapes_of(cfg)
    staging = cfg.pipeline.microbatches
    gen = torch.Generator(device=dev).manual_seed(0)
    params = [torch.randn(s, device=dev, generator=gen) * 0.02 for s in shapes]
    names = ("torch-fused", "fold+torch-fused", "triton", "fold+triton", "fold-in-triton")
    # slots: bf16 staging of each matrix weight; grads: their fold (the gradient every variant sees)
    slots = [torch.randn(staging, p.numel(), device=dev, generator=gen).mul_(1e-3).to(torch.bfloat16) if mx else None
             for p, mx in zip(params, matrix, strict=True)]
    regions = [torch.empty_like(p) for p in params]
    grads = []
    for p, s in zip(params, slots, strict=True):
        if s is None:
            grads.append(torch.randn(p.shape, device=dev, generator=gen) * 1e-3)
        else:
            g = torch.empty_like(p)
            fold_staged(g, s, staging, True)
            grads.append(g)
    bits = []
    for wd in sorted({o.weight_decay, 0.1}):
        variants = [Variant(n, params, o.lr, (o.beta1, o.beta2), o.eps, wd) for n in names]
        for step in range(1, a.bit_steps + 1):
            for v in variants:
                v.step(grads, slots, regions)
            ref = variants[0]
            for v in variants[1:]:
                diff = sum(int(not torch.equal(x, y)) for x, y in zip(ref.state(), v.state(), strict=True))
                bits.append({"weight_decay": wd, "step": step, "variant": v.name, "tensors_differing": diff,
                             "tensors": 3 * len(params)})
        del variants
    torch.cuda.synchronize(dev)
    timings = {}
    variants = [Variant(n, params, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay) for n in names]
    for _ in range(a.warmup):
        for v in variants:
            v.step(grads, slots, regions)
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(a.reps):  # interleaved, so drift hits every variant alike
        for v in variants:
            times[v.name].append(v.timed_step(grads, slots, regions))
    n_all = sum(p.numel() for p in params)
    n_staged = sum(p.numel() for p, mx in zip(params, matrix, strict=True) if mx)
    fold_bytes = (2 * staging + 4) * n_staged  # read the bf16 slots, write the fp32 region
    moved = {n: 28 * n_all + (fold_bytes if n.startswith("fold+") else 0) for n in names}
    moved["fold-in-triton"] = 28 * n_all + (2 * staging - 4) * n_staged  # slots read, the fp32 gradient never
    base = statistics.median(times["fold+torch-fused"])
    for n in names:
        med = statistics.median(times[n])
        timings[n] = {"median_seconds": med, "seconds": times[n], "bytes": moved[n],
                      "tb_per_s": moved[n] / med / 1e12, "ratio_to_fold+torch-fused": med / base}
        print(f"{n:18s} median {med * 1e3:7.3f} ms  {moved[n] / med / 1e12:5.2f} TB/s  x{med / base:.3f}")
    sweep = []
    if a.fold_sweep:
        import qeffect.runtime.adamw as adamw_mod

        v = next(v for v in variants if v.name == "fold-in-triton")
        for block in (1024, 2048, 4096, 8192):
            for warps in (4, 8, 16):
                adamw_mod.FOLD_BLOCK, adamw_mod.FOLD_WARPS = block, warps
                for _ in range(2):
                    v.step(grads, slots, regions)
                ts = [v.timed_step(grads, slots, regions) for _ in range(a.reps)]
                med = statistics.median(ts)
                sweep.append({"block": block, "warps": warps, "median_seconds": med, "seconds": ts,
                              "tb_per_s": moved["fold-in-triton"] / med / 1e12})
                print(f"sweep fold-in-triton block {block:5d} warps {warps:2d}: {med * 1e3:7.3f} ms "
                      f"{moved['fold-in-triton'] / med / 1e12:5.2f} TB/s")
    worst = {}
    for b in bits:
        k = (b["variant"], b["weight_decay"])
        worst[k] = max(worst.get(k, 0), b["tensors_differing"])
    for (n, wd), w in sorted(worst.items()):
        print(f"bits: {n:18s} weight_decay {wd}: {'bitwise equal to torch-fused' if w == 0 else f'{w} tensor(s) differ'}"
              f" over {a.bit_steps} steps")
    if a.json:
        write_json(Path(a.json), {**script_provenance(), "device": torch.cuda.get_device_name(dev),
                                  "torch_version": torch.__version__, "te_version": te_version(),
                                  "config": a.config, "parameters": n_all, "staged_parameters": n_staged,
                                  "staging_slots": staging, "timings": timings, "fold_sweep": sweep, "bits": bits})
    return 0


if __name__ == "__main__":
    sys.exit(main())
