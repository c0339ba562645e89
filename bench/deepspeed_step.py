#!/usr/bin/env python3
"""DeepSpeed's side of the whole-step comparison with zero over MPI on CPUs.

The model and config of BenchmarkMPIStep (mpi_bench_test.go): LAYERS fp32
weights of HIDDEN x HIDDEN, the loss sum_p <w_p, c_p> with fixed random c_p
(so backward hands over c_p and costs a pass over memory, as zero's
benchmark hands over fixed gradients), ZeRO stage 2, buckets of BUCKET
elements, torch's AdamW (lr 1e-3, weight decay 0.01), W processes on gloo.
Prints the mean steps per second over STEPS steps after WARMUP.

    # DeepSpeed 0.19.8 and torch 2.15.0 (CPU), in a venv:
    python3 -m venv venv-ds && venv-ds/bin/pip install torch==2.15.0 deepspeed==0.19.8
    venv-ds/bin/torchrun --nproc-per-node 2 bench/deepspeed_step.py --layers 8 --hidden 1024

bench/mpi_step.sh runs it beside zero's benchmark.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--bucket", type=int, default=1 << 22, help="elements per reduce and all-gather bucket")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.ParameterList(
                [torch.nn.Parameter(torch.randn(a.hidden, a.hidden) * 0.02) for _ in range(a.layers)])
            # the fixed gradients, one per rank as zero's benchmark draws them
            g = torch.Generator().manual_seed(100 + rank)
            self.c = [torch.randn(a.hidden, a.hidden, generator=g) for _ in range(a.layers)]

        def forward(self):
            return sum((w * c).sum() for w, c in zip(self.w, self.c))

    model = Model()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": a.bucket,
            "allgather_bucket_size": a.bucket,
            "overlap_comm": False,
            "contiguous_gradients": True,
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)

    def step():
        loss = engine()
        engine.backward(loss)
        engine.step()

    for _ in range(a.warmup):
        step()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(a.steps):
        step()
    dist.barrier()
    dt = time.perf_counter() - t0
    if rank == 0:
        n = a.layers * a.hidden * a.hidden
        print(f"deepspeed {deepspeed.__version__} torch {torch.__version__} gloo W={world} "
              f"params={n} stage=2: {a.steps / dt:.3f} steps/s ({dt / a.steps * 1e3:.1f} ms/step)", flush=True)


if __name__ == "__main__":
    main()
