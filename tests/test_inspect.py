"""cell_table and cell_map."""

import numpy as np

import kvjax
from tests.helpers import fill, small_config


def test_cell_table_round_trips_membership():
    cfg = small_config(n_seq_max=40)
    cache = fill(kvjax.init(cfg), [0, 1, 2], [[0], [33, 1], [39]])
    cache = kvjax.seq_add(cache, 33, -1, -1, 5)
    table = kvjax.cell_table(cache)
    assert table.pos[:4].tolist() == [0, 6, 2, -1]
    assert table.seqs.shape == (64, 40)
    assert np.flatnonzero(table.seqs[1]).tolist() == [1, 33]
    assert np.flatnonzero(table.seqs[2]).tolist() == [39]
    assert table.delta[:3].tolist() == [0, 5, 0]


def test_cell_map_lines():
    cache = fill(kvjax.init(small_config()), range(5), [[0], [1], [2, 3], [3], [0]])
    text = kvjax.cell_map(cache, width=32)
    lines = text.splitlines()
    assert lines[0] == "cells 5/64 used, head 0, n_kv 16, cell_max 5"
    assert lines[1] == "01+30" + "." * 27 and lines[2] == "." * 32


def test_inspection_bad_input():
    import pytest

    with pytest.raises(ValueError, match="must be a kvjax.*KVCache"):
        kvjax.cell_table(None)
    with pytest.raises(ValueError, match=r"width=0 is out of range: allowed an integer >= 1"):
        kvjax.cell_map(kvjax.init(small_config()), width=0)
