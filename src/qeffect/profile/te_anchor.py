"""The Transformer Engine anchors: TE's own `make_graphed_callables`, one graphed `TransformerLayer` per layer.

`te-graphed` (`TEGraphedLayers`) is what TE users do today without qeffect, as docs/design.md §8 describes it
(22.1 ms / 43.7 ms per step for h2048 / h4096): the model's layers as TE `TransformerLayer`s (same hidden,
FFN, heads, sequence and microbatch size, as many layers as the pipeline has), each graphed separately
with FP8 delayed scaling from the run's recipe, params in the activation dtype (TE's usual setup), dropout
off. A llama run's layers are `TransformerLayer`s with its settings (`te_layer_family`: RMSNorm, SwiGLU,
`num_gqa_groups`, no biases, TE's rotary frequencies as `rotary_pos_emb`). One step: for each
microbatch, forward through all layers inside `te.pytorch.autocast` and backward with a fixed random
output gradient (TE's own CUDA-graph test drives its graphed layers the same way);
then AdamW over the bf16 params. No embedding, head or loss, and no pipeline: its floor is the
layers-only floor.

`te-graphed-model` (`TEGraphedModel`) puts the same per-layer graphs into the run's whole model with
its numerics, for a like-for-like reference: fp32 master parameters (the layers under `torch.autocast`
in the activation dtype), token and position embeddings, the final LayerNorm and an FP8 output head
(`te.LayerNormLinear`, eager, as the embeddings), the model's loss on the run's token data, and torch's
fused AdamW over every fp32 parameter (native eager's optimizer). Its floor is the whole model's.

`te-graphed-mcore` (`TEGraphedMcore`) is `te-graphed-model` set up as Megatron-LM sets TE up (what a
Megatron-Core user runs with its Transformer Engine graphs): gradient accumulation fusion (every TE
weight's gradient GEMM accumulates into an fp32 ``main_grad``, one flat buffer zeroed once per step, so
no per-microbatch gradient copies, casts or adds) and FP8 weights cached per step (`make_graphed_callables`
with ``cache_quantized_params``, Megatron-Core's ``fp8_weight_caching``: a weight is cast on a step's first
microbatch only). The same model, fp32 masters and optimizer; its wgrad sums in fp32 inside the GEMM.

`te-graphed` is the fixed anchor of the Transformer Engine targets (a targets file names it:
`examples/targets/h200.toml`); `te-graphed-model` and `te-graphed-mcore` are extra rows beside it.

Per-layer graphs keep one static input/output set, so microbatch m's backward must run before
microbatch m+1's forward (no 1F1B overlap, which one process cannot use anyway). Transformer Engine
is imported only here and only when an anchor runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from qeffect.config import RunConfig
from qeffect.fp8.te import make_te_recipe
from qeffect.model.gpt import INIT_STD, cross_entropy, rng_devices
from qeffect.runtime.build import dtype_of, recipe_of
from qeffect.runtime.phases import SetupClock
from qeffect.runtime.rank import make_optimizer
from qeffect.verify.state import synthetic_batches


def te_layer_family(cfg: RunConfig) -> dict[str, object]:
    """The `TransformerLayer` settings of the run's model family beyond the shape: for llama, RMSNorm with
    its epsilon, SwiGLU, grouped-query attention (`num_gqa_groups`) and no biases (the rotary frequencies
    are a forward argument, `TEGraphedLayers._rotary`); the GPT keeps TE's defaults (LayerNorm, GELU, biases)."""
    mc = cfg.model
    if mc.family != "llama":
        return {}
    return {"normalization": "RMSNorm", "layernorm_epsilon": mc.norm_eps, "activation": "swiglu",
            "num_gqa_groups": mc.num_kv_heads, "bias": False}


class TEGraphedLayers:
    """Runner with the interface `matrix.py` times: `data(step)`, `step(data)` and graph counters."""

    whole_model = False  # `TEGraphedModel`: fp32 masters, embeddings, head and loss around the layers
    fused_wgrad = False  # `TEGraphedMcore`: wgrad GEMMs accumulate into `main_grad`
    cached_weights = False  # `TEGraphedMcore`: FP8 weights cast on a step's first microbatch only

    def __init__(self, cfg: RunConfig, device: torch.device, *, num_warmup_iters: int = 3) -> None:
        import transformer_engine.pytorch as te

        self.te = te
        mc = cfg.model
        self.cfg, self.device = cfg, device
        self.dtype = dtype_of(cfg)
        self.microbatches = cfg.pipeline.microbatches
        self.layers_count = mc.layers_per_chunk * cfg.pipeline.num_stages
        self.shape = (mc.seq_len, mc.microbatch_size, mc.hidden)  # TE's default sbhd layout
        self.recipe = make_te_recipe(recipe_of(cfg))
        params_dtype = torch.float32 if self.whole_model else self.dtype
        clock = SetupClock(device)
        with clock.phase("modules"), torch.random.fork_rng(devices=rng_devices(device)):
            torch.manual_seed(cfg.train.seed)
            layers = [te.TransformerLayer(mc.hidden, mc.ffn, mc.heads, hidden_dropout=0.0, attention_dropout=0.0,
                                          self_attn_mask_type="causal", fuse_qkv_params=True,
                                          params_dtype=params_dtype, seq_length=mc.seq_len,
                                          micro_batch_size=mc.microbatch_size, device=device,
                                          fuse_wgrad_accumulation=self.fused_wgrad, **te_layer_family(cfg))
                      for _ in range(self.layers_count)]
            self.layer_kwargs = self._rotary()  # llama: the rotary frequencies every layer call takes
            self.ends = self._ends()
        modules = {**{f"layer{i}": layer for i, layer in enumerate(layers)}, **self.ends}
        named = [(f"{m}.{n}", p) for m, module in modules.items() for n, p in module.named_parameters()]
        self.param_names = [n for n, _ in named]  # beside `params`, for whoever reports on them
        self.params = [p for _, p in named]
        # fused wgrad: one fp32 buffer, and the weights whose gradient is their view of it (`main_grad`)
        self.main_grad, self.fused_weights = (self._main_grads([*layers, *self.ends.values()]) if self.fused_wgrad
                                              else (None, []))
        self._skip_flag: torch.Tensor | None = None  # see `_weight_cache_flag`
        with clock.phase("capture"), self._activations(), self._weight_cache_flag():  # synchronized at both ends
            # fused wgrad: the weights' gradients are `main_grad`'s, not autograd's (hence unused inputs)
            self.graphed = [te.make_graphed_callables(
                layer, (torch.ones(self.shape, device=device, dtype=self.dtype, requires_grad=True),),
                sample_kwargs=self.layer_kwargs or None,
                num_warmup_iters=num_warmup_iters, enabled=True, recipe=self.recipe,
                cache_quantized_params=self.cached_weights, allow_unused_input=self.fused_wgrad) for layer in layers]
            if self.main_grad is not None:
                self.main_grad.zero_()  # what the warm-up and capture accumulated
        self.capture_host_seconds = clock.seconds["capture"]
        with clock.phase("optimizer"):
            self.optimizer = make_optimizer(self.params, cfg.optim)
        self.setup_phases = clock.seconds
        self.graph_count = 2 * self.layers_count  # one forward and one backward graph per layer
        self.graphs_per_rank = None
        self.arena_bytes = None
        self.manager = None
        self._replays = 0

    def _ends(self) -> dict[str, nn.Module]:
        """The modules around the layers (none here)."""
        return {}

    def _rotary(self) -> dict[str, torch.Tensor]:
        """Llama: TE's own rotary frequencies `[s, 1, 1, head_dim]` (`RotaryPositionEmbedding`, the
        rotate-half layout qeffect's llama uses), passed to every layer as `rotary_pos_emb`; GPT: nothing."""
        mc = self.cfg.model
        if mc.family != "llama":
            return {}
        from transformer_engine.pytorch.attention.rope import RotaryPositionEmbedding

        with torch.cuda.device(self.device):
            rope = RotaryPositionEmbedding(mc.hidden // mc.heads, rotary_base=mc.rope_theta)
            return {"rotary_pos_emb": rope(mc.seq_len)}

    def _main_grads(self, modules: list[nn.Module]) -> tuple[torch.Tensor, list[nn.Parameter]]:
        """One fp32 buffer holding every TE weight's ``main_grad`` (Megatron's grad buffer), and those weights:
        the 2-D parameters of the TE modules, which fused accumulation writes; the rest keep autograd's ``.grad``."""
        weights = [p for m in modules if type(m).__module__.startswith("transformer_engine")
                   for p in m.parameters() if p.dim() == 2]
        flat = torch.zeros(sum(p.numel() for p in weights), device=self.device, dtype=torch.float32)
        offset = 0
        for p in weights:
            p.main_grad = flat[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
        return flat, weights

    @contextlib.contextmanager
    def _weight_cache_flag(self) -> Iterator[None]:
        """TE's flag that tells graphs with cached FP8 weights whether to cast (set per call from
        ``is_first_microbatch``) is process-global, and every TE module captured in a graph later (qeffect's
        own captured stage actions included) would read it and skip its weight casts: it is this anchor's
        only while it captures or steps; TE's own value (normally none) is put back after."""
        if not self.cached_weights:
            yield
            return
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager

        state = FP8GlobalStateManager.quantization_state
        saved, state.skip_fp8_weight_update_tensor = state.skip_fp8_weight_update_tensor, self._skip_flag
        try:
            yield
        finally:  # the capture allocated it (its graphs read that tensor): kept for the replays
            self._skip_flag, state.skip_fp8_weight_update_tensor = state.skip_fp8_weight_update_tensor, saved

    def _first(self, microbatch: int) -> dict[str, bool]:
        """The keyword a layer or the head takes: with cached FP8 weights, whether this is the step's first
        microbatch (the one that casts them); TE's defaults otherwise."""
        return {"is_first_microbatch": microbatch == 0} if self.cached_weights else {}

    def update(self) -> None:
        """The optimizer step over the accumulated gradients, then every gradient cleared."""
        for p in self.fused_weights:
            p.grad = p.main_grad  # a view: the optimizer reads the fused sums in place
        self.optimizer.step()
        self.discard()

    def discard(self) -> None:
        """Every accumulated gradient cleared (autograd's ``.grad`` and the fused ``main_grad``)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.main_grad is not None:
            self.main_grad.zero_()

    def _activations(self) -> contextlib.AbstractContextManager:
        """The context the layers run (and are captured) in: the params are already in the activation dtype."""
        return contextlib.nullcontext()

    def data(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.cfg.train.seed * 1_000_003 + step)
        return [(torch.randn(self.shape, generator=g).to(self.device, self.dtype),
                 torch.randn(self.shape, generator=g).to(self.device, self.dtype))
                for _ in range(self.microbatches)]

    def step(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        te = self.te
        with self._weight_cache_flag():  # the step's: entered once, not per microbatch
            for m, (x, grad_out) in enumerate(data):
                y = x.requires_grad_()
                with te.autocast(enabled=True, recipe=self.recipe):
                    for layer in self.graphed:
                        y = layer(y, **self.layer_kwargs, **self._first(m))
                y.backward(grad_out)
                self._replays += 2 * self.layers_count
        self.update()
        return None

    def counters(self) -> tuple[int, int]:
        """(replays, caller/graph handoffs): TE replays on the caller's stream, so no handoffs."""
        return self._replays, 0

    def host_phases(self) -> None:
        """Not timed by phase: the host's queue time is Transformer Engine's and torch's."""
        return None


class TEGraphedModel(TEGraphedLayers):
    """`te-graphed-model`: the per-layer graphs inside the run's whole model, with its numerics (module doc)."""

    whole_model = True

    def _ends(self) -> dict[str, nn.Module]:
        mc, te = self.cfg.model, self.te
        llama = mc.family == "llama"  # rotary positions (no table), an RMSNorm before the head
        norm = {"normalization": "RMSNorm", "eps": mc.norm_eps} if llama else {}
        ends = {"tok_emb": nn.Embedding(mc.vocab_size, mc.hidden, device=self.device),
                **({} if llama else {"pos_emb": nn.Embedding(mc.seq_len, mc.hidden, device=self.device)}),
                "head": te.LayerNormLinear(mc.hidden, mc.vocab_size, bias=False, params_dtype=torch.float32,
                                           device=self.device, fuse_wgrad_accumulation=self.fused_wgrad,
                                           **norm)}
        with torch.no_grad():  # the model's init scale (nn.Embedding's own is N(0, 1))
            for name in ("tok_emb", "pos_emb"):
                if name in ends:
                    ends[name].weight.normal_(0.0, INIT_STD)
        return ends

    def _activations(self) -> contextlib.AbstractContextManager:
        """fp32 masters: the layers compute in the activation dtype under torch's autocast (TE's graphs
        refuse autocast's weight cache, which a captured graph could not refresh)."""
        return torch.autocast(self.device.type, dtype=self.dtype, cache_enabled=False)

    def data(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return synthetic_batches(self.cfg, step, self.device)  # the pipeline's own token data

    def step(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        total = self.accumulate(data)
        self.update()
        return total

    def accumulate(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """Forward and backward of every microbatch (the gradients summed, no update): the mean loss."""
        te, ends = self.te, self.ends
        total = torch.zeros((), device=self.device)
        pos = torch.arange(self.cfg.model.seq_len, device=self.device)
        with self._weight_cache_flag():  # the step's: entered once, not per microbatch
            for m, (tokens, targets) in enumerate(data):
                with self._activations(), te.autocast(enabled=True, recipe=self.recipe):
                    x = ends["tok_emb"](tokens)
                    if "pos_emb" in ends:
                        x = x + ends["pos_emb"](pos)
                    x = x.to(self.dtype).transpose(0, 1).contiguous()  # sbhd
                    for layer in self.graphed:
                        x = layer(x, **self.layer_kwargs, **self._first(m))
                    logits = ends["head"](x, **self._first(m)).transpose(0, 1)  # [b, s, vocab]
                loss = cross_entropy(logits, targets) / len(data)
                loss.backward()
                total += loss.detach()
                self._replays += 2 * self.layers_count
        return total

    def gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """`param`'s accumulated gradient: its ``main_grad`` where accumulation is fused, else ``.grad``."""
        return getattr(param, "main_grad", param.grad)  # only the fused weights have one


class TEGraphedMcore(TEGraphedModel):
    """`te-graphed-mcore`: `te-graphed-model` with Megatron-LM's TE setup (fused wgrad accumulation into
    fp32 ``main_grad``, FP8 weights cached per step; module doc)."""

    fused_wgrad = True
    cached_weights = True
