"""The mixture-of-experts MLP (gpt-oss's): kvjax's grouped loop against the formulations one would pick instead.

One MoE layer, 32 experts of which 4 run per token, d_model = d_ff = 512 (quick: 256), float32, jitted,
at 1, 4, 32 and 256 tokens. Compared in the same run, on the same routing:

- **kvjax**: :func:`kvjax.nn._moe.grouped_products`, a loop over the experts that skips the unused
  ones and runs each expert's sorted rows in products of about its share;
- **ragged_dot**: ``jax.lax.ragged_dot`` over the same sorted rows (JAX's grouped matmul);
- **dense**: every expert on every token, weighted by the routing (zeros for the unused);
- **gathered**: each (token, expert) pair gathers its expert's matrices and runs a batched product.

The bytes column is the expert weights the routing touches (each used expert's three matrices once),
over the time: a decode step is bound by them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import fmt_rate, fmt_time, median_time, table
from kvjax.nn._moe import mix_experts, route


def run(quick: bool) -> str:
    n_experts, k = 32, 4
    d = 256 if quick else 512
    rng = np.random.default_rng(0)
    params = {
        name: jnp.asarray(rng.standard_normal((n_experts, d, d)).astype(np.float32) * 0.05)
        for name in ("gate", "up", "down")
    }
    router = jnp.asarray(rng.standard_normal((d, n_experts)).astype(np.float32))

    def routed(x):
        return route(x @ router, k)

    def kvjax_loop(x):
        experts, w = routed(x)
        return mix_experts(x, experts, w, params, "silu", 1.702, 7.0)

    def ragged(x):
        experts, w = routed(x)
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token = order // k
        sizes = jnp.bincount(flat, length=n_experts).astype(jnp.int32)
        rows = x[token]
        dot = lambda h, name: jax.lax.ragged_dot(h, params[name], sizes)  # noqa: E731
        hidden = jax.nn.silu(dot(rows, "gate")) * dot(rows, "up")
        out = dot(hidden, "down") * w.reshape(-1)[order][:, None]
        return jnp.zeros_like(x).at[token].add(out)

    def dense(x):
        experts, w = routed(x)
        full = jnp.zeros((x.shape[0], n_experts)).at[jnp.arange(x.shape[0])[:, None], experts].set(w)
        hidden = jax.nn.silu(jnp.einsum("te,xef->txf", x, params["gate"])) * jnp.einsum("te,xef->txf", x, params["up"])
        return jnp.einsum("txf,xfe,tx->te", hidden, params["down"], full)

    def gathered(x):
        experts, w = routed(x)
        g, u, dn = (params[name][experts] for name in ("gate", "up", "down"))  # [T, k, d, d]
        hidden = jax.nn.silu(jnp.einsum("te,tkef->tkf", x, g)) * jnp.einsum("te,tkef->tkf", x, u)
        return jnp.einsum("tkf,tkfe,tk->te", hidden, dn, w)

    ways = {"kvjax": kvjax_loop, "ragged_dot": ragged, "dense": dense, "gathered": gathered}
    rows = []
    for n_tok in (1, 4, 32, 256):
        x = jnp.asarray(rng.standard_normal((n_tok, d)).astype(np.float32))
        jitted = {name: jax.jit(fn) for name, fn in ways.items()}
        want = jitted["dense"](x)
        times = {}
        for name, fn in jitted.items():
            err = float(jnp.max(jnp.abs(fn(x) - want)))
            assert err < 1e-3, f"{name} disagrees with the dense product ({err})"
            if name == "gathered" and n_tok > 32:
                continue  # [T, k, d, d] of gathered weights: seconds, and the point is made at 32
            times[name] = median_time(lambda fn=fn: fn(x), repeats=5)
        used = len(np.unique(np.asarray(routed(x)[0])))
        touched = 3 * used * d * d * 4
        rows.append(
            [
                n_tok,
                used,
                fmt_time(times["kvjax"]),
                fmt_rate(touched / times["kvjax"]),
                *(f"{times[name] / times['kvjax']:.1f}x" if name in times else "-" for name in list(ways)[1:]),
            ]
        )
    return "\n".join(
        [
            "## Mixture of experts (gpt-oss's MLP)",
            "",
            f"One layer, {n_experts} experts, {k} per token, d_model = d_ff = {d}, float32, jitted; the other "
            "columns are each formulation's time over kvjax's, same run, same routing.",
            "",
            table(["tokens", "experts used", "kvjax", "used expert bytes/s", "ragged_dot", "dense", "gathered"], rows),
        ]
    )


if __name__ == "__main__":
    import sys

    print(run(quick="--quick" in sys.argv))
