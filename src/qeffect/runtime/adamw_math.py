"""The arithmetic of one AdamW update, as Triton JIT functions every updating pass calls.

Why a module of its own: `runtime.adamw`'s dense pass and `runtime.lazy_rows`' row-lazy pass must leave
the same bits, so both call these; the dense optimizer also builds the row-lazy state, so the shared
arithmetic sits below both (see `runtime.adamw`'s docstring for whose bits they are).
"""

from __future__ import annotations

from qeffect.triton_lazy import triton_kernel


@triton_kernel
def adamw_math(triton, tl):  # noqa: ANN001, ANN202 - builds Triton JIT functions
    """(update, step): `update` loads, updates and stores at ``offs``; `step` is the arithmetic alone.
    A kernel that calls them must bind them as globals of its own module under the same names
    (``_adamw_update``, ``_adamw_step``): every Triton version resolves a JIT function's callees there."""

    @triton.jit
    def _adamw_update(p_ptr, g_ptr, s_ptr, slot_stride, m_ptr, v_ptr, bc1_ptr, bc2_sqrt_ptr, offs, mask, lr, beta1,
                      beta2, weight_decay, eps, COUNT: tl.constexpr, INIT: tl.constexpr, DECAY: tl.constexpr):
        """The update at ``offs`` (any shape), stored; returns the new parameter. With ``COUNT`` staged
        slots (``s_ptr``, rows ``slot_stride`` apart) the gradient is their fold first, as
        `stage.accumulate.fold_staged` adds: fp32, slot order, onto ``g`` or (``INIT``) onto slot 0."""
        if INIT:
            g = tl.load(s_ptr + offs, mask=mask).to(tl.float32)
            for j in tl.static_range(1, COUNT):
                g = g + tl.load(s_ptr + j * slot_stride + offs, mask=mask).to(tl.float32)
        else:
            g = tl.load(g_ptr + offs, mask=mask)
            for j in tl.static_range(0, COUNT):
                g = g + tl.load(s_ptr + j * slot_stride + offs, mask=mask).to(tl.float32)
        p = tl.load(p_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        p, m, v = _adamw_step(p, g, m, v, lr, beta1, beta2, weight_decay, eps, tl.load(bc1_ptr),
                              tl.load(bc2_sqrt_ptr), DECAY)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        return p

    @triton.jit
    def _adamw_step(p, g, m, v, lr, beta1, beta2, weight_decay, eps, bc1, bc2_sqrt, DECAY: tl.constexpr):
        """The arithmetic of one update on loaded values (torch's fused kernel's): (p, m, v) after it.
        Shared by every pass that updates, so each gives the bits of the others (`runtime.lazy_rows`)."""
        if DECAY:
            p = p - lr * weight_decay * p
        m = tl.fma(beta1, m, tl.fma(-beta1, g, g))
        gg = g * g
        v = tl.fma(beta2, v, tl.fma(-beta2, gg, gg))
        step_size = tl.div_rn(lr, bc1)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
        return p, m, v

    globals()["_adamw_update"] = _adamw_update  # `_adamw_update` calls `_adamw_step` through this module
    globals()["_adamw_step"] = _adamw_step
    globals()["tl"] = tl  # Triton's interpreter finds the language it patches in the callee's module globals
    return _adamw_update, _adamw_step
