"""LCE fwd+bwd time (ms) and peak extra memory vs chunk size at the issue's shapes (one H200 run)."""
import torch, opforge
torch.manual_seed(0)
for BT, H, V in ((8192, 4096, 128256), (8192, 2048, 128256)):
    x = torch.randn(BT, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(V, H, device="cuda", dtype=torch.bfloat16) / H**0.5).requires_grad_()
    t = torch.randint(0, V, (BT,), device="cuda"); t[::10] = -100
    for chunk in (None, 1024, 2048, 4096, 8192):
        def step():
            x.grad = None; w.grad = None
            opforge.linear_cross_entropy(x, w, t, chunk_size=chunk).backward()
        step(); torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(5): step()
        e.record(); torch.cuda.synchronize()
        print(f"lce {BT}x{H}x{V} chunk={chunk}: {s.elapsed_time(e)/5:.1f} ms, peak above inputs {(torch.cuda.max_memory_allocated()-base)/2**20:.0f} MiB", flush=True)
