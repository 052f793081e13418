"""The reference model's weights on a mesh: attention heads and the MLP width on ``"model"``.

Megatron-style tensor parallelism, by parameter name (the NNX model and its linen twin use the
same names): the Q/K/V projections are split by output columns (whole heads per device, in the
order ggml lays heads out, so query head ``j`` sits on the device of kv head ``j // G``), the
output projection by input rows; the MLP's gate/up by columns and down by rows (each expert of
a mixture the same way; gpt-oss's learned sinks with their query heads). Each block then
needs one all-reduce after the output projection and one after the MLP; the K/V a device writes
and reads are its own heads' only. Everything else (norms, embeddings) is replicated, which is
also what happens to any parameter these names do not match (a Mamba block's, for example).

Example:
    >>> from flax import nnx
    >>> from kvjax import shard
    >>> from kvjax.nn import Llama, LlamaConfig
    >>> model = Llama(LlamaConfig(n_layer=1), rngs=nnx.Rngs(0))
    >>> axes = shard.param_axes(nnx.state(model))
    >>> axes["layers"][0]["attn"]["q_proj"]["kernel"].get_value(), axes["norm"]["scale"].get_value()
    (P('embed', 'heads'), P(None,))
    >>> state = shard.shard_params(model, shard.make_mesh(1, 1))
    >>> state["layers"][0]["attn"]["q_proj"]["kernel"].get_value().sharding.spec
    P(None, 'model')
"""

from __future__ import annotations

from typing import Optional, Tuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from kvjax._validate import check_count
from kvjax._axes import EMBED, FF, HEADS, VOCAB
from kvjax._mesh import Rules, check_mesh, check_rules, to_mesh_spec
from flax import nnx

#: (last names of a parameter's path, its logical axes); the first match wins, the rest is replicated
PARAM_RULES: Tuple[Tuple[Tuple[str, ...], P], ...] = (
    (("q_proj", "kernel"), P(EMBED, HEADS)),
    (("k_proj", "kernel"), P(EMBED, HEADS)),
    (("v_proj", "kernel"), P(EMBED, HEADS)),
    (("q_proj", "bias"), P(HEADS)),
    (("k_proj", "bias"), P(HEADS)),
    (("v_proj", "bias"), P(HEADS)),
    (("o_proj", "kernel"), P(HEADS, EMBED)),
    (("o_proj", "bias"), P(EMBED)),
    (("attn", "sinks"), P(HEADS)),  # learned sinks (gpt-oss): one per query head, with its head
    # a mixture's experts [X, E, F] / [X, F, E]: every expert split by MLP columns as a dense MLP is
    (("mlp", "gate"), P(None, EMBED, FF)),
    (("mlp", "up"), P(None, EMBED, FF)),
    (("mlp", "down"), P(None, FF, EMBED)),
    (("mlp", "gate_bias"), P(None, FF)),
    (("mlp", "up_bias"), P(None, FF)),
    # fused projections (kvjax.nn.fuse_projections): columns grouped by kv head / by MLP column
    (("qkv_proj", "kernel"), P(EMBED, HEADS)),
    (("qkv_proj", "bias"), P(HEADS)),
    (("gate_up", "kernel"), P(EMBED, FF)),
    (("gate", "kernel"), P(EMBED, FF)),
    (("up", "kernel"), P(EMBED, FF)),
    (("down", "kernel"), P(FF, EMBED)),
    (("embed", "embedding"), P(VOCAB, EMBED)),
    (("lm_head", "kernel"), P(EMBED, VOCAB)),
)


def _names(path) -> Tuple[str, ...]:
    out = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                out.append(str(getattr(key, attr)))
                break
    if out and out[-1] == "value":  # an NNX Variable's value
        out = out[:-1]
    return tuple(out)


def param_axes(state):
    """The logical axes of every parameter of a model state (``nnx.state(model)`` or linen variables).

    Returns:
        The state's structure with ``PartitionSpec`` leaves of logical names (:data:`PARAM_RULES`;
        parameters they do not name: all ``None``, replicated).
    """

    def one(path, leaf):
        names = _names(path)
        for suffix, spec in PARAM_RULES:
            if names[-len(suffix) :] == suffix and len(spec) == np.ndim(leaf):
                return spec
        return P(*((None,) * np.ndim(leaf)))

    return jax.tree_util.tree_map_with_path(one, state)


def param_shardings(state, mesh: Mesh, rules: Rules = None, *, n_kv_heads: Optional[int] = None):
    """A ``NamedSharding`` per parameter (see :func:`param_axes`), checked against the mesh.

    Args:
        state: the model state.
        mesh: the device mesh.
        rules: overrides of :data:`kvjax.shard.DEFAULT_RULES`.
        n_kv_heads: the model's kv heads: when given, the devices its heads are split over must
            divide it (a projection split inside a head would still compute, but its K/V would
            not sit with the cache's heads).

    Raises:
        ValueError: as :func:`kvjax.shard.memory_shardings`, and ``n_kv_heads`` the mesh does not divide.
    """
    check_mesh(mesh)
    table = check_rules(rules, mesh)
    if n_kv_heads is not None:
        n_kv_heads = check_count("n_kv_heads", n_kv_heads, 1)
        parts = int(np.prod([mesh.shape[a] for a in table[HEADS]])) if table[HEADS] else 1
        if n_kv_heads % parts:
            allowed = [d for d in range(1, n_kv_heads + 1) if n_kv_heads % d == 0]
            raise ValueError(
                f"n_kv_heads={n_kv_heads} is out of range for mesh={dict(mesh.shape)}: heads are split "
                f"over {parts} devices; allowed a mesh whose {'x'.join(table[HEADS])} size is one of "
                f"{allowed}"
            )
    axes = param_axes(state)

    def one(path, leaf, spec):
        return NamedSharding(
            mesh, to_mesh_spec(spec, tuple(np.shape(leaf)), table, mesh, "params" + jax.tree_util.keystr(path))
        )

    return jax.tree_util.tree_map_with_path(one, state, axes)


def shard_params(model_or_state, mesh: Mesh, rules: Rules = None, *, n_kv_heads: Optional[int] = None):
    """Place a model's weights on ``mesh`` (heads and MLP width on ``"model"``, the rest replicated).

    Args:
        model_or_state: an NNX module (its state is placed and written back into it), or a state /
            linen variables pytree.
        mesh: the device mesh.
        rules: overrides of :data:`kvjax.shard.DEFAULT_RULES`.
        n_kv_heads: the model's kv heads, checked against the mesh (the devices heads are split
            over must divide it). A module's own ``config.n_kv_heads`` is used when not given;
            pass it with a bare state, which carries no config: a mesh that divides a
            projection's columns but not its heads would otherwise split a head group.

    Returns:
        The placed state (pass it to the step: ``step(state, memory, ...)``).

    Raises:
        ValueError: as :func:`param_shardings`; nothing is placed then.
    """
    if n_kv_heads is not None:
        n_kv_heads = check_count("n_kv_heads", n_kv_heads, 1)
    if isinstance(model_or_state, nnx.Module):
        state = nnx.state(model_or_state)
        own = getattr(getattr(model_or_state, "config", None), "n_kv_heads", None)
        if n_kv_heads is not None and own is not None and n_kv_heads != own:
            raise ValueError(
                f"n_kv_heads={n_kv_heads!r} does not match the model's config.n_kv_heads={own}: "
                f"leave n_kv_heads out for a module (its config is read)"
            )
        placed = jax.device_put(state, param_shardings(state, mesh, rules, n_kv_heads=own or n_kv_heads))
        nnx.update(model_or_state, placed)
        return placed
    return jax.device_put(model_or_state, param_shardings(model_or_state, mesh, rules, n_kv_heads=n_kv_heads))
