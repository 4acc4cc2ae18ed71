#!/usr/bin/env python3
"""Writes the seed corpora of tests/fuzz (run from anywhere; needs protoc).

proto_convert_fuzzer inputs: [type byte][session byte][serialized request],
one valid request of each type (see proto_convert_fuzzer.cc), encoded with
`protoc --encode`. engine_ops_fuzzer inputs: fixed pseudo-random bytes
(FuzzedDataProvider turns any bytes into operations). The corpora also
hold inputs that this script does not write: regression_* (inputs that
once failed) and engine_ops_fuzzer/latent_topk_* (inputs libFuzzer found
that create MLA and top-k sessions and append to them with a history, so
that every replay checks those paths).
"""
import math
import pathlib
import random
import struct
import subprocess

HERE = pathlib.Path(__file__).resolve().parent
PROTO_DIR = HERE.parent.parent / "proto"
F32, F16 = "DTYPE_FLOAT32", "DTYPE_FLOAT16"


def tensor(field, dtype, shape, seed):
    rng = random.Random(seed)
    count = math.prod(shape)
    values = [rng.uniform(-1.0, 1.0) for _ in range(count)]
    fmt = "<%df" % count if dtype == F32 else "<%de" % count
    data = "".join("\\%03o" % b for b in struct.pack(fmt, *values))
    dims = " ".join("shape: %d" % d for d in shape)
    return '%s { dtype: %s %s data: "%s" }' % (field, dtype, dims, data)


def encode(message, text):
    return subprocess.run(
        ["protoc", "--proto_path=%s" % PROTO_DIR,
         "--encode=attention.v1.%s" % message, "attention/v1/attention.proto"],
        input=text.encode(), capture_output=True, check=True).stdout


def step(layer, h, hkv, d, dv, dtype, seed):
    return " ".join([
        "layer: %d" % layer,
        tensor("q", dtype, [1, h, d], seed),
        tensor("k", dtype, [1, hkv, d], seed + 1),
        tensor("v", dtype, [1, hkv, dv], seed + 2)])


# (file, type byte, session byte, message, text). Session specs (low 4 bits
# of byte 1, modulo 5): 0: H 2, H_kv 1, d 4, layers full + window 4/sink
# 1/learned sinks; 1: H 4, H_kv 2, d 8, value_dim 2, fp16 KV; 2: H 1,
# H_kv 1, d 2, 3 window layers, bf16 KV; 3: MLA, H 2, d 6, value_dim 4,
# layers top-3 (index 2 heads x 2) + window 5; 4: H 2, H_kv 2, d 4, bf16,
# layers top-2 ReLU window 4/sink 1/learned sinks (index 1 head x 3) +
# full. Bit 7 of the session byte prefills bits 4-6 + 1 tokens.
PROTO_SEEDS = [
    ("create_session", 0, 0, "CreateSessionRequest",
     "spec { num_layers: 2 num_q_heads: 4 num_kv_heads: 2 head_dim: 8 "
     "kv_dtype: DTYPE_BFLOAT16 layers { window: 16 num_sink_tokens: 2 } "
     "layers { sink_logits: [0.5, -1, 2, 0] } } idle_timeout_seconds: 30"),
    ("prefill", 1, 0x80, "PrefillRequest",
     "layer: 1 %s %s %s output_dtype: DTYPE_FLOAT16 return_lse: true" % (
         tensor("q", F32, [3, 2, 4], 1), tensor("k", F32, [3, 1, 4], 2),
         tensor("v", F32, [3, 1, 4], 3))),
    ("decode", 2, 1, "DecodeRequest",
     step(0, 4, 2, 8, 2, F16, 10) + " return_lse: true"),
    ("batch_decode", 3, 0x92, "BatchDecodeRequest",
     " ".join("steps { %s }" % step(l, 1, 1, 2, 2, F32, 20 + l)
              for l in range(3))),
    ("batch_decode_each", 4, 2, "BatchDecodeRequest",
     " ".join("steps { %s }" % step(l, 1, 1, 2, 2, F32, 30 + l)
              for l in (0, 1, 1))),
    ("attention", 5, 0, "AttentionRequest",
     "%s %s %s causal: true window: 2 num_sink_tokens: 1 query_start: 2 "
     "sink_logits: [0.25, -0.25] %s empty_row_policy: EMPTY_ROW_POLICY_ZERO "
     "return_weights: true return_lse: true output_dtype: DTYPE_BFLOAT16" % (
         tensor("q", F32, [3, 2, 4], 40), tensor("k", F32, [5, 1, 4], 41),
         tensor("v", F32, [5, 1, 4], 42), tensor("bias", F32, [3, 5], 43))),
    ("truncate", 6, 0xA0, "TruncateSessionRequest", "length: 2"),
    # Session 3 (MLA, top-k layer 0), one token prefilled: no v.
    ("decode_latent_topk", 2, 0x83, "DecodeRequest",
     "layer: 0 %s %s %s %s %s return_topk_indices: true" % (
         tensor("q", F32, [1, 2, 6], 50), tensor("k", F32, [1, 1, 6], 51),
         tensor("index_k", F32, [1, 2], 52),
         tensor("index_q", F32, [1, 2, 2], 53),
         tensor("index_weights", F32, [1, 2], 54))),
    # Session 4 (top-k ReLU window layer 0), two tokens prefilled.
    ("prefill_topk", 1, 0x94, "PrefillRequest",
     "layer: 0 %s %s %s %s %s %s return_topk_indices: true "
     "output_dtype: DTYPE_BFLOAT16" % (
         tensor("q", F32, [3, 2, 4], 60), tensor("k", F32, [3, 2, 4], 61),
         tensor("v", F32, [3, 2, 4], 62), tensor("index_k", F32, [3, 3], 63),
         tensor("index_q", F32, [3, 1, 3], 64),
         tensor("index_weights", F32, [3, 1], 65))),
    ("session_calls", 7, 0x81, "GetSessionRequest", ""),
]


def main():
    out = HERE / "corpus" / "proto_convert_fuzzer"
    out.mkdir(parents=True, exist_ok=True)
    for name, kind, session, message, text in PROTO_SEEDS:
        (out / name).write_bytes(bytes([kind, session]) +
                                 encode(message, text))
    out = HERE / "corpus" / "engine_ops_fuzzer"
    out.mkdir(parents=True, exist_ok=True)
    for seed, size in ((1, 300), (2, 1000), (3, 3000)):
        (out / ("random_%d" % seed)).write_bytes(
            random.Random(seed).randbytes(size))


if __name__ == "__main__":
    main()
