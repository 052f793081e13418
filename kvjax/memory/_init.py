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


def init(config) -> Memory:
    """A new, empty memory of the kind ``config`` describes (zeroed buffers: no NaN reaches a softmax).

    Args:
        config: a :class:`kvjax.CacheConfig` (the unified cache), a :class:`kvjax.IswaConfig`, ...

    Returns:
        The memory.
    """
    return _maker(config)(config)


def abstract(config) -> Memory:
    """Shapes and dtypes of :func:`init`'s result (``jax.ShapeDtypeStruct`` leaves), allocating nothing."""
    maker = _maker(config)
    return jax.eval_shape(lambda: maker(config))
