"""An independent float64 NumPy oracle for `attnaux.attention`.

Written straight from the semantics in `docs/kernel_abi.md`, at the level of the public API
(any leading batch dims, NumPy broadcasting of bias/mask, `causal` spelled as the user spells it,
`window` with `None` sides, one segment-id array standing for both when `q_seq == kv_seq`). It
imports nothing from attnaux and shares no code with the `reference` backend: visibility is
built per row, the softmax per row over the visible keys only (selection by index, so NaN/inf in
invisible places can never reach a result), everything in float64.

```python
from oracle import attention, scores, lse_from_max
out, lse, row_max, probs = attention(q, k, v, causal="bottom_right", q_seqlens=...)
```
"""

import math

import numpy as np

_CAUSAL = {False: 0, None: 0, True: 1, "top_left": 1, "bottom_right": 2}


def _f64(x):
    return None if x is None else np.asarray(x).astype(np.float64)


def _parse(q, k, v, scale, bias, mask, causal, window, q_seqlens, kv_seqlens, q_segment_ids,
           kv_segment_ids, sink):
    """Flattens the batch dims and broadcasts every option to its full per-batch shape."""
    q, k = _f64(q), _f64(k)
    v = _f64(v) if v is not None else None
    batch = q.shape[:-3]
    nb = math.prod(batch)
    sq, hq, d = q.shape[-3:]
    skv, hkv = k.shape[-3], k.shape[-2]
    assert k.shape[:-3] == batch and k.shape[-1] == d and hq % hkv == 0
    p = dict(batch=batch, nb=nb, sq=sq, skv=skv, hq=hq, hkv=hkv, group=hq // hkv)
    p["q"] = q.reshape(nb, sq, hq, d)
    p["k"] = k.reshape(nb, skv, hkv, d)
    p["v"] = None if v is None else v.reshape(nb, skv, hkv, v.shape[-1])
    p["scale"] = 1.0 / math.sqrt(d) if scale is None else float(scale)
    full = (*batch, hq, sq, skv)
    p["bias"] = (None if bias is None
                 else np.broadcast_to(_f64(bias), full).reshape(nb, hq, sq, skv))
    p["mask"] = (None if mask is None
                 else np.broadcast_to(np.asarray(mask).astype(bool), full).reshape(nb, hq, sq, skv))
    p["causal"] = _CAUSAL[causal]
    left, right = (None, None) if window is None else window
    p["left"], p["right"] = left, right

    def lens(x, n):
        if x is None:
            return np.full(nb, n, np.int64)
        return np.clip(np.broadcast_to(np.asarray(x).astype(np.int64), batch).reshape(nb), 0, n)

    p["ql"], p["kl"] = lens(q_seqlens, sq), lens(kv_seqlens, skv)
    if q_segment_ids is None and kv_segment_ids is not None:
        assert sq == skv
        q_segment_ids = kv_segment_ids
    if kv_segment_ids is None and q_segment_ids is not None:
        assert sq == skv
        kv_segment_ids = q_segment_ids
    p["qseg"] = None if q_segment_ids is None else np.asarray(q_segment_ids).reshape(nb, sq)
    p["kseg"] = None if kv_segment_ids is None else np.asarray(kv_segment_ids).reshape(nb, skv)
    p["sink"] = None if sink is None else _f64(sink).reshape(hq)
    return p


def _visible_row(p, b, h, i):
    """`bool[Skv]`: which keys query row `i` of batch `b`, head `h` sees (kernel_abi.md)."""
    j = np.arange(p["skv"])
    ql, kl = p["ql"][b], p["kl"][b]
    if i >= ql:
        return np.zeros(p["skv"], bool)
    vis = j < kl
    off = kl - ql if p["causal"] == 2 else 0
    if p["causal"]:
        vis &= j <= i + off
    if p["left"] is not None:
        vis &= j >= i + off - p["left"]
    if p["right"] is not None:
        vis &= j <= i + off + p["right"]
    if p["mask"] is not None:
        vis &= p["mask"][b, h, i]
    if p["qseg"] is not None:
        vis &= p["kseg"][b] == p["qseg"][b, i]
    return vis


def _logits_row(p, b, h, i, idx):
    """float64 logits of row `i` at the visible key indices `idx` only."""
    g = h // p["group"]
    s = p["scale"] * (p["k"][b, idx, g, :] @ p["q"][b, i, h, :])
    if p["softcap"] is not None:
        s = p["softcap"] * np.tanh(s / p["softcap"])
    if p["bias"] is not None:
        s = s + p["bias"][b, h, i, idx]
    return s


def scores(q, k, *, scale=None, bias=None, mask=None, causal=False, window=None, q_seqlens=None,
           kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None, softcap=None):
    """The final float64 logits and the visibility, as `attnaux.attention` defines them.

    **Returns:**

    `(logits, visible)`, both `[*batch, q_heads, q_seq, kv_seq]`; `logits` is `-inf` wherever
    `visible` is False.
    """
    p = _parse(q, k, None, scale, bias, mask, causal, window, q_seqlens, kv_seqlens,
               q_segment_ids, kv_segment_ids, None)
    p["softcap"] = None if not softcap else float(softcap)
    nb, hq, sq, skv = p["nb"], p["hq"], p["sq"], p["skv"]
    logits = np.full((nb, hq, sq, skv), -np.inf)
    visible = np.zeros((nb, hq, sq, skv), bool)
    with np.errstate(all="ignore"):
        for b in range(nb):
            for h in range(hq):
                for i in range(sq):
                    vis = _visible_row(p, b, h, i)
                    idx = np.flatnonzero(vis)
                    visible[b, h, i] = vis
                    logits[b, h, i, idx] = _logits_row(p, b, h, i, idx)
    shape = (*p["batch"], hq, sq, skv)
    return logits.reshape(shape), visible.reshape(shape)


def attention(q, k, v, *, scale=None, bias=None, mask=None, causal=False, window=None,
              q_seqlens=None, kv_seqlens=None, q_segment_ids=None, kv_segment_ids=None,
              softcap=None, sink=None):
    """float64 attention with the arguments of `attnaux.attention` (no dropout).

    **Returns:**

    `(out [*batch, q_seq, q_heads, v_dim], lse [*batch, q_heads, q_seq],
    max [*batch, q_heads, q_seq], probs [*batch, q_heads, q_seq, kv_seq])`, all float64.
    A row with no visible key has out 0, max -inf and lse -inf (sink[h] with a sink).
    """
    p = _parse(q, k, v, scale, bias, mask, causal, window, q_seqlens, kv_seqlens,
               q_segment_ids, kv_segment_ids, sink)
    p["softcap"] = None if not softcap else float(softcap)
    nb, hq, sq, skv, dv = p["nb"], p["hq"], p["sq"], p["skv"], p["v"].shape[-1]
    out = np.zeros((nb, sq, hq, dv))
    lse = np.full((nb, hq, sq), -np.inf)
    row_max = np.full((nb, hq, sq), -np.inf)
    probs = np.zeros((nb, hq, sq, skv))
    with np.errstate(all="ignore"):  # NaN/inf placed in invisible inputs are never selected
        for b in range(nb):
            for h in range(hq):
                g = h // p["group"]
                sink_h = None if p["sink"] is None else p["sink"][h]
                for i in range(sq):
                    idx = np.flatnonzero(_visible_row(p, b, h, i))
                    s = _logits_row(p, b, h, i, idx)
                    m = s.max() if idx.size else -np.inf
                    row_max[b, h, i] = m
                    # lse = log(sum_j exp(s_j) + exp(sink)), stable around the largest term
                    top = m if sink_h is None else max(m, sink_h)
                    if top == -np.inf:
                        continue  # no visible key and no sink: lse = -inf, out = 0
                    total = np.exp(s - top).sum()
                    if sink_h is not None:
                        total += np.exp(sink_h - top)
                    lse[b, h, i] = top + np.log(total)
                    if idx.size:
                        pr = np.exp(s - lse[b, h, i])
                        probs[b, h, i, idx] = pr
                        out[b, i, h] = pr @ p["v"][b, idx, g, :]
    batch = p["batch"]
    return (
        out.reshape(*batch, sq, hq, dv),
        lse.reshape(*batch, hq, sq),
        row_max.reshape(*batch, hq, sq),
        probs.reshape(*batch, hq, sq, skv),
    )


def lse_from_max(row_max, logits, sink=None):
    """The log-sum-exp identity `lse = max + log(sum(exp(logits - max)))`, in float64.

    `row_max: [..., q_seq]` is the row maximum to shift by (e.g. `aux.max` under test),
    `logits: [..., q_seq, kv_seq]` with `-inf` at invisible keys. With `sink: [q_heads]` (the
    `...` then ends in the head axis) the term `exp(sink - max)` joins the sum. Rows whose max is
    -inf get lse -inf (or the sink).
    """
    row_max = _f64(row_max)
    logits = _f64(logits)
    finite = np.isfinite(row_max)
    m = np.where(finite, row_max, 0.0)[..., None]
    with np.errstate(all="ignore"):
        total = np.sum(np.where(np.isfinite(logits), np.exp(logits - m), 0.0), axis=-1)
        if sink is None:
            return np.where(finite, row_max + np.log(total), -np.inf)
        sink = _f64(sink)[:, None]
        shifted_sink = np.exp(sink - np.where(finite, row_max, 0))
        return np.where(finite, row_max + np.log(total + shifted_sink),
                        np.broadcast_to(sink, row_max.shape))
