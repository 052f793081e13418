"""The recurrent memory's description: state shapes per layer, cells, kept states (:class:`RecurrentConfig`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Tuple, Union

import jax.numpy as jnp
from flax import struct

from kvjax.memory._config import FLOAT_DTYPES, MAX_LAYERS, MAX_SEQ
from kvjax._validate import is_int, require


#: Largest number of floats of one state row per layer accepted (a typo must not allocate terabytes).
MAX_STATE_FLOATS = 2**26


def _shape(name: str, value) -> Tuple[int, ...]:
    if is_int(value):
        value = (int(value),)
    try:
        shape = tuple(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} is out of range: allowed a shape (a tuple of positive integers)") from None
    require(
        len(shape) >= 1 and all(is_int(d) and d >= 1 for d in shape),
        name,
        value,
        "a shape: a non-empty tuple of positive integers",
    )
    require(math.prod(shape) <= MAX_STATE_FLOATS, name, value, f"at most {MAX_STATE_FLOATS} values per row")
    return tuple(int(d) for d in shape)


def _per_layer_shapes(name: str, value, n_layer: int) -> Tuple[Tuple[int, ...], ...]:
    """One shape for every layer, or a tuple of one shape per layer."""
    if is_int(value) or (isinstance(value, (tuple, list)) and value and all(is_int(d) for d in value)):
        return (_shape(name, value),) * n_layer
    try:
        shapes = tuple(value)
    except TypeError:
        raise ValueError(f"{name}={value!r} is out of range: allowed a shape or one shape per layer") from None
    if len(shapes) != n_layer:
        raise ValueError(f"{name} has {len(shapes)} shapes: allowed one shape, or one per layer (n_layer={n_layer})")
    return tuple(_shape(f"{name}[{i}]", s) for i, s in enumerate(shapes))


class RecurrentGroup(struct.PyTreeNode):
    """Layers whose states have the same shapes: stored stacked, ``[Lg, R, *shape]``."""

    layers: Tuple[int, ...] = struct.field(pytree_node=False)
    k_shape: Tuple[int, ...] = struct.field(pytree_node=False)
    v_shape: Tuple[int, ...] = struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """The recurrent-state memory's description (frozen, hashable, validated on construction).

    Attributes:
        size: C, number of state cells (the seed uses ``max(1, n_seq_max)``: one per sequence).
        n_seq_max: S, number of sequence ids, 1 to 1024.
        n_layer: number of layers with a state.
        k_shape: shape of one cell's first state per layer (the seed's ``k_l`` row: Mamba's
            convolution window ``(d_conv - 1, d_inner)``); one shape, or one per layer.
        v_shape: shape of the second state (``v_l``: Mamba's SSM state ``(d_inner, d_state)``).
        k_dtype: storage dtype of the first state (``"float32"``, ``"float16"``, ``"bfloat16"``).
        v_dtype: storage dtype of the second state.
        n_states: k, states kept per sequence (1 is the seed): ``k - 1`` tokens can be rolled back.

    Example:
        >>> cfg = RecurrentConfig(size=2, n_seq_max=2, n_layer=3, k_shape=(3, 16), v_shape=(16, 4))
        >>> cfg.rows, [g.layers for g in cfg.groups], cfg.n_embd_k_s(0), cfg.n_embd_v_s(0)
        (2, [(0, 1, 2)], 48, 64)
    """

    size: int
    n_seq_max: int
    n_layer: int
    k_shape: Union[Tuple[int, ...], Tuple[Tuple[int, ...], ...]]
    v_shape: Union[Tuple[int, ...], Tuple[Tuple[int, ...], ...]]
    k_dtype: str = "float32"
    v_dtype: str = "float32"
    n_states: int = 1

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        require(is_int(self.size) and 1 <= self.size <= 2**20, "size", self.size, "an integer in [1, 2**20]")
        require(
            is_int(self.n_seq_max) and 1 <= self.n_seq_max <= MAX_SEQ,
            "n_seq_max",
            self.n_seq_max,
            f"an integer in [1, {MAX_SEQ}]",
        )
        require(
            is_int(self.n_layer) and 1 <= self.n_layer <= MAX_LAYERS,
            "n_layer",
            self.n_layer,
            f"an integer in [1, {MAX_LAYERS}]",
        )
        require(is_int(self.n_states) and 1 <= self.n_states <= 64, "n_states", self.n_states, "an integer in [1, 64]")
        for name in ("size", "n_seq_max", "n_layer", "n_states"):
            set_(name, int(getattr(self, name)))
        set_("k_shape", _per_layer_shapes("k_shape", self.k_shape, self.n_layer))
        set_("v_shape", _per_layer_shapes("v_shape", self.v_shape, self.n_layer))
        for name in ("k_dtype", "v_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) and _dtype_like(value):
                value = jnp.dtype(value).name
            require(
                isinstance(value, str) and value in FLOAT_DTYPES,
                name,
                getattr(self, name),
                f"one of {list(FLOAT_DTYPES)}",
            )
            set_(name, value)
        require(
            self.size * self.n_states <= 2**24,
            "n_states",
            self.n_states,
            f"at most {2**24 // self.size} with size={self.size} (2**24 rows)",
        )

    @property
    def rows(self) -> int:
        """R, state rows per layer: ``size * n_states``."""
        return self.size * self.n_states

    @property
    def groups(self) -> Tuple[RecurrentGroup, ...]:
        """Layers grouped by their two state shapes, in order of first appearance."""
        order = {}
        for il in range(self.n_layer):
            order.setdefault((self.k_shape[il], self.v_shape[il]), []).append(il)
        return tuple(RecurrentGroup(layers=tuple(ls), k_shape=ks, v_shape=vs) for (ks, vs), ls in order.items())

    def locate(self, layer: int) -> Tuple[int, int]:
        """``(group, index in group)`` of layer ``layer``."""
        require(is_int(layer) and 0 <= layer < self.n_layer, "layer", layer, f"[0, {self.n_layer})")
        for g, grp in enumerate(self.groups):
            if layer in grp.layers:
                return g, grp.layers.index(layer)
        raise AssertionError(layer)

    def n_embd_k_s(self, layer: int) -> int:
        """Values of one cell's first state in ``layer`` (the seed's ``n_embd_k_s``)."""
        return math.prod(self.k_shape[layer])

    def n_embd_v_s(self, layer: int) -> int:
        """Values of one cell's second state in ``layer`` (the seed's ``n_embd_v_s``)."""
        return math.prod(self.v_shape[layer])

    def nbytes(self) -> int:
        """Bytes of the two state buffers (metadata not included)."""
        k_item, v_item = jnp.dtype(self.k_dtype).itemsize, jnp.dtype(self.v_dtype).itemsize
        return self.rows * sum(
            self.n_embd_k_s(il) * k_item + self.n_embd_v_s(il) * v_item for il in range(self.n_layer)
        )


def _dtype_like(value) -> bool:
    try:
        jnp.dtype(value)
        return True
    except TypeError:
        return False
