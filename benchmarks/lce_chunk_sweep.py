"""LCE fwd+bwd time (ms), peak extra memory and dW error vs chunk size, dW group (the knob OPFORGE_LCE_DW_GROUP: chunks
per dW GEMM) and dW accumulation (the knob OPFORGE_LCE_DW_ACCUM: 0 float32 accumulator, 1 bf16 accumulation in the
gradient itself) at the issue's shapes (one H200 run). The dW error is the bf16 gradient's norm-relative error against
a float64 dW. Usage: python benchmarks/lce_chunk_sweep.py [H ...] (default 4096 2048)."""
import sys
import torch, opforge
torch.manual_seed(0)
# (OPFORGE_LCE_DW_ACCUM, OPFORGE_LCE_DW_GROUP, chunk_size); None: the default budget (1024 rows at V = 128256)
CONFIGS = ([(0, 1, c) for c in (None, 1024, 2048, 8192)] + [(0, 2, c) for c in (None, 768, 1024, 1536, 2048)]
           + [(1, 1, c) for c in (1024, 2048, 4096, 8192)])


def dw_reference(x, w, t, rows=1024):
    """float64 dW of the mean loss (ignore_index -100), `rows` tokens at a time."""
    w64, dw = w.double(), torch.zeros(w.shape, dtype=torch.float64, device=w.device)
    for s in range(0, x.shape[0], rows):
        xs, ts = x[s:s + rows].double(), t[s:s + rows]
        p = torch.softmax(xs @ w64.t(), -1)
        keep = (ts != -100).nonzero().squeeze(1)
        p[keep, ts[keep]] -= 1
        p[ts == -100] = 0
        dw += p.t() @ xs
    return dw / (t != -100).sum()


for BT, H, V in [(8192, int(h), 128256) for h in (sys.argv[1:] or (4096, 2048))]:
    x = torch.randn(BT, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16) / H**0.5).requires_grad_()
    t = torch.randint(0, V, (BT,), device="cuda"); t[::10] = -100
    ref = dw_reference(x.detach(), w.detach(), t)
    for accum, group, chunk in CONFIGS:
        torch.ops.opforge._set_knob("OPFORGE_LCE_DW_GROUP", group)
        torch.ops.opforge._set_knob("OPFORGE_LCE_DW_ACCUM", accum)
        def step():
            x.grad = None; w.grad = None
            opforge.linear_cross_entropy(x, w, t, chunk_size=chunk).backward()
        step(); torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5): step()
        e.record(); torch.cuda.synchronize()
        err = ((w.grad.double() - ref).norm() / ref.norm()).item()
        print(f"lce {BT}x{H}x{V} accum={accum} group={group} chunk={chunk}: {s.elapsed_time(e)/5:.1f} ms, peak above "
              f"inputs {(torch.cuda.max_memory_allocated()-base)/2**20:.0f} MiB, dW error {err:.2e}", flush=True)
    del ref
torch.ops.opforge._set_knob("OPFORGE_LCE_DW_GROUP", 1)
torch.ops.opforge._set_knob("OPFORGE_LCE_DW_ACCUM", 0)
