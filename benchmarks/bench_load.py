"""Loading a Hugging Face checkpoint folder: load time, peak host memory, then prefill/decode speed.

A random Llama checkpoint (bfloat16 safetensors in shards with an index file, as transformers
writes them; about 300 MB, quick: about 20 MB) is written to a temporary folder without building
the model: each tensor is drawn from the shapes of :func:`kvjax.nn._hf.llama_plan` and written
shard by shard. Each load runs in a fresh Python process (peak resident memory is a process
high-water mark): ``kvjax.nn.from_pretrained`` as float32 and as bfloat16, timed to the weights
being on the device; the peak is the high-water resident memory above the process's after
importing jax and kvjax, against the size of the model made (the checkpoint files are read
memory-mapped, one tensor at a time). The loaded model then runs through ``kvjax.generate``
(greedy, one sequence): prompt tokens/s and generated tokens/s with compile time apart.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile

import numpy as np

from benchmarks.common import fmt_time, table

_CHILD = r"""
import json, resource, sys, threading, time
import jax, jax.numpy as jnp
from flax import nnx
import kvjax
from kvjax.nn import from_pretrained, memory_config_for
from kvjax import Engine, generate

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20

def anon_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("RssAnon")) / 1024

folder, dtype, n_prompt, n_new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
jax.block_until_ready(jnp.ones(4) + 1)                 # the runtime is up before the baseline
base_rss = rss_mb()
base_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
base_anon = anon_mb()
anon_peak, sampling = [base_anon], [True]

def sample():                                          # anonymous memory has no high-water mark: sample it
    while sampling[0]:
        anon_peak[0] = max(anon_peak[0], anon_mb())
        time.sleep(0.002)

sampler = threading.Thread(target=sample, daemon=True)
sampler.start()
t0 = time.perf_counter()
model = from_pretrained(folder, dtype=dtype)
jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
load = time.perf_counter() - t0
sampling[0] = False
sampler.join()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
model_mb = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model))) / 2**20
after = rss_mb()
prompt = [int(t) for t in jax.random.randint(jax.random.PRNGKey(0), (n_prompt,), 3, model.config.vocab_size)]
runs = []
for _ in range(2):   # the first run compiles every program, the second is timed
    engine = Engine(model, kvjax.init(memory_config_for(model, size=n_prompt + n_new + 64, n_seq_max=1)),
                    n_ubatch=64)
    runs.append(generate(engine, [prompt], max_new_tokens=n_new, key=jax.random.PRNGKey(0),
                         sampling=kvjax.SamplingConfig(temperature=0.0)))
first, warm = runs
print(json.dumps(dict(load=load, model_mb=model_mb, peak_mb=max(peak, base_peak) - base_rss,
                      anon_peak_mb=anon_peak[0] - base_anon, resident_mb=after - base_rss,
                      prompt_tps=warm.prompt_tokens / warm.time_to_first_token,
                      decode_tps=warm.tokens_per_second, compile=first.compile_seconds,
                      warm_compiles=warm.compiles)))
"""


def _sizes(quick: bool) -> dict:
    if quick:
        return dict(vocab_size=8000, d_model=256, n_layer=4, n_heads=8, n_kv_heads=4, d_ff=704)
    return dict(vocab_size=32000, d_model=1024, n_layer=8, n_heads=16, n_kv_heads=4, d_ff=2816)


def write_random_checkpoint(folder: pathlib.Path, quick: bool, shard_bytes: int = 100 * 2**20) -> int:
    """A random Llama checkpoint in bfloat16 shards (no model built); returns the bytes written."""
    import ml_dtypes
    from flax import nnx
    from safetensors.numpy import save_file

    import kvjax
    from kvjax.nn import Llama, LlamaConfig
    from kvjax.nn._hf import llama_plan

    sizes = _sizes(quick)
    head = sizes["d_model"] // sizes["n_heads"]
    cfg = LlamaConfig(**sizes, rope=kvjax.RopeConfig(n_rot=head, mode="neox"))
    abstract = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    shards, current, size, total = [], {}, 0, 0
    index = {}

    def flush():
        nonlocal current, size
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(current, str(folder / name), metadata={"format": "pt"})
        shards.append(name)
        index.update({k: name for k in current})
        current, size = {}, 0

    for var, key, fn in llama_plan(abstract):
        shape = tuple(var.shape)[::-1] if fn is not None else tuple(var.shape)  # stored [out, in]
        if key.endswith("norm.weight"):  # RMSNorm scales near 1, projections small (a sane forward pass)
            arr = (1.0 + 0.1 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)
        else:
            arr = (0.02 * rng.standard_normal(shape, np.float32)).astype(ml_dtypes.bfloat16)
        current[key if key.startswith("lm_head") else "model." + key] = arr
        size += arr.nbytes
        total += arr.nbytes
        if size >= shard_bytes:
            flush()
    if current:
        flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index})
    )
    config = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=sizes["vocab_size"],
        hidden_size=sizes["d_model"],
        intermediate_size=sizes["d_ff"],
        num_hidden_layers=sizes["n_layer"],
        num_attention_heads=sizes["n_heads"],
        num_key_value_heads=sizes["n_kv_heads"],
        head_dim=head,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        tie_word_embeddings=False,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        torch_dtype="bfloat16",
    )
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return total


def _load_in_child(folder, dtype, n_prompt, n_new) -> dict:
    root = pathlib.Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(folder), dtype, str(n_prompt), str(n_new)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"loading in a child process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(quick: bool = False) -> str:
    n_prompt, n_new = (32, 8) if quick else (128, 32)
    with tempfile.TemporaryDirectory(prefix="kvjax-bench-load-") as tmp:
        folder = pathlib.Path(tmp)
        stored = write_random_checkpoint(folder, quick)
        n_files = len(list(folder.glob("*.safetensors")))
        rows = []
        for dtype in ("float32", "bfloat16"):
            r = _load_in_child(folder, dtype, n_prompt, n_new)
            rows.append(
                [
                    dtype,
                    fmt_time(r["load"]),
                    f"{stored / 2**20 / r['load']:.0f} MB/s",
                    f"{r['model_mb']:.0f} MB",
                    f"{r['peak_mb']:.0f} MB",
                    f"{r['anon_peak_mb']:.0f} MB",
                    f"{r['anon_peak_mb'] / r['model_mb']:.2f}",
                    f"{r['prompt_tps']:.0f}",
                    f"{r['decode_tps']:.1f}",
                    f"{r['compile']:.1f} s ({r['warm_compiles']} in the timed run)",
                ]
            )
    s = _sizes(quick)
    return "\n".join(
        [
            "## Loading a checkpoint folder (from_pretrained)",
            "",
            f"A random Llama ({s['n_layer']} layers, width {s['d_model']}, vocabulary {s['vocab_size']}) stored as "
            f"{stored / 2**20:.0f} MB of bfloat16 safetensors in {n_files} shards with an index file, loaded in a fresh "
            f"process. Peak resident is the process's high-water mark above its size after importing jax and kvjax "
            f"(it includes file pages mapped while a tensor is read); peak anonymous is sampled every 2 ms (the "
            f"memory the load allocates), and its ratio compares it with the model made. Then a {n_prompt}-token "
            f"prompt and {n_new} greedy tokens through kvjax.generate (one sequence, float32 K/V): timed on a second "
            f"run after a first one compiled every program.",
            "",
            table(
                [
                    "dtype",
                    "load",
                    "read rate (stored bytes)",
                    "model",
                    "peak resident added",
                    "peak anonymous added",
                    "anonymous peak / model",
                    "prompt tokens/s",
                    "generated tokens/s",
                    "compile (first run)",
                ],
                rows,
            ),
            "",
        ]
    )
