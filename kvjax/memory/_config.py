"""Static configuration of a cache: sizes, layer shapes, dtypes, sliding window, RoPE.

A :class:`CacheConfig` is frozen and hashable. It rides along in the cache pytree as static
metadata, so changing it means a new compilation while changing anything in the cells or the K/V
buffers does not. Every rule is checked on construction and a violation raises a ``ValueError``
that names the field and the allowed range.

Example:
    >>> import kvjax
    >>> cfg = kvjax.CacheConfig(size=256, n_seq_max=4, n_layer=2, n_kv_heads=2, head_dim=16)
    >>> cfg.padding, cfg.k_dtype, cfg.n_words
    (32, 'float32', 1)
    >>> cfg.cached_layers
    (0, 1)
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Callable, Optional, Sequence, Tuple, Union

import numpy as np

from kvjax._validate import POS_END, check_flag, check_real, is_int, require
from kvjax.memory import _seqbits as seqbits
from kvjax.storage._quant import BLOCK, QUANT_TYPES

#: Largest ``n_seq_max`` accepted (32 words of sequence bitmask per cell).
MAX_SEQ = 1024

#: Largest ``n_layer`` accepted (real models have at most a few hundred).
MAX_LAYERS = 4096

#: Largest kv-head count or head size accepted per layer.
MAX_WIDTH = 65536

#: Float storage dtypes understood by kvjax, by name.
FLOAT_DTYPES = ("float32", "float16", "bfloat16")

#: Block-quantized storage types (ggml's layouts, see :mod:`kvjax.memory._quant`); K/V rows are
#: stored per cell as ``head_dim // 32`` blocks of bytes, so the head size must be a multiple of 32.
QUANT_DTYPES = tuple(QUANT_TYPES)

#: ggml type ids of the dtypes (used by the state format).
GGML_TYPE_IDS = {"float32": 0, "float16": 1, "bfloat16": 30, **{name: qt.ggml_id for name, qt in QUANT_TYPES.items()}}


class SwaType(str, enum.Enum):
    """Kind of sliding-window attention applied by the mask (the seed's ``llama_swa_type``).

    ``p0`` is the cell's position, ``p1`` the token's:

    - ``NONE``: no window.
    - ``STANDARD``: masked when ``p1 - p0 >= n_swa``.
    - ``CHUNKED``: masked when ``p0 < (p1 // n_swa) * n_swa`` (attend within the chunk).
    - ``SYMMETRIC``: masked when ``|p1 - p0| > n_swa // 2`` (newer llama.cpp).
    """

    NONE = "none"
    STANDARD = "standard"
    CHUNKED = "chunked"
    SYMMETRIC = "symmetric"


class RopeMode(str, enum.Enum):
    """RoPE pairing: ``NORMAL`` rotates adjacent pairs (x0, x1), ``NEOX`` the two halves."""

    NORMAL = "normal"
    NEOX = "neox"


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Parameters of ggml's ``rope_ext`` (used for RoPE and for the K-shift).

    Attributes:
        n_rot: number of leading dims rotated (even, at most the head size).
        mode: ``"normal"`` (adjacent pairs) or ``"neox"`` (halves).
        freq_base: base of the frequencies, theta_i = pos * freq_base^(-2i/n_rot).
        freq_scale: linear position scale (1 / context-extension factor).
        ext_factor: YaRN extrapolation mix (0 disables YaRN).
        attn_factor: YaRN magnitude scale.
        beta_fast: YaRN ramp start (in rotations).
        beta_slow: YaRN ramp end (in rotations).
        n_ctx_orig: original training context for YaRN.
        freq_factors: optional per-pair frequency divisors (``n_rot // 2`` values > 0).
        yarn_truncate: round YaRN's correction range out to whole pairs (ggml always does, and
            transformers by default); False keeps its fractional ends, as gpt-oss's transformers
            config asks (``truncate: false``).

    The math is in :mod:`kvjax.rope`. YaRN (``ext_factor != 0``) needs ``n_ctx_orig``,
    ``beta_fast`` and ``beta_slow`` > 0. The K-shift uses the same frequencies as a pure rotation
    (no ``attn_factor`` / YaRN magnitude), so shifted K equals K computed at the new position.
    Instances are hashable (they are static configuration inside ``jit``).

    Example:
        >>> RopeConfig(n_rot=16).mode
        <RopeMode.NORMAL: 'normal'>
    """

    n_rot: int
    mode: Union[RopeMode, str] = RopeMode.NORMAL
    freq_base: float = 10000.0
    freq_scale: float = 1.0
    ext_factor: float = 0.0
    attn_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    n_ctx_orig: int = 0
    freq_factors: Optional[Tuple[float, ...]] = None
    yarn_truncate: bool = True

    def __post_init__(self):
        require(
            is_int(self.n_rot) and self.n_rot > 0 and self.n_rot % 2 == 0,
            "n_rot",
            self.n_rot,
            "a positive even integer (rotated dims come in pairs)",
        )
        object.__setattr__(self, "n_rot", int(self.n_rot))
        try:
            mode = RopeMode(self.mode)
        except ValueError:
            raise ValueError(f"mode={self.mode!r} is not a RoPE mode: allowed 'normal' or 'neox'") from None
        object.__setattr__(self, "mode", mode)
        for name in ("freq_base", "freq_scale", "attn_factor"):
            object.__setattr__(self, name, check_real(name, getattr(self, name), above=0))
        for name in ("ext_factor", "beta_fast", "beta_slow"):
            object.__setattr__(self, name, check_real(name, getattr(self, name)))
        require(isinstance(self.yarn_truncate, (bool, np.bool_)), "yarn_truncate", self.yarn_truncate, "True or False")
        object.__setattr__(self, "yarn_truncate", bool(self.yarn_truncate))
        require(is_int(self.n_ctx_orig) and self.n_ctx_orig >= 0, "n_ctx_orig", self.n_ctx_orig, "an integer >= 0")
        if self.ext_factor != 0:
            # YaRN's correction dims take log(n_ctx_orig / (2 pi beta)): all three must be positive
            require(self.n_ctx_orig > 0, "n_ctx_orig", self.n_ctx_orig, "> 0 when ext_factor != 0 (YaRN)")
            require(self.beta_fast > 0, "beta_fast", self.beta_fast, "> 0 when ext_factor != 0 (YaRN)")
            require(self.beta_slow > 0, "beta_slow", self.beta_slow, "> 0 when ext_factor != 0 (YaRN)")
        if self.freq_factors is not None:
            given = self.freq_factors
            if isinstance(given, (str, bytes)) or not isinstance(given, (tuple, list, np.ndarray)):
                require(False, "freq_factors", given, f"None or a sequence of n_rot // 2 = {self.n_rot // 2} numbers")
            try:
                ff = tuple(check_real("freq_factors", f) for f in np.asarray(given, dtype=object).reshape(-1))
            except ValueError:
                require(
                    False, "freq_factors", given, "finite numbers > 0 (each pair's frequency is divided by its factor)"
                )
            require(
                len(ff) == self.n_rot // 2,
                "freq_factors",
                f"{len(ff)} values",
                f"exactly n_rot // 2 = {self.n_rot // 2} values",
            )
            require(
                all(math.isfinite(f) and f > 0 for f in ff),
                "freq_factors",
                ff,
                "finite values > 0 (each pair's frequency is divided by its factor)",
            )
            object.__setattr__(self, "freq_factors", ff)


LayerFilter = Union[None, Sequence[int], Callable[[int], bool]]


@dataclasses.dataclass(frozen=True)
class LayerGroup:
    """Cached layers that share K/V shapes and are stored stacked in one array pair.

    Attributes:
        layers: model layer ids in this group, in order (the stacked axis L).
        n_kv_heads: H.
        head_dim: D (K head size).
        head_dim_v: Dv (V head size).
    """

    layers: Tuple[int, ...]
    n_kv_heads: int
    head_dim: int
    head_dim_v: int


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    """Static description of a unified KV cache.

    Attributes:
        size: number of cells C; a positive multiple of ``padding``.
        n_seq_max: number of sequence ids, 1 to ``MAX_SEQ`` (1024).
        n_layer: number of model layers.
        n_kv_heads: kv heads per layer, an int for all layers or one value per layer.
        head_dim: K head size, an int or one value per layer.
        head_dim_v: V head size (defaults to ``head_dim``), an int or one value per layer.
        k_dtype: K storage dtype name (``"float32"``, ``"float16"``, ``"bfloat16"``, or a ggml
            block type ``"q8_0"``, ``"q4_0"``, ``"q4_1"``, ``"q5_0"``, ``"q5_1"``, which needs
            every ``head_dim`` to be a multiple of 32).
        v_dtype: V storage dtype name (the same choices; a block type needs ``head_dim_v`` a
            multiple of 32).
        padding: granularity of the attention window ``n_kv`` (the seed's padding, 32 or 256).
        layer_filter: which layers are cached: ``None`` (all), a sequence of layer ids, or a
            predicate on the layer id (evaluated once, on construction).
        v_trans: whether the seed's state format stores V transposed (affects ``state_write``
            only; kvjax's own storage layout is fixed, see ``_typing``).
        swa_type: sliding-window kind for masks (:class:`SwaType`).
        n_swa: sliding-window size (required > 0 when ``swa_type`` is not ``"none"``).
        rope: RoPE parameters the K-shift needs: one :class:`RopeConfig` for every layer, a tuple
            with one per model layer, or ``None`` (then the cache cannot shift).
        mla: a latent cache for multi-head latent attention (DeepSeek's MLA, llama.cpp's
            ``is_mla``): each cell's K row is ``[latent (head_dim_v) | RoPE key (n_rot)]`` and
            there is no V storage: V is a view of K's first ``head_dim_v`` columns, and the
            K-shift rotates K's last ``n_rot`` columns only. Needs ``head_dim_v < head_dim``,
            ``n_rot <= head_dim - head_dim_v`` (the latent never rotates) and ``v_dtype`` left at
            its default or equal to ``k_dtype`` (V is read from K's storage). See
            ``docs/architecture.md`` (the latent layout).

    Derived (read-only) attributes: ``cached_layers``, ``groups``, ``n_words``.
    """

    size: int
    n_seq_max: int
    n_layer: int
    n_kv_heads: Union[int, Tuple[int, ...]]
    head_dim: Union[int, Tuple[int, ...]]
    head_dim_v: Union[None, int, Tuple[int, ...]] = None
    k_dtype: str = "float32"
    v_dtype: str = "float32"
    padding: int = 32
    layer_filter: LayerFilter = None
    v_trans: bool = False
    swa_type: Union[SwaType, str] = SwaType.NONE
    n_swa: int = 0
    rope: Union[None, RopeConfig, Tuple[RopeConfig, ...]] = None
    mla: bool = False

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        require(is_int(self.padding) and self.padding > 0, "padding", self.padding, "a positive integer")
        require(
            is_int(self.size) and self.size > 0 and self.size % self.padding == 0,
            "size",
            self.size,
            f"a positive multiple of padding={self.padding}",
        )
        require(self.size <= 2**30, "size", self.size, "at most 2**30 cells")
        require(
            is_int(self.n_seq_max) and 1 <= self.n_seq_max <= MAX_SEQ, "n_seq_max", self.n_seq_max, f"[1, {MAX_SEQ}]"
        )
        # bounds that keep a typo (n_layer=10**9) from hanging the process instead of being refused
        require(
            is_int(self.n_layer) and 1 <= self.n_layer <= MAX_LAYERS,
            "n_layer",
            self.n_layer,
            f"an integer in [1, {MAX_LAYERS}]",
        )
        set_("n_kv_heads", self._per_layer("n_kv_heads", self.n_kv_heads))
        set_("head_dim", self._per_layer("head_dim", self.head_dim))
        hv = self.head_dim if self.head_dim_v is None else self.head_dim_v
        set_("head_dim_v", self._per_layer("head_dim_v", hv))
        for name in ("k_dtype", "v_dtype"):
            set_(name, _dtype_name(name, getattr(self, name)))
        set_("layer_filter", self._normalize_filter(self.layer_filter))
        check_flag("mla", self.mla)
        set_("mla", bool(self.mla))
        if self.mla:
            self._check_latent()
        for name, dims in (("k_dtype", "head_dim"), ("v_dtype", "head_dim_v")):
            if getattr(self, name) in QUANT_TYPES:
                for il in self.cached_layers:
                    d = getattr(self, dims)[il]
                    require(
                        d % BLOCK == 0,
                        dims,
                        d,
                        f"a multiple of {BLOCK} (the block size of "
                        f"{name}={getattr(self, name)!r}; layer {il}), or a float {name}",
                    )
        try:
            set_("swa_type", SwaType(self.swa_type))
        except ValueError:
            raise ValueError(
                f"swa_type={self.swa_type!r} is not a sliding-window kind: allowed {[s.value for s in SwaType]}"
            ) from None
        require(is_int(self.n_swa) and 0 <= self.n_swa < POS_END, "n_swa", self.n_swa, f"an integer in [0, {POS_END})")
        if self.swa_type != SwaType.NONE:
            require(self.n_swa > 0, "n_swa", self.n_swa, f"> 0 when swa_type={self.swa_type.value!r}")
        check_flag("v_trans", self.v_trans)
        set_("v_trans", bool(self.v_trans))
        if self.v_trans and self.v_dtype in QUANT_TYPES and not self.mla:  # a latent cache has no V rows
            # a transposed V has one value per element of a row across cells: it has no blocks (the
            # seed needs flash attention, hence v_trans = false, for a quantized V cache)
            raise ValueError(
                f"v_trans=True is out of range with v_dtype={self.v_dtype!r}: allowed "
                f"v_trans=False for a block-quantized V (blocks run along the head, not the cells)"
            )
        set_("rope", self._normalize_rope(self.rope))
        if self.mla and self.rope is not None:
            widths = sorted({self.rope[il].n_rot for il in self.cached_layers})
            require(
                len(widths) <= 1,
                "rope.n_rot",
                widths,
                "one n_rot for every cached layer with mla=True (the RoPE key is K's last n_rot columns)",
            )
            for il in self.cached_layers:
                nope = self.head_dim[il] - self.head_dim_v[il]
                require(
                    self.rope[il].n_rot <= nope,
                    "rope.n_rot",
                    self.rope[il].n_rot,
                    f"<= head_dim - head_dim_v = {nope} of layer {il} with mla=True (the RoPE key follows "
                    "the latent; rotating the latent would rotate V)",
                )
                if self.k_dtype in QUANT_TYPES:
                    start = self.head_dim[il] - self.rope[il].n_rot
                    require(
                        start % BLOCK == 0,
                        "rope.n_rot",
                        self.rope[il].n_rot,
                        f"a value leaving head_dim - n_rot a multiple of {BLOCK} with k_dtype={self.k_dtype!r} "
                        f"(the K-shift rotates whole blocks; layer {il})",
                    )

    def _check_latent(self):
        """The rules of a latent (MLA) cache: V is K's first ``head_dim_v`` columns."""
        if self.v_dtype != self.k_dtype:
            require(
                self.v_dtype == "float32",
                "v_dtype",
                self.v_dtype,
                f"k_dtype={self.k_dtype!r} or the default with mla=True (V is read from K's storage)",
            )
            object.__setattr__(self, "v_dtype", self.k_dtype)
        for il in self.cached_layers:
            require(
                self.head_dim_v[il] < self.head_dim[il],
                "head_dim_v",
                self.head_dim_v[il],
                f"< head_dim={self.head_dim[il]} of layer {il} with mla=True (V is K's first head_dim_v "
                "columns, the RoPE key the rest)",
            )

    # -- normalization helpers -------------------------------------------------------------

    def _per_layer(self, name, value):
        if is_int(value):
            value = (int(value),) * self.n_layer
        if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list, np.ndarray)):
            require(False, name, value, f"an integer in [1, {MAX_WIDTH}], or one per layer (n_layer={self.n_layer})")
        value = tuple(value)
        require(
            len(value) == self.n_layer, name, f"{len(value)} values", f"one value per layer (n_layer={self.n_layer})"
        )
        for v in value:
            require(is_int(v) and 1 <= v <= MAX_WIDTH, name, v, f"integers in [1, {MAX_WIDTH}]")
        return tuple(int(v) for v in value)

    def _normalize_filter(self, flt):
        if flt is None:
            return tuple(range(self.n_layer))
        if callable(flt):
            return tuple(il for il in range(self.n_layer) if flt(il))
        flt = tuple(flt)
        for il in flt:
            require(is_int(il), "layer_filter", il, "integer layer ids")
        layers = tuple(sorted(set(int(il) for il in flt)))
        for il in layers:
            require(0 <= il < self.n_layer, "layer_filter", il, f"layer ids in [0, {self.n_layer})")
        return layers

    def _normalize_rope(self, rope):
        if rope is None:
            return None
        if isinstance(rope, RopeConfig):
            rope = (rope,) * self.n_layer
        rope = tuple(rope)
        require(
            len(rope) == self.n_layer and all(isinstance(r, RopeConfig) for r in rope),
            "rope",
            f"{len(rope)} entries",
            f"a RopeConfig or one per layer (n_layer={self.n_layer})",
        )
        for il, r in enumerate(rope):
            require(
                r.n_rot <= self.head_dim[il],
                "rope.n_rot",
                r.n_rot,
                f"an even number <= head_dim={self.head_dim[il]} of layer {il}",
            )
        return rope

    # -- derived ---------------------------------------------------------------------------

    @property
    def cached_layers(self) -> Tuple[int, ...]:
        """Model layer ids that have K/V storage, ascending."""
        return self.layer_filter  # normalized to a tuple on construction

    @property
    def n_words(self) -> int:
        """W, the number of 32-bit words in each cell's sequence bitmask."""
        return seqbits.n_words(self.n_seq_max)

    @property
    def groups(self) -> Tuple[LayerGroup, ...]:
        """Cached layers grouped by K/V shape, in order of first appearance."""
        order, members = [], {}
        for il in self.cached_layers:
            key = (self.n_kv_heads[il], self.head_dim[il], self.head_dim_v[il])
            if key not in members:
                order.append(key)
                members[key] = []
            members[key].append(il)
        return tuple(LayerGroup(tuple(members[k]), *k) for k in order)

    def locate(self, layer: int) -> Tuple[int, int]:
        """Return ``(group, index in group)`` of a cached model layer.

        Raises:
            ValueError: when ``layer`` is not a cached layer.
        """
        for g, grp in enumerate(self.groups):
            if layer in grp.layers:
                return g, grp.layers.index(layer)
        raise ValueError(f"layer={layer} is not a cached layer: allowed {list(self.cached_layers)}")

    def rope_start(self, layer: int) -> int:
        """First K column the RoPE rotates in ``layer``: 0, or ``head_dim - n_rot`` in a latent (MLA) cache.

        Example:
            >>> cfg = CacheConfig(size=32, n_seq_max=1, n_layer=1, n_kv_heads=1, head_dim=40, head_dim_v=32,
            ...                   mla=True, rope=RopeConfig(n_rot=8))
            >>> cfg.rope_start(0), cfg.v_dtype
            (32, 'float32')
        """
        if not self.mla or self.rope is None:
            return 0
        return self.head_dim[layer] - self.rope[layer].n_rot

    @property
    def can_shift(self) -> bool:
        """Whether K-shift is possible: RoPE parameters are known for the cached layers."""
        return self.rope is not None

    def replace(self, **changes) -> "CacheConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)


def _dtype_name(field, dtype) -> str:
    if isinstance(dtype, str) and dtype in GGML_TYPE_IDS:
        name = dtype
    else:
        try:
            name = np.dtype(dtype).name
        except TypeError:
            name = str(dtype)
    if name not in FLOAT_DTYPES and name not in QUANT_TYPES:
        raise ValueError(
            f"{field}={dtype!r} is not a supported storage dtype: allowed {list(FLOAT_DTYPES) + list(QUANT_TYPES)}"
        )
    return name
