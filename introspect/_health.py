import math
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, jaxtyped

from attnaux._internal import AttnAux

from ._blockwise import typechecker

DEFAULT_SATURATION = 0.01


class HealthReport(eqx.Module):
    """Per-head health of one attention call, as [`attnaux.introspect.health`][] returns it.

    Every field is an array over the query heads (the last axis; leading axes appear only when
    `health` is `jax.vmap`ped). "Rows" are softmax rows, counted over all batch elements.

    **Fields:**

    - `rows`: `int32[q_heads]`, the number of rows.
    - `masked`: rows with no visible key (fully masked or padding): `aux.max = -inf` with
      `aux.lse` either `-inf` or finite (a sink). These are expected, not errors.
    - `nonfinite`: rows whose statistics are broken: `lse` or `max` is NaN or `+inf`, or `max`
      is finite while `lse` is not. A healthy call has none; any is an overflow or NaN upstream.
    - `saturated`: rows that see a key and whose softmax is near one-hot:
      `lse - max < saturation`, i.e. the largest probability exceeds `exp(-saturation)`
      (about `1 - saturation`). A row that sees a single key is saturated by definition.
    - `max_logit`: `float32[q_heads]`, the largest logit (`-inf` if every row is masked).
    - `mean_max_logit`: the mean over the rows that see a key of the row maxima (NaN if none).
    - `mean_lse`: the mean of `lse` over the same rows (what a z-loss pushes towards 0).
    - `mean_entropy`: the mean over the same rows of `-sum P log P` from `aux.probs`, or `None`
      when the aux holds no probabilities (the call had no `return_probs=True`; compute it with
      [`entropy`][attnaux.introspect.entropy] and `q`, `k` instead).
    - `saturation`: the threshold used, a static float.
    """

    rows: Int[Array, "*layers q_heads"]
    masked: Int[Array, "*layers q_heads"]
    nonfinite: Int[Array, "*layers q_heads"]
    saturated: Int[Array, "*layers q_heads"]
    max_logit: Float[Array, "*layers q_heads"]
    mean_max_logit: Float[Array, "*layers q_heads"]
    mean_lse: Float[Array, "*layers q_heads"]
    mean_entropy: Float[Array, "*layers q_heads"] | None = None
    saturation: float = eqx.field(static=True, default=DEFAULT_SATURATION)

    def table(self, name: str = "aux") -> str:
        """This report as a plain-text table, one line per head (`name` fills the layer
        column). `print(report)` prints the same."""
        return format_table({name: self})

    def __str__(self) -> str:
        return self.table()

    @staticmethod
    def table_of(collection) -> str:
        """One plain-text table of many reports, one line per (layer, head).

        **Arguments:**

        - `collection`: a `HealthReport`, an `AttnAux`, or a mapping `{name: HealthReport or
          AttnAux}` (an aux is reported with the default saturation threshold).

        **Returns:**

        The table; a warning line follows when any row has non-finite statistics.
        """
        return format_table(collection)


def _per_head(x: jax.Array) -> jax.Array:
    """`[*batch, heads, q_seq(, ...)]` -> `[heads, rows]` (the trailing axes must be removed)."""
    heads = x.shape[-2]
    return jnp.moveaxis(x, -2, 0).reshape(heads, -1)


@jaxtyped(typechecker=typechecker)
def health(aux: AttnAux, *, saturation: float = DEFAULT_SATURATION) -> HealthReport:
    """A per-head health report of an attention call, from its statistics alone.

    Counts the masked, broken (non-finite) and saturated (near one-hot) rows of every head and
    summarises its logit range; cheap (one pass over `lse` and `max`), jit- and vmap-friendly,
    so it can run inside a training step and be logged.

    **Arguments:**

    - `aux`: the `AttnAux` of an attention call.
    - `saturation`: a row is saturated when `lse - max < saturation` (its largest probability
      exceeds `exp(-saturation)`); `> 0`, default 0.01.

    **Returns:**

    A [`HealthReport`][attnaux.introspect.HealthReport] with one entry per query head.

    **Example:**

    ```python
    out, aux = ax.attention(q, k, v, causal=True, return_probs=True)
    report = ai.health(aux)
    report.saturated / report.rows        # fraction of near one-hot rows per head
    report.mean_entropy                   # present because aux.probs is
    ```
    """
    if not isinstance(aux, AttnAux):
        raise TypeError(
            f"health() needs the `AttnAux` returned by attnaux.attention; got an object of type "
            f"{type(aux).__name__}."
        )
    if isinstance(saturation, bool) or not (
        isinstance(saturation, (int, float)) and math.isfinite(saturation) and saturation > 0
    ):
        raise ValueError(f"`saturation` must be a finite float > 0; got {saturation!r}.")
    if jnp.ndim(aux.lse) < 2 or jnp.shape(aux.lse) != jnp.shape(aux.max):
        raise ValueError(
            "`aux.lse` and `aux.max` must share one shape [*batch, q_heads, q_seq]; got "
            f"{tuple(jnp.shape(aux.lse))} and {tuple(jnp.shape(aux.max))}."
        )
    lse = _per_head(jax.lax.stop_gradient(aux.lse).astype(jnp.float32))
    mx = _per_head(jax.lax.stop_gradient(aux.max).astype(jnp.float32))
    heads, n = lse.shape
    nonfinite = (
        jnp.isnan(lse) | jnp.isnan(mx) | (lse == jnp.inf) | (mx == jnp.inf)
        | (jnp.isfinite(mx) & ~jnp.isfinite(lse))
    )
    masked = (mx == -jnp.inf) & ~nonfinite
    seen = jnp.isfinite(mx) & jnp.isfinite(lse)
    count = jnp.sum(seen, axis=1)
    denom = jnp.where(count > 0, count, 1).astype(jnp.float32)

    def mean(x):
        return jnp.where(count > 0, jnp.sum(jnp.where(seen, x, 0), axis=1) / denom, jnp.nan)

    saturated = seen & (lse - mx < saturation)
    max_logit = jnp.max(jnp.where(seen, mx, -jnp.inf), axis=1, initial=-jnp.inf)
    mean_entropy = None
    if aux.probs is not None:
        p = jax.lax.stop_gradient(aux.probs).astype(jnp.float32)
        plogp = jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1)), 0)
        row_entropy = _per_head(-jnp.sum(plogp, axis=-1))
        mean_entropy = mean(row_entropy)
    return HealthReport(
        rows=jnp.full((heads,), n, jnp.int32),
        masked=jnp.sum(masked, axis=1, dtype=jnp.int32),
        nonfinite=jnp.sum(nonfinite, axis=1, dtype=jnp.int32),
        saturated=jnp.sum(saturated, axis=1, dtype=jnp.int32),
        max_logit=max_logit,
        mean_max_logit=mean(mx),
        mean_lse=mean(lse),
        mean_entropy=mean_entropy,
        saturation=float(saturation),
    )


def reports_of(collection, *, saturation: float = DEFAULT_SATURATION) -> dict[str, HealthReport]:
    """`{name: HealthReport}` from a report, an aux, or a mapping of either."""
    if isinstance(collection, (HealthReport, AttnAux)):
        collection = {"aux": collection}
    if not isinstance(collection, Mapping):
        raise TypeError(
            "Expected a HealthReport, an AttnAux, or a mapping {name: HealthReport or AttnAux}; "
            f"got an object of type {type(collection).__name__}."
        )
    reports = {}
    for name, item in collection.items():
        if isinstance(item, AttnAux):
            item = health(item, saturation=saturation)
        if not isinstance(item, HealthReport):
            raise TypeError(
                f"Entry {name!r} must be a HealthReport or an AttnAux; got an object of type "
                f"{type(item).__name__}."
            )
        if item.max_logit.ndim != 1:
            raise ValueError(
                f"Entry {name!r} has report fields of shape {item.max_logit.shape}; expected one "
                "value per head (a vmapped report must be split into one entry per layer)."
            )
        reports[str(name)] = item
    return reports


def _fmt(x: float, digits: int = 3) -> str:
    if x is None:
        return "-"
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    return f"{x:.{digits}f}"


def format_table(collection, *, saturation: float = DEFAULT_SATURATION) -> str:
    """The reports of a collection as a plain-text table, one line per (layer, head)."""
    reports = reports_of(collection, saturation=saturation)
    header = (
        "layer", "head", "rows", "masked", "nonfinite", "saturated", "max_logit",
        "mean_max", "mean_lse", "entropy",
    )
    lines = [header]
    for name, rep in reports.items():
        fields = {f: None if getattr(rep, f) is None else np.asarray(getattr(rep, f))
                  for f in ("rows", "masked", "nonfinite", "saturated", "max_logit",
                            "mean_max_logit", "mean_lse", "mean_entropy")}
        for h in range(fields["rows"].shape[0]):
            ent = fields["mean_entropy"]
            lines.append((
                name, str(h), str(int(fields["rows"][h])), str(int(fields["masked"][h])),
                str(int(fields["nonfinite"][h])), str(int(fields["saturated"][h])),
                _fmt(fields["max_logit"][h]), _fmt(fields["mean_max_logit"][h]),
                _fmt(fields["mean_lse"][h]), "-" if ent is None else _fmt(ent[h]),
            ))
    widths = [max(len(row[c]) for row in lines) for c in range(len(header))]
    out = []
    for index, row in enumerate(lines):
        cells = [cell.ljust(w) if c == 0 else cell.rjust(w)
                 for c, (cell, w) in enumerate(zip(row, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    flagged = [
        f"{name}: {int(np.sum(np.asarray(rep.nonfinite)))} non-finite rows"
        for name, rep in reports.items() if int(np.sum(np.asarray(rep.nonfinite))) > 0
    ]
    if flagged:
        out.append("")
        out.append("WARNING: " + "; ".join(flagged))
    return "\n".join(out)
