"""The composite memory: a memory made of memories, routing each verb and query to them by a table.

The iSWA pair (:class:`kvjax.IswaCache`: a full-size cache and a window cache) and the hybrid
(:class:`kvjax.HybridCache`: an attention memory and recurrent states) are both a fixed tuple of
**members**, each a memory of its own. A subclass names its members (``MEMBERS``, the dataclass
fields in order), the member that answers for the whole (``MAIN``) and the members whose positions
count (``POSITIONS``); everything else is routed here, once:

- **every member**: ``clear``, ``seq_cp``, ``seq_keep``, ``seq_div``, ``clear_errors``, ``update``
  and ``commit`` apply to each member in turn;
- **all or nothing**: ``seq_rm``, ``seq_add`` and ``find_slot`` run on every member and keep the
  results only when every member accepts (``seq_rm``'s ``ok``, ``shift_keeps_states``,
  ``find_slot``'s ``ok``);
- **the main member**: ``size``, ``max_context``, ``used_cells``, ``n_tokens``, ``pos_max`` and
  ``flag_errors``;
- **what every member holds**: ``seq_pos_min`` is the largest of the ``POSITIONS`` members'
  minima, ``seq_pos_max`` the smallest of their maxima;
- **any / sum / least**: ``seq_shared``, ``pending`` and ``error_bits`` or the members';
  ``nbytes`` sums them; ``rollback_depth`` is the least (None: unbounded), ``can_shift`` needs
  every member;
- **attention parts**: the members' parts, in member order (``part(i)``, ``with_part``,
  ``part_slots``, ``extent``); a placement is the tuple of the members' placements;
- **state**: the members' blobs one after the other (the format :mod:`kvjax.io` registers for
  this class).

**The refusal rule** (one for every composite). When an all-or-nothing operation is refused, the
memory returned equals the one passed in except its sticky error bits, which are the members' new
ones: a refused operation says why (a bad traced id, a state that would go below position 0), as
every memory's own refusals do. Buffers are never selected: the operations that can refuse write
none.

Example:
    >>> import kvjax
    >>> attn = kvjax.CacheConfig(size=64, n_seq_max=2, n_layer=2, n_kv_heads=1, head_dim=4, layer_filter=(1,))
    >>> rec = kvjax.RecurrentConfig(size=2, n_seq_max=2, n_layer=1, k_shape=(4, 3), v_shape=(4, 2), n_states=1)
    >>> memory = kvjax.init(kvjax.HybridConfig(attn, rec, recurrent_layers=(0,)))
    >>> type(memory).MEMBERS, memory.n_parts
    (('attention', 'recurrent'), 1)
"""

from __future__ import annotations

from typing import ClassVar, Sequence, Tuple

import jax
import jax.numpy as jnp

from kvjax.memory._protocol import Memory, on_metadata

__all__ = ["Composite"]


class Composite(Memory):
    """A memory whose state is a fixed tuple of member memories (see the module docstring).

    Subclasses are ``flax.struct`` dataclasses whose member fields are listed in ``MEMBERS``; they
    implement ``n_seq_max`` and ``layer_part`` (which member serves a layer is their own routing)
    and may override any rule that differs (the iSWA pair prunes its window cache on ``commit``).
    """

    #: the dataclass fields holding the members, in order (placement, split, state order)
    MEMBERS: ClassVar[Tuple[str, ...]]
    #: the member that answers for the whole: size, used cells, tokens, largest position
    MAIN: ClassVar[str]
    #: the members whose positions count in seq_pos_min / seq_pos_max (what all of them hold)
    POSITIONS: ClassVar[Tuple[str, ...]]

    # -- members ---------------------------------------------------------------------------------

    @property
    def members(self) -> Tuple[Memory, ...]:
        """The member memories, in ``MEMBERS`` order."""
        return tuple(getattr(self, name) for name in self.MEMBERS)

    def with_members(self, members: Sequence[Memory]) -> "Composite":
        """This memory with its members replaced (same order)."""
        return self.replace(**dict(zip(self.MEMBERS, members)))

    def _each(self, verb: str, *args, **kwargs) -> "Composite":
        return self.with_members([getattr(m, verb)(*args, **kwargs) for m in self.members])

    @property
    def _main(self) -> Memory:
        return getattr(self, self.MAIN)

    def _keep_if(self, ok, new: "Composite") -> "Composite":
        """``new`` where ``ok``, else this memory with ``new``'s error bits (the refusal rule).

        Only the metadata is selected (``split``'s rest); the buffers are ``new``'s, which an
        operation that can refuse never changes.
        """
        buffers, new_rest = new.split()
        _, old_rest = self.split()

        def pick(path, old, fresh):
            is_error_word = getattr(path[-1], "name", None) == "error"
            return fresh if is_error_word else jnp.where(ok, fresh, old)

        return jax.tree_util.tree_map_with_path(pick, old_rest, new_rest).join(buffers)

    # -- identity --------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return self._main.size

    @property
    def max_context(self):
        return self._main.max_context

    @property
    def ubatch_split(self) -> str:
        # a member that needs equal splits (a recurrent state) decides for all
        return "equal" if any(m.ubatch_split == "equal" for m in self.members) else "simple"

    @property
    def rollback_depth(self):
        depths = [m.rollback_depth for m in self.members if m.rollback_depth is not None]
        return min(depths) if depths else None

    @property
    def can_shift(self) -> bool:
        return all(m.can_shift for m in self.members)

    # -- sequences -------------------------------------------------------------------------------

    def clear(self):
        return self._each("clear")

    def seq_cp(self, seq_id_src, seq_id_dst, p0, p1):
        return self._each("seq_cp", seq_id_src, seq_id_dst, p0, p1)

    def seq_keep(self, seq_id):
        return self._each("seq_keep", seq_id)

    def seq_div(self, seq_id, p0, p1, d):
        return self._each("seq_div", seq_id, p0, p1, d)

    # all or nothing over the members: several dispatches when composed eagerly (and small programs
    # compiled on first use), one program here
    @on_metadata
    def seq_rm(self, seq_id, p0, p1):
        results = [m.seq_rm(seq_id, p0, p1) for m in self.members]
        ok = jnp.all(jnp.stack([accepted for _, accepted in results]))
        return self._keep_if(ok, self.with_members([m for m, _ in results])), ok

    @on_metadata
    def seq_add(self, seq_id, p0, p1, delta):
        # a shift one member refuses (a state would go below position 0) moves no member's cells
        ok = self.shift_keeps_states(seq_id, p0, p1, delta)
        return self._keep_if(ok, self._each("seq_add", seq_id, p0, p1, delta))

    def shift_keeps_states(self, seq_id, p0, p1, delta):
        return jnp.all(jnp.stack([m.shift_keeps_states(seq_id, p0, p1, delta) for m in self.members]))

    def seq_pos_min(self, seq_id):
        return jnp.max(jnp.stack([getattr(self, name).seq_pos_min(seq_id) for name in self.POSITIONS]))

    def seq_pos_max(self, seq_id):
        return jnp.min(jnp.stack([getattr(self, name).seq_pos_max(seq_id) for name in self.POSITIONS]))

    def seq_shared(self, seq_id, p0, p1):
        return jnp.any(jnp.stack([m.seq_shared(seq_id, p0, p1) for m in self.members]))

    # -- queries of the main member --------------------------------------------------------------

    def used_cells(self):
        return self._main.used_cells()

    def n_tokens(self):
        return self._main.n_tokens()

    def pos_max(self):
        return self._main.pos_max()

    # -- placement -------------------------------------------------------------------------------

    def find_slot(self, ubatch, *, contiguous: bool = True):
        results = [m.find_slot(ubatch, contiguous=contiguous) for m in self.members]
        ok = jnp.all(jnp.stack([placed for _, _, placed in results]))
        placement = self.mask_placement(tuple(p for _, p, _ in results), ok)  # a refused ubatch writes nowhere
        return self._keep_if(ok, self.with_members([m for m, _, _ in results])), placement, ok

    def mask_placement(self, placement, ok):
        return tuple(m.mask_placement(p, ok) for m, p in zip(self.members, placement))

    def commit(self, ubatches: Sequence):
        return self._each("commit", ubatches)

    # -- attention parts: the members', in member order -------------------------------------------

    @property
    def n_parts(self) -> int:
        return sum(m.n_parts for m in self.members)

    def _locate(self, index: int) -> Tuple[int, int]:
        """``(member, the member's part index)`` of attention part ``index`` (static)."""
        for i, m in enumerate(self.members):
            if index < m.n_parts:
                return i, index
            index -= m.n_parts
        raise ValueError(f"index is out of range: allowed [0, {self.n_parts})")

    def part(self, index: int):
        i, j = self._locate(index)
        return self.members[i].part(j)

    def with_part(self, index: int, cache):
        i, j = self._locate(index)
        members = list(self.members)
        members[i] = members[i].with_part(j, cache)
        return self.with_members(members)

    def part_slots(self, placement, index: int):
        i, j = self._locate(index)
        return self.members[i].part_slots(placement[i], j)

    def extent(self):
        return jnp.concatenate([m.extent() for m in self.members])

    def extent_after(self, n_tokens):
        return jnp.concatenate([m.extent_after(n_tokens) for m in self.members])

    def logical_axes(self):
        return self.with_members([m.logical_axes() for m in self.members])

    # -- pending work, donation, errors, sizes ---------------------------------------------------

    def pending(self):
        return jnp.any(jnp.stack([m.pending() for m in self.members]))

    def update(self, *, donate: bool = False):
        return self._each("update", donate=donate)

    def split(self):
        pairs = [m.split() for m in self.members]
        return tuple(b for b, _ in pairs), self.with_members([r for _, r in pairs])

    def join(self, buffers):
        return self.with_members([m.join(b) for m, b in zip(self.members, buffers)])

    def error_bits(self):
        bits = jnp.uint32(0)
        for m in self.members:
            bits = bits | m.error_bits()
        return bits

    def clear_errors(self):
        return self._each("clear_errors")

    def flag_errors(self, bits):
        # error_bits() ors every member, so the main member carries what the whole reports
        return self.replace(**{self.MAIN: self._main.flag_errors(bits)})

    def nbytes(self) -> int:
        return sum(m.nbytes() for m in self.members)
