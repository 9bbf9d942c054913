"""The model's causal attention under each of torch's SDPA backends: time, repeatability, capture.

Why: flash attention's forward (split over the keys, then combined) and backward are ~1.5 ms of a
captured h4096 step. A faster backend changes the model's numbers for native eager and qeffect alike,
so the oracle would still hold, but only if the backend gives the same bits every run: the bitwise
tests compare whole runs. torch declares cuDNN's SDPA not deterministic (`check_cudnn_deterministic`),
so a clean repeat here is evidence at these shapes, not a promise.

Per backend and shape (the model's q, k, v views of one fused [b, t, 3, heads, d] projection, causal):
forward + backward as one CUDA graph, the median of `--reps` timed replays of `--replays` each; whether
`--repeats` eager runs gave identical output and input-gradient bits; whether the captured replay gave
the eager bits.

    source .gpu-kit/setup.sh
    python3 benchmarks/attention_backends.py --json $OUT/attention-backends-h200.json
    python3 benchmarks/attention_backends.py --seq-len 2048 --microbatch-size 2 --repeats 20 --json ...
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from qeffect.cli.common import write_json
from qeffect.graphs.handshake import gpu_provenance
from qeffect.model.attention import causal_attention

# torch's SDPA backends, then the model's "efficient" (SDPA's forward, a backward with the keys unsplit)
UNSPLIT = "EFFICIENT_KEYS_UNSPLIT"
BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, UNSPLIT)
SHAPES = {"h4096": 32, "h2048": 16}  # heads at head dimension 128 (sequence and microbatch: the options)


def case(heads: int, seq: int = 256, batch: int = 1, dim: int = 128):
    gen = torch.Generator(device="cuda").manual_seed(0)
    qkv0 = torch.randn(batch, seq, 3, heads, dim, device="cuda", generator=gen).to(torch.bfloat16)
    grad = torch.randn(batch, heads, seq, dim, device="cuda", generator=gen).to(torch.bfloat16)
    return qkv0, grad


def fwd_bwd(backend: SDPBackend | str, qkv0: torch.Tensor, grad: torch.Tensor):
    qkv = qkv0.clone().requires_grad_(True)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    if backend == UNSPLIT:
        out = causal_attention(q, k, v, "efficient")
    else:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(grad)
    return out.detach(), qkv.grad


def measure(backend: SDPBackend | str, heads: int, repeats: int, reps: int, replays: int, seq: int = 256,
            batch: int = 1) -> dict:
    qkv0, grad = case(heads, seq, batch)
    first = fwd_bwd(backend, qkv0, grad)
    repeatable = all(all(torch.equal(a, b) for a, b in zip(first, fwd_bwd(backend, qkv0, grad), strict=True))
                     for _ in range(repeats))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fwd_bwd(backend, qkv0, grad)
        with torch.cuda.graph(graph, stream=stream):
            captured = fwd_bwd(backend, qkv0, grad)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    same_captured = all(torch.equal(a, b) for a, b in zip(first, captured, strict=True))
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(replays):
            graph.replay()
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) / replays * 1e3)
    return {"median_us": statistics.median(times), "raw_us": times, "repeatable": repeatable,
            "captured_same_bits": same_captured, "output": first[0]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=200, help="eager reruns compared bitwise with the first")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (h4096-long: 2048)")
    ap.add_argument("--microbatch-size", type=int, default=1, help="sequences per call")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_backends.py needs CUDA")
    rows = []
    for shape, heads in SHAPES.items():
        flash_out = None
        for backend in BACKENDS:
            name = getattr(backend, "name", backend)
            try:
                r = measure(backend, heads, a.repeats, a.reps, a.replays, a.seq_len, a.microbatch_size)
            except RuntimeError as err:  # a backend this build or shape does not run
                rows.append({"shape": shape, "backend": name, "error": str(err)[:300]})
                continue
            out = r.pop("output")
            if backend is SDPBackend.FLASH_ATTENTION:
                flash_out = out
            r["same_output_bits_as_flash"] = None if flash_out is None else bool(torch.equal(out, flash_out))
            rows.append({"shape": shape, "heads": heads, "backend": name, **r})
            print(shape, name, {k: v for k, v in r.items() if k != "raw_us"}, flush=True)
    if a.json:
        write_json(a.json, {**gpu_provenance(), "repeats": a.repeats, "reps": a.reps, "replays": a.replays,
                            "seq_len": a.seq_len, "microbatch_size": a.microbatch_size, "rows": rows})


if __name__ == "__main__":
    main()
