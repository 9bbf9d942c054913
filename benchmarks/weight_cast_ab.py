"""The FP8 weight cast in one process: Transformer Engine's cast pass against the cast in the AdamW pass.

On a configuration's matrix weights (fp32 masters; the captured te path's staged gradient folded in the
update, as `fold-in-triton` in `adamw_ab.py`), per step:

- ``adamw``: `runtime.adamw.TritonAdamW` alone (no cast);
- ``te-cast``: Transformer Engine's delayed-scaling cast of every weight into its FP8 workspace (its
  `cast_transpose` kernel: what the first forward of a step runs when the optimizer does not cast);
- ``adamw+cast``: `TritonAdamW` with `cast_after_step` on every weight: the update writes the E4M3
  bytes, amax and 1 / scale in its pass, then `transpose_bytes` writes the transpose;
- ``adamw+rowwise``: the same without the transpose (what the pass itself costs);
- ``transpose[BMxBNxW]``: `transpose_bytes` alone per tile shape and warps (``--sweep``).

The comparison that matters: ``adamw+cast`` against ``adamw`` + ``te-cast``. Bits: after one step the
cast's bytes, transpose, 1 / scale and amax equal TE's cast of the same updated weights. CUDA events
around each variant's whole pass, medians of ``--reps`` after ``--warmup``, interleaved.

    source .gpu-kit/setup.sh
    python3 benchmarks/weight_cast_ab.py --config examples/configs/h4096.toml --json $OUT/weight-cast-kernels-h4096-h200.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
from adamw_ab import Variant, shapes_of  # benchmarks/ is sys.path[0] when this script runs

from qeffect.cli.common import write_json
from qeffect.config import load_config
from qeffect.fp8.fused_quantize import transpose_bytes
from qeffect.fp8.weight_cast import WeightCastTarget
from qeffect.graphs.handshake import gpu_provenance
from qeffect.profile.matrix import te_version
from qeffect.runtime import adamw

FP8 = torch.float8_e4m3fn
SWEEP = ((64, 64, 4), (64, 64, 8), (128, 64, 8), (64, 128, 8), (128, 128, 8), (128, 128, 16), (256, 64, 8))


def matrix_shapes(cfg) -> list[torch.Size]:
    shapes, matrix = shapes_of(cfg)
    return [shape for shape, staged in zip(shapes, matrix, strict=True) if staged]


def timed(fn) -> float:
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e-3


class Optim(Variant):
    """`adamw_ab.py`'s ``fold-in-triton`` on its own copy of the weights (the staged gradient folded in the
    update's pass), with every weight's cast registered (``cast``: "full" with, "rowwise" without transpose)."""

    def __init__(self, params, slots, cfg, cast: str | None) -> None:
        o = cfg.optim
        super().__init__("fold-in-triton", params, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay)
        self.slots = slots
        self.regions = [torch.empty_like(p) for p in params]
        self.targets = []
        for i, p in enumerate(self.params) if cast else ():
            rows, cols = p.shape
            t = WeightCastTarget(f"w{i}", p, torch.empty((rows, cols), dtype=FP8, device=p.device),
                                 torch.empty((cols, rows), dtype=FP8, device=p.device) if cast == "full" else None,
                                 torch.full((1,), 57.0, device=p.device), torch.zeros(1, device=p.device),
                                 torch.zeros(1, device=p.device))
            self.opt.cast_after_step(t)
            self.targets.append(t)

    def run(self) -> None:
        self.step(self.regions, self.slots, self.regions)


def te_caster(params: list[torch.Tensor]):
    """TE's cast of every weight into its own workspace, with scale 57 (the targets' scale)."""
    import transformer_engine.pytorch  # noqa: F401 - loads the library transformer_engine_torch needs
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    dev = params[0].device
    quantizers = [Float8Quantizer(torch.full((1,), 57.0, device=dev), torch.zeros(1, device=dev),
                                  tex.DType.kFloat8E4M3, rowwise=True, columnwise=True) for _ in params]
    workspaces = [q.quantize(p) for q, p in zip(quantizers, params, strict=True)]

    def run() -> None:
        for q, p, w in zip(quantizers, params, workspaces, strict=True):
            q.amax.zero_()
            q.update_quantized(p, w)

    return run, quantizers, workspaces


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/h4096.toml")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sweep", action="store_true", help="also time transpose_bytes per tile shape and warps")
    ap.add_argument("--iters", default="", help="also time adamw+cast per CAST_ITER, e.g. 1,4,8,16")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = load_config(a.config)
    shapes = matrix_shapes(cfg)
    gen = torch.Generator(device=dev).manual_seed(0)
    params = [torch.randn(s, device=dev, generator=gen) * 0.02 for s in shapes]
    staging = cfg.pipeline.microbatches
    slots = [torch.randn(staging, p.numel(), device=dev, generator=gen).mul_(1e-3).to(torch.bfloat16) for p in params]
    plain, full, rowwise = (Optim(params, slots, cfg, c) for c in (None, "full", "rowwise"))
    # bits: one step each, then TE's cast of the plain optimizer's weights against the fused cast's bytes
    plain.run()
    full.run()
    te_run, te_q, te_ws = te_caster(plain.params)
    te_run()
    torch.cuda.synchronize(dev)
    differ = {"weights": 0, "data": 0, "transpose": 0, "scale_inv": 0, "amax": 0}
    for p, t, q, w in zip(plain.params, full.targets, te_q, te_ws, strict=True):
        t.fold_pending_amax()
        differ["weights"] += not torch.equal(p, t.weight)
        differ["data"] += not torch.equal(w._data.view(torch.uint8), t.data.view(torch.uint8))
        differ["transpose"] += not torch.equal(w._transpose.view(torch.uint8), t.transpose.view(torch.uint8))
        differ["scale_inv"] += not torch.equal(w._scale_inv.view(-1), t.scale_inv.view(-1))
        differ["amax"] += not torch.equal(q.amax.view(-1), t.amax_row.view(-1))
    variants = {"adamw": plain.run, "te-cast": te_run, "adamw+cast": full.run, "adamw+rowwise": rowwise.run}
    qs = [t.data for t in full.targets]
    outs = [t.transpose for t in full.targets]
    default_iter = adamw.CAST_ITER

    def with_iter(k: int) -> None:
        adamw.CAST_ITER = k
        try:
            full.run()
        finally:
            adamw.CAST_ITER = default_iter

    for k in (int(x) for x in a.iters.split(",") if x):
        variants[f"adamw+cast[iter={k}]"] = lambda k=k: with_iter(k)
    for bm, bn, w in SWEEP if a.sweep else ():
        variants[f"transpose[{bm}x{bn}x{w}]"] = (
            lambda bm=bm, bn=bn, w=w: [transpose_bytes(q, out=o, block=(bm, bn, w)) for q, o in zip(qs, outs, strict=True)])
    for _ in range(a.warmup):
        for fn in variants.values():
            fn()
    times: dict[str, list[float]] = {n: [] for n in variants}
    for _ in range(a.reps):
        for n, fn in variants.items():
            times[n].append(timed(fn))
    med = {n: statistics.median(v) for n, v in times.items()}
    numel = sum(p.numel() for p in params)
    for n, m in med.items():
        print(f"{n:>24}: {m * 1e3:7.3f} ms")
    before, after = med["adamw"] + med["te-cast"], med["adamw+cast"]
    print(f"adamw + te-cast {before * 1e3:.3f} ms, adamw+cast {after * 1e3:.3f} ms: saves {(before - after) * 1e3:.3f} ms"
          f" (x{before / after:.3f}); bits differing: {differ}")
    report = {
        **gpu_provenance(dev), "te": te_version(), "config": a.config, "weights": len(params),
        "elements": numel, "cast_iter": adamw.CAST_ITER, "cast_transpose_block": adamw.CAST_TRANSPOSE_BLOCK,
        "warmup": a.warmup, "reps": a.reps, "bits_differing": differ,
        "median_seconds": med, "raw_seconds": times,
        "saves_seconds": before - after, "ratio": before / after,
    }
    if a.json:
        write_json(Path(a.json), report)
    return 0 if not any(differ.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
