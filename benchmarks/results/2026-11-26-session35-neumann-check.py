"""Neumann diagonal inverse (chunk_fwd._KNOBS['neumann']) against the default, realistic sizes, fwd and fwd+bwd."""
import torch, torch.nn.functional as F
from rankdecay import ops
from rankdecay.ops.triton import chunk_fwd

def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()

gen = torch.Generator().manual_seed(0)
B, T, H, D = 2, 1000, 4, 128
q, v = torch.randn(B, T, H, D, generator=gen), torch.randn(B, T, H, D, generator=gen)
k = F.normalize(torch.randn(B, T, H, D, generator=gen), dim=-1)
g = F.logsigmoid(torch.randn(B, T, H, generator=gen) + 3)
gk = F.logsigmoid(torch.randn(B, T, H, D, generator=gen) + 3)
beta, h0 = 2 * torch.rand(B, T, H, generator=gen), torch.randn(B, H, D, D, generator=gen)
mask = ops.head_in_head_mask(torch.rand(H, 4, 4, generator=gen))
cases = {
    "gdn": lambda x: ops.gated_delta_rule(x[0], x[1], x[2], x[3], x[4], initial_state=x[5], output_final_state=True),
    "hh": lambda x: ops.hh_delta_rule(x[0], x[1], x[2], x[4], mask.cuda(), x[3], initial_state=x[5],
                                      output_final_state=True),
    "hdla": lambda x: ops.hdla(x[0], x[1], x[2], x[6], x[4], initial_state=x[5], output_final_state=True),
    "gdp": lambda x: ops.gated_delta_product(x[0][:, :500], x[1], x[2], x[3][:, :500], x[4], 2, initial_state=x[5],
                                             output_final_state=True),
}
for prec, dt in (("highest", torch.float32), ("medium", torch.bfloat16)):
    torch.set_float32_matmul_precision(prec)
    for name, fn in cases.items():
        for grads in (False, True):
            res = {}
            for kn in (False, True):
                chunk_fwd._KNOBS["neumann"] = kn
                xs = [t.cuda().to(dt if i < 5 or i == 6 else torch.float32).clone().requires_grad_(grads)
                      for i, t in enumerate((q, k, v, g, beta, h0, gk))]
                with torch.set_grad_enabled(grads):
                    o, s = fn(xs)
                out = [o.detach(), s.detach()]
                if grads:
                    (o.float().sin().sum() + s.sin().sum()).backward()
                    out += [x.grad for x in xs if x.grad is not None]
                res[kn] = out
            errs = [rel(a, b) for a, b in zip(res[True], res[False])]
            fin = all(torch.isfinite(a).all().item() for a in res[True])
            print(f"{prec} {name} grads={grads}: finite={fin} max rel diff neumann vs default {max(errs):.2e}", flush=True)
chunk_fwd._KNOBS.pop("neumann")
