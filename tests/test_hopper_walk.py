"""The Hopper forward's pipeline protocol, simulated on the CPU.

`_flash_hopper._walk_overlapped` (a consumer warpgroup's pass with FlashAttention-3's
intra-warpgroup overlap) and `_flash_hopper._produce` (the TMA producer) only meet the GPU
through the `pl`/`plgpu` calls they are given, so they can run here against a model of the
hardware they rely on:

- threads: the producer and the two consumer warpgroups, as Python threads;
- mbarriers: a fixed number of arrivals completes a phase; a wait is `try_wait.parity` on the
  waiter's own parity bit (flipped at every wait, as Mosaic GPU tracks it), so a barrier that
  runs two phases ahead of a waiter is a protocol error, and a wait that never completes is a
  deadlock (a timeout here);
- wgmma: issued asynchronously into commit groups; `wgmma_accumulator_load(wait_n=n)` retires
  all but the newest n. A product reads its shared-memory operands until it is retired: a
  consumer that frees a slot (or a producer that refills one) while a product still reads it
  is a race;
- the products themselves in float64, so each warpgroup's output must equal softmax-attention
  over exactly the key tiles of its range.

The kernel wraps these walks with what is simulated here too: warpgroup 1 arrives once on the
first warpgroup's turn barrier before its walk (the strict alternation starts with warpgroup 0).
What it cannot see: register reuse (ptxas's C7513, see the module's docstring), and the kernel
body around the walks; the GPU tests (`test_hopper.py`) cover those.
"""

import sys
import threading
import types

import mbarrier_model
import numpy as np
import pytest
from mbarrier_model import Barrier, Indexed, ProtocolError, loop, when

from attnaux import _flash_hopper as fh

TIMEOUT_S = 5.0


class Machine(mbarrier_model.Machine):
    """The shared state of one simulated CTA: barriers, slots and the products in flight."""

    def __init__(self):
        super().__init__(TIMEOUT_S)
        self.reading = {}  # (thread name) -> list of commit groups, each a set of slot keys

    def groups(self):
        return self.reading.setdefault(threading.current_thread().name, [])


class Slot:
    """One shared-memory tile; `transpose` gives the view a product reads."""

    def __init__(self, machine, name):
        self.m, self.name, self.value = machine, name, None

    def transpose(self, axes):
        assert tuple(axes) == (1, 0)
        return SlotView(self, transposed=True)


class SlotView:
    def __init__(self, slot, transposed=False):
        self.slot, self.transposed = slot, transposed

    def array(self):
        return self.slot.value.T if self.transposed else self.slot.value


class Ref:
    def __init__(self, value):
        self.value = value


class Spec:
    def __init__(self, shape, init=None):
        self.shape, self.init = shape, init


def make_pl(machine):
    def run_scoped(f, *specs):
        return f(*(Ref(np.zeros(s.shape)) for s in specs))

    def run_state(f):
        def run(spec):
            ref = Ref(np.array(spec.init, dtype=np.float64))
            f(ref)
            retire(machine, 0)  # leaving the scope reads the accumulator
            return ref.value
        return run

    return types.SimpleNamespace(run_scoped=run_scoped, run_state=run_state, when=when,
                                 loop=loop)


def retire(machine, keep):
    groups = machine.groups()
    del groups[:max(0, len(groups) - keep)]


def slots_in_flight(machine):
    return {key for groups in machine.reading.values() for g in groups for key in g}


def make_plgpu(machine):
    def wgmma(acc_ref, a, b):
        reads = set()
        if isinstance(a, (Slot, SlotView)):
            a_view = a if isinstance(a, SlotView) else SlotView(a)
            reads.add(a_view.slot.name)
            a = a_view.array()
        b_view = b if isinstance(b, SlotView) else SlotView(b)
        reads.add(b_view.slot.name)
        acc_ref.value = acc_ref.value + np.asarray(a, np.float64) @ b_view.array()
        machine.groups().append(reads)

    def accumulator_load(ref, wait_n=0):
        retire(machine, wait_n)
        return ref.value.copy()

    def barrier_arrive(barrier):
        if isinstance(barrier, Barrier) and barrier.name.startswith("free"):
            slot_key = barrier.name.split(" ", 1)[1]
            mine = {key for g in machine.groups() for key in g}
            if any(key.endswith(slot_key) for key in mine):
                machine.fail(f"{threading.current_thread().name}: frees {slot_key} while a "
                             "product still reads it")
        barrier.arrive()

    def copy_gmem_to_smem(src, dst, barrier):
        if any(key == dst.name for key in slots_in_flight(machine)):
            machine.fail(f"producer refills {dst.name} while a product reads it")
        dst.value = np.array(src, np.float64)
        barrier.arrive()

    class ACC:
        def __new__(cls, shape, dtype=None):
            return Spec(shape)

        @staticmethod
        def init(x):
            return Spec(np.shape(x), init=x)

    return types.SimpleNamespace(
        wgmma=wgmma, wgmma_accumulator_load=accumulator_load, barrier_wait=Barrier.wait,
        barrier_arrive=barrier_arrive, copy_gmem_to_smem=copy_gmem_to_smem, ACC=ACC,
        layout_cast=lambda x, layout: x, Layout=types.SimpleNamespace(WGMMA=None))


def python_lax():
    def fori_loop(lo, hi, body, carry):
        for i in range(int(lo), int(hi)):
            carry = body(i, carry)
        return carry

    def cond(pred, true_fn, false_fn, operand):
        return true_fn(operand) if bool(pred) else false_fn(operand)

    def broadcast_in_dim(x, shape, dims):
        x = np.asarray(x)
        return np.broadcast_to(x.reshape(x.shape + (1,) * (len(shape) - x.ndim)), shape)

    return types.SimpleNamespace(fori_loop=fori_loop, cond=cond,
                                 optimization_barrier=lambda x: x, rem=np.remainder,
                                 broadcast_in_dim=broadcast_in_dim)


def online_softmax(block_kv, masked_steps):
    """The callbacks the kernel passes: plain scores (recording which steps were masked) and
    the natural-exp online softmax in float64."""

    def scores(s, step, masked):
        if masked:
            masked_steps.add(int(step))
        return s

    def softmax(x, step, m, denom):
        m_new = np.maximum(m, x.max(axis=1))
        alpha = np.exp(m - m_new)
        p = np.exp(x - m_new[:, None])
        return p, m_new, denom * alpha + p.sum(axis=1), alpha

    return scores, softmax


def run_cta(ranges, n_tiles, stages=2, block_q=4, block_kv=8, dim=8, seed=0):
    """One CTA: the producer streaming the union of the two warpgroups' ranges, each consumer
    walking its own. Returns (outputs per warpgroup, inputs, masked steps per warpgroup)."""
    machine = Machine()
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, block_q, dim))
    k = rng.standard_normal((n_tiles * block_kv, dim))
    v = rng.standard_normal((n_tiles * block_kv, dim))
    pl, plgpu = make_pl(machine), make_plgpu(machine)
    cta_lo, cta_hi = (int(x) for x in fh._union(*ranges))
    group = lambda name, n, arrivals: Indexed(  # noqa: E731
        [Barrier(machine, f"{name} {i}", arrivals) for i in range(n)])
    k_ready, v_ready = group("ready k", stages, 1), group("ready v", stages, 1)
    k_free, v_free = group("free k", stages, 2), group("free v", stages, 2)
    turns = group("turn", 2, 1)
    k_smem = Indexed([Slot(machine, f"k {i}") for i in range(stages)])
    v_smem = Indexed([Slot(machine, f"v {i}") for i in range(stages)])
    q_smem = [Slot(machine, f"q {w}") for w in range(2)]
    for w in range(2):
        q_smem[w].value = q[w]
    results, masked = [None, None], [set(), set()]

    def slot_of(step):
        return (int(step) - cta_lo) % stages

    def consumer(w):
        scores, softmax = online_softmax(block_kv, masked[w])
        if w == 1:
            turns[0].arrive()
        carry = (np.zeros((block_q, dim)), np.full(block_q, -np.inf), np.zeros(block_q))
        acc, m, denom = fh._walk_overlapped(
            pl, plgpu, cta_lo, cta_hi, tuple(np.int32(x) for x in ranges[w]), carry,
            scores=scores, softmax=softmax, k_smem=k_smem, v_smem=v_smem, q_smem=q_smem[w],
            ready=(k_ready, v_ready), free=(k_free, v_free), slot_of=slot_of,
            turns=(turns[w], turns[1 - w]), shape=(block_q, block_kv), dtype=np.float64,
            all_masked=False)
        if machine.groups():
            machine.fail(f"consumer {w} ends with products in flight")
        results[w] = (acc, m, denom)

    def producer():
        tile = lambda a: lambda step: a[int(step) * block_kv:(int(step) + 1) * block_kv]  # noqa: E731
        fh._produce(pl, plgpu, cta_lo, cta_hi, stages,
                    [(tile(k), k_smem, k_ready, k_free), (tile(v), v_smem, v_ready, v_free)])

    def guarded(fn, *args):
        try:
            fn(*args)
        except ProtocolError:
            pass
        except Exception as error:  # noqa: BLE001 - reported as the test's failure
            machine.errors.append(f"{threading.current_thread().name}: {error!r}")
            with machine.cv:
                machine.cv.notify_all()

    threads = [threading.Thread(target=guarded, args=(consumer, w), name=f"consumer {w}")
               for w in range(2)] + [threading.Thread(target=guarded, args=(producer,),
                                                      name="producer")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(4 * TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a simulated thread never finished"
    assert not machine.errors, machine.errors
    return results, (q, k, v), masked


@pytest.fixture
def simulated(monkeypatch):
    monkeypatch.setattr(fh, "lax", python_lax())
    monkeypatch.setattr(fh, "jnp", types.SimpleNamespace(
        clip=np.clip, minimum=np.minimum, maximum=np.maximum, where=np.where, zeros=np.zeros,
        int32=np.int32, float32=np.float32, inf=np.inf,
        array=lambda x, dtype=None: np.array(x, dtype)))
    monkeypatch.setattr(fh, "_accumulator_store", lambda ref, value: setattr(
        ref, "value", np.array(value, np.float64)))


# (lo, hi, full_lo, full_hi) of the two warpgroups, and the number of key tiles
CASES = {
    "both_whole": (((0, 5, 0, 5), (0, 5, 0, 5)), 5),
    "causal_diagonal": (((0, 3, 0, 2), (0, 4, 0, 3)), 4),
    "one_tile": (((0, 1, 0, 0), (0, 1, 0, 0)), 1),
    "first_empty": (((0, 0, 0, 0), (0, 3, 1, 2)), 3),
    "window_offset": (((1, 3, 2, 2), (2, 5, 3, 4)), 6),
    "disjoint": (((0, 2, 0, 2), (3, 5, 3, 5)), 5),
}


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("name", sorted(CASES))
def test_overlapped_walk_keeps_the_pipeline_protocol_and_computes_attention(simulated, name,
                                                                            stages):
    ranges, n_tiles = CASES[name]
    block_kv = 8
    results, (q, k, v), masked = run_cta(ranges, n_tiles, stages=stages, block_kv=block_kv)
    for w, (lo, hi, full_lo, full_hi) in enumerate(ranges):
        acc, m, denom = results[w]
        if lo == hi:
            assert np.all(acc == 0) and np.all(denom == 0) and np.all(m == -np.inf)
            continue
        keys = slice(lo * block_kv, hi * block_kv)
        s = q[w] @ k[keys].T
        p = np.exp(s - s.max(axis=1, keepdims=True))
        expected = (p / p.sum(axis=1, keepdims=True)) @ v[keys]
        np.testing.assert_allclose(acc / denom[:, None], expected, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(m, s.max(axis=1), rtol=0, atol=0)
        # tiles outside [full_lo, full_hi) take the masked body (the first tile always does)
        want = {lo} | {t for t in range(lo + 1, hi) if t < full_lo or t >= full_hi}
        assert masked[w] == want, (w, masked[w], want)


def test_one_stage_deadlocks_when_a_warpgroup_skips(simulated, monkeypatch):
    """Why `forward` refuses the overlap with one slot (and several key tiles): warpgroup 0,
    done with its range, waits in a skipped step for V's slot before passing its turn on,
    and the slot is freed only by warpgroup 1's next step, which needs that turn. (Passing
    the turn first would lift this; the kernels keep the order verified on the GPU.)"""
    monkeypatch.setattr(sys.modules[__name__], "TIMEOUT_S", 0.5)
    with pytest.raises(AssertionError, match="deadlock"):
        run_cta(*CASES["causal_diagonal"], stages=1)


def test_the_simulation_catches_a_doubled_wait(simulated, monkeypatch):
    """The model can fail: one extra wait on K's first slot before the walk (the bug a draft of
    the overlapped kernel had: the plain walk's early wait left on) hangs the pipeline."""
    original = fh._walk_overlapped

    def doubled(pl, plgpu, cta_lo, cta_hi, ranges, carry, *, ready, **kw):
        plgpu.barrier_wait(ready[0].at[0])
        return original(pl, plgpu, cta_lo, cta_hi, ranges, carry, ready=ready, **kw)

    monkeypatch.setattr(fh, "_walk_overlapped", doubled)
    monkeypatch.setattr(sys.modules[__name__], "TIMEOUT_S", 0.5)
    with pytest.raises(AssertionError, match="deadlock|ahead"):
        run_cta(*CASES["both_whole"])


def test_the_simulation_catches_a_slot_freed_too_early(simulated, monkeypatch):
    """The model can fail: freeing K's slot before the S product that reads it is retired
    (`wait_n=2` instead of 1) is reported as a race."""
    plgpu_load = make_plgpu

    def early(machine):
        plgpu = plgpu_load(machine)
        load = plgpu.wgmma_accumulator_load
        plgpu.wgmma_accumulator_load = lambda ref, wait_n=0: load(ref, wait_n + 1)
        return plgpu

    monkeypatch.setattr(sys.modules[__name__], "make_plgpu", early)
    with pytest.raises(AssertionError, match="still reads|reads it"):
        run_cta(*CASES["both_whole"])


@pytest.mark.parametrize("n_tiles,n_heads,bsz,stream_mb,group,longest", [
    (8, 16, 8, 0.5, 1, "last"),  # 8x1024x16x128's forward: 64 heads a section
    (64, 16, 1, 4.0, 1, "last"),  # 1x8192x16x128: 8 heads a section
    (4, 6, 3, 20.0, 2, "last"),  # one kv head a section, GQA pairs of query heads
    (5, 3, 7, 5.0, 1, "first"),  # sections of 4 over 21 heads: the last one short
    (3, 2, 1, 100.0, 1, "first"),  # streams above the budget: one head a section
])
def test_cta_order(n_tiles, n_heads, bsz, stream_mb, group, longest):
    """`_cta_place` hands every (tile, batch, head) to exactly one CTA; inside a section of
    heads the CTAs go tile by tile, longest first (`longest`), over all the section's heads;
    and a section's heads share what fits in `L2_STREAM_BYTES`."""
    n = n_tiles * n_heads * bsz
    stream = int(stream_mb * 2**20)
    tile, b, h = (np.asarray(x) for x in fh._cta_place(
        np.arange(n, dtype=np.int32), n_tiles, n_heads, bsz, stream, group, longest))
    places = set(zip(tile.tolist(), b.tolist(), h.tolist()))
    assert len(places) == n and places == {
        (t, bb, hh) for t in range(n_tiles) for bb in range(bsz) for hh in range(n_heads)}
    heads = b * n_heads + h
    fit = max(1, fh.L2_STREAM_BYTES // stream)
    section = min(n_heads * bsz, 2 ** (fit.bit_length() - 1) * group)
    sections = heads // section
    assert (np.diff(sections) >= 0).all()  # one section after the other
    rank = tile if longest == "first" else n_tiles - 1 - tile
    for s in np.unique(sections):
        mine = sections == s
        assert (np.diff(rank[mine]) >= 0).all()  # longest first inside the section
        assert len(np.unique(heads[mine])) * stream <= max(fh.L2_STREAM_BYTES, stream) * group
