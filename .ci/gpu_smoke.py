import torch, mokgen
from mokgen import reference
spec = mokgen.load_spec("qwen3-30b-a3b")
g = torch.Generator(device="cuda").manual_seed(0)
E, I, H = spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
wg = (torch.randn(E, I, H, generator=g, device="cuda") * H**-0.5).bfloat16()
wu = (torch.randn(E, I, H, generator=g, device="cuda") * H**-0.5).bfloat16()
wd = (torch.randn(E, H, I, generator=g, device="cuda") * I**-0.5).bfloat16()
for T in (1, 300, 3000):
    x = torch.randn(T, H, generator=g, device="cuda").bfloat16()
    ids = torch.rand(T, E, generator=g, device="cuda").topk(8, -1).indices
    w = torch.rand(T, 8, generator=g, device="cuda")
    out = mokgen.experts_forward(x, ids, w, wg, wu, wd, spec=spec)
    torch.cuda.synchronize()
    ref = reference.experts_forward(x, ids, w, wg, wu, wd)
    print("T", T, "rel err", ((out.float() - ref).norm() / ref.norm()).item(), flush=True)
