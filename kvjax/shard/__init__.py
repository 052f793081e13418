"""Every memory on a device mesh: logical axes, one set of rules, sharded init, sharded model weights.

A memory names what each dimension of its leaves is (:meth:`kvjax.Memory.logical_axes`: kv
heads, cells, layers, ...); :data:`DEFAULT_RULES` map those names onto the axes of a
``jax.sharding.Mesh`` (``"data"`` x ``"model"``, :func:`make_mesh`): kv heads on ``"model"``,
streams on ``"data"``, cells and cell metadata whole on every device. ``kvjax.init(config,
mesh=mesh)`` creates a memory directly in its shards. Every kvjax operation is a jitted pure
function, so from there XLA keeps each leaf where it is (see ``docs/sharding.md``, which also
says what runs under ``jax.distributed``). :func:`shard_params` places the reference model's
weights so its heads sit with their K/V.

Example:
    >>> import kvjax
    >>> from kvjax import shard
    >>> mesh = shard.make_mesh(data=1, model=1)
    >>> cfg = kvjax.CacheConfig(size=64, n_seq_max=2, n_layer=2, n_kv_heads=2, head_dim=8)
    >>> cache = kvjax.init(cfg, mesh=mesh)
    >>> shard.logical_axes(cfg).k[0], cache.k[0].sharding.spec
    (P('layers', 'kv_heads', 'cells', 'head_dim'), P(None, 'model', None, None))
    >>> cache, _, _ = kvjax.find_slot(cache, kvjax.make_ubatch([0, 1], [[0], [0]]))
    >>> shard.same_shardings(cache, kvjax.init(cfg, mesh=mesh))
    True
"""

from kvjax._axes import (
    CELLS,
    EMBED,
    FF,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYERS,
    LOGICAL_AXES,
    SEQ_WORDS,
    SEQS,
    STATE,
    STATE_ROWS,
    STREAMS,
    VOCAB,
    kv_axes,
    scalar_axes,
    state_axes,
)
from kvjax._mesh import DATA, DEFAULT_RULES, MODEL, check_rules, make_mesh, reshard_like, same_shardings, shardings_of
from kvjax.memory._init import logical_axes, memory_shardings, mesh_axes, shard
from kvjax.shard._params import PARAM_RULES, param_axes, param_shardings, shard_params

__all__ = [
    "LOGICAL_AXES",
    "DEFAULT_RULES",
    "DATA",
    "MODEL",
    "LAYERS",
    "KV_HEADS",
    "CELLS",
    "HEAD_DIM",
    "SEQ_WORDS",
    "SEQS",
    "STREAMS",
    "STATE_ROWS",
    "STATE",
    "HEADS",
    "FF",
    "EMBED",
    "VOCAB",
    "kv_axes",
    "scalar_axes",
    "state_axes",
    "make_mesh",
    "check_rules",
    "logical_axes",
    "mesh_axes",
    "memory_shardings",
    "shard",
    "shardings_of",
    "same_shardings",
    "reshard_like",
    "PARAM_RULES",
    "param_axes",
    "param_shardings",
    "shard_params",
]
