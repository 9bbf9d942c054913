"""The Triton LayerNorm's backward: rows per program and the partial sums' reduction, timed in graphs.

Why: a captured h4096 step runs 80 LayerNorm backwards (8.7 us each) and 80 reductions of their partial
weight and bias gradients (4.7 us each in torch's reduction kernel). Rows per program sets how many
programs there are (256 rows at 4 per program is 64 programs on 132 SMs) and how large the partial
array is; the reduction is a launch-bound pass over it. Both change the model's bits, for native eager
and every qeffect path alike (the model code is shared), so the choice is free but must be one.

Per shape, rows per program and reduction (torch's ``part.sum(0)`` or the Triton tile sum): backward
plus reduction captured `--calls` times in one CUDA graph, the median of `--reps` timed replays, per
call; and the Triton sum's largest relative difference from a float64 sum.

    source .gpu-kit/setup.sh
    python3 benchmarks/layernorm_backward.py --json $OUT/layernorm-backward-h200.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from qeffect.cli.common import write_json
from qeffect.graphs.handshake import gpu_provenance
from qeffect.model import layernorm

SHAPES = {"h4096": (256, 4096), "h2048": (256, 2048)}
ROWS = (1, 2, 4, 8)


def _torch_sum(part: torch.Tensor) -> torch.Tensor:
    return part.sum(0)


def measure(rows: int, hidden: int, per_program: int, reducer, calls: int, reps: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    dy = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    w = 1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen)
    mean = x.float().mean(1)
    rstd = torch.rsqrt(x.float().var(1, unbiased=False) + 1e-5)
    old_rows, old_sum = layernorm.ROWS_PER_PROGRAM, layernorm._sum_partials
    layernorm.ROWS_PER_PROGRAM, layernorm._sum_partials = per_program, reducer
    try:
        first = layernorm._backward(dy, None, x, w, mean, rstd)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                outs = [layernorm._backward(dy, None, x, w, mean, rstd) for _ in range(calls)]
        torch.cuda.current_stream().wait_stream(stream)
    finally:
        layernorm.ROWS_PER_PROGRAM, layernorm._sum_partials = old_rows, old_sum
    graph.replay()
    torch.cuda.synchronize()
    same = all(torch.equal(a, b) for out in outs for a, b in zip(first, out, strict=True))
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / calls * 1e3)
    return {"rows_per_program": per_program, "reduction": "torch" if reducer is _torch_sum else "triton",
            "median_us_per_call": statistics.median(times), "raw_us_per_call": times,
            "captured_same_bits": same}


def sum_error(rows: int, hidden: int, per_program: int) -> float:
    """The Triton sum's largest difference from a float64 sum of the same partials, relative to the
    largest magnitude of that sum."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    part = torch.randn(-(-rows // per_program), 2, hidden, device="cuda", generator=gen)
    want = part.double().sum(0)
    return float((layernorm._sum_partials(part).double() - want).abs().max() / want.abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, required=True, help="where to write the results")
    ap.add_argument("--calls", type=int, default=40, help="backwards per graph")
    ap.add_argument("--reps", type=int, default=30, help="timed replays")
    args = ap.parse_args()
    results = {}
    for name, (rows, hidden) in SHAPES.items():
        cases = [measure(rows, hidden, r, red, args.calls, args.reps)
                 for r in ROWS for red in (_torch_sum, layernorm._sum_partials)]
        base = next(c for c in cases if c["rows_per_program"] == 4 and c["reduction"] == "torch")
        for c in cases:
            c["ratio_to_4_rows_torch_sum"] = c["median_us_per_call"] / base["median_us_per_call"]
            print(f"{name} rows/program {c['rows_per_program']} {c['reduction']:6s} "
                  f"{c['median_us_per_call']:7.2f} us  x{c['ratio_to_4_rows_torch_sum']:.3f}  "
                  f"captured bits {c['captured_same_bits']}")
        results[name] = {"rows": rows, "hidden": hidden, "cases": cases,
                         "triton_sum_relative_error": {r: sum_error(rows, hidden, r) for r in ROWS}}
    write_json(args.json, {"command": "python3 benchmarks/layernorm_backward.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items()), **gpu_provenance(), "shapes": results})


if __name__ == "__main__":
    main()
