"""The static calls that serve context parallelism's blocks on GPU (`attnaux.parallel._ring.
_band`, for backends whose masks are static graph attributes: cuDNN): for every diagonal shift a
block can have, the pairs the call covers (its slice of the block under its static causal /
window band) must be exactly the pairs visible at global positions. Checked pair by pair against
the rule of `docs/kernel_abi.md` (key j visible from query i iff `j <= i + shift` under causal,
`i + shift - left <= j <= i + shift + right` under a window), in pure Python.

The kernels behind these calls are checked by `tests/spmd/test_parallel.py` (the CPU kernels
made to take the static calls, on 8 host devices) and, on GPUs, by
`tests/test_parallel_one_device.py` and `tests/test_multi_gpu.py`.
"""

import itertools
from types import SimpleNamespace

import pytest

from attnaux.parallel._ring import _band, _static_plan


def visible_global(i, j, shift, causal, left, right):
    d = j - i - shift
    return ((not causal or d <= 0) and (left < 0 or d >= -left) and (right < 0 or d <= right))


def covered(i, j, band):
    if band is None or not (band.q_lo <= i < band.q_hi and band.k_lo <= j < band.k_hi):
        return False
    d = (j - band.k_lo) - (i - band.q_lo)
    left, right = band.window
    return ((not band.causal or d <= 0) and (left < 0 or d >= -left)
            and (right < 0 or d <= right))


CHUNK = 8
MASKS = [(causal, left, right) for causal in (False, True)
         for left, right in itertools.product((-1, 0, 3, 7, 8, 9, 20), (-1, 0, 2, 8, 13))]


@pytest.mark.parametrize(("causal", "left", "right"), MASKS)
def test_band_covers_exactly_the_visible_pairs(causal, left, right):
    cfg = SimpleNamespace(causal=causal,
                          options=SimpleNamespace(window_left=left, window_right=right))
    for m in range(-4, 5):
        shift = m * CHUNK
        band = _band(cfg, shift, CHUNK)
        for i, j in itertools.product(range(CHUNK), repeat=2):
            want = visible_global(i, j, shift, causal, left, right)
            assert covered(i, j, band) == want, (shift, i, j, band)
        if band is not None:  # square sub-blocks (cuDNN's band masks want q_seq == kv_seq)
            assert band.q_hi - band.q_lo == band.k_hi - band.k_lo > 0


def test_plan_shares_calls_between_shifts():
    cfg = SimpleNamespace(causal=True, options=SimpleNamespace(window_left=3, window_right=-1))
    table, bands = _static_plan(cfg, CHUNK, 4)
    # shifts -3c..3c: above the diagonal and beyond the window hidden; the diagonal block a
    # causal window; the block before it a slice
    assert [int(x) for x in table] == [0, 0, 0, 1, 2, 0, 0]
    assert bands[0].causal == 1 and bands[0].window == (3, -1)
    assert (bands[1].q_lo, bands[1].q_hi, bands[1].k_lo, bands[1].k_hi) == (0, 3, 5, 8)
