#!/usr/bin/env python3
"""Deterministic PyTorch DDP training over NCCL for ptxmig's job tests.

    python3 ddp.py [--world N] [--steps N] [--log-every K] [--sleep-ms M] [--port P]

One process per GPU, spawned by this parent with torch.multiprocessing (the job is one process
tree: the parent and its ranks). Each rank trains the same MLP on its own shard of synthetic data
generated from the seed; DDP all-reduces the gradients. Rank 0 prints "step N loss X" (the loss
averaged over the ranks with an all-reduce, 17 significant digits) every K steps and "final loss
X" at the end; every rank ends with "rank R done". Two uninterrupted runs with the same arguments
and the same NCCL transports print identical lines; a run that was checkpointed/restored or
migrated in between must print the same lines too. Under torchrun (RANK/WORLD_SIZE set) it runs
as that rank instead of spawning.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def train(rank: int, world: int, a: argparse.Namespace) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(a.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    torch.manual_seed(a.seed)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", rank)
    g = torch.Generator(device="cpu").manual_seed(a.seed + rank)
    x = torch.randn(2048, 256, generator=g).to(dev)
    w_true = torch.randn(256, 16, generator=torch.Generator().manual_seed(a.seed)).to(dev)
    y = torch.tanh(x @ w_true) + 0.01 * torch.randn(2048, 16, generator=g).to(dev)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, a.hidden), torch.nn.GELU(),
        torch.nn.Linear(a.hidden, a.hidden), torch.nn.GELU(),
        torch.nn.Linear(a.hidden, 16),
    ).to(dev)
    ddp = DDP(model, device_ids=[rank])
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-3)
    if rank == 0:
        print(f"pid {os.getpid()} world {world} steps {a.steps}", flush=True)
    for step in range(1, a.steps + 1):
        i = (step * 128) % 2048
        loss = torch.nn.functional.mse_loss(ddp(x[i:i + 128]), y[i:i + 128])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % a.log_every == 0 or step == a.steps:
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            if rank == 0:
                word = "final" if step == a.steps else f"step {step}"
                print(f"{word} loss {avg.item() / world:.17g}", flush=True)
        if a.sleep_ms > 0:
            time.sleep(a.sleep_ms / 1000)
    dist.barrier()
    print(f"rank {rank} done", flush=True)
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--sleep-ms", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--port", type=int, default=29533)
    a = p.parse_args()
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun
        train(int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]), a)
        return 0
    if torch.cuda.device_count() < a.world:
        print(f"needs {a.world} GPUs, has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    mp.spawn(train, args=(a.world, a), nprocs=a.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
