"""User-facing audits built on the runtime. `megatron`: Megatron-Core's own CUDA-graph modes, one process each.

`runner` is the child entry point (`python -m qeffect.audit.runner`); `report` holds the JSON schema.
Nothing here imports Megatron, Transformer Engine or CUDA at import time.
"""
