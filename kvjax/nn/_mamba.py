"""A Mamba (selective state space) language model in Flax NNX, numerically Hugging Face's MambaForCausalLM.

Embedding, ``n_layer`` pre-norm residual blocks ``x + mixer(rmsnorm(x))``, a final RMSNorm and a
tied or untied LM head. The mixer is the one of ``transformers``' ``MambaMixer`` (its torch-only
path) and of llama.cpp's ``build_mamba_layer``:

    xz = in_proj(x)                      -> x, z                 [S, T, Di] each
    u  = silu(causal_depthwise_conv(x))  (width K = d_conv, + bias)
    dt, B, C = x_proj(u)                 [R], [N], [N]
    dt = softplus(dt_proj(dt))           [S, T, Di]
    h_t = exp(dt_t * A) * h_{t-1} + dt_t * B_t * u_t,   A = -exp(A_log)   [Di, N]
    y_t = h_t @ C_t + D * u_t
    out = out_proj(y * silu(z))

The model has an explicit state, the one llama.cpp's recurrent memory (the seed's
``llama_kv_cache_recurrent``) keeps per cell: per layer a conv state (the last ``d_conv - 1``
inputs of the convolution) and an SSM state ``h``. Two entry points share the maths:

- :meth:`Mamba.forward` ``(tokens [B, T]) -> logits``: every sequence from the zero state;
- :meth:`Mamba.step` ``(tokens [S, T], conv_state, ssm_state) -> (logits, conv_state, ssm_state)``:
  S sequences of T tokens each (one equal-split ubatch) continue from the states given, which the
  memory gathers by ``s_copy`` and zeroes by ``s_mask`` (:func:`select_states`) before the call.

Shape letters: L layers, S sequences of a ubatch, T tokens per sequence, E = d_model,
Di = d_inner = expand * d_model, N = d_state, K = d_conv, R = dt_rank, V = vocab_size, C cells.

**State layout and the seed's byte format.** ``conv_state`` is ``f32[L, S, K-1, Di]`` (time major,
oldest input first) and ``ssm_state`` is ``f32[L, S, Di, N]``. llama.cpp stores per layer and per
cell one K row of ``n_embd_k_s = (K-1) * Di`` floats, a ggml tensor ``{K-1, Di}`` (``ne[0] = K-1``
fastest, so channel major: ``row[i * (K-1) + j] = conv_state[l, c, j, i]``), and one V row of
``n_embd_v_s = N * Di`` floats, a ggml tensor ``{N, Di}`` (``row[i * N + n] = ssm_state[l, c, i, n]``),
both f32, V never transposed. So the rows of layer ``l`` in the seed's order are
``jnp.swapaxes(conv_state[l], -1, -2).reshape(C, -1)`` and ``ssm_state[l].reshape(C, -1)``
(:meth:`MambaConfig.state_rows` does this).

Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> from kvjax.nn._mamba import Mamba, MambaConfig
    >>> cfg = MambaConfig(vocab_size=32, d_model=16, n_layer=2, d_state=4)
    >>> model = Mamba(cfg, rngs=nnx.Rngs(0))
    >>> tokens = jnp.array([[1, 2, 3, 4]])
    >>> full = model.forward(tokens)                              # [1, 4, 32], from the zero state
    >>> conv, ssm = cfg.zero_states(1)                            # [2, 1, 3, 32], [2, 1, 32, 4]
    >>> head, conv, ssm = model.step(tokens[:, :3], conv, ssm)    # prefill (parallel scan)
    >>> last, conv, ssm = model.step(tokens[:, 3:], conv, ssm)    # decode (one recurrence step)
    >>> bool(jnp.allclose(jnp.concatenate([head, last], 1), full, atol=1e-5))
    True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Optional, Tuple, Union

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from kvjax._validate import check_count, check_flag, check_real
from kvjax.nn._inputs import check_token_rows, check_tokens
from kvjax.memory._recurrent import RecurrentConfig
from kvjax.memory._recurrent import RecurrentCache
from kvjax.memory._ubatch import equal_slots
from kvjax.nn._selective_scan import SCANS, selective_scan, selective_scan_keep

__all__ = ["MambaConfig", "Mamba", "MambaBlock", "MambaMixer", "make_mamba_step"]


@dataclasses.dataclass(frozen=True)
class MambaConfig:
    """Sizes and options of a Mamba model (frozen, hashable, validated on construction).

    Only what changes the maths is here; HF's initialisation-only fields (``time_step_min``,
    ``time_step_max``, ``time_step_floor``, ``initializer_range``, ...) are not (the NNX
    initialiser uses HF's defaults).

    Attributes:
        vocab_size: V, number of token ids.
        d_model: E, the residual width (HF ``hidden_size``).
        n_layer: number of blocks (HF ``num_hidden_layers``).
        d_state: N, SSM state size per channel (HF ``state_size``).
        d_conv: K, width of the causal depthwise convolution (HF ``conv_kernel``), >= 2.
        expand: Di = expand * d_model (HF ``expand``).
        dt_rank: R, rank of the time-step projection; ``"auto"`` is ``ceil(d_model / 16)``
            (HF ``time_step_rank``); resolved to an int on construction.
        norm_eps: RMSNorm epsilon (HF ``layer_norm_epsilon``).
        use_bias: biases on ``in_proj`` and ``out_proj``.
        use_conv_bias: bias on the convolution.
        tie_embeddings: the LM head is the token embedding (HF ``tie_word_embeddings``).
        residual_in_fp32: keep the residual stream in float32 when ``dtype`` is narrower (as HF
            does; no effect with float32 activations).
        dtype: activation dtype of the projections and norms (the scan and the states are
            always float32, as in HF and llama.cpp).
        param_dtype: dtype of the weights.
        scan: how a ubatch of several tokens runs the selective scan (:data:`SCANS`):
            ``"sequential"``, one recurrence step per token carrying the ``[S, Di, N]`` state
            (``lax.scan``); ``"chunked"``, the parallel scan within chunks of ``scan_chunk``
            tokens; ``"auto"`` (the default), sequential on CPU, where it measured 3-6x faster
            (``docs/speed.md`` section 11), chunked on accelerators, where a step per token is a
            launch per token. Only float rounding depends on it.
        scan_chunk: the chunked scan runs the parallel scan over chunks of this many tokens,
            carrying the state between chunks, so its working set is ``[S, scan_chunk, Di, N]``
            instead of ``[S, T, Di, N]``; only float rounding depends on it.

    Example:
        >>> cfg = MambaConfig(vocab_size=32, d_model=40, n_layer=1)
        >>> cfg.d_inner, cfg.dt_rank, cfg.n_embd_k_s, cfg.n_embd_v_s
        (80, 3, 240, 1280)
    """

    vocab_size: int = 64
    d_model: int = 32
    n_layer: int = 2
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: Union[int, str] = "auto"
    norm_eps: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    tie_embeddings: bool = True
    residual_in_fp32: bool = True
    dtype: Any = jnp.float32
    param_dtype: Any = jnp.float32
    scan_chunk: int = 64
    scan: str = "auto"

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layer", "d_state", "expand", "scan_chunk"):
            object.__setattr__(self, name, check_count(name, getattr(self, name), 1))
        if not isinstance(self.scan, str) or self.scan not in SCANS:
            raise ValueError(f"scan={self.scan!r} is out of range: allowed one of {', '.join(map(repr, SCANS))}")
        object.__setattr__(self, "d_conv", check_count("d_conv", self.d_conv, 2))
        if self.dt_rank == "auto":
            object.__setattr__(self, "dt_rank", math.ceil(self.d_model / 16))
        else:
            if isinstance(self.dt_rank, str):
                raise ValueError(f"dt_rank={self.dt_rank!r} is out of range: allowed 'auto' or an integer >= 1")
            object.__setattr__(self, "dt_rank", check_count("dt_rank", self.dt_rank, 1))
        object.__setattr__(self, "norm_eps", check_real("norm_eps", self.norm_eps, above=0))
        for name in ("use_bias", "use_conv_bias", "tie_embeddings", "residual_in_fp32"):
            object.__setattr__(self, name, check_flag(name, getattr(self, name)))
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            try:
                dt = jnp.dtype(value)
            except TypeError:
                dt = None
            if dt is None or not jnp.issubdtype(dt, jnp.floating):
                raise ValueError(f"{name}={value!r} is out of range: allowed a floating dtype")
            object.__setattr__(self, name, dt)

    @classmethod
    def from_hf(cls, hf_config, **overrides) -> "MambaConfig":
        """The config of a ``transformers.MambaConfig`` (``overrides`` replace fields, e.g. dtype).

        Raises:
            ValueError: ``hidden_act`` other than SiLU (llama.cpp and this model hard-wire SiLU),
                or ``intermediate_size`` other than ``expand * hidden_size``.
        """
        act = getattr(hf_config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"hf_config.hidden_act={act!r} is out of range: allowed 'silu'")
        args = dict(
            vocab_size=hf_config.vocab_size,
            d_model=hf_config.hidden_size,
            n_layer=hf_config.num_hidden_layers,
            d_state=hf_config.state_size,
            d_conv=hf_config.conv_kernel,
            expand=hf_config.expand,
            dt_rank=hf_config.time_step_rank,
            norm_eps=float(hf_config.layer_norm_epsilon),
            use_bias=bool(hf_config.use_bias),
            use_conv_bias=bool(hf_config.use_conv_bias),
            tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", True)),
            residual_in_fp32=bool(getattr(hf_config, "residual_in_fp32", True)),
        )
        args.update(overrides)
        cfg = cls(**args)
        inter = getattr(hf_config, "intermediate_size", cfg.d_inner)
        if inter != cfg.d_inner:
            raise ValueError(
                f"hf_config.intermediate_size={inter!r} is out of range: allowed expand * hidden_size = {cfg.d_inner}"
            )
        return cfg

    # -- derived ---------------------------------------------------------------------------

    @property
    def d_inner(self) -> int:
        """Di = expand * d_model."""
        return self.expand * self.d_model

    @property
    def n_embd_k_s(self) -> int:
        """Floats of one cell's conv state per layer, ``(d_conv - 1) * d_inner`` (llama.cpp's name)."""
        return (self.d_conv - 1) * self.d_inner

    @property
    def n_embd_v_s(self) -> int:
        """Floats of one cell's SSM state per layer, ``d_state * d_inner`` (llama.cpp's name)."""
        return self.d_state * self.d_inner

    def state_shapes(self, n: int) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
        """``([L, n, K-1, Di], [L, n, Di, N])``: the conv and SSM state shapes of n sequences (or cells)."""
        return ((self.n_layer, n, self.d_conv - 1, self.d_inner), (self.n_layer, n, self.d_inner, self.d_state))

    def zero_states(self, n: int) -> Tuple[Float[Array, "L n Km1 Di"], Float[Array, "L n Di N"]]:
        """Zero ``f32`` conv and SSM states of n sequences (the state of an empty sequence)."""
        n = check_count("n", n, 1)
        conv, ssm = self.state_shapes(n)
        return jnp.zeros(conv, jnp.float32), jnp.zeros(ssm, jnp.float32)

    def memory_config(self, n_seq_max: int, *, size: Optional[int] = None, n_states: int = 1):
        """The :class:`kvjax.RecurrentConfig` of this model's states.

        States are stored in the seed's element order, so the memory's state blobs are llama.cpp's:
        the conv state as ``[Di, K-1]`` rows (channel major), the SSM state as ``[Di, N]``.

        Args:
            n_seq_max: sequence ids.
            size: cells (default ``n_seq_max``, one per sequence, as the seed).
            n_states: states kept per sequence (``n_states - 1`` tokens can be rolled back).

        Example:
            >>> cfg = MambaConfig(vocab_size=32, d_model=16, n_layer=2, d_state=4)
            >>> mem = cfg.memory_config(4, n_states=2)
            >>> mem.size, mem.k_shape[0], mem.v_shape[0], mem.rows
            (4, (32, 3), (32, 4), 8)
        """
        return RecurrentConfig(
            size=n_seq_max if size is None else size,
            n_seq_max=n_seq_max,
            n_layer=self.n_layer,
            k_shape=(self.d_inner, self.d_conv - 1),
            v_shape=(self.d_inner, self.d_state),
            n_states=n_states,
        )

    def state_rows(self, conv_state, ssm_state) -> Tuple[Array, Array]:
        """The states as llama.cpp's per-cell rows: ``([L, C, n_embd_k_s], [L, C, n_embd_v_s])``.

        The conv row is channel major (a ggml ``{K-1, Di}`` tensor), the SSM row too (``{N, Di}``);
        see the module docstring.
        """
        L, C = ssm_state.shape[:2]
        return jnp.swapaxes(conv_state, -1, -2).reshape(L, C, -1), ssm_state.reshape(L, C, -1)


# -- modules ---------------------------------------------------------------------------------


def _inv_softplus(x):
    return x + jnp.log(-jnp.expm1(-x))


class MambaMixer(nnx.Module):
    """The selective SSM mixer of one layer (HF's ``MambaMixer``; maths in the module docstring).

    Parameters (HF name in brackets): ``in_proj`` (``in_proj``), ``conv_kernel f[K, Di]``
    (``conv1d.weight [Di, 1, K]`` transposed), ``conv_bias f[Di]``, ``x_proj``, ``dt_proj``,
    ``A_log f[Di, N]``, ``D f[Di]``, ``out_proj``. Linear kernels are ``[in, out]`` (HF's
    transposed). Initialisation follows HF's (S4D-real ``A``, ``D = 1``, ``dt`` bias the inverse
    softplus of a log-uniform time step in [0.001, 0.1]).
    """

    def __init__(self, config: MambaConfig, *, rngs: nnx.Rngs):
        c = config
        self.config = config
        Di, N, R, K = c.d_inner, c.d_state, c.dt_rank, c.d_conv
        lin = dict(dtype=c.dtype, param_dtype=c.param_dtype, rngs=rngs)
        self.in_proj = nnx.Linear(c.d_model, 2 * Di, use_bias=c.use_bias, **lin)
        bound = 1.0 / math.sqrt(K)  # torch's Conv1d default (fan_in = K)
        self.conv_kernel = nnx.Param(jax.random.uniform(rngs.params(), (K, Di), c.param_dtype, -bound, bound))
        self.conv_bias = nnx.Param(jnp.zeros((Di,), c.param_dtype)) if c.use_conv_bias else None
        self.x_proj = nnx.Linear(Di, R + 2 * N, use_bias=False, **lin)
        dt_std = R**-0.5
        dt = jnp.exp(jax.random.uniform(rngs.params(), (Di,)) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
        self.dt_proj = nnx.Linear(
            R,
            Di,
            use_bias=True,
            kernel_init=lambda key, shape, dtype: jax.random.uniform(key, shape, dtype, -dt_std, dt_std),
            bias_init=lambda key, shape, dtype: _inv_softplus(jnp.maximum(dt, 1e-4)).astype(dtype),
            **lin,
        )
        self.A_log = nnx.Param(
            jnp.log(jnp.broadcast_to(jnp.arange(1, N + 1, dtype=jnp.float32), (Di, N))).astype(c.param_dtype)
        )
        self.D = nnx.Param(jnp.ones((Di,), c.param_dtype))
        self.out_proj = nnx.Linear(Di, c.d_model, use_bias=c.use_bias, **lin)

    def __call__(
        self,
        x: Float[Array, "S T E"],
        conv_state: Float[Array, "S Km1 Di"],
        ssm_state: Float[Array, "S Di N"],
        keep: Optional[int] = None,
    ):
        """``x [S, T, E]`` from states ``[S, K-1, Di]``, ``[S, Di, N]`` -> ``(out [S, T, E], conv, ssm)``.

        With ``keep = q`` the states returned are those after each of the last ``q`` tokens,
        ``[S, q, K-1, Di]`` and ``[S, q, Di, N]`` (oldest first): what the recurrent memory keeps
        for rollback.
        """
        c = self.config
        T, N, R = x.shape[1], c.d_state, c.dt_rank
        xs, z = jnp.split(self.in_proj(x), 2, axis=-1)  # [S, T, Di] each
        # causal depthwise conv over the K-1 stored inputs followed by the new ones
        window = jnp.concatenate([conv_state.astype(xs.dtype), xs], axis=1)  # [S, K-1+T, Di]
        kernel = self.conv_kernel[...].astype(xs.dtype)
        conv = sum(window[:, k : k + T] * kernel[k] for k in range(c.d_conv))
        if self.conv_bias is not None:
            conv = conv + self.conv_bias[...].astype(xs.dtype)
        u = jax.nn.silu(conv)
        dt, Bm, Cm = jnp.split(self.x_proj(u), [R, R + N], axis=-1)
        f32 = lambda a: a.astype(jnp.float32)
        dt = jax.nn.softplus(f32(self.dt_proj(dt)))  # [S, T, Di]
        A = -jnp.exp(f32(self.A_log[...]))  # [Di, N]
        u32 = f32(u)
        if keep is None:
            y, h = selective_scan(f32(ssm_state), u32, dt, f32(Bm), f32(Cm), A, chunk=c.scan_chunk, scan=c.scan)
            conv_out = f32(window[:, T:])
        else:
            y, h = selective_scan_keep(
                f32(ssm_state), u32, dt, f32(Bm), f32(Cm), A, chunk=c.scan_chunk, keep=keep, scan=c.scan
            )
            # the conv state after token t is the K-1 inputs ending at t: window[t + 1 : t + K]
            conv_out = jnp.stack([f32(window[:, t + 1 : t + c.d_conv]) for t in range(T - keep, T)], axis=1)
        y = (y + u32 * f32(self.D[...])) * jax.nn.silu(f32(z))
        out = self.out_proj(y.astype(c.dtype))
        return out, conv_out, h


class MambaBlock(nnx.Module):
    """Pre-norm residual block: ``x + mixer(rmsnorm(x))`` (HF's ``MambaBlock``)."""

    def __init__(self, config: MambaConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.norm = nnx.RMSNorm(
            config.d_model, epsilon=config.norm_eps, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs
        )
        self.mixer = MambaMixer(config, rngs=rngs)

    def __call__(self, x, conv_state, ssm_state, keep: Optional[int] = None):
        """``x [S, T, E]`` -> ``(x [S, T, E], conv_state, ssm_state)`` (see :class:`MambaMixer` for ``keep``)."""
        residual = x.astype(jnp.float32) if self.config.residual_in_fp32 else x
        h, conv_state, ssm_state = self.mixer(self.norm(x.astype(self.config.dtype)), conv_state, ssm_state, keep)
        return residual + h, conv_state, ssm_state


class Mamba(nnx.Module):
    """The Mamba language model (see the module docstring).

    Args:
        config: sizes and options.
        rngs: NNX random streams for the initial weights.
    """

    def __init__(self, config: MambaConfig, *, rngs: nnx.Rngs):
        if not isinstance(config, MambaConfig):
            raise ValueError(f"config must be a MambaConfig, got {type(config).__name__}")
        self.config = config
        self.embed = nnx.Embed(
            config.vocab_size, config.d_model, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs
        )
        self.layers = nnx.List([MambaBlock(config, rngs=rngs) for _ in range(config.n_layer)])
        self.norm = nnx.RMSNorm(
            config.d_model, epsilon=config.norm_eps, dtype=config.dtype, param_dtype=config.param_dtype, rngs=rngs
        )
        self.lm_head = (
            None
            if config.tie_embeddings
            else nnx.Linear(
                config.d_model,
                config.vocab_size,
                use_bias=False,
                dtype=config.dtype,
                param_dtype=config.param_dtype,
                rngs=rngs,
            )
        )

    def _run(self, tokens, conv_state, ssm_state, keep: Optional[int] = None, outputs=None):
        """Layers, then the head; with ``outputs`` (``i32[R]`` rows of the flattened ``[S * T]``)
        the head runs on those rows only and the logits are ``[R, V]``."""
        x = self.embed(tokens)
        convs, ssms = [], []
        for il, block in enumerate(self.layers):
            x, conv, ssm = block(x, conv_state[il], ssm_state[il], keep)
            convs.append(conv)
            ssms.append(ssm)
        if outputs is not None:
            x = jnp.take(x.reshape((-1, x.shape[-1])), outputs, axis=0, mode="clip")
        x = self.norm(x.astype(self.config.dtype))
        logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
        return logits.astype(jnp.float32), jnp.stack(convs), jnp.stack(ssms)

    def __call__(self, tokens: Int[Array, " T"], memory, inputs) -> Tuple[Float[Array, "T V"], Any]:
        """One equal-split ubatch through a recurrent memory: the model call of ``kvjax.nn.make_step``.

        The states of the ubatch's sequences are read from the memory (after the copies the
        placement asks for: copy-on-write of a shared state, cells moved by the gather, new
        sequences from zeros), the tokens run, and the states after them (the last
        ``min(n_states, T)`` of each sequence) are written back.

        Args:
            tokens: ``i32[S * T]``, the ubatch's rows (slot major, ``kvjax.make_equal_ubatch``).
            memory: a :class:`kvjax.RecurrentCache` made from :meth:`MambaConfig.memory_config`.
            inputs: the step's :class:`kvjax.nn.UbatchInputs` (ubatch and placement).

        Returns:
            ``(logits f32[S * T, V], memory)``; ``f32[R, V]`` of the rows ``inputs.outputs`` when
            it is set (the states are written for every row all the same).
        """
        return _memory_call(self, tokens, memory, inputs)

    def forward(self, tokens: Int[Array, "B T"]) -> Float[Array, "B T V"]:
        """The uncached pass: each row of ``tokens`` is one sequence, from the zero state.

        Args:
            tokens: ``i32[B, T]`` (or ``[T]`` for one sequence), ids in ``[0, vocab_size)``.

        Returns:
            ``f32[B, T, V]`` logits (``[T, V]`` for a 1-d input).

        Raises:
            ValueError: tokens of another rank, not integer, or ids out of range.
        """
        tokens = jnp.asarray(tokens)
        squeeze = tokens.ndim == 1
        tokens = tokens[None] if squeeze else tokens
        check_token_rows(tokens, self.config.vocab_size)
        conv, ssm = self.config.state_shapes(tokens.shape[0])
        logits, _, _ = self._run(tokens, jnp.zeros(conv, jnp.float32), jnp.zeros(ssm, jnp.float32))
        return logits[0] if squeeze else logits

    def step(
        self, tokens: Int[Array, "S T"], conv_state: Float[Array, "L S Km1 Di"], ssm_state: Float[Array, "L S Di N"]
    ) -> Tuple[Float[Array, "S T V"], Float[Array, "L S Km1 Di"], Float[Array, "L S Di N"]]:
        """Continue S sequences by T tokens each from the states given (one equal-split ubatch).

        T > 1 (prefill) runs the chunked parallel scan, T = 1 (decode) one recurrence step; both
        start from ``conv_state`` / ``ssm_state`` (zero states for new sequences: the memory's
        :func:`select_states` gives them).

        Args:
            tokens: ``i32[S, T]``: row s holds the next T tokens of sequence s.
            conv_state: ``f32[L, S, K-1, Di]``: the last K-1 conv inputs of every layer, oldest first.
            ssm_state: ``f32[L, S, Di, N]``: the SSM state of every layer.

        Returns:
            ``(logits f32[S, T, V], conv_state, ssm_state)``, the states after the T tokens.
            ``logits.reshape(S * T, V)`` is in the row order of llama.cpp's equal-split ubatch
            (sequence major, ``{n_embd, n_seq_tokens, n_seqs}``).

        Raises:
            ValueError: tokens not an integer ``[S, T]`` array or ids out of range, states of
                another shape or not floating point.
        """
        tokens = jnp.asarray(tokens)
        check_token_rows(tokens, self.config.vocab_size)
        want = self.config.state_shapes(tokens.shape[0])
        for name, x, shape in (("conv_state", conv_state, want[0]), ("ssm_state", ssm_state, want[1])):
            if tuple(jnp.shape(x)) != shape or not jnp.issubdtype(jnp.result_type(x), jnp.floating):
                raise ValueError(
                    f"{name} has shape {tuple(jnp.shape(x))} and dtype {jnp.result_type(x)}: allowed "
                    f"a floating {list(shape)} array (S = tokens.shape[0])"
                )
        return self._run(tokens, conv_state, ssm_state)


def _memory_call(model: "Mamba", tokens, memory, inputs):
    """One equal-split ubatch through a recurrent memory (what ``Mamba.__call__`` does)."""

    c = model.config
    if not isinstance(memory, RecurrentCache):
        raise ValueError(
            f"memory must be a kvjax.RecurrentCache for a Mamba model (make it with "
            f"kvjax.init(config.memory_config(...))), got {type(memory).__name__}"
        )
    want = c.memory_config(memory.n_seq_max, size=memory.size, n_states=memory.config.n_states)
    if (memory.config.n_layer, memory.config.k_shape, memory.config.v_shape) != (
        want.n_layer,
        want.k_shape,
        want.v_shape,
    ):
        raise ValueError(
            f"memory holds {memory.config.n_layer} layers of states {memory.config.k_shape[0]} and "
            f"{memory.config.v_shape[0]}: allowed this model's {c.n_layer} layers of "
            f"{want.k_shape[0]} and {want.v_shape[0]} (use config.memory_config)"
        )
    check_tokens(tokens, inputs.ubatch, c.vocab_size)
    n_slots, t = equal_slots(inputs.ubatch)
    placement = inputs.placement
    memory, ((conv, ssm),) = memory.read_states(placement, n_slots, t)  # [L, S, Di, K-1], [L, S, Di, N]
    keep = min(memory.config.n_states, t)
    logits, conv_h, ssm_h = model._run(
        jnp.asarray(tokens).reshape(n_slots, t),
        jnp.swapaxes(conv, -1, -2).astype(jnp.float32),
        ssm.astype(jnp.float32),
        keep=keep,
        outputs=inputs.outputs,
    )
    # stored in the seed's element order: the conv row channel major ([Di, K-1])
    memory = memory.write_states(placement, jnp.swapaxes(conv_h, -1, -2), ssm_h, after=logits)
    return logits.reshape((-1, logits.shape[-1])), memory


def make_mamba_step(model: Mamba, *, donate: bool = True) -> Callable:
    """A jitted :meth:`Mamba.step`: ``step(state, tokens, conv_state, ssm_state)``.

    ``state`` is ``nnx.state(model)`` (traced, so new weights do not recompile either); one
    program per ``(S, T)``, never per token value. With ``donate`` the state buffers passed in
    are updated in place: use the returned states afterwards.

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> model = Mamba(MambaConfig(vocab_size=32, d_model=16, n_layer=1, d_state=4), rngs=nnx.Rngs(0))
        >>> step = make_mamba_step(model)
        >>> conv, ssm = model.config.zero_states(2)
        >>> logits, conv, ssm = step(nnx.state(model), jnp.array([[1], [2]]), conv, ssm)
        >>> logits.shape, conv.shape, ssm.shape
        ((2, 1, 32), (1, 2, 3, 32), (1, 2, 32, 4))
    """
    if not isinstance(model, Mamba):
        raise ValueError(f"model must be a Mamba, got {type(model).__name__}")
    graphdef = nnx.graphdef(model)

    def run(state, tokens, conv_state, ssm_state):
        return nnx.merge(graphdef, state).step(tokens, conv_state, ssm_state)

    return jax.jit(run, donate_argnums=(2, 3) if donate else ())
