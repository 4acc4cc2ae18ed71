// The multiply-add probe: the peak fp32 multiply-add rate of the CPU
// backend's kernel ISA (KernelTable::fma_probe: independent multiply-add
// chains in registers, nothing read from memory), on one thread or on a
// pool's threads. attn-bench's roofline and its small-step bounds divide by
// it.
#ifndef ATTENTION_BENCH_FMA_PROBE_H_
#define ATTENTION_BENCH_FMA_PROBE_H_

#include <cstdint>

#include "core/cpu/cpu_backend.h"
#include "core/cpu/kernels.h"
#include "core/thread_pool.h"

namespace attention::bench {

// The kernel table of `backend`'s ISA.
const cpu::KernelTable& KernelsOf(const CpuBackend& backend);

// Rounds of the probe that take about 250 us on one thread (the scalar
// table is far slower than the SIMD ones). Adds the probe's result to
// `*sink` (as every function here does) so that the work is kept.
int64_t FmaProbeRounds(const cpu::KernelTable& kernels, float* sink);

// Runs the probe on the pool's threads, 16 pieces of `rounds` per thread;
// returns the floating-point operations per second of all of them.
double FmaPeak(ThreadPool& pool, const cpu::KernelTable& kernels,
               int64_t rounds, float* sink);

// The probe on the calling thread alone: floating-point operations per
// second.
double OneThreadFmaPeak(const cpu::KernelTable& kernels, int64_t rounds,
                        float* sink);

// The same for the probe whose multiply-adds also widen float16 values
// (KernelTable::fma_widen_probe): the fastest a float16 GQA 32/8 decode's
// multiply-adds can run on this thread with their widenings.
double OneThreadFmaWidenPeak(const cpu::KernelTable& kernels, int64_t rounds,
                             float* sink);

}  // namespace attention::bench

#endif  // ATTENTION_BENCH_FMA_PROBE_H_
