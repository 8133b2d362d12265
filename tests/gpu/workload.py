"""A CUDA workload for the GPU tests and benchmarks, run inside a container.

    python workload.py [NPROC] [GIB]   (defaults 1, 2)

The parent starts NPROC worker processes (it uses no CUDA itself). Each worker
draws a random seed at its start and writes it to /status/w<i>.born: a restored
worker keeps it, a restarted one draws another. It fills GIB GiB of GPU memory
with pseudo-random int32 from that seed, then loops: it checks the tensor's sum
and writes /status/w<i> as "<iteration> <ok>". When /status/verify holds
"<token> <seed0> <seed1>...", the worker regenerates the data from the seed the
test read at the start (not its own) and compares every element with its
tensor, writing "<token> ok|bad" to /status/w<i>.verified: only the tensor the
original run made, as it was at the checkpoint, passes. When /status/busy
exists it runs one long kernel (about 8 s) so that a lock with a short timeout
must fail. While /status/fork exists, worker 0 keeps a forked child (its pid in
/status/w0.forked), as torch.compile's compile workers are: it inherits the
worker's driver files and the driver does not manage it.
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
    born = os.urandom(8).hex()

    def generate(seed: str) -> "torch.Tensor":
        g = torch.Generator(device="cuda").manual_seed(int(seed, 16))
        return torch.randint(-(2**31), 2**31 - 1, (n,), dtype=torch.int32, device="cuda", generator=g)

    def checksum() -> int:
        # by slices: a sum of all of x in int64 takes a temporary of twice its
        # size, which PyTorch's cache then keeps (8 GiB of data held 24.6 GiB)
        return int(torch.stack([c.sum(dtype=torch.int64) for c in x.split(1 << 26)]).sum())

    _write(f"w{index}.born", born)
    x = generate(born)
    ref = checksum()
    torch.cuda.empty_cache()  # the process holds about GIB of GPU memory
    it, done_token, forked = 0, None, None
    while True:
        it += 1
        if index == 0:
            forked = _fork_child(forked)
        ok = checksum() == ref
        _write(f"w{index}", f"{it} {'ok' if ok else 'bad'}")
        try:
            token, *seeds = open(os.path.join(STATUS, "verify")).read().split()
        except (OSError, ValueError):
            token, seeds = None, []
        if token and token != done_token:
            # the seed the test knew before the checkpoint; a worker started
            # afresh has another, so its tensor differs from this one
            y = generate(seeds[index] if index < len(seeds) else born)
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


def _fork_child(forked: int | None) -> int | None:
    """A forked child while /status/fork exists; ``forked``: the last one's pid."""
    wanted = os.path.exists(os.path.join(STATUS, "fork"))
    if forked is not None and os.waitpid(forked, os.WNOHANG)[0]:
        os.unlink(os.path.join(STATUS, "w0.forked"))
        forked = None
    if wanted and forked is None:
        forked = os.fork()
        if forked == 0:  # CUDA is unusable here; the driver's files are inherited
            while os.path.exists(os.path.join(STATUS, "fork")):
                time.sleep(0.2)
            os._exit(0)
        _write("w0.forked", str(forked))
    return forked


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
