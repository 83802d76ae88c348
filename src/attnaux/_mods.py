"""`attnaux.attention` with `score_mod` / `mask_mod`: which backend serves the call, and the call.

Three backends serve the functions:

- `flash` (CPU): the C++ flash kernels run them inside their tiles as a *score program*, the
  functions' jaxprs translated into a flat list of elementwise instructions
  (`_score_program.py`, `csrc/cpu/score_program.h`); the kernels differentiate the program
  instruction by instruction (JAX's rules), so captured arrays get their gradients, and skip
  the 64 x 64 tiles that `mask_mod` hides (a table built once per static shape). `auto` picks it
  on CPU whenever the functions translate.
- `flash` (GPU, Hopper): attnaux's own Pallas Mosaic GPU kernels (`_flash_hopper.py`) run the
  part of the program that depends on both positions (or the score) inside their tiles and
  take what depends on one side only as per-row / per-column inputs computed by XLA
  (`_hopper_mods.py`); the backward kernels differentiate the tile part with `jax.vjp`, XLA
  the rest; mask_mod's block table becomes each tile row's visiting range. Per-row lengths and
  segment ids, which those kernels do not read, are folded into the mask_mod first
  (`rules_as_mask`), as is a bottom-right mask whose diagonal moves with the lengths.
- `flex`: blockwise online softmax in JAX (`_flex.py`), compiled by XLA on every platform; it
  serves what the compiled kernels do not, and `explain` says what stopped them.
- `reference`: the scores materialised (the test oracle; serves `return_probs`).
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import _flash_cpu, _flex, _hopper_mods
from ._score_program import ScoreProgram, Untranslatable, pack_consts, translate

MOD_BACKENDS = ("auto", "flash", "flex", "reference")

CONST_GRADIENT_MAX_FLOATS = 2**26
"""The C++ backward keeps one partial sum of the captured arrays' gradient per (batch row, head,
64-row query tile), so that its result does not depend on the threads; above this many floats
(256 MiB) per batch row the compiled path is not taken (flex serves the call)."""


class ModsChoice(NamedTuple):
    backend: str
    implementation: str
    mods: Any  # _flex.Mods
    consts: tuple
    table: Any  # _flex.BlockTable (the flex tiles; also what explain reports)
    program: ScoreProgram | None
    extras: tuple
    tile_mask: np.ndarray | None
    reasons: dict
    split: Any = None  # _hopper_mods.Split on a Hopper GPU


def _check(backend: str, bias, mask, return_probs: bool) -> None:
    if backend not in MOD_BACKENDS:
        raise ValueError(
            f"`score_mod` and `mask_mod` are served by backend 'flash' (compiled into the C++ "
            f"kernels on CPU, attnaux's own kernels on Hopper GPUs), 'flex' (blockwise, "
            f"compiled by XLA) or 'reference' (materialised); "
            f"got backend={backend!r}."
        )
    if bias is not None:
        raise ValueError("`bias` does not combine with `score_mod`/`mask_mod`: add it in the "
                         "score_mod (`lambda s, b, h, i, j: s + bias[b, h, i, j]`, closing over "
                         "the array, which then receives its gradient).")
    if mask is not None:
        raise ValueError("`mask` does not combine with `score_mod`/`mask_mod`: read it in the "
                         "mask_mod (`lambda b, h, i, j: mask[b, h, i, j]`).")
    if backend in ("flex", "flash") and return_probs:
        raise ValueError(f"backend={backend!r} does not save the probabilities "
                         "(return_probs=True); use backend='reference' (materialised) or 'auto'.")


def _hopper(problem, mods, consts, dense):
    """`(program, extras, tile_mask, split, None)` when attnaux's Hopper kernels can run the
    functions, else `(None, (), None, None, why not)`."""
    why = _hopper_mods.unavailable(problem)
    if why is not None:
        return None, (), None, None, why
    try:
        program, extras = translate(mods.score_scalar, mods.n_score, mods.mask_scalar,
                                    mods.n_mask, consts)
        split = _hopper_mods.split(program)
    except Untranslatable as error:
        return None, (), None, None, str(error)
    tile_mask = None if dense is None else _flex.tiles_of(dense, 64)
    return program, extras, tile_mask, split, None


def _compiled(problem, mods, consts, dense, platform: str):
    """`(program, extras, tile_mask, None)` when the CPU kernels can run the functions, else
    `(None, (), None, why not)`."""
    if platform != "cpu":
        return None, (), None, (
            f"score programs run in the CPU kernels and on Hopper GPUs; not on {platform!r}")
    why = _flash_cpu.mod_unavailable(platform)
    if why is not None:
        return None, (), None, why
    try:
        program, extras = translate(mods.score_scalar, mods.n_score, mods.mask_scalar,
                                    mods.n_mask, consts)
    except Untranslatable as error:
        return None, (), None, str(error)
    arrays = problem.arrays
    _, q_seq, q_heads, _ = arrays.q.shape
    if any(program.differentiable):
        q_tiles = -(-q_seq // _flash_cpu.KERNEL_TILE)
        need = q_heads * q_tiles * program.size
        if need > CONST_GRADIENT_MAX_FLOATS:
            return None, (), None, (
                f"the captured arrays ({program.size} floats) are too large for the kernels' "
                f"per-tile gradient sums ({need} floats per batch row > "
                "CONST_GRADIENT_MAX_FLOATS)")
    tile_mask = None if dense is None else _flex.tiles_of(dense, _flash_cpu.KERNEL_TILE)
    return program, extras, tile_mask, None


SEGMENT_ID_SPLIT = 12
"""Segment ids reach the Hopper kernels as float32 per-row and per-column inputs; compared as
two halves (`id >> 12`, `id & 4095`, each below 2**20) every int32 id stays exact."""


def rules_as_mask(problem, mask_mod):
    """`(problem, mask_mod)` of the same call with its data-dependent rules (per-row lengths,
    segment ids; a bottom-right mask and window, whose diagonal moves with the lengths) moved
    into the mask_mod, and q, k, v zeroed past the lengths (so NaN stored in padding never
    reaches a product, as the kernels that read lengths guarantee); None when it has none.

    The Hopper kernels serve the functions with static masking rules only; with this, they
    serve calls with lengths and segment ids too. The rewritten mask closes over the lengths
    and ids (captured int32 arrays: per-row and per-column inputs of the kernels)."""
    arrays, options = problem.arrays, problem.options
    segments = arrays.q_segment_ids is not None
    lengths = options.has_seqlens
    if not (lengths or segments):
        return None
    q_len, kv_len = arrays.q_seqlens, arrays.kv_seqlens
    moving = lengths and options.causal == 2  # the diagonal moves with the lengths
    left, right = options.window_left, options.window_right
    if segments:
        q_ids, kv_ids = arrays.q_segment_ids, arrays.kv_segment_ids
        low = (1 << SEGMENT_ID_SPLIT) - 1
        q_hi, q_lo = q_ids >> SEGMENT_ID_SPLIT, q_ids & low
        kv_hi, kv_lo = kv_ids >> SEGMENT_ID_SPLIT, kv_ids & low

    def rules(b, h, i, j):
        keep = jnp.bool_(True) if mask_mod is None else mask_mod(b, h, i, j)
        if lengths:
            keep = keep & (i < q_len[b]) & (j < kv_len[b])
        if segments:
            keep = keep & (q_hi[b, i] == kv_hi[b, j]) & (q_lo[b, i] == kv_lo[b, j])
        if moving:
            diagonal = i + (kv_len[b] - q_len[b])
            keep = keep & (j <= diagonal)
            if left >= 0:
                keep = keep & (j >= diagonal - left)
            if right >= 0:
                keep = keep & (j <= diagonal + right)
        return keep

    q, k, v = arrays.q, arrays.k, arrays.v
    if lengths:
        def zeroed(x, row_lengths):
            covered = jnp.arange(x.shape[1])[None, :] < row_lengths[:, None]
            return jnp.where(covered[:, :, None, None], x, jnp.zeros((), x.dtype))
        q, k, v = zeroed(q, q_len), zeroed(k, kv_len), zeroed(v, kv_len)
    bsz = q.shape[0]
    arrays = arrays._replace(  # the lengths live in the mask now: every row and key counts
        q=q, k=k, v=v, q_segment_ids=None, kv_segment_ids=None,
        q_seqlens=jnp.full((bsz,), q.shape[1], jnp.int32),
        kv_seqlens=jnp.full((bsz,), k.shape[1], jnp.int32))
    options = options._replace(has_seqlens=False)
    if moving:
        options = options._replace(causal=0, window_left=-1, window_right=-1)
    return problem._replace(arrays=arrays, options=options), rules


def choose_with_rules(problem, score_mod, mask_mod, backend, bias, mask, return_probs):
    """`(choice, problem, mask_mod)` to run: `choose_mods`' choice, or on a Hopper GPU, for a
    call with lengths or segment ids, the choice for the call with those folded into the
    mask_mod (`rules_as_mask`) when that lets attnaux's Hopper kernels serve it."""
    if jax.default_backend() == "gpu" and backend in ("auto", "flash") and not return_probs:
        rewritten = rules_as_mask(problem, mask_mod)
        if rewritten is not None:
            try:
                new_problem, new_mask_mod = rewritten
                c = choose_mods(new_problem, score_mod, new_mask_mod, backend, bias, mask,
                                return_probs)
            except ValueError:
                c = None
            if c is not None and c.split is not None:
                reasons = dict(c.reasons, flash=c.reasons["flash"] + (
                    "; the lengths / segment ids are folded into the mask_mod (per-row and "
                    "per-column inputs of the kernels)"))
                return c._replace(reasons=reasons), *rewritten
    return choose_mods(problem, score_mod, mask_mod, backend, bias, mask,
                       return_probs), problem, mask_mod


def choose_mods(problem, score_mod, mask_mod, backend, bias, mask, return_probs) -> ModsChoice:
    """The backend (and what it needs) for a validated call with score_mod/mask_mod."""
    options = problem.options
    _check(backend, bias, mask, return_probs)
    arrays = problem.arrays
    mods, consts = _flex.convert(score_mod, mask_mod)
    bsz, q_seq, q_heads, _ = arrays.q.shape
    kv_seq = arrays.k.shape[1]
    dense, why_not = _flex.dense_mask(mods, consts, bsz, q_heads, q_seq, kv_seq)
    table = _flex.block_table(mods, consts, options, bsz, q_heads, q_seq, kv_seq, dense, why_not)
    platform = jax.default_backend()
    split = None
    if platform == "gpu":
        program, extras, tile_mask, split, why = _hopper(problem, mods, consts, dense)
    else:
        program, extras, tile_mask, why = _compiled(problem, mods, consts, dense, platform)
    if backend == "flash" and program is None:
        raise ValueError(f"backend='flash' cannot serve this score_mod/mask_mod: {why}.")
    chosen = backend
    if backend == "auto":
        chosen = "reference" if return_probs else "flash" if program is not None else "flex"
    if split is not None:
        tiles = ""
        if tile_mask is not None:
            kept = float((tile_mask > 0).mean())
            tiles = f"; mask_mod's block table keeps {kept:.1%} of the 64 x 64 tiles"
        elif why_not:
            tiles = f"; {why_not}: no tile skipped by it"
        flash = (f"attnaux's Hopper kernels run the functions: {len(split.kernel)} of "
                 f"{program.n_instr} instructions inside the tiles, {len(split.rows)} per-row "
                 f"and {len(split.cols)} per-column inputs computed ahead by XLA{tiles}")
    elif program is not None:
        tiles = ""
        if tile_mask is not None:
            kept = float((tile_mask > 0).mean())
            tiles = (f"; mask_mod's block table keeps {kept:.1%} of the 64 x 64 tiles (the "
                     "causal/window/length rules skip more)")
        elif why_not:
            tiles = f"; {why_not}: no tile skipped by it"
        flash = (f"the functions run inside the C++ kernels as a score program of "
                 f"{program.n_instr} instructions{tiles}")
    else:
        flash = f"cannot run these functions: {why}"
    if chosen == "flash":
        flash += "; chosen"
    elif program is not None:
        flash += ("; not chosen: it saves no probabilities" if return_probs
                  else f"; not chosen: asked for {backend}")
    reasons = {
        "flash": flash,
        "flex": _flex.describe(table) + (
            "; chosen" if chosen == "flex" else
            "; not chosen: it saves no probabilities" if return_probs else
            "; not chosen: the compiled kernels serve it" if chosen == "flash" else
            f"; not chosen: asked for {chosen}"),
        "reference": "materialises the q_seq x kv_seq scores" + (
            "; chosen" if chosen == "reference" else ""),
        "probs": "does not serve score_mod/mask_mod: flash and flex do",
        "small_seq": "does not serve score_mod/mask_mod: flash and flex do",
    }
    implementation = {
        "flash": ("Pallas Mosaic GPU (attnaux's Hopper kernels) with a split score program"
                  if split is not None else f"C++ (XLA FFI, {platform}) with a score program"),
        "flex": "JAX (XLA-compiled)", "reference": "JAX (XLA-compiled), materialised",
    }[chosen]
    return ModsChoice(chosen, implementation, mods, consts, table, program, extras, tile_mask,
                      reasons, split)


def attention_with_mods(q, k, v, *, statics, score_mod, mask_mod, bias, mask, q_seqlens,
                        kv_seqlens, q_segment_ids, kv_segment_ids, sink, key, return_probs,
                        backend):
    from ._aux import unflatten
    from ._canon import canonicalize
    from ._reference import reference_attention

    problem = canonicalize(q, k, v, statics, q_seqlens=q_seqlens, kv_seqlens=kv_seqlens,
                           q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                           sink=sink, key=key)
    c, problem, mask_mod = choose_with_rules(problem, score_mod, mask_mod, backend, bias,
                                             mask, return_probs)
    arrays, options = problem.arrays, problem.options
    probs = None
    if c.backend == "flash" and c.split is not None:
        out, lse, row_max = _hopper_mods.run(arrays, options, c.split, (*c.consts, *c.extras),
                                             c.tile_mask)
    elif c.backend == "flash":
        flat = pack_consts(c.program, c.consts, c.extras)
        out, lse, row_max = _flash_cpu.run_mods(arrays, options, c.program, flat, c.tile_mask)
    elif c.backend == "flex":
        out, lse, row_max = _flex.run(arrays, options, c.mods, c.consts, c.table)
    else:
        out, lse, row_max, probs = reference_attention(arrays, options,
                                                       return_probs=return_probs, mods=c.mods,
                                                       consts=c.consts)
    return unflatten(problem.batch_shape, out, lse, row_max, probs, arrays.rng_state,
                     backend=c.backend, dropout_impl="attnaux")
