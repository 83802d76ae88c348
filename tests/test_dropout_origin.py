"""The 12-word block state (`docs/kernel_abi.md`, "A block of a larger problem"): a kernel
called on a block of a problem, with the block's origin, draws that block of the whole problem's
keep-mask, and applies the causal and window rules at the block's global positions. This is what
a sharded call's devices and context parallelism's block calls do; here the block is cut by hand
on one device, so the CUDA kernels are checked too (on a GPU).

Reference: the same kernel on the whole problem, sliced. Every row of the block is computed from
the same inputs by the same kernel in both calls, so outputs and gradients agree to float32
rounding (1e-6; they are usually bitwise equal).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HAS_FLASH

import attnaux as ax
from attnaux import _ffi
from attnaux._internal import canonical_problem
from attnaux._partition import dropout_origin

B, S, H, KV, D = 4, 24, 4, 2, 8
RATE = 0.4
TOL = 1e-6


def _backend(name: str):
    if name == "flash":
        from attnaux import _flash_cpu as module
    elif name == "probs_cpu":
        from attnaux import _probs_cpu as module
    elif name == "probs_cuda":
        from attnaux import _probs_cuda as module
    else:
        from attnaux import _small_seq as module
    return module


CASES = [
    pytest.param("flash", "cpu", marks=pytest.mark.skipif(not HAS_FLASH, reason="not built")),
    pytest.param("probs_cpu", "cpu", marks=pytest.mark.skipif(not HAS_FLASH, reason="not built")),
    pytest.param("small_seq", "cpu", marks=pytest.mark.skipif(not HAS_FLASH, reason="not built")),
    pytest.param("probs_cuda", "gpu", marks=pytest.mark.gpu),
    pytest.param("small_seq", "gpu", marks=pytest.mark.gpu),
]


def _setup(backend: str, platform: str, seed: int):
    """The backend module, `(q_seq, kv_seq)` and float32 `q, k, v` of a case (skips a GPU case
    without CUDA kernels)."""
    if platform == "gpu" and (_ffi.ext_cuda() is None or _ffi.KERNELS_CUDA_ERROR is not None):
        pytest.skip("no CUDA kernels in this build")
    q_seq, kv_seq = (1, 12) if backend == "small_seq" else (S, S)
    ks = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(ks[0], (B, q_seq, H, D), jnp.float32)
    k = jax.random.normal(ks[1], (B, kv_seq, KV, D), jnp.float32)
    v = jax.random.normal(ks[2], (B, kv_seq, KV, D), jnp.float32)
    return _backend(backend), (q_seq, kv_seq), (q, k, v)


@pytest.mark.parametrize(("backend", "platform"), CASES)
def test_a_block_draws_its_part_of_the_whole_mask(backend, platform):
    module, (q_seq, kv_seq), (q, k, v) = _setup(backend, platform, 0)
    causal = backend != "small_seq"
    problem = canonical_problem(q, k, v, dropout_rate=RATE, key=jax.random.key(5), causal=causal)
    arrays, options = problem.arrays, problem.options
    device = jax.devices(platform)[0]
    arrays = jax.device_put(arrays, device)

    def run(a):
        return module.run(a, options, False)[0]

    def loss(q, k, v, a):
        return jnp.sum(jnp.sin(run(a._replace(q=q, k=k, v=v))))

    full = jax.jit(run)(arrays)
    full_grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(arrays.q, arrays.k, arrays.v, arrays)
    # the block: batch rows 1..2, query heads 2..3 (kv head 1 under GQA 4:2)
    b0, b1, h0, h1, g = 1, 3, 2, 4, H // KV
    block = arrays._replace(
        q=arrays.q[b0:b1, :, h0:h1], k=arrays.k[b0:b1, :, h0 // g:h1 // g],
        v=arrays.v[b0:b1, :, h0 // g:h1 // g], q_seqlens=arrays.q_seqlens[b0:b1],
        kv_seqlens=arrays.kv_seqlens[b0:b1],
        rng_state=dropout_origin(arrays.rng_state, jnp.int32(b0), jnp.int32(h0), H, q_seq, kv_seq),
    )
    assert block.rng_state.shape == (12,)
    part = jax.jit(run)(block)
    np.testing.assert_allclose(np.asarray(part), np.asarray(full[b0:b1, :, h0:h1]), rtol=TOL,
                               atol=TOL, err_msg="out of the block")
    # the mask is really in play: the block's own 4-word state draws another mask
    other = jax.jit(run)(block._replace(rng_state=arrays.rng_state))
    assert not np.allclose(np.asarray(other), np.asarray(part), atol=1e-3)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(block.q, block.k, block.v, block)
    want = (full_grads[0][b0:b1, :, h0:h1], full_grads[1][b0:b1, :, h0 // g:h1 // g],
            full_grads[2][b0:b1, :, h0 // g:h1 // g])
    for got, expected, name in zip(grads, want, ("dq", "dk", "dv")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-5,
                                   err_msg=name)


@pytest.mark.parametrize(("backend", "platform"), CASES)
@pytest.mark.parametrize("shift", [-9, 0, 7, 40])
def test_a_block_state_shifts_the_causal_and_window_rules(backend, platform, shift):
    """Without dropout, a 12-word block state's word 11 shifts the diagonal: the block whose
    queries start at global position q0 and keys at k0 = q0 - shift sees key j from query i iff
    `k0 + j <= q0 + i` and the window holds at those global positions. Reference: the pure-JAX
    backend with that visibility as an explicit boolean mask."""
    module, (q_seq, kv_seq), (q, k, v) = _setup(backend, platform, 1)
    window = (5, 2)
    problem = canonical_problem(q, k, v, causal=True, window=window)
    state = jnp.zeros((12,), jnp.uint32).at[11].set(
        jax.lax.bitcast_convert_type(jnp.int32(shift), jnp.uint32))
    arrays = jax.device_put(problem.arrays._replace(rng_state=state), jax.devices(platform)[0])
    out, lse, row_max, _ = jax.jit(lambda a: module.run(a, problem.options, False))(arrays)
    i = np.arange(q_seq)[:, None] + shift
    j = np.arange(kv_seq)[None, :]
    visible = (j <= i) & (j >= i - window[0]) & (j <= i + window[1])
    want, want_aux = ax.attention(q, k, v, mask=jnp.asarray(visible), backend="reference")
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(lse), np.asarray(want_aux.lse), rtol=1e-5, atol=1e-5)
