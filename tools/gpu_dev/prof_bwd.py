"""Per-kernel GPU timeline of forward+backward (jax.profiler): attnaux's CUDA backward
(`hopper_candidate(cuda_backward=True)`), cuDNN and FlashAttention-3, `benchmarks/gpu_hopper.py`'s
candidates. After `source tools/gpu_dev/pre.sh`:
`python3 tools/gpu_dev/prof_bwd.py 8x1024x16x128c,4x2048x16x128 [cuda,cudnn,fa3]` (a trailing
c: causal)."""
import glob, os, sys, tempfile
from collections import Counter, defaultdict
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp
import gpu_hopper as gh
shapes = sys.argv[1].split(",")
cands = {"cuda": gh.hopper_candidate(cuda_backward=True), "cudnn": gh.cudnn_attention,
         "fa3": gh.CANDIDATES["fa3"]}
if len(sys.argv) > 2:
    cands = {k: v for k, v in cands.items() if k in sys.argv[2].split(",")}
for shape in shapes:
    causal = shape.endswith("c")
    b, s, h, d = (int(x) for x in shape.rstrip("c").split("x"))
    key = jax.random.key(0)
    q, k, v, w = (jax.random.normal(jax.random.fold_in(key, i), (b, s, h, d), jnp.bfloat16) for i in range(4))
    for name, fn in cands.items():
        f = jax.jit(lambda q, k, v, w: jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, causal).astype(jnp.float32) * w), argnums=(0, 1, 2))(q, k, v))
        for _ in range(3):
            jax.block_until_ready(f(q, k, v, w))
        dr = tempfile.mkdtemp(); N = 10
        with jax.profiler.trace(dr):
            outs = [f(q, k, v, w) for _ in range(N)]
            jax.block_until_ready(outs)
        path = glob.glob(os.path.join(dr, "**", "*.xplane.pb"), recursive=True)[0]
        pd = jax.profiler.ProfileData.from_file(path)
        evs = []
        for plane in pd.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for line in plane.lines:
                if "tream" in line.name:
                    evs.extend((e.start_ns, e.duration_ns, e.name) for e in line.events)
        evs.sort()
        t0, t1 = evs[0][0], max(a + b_ for a, b_, _ in evs)
        per = defaultdict(int); cnt = Counter()
        for _, du, n in evs:
            per[n[:90]] += du; cnt[n[:90]] += 1
        busy = sum(per.values())
        print(f"== {shape} {name}: span/call {(t1-t0)/N/1e3:.1f} us, busy/call {busy/N/1e3:.1f} us", flush=True)
        for n, du in sorted(per.items(), key=lambda x: -x[1])[:9]:
            print(f"   {du/N/1e3:8.1f} us x{cnt[n]/N:.0f}  {n}")
