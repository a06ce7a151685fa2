"""Shared fixtures: devices (CUDA cases skip cleanly without a GPU), dtypes and seeded RNG."""
import os
from pathlib import Path

# Inductor's on-disk cache is keyed on the graph, not on a custom op's schema: a cache shared with
# another checkout (a worktree whose op takes other arguments) can replay stale code. Each checkout
# gets its own cache unless one is set.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(__file__).resolve().parents[2] / "build" / "inductor-cache"))

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
