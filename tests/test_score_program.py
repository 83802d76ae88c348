"""Score programs (`attnaux._score_program`): `score_mod`/`mask_mod` translated for the compiled
kernels, checked by running the NumPy reference interpreter (`evaluate`) of the specification
against the JAX functions themselves (vectorised as `_flex` does) on a grid of batch, head,
query and key indices, once as they are and once shifted to negative positions (where integer
division and remainder differ between C and Python rounding)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnaux import _flex
from attnaux._score_program import (
    MAGIC,
    N_INPUTS,
    Op,
    ScoreProgram,
    Untranslatable,
    evaluate,
    pack_consts,
    translate,
    unpack_gradients,
)

B, H, Q, K = 2, 3, 7, 9
S32 = jnp.zeros((), jnp.float32)
I32 = jnp.zeros((), jnp.int32)
SHIFTS = {"grid": (0, 0), "negative": (-3, -4)}  # added to (q_idx, kv_idx)

_rng = np.random.default_rng(0)
SCORES = (_rng.standard_normal((B, H, Q, K)) * 4).astype(np.float32)
SLOPES = jnp.asarray(2.0 ** -np.arange(1, H + 1), jnp.float32)
TABLE = jnp.asarray(_rng.standard_normal((32, H)), jnp.float32)
GATE = jnp.asarray(_rng.standard_normal(H), jnp.float32)
DOCS_NP = np.array([[0, 0, 1, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 3, 3, 3]], np.int32)
DOCS = jnp.asarray(DOCS_NP)


def _indices(shift):
    dq, dk = shift
    return (np.arange(B, dtype=np.int32), np.arange(H, dtype=np.int32),
            np.arange(Q, dtype=np.int32) + dq, np.arange(K, dtype=np.int32) + dk)


def _grid(b, h, q, k):
    return (b[:, None, None, None], h[None, :, None, None], q[None, None, :, None],
            k[None, None, None, :])


def _program(score_mod=None, mask_mod=None):
    """`(program, flat consts, score_fn, mask_fn, score consts, mask consts)` as `_flex.convert`
    closure-converts the functions."""
    score_fn = mask_fn = None
    cs, cm = [], []
    if score_mod is not None:
        score_fn, cs = jax.closure_convert(score_mod, S32, I32, I32, I32, I32)
    if mask_mod is not None:
        mask_fn, cm = jax.closure_convert(mask_mod, I32, I32, I32, I32)
    consts = (*cs, *cm)
    program, extras = translate(score_fn, len(cs), mask_fn, len(cm), consts)
    _check_layout(program)
    return program, np.asarray(pack_consts(program, consts, extras)), score_fn, mask_fn, cs, cm


def _check_layout(program: ScoreProgram):
    w = program.words
    assert w[:2] == (MAGIC, 1)
    n_regs, n_instr, _, _, n_consts, n_lits = w[2:8]
    assert n_regs == N_INPUTS + n_instr and n_lits == len(program.literals)
    assert len(w) == 8 + 7 * n_consts + 7 * n_instr
    at = 8 + 7 * n_consts
    for k in range(n_instr):
        assert w[at + 7 * k + 1] == N_INPUTS + k  # SSA: dst = 5 + k
    hash(program)


def check_score(score_mod, shift="grid"):
    program, flat, score_fn, _, cs, _ = _program(score_mod=score_mod)
    b, h, q, k = _indices(SHIFTS[shift])
    got, mask = evaluate(program, flat, SCORES, *_grid(b, h, q, k))
    assert mask is None
    want = np.asarray(_flex.vectorize_score_mod(score_fn, len(cs))(SCORES, b, h, q, k, *cs),
                      np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    return program


def check_mask(mask_mod, shift="grid"):
    program, flat, _, mask_fn, _, cm = _program(mask_mod=mask_mod)
    b, h, q, k = _indices(SHIFTS[shift])
    score, got = evaluate(program, flat, SCORES, *_grid(b, h, q, k))
    assert score is None and got.dtype == bool
    want = np.asarray(_flex.vectorize_mask_mod(mask_fn, len(cm))(b, h, q, k, *cm))
    np.testing.assert_array_equal(got, want)
    assert 0 < want.sum() < want.size or mask_mod is _ALL  # a mask that tests something
    return program


def _t5_bucket(rel):
    """T5's log-bucketed relative position (bidirectional, 32 buckets, exact below 8)."""
    n, exact = 16, 8
    offset = jnp.where(rel > 0, n, 0)
    a = jnp.abs(rel)
    large = exact + (jnp.log(a.astype(jnp.float32) / exact + 1e-6) / np.log(128 / exact)
                     * (n - exact)).astype(jnp.int32)
    large = jnp.minimum(large, n - 1)
    return offset + jnp.where(a < exact, a, large)


SCORE_MODS = {
    "identity": lambda s, b, h, i, j: s,
    "alibi": lambda s, b, h, i, j: s - SLOPES[h] * jnp.abs(i - j),
    "t5_table": lambda s, b, h, i, j: s + TABLE[jnp.clip(j - i + 16, 0, 31), h],
    "t5_log_buckets": lambda s, b, h, i, j: s + TABLE[_t5_bucket(j - i), h],
    "softcap": lambda s, b, h, i, j: 30 * jnp.tanh(s / 30),
    "tanh_gate": lambda s, b, h, i, j: s * (1 + jnp.tanh(GATE[h] * s)),
    "sigmoid_gate": lambda s, b, h, i, j: s * jax.nn.sigmoid(GATE[h]),
    "causal_inf": lambda s, b, h, i, j: jnp.where(i >= j, s, -jnp.inf),
    "relu": lambda s, b, h, i, j: jax.nn.relu(s),
    "gelu_tanh": lambda s, b, h, i, j: jax.nn.gelu(s, approximate=True),
    "maximum": lambda s, b, h, i, j: jnp.maximum(s, -1.5),
    "clip": lambda s, b, h, i, j: jnp.clip(s, -1.0, 2.0) + jnp.clip(i - j, -2, 2),
    "square": lambda s, b, h, i, j: s ** 2,
    "cube_inverse": lambda s, b, h, i, j: s ** 3 + 1 / (s ** 2 + 1),
    "sqrt_abs": lambda s, b, h, i, j: jnp.sqrt(jnp.abs(s) + 1),
    "round_floor": lambda s, b, h, i, j: jnp.round(s * 2) + jnp.floor(s) + jnp.ceil(s)
    + jax.lax.round(s, jax.lax.RoundingMethod.AWAY_FROM_ZERO),
    "float_to_int": lambda s, b, h, i, j: (s * 3).astype(jnp.int32) + jnp.sign(s),
    "exp_log": lambda s, b, h, i, j: jnp.log1p(jnp.exp(-jnp.abs(s))) + jnp.exp2(s / 8)
    - jnp.expm1(s / 4) + jax.lax.rsqrt(jnp.abs(s) + 1) + jnp.log(jnp.abs(s) + 1),
    "float_rem_pow": lambda s, b, h, i, j: jnp.fmod(s, 1.5) + (jnp.abs(s) + 1) ** (s / 4),
    "float_div": lambda s, b, h, i, j: s / (1.0 + h) - s / (j - i + 0.5),
    "take_fill": lambda s, b, h, i, j: s + jnp.nan_to_num(jnp.take(TABLE[:, h], j - i + 3)),
    "arange_constant": lambda s, b, h, i, j: s + jnp.arange(10)[j] * 0.5,
    "stop_gradient": lambda s, b, h, i, j: s * jax.lax.stop_gradient(s),
    "custom_vjp": lambda s, b, h, i, j: _custom_double(s) + i,
}


@jax.custom_vjp
def _custom_double(x):
    return 2 * x


_custom_double.defvjp(lambda x: (2 * x, None), lambda _, g: (2 * g,))


def _all(b, h, i, j):
    return i > -100


_ALL = _all
MASK_MODS = {
    "documents_numpy": lambda b, h, i, j: jnp.asarray(DOCS_NP)[b, i] == jnp.asarray(DOCS_NP)[b, j],
    "documents_jnp": lambda b, h, i, j: DOCS[b, i] == DOCS[b, j],
    "prefix_lm": lambda b, h, i, j: (j <= i) | (j < 3),
    "sliding_window_sink": lambda b, h, i, j: (i - j < 4) & (j <= i) | (j == 0),
    "dilated": lambda b, h, i, j: (i - j) % 2 == 0,
    "dilated_3": lambda b, h, i, j: (i - j) % 3 == 1,
    "dilated_c_rem": lambda b, h, i, j: jax.lax.rem(i - j, 3) == -1,
    "integer_division": lambda b, h, i, j: (i // 3) == (j // 3),
    "c_division": lambda b, h, i, j: jax.lax.div(i - j, 3) == jax.lax.div(j, 2),
    "rem_by_index": lambda b, h, i, j: jax.lax.rem(i, j - 2) == jax.lax.rem(j, 3),
    "div_by_index": lambda b, h, i, j: jax.lax.div(i + 1, j - 2) == -1,
    "per_head": lambda b, h, i, j: jnp.logical_xor(h == 1, j <= i) & ~(i == j + 5),
    "float_threshold": lambda b, h, i, j: SLOPES[h] * (i - j) < 0.6,
}


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("name", SCORE_MODS)
def test_score_mod_matches_jax(name, shift):
    check_score(SCORE_MODS[name], shift)


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("name", MASK_MODS)
def test_mask_mod_matches_jax(name, shift):
    check_mask(MASK_MODS[name], shift)


def test_c_semantics_of_integer_division_and_remainder():
    """Negative operands: IDIV truncates toward zero, REM takes the dividend's sign; a zero
    divisor gives -1 and the dividend (XLA's rules), which `jnp.floor_divide`/`%` build on."""
    program, flat, *_ = _program(score_mod=lambda s, b, h, i, j: (
        jax.lax.div(i, j) * 100 + jax.lax.rem(i, j)).astype(jnp.float32))
    i = np.array([-7, 7, -7, 7, 5, -5], np.float32)
    j = np.array([2, -2, -2, 2, 0, 0], np.float32)
    got, _ = evaluate(program, flat, 0.0, 0, 0, i, j)
    np.testing.assert_array_equal(got, [-301, -299, 299, 301, -95, -105])
    ii, jj = jnp.asarray(i, jnp.int32), jnp.asarray(j, jnp.int32)
    np.testing.assert_array_equal(got, jax.lax.div(ii, jj) * 100 + jax.lax.rem(ii, jj))


def test_mask_program_with_all():
    check_mask(_ALL)


def test_both_functions_in_one_program():
    """One program, the index registers shared; the consts passed explicitly (as
    `jax.closure_convert` hoists traced arrays): a float score const, an int mask const."""

    def score_fn(s, b, h, i, j, slopes):
        return s - slopes[h] * jnp.abs(i - j)

    def mask_fn(b, h, i, j, docs):
        return (docs[b, i] == docs[b, j]) & (j <= i)

    consts = (SLOPES, DOCS)
    program, extras = translate(score_fn, 1, mask_fn, 1, consts)
    _check_layout(program)
    assert extras == () and program.n_user_consts == 2
    assert program.const_shapes == ((H,), DOCS.shape) and program.differentiable == (True, False)
    flat = np.asarray(pack_consts(program, consts, extras))
    for shift in SHIFTS.values():
        b, h, q, k = _indices(shift)
        got_s, got_m = evaluate(program, flat, SCORES, *_grid(b, h, q, k))
        want_s = _flex.vectorize_score_mod(score_fn, 1)(SCORES, b, h, q, k, SLOPES)
        want_m = _flex.vectorize_mask_mod(mask_fn, 1)(b, h, q, k, DOCS)
        np.testing.assert_allclose(got_s, want_s, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got_m, want_m)


def test_closed_over_constants_become_extras():
    """Concrete arrays stay constants of the jaxpr (`closure_convert` hoists tracers only):
    they follow the user consts in the table, without gradient; as do arrays computed from
    constants alone (`TABLE @ TABLE.T`, `jnp.arange`)."""
    program = check_score(lambda s, b, h, i, j: s + SLOPES[h] + (TABLE @ TABLE.T)[i, j]
                          + jnp.arange(10)[j])
    assert program.n_user_consts == 0
    assert program.const_shapes == ((H,), (32, 32), (10,))
    assert program.differentiable == (False,) * 3


def test_dead_code_is_pruned():
    def score_mod(s, b, h, i, j):
        unused = jnp.exp(s) * TABLE[i, h]  # noqa: F841
        return s + 1

    program = check_score(score_mod)
    ops = program.words[8 + 7 * len(program.const_shapes)::7]
    assert sorted(ops) == [Op.LIT, Op.ADD]


def test_untranslatable_primitive_names_it():
    with pytest.raises(Untranslatable, match="`score_mod` uses `cos`") as info:
        _program(score_mod=lambda s, b, h, i, j: jnp.cos(s))
    assert info.value.function == "score_mod" and info.value.primitive == "cos"
    with pytest.raises(Untranslatable, match="`mask_mod` uses `cos`"):
        _program(mask_mod=lambda b, h, i, j: jnp.cos(i.astype(jnp.float32)) > 0)


@pytest.mark.parametrize("fn, primitive", [
    (lambda s, b, h, i, j: s + jnp.sum(TABLE[:, h]), "reduce_sum"),
    (lambda s, b, h, i, j: s + (i & j), "bitwise and on int32"),
    (lambda s, b, h, i, j: s + TABLE[i + 2**25, h], "the integer literal 33554432"),
    (lambda s, b, h, i, j: s + jnp.dot(TABLE[:, h], TABLE[:, 0]), "dot_general"),
    (lambda s, b, h, i, j: jnp.stack([s, s * 2])[i], "stack"),
    (lambda s, b, h, i, j: s + TABLE[:, h][::2][i], "slice"),
    (lambda s, b, h, i, j: jax.lax.reduce_precision(s, 5, 10), "reduce_precision"),
])
def test_untranslatable_constructs(fn, primitive):
    with pytest.raises(Untranslatable) as info:
        _program(score_mod=fn)
    assert info.value.primitive == primitive


def test_untranslatable_five_dimensional_capture():
    big = jnp.ones((2, 1, 1, 1, 3))
    with pytest.raises(Untranslatable, match="5 dimensions") as info:
        _program(score_mod=lambda s, b, h, i, j: s + big[b, 0, 0, 0, h])
    assert info.value.function == "score_mod"


def test_untranslatable_bfloat16_cast():
    with pytest.raises(Untranslatable, match="bfloat16") as info:
        _program(score_mod=lambda s, b, h, i, j: (s.astype(jnp.bfloat16) * 3).astype(
            jnp.float32))
    assert info.value.primitive == "convert_element_type to bfloat16"


def test_pack_and_unpack_round_trip():
    table = jnp.asarray(TABLE, jnp.float32)
    scale = jnp.asarray(0.5, jnp.float16)  # a float const that is not float32
    idx = jnp.asarray(np.arange(H), jnp.int32)
    width = jnp.asarray(np.array([[2.0, 3.0]]), jnp.float32)  # a mask const: no gradient

    def score_fn(s, b, h, i, j, table, scale, idx):
        return s + table[j - i + 16, idx[h]] * scale.astype(jnp.float32)

    def mask_fn(b, h, i, j, width):
        return (i - j) < width[0, 1]

    consts = (table, scale, idx, width)
    with pytest.raises(Untranslatable, match="float16"):  # the float16 cast changes rounding
        translate(score_fn, 3, mask_fn, 1, consts)

    def score_fn32(s, b, h, i, j, table, scale, idx):
        return s + table[j - i + 16, idx[h]] * scale

    consts = (table, scale.astype(jnp.float32), idx, width)
    program, extras = translate(score_fn32, 3, mask_fn, 1, consts)
    assert extras == ()
    assert program.const_shapes == ((32, H), (), (H,), (1, 2))
    assert program.differentiable == (True, True, False, False)
    flat = pack_consts(program, consts, extras)
    assert flat.dtype == jnp.float32 and flat.shape == (program.size,) == (32 * H + 1 + H + 2,)
    np.testing.assert_array_equal(flat[:32 * H], np.ravel(table))
    grads = unpack_gradients(program, np.arange(program.size, dtype=np.float32), consts)
    assert [g.shape for g in grads] == [c.shape for c in consts]
    assert [g.dtype for g in grads] == [jnp.float32, jnp.float32, jax.dtypes.float0,
                                        jnp.float32]
    np.testing.assert_array_equal(grads[0], np.arange(32 * H).reshape(32, H))
    assert grads[1] == 32 * H
    # gradients keep the const's own dtype
    half = (table.astype(jnp.bfloat16), *consts[1:])
    assert unpack_gradients(program, flat, half)[0].dtype == jnp.bfloat16


def test_translate_under_jit_with_traced_consts():
    def score_fn(s, b, h, i, j, slopes):
        return s - slopes[h] * jnp.abs(i - j)

    programs = []

    @jax.jit
    def packed(slopes):
        program, extras = translate(score_fn, 1, None, 0, (slopes,))
        programs.append(program)
        return pack_consts(program, (slopes,), extras)

    flat = packed(SLOPES)
    np.testing.assert_array_equal(flat, SLOPES)
    again, _ = translate(score_fn, 1, None, 0, (SLOPES,))
    assert programs[0] == again and hash(programs[0]) == hash(again)
    assert again.attrs()["program"].dtype == np.int32
    assert again.attrs()["literals"].dtype == np.float32


def test_literal_bits_distinguish_programs():
    p0, _ = translate(lambda s, b, h, i, j: s * 0.0, 0, None, 0, ())
    p1, _ = translate(lambda s, b, h, i, j: s * -0.0, 0, None, 0, ())
    pn, _ = translate(lambda s, b, h, i, j: s * jnp.nan, 0, None, 0, ())
    pn2, _ = translate(lambda s, b, h, i, j: s * jnp.nan, 0, None, 0, ())
    assert p0 != p1 and pn == pn2 and hash(pn) == hash(pn2)
