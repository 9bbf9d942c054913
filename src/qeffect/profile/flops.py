"""Matrix FLOPs of one optimizer step and the FP8 GEMM rate measured on the model's own shapes.

The compute floor of a step is the time its matrix products alone would take at the FP8 GEMM rate
this device reaches *on these shapes* (a head GEMM [256 x 2048 x 32768] runs nearer the peak than a
proj GEMM [256 x 2048 x 2048]), so each GEMM problem of the step is timed with `fp8_mm` (the
reference backend's one FP8 GEMM: `torch._scaled_mm` on CUDA) in the same process as the step
timings. Floor = sum over problems of (calls per step x measured seconds per call); its rate is the
step's matrix FLOPs over that floor.

Floors are lower bounds, each named by its method in the report (`Floor`): (a) the GEMM floor: each
problem timed inside a CUDA graph of several calls, replayed many times back to back and timed with
device events, so no launch or host cost is in it (CPU: eager back-to-back calls, said so); (b) the
peak-rate floor: the step's matrix FLOPs at the FP8 rate of one large square GEMM timed the same way;
(c) the optimizer floor: the bytes AdamW must read and write (parameter, gradient, two moments read;
parameter and moments written) at the bandwidth of one large device copy. The limit is (b) + (c).

Counting (what the brief fixes; `qeffect.model.flops`, shared with the training loop's MFU): every
backend linear (qkv, proj, fc1, fc2 per GPT layer; qkv, proj, gate, up, down per Llama layer; the head
once) costs 2 * N * in * out FLOPs forward and twice that backward (dI's dgrad plus dW's wgrad), for N = microbatch_size * seq_len tokens per
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
from qeffect.runtime.lazy_rows import MAX_TOKENS

__all__ = ["HEAD", "DeviceRates", "Floor", "GemmRate", "LinearFlops", "MatrixFlops", "count_matrix_flops",
           "floor_of", "gemm_problems", "linear_shapes", "measure_device_rates", "measure_gemm_rates",
           "optimizer_params", "time_call", "time_in_graph"]


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
    # how it was timed (`GRAPH_METHOD` / `EAGER_METHOD`); reports before the graph-timed floor: eager
    method: str = "eager back-to-back launches (launch cost included)"


class Floor(BaseModel):
    """The step's floors measured in this run (see the module docstring); the fields after `peak_tflops`
    are null in reports from before the lower-bound floors."""

    seconds: float  # (a) GEMM floor: sum of calls x seconds over all problems
    seconds_layers_only: float  # the same without the head's problems
    effective_tflops: float  # total matrix FLOPs / seconds
    peak_tflops: float  # the fastest problem's rate
    gemm_method: str | None = None
    # (b) peak-rate floor: matrix FLOPs at the FP8 rate of a large square GEMM
    peak_rate_gemm: str | None = None  # e.g. "8192 x 8192 x 8192 e4m3 -> bfloat16"
    peak_rate_tflops: float | None = None
    peak_rate_seconds: float | None = None
    peak_rate_seconds_layers_only: float | None = None
    peak_rate_method: str | None = None
    # (c) optimizer floor: AdamW's bytes at a large device copy's bandwidth
    optimizer_params: int | None = None  # parameters counted (matrix weights and embeddings: a lower bound)
    optimizer_bytes: int | None = None  # fp32 masters: 7 x 4 bytes per parameter
    optimizer_bytes_layers_only: int | None = None  # the layers alone in bf16 (te-graphed): 7 x 2 bytes
    copy_bytes_per_second: float | None = None  # bytes read + written per second
    optimizer_seconds: float | None = None
    optimizer_seconds_layers_only: float | None = None
    optimizer_method: str | None = None
    # the limit: (b) + (c)
    limit_seconds: float | None = None
    limit_seconds_layers_only: float | None = None

    def limit_for(self, layers_only: bool) -> float | None:
        """The limit of the run's model, or of the layers alone (`te-graphed`); None in older reports."""
        return self.limit_seconds_layers_only if layers_only else self.limit_seconds


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


GRAPH_SECONDS = 2e-3  # a graph lasts about this long, so one replay's launch hides behind the previous one
MAX_CALLS_PER_GRAPH = 64
_IN_GRAPH = (f"inside a CUDA graph of up to {MAX_CALLS_PER_GRAPH} calls (about {GRAPH_SECONDS * 1e3:g} ms), "
             "replayed back to back")
GRAPH_METHOD = _IN_GRAPH + ", device events: no launch cost"
# A kernel's duration moves by a few percent between runs of one process with the GPU's clocks (on an H100 a
# 5.3 us GEMM traced 3% faster in a later run than its fastest run here): the floor takes that much off.
CLOCK_MARGIN = 0.05
GRAPH_KERNEL_METHOD = (_IN_GRAPH + ": the lesser of the device-event time per call and the profiled kernel time "
                       "per call, each kernel at its fastest traced run, replayed in the graph or launched "
                       f"alone (no launch cost, no gaps), less {CLOCK_MARGIN:.0%} for the clocks' run-to-run "
                       "variation")
EAGER_TRACED_CALLS = 20  # calls of `fn` launched alone under the profiler (`time_in_graph`, `kernel_time`)
EAGER_METHOD = "eager back-to-back calls (no CUDA device: host timing, not a device lower bound)"


def _traced_kernel_seconds(run: Callable[[], None], calls: int, device: torch.device) -> float | None:
    """Device kernel time per call of `run` (which makes `calls` calls) under `torch.profiler`, each kernel
    (by name) at the shortest duration it was traced at: a lower bound, since a call's kernels never run
    faster than their fastest observed run (None: nothing traced, or no profiler here). Kineto events are
    read as `profile.trace` reads them (not imported: trace is above)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize(device)
        fastest: dict[str, int] = {}
        count: dict[str, int] = {}
        for ev in prof.profiler.kineto_results.events():
            if ev.device_type() != torch.autograd.DeviceType.CUDA or ev.name().startswith(("[", "Memcpy", "Memset")):
                continue
            activity = getattr(ev, "activity_type", lambda: None)()
            if activity not in (None, "kernel") or getattr(ev, "is_user_annotation", lambda: False)():
                continue
            name, ns = ev.name(), ev.end_ns() - ev.start_ns()
            fastest[name] = min(fastest.get(name, ns), ns)
            count[name] = count.get(name, 0) + 1
    except Exception:  # no CUPTI, or a profiler that cannot trace graph kernels: the event time stands
        return None
    if not fastest:
        return None
    return sum(fastest[n] * count[n] for n in fastest) * 1e-9 / calls


def time_in_graph(fn: Callable[[], object], device: torch.device, *, target_seconds: float,
                  min_samples: int = 3, max_samples: int = 50, kernel_time: bool = False) -> tuple[float, int, str]:
    """Median device seconds per call of `fn`, the calls timed and the method's words.

    CUDA: `fn` (which must allocate nothing: give it its output) is captured `calls` times into one graph,
    the graph is replayed back to back and each sample is timed between two device events, so the host's
    launches and synchronizations stay outside the interval: a lower bound of what the call costs inside
    a captured step. `kernel_time`: also profile a few replays and a few calls launched alone, and take the
    least per call (the event time holds the small gaps between the graph's kernels; a GEMM's floor must not
    exceed its kernel's time in a traced step, so the traced time counts each kernel at its fastest run).
    Elsewhere: `time_call` (eager), said so in the method.
    """
    if device.type != "cuda":
        seconds, reps = time_call(fn, device, target_seconds=target_seconds, min_samples=min_samples,
                                  max_samples=max_samples)
        return seconds, reps, EAGER_METHOD
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up off the default stream, as capture wants (cuBLAS workspaces)
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    single = max(time.perf_counter() - t0, 1e-7)  # an upper estimate (launch and sync included)
    calls = max(1, min(MAX_CALLS_PER_GRAPH, math.ceil(GRAPH_SECONDS / single)))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replays = 8
    samples: list[float] = []
    spent = 0.0
    while len(samples) < max_samples and (len(samples) < min_samples or spent < target_seconds):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        dt = start.elapsed_time(end) * 1e-3
        samples.append(dt / (replays * calls))
        spent += dt
    seconds, method = statistics.median(samples), GRAPH_METHOD
    if kernel_time:
        # The same kernels replayed and launched alone: a kernel may run a little faster outside the graph
        # (measured on the H200: a 2.2 us GEMM 16 ns faster), and a floor takes its fastest run either way.
        def replay(graph: torch.cuda.CUDAGraph = graph) -> None:
            for _ in range(replays):
                graph.replay()

        def alone() -> None:
            for _ in range(EAGER_TRACED_CALLS):
                fn()

        traced = [t for t in (_traced_kernel_seconds(replay, replays * calls, device),
                              _traced_kernel_seconds(alone, EAGER_TRACED_CALLS, device)) if t is not None]
        if traced:
            seconds, method = min(seconds, *traced) * (1 - CLOCK_MARGIN), GRAPH_KERNEL_METHOD
    del graph
    return seconds, len(samples) * replays * calls, method


def measure_gemm_rates(cfg: RunConfig, device: torch.device | str, act_dtype: torch.dtype, *,
                       target_seconds: float | None = None) -> list[GemmRate]:
    """Time every GEMM problem of the step with `fp8_mm` on `device` (random FP8 operands, unit scales),
    each inside a CUDA graph (`time_in_graph`) into a preallocated output."""
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
        out = torch.empty((p["m"], p["n"]), dtype=p["out_dtype"], device=device)
        seconds, reps, method = time_in_graph(
            lambda a=a, b=b, od=p["out_dtype"], out=out: fp8_mm(a, one, b, one, od, out=out), device,
            target_seconds=target_seconds, kernel_time=True)
        flops = 2 * p["m"] * p["n"] * p["k"]
        rates.append(GemmRate(linear=p["linear"], role=p["role"], m=p["m"], n=p["n"], k=p["k"],
                              a_dtype=str(p["a_dtype"]).removeprefix("torch."),
                              b_dtype=str(p["b_dtype"]).removeprefix("torch."),
                              out_dtype=str(p["out_dtype"]).removeprefix("torch."),
                              calls_per_step=p["calls_per_step"], flops_per_call=flops, seconds_per_call=seconds,
                              repetitions=reps, tflops=flops / seconds / 1e12 if seconds > 0 else 0.0,
                              method=method))
        del a, b, out
    return rates


class DeviceRates(BaseModel):
    """The two device rates the peak-rate and optimizer floors use, measured in the run."""

    square_gemm: str  # the problem, e.g. "8192 x 8192 x 8192 float8_e4m3fn -> bfloat16"
    fp8_tflops: float
    gemm_method: str
    copy_bytes: int  # one copy moves this many bytes each way
    copy_bytes_per_second: float  # read + written per second
    copy_method: str


def measure_device_rates(device: torch.device | str, *, square: int | None = None, copy_bytes: int | None = None,
                         target_seconds: float | None = None) -> DeviceRates:
    """The FP8 rate of one large square GEMM and the bandwidth of one large device copy (read + write),
    each timed with `time_in_graph`. Defaults: 8192 and 1 GiB on CUDA; small on a CPU (a dry run)."""
    from qeffect.fp8.gemm import fp8_mm

    device = torch.device(device)
    cuda = device.type == "cuda"
    square = square or (8192 if cuda else 256)
    copy_bytes = copy_bytes or (2**30 if cuda else 2**24)
    if target_seconds is None:
        target_seconds = 0.1 if cuda else 0.02
    e4 = torch.float8_e4m3fn
    g = torch.Generator().manual_seed(1)
    a = (torch.randn((square, square), generator=g) * 0.5).to(device).to(e4)
    b = (torch.randn((square, square), generator=g) * 0.5).to(device).to(e4)
    one = torch.ones((), dtype=torch.float32, device=device)
    out = torch.empty((square, square), dtype=torch.bfloat16, device=device)
    gemm_s, _, gemm_method = time_in_graph(lambda: fp8_mm(a, one, b, one, torch.bfloat16, out=out), device,
                                           target_seconds=target_seconds)
    src = torch.empty(copy_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    src32, dst32 = src.view(torch.float32), dst.view(torch.float32)
    # Two ways to move the bytes, the faster one taken: torch's copy of one contiguous tensor is the driver's
    # memcpy, which on the H200 moved fewer bytes per second than the AdamW pass itself; an elementwise
    # kernel of the SMs (a sign flip into a preallocated output, same bytes read and written) streams faster.
    copies = {"torch copy_ (a driver memcpy)": lambda: dst.copy_(src),
              "an elementwise kernel (torch.neg into a preallocated output)": lambda: torch.neg(src32, out=dst32)}
    timed = {name: time_in_graph(fn, device, target_seconds=target_seconds) for name, fn in copies.items()}
    name = min(timed, key=lambda n: timed[n][0])
    copy_s = timed[name][0]
    copy_method = (f"the faster of {' and '.join(copies)}: {name}, {timed[name][2]}; the other ran "
                   + ", ".join(f"{2 * copy_bytes / t[0] / 1e9:,.0f} GB/s" for n, t in timed.items() if n != name))
    return DeviceRates(square_gemm=f"{square} x {square} x {square} float8_e4m3fn -> bfloat16",
                       fp8_tflops=2 * square**3 / gemm_s / 1e12, gemm_method=gemm_method, copy_bytes=copy_bytes,
                       copy_bytes_per_second=2 * copy_bytes / copy_s, copy_method=copy_method)


ADAMW_BYTES_PER_PARAM_FP32 = 7 * 4  # read parameter, gradient, exp_avg, exp_avg_sq; write the three states
ADAMW_BYTES_PER_PARAM_BF16 = 7 * 2  # the same in bf16 (te-graphed's layers alone: bf16 params and states)


def row_lazy_token_table(cfg: RunConfig) -> bool:
    """Whether the captured runtime updates the token table row-lazily (`runtime.lazy_rows`): without data
    parallelism, and with a microbatch's tokens within one catch-up's reach."""
    return cfg.pipeline.dp == 1 and cfg.model.microbatch_size * cfg.model.seq_len <= MAX_TOKENS


def optimizer_params(cfg: RunConfig) -> tuple[int, int]:
    """(the model's, the layers alone's) parameters the optimizer floor counts: every matrix weight, plus
    the token and (GPT) position embeddings for the model. Left out, for a lower bound: norm weights and
    biases, and a row-lazy token table (`row_lazy_token_table`), whose step updates only the rows it touched."""
    mc = cfg.model
    layers = sum(fin * fout * n for name, fin, fout, n in linear_shapes(cfg) if name != HEAD)
    head = sum(fin * fout * n for name, fin, fout, n in linear_shapes(cfg) if name == HEAD)
    positions = mc.seq_len if mc.family == "gpt" else 0  # llama: rotary, no table
    tokens = 0 if row_lazy_token_table(cfg) else mc.vocab_size
    return layers + head + (tokens + positions) * mc.hidden, layers


def floor_of(rates: list[GemmRate], flops: MatrixFlops, device_rates: DeviceRates | None = None,
             params: tuple[int, int] | None = None, *, lazy_table: bool = False) -> Floor:
    """GEMM floor = sum of calls x measured seconds (the layers-only floor leaves the head's problems out);
    with `device_rates` and `params` (`optimizer_params`) also the peak-rate and optimizer floors and the
    limit, their sum. `lazy_table`: `params` left a row-lazy token table out (said in the method)."""
    seconds = sum(r.calls_per_step * r.seconds_per_call for r in rates)
    layers = sum(r.calls_per_step * r.seconds_per_call for r in rates if r.linear != HEAD)
    methods = sorted({r.method for r in rates})
    floor = Floor(seconds=seconds, seconds_layers_only=layers,
                  effective_tflops=flops.total / seconds / 1e12 if seconds > 0 else 0.0,
                  peak_tflops=max((r.tflops for r in rates), default=0.0),
                  gemm_method="each GEMM problem " + "; ".join(methods) + ", x its calls per step")
    if device_rates is None or params is None:
        return floor
    rate = device_rates.fp8_tflops * 1e12
    model_bytes = params[0] * ADAMW_BYTES_PER_PARAM_FP32
    layer_bytes = params[1] * ADAMW_BYTES_PER_PARAM_BF16
    bw = device_rates.copy_bytes_per_second
    floor.peak_rate_gemm = device_rates.square_gemm
    floor.peak_rate_tflops = device_rates.fp8_tflops
    floor.peak_rate_seconds = flops.total / rate
    floor.peak_rate_seconds_layers_only = flops.layers_only / rate
    floor.peak_rate_method = (f"the step's matrix FLOPs at the FP8 rate of one {device_rates.square_gemm} GEMM, "
                              f"{device_rates.gemm_method}")
    floor.optimizer_params = params[0]
    floor.optimizer_bytes, floor.optimizer_bytes_layers_only = model_bytes, layer_bytes
    floor.copy_bytes_per_second = bw
    floor.optimizer_seconds, floor.optimizer_seconds_layers_only = model_bytes / bw, layer_bytes / bw
    lazy = ", the row-lazy token table left out: a step updates only the rows it touched" if lazy_table else ""
    floor.optimizer_method = (f"AdamW's bytes (read parameter, gradient and both moments, write parameter and "
                              f"moments: 28 B per fp32 parameter, 14 per bf16 one; matrix weights and embeddings "
                              f"only{lazy}) at the bandwidth of one {device_rates.copy_bytes / 2**20:,.0f} MiB device "
                              f"copy, {device_rates.copy_method}")
    floor.limit_seconds = floor.peak_rate_seconds + floor.optimizer_seconds
    floor.limit_seconds_layers_only = floor.peak_rate_seconds_layers_only + floor.optimizer_seconds_layers_only
    return floor
