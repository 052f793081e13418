"""Mamba: HF equivalence, stateful step equals forward (decode, prefill, chunks, batches, forks), jit, errors.

The model is checked against ``transformers``' ``MambaForCausalLM`` (torch's reference path) on
the same random weights, then against itself: whatever way the tokens of a sequence are cut into
ubatches, and whichever sequences share a ubatch, the logits must equal one uncached pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from kvjax.nn._mamba import Mamba, MambaConfig, make_mamba_step
from kvjax.nn._mamba_hf import params_from_hf
from kvjax.nn._selective_scan import pick_scan, select_states, selective_scan, selective_scan_keep

ATOL = 1e-5  # one float32 model against itself: only the order of the scan's sums differs
ATOL_HF = 1e-4  # against torch: different matmul and scan orders
RTOL = 1e-5  # SSM states reach ~10: compare them relatively too

CFG = MambaConfig(vocab_size=40, d_model=16, n_layer=2, d_state=4, d_conv=4, scan_chunk=4)


def make_model(cfg: MambaConfig = CFG, seed: int = 0) -> Mamba:
    """A model whose every weight is randomised, so the state matters.

    HF's initial time steps are 0.001..0.1, which keeps the state's effect on the logits near the
    tolerance; a dt bias around 0 (dt ~ softplus(0) = 0.7) and random A, D and norms make a
    wrong state visible.
    """
    model = Mamba(cfg, rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    params = nnx.state(model, nnx.Param)
    noisy = jax.tree_util.tree_map(lambda p: p + jnp.asarray(0.3 * rng.standard_normal(p.shape), p.dtype), params)
    nnx.update(model, noisy)
    for block in model.layers:
        block.mixer.dt_proj.bias[...] = jnp.asarray(0.5 * rng.standard_normal(cfg.d_inner), jnp.float32)
    return model


def tokens_of(shape, seed=1, vocab=CFG.vocab_size):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


class Jitted:
    """A model's ``step`` and ``forward`` jitted once (eager calls compile every op per shape: slow)."""

    def __init__(self, model: Mamba):
        graphdef, self.state = nnx.split(model)
        self.config = model.config
        self._step = make_mamba_step(model, donate=False)
        self._forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state).forward(tokens))

    def step(self, tokens, conv_state, ssm_state):
        return self._step(self.state, tokens, conv_state, ssm_state)

    def forward(self, tokens):
        return self._forward(self.state, tokens)


@pytest.fixture(scope="module")
def eager_model():
    return make_model()


@pytest.fixture(scope="module")
def model(eager_model):
    return Jitted(eager_model)


# -- against Hugging Face --------------------------------------------------------------------


@pytest.mark.parametrize(
    "tie, bias, chunk, scan",
    [(True, False, 256, "sequential"), (False, True, 4, "chunked")],
    ids=["tied-convbias-sequential", "untied-bias-chunked"],
)
def test_logits_and_states_equal_hf(tie, bias, chunk, scan):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hc = transformers.MambaConfig(
        vocab_size=48,
        hidden_size=16,
        state_size=4,
        num_hidden_layers=2,
        conv_kernel=4,
        expand=2,
        use_bias=bias,
        use_conv_bias=not bias,
        tie_word_embeddings=tie,
    )
    hf = transformers.MambaForCausalLM(hc).eval()
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.add_(0.3 * torch.randn_like(p))
    ids = torch.randint(0, 48, (2, 11))
    with torch.no_grad():
        out = hf(ids, use_cache=True)

    loaded = params_from_hf(hf, scan_chunk=chunk, scan=scan)
    assert loaded.config.tie_embeddings == tie and loaded.config.use_bias == bias and loaded.config.scan == scan
    assert (loaded.lm_head is None) == tie
    ours = Jitted(loaded)
    np.testing.assert_allclose(ours.forward(jnp.asarray(ids.numpy())), out.logits.numpy(), atol=ATOL_HF)

    # the states after the prefill equal HF's cache (HF keeps K conv inputs, channel major)
    conv, ssm = ours.config.zero_states(2)
    logits, conv, ssm = ours.step(jnp.asarray(ids.numpy()), conv, ssm)
    np.testing.assert_allclose(logits, out.logits.numpy(), atol=ATOL_HF)
    for il in range(2):
        hf_conv = out.cache.get_conv_state(il, state_idx=0).numpy()
        np.testing.assert_allclose(conv[il], np.swapaxes(hf_conv, 1, 2)[:, 1:], atol=ATOL_HF)
        np.testing.assert_allclose(ssm[il], out.cache.get_recurrent_state(il, state_idx=0).numpy(), atol=ATOL_HF)

    # and one HF decode step from its cache equals ours from our states
    nxt = torch.randint(0, 48, (2, 1))
    with torch.no_grad():
        hf_next = hf(nxt, cache=out.cache, use_cache=True).logits.numpy()
    np.testing.assert_allclose(ours.step(jnp.asarray(nxt.numpy()), conv, ssm)[0], hf_next, atol=ATOL_HF)

    # loading a bare state dict into a model of the same config gives the same model
    again = Jitted(params_from_hf(hf.state_dict(), Mamba(ours.config, rngs=nnx.Rngs(5))))
    np.testing.assert_array_equal(again.forward(jnp.asarray(ids.numpy())), ours.forward(jnp.asarray(ids.numpy())))


def test_from_hf_config():
    transformers = pytest.importorskip("transformers")
    hc = transformers.MambaConfig(
        vocab_size=50,
        hidden_size=40,
        num_hidden_layers=3,
        state_size=8,
        conv_kernel=3,
        expand=3,
        layer_norm_epsilon=1e-6,
        use_bias=True,
        use_conv_bias=False,
        tie_word_embeddings=False,
        residual_in_fp32=False,
    )
    cfg = MambaConfig.from_hf(hc)
    assert (cfg.vocab_size, cfg.d_model, cfg.n_layer, cfg.d_state, cfg.d_conv, cfg.expand) == (50, 40, 3, 8, 3, 3)
    assert (cfg.dt_rank, cfg.norm_eps, cfg.use_bias, cfg.use_conv_bias) == (3, 1e-6, True, False)
    assert (cfg.tie_embeddings, cfg.residual_in_fp32, cfg.d_inner) == (False, False, 120)
    hc.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act"):
        MambaConfig.from_hf(hc)


# -- the two scans ---------------------------------------------------------------------------


@pytest.mark.parametrize("T", [2, 4, 9, 17])
@pytest.mark.parametrize("keep", [None, 1, 3])
def test_sequential_and_chunked_scans_agree(T, keep):
    """The per-token scan (CPU's default) and the chunked parallel scan give the same outputs and
    states, for lengths inside one chunk, whole chunks and padded chunks (chunk 4)."""
    S, Di, N = 2, 6, 3
    k = jax.random.split(jax.random.PRNGKey(T), 6)
    h0 = jax.random.normal(k[0], (S, Di, N))
    u = jax.random.normal(k[1], (S, T, Di))
    dt = jax.nn.softplus(jax.random.normal(k[2], (S, T, Di)))
    Bm, Cm = jax.random.normal(k[3], (S, T, N)), jax.random.normal(k[4], (S, T, N))
    A = -jnp.exp(jax.random.normal(k[5], (Di, N)))
    if keep is None:
        run = lambda scan: selective_scan(h0, u, dt, Bm, Cm, A, chunk=4, scan=scan)  # noqa: E731
    else:
        run = lambda scan: selective_scan_keep(h0, u, dt, Bm, Cm, A, chunk=4, keep=min(keep, T), scan=scan)  # noqa: E731
    (y1, h1), (y2, h2) = run("sequential"), run("chunked")
    np.testing.assert_allclose(y1, y2, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(h1, h2, atol=ATOL, rtol=RTOL)
    # and both are the recurrence written out
    h, ys = h0, []
    for t in range(T):
        h = jnp.exp(dt[:, t, :, None] * A) * h + (dt[:, t] * u[:, t])[..., None] * Bm[:, t, None, :]
        ys.append(jnp.einsum("sdn,sn->sd", h, Cm[:, t]))
    np.testing.assert_allclose(y1, jnp.stack(ys, 1), atol=ATOL, rtol=RTOL)


def test_auto_scan_is_sequential_on_cpu():
    assert pick_scan("auto") == ("sequential" if jax.default_backend() == "cpu" else "chunked")
    assert MambaConfig().scan == "auto" and pick_scan("chunked") == "chunked"


# -- the stateful step against the uncached pass ---------------------------------------------


def run_pieces(model, tokens, cuts):
    """Step ``tokens [S, T]`` ubatch by ubatch, cut before each index of ``cuts``."""
    conv, ssm = model.config.zero_states(tokens.shape[0])
    out = []
    for a, b in zip((0,) + tuple(cuts), tuple(cuts) + (tokens.shape[1],)):
        logits, conv, ssm = model.step(tokens[:, a:b], conv, ssm)
        out.append(logits)
    return jnp.concatenate(out, axis=1), conv, ssm


# ubatch lengths 1..5 and 9 only, to keep the compilations few
@pytest.mark.parametrize(
    "cuts",
    [tuple(range(1, 9)), (5, 6, 7, 8), (4,), (2, 6)],
    ids=["token-by-token", "prefill-then-decode", "two-ubatches", "short-first-ubatch"],
)
def test_pieces_equal_forward(model, cuts):
    tokens = tokens_of((2, 9))
    full = model.forward(tokens)
    got, conv, ssm = run_pieces(model, tokens, cuts)
    np.testing.assert_allclose(got, full, atol=ATOL)
    # the states do not depend on the cut either (9 tokens with scan_chunk=4: the padded chunked scan)
    _, conv1, ssm1 = run_pieces(model, tokens, ())
    np.testing.assert_allclose(conv, conv1, atol=ATOL, rtol=RTOL)
    np.testing.assert_allclose(ssm, ssm1, atol=ATOL, rtol=RTOL)


def test_state_matters(model):
    """The equalities above can fail: the same tokens from another state give other logits."""
    tokens = tokens_of((2, 9))
    _, conv, ssm = model.step(tokens[:, :4], *CFG.zero_states(2))
    fresh = model.step(tokens[:, 4:], *CFG.zero_states(2))[0]
    continued = model.step(tokens[:, 4:], conv, ssm)[0]
    assert float(jnp.abs(fresh - continued).max()) > 100 * ATOL
    # both the conv and the SSM state carry information
    only_conv = model.step(tokens[:, 4:], conv, jnp.zeros_like(ssm))[0]
    assert float(jnp.abs(only_conv - continued).max()) > 100 * ATOL
    assert float(jnp.abs(only_conv - fresh).max()) > 100 * ATOL


def test_sequences_together_equal_alone(model):
    # two sequences at different points: each starts from its own prefix's state
    _, conv, ssm = model.step(tokens_of((2, 4), seed=3), *CFG.zero_states(2))
    tokens = tokens_of((2, 5), seed=2)
    logits, conv2, ssm2 = model.step(tokens, conv, ssm)
    for s in range(2):
        alone = model.step(tokens[s : s + 1], conv[:, s : s + 1], ssm[:, s : s + 1])
        np.testing.assert_allclose(alone[0], logits[s : s + 1], atol=ATOL)
        np.testing.assert_allclose(alone[1], conv2[:, s : s + 1], atol=ATOL, rtol=RTOL)
        np.testing.assert_allclose(alone[2], ssm2[:, s : s + 1], atol=ATOL, rtol=RTOL)


def test_fork_equals_full_sequences(model):
    """A prefix's state copied to two sequences (seq_cp) that go on differently."""
    prefixes, tail = tokens_of((2, 5), seed=4), tokens_of((2, 4), seed=5)
    _, conv, ssm = model.step(prefixes, *CFG.zero_states(2))
    # the memory's cells: cell 2 holds prefix 0, cells 0, 1, 3 garbage
    conv_all = jax.random.normal(jax.random.key(0), CFG.state_shapes(4)[0]).at[:, 2].set(conv[:, 0])
    ssm_all = jax.random.normal(jax.random.key(1), CFG.state_shapes(4)[1]).at[:, 2].set(ssm[:, 0])
    conv2, ssm2 = select_states((conv_all, ssm_all), jnp.array([2, 2]), jnp.array([1.0, 1.0]))
    got = model.step(tail, conv2, ssm2)[0]
    full = model.forward(jnp.concatenate([jnp.repeat(prefixes[:1], 2, axis=0), tail], axis=1))
    np.testing.assert_allclose(got, full[:, 5:], atol=ATOL)
    # s_mask = 0 clears: the sequence starts over whatever the source cell held
    conv3, ssm3 = select_states((conv_all, ssm_all), jnp.array([2, 0]), jnp.array([True, False]))
    fresh = model.step(tail, *CFG.zero_states(2))[0]
    np.testing.assert_allclose(model.step(tail, conv3, ssm3)[0][1], fresh[1], atol=ATOL)


def test_select_states_gathers_and_zeroes():
    states = jnp.arange(2 * 3 * 2, dtype=jnp.float32).reshape(2, 3, 2).at[1, 1, 0].set(jnp.nan)
    got = select_states({"a": states}, jnp.array([1, 0, 1]), jnp.array([1.0, 1.0, 0.0]))["a"]
    want = np.stack([states[:, 1], states[:, 0], np.zeros((2, 2))], axis=1)
    np.testing.assert_array_equal(got, want)  # the NaN of a cleared row is gone, the kept one stays
    jitted = jax.jit(select_states)(states, jnp.array([1, 0, 1]), jnp.array([1.0, 1.0, 0.0]))
    np.testing.assert_array_equal(jitted, want)


def test_narrow_dtype_keeps_states_and_residual_wide(eager_model):
    """bfloat16 activations: float32 logits and states, close to the float32 model, and
    ``residual_in_fp32`` decides the residual stream's dtype (as in HF)."""
    tokens = tokens_of((2, 9))
    ref = Jitted(eager_model).forward(tokens)
    scale = float(jnp.abs(ref).max())
    outs = {}
    for wide in (True, False):
        cfg = dataclasses.replace(CFG, dtype=jnp.bfloat16, residual_in_fp32=wide)
        narrow = Mamba(cfg, rngs=nnx.Rngs(1))
        nnx.update(narrow, nnx.state(eager_model, nnx.Param))
        logits, conv, ssm = Jitted(narrow).step(tokens, *cfg.zero_states(2))
        assert logits.dtype == conv.dtype == ssm.dtype == jnp.float32
        np.testing.assert_allclose(logits, ref, atol=0.05 * scale)
        outs[wide] = logits
    assert not np.array_equal(outs[True], outs[False])


def test_state_rows_follow_the_seed_layout():
    """llama.cpp's per-cell rows: conv channel major ``row[i * (K-1) + j]``, SSM ``row[i * N + n]``."""
    L, C, K, Di, N = CFG.n_layer, 3, CFG.d_conv, CFG.d_inner, CFG.d_state
    conv = jax.random.normal(jax.random.key(0), (L, C, K - 1, Di))
    ssm = jax.random.normal(jax.random.key(1), (L, C, Di, N))
    k_rows, v_rows = CFG.state_rows(conv, ssm)
    assert k_rows.shape == (L, C, CFG.n_embd_k_s) and v_rows.shape == (L, C, CFG.n_embd_v_s)
    l, c, j, i, n = 1, 2, 1, 5, 3
    assert k_rows[l, c, i * (K - 1) + j] == conv[l, c, j, i]
    assert v_rows[l, c, i * N + n] == ssm[l, c, i, n]


# -- jit ---------------------------------------------------------------------------------------


def test_jit_equals_eager_and_compiles_once_per_shape(eager_model, monkeypatch):
    traces = []
    original = Mamba.step

    def counting(self, *args):
        traces.append(tuple(jnp.shape(args[0])))
        return original(self, *args)

    monkeypatch.setattr(Mamba, "step", counting)
    model = eager_model
    step, state = make_mamba_step(model, donate=False), nnx.state(model)
    conv, ssm = CFG.zero_states(2)
    jitted = step(state, tokens_of((2, 5), seed=6), conv, ssm)
    eager = original(model, tokens_of((2, 5), seed=6), conv, ssm)
    for a, b in zip(jitted, eager):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=RTOL)
    _, conv, ssm = jitted
    nxt = tokens_of((2, 1), seed=10)
    decoded = step(state, nxt, conv, ssm)
    for a, b in zip(decoded, original(model, nxt, conv, ssm)):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=RTOL)
    for seed in range(3):  # new token values and states, same shapes
        _, conv, ssm = step(state, tokens_of((2, 1), seed=11 + seed), conv, ssm)
    step(state, tokens_of((2, 5), seed=20), conv, ssm)
    assert traces == [(2, 5), (2, 1)]  # one trace per shape, none for new values

    # donation: the states passed in are consumed, the results are the same
    donating = make_mamba_step(model)
    _, conv, ssm = decoded
    conv_d, ssm_d = conv + 0, ssm + 0
    out = donating(state, nxt, conv_d, ssm_d)
    for a, b in zip(out, step(state, nxt, conv, ssm)):
        np.testing.assert_array_equal(a, b)


# -- errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("vocab_size", 0),
        ("d_model", -1),
        ("n_layer", 1.5),
        ("d_state", 0),
        ("d_conv", 1),
        ("expand", 0),
        ("dt_rank", 0),
        ("dt_rank", "big"),
        ("norm_eps", 0.0),
        ("use_bias", 1),
        ("tie_embeddings", "yes"),
        ("dtype", jnp.int32),
        ("param_dtype", "nope"),
        ("scan_chunk", 0),
        ("scan", "fast"),
        ("scan", 1),
    ],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field}="):
        MambaConfig(**{field: value})


def test_bad_shapes_name_the_argument(eager_model):
    model = eager_model  # host checks: the token ids are concrete
    conv, ssm = CFG.zero_states(2)
    tok = tokens_of((2, 3))
    cases = [
        (lambda: model.step(tok[0], conv, ssm), "tokens"),
        (lambda: model.step(tok.astype(jnp.float32), conv, ssm), "tokens"),
        (lambda: model.step(tok.at[0, 0].set(CFG.vocab_size), conv, ssm), "tokens contains 40"),
        (lambda: model.step(tok.at[0, 0].set(-1), conv, ssm), "tokens contains -1"),
        (lambda: model.step(tok[:1], conv, ssm), "conv_state"),
        (lambda: model.step(tok, conv, ssm[:, :, :, :3]), "ssm_state"),
        (lambda: model.step(tok, conv.astype(jnp.int32), ssm), "conv_state"),
        (lambda: model.forward(tok[None]), "tokens"),
        (lambda: CFG.zero_states(0), "n="),
        (lambda: select_states(ssm, jnp.array([0, 2]), jnp.ones(2)), "s_copy contains 2"),
        (lambda: select_states(ssm, jnp.array([0.0, 1.0]), jnp.ones(2)), "s_copy"),
        (lambda: select_states(ssm, jnp.array([0, 1]), jnp.ones(3)), "s_mask"),
        (lambda: select_states((ssm, jnp.zeros((2, 3, 1))), jnp.array([0]), jnp.ones(1)), "states_all"),
        (lambda: Mamba(dataclasses.asdict(CFG), rngs=nnx.Rngs(0)), "config"),
        (lambda: make_mamba_step(object()), "model"),
    ]
    for fn, name in cases:
        with pytest.raises(ValueError, match=name):
            fn()


def test_params_from_hf_errors(eager_model, model):
    rng = np.random.default_rng(0)
    sd = {
        "backbone.embeddings.weight": rng.standard_normal((CFG.vocab_size, CFG.d_model)),
        "backbone.norm_f.weight": np.ones(CFG.d_model),
    }
    with pytest.raises(ValueError, match="model is None"):
        params_from_hf(sd)
    with pytest.raises(ValueError, match=r"lacks \['layers.0.norm.weight'"):
        params_from_hf(sd, eager_model)
    with pytest.raises(ValueError, match="hf_model_or_state_dict"):
        params_from_hf([1, 2])
    # a full state dict of our own weights (HF layout) round-trips; a wrong shape or an extra key is refused
    full = dict(sd)
    for il, block in enumerate(eager_model.layers):
        m, p = block.mixer, f"backbone.layers.{il}."
        full.update(
            {
                p + "norm.weight": block.norm.scale[...],
                p + "mixer.in_proj.weight": m.in_proj.kernel[...].T,
                p + "mixer.conv1d.weight": m.conv_kernel[...].T[:, None, :],
                p + "mixer.conv1d.bias": m.conv_bias[...],
                p + "mixer.x_proj.weight": m.x_proj.kernel[...].T,
                p + "mixer.dt_proj.weight": m.dt_proj.kernel[...].T,
                p + "mixer.dt_proj.bias": m.dt_proj.bias[...],
                p + "mixer.A_log": m.A_log[...],
                p + "mixer.D": m.D[...],
                p + "mixer.out_proj.weight": m.out_proj.kernel[...].T,
            }
        )
    full["backbone.embeddings.weight"] = eager_model.embed.embedding[...]
    full["backbone.norm_f.weight"] = eager_model.norm.scale[...]
    copy = Jitted(params_from_hf(full, make_model(seed=9)))
    np.testing.assert_array_equal(copy.forward(tokens_of((1, 4))), model.forward(tokens_of((1, 4))))
    with pytest.raises(ValueError, match=r"layers.1.mixer.A_log has shape \(32, 3\)"):
        params_from_hf({**full, "backbone.layers.1.mixer.A_log": np.zeros((32, 3))}, make_model(seed=9))
    with pytest.raises(ValueError, match="unexpected keys"):
        params_from_hf({**full, "backbone.layers.2.norm.weight": np.ones(16)}, make_model(seed=9))
