"""Where the gathered GEMMs' time goes (runs on an H200, not in CI): dW_down and dh of the
qwen3.5-35b-a3b layer at T = 16384 (uniform routing), each operand form timed interleaved by
CUDA events (median of `--iters` rounds, each round one launch of every form in turn):
  tma     A from the gathered copy by TMA (MOKGEN_BWD_DOUT=gather's kernels)
  index   A from dOut through the token index (cp.async; MOKGEN_BWD_DOUT=inline's)
  inorder A from the gathered copy through the identity index (cp.async over contiguous rows)
If `inorder` runs as `tma`, the gathered kernels' loss lies in dOut's scattered rows (L2); if
it runs as `index`, in the cp.async producer itself (its issue rate, the consumers' proxy fence).
--flags: nvcc flags of a variant build of the library to time instead (bwd_gemm.build_variant),
e.g. -DMOKGEN_GATHER_NO_FENCE (the consumers' proxy fence left out: a measurement, not a
correct kernel).
Usage: python3 .ci/gather_probe.py [--iters 30] [--flags=-DNAME,...]"""

import argparse
import statistics

import torch

from mokgen import bwd_gemm

ap = argparse.ArgumentParser()
ap.add_argument("--iters", type=int, default=30)
ap.add_argument("--flags", default="")
args = ap.parse_args()
if args.flags:
    import tempfile
    from pathlib import Path

    flags = args.flags.split(",")
    variant = bwd_gemm._Lib(bwd_gemm.build_variant(flags, Path(tempfile.mkdtemp()) / "variant"))
    bwd_gemm.load_library = lambda: variant  # every call below goes to the variant
    print(f"variant build: {' '.join(flags)}")
T, K, E, H, I = 16384, 8, 256, 2048, 512
gen = torch.Generator(device="cuda").manual_seed(0)
ids = torch.stack([torch.randperm(E, generator=gen, device="cuda")[:K] for _ in range(T)]).to(torch.int32)
order, tok, offs, _ = bwd_gemm.expert_major(ids.contiguous(), E, torch.rand(T, K, device="cuda"))
dout = torch.randn(T, H, generator=gen, device="cuda").to(torch.bfloat16)
copy = dout.index_select(0, tok).contiguous()
ident = torch.arange(T * K, device="cuda")
hw = torch.randn(T * K, I, generator=gen, device="cuda").to(torch.bfloat16)
wd = (torch.randn(E, H, I, generator=gen, device="cuda") * H**-0.5).to(torch.bfloat16)
forms = {
    "dW_down tma": lambda: bwd_gemm.weight_grads(copy, hw, offs, cluster=1, schedule="split"),
    "dW_down index": lambda: bwd_gemm.weight_grads(dout, hw, offs, a_index=tok),
    "dW_down inorder": lambda: bwd_gemm.weight_grads(copy, hw, offs, a_index=ident),
    "dh tma": lambda: bwd_gemm.rows_gemm([(copy, wd)], offs, out_dtype=torch.bfloat16, cluster=1),
    "dh index": lambda: bwd_gemm.rows_gemm([(dout, wd)], offs, out_dtype=torch.bfloat16, a_index=tok),
    "dh inorder": lambda: bwd_gemm.rows_gemm([(copy, wd)], offs, out_dtype=torch.bfloat16, a_index=ident),
}
ref = {k: f() for k, f in forms.items()}
for kind in ("dW_down", "dh"):  # the same bits every way
    outs = [v for k, v in ref.items() if k.startswith(kind + " ")]
    assert all(torch.equal(o, outs[0]) for o in outs), kind
times = {k: [] for k in forms}
for _ in range(3):
    for f in forms.values():
        f()
torch.cuda.synchronize()
for _ in range(args.iters):
    for k, f in forms.items():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        b.synchronize()
        times[k].append(a.elapsed_time(b))
for k, v in times.items():
    print(f"{k:18s} {statistics.median(v):.3f} ms (median of {len(v)})")
