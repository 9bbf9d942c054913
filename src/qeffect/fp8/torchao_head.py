"""The TorchAO output head (`fp8.head = "torchao"`): a dynamic, tensorwise-scaled `Float8Linear`.

Dynamic scaling computes each amax and scale from the tensor being cast, on the device, every call, so
the head keeps no FP8 state: nothing to checkpoint, no weight cache to refresh, and no delayed-scaling
transition for F or dI to commit. It is therefore not a backend matrix linear (`is_backend_linear` is
False): its weight is a non-matrix parameter, and autograd computes its gradient in `dI` together with
the norms, biases and embeddings. Every other linear stays the backend's.

torchao is imported lazily, only when this head is built: `import qeffect` never needs it.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from qeffect.errors import UserError

TORCHAO_MISSING_MSG = (
    "fp8.head = \"torchao\" needs torchao (pip install 'qeffect[torchao]'); it is not importable here"
)
# torch._scaled_mm (CUDA) needs every GEMM dimension to be a multiple of 16; the head's GEMMs
# (forward, input gradient, weight gradient) together use tokens, hidden and vocab in every position.
DIM_MULTIPLE = 16
# FP8 tensor cores: Ada (8.9) and Hopper (9.0) or newer.
MIN_CUDA_CAPABILITY = (8, 9)


def torchao_available() -> bool:
    """Whether `torchao.float8` imports here."""
    try:
        import torchao.float8  # noqa: F401
    except Exception:  # an ImportError, or a broken install
        return False
    return True


def require_torchao() -> None:
    if not torchao_available():
        raise UserError(TORCHAO_MISSING_MSG)


def check_torchao_head(*, vocab_size: int, hidden: int, tokens: int, device: torch.device | str) -> None:
    """UserError, naming the config fields, when the torchao head cannot run this shape on `device`.

    The multiple-of-16 rule is CUDA's, but it is checked on every device so that a configuration that
    verifies on a CPU also runs on a GPU. `tokens` is `model.microbatch_size * model.seq_len`.
    """
    dims = {"model.hidden": hidden, "model.vocab_size": vocab_size,
            "model.microbatch_size * model.seq_len": tokens}
    bad = [f"{k} = {v}" for k, v in dims.items() if v % DIM_MULTIPLE]
    if bad:
        raise UserError(f"fp8.head = \"torchao\" needs multiples of {DIM_MULTIPLE} (torchao float8 GEMMs): "
                        + ", ".join(bad))
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(dev)
        if cap < MIN_CUDA_CAPABILITY:
            raise UserError(f"fp8.head = \"torchao\" needs FP8 tensor cores (compute capability >= 8.9); "
                            f"{torch.cuda.get_device_name(dev)} has {cap[0]}.{cap[1]}")
    require_torchao()


@functools.cache
def _head_class() -> type[nn.Module]:
    """`Float8Linear` taking the chunk's `(x, is_first_microbatch)` call (defined once torchao imports)."""
    from torchao.float8.float8_linear import Float8Linear

    class TorchAOHead(Float8Linear):
        """Dynamic tensorwise FP8 linear: stateless, so `is_first_microbatch` has nothing to refresh."""

        qeffect_matrix_linear = False  # not a backend linear: no dW work, no FP8 state (see module doc)

        def forward(self, input: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
            return super().forward(input)

    return TorchAOHead


def torchao_head(in_f: int, out_f: int, *, device: torch.device | str | None = None) -> nn.Module:
    """A bias-free fp32-master `Float8Linear` (dynamic tensorwise scaling: e4m3 forward, e5m2 gradients).

    The weight is a plain `nn.Parameter` named `weight`, like the backend head's, so parameter names,
    the deterministic init and checkpoint keys are the same for both heads.
    """
    require_torchao()
    from torchao.float8 import Float8LinearConfig

    base = nn.Linear(in_f, out_f, bias=False, device=device, dtype=torch.float32)
    return _head_class().from_float(base, config=Float8LinearConfig.from_recipe_name("tensorwise"))
