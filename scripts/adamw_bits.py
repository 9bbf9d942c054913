"""Which arithmetic does torch's fused AdamW kernel use for the parameter update? Candidates, compared bitwise.

`runtime/adamw.py` must give torch's bits. This takes one tensor through a few torch fused steps and, at
each, recomputes the update from the kernel's own moments with candidate formulas (separate torch ops on
the GPU, so no operation is fused or reassociated) and counts the elements where each differs from
torch's result. It also compares Triton's fp32 ``pow`` with torch's on the bias-correction powers:
they differ, which is why `runtime/adamw.py` takes the bias corrections from torch.

    source .gpu-kit/setup.sh
    python3 scripts/adamw_bits.py --json $OUT/adamw-bits.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from qeffect.cli.common import write_json
from qeffect.graphs.handshake import gpu_provenance
from qeffect.triton_lazy import triton_kernel


def torch_pow(base: float, steps: int) -> list[float]:
    b = torch.tensor(base, dtype=torch.float32, device="cuda")
    return [torch.pow(b, torch.tensor(float(s), device="cuda")).item() for s in range(1, steps + 1)]


@triton_kernel
def _pow_kernel(triton, tl):  # noqa: ANN001, ANN202 - builds a Triton JIT function
    from triton.language.extra import libdevice

    @triton.jit
    def pow_kernel(step_ptr, out_ptr, base):
        tl.store(out_ptr, libdevice.pow(base, tl.load(step_ptr)))

    return pow_kernel


def triton_pow(base: float, steps: int) -> list[float]:
    """Triton's fp32 ``pow`` (libdevice) of `base` to 1..steps, on the device."""
    out = []
    for s in range(1, steps + 1):
        o = torch.zeros(1, device="cuda")
        _pow_kernel()[(1,)](torch.tensor(float(s), device="cuda"), o, base)
        out.append(o.item())
    return out


def candidates(p0, m, v, step, lr, b1, b2, wd, eps) -> dict[str, torch.Tensor]:
    f = torch.float32
    dev = p0.device
    s = torch.tensor(float(step), dtype=f, device=dev)
    b1t, b2t = torch.tensor(b1, dtype=f, device=dev), torch.tensor(b2, dtype=f, device=dev)
    lr_t, eps_t = torch.tensor(lr, dtype=f, device=dev), torch.tensor(eps, dtype=f, device=dev)
    bc1 = {"pow-f32": 1 - torch.pow(b1t, s), "double": torch.tensor(1 - b1 ** step, dtype=f, device=dev)}
    bc2s = {"pow-f32": torch.sqrt(1 - torch.pow(b2t, s)),
            "double": torch.tensor((1 - b2 ** step) ** 0.5, dtype=f, device=dev)}
    p = p0 - lr_t * torch.tensor(wd, dtype=f, device=dev) * p0 if wd else p0
    out = {}
    for kb in ("pow-f32", "double"):
        ss = lr_t / bc1[kb]
        denom = torch.sqrt(v) / bc2s[kb] + eps_t
        out[f"{kb}: p - (ss*m)/d"] = p - (ss * m) / denom
        out[f"{kb}: p - ss*(m/d)"] = p - ss * (m / denom)
        out[f"{kb}: p - (ss*m)*(1/d)"] = p - (ss * m) * torch.reciprocal(denom)
        out[f"{kb}: p + (-ss)*(m/d)"] = torch.addcmul(p, -ss.expand_as(m), m / denom)
        out[f"{kb}: p - (ss/d)*m"] = p - (ss / denom) * m
        d2 = torch.sqrt(v) * torch.reciprocal(bc2s[kb]) + eps_t
        out[f"{kb}: d=sqrt(v)*(1/bc2s)+eps"] = p - (ss * m) / d2
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=1 << 22)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    lr, b1, b2, eps = 3e-4, 0.9, 0.95, 1e-8
    rows = []
    for wd in (0.0, 0.1):
        p = (torch.randn(a.numel, device=dev, generator=gen) * 0.02).requires_grad_(True)
        opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, fused=True)
        for step in range(1, a.steps + 1):
            g = torch.randn(a.numel, device=dev, generator=gen) * 1e-3
            before = p.detach().clone()
            p.grad = g
            opt.step()
            st = opt.state[p]
            cands = candidates(before, st["exp_avg"], st["exp_avg_sq"], step, lr, b1, b2, wd, eps)
            row = {"weight_decay": wd, "step": step,
                   "candidates": {k: int((c != p.detach()).sum()) for k, c in cands.items()}}
            rows.append(row)
            print(f"wd {wd} step {step}: " + ", ".join(f"{k}: {n}" for k, n in row["candidates"].items()))
    for step, (tri, ref) in enumerate(zip(triton_pow(0.95, a.steps), torch_pow(0.95, a.steps), strict=True), 1):
        rows.append({"pow_base": 0.95, "step": step, "triton_pow": tri, "torch_pow": ref})
        print(f"0.95**{step}: Triton pow {tri!r}, torch pow {ref!r}{'' if tri == ref else '  (differ)'}")
    if a.json:
        write_json(Path(a.json), {**gpu_provenance(dev), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
