"""Write the notebooks in ``notebooks/`` from the cells below (run: ``python scripts/build_notebook.py``).

The notebooks are generated so that their source stays reviewable as Python; the test suite
executes the generated files (``tests/test_notebook.py``).
"""

import pathlib

import nbformat

TOUR = [
    (
        "md",
        """# A tour of kvjax

kvjax is a KV cache for JAX language models with the semantics of llama.cpp's KV cache. The cache
is an immutable pytree and every operation is a pure jitted function that returns a new cache.
This tour places tokens, shares a prefix between sequences, looks at the attention mask, generates
text for several sequences, shifts a context and defragments.""",
    ),
    (
        "code",
        """%matplotlib inline
import jax, jax.numpy as jnp, numpy as np, matplotlib.pyplot as plt
import kvjax
from kvjax.plot import plot_cells, plot_mask

cfg = kvjax.CacheConfig(size=64, n_seq_max=3, n_layer=2, n_kv_heads=2, head_dim=16, padding=16)
cache = kvjax.init(cfg)
print(cfg.size, "cells;", kvjax.total_size(cfg), "bytes of K/V")""",
    ),
    (
        "md",
        """## Placing a prompt

`find_slot` places a ubatch (positions and sequence ids of its tokens) into free cells: the seed's
contiguous search by default. It returns the new cache, the cell of every token and whether it fit.""",
    ),
    (
        "code",
        """prompt = kvjax.make_ubatch(range(10), [[0]] * 10)
cache, slot, ok = kvjax.find_slot(cache, prompt)
print(slot, bool(ok))
print(kvjax.cell_map(cache, width=64))""",
    ),
    (
        "md",
        """## Sharing a prefix

`seq_cp` adds a sequence to cells: no K/V bytes are copied, the cells are shared.""",
    ),
    (
        "code",
        """cache = kvjax.seq_cp(cache, 0, 1, 0, 6)   # sequence 1 shares the first 6 positions
cache = kvjax.seq_cp(cache, 0, 2, 0, 6)
for t in range(4):                        # three sequences decode side by side
    step = kvjax.make_ubatch([10 + t, 6 + t, 6 + t], [[0], [1], [2]])
    cache, _, _ = kvjax.find_slot(cache, step)
plot_cells(cache, n_cells=32); plt.show()""",
    ),
    (
        "md",
        """## The attention mask

For a ubatch, `kq_mask` says which cells each token may attend to: cells of its sequence, not in
its future, inside the sliding window if any. White is visible.""",
    ),
    (
        "code",
        """ub = kvjax.make_ubatch([14, 10, 10], [[0], [1], [2]])
mask = kvjax.kq_mask(cache, ub, 32)
plot_mask(mask[:3]); plt.show()""",
    ),
    (
        "md",
        """## Generating for several sequences

The decode driver splits a batch into ubatches, dry-runs the placement of all of them (a batch that
cannot fit raises `CacheFullError` and leaves the cache as it was), and runs one jitted step per
ubatch. `generate` evaluates the common prefix of the prompts once and shares it.""",
    ),
    (
        "code",
        """from kvjax.app import _charlm as charlm
from kvjax import Engine, generate

model, tok, trained = charlm.load()
engine = Engine(model, kvjax.init(model.config.cache_config(size=256, n_seq_max=3, padding=32)))
prompts = ["The file is ", "The file was ", "The file name "]
out = generate(engine, [tok.encode(p).tolist() for p in prompts], max_new_tokens=20,
               key=jax.random.PRNGKey(0), sampling=kvjax.SamplingConfig(temperature=0.6, top_k=10))
for p, t in zip(prompts, out.tokens):
    print(repr(p + tok.decode(t)))
print(out.prompt_tokens, "prompt tokens evaluated;", out.compiles, "compilations")
plot_cells(engine.cache, n_cells=96, show_pos=False); plt.show()""",
    ),
    (
        "md",
        """## A context shift

When a sequence reaches its context limit, keep the first `n_keep` tokens, drop the next
`n_discard` and shift the rest back with `seq_add`; the next decode applies the K-shift (RoPE by
the accumulated delta) before placing new tokens.""",
    ),
    (
        "code",
        """next_pos = engine.context_shift(0, n_keep=4, n_discard=8)
print("pending K-shift:", bool(kvjax.has_shift(engine.cache)), "- sequence 0 continues at", next_pos)
logits = engine.decode([out.tokens[0][-1]], [next_pos], [[0]])
print("after decode, pending K-shift:", bool(kvjax.has_shift(engine.cache)))
plot_cells(engine.cache, n_cells=96, show_pos=False); plt.show()""",
    ),
    (
        "md",
        """## Defragmentation

Dropping a sequence leaves holes; `defrag` fills them with cells from the end of the cache, moving
K/V of every layer in one jitted program, so attention reads fewer cells.""",
    ),
    (
        "code",
        """engine.cache, _ = kvjax.seq_rm(engine.cache, 1)
print("n_kv before:", int(kvjax.n_kv(engine.cache)))
engine.cache = kvjax.defrag(engine.cache)
print("n_kv after: ", int(kvjax.n_kv(engine.cache)))
plot_cells(engine.cache, n_cells=96, show_pos=False); plt.show()""",
    ),
]


MEMORIES = [
    (
        "md",
        """# The memories of kvjax

One protocol (`kvjax.Memory`), several memories. This notebook shows the iSWA pair, the seed's
memory for models that interleave sliding-window and full-attention layers (Gemma 2 and 3, Cohere,
Llama 4): a full-size cache for the full layers and a small one for the window layers, pruned as
the window slides.""",
    ),
    (
        "code",
        """%matplotlib inline
import jax, numpy as np, matplotlib.pyplot as plt
from flax import nnx
import kvjax
from kvjax.nn import Llama, LlamaConfig
from kvjax.plot import plot_cells

model_cfg = LlamaConfig(vocab_size=48, d_model=32, n_layer=4, n_heads=4, n_kv_heads=2, swa_layers=(0, 2), n_swa=8)
base = model_cfg.cache_config(size=128, n_seq_max=2, padding=16)
cfg = kvjax.IswaConfig(base, swa_layers=model_cfg.swa_layers, n_swa=8, n_batch=16)
memory = kvjax.init(cfg)
print("full-size cache:", cfg.base_config.size, "cells, layers", cfg.base_config.cached_layers)
print("window cache:   ", cfg.size_swa, "cells, layers", cfg.swa_config.cached_layers)
print("bytes: iSWA", memory.nbytes(), "vs one full-size cache", kvjax.total_size(base))""",
    ),
    (
        "md",
        """## Two sequences with a shared prompt

The engine drives the pair like any memory: it places each ubatch in both caches (or in neither),
runs the model (full layers read the base cache, window layers the window cache, each with its
own window bucket) and calls `kvjax.commit` after every batch, which prunes the window cache.""",
    ),
    (
        "code",
        """engine = kvjax.Engine(Llama(model_cfg, rngs=nnx.Rngs(0)), memory, n_ubatch=16)
engine.decode(list(range(1, 13)), list(range(12)), [[0]] * 12)    # a 12-token prompt
engine.cache = kvjax.seq_cp(engine.cache, 0, 1)                    # sequence 1 shares it

def show(memory, title):
    fig, axes = plt.subplots(2, 1, figsize=(9, 2.6))
    plot_cells(memory.base, axes[0], n_cells=64, show_pos=False); axes[0].set_title(title + ": full-size cache")
    plot_cells(memory.swa, axes[1], n_cells=64, show_pos=False); axes[1].set_title(title + ": window cache")
    fig.tight_layout(); plt.show()

show(engine.cache, "after the prompt")
print("used cells: base", int(kvjax.used_cells(engine.cache.base)), "window", int(kvjax.used_cells(engine.cache.swa)))""",
    ),
    (
        "md",
        """## The window slides

Each sequence decodes on its own; after every batch the window cache forgets, per sequence, the
cells no later token of that sequence can attend to (positions more than `n_swa` behind its
newest token). The shared prompt cells stay while either sequence can still see them.""",
    ),
    (
        "code",
        """tokens = [5, 6]
for step in range(20):
    pos = [12 + step, 12 + step]
    logits = engine.decode(tokens, pos, [[0], [1]])
    tokens = [int(t) for t in np.argmax(np.asarray(logits), axis=-1)]
show(engine.cache, "after 20 more tokens each")
print("used cells: base", int(kvjax.used_cells(engine.cache.base)), "window", int(kvjax.used_cells(engine.cache.swa)))
print("oldest position still held by sequence 0:", int(kvjax.seq_pos_min(engine.cache, 0)))""",
    ),
    (
        "md",
        """The full-size cache keeps every token (full layers attend to all of them); the window
cache holds at most `n_swa` positions per sequence plus one batch, so its size, and the cost of
the window layers' attention, no longer grows with the context.""",
    ),
    (
        "md",
        """## The recurrent memory

A state-space model (Mamba) keeps one fixed-size state per sequence instead of K/V per token.
`kvjax.RecurrentConfig` describes the seed's recurrent cache: cells of states, a `tail` naming
each sequence's cell, and `seq_cp` that *shares* a state instead of copying it. Here a prompt is
evaluated once in sequence 0 and forked to sequences 1 and 2: one cell, three sequences.""",
    ),
    (
        "code",
        """from kvjax.nn import Mamba, MambaConfig

mamba_cfg = MambaConfig(vocab_size=48, d_model=32, n_layer=2, d_state=8)
rec = kvjax.Engine(Mamba(mamba_cfg, rngs=nnx.Rngs(0)), kvjax.init(mamba_cfg.memory_config(4, n_states=3)))
rec.decode(list(range(1, 9)), list(range(8)), [[0]] * 8)          # an 8-token prompt in sequence 0
for s in (1, 2):
    rec.cache = kvjax.seq_cp(rec.cache, 0, s)                      # shared: no state bytes copied

def show_states(memory, title):
    t = kvjax.cell_table(memory)
    fig, ax = plt.subplots(figsize=(5, 1.8))
    ax.imshow(t.seqs.T, cmap="Blues", vmin=0, vmax=1.4, aspect="auto")
    ax.set_xticks(range(len(t.pos)), [f"cell {i}\\npos {p}" for i, p in enumerate(t.pos)])
    ax.set_yticks(range(t.seqs.shape[1]), [f"seq {s}" for s in range(t.seqs.shape[1])])
    ax.set_title(title); fig.tight_layout(); plt.show()
    print("tail", t.tail.tolist(), " src", t.src.tolist(), " states kept", t.hist.tolist())

show_states(rec.cache, "after seq_cp: one state, three sequences")""",
    ),
    (
        "md",
        """## Copy-on-write

The next decode gives every sequence that shares a cell one of its own: the new cells start from a
copy of the shared state (`s_copy` of the placement), the last sequence keeps the original cell.
Each sequence then continues exactly as it would have alone.""",
    ),
    (
        "code",
        """logits = rec.decode([20, 21, 22], [8, 8, 8], [[0], [1], [2]])
show_states(rec.cache, "after one token each: three states")""",
    ),
    (
        "md",
        """## Rollback

With `n_states=3` each cell keeps its last three states, so the last two tokens of a sequence can
be dropped (a rejected speculative draft): `seq_rm(seq, p, -1)` moves the sequence back to the
state after `p - 1` without touching any bytes. A cut deeper than the kept states is refused.""",
    ),
    (
        "code",
        """rec.decode([30, 31, 32], [9, 9, 9], [[0], [1], [2]])
memory, ok = kvjax.seq_rm(rec.cache, 1, 9, -1)
print("roll back sequence 1 to position 8:", bool(ok), "-> pos", int(kvjax.seq_pos_max(memory, 1)))
memory, ok = kvjax.seq_rm(rec.cache, 1, 2, -1)
print("cut sequence 1 at position 2 (inside its state):", bool(ok))""",
    ),
]

SERVING = [
    (
        "md",
        """# Serving: a prompt cache on the device

A chat server sees the same conversation again and again: each request repeats the conversation so
far and adds a turn. `kvjax.PromptCache` keeps finished sequences parked in the memory (their
tokens in a small device array), finds the longest common prefix of a new prompt with all of them
in one jitted call, and lends it with `seq_cp`: the cells are shared, not copied, and only the new
part of the prompt is evaluated. When room runs out, the least recently used parked sequences go.""",
    ),
    (
        "code",
        """%matplotlib inline
import jax, numpy as np, matplotlib.pyplot as plt
import kvjax
from kvjax.app._charlm import load
from kvjax.plot import plot_cells

model, tok, trained = load(verbose=False)
print("character model:", "trained" if trained else "random weights (charlm.npz missing)")
cfg = model.config
engine = kvjax.Engine(model, kvjax.init(cfg.cache_config(size=256, n_seq_max=4, padding=32)), n_ubatch=64)
cache = kvjax.PromptCache(n_seq_max=4, max_tokens=256)
greedy = kvjax.SamplingConfig(temperature=0)

def ask(text, n=16):
    out = kvjax.generate(engine, [tok.encode(text).tolist()], max_new_tokens=n, key=jax.random.PRNGKey(0),
                         sampling=greedy, prompt_cache=cache)
    reply = tok.decode(out.tokens[0])
    print(f"{len(text):3d} prompt chars, {out.prompt_tokens:3d} evaluated -> {reply!r}")
    return text + reply""",
    ),
    (
        "md",
        """## A conversation and a second user

Each turn of the first user repeats everything before it; only the new turn is evaluated. The
second user's requests share nothing with the first's and get sequences of their own.""",
    ),
    (
        "code",
        """chat = ask("The file is ")
other = ask("Return the value ")
chat = ask(chat + " and the name ")
other = ask(other + " of the ")
chat = ask(chat + " If the ")
print("parked sequences:", cache.parked(), "- tokens reused so far:", cache.reused_tokens)
plot_cells(engine.cache, n_cells=256, show_pos=False); plt.show()""",
    ),
    (
        "md",
        """## Parallel sampling from a parked prefix

Several continuations of one prompt: `n_parallel` evaluates the prompt once and shares it with
`seq_cp`; sampling draws a different continuation per sequence.""",
    ),
    (
        "code",
        """fresh = kvjax.Engine(model, kvjax.init(cfg.cache_config(size=256, n_seq_max=4, padding=32)), n_ubatch=64)
out = kvjax.generate(fresh, [tok.encode("The file is ").tolist()], n_parallel=3, max_new_tokens=16,
                     key=jax.random.PRNGKey(1), sampling=kvjax.SamplingConfig(temperature=0.8, top_k=10))
for t in out.tokens:
    print(repr(tok.decode(t)))
plot_cells(fresh.cache, n_cells=96, show_pos=False); plt.show()""",
    ),
    (
        "md",
        """## Rollback

Removing the last tokens of a sequence (a rejected speculative draft, a retry) is one `seq_rm`:
the cells are freed and the next decode continues from the kept positions.""",
    ),
    (
        "code",
        """seq = 0
end = int(kvjax.seq_pos_max(fresh.cache, seq)) + 1
fresh.rollback(seq, end - 5)
print("sequence 0 held", end, "positions, now", int(kvjax.seq_pos_max(fresh.cache, seq)) + 1)
plot_cells(fresh.cache, n_cells=96, show_pos=False); plt.show()""",
    ),
    (
        "md",
        """## Eviction

A memory with room for few sequences: parked conversations are evicted, least recently used first,
when a new request needs their cells or their sequence ids.""",
    ),
    (
        "code",
        """small = kvjax.Engine(model, kvjax.init(cfg.cache_config(size=96, n_seq_max=3, padding=32)), n_ubatch=64)
small_cache = kvjax.PromptCache(n_seq_max=3, max_tokens=96)
for i, text in enumerate(["The file is ", "Return the ", "If the value ", "The file is a ", "Return the name "]):
    out = kvjax.generate(small, [tok.encode(text).tolist()], max_new_tokens=12, key=jax.random.PRNGKey(i),
                         sampling=greedy, prompt_cache=small_cache)
    print(f"{text!r:22} evaluated {out.prompt_tokens:2d} of {len(text):2d}; parked {small_cache.parked()}, "
          f"evictions so far {small_cache.evictions}")""",
    ),
    (
        "md",
        """## Continuous batching: requests that come and go

`kvjax.serve.Scheduler` is what a server runs: requests arrive between steps, each step feeds one
token of every request that is decoding and fills the rest of its token budget (`n_batch`) with
prompt chunks, a finished request's cells are freed at once, and every request gets exactly the
tokens it would get alone (`docs/serving.md`). `python -m kvjax serve` puts an OpenAI-compatible
HTTP server in front of it. Below, four requests arrive at steps 0, 0, 3 and 8; the picture shows
what each step's batch held.""",
    ),
    (
        "code",
        """from kvjax.serve import Scheduler, ServeRequest, plot_steps

busy = kvjax.Engine(model, kvjax.init(cfg.cache_config(size=256, n_seq_max=4, padding=32)), n_ubatch=32)
scheduler = Scheduler(busy, n_batch=24, device_loop=False)  # one token per request per step, to draw it
texts = ["The file is ", "Return the value of the name ", "If the ", "The name of the file is "]
arrive = {0: [0, 1], 3: [2], 8: [3]}
owner, replies, steps = {}, {}, []
for step in range(200):
    for i in arrive.get(step, []):
        owner[scheduler.submit(ServeRequest(tok.encode(texts[i]).tolist(), max_tokens=12))] = i
    for ev in scheduler.step():
        replies.setdefault(owner[ev.request_id], []).extend(ev.tokens)
    steps.append(scheduler.last_batch)
    if step > 8 and scheduler.idle:
        break
for i in sorted(replies):
    print(f"{texts[i]!r:32} -> {tok.decode(replies[i])!r}")
print("cells in use at the end:", int(kvjax.used_cells(busy.cache)))
plot_steps(steps, labels={r: f"request {i}" for r, i in owner.items()}, n_batch=24); plt.show()""",
    ),
]

NOTEBOOKS = {"01_tour.ipynb": TOUR, "02_memories.ipynb": MEMORIES, "03_serving.ipynb": SERVING}


def build(cells) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for kind, src in cells:
        nb.cells.append(nbformat.v4.new_markdown_cell(src) if kind == "md" else nbformat.v4.new_code_cell(src))
    return nb


if __name__ == "__main__":
    for name, cells in NOTEBOOKS.items():
        out = pathlib.Path(__file__).resolve().parent.parent / "notebooks" / name
        nbformat.write(build(cells), out)
        print(f"wrote {out}")
