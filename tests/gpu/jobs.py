"""Workloads that look like real GPU jobs, for the GPU-scale benchmarks (run in a container).

    python jobs.py infer GIB     # bf16 weights fixed after load + a KV-like buffer rewritten per step
    python jobs.py train GIB     # fp32 weights + Adam moments, all rewritten every step
    python jobs.py train GIB --reference STEPS   # the same run, uninterrupted, unpaced: loss lines
    python jobs.py serve DIR     # an inference server: weights from DIR's files, warm-up, a socket
    python jobs.py serve-compiled DIR   # the same, compiled, with CUDA graphs per batch size
    python jobs.py weights DIR GIB   # (on the host) the weight files a serve image holds

Both write, under /status (a host folder):
- ``w0``: "<step> ok|bad", rewritten each step (tests/gpu/harness.py waits on it);
- ``progress.log``: one line per step, "<unix time> <step> <what>", appended: the
  benchmarks read downtime from it (last step on the source, first on the target),
  not from gpusnap's own timers;
- ``verify`` -> ``w0.verified`` (inference): on request, every weight is regenerated
  from its seed and compared element by element, and the KV buffer with its step's.

*infer*: GIB GiB of bf16 weights in 8192 x 8192 layers drawn from a seeded normal
(std 0.02: the bit statistics of real checkpoints, not uniform noise), and a
KV-like buffer of GIB/16 (at most 1 GiB) rewritten every step from the step's own
seed. Each step answers request ``step % 97`` by running a vector through 4 of the
layers; the answer (a float's hex) depends only on the request and the weights, so
answers after a restore must equal those logged before it for the same request.

*train*: the GIB GiB hold three fp32 tensors of equal size (weights, Adam's first and
second moments); every step computes a synthetic gradient from the weights, updates
all three in place and logs the loss (sum of squared weights, float64, as hex) to
``loss.log``. On the same GPU the lines after a restore equal an uninterrupted run's.
"""

from __future__ import annotations

import os
import sys
import time

STATUS = os.environ.get("GPUSNAP_JOB_STATUS", "/status")
D = 8192  # layer width: one bf16 layer is 128 MiB
SLICE = 1 << 26  # elements updated at once in training: bounds the temporaries (256 MiB)


def _write(name: str, text: str) -> None:
    tmp = os.path.join(STATUS, f".{name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, os.path.join(STATUS, name))


def _append(name: str, line: str) -> None:
    with open(os.path.join(STATUS, name), "a") as f:
        f.write(line + "\n")


def _token(done: str | None) -> str | None:
    try:
        token = open(os.path.join(STATUS, "verify")).read().strip()
    except OSError:
        return None
    return token if token and token != done else None


class Inference:
    def __init__(self, gib: float) -> None:
        import torch
        self.torch = torch
        self.layers = max(4, int(gib * (1 << 30)) // (D * D * 2))
        self.weights = [self._layer(i) for i in range(self.layers)]
        kv_elems = min(1 << 30, int(gib * (1 << 30)) // 16) // 2
        self.kv = torch.empty(kv_elems // D * D, dtype=torch.bfloat16, device="cuda").view(-1, D)
        torch.cuda.empty_cache()  # randn's fp32 temporaries: hold about GIB, not more

    def _gen(self, seed: int):
        return self.torch.Generator(device="cuda").manual_seed(seed)

    def _layer(self, i: int):
        t = self.torch
        return (t.randn(D, D, device="cuda", generator=self._gen(1000 + i)) * 0.02).to(t.bfloat16)

    def _kv_row(self, step: int):
        t = self.torch
        return t.randn(D, device="cuda", generator=self._gen(10**6 + step)).to(t.bfloat16)

    def step(self, step: int) -> str:
        t = self.torch
        self.kv.copy_(self._kv_row(step).expand_as(self.kv))  # the whole buffer, every step
        request = step % 97
        y = t.randn(D, device="cuda", generator=self._gen(10**7 + request)).to(t.bfloat16)
        for j in range(4):
            y = t.tanh(self.weights[(request * 7 + j * 13) % self.layers] @ y)
        answer = float(y.float().sum().item())
        return f"request {request} answer {answer.hex()}"

    def verify(self, step: int) -> bool:
        t = self.torch
        ok = all(t.equal(w, self._layer(i)) for i, w in enumerate(self.weights))
        ok = ok and t.equal(self.kv, self._kv_row(step).expand_as(self.kv))
        t.cuda.empty_cache()
        return ok


class Training:
    def __init__(self, gib: float) -> None:
        import torch
        self.torch = torch
        n = int(gib * (1 << 30)) // 12  # three fp32 tensors
        g = torch.Generator(device="cuda").manual_seed(7)
        self.p = torch.randn(n, device="cuda", generator=g) * 0.02
        self.m = torch.zeros(n, device="cuda")
        self.v = torch.zeros(n, device="cuda")
        torch.cuda.empty_cache()

    def step(self, step: int) -> str:
        t = self.torch
        for lo in range(0, self.p.numel(), SLICE):
            p, m, v = (x[lo:lo + SLICE] for x in (self.p, self.m, self.v))
            grad = t.sin(p * 3.0 + step * 1e-3) * 1e-2
            m.mul_(0.9).add_(grad, alpha=0.1)
            v.mul_(0.999).addcmul_(grad, grad, value=1e-3)
            p.addcdiv_(m, v.sqrt().add_(1e-8), value=-1e-3)
        loss = float(t.sum(self.p * self.p, dtype=t.float64).item())
        return f"loss {loss.hex()}"


class Server:
    """*serve*: what a cold start costs, for bench/coldstart.py. Imports PyTorch,
    reads the weight files of DIR (``layer-NNNN.bf16``, raw bf16 8192 x 8192, as
    ``weights()`` writes them: the same seeds as *infer*) onto the GPU, runs
    warm-up requests, then answers on a unix socket (/tmp/serve.sock, reached
    from the host through /proc/PID/root) and on TCP port 8000 where the
    container has a network. A request is a line: ``N`` answers request N as
    *infer* does (a float's hex: equal on every copy of the same weights);
    ``verify`` sums every layer again and compares with the sums taken at load.
    Each phase is printed as "phase <unix time> <name>" (podman logs)."""

    def __init__(self, folder: str) -> None:
        _phase("started")
        import torch
        self.torch = torch
        torch.zeros(1, device="cuda")  # the CUDA context: part of any server's start
        _phase("imported")
        files = sorted(f for f in os.listdir(folder) if f.endswith(".bf16"))
        self.layers = []
        for f in files:
            host = torch.from_file(os.path.join(folder, f), shared=False, size=D * D,
                                   dtype=torch.bfloat16)
            self.layers.append(host.view(D, D).to("cuda"))
            del host
        self.sums = [self._sum(w) for w in self.layers]
        _phase("loaded")
        self.prepare()
        for n in range(WARMUP):
            self.answer(n % 97)
        torch.cuda.synchronize()
        _phase("warm")

    def prepare(self) -> None:
        """What a server does between loading its weights and warming up: nothing here."""

    def _sum(self, w) -> str:
        return float(w.float().sum(dtype=self.torch.float64).item()).hex()

    def answer(self, request: int) -> str:
        t = self.torch
        g = t.Generator(device="cuda").manual_seed(10**7 + request)
        y = t.randn(D, device="cuda", generator=g).to(t.bfloat16)
        for j in range(4):
            y = t.tanh(self.layers[(request * 7 + j * 13) % len(self.layers)] @ y)
        return float(y.float().sum().item()).hex()

    def handle(self, line: str) -> str:
        if line == "verify":
            return "ok" if [self._sum(w) for w in self.layers] == self.sums else "bad"
        return self.answer(int(line))

    def serve(self) -> None:
        import selectors
        import socket
        sel = selectors.DefaultSelector()
        unix = socket.socket(socket.AF_UNIX)
        unix.bind("/tmp/serve.sock")
        listeners = [unix]
        if os.environ.get("SERVE_TCP"):  # CRIU < 4.2 cannot dump TCP sockets on Linux >= 6.16
            listeners.append(socket.create_server(("0.0.0.0", 8000)))
        for s in listeners:
            s.listen(16)
            sel.register(s, selectors.EVENT_READ)
        _phase("listening")
        while True:
            for key, _ in sel.select():
                conn, _ = key.fileobj.accept()
                with conn, conn.makefile("rw") as f:
                    for line in f:
                        f.write(self.handle(line.strip()) + "\n")
                        f.flush()


WARMUP = 200
BATCHES = (1, 2, 4, 8)  # the batch sizes a compiled server captures a CUDA graph for


class CompiledServer(Server):
    """*serve-compiled*: *serve* as servers are run for speed. Between load and
    warm-up it compiles its forward pass through every layer (torch.compile,
    mode SERVE_COMPILE_MODE, default "max-autotune-no-cudagraphs": inductor's
    Triton kernels, the matrix products autotuned) and shuts its compile workers
    down, then captures one CUDA graph per batch size in BATCHES itself, as
    inference servers do. Inductor and
    Triton keep what they compiled where TORCHINDUCTOR_CACHE_DIR and
    TRITON_CACHE_DIR say: a host folder kept between runs is a warm compile
    cache. Request N runs a batch of BATCHES[N % 4] rows drawn from N's seed
    through the graph; the answer is the sum of its output (a float's hex)."""

    def prepare(self) -> None:
        t = self.torch
        t.set_grad_enabled(False)  # serving: no autograd state, in the graphs or out
        nn = t.nn.functional

        def forward(x, layers):
            for w in layers:
                x = x + nn.gelu(nn.layer_norm(x @ w, (D,)))
            return x.float().sum(dim=1)

        mode = os.environ.get("SERVE_COMPILE_MODE", "max-autotune-no-cudagraphs")
        compiled = t.compile(forward, mode=mode, dynamic=False)
        for b in BATCHES:  # compiles (and autotunes) once per shape
            compiled(t.zeros(b, D, device="cuda", dtype=t.bfloat16), self.layers)
        t.cuda.synchronize()
        # Idle from now on, and children forked from a CUDA process, which the
        # driver cannot checkpoint: gpusnap refuses the dump while they run.
        from torch._inductor import async_compile
        async_compile.shutdown_compile_workers()
        _phase("compiled")
        self.graphs = {}
        for b in BATCHES:
            x = t.zeros(b, D, device="cuda", dtype=t.bfloat16)
            side = t.cuda.Stream()
            side.wait_stream(t.cuda.current_stream())
            with t.cuda.stream(side):  # capture wants its first run off the default stream
                compiled(x, self.layers)
            t.cuda.current_stream().wait_stream(side)
            graph = t.cuda.CUDAGraph()
            with t.cuda.graph(graph):
                out = compiled(x, self.layers)
            self.graphs[b] = (graph, x, out)
        t.cuda.synchronize()
        _phase("captured")

    def answer(self, request: int) -> str:
        t = self.torch
        graph, x, out = self.graphs[BATCHES[request % len(BATCHES)]]
        g = t.Generator(device="cuda").manual_seed(10**7 + request)
        x.copy_(t.randn(x.shape, device="cuda", generator=g).to(t.bfloat16))
        graph.replay()
        return float(out.double().sum().item()).hex()


def _phase(name: str) -> None:
    print(f"phase {time.time():.6f} {name}", flush=True)


def weights(folder: str, gib: float) -> None:
    """The weight files a *serve* image holds: *infer*'s layers, same seeds."""
    import torch
    os.makedirs(folder, exist_ok=True)
    layers = max(4, int(gib * (1 << 30)) // (D * D * 2))
    for i in range(layers):
        g = torch.Generator(device="cuda").manual_seed(1000 + i)
        w = (torch.randn(D, D, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        w.view(torch.int16).cpu().numpy().tofile(os.path.join(folder, f"layer-{i:04d}.bf16"))


def run(kind: str, gib: float, reference: int | None) -> None:
    job = Inference(gib) if kind == "infer" else Training(gib)
    pace = float(os.environ.get("GPUSNAP_JOB_PACE", "0.1"))
    done = None
    step = 0
    while reference is None or step < reference:
        step += 1
        what = job.step(step)
        if reference is not None:
            print(f"{step} {what}", flush=True)
            continue
        job.torch.cuda.synchronize()
        _append("progress.log", f"{time.time():.6f} {step} {what}")
        if kind == "train":
            _append("loss.log", f"{step} {what}")
        _write("w0", f"{step} ok")
        token = _token(done) if kind == "infer" else None  # training: the loss lines are the check
        if token:
            _write("w0.verified", f"{token} {'ok' if job.verify(step) else 'bad'}")
            done = token
        time.sleep(pace)


def main() -> None:
    args = sys.argv[1:]
    if args[:1] in (["serve"], ["serve-compiled"]) and len(args) == 2:
        (Server if args[0] == "serve" else CompiledServer)(args[1]).serve()
        return
    if args[:1] == ["weights"] and len(args) == 3:
        weights(args[1], float(args[2]))
        return
    if len(args) < 2 or args[0] not in ("infer", "train"):
        raise SystemExit(__doc__)
    reference = int(args[3]) if len(args) > 3 and args[2] == "--reference" else None
    run(args[0], float(args[1]), reference)


if __name__ == "__main__":
    main()
