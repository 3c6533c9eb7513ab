"""The DP reduction's collectives alone, as the trainer issues them: all-reduce and reduce-scatter of fp32
buckets of 40M elements (Megatron-LM's default bucket), and all-gather of their bf16 weights, timed on the
GPUs of one host. Run under torchrun; NCCL_PROTO / NCCL_ALGO in the environment pick NCCL's protocol.

    torchrun --nproc-per-node 2 benchmarks/nccl_bandwidth.py
    NCCL_PROTO=Simple torchrun --nproc-per-node 2 benchmarks/nccl_bandwidth.py

Bus bandwidth as nccl-tests defines it: all-reduce bytes x 2(n-1)/n, reduce-scatter and all-gather bytes x (n-1)/n,
over the time of one collective."""
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl")
    n = dist.get_world_size()
    elements = 40_000_000
    grad = torch.ones(elements, device="cuda")
    part = torch.empty(elements // n, device="cuda")
    weights = torch.empty(elements, device="cuda", dtype=torch.bfloat16)
    cases = {"all-reduce fp32": (lambda: dist.all_reduce(grad), grad.numel() * 4 * 2 * (n - 1) / n),
             "reduce-scatter fp32": (lambda: dist.reduce_scatter_tensor(part, grad), grad.numel() * 4 * (n - 1) / n),
             "all-gather bf16": (lambda: dist.all_gather_into_tensor(weights, weights[:elements // n].clone()),
                                 weights.numel() * 2 * (n - 1) / n)}
    for name, (op, bus_bytes) in cases.items():
        for _ in range(3):
            op()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            op()
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / 10
        if rank == 0:
            print(f"{name:20s} {elements * 4 / 2**20:6.0f} MiB: {seconds * 1e3:6.2f} ms, bus {bus_bytes / seconds / 1e9:6.1f} GB/s "
                  f"(NCCL_PROTO={os.environ.get('NCCL_PROTO', 'default')})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
