#!/usr/bin/env python3
"""The bucket reduction pipeline of zero, written in PyTorch eager ops.

The yardstick for BenchmarkCUDAPipeline/ZeRO-2 (cuda_bench_test.go): the same
shape (seed 000: 8 layers x hidden 4096, bf16, about 134M parameters, 4
backwards per step, W=2 ranks in one process on one GPU, 32 MiB buckets,
pre-division by W) with the passes a PyTorch implementation makes for each
bucket and rank:

    flat = torch.cat(grads)            # gather the bucket
    flat.div_(predivide)               # pre-division
    s = flat_0[chunk r].float() + ...  # in-process reduce-scatter, rank order, fp32
    shard = s.to(bfloat16)             # the communication dtype
    acc.add_(shard.float(), alpha=post) (or copy_ on the first backward)

zero fuses these into three kernels (flatten with the pre-scale, one
reduce-scatter kernel, accumulate with the post-scale), so it should be at
least 2x faster. Run it on the GPU host right after the Go benchmark, as
scripts/gpu-test.sh does, and compare ms/step on the same card.
"""
import argparse
import json

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--backwards", type=int, default=4)
    ap.add_argument("--bucket-mib", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    a = ap.parse_args()

    dev = torch.device("cuda")
    W, n = a.world, a.hidden * a.hidden
    grads = [[torch.randn(n, device=dev, dtype=torch.bfloat16) for _ in range(a.layers)] for _ in range(W)]

    # buckets in reverse registration order, at most bucket-mib of bf16 each
    buckets, cur, cur_bytes = [], [], 0
    limit = a.bucket_mib << 20
    for p in reversed(range(a.layers)):
        if cur and cur_bytes + 2 * n > limit:
            buckets.append(cur)
            cur, cur_bytes = [], 0
        cur.append(p)
        cur_bytes += 2 * n
        if cur_bytes >= limit:
            buckets.append(cur)
            cur, cur_bytes = [], 0
    if cur:
        buckets.append(cur)

    shard_sizes = [len(b) * n // W for b in buckets]
    acc = [torch.zeros(sum(shard_sizes), device=dev, dtype=torch.float32) for _ in range(W)]
    pre, post = float(W), 1.0 / a.backwards  # predivide by W, then f/(W*G)

    def step():
        for k in range(a.backwards):
            off = 0
            for b, size in zip(buckets, shard_sizes):
                flats = []
                for r in range(W):
                    flat = torch.cat([grads[r][p] for p in b])
                    flat.div_(pre)
                    flats.append(flat.view(W, -1))
                for r in range(W):
                    s = flats[0][r].float()
                    for q in range(1, W):
                        s = s + flats[q][r].float()
                    shard = s.to(torch.bfloat16)
                    dst = acc[r][off:off + size]
                    if k == 0:
                        dst.copy_(shard.float()).mul_(post)
                    else:
                        dst.add_(shard.float(), alpha=post)
                off += size

    for _ in range(a.warmup):
        step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(a.steps):
        step()
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / a.steps
    params = a.layers * n
    print(f"torch eager bucket pipeline on {torch.cuda.get_device_name(0)}: W={W}, {a.layers} x {a.hidden}^2 bf16 "
          f"({params / 1e6:.0f}M params), {a.backwards} backwards/step, {len(buckets)} buckets: {ms:.2f} ms/step")
    print(json.dumps({"bench": "torch_pipeline", "device": torch.cuda.get_device_name(0), "world": W,
                      "params": params, "backwards": a.backwards, "buckets": len(buckets),
                      "ms_per_step": round(ms, 3), "torch": torch.__version__}))


if __name__ == "__main__":
    main()
