"""A mixture-of-experts MLP (gpt-oss, Mixtral style): top-k routing and one grouped matmul per projection.

Each token's router logits pick its ``k`` best experts; their softmax over those ``k`` weighs the
experts' outputs (gpt-oss's router; Mixtral's softmax-then-renormalise over the top ``k`` is the
same numbers). DeepSeek's routers are :class:`Routing` options: V2 weighs the top ``k`` of a
softmax over every expert, V3 picks by sigmoid scores plus a learned bias within the best groups of
experts, and both scale the weights by ``routed_scaling_factor``.

The experts run as grouped matmuls (:func:`grouped_products`): the ``T * k`` (token, expert) pairs
are sorted by expert, so each expert's weights meet only the rows routed to it and the work follows
``T * k``, not ``T * n_experts``; the weighted results are added back to their tokens. Shapes are
static whatever the routing, so the step compiles once.

The gated product is the dense MLP's (:data:`GATED`): ``act(gate) * up`` for SwiGLU / GeGLU, or
gpt-oss's clamped ``swiglu_oai``: ``gate = min(gate, limit)``, ``up = clip(up, -limit, limit)``,
``gate * sigmoid(alpha * gate) * (up + 1)``.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> moe = MoE(8, 16, n_experts=4, n_experts_used=2, rngs=nnx.Rngs(0))
    >>> x = jax.random.normal(jax.random.PRNGKey(1), (3, 8))
    >>> y = moe(x)
    >>> dense = sum(w[:, None] * moe.expert(x, e) for e, w in enumerate(moe.weights(x).T))
    >>> y.shape, bool(jnp.allclose(y, dense, atol=1e-5))      # equal to every expert, weighted
    ((3, 8), True)
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional

import jax
import jax.numpy as jnp
from flax import nnx

from kvjax._typing import Array, Float, Int
from kvjax._validate import check_count, check_flag, check_real, require

__all__ = [
    "GATED",
    "EXPERT_PARAMS",
    "MoE",
    "Routing",
    "Float32Param",
    "load_dtype",
    "gated_product",
    "route",
    "mix_experts",
    "grouped_products",
    "moe_forward",
]

#: The experts' parameters of a mixture (NNX and linen alike): ``gate`` / ``up`` ``[X, E, F]``,
#: ``down`` ``[X, F, E]`` and their optional biases.
EXPERT_PARAMS = ("gate", "up", "down", "gate_bias", "up_bias", "down_bias")


def _swiglu_oai(gate, up, *, alpha: float, limit: float):
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(alpha * gate) * (up + 1)


#: The gated products of an MLP, ``(gate, up, alpha, limit) -> hidden``: ``"silu"`` (SwiGLU),
#: ``"gelu_tanh"`` (GeGLU with the tanh approximation) and ``"swiglu_oai"`` (gpt-oss's clamped
#: SwiGLU; the only one that reads ``alpha`` and ``limit``).
GATED: Dict[str, Callable] = {
    "silu": lambda gate, up, alpha, limit: jax.nn.silu(gate) * up,
    "gelu_tanh": lambda gate, up, alpha, limit: jax.nn.gelu(gate, approximate=True) * up,
    "swiglu_oai": lambda gate, up, alpha, limit: _swiglu_oai(gate, up, alpha=alpha, limit=limit),
}


def gated_product(activation: str, gate, up, alpha: float = 1.702, limit: float = 7.0):
    """The hidden ``[..., F]`` of a gated MLP from its ``gate`` and ``up`` projections (:data:`GATED`).

    Example:
        >>> gated_product("swiglu_oai", jnp.array([9.0, 0.0]), jnp.array([-9.0, 1.0])).tolist()  # clamped
        [-42.0, 0.0]
    """
    return GATED[activation](gate, up, alpha, limit)


@dataclasses.dataclass(frozen=True)
class Routing:
    """How a router's logits pick each token's experts and weigh them (frozen, hashable, validated).

    Attributes:
        score: ``"topk_softmax"`` (the default: softmax over the ``k`` largest logits, gpt-oss and
            Mixtral), ``"softmax"`` (softmax over every expert, the ``k`` largest probabilities
            kept as they are: DeepSeek V2) or ``"sigmoid"`` (each expert's sigmoid: DeepSeek V3).
        n_group: experts form this many equal groups, and only the ``topk_group`` best groups
            may be picked (DeepSeek's group-limited routing; 1 for no groups). A group's score is
            its best expert's with ``"softmax"`` (V2's ``group_limited_greedy``) and the sum of its
            two best with ``"sigmoid"`` (V3).
        topk_group: the groups kept (1 <= topk_group <= n_group).
        choice_bias: a learned per-expert bias added to the scores for choosing only, not to the
            weights (V3's ``e_score_correction_bias``; the MoE's ``score_bias`` parameter).
        normalize: divide the ``k`` weights by their sum (V3's ``norm_topk_prob``).
        scale: multiply the weights by this (``routed_scaling_factor``, > 0).

    Example:
        >>> Routing(score="sigmoid", n_group=4, topk_group=2, scale=2.5).n_group
        4
    """

    score: str = "topk_softmax"
    n_group: int = 1
    topk_group: int = 1
    choice_bias: bool = False
    normalize: bool = False
    scale: float = 1.0

    def __post_init__(self):
        scores = ("topk_softmax", "softmax", "sigmoid")
        require(self.score in scores, "routing.score", self.score, f"one of {list(scores)}")
        object.__setattr__(self, "n_group", check_count("routing.n_group", self.n_group, 1))
        topk_group = check_count("routing.topk_group", self.topk_group, 1)
        require(topk_group <= self.n_group, "routing.topk_group", topk_group, f"at most n_group={self.n_group}")
        object.__setattr__(self, "topk_group", topk_group)
        grouped = self.n_group > 1
        require(
            not (grouped and self.score == "topk_softmax"),
            "routing.n_group",
            self.n_group,
            "1 with score='topk_softmax' (groups are DeepSeek's: score 'softmax' or 'sigmoid')",
        )
        for name in ("choice_bias", "normalize"):
            object.__setattr__(self, name, check_flag(f"routing.{name}", getattr(self, name)))
        object.__setattr__(self, "scale", check_real("routing.scale", self.scale, above=0))

    def check_experts(self, n_experts: int, k: int) -> None:
        """Raise ``ValueError`` unless ``n_experts`` split into ``n_group`` groups that hold ``k`` experts."""
        require(n_experts % self.n_group == 0, "routing.n_group", self.n_group, f"a divisor of n_experts={n_experts}")
        held = self.topk_group * (n_experts // self.n_group)
        require(
            k <= held, "n_experts_used", k, f"at most the {held} experts of the topk_group={self.topk_group} groups"
        )
        if self.score == "sigmoid" and self.n_group > 1:
            require(
                n_experts // self.n_group >= 2,
                "routing.n_group",
                self.n_group,
                "groups of >= 2 experts (V3 sums the two best)",
            )


class Float32Param(nnx.Param):
    """A parameter that stays float32 whatever dtype a loader gives the other weights (a router's
    choice bias: transformers keeps DeepSeek's ``e_score_correction_bias`` float32, llama.cpp its
    ``exp_probs_b`` F32). :func:`kvjax.nn._hf.load_plan` and the GGUF loader read it so."""


def load_dtype(var, dtype):
    """The dtype a loader sets ``var`` in: ``var``'s own for a :class:`Float32Param` or without
    ``dtype``, else ``dtype``."""
    return var.dtype if dtype is None or isinstance(var, Float32Param) else dtype


#: gpt-oss's and Mixtral's router: softmax over each token's ``k`` largest logits.
TOPK_SOFTMAX = Routing()


def _keep_groups(choice: Float[Array, "T X"], routing: Routing, fill: float) -> Float[Array, "T X"]:
    """``choice`` with the experts outside each token's ``topk_group`` best groups set to ``fill``."""
    n_tok, n_experts = choice.shape
    grouped = choice.reshape(n_tok, routing.n_group, n_experts // routing.n_group)
    if routing.score == "sigmoid":
        group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
    else:
        group_score = grouped.max(-1)
    _, best = jax.lax.top_k(group_score, routing.topk_group)
    keep = jnp.zeros((n_tok, routing.n_group), bool).at[jnp.arange(n_tok)[:, None], best].set(True)
    return jnp.where(keep[:, :, None], grouped, fill).reshape(n_tok, n_experts)


def route(
    logits: Float[Array, "T X"], k: int, routing: Routing = TOPK_SOFTMAX, bias: Optional[Float[Array, " X"]] = None
) -> tuple[Int[Array, "T k"], Float[Array, "T k"]]:
    """``(experts, weights)``: each token's ``k`` experts and their weights under ``routing``.

    ``bias`` (``[X]``) is the choice bias of ``routing.choice_bias`` (V3), added to the scores
    that pick the experts; the weights are the unbiased scores.

    Example:
        >>> experts, weights = route(jnp.array([[0.0, 2.0, 1.0, 2.0]]), 2)
        >>> experts.tolist(), weights.round(3).tolist()
        ([[1, 3]], [[0.5, 0.5]])
        >>> v2 = Routing(score="softmax", scale=2.0)       # DeepSeek V2: top-k of the full softmax, scaled
        >>> [round(float(w), 3) for w in route(jnp.array([[0.0, 2.0, 1.0, 2.0]]), 2, v2)[1][0]]
        [0.799, 0.799]
    """
    logits = logits.astype(jnp.float32)
    if routing.score == "topk_softmax":
        top, experts = jax.lax.top_k(logits, k)
        weights = jax.nn.softmax(top, axis=-1)
    else:
        scores = jax.nn.softmax(logits, axis=-1) if routing.score == "softmax" else jax.nn.sigmoid(logits)
        choice = scores if bias is None else scores + bias.astype(jnp.float32)
        if routing.n_group > 1:
            # V2 zeroes the dropped groups' probabilities, V3 drops them from the choice altogether
            choice = _keep_groups(choice, routing, 0.0 if routing.score == "softmax" else -jnp.inf)
        _, experts = jax.lax.top_k(choice, k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
    if routing.normalize:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return experts, weights * routing.scale if routing.scale != 1.0 else weights


#: The most rows per product inside an expert's group (:func:`grouped_products`); fewer when an
#: expert's share of the routed pairs is smaller (a decode step's rows run one per product).
GROUP_ROWS = 64


def grouped_products(
    rows: Float[Array, "P I"], sizes: Int[Array, " X"], weight_of: Callable, n_out: int
) -> Float[Array, "P O"]:
    """``rows[p] @ W_e`` for the rows of each expert's group, the groups consecutive (rows sorted by expert).

    A loop over the experts that skips those no row is routed to; each expert present takes its
    matrix once (``weight_of(e) -> f[I, O]``: a slice of a float stack, or a GGML expert dequantized
    right there) and runs its group in products of about an expert's share of the rows (a power of
    two, at most :data:`GROUP_ROWS`), so the work follows the routed rows (plus at most one partial
    block an expert) and a decode step reads only the ``k`` experts it uses. Chosen by measurement
    on XLA:CPU (``benchmarks/bench_moe.py``, docs/speed.md section 14): ``jax.lax.ragged_dot`` ran
    2-16x slower than this loop, and a dense product over every expert does ``X / k`` times the
    work. Dynamic trip counts: inference only (no reverse-mode autodiff through it).

    Example:
        >>> w = jnp.arange(2 * 2 * 3.0).reshape(2, 2, 3)                  # two experts [I=2, O=3]
        >>> rows, sizes = jnp.ones((3, 2)), jnp.array([1, 2], jnp.int32)   # row 0 -> expert 0, rows 1-2 -> 1
        >>> grouped_products(rows, sizes, lambda e: w[e], 3).tolist()
        [[3.0, 5.0, 7.0], [15.0, 17.0, 19.0], [15.0, 17.0, 19.0]]
    """
    n_rows, n_in = rows.shape
    # rows per product: about one expert's share of the pairs (a power of two), at most GROUP_ROWS,
    # so a product wastes little on rows of other groups (one row a product for a decode step)
    share = -(-n_rows // sizes.shape[0])
    chunk = min(GROUP_ROWS, 1 << (share - 1).bit_length())
    starts = jnp.cumsum(sizes) - sizes
    padded = jnp.pad(rows.astype(jnp.float32), ((0, chunk), (0, 0)))  # a block never reads past the end
    cols = jnp.arange(chunk)

    def expert(e, out):
        def run(out):
            w = weight_of(e).astype(jnp.float32)
            start, size = starts[e], sizes[e]

            def block(c, out):
                at = start + c * chunk
                y = jax.lax.dynamic_slice(padded, (at, 0), (chunk, n_in)) @ w
                keep = (cols < size - c * chunk)[:, None]  # the group's rows only: the next group's stay
                old = jax.lax.dynamic_slice(out, (at, 0), (chunk, n_out))
                return jax.lax.dynamic_update_slice(out, jnp.where(keep, y, old), (at, 0))

            return jax.lax.fori_loop(0, (size + chunk - 1) // chunk, block, out)

        return jax.lax.cond(sizes[e] > 0, run, lambda out: out, out)

    out = jax.lax.fori_loop(0, sizes.shape[0], expert, jnp.zeros((n_rows + chunk, n_out), jnp.float32))
    return out[:n_rows]


def mix_experts(
    x: Float[Array, "T E"],
    experts: Int[Array, "T k"],
    weights: Float[Array, "T k"],
    params: Dict[str, Array],
    activation: str,
    alpha: float,
    limit: float,
) -> Float[Array, "T E"]:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` as grouped matmuls over the routed pairs.

    ``params``: ``gate``, ``up`` ``[X, E, F]``, ``down`` ``[X, F, E]`` (float arrays, or
    :class:`kvjax.nn.GGMLExperts` kept as ggml blocks) and optional biases ``gate_bias``,
    ``up_bias`` ``[X, F]``, ``down_bias`` ``[X, E]`` (None for none).
    """
    n_tok, k = experts.shape
    n_experts = params["gate"].shape[0]
    flat = experts.reshape(-1)  # pair i = (token i // k, its (i % k)-th expert)
    order = jnp.argsort(flat, stable=True)
    by_expert = flat[order]
    token = order // k
    sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
    rows = x[token]  # [T * k, E], grouped by expert

    def dot(h, w):
        if hasattr(w, "matrix"):  # experts kept as ggml blocks (kvjax.nn.GGMLExperts)
            return grouped_products(h, sizes, w.matrix, w.shape[-1])
        return grouped_products(h, sizes, lambda e: jax.lax.dynamic_index_in_dim(w, e, keepdims=False), w.shape[-1])

    def biased(h, name):
        b = params.get(name)
        return h if b is None else h + b[by_expert].astype(jnp.float32)

    gate = biased(dot(rows, params["gate"]), "gate_bias")
    up = biased(dot(rows, params["up"]), "up_bias")
    hidden = gated_product(activation, gate, up, alpha, limit).astype(x.dtype)
    out = biased(dot(hidden, params["down"]), "down_bias")
    out = out * weights.reshape(-1)[order][:, None]
    return jnp.zeros((n_tok, x.shape[-1]), jnp.float32).at[token].add(out).astype(x.dtype)


def moe_forward(
    x: Float[Array, "... E"],
    router: Callable,
    params: Dict[str, Array],
    k: int,
    activation: str,
    alpha,
    limit,
    routing: Routing = TOPK_SOFTMAX,
    score_bias: Optional[Float[Array, " X"]] = None,
) -> Float[Array, "... E"]:
    """A mixture's output for ``x`` of any leading shape: ``router`` (a callable giving the logits
    ``[T, X]``), :func:`route` under ``routing``, then :func:`mix_experts` (shared by the NNX module
    and its linen twin)."""
    flat = x.reshape(-1, x.shape[-1])
    experts, w = route(router(flat), k, routing, score_bias)
    return mix_experts(flat, experts, w, params, activation, alpha, limit).reshape(x.shape)


class MoE(nnx.Module):
    """A mixture-of-experts gated MLP with a linear router (see the module docstring).

    Args:
        d_model: E, the input and output width.
        d_ff: F, each expert's hidden width.
        n_experts: X, the experts (>= 2).
        n_experts_used: k, experts per token (1 <= k <= X).
        activation: the gated product (:data:`GATED`).
        use_bias: biases on the router and every expert projection (gpt-oss).
        swiglu_alpha, swiglu_limit: ``swiglu_oai``'s constants (gpt-oss: 1.702 and 7.0).
        routing: how the router's logits pick and weigh the experts (:class:`Routing`; default
            gpt-oss's softmax over the top ``k``).
        param_dtype: parameter dtype.
        rngs: NNX random streams.

    Parameters: ``router`` (an ``nnx.Linear`` E -> X), ``gate`` / ``up`` ``[X, E, F]``, ``down``
    ``[X, F, E]``, with ``use_bias`` ``gate_bias`` / ``up_bias`` ``[X, F]``, ``down_bias`` ``[X, E]``,
    and with ``routing.choice_bias`` ``score_bias`` ``[X]`` (float32, initialised to 0).
    """

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        n_experts: int,
        n_experts_used: int,
        activation: str = "silu",
        use_bias: bool = False,
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        routing: Routing = TOPK_SOFTMAX,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        d_model, d_ff = check_count("d_model", d_model, 1), check_count("d_ff", d_ff, 1)
        n_experts = check_count("n_experts", n_experts, 2)
        n_used = check_count("n_experts_used", n_experts_used, 1)
        require(n_used <= n_experts, "n_experts_used", n_used, f"at most n_experts={n_experts}")
        require(activation in GATED, "activation", activation, f"one of {sorted(GATED)}")
        require(isinstance(routing, Routing), "routing", routing, "a kvjax.nn.Routing")
        routing.check_experts(n_experts, n_used)
        self.n_experts_used, self.activation, self.routing = n_used, activation, routing
        self.swiglu_alpha = check_real("swiglu_alpha", swiglu_alpha, above=0)
        self.swiglu_limit = check_real("swiglu_limit", swiglu_limit, above=0)
        self.router = nnx.Linear(d_model, n_experts, use_bias=use_bias, param_dtype=param_dtype, rngs=rngs)
        init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=0)

        def weight(shape):
            return nnx.Param(init(rngs.params(), shape, param_dtype))

        def bias(shape):
            return nnx.Param(jnp.zeros(shape, param_dtype)) if use_bias else None

        self.gate, self.up = weight((n_experts, d_model, d_ff)), weight((n_experts, d_model, d_ff))
        self.down = weight((n_experts, d_ff, d_model))
        self.gate_bias, self.up_bias = bias((n_experts, d_ff)), bias((n_experts, d_ff))
        self.down_bias = bias((n_experts, d_model))
        # the router runs in float32 (transformers keeps DeepSeek's gate and its bias in float32)
        self.score_bias = Float32Param(jnp.zeros((n_experts,), jnp.float32)) if routing.choice_bias else None

    def _params(self) -> Dict[str, Array]:
        def value(v):  # a parameter's array; experts kept as ggml blocks go as they are
            return None if v is None else v if isinstance(v, nnx.Module) else v[...]

        return {n: value(getattr(self, n)) for n in EXPERT_PARAMS}

    def weights(self, x: Float[Array, "T E"]) -> Float[Array, "T X"]:
        """Each token's weight on every expert (0 for those not routed to): for inspection and tests."""
        experts, w = route(self.router(x), self.n_experts_used, self.routing, self._score_bias())
        return (
            jnp.zeros(x.shape[:-1] + (self.gate.shape[0],), w.dtype).at[jnp.arange(x.shape[0])[:, None], experts].set(w)
        )

    def _score_bias(self):
        return None if self.score_bias is None else self.score_bias[...]

    def expert(self, x: Float[Array, "T E"], e: int) -> Float[Array, "T E"]:
        """Expert ``e`` alone on every row (dense, for the tests' reference)."""
        p = self._params()
        bias = lambda name: 0.0 if p[name] is None else p[name][e]  # noqa: E731
        gate, up = x @ p["gate"][e] + bias("gate_bias"), x @ p["up"][e] + bias("up_bias")
        hidden = gated_product(self.activation, gate, up, self.swiglu_alpha, self.swiglu_limit)
        return hidden @ p["down"][e] + bias("down_bias")

    def __call__(self, x: Float[Array, "... E"]) -> Float[Array, "... E"]:
        return moe_forward(
            x,
            self.router,
            self._params(),
            self.n_experts_used,
            self.activation,
            self.swiglu_alpha,
            self.swiglu_limit,
            self.routing,
            self._score_bias(),
        )
