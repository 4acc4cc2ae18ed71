#include "core/engine.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/call_cost.h"
#include "core/client_string.h"
#include "core/moved_sessions.h"
#include "core/request_validation.h"
#include "core/status_macros.h"

namespace attention {
namespace {

// Prefixes a batch step's errors with its index so a caller can find it.
absl::Status AtStep(const absl::Status& status, size_t step, size_t steps) {
  if (status.ok() || steps == 1) return status;
  // Keeps the payloads: a moved session's redirect stays one.
  return PrefixStatus(absl::StrCat("step ", step, ": "), status);
}

// Converts the float32 values `result` of `shape` to a new tensor of
// `dtype`. INVALID_ARGUMENT when a value does not fit (e.g. float16
// overflow).
absl::StatusOr<Tensor> ConvertOutput(const float* result, Shape shape,
                                     DType dtype) {
  Tensor converted(dtype, std::move(shape));
  ATTN_RETURN_IF_ERROR(ConvertFromFloatChecked(result, converted.num_elements(),
                                               dtype, converted.data(),
                                               "attention output"));
  return converted;
}

// `view` as float32: itself, or widened into `storage` (exact).
TensorView AsFloat32(const TensorView& view, Tensor* storage) {
  if (view.dtype == DType::kFloat32) return view;
  *storage = Tensor(DType::kFloat32, view.shape);
  ConvertToFloat(view.dtype, view.data, view.num_elements(),
                 storage->float_data());
  return storage->view();
}

// Converts the float32 result to the requested dtype (no copy for float32).
absl::StatusOr<Tensor> ToOutputDType(Tensor result, DType dtype) {
  if (dtype == DType::kFloat32) return result;
  return ConvertOutput(result.float_data(), result.shape(), dtype);
}

// True when the request's float32 output can be computed directly in its
// output destination.
bool WritesOutputInPlace(const AppendRequest& request) {
  return !request.output_destination.empty() &&
         request.output_dtype == DType::kFloat32 &&
         reinterpret_cast<uintptr_t>(request.output_destination.data()) %
                 alignof(float) ==
             0;
}

// True when the request's float32 result is the step's output tensor
// itself; otherwise it is computed in place or converted from a scratch.
bool ReturnsFloatTensor(const AppendRequest& request) {
  return request.output_destination.empty() &&
         request.output_dtype == DType::kFloat32;
}

// Moves a step's `count` float32 `scratch` results into the request's output
// destination (nothing to do when they were computed there in place).
// INVALID_ARGUMENT when a value does not fit the output dtype.
absl::Status ToOutputDestination(const float* scratch, int64_t count,
                                 const AppendRequest& request) {
  if (WritesOutputInPlace(request)) return absl::OkStatus();
  std::byte* destination = request.output_destination.data();
  if (request.output_dtype == DType::kFloat32) {
    std::memcpy(destination, scratch, static_cast<size_t>(count) * 4);
    return absl::OkStatus();
  }
  return ConvertFromFloatChecked(scratch, count, request.output_dtype,
                                 destination, "attention output");
}

// Up to this many floats of a batch's scratch results stay allocated for
// the thread's next batch (4 MiB: a decode batch of 64 steps of 32 heads x
// 128 takes 1 MiB), so that steady decoding allocates none; a larger
// scratch (a long prefill converted to float16) is freed after its call.
constexpr int64_t kKeptScratchFloats = int64_t{1} << 20;

// Uninitialized room for `floats` floats: the calling thread's kept buffer,
// or `large` when it would pass kKeptScratchFloats. Valid until the
// thread's next call (batches on one thread never nest).
float* BatchScratch(int64_t floats, std::unique_ptr<float[]>* large) {
  if (floats > kKeptScratchFloats) {
    large->reset(new float[static_cast<size_t>(floats)]);
    return large->get();
  }
  thread_local std::unique_ptr<float[]> kept;
  thread_local int64_t kept_floats = 0;
  if (kept_floats < floats) {
    kept.reset(new float[static_cast<size_t>(floats)]);
    kept_floats = floats;
  }
  return kept.get();
}

// Holds the mutexes of a batch's sessions, taken in id order (so that
// concurrent batches never deadlock) and released in reverse. With
// BusySessions::kSkip a session another call holds is left alone (busy())
// instead of waited for; trying never blocks, so that cannot deadlock either.
class SessionLocks {
 public:
  // `sessions` must be sorted by id, without duplicates.
  SessionLocks(std::vector<Session*> sessions, BusySessions busy)
      : locked_(std::move(sessions)) {
    // Keeps the locked ones in place (no allocation per batch).
    auto keep = locked_.begin();
    for (Session* session : locked_) {
      // As TryFirstMutexLock: taking the n-th by Lock would check it
      // against the n - 1 held before it (quadratic in the batch).
      if (!session->mu().TryLock()) {
        if (busy == BusySessions::kSkip) {
          busy_.insert(session);
          continue;
        }
        session->mu().Lock();
      }
      *keep++ = session;
    }
    locked_.erase(keep, locked_.end());
  }
  ~SessionLocks() {
    for (auto it = locked_.rbegin(); it != locked_.rend(); ++it) {
      (*it)->mu().Unlock();
    }
  }
  SessionLocks(const SessionLocks&) = delete;
  SessionLocks& operator=(const SessionLocks&) = delete;

  bool busy(const Session* session) const { return busy_.contains(session); }

 private:
  std::vector<Session*> locked_;
  absl::flat_hash_set<const Session*> busy_;
};

const Tenant& TenantOf(const AppendRequest& request) {
  return request.tenant != nullptr ? *request.tenant : DefaultTenant();
}

// The shortest length from which on every layer of `session` can be cut.
int64_t ShortestTruncation(const Session& session)
    ABSL_EXCLUSIVE_LOCKS_REQUIRED(session.mu()) {
  int64_t shortest = 0;
  for (int i = 0; i < session.spec().num_layers; ++i) {
    shortest = std::max(shortest, session.layer(i).ShortestTruncation());
  }
  return shortest;
}

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionEngine>> AttentionEngine::Create(
    std::unique_ptr<AttentionBackend> backend, EngineOptions options) {
  if (backend == nullptr) {
    return absl::InvalidArgumentError("no attention backend");
  }
  if (options.max_weights_bytes < 0) {
    return absl::InvalidArgumentError("max_weights_bytes must be >= 0");
  }
  if (options.max_call_flops <= 0) {
    return absl::InvalidArgumentError("max_call_flops must be > 0");
  }
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<BlockPool> pool,
                        BlockPool::Create(backend.get(), options.kv_cache_bytes,
                                          options.kv_block_bytes));
  return std::unique_ptr<AttentionEngine>(new AttentionEngine(
      std::move(backend), std::move(pool), std::move(options)));
}

AttentionEngine::AttentionEngine(std::unique_ptr<AttentionBackend> backend,
                                 std::unique_ptr<BlockPool> pool,
                                 EngineOptions options)
    : backend_(std::move(backend)),
      pool_(std::move(pool)),
      options_(std::move(options)),
      sessions_(pool_.get(), options_.sessions) {}

AttentionEngine::~AttentionEngine() = default;

absl::StatusOr<SessionInfo> AttentionEngine::CreateSession(
    const SessionSpec& spec, absl::Duration idle_timeout, const Tenant& tenant,
    const CallControl* control) {
  ATTN_RETURN_IF_ERROR(backend_->CheckSessionSpec(spec));
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                        sessions_.Create(spec, idle_timeout, tenant, control));
  return session->Info();
}

absl::StatusOr<SessionInfo> AttentionEngine::GetSession(
    const std::string& id, const Tenant& tenant, const CallControl* control) {
  ATTN_ASSIGN_OR_RETURN(
      SessionRef session,
      sessions_.Get(id, tenant, SessionManager::SealWait::kWait, control));
  session.MarkUsed();
  return session->Info();
}

absl::StatusOr<SessionInfo> AttentionEngine::PeekSession(
    const std::string& id, const Tenant& tenant, const CallControl* control) {
  // A ref that is not marked used leaves the idle clock as it was.
  ATTN_ASSIGN_OR_RETURN(
      SessionRef session,
      sessions_.Get(id, tenant, SessionManager::SealWait::kWait, control));
  return session->Info();
}

std::vector<SessionInfo> AttentionEngine::ListSessions(
    const std::string& after, int64_t page_size, const Tenant& tenant,
    int64_t max_metadata_bytes, bool* cut) const {
  std::vector<SessionInfo> infos;
  int64_t metadata_bytes = 0;
  if (cut != nullptr) *cut = false;
  for (const std::shared_ptr<Session>& session :
       sessions_.List(after, page_size, tenant)) {
    if (metadata_bytes > max_metadata_bytes) {
      if (cut != nullptr) *cut = true;
      break;
    }
    metadata_bytes += session->metadata_bytes();
    infos.push_back(session->Info());
  }
  return infos;
}

absl::StatusOr<SessionHold> AttentionEngine::HoldSession(
    const std::string& id, const Tenant& tenant) {
  ATTN_ASSIGN_OR_RETURN(
      SessionRef ref,
      sessions_.Get(id, tenant, SessionManager::SealWait::kFail));
  return SessionHold(ref.shared(), sessions_.clock());
}

absl::Status AttentionEngine::DeleteSession(const std::string& id,
                                            const Tenant& tenant,
                                            const CallControl* control) {
  return sessions_.Delete(id, tenant, control);
}

absl::StatusOr<SessionInfo> AttentionEngine::ForkSession(
    const std::string& id, const Tenant& tenant, const CallControl* control) {
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Session> fork,
                        sessions_.Fork(id, tenant, control));
  return fork->Info();
}

std::vector<AttentionEngine::SessionOwner>
AttentionEngine::ListAllSessionOwners(const std::string& after,
                                      int64_t page_size) const {
  std::vector<SessionOwner> owners;
  for (const std::shared_ptr<Session>& session :
       sessions_.ListAllTenants(after, page_size)) {
    owners.push_back(
        SessionOwner{.session_id = session->id(), .owner = session->owner()});
  }
  return owners;
}

absl::StatusOr<std::unique_ptr<SessionExport>> AttentionEngine::ExportSession(
    const std::string& id, const Tenant& tenant, absl::Time wait_until) {
  // Not a use of the session: the snapshot keeps its idle deadline.
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                        sessions_.Find(id, tenant));
  return SessionExport::Start(backend_.get(), *session, options_.version,
                              (*sessions_.clock())(), /*sealed=*/false,
                              wait_until);
}

absl::Status AttentionEngine::StopChanges(absl::Time deadline) {
  return sessions_.changes().Close(deadline);
}

absl::StatusOr<SessionSeal> AttentionEngine::SealSession(const std::string& id,
                                                         absl::Time deadline) {
  return sessions_.Seal(id, deadline);
}

absl::StatusOr<std::unique_ptr<SessionExport>> AttentionEngine::ExportSealed(
    const SessionSeal& seal) {
  return SessionExport::Start(backend_.get(), seal.session(), options_.version,
                              (*sessions_.clock())(), /*sealed=*/true);
}

absl::StatusOr<std::unique_ptr<SessionImport>> AttentionEngine::BeginImport(
    const SnapshotHeader& header, const ImportOptions& options) {
  return SessionImport::Begin(&sessions_, pool_.get(), backend_.get(), header,
                              options);
}

absl::StatusOr<SessionInfo> AttentionEngine::TruncateSession(
    const std::string& id, int64_t length, const Tenant& tenant,
    const CallControl* control) {
  if (length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("truncate length must be >= 0, got ", length));
  }
  ATTN_ASSIGN_OR_RETURN(const ChangeGate::Pass pass,
                        sessions_.changes().Enter());
  ATTN_ASSIGN_OR_RETURN(
      SessionRef session,
      sessions_.Get(id, tenant, SessionManager::SealWait::kWait, control));
  {
    absl::MutexLock lock(&session->mu());
    ATTN_RETURN_IF_ERROR(CheckCall(control));
    // Check every layer before touching any: all layers or none.
    for (int i = 0; i < session->spec().num_layers; ++i) {
      if (absl::Status status = session->layer(i).CheckTruncate(length);
          !status.ok()) {
        return absl::Status(
            status.code(),
            absl::StrCat("layer ", i, ": ", status.message(),
                         "; any length of ", ShortestTruncation(*session),
                         " tokens or more works, as does 0"));
      }
    }
    for (int i = 0; i < session->spec().num_layers; ++i) {
      session->layer(i).Truncate(length);
    }
  }
  session.MarkUsed();
  return session->Info();
}

// Per-step state of a batch of appends.
struct AttentionEngine::BatchStep {
  SessionRef session;
  const AppendRequest* request = nullptr;
  QkvShape shape;
  std::optional<LayerKvCache::PendingAppend> pending;
  // The tenant's quota reservation for the blocks `pending` takes, held
  // until they are committed (or released).
  BlockReservation reservation;
  double flops = 0;  // AttentionFlops of the step
  double reply_bytes = 0;  // ResultBytes of the step
  Tensor output;  // the float32 result, when returned as it is
  // The float32 result in the batch's scratch, when it is converted (or
  // copied) into the reply afterwards.
  float* scratch = nullptr;
  std::optional<Tensor> lse;
  TopKSpec topk;  // the selection of a top-k layer's step
  std::vector<int64_t> topk_indices;
  absl::Status status;  // the step's own outcome (independent batches)
};

int64_t HeldBytes(const AppendRequest& request) {
  const int64_t tensors = request.q.size_bytes + request.k.size_bytes +
                          request.v.size_bytes + request.index_k.size_bytes +
                          request.index_q.size_bytes +
                          request.index_weights.size_bytes;
  return std::max(tensors, request.message_bytes) +
         static_cast<int64_t>(request.output_destination.size());
}

double ResultBytes(const SessionSpec& spec, int32_t layer, int64_t tokens,
                   DType output_dtype, bool return_lse,
                   bool return_topk_indices) {
  const double rows = static_cast<double>(tokens) * spec.num_q_heads;
  double bytes = rows * spec.value_dim * DTypeSize(output_dtype);
  if (return_lse) bytes += rows * sizeof(float);
  if (return_topk_indices) {
    bytes +=
        static_cast<double>(tokens) * spec.layers[layer].topk * kTopKIndexBytes;
  }
  return bytes;
}

namespace {

// RESOURCE_EXHAUSTED for `what` (a step, or a batch's steps) whose results
// take `bytes`, over the `limit` their reply may take.
absl::Status ReplyTooLarge(absl::string_view what, double bytes,
                           int64_t limit) {
  return absl::ResourceExhaustedError(absl::StrCat(
      "the results of ", what, " would take ", absl::StrFormat("%.0f", bytes),
      " bytes, over the ", limit,
      " bytes their reply may take (the server's --max_message_bytes, less "
      "framing); nothing was computed or applied. Send fewer tokens per call "
      "(chunks give bitwise the same outputs) or fewer steps per batch, ask "
      "for a narrower output_dtype, or drop return_lse or "
      "return_topk_indices"));
}

}  // namespace

// Floats of a validated step's output: [tokens, num_q_heads, value_dim].
int64_t AttentionEngine::OutputFloats(const BatchStep& step) {
  const SessionSpec& spec = step.session->spec();
  return step.shape.num_queries * spec.num_q_heads * spec.value_dim;
}

absl::StatusOr<AttentionOutput> AttentionEngine::Append(
    const AppendRequest& request) {
  std::vector<absl::Status> statuses;
  std::vector<AttentionOutput> outputs;
  ATTN_RETURN_IF_ERROR(RunBatch(absl::MakeConstSpan(&request, 1),
                                /*atomic=*/true, /*max_batch_reply_bytes=*/-1,
                                SessionManager::SealWait::kWait,
                                BusySessions::kWait, &statuses, &outputs));
  return std::move(outputs[0]);
}

absl::StatusOr<std::vector<AttentionOutput>> AttentionEngine::AppendBatch(
    absl::Span<const AppendRequest> requests, int64_t max_reply_bytes,
    BusySessions busy) {
  std::vector<absl::Status> statuses;
  std::vector<AttentionOutput> outputs;
  ATTN_RETURN_IF_ERROR(RunBatch(requests, /*atomic=*/true, max_reply_bytes,
                                SessionManager::SealWait::kFail, busy,
                                &statuses, &outputs));
  return outputs;
}

std::vector<absl::StatusOr<AttentionOutput>> AttentionEngine::AppendEach(
    absl::Span<const AppendRequest> requests, BusySessions busy) {
  std::vector<absl::Status> statuses;
  std::vector<AttentionOutput> outputs;
  RunBatch(requests, /*atomic=*/false, /*max_batch_reply_bytes=*/-1,
           SessionManager::SealWait::kFail, busy, &statuses, &outputs)
      .IgnoreError();
  std::vector<absl::StatusOr<AttentionOutput>> results;
  results.reserve(requests.size());
  for (size_t i = 0; i < requests.size(); ++i) {
    if (statuses[i].ok()) {
      results.emplace_back(std::move(outputs[i]));
    } else {
      results.emplace_back(statuses[i]);
    }
  }
  return results;
}

absl::Status AttentionEngine::CheckCallCost(double flops) const {
  if (flops <= static_cast<double>(options_.max_call_flops)) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "this call asks for ", absl::StrFormat("%.0f", flops),
      " floating-point operations, over this server's per-call limit of ",
      options_.max_call_flops,
      " (--max_call_flops); send fewer tokens per call (a prefill split into "
      "chunks gives bitwise the same outputs) or fewer keys"));
}

absl::Status AttentionEngine::ValidateStep(BatchStep& step) {
  const AppendRequest& request = *step.request;
  Session& session = *step.session;
  const SessionSpec& spec = session.spec();
  ATTN_RETURN_IF_ERROR(CheckCall(request.control));
  if (request.layer < 0 || request.layer >= spec.num_layers) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer ", request.layer, " is out of range: session ",
                     QuoteClientString(session.id()), " has ",
                     spec.num_layers, " layers"));
  }
  QkvShape expected;
  expected.num_q_heads = spec.num_q_heads;
  expected.num_kv_heads = spec.num_kv_heads;
  expected.head_dim = spec.head_dim;
  expected.value_dim = spec.value_dim;
  const bool latent = spec.kv_layout == KvLayout::kSharedLatent;
  if (latent) {
    // The values are the keys' leading entries: no v, and k checked in its
    // place (an empty view stands for an absent tensor).
    if (!request.v.shape.empty() || request.v.size_bytes != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "session ", QuoteClientString(session.id()),
          " stores a shared latent (MLA): send no v, the values are the "
          "first value_dim = ",
          spec.value_dim, " entries of each k"));
    }
    expected.value_dim = spec.head_dim;
  }
  ATTN_ASSIGN_OR_RETURN(
      step.shape, ValidateQkv(request.q, request.k,
                              latent ? request.k : request.v, expected));
  step.shape.value_dim = spec.value_dim;
  const int64_t tokens = step.shape.num_queries;
  if (tokens != step.shape.num_keys) {
    return absl::InvalidArgumentError(absl::StrCat(
        "q has ", tokens, " tokens but k and v have ", step.shape.num_keys,
        "; every appended token needs a query, a key and a value"));
  }
  if (request.required_tokens.has_value() &&
      tokens != *request.required_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a decode step takes exactly ", *request.required_tokens,
        " token, got ", tokens, "; use Prefill for several tokens"));
  }
  if (!request.output_destination.empty()) {
    const int64_t expected_bytes = tokens * spec.num_q_heads * spec.value_dim *
                                   DTypeSize(request.output_dtype);
    if (static_cast<int64_t>(request.output_destination.size()) !=
        expected_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the output destination holds ", request.output_destination.size(),
          " bytes but the output [", tokens, ", ", spec.num_q_heads, ", ",
          spec.value_dim, "] of ", DTypeName(request.output_dtype), " takes ",
          expected_bytes, "; size it from the session spec"));
    }
  }
  ATTN_RETURN_IF_ERROR(CheckRepresentable(request.k.dtype, request.k.data,
                                          request.k.num_elements(),
                                          spec.kv_dtype, "k"));
  if (!latent) {
    ATTN_RETURN_IF_ERROR(CheckRepresentable(request.v.dtype, request.v.data,
                                            request.v.num_elements(),
                                            spec.kv_dtype, "v"));
  }
  const int64_t length = session.layer(request.layer).length();
  if (length + tokens > spec.max_tokens) {
    return absl::OutOfRangeError(absl::StrCat(
        "layer ", request.layer, " of session ",
        QuoteClientString(session.id()), " holds ",
        length, " tokens; appending ", tokens, " would pass its max_tokens of ",
        spec.max_tokens,
        "; truncate the session or create one with a larger max_tokens"));
  }
  const LayerSpec& layer = spec.layers[request.layer];
  const MaskSpec mask{.causal = true,
                      .window = layer.window,
                      .num_sink_tokens = layer.num_sink_tokens,
                      .query_start = length};
  if (layer.topk > 0) {
    ATTN_RETURN_IF_ERROR(ValidateIndexInputs(
        request.index_k, request.index_q, request.index_weights, tokens,
        spec.index_heads, spec.index_dim));
    ATTN_RETURN_IF_ERROR(CheckRepresentable(
        request.index_k.dtype, request.index_k.data,
        request.index_k.num_elements(), spec.kv_dtype, "index_k"));
    step.flops = TopKAttentionFlops(
        tokens, spec.num_q_heads, spec.head_dim, spec.value_dim,
        spec.index_heads, spec.index_dim, layer.topk, mask, length + tokens);
  } else {
    if (!request.index_k.shape.empty() || !request.index_q.shape.empty() ||
        !request.index_weights.shape.empty() || request.return_topk_indices) {
      return absl::InvalidArgumentError(absl::StrCat(
          "layer ", request.layer,
          " is dense (topk = 0): send no index_k, index_q, index_weights "
          "nor return_topk_indices"));
    }
    step.flops = AttentionFlops(tokens, spec.num_q_heads, spec.head_dim,
                                spec.value_dim, mask, length + tokens);
  }
  step.reply_bytes =
      ResultBytes(spec, request.layer, tokens, request.output_dtype,
                  request.return_lse, request.return_topk_indices);
  if (request.max_reply_bytes >= 0 &&
      step.reply_bytes > static_cast<double>(request.max_reply_bytes)) {
    return ReplyTooLarge("this step", step.reply_bytes,
                         request.max_reply_bytes);
  }
  return CheckCallCost(step.flops);
}

absl::Status AttentionEngine::RunBatch(absl::Span<const AppendRequest> requests,
                                       bool atomic,
                                       int64_t max_batch_reply_bytes,
                                       SessionManager::SealWait seal_wait,
                                       BusySessions busy,
                                       std::vector<absl::Status>* statuses,
                                       std::vector<AttentionOutput>* outputs) {
  const size_t n = requests.size();
  absl::StatusOr<ChangeGate::Pass> pass = sessions_.changes().Enter();
  if (!pass.ok()) {
    statuses->assign(n, pass.status());
    return pass.status();
  }
  std::vector<BatchStep> steps(n);
  // Records a step's failure. An atomic batch fails as a whole (dropping
  // `steps` releases every staged block); an independent one carries on.
  auto fail = [&](size_t i, const absl::Status& status) -> absl::Status {
    if (atomic) return AtStep(status, i, n);
    steps[i].status = status;
    steps[i].pending.reset();
    // Its quota reservation too: the batch's other steps of the tenant
    // must see what they would alone.
    steps[i].reservation = BlockReservation();
    return absl::OkStatus();
  };
  auto live = [&](size_t i) { return steps[i].status.ok(); };

  // 1. Resolve sessions; a (session, layer) may be appended once per batch.
  // A session is looked up once per tenant: a second lookup could wait for
  // (or fail on) a seal (SessionManager::Seal) that waits for this batch's
  // first one.
  absl::flat_hash_map<std::pair<absl::string_view, absl::string_view>, size_t>
      first_lookup;
  first_lookup.reserve(n);
  absl::flat_hash_set<std::pair<const Session*, int32_t>> seen;
  seen.reserve(n);
  std::vector<Session*> to_lock;
  to_lock.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const AppendRequest& request = requests[i];
    steps[i].request = &request;
    const auto [first, is_first] = first_lookup.try_emplace(
        std::pair{absl::string_view(request.session_id),
                  absl::string_view(TenantOf(request).name)},
        i);
    absl::StatusOr<SessionRef> session;
    if (is_first) {
      session = sessions_.Get(request.session_id, TenantOf(request), seal_wait,
                              request.control);
    } else if (const BatchStep& earlier = steps[first->second];
               earlier.session) {
      session = earlier.session.Share();
    } else {
      session = earlier.status;  // its lookup failed
    }
    if (!session.ok()) {
      ATTN_RETURN_IF_ERROR(fail(i, session.status()));
      continue;
    }
    if (!seen.insert({session->get(), request.layer}).second) {
      const std::string what = absl::StrCat(
          "session ", QuoteClientString(request.session_id), " layer ",
          request.layer,
          " appears twice in one batch; send the second step in a later "
          "batch");
      ATTN_RETURN_IF_ERROR(fail(i, atomic ? absl::InvalidArgumentError(what)
                                          : absl::AbortedError(what)));
      continue;
    }
    steps[i].session = *std::move(session);
    to_lock.push_back(steps[i].session.get());
  }

  // 2. Lock each session once, in id order so concurrent batches never
  // deadlock. Two sessions may share an id (one deleted and another created
  // under its id while the batch looked them up): the address orders them,
  // and keeps each one's copies adjacent for std::unique.
  std::sort(to_lock.begin(), to_lock.end(), [](Session* a, Session* b) {
    if (a->id() != b->id()) return a->id() < b->id();
    return std::less<Session*>()(a, b);
  });
  to_lock.erase(std::unique(to_lock.begin(), to_lock.end()), to_lock.end());
  const SessionLocks locks(std::move(to_lock), busy);
  for (size_t i = 0; i < n; ++i) {
    if (!live(i) || !locks.busy(steps[i].session.get())) continue;
    // Left out (kSkip), unless its caller has withdrawn it: then it ends.
    absl::Status status = CheckCall(requests[i].control);
    if (status.ok()) status = SessionBusyError(requests[i].session_id);
    ATTN_RETURN_IF_ERROR(fail(i, status));
  }

  // 3. Validate every step before changing anything, then stage its blocks.
  double batch_flops = 0;
  double batch_reply_bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!live(i)) continue;
    if (absl::Status status = ValidateStep(steps[i]); !status.ok()) {
      ATTN_RETURN_IF_ERROR(fail(i, status));
    }
    batch_flops += steps[i].flops;
    batch_reply_bytes += steps[i].reply_bytes;
  }
  // An atomic batch is one call: its steps' work and results add up.
  if (atomic && n > 1) ATTN_RETURN_IF_ERROR(CheckCallCost(batch_flops));
  if (atomic && max_batch_reply_bytes >= 0 &&
      batch_reply_bytes > static_cast<double>(max_batch_reply_bytes)) {
    return ReplyTooLarge(absl::StrCat("this batch's ", n, " steps"),
                         batch_reply_bytes, max_batch_reply_bytes);
  }
  for (size_t i = 0; i < n; ++i) {
    if (!live(i)) continue;
    // The tenant's KV quota, before any block is taken.
    Session& session = *steps[i].session;
    LayerKvCache& layer = session.layer(steps[i].request->layer);
    const int64_t blocks = layer.BlocksToStage(steps[i].shape.num_queries);
    if (absl::Status status = session.usage().Reserve(
            blocks, TenantOf(*steps[i].request).quota);
        !status.ok()) {
      ATTN_RETURN_IF_ERROR(fail(i, status));
      continue;
    }
    steps[i].reservation = BlockReservation(&session.usage(), blocks);
    absl::StatusOr<LayerKvCache::PendingAppend> pending =
        layer.PrepareAppend(steps[i].shape.num_queries);
    if (!pending.ok()) {
      ATTN_RETURN_IF_ERROR(fail(i, pending.status()));
      continue;
    }
    steps[i].pending.emplace(*std::move(pending));
  }

  // 4. Write the new keys/values and build one problem per live step. The
  // float32 results to be converted share one scratch.
  int64_t scratch_floats = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!live(i) || WritesOutputInPlace(*steps[i].request) ||
        ReturnsFloatTensor(*steps[i].request)) {
      continue;
    }
    scratch_floats += OutputFloats(steps[i]);
  }
  std::unique_ptr<float[]> large_scratch;
  float* next_scratch = BatchScratch(scratch_floats, &large_scratch);
  std::vector<AttentionProblem> problems;
  std::vector<size_t> problem_step;
  problems.reserve(n);
  problem_step.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    if (!live(i)) continue;
    BatchStep& step = steps[i];
    const AppendRequest& request = *step.request;
    const SessionSpec& spec = step.session->spec();
    const LayerSpec& layer = spec.layers[request.layer];
    KvWrite write = step.pending->write_target();
    write.k = request.k;
    write.v = request.v;
    write.index_k = request.index_k;
    if (absl::Status status = backend_->WriteKv(write); !status.ok()) {
      ATTN_RETURN_IF_ERROR(fail(i, status));
      continue;
    }
    const int64_t tokens = step.shape.num_queries;
    // A float32 output goes straight into the caller's destination when it
    // can be written as floats, or is the returned tensor; otherwise it
    // goes into the scratch first.
    float* output = nullptr;
    if (WritesOutputInPlace(request)) {
      output = reinterpret_cast<float*>(request.output_destination.data());
    } else if (ReturnsFloatTensor(request)) {
      step.output =
          Tensor(DType::kFloat32, {tokens, spec.num_q_heads, spec.value_dim});
      output = step.output.float_data();
    } else {
      step.scratch = next_scratch;
      next_scratch += OutputFloats(step);
      output = step.scratch;
    }
    if (request.return_lse) {
      step.lse.emplace(DType::kFloat32, Shape{tokens, spec.num_q_heads});
    }
    AttentionProblem problem;
    problem.q = request.q;
    problem.kv = step.pending->view();
    problem.mask.causal = true;
    problem.mask.window = layer.window;
    problem.mask.num_sink_tokens = layer.num_sink_tokens;
    problem.mask.query_start = step.pending->start();
    problem.sink_logits = layer.sink_logits;
    problem.scale = spec.scale;
    problem.empty_row_policy = EmptyRowPolicy::kError;
    problem.control = request.control;
    problem.output = output;
    problem.lse = step.lse.has_value() ? step.lse->float_data() : nullptr;
    if (layer.topk > 0) {
      step.topk.topk = layer.topk;
      step.topk.score = layer.index_score;
      step.topk.index_q = request.index_q;
      step.topk.index_weights = request.index_weights;
      if (request.return_topk_indices) {
        step.topk_indices.resize(static_cast<size_t>(tokens * layer.topk));
        step.topk.selected = step.topk_indices.data();
      }
      problem.topk = &step.topk;
    }
    problems.push_back(problem);
    problem_step.push_back(i);
  }

  // 5. Attend, each step with its own status (results are batch-invariant,
  // and each error is the one the step alone would get): an independent
  // batch fails only the offending steps, an atomic one names the first of
  // them.
  std::vector<absl::Status> attended(problems.size());
  backend_->AttendEach(problems, absl::MakeSpan(attended));
  for (size_t p = 0; p < problems.size(); ++p) {
    if (!attended[p].ok()) {
      ATTN_RETURN_IF_ERROR(fail(problem_step[p], std::move(attended[p])));
    }
  }

  // 6. Convert to the requested dtypes; then nothing can fail any more.
  outputs->resize(n);
  for (size_t i = 0; i < n; ++i) {
    if (!live(i)) continue;
    const AppendRequest& request = *steps[i].request;
    if (!request.output_destination.empty()) {
      if (absl::Status status = ToOutputDestination(
              steps[i].scratch, OutputFloats(steps[i]), request);
          !status.ok()) {
        ATTN_RETURN_IF_ERROR(fail(i, status));
        continue;
      }
      (*outputs)[i].output = Tensor(request.output_dtype, Shape{0});
    } else if (ReturnsFloatTensor(request)) {
      (*outputs)[i].output = std::move(steps[i].output);
    } else {
      const SessionSpec& spec = steps[i].session->spec();
      absl::StatusOr<Tensor> output = ConvertOutput(
          steps[i].scratch,
          {steps[i].shape.num_queries, spec.num_q_heads, spec.value_dim},
          request.output_dtype);
      if (!output.ok()) {
        ATTN_RETURN_IF_ERROR(fail(i, output.status()));
        continue;
      }
      (*outputs)[i].output = *std::move(output);
    }
    (*outputs)[i].position = steps[i].pending->start();
    (*outputs)[i].lse = std::move(steps[i].lse);
    (*outputs)[i].topk_indices = std::move(steps[i].topk_indices);
  }

  // 7. The last chance for a caller to withdraw: after this check nothing
  // fails, so a withdrawn call never changes its session.
  for (size_t i = 0; i < n; ++i) {
    if (!live(i)) continue;
    if (absl::Status status = CheckCall(steps[i].request->control);
        !status.ok()) {
      ATTN_RETURN_IF_ERROR(fail(i, status));
    }
  }

  // 8. Publish every surviving append. Releasing their session refs
  // restarts the idle clocks (not those of failed steps).
  statuses->resize(n);
  for (size_t i = 0; i < n; ++i) {
    (*statuses)[i] = steps[i].status;
    if (!live(i)) continue;
    BatchStep& step = steps[i];
    step.session->layer(step.request->layer)
        .Commit(*std::move(step.pending), &step.reservation);
    step.session.MarkUsed();
    step.pending.reset();
    step.reservation = BlockReservation();
    (step.request->required_tokens.has_value() ? decode_tokens_total_
                                               : prefill_tokens_total_)
        .fetch_add(step.shape.num_queries, std::memory_order_relaxed);
  }
  return absl::OkStatus();
}

absl::StatusOr<AttentionOutput> AttentionEngine::Attend(
    const StatelessRequest& request) {
  ATTN_ASSIGN_OR_RETURN(QkvShape shape, ValidateQkv(request.q, request.k,
                                                    request.v, std::nullopt));
  // A session's limits bound a stateless call's heads and widths too: the
  // kernels' buffers grow with the query heads per KV head and the widths,
  // and a few megabytes of request with millions of heads took gigabytes.
  const SpecLimits& limits = options_.sessions.limits;
  if (shape.num_q_heads > limits.max_heads) {
    return absl::InvalidArgumentError(
        absl::StrCat("q has ", shape.num_q_heads, " heads; at most ",
                     limits.max_heads, ", as in a session"));
  }
  if (shape.head_dim > limits.max_head_dim ||
      shape.value_dim > limits.max_head_dim) {
    return absl::InvalidArgumentError(absl::StrCat(
        "head_dim ", shape.head_dim, " and value_dim ", shape.value_dim,
        " must be at most ", limits.max_head_dim, ", as in a session"));
  }
  const MaskSpec& mask = request.mask;
  if (mask.window < 0 || mask.num_sink_tokens < 0 || mask.query_start < 0) {
    return absl::InvalidArgumentError(
        "window, num_sink_tokens and query_start must be >= 0");
  }
  if (mask.query_start >
      std::numeric_limits<int64_t>::max() - shape.num_queries) {
    return absl::InvalidArgumentError(absl::StrCat(
        "query_start ", mask.query_start, " puts the last of the ",
        shape.num_queries,
        " query rows past the largest position (2^63 - 1); use a smaller "
        "query_start"));
  }
  if (!mask.causal && (mask.window > 0 || mask.query_start > 0)) {
    return absl::InvalidArgumentError(
        "window and query_start only apply to causal attention; set causal");
  }
  if (mask.num_sink_tokens > 0 && mask.window == 0) {
    return absl::InvalidArgumentError(
        "num_sink_tokens needs a sliding window (window > 0)");
  }
  ATTN_RETURN_IF_ERROR(
      ValidateSinkLogits(request.sink_logits, shape.num_q_heads));
  ATTN_RETURN_IF_ERROR(CheckCallCost(
      AttentionFlops(shape.num_queries, shape.num_q_heads, shape.head_dim,
                     shape.value_dim, mask, shape.num_keys)));
  ATTN_RETURN_IF_ERROR(CheckCall(request.control));
  float scale = request.scale;
  if (scale == 0.0f) scale = DefaultScale(shape.head_dim);
  if (!std::isfinite(scale) || scale < 0.0f) {
    return absl::InvalidArgumentError(absl::StrCat(
        "scale must be finite and positive (0 = 1/sqrt(head_dim)), "
        "got ",
        request.scale));
  }
  // The kernels read the bias as float32, and K and V in one dtype: sent in
  // two, both are widened to float32 (exact, so the same result).
  Tensor bias_f32, k_f32, v_f32;
  TensorView bias_view;
  if (request.bias.has_value()) {
    ATTN_RETURN_IF_ERROR(ValidateBias(*request.bias, shape));
    bias_view = AsFloat32(*request.bias, &bias_f32);
  }
  TensorView k_view = request.k;
  TensorView v_view = request.v;
  if (k_view.dtype != v_view.dtype) {
    k_view = AsFloat32(k_view, &k_f32);
    v_view = AsFloat32(v_view, &v_f32);
  }
  AttentionOutput result;
  result.position = mask.query_start;
  if (request.return_weights) {
    const int64_t weight_bytes =
        int64_t{shape.num_q_heads} * shape.num_queries * shape.num_keys * 4;
    if (weight_bytes > options_.max_weights_bytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("the requested weights would take ", weight_bytes,
                       " bytes, over the limit of ", options_.max_weights_bytes,
                       "; send fewer queries or keys, or drop return_weights"));
    }
    result.weights.emplace(
        DType::kFloat32,
        Shape{shape.num_q_heads, shape.num_queries, shape.num_keys});
  }
  Tensor output(DType::kFloat32,
                {shape.num_queries, shape.num_q_heads, shape.value_dim});
  if (request.return_lse) {
    result.lse.emplace(DType::kFloat32,
                       Shape{shape.num_queries, shape.num_q_heads});
  }

  const std::byte* blocks[2];
  AttentionProblem problem;
  problem.q = request.q;
  problem.kv = ContiguousKvView(k_view, v_view, blocks);
  problem.mask = mask;
  problem.sink_logits = request.sink_logits;
  problem.scale = scale;
  problem.bias = request.bias.has_value() ? &bias_view : nullptr;
  problem.empty_row_policy = request.empty_row_policy;
  problem.control = request.control;
  problem.output = output.float_data();
  problem.lse = result.lse.has_value() ? result.lse->float_data() : nullptr;
  problem.weights =
      result.weights.has_value() ? result.weights->float_data() : nullptr;
  ATTN_RETURN_IF_ERROR(backend_->Attend(absl::MakeConstSpan(&problem, 1)));
  ATTN_ASSIGN_OR_RETURN(result.output,
                        ToOutputDType(std::move(output), request.output_dtype));
  return result;
}

TenantStats AttentionEngine::tenant_stats(const std::string& name) const {
  return sessions_.tenant_stats(name);
}

EngineStats AttentionEngine::stats() const {
  EngineStats stats;
  stats.pool = pool_->stats();
  stats.active_sessions = sessions_.size();
  stats.session_metadata_bytes = sessions_.metadata_bytes();
  stats.sessions_created_total = sessions_.created_total();
  stats.sessions_expired_total = sessions_.expired_total();
  stats.decode_tokens_total =
      decode_tokens_total_.load(std::memory_order_relaxed);
  stats.prefill_tokens_total =
      prefill_tokens_total_.load(std::memory_order_relaxed);
  stats.shared_kv_chunks_total = backend_->shared_chunk_computations();
  stats.backend_failed = !backend_->failure().ok();
  stats.backend_scratch_bytes = backend_->scratch_bytes();
  stats.moved_sessions = sessions_.moved_sessions();
  stats.moved_session_redirects_total = sessions_.redirects_total();
  return stats;
}

}  // namespace attention
