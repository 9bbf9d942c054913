"""Import Transformer Engine first on GPU machines, before any test makes torch load cuDNN.

Why: on the H200 image TE opens the system cuDNN libraries; once torch has loaded its own cuDNN
sub-libraries (a captured pipeline does), TE's import fails with an undefined cuDNN symbol
(`libcudnn_heuristic.so.9: undefined symbol ... libcudnn_graph.so.9`). A GPU test module run alone would
then fail by test order, not by code. The te tests report any other import failure themselves.
"""

import importlib.util

import torch

if torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:  # noqa: BLE001 - qeffect.fp8.te.require_te names the cause in the failing test
        pass
