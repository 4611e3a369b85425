"""The same shard_map program on real processes.

    torchrun --nproc-per-node 2 examples/torchrun_shard_map.py

Every process calls shard_map with the same global tensors; each computes its shard,
outputs are all-gathered, and backward leaves the single-device gradients on every
process (gloo on CPU, NCCL when CUDA is available).
"""
import os

import torch
import torch.distributed as dist

import spmd
from spmd import P


def main() -> None:
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend)
    mesh = spmd.Mesh((dist.get_world_size(),), ("sp",))  # backend="torch": a process group exists
    torch.manual_seed(0)  # the same global tensors on every process
    x = torch.randn(10, 4, dtype=torch.float64, device=mesh.device, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(4, dtype=torch.float64, device=mesh.device))

    f = spmd.shard_map(lambda x: spmd.psum((x * w).sum(), "sp") ** 2, mesh, P("sp"), P())
    loss = f(x)
    loss.backward()

    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ((xr * wr).sum() ** 2).backward()
    ok = torch.allclose(x.grad, xr.grad) and torch.allclose(w.grad, wr.grad)
    print(f"rank {dist.get_rank()}: loss {loss.item():.6f}, gradients match one device: {ok}")
    # torch 2.13's gloo can abort a process that tears down while a peer still has
    # traffic on a subgroup; a world barrier first makes the exit clean.
    dist.barrier()
    dist.destroy_process_group()
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
