"""One Megatron-Core capture mode in its own process: `python -m qeffect.audit.runner --mode M --json PATH`.

Why a process per mode: a capture mode that corrupts the CUDA context, deadlocks NCCL or leaves
Megatron's process-wide graph state (`_CudagraphGlobalRecord`, `FullCudaGraphWrapper`'s class
attributes, the RNG tracker) half-initialized must not take the other modes with it. The parent
(`qeffect.audit.megatron`) only reads the JSON written here, or this process's exit code and stderr.

The training loop is built from `megatron.core` pieces only (no `megatron.training`), the way
Megatron's own `train_step` drives them: GPTModel with the Transformer Engine layer spec, wrapped in
`Float16Module` and Megatron DDP (`main_grad`), Megatron's mixed-precision Adam, the schedule from
`get_forward_backward_func()`, `finalize_model_grads`, FP8 delayed scaling through the config.
The JSON is rewritten after setup and after every step, so a hard crash still leaves the steps done.

Only the standard library is imported at module level: the parent and the CPU tests import
`mode_settings` and `describe_exception` from here without torch or Megatron.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from typing import Any

MODES = ("eager", "local", "transformer_engine", "full_iteration")
DELAY_WGRAD = "delay_wgrad"
GRAPH_WARMUP_STEPS = 3  # Megatron's default cuda_graph_warmup_steps

# The four capture modes, as Megatron-Core 0.19's `TransformerConfig.cuda_graph_impl`. Per-layer modes
# capture the whole layer (`cuda_graph_modules=[]`, which replaced the deprecated `cuda_graph_scope="full"`).
_MODE_SETTINGS: dict[str, dict[str, Any]] = {
    "eager": {"cuda_graph_impl": "none"},
    "local": {"cuda_graph_impl": "local", "cuda_graph_modules": [],
              "cuda_graph_warmup_steps": GRAPH_WARMUP_STEPS,
              "driver": "CudaGraphManager per layer; create_cudagraphs() at the end of forward_backward"},
    "transformer_engine": {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": [],
                           "cuda_graph_warmup_steps": GRAPH_WARMUP_STEPS,
                           "driver": "TECudaGraphHelper.create_cudagraphs() before step cuda_graph_warmup_steps"},
    "full_iteration": {"cuda_graph_impl": "full_iteration", "cuda_graph_warmup_steps": GRAPH_WARMUP_STEPS,
                       "driver": "FullCudaGraphWrapper(forward_backward_func); DDP built on its capture stream"},
    DELAY_WGRAD: {"cuda_graph_impl": "none", "delay_wgrad_compute": True},
}


def mode_settings(mode: str) -> dict[str, Any]:
    """The Megatron-Core settings a mode asks for (the child records what the installed version took)."""
    if mode not in _MODE_SETTINGS:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(_MODE_SETTINGS)}")
    return json.loads(json.dumps(_MODE_SETTINGS[mode]))


def short_path(filename: str) -> str:
    """Cut a frame's file name to the package-relative part (`megatron/core/...`, `transformer_engine/...`)."""
    name = filename.replace("\\", "/")
    for marker in ("/megatron/", "/transformer_engine/", "/torch/", "/qeffect/"):
        i = name.rfind(marker)
        if i >= 0:
            return name[i + 1:]
    return name


def describe_exception(exc: BaseException, stage: str) -> dict[str, Any]:
    """Exception type, message and the innermost Megatron frame (`megatron/...py:LINE in FUNC`)."""
    frames = traceback.extract_tb(exc.__traceback__)
    megatron = [f for f in frames if "/megatron/" in f.filename.replace("\\", "/")]
    where = (lambda f: f"{short_path(f.filename)}:{f.lineno} in {f.name}") if frames else None
    message = str(exc) or repr(exc)
    return {
        "type": type(exc).__name__,
        "message": message if len(message) <= 2000 else message[:2000] + "...",
        "megatron_location": where(megatron[-1]) if megatron else None,
        "origin_location": where(frames[-1]) if frames else None,
        "stage": stage,
    }


def _write(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def _versions() -> dict[str, str | None]:
    import torch

    out: dict[str, str | None] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                                  "python": platform.python_version()}
    try:
        import transformer_engine

        out["transformer_engine"] = transformer_engine.__version__
    except Exception:  # noqa: BLE001 - a missing TE is itself a finding, reported by the mode that needs it
        out["transformer_engine"] = None
    try:
        from megatron.core import package_info

        out["megatron_core"] = package_info.__version__
    except Exception:  # noqa: BLE001
        out["megatron_core"] = None
    return out


def _graph_kwargs(config_cls: type, mode: str) -> dict[str, Any]:
    """Map a mode onto the fields the installed TransformerConfig has (0.19: cuda_graph_impl/modules)."""
    import dataclasses

    fields = {f.name for f in dataclasses.fields(config_cls)}
    want = mode_settings(mode)
    want.pop("driver", None)
    kw: dict[str, Any] = {}
    impl = want.pop("cuda_graph_impl")
    if "cuda_graph_impl" in fields:
        kw["cuda_graph_impl"] = impl
    elif impl == "local":  # before cuda_graph_impl existed
        kw["enable_cuda_graph"] = True
    elif impl == "transformer_engine":
        kw["external_cuda_graph"] = True
    elif impl == "full_iteration":
        kw["enable_cuda_graph"] = True
        kw["cuda_graph_scope"] = "full_iteration"
    if "cuda_graph_modules" in want:
        modules = want.pop("cuda_graph_modules")
        if "cuda_graph_modules" in fields:
            kw["cuda_graph_modules"] = modules
        elif "cuda_graph_scope" in fields:
            kw["cuda_graph_scope"] = "full"
    kw.update({k: v for k, v in want.items() if k in fields})
    return kw


def _reinit(module: Any, seed: int) -> None:
    """Identical initial parameters in every mode, whatever RNG tracker the mode's Megatron setup uses."""
    import torch

    g = torch.Generator(device="cuda")
    g.manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() >= 2:
                p.copy_(torch.empty(p.shape, device=p.device, dtype=torch.float32).normal_(0.0, 0.02, generator=g))
            elif name.rsplit(".", 1)[-1].endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)


def _run(args: argparse.Namespace, result: dict[str, Any], save: Any) -> None:
    shape = json.loads(args.shape)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    result["rank"] = rank

    import torch

    result["versions"] = _versions()
    torch.cuda.set_device(local)
    result["device"] = torch.cuda.get_device_name(local)
    torch.distributed.init_process_group("nccl", rank=rank, world_size=world,
                                         device_id=torch.device("cuda", local))

    from megatron.core import parallel_state
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    pp, vpp = args.pp, (args.vpp or None)
    dp = world // pp
    S, B, M, V = shape["seq_len"], shape["microbatch_size"], shape["microbatches"], shape["vocab_size"]
    seed = shape["seed"]
    result["stage"] = "setup: parallel state"
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp,
                                             virtual_pipeline_model_parallel_size=vpp,
                                             create_gloo_process_groups=False)
    # Graph-safe RNG tracker in every mode (Megatron switches to it for graphs; eager shares it so that
    # the modes differ only in capture). Dropout is 0, so no random numbers are drawn while training.
    model_parallel_cuda_manual_seed(seed, te_rng_tracker=True, use_cudagraphable_rng=True)
    init_num_microbatches_calculator(rank, None, B * M * dp, B, dp)

    graph_kw = _graph_kwargs(TransformerConfig, args.mode)
    common = dict(
        num_layers=shape["layers"], hidden_size=shape["hidden"], ffn_hidden_size=shape["ffn"],
        num_attention_heads=shape["heads"], hidden_dropout=0.0, attention_dropout=0.0, init_method_std=0.02,
        tensor_model_parallel_size=1, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16,
        fp8="hybrid", fp8_recipe="delayed", fp8_margin=shape["fp8_margin"],
        fp8_amax_history_len=shape["amax_history_len"], fp8_amax_compute_algo=shape["amax_compute_algo"],
        # No apex here: Megatron's own output layer needs apex for fused wgrad accumulation.
        gradient_accumulation_fusion=False, deallocate_pipeline_outputs=True, use_te_rng_tracker=True,
    )
    result["settings"] = {**mode_settings(args.mode), "applied": {k: v for k, v in graph_kw.items()}}
    result["common_settings"] = {k: (str(v) if isinstance(v, torch.dtype) else v) for k, v in common.items()}
    if args.mode == DELAY_WGRAD:
        # Second attempt, config only: the dense model asks for the MoE overlap that delayed wgrad requires.
        probe_kw = {**graph_kw, "overlap_moe_expert_parallel_comm": True}
        try:
            TransformerConfig(**common, **probe_kw)
            probe = {"type": None, "message": "accepted"}
        except Exception as exc:  # noqa: BLE001 - the refusal is the finding
            probe = describe_exception(exc, "setup: TransformerConfig")
        result["probes"] = [{"settings": {k: v for k, v in probe_kw.items()}, **probe}]
    result["stage"] = "setup: TransformerConfig"
    config = TransformerConfig(**common, **graph_kw)
    impl = getattr(config, "cuda_graph_impl", "none")
    resolved = {"cuda_graph_impl": impl}
    if hasattr(config, "cuda_graph_modules"):
        resolved["cuda_graph_modules"] = [getattr(m, "name", str(m)) for m in config.cuda_graph_modules]
    for key in ("cuda_graph_warmup_steps", "cuda_graph_use_single_mempool", "delay_wgrad_compute"):
        if hasattr(config, key):
            resolved[key] = getattr(config, key)
    result["settings"]["resolved"] = resolved
    save()

    result["stage"] = "setup: model"
    spec = get_gpt_layer_with_transformer_engine_spec()
    chunks = []
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    for vp in range(vpp or 1):
        vp_stage = vp if vpp else None
        gpt = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=V, max_sequence_length=S,
                       pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                       post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                       share_embeddings_and_output_weights=False, position_embedding_type="learned_absolute",
                       vp_stage=vp_stage)
        gpt.cuda(torch.cuda.current_device())
        chunk = Float16Module(config, gpt)
        _reinit(chunk, seed + 7919 * (vp * pp + pp_rank))
        chunks.append(chunk)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            use_distributed_optimizer=False, check_for_nan_in_grad=False)
    if impl == "full_iteration":
        from megatron.core.full_cuda_graph import get_shared_capture_stream

        ddp_stream = get_shared_capture_stream()
    else:
        ddp_stream = torch.cuda.Stream()
    ddp_stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(ddp_stream):
        model = [DistributedDataParallel(config=config, ddp_config=ddp_cfg, module=c, disable_bucketing=i > 0)
                 for i, c in enumerate(chunks)]
    torch.cuda.current_stream().wait_stream(ddp_stream)

    result["stage"] = "setup: optimizer"
    opt_cfg = OptimizerConfig(optimizer="adam", lr=shape["lr"], min_lr=shape["lr"], weight_decay=shape["weight_decay"],
                              adam_beta1=shape["beta1"], adam_beta2=shape["beta2"], adam_eps=shape["eps"],
                              bf16=True, params_dtype=torch.bfloat16, use_distributed_optimizer=False, clip_grad=1.0)
    optimizer = get_megatron_optimizer(opt_cfg, model, use_gloo_process_groups=False)
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss

    # Synthetic tokens: a fixed pool of microbatches, cycled, so the loss falls and trajectories say something.
    gen = torch.Generator().manual_seed(seed + 1)
    pool = torch.randint(0, V, (4 * M, B, S + 1), generator=gen).cuda()
    mask = (~torch.tril(torch.ones(S, S, dtype=torch.bool, device="cuda"))).reshape(1, 1, S, S).repeat(B, 1, 1, 1)
    pos = torch.arange(S, device="cuda").unsqueeze(0).repeat(B, 1)
    loss_mask = torch.ones(B, S, device="cuda")
    batches = [{"tokens": x[:, :-1].contiguous(), "labels": x[:, 1:].contiguous(), "loss_mask": loss_mask,
                "attention_mask": mask, "position_ids": pos} for x in pool]

    def cycle():
        while True:
            yield from batches

    iters = [cycle() for _ in model]

    def forward_step(data_iterator, chunk):
        batch = next(data_iterator)
        out = chunk(batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"])
        lm = batch["loss_mask"]

        def loss_func(output_tensor):
            losses = output_tensor.float().view(-1)
            m = lm.view(-1).float()
            loss = torch.sum(losses * m)
            num_tokens = m.sum().to(torch.int)
            report = torch.cat([loss.detach().view(1), num_tokens.float().view(1)])
            return loss, num_tokens, {"lm loss": report}

        return out, loss_func

    forward_backward = get_forward_backward_func()
    helper = None
    if impl == "full_iteration":
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper

        forward_backward = FullCudaGraphWrapper(forward_backward,
                                                cuda_graph_warmup_steps=config.cuda_graph_warmup_steps,
                                                use_single_mempool=config.cuda_graph_use_single_mempool)
    elif impl == "transformer_engine":
        from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

        helper = TECudaGraphHelper(model=model, config=config, seq_length=S, micro_batch_size=B,
                                   optimizers=[optimizer])
    save()

    for step in range(args.steps):
        result["stage"] = f"step {step}"
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if helper is not None and not helper.capture_finished() and step == config.cuda_graph_warmup_steps:
            helper.create_cudagraphs()
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        losses_reduced = forward_backward(forward_step_func=forward_step, data_iterator=iters, model=model,
                                          num_microbatches=M, seq_length=S, micro_batch_size=B,
                                          decoder_seq_length=S, forward_only=False)
        optimizer.step()
        torch.cuda.synchronize()
        dt = torch.tensor([(time.perf_counter() - t0) * 1e3], dtype=torch.float64, device="cuda")
        if losses_reduced:
            total = torch.stack([d["lm loss"] for d in losses_reduced]).sum(0).double()
        else:
            total = torch.zeros(2, dtype=torch.float64, device="cuda")
        if world > 1:  # the loss lives on the last stage, the step takes as long as the slowest rank
            torch.distributed.all_reduce(total)
            torch.distributed.all_reduce(dt, op=torch.distributed.ReduceOp.MAX)
        loss_sum, tokens = total.tolist()
        result["step_times_ms"].append(dt.item())
        result["losses"].append(float(torch.tensor(loss_sum / tokens, dtype=torch.float32).item()))
        result["steps_completed"] = step + 1
        save()
    result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()  # `qeffect profile`'s megatron-graphs row
    result["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
    result["stage"] = "done"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m qeffect.audit.runner")
    ap.add_argument("--mode", required=True, choices=list(_MODE_SETTINGS))
    ap.add_argument("--json", required=True)
    ap.add_argument("--shape", required=True, help="AuditShape as JSON")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=0)
    ap.add_argument("--port", type=int, default=29500)
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    path = args.json if rank == 0 else f"{args.json}.rank{rank}"
    result: dict[str, Any] = {"mode": args.mode, "pp": args.pp, "vpp": args.vpp or None, "status": "running",
                              "stage": "setup: import", "steps_requested": args.steps, "steps_completed": 0,
                              "step_times_ms": [], "losses": [], "settings": mode_settings(args.mode),
                              "probes": [], "failure": None}
    t0 = time.perf_counter()

    def save() -> None:
        result["wall_s"] = time.perf_counter() - t0
        _write(path, result)

    code = 0
    try:
        _run(args, result, save)
        result["status"] = "finished"
    except BaseException as exc:  # noqa: BLE001 - every failure, even SystemExit, is the mode's result
        result["status"] = "failed"
        result["failure"] = describe_exception(exc, result["stage"])
        traceback.print_exc()
        code = 3
    save()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter and NCCL teardown: after a failed capture it can hang or abort, and the result is saved.
    os._exit(code)


if __name__ == "__main__":
    main()
