"""CPU: opforge.linear_cross_entropy vs F.linear_cross_entropy (chunked path and reference path), fwd+bwd, BT 2048, H 512, V 32000, fp32.

Usage: python benchmarks/lce_cpu_vs_torch.py {opforge|chunked|reference}  (one process each: maxrss is per process)"""
import sys, time, resource, torch, torch.nn.functional as F
import opforge
which = sys.argv[1]
torch.manual_seed(0); torch.set_num_threads(2)
BT, H, V = 2048, 512, 32000
x = torch.randn(BT, H, requires_grad=True); w = (torch.randn(V, H) / H**0.5).requires_grad_()
t = torch.randint(0, V, (BT,)); t[::10] = -100
def step():
    x.grad = None; w.grad = None
    if which == "opforge":
        loss = opforge.linear_cross_entropy(x, w, t)
    else:
        loss = F.linear_cross_entropy(x, w, t, ignore_index=-100, options=torch.nn.LinearCrossEntropyOptions()) if which == "chunked" else F.linear_cross_entropy(x, w, t, ignore_index=-100)
    loss.backward()
    return loss
step()
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ts = []
for _ in range(3):
    t0 = time.perf_counter(); l = step(); ts.append(time.perf_counter() - t0)
print(f"{which}: fwd+bwd median {sorted(ts)[1]*1e3:.0f} ms, loss {l.item():.6f}, maxrss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss/1024:.0f} MiB")
