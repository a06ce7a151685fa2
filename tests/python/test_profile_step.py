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
