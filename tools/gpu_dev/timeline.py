"""One jitted call's GPU kernels under `jax.profiler` (shared by prof_bwd.py and
prof_varlen.py)."""

import glob
import os
import tempfile
from collections import Counter, defaultdict

import jax

CALLS = 10


def timeline(f, args, *, top=7, width=70):
    """`(span, busy, kernels)` of one call of `f(*args)` in us, over CALLS calls after warm-ups:
    the span from the first kernel's start to the last one's end, the kernels' summed time, and
    the `top` kernels by time, `(name[:width], us a call, launches a call)`."""
    for _ in range(4):
        jax.block_until_ready(f(*args))
    folder = tempfile.mkdtemp()
    with jax.profiler.trace(folder):
        jax.block_until_ready([f(*args) for _ in range(CALLS)])
    path = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)[0]
    events = []
    for plane in jax.profiler.ProfileData.from_file(path).planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                if "tream" in line.name:
                    events.extend((e.start_ns, e.duration_ns, e.name) for e in line.events)
    events.sort()
    start, end = events[0][0], max(s + d for s, d, _ in events)
    per_kernel, launches = defaultdict(int), Counter()
    for _, duration, name in events:
        per_kernel[name[:width]] += duration
        launches[name[:width]] += 1
    kernels = sorted(per_kernel.items(), key=lambda item: -item[1])[:top]
    return ((end - start) / CALLS / 1e3, sum(per_kernel.values()) / CALLS / 1e3,
            [(name, ns / CALLS / 1e3, launches[name] / CALLS) for name, ns in kernels])
