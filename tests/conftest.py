"""Under pytest-xdist, each worker's share of the CPU threads and the slow tests first; on GPU machines,
Transformer Engine imported before any test makes torch load cuDNN.

Why TE first: on the H200 image TE opens the system cuDNN libraries; once torch has loaded its own cuDNN
sub-libraries (a captured pipeline does), TE's import fails with an undefined cuDNN symbol
(`libcudnn_heuristic.so.9: undefined symbol ... libcudnn_graph.so.9`). A GPU test module run alone would
then fail by test order, not by code. The te tests report any other import failure themselves.
"""

import importlib.util
import os

# Under pytest-xdist (`-n auto`, .ci/run) each worker gets its share of the cores: torch's OpenMP pool
# otherwise takes every core in every worker (and in each `qeffect train` it starts), and OpenMP threads
# that wait at a barrier for a descheduled sibling make a CPU step up to ten times slower. Tests that compare
# bits across processes set the thread count themselves (launch.ENV, OMP_NUM_THREADS=1).
if "PYTEST_XDIST_WORKER" in os.environ:
    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _threads = max(1, _cores // _workers)
    os.environ["OMP_NUM_THREADS"] = str(_threads)  # inherited by the tests' subprocesses

import torch  # noqa: E402

if "PYTEST_XDIST_WORKER" in os.environ:
    torch.set_num_threads(_threads)

if torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - qeffect.fp8.te.require_te names the cause in the failing test
        pass


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001, ARG001 - pytest's hook
    """Tests marked `slow` first, in their collected order, then the rest. Under pytest-xdist each worker
    takes more tests as it finishes; a long test collected late would run alone at the end while the other
    workers idle, whereas started first the short ones fill in around it."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
