"""Shared by the torchrun tests: the launcher command on a free loopback port, and a smaller vocabulary
for tests of launch, layout and resume mechanics."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

ROOT = Path(__file__).resolve().parent.parent
# The tiny default's 32768-row token table and output head are most of its CPU step (and of its checkpoint
# bytes). Tests of mechanics that hold for any vocabulary run the same model with a 64th of the rows.
SMALL_VOCAB = 512
SMALL = ["--set", f"model.vocab_size={SMALL_VOCAB}"]
# One thread per worker; ./src first but the caller's PYTHONPATH kept (on the GPU machine it names the
# site with pydantic, TE and the rest).
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, *target: str) -> list[str]:
    """`python -m torch.distributed.run` with `nproc` processes on loopback, then the script or `-m module`."""
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", *target]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """Run a launcher command with `ENV`, output captured (ten minutes at most). A torchrun launch whose port
    was taken between `free_port` and its bind (EADDRINUSE: another launch on the machine, as under
    pytest-xdist) starts nothing, so it is relaunched on a new port, at most twice."""
    for _ in range(2):
        proc = subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)
        if proc.returncode == 0 or "EADDRINUSE" not in proc.stdout + proc.stderr:
            return proc
        args = [f"--master-port={free_port()}" if a.startswith("--master-port=") else a for a in args]
    return subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=600)


def small_tokenizer(folder: Path) -> Path:
    """A byte-level tokenizer (the 256 bytes and <|endoftext|>, no merges) written into `folder`: `qeffect train`
    refuses a model.vocab_size below the tokenizer's, so a SMALL_VOCAB run on real text needs one this small."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    path = folder / "bytes-tokenizer.json"
    tok.save(str(path))
    return path


def small_train(folder: Path) -> list[str]:
    """`qeffect train` arguments for a SMALL_VOCAB model on the bundled text: `small_tokenizer` and the setting."""
    return ["--tokenizer", str(small_tokenizer(folder)), *SMALL]
