"""The memory protocol: what every kvjax memory is and does (llama.cpp's ``llama_memory_i``).

A memory is an immutable pytree with a static config. Concrete memories are final
``flax.struct`` dataclasses that subclass :class:`Memory` and implement its abstract methods; the
docstrings below are the specification every memory meets, and ``tests/test_memory_contract.py``
runs the same contract on every row of its table of memories.

Methods trust their arguments: the public free functions (``kvjax.seq_rm(memory, ...)``, ...)
validate concrete arguments on the host once, then call the method. Inside ``jit`` arguments are
traced; a method then guards them on device (an invalid value makes the op a no-op and sets an
error bit, see :func:`kvjax.errors`).

Attention memories are made of **attention parts**: unified caches (:class:`kvjax.KVCache`), each
serving some of the model's layers. The unified cache is one part (itself); the iSWA pair has
two. A layer reaches the part it reads and writes through the memory, by its layer id
(:meth:`Memory.layer_part`, static configuration, never a traced branch), and the per-part
capabilities (``write``, ``view``, ``kq_mask``, ``attention``, ``k_shift``) act on that part.

The optional capabilities that do not apply to a memory (defrag and compaction, K-shift, K/V
rows, masks) raise :class:`NotDefinedError` naming the operation and the memory.

Shape letters: see :mod:`kvjax._typing`; P is the number of attention parts.
"""

from __future__ import annotations

import abc
import functools
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from kvjax._typing import Array, Bool, Int
from kvjax.attn._windows import window_bucket
from kvjax._mesh import reshard_like, spans_devices

#: A memory-specific pytree saying where a ubatch went (unified cache: the ``i32[T]`` slots).
Placement = Any


class NotDefinedError(ValueError):
    """An optional capability (defrag, K-shift, K/V rows, masks, ...) that a memory does not have."""


NotDefinedError.__module__ = "kvjax"


def not_defined(memory, operation: str, why: str = "") -> NotDefinedError:
    """The error for an optional capability that ``memory`` does not have."""
    name = type(memory).__name__
    return NotDefinedError(f"{operation} is not defined for {name}{': ' + why if why else ''}")


class Memory(abc.ABC):
    """The protocol (abstract; concrete memories are final ``flax.struct`` pytrees).

    Sequence arguments follow the seed: ranges are ``[p0, p1)`` with ``p0 < 0`` meaning 0 and
    ``p1 < 0`` meaning +infinity; ``seq_id = -1`` means every sequence where that has a meaning.
    Scalars are ``int32`` (Python/numpy ints or traced values).
    """

    # -- identity --------------------------------------------------------------------------

    @property
    @abc.abstractmethod
    def n_seq_max(self) -> int:
        """S, the number of sequence ids (static)."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Cells of the memory's main part (what bounds a sequence's context; static)."""

    # -- sequences --------------------------------------------------------------------------

    @abc.abstractmethod
    def clear(self) -> "Memory":
        """Every cell empty, nothing pending (the K/V or state bytes need not be zeroed)."""

    @abc.abstractmethod
    def seq_rm(self, seq_id, p0, p1) -> Tuple["Memory", Bool[Array, ""]]:
        """Remove ``seq_id`` (-1: all) from positions ``[p0, p1)``.

        Returns:
            ``(memory, ok)``. A memory may refuse (the recurrent memory refuses to cut a state in
            the middle): then ``ok`` is false and the memory returned equals the one passed in.
        """

    @abc.abstractmethod
    def seq_cp(self, seq_id_src, seq_id_dst, p0, p1) -> "Memory":
        """Make ``seq_id_dst`` share what ``seq_id_src`` holds at positions ``[p0, p1)``."""

    @abc.abstractmethod
    def seq_keep(self, seq_id) -> "Memory":
        """Remove every sequence but ``seq_id`` (-1 keeps all)."""

    @abc.abstractmethod
    def seq_add(self, seq_id, p0, p1, delta) -> "Memory":
        """Shift the positions of ``seq_id`` in ``[p0, p1)`` by ``delta`` (pending for K until update)."""

    def shift_keeps_states(self, seq_id, p0, p1, delta) -> Bool[Array, ""]:
        """Whether :meth:`seq_add` with these arguments keeps every sequence's state (``bool[]``).

        True unless a memory refuses some shifts: a recurrent state refuses to go below position
        0. A composite shifts none of its members when one of them refuses.
        """
        del seq_id, p0, p1, delta
        return jnp.bool_(True)

    @abc.abstractmethod
    def seq_div(self, seq_id, p0, p1, d) -> "Memory":
        """Integer-divide the positions of ``seq_id`` in ``[p0, p1)`` by ``d >= 1``."""

    @abc.abstractmethod
    def seq_pos_min(self, seq_id) -> Int[Array, ""]:
        """Smallest position ``seq_id`` (-1: any) holds, -1 when absent."""

    @abc.abstractmethod
    def seq_pos_max(self, seq_id) -> Int[Array, ""]:
        """Largest position ``seq_id`` (-1: any) holds, -1 when absent."""

    @abc.abstractmethod
    def seq_shared(self, seq_id, p0, p1) -> Bool[Array, ""]:
        """Whether some cell of ``seq_id`` in ``[p0, p1)`` is shared with another sequence.

        ``seq_add`` moves a shared cell for every sequence in it, so the decode driver asks this
        before a context shift.
        """

    # -- queries ------------------------------------------------------------------------------

    @abc.abstractmethod
    def used_cells(self) -> Int[Array, ""]:
        """Non-empty cells (of the main part)."""

    @abc.abstractmethod
    def n_tokens(self) -> Int[Array, ""]:
        """Sum of the sequence-set sizes over the cells (of the main part)."""

    @abc.abstractmethod
    def pos_max(self) -> Int[Array, ""]:
        """Largest position held (of the main part), -1 when empty."""

    @property
    def streamed(self) -> bool:
        """Whether the attention part keeps one cache per stream (static; :class:`kvjax.StreamCache`).

        Then ``part(i)`` is a unified cache with a leading stream axis on every leaf, and layers
        attend through :func:`kvjax.stream_attend` (each ubatch slot over its own stream's cells).
        """
        return False

    # -- placement ------------------------------------------------------------------------------

    @property
    def ubatch_split(self) -> str:
        """How a batch is cut into ubatches for this memory (static): ``"simple"`` (consecutive
        tokens, :func:`kvjax.split_simple` and :func:`kvjax.make_ubatch`) or ``"equal"`` (the same
        number of tokens of each sequence, :func:`kvjax.split_equal` and
        :func:`kvjax.make_equal_ubatch`: what a recurrent state needs)."""
        return "simple"

    @property
    def max_context(self):
        """Most positions one sequence can hold at once (static): the main part's size, or None
        when positions are unbounded (a recurrent state folds any number of tokens into one cell)."""
        return self.size

    def context_per_sequence(self, n_seq: int):
        """Positions each of sequences ``0..n_seq-1`` can hold when all of them run at once (host
        side; None when unbounded): the main part's cells shared evenly, ``max_context // n_seq``.
        Per-sequence streams give each stream's cells to the sequences of that stream only."""
        return None if self.max_context is None else self.max_context // max(1, int(n_seq))

    @abc.abstractmethod
    def find_slot(self, ubatch, *, contiguous: bool = True) -> Tuple["Memory", Placement, Bool[Array, ""]]:
        """Place a ubatch.

        Returns:
            ``(memory, placement, ok)``; when ``ok`` is false the memory returned equals the one
            passed in (a failed placement is a no-op).
        """

    def mask_placement(self, placement: Placement, ok) -> Placement:
        """``placement`` where ``ok``, else a placement that writes nothing (every slot -1).

        A step whose ubatch cannot be computed (a token outside the vocabulary, a window too small)
        runs with it, so that a failed step changes no buffer a live sequence reads.
        """
        return jax.tree.map(lambda slots: jnp.where(ok, slots, -1), placement)

    def prepare(self, ubatches: Sequence, *, contiguous: bool = True) -> Tuple[Bool[Array, ""], Tuple[Placement, ...]]:
        """The dry run of a batch: place every ubatch in turn on a scratch value, keep nothing.

        Returns:
            ``(ok, placements)``: whether every ubatch fits, and where each would go (placing
            them for real, in order, finds the same placements).
        """
        memory, ok, placements = self, jnp.bool_(True), []
        for ubatch in ubatches:
            memory, placement, placed = memory.find_slot(ubatch, contiguous=contiguous)
            ok = ok & placed
            placements.append(placement)
        return ok, tuple(placements)

    def commit(self, ubatches: Sequence) -> "Memory":
        """What follows a successful batch (the seed's ``commit``); nothing for most memories.

        The iSWA memory prunes its window cache here: cells no later token can attend to.
        """
        del ubatches
        return self

    # -- attention parts and windows -------------------------------------------------------------

    @property
    @abc.abstractmethod
    def n_parts(self) -> int:
        """P, the number of attention parts (0 for a memory without attention layers)."""

    @abc.abstractmethod
    def layer_part(self, layer: int) -> int:
        """The attention part that model layer ``layer`` reads and writes (static routing)."""

    @abc.abstractmethod
    def part(self, index: int):
        """Attention part ``index`` (a :class:`kvjax.KVCache`)."""

    @abc.abstractmethod
    def with_part(self, index: int, cache) -> "Memory":
        """This memory with attention part ``index`` replaced by ``cache``."""

    @abc.abstractmethod
    def part_slots(self, placement: Placement, index: int) -> Int[Array, " T"]:
        """The cells of attention part ``index`` where a ubatch went (``i32[T]``, -1 = not written)."""

    @abc.abstractmethod
    def extent(self) -> Int[Array, " P"]:
        """Per attention part, one past its last non-empty cell (``cell_max``)."""

    @abc.abstractmethod
    def extent_after(self, n_tokens) -> Int[Array, " P"]:
        """Per attention part, a bound on the extent after ``n_tokens`` more tokens are placed.

        With ``n_tokens == 0`` it equals :meth:`extent`; it lets a caller pick a window before
        placing a ubatch without a dry run.
        """

    def windows_for(self, placements: Sequence[Placement], extent) -> List[Tuple[int, ...]]:
        """The static window of every attention part for each ubatch of a placed batch (host side).

        Cells are only added during a batch, so after ubatch ``i`` part ``p`` extends to the larger
        of ``extent[p]`` and one past the largest cell of ubatches ``0..i`` in that part; each is
        rounded up to a window bucket (``kvjax.window_bucket``) so few programs are compiled.

        Args:
            placements: host (numpy) values of ``prepare``'s placements.
            extent: host value of :meth:`extent`, read with them.
        """
        top = [int(x) for x in np.asarray(extent).reshape(-1)]
        out = []
        for placement in placements:
            row = []
            for p in range(self.n_parts):
                slots = np.asarray(self.part_slots(placement, p))
                if slots.size:
                    top[p] = max(top[p], int(slots.max()) + 1)
                cfg = self.part(p).config
                row.append(int(window_bucket(min(cfg.size, max(top[p], 1)), cfg.size, cfg.padding)))
            out.append(tuple(row))
        return out

    # -- pending work ------------------------------------------------------------------------------

    @abc.abstractmethod
    def pending(self) -> Bool[Array, ""]:
        """Whether :meth:`update` has work to do (a K-shift, a defrag, copies)."""

    @abc.abstractmethod
    def update(self, *, donate: bool = False) -> "Memory":
        """Apply the pending work (the seed's ``update``); a no-op when nothing is pending."""

    @property
    @abc.abstractmethod
    def can_shift(self) -> bool:
        """Whether positions may be shifted (the seed's ``get_can_shift``; static).

        The decode driver refuses a context shift on a memory that cannot shift.
        """

    @property
    def rollback_depth(self):
        """How many of a sequence's last positions ``seq_rm(seq, p, -1)`` can always remove (static):
        None when any (K/V per token), ``n_states - 1`` for a recurrent state (kept states)."""
        return None

    # -- reuse of a held prefix (a prompt cache) ------------------------------------------------

    def prefix_visible(self, seq_id: int, n: int) -> bool:
        """Whether ``seq_id`` still holds everything a token at position ``n`` of a sequence that
        shares its positions ``[0, n)`` would attend to (host side; concrete ids).

        A cache that dropped the start of the sequence (a context shift) cannot lend its prefix.
        """
        return int(self.seq_pos_min(np.int32(seq_id))) == 0 and int(self.seq_pos_max(np.int32(seq_id))) >= n - 1

    def share_prefix(self, src: int, dst: int, n: int) -> Tuple["Memory", int, bool]:
        """Give the empty sequence ``dst`` the first ``n`` positions of ``src`` (host side), if exact.

        Returns:
            ``(memory, n_shared, src_consumed)``: ``n_shared`` is ``n`` or 0 (nothing shared: the
            memory is returned as it was); ``src_consumed`` says ``src`` was removed to make it
            possible (a recurrent state cannot be shared and rolled back at once).
        """
        if n <= 0 or not self.prefix_visible(src, n):
            return self, 0, False
        return self.seq_cp(np.int32(src), np.int32(dst), np.int32(0), np.int32(n)), n, False

    # -- donation -------------------------------------------------------------------------------

    @abc.abstractmethod
    def split(self) -> Tuple[Any, "Memory"]:
        """``(buffers, rest)``: the large buffers a step donates, and the rest (kept, not donated).

        ``rest.join(buffers)`` gives the memory back. A step donates ``buffers`` only, so a
        reference to ``rest`` (the cell metadata) kept before the step stays a valid snapshot.
        """

    @abc.abstractmethod
    def join(self, buffers) -> "Memory":
        """The inverse of :meth:`split`, called on ``rest``."""

    # -- placement on a device mesh ---------------------------------------------------------------

    def logical_axes(self) -> "Memory":
        """What every dimension of every leaf means, for placing the memory on a device mesh.

        Returns:
            This memory's pytree (same type, same static config) with each array leaf replaced
            by a ``jax.sharding.PartitionSpec`` of logical axis names, one per dimension, from
            :data:`kvjax.shard.LOGICAL_AXES` (``"layers"``, ``"kv_heads"``, ``"cells"``,
            ``"head_dim"``, ``"seq_words"``, ``"streams"``, ...). It must depend on the config
            and the leaves' shapes only (it is called on :func:`kvjax.abstract` memories).
            :mod:`kvjax.shard`'s rules map the names onto mesh axes; a memory never names a mesh
            axis. A memory that does not implement it cannot be sharded
            (:class:`NotDefinedError`).
        """
        raise not_defined(
            self, "logical_axes", "implement Memory.logical_axes() to place it on a mesh (see docs/sharding.md)"
        )

    # -- errors and sizes ---------------------------------------------------------------------------

    @abc.abstractmethod
    def error_bits(self) -> Int[Array, ""]:
        """The sticky error bits of every part, or-ed (``u32[]``; see :class:`kvjax.ErrorFlag`)."""

    @abc.abstractmethod
    def clear_errors(self) -> "Memory":
        """This memory with every error bit cleared."""

    @abc.abstractmethod
    def flag_errors(self, bits) -> "Memory":
        """This memory with ``bits`` (``u32[]``, traced or not) or-ed into its sticky error word.

        How a computation around the memory (the model step: a slot outside the memory, a token
        outside the vocabulary) reports what it refused under ``jit`` through the same
        :func:`kvjax.errors` as the memory's own operations.
        """

    @abc.abstractmethod
    def nbytes(self) -> int:
        """Bytes of the memory's buffers (K/V or states; metadata not included)."""

    # -- state -------------------------------------------------------------------------------------

    # A memory does not know its byte layout: kvjax.io registers one format per memory type
    # (register_state_format), and these methods look it up, so no memory imports its codec.

    def state_write(self, seq_id: int = -1) -> bytes:
        """The seed's state blob of the whole memory (``seq_id = -1``) or of one sequence."""
        return state_format(self).write(self, seq_id)

    def state_read(self, data, seq_id: int = -1, **options) -> "Memory":
        """A memory restored from a :meth:`state_write` blob; this one unchanged on error."""
        return state_format(self).read(self, data, seq_id, **options)

    def blob_size(self, data, seq_id: int = -1) -> int:
        """Bytes of this memory's blob at the start of ``data`` (a composite's members follow it)."""
        size = state_format(self).size
        if size is None:
            raise not_defined(self, "blob_size", "its blob is never a member of another memory's")
        return size(self, data, seq_id)


class StateFormat(NamedTuple):
    """How one memory type is written to and read from bytes (registered by :mod:`kvjax.io`).

    Attributes:
        write: ``write(memory, seq_id) -> bytes``.
        read: ``read(memory, data, seq_id, **options) -> memory`` (the memory unchanged on error).
        size: ``size(memory, data, seq_id) -> int``, the bytes of the blob at the start of ``data``
            (None for a memory that is never a member of a composite).
    """

    write: Callable[..., bytes]
    read: Callable[..., "Memory"]
    size: Optional[Callable[..., int]]


_STATE_FORMATS: Dict[type, StateFormat] = {}


def register_state_format(kind: type, *, write, read, size) -> None:
    """Register the state format of memory type ``kind`` (and of its subclasses without their own).

    The way :mod:`kvjax.io` gives every memory its ``state_write`` / ``state_read`` without a
    memory importing ``io`` (``import kvjax`` imports ``kvjax.io``, which registers them all).
    """
    if not (isinstance(kind, type) and issubclass(kind, Memory)):
        raise ValueError(f"kind must be a kvjax.Memory subclass, got {kind!r}")
    _STATE_FORMATS[kind] = StateFormat(write, read, size)


def state_format(memory) -> StateFormat:
    """The state format registered for ``memory``'s type (the nearest base class's otherwise)."""
    for kind in type(memory).__mro__:
        if kind in _STATE_FORMATS:
            return _STATE_FORMATS[kind]
    raise not_defined(
        memory,
        "state_write / state_read",
        "no state format is registered for it (import kvjax "
        "registers kvjax's; a memory of your own registers one with "
        "kvjax.memory._protocol.register_state_format)",
    )


def on_metadata(fn=None, *, static_argnames=()):
    """A memory method ``fn(memory, *args)`` run as one compiled program over the memory's metadata.

    For memories whose methods compose other memories' operations (the stream stack, the iSWA pair,
    the hybrid): called eagerly, each ``vmap``, ``jnp`` call or part's operation would be a dispatch
    of its own, and on first use a compile of its own. The program sees the memory without its
    buffers (:meth:`Memory.split`): the method must not read or write them (K/V, states), because a
    jitted function hands back every array it returns as a fresh copy and the buffers would be
    copied on every call. Under an outer ``jit`` the program is inlined.

    Example:
        >>> import kvjax
        >>> cfg = kvjax.StreamsConfig(kvjax.CacheConfig(size=32, n_seq_max=2, n_layer=1, n_kv_heads=1,
        ...                                                 head_dim=4))
        >>> memory = kvjax.init(cfg)
        >>> kvjax.seq_rm(memory, 0)[0].cache.k[0] is memory.cache.k[0]   # K/V handed back untouched
        True
    """
    if fn is None:
        return functools.partial(on_metadata, static_argnames=static_argnames)
    compiled = jax.jit(fn, static_argnames=static_argnames)

    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        buffers, rest = self.split()
        out = compiled(rest, *args, **kwargs)
        kind = type(self)
        placed = spans_devices(rest)

        def back(x):
            # outputs that do not depend on the inputs (a clear's fresh cells) come back with the
            # program's default placement: on a mesh they go back where the memory's leaves were
            return (reshard_like(x, rest) if placed else x).join(buffers)

        return jax.tree.map(lambda x: back(x) if isinstance(x, kind) else x, out, is_leaf=lambda x: isinstance(x, kind))

    return method


def require_live(value, name: str = "memory") -> None:
    """Raise ``ValueError`` when a buffer of ``value`` was donated to an earlier call (it is deleted).

    JAX itself would fail later with "Array has been deleted"; this says what happened and what to
    use instead.
    """
    for leaf in jax.tree.leaves(value):
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
            raise ValueError(
                f"{name} was donated: its buffers were given to an earlier call that updates them in "
                f"place (a jitted step, kvjax.update / defrag / k_shift / state_read with donate=True, "
                f"an Engine that owns it); use the memory that call returned instead"
            )
