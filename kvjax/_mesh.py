"""Mesh rules: logical axes onto a device mesh, with every mismatch refused up front (no memory here).

One table of rules (logical axis name -> mesh axis name, a tuple of mesh axis names, or ``None``
for "not split") places every memory and the reference model's weights. This module knows meshes and logical
axis names only: it is on the bottom floor, so memories use it freely; how a memory's leaves
map through it is :mod:`kvjax.memory._init`'s job. The defaults are
tensor parallel over kv heads (``"model"``) and data parallel over streams (``"data"``); cells,
layers, head sizes and all cell metadata stay whole on every device (replicated), because every
sequence operation and every placement reads all cells of a part, and splitting them would turn
each of those small programs into a collective.

Example:
    >>> import jax, kvjax
    >>> from kvjax import shard
    >>> mesh = shard.make_mesh(1, 1)
    >>> cfg = kvjax.CacheConfig(size=64, n_seq_max=2, n_layer=2, n_kv_heads=2, head_dim=8)
    >>> cache = kvjax.init(cfg, mesh=mesh)
    >>> cache.k[0].sharding.spec
    P(None, 'model', None, None)
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, Union

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from kvjax._validate import check_count
from kvjax import _axes as ax

#: the mesh axis of data parallelism (sequences, streams)
DATA = "data"
#: the mesh axis of tensor parallelism (heads)
MODEL = "model"

MeshAxes = Union[None, str, Tuple[str, ...]]
Rules = Union[None, Mapping[str, MeshAxes], Sequence[Tuple[str, MeshAxes]]]

#: logical axis -> mesh axis: kv heads (and the weights' heads and MLP width) on ``"model"``,
#: streams on ``"data"``, everything else whole on every device
DEFAULT_RULES: Tuple[Tuple[str, MeshAxes], ...] = (
    (ax.LAYERS, None),
    (ax.KV_HEADS, MODEL),
    (ax.CELLS, None),
    (ax.HEAD_DIM, None),
    (ax.SEQ_WORDS, None),
    (ax.SEQS, None),
    (ax.STREAMS, DATA),
    (ax.STATE_ROWS, None),
    (ax.STATE, None),
    (ax.HEADS, MODEL),
    (ax.FF, MODEL),
    (ax.EMBED, None),
    (ax.VOCAB, None),
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
        raise ValueError(
            f"data * model = {need} devices is out of range: allowed at most {len(pool)} (the devices "
            f"given; for virtual CPU devices set XLA_FLAGS=--xla_force_host_platform_device_count=N "
            f"before jax starts)"
        )
    return Mesh(np.asarray(pool[:need], dtype=object).reshape(int(data), int(model)), (DATA, MODEL))


def _mesh_axes_of(value, logical: str) -> Tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(
        f"rules[{logical!r}]={value!r} is out of range: allowed a mesh axis name, a tuple of them, or None"
    )


def check_mesh(mesh) -> Mesh:
    """``mesh`` if it is a ``jax.sharding.Mesh``, else ``ValueError``."""
    if not isinstance(mesh, Mesh):
        raise ValueError(
            f"mesh must be a jax.sharding.Mesh (e.g. kvjax.shard.make_mesh(data, model)), got {type(mesh).__name__}"
        )
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
                raise ValueError(
                    f"rules={rules!r} is out of range: allowed a mapping or a sequence of "
                    f"(logical axis, mesh axes) pairs"
                ) from None
            if any(len(p) != 2 for p in pairs):
                raise ValueError(
                    f"rules={rules!r} is out of range: allowed a mapping or a sequence of "
                    f"(logical axis, mesh axes) pairs"
                )
        for name, value in pairs:
            if name not in ax.LOGICAL_AXES:
                raise ValueError(f"rules names the logical axis {name!r}: allowed {list(ax.LOGICAL_AXES)}")
            table[name] = _mesh_axes_of(value, name)
    if mesh is not None:
        names = tuple(check_mesh(mesh).axis_names)
        for logical, axes in table.items():
            for a in axes:
                if a not in names:
                    hint = (
                        " (the default rules use the axes 'data' and 'model': kvjax.shard.make_mesh, or pass rules)"
                        if a in (DATA, MODEL)
                        else ""
                    )
                    raise ValueError(
                        f"rules map the logical axis {logical!r} to the mesh axis {a!r}: allowed the "
                        f"mesh's axes {list(names)} or None{hint}"
                    )
    return table


def freeze_rules(table: Dict[str, Tuple[str, ...]]):
    return tuple(sorted(table.items()))


def to_mesh_spec(
    logical: PartitionSpec, shape: Tuple[int, ...], table: Dict[str, Tuple[str, ...]], mesh: Optional[Mesh], where: str
) -> PartitionSpec:
    """One leaf's mesh ``PartitionSpec`` from its logical one, checked against its shape and the mesh.

    Raises:
        ValueError: a logical name without a rule, a spec of the wrong length, a mesh axis used
            twice in one leaf, or a dimension the mesh axes do not divide.
    """
    if not isinstance(logical, PartitionSpec):
        raise ValueError(
            f"{where}: logical axes must be a jax.sharding.PartitionSpec of logical names, got {type(logical).__name__}"
        )
    names = tuple(logical)
    if len(names) != len(shape):
        raise ValueError(
            f"{where} has {len(shape)} dimensions {tuple(shape)} but {len(names)} logical axes "
            f"{names}: allowed one logical axis per dimension"
        )
    out, used = [], {}
    for i, (name, n) in enumerate(zip(names, shape)):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise ValueError(
                f"{where}: the logical axis {name!r} has no rule: allowed {sorted(table)} (a new axis "
                f"name needs a rule: add it to kvjax.shard.LOGICAL_AXES and DEFAULT_RULES)"
            )
        axes = table[name]
        for a in axes:
            if a in used:
                raise ValueError(
                    f"{where}: the mesh axis {a!r} splits both dimension {used[a]} and dimension {i} "
                    f"({name!r}): allowed each mesh axis once per leaf (change the rules)"
                )
            used[a] = i
        if mesh is not None and axes:
            parts = math.prod(mesh.shape[a] for a in axes)
            if n % parts:
                allowed = [d for d in range(1, n + 1) if n % d == 0]
                raise ValueError(
                    f"mesh={dict(mesh.shape)} does not divide {where}: dimension {i} ({name!r}, size "
                    f"{n}) is split over mesh axes {list(axes)} of {parts} devices; allowed a mesh "
                    f"whose {'x'.join(axes)} size is one of {allowed} (or a rule mapping {name!r} "
                    f"to None)"
                )
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


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
    return any(
        isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer) and len(x.sharding.device_set) > 1
        for x in jax.tree.leaves(tree)
    )
