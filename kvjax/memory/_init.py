"""A memory from its config, for every kind of memory, on one device or laid out on a mesh.

One table maps each config type to the function that makes its memory; a new memory kind adds a
row. This module stands above every memory kind (it imports them all), so it also holds what
needs the table: :func:`require_memory` (a memory whose arrays agree with its config) and the
layout of a memory's leaves on a device mesh (its logical axes, :meth:`kvjax.Memory.logical_axes`,
mapped through :mod:`kvjax._mesh`'s rules), which ``init(config, mesh=...)`` uses and
:mod:`kvjax.shard` publishes.

Example:
    >>> import kvjax
    >>> cfg = kvjax.CacheConfig(size=256, n_seq_max=4, n_layer=2, n_kv_heads=2, head_dim=16)
    >>> type(kvjax.init(cfg)).__name__, kvjax.abstract(cfg).k[0]
    ('KVCache', ShapeDtypeStruct(shape=(2, 2, 256, 16), dtype=float32))
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax.memory._config import CacheConfig
from kvjax.memory._iswa import IswaConfig, init_iswa
from kvjax.memory._protocol import Memory, require_live
from kvjax.memory._recurrent import RecurrentConfig, init_recurrent
from kvjax.memory._hybrid import HybridConfig, init_hybrid
from kvjax.memory._streams import StreamsConfig, init_streams
from kvjax.memory._unified import init_unified
from kvjax._mesh import Rules, freeze_rules, check_mesh, check_rules, to_mesh_spec

#: config type -> the function that makes an empty memory of it
MAKERS = {
    CacheConfig: init_unified,
    IswaConfig: init_iswa,
    RecurrentConfig: init_recurrent,
    HybridConfig: init_hybrid,
    StreamsConfig: init_streams,
}


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
            raise ValueError(
                f"rules={rules!r} is out of range without mesh=: allowed None (rules place a memory on a mesh)"
            )
        return maker(config)
    return init_sharded(maker, config, mesh, rules)


def abstract(config) -> Memory:
    """Shapes and dtypes of :func:`init`'s result (``jax.ShapeDtypeStruct`` leaves), allocating nothing."""
    maker = _maker(config)
    return jax.eval_shape(lambda: maker(config))


# -- a memory checked against its config ------------------------------------------------------------


def require_memory(memory, name: str = "memory") -> Memory:
    """Raise ``ValueError`` unless ``memory`` is a kvjax memory (every free function calls it)."""
    if not isinstance(memory, Memory):
        raise ValueError(
            f"{name} must be a kvjax memory (a kvjax.KVCache or another kvjax.Memory, made by "
            f"kvjax.init(config)), got {type(memory).__name__}"
        )
    require_live(memory, name)
    require_layout(memory, name)
    return memory


@functools.lru_cache(maxsize=256)
def _layout_of(config):
    """``(shape, dtype)`` of every array ``kvjax.init(config)`` makes, in leaf order (configs are hashable)."""
    return tuple((tuple(x.shape), np.dtype(x.dtype)) for x in jax.tree.leaves(abstract(config)))


def require_layout(memory, name: str = "memory") -> None:
    """Raise ``ValueError`` when an array of ``memory`` disagrees with its config (shape or dtype).

    A memory is only ever made by :func:`kvjax.init`; one rebuilt by hand (``cache.replace(config=
    another)``, arrays of another memory) would be read and written out of bounds. Shapes are static,
    so the check costs nothing under ``jit`` (and a few microseconds eagerly).
    """
    want = _layout_of(memory.config)
    got = jax.tree.leaves(memory)
    if len(got) == len(want) and all(
        getattr(x, "shape", None) == shape and getattr(x, "dtype", None) == dtype
        for x, (shape, dtype) in zip(got, want)
    ):
        return
    if len(got) != len(want):
        raise ValueError(
            f"{name} has {len(got)} arrays where its config gives {len(want)}: a memory must be made by "
            f"kvjax.init(config) (and changed only by kvjax's functions)"
        )
    for (path, leaf), (shape, dtype) in zip(jax.tree_util.tree_flatten_with_path(memory)[0], want):
        if tuple(jnp.shape(leaf)) != shape or jnp.result_type(leaf) != dtype:
            raise ValueError(
                f"{name}{jax.tree_util.keystr(path)} has shape {tuple(jnp.shape(leaf))} and dtype "
                f"{jnp.result_type(leaf)} where its config gives {shape} and {dtype}: the arrays and the "
                f"config disagree (a config replaced by hand?); make the memory with kvjax.init(config)"
            )


# -- a memory on a device mesh ----------------------------------------------------------------------


def _as_memory(memory_or_config):
    if isinstance(memory_or_config, Memory):
        return memory_or_config
    if type(memory_or_config) in MAKERS:
        return abstract(memory_or_config)
    raise ValueError(
        f"memory must be a kvjax memory or a memory config ({', '.join(t.__name__ for t in MAKERS)}), "
        f"got {type(memory_or_config).__name__}"
    )


def logical_axes(memory_or_config):
    """The logical axes of every leaf of a memory (or of the memory a config describes).

    Returns:
        A pytree of the memory's structure whose leaves are ``PartitionSpec`` of logical names
        (:meth:`kvjax.Memory.logical_axes`).
    """
    return _as_memory(memory_or_config).logical_axes()


def _spec_tree(memory, table, mesh):
    axes = memory.logical_axes()

    def one(path, leaf, logical):
        where = "memory" + jax.tree_util.keystr(path)
        return to_mesh_spec(logical, tuple(np.shape(leaf)), table, mesh, where)

    if jax.tree.structure(axes) != jax.tree.structure(memory):
        raise ValueError(
            f"{type(memory).__name__}.logical_axes() does not match the memory's leaves: allowed the "
            f"memory's own structure with one PartitionSpec per array"
        )
    return jax.tree_util.tree_map_with_path(one, memory, axes)


def mesh_axes(memory_or_config, rules: Rules = None, mesh: Optional[Mesh] = None):
    """Each leaf's mesh ``PartitionSpec`` under ``rules`` (checked against ``mesh`` when given)."""
    table = check_rules(rules, mesh)
    return _spec_tree(_as_memory(memory_or_config), table, mesh)


def memory_shardings(memory_or_config, mesh: Mesh, rules: Rules = None):
    """A ``NamedSharding`` for every leaf of a memory (or of the memory a config describes).

    Args:
        memory_or_config: a memory (concrete or abstract) or a memory config.
        mesh: the device mesh.
        rules: logical axis -> mesh axes overrides of :data:`DEFAULT_RULES`.

    Returns:
        A pytree of the memory's structure with ``NamedSharding`` leaves (``jax.device_put`` and
        ``jax.jit(out_shardings=...)`` take it as it is).

    Raises:
        ValueError: see :func:`check_rules` and :func:`to_mesh_spec` (a mesh that does not divide a
            leaf names the leaf, its dimension and the sizes allowed).
    """
    check_mesh(mesh)
    specs = mesh_axes(memory_or_config, rules, mesh)
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs, is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard(memory, mesh: Mesh, rules: Rules = None):
    """``memory`` placed on ``mesh`` by the rules (one ``jax.device_put``; the values are unchanged).

    To make a new memory sharded without a single-device copy first, use
    ``kvjax.init(config, mesh=mesh)`` instead.
    """
    require_memory(memory)
    return jax.device_put(memory, memory_shardings(memory, mesh, rules))


@functools.lru_cache(maxsize=32)
def _sharded_maker(maker, config, shardings_key, mesh):
    shardings = memory_shardings(config, mesh, dict(shardings_key))
    return jax.jit(lambda: maker(config), out_shardings=shardings)


def init_sharded(maker, config, mesh: Mesh, rules: Rules = None):
    """``maker(config)`` compiled with ``out_shardings``: every buffer is created in its shards."""
    check_mesh(mesh)
    table = check_rules(rules, mesh)
    return _sharded_maker(maker, config, freeze_rules(table), mesh)()
