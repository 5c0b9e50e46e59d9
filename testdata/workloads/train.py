#!/usr/bin/env python3
"""Deterministic PyTorch training loop for ptxmig's GPU tests.

    python3 train.py [--steps N] [--log-every K] [--sleep-ms M] [--seed S] [--device cuda:0]

Trains a small MLP with Adam on synthetic data generated from the seed, printing
"step N loss X" (X with 17 significant digits) every K steps and "final loss X" at the end.
Two uninterrupted runs with the same arguments print identical lines; a run that was
checkpointed/restored or migrated in between must print the same lines too.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
import torch  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--sleep-ms", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--report-time", action="store_true",
                   help="print 'steps_per_s X' for the steps after the first 20 to stderr")
    a = p.parse_args()
    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(a.device)
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    x = torch.randn(4096, 256, generator=g).to(dev)
    w_true = torch.randn(256, 16, generator=g).to(dev)
    y = torch.tanh(x @ w_true) + 0.01 * torch.randn(4096, 16, generator=g).to(dev)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, a.hidden), torch.nn.GELU(),
        torch.nn.Linear(a.hidden, a.hidden), torch.nn.GELU(),
        torch.nn.Linear(a.hidden, 16),
    ).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    print(f"pid {os.getpid()} device {a.device} steps {a.steps}", flush=True)
    loss = None
    t0 = None
    for step in range(1, a.steps + 1):
        if step == 21:
            torch.cuda.synchronize(dev)
            t0 = time.perf_counter()
        i = (step * 512) % 4096
        xb, yb = x[i:i + 512], y[i:i + 512]
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        if step % a.log_every == 0:
            print(f"step {step} loss {loss.item():.17g}", flush=True)
        if a.sleep_ms > 0:
            time.sleep(a.sleep_ms / 1000.0)
    print(f"final loss {loss.item():.17g}", flush=True)
    if a.report_time and t0 is not None:
        print(f"steps_per_s {(a.steps - 20) / (time.perf_counter() - t0):.3f}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
