"""CPU benchmark: attnaux `flash` against `jax.nn.dot_product_attention` (XLA), side by side.

Run it as `python -m attnaux bench`. Conventions follow `BENCHMARKS.md`:

- FLOPs: forward = `4 * b * h * s * s * d`, halved for causal; forward+backward = 3.5 x forward.
- Timing: every function is jitted; one warm-up call (which compiles), then the best of 5 calls,
  each ended by `jax.block_until_ready`.
- Forward: attnaux returns `(out, lse, max)`, XLA returns `out`. Forward+backward: `jax.grad` of
  `sum(out * dout)` (a fixed random `dout`) with respect to `q, k, v`, jitted.
- Peak memory: each (candidate, pass) runs in a fresh subprocess (`python -m attnaux._cli.bench
  _memory ...`) that creates its inputs, compiles ahead of time, resets the process's RSS
  high-water mark, runs the call twice and reports the peak RSS (`VmHWM`, what `getrusage`'s
  `ru_maxrss` reports minus what a child inherits from its parent) minus the RSS it had before
  the first call.
"""

import argparse
import dataclasses
import functools
import json
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from attnaux._attention import attention, explain
from attnaux._version import __version__

Shape = tuple[int, int, int, int]  # (b, s, h, d), layout BSHD

SHAPES: tuple[Shape, ...] = ((4, 512, 8, 64), (1, 2048, 8, 64), (1, 4096, 8, 64), (1, 2048, 8, 128))
MEMORY_SHAPE: Shape = (1, 8192, 8, 64)
QUICK_SHAPES: tuple[Shape, ...] = ((1, 512, 8, 64),)
QUICK_MEMORY_SHAPE: Shape = (1, 1024, 8, 64)
PASSES = ("fwd", "fwd+bwd")
PASS_NAMES = {"fwd": "forward", "fwd+bwd": "forward+backward"}
REPEATS = 5
DTYPE = jnp.float32


# --------------------------------------------------------------------------------------------
# The candidates: forward functions of (q, k, v) returning a tuple whose first element is out.


def _attnaux_flash(q, k, v, *, causal: bool):
    out, aux = attention(q, k, v, causal=causal, backend="flash")
    return out, aux.lse, aux.max


def _xla(q, k, v, *, causal: bool):
    return (jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla"),)


CANDIDATES = {"attnaux": _attnaux_flash, "xla": _xla}
LABELS = {"attnaux": "attnaux flash", "xla": "XLA (jax.nn)"}


def build(candidate: str, causal: bool, pass_: str):
    """The jitted function to time: `f(q, k, v, dout)`; forward ignores `dout`."""
    forward = functools.partial(CANDIDATES[candidate], causal=causal)
    if pass_ == "fwd":
        return jax.jit(lambda q, k, v, dout: forward(q, k, v))

    def loss(q, k, v, dout):
        return jnp.sum(forward(q, k, v)[0] * dout)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def make_inputs(shape: Shape, seed: int = 0) -> tuple[jax.Array, ...]:
    """Random `q, k, v, dout`, all `[b, s, h, d]` float32, already on the device."""
    keys = jax.random.split(jax.random.key(seed), 4)
    return jax.block_until_ready(tuple(jax.random.normal(key, shape, DTYPE) for key in keys))


def flops(shape: Shape, causal: bool, pass_: str) -> float:
    b, s, h, d = shape
    forward = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    return forward * (3.5 if pass_ == "fwd+bwd" else 1.0)


def best_time(fn, args, repeats: int) -> tuple[float, object]:
    """One warm-up call (compiles), then the best of `repeats` timed calls, in seconds."""
    result = jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - start)
    return best, result


def flash_unavailable(shape: Shape = (1, 8, 1, 8)) -> str | None:
    """Why `backend="flash"` cannot run here (for example, the extension is not built), or None."""
    spec = jax.ShapeDtypeStruct(shape, DTYPE)
    try:
        explain(spec, spec, spec, backend="flash")
    except ValueError as error:
        return str(error)
    return None


def shape_str(shape: Shape) -> str:
    return "x".join(map(str, shape))


def parse_shape(text: str) -> Shape:
    parts = text.lower().split("x")
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(
            f"a shape is BxSxHxD with four positive integers (for example 1x2048x8x64); got "
            f"{text!r}."
        )
    return tuple(int(p) for p in parts)  # type: ignore[return-value]


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _max_abs_diff(a, b) -> float:
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
               for x, y in pairs)


# --------------------------------------------------------------------------------------------
# Throughput


@dataclasses.dataclass
class Cell:
    seconds: float | None = None
    gflops: float | None = None
    error: str | None = None

    def text(self) -> str:
        if self.gflops is not None:
            return f"{self.gflops:.0f}" if self.gflops >= 10 else f"{self.gflops:.1f}"
        return "error" if self.error and self.error != "skipped" else "-"


def run_throughput(shapes, causals, repeats: int, flash_reason: str | None):
    """Times every (shape, causal, pass, candidate); returns `{key: Cell}` and `{key: diff}`."""
    cases = [(s, c, p) for s in shapes for c in causals for p in PASSES]
    cells: dict[tuple, Cell] = {}
    diffs: dict[tuple, float] = {}
    total = len(cases) * len(CANDIDATES)
    step = 0
    for shape, causal, pass_ in cases:
        args = make_inputs(shape)
        results = {}
        for candidate in CANDIDATES:
            step += 1
            key = (shape, causal, pass_, candidate)
            mask = "yes" if causal else "no"
            head = (f"[{step:2d}/{total}] {shape_str(shape):>13} causal={mask:3} {pass_:7} "
                    f"{LABELS[candidate]:13}")
            if candidate == "attnaux" and flash_reason is not None:
                cells[key] = Cell(error="skipped")
                _progress(f"{head}  skipped (flash unavailable)")
                continue
            try:
                seconds, results[candidate] = best_time(build(candidate, causal, pass_), args,
                                                        repeats)
            except Exception as error:  # report and keep going: the other rows still count
                cells[key] = Cell(error=f"{type(error).__name__}: {error}")
                _progress(f"{head}  FAILED: {cells[key].error.splitlines()[0]}")
                continue
            gflops = flops(shape, causal, pass_) / seconds / 1e9
            cells[key] = Cell(seconds, gflops)
            _progress(f"{head} {seconds * 1e3:9.2f} ms {gflops:8.1f} GFLOP/s")
        if len(results) == len(CANDIDATES):
            a, x = results["attnaux"], results["xla"]
            diffs[(shape, causal, pass_)] = _max_abs_diff(a[:1] if pass_ == "fwd" else a,
                                                          x[:1] if pass_ == "fwd" else x)
        del args, results
    return cells, diffs


def _ratio(a: Cell, b: Cell) -> str:
    if a.gflops is None or b.gflops is None:
        return "-"
    return f"{a.gflops / b.gflops:.1f}x"


def throughput_table(shapes, causals, cells, diffs) -> list[str]:
    header = ["b x s x h x d", "causal"]
    for pass_ in PASSES:
        header += [f"{LABELS['attnaux']} {pass_}", f"{LABELS['xla']} {pass_}", f"ratio {pass_}"]
    header.append("max abs diff out / grads")
    rows = []
    for shape in shapes:
        for causal in causals:
            row = [shape_str(shape), "yes" if causal else "no"]
            for pass_ in PASSES:
                a = cells[(shape, causal, pass_, "attnaux")]
                x = cells[(shape, causal, pass_, "xla")]
                row += [a.text(), x.text(), _ratio(a, x)]
            d = [diffs.get((shape, causal, p)) for p in PASSES]
            row.append(" / ".join("-" if v is None else f"{v:.1e}" for v in d))
            rows.append(row)
    return markdown(header, rows)


def markdown(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


# --------------------------------------------------------------------------------------------
# Peak memory, one fresh subprocess per measurement


def _rss_bytes() -> int:
    """The current resident set size of this process (Linux `/proc/self/statm`)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    """The RSS high-water mark of this process's address space (Linux `VmHWM`).

    `getrusage(RUSAGE_SELF).ru_maxrss` is the same figure except that it never goes below the
    high-water mark the process had before `exec`: in a child started by `subprocess`, that is
    the parent's RSS at `fork`, so it would hide the child's own peak. `VmHWM` is reset by
    `_reset_peak_rss` and starts afresh at `exec`; `ru_maxrss` is only the fallback.
    """
    try:
        with open("/proc/self/status") as f:
            return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024
    except (OSError, AttributeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _reset_peak_rss() -> bool:
    """Resets the RSS high-water mark to the current RSS (Linux >= 4.0); False if not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


def _available_bytes() -> int | None:
    """`MemAvailable` of the machine (Linux `/proc/meminfo`), or None."""
    try:
        with open("/proc/meminfo") as f:
            return int(re.search(r"^MemAvailable:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024
    except (OSError, AttributeError):
        return None


def _hwm_of(pid: int) -> int:
    """Another process's RSS high-water mark (`VmHWM`), or 0 when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024
    except (OSError, AttributeError):
        return 0


def measure_memory(candidate: str, pass_: str, shape: Shape) -> None:
    """Runs in the child process; prints two JSON lines: the state before the calls (so that the
    parent still knows it if the calls get the process killed), then the measurement."""
    args = make_inputs(shape)
    compiled = build(candidate, False, pass_).lower(*args).compile()
    try:
        stats = compiled.memory_analysis()
        temp, output = int(stats.temp_size_in_bytes), int(stats.output_size_in_bytes)
    except Exception:  # memory_analysis is not available on every JAX version/platform
        temp = output = None
    reset = _reset_peak_rss()
    baseline = _rss_bytes()
    print(json.dumps(dict(baseline=baseline, temp=temp, output=output, hwm_reset=reset)),
          flush=True)
    needed, available = (temp or 0) + (output or 0), _available_bytes()
    if available is not None and needed > available:  # spare the machine an out-of-memory kill
        print(json.dumps(dict(error=f"not run: XLA plans {_mib(needed)} MiB of buffers and only "
                                    f"{_mib(available)} MiB of memory are available")))
        return
    for _ in range(2):  # a first call and a repeated one: buffers an allocator keeps still count
        result = jax.block_until_ready(compiled(*args))
        del result
    peak = _peak_rss_bytes()
    ru_maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # for the record
    print(json.dumps(dict(peak_increase=peak - baseline, peak=peak, ru_maxrss=ru_maxrss)),
          flush=True)


def run_memory_child(candidate: str, pass_: str, shape: Shape, timeout: float = 900) -> dict:
    """Runs `measure_memory` in a fresh Python process and returns what it reported.

    While the child runs, its high-water mark is polled, so that a child killed on the way (by
    the out-of-memory killer, typically) still yields a lower bound, `peak_at_least`; `error`
    then says what happened.
    """
    command = [sys.executable, "-m", "attnaux._cli.bench", "_memory", candidate, pass_,
               shape_str(shape)]
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        child = subprocess.Popen(command, stdout=out, stderr=err, text=True)
        seen, deadline, timed_out = 0, time.monotonic() + timeout, False
        while child.poll() is None:
            seen = max(seen, _hwm_of(child.pid))
            if time.monotonic() > deadline:
                child.kill()
                child.wait()
                timed_out = True
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        lines, err_lines = out.read().splitlines(), err.read().strip().splitlines()
    result: dict = {}
    for line in lines:
        if line.startswith("{"):
            result.update(json.loads(line))
    code = child.returncode
    if code == 0 and "peak_increase" in result:
        return result
    if "error" in result:  # the child said why it did not measure
        return result
    if timed_out:
        result["error"] = f"timed out after {timeout:.0f} s"
    elif code == -signal.SIGKILL:
        result["error"] = "killed by SIGKILL (most likely the out-of-memory killer)"
    else:
        result["error"] = f"exit status {code}: {(err_lines or ['no output'])[-1]}"
    if "baseline" in result and seen > result["baseline"]:
        result["peak_at_least"] = seen - result["baseline"]
    return result


def run_memory(shape: Shape, flash_reason: str | None) -> dict:
    results = {}
    for pass_ in PASSES:
        for candidate in CANDIDATES:
            head = f"[memory] {shape_str(shape)} {pass_:7} {LABELS[candidate]:13}"
            if candidate == "attnaux" and flash_reason is not None:
                results[(candidate, pass_)] = {"error": "skipped"}
                _progress(f"{head}  skipped (flash unavailable)")
                continue
            start = time.perf_counter()
            result = results[(candidate, pass_)] = run_memory_child(candidate, pass_, shape)
            took = time.perf_counter() - start
            peak = _peak_text(result)
            message = f"FAILED: {result['error']}; " if "error" in result else ""
            _progress(f"{head} {message}peak RSS +{peak} MiB, XLA temp "
                      f"{_mib(result.get('temp'))} MiB ({took:.0f} s)")
    return results


def _mib(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 2**20:.1f}" if abs(n) < 10 * 2**20 else f"{n / 2**20:,.0f}"


def _peak_text(result: dict) -> str:
    if "peak_increase" in result:
        return _mib(result["peak_increase"])
    if "peak_at_least" in result:
        return f"> {_mib(result['peak_at_least'])} (killed)"
    return "-"


def memory_table(shape: Shape, results: dict) -> list[str]:
    header = ["measure", "pass", LABELS["attnaux"], LABELS["xla"], "XLA / attnaux"]
    rows = []
    for field, name in (("peak_increase", "peak RSS increase (MiB)"),
                        ("temp", "XLA temp buffers (MiB)"),
                        ("output", "output buffers (MiB)")):
        for pass_ in PASSES:
            a, x = (results[(c, pass_)] for c in ("attnaux", "xla"))
            if field == "peak_increase":
                cells = [_peak_text(a), _peak_text(x)]
                a = a.get("peak_increase")
                x = x.get("peak_increase", x.get("peak_at_least"))
                bound = "peak_increase" not in results[("xla", pass_)]
            else:
                a, x = a.get(field), x.get(field)
                cells, bound = [_mib(a), _mib(x)], False
            ratio = "-" if not (a and x) else f"{x / a:.1f}x" if x < 10 * a else f"{x / a:.0f}x"
            rows.append([name, PASS_NAMES[pass_], *cells, ("> " if bound and a else "") + ratio])
    return markdown(header, rows)


# --------------------------------------------------------------------------------------------
# Command line


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            match = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        if match:
            return match.group(1).strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load() -> str:
    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `python -m attnaux bench`."""
    parser.add_argument(
        "--quick", action="store_true",
        help=f"smoke test (seconds): only the shape {shape_str(QUICK_SHAPES[0])} and peak memory "
             f"at {shape_str(QUICK_MEMORY_SHAPE)}, unless --shapes or --memory-shape say "
             "otherwise.")
    parser.add_argument(
        "--shapes", nargs="+", type=parse_shape, metavar="BxSxHxD",
        help="shapes to time, batch x seq x heads x head_dim (q, k and v alike). Default: the CPU "
             f"table of BENCHMARKS.md: {', '.join(map(shape_str, SHAPES))}.")
    parser.add_argument(
        "--causal", choices=("both", "no", "yes"), default="both",
        help="time without the causal mask, with it, or both (default: both).")
    parser.add_argument(
        "--repeats", type=int, default=REPEATS, metavar="N",
        help=f"timed calls per case after one warm-up; the best counts (default: {REPEATS}).")
    parser.add_argument(
        "--no-memory", action="store_true",
        help="skip the peak-memory measurement (4 fresh subprocesses; at the default shape the "
             "XLA forward+backward needs several GiB and about half a minute).")
    parser.add_argument(
        "--memory-shape", type=parse_shape, metavar="BxSxHxD",
        help=f"shape of the peak-memory measurement, non-causal (default: "
             f"{shape_str(MEMORY_SHAPE)}).")


def main(args: argparse.Namespace) -> int:
    """Runs the benchmark; progress goes to stderr, the markdown tables to stdout."""
    if args.repeats < 1:
        raise SystemExit("--repeats must be at least 1.")
    shapes = tuple(args.shapes or (QUICK_SHAPES if args.quick else SHAPES))
    memory_shape = args.memory_shape or (QUICK_MEMORY_SHAPE if args.quick else MEMORY_SHAPE)
    causals = {"both": (False, True), "no": (False,), "yes": (True,)}[args.causal]
    load_start = _load()
    flash_reason = flash_unavailable()
    notes = []
    if flash_reason is not None:
        notes.append(f"**attnaux flash did not run**: {flash_reason} Its columns show '-'; build "
                     "the extension (`pip install .`) to measure it.")
        _progress(f"WARNING: attnaux flash is unavailable, only XLA runs: {flash_reason}")

    cells, diffs = run_throughput(shapes, causals, args.repeats, flash_reason)
    memory = None if args.no_memory else run_memory(memory_shape, flash_reason)

    device = jax.devices()[0]
    lines = [
        f"attnaux {__version__}, JAX {jax.__version__}, {device.platform.upper()}: "
        f"{_cpu_name()}, {os.cpu_count()} cores; float32, layout BSHD, q/k/v heads equal. "
        f"Load average (1 min) at start / end: {load_start} / {_load()}.",
        "",
        f"GFLOP/s (forward = 4*b*h*s*s*d, halved for causal; forward+backward = 3.5x forward), "
        f"best of {args.repeats} jitted calls after a warm-up, `block_until_ready`. attnaux "
        "forward returns out, lse and max; forward+backward is `jax.grad` of sum(out * dout) "
        "w.r.t. q, k, v. Ratio = attnaux / XLA. Last column: max abs difference between the two "
        "(out; dq, dk, dv).",
        "",
        *throughput_table(shapes, causals, cells, diffs),
    ]
    if memory is not None:
        reset = all(r.get("hwm_reset", True) for r in memory.values())
        lines += [
            "",
            f"Peak memory at {shape_str(memory_shape)}, non-causal. Each cell is a fresh process "
            "that creates q, k, v, dout, compiles the function ahead of time, "
            + ("resets the RSS high-water mark, " if reset else "(could NOT reset the RSS "
               "high-water mark, so compile-time peaks may be included: an upper bound) ")
            + "then runs the call twice; the number is the peak RSS of those calls (VmHWM, the "
            "high-water mark getrusage's ru_maxrss reports, read from /proc so that it is not "
            "the parent's RSS inherited at fork) minus the RSS just before the first call. It "
            "includes the outputs (out, or dq/dk/dv) and everything the call allocates, the "
            "kernel's own scratch included; runs vary by a few tens of MiB (allocator arenas, "
            "threads). 'XLA temp buffers' and 'output buffers' "
            "are XLA's compiled memory_analysis() (temp_size_in_bytes, output_size_in_bytes): "
            "a second view that does not see memory allocated inside the attnaux FFI kernel.",
            "",
            *memory_table(memory_shape, memory),
        ]
    errors = [f"{LABELS[c]} {shape_str(shape)} causal={causal} {pass_} failed: {cell.error}"
              for (shape, causal, pass_, c), cell in cells.items()
              if cell.error and cell.error != "skipped"]
    errors += [f"{LABELS[c]} peak-memory run {pass_} at {shape_str(memory_shape)} failed: "
               f"{r['error']}" for (c, pass_), r in (memory or {}).items()
               if "error" in r and r["error"] != "skipped"]
    notes += [e.splitlines()[0] for e in errors]
    if notes:
        lines += [""] + [f"- {n}" for n in notes]
    print("\n".join(lines), flush=True)
    return 1 if errors else 0


def _child(argv: list[str]) -> int:
    """`python -m attnaux._cli.bench _memory CANDIDATE PASS SHAPE`: prints two JSON lines."""
    parser = argparse.ArgumentParser(prog="python -m attnaux._cli.bench _memory")
    parser.add_argument("candidate", choices=tuple(CANDIDATES))
    parser.add_argument("pass_", choices=PASSES, metavar="pass")
    parser.add_argument("shape", type=parse_shape)
    args = parser.parse_args(argv)
    measure_memory(args.candidate, args.pass_, args.shape)
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["_memory"]:
        sys.exit(_child(sys.argv[2:]))
    bench_parser = argparse.ArgumentParser(prog="python -m attnaux._cli.bench", description=__doc__,
                                           formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(bench_parser)
    sys.exit(main(bench_parser.parse_args()))
