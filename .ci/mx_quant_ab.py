"""The MXFP8 column quantizers, v1 against v2 (MOKGEN_MX_QUANT; runs on an H200, not in CI;
docs/perf-notes.md v0.39-v0.41; by rows one kernel since v0.41), on the bench's local weights of
each named spec: by columns (the dgrads' W_down^T and [W_gate; W_up]^T) and the activations by column (cols_bf16_math of
float32 rows, the wgrads' B). ABBA blocks of 5 timed calls each (median per block), then the
mean of B / A over the blocks with its min and max, and GB/s of the median call (bytes read plus
written). Checks the two versions' bits first. Usage: python3 .ci/mx_quant_ab.py [SPEC ...] (default
kimi-k2.5)."""
import os
import statistics
import sys

import torch

from mokgen import bench, load_spec, mx_gemm

BLOCKS = 10


def timed(fn, n=5):
    return statistics.median(bench.time_cuda(lambda i: fn(), n_inputs=1, warmup=1, iters=n))


def ab(name: str) -> None:
    spec, tokens = bench.local_spec(load_spec(name), bench.LOCAL_EP.get(name, 8))
    wg, wu, wd = bench._weights(spec)
    rows = -(-tokens * spec.top_k // 128) * 128 + 128 * spec.num_experts  # the padded rows' bound
    acts = torch.randn(rows, spec.moe_intermediate_size, device="cuda")
    cases = {
        "columns (down^T, [gate;up]^T)": (lambda: (mx_gemm.expert_weights([wd], transpose=True),
                                                   mx_gemm.expert_weights([wg, wu], transpose=True)),
                                          2 * 2 * (wg.numel() + wu.numel() + wd.numel())),
        "activations by column (f32)": (lambda: mx_gemm.cols_bf16_math(acts), (4 + 2) * acts.numel()),
    }
    for label, (fn, nbytes) in cases.items():
        outs = {}
        for q in ("v1", "v2"):
            os.environ["MOKGEN_MX_QUANT"] = q
            got = fn()
            outs[q] = [t.view(torch.uint8) for t in (got if isinstance(got, tuple) else (got,))]
        same = all(torch.equal(a, b) for a, b in zip(outs["v1"], outs["v2"]))
        del outs
        ms = {"v1": [], "v2": []}
        for blk in range(BLOCKS):
            for q in (("v1", "v2") if blk % 2 == 0 else ("v2", "v1")):
                os.environ["MOKGEN_MX_QUANT"] = q
                ms[q].append(timed(fn))
        ratios = [b / a for a, b in zip(ms["v1"], ms["v2"])]
        a, b = statistics.median(ms["v1"]), statistics.median(ms["v2"])
        print(f"{spec.name} {label}: v1 {a:.3f} ms ({nbytes / a / 1e6:.0f} GB/s), v2 {b:.3f} ms "
              f"({nbytes / b / 1e6:.0f} GB/s), v2 / v1 {statistics.mean(ratios):.4f} "
              f"[{min(ratios):.4f}, {max(ratios):.4f}], same bits: {same}", flush=True)
    os.environ.pop("MOKGEN_MX_QUANT", None)


for spec_name in sys.argv[1:] or ["kimi-k2.5"]:
    ab(spec_name)  # its tensors go when it returns
    torch.cuda.empty_cache()
