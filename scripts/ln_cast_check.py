"""Can the LayerNorm's two casts go? `F.layer_norm` on the bf16 activation with fp32 parameters, against
the model's form (`model/gpt._layer_norm`: upcast, fp32 LayerNorm, downcast), on one GPU.

The h4096 te step runs 72 of these LayerNorms (2 per layer and microbatch, plus the final one); each
costs two cast kernels forward and two backward. Dropping them is worth doing only if the mixed-dtype
call exists on CUDA and gives the same bits (forward output, input gradient, parameter gradients). This
checks both, and sums each form's kernel time and count for one forward and backward (torch profiler).

    source .gpu-kit/setup.sh; python3 scripts/ln_cast_check.py --json $OUT/ln-cast-check-h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from qeffect.cli.common import write_json
from qeffect.graphs.handshake import script_provenance
from qeffect.model.gpt import _layer_norm

EPS = 1e-5  # nn.LayerNorm's default, the model's


def cast_form(x, w, b):
    """The model's own LayerNorm (`model.gpt._layer_norm`) with these parameters."""
    return _layer_norm(SimpleNamespace(normalized_shape=(x.shape[-1],), weight=w, bias=b, eps=EPS), x)


def mixed_form(x, w, b):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


def leaves(x0, w0, b0):
    """Fresh leaf copies of the inputs (made outside the profiled region: their copies are not the form's)."""
    return tuple(t.detach().clone().requires_grad_(True) for t in (x0, w0, b0))


def run(form, inputs, gy):
    x, w, b = inputs
    y = form(x, w, b)
    y.backward(gy)
    return y.detach(), x.grad, w.grad, b.grad


def kernel_time(form, x0, w0, b0, gy, reps: int = 20) -> dict:
    for _ in range(3):
        run(form, leaves(x0, w0, b0), gy)
    inputs = [leaves(x0, w0, b0) for _ in range(reps)]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for leaf in inputs:
            run(form, leaf, gy)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return {"kernels_per_call": len(kernels) / reps,
            "kernel_us_per_call": sum(e.device_time_total for e in kernels) / reps,
            "names": sorted({e.name[:80] for e in kernels})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256, help="tokens per microbatch (h4096: 1 x 256)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("ln_cast_check: no CUDA device", file=sys.stderr)
        return 2
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(a.rows, a.hidden, device="cuda", generator=g).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(a.hidden, device="cuda", generator=g)
    b = 0.1 * torch.randn(a.hidden, device="cuda", generator=g)
    gy = torch.randn(a.rows, a.hidden, device="cuda", generator=g).to(torch.bfloat16)
    result: dict = {**script_provenance(),
                    "device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "rows": a.rows, "hidden": a.hidden}
    ref = run(cast_form, leaves(x, w, b), gy)
    try:
        got = run(mixed_form, leaves(x, w, b), gy)
    except RuntimeError as err:
        result["mixed_dtype_supported"] = False
        result["error"] = str(err).splitlines()[0]
    else:
        result["mixed_dtype_supported"] = True
        result["dtypes"] = [str(t.dtype) for t in got]
        result["bitwise_equal"] = {n: bool(r.dtype == t.dtype and torch.equal(r, t))
                                   for n, r, t in zip(("y", "dx", "dw", "db"), ref, got, strict=True)}
        result["mixed"] = kernel_time(mixed_form, x, w, b, gy)
    result["cast"] = kernel_time(cast_form, x, w, b, gy)
    print(json.dumps({k: v for k, v in result.items() if k not in ("cast", "mixed")}))
    for form in ("cast", "mixed"):
        if form in result:
            r = result[form]
            print(f"{form}: {r['kernels_per_call']:.0f} kernels, {r['kernel_us_per_call']:.1f} us per forward+backward")
    if a.json:
        write_json(Path(a.json), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
