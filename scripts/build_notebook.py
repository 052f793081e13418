"""Write ``notebooks/01_tour.ipynb`` from the cells below (run: ``python scripts/build_notebook.py``).

The notebook is generated so that its source stays reviewable as Python; the test suite executes
the generated file (``tests/test_notebook.py``).
"""

import pathlib

import nbformat

CELLS = [
    ("md", """# A tour of kvjax

kvjax is a KV cache for JAX language models with the semantics of llama.cpp's KV cache. The cache
is an immutable pytree and every operation is a pure jitted function that returns a new cache.
This tour places tokens, shares a prefix between sequences, looks at the attention mask, generates
text for several sequences, shifts a context and defragments."""),
    ("code", """%matplotlib inline
import jax, jax.numpy as jnp, numpy as np, matplotlib.pyplot as plt
import kvjax
from kvjax.plot import plot_cells, plot_mask

cfg = kvjax.CacheConfig(size=64, n_seq_max=3, n_layer=2, n_kv_heads=2, head_dim=16, padding=16)
cache = kvjax.init(cfg)
print(cfg.size, "cells;", kvjax.total_size(cfg), "bytes of K/V")"""),
    ("md", """## Placing a prompt

`find_slot` places a ubatch (positions and sequence ids of its tokens) into free cells: the seed's
contiguous search by default. It returns the new cache, the cell of every token and whether it fit."""),
    ("code", """prompt = kvjax.make_ubatch(range(10), [[0]] * 10)
cache, slot, ok = kvjax.find_slot(cache, prompt)
print(slot, bool(ok))
print(kvjax.cell_map(cache, width=64))"""),
    ("md", """## Sharing a prefix

`seq_cp` adds a sequence to cells: no K/V bytes are copied, the cells are shared."""),
    ("code", """cache = kvjax.seq_cp(cache, 0, 1, 0, 6)   # sequence 1 shares the first 6 positions
cache = kvjax.seq_cp(cache, 0, 2, 0, 6)
for t in range(4):                        # three sequences decode side by side
    step = kvjax.make_ubatch([10 + t, 6 + t, 6 + t], [[0], [1], [2]])
    cache, _, _ = kvjax.find_slot(cache, step)
plot_cells(cache, n_cells=32); plt.show()"""),
    ("md", """## The attention mask

For a ubatch, `kq_mask` says which cells each token may attend to: cells of its sequence, not in
its future, inside the sliding window if any. White is visible."""),
    ("code", """ub = kvjax.make_ubatch([14, 10, 10], [[0], [1], [2]])
mask = kvjax.kq_mask(cache, ub, 32)
plot_mask(mask[:3]); plt.show()"""),
    ("md", """## Generating for several sequences

The decode driver splits a batch into ubatches, dry-runs the placement of all of them (a batch that
cannot fit raises `CacheFullError` and leaves the cache as it was), and runs one jitted step per
ubatch. `generate` evaluates the common prefix of the prompts once and shares it."""),
    ("code", """from kvjax.app import _charlm as charlm
from kvjax.engine._engine import Engine, generate

model, tok, trained = charlm.load()
engine = Engine(model, kvjax.init(model.config.cache_config(size=256, n_seq_max=3, padding=32)))
prompts = ["The file is ", "The file was ", "The file name "]
out = generate(engine, [tok.encode(p).tolist() for p in prompts], max_new_tokens=20,
               key=jax.random.PRNGKey(0), sampling=kvjax.SamplingConfig(temperature=0.6, top_k=10))
for p, t in zip(prompts, out.tokens):
    print(repr(p + tok.decode(t)))
print(out.prompt_tokens, "prompt tokens evaluated;", out.compiles, "compilations")
plot_cells(engine.cache, n_cells=96, show_pos=False); plt.show()"""),
    ("md", """## A context shift

When a sequence reaches its context limit, keep the first `n_keep` tokens, drop the next
`n_discard` and shift the rest back with `seq_add`; the next decode applies the K-shift (RoPE by
the accumulated delta) before placing new tokens."""),
    ("code", """next_pos = engine.context_shift(0, n_keep=4, n_discard=8)
print("pending K-shift:", bool(kvjax.has_shift(engine.cache)), "- sequence 0 continues at", next_pos)
logits = engine.decode([out.tokens[0][-1]], [next_pos], [[0]])
print("after decode, pending K-shift:", bool(kvjax.has_shift(engine.cache)))
plot_cells(engine.cache, n_cells=96, show_pos=False); plt.show()"""),
    ("md", """## Defragmentation

Dropping a sequence leaves holes; `defrag` fills them with cells from the end of the cache, moving
K/V of every layer in one jitted program, so attention reads fewer cells."""),
    ("code", """engine.cache, _ = kvjax.seq_rm(engine.cache, 1)
print("n_kv before:", int(kvjax.n_kv(engine.cache)))
engine.cache = kvjax.defrag(engine.cache)
print("n_kv after: ", int(kvjax.n_kv(engine.cache)))
plot_cells(engine.cache, n_cells=96, show_pos=False); plt.show()"""),
]


def build() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, src in CELLS:
        nb.cells.append(nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src))
    return nb


if __name__ == "__main__":
    out = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / "01_tour.ipynb"
    nbformat.write(build(), out)
    print(f"wrote {out}")
