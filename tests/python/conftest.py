"""Shared fixtures: devices (CUDA cases skip cleanly without a GPU), dtypes and seeded RNG."""
import hashlib
import os
from pathlib import Path

# Inductor's on-disk cache is keyed on the graph, not on a custom op's schema: a cache shared with
# another checkout (a worktree whose op takes other arguments), or kept across a change of the schemas,
# can replay stale code ("Unknown keyword argument ... for operator 'opforge::...'"). Each checkout and
# each version of the schemas (csrc/library.cpp holds them all) gets its own cache unless one is set.
_ROOT = Path(__file__).resolve().parents[2]
_LIBRARY_CPP = _ROOT / "csrc" / "library.cpp"  # absent where this file is copied out of the tree
_SCHEMAS = hashlib.sha1(_LIBRARY_CPP.read_bytes()).hexdigest()[:12] if _LIBRARY_CPP.exists() else "schemas"
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_ROOT / "build" / "inductor-cache" / _SCHEMAS))

import pytest  # noqa: E402
import torch  # noqa: E402

import opforge  # noqa: F401,E402  (loads the library once for the whole session)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
ALL_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU"))]
FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
LOW_PRECISION = [torch.float16, torch.bfloat16]
ODD_SIZES = [1, 7, 83, 769, 3584, 5120, 8200]


@pytest.fixture(params=ALL_DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---- slow tests: marked @pytest.mark.slow, skipped unless --run-slow (or OPFORGE_RUN_SLOW=1) -------------
def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true", default=False,
                     help="also run tests marked slow (e.g. the JIT build, minutes on a small machine)")
    parser.addoption("--cuda-only", action="store_true", default=False,
                     help="keep only the CUDA tests (a 'cuda' in the test id, or a skip-without-CUDA/GPU mark): "
                          "the GPU machine's run, whose CPU twins CI already runs")
    parser.addoption("--shard", default=None, metavar="K/N",
                     help="keep the K-th of N disjoint parts of the selected tests (by a hash of each test id, so "
                          "the parts are stable and balanced): the GPU machine runs the whole suite as N calls on "
                          "one warm build when one call's time limit cannot hold it (scripts/gpu_check.sh)")


def _needs_cuda(item) -> bool:
    """True for a test that skips on a machine without CUDA: its id names cuda (the device fixture's "cuda"
    parameter, a test_cuda_* module) or it carries a skipif mark whose reason names CUDA or a GPU."""
    if "cuda" in item.nodeid.lower():
        return True
    return any(word in m.kwargs.get("reason", "").lower() for m in item.iter_markers("skipif") for word in ("cuda", "gpu"))


def pytest_collection_modifyitems(config, items):
    import os

    if config.getoption("--cuda-only"):
        kept = [i for i in items if _needs_cuda(i)]
        config.hook.pytest_deselected(items=[i for i in items if not _needs_cuda(i)])
        items[:] = kept
    shard = config.getoption("--shard")
    if shard is not None:  # an empty value is malformed too, not "no sharding"
        import zlib

        try:
            k, n = (int(v) for v in shard.split("/"))
            assert 1 <= k <= n
        except (ValueError, AssertionError):
            raise pytest.UsageError(f"--shard: expected K/N with 1 <= K <= N, but got {shard!r}") from None
        part = [i for i in items if zlib.crc32(i.nodeid.encode()) % n == k - 1]
        config.hook.pytest_deselected(items=[i for i in items if zlib.crc32(i.nodeid.encode()) % n != k - 1])
        items[:] = part
    if config.getoption("--run-slow") or os.environ.get("OPFORGE_RUN_SLOW", "") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="slow test: run with --run-slow or OPFORGE_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


# ---- a CUDA device-side assert poisons the process's CUDA context: every later CUDA call in it fails. Under
# pytest-xdist the worker that saw one exits after reporting the test, and xdist starts a fresh worker, so one
# failing test is reported as itself instead of as hundreds of setup errors in the tests after it. ----------
_device_assert_seen = False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    global _device_assert_seen
    report = (yield).get_result()
    if report.failed and os.environ.get("PYTEST_XDIST_WORKER") and "device-side assert" in str(report.longrepr):
        _device_assert_seen = True


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location):
    if _device_assert_seen:
        os._exit(3)


@pytest.fixture
def knob():
    """knob(name, value): sets an opforge run-time switch (csrc/core/knobs.h: a test hook such as "linear_gemv", or
    a user-facing mode such as OPFORGE_LCE_DW_ACCUM) through torch.ops.opforge._set_knob for this test, restored
    after."""
    saved = []

    def set_knob(name, value):
        saved.append((name, torch.ops.opforge._set_knob(name, int(value))))

    yield set_knob
    for name, old in reversed(saved):
        torch.ops.opforge._set_knob(name, old)


@pytest.fixture
def one_thread():
    """torch.set_num_threads(1) for the test: tiny models run faster on one thread than two (and far faster on a
    shared CI machine, where a second thread spins waiting for a busy core)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


# ---- linear_cross_entropy's lean mode (knob OPFORGE_LCE_LEAN, csrc/core/knobs.h): the CUDA tests of the chunked head
# losses (linear_cross_entropy, linear_log_probs, linear_jsd) run once per mode. A module opts in by defining
# `device = lce_device_fixture()`. ----------------------------------------------------------------------------------
LCE_LEAN = "OPFORGE_LCE_LEAN"
_NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")


def lce_device_fixture():
    """A `device` fixture for the chunked head-loss tests: "cpu", "cuda" (OPFORGE_LCE_LEAN=0: fp32 logits chunks)
    and "cuda-lean" (OPFORGE_LCE_LEAN=1: 16-bit logits chunks for 16-bit inputs), the knob restored after the test;
    the test sees "cuda" for both CUDA ids. The CPU path ignores the knob; the CUDA ids skip without a GPU."""
    @pytest.fixture(params=["cpu", pytest.param("cuda", marks=_NO_CUDA), pytest.param("cuda-lean", marks=_NO_CUDA)])
    def device(request, knob):
        if request.param == "cpu":
            return "cpu"
        knob(LCE_LEAN, 1 if request.param == "cuda-lean" else 0)
        return "cuda"

    return device


def assert_compile_matches_eager(fn, inputs):
    """fn(*inputs), a scalar loss, compiled with fullgraph=True (static, then dynamic shapes) gives eager's value and
    the same gradients in every input (each run on fresh leaf copies of `inputs`)."""
    for dynamic in (False, True):
        torch._dynamo.reset()
        xs = [v.clone().requires_grad_() for v in inputs]
        ys = [v.clone().requires_grad_() for v in inputs]
        le = fn(*xs)
        le.backward()
        lc = torch.compile(fn, fullgraph=True, dynamic=dynamic)(*ys)
        lc.backward()
        torch.testing.assert_close(lc, le)
        for a, c in zip(xs, ys):
            torch.testing.assert_close(c.grad, a.grad)


def lce_lean(input, linear_weight, linear_bias=None) -> bool:
    """Whether a chunked head-loss call on these tensors runs in lean mode now: the knob OPFORGE_LCE_LEAN is 1,
    input is on CUDA in float16/bfloat16, and linear_weight (and linear_bias) share its dtype (csrc's lce::lean_mode)."""
    dt = input.dtype
    if not input.is_cuda or dt not in (torch.float16, torch.bfloat16) or linear_weight.dtype != dt:
        return False
    if linear_bias is not None and linear_bias.dtype != dt:
        return False
    now = torch.ops.opforge._set_knob(LCE_LEAN, 0)
    torch.ops.opforge._set_knob(LCE_LEAN, now)
    return now == 1


def lean_rounding_bound(value_fn, logits, reference):
    """The a-priori error bound lean mode adds to a value computed from logits rounded to their 16-bit dtype.

    Derivation: lean mode rounds each raw logit l (x · w + b, before any softcap or temperature) once to the
    storage dtype, a relative error of at most u = eps / 2 (2^-8 for bfloat16, 2^-11 for float16); everything after
    runs in float32. To first order the value f(l) then moves by at most u · Σ_j |∂f/∂l_j| · |l_j| (per output
    element: each token's value depends on its own row of logits only, so the rows' sums are the elements' bounds).
    The bound is 2× that first-order term (the tolerance rule's own factor, covering the second-order terms,
    O((u·|l|)²), which are far smaller at these sizes) plus 8 float32 eps of (|reference| + the first-order term) for
    the float32 evaluation of the softmax sums.

    Args:
        value_fn: callable taking the float64 logits list (each [N, V], requiring grad) and returning the value
            (a scalar or one element per token), differentiable.
        logits: list of (float64 raw logits [N, V], dtype they are rounded to in lean mode).
        reference: the float64 reference value (value_fn's output shape).

    Returns:
        float64 tensor of reference's shape: the bound per element.
    """
    ls = [l.detach().double().clone().requires_grad_() for l, _ in logits]
    out = value_fn(ls)
    grads = torch.autograd.grad(out.sum(), ls)
    first = 0
    for (l, dt), g, lv in zip(logits, grads, ls):
        u = torch.finfo(dt).eps / 2
        s = (g.abs() * lv.detach().abs())
        first = first + u * (s.sum() if out.dim() == 0 else s.reshape(out.numel(), -1).sum(1).reshape(out.shape))
    eps32 = torch.finfo(torch.float32).eps
    return 2 * first + 8 * eps32 * (reference.detach().double().abs() + first)


def lce_lean_loss_bound(input, linear_weight, target, linear_bias=None, **kwargs):
    """lean_rounding_bound of opforge.linear_cross_entropy's loss when the call runs in lean mode (lce_lean), else None.

    The float64 loss (opforge.testing.linear_cross_entropy_reference) as a function of the raw logits
    x · linear_weightᵀ + linear_bias (float64), through an identity head; softcap and the other options act on them
    as in the op.

    Args:
        input: (*, H) floating. The hidden states of the call.
        linear_weight: (V, H) floating.
        target: input's leading shape, int64.
        linear_bias: (V,) floating or None.
        **kwargs: the call's options (weight, reduction, ignore_index, label_smoothing, z_loss, softcap);
            chunk_size is ignored.

    Returns:
        float64 tensor of the loss's shape (a scalar, or target's shape for reduction="none"), or None outside
        lean mode or without tokens.
    """
    if not lce_lean(input, linear_weight, linear_bias) or target.numel() == 0:
        return None
    from opforge.testing import linear_cross_entropy_reference

    kwargs = {k: v for k, v in kwargs.items() if k != "chunk_size"}
    V = linear_weight.shape[0]
    L = input.detach().reshape(-1, input.shape[-1]).double() @ linear_weight.detach().double().t()
    if linear_bias is not None:
        L = L + linear_bias.detach().double()
    eye = torch.eye(V, dtype=torch.float64, device=input.device)

    def loss(ls):
        return linear_cross_entropy_reference(ls[0].reshape(*target.shape, V), eye, target, **kwargs)

    return lean_rounding_bound(loss, [(L, input.dtype)], loss([L]))


def lean_accum_factor(k: int) -> float:
    """The tolerance rule's factor for a weight gradient accumulated in its 16-bit dtype over k chunks (lean mode, or
    OPFORGE_LCE_DW_ACCUM=1): 2 × k for k > 1 (k roundings of a partial sum of dW's size, each at most the baseline's
    one; test_linear_cross_entropy._accum_factor derives it), the rule's own 2 for k = 1."""
    return 2.0 * k if k > 1 else 2.0


# ---- two processes in a gloo process group (the CPU's distributed tests) ------------------------------------


def _gloo_main(rank, world, init, worker, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        worker(rank, world, *args)
        # every rank done with its collectives before any tears the group down (a rank destroying it while a peer's
        # gloo work is still in flight aborts the peer)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn_gloo(tmp_path, worker, *args, world: int = 2) -> None:
    """Runs worker(rank, world, *args) in `world` spawned processes, each with one thread and in one gloo process
    group (a file store under tmp_path), destroyed after; raises when a process fails. `worker` must be a module-level
    function (it is pickled)."""
    import torch.multiprocessing as mp

    mp.spawn(_gloo_main, args=(world, f"file://{tmp_path / 'store'}", worker, args), nprocs=world, join=True)
