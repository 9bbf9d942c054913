"""Matrix FLOPs of one optimizer step and the FP8 GEMM rate measured on the model's own shapes.

The compute floor of a step is the time its matrix products alone would take at the FP8 GEMM rate
this device reaches *on these shapes* (a head GEMM [256 x 2048 x 32768] runs nearer the peak than a
proj GEMM [256 x 2048 x 2048]), so each GEMM problem of the step is timed with `fp8_mm` (the
reference backend's one FP8 GEMM: `torch._scaled_mm` on CUDA) in the same process as the step
timings. Floor = sum over problems of (calls per step x measured seconds per call); its rate is the
step's matrix FLOPs over that floor.

Counting (what the brief fixes; `qeffect.model.flops`, shared with the training loop's MFU): every
backend linear (qkv, proj, fc1, fc2 per layer; the head once) costs 2 * N * in * out FLOPs forward and
twice that backward (dI's dgrad plus dW's wgrad), for N = microbatch_size * seq_len tokens per
microbatch, over all microbatches. Attention score products, norms and the optimizer are not matrix
FLOPs of this count.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable

import torch
from pydantic import BaseModel

from qeffect.config import RunConfig
from qeffect.model.flops import HEAD, LinearFlops, MatrixFlops, count_matrix_flops, linear_shapes

__all__ = ["HEAD", "Floor", "GemmRate", "LinearFlops", "MatrixFlops", "count_matrix_flops",
           "floor_of", "gemm_problems", "linear_shapes", "measure_gemm_rates", "time_call"]


class GemmRate(BaseModel):
    """One GEMM problem of the step: `a [m, k] x b [n, k]^T`, timed with `fp8_mm`."""

    linear: str
    role: str  # forward | dgrad | wgrad
    m: int
    n: int
    k: int
    a_dtype: str
    b_dtype: str
    out_dtype: str
    calls_per_step: int
    flops_per_call: int
    seconds_per_call: float  # median over timed repetitions
    repetitions: int
    tflops: float


class Floor(BaseModel):
    """The step's matrix-FLOP floor at the FP8 GEMM rate measured in this run."""

    seconds: float  # sum of calls x seconds over all problems
    seconds_layers_only: float  # the same without the head's problems
    effective_tflops: float  # total matrix FLOPs / seconds
    peak_tflops: float  # the fastest problem's rate


def gemm_problems(cfg: RunConfig, act_dtype: torch.dtype) -> list[dict]:
    """The three GEMMs of every linear, laid out as the reference backend calls `fp8_mm`.

    forward `x_q [N, in] (E4M3) x w_q [out, in] (E4M3)` -> activation dtype; dgrad
    `dy_q [N, out] (E5M2) x w_q_t [in, out] (E4M3)` -> activation dtype; wgrad
    `dy_q_t [out, N] (E5M2) x x_q_t [in, N] (E4M3)` -> fp32 (the master weight's dtype).
    """
    mc = cfg.model
    n = mc.microbatch_size * mc.seq_len
    mb = cfg.pipeline.microbatches
    e4, e5 = torch.float8_e4m3fn, torch.float8_e5m2
    out = []
    for name, fin, fout, count in linear_shapes(cfg):
        for role, (m, nn, k), (ad, bd), od in (
            ("forward", (n, fout, fin), (e4, e4), act_dtype),
            ("dgrad", (n, fin, fout), (e5, e4), act_dtype),
            ("wgrad", (fout, fin, n), (e5, e4), torch.float32),
        ):
            out.append(dict(linear=name, role=role, m=m, n=nn, k=k, a_dtype=ad, b_dtype=bd, out_dtype=od,
                            calls_per_step=count * mb))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, *, target_seconds: float,
              min_samples: int = 3, max_samples: int = 50, sample_seconds: float = 1e-3) -> tuple[float, int]:
    """Median seconds per call of `fn`, and the number of calls timed.

    Each sample times `inner` back-to-back calls between two device synchronizations, `inner` chosen
    so that a sample lasts about `sample_seconds`: a short GEMM timed alone would mostly measure the
    launch and the synchronization, and make the floor look slower than the device is.
    """
    fn()
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    single = max(time.perf_counter() - t0, 1e-9)
    inner = max(1, min(1000, math.ceil(sample_seconds / single)))
    samples: list[float] = []
    spent = 0.0
    while len(samples) < max_samples and (len(samples) < min_samples or spent < target_seconds):
        _sync(device)
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        _sync(device)
        dt = time.perf_counter() - t
        samples.append(dt / inner)
        spent += dt
    return statistics.median(samples), len(samples) * inner


def measure_gemm_rates(cfg: RunConfig, device: torch.device | str, act_dtype: torch.dtype, *,
                       target_seconds: float | None = None) -> list[GemmRate]:
    """Time every GEMM problem of the step with `fp8_mm` on `device` (random FP8 operands, unit scales)."""
    from qeffect.fp8.gemm import fp8_mm

    device = torch.device(device)
    if target_seconds is None:
        target_seconds = 0.05 if device.type == "cuda" else 0.02
    g = torch.Generator().manual_seed(0)
    one = torch.ones((), dtype=torch.float32, device=device)
    rates = []
    for p in gemm_problems(cfg, act_dtype):
        a = (torch.randn((p["m"], p["k"]), generator=g) * 0.5).to(device).to(p["a_dtype"])
        b = (torch.randn((p["n"], p["k"]), generator=g) * 0.5).to(device).to(p["b_dtype"])
        seconds, reps = time_call(lambda a=a, b=b, od=p["out_dtype"]: fp8_mm(a, one, b, one, od), device,
                                  target_seconds=target_seconds)
        flops = 2 * p["m"] * p["n"] * p["k"]
        rates.append(GemmRate(linear=p["linear"], role=p["role"], m=p["m"], n=p["n"], k=p["k"],
                              a_dtype=str(p["a_dtype"]).removeprefix("torch."),
                              b_dtype=str(p["b_dtype"]).removeprefix("torch."),
                              out_dtype=str(p["out_dtype"]).removeprefix("torch."),
                              calls_per_step=p["calls_per_step"], flops_per_call=flops, seconds_per_call=seconds,
                              repetitions=reps, tflops=flops / seconds / 1e12 if seconds > 0 else 0.0))
        del a, b
    return rates


def floor_of(rates: list[GemmRate], flops: MatrixFlops) -> Floor:
    """Floor = sum of calls x measured seconds; the layers-only floor leaves the head's problems out."""
    seconds = sum(r.calls_per_step * r.seconds_per_call for r in rates)
    layers = sum(r.calls_per_step * r.seconds_per_call for r in rates if r.linear != HEAD)
    return Floor(seconds=seconds, seconds_layers_only=layers,
                 effective_tflops=flops.total / seconds / 1e12 if seconds > 0 else 0.0,
                 peak_tflops=max((r.tflops for r in rates), default=0.0))
