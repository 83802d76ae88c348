"""Philox-4x32-10 and attnaux's dropout keep-mask, in pure JAX.

The compiled kernels draw the dropout keep-mask from the same function (see
`docs/kernel_abi.md`): element `(b, h, i, j)` of the `[B, heads, q_seq, kv_seq]` probabilities has
the linear index `e`, counter `(lo32(e >> 2), hi32(e >> 2), offset_lo, offset_hi)`, key
`(seed_lo, seed_hi)`, and uses word `e & 3` of the Philox output. Everything here is 32-bit
integer arithmetic, so it needs no `jax_enable_x64`.
"""

import jax
import jax.numpy as jnp
import numpy as np

_M0 = np.uint32(0xD2511F53)
_M1 = np.uint32(0xCD9E8D57)
_W0 = np.uint32(0x9E3779B9)
_W1 = np.uint32(0xBB67AE85)


def mulhilo(a: jax.Array, b) -> tuple[jax.Array, jax.Array]:
    """(hi, lo) 32-bit halves of the 64-bit product of uint32 `a` and `b` (a constant or a
    uint32 scalar), from 16-bit halves: only 32-bit operations, so it runs inside the Hopper
    kernels too (`_flash_hopper`), where there is no 64-bit type."""
    b = jnp.asarray(b, jnp.uint32)
    a0, a1 = a & 0xFFFF, a >> 16
    b0, b1 = b & 0xFFFF, b >> 16
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    mid = (p00 >> 16) + (p01 & 0xFFFF) + (p10 & 0xFFFF)
    hi = p11 + (p01 >> 16) + (p10 >> 16) + (mid >> 16)
    return hi, a * b


def add_with_carry(hi: jax.Array, lo: jax.Array, x) -> tuple[jax.Array, jax.Array]:
    """`(hi, lo) + x` for a 64-bit number in two uint32 words and a uint32 `x` (arrays that
    broadcast): the low word wraps and carries into the high one."""
    new_lo = lo + jnp.asarray(x, jnp.uint32)
    return hi + (new_lo < lo).astype(jnp.uint32), new_lo


def philox4x32_10(counter: tuple[jax.Array, ...], key: tuple[jax.Array, jax.Array],
                  mulhilo=mulhilo):
    """Random123's Philox-4x32 with 10 rounds, elementwise over uint32 arrays. `mulhilo`:
    how `(hi, lo)` of a product with a constant is computed (the Hopper kernels pass their
    hardware multiply)."""
    c0, c1, c2, c3 = (jnp.asarray(c, jnp.uint32) for c in counter)
    k0, k1 = (jnp.asarray(x, jnp.uint32) for x in key)
    for round_index in range(10):
        if round_index:
            k0, k1 = k0 + _W0, k1 + _W1
        hi0, lo0 = mulhilo(c0, _M0)
        hi1, lo1 = mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def keep_threshold(rate: float) -> np.uint32:
    """Words at or above this threshold keep their element.

    The one definition every implementation uses (`docs/kernel_abi.md`): the rate is first
    rounded to float32, the type of the kernels' `dropout_rate` attribute, then
    `threshold = uint32(min(floor(float32(rate) * 2**32), 2**32 - 1))`, computed exactly in
    float64. Rounding first keeps the pure-JAX mask bit-identical to the kernels' for rates such
    as 0.7 whose float64 and float32 values straddle a multiple of 2**-32."""
    rate32 = float(np.float32(rate))
    return np.uint32(min(int(np.floor(rate32 * 2.0**32)), 2**32 - 1))


def keep_word(rng_state, e_hi: jax.Array, e_lo: jax.Array, mulhilo=mulhilo) -> jax.Array:
    """The Philox word of the elements with linear index `e = e_hi * 2**32 + e_lo` (uint32
    arrays that broadcast): counter `(lo32(e >> 2), hi32(e >> 2), offset)`, key `seed`, word
    `e & 3` (`docs/kernel_abi.md`). `rng_state`: the seed and offset words (a uint32 array or
    a sequence of four uint32 scalars). Only 32-bit operations and two-way selects, so the
    Hopper kernels trace this same function (with their own `mulhilo`)."""
    seed_lo, seed_hi, off_lo, off_hi = (rng_state[i] for i in range(4))
    g_lo = (e_lo >> 2) | (e_hi << 30)
    g_hi = e_hi >> 2
    w0, w1, w2, w3 = philox4x32_10((g_lo, g_hi, off_lo, off_hi), (seed_lo, seed_hi), mulhilo)
    lane = e_lo & 3
    return jnp.where(lane < 2, jnp.where(lane == 0, w0, w1), jnp.where(lane == 2, w2, w3))


def keep_at(rng_state: jax.Array, rate: float, row: jax.Array, col: jax.Array,
            kv_total) -> jax.Array:
    """The keep bits of the elements at softmax row `row` (uint32, `(b * Hq + h) * Sq + i` in
    the whole problem) and key `col` of a problem with `kv_total` keys per row (arrays that
    broadcast; `kv_total` may be traced): `e = row * kv_total + col` in 64 bits, then the
    documented counter, key and word (`docs/kernel_abi.md`)."""
    rng_state = jnp.asarray(rng_state, jnp.uint32)
    e_hi, e_lo = add_with_carry(*mulhilo(jnp.asarray(row, jnp.uint32), kv_total), col)
    return keep_word(rng_state, e_hi, e_lo) >= keep_threshold(rate)


def dropout_keep_mask(
    rng_state: jax.Array, rate: float, batch: int, heads: int, q_seq: int, kv_seq: int,
    columns: jax.Array | None = None,
) -> jax.Array:
    """The `bool[batch, heads, q_seq, kv_seq]` keep-mask that the kernels use; with `columns`
    (`int[n]` key positions) only those columns, `bool[batch, heads, q_seq, n]`."""
    rows = batch * heads * q_seq
    if rows >= 2**32:
        raise ValueError(
            f"dropout over {rows} softmax rows (batch * heads * q_seq) exceeds 2**32 rows."
        )
    row = jnp.arange(rows, dtype=jnp.uint32).reshape(batch, heads, q_seq, 1)
    if columns is None:
        columns = jnp.arange(kv_seq, dtype=jnp.uint32)
    col = columns.astype(jnp.uint32).reshape(1, 1, 1, -1)
    return keep_at(rng_state, rate, row, col, np.uint32(kv_seq))
