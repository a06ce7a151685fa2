"""benchmarks/profile_step.py: the kernel-name categories of its GPU-time table, and a CPU smoke run (tiny
configuration: the patched Hugging Face Llama's step by category, and the demo model's table with opforge's
ranges)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import profile_step  # noqa: E402

# (kernel name as torch.profiler reports it on CUDA, category)
KERNELS = [
    ("void opforge::(anonymous namespace)::rope_rows_kernel<c10::BFloat16, c10::BFloat16, false, 8>(...)",
     "opforge kernels"),
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_TNT", "GEMM"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "GEMM"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>(...)", "GEMM"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false>>(...)", "attention"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor<...>>(...)", "optimizer"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(...)", "softmax/CE"),
    ("void at::native::(anonymous namespace)::nll_loss_forward_reduce_cuda_kernel_2d<float, float, long>(...)",
     "softmax/CE"),
    ("liger_cross_entropy_kernel", "softmax/CE"),
    ("_rms_norm_forward_kernel", "norms"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norms"),
    ("void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel_cuda"
     "(at::TensorIteratorBase&)::{lambda()#3}>(...)", "copies/casts"),
    ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>(...)", "copies/casts"),
    ("Memcpy DtoD (Device -> Device)", "copies/casts"),
    ("triton_poi_fused__to_copy_3", "copies/casts"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>, ...>(...)",
     "elementwise"),
    ("triton_poi_fused_mul_silu_2", "elementwise"),
    ("_triton_rope", "elementwise"),
    ("some_unknown_kernel", "other"),
]


@pytest.mark.parametrize("name, expected", KERNELS, ids=[k[1] + ":" + k[0][:30] for k in KERNELS])
def test_category_of_kernel_names(name, expected):
    assert profile_step.category(name) == expected


def test_profile_step_smoke_cpu(tmp_path):
    out = tmp_path / "profile.txt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(BENCH / "profile_step.py"), "--smoke", "--variants", "opforge",
                        "--out", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    text = out.read_text()
    assert "== opforge: self CPU time (ops) of one training step" in text and "top 15:" in text
    assert "GEMM" in text and "opforge kernels" in text
    # (b): the demo model's table, with opforge's ranges (forward and backward ops)
    assert "demo model (opforge.models.llama.Llama, backend opforge)" in text
    for op in ("opforge::rope", "opforge::rope_backward", "opforge::linear", "opforge::linear_cross_entropy"):
        assert f"\n{op} " in text, op


def test_idle_gaps_attributes_each_gap_to_the_next_kernel():
    """Gaps of >= 5 us between the end of all earlier device activities and the next start, longest first; a kernel
    nested in an earlier one's time closes no gap; 'host late' when the launch came after the GPU went idle."""
    kernels = [(50, 60, "c", 3), (0, 10, "a", 1), (12, 20, "b", 2), (52, 58, "d", 4), (70, 80, "e", 5),
               (90, 95, "f", 6)]
    launches = {2: (5, "x"), 3: (40, "y"), 5: (61, "z"), 6: (30, "w")}
    assert profile_step.idle_gaps(kernels, launches) == [
        (30, 20, "c", "y", True), (10, 60, "e", "z", True), (10, 80, "f", "w", False)]
    assert profile_step.idle_gaps(kernels, launches, min_us=1)[-1] == (2, 10, "b", "x", False)


class _Range:
    def __init__(self, start, end):
        self.start, self.end = start, end

    def elapsed_us(self):
        return self.end - self.start


class _Event:
    """The FunctionEvent fields _gpu_idle reads."""

    def __init__(self, name, id, linked, device, start, end, parent=None):
        from torch.autograd import DeviceType

        self.name, self.id, self.linked_correlation_id = name, id, linked
        self.device_type = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
        self.time_range, self.cpu_parent, self.is_user_annotation = _Range(start, end), parent, False
        self.activity_type = "kernel" if device == "cuda" else "cpu_op"


def test_gpu_idle_from_profiler_events():
    """_gpu_idle on a synthetic trace: a linear launches a GEMM, then .item() syncs (cudaMemcpy under
    aten::_local_scalar_dense) and the next kernel, launched late, ends a 40 us gap attributed to aten::add."""
    step = _Event("ProfilerStep#3", 100, 0, "cpu", 0, 200)
    linear = _Event("aten::linear", 1, 0, "cpu", 1, 10, step)
    mm = _Event("aten::mm", 2, 0, "cpu", 2, 9, linear)
    item = _Event("aten::item", 3, 0, "cpu", 11, 70, step)
    dense = _Event("aten::_local_scalar_dense", 4, 0, "cpu", 12, 69, item)
    add = _Event("aten::add", 5, 0, "cpu", 75, 80, step)
    events = [step, linear, mm, item, dense, add,
              _Event("cudaLaunchKernel", 501, 2, "cpu", 3, 4), _Event("nvjet_gemm", 501, 2, "cuda", 5, 35),
              _Event("cudaMemcpy", 502, 4, "cpu", 13, 68), _Event("Memcpy DtoH", 502, 4, "cuda", 36, 37),
              _Event("cudaLaunchKernel", 503, 5, "cpu", 76, 77), _Event("add_kernel", 503, 5, "cuda", 77, 80)]

    class Prof:
        def events(self):
            return events

    idle = profile_step._gpu_idle(Prof())
    assert idle["span_us"] == 75 and idle["lead_us"] == 5 and idle["n_gaps"] == 1
    assert idle["idle_us"] == 40 and idle["host_late_us"] == 40
    assert idle["top"] == [[40, 37, "add_kernel", "aten::add", True]]
    assert idle["syncs"] == [["cudaMemcpy from aten::item > aten::_local_scalar_dense", 55, 1]]
    text = profile_step.format_idle(idle)
    assert "GPU idle: 0.04 ms of the 0.07 ms" in text and "aten::item > aten::_local_scalar_dense" in text
    assert profile_step._gpu_idle(type("P", (), {"events": lambda self: events[:6]})()) == {}


def test_gpu_idle_without_correlation_says_unknown():
    """Events without linked_correlation_id (torch 2.11's profiler): the gaps are still measured, but host-late,
    lead and syncs are printed as unknown, not as zeros."""
    step = _Event("ProfilerStep#3", 100, 0, "cpu", 0, 200)
    events = [step, _Event("nvjet_gemm", 501, 0, "cuda", 5, 35), _Event("add_kernel", 503, 0, "cuda", 77, 80)]
    for e in events:
        del e.linked_correlation_id

    class Prof:
        def events(self):
            return events

    idle = profile_step._gpu_idle(Prof())
    assert idle["n_gaps"] == 1 and idle["idle_us"] == 42 and not idle["attributed"]
    text = profile_step.format_idle(idle)
    assert "no linked_correlation_id" in text and "host syncs in the step: n/a" in text and " n/a " in text
    assert "ms where the host issued" not in text


def _x(cat, name, ts, dur, tid=1, correlation=None):
    e = {"ph": "X", "cat": cat, "name": name, "pid": 0 if cat in ("kernel", "gpu_memcpy") else 7, "tid": tid,
         "ts": ts, "dur": dur}
    if correlation is not None:
        e["args"] = {"correlation": correlation}
    return e


def test_gpu_idle_from_chrome_trace():
    """gpu_idle_from_trace, the path for torch 2.11 (no linked_correlation_id): the synthetic step of
    test_gpu_idle_from_profiler_events as chrome-trace events gives the same figures; a runtime call is attributed to
    the innermost CPU op around it on its own thread (an op of another thread at the same time does not count)."""
    trace = {"traceEvents": [
        _x("user_annotation", "ProfilerStep#3", 0, 200),
        _x("cpu_op", "aten::linear", 1, 9), _x("cpu_op", "aten::mm", 2, 7),
        _x("cpu_op", "aten::item", 11, 59), _x("cpu_op", "aten::_local_scalar_dense", 12, 57),
        _x("cpu_op", "aten::add", 75, 5), _x("cpu_op", "aten::other_thread", 70, 20, tid=2),
        _x("cuda_runtime", "cudaLaunchKernel", 3, 1, correlation=501), _x("kernel", "nvjet_gemm", 5, 30, correlation=501),
        _x("cuda_runtime", "cudaMemcpy", 13, 55, correlation=502),
        _x("gpu_memcpy", "Memcpy DtoH", 36, 1, correlation=502),
        _x("cuda_runtime", "cudaLaunchKernel", 76, 1, correlation=503),
        _x("kernel", "add_kernel", 77, 3, correlation=503),
        {"ph": "s", "cat": "ac2g", "name": "flow", "id": 503, "ts": 76},  # flow events are ignored
    ]}
    idle = profile_step.gpu_idle_from_trace(trace)
    assert idle["span_us"] == 75 and idle["lead_us"] == 5 and idle["n_gaps"] == 1 and idle["attributed"]
    assert idle["idle_us"] == 40 and idle["host_late_us"] == 40
    assert idle["top"] == [[40, 37, "add_kernel", "aten::add", True]]
    assert idle["syncs"] == [["cudaMemcpy from aten::item > aten::_local_scalar_dense", 55, 1]]
    assert "aten::item > aten::_local_scalar_dense" in profile_step.format_idle(idle)
    assert profile_step.gpu_idle_from_trace({"traceEvents": trace["traceEvents"][:7]}) == {}


def test_chrome_trace_of_a_cpu_profile_parses():
    """_chrome_trace exports a real profile and reads it back: CPU ops there, no device activity, so no idle figures."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8).add(1)
    trace = profile_step._chrome_trace(prof)
    assert any(str(e.get("cat", "")).lower() == "cpu_op" for e in trace["traceEvents"])
    assert profile_step.gpu_idle_from_trace(trace) == {}


def test_gpu_idle_from_trace_op_boundaries():
    """An op's span is [ts, ts + dur): a runtime call at an op's start is inside it, one at its end is not; an op that
    ends where its sibling starts is not the sibling's parent; a zero-duration op (or one without dur) holds no
    call; an outer op that ended (spans nested off by a rounding) is not in the path of a later call."""
    trace = {"traceEvents": [
        _x("cpu_op", "aten::a", 0, 10), _x("cpu_op", "aten::b", 10, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 12, 1, correlation=1), _x("kernel", "k1", 100, 1, correlation=1),
        _x("cpu_op", "aten::c", 20, 10), _x("cpu_op", "aten::empty", 20, 0),
        _x("cuda_runtime", "cudaLaunchKernel", 20, 1, correlation=2), _x("kernel", "k2", 110, 1, correlation=2),
        {"ph": "X", "cat": "cpu_op", "name": "aten::view", "pid": 7, "tid": 1, "ts": 24},  # no dur
        _x("cuda_runtime", "cudaLaunchKernel", 24, 1, correlation=3), _x("kernel", "k3", 120, 1, correlation=3),
        _x("cuda_runtime", "cudaLaunchKernel", 30, 1, correlation=4), _x("kernel", "k4", 130, 1, correlation=4),
        _x("cpu_op", "aten::p", 40, 10), _x("cpu_op", "aten::q", 45, 8),
        _x("cuda_runtime", "cudaLaunchKernel", 51, 1, correlation=5), _x("kernel", "k5", 140, 1, correlation=5),
    ]}
    idle = profile_step.gpu_idle_from_trace(trace)
    ops = {g[2]: g[3] for g in idle["top"]}
    assert ops == {"k2": "aten::c", "k3": "aten::c", "k4": "cudaLaunchKernel", "k5": "aten::q"}
    assert profile_step.gpu_idle_from_trace(trace, top=1)["by_op"][0][0] == "aten::c"
    idle = profile_step.gpu_idle_from_trace({"traceEvents": trace["traceEvents"][:4] + [_x("kernel", "k0", 50, 1)]})
    assert idle["top"][0][2:4] == ["k1", "aten::b"]


def test_gpu_idle_from_trace_record_function_ranges():
    """record_function ranges (kineto's user_annotation, e.g. the optimizer's) are CPU ops of the path, as in
    _gpu_idle (ProfilerStep left out of the path, but the first host event for the lead); a CPU op around a sync op's
    call does not make it a sync, as in _gpu_idle (the innermost op decides)."""
    trace = {"traceEvents": [
        _x("user_annotation", "ProfilerStep#3", 0, 200),
        _x("cpu_op", "aten::unique", 5, 30), _x("cpu_op", "aten::sort", 6, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 7, 1, correlation=1), _x("kernel", "sort_kernel", 15, 2, correlation=1),
        _x("user_annotation", "Optimizer.step#AdamW.step", 40, 50), _x("cpu_op", "aten::_foreach_add_", 41, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 42, 1, correlation=2),
        _x("kernel", "multi_tensor_apply", 60, 2, correlation=2),
    ]}
    idle = profile_step.gpu_idle_from_trace(trace)
    assert idle["lead_us"] == 15 and idle["syncs"] == []
    assert idle["top"] == [[43, 17, "multi_tensor_apply", "Optimizer.step#AdamW.step > aten::_foreach_add_", True]]
