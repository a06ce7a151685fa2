"""LCE fwd+bwd time (ms) and peak extra memory vs chunk size and dW group (the knob OPFORGE_LCE_DW_GROUP: chunks per
dW GEMM) at the issue's shapes (one H200 run). Usage: python benchmarks/lce_chunk_sweep.py [H ...] (default 4096 2048)."""
import sys
import torch, opforge
torch.manual_seed(0)
for BT, H, V in [(8192, int(h), 128256) for h in (sys.argv[1:] or (4096, 2048))]:
    x = torch.randn(BT, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16) / H**0.5).requires_grad_()
    t = torch.randint(0, V, (BT,), device="cuda"); t[::10] = -100
    for group, chunk in [(1, c) for c in (None, 1024, 2048, 8192)] + [(2, c) for c in (None, 768, 1024, 1536, 2048)]:
        torch.ops.opforge._set_knob("OPFORGE_LCE_DW_GROUP", group)
        def step():
            x.grad = None; w.grad = None
            opforge.linear_cross_entropy(x, w, t, chunk_size=chunk).backward()
        step(); torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5): step()
        e.record(); torch.cuda.synchronize()
        print(f"lce {BT}x{H}x{V} group={group} chunk={chunk}: {s.elapsed_time(e)/5:.1f} ms, peak above inputs {(torch.cuda.max_memory_allocated()-base)/2**20:.0f} MiB", flush=True)
