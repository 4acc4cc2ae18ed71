#include "core/cuda/cuda_backend.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/cuda/attend_plan.h"
#include "core/cuda/attention_kernels.h"
#include "core/cuda/cuda_status.h"
#include "core/cuda/device_probe.h"
#include "core/cuda/kv_write_kernels.h"
#include "core/cuda/session_support.h"
#include "core/cuda/stream_pool.h"
#include "core/dtype.h"
#include "core/status_macros.h"

namespace attention {
namespace {

using cuda::CudaStatus;

constexpr int64_t kAlign = 256;
int64_t AlignUp(int64_t x) { return (x + kAlign - 1) / kAlign * kAlign; }

absl::Status Unavailable(absl::string_view reason, cudaError_t error) {
  (void)cudaGetLastError();
  return absl::UnavailableError(absl::StrCat(
      reason, ": ", cudaGetErrorName(error), ": ", cudaGetErrorString(error)));
}

}  // namespace

class CudaBackend::Arena final : public DeviceArena {
 public:
  Arena(CudaBackend* owner, std::byte* data, int64_t size)
      : owner_(owner), data_(data), size_(size) {}
  ~Arena() override {
    owner_->ForgetArena(data_);
    (void)cudaSetDevice(owner_->device_ordinal_);
    (void)cudaFree(data_);
  }
  std::byte* data() override { return data_; }
  int64_t size_bytes() const override { return size_; }

 private:
  CudaBackend* const owner_;
  std::byte* const data_;
  const int64_t size_;
};

absl::StatusOr<std::unique_ptr<CudaBackend>> CudaBackend::Create(
    const CudaBackendOptions& options) {
  const cuda::DeviceProbe probe = cuda::ProbeDevices();
  ATTN_RETURN_IF_ERROR(probe.status);
  const int count = probe.device_count;
  if (options.device < 0 || options.device >= count) {
    return absl::UnavailableError(absl::StrCat(
        "CUDA device ", options.device, " does not exist (", count, " found)"));
  }
  if (const cudaError_t e = cudaSetDevice(options.device); e != cudaSuccess) {
    return Unavailable(
        absl::StrCat("cannot select CUDA device ", options.device), e);
  }
  cudaDeviceProp prop;
  if (const cudaError_t e = cudaGetDeviceProperties(&prop, options.device);
      e != cudaSuccess) {
    return Unavailable("cannot query the CUDA device", e);
  }
  if (prop.major < 8) {
    return absl::UnavailableError(
        absl::StrCat("CUDA device ", options.device, " (", prop.name,
                     ") has compute capability ", prop.major, ".", prop.minor,
                     "; the CUDA backend needs 8.0 (Ampere) or newer"));
  }
  if (const cudaError_t e = cudaFree(nullptr); e != cudaSuccess) {
    return Unavailable(absl::StrCat("cannot initialise CUDA on ", prop.name),
                       e);
  }
  if (const cudaError_t e = cuda::ConfigureAttentionKernels();
      e != cudaSuccess) {
    return Unavailable(absl::StrCat("this build has no usable kernels for ",
                                    prop.name, " (sm_", prop.major, prop.minor,
                                    "); rebuild with that architecture in "
                                    "CMAKE_CUDA_ARCHITECTURES"),
                       e);
  }
  std::string description = absl::StrFormat(
      "%s (sm_%d%d, %d SMs, %.1f GiB)", prop.name, prop.major, prop.minor,
      prop.multiProcessorCount,
      static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  if (options.scratch_bytes_per_stream < (int64_t{1} << 20) ||
      options.pinned_bytes_per_stream < (int64_t{1} << 20)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scratch_bytes_per_stream and pinned_bytes_per_stream must be at "
        "least 1 MiB, got ",
        options.scratch_bytes_per_stream, " and ",
        options.pinned_bytes_per_stream));
  }
  // The scratch budget, reserved before any KV arena.
  absl::StatusOr<std::unique_ptr<cuda::StreamPool>> streams =
      cuda::StreamPool::Create(options.device, options.max_streams,
                               options.scratch_bytes_per_stream,
                               options.pinned_bytes_per_stream);
  if (!streams.ok()) {
    return absl::Status(
        streams.status().code(),
        absl::StrCat("cannot reserve the CUDA backend's scratch memory (",
                     options.max_streams, " streams x ",
                     options.scratch_bytes_per_stream, " bytes, pinned ",
                     options.pinned_bytes_per_stream,
                     " bytes): ", streams.status().message()));
  }
  return std::unique_ptr<CudaBackend>(
      new CudaBackend(options.device, std::move(description),
                      prop.multiProcessorCount,
                      static_cast<int64_t>(prop.sharedMemPerBlockOptin),
                      options, *std::move(streams)));
}

CudaBackend::CudaBackend(int device, std::string description, int num_sms,
                         int64_t max_shared_bytes,
                         const CudaBackendOptions& options,
                         std::unique_ptr<cuda::StreamPool> streams)
    : device_ordinal_(device),
      device_(std::move(description)),
      num_sms_(num_sms),
      max_shared_bytes_(max_shared_bytes),
      options_(options),
      streams_(std::move(streams)),
      health_(device_) {}

CudaBackend::~CudaBackend() = default;

int64_t CudaBackend::scratch_bytes() const {
  return streams_->num_contexts() * streams_->scratch_bytes();
}

absl::StatusOr<std::unique_ptr<DeviceArena>> CudaBackend::AllocateArena(
    int64_t bytes) {
  if (bytes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV arena size must be positive, got ", bytes));
  }
  ATTN_RETURN_IF_ERROR(health_.failure());
  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_ordinal_),
                            "selecting the GPU");
  void* ptr = nullptr;
  if (const cudaError_t e = cudaMalloc(&ptr, static_cast<size_t>(bytes));
      e != cudaSuccess) {
    (void)cudaGetLastError();
    size_t free_bytes = 0;
    size_t total_bytes = 0;
    (void)cudaMemGetInfo(&free_bytes, &total_bytes);
    (void)cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a ", bytes, "-byte KV cache on ", device_,
                     ": ", cudaGetErrorString(e), " (", free_bytes, " of ",
                     total_bytes, " bytes free); lower --kv_cache_bytes"));
  }
  // Zeroed once, so never-written block rows hold finite values. The wait
  // orders the memset (legacy stream) before work on the non-blocking
  // streams of later calls.
  cudaError_t e = cudaMemset(ptr, 0, static_cast<size_t>(bytes));
  if (e == cudaSuccess) e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    (void)cudaFree(ptr);
    return health_.Record(CudaStatus(e, "zeroing the KV cache"));
  }
  auto* base = static_cast<std::byte*>(ptr);
  {
    absl::MutexLock lock(&arenas_mu_);
    arenas_.emplace_back(base, bytes);
  }
  return std::unique_ptr<DeviceArena>(new Arena(this, base, bytes));
}

absl::StatusOr<int64_t> CudaBackend::FreeMemoryBytes() const {
  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_ordinal_),
                            "selecting the GPU");
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  ATTN_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes),
                            "querying free GPU memory");
  return static_cast<int64_t>(free_bytes);
}

void CudaBackend::ForgetArena(const std::byte* base) {
  absl::MutexLock lock(&arenas_mu_);
  for (size_t i = 0; i < arenas_.size(); ++i) {
    if (arenas_[i].first == base) {
      arenas_.erase(arenas_.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
  }
}

bool CudaBackend::IsArenaMemory(const void* ptr, int64_t bytes) const {
  const auto* p = static_cast<const std::byte*>(ptr);
  absl::MutexLock lock(&arenas_mu_);
  for (const auto& [base, size] : arenas_) {
    if (p >= base && bytes >= 0 && bytes <= size && p - base <= size - bytes) {
      return true;
    }
  }
  return false;
}

absl::Status CudaBackend::CheckSessionSpec(const SessionSpec& spec) const {
  return CudaServesSessionSpec(spec);
}

absl::Status CudaBackend::WriteKv(const KvWrite& write) {
  if (write.layout.shared_values || write.layout.index_dim > 0) {
    return absl::FailedPreconditionError(
        "the CUDA backend does not serve MLA shared-latent KV layouts nor "
        "top-k index keys");
  }
  ATTN_RETURN_IF_ERROR(health_.failure());
  // Pieces of whole tokens that fit one context's scratch: a piece of t
  // tokens needs its keys and values, two alignments and at most t + 1
  // block pointers.
  const int64_t num_tokens = write.k.dim(0);
  if (num_tokens <= 0) return absl::OkStatus();
  const int64_t k_row =
      write.k.num_elements() / num_tokens * DTypeSize(write.k.dtype);
  const int64_t v_row =
      write.v.num_elements() / num_tokens * DTypeSize(write.v.dtype);
  const int64_t piece_tokens =
      (std::min(streams_->scratch_bytes(), streams_->pinned_bytes()) -
       3 * kAlign) /
      (k_row + v_row + 8);
  if (piece_tokens < 1) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "one token of keys and values (", k_row + v_row,
        " bytes) does not fit the CUDA backend's scratch buffer of ",
        std::min(streams_->scratch_bytes(), streams_->pinned_bytes()),
        " bytes"));
  }
  for (int64_t t = 0; t < num_tokens; t += piece_tokens) {
    const int64_t count = std::min(piece_tokens, num_tokens - t);
    KvWrite piece = write;
    piece.start = write.start + t;
    piece.k.shape[0] = count;
    piece.k.data = write.k.data + t * k_row;
    piece.k.size_bytes = count * k_row;
    piece.v.shape[0] = count;
    piece.v.data = write.v.data + t * v_row;
    piece.v.size_bytes = count * v_row;
    ATTN_RETURN_IF_ERROR(health_.Record(WriteKvImpl(piece)));
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::WriteKvImpl(const KvWrite& write) {
  const KvBlockLayout& layout = write.layout;
  const int64_t num_tokens = write.k.dim(0);
  const int64_t tokens_per_block = layout.tokens_per_block;
  const int64_t first_block = write.start / tokens_per_block;
  const int64_t last_block = (write.start + num_tokens - 1) / tokens_per_block;
  if (last_block >= write.num_blocks()) {
    return absl::InternalError(
        absl::StrCat("WriteKv: positions up to ", write.start + num_tokens - 1,
                     " need block ", last_block, " but the layer has ",
                     write.num_blocks(), " blocks"));
  }
  for (int64_t b = first_block; b <= last_block; ++b) {
    if (write.block(b) == nullptr ||
        !IsArenaMemory(write.block(b), layout.used_bytes())) {
      return absl::InternalError(
          absl::StrCat("WriteKv: block ", b,
                       " is missing or not in this backend's GPU KV pool"));
    }
  }
  const int64_t num_blocks = last_block - first_block + 1;
  const int64_t k_bytes = write.k.num_elements() * DTypeSize(write.k.dtype);
  const int64_t v_bytes = write.v.num_elements() * DTypeSize(write.v.dtype);
  const int64_t v_offset = AlignUp(k_bytes);
  const int64_t table_offset = AlignUp(v_offset + v_bytes);
  const int64_t total = table_offset + num_blocks * 8;

  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_ordinal_),
                            "selecting the GPU");
  cuda::StreamPool::Lease ctx = streams_->Acquire();
  if (total > ctx->scratch.capacity() || total > ctx->pinned.capacity()) {
    return absl::InternalError(absl::StrCat(
        "WriteKv: a piece of ", total, " bytes exceeds the scratch buffer"));
  }
  std::byte* pinned = ctx->pinned.data();
  std::byte* device = ctx->scratch.data();
  std::memcpy(pinned, write.k.data, static_cast<size_t>(k_bytes));
  std::memcpy(pinned + v_offset, write.v.data, static_cast<size_t>(v_bytes));
  std::byte** table = reinterpret_cast<std::byte**>(pinned + table_offset);
  for (int64_t b = 0; b < num_blocks; ++b) {
    table[b] = write.block(first_block + b);
  }

  cuda::KvWriteParams params;
  params.k = device;
  params.v = device + v_offset;
  params.k_dtype = static_cast<int32_t>(write.k.dtype);
  params.v_dtype = static_cast<int32_t>(write.v.dtype);
  params.kv_dtype = static_cast<int32_t>(layout.dtype);
  params.num_kv_heads = layout.num_kv_heads;
  params.head_dim = layout.head_dim;
  params.value_dim = layout.value_dim;
  params.start = write.start;
  params.num_tokens = num_tokens;
  params.tokens_per_block = tokens_per_block;
  params.value_offset_bytes = layout.value_offset_bytes();
  params.blocks = reinterpret_cast<char* const*>(device + table_offset);
  params.first_block = first_block;

  absl::Status status =
      CudaStatus(cudaMemcpyAsync(device, pinned, static_cast<size_t>(total),
                                 cudaMemcpyHostToDevice, ctx->stream),
                 "copying new keys and values to the GPU");
  if (status.ok()) {
    status = CudaStatus(cuda::LaunchWriteKv(params, ctx->stream),
                        "launching the KV write kernel");
  }
  // Always drain the stream before the buffers go back to the pool.
  const absl::Status sync =
      CudaStatus(cudaStreamSynchronize(ctx->stream), "writing the KV cache");
  return status.ok() ? sync : status;
}

absl::Status CudaBackend::CopyFromArena(const std::byte* src, std::byte* dst,
                                        int64_t bytes, bool to_host,
                                        absl::string_view what) {
  if (bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": byte count must be >= 0, got ", bytes));
  }
  if (bytes == 0) return absl::OkStatus();
  if (!IsArenaMemory(src, bytes) || (!to_host && !IsArenaMemory(dst, bytes))) {
    return absl::InvalidArgumentError(absl::StrCat(
        what, ": ", to_host ? "the source" : "source and destination",
        " must be KV blocks in this backend's GPU memory"));
  }
  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_ordinal_),
                            "selecting the GPU");
  cuda::StreamPool::Lease ctx = streams_->Acquire();
  const std::string doing =
      to_host ? "reading a KV block" : "copying a KV block";
  const absl::Status status =
      CudaStatus(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                                 to_host ? cudaMemcpyDeviceToHost
                                         : cudaMemcpyDeviceToDevice,
                                 ctx->stream),
                 doing);
  const absl::Status sync =
      CudaStatus(cudaStreamSynchronize(ctx->stream), doing);
  return status.ok() ? sync : status;
}

absl::Status CudaBackend::CopyBlock(const std::byte* src, std::byte* dst,
                                    int64_t bytes) {
  ATTN_RETURN_IF_ERROR(health_.failure());
  return health_.Record(
      CopyFromArena(src, dst, bytes, /*to_host=*/false, "CopyBlock"));
}

absl::Status CudaBackend::ReadBlock(const std::byte* src, std::byte* dst,
                                    int64_t bytes) {
  ATTN_RETURN_IF_ERROR(health_.failure());
  return health_.Record(
      CopyFromArena(src, dst, bytes, /*to_host=*/true, "ReadBlock"));
}

absl::Status CudaBackend::Attend(absl::Span<const AttentionProblem> problems) {
  for (const AttentionProblem& problem : problems) {
    if (problem.topk != nullptr) {
      return absl::FailedPreconditionError(
          "the CUDA backend does not serve top-k sparse attention");
    }
  }
  ATTN_RETURN_IF_ERROR(health_.failure());
  return health_.Record(AttendImpl(problems, nullptr));
}

absl::StatusOr<float> CudaBackend::AttendTimed(
    absl::Span<const AttentionProblem> problems) {
  ATTN_RETURN_IF_ERROR(health_.failure());
  float ms = 0.0f;
  ATTN_RETURN_IF_ERROR(health_.Record(AttendImpl(problems, &ms)));
  return ms;
}

absl::Status CudaBackend::AttendImpl(
    absl::Span<const AttentionProblem> problems, float* kernel_ms) {
  if (kernel_ms != nullptr) *kernel_ms = 0.0f;
  if (problems.empty()) return absl::OkStatus();
  // One launch runs the whole batch in microseconds to milliseconds: a
  // withdrawn call is dropped before it, not inside it.
  for (const AttentionProblem& problem : problems) {
    ATTN_RETURN_IF_ERROR(CheckCall(problem.control));
  }
  // A snapshot of the arenas: a long batch checks every block pointer, so
  // the check must not take a lock each time.
  std::vector<std::pair<const std::byte*, int64_t>> arenas;
  {
    absl::MutexLock lock(&arenas_mu_);
    arenas = arenas_;
  }
  const auto in_arena = [&arenas](const void* ptr, int64_t bytes) {
    const auto* p = static_cast<const std::byte*>(ptr);
    for (const auto& [base, size] : arenas) {
      if (p >= base && bytes >= 0 && bytes <= size &&
          p - base <= size - bytes) {
        return true;
      }
    }
    return false;
  };
  cuda::AttendPlan::Limits limits;
  limits.device_bytes = streams_->scratch_bytes();
  limits.pinned_bytes = streams_->pinned_bytes();
  // States share the call's scratch with its inputs and outputs.
  limits.max_state_bytes =
      std::min(options_.max_state_bytes, streams_->scratch_bytes() / 4);
  limits.max_shared_bytes = max_shared_bytes_;
  ATTN_ASSIGN_OR_RETURN(
      cuda::AttendPlan plan,
      cuda::AttendPlan::Create(problems, in_arena, num_sms_, limits));
  ATTN_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_ordinal_),
                            "selecting the GPU");
  cuda::StreamPool::Lease ctx = streams_->Acquire();
  // The wait for a stream may have outlasted the call.
  for (const AttentionProblem& problem : problems) {
    ATTN_RETURN_IF_ERROR(CheckCall(problem.control));
  }
  plan.FillUpload(ctx->pinned.data(), ctx->scratch.data());
  const absl::Status enqueued =
      plan.Enqueue(ctx->pinned.data(), ctx->scratch.data(), ctx->stream,
                   kernel_ms != nullptr ? ctx->kernels_start : nullptr,
                   kernel_ms != nullptr ? ctx->kernels_stop : nullptr);
  // Always drain the stream before the buffers go back to the pool.
  const absl::Status finished = CudaStatus(cudaStreamSynchronize(ctx->stream),
                                           "running attention on the GPU");
  ATTN_RETURN_IF_ERROR(enqueued);
  ATTN_RETURN_IF_ERROR(finished);
  if (kernel_ms != nullptr) {
    ATTN_CUDA_RETURN_IF_ERROR(
        cudaEventElapsedTime(kernel_ms, ctx->kernels_start, ctx->kernels_stop),
        "reading the kernel timer");
  }
  return plan.Collect(ctx->pinned.data());
}

}  // namespace attention
