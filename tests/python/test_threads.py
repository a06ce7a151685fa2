"""Thread safety: N Python threads calling every op (forward + backward) at once give exactly the serial
results; on CUDA each thread runs on its own stream. OPFORGE_THREAD_CALLS sets the calls per thread (default 20; the
issue's soak is 1000)."""
import os
import threading

import torch

import opforge

THREADS = 8
CALLS = int(os.environ.get("OPFORGE_THREAD_CALLS", "20"))


def _step(inputs):
    x, r, w, W, b = (t.detach().requires_grad_() for t in inputs)
    h, res = opforge.fused_add_rms_norm(x, r, x.shape[-1], w)
    y = opforge.linear(opforge.rms_norm(h, x.shape[-1], w), W, b, "silu")
    y = opforge.square_add(opforge.sigmoid(opforge.swiglu(y, y.flip(-1))), opforge.square(b))
    (y.sum() + res.sum()).backward()
    return [y.detach()] + [t.grad for t in (x, r, w, W, b)]


def _inputs(i, device):
    g = torch.Generator().manual_seed(i)
    shapes = [(9, 48), (9, 48), (48,), (24, 48), (24,)]
    return [torch.randn(s, generator=g).to(device) for s in shapes]


def test_threads_equal_serial(device):
    inputs = [_inputs(i, device) for i in range(THREADS)]
    serial = [_step(inp) for inp in inputs]
    errors, results = [], [None] * THREADS

    def work(i):
        try:
            stream = torch.cuda.Stream() if device == "cuda" else None
            with torch.cuda.stream(stream) if stream is not None else _null():
                for _ in range(CALLS):
                    out = _step(inputs[i])
                    if stream is not None:
                        stream.synchronize()
                    results[i] = out
                    for a, b in zip(out, serial[i]):
                        if not torch.equal(a, b):
                            errors.append(f"thread {i}: result differs from the serial one")
                            return
        except Exception as e:  # noqa: BLE001 (reported below, with the thread)
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert all(r is not None for r in results)


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False
