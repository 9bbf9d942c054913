"""Resident memory of training on a prepared folder, by the folder's size: a benchmark, not a timed test.

    python3 benchmarks/data_memory.py --sizes 10MB,1GB --steps 20 \
        --out benchmarks/results/data-memory-<rev>-cpu.json

For each size: write a synthetic prepared folder (random token ids straight into tokens.bin, documents every
`--doc-tokens` tokens, an index naming the bundled tokenizer: no tokenizing), then run `--steps` training
steps of the embedded tiny config on it (`qeffect.runtime.train.train`, what `qeffect train --data DIR`
runs, held-out evaluation included) in a fresh child process, `--repeats` times. The child's peak resident
set comes from `wait4` (ru_maxrss of that child alone), and the child reports its own /proc/self/status
(VmHWM, RssAnon, RssFile) after the last step. The claim checked: the largest size's peak RSS is within
100 MB of the smallest's (`within_100mb`). Needs the folders' bytes free under `--workdir`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}
LIMIT_BYTES = 100 * 10**6


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for unit in sorted(UNITS, key=len, reverse=True):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * UNITS[unit])
    return int(t)


def write_synthetic(folder: Path, size_bytes: int, *, doc_tokens: int = 1024, seed: int = 0) -> dict:
    """A prepared folder of `size_bytes` bytes of uint16 token ids (ids 1..32767, end-of-text id 0 closing
    every `doc_tokens`-token document), 10% of the documents held out; returns its index."""
    from qeffect import __version__
    from qeffect.data.prepared import (
        DOCUMENTS_FILE,
        INDEX_FILE,
        TOKENS_FILE,
        PreparedIndex,
        SourceEntry,
        Split,
    )
    from qeffect.data.tokenizer import TOKENIZER_ASSET, bundled_asset, file_sha256

    folder.mkdir(parents=True, exist_ok=True)
    n = size_bytes // 2
    n_docs = max(2, n // doc_tokens)
    n = n_docs * doc_tokens
    rng = np.random.default_rng(seed)
    sha = hashlib.sha256()
    chunk = 8 << 20  # tokens per write: flat memory while writing
    with open(folder / TOKENS_FILE, "wb") as f:
        for start in range(0, n, chunk):
            ids = rng.integers(1, 32768, size=min(chunk, n - start), dtype=np.uint16)
            ids[(np.arange(start, start + len(ids)) % doc_tokens) == doc_tokens - 1] = 0
            data = ids.astype("<u2").tobytes()
            f.write(data)
            sha.update(data)
    np.save(folder / DOCUMENTS_FILE, np.arange(n_docs, dtype="<i8") * doc_tokens)
    held = -(-n_docs // 10)
    cut = (n_docs - held) * doc_tokens
    index = PreparedIndex(
        dtype="uint16", num_tokens=n, num_documents=n_docs, tokens_sha256=sha.hexdigest(), vocab_size=32768,
        eot="<|endoftext|>", eot_id=0, tokenizer="", tokenizer_sha256=file_sha256(bundled_asset(TOKENIZER_ASSET)),
        text_field="text",
        split=Split(heldout_fraction=0.1, train_documents=(0, n_docs - held), heldout_documents=(n_docs - held, n_docs),
                    train_tokens=(0, cut), heldout_tokens=(cut, n)),
        sources=[SourceEntry(path="synthetic", kind="jsonl", bytes=0, sha256="", documents=n_docs, tokens=n)],
        created_by=f"qeffect {__version__} benchmarks/data_memory.py",
    )
    (folder / INDEX_FILE).write_text(json.dumps(index.model_dump(mode="json"), indent=2) + "\n")
    return index.model_dump(mode="json")


def _status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of this process, in KiB (Linux)."""
    out = {}
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[key + "_kib"] = int(value.split()[0])
    except OSError:
        pass
    return out


def child(folder: str, steps: int, run_dir: str) -> None:
    """The measured process: train `steps` steps on `folder`, then print one JSON line."""
    from qeffect.config import load_config
    from qeffect.runtime.train import train

    t0 = time.perf_counter()
    cfg = load_config().with_overrides(**{"data.path": folder, "train.steps": steps,
                                          "train.eval_every": max(1, steps // 2)})
    before = _status()
    summary = train(cfg, out=Path(run_dir))
    print(json.dumps({"seconds": time.perf_counter() - t0, "status_after": _status(), "status_before_train": before,
                      "last_ten_ce": summary.last_ten_ce, "heldout_last": summary.heldout_last}))


def measure(folder: Path, steps: int, run_dir: Path) -> dict:
    """Run the child; its own peak RSS from wait4 (not RUSAGE_CHILDREN, the maximum over every child)."""
    cmd = [sys.executable, __file__, "--child", str(folder), str(steps), str(run_dir)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - t0
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        raise SystemExit(f"child failed ({proc.returncode}): {stderr[-2000:]}")
    report = json.loads(stdout.strip().splitlines()[-1])
    return {"ru_maxrss_kib": usage.ru_maxrss, "wall_s": wall, **report}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10MB,1GB", help="tokens.bin sizes, smallest first (10MB, 1GB, 512MiB)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--workdir", type=Path, default=None, help="where the folders go (default: a temp folder)")
    ap.add_argument("--keep", action="store_true", help="keep the folders")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON report here (default: stdout)")
    ap.add_argument("--child", nargs=3, metavar=("DIR", "STEPS", "RUN"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]), args.child[2])
        return

    import torch

    from qeffect import __version__
    from qeffect.graphs.handshake import git_revision

    sizes = [parse_size(s) for s in args.sizes.split(",")]
    work = args.workdir or Path(tempfile.mkdtemp(prefix="qeffect-data-memory-"))
    free = shutil.disk_usage(work if work.exists() else work.parent).free
    if free < sum(sizes) * 1.1:
        raise SystemExit(f"{work}: {free / 1e9:.1f} GB free, the folders need {sum(sizes) / 1e9:.1f} GB")
    runs = []
    try:
        for size in sizes:
            folder = work / f"prepared-{size}"
            t0 = time.perf_counter()
            index = write_synthetic(folder, size, doc_tokens=args.doc_tokens)
            write_s = time.perf_counter() - t0
            for r in range(args.repeats):
                m = measure(folder, args.steps, work / f"run-{size}-{r}")
                m.update(size_bytes=(folder / "tokens.bin").stat().st_size, repeat=r, num_tokens=index["num_tokens"],
                         write_folder_s=write_s)
                runs.append(m)
                print(f"{size / 1e6:>9,.0f} MB  peak RSS {m['ru_maxrss_kib'] / 1024:8.1f} MiB  "
                      f"(RssFile {m['status_after'].get('RssFile_kib', 0) / 1024:.1f} MiB)  {m['wall_s']:.1f} s",
                      file=sys.stderr)
            if not args.keep:
                shutil.rmtree(folder)
    finally:
        if not args.keep and args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    small = max(r["ru_maxrss_kib"] for r in runs if r["size_bytes"] == min(x["size_bytes"] for x in runs))
    large = max(r["ru_maxrss_kib"] for r in runs if r["size_bytes"] == max(x["size_bytes"] for x in runs))
    report = {
        "kind": "data-memory", "command": " ".join(["python3", *sys.argv]), "git_revision": git_revision() or "unknown",
        "device": "cpu", "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                     "python": platform.python_version()},
        "versions": {"qeffect": __version__, "torch": torch.__version__, "numpy": np.__version__},
        "config": "embedded tiny.toml (seq_len 32, microbatch 2, 4 microbatches, PP=2 in one process)",
        "steps": args.steps, "repeats": args.repeats, "doc_tokens": args.doc_tokens, "runs": runs,
        "peak_rss_smallest_kib": small, "peak_rss_largest_kib": large,
        "peak_rss_difference_bytes": (large - small) * 1024, "limit_bytes": LIMIT_BYTES,
        "within_100mb": (large - small) * 1024 <= LIMIT_BYTES,
    }
    text = json.dumps(report, indent=2) + "\n"
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
