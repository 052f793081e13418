"""Multi-head latent attention (DeepSeek V2/V3's MLA) for Flax NNX, cached on kvjax's latent cache.

Each token's key and value come from one compressed latent ``c = norm(W_dkv x)`` (``kv_lora_rank``
wide) and one RoPE key ``k_pe`` shared by every head (``qk_rope_head_dim`` wide). Decompressed,
head ``h`` sees ``k_h = [W_uk[h] c | k_pe]`` and ``v_h = W_uv[h] c`` (``kv_b_proj`` holds both),
which is how transformers computes it and how :meth:`MLAttention.uncached` does, the reference.

The cached path never decompresses. The cache row of a token is ``[c | k_pe]`` (one kv head of
a ``CacheConfig(mla=True)``; V is the row's first ``kv_lora_rank`` columns), and the absorbed
form moves ``W_uk`` onto the query and ``W_uv`` after the attention:

- ``q_row[h] = [W_uk[h]^T q_nope[h] | q_pe[h]]``, so ``q_row[h] . [c | k_pe] = q_h . k_h``;
- ``out[h] = W_uv[h] (sum_j p_hj c_j)``, so the attention reads latents only.

The scores are the same numbers, the softmax the same, so cached equals uncached within float
rounding, while the cache holds ``kv_lora_rank + qk_rope_head_dim`` numbers a token instead of
``n_heads * (qk_nope + qk_rope + v_head_dim)`` (``docs/architecture.md`` section 0i).

RoPE runs on the ``qk_rope_head_dim`` part only, in ggml's ``"normal"`` layout (adjacent pairs,
transformers' complex / interleaved DeepSeek form) unless the config says ``"neox"``; the K-shift
of the latent cache rotates that part of the row alone.

Example:
    >>> import jax, jax.numpy as jnp, kvjax
    >>> from flax import nnx
    >>> attn = MLAttention(32, n_heads=2, kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=4,
    ...                    v_head_dim=8, layer=0, rope=kvjax.RopeConfig(n_rot=4), rngs=nnx.Rngs(0))
    >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=36,
    ...                         head_dim_v=32, mla=True, rope=kvjax.RopeConfig(n_rot=4))
    >>> cache = kvjax.init(cfg)
    >>> ub = kvjax.make_ubatch([0, 1, 2], [[0]] * 3)
    >>> cache, slot, ok = kvjax.find_slot(cache, ub)
    >>> x = jax.random.normal(jax.random.PRNGKey(0), (4, 32))
    >>> y, cache = attn(x, cache, UbatchInputs(ubatch=ub, placement=slot, windows=(32,)))
    >>> ref = attn.uncached(x[None, :3], jnp.arange(3)[None])
    >>> bool(jnp.allclose(y[:3], ref[0], atol=1e-5))
    True
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax.numpy as jnp
from flax import nnx

import kvjax
from kvjax._typing import Array, Float, Int
from kvjax._validate import check_count, check_flag, check_real, require
from kvjax.memory._config import RopeConfig
from kvjax.memory._protocol import Memory
from kvjax.nn._inputs import UbatchInputs
from kvjax.nn._nnx_attention import attend_cached, attend_uncached, check_inputs, check_layer_cache

__all__ = ["MLAttention"]


def _rope(x: Float[Array, "... T H R"], pos: Int[Array, "... T"], rope: RopeConfig) -> Float[Array, "... T H R"]:
    """``kvjax.rope`` over any leading shape (the RoPE part of the queries or of the shared key)."""
    flat = pos.reshape(-1)
    return kvjax.rope(x.reshape((flat.shape[0],) + x.shape[-2:]), flat, rope).reshape(x.shape)


class MLAttention(nnx.Module):
    """DeepSeek's multi-head latent attention over a kvjax latent cache (see the module docstring).

    Args:
        d_model: E, the input and output width.
        n_heads: H, attention heads.
        kv_lora_rank: C, the latent width (the cache's ``head_dim_v``).
        qk_nope_head_dim: the per-head query/key width without RoPE.
        qk_rope_head_dim: R, the RoPE width (shared key, per-head query part).
        v_head_dim: the per-head value width.
        layer: the model layer id this module caches under.
        rope: RoPE parameters of the R-wide part (``n_rot == qk_rope_head_dim``).
        q_lora_rank: the low-rank query (``q_a_proj`` E -> Q, ``q_a_layernorm``, ``q_b_proj``), or
            ``None`` for one ``q_proj`` (DeepSeek V2-Lite).
        scale: softmax scale (default ``(qk_nope + qk_rope) ** -0.5``; DeepSeek's YaRN multiplies
            it by ``mscale ** 2``).
        use_bias: biases on ``q_a_proj``, ``kv_a_proj_with_mqa`` and ``o_proj`` (transformers'
            ``attention_bias``).
        norm_eps: epsilon of the latent norms ``q_a_layernorm`` / ``kv_a_layernorm``.
        param_dtype: parameter dtype.
        rngs: NNX random streams.

    Parameters (transformers' names): ``q_proj`` or ``q_a_proj`` / ``q_a_layernorm`` /
    ``q_b_proj``, ``kv_a_proj_with_mqa`` (E -> C + R), ``kv_a_layernorm`` (C), ``kv_b_proj``
    (C -> H * (qk_nope + v): each head's ``W_uk`` then ``W_uv``), ``o_proj`` (H * v -> E).
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        layer: int,
        rope: RopeConfig,
        q_lora_rank: Optional[int] = None,
        scale: Optional[float] = None,
        use_bias: bool = False,
        norm_eps: float = 1e-6,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.n_heads = check_count("n_heads", n_heads, 1)
        self.kv_lora_rank = check_count("kv_lora_rank", kv_lora_rank, 1)
        self.qk_nope_head_dim = check_count("qk_nope_head_dim", qk_nope_head_dim, 1)
        self.qk_rope_head_dim = check_count("qk_rope_head_dim", qk_rope_head_dim, 2)
        self.v_head_dim = check_count("v_head_dim", v_head_dim, 1)
        require(isinstance(rope, RopeConfig), "rope", rope, "a kvjax.RopeConfig")
        require(
            rope.n_rot == self.qk_rope_head_dim, "rope.n_rot", rope.n_rot, f"qk_rope_head_dim={self.qk_rope_head_dim}"
        )
        self.layer, self.rope = check_count("layer", layer, 0), rope
        self.q_lora_rank = None if q_lora_rank is None else check_count("q_lora_rank", q_lora_rank, 1)
        self.scale = check_real("scale", scale, above=0, optional=True)
        use_bias = check_flag("use_bias", use_bias)
        norm_eps = check_real("norm_eps", norm_eps, above=0)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        lin = dict(param_dtype=param_dtype, rngs=rngs)
        norm = dict(epsilon=norm_eps, param_dtype=param_dtype, rngs=rngs)
        if self.q_lora_rank is None:
            self.q_proj = nnx.Linear(d_model, n_heads * qk, use_bias=False, **lin)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nnx.Linear(d_model, self.q_lora_rank, use_bias=use_bias, **lin)
            self.q_a_layernorm = nnx.RMSNorm(self.q_lora_rank, **norm)
            self.q_b_proj = nnx.Linear(self.q_lora_rank, n_heads * qk, use_bias=False, **lin)
        self.kv_a_proj_with_mqa = nnx.Linear(
            d_model, self.kv_lora_rank + self.qk_rope_head_dim, use_bias=use_bias, **lin
        )
        self.kv_a_layernorm = nnx.RMSNorm(self.kv_lora_rank, **norm)
        self.kv_b_proj = nnx.Linear(
            self.kv_lora_rank, n_heads * (self.qk_nope_head_dim + self.v_head_dim), use_bias=False, **lin
        )
        self.o_proj = nnx.Linear(n_heads * self.v_head_dim, d_model, use_bias=use_bias, **lin)

    # -- shapes of the cache it needs ----------------------------------------------------------

    @property
    def row_width(self) -> int:
        """The latent cache's ``head_dim``: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """The scale of the scores: ``scale``, or ``(qk_nope + qk_rope) ** -0.5``."""
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5 if self.scale is None else self.scale

    # -- the projections -----------------------------------------------------------------------

    def _queries(self, x: Float[Array, "... E"]) -> Tuple[Float[Array, "... H N"], Float[Array, "... H R"]]:
        """``(q_nope, q_pe)`` of ``x`` (before RoPE)."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(x.shape[:-1] + (self.n_heads, self.qk_nope_head_dim + self.qk_rope_head_dim))
        return q[..., : self.qk_nope_head_dim], q[..., self.qk_nope_head_dim :]

    def _latents(self, x: Float[Array, "... E"]) -> Tuple[Float[Array, "... C"], Float[Array, "... 1 R"]]:
        """``(c, k_pe)``: the normalised latent and the shared RoPE key of ``x`` (before RoPE)."""
        ckv = self.kv_a_proj_with_mqa(x)
        c, k_pe = ckv[..., : self.kv_lora_rank], ckv[..., self.kv_lora_rank :]
        return self.kv_a_layernorm(c), k_pe[..., None, :]

    def up_projections(self) -> Tuple[Float[Array, "C H N"], Float[Array, "C H V"]]:
        """``(W_uk, W_uv)``: ``kv_b_proj``'s kernel as each head's key and value up-projections."""
        w = self.kv_b_proj.kernel[...].reshape(self.kv_lora_rank, self.n_heads, -1)
        return w[..., : self.qk_nope_head_dim], w[..., self.qk_nope_head_dim :]

    # -- cached (absorbed) and uncached (decompressed) -----------------------------------------

    def __call__(
        self, x: Float[Array, "T E"], memory: Memory, inputs: UbatchInputs
    ) -> Tuple[Float[Array, "T E"], Memory]:
        """Attend the ubatch tokens through a latent memory in the absorbed form.

        Args:
            x: ``[T, E]`` the ubatch's hidden states.
            memory: a memory whose part of this layer is a latent cache (``CacheConfig(mla=True)``,
                one kv head, ``head_dim = kv_lora_rank + qk_rope_head_dim``,
                ``head_dim_v = kv_lora_rank``), the ubatch already placed.
            inputs: the per-ubatch inputs (:class:`kvjax.nn.UbatchInputs`).

        Returns:
            ``(y [T, E], memory)`` with this layer's ``[c | k_pe]`` rows written.
        """
        check_layer_cache(memory, self.layer, 1, self.row_width)
        check_inputs(inputs)
        t = inputs.ubatch.length
        if x.ndim != 2 or x.shape[0] != t:
            raise ValueError(f"x has shape {tuple(x.shape)}: allowed [T, E] with T = ubatch.length = {t}")
        pos = inputs.ubatch.pos
        q_nope, q_pe = self._queries(x)
        c, k_pe = self._latents(x)
        w_uk, w_uv = self.up_projections()
        q_row = jnp.concatenate([jnp.einsum("thn,chn->thc", q_nope, w_uk), _rope(q_pe, pos, self.rope)], axis=-1)
        k_row = jnp.concatenate([c[:, None, :], _rope(k_pe, pos, self.rope)], axis=-1)
        # the row's RoPE part is rotated here (kvjax.rope turns a row's first n_rot columns, the
        # latent cache's K-shift its last), so the attention gets no rope of its own
        latent_out, memory = attend_cached(q_row, k_row, None, memory, self.layer, inputs, scale=self.softmax_scale)
        out = jnp.einsum("thc,chv->thv", latent_out, w_uv.astype(latent_out.dtype))
        return self.o_proj(out.reshape(t, -1).astype(x.dtype)), memory

    def uncached(self, x: Float[Array, "B T E"], pos: Int[Array, "B T"]) -> Float[Array, "B T E"]:
        """Attention of each sequence (row) over its own tokens with every head decompressed, no cache."""
        q_nope, q_pe = self._queries(x)
        c, k_pe = self._latents(x)
        w_uk, w_uv = self.up_projections()
        k_nope = jnp.einsum("btc,chn->bthn", c, w_uk)
        k_pe = jnp.broadcast_to(_rope(k_pe, pos, self.rope), k_nope.shape[:-1] + (self.qk_rope_head_dim,))
        q = jnp.concatenate([q_nope, _rope(q_pe, pos, self.rope)], axis=-1)
        k = jnp.concatenate([k_nope, k_pe], axis=-1)
        v = jnp.einsum("btc,chv->bthv", c, w_uv)
        out = attend_uncached(q, k, v, pos, scale=self.softmax_scale)
        return self.o_proj(out.reshape(x.shape[:-1] + (-1,)))
