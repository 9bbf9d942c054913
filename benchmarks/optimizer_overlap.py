"""Can the optimizer's memory pass hide behind the step's GEMMs? Two CUDA graphs on two streams, one process.

Why: at h4096 a captured step is ~13 ms of GEMMs and ~8.5 ms of AdamW, run one after the other; issue 8's
2x against Transformer Engine's graphs needs less than their sum. This asks the hardware directly, with
no pipeline around it:

- ``gemms``: FP8 GEMMs of h4096's shapes at 256 tokens (qkv, fc1, fc2 forward; a weight-gradient-shaped
  product with a bf16 11008 x 4096 output), `--gemm-rounds` times, captured in one graph;
- ``optimizer``: torch's fused AdamW over `--tensors` fp32 tensors of `--elements` each, one graph.

Each alone, then both replayed at once on two streams with equal priorities, GEMMs on the higher-priority
stream, and the optimizer on it. Per arrangement: medians of `--reps` (CUDA events) of each alone, of both
(until both end), and when the GEMMs ended; ``hidden_ms`` = alone + alone - both.

    source .gpu-kit/setup.sh
    python3 benchmarks/optimizer_overlap.py --json $OUT/optimizer-overlap-h200.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from qeffect.cli.common import write_json
from qeffect.graphs.handshake import gpu_provenance
from qeffect.profile.matrix import te_version

E4M3 = torch.float8_e4m3fn


def _fp8(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, device="cuda") * scale).to(E4M3)


def make_gemms(rounds: int):
    one = torch.ones((), device="cuda")
    x, xf = _fp8(256, 4096), _fp8(256, 11008)
    w_qkv, w_fc1, w_fc2 = _fp8(12288, 4096, scale=0.05), _fp8(11008, 4096, scale=0.05), _fp8(4096, 11008, scale=0.05)
    g_t, x_t = _fp8(11008, 256), _fp8(4096, 256)

    def run() -> None:
        for _ in range(rounds):
            torch._scaled_mm(x, w_qkv.t(), one, one, out_dtype=torch.bfloat16)
            torch._scaled_mm(x, w_fc1.t(), one, one, out_dtype=torch.bfloat16)
            torch._scaled_mm(xf, w_fc2.t(), one, one, out_dtype=torch.bfloat16)
            torch._scaled_mm(g_t, x_t.t(), one, one, out_dtype=torch.bfloat16)  # weight-gradient shaped
    return run


def make_optimizer(tensors: int, elements: int):
    p, g = ([torch.randn(elements, device="cuda") for _ in range(tensors)] for _ in range(2))
    m, v = ([torch.zeros(elements, device="cuda") for _ in range(tensors)] for _ in range(2))
    steps = [torch.zeros((), device="cuda") for _ in range(tensors)]

    def run() -> None:
        torch._fused_adamw_(p, g, m, v, [], steps, amsgrad=False, lr=1e-4, beta1=0.9, beta2=0.95,
                            weight_decay=0.0, eps=1e-8, maximize=False)
    return run


def capture(fn, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm-up: kernels chosen and compiled outside the capture
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    return graph


def _event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


def time_alone(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        e0, e1 = _event(), _event()
        with torch.cuda.stream(stream):
            e0.record()
            graph.replay()
            e1.record()
        torch.cuda.synchronize()
        out.append(e0.elapsed_time(e1))
    return out


def time_both(g1, s1, g2, s2, reps: int) -> tuple[list[float], list[float]]:
    both, first = [], []
    for _ in range(reps):
        e0, e1, e2 = _event(), _event(), _event()
        torch.cuda.synchronize()
        with torch.cuda.stream(s1):
            e0.record()
        s2.wait_event(e0)
        with torch.cuda.stream(s1):
            g1.replay()
            e1.record()
        with torch.cuda.stream(s2):
            g2.replay()
            e2.record()
        torch.cuda.synchronize()
        both.append(max(e0.elapsed_time(e1), e0.elapsed_time(e2)))
        first.append(e0.elapsed_time(e1))
    return both, first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gemm-rounds", type=int, default=4)
    ap.add_argument("--tensors", type=int, default=5)
    ap.add_argument("--elements", type=int, default=40_000_000)
    ap.add_argument("--reps", type=int, default=21)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("optimizer_overlap.py needs CUDA")
    gemms, opt = make_gemms(a.gemm_rounds), make_optimizer(a.tensors, a.elements)
    lowest, highest = torch.cuda.Stream.priority_range()  # (0, -N): a lower number is a higher priority
    arrangements = {}
    for label, p_gemm, p_opt in (("same-priority", lowest, lowest), ("gemms-high", highest, lowest),
                                 ("optimizer-high", lowest, highest)):
        s1, s2 = torch.cuda.Stream(priority=p_gemm), torch.cuda.Stream(priority=p_opt)
        g1, g2 = capture(gemms, s1), capture(opt, s2)
        alone1, alone2 = time_alone(g1, s1, a.reps), time_alone(g2, s2, a.reps)
        both, first = time_both(g1, s1, g2, s2, a.reps)
        med = {k: statistics.median(v) for k, v in (("gemms_alone_ms", alone1), ("optimizer_alone_ms", alone2),
                                                     ("both_ms", both), ("gemms_done_ms", first))}
        med["hidden_ms"] = med["gemms_alone_ms"] + med["optimizer_alone_ms"] - med["both_ms"]
        arrangements[label] = {**med, "priorities": [p_gemm, p_opt],
                               "raw_ms": {"gemms_alone": alone1, "optimizer_alone": alone2, "both": both,
                                          "gemms_done": first}}
        print(label, {k: round(v, 3) for k, v in med.items()}, flush=True)
    report = {**gpu_provenance(), "te": te_version(), "gemm_rounds": a.gemm_rounds, "tensors": a.tensors,
              "elements": a.elements, "reps": a.reps, "arrangements": arrangements}
    if a.json:
        write_json(a.json, report)


if __name__ == "__main__":
    main()
