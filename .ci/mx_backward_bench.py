"""The staged MXFP8 experts' forward + backward (mokgen.mx_experts.experts_forward_train) against
mokgen's BF16 forward + backward on the bench's local workloads (runs on an H200, not in CI;
issue 6's backward ratio), median of 10 CUDA-event timings each, and the MXFP8 gradients' error
against float64 autograd of the unquantized layer: the output's and each gradient's relative
Frobenius error. Usage: python3 .ci/mx_backward_bench.py [SPEC...] (default: every bundled spec)."""
import statistics
import sys

import torch

from mokgen import bench, load_spec, mx_experts, mx_gemm, reference
from mokgen.spec import bundled_specs


def timed(fn, n=10):
    """Median ms of n CUDA-event timed calls after one warm-up (mokgen.bench.time_cuda)."""
    return statistics.median(bench.time_cuda(lambda i: fn(), n_inputs=1, warmup=1, iters=n))


for name in sys.argv[1:] or bundled_specs():
    ep = bench.LOCAL_EP.get(name, 8)
    spec, tokens = bench.local_spec(load_spec(name), ep)
    layer, (wg, wu, wd), inputs = bench.backward_problem(spec, tokens, 1, bench.local_layer_kwargs(load_spec(name), ep))
    x, ids, w, d_out = inputs[0]
    clamp = spec.activation.clamp_limit

    def bf16_step():
        for t in (x, w, *layer.parameters()):
            t.grad = None
        layer(x, ids, w).backward(d_out)

    def mx_step(form="bf16"):
        for t in (x, w, wg, wu, wd):
            t.grad = None
        mx_experts.experts_forward_train(x, ids, w, wg, wu, wd, clamp, form=form).backward(d_out)

    ms_bf16, ms_mx, ms_quad = timed(bf16_step), timed(mx_step), timed(lambda: mx_step("quad"))
    ms_wq = timed(lambda: (mx_experts.quantize_weights(wg, wu, wd, codes=False),
                           mx_gemm.expert_weights([wd], transpose=True), mx_gemm.expert_weights([wg, wu], transpose=True)))
    flops = 3 * bench.routed_flops(spec, tokens)
    print(f"{spec.name}: BF16 megakernel fwd+bwd {ms_bf16:.3f} ms ({flops / ms_bf16 / 1e9:.0f} TFLOP/s), "
          f"MXFP8 staged fwd+bwd {ms_mx:.3f} ms ({flops / ms_mx / 1e9:.0f}; FP8 quad form {ms_quad:.3f} ms), "
          f"MXFP8 / BF16 speed {ms_bf16 / ms_mx:.2f}x; of which the weights' three quantizations {ms_wq:.3f} ms",
          flush=True)
    for t in (x, w, wg, wu, wd):
        t.grad = None
    out = mx_experts.experts_forward_train(x, ids, w, wg, wu, wd, clamp)
    out.backward(d_out)
    grads = [t.grad.double() for t in (x, w, wg, wu, wd)]
    layer = None  # frees the BF16 layer (bf16_step closes over the name)
    try:  # float64 autograd of kimi-k2.5's local layer needs more than an H100's 80 GB (v0.43)
        ref = [t.detach().double().requires_grad_(True) for t in (x, w, wg, wu, wd)]
        ref_out = reference.experts_forward(ref[0], ids, ref[1], *ref[2:], clamp_limit=clamp,
                                            acc_dtype=torch.float64)
        ref_out.backward(d_out.double())
        errs = {"out": ((out.double() - ref_out.detach()).norm() / ref_out.detach().norm()).item()}
        errs.update({n: ((g - r.grad).norm() / r.grad.norm()).item()
                     for n, g, r in zip(("dx", "dw", "dw_gate", "dw_up", "dw_down"), grads, ref)})
        print("  MXFP8 (bf16 math) against float64: " + ", ".join(f"{n} {e:.2e}" for n, e in errs.items()),
              flush=True)
    except torch.OutOfMemoryError:
        print("  MXFP8 against float64: not measured (the float64 reference ran out of GPU memory)", flush=True)
    ref = ref_out = grads = out = None
    torch.cuda.empty_cache()
