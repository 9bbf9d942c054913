"""Shared by the torchrun tests: the launcher command on a free loopback port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
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
