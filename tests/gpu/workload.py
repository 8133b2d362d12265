"""A CUDA workload for the GPU tests and benchmarks, run inside a container.

    python workload.py [NPROC] [GIB]   (defaults 1, 2)

The parent starts NPROC worker processes (it uses no CUDA itself). Each worker
fills GIB GiB of GPU memory with pseudo-random int32 from a seeded generator,
then loops: it checks the tensor's sum and writes /status/w<i> as
"<iteration> <ok>". At its start it writes /status/w<i>.born, a token drawn
afresh by every start: a restored worker keeps it, a restarted one would not. When /status/verify holds a token, the worker regenerates
the data and compares every element, writing "<token> ok|bad" to
/status/w<i>.verified. When /status/busy exists it runs one long kernel
(about 8 s) so that a lock with a short timeout must fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

STATUS = "/status"


def _write(name: str, text: str) -> None:
    tmp = os.path.join(STATUS, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(STATUS, name))


def worker(index: int, gib: float) -> None:
    import torch

    n = int(gib * (1 << 30)) // 4
    seed = 1234 + index

    def generate() -> "torch.Tensor":
        g = torch.Generator(device="cuda").manual_seed(seed)
        return torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda", generator=g)

    _write(f"w{index}.born", os.urandom(16).hex())
    x = generate()
    ref = x.sum(dtype=torch.int64).item()
    # randint's temporaries stay in PyTorch's cache (a 2 GiB tensor left 7.7 GB in
    # use): give them back, so that the process holds about GIB of GPU memory.
    torch.cuda.empty_cache()
    it, done_token = 0, None
    while True:
        it += 1
        ok = x.sum(dtype=torch.int64).item() == ref
        _write(f"w{index}", f"{it} {'ok' if ok else 'bad'}")
        try:
            token = open(os.path.join(STATUS, "verify")).read().strip()
        except OSError:
            token = None
        if token and token != done_token:
            y = generate()
            same = bool(torch.equal(x, y))
            del y
            torch.cuda.empty_cache()
            _write(f"w{index}.verified", f"{token} {'ok' if same else 'bad'}")
            done_token = token
        if os.path.exists(os.path.join(STATUS, "busy")):
            _write(f"w{index}.busy", str(it))
            torch.cuda._sleep(int(8 * 1.9e9))  # ~8 s of GPU clock cycles
            torch.cuda.synchronize()
            os.unlink(os.path.join(STATUS, "busy"))
        time.sleep(0.2)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(int(sys.argv[2]), float(sys.argv[3]))
        return
    nproc = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    gib = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    children = [subprocess.Popen([sys.executable, __file__, "--worker", str(i), str(gib)])
                for i in range(nproc)]
    for child in children:
        child.wait()


if __name__ == "__main__":
    main()
