"""Rules: logical axes onto a device mesh, with every mismatch refused up front.

One table of rules (logical axis name -> mesh axis name, a tuple of mesh axis names, or ``None``
for "not split") places every memory and the reference model's weights. The defaults are
tensor parallel over kv heads (``"model"``) and data parallel over streams (``"data"``); cells,
layers, head sizes and all cell metadata stay whole on every device (replicated), because every
sequence operation and every placement reads all cells of a part, and splitting them would turn
each of those small programs into a collective.

Example:
    >>> import jax, kvjax
    >>> from kvjax import shard
    >>> mesh = shard.make_mesh(1, 1)
    >>> cfg = kvjax.CacheConfig(size=64, n_seq_max=2, n_layer=2, n_kv_heads=2, head_dim=8)
    >>> shard.mesh_axes(cfg).k[0]
    P(None, 'model', None, None)
    >>> cache = kvjax.init(cfg, mesh=mesh)
    >>> cache.k[0].sharding.spec
    P(None, 'model', None, None)
"""

from __future__ import annotations

import functools
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvjax._validate import check_count
from kvjax.shard import _axes as ax

#: the mesh axis of data parallelism (sequences, streams)
DATA = "data"
#: the mesh axis of tensor parallelism (heads)
MODEL = "model"

MeshAxes = Union[None, str, Tuple[str, ...]]
Rules = Union[None, Mapping[str, MeshAxes], Sequence[Tuple[str, MeshAxes]]]

#: logical axis -> mesh axis: kv heads (and the weights' heads and MLP width) on ``"model"``,
#: streams on ``"data"``, everything else whole on every device
DEFAULT_RULES: Tuple[Tuple[str, MeshAxes], ...] = (
    (ax.LAYERS, None), (ax.KV_HEADS, MODEL), (ax.CELLS, None), (ax.HEAD_DIM, None), (ax.SEQ_WORDS, None),
    (ax.SEQS, None), (ax.STREAMS, DATA), (ax.STATE_ROWS, None), (ax.STATE, None),
    (ax.HEADS, MODEL), (ax.FF, MODEL), (ax.EMBED, None), (ax.VOCAB, None),
)


def make_mesh(data: int, model: int, devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A ``data x model`` mesh with the axis names the default rules use.

    Args:
        data: devices along the data axis (sequences, streams).
        model: devices along the model axis (heads).
        devices: the devices to use, ``data * model`` of them (default the first of
            ``jax.devices()``; under ``jax.distributed`` every process's devices).

    Raises:
        ValueError: sizes that are not positive integers, or more devices than there are.

    Example:
        >>> dict(make_mesh(1, 1).shape)
        {'data': 1, 'model': 1}
    """
    data, model = check_count("data", data, 1), check_count("model", model, 1)
    pool = list(jax.devices() if devices is None else devices)
    need = int(data) * int(model)
    if need > len(pool):
        raise ValueError(f"data * model = {need} devices is out of range: allowed at most {len(pool)} (the devices "
                         f"given; for virtual CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count=N "
                         f"before jax starts)")
    return Mesh(np.asarray(pool[:need], dtype=object).reshape(int(data), int(model)), (DATA, MODEL))


def _mesh_axes_of(value, logical: str) -> Tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(f"rules[{logical!r}]={value!r} is out of range: allowed a mesh axis name, a tuple of them, "
                     f"or None")


def check_mesh(mesh) -> Mesh:
    """``mesh`` if it is a ``jax.sharding.Mesh``, else ``ValueError``."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh (e.g. kvjax.shard.make_mesh(data, model)), got "
                         f"{type(mesh).__name__}")
    return mesh


def check_rules(rules: Rules, mesh: Optional[Mesh] = None) -> Dict[str, Tuple[str, ...]]:
    """The rules as ``{logical: (mesh axes...)}``: :data:`DEFAULT_RULES` updated with ``rules``.

    Args:
        rules: ``None``, a mapping or a sequence of ``(logical, mesh axes)`` pairs; each logical
            name must be one of :data:`kvjax.shard.LOGICAL_AXES`, each mesh axis one of
            ``mesh.axis_names``.
        mesh: when given, every mesh axis a rule names must be one of its axes.

    Raises:
        ValueError: an unknown logical name, a mesh axis the mesh does not have, a malformed rule.

    Example:
        >>> check_rules({"cells": "data"})["cells"], check_rules(None)["kv_heads"]
        (('data',), ('model',))
    """
    table = {name: _mesh_axes_of(value, name) for name, value in DEFAULT_RULES}
    if rules is not None:
        if isinstance(rules, Mapping):
            pairs = list(rules.items())
        else:
            try:
                pairs = [tuple(p) for p in rules]
            except TypeError:
                raise ValueError(f"rules={rules!r} is out of range: allowed a mapping or a sequence of "
                                 f"(logical axis, mesh axes) pairs") from None
            if any(len(p) != 2 for p in pairs):
                raise ValueError(f"rules={rules!r} is out of range: allowed a mapping or a sequence of "
                                 f"(logical axis, mesh axes) pairs")
        for name, value in pairs:
            if name not in ax.LOGICAL_AXES:
                raise ValueError(f"rules names the logical axis {name!r}: allowed {list(ax.LOGICAL_AXES)}")
            table[name] = _mesh_axes_of(value, name)
    if mesh is not None:
        names = tuple(check_mesh(mesh).axis_names)
        for logical, axes in table.items():
            for a in axes:
                if a not in names:
                    hint = " (the default rules use the axes 'data' and 'model': kvjax.shard.make_mesh, " \
                           "or pass rules)" if a in (DATA, MODEL) else ""
                    raise ValueError(f"rules map the logical axis {logical!r} to the mesh axis {a!r}: allowed the "
                                     f"mesh's axes {list(names)} or None{hint}")
    return table


def _freeze(table: Dict[str, Tuple[str, ...]]):
    return tuple(sorted(table.items()))


def to_mesh_spec(logical: PartitionSpec, shape: Tuple[int, ...], table: Dict[str, Tuple[str, ...]],
                 mesh: Optional[Mesh], where: str) -> PartitionSpec:
    """One leaf's mesh ``PartitionSpec`` from its logical one, checked against its shape and the mesh.

    Raises:
        ValueError: a logical name without a rule, a spec of the wrong length, a mesh axis used
            twice in one leaf, or a dimension the mesh axes do not divide.
    """
    if not isinstance(logical, PartitionSpec):
        raise ValueError(f"{where}: logical axes must be a jax.sharding.PartitionSpec of logical names, got "
                         f"{type(logical).__name__}")
    names = tuple(logical)
    if len(names) != len(shape):
        raise ValueError(f"{where} has {len(shape)} dimensions {tuple(shape)} but {len(names)} logical axes "
                         f"{names}: allowed one logical axis per dimension")
    out, used = [], {}
    for i, (name, n) in enumerate(zip(names, shape)):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(f"{where}: the logical axis {name!r} has no rule: allowed {sorted(table)} (a new axis "
                             f"name needs a rule: add it to kvjax.shard.LOGICAL_AXES and DEFAULT_RULES)")
        axes = table[name]
        for a in axes:
            if a in used:
                raise ValueError(f"{where}: the mesh axis {a!r} splits both dimension {used[a]} and dimension {i} "
                                 f"({name!r}): allowed each mesh axis once per leaf (change the rules)")
            used[a] = i
        if mesh is not None and axes:
            parts = math.prod(mesh.shape[a] for a in axes)
            if n % parts:
                allowed = [d for d in range(1, n + 1) if n % d == 0]
                raise ValueError(f"mesh={dict(mesh.shape)} does not divide {where}: dimension {i} ({name!r}, size "
                                 f"{n}) is split over mesh axes {list(axes)} of {parts} devices; allowed a mesh "
                                 f"whose {'x'.join(axes)} size is one of {allowed} (or a rule mapping {name!r} "
                                 f"to None)")
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def _as_memory(memory_or_config):
    from kvjax.memory._init import MAKERS, abstract
    from kvjax.memory._protocol import Memory

    if isinstance(memory_or_config, Memory):
        return memory_or_config
    if type(memory_or_config) in MAKERS:
        return abstract(memory_or_config)
    raise ValueError(f"memory must be a kvjax memory or a memory config ({', '.join(t.__name__ for t in MAKERS)}), "
                     f"got {type(memory_or_config).__name__}")


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
        raise ValueError(f"{type(memory).__name__}.logical_axes() does not match the memory's leaves: allowed the "
                         f"memory's own structure with one PartitionSpec per array")
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
    return jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs,
                        is_leaf=lambda x: isinstance(x, PartitionSpec))


def shard(memory, mesh: Mesh, rules: Rules = None):
    """``memory`` placed on ``mesh`` by the rules (one ``jax.device_put``; the values are unchanged).

    To make a new memory sharded without a single-device copy first, use
    ``kvjax.init(config, mesh=mesh)`` instead.
    """
    from kvjax.memory._protocol import require_memory

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
    return _sharded_maker(maker, config, _freeze(table), mesh)()


def shardings_of(tree):
    """The ``.sharding`` of every array leaf of a pytree (a memory, a model state)."""
    return jax.tree.map(lambda x: x.sharding, tree)


def same_shardings(a, b) -> bool:
    """Whether two pytrees of arrays have the same structure and equivalent shardings leaf by leaf.

    Equivalence is ``Sharding.is_equivalent_to(other, ndim)``: the same devices hold the same
    pieces (``P(None, 'model')`` and ``P(None, 'model', None, None)`` are equivalent).
    """
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    if ta != tb:
        return False
    return all(x.sharding.is_equivalent_to(y.sharding, np.ndim(x)) for x, y in zip(la, lb))


def reshard_like(tree, like):
    """``tree`` placed with the shardings of ``like`` (same structure): a no-op for leaves already there."""
    return jax.device_put(tree, shardings_of(like))


def type_mesh(x) -> Tuple[Any, Dict[str, int]]:
    """``(mesh, {axis name: size})`` of the mesh in ``x``'s type, traced or not (``(None, {})`` off a mesh).

    Known while tracing with no mesh context (``jax.typeof(x).sharding.mesh``); the spec is not,
    under ``Auto`` axes, so callers decide from the mesh and kvjax's rules.
    """
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    return mesh, dict(getattr(mesh, "shape", {}) or {})


def spans_devices(tree) -> bool:
    """Whether any array leaf of ``tree`` lives on more than one device (it was placed on a mesh)."""
    return any(isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and len(x.sharding.device_set) > 1
               for x in jax.tree.leaves(tree))
