#!/usr/bin/env python3
"""Deterministic loops in the frameworks users run, for ptxmig's framework matrix (TestFrameworks).

    python3 frameworks.py FRAMEWORK [--steps N] [--sleep-ms M] [--long-ms L] [--one-wave] [--spin clock|sleep]
                                    [--hold-gib G]

FRAMEWORK: resnet (torchvision ResNet-18 training), gpt2 (Hugging Face GPT-2, bf16 autocast,
AdamW), compile (an MLP under torch.compile: Inductor's Triton kernels), triton (a @triton.jit
kernel), cupy (a cupy.RawKernel: NVRTC), numba (a numba.cuda.jit kernel: NVVM's LTO-IR linked by
nvJitLink), jax (a jax.jit MLP), pipeline (a PyTorch MLP split over cuda:0 and cuda:1, model
parallel: activations and gradients copied between the GPUs). One GPU (pipeline: two), no
download: models are built from configurations with a fixed seed. Every step prints "step N VALUE" (a loss to 17
significant digits, or an exact checksum) and the end "final VALUE"; two uninterrupted runs print
identical lines, and so must a run checkpointed, restored or migrated in between. --long-ms makes
each cupy/numba launch spin about that long per block (a long kernel; --one-wave: a grid of one
block per SM; otherwise 64 per SM: about four waves of 128-thread blocks). cupy spins on the SM's
clock by default (--spin clock: each thread leaves the loop on its own clock, a thread-loop safe
point with the start time rebased) or, with --spin sleep, as numba always does: a loop of 1 µs
nanosleeps with a uniform trip count (a CTA-wide loop safe point). --hold-gib G (resnet) keeps G GiB of random int32 on
the GPU beside the model, 64 MiB of it changed every step, and prints its sum at the end ("result
hold SUM"): a training process with that much device memory to move. Prints "skip: REASON" and
exits 3 when the framework is missing.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_deterministic_ops=true")

# The spin-and-count kernels of cupy and numba: each block spins (spin_count: `spin` clock cycles;
# spin_sleep: `spin` sleeps of about 1 µs; 0: none), then each thread adds a value that depends on
# its index and the step to out[thread], so the sum is an exact function of the steps run.
CUDA_SRC = r"""
extern "C" __global__ void spin_count(unsigned long long *out, unsigned long long spin, unsigned int step) {
    unsigned long long t0 = clock64();
    while (spin && (unsigned long long)(clock64() - t0) < spin) { }
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(&out[i], (unsigned long long)(i % 97 + step));
}
extern "C" __global__ void spin_sleep(unsigned long long *out, unsigned long long spin, unsigned int step) {
    for (unsigned long long k = 0; k < spin; k++) __nanosleep(1000);
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(&out[i], (unsigned long long)(i % 97 + step));
}
"""


def torch_setup(seed):
    import torch
    torch.manual_seed(seed)
    # Deterministic kernels where PyTorch has them; an op without one warns instead of failing
    # (the comparison with an uninterrupted run then says whether it mattered).
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch


def run_resnet(a, emit):
    torch = torch_setup(a.seed)
    import torchvision
    dev = torch.device("cuda:0")
    model = torchvision.models.resnet18(weights=None, num_classes=10).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(a.seed)
    x = torch.randn(32, 3, 64, 64, generator=g).to(dev)
    y = torch.randint(0, 10, (32,), generator=g).to(dev)
    hold = None
    if a.hold_gib > 0:  # random data the process keeps on the GPU; 64 MiB of it change every step
        gd = torch.Generator(device=dev).manual_seed(a.seed)
        hold = torch.randint(0, 1 << 30, (int(a.hold_gib * (1 << 28)),), dtype=torch.int32, device=dev, generator=gd)
    for step in range(1, a.steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if hold is not None:
            hold[: 1 << 24].add_(step)
        emit(step, f"{loss.item():.17g}")
    if hold is not None:
        print(f"result hold {int(hold.sum(dtype=torch.int64).item())}", flush=True)


def run_gpt2(a, emit):
    torch = torch_setup(a.seed)
    from transformers import GPT2Config, GPT2LMHeadModel
    dev = torch.device("cuda:0")
    cfg = GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab_size=1000, n_positions=128)
    model = GPT2LMHeadModel(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(a.seed)
    ids = torch.randint(0, 1000, (8, 128), generator=g).to(dev)
    for step in range(1, a.steps + 1):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        emit(step, f"{loss.item():.17g}")


def run_compile(a, emit):
    torch = torch_setup(a.seed)
    dev = torch.device("cuda:0")
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 16)).to(dev)
    step_fn = torch.compile(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(a.seed)
    x = torch.randn(512, 256, generator=g).to(dev)
    y = torch.randn(512, 16, generator=g).to(dev)
    for step in range(1, a.steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(step_fn(x), y)
        loss.backward()
        opt.step()
        emit(step, f"{loss.item():.17g}")


def run_pipeline(a, emit):
    torch = torch_setup(a.seed)
    if torch.cuda.device_count() < 2:
        print(f"skip: pipeline needs 2 GPUs, {torch.cuda.device_count()} visible", flush=True)
        raise SystemExit(3)
    d0, d1 = torch.device("cuda:0"), torch.device("cuda:1")
    first = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU()).to(d0)
    second = torch.nn.Linear(1024, 16).to(d1)
    opt = torch.optim.Adam(list(first.parameters()) + list(second.parameters()), lr=1e-3)
    g = torch.Generator().manual_seed(a.seed)
    x = torch.randn(512, 256, generator=g).to(d0)
    y = torch.randn(512, 16, generator=g).to(d1)
    for step in range(1, a.steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(second(first(x).to(d1)), y)  # GPU 0 -> GPU 1, and back in backward
        loss.backward()
        opt.step()
        emit(step, f"{loss.item():.17g}")


def run_triton(a, emit):
    torch = torch_setup(a.seed)
    import triton
    import triton.language as tl

    @triton.jit
    def axpb(x_ptr, out_ptr, n, a_, b_, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        v = tl.load(x_ptr + offs, mask=m)
        tl.store(out_ptr + offs, (v * a_ + b_) % 1000003, mask=m)

    n = 1 << 24
    x = torch.arange(n, dtype=torch.int64, device="cuda:0") % 1000003
    out = torch.empty_like(x)
    for step in range(1, a.steps + 1):
        axpb[(triton.cdiv(n, 1024),)](x, out, n, 31 + step, step, BLOCK=1024)
        x, out = out, x
        emit(step, str(int(x.sum().item())))


def spin_cycles(a, sms_hz):
    return int(a.long_ms * 1e-3 * sms_hz) if a.long_ms > 0 else 0


def run_cupy(a, emit):
    import cupy as cp
    k = cp.RawKernel(CUDA_SRC, "spin_sleep" if a.spin == "sleep" else "spin_count")
    dev = cp.cuda.Device(0)
    sms = dev.attributes["MultiProcessorCount"]
    hz = dev.attributes["ClockRate"] * 1000
    blocks = sms if a.one_wave else 64 * sms
    out = cp.zeros(blocks * 128, dtype=cp.uint64)
    spin = int(a.long_ms * 1000) if a.spin == "sleep" and a.long_ms > 0 else spin_cycles(a, hz)
    for step in range(1, a.steps + 1):
        k((blocks,), (128,), (out, cp.uint64(spin), cp.uint32(step)))
        emit(step, str(int(out.sum())))


def run_numba(a, emit):
    import numpy as np
    if not hasattr(np, "row_stack"):
        # numba-cuda 0.2x registers an overload of np.row_stack at import, which NumPy 2.4 removed
        # (the GPU hosts' image: numba 0.68, numba-cuda's import fails). Its old alias is enough.
        np.row_stack = np.vstack
    from numba import cuda

    # The same kernel as CUDA_SRC; the spin is `spin_us` sleeps of about 1 µs (numba has no clock64).
    @cuda.jit
    def spin_count(out, spin_us, step):
        for _ in range(spin_us):
            cuda.nanosleep(1000)
        i = cuda.grid(1)
        cuda.atomic.add(out, i, np.uint64(i % 97) + step)

    dev = cuda.get_current_device()
    blocks = dev.MULTIPROCESSOR_COUNT if a.one_wave else 64 * dev.MULTIPROCESSOR_COUNT
    out = cuda.to_device(np.zeros(blocks * 128, dtype=np.uint64))
    spin_us = np.int64(a.long_ms * 1000) if a.long_ms > 0 else np.int64(0)
    for step in range(1, a.steps + 1):
        spin_count[blocks, 128](out, spin_us, np.uint64(step))
        emit(step, str(int(out.copy_to_host().sum())))


def run_jax(a, emit):
    import jax
    import jax.numpy as jnp
    key = jax.random.PRNGKey(a.seed)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    x = jax.random.normal(k1, (512, 256))
    y = jnp.tanh(x @ jax.random.normal(k2, (256, 16)))
    params = {"w1": jax.random.normal(k3, (256, 512)) * 0.05, "w2": jax.random.normal(k4, (512, 16)) * 0.05}

    def loss_fn(p):
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)

    @jax.jit
    def update(p):
        loss, g = jax.value_and_grad(loss_fn)(p)
        return jax.tree_util.tree_map(lambda w, d: w - 0.05 * d, p, g), loss

    for step in range(1, a.steps + 1):
        params, loss = update(params)
        emit(step, f"{float(loss):.17g}")


RUNNERS = {"resnet": (run_resnet, "torchvision"), "gpt2": (run_gpt2, "transformers"), "compile": (run_compile, "torch"),
           "triton": (run_triton, "triton"), "cupy": (run_cupy, "cupy"), "numba": (run_numba, "numba.cuda"),
           "jax": (run_jax, "jax"), "pipeline": (run_pipeline, "torch")}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("framework", choices=sorted(RUNNERS))
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sleep-ms", type=float, default=20.0)
    p.add_argument("--long-ms", type=float, default=0.0)
    p.add_argument("--one-wave", action="store_true")
    p.add_argument("--spin", choices=["clock", "sleep"], default="clock", help="cupy's spin (numba always sleeps)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hold-gib", type=float, default=0.0, help="resnet: also keep this much random data on the GPU")
    a = p.parse_args()
    run, module = RUNNERS[a.framework]
    try:
        __import__(module)
    except Exception as e:  # noqa: BLE001 - any import failure means "not on this host"
        print(f"skip: {module} cannot be imported: {e}", flush=True)
        return 3
    print(f"pid {os.getpid()} framework {a.framework} steps {a.steps}", flush=True)
    last = [None]

    t0 = [time.monotonic()]

    def emit(step, value):
        last[0] = value
        print(f"step {step} {value}", flush=True)
        if os.environ.get("FW_TIMES") == "1":  # the step's wall time (probe-jit.sh)
            now = time.monotonic()
            print(f"time step {step} {now - t0[0]:.3f}", flush=True)
            t0[0] = now
        if a.sleep_ms > 0:
            time.sleep(a.sleep_ms / 1000)

    run(a, emit)
    print(f"final {last[0]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
