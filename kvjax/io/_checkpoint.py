"""Checkpointing the whole cache pytree with orbax, for programs that already use orbax.

Unlike the seed's state format (:mod:`kvjax.io._state`), a checkpoint keeps every leaf exactly as it
is: cells at their indices, pending shifts, ``head``, the error and defrag flags, and the full
K/V buffers (empty cells included). It is restored into a cache of the same config only; the
config is saved beside the arrays as JSON and compared field by field on restore, and a
mismatch is a :class:`kvjax.StateError` naming the fields.

orbax-checkpoint is an optional dependency (``pip install kvjax[orbax]``); it is imported when a
function here is called, and a missing install is reported with that hint.

Layout on disk (an orbax composite checkpoint): item ``state`` holds the arrays as a nested dict
``{"cells": {pos, seq, delta, head, error, defrag}, "k": {"0": ..., ...}, "v": {...}}`` (one
entry per layer group), item ``meta`` holds ``{"format", "version", "config"}``.

Example:
    >>> import os, tempfile, kvjax
    >>> cfg = kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1, head_dim=2)
    >>> cache, _, _ = kvjax.find_slot(kvjax.init(cfg), kvjax.make_ubatch([0, 1], [[0], [1]]))
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> kvjax.checkpoint_save(path, cache)
    >>> int(kvjax.used_cells(kvjax.checkpoint_restore(path, cfg)))
    2
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Union

import jax
import jax.numpy as jnp
import numpy as np

from kvjax.memory._init import abstract
from kvjax.memory._unified import KVCache, require_cache
from kvjax.memory._cells import Cells
from kvjax.memory._config import CacheConfig
from kvjax._errors import StateError
from kvjax._validate import INT32_MAX
from kvjax.memory import _seqbits as seqbits
from kvjax.storage import _quant

FORMAT = "kvjax-cache"
VERSION = 1
_CELL_FIELDS = ("pos", "seq", "delta", "head", "error", "defrag")


def _orbax():
    try:
        import orbax.checkpoint as ocp
    except ImportError as exc:
        raise ImportError(
            "kvjax checkpoints need orbax-checkpoint, which is not installed: "
            "pip install 'kvjax[orbax]' (or pip install orbax-checkpoint)"
        ) from exc
    return ocp


def _jsonable(value):
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    return value


def config_record(config: CacheConfig) -> dict:
    """Every field of ``config`` as JSON-compatible values (what a checkpoint stores).

    Example:
        >>> import kvjax
        >>> rec = config_record(kvjax.CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=2))
        >>> rec["size"], rec["head_dim"], rec["swa_type"]
        (32, [2], 'none')
    """
    return {f.name: _jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)}


def _tree(cache: KVCache) -> dict:
    cells = {name: getattr(cache.cells, name) for name in _CELL_FIELDS}
    tree = {"cells": cells, "k": {str(g): x for g, x in enumerate(cache.k)}}
    if not cache.config.mla:  # a latent cache's V leaves hold nothing (orbax refuses zero-size arrays)
        tree["v"] = {str(g): x for g, x in enumerate(cache.v)}
    return tree


def _field_defaults() -> dict:
    """The JSON record of every CacheConfig field that has a plain default."""
    return {
        f.name: _jsonable(f.default) for f in dataclasses.fields(CacheConfig) if f.default is not dataclasses.MISSING
    }


def _empty_v(config: CacheConfig):
    """A latent cache's zero-width V leaves (not in its checkpoint: they hold nothing)."""
    dtype = _quant.storage_dtype(config.v_dtype)
    return tuple(jnp.zeros((len(g.layers), g.n_kv_heads, config.size, 0), dtype) for g in config.groups)


def _check_path(path) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return os.path.abspath(os.fspath(path))  # orbax wants absolute paths


def checkpoint_save(path, cache: KVCache, *, force: bool = False) -> None:
    """Save the whole cache pytree (and its config) as an orbax checkpoint at ``path``.

    Args:
        path: a directory that does not exist yet (or exists, with ``force``).
        cache: the cache (concrete).
        force: replace an existing checkpoint at ``path``.

    Raises:
        ImportError: orbax-checkpoint is not installed.
        ValueError: a bad argument.
    """
    require_cache(cache, "checkpoint_save")
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(cache)):
        raise ValueError("checkpoint_save runs on the host: call it outside jax.jit")
    path = _check_path(path)
    ocp = _orbax()
    meta = {"format": FORMAT, "version": VERSION, "config": config_record(cache.config)}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        ckptr.save(
            path,
            ocp.args.Composite(state=ocp.args.StandardSave(_tree(cache)), meta=ocp.args.JsonSave(meta)),
            force=bool(force),
        )


def _check_cells(cells: dict, config: CacheConfig) -> None:
    """The invariants ``state_read`` enforces, on a checkpoint's cells (host arrays); StateError otherwise."""
    pos, seq, delta, head = cells["pos"], cells["seq"], cells["delta"], int(cells["head"])
    if not 0 <= head < config.size:
        raise StateError(f"cells.head: expected a cell in [0, {config.size}), found {head}")
    members = seqbits.unpack(seq, seqbits.BITS * seq.shape[1])
    if members[:, config.n_seq_max :].any():
        cell = int(np.nonzero(members[:, config.n_seq_max :].any(axis=1))[0][0])
        raise StateError(
            f"cells.seq: expected sequence ids in [0, {config.n_seq_max}), found a higher one in cell {cell}"
        )
    used = members.any(axis=1)
    for name, bad, allowed in (
        ("pos", used & ((pos < 0) | (pos >= INT32_MAX)), f"[0, {INT32_MAX}) in a used cell"),
        ("pos", ~used & (pos != -1), "-1 in an empty cell (a position without a sequence)"),
        ("delta", ~used & (delta != 0), "0 in an empty cell"),
    ):
        if bad.any():
            cell = int(np.nonzero(bad)[0][0])
            value = (pos if name == "pos" else delta)[cell]
            raise StateError(f"cells.{name}: expected {allowed}, found {int(value)} in cell {cell}")


def checkpoint_restore(path, config_or_cache: Union[CacheConfig, KVCache]) -> KVCache:
    """Restore a checkpoint written by :func:`checkpoint_save` into a cache of the same config.

    Args:
        path: the checkpoint directory.
        config_or_cache: the expected config (or a cache with it).

    Returns:
        The cache, every leaf as it was saved.

    Raises:
        StateError: the checkpoint is not a kvjax cache of this format, its config differs (the
            message names each differing field), its arrays cannot be read (a damaged or
            incomplete checkpoint), or its cells break the invariants ``state_read``
            enforces (a head outside the cells, sequence ids beyond ``n_seq_max``, a position
            without a sequence).
        ImportError: orbax-checkpoint is not installed.
        FileNotFoundError: nothing at ``path``.
    """
    config = config_or_cache.config if isinstance(config_or_cache, KVCache) else config_or_cache
    if not isinstance(config, CacheConfig):
        raise ValueError(
            f"config_or_cache must be a kvjax.CacheConfig or KVCache, got {type(config_or_cache).__name__}"
        )
    path = _check_path(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path}")
    ocp = _orbax()
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as ckptr:
        try:
            meta = ckptr.restore(path, ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except (KeyError, ValueError, FileNotFoundError) as exc:
            raise StateError(f"meta: expected a kvjax cache checkpoint at {path}, found none ({exc})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise StateError(f"format: expected {FORMAT!r}, found {found!r}")
        if meta.get("version") != VERSION:
            raise StateError(f"version: expected {VERSION}, found {meta.get('version')!r}")
        want, have = config_record(config), meta.get("config", {})
        # a field newer than the checkpoint (e.g. mla) was its default when the checkpoint was written
        have = {**_field_defaults(), **have}
        diff = [f"{k}: checkpoint {have.get(k)!r}, target {want[k]!r}" for k in want if have.get(k) != want[k]]
        if diff:
            raise StateError("config: expected the checkpoint's config, found differences: " + "; ".join(diff))
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), _tree(abstract(config)))
        try:
            state = ckptr.restore(path, ocp.args.Composite(state=ocp.args.StandardRestore(target))).state
        except Exception as exc:  # noqa: BLE001 - orbax / tensorstore raise a bare Exception for unreadable arrays
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StateError(
                f"state: the arrays of the checkpoint at {path} cannot be read ({first[:200]}): it is "
                f"damaged or incomplete; restore another checkpoint or write it again"
            ) from exc
    groups = range(len(config.groups))
    _check_cells({name: np.asarray(state["cells"][name]) for name in _CELL_FIELDS}, config)
    cells = Cells(**{name: state["cells"][name] for name in _CELL_FIELDS}, n_seq_max=config.n_seq_max)
    return KVCache(
        cells=cells,
        k=tuple(state["k"][str(g)] for g in groups),
        v=tuple(state["v"][str(g)] for g in groups) if "v" in state else _empty_v(config),
        config=config,
    )


__all__ = ["checkpoint_save", "checkpoint_restore", "config_record"]
