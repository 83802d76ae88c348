import functools
from collections.abc import Callable

import jax
import numpy as np
from beartype import BeartypeConf, beartype
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray, TypeCheckError, jaxtyped

from ._aux import AttnAux, unflatten
from ._canon import canonicalize, check_key
from ._dispatch import Explanation, call_statics, choose
from ._mods import attention_with_mods, choose_with_rules
from ._varlen import explain_varlen

# Arrays may come from JAX or NumPy; Python ints are accepted where a float is asked for.
_Arr = Array | np.ndarray
_typechecker = beartype(conf=BeartypeConf(is_pep484_tower=True))
# Static floats: Python or NumPy scalars, or a concrete 0-d JAX array (traced ones are rejected
# with a clear message by `_canon._static_float`).
_Scalar = float | np.floating | Array
# bias and mask broadcast by NumPy's right-aligned rules, so a lower rank works too: `[kv_seq]`
# for a key mask, `[q_seq, kv_seq]`, or a scalar.
_Bias = (Float[_Arr, "*#batch #q_heads #q_seq #kv_seq"] | Float[_Arr, "#q_seq #kv_seq"]
         | Float[_Arr, "#kv_seq"] | Float[_Arr, ""])
_Mask = (Bool[_Arr, "*#batch #q_heads #q_seq #kv_seq"] | Bool[_Arr, "#q_seq #kv_seq"]
         | Bool[_Arr, "#kv_seq"] | Bool[_Arr, ""])
_WindowSide = int | np.integer | None

def _choose(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, sink,
            key, *, statics, return_probs, backend):
    problem = canonicalize(
        q, k, v, statics, bias=bias, mask=mask, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, sink=sink, key=key,
    )
    return problem, choose(problem, backend, return_probs)


@functools.partial(jax.jit, static_argnames=("statics", "return_probs", "backend"))
def _attention_jit(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids,
                   sink, key, *, statics, return_probs, backend):
    problem, choice = _choose(q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids,
                              kv_segment_ids, sink, key, statics=statics,
                              return_probs=return_probs, backend=backend)
    arrays, options = problem.arrays, problem.options
    out, lse, row_max, probs = choice.implementation.module.run(arrays, options, return_probs)
    return unflatten(problem.batch_shape, out, lse, row_max, probs, arrays.rng_state,
                     backend=choice.explanation.backend,
                     dropout_impl=choice.explanation.dropout_impl)


def _short_errors_first(typed):
    """Makes a shape or dtype mistake one short sentence at the public boundary.

    jaxtyping checks the annotations of `typed`; when it rejects a call, attnaux's explicit
    checks (those `explain` runs, at no cost on calls that pass) usually say the same in one
    sentence naming the argument, the expected shape with its bound sizes and what came: that
    error is raised, with jaxtyping's full report as its cause. Where they find nothing,
    jaxtyping's error is raised as it is. `__wrapped__` is the undecorated function (what runs
    with `JAXTYPING_DISABLE=1`)."""

    @functools.wraps(typed)
    def wrapper(q, k, v, **options):
        try:
            return typed(q, k, v, **options)
        except TypeCheckError as error:
            try:
                explain(q, k, v, **options)
            except (ValueError, TypeError) as short:
                if "`" in str(short):  # one of attnaux's own messages, naming the argument
                    raise short.with_traceback(None) from error
            raise

    wrapper.__wrapped__ = getattr(typed, "__wrapped__", typed)
    return wrapper


@_short_errors_first
@jaxtyped(typechecker=_typechecker)
def attention(
    q: Float[_Arr, "*batch q_seq q_heads qk_dim"],
    k: Float[_Arr, "*batch kv_seq kv_heads qk_dim"],
    v: Float[_Arr, "*batch kv_seq kv_heads v_dim"],
    *,
    scale: _Scalar | None = None,
    bias: _Bias | None = None,
    mask: _Mask | None = None,
    causal: bool | str | None = False,
    window: tuple[_WindowSide, _WindowSide] | list | None = None,
    q_seqlens: Int[_Arr, "*batch"] | None = None,
    kv_seqlens: Int[_Arr, "*batch"] | None = None,
    q_segment_ids: Int[_Arr, "*batch q_seq"] | None = None,
    kv_segment_ids: Int[_Arr, "*batch kv_seq"] | None = None,
    softcap: _Scalar | None = None,
    sink: Float[_Arr, " q_heads"] | None = None,
    dropout_rate: _Scalar = 0.0,
    key: PRNGKeyArray | None = None,
    return_probs: bool = False,
    backend: str = "auto",
    score_mod: Callable | None = None,
    mask_mod: Callable | None = None,
) -> tuple[Float[Array, "*batch q_seq q_heads v_dim"], AttnAux]:
    """Fused multi-head attention that returns its softmax statistics.

    Computes `softmax(scale * q @ k^T + bias, masked) @ v` per head and returns the output together
    with an [`AttnAux`][attnaux.AttnAux] holding the log-sum-exp and maximum of every softmax row.
    Layout is BSHD: `[*batch, seq, heads, dim]`, any number of leading batch dimensions (none for
    an unbatched call). Works under `jax.jit`, `jax.grad` and `jax.vmap`.

    **Arguments:**

    - `q`: queries, `[*batch, q_seq, q_heads, qk_dim]`; float32, bfloat16 or float16.
    - `k`: keys, `[*batch, kv_seq, kv_heads, qk_dim]`; `q_heads` must be a multiple of
      `kv_heads` (GQA; `kv_heads = 1` is MQA).
    - `v`: values, `[*batch, kv_seq, kv_heads, v_dim]`.
    - `scale`: multiplies `q @ k^T`; defaults to `1 / sqrt(qk_dim)`. A static Python float.
    - `bias`: added to the scaled (and soft-capped) logits; broadcasts against
      `[*batch, q_heads, q_seq, kv_seq]`. Differentiable.
    - `mask`: boolean, `True` = attend; broadcasts like `bias`.
    - `causal`: `False`, `True` (= `"top_left"`: query `i` sees keys `j <= i`) or
      `"bottom_right"` (the last valid query row is aligned with the last valid key row, using
      the valid lengths of `q_seqlens`/`kv_seqlens`).
    - `window`: `(left, right)`: query `i` sees key `j` iff `i - left <= j <= i + right`, positions
      shifted like the causal alignment; `None` on a side leaves it unbounded.
    - `q_seqlens`, `kv_seqlens`: `int[*batch]` valid lengths; rows past them are padding (output 0,
      zero gradients) and their contents are never read. Values are clamped to `[0, seq]`.
    - `q_segment_ids`, `kv_segment_ids`: `int[*batch, seq]` for packed sequences: query and key
      attend only when their ids are equal. One of them alone is used for both when
      `q_seq == kv_seq`.
    - `softcap`: logits become `softcap * tanh(logits / softcap)` (before the bias is added).
    - `sink`: `float[q_heads]`, a learnable logit per head added to every softmax denominator.
    - `dropout_rate`: dropout on the probabilities; needs `key`.
    - `key`: a JAX PRNG key for dropout (keyword-only).
    - `return_probs`: also return the full probabilities in `aux.probs`.
    - `backend`: `"auto"` (default), `"flash"`, `"probs"`, `"small_seq"` or `"reference"`
      (with `score_mod`/`mask_mod`: `"flash"` runs them inside the CPU kernels, `"flex"` is
      the blockwise JAX path). See [`attnaux.explain`][] for what `"auto"` picks and why.
    - `score_mod`: `score_mod(score, batch, head, q_idx, kv_idx) -> score`, a scalar function of
      one logit (after `scale` and `softcap`) and its integer indices (`batch` indexes the
      flattened leading dims); attnaux vectorises it. Arrays it closes over receive gradients.
      `aux.lse` and `aux.max` are of the modified scores. See [score_mod](score_mod.md).
    - `mask_mod`: `mask_mod(batch, head, q_idx, kv_idx) -> bool`, True = attend; composes with
      every other mask, and the blocks it hides entirely are skipped.

    **Returns:**

    `(out, aux)`: `out` is `[*batch, q_seq, q_heads, v_dim]` in the input dtype; `aux` is an
    [`AttnAux`][attnaux.AttnAux] with float32 `lse` and `max` of shape
    `[*batch, q_heads, q_seq]`. A row with no visible key gives output 0 and `lse = max = -inf`
    (`lse = sink` with a sink). Gradients flow through `out`, `aux.lse` and `aux.probs`; `aux.max`
    carries none.

    **Raises:**

    `ValueError` or `TypeError` naming the argument, what was expected and what came, before
    anything is traced.
    """
    mods = score_mod is not None or mask_mod is not None
    if backend == "flex" and not mods:
        raise ValueError("backend='flex' serves calls with `score_mod` or `mask_mod`; this call "
                         "has neither.")
    statics = call_statics(scale, causal, window, softcap, dropout_rate, return_probs,
                           "auto" if mods else backend)
    if key is not None:
        check_key(key)
    if mods:
        return attention_with_mods(
            q, k, v, statics=statics["statics"], score_mod=score_mod, mask_mod=mask_mod,
            bias=bias, mask=mask, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
            q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, sink=sink, key=key,
            return_probs=statics["return_probs"], backend=backend)
    return _attention_jit(
        q, k, v, bias, mask, q_seqlens, kv_seqlens, q_segment_ids, kv_segment_ids, sink, key,
        **statics,
    )


def explain(q, k, v, **options) -> Explanation:
    """Says which backend `attention(q, k, v, **options)` would run, and why.

    Takes exactly the arguments of [`attnaux.attention`][] (arrays or `jax.ShapeDtypeStruct`s),
    or those of [`attnaux.varlen_attention`][] (then `packed` says whether the
    sequences are read in place or padded per sequence); validates them the same way, runs
    nothing.

    **Returns:**

    An `Explanation` with `backend`, `implementation`, `platform` and `reasons` (for every backend,
    why it was or was not chosen); `print()` it for a readable summary.
    """
    options = dict(options)
    if "cu_seqlens_q" in options or "cu_seqlens_kv" in options:  # varlen_attention's arguments
        return explain_varlen(q, k, v, **options)
    score_mod, mask_mod = options.pop("score_mod", None), options.pop("mask_mod", None)
    if score_mod is not None or mask_mod is not None:
        return _explain_mods(q, k, v, score_mod, mask_mod, options)
    statics = call_statics(
        options.pop("scale", None), options.pop("causal", False), options.pop("window", None),
        options.pop("softcap", None), options.pop("dropout_rate", 0.0),
        options.pop("return_probs", False), options.pop("backend", "auto"),
    )
    names = ("bias", "mask", "q_seqlens", "kv_seqlens", "q_segment_ids", "kv_segment_ids", "sink",
             "key")
    unknown = set(options) - set(names)
    if unknown:
        raise TypeError(f"explain() got unknown options {sorted(unknown)}; it takes the keyword "
                        "arguments of attnaux.attention.")
    arrays = [options.get(n) for n in names]
    result: list[Explanation] = []

    def trace(q, k, v, *arrays):
        result.append(_choose(q, k, v, *arrays, **statics)[1].explanation)
        return 0

    jax.eval_shape(trace, q, k, v, *arrays)
    return result[0]


def _explain_mods(q, k, v, score_mod, mask_mod, options) -> Explanation:
    """`explain` for a call with `score_mod`/`mask_mod` (`_mods.choose_with_rules`)."""
    backend = options.pop("backend", "auto")
    statics = call_statics(
        options.pop("scale", None), options.pop("causal", False), options.pop("window", None),
        options.pop("softcap", None), options.pop("dropout_rate", 0.0),
        options.pop("return_probs", False), "auto",
    )
    bias, mask = options.pop("bias", None), options.pop("mask", None)
    names = ("q_seqlens", "kv_seqlens", "q_segment_ids", "kv_segment_ids", "sink", "key")
    unknown = set(options) - set(names)
    if unknown:
        raise TypeError(f"explain() got unknown options {sorted(unknown)}; it takes the keyword "
                        "arguments of attnaux.attention.")
    arrays = [options.get(n) for n in names]
    result: list[Explanation] = []

    def trace(q, k, v, *arrays):
        problem = canonicalize(q, k, v, statics["statics"], **dict(zip(names, arrays)))
        c = choose_with_rules(problem, score_mod, mask_mod, backend, bias, mask,
                              statics["return_probs"])[0]
        result.append(Explanation(backend=c.backend, implementation=c.implementation,
                                  platform=jax.default_backend(), reasons=c.reasons))
        return 0

    jax.eval_shape(trace, q, k, v, *arrays)
    return result[0]
