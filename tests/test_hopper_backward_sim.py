"""The Hopper backward's kernels (`_flash_hopper.backward`: dK/dV, with dQ reduce-added inside it or
in a second kernel), run whole on the CPU against a model of the GPU they rely on.

`backward` meets the GPU only through `_pallas()` (`pl`, `plgpu`) and `lax.axis_index`; here they
are replaced by a simulation, and the kernels' own code runs unchanged:

- a CTA is three Python threads (two consumer warpgroups and the producer), the grid's CTAs run
  one after another; `lax.axis_index` answers per thread;
- mbarriers: a fixed number of arrivals completes a phase; a wait is on the waiter's own parity
  bit (flipped at every wait, as Mosaic GPU tracks it), so a barrier two phases ahead of a waiter
  is a protocol error, and a wait that never completes is a deadlock (a timeout here);
- shared memory keeps a log of writes. A matrix product reads its shared-memory operands from its
  issue until it is awaited: products retire in issue order, `wgmma_accumulator_load(wait_n=n)`
  leaves the newest n in flight and a scope's end (`run_scoped`/`run_state`) awaits all. A bulk
  copy to global memory reads its source until `wait_smem_to_gmem` covers it. A write to what an
  unfinished read covers, by any thread, is a race. Threads sleep at random inside products so
  interleavings vary;
- the products in float64, TMA copies at once, `reduction_op="add"` as an addition.

The gradients must equal a float64 NumPy reference (float32 inputs, so no bfloat16 rounding of
P or dS), or, with a score function, `jax.vjp` of the same function in float32. What it cannot
see: registers, layouts, ptxas; the GPU tests (`test_hopper.py`) and `tests/sanitize_hopper.py`
cover those. The threads and mbarriers are `mbarrier_model`'s, shared with `test_hopper_walk.py`.
"""

import dataclasses
import random
import sys
import threading
import time
import types

import jax
import jax.numpy as jnp
import mbarrier_model
import numpy as np
import pytest
from mbarrier_model import Barrier, Indexed, ProtocolError, loop, when

from attnaux import _flash_hopper as fh

TIMEOUT_S = 10.0


class Machine(mbarrier_model.Machine):
    """One simulated CTA's shared state, with a log of shared-memory writes to check reads
    against."""

    def __init__(self, seed):
        super().__init__(TIMEOUT_S)
        self.writes = []  # (memory name, key), in order: a read remembers the length at issue
        self.lock = threading.Lock()
        self.rng = random.Random(seed)

    def thread_state(self):
        local = self.local
        if not hasattr(local, "products"):
            local.products, local.copies = [], []  # products: each one's reads, oldest first
        return local

    def record_write(self, view):
        with self.lock:
            self.writes.append((view.mem.name, view.key()))

    def now(self):
        with self.lock:
            return len(self.writes)

    def check_reads(self, reads, what):
        """Fails if a write since a read's issue overlapped what it read."""
        with self.lock:
            writes = list(self.writes)
        for name, key, since in reads:
            for w_name, w_key in writes[since:]:
                shorter = min(len(key), len(w_key))
                if w_name == name and key[:shorter] == w_key[:shorter]:
                    self.fail(f"{threading.current_thread().name}: {name}{list(key)} was "
                              f"rewritten ({w_name}{list(w_key)}) while {what} still read it")


class Mem:
    """A shared- or global-memory array; `View`s index into it."""

    def __init__(self, machine, name, value):
        self.m, self.name, self.value = machine, name, value


def _index(i):
    if isinstance(i, slice):
        return i
    return int(i)


class View:
    def __init__(self, mem, chain=(), transposed=False):
        self.mem, self.chain, self.transposed = mem, chain, transposed

    @property
    def at(self):
        view = self

        class At:
            def __getitem__(self, idx):
                idx = idx if isinstance(idx, tuple) else (idx,)
                return View(view.mem, view.chain + (tuple(_index(i) for i in idx),))
        return At()

    def key(self):
        """The leading integer indices: what a write or a read covers (a slice covers all)."""
        out = []
        for idx in self.chain:
            for i in idx:
                if not isinstance(i, int):
                    return tuple(out)
                out.append(i)
        return tuple(out)

    def _sub(self):
        x = self.mem.value
        for idx in self.chain:
            x = x[idx]
        return x

    @property
    def shape(self):
        s = self._sub().shape
        return s[::-1] if self.transposed else s

    def array(self):
        x = np.array(self._sub())
        return x.T if self.transposed else x

    def transpose(self, axes):
        assert tuple(axes) == (1, 0)
        return View(self.mem, self.chain, not self.transposed)

    def __getitem__(self, idx):
        assert idx is Ellipsis
        return jnp.asarray(self.array())

    def __setitem__(self, idx, value):
        assert idx is Ellipsis and not self.transposed
        self._sub()[...] = np.asarray(value).astype(self.mem.value.dtype)
        self.mem.m.record_write(self)


@dataclasses.dataclass
class SmemSpec:
    shape: tuple
    dtype: object


@dataclasses.dataclass
class BarrierSpec:
    num_arrivals: int
    num_barriers: int


class Acc:
    def __init__(self, value):
        self.value = np.array(value, np.float64)

    def __getitem__(self, idx):
        assert idx is Ellipsis
        return jnp.asarray(self.value, jnp.float32)


class Holder:
    """A host-level `pl.run_state` ref (the fused dQ's zeroed sum, the dK/dV kernel's outputs):
    an array the simulated kernel writes in place."""

    def __init__(self, value):
        self.value = np.array(value)

    def __setitem__(self, idx, value):
        assert idx is Ellipsis
        self.value[...] = np.asarray(value)


def make_pallas(machine, sleep_s):
    state = machine.thread_state

    def retire_products(in_flight=0):
        """Awaits the products issued before the newest `in_flight`."""
        local = state()
        done = local.products[:max(0, len(local.products) - in_flight)]
        for reads in done:
            machine.check_reads(reads, "a matrix product")
        del local.products[:len(done)]

    def run_scoped(f, *specs):
        result = f(*(Acc(np.zeros(s.shape)) for s in specs))
        retire_products()
        return result

    def run_state(f):
        def run(init):
            inits = init if isinstance(init, tuple) else (init,)
            if not hasattr(inits[0], "init"):  # arrays, outside the kernel: in-place buffers
                holders = tuple(Holder(x) for x in inits)
                f(holders if isinstance(init, tuple) else holders[0])
                values = tuple(jnp.asarray(h.value) for h in holders)
                return values if isinstance(init, tuple) else values[0]
            refs = tuple(Acc(np.broadcast_to(np.asarray(s.init, np.float64), s.shape))
                         for s in inits)
            f(refs if isinstance(init, tuple) else refs[0])
            retire_products()
            values = tuple(jnp.asarray(r.value, jnp.float32) for r in refs)
            return values if isinstance(init, tuple) else values[0]
        return run

    pl = types.SimpleNamespace(run_scoped=run_scoped, run_state=run_state, when=when, loop=loop,
                               ds=lambda start, size: slice(int(start), int(start) + int(size)))

    def operand(x, reads):
        if isinstance(x, View):
            reads.append((x.mem.name, x.key(), machine.now()))
            return x.array().astype(np.float64)
        return np.asarray(x, np.float64)

    def wgmma(acc, a, b):
        reads = []
        acc.value = acc.value + operand(a, reads) @ operand(b, reads)
        state().products.append(reads)
        time.sleep(sleep_s * machine.rng.random())  # the product in flight

    def accumulator_load(acc, wait_n=0):
        retire_products(wait_n)
        return acc[...]

    def copy_gmem_to_smem(src, dst, barrier):
        dst[...] = src.array()
        barrier.arrive()

    def copy_smem_to_gmem(src, dst, predicate=None, *, commit_group=True, reduction_op=None):
        value = src.array().astype(dst.mem.value.dtype)
        state().copies.append((src.mem.name, src.key(), machine.now()))
        if reduction_op == "add":
            dst._sub()[...] += value
        else:
            assert reduction_op is None
            dst._sub()[...] = value

    def wait_smem_to_gmem(n, wait_read_only=False):
        copies = state().copies
        done = copies[:max(0, len(copies) - n)]
        machine.check_reads(done, "a bulk copy to global memory")
        del copies[:len(done)]

    class ACC:
        def __new__(cls, shape, dtype=None):
            return types.SimpleNamespace(shape=shape, init=0.0)

        @staticmethod
        def init(x):
            return types.SimpleNamespace(shape=np.shape(x), init=np.asarray(x))

    layout = types.SimpleNamespace(reduce=lambda dim: None)

    def broadcasted_iota(dtype, shape, dim, layout=None):
        return jnp.asarray(jax.lax.broadcasted_iota(dtype, shape, dim))

    def kernel(body, *, out_type, grid, grid_names, num_threads, thread_name, scratch_types,
               compiler_params=None):
        def call(*args):
            inputs = [View(Mem(machine, f"in{i}", a.value if isinstance(a, Holder)
                               else np.array(a))) for i, a in enumerate(args)]
            outs = [View(Mem(machine, f"out{i}", np.zeros(o.shape, o.dtype)))
                    for i, o in enumerate(out_type)]
            for point in np.ndindex(*grid):
                scratch = _allocate(machine, scratch_types, "smem")
                threads = []
                for wg in range(num_threads):
                    axes = dict(zip(grid_names, point)) | {thread_name: wg}
                    threads.append(threading.Thread(
                        target=_guarded, args=(machine, axes, body, inputs, outs, scratch),
                        name=f"CTA {point} warpgroup {wg}"))
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(4 * TIMEOUT_S)
                assert not any(t.is_alive() for t in threads), "a simulated thread never ended"
                assert not machine.errors, machine.errors
            return tuple(jnp.asarray(o.mem.value) for o in outs)
        return call

    plgpu = types.SimpleNamespace(
        wgmma=wgmma, wgmma_accumulator_load=accumulator_load, ACC=ACC,
        barrier_wait=Barrier.wait, barrier_arrive=Barrier.arrive,
        copy_gmem_to_smem=copy_gmem_to_smem, copy_smem_to_gmem=copy_smem_to_gmem,
        wait_smem_to_gmem=wait_smem_to_gmem, commit_smem=lambda: None,
        set_max_registers=lambda n, action: None, layout_cast=lambda x, layout: x,
        load=lambda view, layout=None, optimized=True: jnp.asarray(view.array()),
        broadcasted_iota=broadcasted_iota, Layout=types.SimpleNamespace(WGMMA=layout),
        TilingTransform=lambda tiling: None, SwizzleTransform=lambda size: None,
        SMEM=lambda shape, dtype, transforms=(): SmemSpec(tuple(shape), dtype),
        Barrier=lambda num_arrivals=1, num_barriers=1: BarrierSpec(num_arrivals, num_barriers),
        CompilerParams=lambda **kw: None, kernel=kernel)
    return pl, plgpu


def _allocate(machine, spec, name):
    if isinstance(spec, (tuple, list)):
        return tuple(_allocate(machine, s, f"{name}.{i}") for i, s in enumerate(spec))
    if isinstance(spec, SmemSpec):
        return View(Mem(machine, name, np.zeros(spec.shape, jnp.dtype(spec.dtype))))
    return Indexed([Barrier(machine, f"barrier {name}[{i}]", spec.num_arrivals)
                     for i in range(spec.num_barriers)])


def _guarded(machine, axes, body, inputs, outs, scratch):
    machine.local.axes = axes
    try:
        body(*inputs, *outs, *scratch)
        local = machine.thread_state()
        if local.copies:
            machine.fail(f"{threading.current_thread().name}: ends with bulk copies unawaited")
    except ProtocolError:
        pass
    except Exception as error:  # noqa: BLE001 - reported as the test's failure
        machine.errors.append(f"{threading.current_thread().name}: {error!r}")
        with machine.cv:
            machine.cv.notify_all()


@pytest.fixture
def simulate(monkeypatch):
    """Runs `backward` on the simulation (block 8 instead of 64, so that small problems have
    several tiles); returns a function making a fresh machine for each call."""
    monkeypatch.setattr(fh, "BLOCK_Q", 8)
    real_lax = fh.lax

    def install(seed=0, sleep_s=2e-4):
        machine = Machine(seed)
        monkeypatch.setattr(fh, "_pallas", lambda: make_pallas(machine, sleep_s))
        fake_lax = types.SimpleNamespace(**{n: getattr(real_lax, n) for n in dir(real_lax)
                                            if not n.startswith("_")})
        fake_lax.axis_index = lambda name: jnp.int32(machine.local.axes[name])

        def fori_loop(lo, hi, body, carry):
            for i in range(int(lo), int(hi)):
                carry = body(jnp.int32(i), carry)
            return carry

        fake_lax.fori_loop = fori_loop
        fake_lax.cond = lambda pred, t, f, *ops: t(*ops) if bool(pred) else f(*ops)
        monkeypatch.setattr(fh, "lax", fake_lax)
        monkeypatch.setattr(fh, "_accumulator_store", lambda ref, value: setattr(
            ref, "value", np.array(value, np.float64)))
        return machine

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield install
    sys.setswitchinterval(old)


def _backward(*args, **kw):
    """`fh.backward` run eagerly (under `jax.jit` the simulation would see tracers)."""
    return fh.backward.__wrapped__(*args, **kw)


def _reference(q, k, v, dout, dlse, scale, geometry):
    """float64 `(lse, out, dq, dk, dv)` of softmax attention under `geometry`, with the lse
    cotangent `dlse`; rows that see no key have lse -inf and no gradient."""
    q, k, v, dout, dlse = (np.asarray(x, np.float64) for x in (q, k, v, dout, dlse))
    group = q.shape[2] // k.shape[2]
    kf, vf = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kf) * scale
    qp, kp = np.arange(q.shape[1])[:, None], np.arange(k.shape[1])[None, :]
    vis = np.asarray(fh._geometry_visible(geometry, jnp.asarray(qp), jnp.asarray(kp)))
    s = np.where(vis, s, -np.inf)
    m = s.max(-1, keepdims=True)
    seen = np.isfinite(m)
    p = np.where(seen, np.exp(s - np.where(seen, m, 0)), 0)
    denom = p.sum(-1, keepdims=True)
    p = p / np.where(seen, denom, 1)
    lse = np.where(seen[..., 0], (m + np.log(np.where(seen, denom, 1)))[..., 0], -np.inf)
    out = np.einsum("bhqk,bkhd->bqhd", p, vf)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, vf)
    row = np.einsum("bqhd,bqhd->bhq", dout, out) - np.where(seen[..., 0], dlse, 0)
    ds = p * (dp - row[..., None])
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kf) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", p, dout)
    fold = lambda x: x.reshape(x.shape[0], x.shape[1], k.shape[2], group, -1).sum(3)  # noqa: E731
    return lse, out, dq, fold(dk), fold(dv)


def _run(geometry, *, fused, q_seq=32, kv_seq=48, q_heads=4, kv_heads=2, dim=16, seed=0):
    """`(dq, dk, dv)` of the simulated kernels and of the reference, for random float32 inputs
    and lse cotangents (the simulation installed by the caller)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, q_seq, q_heads, dim)).astype(np.float32)
    k, v = (rng.standard_normal((1, kv_seq, kv_heads, dim)).astype(np.float32)
            for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    dlse = rng.standard_normal((1, q_heads, q_seq)).astype(np.float32)
    scale = dim ** -0.5
    lse, out, *want = _reference(q, k, v, dout, dlse, scale, geometry)
    dlse = np.where(np.isfinite(lse), dlse, 0).astype(np.float32)
    none = jnp.zeros((1, q_heads, 0, q_seq), jnp.float32)
    config = dataclasses.replace(fh.default_config(dim), fused_dq=fused)
    got = _backward(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                    jnp.asarray(out, jnp.float32), jnp.asarray(lse, jnp.float32),
                    jnp.asarray(dout), jnp.asarray(dlse), none, none, scale=scale,
                    softcap=None, geometry=geometry, tile_fn=None, config=config)
    return got[:3], want


def _assert_close(got, want):
    for what, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=0,
                                   atol=2e-5 * max(1.0, np.abs(w).max()), err_msg=what)


GEOMETRIES = {  # with 8-row tiles: 4 query tiles, 6 key tiles, 3 CTAs of 16 keys per kv head
    # (the kernels take sequences in multiples of two tiles, padded by their callers)
    "whole": fh.Geometry(False, None, 0, 48, 32),
    "causal": fh.Geometry(True, None, 0, 48, 32),
    "causal_bottom_right": fh.Geometry(True, None, 16, 48, 32),
    "window_and_padding": fh.Geometry(False, (5, 3), 0, 43, 29),
}


@pytest.mark.parametrize("fused", [True, False], ids=["dq_in_dkv", "two_kernels"])
@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_backward_protocol_and_gradients(simulate, name, fused):
    simulate(seed=len(name))
    _assert_close(*_run(GEOMETRIES[name], fused=fused, seed=len(name)))


def test_one_query_tile_per_head_and_an_odd_stream(simulate):
    """Causal with one CTA of keys: warpgroup 1 skips the first query tile of each of its
    three heads and the stream has an odd count per head (the turn to sum dQ alternates)."""
    simulate()
    _assert_close(*_run(fh.Geometry(True, None, 0, 16, 16), fused=True, q_seq=16, kv_seq=16,
                        q_heads=6, kv_heads=2))


def _column_tile(s, q_pos, kv_pos, b, h, rows, cols):
    return (s - cols[0] + 0.01 * h.astype(jnp.float32),
            jax.lax.rem(q_pos + kv_pos, jnp.full_like(q_pos, 3)) != 0)


COLUMN_TILE = fh.TileFn(_column_tile, 0, 1, True, "test_hopper_backward_sim._column_tile")


def test_a_tile_function_with_column_inputs_in_the_fused_form(simulate):
    """A score function with per-key inputs (no per-row ones, so dQ is summed in the dK/dV
    kernel), softcap and a causal mask: dq, dk, dv and the column inputs' gradient equal
    `jax.vjp` of the same function in float32 at HIGHEST precision."""
    simulate(seed=7)
    b, q_seq, kv_seq, hq, hk, dim, softcap = 1, 32, 48, 4, 2, 16, 20.0
    geometry = fh.Geometry(True, None, 8, 45, 32)
    scale = dim ** -0.5
    ks = jax.random.split(jax.random.key(7), 6)
    q = jax.random.normal(ks[0], (b, q_seq, hq, dim))
    k, v = (jax.random.normal(x, (b, kv_seq, hk, dim)) for x in ks[1:3])
    cols = jax.random.normal(ks[3], (b, hq, 1, kv_seq))
    dout = jax.random.normal(ks[4], (b, q_seq, hq, dim))
    dlse = jax.random.normal(ks[5], (b, hq, q_seq))
    qp = jnp.arange(q_seq)[:, None] + jnp.zeros((1, kv_seq), jnp.int32)
    kp = jnp.arange(kv_seq)[None, :] + jnp.zeros((q_seq, 1), jnp.int32)

    def reference(q, k, v, cols):
        kf, vf = (jnp.repeat(x, hq // hk, axis=2) for x in (k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, kf, precision="highest") * scale
        s = jnp.tanh(s / softcap) * softcap
        s, vis = _column_tile(s, qp, kp, None, jnp.arange(hq)[None, :, None, None], (),
                              (cols[:, :, 0, None, :],))
        s = jnp.where(vis & fh._geometry_visible(geometry, qp, kp), s, -jnp.inf)
        lse = jax.nn.logsumexp(s, axis=-1)
        p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - lse[..., None]), 0.0)
        return jnp.einsum("bhqk,bkhd->bqhd", p, vf, precision="highest"), lse

    out, lse = reference(q, k, v, cols)
    dlse = jnp.where(jnp.isfinite(lse), dlse, 0.0)
    def finite_lse(*args):
        o, lse_ = reference(*args)
        return o, jnp.where(jnp.isfinite(lse_), lse_, 0.0)

    _, pull = jax.vjp(finite_lse, q, k, v, cols)
    want = pull((dout, dlse))
    config = dataclasses.replace(fh.default_config(dim), fused_dq=True)
    got = _backward(q, k, v, out, lse, dout, dlse, jnp.zeros((b, hq, 0, q_seq)), cols,
                    scale=scale, softcap=softcap, geometry=geometry, tile_fn=COLUMN_TILE,
                    config=config)
    for what, g, w in zip(("dq", "dk", "dv", "dcols"), (*got[:3], got[4]), want, strict=True):
        w = np.asarray(w, np.float64)
        np.testing.assert_allclose(np.asarray(g, np.float64), w, rtol=0,
                                   atol=1e-4 * max(1.0, np.abs(w).max()), err_msg=what)


def _mutated(monkeypatch, change):
    """`_pallas` with `change(plgpu)` applied to the simulation's primitives."""
    real = fh._pallas

    def pallas():
        pl, plgpu = real()
        change(plgpu)
        return pl, plgpu

    monkeypatch.setattr(fh, "_pallas", pallas)


def test_the_simulation_catches_a_staging_tile_rewritten_too_early(simulate, monkeypatch):
    """The model can fail: without the wait for the previous reduce-add to have read the float32
    staging tile, the other warpgroup's next dQ tile overwrites what is still being read."""
    def no_read_waits(plgpu):
        wait = plgpu.wait_smem_to_gmem
        plgpu.wait_smem_to_gmem = lambda n, wait_read_only=False: (
            None if wait_read_only else wait(n))

    simulate(seed=3)
    _mutated(monkeypatch, no_read_waits)
    with pytest.raises(AssertionError, match="smem.0.7.* rewritten .* bulk copy"):
        _run(GEOMETRIES["whole"], fused=True)


def test_the_simulation_catches_k_restaged_before_the_last_dq_product(simulate, monkeypatch):
    """The model can fail: without the last barrier, a warpgroup stages its dK where the other
    warpgroup's last dQ product still reads K (a slow product makes it likely)."""
    def no_last_barrier(plgpu):
        def skip(kind):  # both_done is the tenth barrier group of the dK/dV kernel
            return lambda barrier: None if "smem.1.9" in barrier.name else kind(barrier)
        plgpu.barrier_arrive = skip(plgpu.barrier_arrive)
        plgpu.barrier_wait = skip(plgpu.barrier_wait)

    simulate(seed=5, sleep_s=5e-3)
    _mutated(monkeypatch, no_last_barrier)
    with pytest.raises(AssertionError, match=r"smem.0.0\[\d\].* rewritten .* matrix product"):
        _run(GEOMETRIES["whole"], fused=True)
