#!/usr/bin/env python3
"""All-reduce bus bandwidth of a PyTorch NCCL job, for bench-job.sh.

    python3 allreduce_bw.py [--world N] [--sizes-mib 1,16,256] [--iters N] [--port P]

One process per GPU (torch.multiprocessing). For each size, rank 0 prints one line:
    allreduce MIB time_us busbw_gbs
where busbw = 2 (N-1)/N * bytes / time (NCCL's own definition, so the numbers compare with
nccl-tests). The transports are whatever the environment selects: run it once plainly and once
with what `ptxmig run --nccl-sockets` sets to see what the sockets cost.
"""
import argparse
import os
import sys
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast on shared hosts
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def run(rank: int, world: int, a: argparse.Namespace) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(a.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    for mib in (int(s) for s in a.sizes_mib.split(",")):
        x = torch.ones(mib << 18, dtype=torch.float32, device="cuda")  # MIB MiB of float32
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(a.iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / a.iters
        if rank == 0:
            busbw = 2 * (world - 1) / world * (mib << 20) / dt / 1e9
            print(f"allreduce {mib} {dt * 1e6:.1f} {busbw:.2f}", flush=True)
        del x
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes-mib", default="1,16,256")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--port", type=int, default=29701)
    a = p.parse_args()
    if torch.cuda.device_count() < a.world:
        print(f"needs {a.world} GPUs, has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    mp.spawn(run, args=(a.world, a), nprocs=a.world, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
