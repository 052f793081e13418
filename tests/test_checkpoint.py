"""kvjax.io._checkpoint: the whole pytree through orbax, into the same config only."""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvjax
from kvjax._errors import StateError
from kvjax.io import _checkpoint
from tests.helpers import fill
from tests.test_state import MIXED, with_random_kv

CFG = kvjax.CacheConfig(**MIXED)


def sample():
    cache = with_random_kv(fill(kvjax.init(CFG), range(9), [[0], [1], [0, 2]] * 3), 21)
    cache, _ = kvjax.seq_rm(cache, 1, 2, 6)  # a hole
    cache = kvjax.seq_add(cache, 0, 3, -1, 2)  # pending shifts: kept by a checkpoint
    return jax.jit(kvjax.seq_rm)(cache, 9, 0, -1)[0]  # a flagged error bit: kept too


def assert_same(a, b):
    assert a.config == b.config
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_round_trip(tmp_path):
    cache = sample()
    assert kvjax.errors(cache) and bool(kvjax.has_shift(cache))
    kvjax.checkpoint_save(tmp_path / "ck", cache)
    assert_same(kvjax.checkpoint_restore(tmp_path / "ck", CFG), cache)
    assert_same(kvjax.checkpoint_restore(str(tmp_path / "ck"), kvjax.init(CFG)), cache)
    restored = kvjax.checkpoint_restore(tmp_path / "ck", CFG)
    # the restored value is a working cache
    restored, _, ok = kvjax.find_slot(restored, kvjax.make_ubatch([50], [[4]]))
    assert bool(ok) and int(kvjax.seq_pos_max(restored, 4)) == 50


def test_overwrite_needs_force(tmp_path):
    cache = sample()
    kvjax.checkpoint_save(tmp_path / "ck", cache)
    other = kvjax.clear(cache)
    with pytest.raises(Exception):
        kvjax.checkpoint_save(tmp_path / "ck", other)
    kvjax.checkpoint_save(tmp_path / "ck", other, force=True)
    assert int(kvjax.used_cells(kvjax.checkpoint_restore(tmp_path / "ck", CFG))) == 0


def test_mismatched_config_is_named(tmp_path):
    kvjax.checkpoint_save(tmp_path / "ck", sample())
    with pytest.raises(StateError, match="size: checkpoint 64, target 128"):
        kvjax.checkpoint_restore(tmp_path / "ck", CFG.replace(size=128))
    with pytest.raises(StateError, match=r"head_dim_v: checkpoint \[4, 4, 2\], target \[4, 4, 4\]"):
        kvjax.checkpoint_restore(tmp_path / "ck", CFG.replace(head_dim_v=4))
    with pytest.raises(StateError, match="v_trans"):
        kvjax.checkpoint_restore(tmp_path / "ck", CFG.replace(v_trans=False))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError):
        kvjax.checkpoint_restore(tmp_path / "missing", CFG)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StateError, match="meta: expected a kvjax cache checkpoint"):
        kvjax.checkpoint_restore(tmp_path / "empty", CFG)
    with pytest.raises(ValueError, match="KVCache"):
        kvjax.checkpoint_save(tmp_path / "x", CFG)
    with pytest.raises(ValueError, match="CacheConfig"):
        kvjax.checkpoint_restore(tmp_path / "x", "config")
    with pytest.raises(ValueError, match="outside jax.jit"):
        jax.jit(lambda c: kvjax.checkpoint_save(tmp_path / "y", c))(sample())


def test_orbax_missing(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)  # import raises ImportError
    with pytest.raises(ImportError, match="pip install 'kvjax\\[orbax\\]'"):
        kvjax.checkpoint_save(tmp_path / "ck", kvjax.init(CFG))
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda c: c.replace(head=jnp.int32(-3)), r"cells.head: expected a cell in \[0, 64\), found -3"),
        (
            lambda c: c.replace(seq=c.seq.at[7, 0].set(jnp.uint32(1 << 31))),
            r"cells.seq: expected sequence ids in \[0, 5\)",
        ),
        (
            lambda c: c.replace(pos=c.pos.at[40].set(9)),
            r"cells.pos: expected -1 in an empty cell \(a position without a sequence\), found 9 in cell 40",
        ),
        (
            lambda c: c.replace(pos=c.pos.at[0].set(-5)),
            r"cells.pos: expected \[0, 2147483647\) in a used cell, found -5 in cell 0",
        ),
        (
            lambda c: c.replace(delta=c.delta.at[40].set(2)),
            r"cells.delta: expected 0 in an empty cell, found 2 in cell 40",
        ),
    ],
)
def test_restore_enforces_the_cell_invariants(tmp_path, corrupt, match):
    """A checkpoint edited by hand (or written by a buggy tool) is refused like a corrupt state blob."""
    cache = sample()
    assert CFG.n_seq_max == 5 and not bool(kvjax.cell_table(cache).seqs[40].any())
    kvjax.checkpoint_save(tmp_path / "ck", cache.replace(cells=corrupt(cache.cells)))
    with pytest.raises(StateError, match=match):
        kvjax.checkpoint_restore(tmp_path / "ck", CFG)


@pytest.mark.parametrize("damage", ["array data gone", "array data truncated"])
def test_a_damaged_checkpoint_is_a_state_error(tmp_path, damage):
    """orbax and tensorstore raise a bare Exception for unreadable arrays: kvjax says what it means."""
    import shutil

    kvjax.checkpoint_save(tmp_path / "ck", sample())
    data = [p for p in (tmp_path / "ck" / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data
    for p in data:
        if damage == "array data gone":
            shutil.rmtree(p.parent, ignore_errors=True)
        else:
            p.write_bytes(p.read_bytes()[: len(p.read_bytes()) // 3])
    with pytest.raises(StateError, match="state: the arrays of the checkpoint at .* cannot be read"):
        kvjax.checkpoint_restore(tmp_path / "ck", CFG)


def test_a_latent_cache_round_trips(tmp_path):
    """A latent (MLA) cache's zero-width V leaves go through orbax as they are."""
    cfg = kvjax.CacheConfig(
        size=32, n_seq_max=2, n_layer=2, n_kv_heads=1, head_dim=40, head_dim_v=32, mla=True, padding=32
    )
    cache = with_random_kv(fill(kvjax.init(cfg), range(6), [[0], [1]] * 3), 4)
    assert cache.v[0].shape[-1] == 0
    kvjax.checkpoint_save(tmp_path / "ck", cache)
    assert_same(kvjax.checkpoint_restore(tmp_path / "ck", cfg), cache)


def test_a_checkpoint_older_than_a_config_field_restores(tmp_path, monkeypatch):
    """A checkpoint written before CacheConfig had ``mla`` has no such field: it was the default then."""
    original = _checkpoint.config_record
    monkeypatch.setattr(_checkpoint, "config_record", lambda c: {k: v for k, v in original(c).items() if k != "mla"})
    cache = sample()
    kvjax.checkpoint_save(tmp_path / "ck", cache)
    monkeypatch.setattr(_checkpoint, "config_record", original)
    assert_same(kvjax.checkpoint_restore(tmp_path / "ck", CFG), cache)
