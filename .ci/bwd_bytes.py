"""What the experts' backward moves through memory, per kernel, for the bench workloads (CPU only).

A byte model of mokgen's backward as mokgen/backward.py runs it (mokgen's GEMMs, the save policy):
each kernel's compulsory reads and writes, with every operand read once from memory (L2 reuse
inside a kernel assumed perfect, none across kernels). It counts the bytes the switches change
(MOKGEN_BWD_DX_PAIRS, MOKGEN_BWD_DH, MOKGEN_BWD_WEIGHTS_JOINT, MOKGEN_BWD_RING's in-place x
rows, MOKGEN_BWD_DOUT's inline dOut rows: read through the index, each of dOut's T rows once per
kernel under the model's perfect in-kernel reuse), to rank the next byte cuts and to
write predictions. Under the H200's power cap a byte saved has measured about twice its share of
the step (docs/perf-notes.md v0.20), so the model ranks but does not time. Per workload it prints:
MB per kernel, the total, the tensor-core time at the dense rate, and the memory time at
--bandwidth.

    python3 .ci/bwd_bytes.py [--pairs bf16|fp32] [--dh bf16|fp32] [--joint] [--ring] [--dout gather|inline]
                             [--bandwidth 3.8] [--dense 732]
"""

from __future__ import annotations

import argparse

from mokgen import bench
from mokgen.spec import load_spec

LOCAL = ("kimi-k2.5", "glm-5.2", "qwen3.5-397b-a17b", "deepseek-v4-pro", "deepseek-v3")
LAYERS = ("qwen3-30b-a3b", "qwen3.5-35b-a3b")
BF16, FP32 = 2, 4


def problems():
    """(label, tokens T, slots K, experts E, H, I) of the bench's backward workloads: the local
    stand-ins (a rank's received rows, one slot each, its E / ep experts) and the layers at
    T = 16384."""
    for name in LOCAL:
        spec = load_spec(name)
        ep = bench.LOCAL_EP.get(name, 8)
        local, rows = bench.local_spec(spec, ep)
        yield f"{name} local EP{ep}", rows, 1, local.num_experts, spec.hidden_size, spec.moe_intermediate_size
    for name in LAYERS:
        spec = load_spec(name)
        yield f"{name} layer T=16384", 16384, spec.top_k, spec.num_experts, spec.hidden_size, spec.moe_intermediate_size


def kernels(T: int, K: int, E: int, H: int, I: int, *, pairs: int, dh: int, joint: bool, ring: bool = False,
            dout: str = "gather") -> dict[str, int]:
    """Bytes read + written per kernel for N = T K pair rows; ``pairs`` / ``dh``: bytes per element
    of the dx pair rows and of dh; ``ring``: the x rows read in place (no gather); ``dout``
    "inline": dh and dW_down read dOut's T rows through the index (no gather)."""
    N = T * K
    w = E * H * I * BF16  # one expert weight tensor
    go = (T if dout == "inline" else N) * H * BF16  # the dOut rows dh and dW_down read
    k = {}
    if not ring:
        k["gather x rows"] = 2 * N * H * BF16
    if dout != "inline":
        k["gather dOut rows"] = 2 * N * H * BF16
    k.update({
        "dh GEMM": go + w + N * I * dh,
        "SwiGLU backward": N * I * dh + N * 2 * I * BF16 + 3 * N * I * BF16 + N * FP32,
        "dx GEMM": 2 * N * I * BF16 + 2 * w + N * H * (BF16 if K == 1 else pairs),
    })
    if K > 1:
        k["sum over slots"] = N * H * pairs + T * H * BF16
    if joint:
        k["dW gate + up (one launch)"] = 2 * N * I * BF16 + N * H * BF16 + 2 * w
    else:
        k["dW gate"] = N * I * BF16 + N * H * BF16 + w
        k["dW up"] = N * I * BF16 + N * H * BF16 + w
    k["dW down"] = go + N * I * BF16 + w
    return k


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--dh", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--joint", action="store_true")
    ap.add_argument("--ring", action="store_true", help="x rows read in place from the forward's ring")
    ap.add_argument("--dout", choices=("gather", "inline"), default="gather")
    ap.add_argument("--bandwidth", type=float, default=3.8, help="TB/s for the memory time")
    ap.add_argument("--dense", type=float, default=732.0, help="TFLOP/s for the tensor-core time")
    args = ap.parse_args()
    size = {"bf16": BF16, "fp32": FP32}
    print(f"dx pairs {args.pairs}, dh {args.dh}, gate/up weight gradients {'joint' if args.joint else 'separate'}, "
          f"x rows {'in the ring' if args.ring else 'gathered'}, dOut rows {args.dout}; "
          f"memory at {args.bandwidth} TB/s, tensor core at {args.dense} TFLOP/s")
    for label, T, K, E, H, I in problems():
        k = kernels(T, K, E, H, I, pairs=size[args.pairs], dh=size[args.dh], joint=args.joint, ring=args.ring,
                    dout=args.dout)
        total = sum(k.values())
        flops = 4 * T * K * H * I * 3  # dh (2 N H I) + dx (4 N H I) + three weight gradients (6 N H I)
        print(f"\n{label}: {total / 1e9:.2f} GB, memory {total / args.bandwidth / 1e9:.2f} ms, "
              f"tensor core {flops / args.dense / 1e9:.2f} ms")
        for name, b in k.items():
            print(f"  {name:28s} {b / 1e6:9.0f} MB  {100 * b / total:5.1f}%")


if __name__ == "__main__":
    main()
