"""Fused projections: one matmul for Q, K and V, one for an MLP's gate and up.

A decode step multiplies a few rows by every weight matrix of the model, so each projection is
one small matmul whose cost is mostly fixed (a kernel launch, a thunk on XLA:CPU, the weights
streamed once). :func:`fuse_projections` concatenates, once and in place, each attention
layer's ``q_proj``/``k_proj``/``v_proj`` into one ``qkv_proj`` and each gated MLP's
``gate``/``up`` into one ``gate_up``: 9 matmuls per Llama block become 6, with the same
results (the same products, read from other columns). Measured in ``docs/speed.md``.

The fused columns are grouped so that tensor parallelism still splits them by whole heads and
MLP columns (:mod:`kvjax.shard` splits ``qkv_proj`` like ``q_proj`` and ``gate_up`` like
``gate``):

- ``qkv_proj.kernel [E, H * (G + 2) * D]``: for each kv head ``h``, its ``G`` query heads
  (query head ``h * G + g``, the grouping kvjax's attention uses), then its key head, then its
  value head, ``D`` columns each. Biases (Qwen2) are grouped the same way.
- ``gate_up.kernel [E, F * 2]``: column ``2 f`` is gate column ``f``, ``2 f + 1`` up column ``f``.

Fusing is a change of parameters, not of the model's maths: checkpoints load into the unfused
layout (``from_pretrained``, ``from_gguf``, ``llama_from_hf``), and a model is fused after
loading. The linen twin (``LlamaLinen``) keeps separate projections.

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from kvjax.nn import Llama, LlamaConfig, fuse_projections
    >>> model = Llama(LlamaConfig(n_layer=1, d_model=64, n_heads=4, n_kv_heads=2), rngs=nnx.Rngs(0))
    >>> tokens = jnp.array([[1, 2, 3]])
    >>> before = model.forward(tokens)
    >>> fuse_projections(model) is model, model.layers[0].attn.qkv_proj.kernel.shape
    (True, (64, 128))
    >>> bool(jnp.allclose(model.forward(tokens), before, atol=1e-5))
    True
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from kvjax.nn._fused_layout import group_qkv
from kvjax.nn._ggml_linear import GGMLLinear
from kvjax.nn._llama import MLP
from kvjax.nn._nnx_attention import CachedAttention

__all__ = ["fuse_projections", "is_fused"]


def _linear(kernel, bias, like):
    """An ``nnx.Linear`` holding ``kernel [in, out]`` (and ``bias [out]``), computing as ``like`` does."""
    n_in, n_out = kernel.shape
    zeros = nnx.initializers.zeros_init()  # overwritten below: no random draw of a large matrix
    lin = nnx.Linear(
        n_in,
        n_out,
        use_bias=bias is not None,
        dtype=like.dtype,
        param_dtype=kernel.dtype,
        precision=like.precision,
        kernel_init=zeros,
        bias_init=zeros,
        rngs=nnx.Rngs(0),
    )
    lin.kernel.set_value(kernel)
    if bias is not None:
        lin.bias.set_value(bias)
    return lin


def _same_blocks(*layers) -> bool:
    """Whether ``layers`` are all :class:`GGMLLinear` of one type and input width (rows can be joined)."""
    return all(isinstance(m, GGMLLinear) for m in layers) and len({(m.type_name, m.in_features) for m in layers}) == 1


def _blocks_linear(raw, bias, like):
    """A :class:`GGMLLinear` over the joined rows ``raw [N, row_bytes]``, of ``like``'s type."""
    return GGMLLinear(raw, like.type_name, like.in_features, bias=bias)


def _fuse_attention(attn) -> None:
    q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
    if not isinstance(q, nnx.Linear):
        # weights kept as ggml blocks: a row of blocks is one output column, so the rows regroup as
        # the kernel's columns do; projections stored in different types stay separate
        if _same_blocks(q, k, v):
            raw = group_qkv(q.blocks[...].T, k.blocks[...].T, v.blocks[...].T, attn.n_kv_heads).T
            bias = None if q.bias is None else group_qkv(q.bias[...], k.bias[...], v.bias[...], attn.n_kv_heads)
            attn.qkv_proj = _blocks_linear(raw, bias, q)
            attn.q_proj = attn.k_proj = attn.v_proj = None
        return
    kernel = group_qkv(q.kernel[...], k.kernel[...], v.kernel[...], attn.n_kv_heads)
    bias = None
    if q.bias is not None:
        bias = group_qkv(q.bias[...], k.bias[...], v.bias[...], attn.n_kv_heads)
    attn.qkv_proj = _linear(kernel, bias, q)
    attn.q_proj = attn.k_proj = attn.v_proj = None


def _fuse_mlp(mlp) -> None:
    if not isinstance(mlp.gate, nnx.Linear):
        if _same_blocks(mlp.gate, mlp.up):
            g, u = mlp.gate.blocks[...], mlp.up.blocks[...]
            mlp.gate_up = _blocks_linear(jnp.stack([g, u], axis=1).reshape(2 * g.shape[0], -1), None, mlp.gate)
            mlp.gate = mlp.up = None
        return
    gate, up = mlp.gate.kernel[...], mlp.up.kernel[...]
    kernel = jnp.stack([gate, up], axis=-1).reshape(gate.shape[0], -1)
    mlp.gate_up = _linear(kernel, None, mlp.gate)
    mlp.gate = mlp.up = None


def is_fused(module) -> bool:
    """Whether ``module`` (a model or one of its layers) holds fused projections."""
    return any(
        getattr(m, "qkv_proj", None) is not None or getattr(m, "gate_up", None) is not None
        for _, m in nnx.iter_modules(module)
    )


def fuse_projections(model):
    """Fuse, in place, every attention layer's Q/K/V and every gated MLP's gate/up projections.

    Walks ``model`` (an NNX module: ``kvjax.nn.Llama``, ``HybridLM``, or any module built from
    :class:`kvjax.nn.CachedAttention` and :class:`kvjax.nn.MLP`) and replaces, in each
    ``CachedAttention``, ``q_proj``/``k_proj``/``v_proj`` by one ``qkv_proj`` and, in each
    ``MLP``, ``gate``/``up`` by one ``gate_up`` (layouts in the module docstring). The model
    computes the same function (the products are the same; float sums are not reordered).
    Layers already fused are left as they are, so fusing twice is harmless. Projections kept as
    ggml blocks (:func:`kvjax.nn.from_gguf`'s compact load) fuse when they share one block type
    (their rows are joined as bytes) and stay separate otherwise (a Q4_K_M file stores V in
    another type than Q and K).

    Take ``nnx.state(model)`` again afterwards (an Engine or Step built before keeps the old
    parameters).

    Args:
        model: an NNX module.

    Returns:
        ``model`` itself, fused.

    Raises:
        ValueError: ``model`` is not an NNX module.
    """
    if not isinstance(model, nnx.Module):
        raise ValueError(
            f"model must be an NNX module (e.g. kvjax.nn.Llama), got {type(model).__name__}; "
            "linen models (LlamaLinen) keep separate projections"
        )
    for _, module in list(nnx.iter_modules(model)):
        if isinstance(module, CachedAttention) and module.q_proj is not None:
            _fuse_attention(module)
        elif isinstance(module, MLP) and module.gate is not None:
            _fuse_mlp(module)
    return model
