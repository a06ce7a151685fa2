"""fake_quant_linear (QAT linear: int4 per-group-32 weights, int8 per-token activations) forward and
forward+backward against torch.fake_quantize_* + F.linear, torch.compile of it and torchao's QAT FakeQuantizedLinear
when torchao imports, with plain opforge.linear beside them as opforge's variant (the cost of the quantization).

Goal (H200, bf16, 8192×4096×4096 forward+backward): ≤ 1.10× plain opforge.linear and ≥ 1.5× torchao's
fake-quantized linear (else the torch.fake_quantize_* composition; the table names which peer ran).

Timing (CUDA): device time per call, back-to-back calls in one CUDA graph (harness.time_cuda_graph; eager loop
where capture fails, e.g. a peer that synchronizes). CPU: blocks of wall time. Metric: TFLOP/s of the GEMMs
(2·M·N·K per forward, 3x for forward+backward). The weight quantizer alone, fake_quantize_weight (int4, group 32,
no gradient), against its torch.fake_quantize_per_channel_affine composition: GB/s of its minimal bytes (read the
weight, write fq_w and the mask). Before timing, opforge's output on the first rows is checked against
opforge.testing's float64 reference.

    python -m opforge bench --ops fake_quant_linear [--quick]
    python benchmarks/bench_fake_quant_linear.py --device cpu --quick
"""
from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

import opforge
from opforge import testing

from .. import harness

NAME = "fake_quant_linear"
CUDA_SHAPES = [(8192, 4096, 4096), (2048, 4096, 14336), (8192, 14336, 4096)]
CUDA_QUICK_SHAPES = [(8192, 4096, 4096)]
CPU_SHAPES = [(256, 1024, 1024), (1024, 1024, 1024)]
GROUP = 32
EPS = torch.finfo(torch.float32).eps


CHECK_ROWS = 64  # the reference check runs on the first rows only


def ours(x, w, b):
    """opforge.fake_quant_linear: int4 symmetric weights in groups of 32, int8 per-token activations."""
    return opforge.fake_quant_linear(x, w, b, weight_bits=4, group_size=GROUP, symmetric=True, act_quant=True)


def plain(x, w, b):
    """opforge.linear without quantization."""
    return opforge.linear(x, w, b)


def torch_composition(x, w, b):
    """torch.fake_quantize_per_channel_affine for the weight groups and the tokens, then F.linear (the same math
    as torchao's QAT, without torchao); scales from min/max in float32 (tensors: no host synchronization)."""
    N, K = w.shape
    wg = w.float().reshape(-1, GROUP)
    wd, xd = wg.detach(), x.detach().reshape(-1, K).float()  # qparams are constants (STE), as in torchao
    ws = torch.clamp(torch.maximum(-wd.amin(1).clamp(max=0), wd.amax(1).clamp(min=0)) / 7.5, min=EPS)
    wq = torch.fake_quantize_per_channel_affine(wg, ws, torch.zeros_like(ws, dtype=torch.int32), 0, -8, 7)
    x2 = x.reshape(-1, K).float()
    lo, hi = xd.amin(1).clamp(max=0), xd.amax(1).clamp(min=0)
    xs = torch.clamp((hi - lo) / 255, min=EPS)
    xz = torch.clamp(-128 - torch.round(lo / xs), -128, 127).to(torch.int32)
    xq = torch.fake_quantize_per_channel_affine(x2, xs, xz, 0, -128, 127)
    return F.linear(xq.to(x.dtype).reshape(x.shape), wq.reshape(N, K).to(x.dtype), b)


def torch_weight_quantizer(w):
    """fake_quantize_weight's math in torch ops: the weight half of torch_composition (int4 symmetric, group 32)."""
    wg = w.float().reshape(-1, GROUP)
    ws = torch.clamp(torch.maximum(-wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)) / 7.5, min=EPS)
    return torch.fake_quantize_per_channel_affine(wg, ws, torch.zeros_like(ws, dtype=torch.int32), 0, -8, 7)


def torchao_module(K, N, device, dtype):
    """torchao's QAT FakeQuantizedLinear (8da4w, group 32), or None when torchao does not import here."""
    try:
        from torchao.quantization.qat import IntxFakeQuantizeConfig
        from torchao.quantization.qat.linear import FakeQuantizedLinear

        act = IntxFakeQuantizeConfig(torch.int8, "per_token", is_symmetric=False)
        wcfg = IntxFakeQuantizeConfig(torch.int4, group_size=GROUP)
        return FakeQuantizedLinear(K, N, bias=True, activation_config=act, weight_config=wcfg, device=device,
                                   dtype=dtype)
    except Exception as e:  # not installed, or built for another torch
        print(f"  [n/a] torchao FakeQuantizedLinear: {type(e).__name__}: {str(e).splitlines()[0][:160]}",
              file=sys.stderr)
        return None


def check_against_reference(x, w, b, what: str) -> None:
    """opforge.fake_quant_linear against opforge.testing.fake_quant_linear_reference (the same quantization as
    torch.fake_quantize_*, bit for bit), within the GEMM rounding bound of the quantized operands."""
    xq = testing.fake_quantize_per_token_reference(x)[0]
    wq = testing.fake_quantize_weight_reference(w, 4, GROUP, True)[0].to(x.dtype)
    harness.check_reference(what, ours(x, w, b),
                            testing.fake_quant_linear_reference(x, w, b, weight_bits=4, group_size=GROUP,
                                                                symmetric=True, act_quant=True),
                            torch_composition(x, w, b), bound=testing.gemm_error_bound(xq, wq, x.dtype))


def main(argv=None) -> int:
    """Run the suite (the harness's command line); 0 when it ran."""
    run = harness.start(NAME, __doc__, argv, dtypes=harness.cuda_or_cpu([torch.bfloat16], [torch.float32]),
                       warmup=(3, 3), reps=((10, 10), (5, 5)))
    device = run.device
    comp = None if run.args.no_compile else harness.compiled(torch_composition, fullgraph=True)
    for dtype in run.dtypes:
        for M, K, N in run.shapes(CUDA_SHAPES, CPU_SHAPES, CUDA_QUICK_SHAPES):
            x = torch.randn(M, K, device=device, dtype=dtype)
            w = (torch.randn(N, K, device=device) / K ** 0.5).to(dtype)
            b = torch.randn(N, device=device, dtype=dtype)
            dy = torch.randn(M, N, device=device, dtype=dtype)
            ao = torchao_module(K, N, device, dtype)
            if ao is not None:
                with torch.no_grad():
                    ao.weight.copy_(w)
                    ao.bias.copy_(b)
            check_against_reference(x[:CHECK_ROWS], w, b, f"{NAME} {harness.dtype_str(dtype)} "
                                                          f"{harness.shape_str((M, K, N))}")
            impls = {"opforge": ours, "opforge.linear (no quant)": plain,
                     "torch.fake_quantize + F.linear": torch_composition,
                     "compile(torch.fake_quantize + F.linear)": comp,
                     "torchao FakeQuantizedLinear": (lambda x, w, b, ao=ao: ao(x)) if ao is not None else None}
            for pass_ in ("fwd", "fwd+bwd"):
                group, by = [], {}
                for impl, fn in impls.items():
                    t, method = math.nan, ""
                    if fn is not None:
                        leaves = [t_.detach().clone().requires_grad_() for t_ in (x, w, b)]
                        if impl.startswith("torchao"):
                            xl = x.detach().clone().requires_grad_()
                            step = ((lambda ao=ao: ao(x)) if pass_ == "fwd" else
                                    harness.fwd_bwd(ao, [xl], dy, params=[ao.weight, ao.bias]))
                        else:
                            step = (lambda fn=fn: fn(x, w, b)) if pass_ == "fwd" else harness.fwd_bwd(fn, leaves, dy)
                        t, method = run.time_graphed(impl, lambda i, step=step: step(), 4)
                    flops = harness.linear_flops(M, K, N, pass_)
                    tflops = harness.tflops(flops, t)
                    by[impl] = run.add(NAME, (M, K, N), dtype, impl, pass_, t, tflops, "TFLOP/s").time_us
                    group.append(f"{impl} {harness._fmt(t)}us {harness._fmt(tflops)}TF" +
                                 harness.method_note(method))
                run.say_case(NAME, pass_, dtype, (M, K, N), group)
                print(f"    fake_quant_linear / opforge.linear: "
                      f"{by['opforge'] / by['opforge.linear (no quant)']:.3f}", flush=True)
            quantizers = {"opforge": lambda: opforge.fake_quantize_weight(w, 4, GROUP),
                          "torch.fake_quantize_per_channel_affine": lambda: torch_weight_quantizer(w)}
            nb = N * K * (2 * w.element_size() + 1)
            group = []
            for impl, fn in quantizers.items():
                t, _ = run.time_graphed(impl, lambda i, fn=fn: fn(), 4)
                run.add("fake_quantize_weight", (N, K), dtype, impl, "fwd", t, harness.gbps(nb, t), "GB/s")
                group.append(f"{impl} {harness._fmt(t)}us {harness._fmt(harness.gbps(nb, t), 0)}GB/s")
            run.say_case("fake_quantize_weight", "fwd", dtype, (N, K), group)
            del x, w, b, dy, ao
            run.release()
    return run.finish()

