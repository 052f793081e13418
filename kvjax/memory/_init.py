"""``init`` and ``abstract``: a memory from its config, for every kind of memory.

One table maps each config type to the function that makes its memory; a new memory kind adds a
row.

Example:
    >>> import kvjax
    >>> cfg = kvjax.CacheConfig(size=256, n_seq_max=4, n_layer=2, n_kv_heads=2, head_dim=16)
    >>> type(kvjax.init(cfg)).__name__, kvjax.abstract(cfg).k[0]
    ('KVCache', ShapeDtypeStruct(shape=(2, 2, 256, 16), dtype=float32))
"""

from __future__ import annotations

import jax

from kvjax.memory._config import CacheConfig
from kvjax.memory._iswa import IswaConfig, init_iswa
from kvjax.memory._protocol import Memory
from kvjax.memory._recurrent import RecurrentConfig, init_recurrent
from kvjax.memory._hybrid import HybridConfig, init_hybrid
from kvjax.memory._streams import StreamsConfig, init_streams
from kvjax.memory._unified import init_unified

#: config type -> the function that makes an empty memory of it
MAKERS = {CacheConfig: init_unified, IswaConfig: init_iswa, RecurrentConfig: init_recurrent,
          HybridConfig: init_hybrid, StreamsConfig: init_streams}


def _maker(config):
    maker = MAKERS.get(type(config))
    if maker is None:
        names = ", ".join(f"kvjax.{t.__name__}" for t in MAKERS)
        raise ValueError(f"config must be a memory description ({names}), got {type(config).__name__}")
    return maker


def init(config, *, mesh=None, rules=None) -> Memory:
    """A new, empty memory of the kind ``config`` describes (zeroed buffers: no NaN reaches a softmax).

    Args:
        config: a :class:`kvjax.CacheConfig` (the unified cache), a :class:`kvjax.IswaConfig`, ...
        mesh: a ``jax.sharding.Mesh`` to create the memory on, each leaf split by ``rules``
            (:mod:`kvjax.shard`); the buffers are made in their shards (``jit`` with
            ``out_shardings``), never whole on one device first. ``None``: the default device.
        rules: logical axis -> mesh axes overrides of ``kvjax.shard.DEFAULT_RULES`` (needs ``mesh``).

    Returns:
        The memory.

    Raises:
        ValueError: an unknown config, or (with ``mesh``) rules or a mesh that do not fit the
            memory's leaves (see :func:`kvjax.shard.memory_shardings`).
    """
    maker = _maker(config)
    if mesh is None:
        if rules is not None:
            raise ValueError(f"rules={rules!r} is out of range without mesh=: allowed None (rules place a memory "
                             f"on a mesh)")
        return maker(config)
    from kvjax.shard._rules import init_sharded

    return init_sharded(maker, config, mesh, rules)


def abstract(config) -> Memory:
    """Shapes and dtypes of :func:`init`'s result (``jax.ShapeDtypeStruct`` leaves), allocating nothing."""
    maker = _maker(config)
    return jax.eval_shape(lambda: maker(config))
