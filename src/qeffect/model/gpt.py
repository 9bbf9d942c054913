"""GPT stage chunks built from an FP8 backend.

A model of `num_stages * layers_per_chunk` pre-LayerNorm transformer layers is cut into `num_stages`
chunks; the first owns the embeddings, the last the final norm, the output head and the loss. Every
matrix product (qkv, proj, fc1, fc2, head) is a backend linear, so its weight gradient is `dW` work;
all other parameters (norms, biases, embeddings) get their gradients in `dI`. With `head="torchao"`
the head is instead a stateless dynamic-scaling torchao `Float8Linear` (fp8/torchao_head.py): not a
backend linear, so its weight is a non-matrix parameter whose gradient also comes in `dI`.
With `family="llama"` the chunks hold `model/llama.py`'s layers instead (RMSNorm, rotary positions,
grouped-query attention, SwiGLU with gate/up/down linears, no biases); everything else here is shared.

Parameters are fp32 masters; activations run in the chunk's `dtype`; the loss and the norms' statistics
are fp32 (the torch form upcasts; on CUDA `model/layernorm.py` reads and writes 16-bit activations and
`model/cross_entropy.py` reads the 16-bit logits).
`build_chunks` initializes every chunk from one CPU generator in stage order, so a seed gives the same
parameters on any device and for any mapping of stages to ranks.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qeffect.fp8.base import FP8Backend, is_backend_linear
from qeffect.model import cross_entropy as fused_ce
from qeffect.model.attention import RESOLVED as ATTENTION_RESOLVED
from qeffect.model.attention import causal_attention, resolve_attention
from qeffect.model.layernorm import available as fused_layer_norm_available
from qeffect.model.layernorm import triton_add_layer_norm, triton_fork_layer_norm, triton_layer_norm
from qeffect.model.llama import ROPE_BUFFERS, LlamaBlock, rms_norm, rope_tables

if TYPE_CHECKING:
    from qeffect.config import RunConfig

INIT_STD = 0.02
HEADS: tuple[str, ...] = ("backend", "torchao")  # the output head's kinds (config: fp8.head)
FAMILIES: tuple[str, ...] = ("gpt", "llama")  # config: model.family (docs/models.md)
RESIDUAL_LINEARS: tuple[str, ...] = ("proj", "fc2", "down")  # linears writing into the residual stream


@dataclass(frozen=True)
class GPTShape:
    vocab_size: int
    hidden: int
    ffn: int
    heads: int
    layers_per_chunk: int
    seq_len: int
    microbatch_size: int
    num_stages: int
    family: str = "gpt"
    kv_heads: int = 0  # llama: key/value heads (0: heads)
    norm_eps: float = 1e-5  # llama: RMSNorm epsilon (the GPT's LayerNorms keep torch's default)
    rope_theta: float = 10000.0  # llama: rotary base
    attention: str = "torch"  # the SDPA backend, resolved (`model.attention.resolve_attention`)

    def __post_init__(self) -> None:
        for field in (
            "vocab_size",
            "hidden",
            "ffn",
            "heads",
            "layers_per_chunk",
            "seq_len",
            "microbatch_size",
            "num_stages",
        ):
            if getattr(self, field) < 1:
                raise ValueError(f"GPTShape.{field} must be >= 1, got {getattr(self, field)}")
        if self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        if self.family not in FAMILIES:
            raise ValueError(f"unknown model family {self.family!r}; choose one of: {', '.join(FAMILIES)}")
        if self.attention not in ATTENTION_RESOLVED:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_RESOLVED)} (resolved), "
                             f"got {self.attention!r}")
        if self.kv_heads < 0 or self.heads % self.num_kv_heads or (self.family == "gpt" and self.kv_heads):
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads}), and be 0 for gpt")

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @classmethod
    def from_config(cls, cfg: RunConfig) -> GPTShape:
        m = cfg.model
        return cls(
            vocab_size=m.vocab_size,
            hidden=m.hidden,
            ffn=m.ffn,
            heads=m.heads,
            layers_per_chunk=m.layers_per_chunk,
            seq_len=m.seq_len,
            microbatch_size=m.microbatch_size,
            num_stages=cfg.pipeline.num_stages,
            family=m.family,
            kv_heads=m.kv_heads,
            norm_eps=m.norm_eps,
            rope_theta=m.rope_theta,
            attention=resolve_attention(m.attention, m.seq_len),
        )

    @property
    def num_layers(self) -> int:
        return self.layers_per_chunk * self.num_stages


def _layer_norm(ln: nn.LayerNorm, x: Tensor) -> Tensor:
    """LayerNorm in fp32 with the fp32 master parameters, back in the activation dtype."""
    return F.layer_norm(x.float(), ln.normalized_shape, ln.weight, ln.bias, ln.eps).to(x.dtype)


def layer_norm(ln: nn.LayerNorm, x: Tensor) -> Tensor:
    """The model's LayerNorm: on 16-bit CUDA activations the Triton kernels of `model/layernorm.py` (fp32
    statistics and parameters, no dtype copies), else `_layer_norm`. The device decides, so native and
    qeffect runs, which share this code, agree (the two forms round differently)."""
    if ln.bias is not None and fused_layer_norm_available(x, ln.weight):
        return triton_layer_norm(ln, x)
    return _layer_norm(ln, x)


def _fused_residual(ln: nn.LayerNorm, x: Tensor) -> bool:
    """The residual adds ride in the Triton LayerNorm's passes (`add_layer_norm`, `fork_layer_norm`) where
    that norm runs: the same bits as the add and the norm apart, fewer passes over the activations."""
    return ln.bias is not None and fused_layer_norm_available(x, ln.weight)


def add_layer_norm(ln: nn.LayerNorm, x: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    """``s = x + r`` and ``layer_norm(ln, s)``: on the Triton LayerNorm one pass each way."""
    if _fused_residual(ln, x) and r.dtype == x.dtype and r.shape == x.shape:
        return triton_add_layer_norm(ln, x, r)
    s = x + r
    return s, layer_norm(ln, s)


def fork_layer_norm(ln: nn.LayerNorm, x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` and ``layer_norm(ln, x)`` for an x used again (the residual): on the Triton LayerNorm the
    backward adds x's two gradients in the norm's pass."""
    if _fused_residual(ln, x):
        return triton_fork_layer_norm(ln, x)
    return x, layer_norm(ln, x)


def cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """The model's loss, mean fp32 cross-entropy: on 16-bit CUDA logits the Triton passes of
    `model/cross_entropy.py` (no fp32 copy of the logits), else the torch form below. The device decides,
    so native and qeffect runs, which share this code, agree (the two forms round differently)."""
    if fused_ce.available(logits, targets):
        return fused_ce.triton_cross_entropy(logits, targets)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class _SplitHeads(torch.autograd.Function):
    """q, k, v as [b, heads, t, d] views of the fused projection [b, t, 3h], as autograd's own route
    (view, permute, unbind). Its backward writes the three gradients into one [b, t, 3, heads, d] tensor
    in one copy. Autograd's route stacks them into [3, b, heads, t, d] (a transposing copy) and then
    copies that into [b, t, 3h] for the view: two copies of the same values, so the bits are the same."""

    @staticmethod
    def forward(ctx, qkv: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:  # noqa: ANN001 - autograd's ctx
        ctx.shape = qkv.shape
        b, t, h3 = qkv.shape
        return qkv.view(b, t, 3, heads, h3 // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor, None]:  # noqa: ANN001
        return torch.stack([g.transpose(1, 2) for g in (dq, dk, dv)], dim=2).view(ctx.shape), None


def split_heads(qkv: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """The attention's q, k, v from the fused projection, as views; the backward writes the three
    gradients in one copy (`_SplitHeads`), autograd's values and bits."""
    return _SplitHeads.apply(qkv, heads)


class Block(nn.Module):
    """Pre-LayerNorm transformer layer: x + proj(attn(ln1 x)); x + fc2(gelu(fc1(ln2 x)))."""

    def __init__(self, shape: GPTShape, backend: FP8Backend, *, device=None) -> None:
        super().__init__()
        h, f = shape.hidden, shape.ffn
        self.heads = shape.heads
        self.attention = shape.attention
        self.ln1 = nn.LayerNorm(h, device=device)
        self.qkv = backend.linear(h, 3 * h, bias=True, device=device, dtype=torch.float32)
        self.proj = backend.linear(h, h, bias=True, device=device, dtype=torch.float32)
        self.ln2 = nn.LayerNorm(h, device=device)
        self.fc1 = backend.linear(h, f, bias=True, device=device, dtype=torch.float32)
        self.fc2 = backend.linear(f, h, bias=True, device=device, dtype=torch.float32)

    def forward(self, x: Tensor, is_first_microbatch: bool) -> Tensor:
        b, t, h = x.shape
        x, n1 = fork_layer_norm(self.ln1, x)
        qkv = self.qkv(n1, is_first_microbatch)
        q, k, v = split_heads(qkv, self.heads)
        a = causal_attention(q, k, v, self.attention)
        a = a.transpose(1, 2).reshape(b, t, h)
        x, n2 = add_layer_norm(self.ln2, x, self.proj(a, is_first_microbatch))
        m = F.gelu(self.fc1(n2, is_first_microbatch), approximate="tanh")
        return x + self.fc2(m, is_first_microbatch)


class StageChunk(nn.Module):
    """Stage `stage` of `num_stages`: [embeddings] + `layers_per_chunk` Blocks + [ln_f, head, loss].

    `shape.family` picks the layers: "gpt" (`Block`, LayerNorms, token and position embeddings) or
    "llama" (`model.llama.LlamaBlock`, RMSNorms, the token embedding only: positions are rotary, from
    the chunk's non-persistent `rope_cos` / `rope_sin` tables)."""

    def __init__(
        self,
        shape: GPTShape,
        backend: FP8Backend,
        stage: int,
        *,
        device=None,
        dtype: torch.dtype = torch.float32,
        head: str = "backend",
    ) -> None:
        super().__init__()
        if not 0 <= stage < shape.num_stages:
            raise ValueError(f"stage {stage} out of range for {shape.num_stages} stages")
        if head not in HEADS:
            raise ValueError(f"unknown head {head!r}; choose one of: {', '.join(HEADS)}")
        self.shape = shape
        self.stage = stage
        self.num_stages = shape.num_stages
        self.dtype = dtype
        # Set by captured stage actions (stage/embedding_grad.py): forward then leaves the token table out
        # of autograd and keeps the lookup's output in `token_out`, whose gradient dI takes instead.
        self.sparse_token_grad = False
        self.token_out: Tensor | None = None
        llama = shape.family == "llama"
        if self.is_first:
            self.tok_emb = nn.Embedding(shape.vocab_size, shape.hidden, device=device)
            if not llama:
                self.pos_emb = nn.Embedding(shape.seq_len, shape.hidden, device=device)
        if llama:
            for name, table in zip(ROPE_BUFFERS, rope_tables(shape.seq_len, shape.head_dim, shape.rope_theta,
                                                              device), strict=True):
                self.register_buffer(name, table, persistent=False)  # constants: rebuilt, never checkpointed
            self.blocks = nn.ModuleList(
                LlamaBlock(shape.hidden, shape.ffn, shape.heads, shape.num_kv_heads, shape.norm_eps, backend,
                           attention=shape.attention, device=device)
                for _ in range(shape.layers_per_chunk))
        else:
            self.blocks = nn.ModuleList(
                Block(shape, backend, device=device) for _ in range(shape.layers_per_chunk)
            )
        if self.is_last:
            self.ln_f = (nn.RMSNorm(shape.hidden, eps=shape.norm_eps, device=device) if llama
                         else nn.LayerNorm(shape.hidden, device=device))
            if head == "torchao":  # lazy: torchao is imported only for this head
                from qeffect.fp8.torchao_head import torchao_head

                self.head = torchao_head(shape.hidden, shape.vocab_size, device=device)
            else:
                self.head = backend.linear(
                    shape.hidden, shape.vocab_size, bias=False, device=device, dtype=torch.float32
                )

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def forward(self, x: Tensor, *, is_first_microbatch: bool, targets: Tensor | None = None) -> Tensor:
        """Token ids [B, T] (first chunk) or hidden [B, T, H] -> hidden, logits or the mean loss."""
        if self.is_first:
            if x.dtype != torch.int64 or x.dim() != 2:
                raise ValueError(f"stage 0 takes int64 token ids [B, T], got {x.dtype} {tuple(x.shape)}")
            if self.sparse_token_grad:  # the table's gradient is TokenEmbeddingGrad's: autograd stops here
                tok = F.embedding(x, self.tok_emb.weight.detach()).requires_grad_(True)
                self.token_out = tok
            else:
                tok = self.tok_emb(x)
            if self.shape.family == "llama":  # rotary positions: nothing added here
                x = tok.to(self.dtype)
            else:
                x = (tok + self.pos_emb(torch.arange(x.shape[1], device=x.device))).to(self.dtype)
        elif x.dim() != 3 or x.shape[-1] != self.shape.hidden:
            raise ValueError(
                f"stage {self.stage} takes hidden [B, T, {self.shape.hidden}], got {tuple(x.shape)}"
            )
        extra = {} if self.shape.family != "llama" else {"rope": (self.rope_cos, self.rope_sin)}
        for block in self.blocks:
            x = block(x, is_first_microbatch, **extra)
        if not self.is_last:
            return x
        norm = rms_norm(self.ln_f, x) if isinstance(self.ln_f, nn.RMSNorm) else layer_norm(self.ln_f, x)
        logits = self.head(norm, is_first_microbatch)
        if targets is None:
            return logits
        return cross_entropy(logits, targets)

    # -- parameter classification -----------------------------------------------------------------
    def matrix_linears(self) -> dict[str, nn.Module]:
        """Qualified name -> backend linear (every qkv/proj/fc1/fc2, and the head unless it is torchao's)."""
        return {name: m for name, m in self.named_modules() if is_backend_linear(m)}

    def matrix_params(self) -> dict[str, nn.Parameter]:
        """The backend linears' weights (their gradients are `dW`), named as in `named_parameters`."""
        return {f"{name}.weight": m.weight for name, m in self.matrix_linears().items()}

    def nonmatrix_params(self) -> dict[str, nn.Parameter]:
        """All other parameters (norms, biases, embeddings, a torchao head): their gradients come in `dI`."""
        matrix = {id(p) for p in self.matrix_params().values()}
        return {name: p for name, p in self.named_parameters() if id(p) not in matrix}

    def use_activation_biases(self) -> None:
        """Backend linears that can take their bias in the activation dtype (Transformer Engine's) get it
        so, cast once per step instead of per microbatch (`TELinear.use_activation_bias`); their bias
        gradients then come in that dtype (`nonmatrix_grad_inputs`). qeffect's runtimes only: native
        eager keeps TE's own per-forward cast, and the bits are the same."""
        for m in self.matrix_linears().values():
            if hasattr(m, "use_activation_bias"):
                m.use_activation_bias(self.dtype)

    def nonmatrix_grad_inputs(self) -> dict[str, Tensor]:
        """`nonmatrix_params` as the tensors dI differentiates: a bias a linear takes in the activation
        dtype is replaced by that stand-in (its gradient is the bias's, in that dtype)."""
        stand_ins = {f"{name}.bias": t for name, m in self.matrix_linears().items()
                     if (t := getattr(m, "bias_grad_input", None)) is not None}
        return {n: stand_ins.get(n, p) for n, p in self.nonmatrix_params().items()}

    def fp8_state(self) -> dict[str, Tensor]:
        """`{linear}.{state}` -> live FP8 state tensor, for every backend linear."""
        return {
            f"{name}.{key}": t
            for name, m in self.matrix_linears().items()
            for key, t in m.fp8_state().items()
        }

    def allocate_fp8_state(self) -> None:
        """Allocate every backend linear's FP8 state where the backend creates it lazily (Transformer Engine, at
        the first forward), so that a checkpoint loads into it before any forward."""
        for m in self.matrix_linears().values():
            allocate = getattr(m, "allocate_fp8_state", None)
            if allocate is not None:
                allocate()

    def set_delay_wgrad(self, flag: bool) -> None:
        for m in self.matrix_linears().values():
            m.delay_wgrad = flag

    def invalidate_caches(self) -> None:
        for m in self.matrix_linears().values():
            m.invalidate_cache()

    def pop_wgrad_work(self) -> dict[str, list]:
        """Linear name -> its retained `dW` work (cleared from the modules)."""
        return {name: m.pop_wgrad_work() for name, m in self.matrix_linears().items()}

    @property
    def caches_valid(self) -> bool:
        return all(m.cache_valid for m in self.matrix_linears().values())


def _init_value(name: str, shape: torch.Size, residual_std: float, gen: torch.Generator) -> Tensor:
    """GPT-2 init of one parameter, drawn from `gen` (on CPU, so every device gets the same numbers)."""
    leaf = name.rsplit(".", 2)
    owner, kind = (leaf[-2] if len(leaf) > 1 else ""), leaf[-1]
    if owner.startswith("ln"):  # ln1, ln2, ln_f
        return torch.ones(shape) if kind == "weight" else torch.zeros(shape)
    if kind == "bias":
        return torch.zeros(shape)
    std = residual_std if owner in RESIDUAL_LINEARS else INIT_STD
    return torch.empty(shape).normal_(0.0, std, generator=gen)


# (seed, shape, head, backend) -> {(stage, parameter name): initial value}, while `shared_init_draws` is active
_DRAWS: dict[tuple, dict[tuple[int, str], Tensor]] | None = None


@contextlib.contextmanager
def shared_init_draws() -> Iterator[None]:
    """Within the scope, `build_chunks` draws each model's initial values once and copies them into
    every later build of the same (seed, shape, head, backend): the same numbers, without drawing the CPU
    generator again (about 9 s per billion parameters). `qeffect profile` builds one model per
    configuration and draws it once before any timer, so the configurations' setup times compare
    what differs between them, not the same random draws with their run-to-run noise."""
    global _DRAWS
    outer = _DRAWS
    _DRAWS = {} if outer is None else outer
    try:
        yield
    finally:
        _DRAWS = outer


def rng_devices(device: torch.device) -> list[int]:
    """The CUDA devices whose RNG a constructor on `device` may draw from (`torch.random.fork_rng`)."""
    if device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


def build_chunks(
    shape: GPTShape,
    backend: FP8Backend,
    *,
    seed: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    stages: Sequence[int] | None = None,
    head: str = "backend",
    phase: Callable[[str], contextlib.AbstractContextManager] | None = None,
) -> list[StageChunk]:
    """Build the model's chunks with a deterministic init; `stages` keeps only those (ascending).

    One CPU `torch.Generator(seed)` is consumed in stage order and parameter-registration order over
    *all* stages (skipped stages still draw their numbers), so a stage's parameters do not depend on
    the device or on which stages a rank builds. Residual projections (proj, fc2; llama: proj, down) use
    std 0.02 / sqrt(2 * n_layers) (GPT-2). The global RNG is left untouched.

    `head`: "backend" (the backend's linear) or "torchao" (a dynamic-scaling torchao `Float8Linear`;
    UserError when torchao is missing or the shape does not suit it). Both heads draw the same numbers.

    Each kept stage is built on `device` and its parameters overwritten there; a stage the build does
    not keep is built on the meta device, since its draws need only its parameters' names and shapes
    (and not at all once `shared_init_draws` holds the draws).

    `phase` (`runtime.phases.Phase`): times "modules" (the modules built) and "values" (the initial
    values drawn and copied in) for `qeffect profile`'s setup breakdown.
    """
    keep = set(range(shape.num_stages) if stages is None else stages)
    if not keep <= set(range(shape.num_stages)):
        raise ValueError(f"stages {sorted(keep)} out of range for {shape.num_stages} stages")
    if head == "torchao":
        from qeffect.fp8.torchao_head import check_torchao_head

        check_torchao_head(vocab_size=shape.vocab_size, hidden=shape.hidden,
                           tokens=shape.microbatch_size * shape.seq_len, device=device)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    residual_std = INIT_STD / math.sqrt(2 * shape.num_layers)
    key = (seed, shape, head, getattr(backend, "name", type(backend).__name__))
    drawn = None if _DRAWS is None else _DRAWS.get(key)  # a complete earlier draw of this model
    fresh: dict[tuple[int, str], Tensor] = {}
    chunks = []
    phase = phase or (lambda name: contextlib.nullcontext())
    for stage in range(shape.num_stages):
        kept = stage in keep
        if not kept and drawn is not None:
            continue  # nothing to draw, nothing to build
        where = torch.device(device) if kept else torch.device("meta")
        with phase("modules"):
            # Module constructors may draw from the global RNGs (embedding init, Transformer Engine's weight
            # init on the GPU): fork them, then overwrite every parameter.
            with torch.random.fork_rng(devices=rng_devices(where)):
                chunk = StageChunk(shape, backend, stage, device=where, dtype=dtype, head=head)
        with phase("values"), torch.no_grad():
            for name, p in chunk.named_parameters():
                if drawn is not None:
                    p.copy_(drawn[(stage, name)])
                    continue
                value = _init_value(name, p.shape, residual_std, gen)
                if kept:
                    p.copy_(value)
                if _DRAWS is not None:
                    fresh[(stage, name)] = value
        if kept:
            chunks.append(chunk)
    if _DRAWS is not None and drawn is None:
        _DRAWS[key] = fresh
    return chunks
