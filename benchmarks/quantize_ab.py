"""The reference backend's quantize pass per launch shape, timed in one process under CUDA graphs.

Why: in a captured h4096 reference step the 272 quantize passes took 2.43 ms (about 9 us each) while
moving about 2 GB: the passes are latency-bound, not bandwidth-bound (the chain of a launch, the tile's
load, its stores, the amax atomic, the ticket and the last program's transition). This script times
that chain's variants on the step's own shapes, each captured ``--calls`` times into one CUDA graph (as
the step replays them), medians of ``--reps`` interleaved rounds:

- ``pass``: the amax slot's zeroing and the pass, no scale update (a lower bound);
- ``two-launch``: the zeroing, the pass, then `fused_update`'s kernel (a state without a scratch);
- ``transition``: the pass completing its own transition (the module's settings);
- ``transition/<ordering>``: the same with the amax atomics' other ordering (relaxed or acquire-release;
  either is correct: the ticket's acquire-release orders them);
- ``tile[BMxBNxW]`` / ``strip[BNxW]``: the transition with another tile (the plain pass) or column
  strip (the pass that also sums the bias gradient's columns), with both orderings of the amax atomics.

Bits: after one call every variant's FP8 bytes, transpose, 1 / scale, amax history and scale equal the
default's (``bits_differing`` names any that do not); a strip's column sums may differ (their order
follows the strip's layout) and are reported apart (``sums_differing``). Per-step estimates weigh each
shape by its calls per step in the configuration (`step_calls`).

    source .gpu-kit/setup.sh
    python3 benchmarks/quantize_ab.py --config examples/configs/h4096.toml --json $OUT/quantize-ab-h4096-h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from qeffect.cli.common import write_json
from qeffect.config import load_config
from qeffect.fp8 import fused_quantize as fq
from qeffect.fp8.scaling import ScalingState
from qeffect.graphs.handshake import gpu_provenance
from qeffect.profile.matrix import te_version

TILES = ((64, 64, 4), (64, 64, 2), (32, 64, 2), (64, 32, 2), (128, 64, 4), (64, 128, 4), (32, 128, 4))
STRIPS = ((32, 8), (16, 4), (16, 2), (16, 1), (8, 4), (8, 2), (8, 1))
SEMS = ("acq_rel", "relaxed")


@dataclass(frozen=True)
class Shape:
    kind: str  # "pair": x quantized with its transpose; "colsum": an output gradient with its column sums
    rows: int
    cols: int
    calls_per_step: int

    @property
    def name(self) -> str:
        return f"{self.kind}[{self.rows}x{self.cols}]"


def step_calls(cfg) -> list[Shape]:
    """The quantize passes of one step of `cfg`: per microbatch each block's four linears quantize their
    input (pair) and output gradient (colsum: they have biases), the head its input and output gradient
    (pair: no bias)."""
    m, p = cfg.model, cfg.pipeline
    t, h, f = m.seq_len * m.microbatch_size, m.hidden, m.ffn
    mb = p.microbatches
    layers = p.pp * p.chunks_per_rank * m.layers_per_chunk
    return [Shape("pair", t, h, (3 * layers + 1) * mb), Shape("pair", t, f, layers * mb),
            Shape("pair", t, m.vocab_size, mb),
            Shape("colsum", t, 3 * h, layers * mb), Shape("colsum", t, h, 2 * layers * mb),
            Shape("colsum", t, f, layers * mb)]


@dataclass(frozen=True)
class Variant:
    name: str
    kinds: tuple[str, ...]
    scratch: bool = True
    update: bool = True
    sem: str | None = None  # the amax atomics' ordering; None: the module's (`fused_quantize.AMAX_SEM`)
    tile: tuple[int, int, int] | None = None  # the plain pass's (rows, columns, warps)
    strip: tuple[int, int] | None = None  # the colsum pass's (columns, warps)

    @contextlib.contextmanager
    def patched(self) -> Iterator[None]:
        saved = (fq.BLOCK_M, fq.BLOCK_N, fq.WARPS, fq.COLSUM_BLOCK_N, fq.COLSUM_WARPS, fq.COLSUM_WIDE_BLOCK_N,
                 fq.COLSUM_WIDE_WARPS, fq.AMAX_SEM)
        try:
            if self.tile:
                fq.BLOCK_M, fq.BLOCK_N, fq.WARPS = self.tile
            if self.strip:  # at every width (the default takes `fq.colsum_strip`'s per width)
                fq.COLSUM_BLOCK_N, fq.COLSUM_WARPS = fq.COLSUM_WIDE_BLOCK_N, fq.COLSUM_WIDE_WARPS = self.strip
            if self.sem:
                fq.AMAX_SEM = self.sem
            yield
        finally:
            (fq.BLOCK_M, fq.BLOCK_N, fq.WARPS, fq.COLSUM_BLOCK_N, fq.COLSUM_WARPS, fq.COLSUM_WIDE_BLOCK_N,
             fq.COLSUM_WIDE_WARPS, fq.AMAX_SEM) = saved


def variants() -> list[Variant]:
    both = ("pair", "colsum")
    out = [Variant("pass", both, scratch=False, update=False), Variant("two-launch", both, scratch=False),
           Variant("transition", both)]
    out += [Variant(f"transition/{sem}", both, sem=sem) for sem in SEMS if sem != fq.AMAX_SEM]
    for sem in SEMS:
        out += [Variant(f"tile[{bm}x{bn}x{w}]/{sem}", ("pair",), sem=sem, tile=(bm, bn, w)) for bm, bn, w in TILES]
        out += [Variant(f"strip[{bn}x{w}]/{sem}", ("colsum",), sem=sem, strip=(bn, w)) for bn, w in STRIPS]
    return out


def state(device: torch.device, scratch: bool) -> ScalingState:
    return ScalingState(torch.tensor([3.0, 1.0, 2.0, 0.5], device=device), torch.tensor(40.0, device=device),
                        torch.float8_e5m2, 0, "max",
                        torch.zeros(2, dtype=torch.int32, device=device) if scratch else None)


def one_call(v: Variant, shape: Shape, s: ScalingState, x: torch.Tensor) -> Callable[[], tuple]:
    def call() -> tuple:
        if not v.update:  # the pass alone: the amax into the history's entry 0, no update
            if shape.kind == "colsum":
                return fq.quantize_amax_colsum(x, s.scale, s.amax_history[0], s.fp8_dtype, torch.float32)
            return fq.quantize_amax(x, s.scale, s.amax_history[0], s.fp8_dtype, transpose=True)
        if shape.kind == "colsum":
            return s.quantize_pair_colsum(x, torch.float32)
        return s.quantize_pair(x)

    return call


def bits(outs: tuple, s: ScalingState) -> dict[str, torch.Tensor]:
    names = ("q", "q_t", "scale_inv", "sums")
    got = {n: t.reshape(-1).view(torch.uint8) for n, t in zip(names, outs, strict=False) if t is not None}
    return {**got, "history": s.amax_history.view(torch.uint8).clone(), "scale": s.scale.reshape(1).view(torch.uint8)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="examples/configs/h4096.toml")
    ap.add_argument("--calls", type=int, default=20, help="quantize calls captured into each graph")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("quantize_ab.py times CUDA graphs: it needs a GPU")
    dev = torch.device("cuda")
    shapes = step_calls(load_config(a.config))
    g = torch.Generator(device=dev).manual_seed(0)
    inputs = {sh: (torch.randn(sh.rows, sh.cols, device=dev, generator=g) * 3).to(torch.bfloat16) for sh in shapes}
    cases: dict[tuple[str, str], torch.cuda.CUDAGraph] = {}
    ref_bits: dict[str, dict[str, torch.Tensor]] = {}
    bits_differing: dict[str, list[str]] = {}
    sums_differing: dict[str, list[str]] = {}
    for v in variants():
        for sh in shapes:
            if sh.kind not in v.kinds:
                continue
            x = inputs[sh]
            with v.patched():
                fresh = state(dev, v.scratch)
                got = bits(one_call(v, sh, fresh, x)(), fresh)  # (also compiles the kernel, outside capture)
                if v.name == "transition":
                    ref_bits[sh.name] = got
                elif v.update and sh.name in ref_bits:
                    for n, t in got.items():
                        if not torch.equal(t, ref_bits[sh.name][n]):
                            (sums_differing if n == "sums" else bits_differing).setdefault(v.name, []).append(
                                f"{sh.name}:{n}")
                s = state(dev, v.scratch)
                call = one_call(v, sh, s, x)
                for _ in range(a.warmup):
                    call()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(a.calls):
                        call()
            graph.replay()
            cases[(v.name, sh.name)] = graph
    torch.cuda.synchronize()
    times: dict[str, dict[str, list[float]]] = {}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(a.reps):
        for (vn, sn), graph in cases.items():
            graph.replay()  # warm
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.setdefault(vn, {}).setdefault(sn, []).append(start.elapsed_time(end) * 1e-3 / a.calls)
    per_call = {vn: {sn: statistics.median(ts) for sn, ts in by.items()} for vn, by in times.items()}
    calls = {sh.name: sh.calls_per_step for sh in shapes}
    base = per_call["transition"]
    per_step: dict[str, dict[str, float]] = {}
    for kind in ("pair", "colsum"):
        names = [sh.name for sh in shapes if sh.kind == kind]
        per_step[kind] = {vn: sum(calls[n] * by[n] for n in names) for vn, by in per_call.items()
                          if all(n in by for n in names)}
        print(f"{kind}: seconds per step (calls: {[calls[n] for n in names]} of {names})")
        for vn, sec in sorted(per_step[kind].items(), key=lambda kv: kv[1]):
            ref = sum(calls[n] * base[n] for n in names)
            print(f"  {vn:>26}: {sec * 1e3:7.3f} ms  x{ref / sec:.3f} of transition   "
                  + "  ".join(f"{per_call[vn][n] * 1e6:6.2f}" for n in names) + " us/call")
    print(f"bits differing: {bits_differing or 'none'}; column sums differing: {sorted(sums_differing) or 'none'}")
    report = {**gpu_provenance(dev), "te": te_version(), "config": a.config, "calls_per_graph": a.calls, "reps": a.reps,
              "warmup": a.warmup, "shapes": [vars(sh) | {"name": sh.name} for sh in shapes],
              "bits_differing": bits_differing, "sums_differing": sums_differing,
              "per_call_median_seconds": per_call, "per_step_seconds": per_step, "raw_seconds": times}
    if a.json:
        write_json(Path(a.json), report)
    return 0 if not bits_differing else 1


if __name__ == "__main__":
    raise SystemExit(main())
