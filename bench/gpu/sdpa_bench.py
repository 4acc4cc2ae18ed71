#!/usr/bin/env python3
"""PyTorch scaled_dot_product_attention on the prefill shapes of
attention_gpu_bench: causal, bf16, 32 query / 8 KV heads, head_dim 128,
T = 4k..16k, batch 1. TFLOP/s use the same count as the C++ benchmark,
4 * H * head_dim * T^2 / 2. PyTorch is not a dependency of the project:
without it (or without a GPU) the script reports "skipped" and exits 0.

usage: sdpa_bench.py [--json PATH] [--quick]
"""
import argparse
import json
import sys

HEADS, KV_HEADS, DIM = 32, 8, 128


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default="")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    result = {"framework": "torch", "prefill": []}
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        result["skipped"] = f"torch is not installed ({e})"
    else:
        result["torch_version"] = torch.__version__
        if not torch.cuda.is_available():
            result["skipped"] = "torch sees no CUDA device"
        else:
            result["device"] = torch.cuda.get_device_name(0)
            tokens_list = [4096] if args.quick else [4096, 8192, 16384]
            for tokens in tokens_list:
                result["prefill"].append(run(torch, F, tokens, args.quick))
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0


def run(torch, F, tokens, quick):
    torch.manual_seed(0)
    q = torch.randn(1, HEADS, tokens, DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, KV_HEADS, tokens, DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, KV_HEADS, tokens, DIM, device="cuda", dtype=torch.bfloat16)
    group = HEADS // KV_HEADS
    try:
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        def call():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                  enable_gqa=True)
        gqa = "enable_gqa"
    except (TypeError, RuntimeError):
        # Older PyTorch: expand K/V outside the timed region.
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)

        def call():
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        gqa = "repeat_interleave"
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    iterations = 3 if quick else 10
    start = torch.cuda.Event(enable_timing=True)
    stop = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iterations):
        start.record()
        call()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    times.sort()
    ms = times[len(times) // 2]
    flops = 4.0 * HEADS * DIM * tokens * tokens / 2.0
    return {"tokens": tokens, "heads": HEADS, "kv_heads": KV_HEADS,
            "head_dim": DIM, "gqa": gqa, "ms": round(ms, 4),
            "tflops": round(flops / (ms * 1e-3) / 1e12, 2)}


if __name__ == "__main__":
    sys.exit(main())
