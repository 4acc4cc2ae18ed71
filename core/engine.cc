#include "core/engine.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "core/request_validation.h"
#include "core/status_macros.h"

namespace attention {
namespace {

// Prefixes a batch step's errors with its index so a caller can find it.
absl::Status AtStep(const absl::Status& status, size_t step, size_t steps) {
  if (status.ok() || steps == 1) return status;
  return absl::Status(status.code(),
                      absl::StrCat("step ", step, ": ", status.message()));
}

// Converts the float32 result to the requested dtype. INVALID_ARGUMENT when a
// value does not fit (e.g. float16 overflow).
absl::StatusOr<Tensor> ToOutputDType(Tensor result, DType dtype) {
  if (dtype == DType::kFloat32) return result;
  ATTN_RETURN_IF_ERROR(CheckRepresentable(DType::kFloat32, result.data(),
                                          result.num_elements(), dtype,
                                          "attention output"));
  Tensor converted(dtype, result.shape());
  ConvertFromFloat(result.float_data(), result.num_elements(), dtype,
                   converted.data());
  return converted;
}

// Per-step state of AppendBatch.
struct StagedStep {
  std::shared_ptr<Session> session;
  const AppendRequest* request = nullptr;
  QkvShape shape;
  std::optional<LayerKvCache::PendingAppend> pending;
  Tensor output;
  std::optional<Tensor> lse;
};

}  // namespace

absl::StatusOr<std::unique_ptr<AttentionEngine>> AttentionEngine::Create(
    std::unique_ptr<AttentionBackend> backend, EngineOptions options) {
  if (backend == nullptr) {
    return absl::InvalidArgumentError("no attention backend");
  }
  if (options.max_weights_bytes < 0) {
    return absl::InvalidArgumentError("max_weights_bytes must be >= 0");
  }
  ATTN_ASSIGN_OR_RETURN(
      std::unique_ptr<BlockPool> pool,
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
    const SessionSpec& spec, absl::Duration idle_timeout) {
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Session> session,
                        sessions_.Create(spec, idle_timeout));
  return session->Info();
}

absl::StatusOr<SessionInfo> AttentionEngine::GetSession(const std::string& id) {
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, sessions_.Get(id));
  return session->Info();
}

std::vector<SessionInfo> AttentionEngine::ListSessions() const {
  std::vector<SessionInfo> infos;
  for (const std::shared_ptr<Session>& session : sessions_.List()) {
    infos.push_back(session->Info());
  }
  std::sort(infos.begin(), infos.end(),
            [](const SessionInfo& a, const SessionInfo& b) {
              return a.session_id < b.session_id;
            });
  return infos;
}

absl::Status AttentionEngine::DeleteSession(const std::string& id) {
  return sessions_.Delete(id);
}

absl::StatusOr<SessionInfo> AttentionEngine::ForkSession(
    const std::string& id) {
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Session> fork, sessions_.Fork(id));
  return fork->Info();
}

absl::StatusOr<SessionInfo> AttentionEngine::TruncateSession(
    const std::string& id, int64_t length) {
  if (length < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("truncate length must be >= 0, got ", length));
  }
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Session> session, sessions_.Get(id));
  {
    absl::MutexLock lock(&session->mu());
    // Check every layer before touching any: all layers or none.
    for (int i = 0; i < session->spec().num_layers; ++i) {
      if (absl::Status status = session->layer(i).CheckTruncate(length);
          !status.ok()) {
        return absl::Status(status.code(),
                            absl::StrCat("layer ", i, ": ", status.message()));
      }
    }
    for (int i = 0; i < session->spec().num_layers; ++i) {
      session->layer(i).Truncate(length);
    }
  }
  return session->Info();
}

absl::StatusOr<AttentionOutput> AttentionEngine::Append(
    const AppendRequest& request) {
  ATTN_ASSIGN_OR_RETURN(std::vector<AttentionOutput> outputs,
                        AppendBatch(absl::MakeConstSpan(&request, 1)));
  return std::move(outputs[0]);
}

absl::StatusOr<std::vector<AttentionOutput>> AttentionEngine::AppendBatch(
    absl::Span<const AppendRequest> requests) {
  const size_t n = requests.size();
  std::vector<StagedStep> steps(n);

  // 1. Resolve sessions and reject duplicate (session, layer) pairs.
  absl::flat_hash_set<std::pair<std::string, int32_t>> seen;
  std::vector<Session*> to_lock;
  for (size_t i = 0; i < n; ++i) {
    const AppendRequest& request = requests[i];
    absl::StatusOr<std::shared_ptr<Session>> session =
        sessions_.Get(request.session_id);
    if (!session.ok()) return AtStep(session.status(), i, n);
    if (!seen.insert({request.session_id, request.layer}).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          "step ", i, ": session '", request.session_id, "' layer ",
          request.layer,
          " appears twice in one batch; send the second step in a later "
          "batch"));
    }
    steps[i].session = *std::move(session);
    steps[i].request = &request;
    to_lock.push_back(steps[i].session.get());
  }

  // 2. Lock each session once, in id order so concurrent batches never
  // deadlock.
  std::sort(to_lock.begin(), to_lock.end(), [](Session* a, Session* b) {
    return a->id() < b->id();
  });
  to_lock.erase(std::unique(to_lock.begin(), to_lock.end()), to_lock.end());
  std::vector<std::unique_ptr<absl::MutexLock>> locks;
  locks.reserve(to_lock.size());
  for (Session* session : to_lock) {
    locks.push_back(std::make_unique<absl::MutexLock>(&session->mu()));
  }

  // 3. Validate every step before changing anything.
  for (size_t i = 0; i < n; ++i) {
    StagedStep& step = steps[i];
    const AppendRequest& request = *step.request;
    Session& session = *step.session;
    const SessionSpec& spec = session.spec();
    if (request.layer < 0 || request.layer >= spec.num_layers) {
      return AtStep(absl::InvalidArgumentError(absl::StrCat(
                        "layer ", request.layer, " is out of range: session '",
                        session.id(), "' has ", spec.num_layers, " layers")),
                    i, n);
    }
    QkvShape expected;
    expected.num_q_heads = spec.num_q_heads;
    expected.num_kv_heads = spec.num_kv_heads;
    expected.head_dim = spec.head_dim;
    expected.value_dim = spec.value_dim;
    absl::StatusOr<QkvShape> shape =
        ValidateQkv(request.q, request.k, request.v, expected);
    if (!shape.ok()) return AtStep(shape.status(), i, n);
    step.shape = *shape;
    if (shape->num_queries != shape->num_keys) {
      return AtStep(absl::InvalidArgumentError(absl::StrCat(
                        "q has ", shape->num_queries, " tokens but k and v have ",
                        shape->num_keys, "; every appended token needs a "
                        "query, a key and a value")),
                    i, n);
    }
    if (request.required_tokens.has_value() &&
        shape->num_queries != *request.required_tokens) {
      return AtStep(absl::InvalidArgumentError(absl::StrCat(
                        "a decode step takes exactly ", *request.required_tokens,
                        " token, got ", shape->num_queries,
                        "; use Prefill for several tokens")),
                    i, n);
    }
    for (const TensorView* t : {&request.k, &request.v}) {
      absl::Status status = CheckRepresentable(
          t->dtype, t->data, t->num_elements(), spec.kv_dtype,
          t == &request.k ? "k" : "v");
      if (!status.ok()) return AtStep(status, i, n);
    }
    const int64_t length = session.layer(request.layer).length();
    if (length + shape->num_queries > spec.max_tokens) {
      return AtStep(absl::OutOfRangeError(absl::StrCat(
                        "layer ", request.layer, " of session '", session.id(),
                        "' holds ", length, " tokens; appending ",
                        shape->num_queries, " would pass its max_tokens of ",
                        spec.max_tokens,
                        "; truncate the session or create one with a larger "
                        "max_tokens")),
                    i, n);
    }
  }

  // 4. Stage blocks (all or nothing: dropping `steps` releases them).
  for (size_t i = 0; i < n; ++i) {
    StagedStep& step = steps[i];
    absl::StatusOr<LayerKvCache::PendingAppend> pending =
        step.session->layer(step.request->layer)
            .PrepareAppend(step.shape.num_queries);
    if (!pending.ok()) return AtStep(pending.status(), i, n);
    step.pending.emplace(*std::move(pending));
  }

  // 5. Write the new keys/values and attend.
  std::vector<AttentionProblem> problems(n);
  for (size_t i = 0; i < n; ++i) {
    StagedStep& step = steps[i];
    const AppendRequest& request = *step.request;
    const SessionSpec& spec = step.session->spec();
    const LayerSpec& layer = spec.layers[request.layer];
    KvWrite write = step.pending->write_target();
    write.k = request.k;
    write.v = request.v;
    ATTN_RETURN_IF_ERROR(AtStep(backend_->WriteKv(write), i, n));

    const int64_t tokens = step.shape.num_queries;
    step.output = Tensor(DType::kFloat32,
                         {tokens, spec.num_q_heads, spec.value_dim});
    if (request.return_lse) {
      step.lse.emplace(DType::kFloat32, Shape{tokens, spec.num_q_heads});
    }
    AttentionProblem& problem = problems[i];
    problem.q = request.q;
    problem.kv = step.pending->view();
    problem.mask.causal = true;
    problem.mask.window = layer.window;
    problem.mask.num_sink_tokens = layer.num_sink_tokens;
    problem.mask.query_start = step.pending->start();
    problem.sink_logits = layer.sink_logits;
    problem.scale = spec.scale;
    problem.empty_row_policy = EmptyRowPolicy::kError;
    problem.output = step.output.float_data();
    problem.lse = step.lse.has_value() ? step.lse->float_data() : nullptr;
  }
  ATTN_RETURN_IF_ERROR(backend_->Attend(problems));

  std::vector<AttentionOutput> outputs(n);
  for (size_t i = 0; i < n; ++i) {
    absl::StatusOr<Tensor> output =
        ToOutputDType(std::move(steps[i].output), steps[i].request->output_dtype);
    if (!output.ok()) return AtStep(output.status(), i, n);
    outputs[i].output = *std::move(output);
    outputs[i].position = steps[i].pending->start();
    outputs[i].lse = std::move(steps[i].lse);
  }

  // 6. Nothing can fail any more: publish every append.
  const absl::Time now = sessions_.Now();
  for (StagedStep& step : steps) {
    step.session->layer(step.request->layer).Commit(*std::move(step.pending));
    step.pending.reset();
    step.session->Touch(now);
  }
  return outputs;
}

absl::StatusOr<AttentionOutput> AttentionEngine::Attend(
    const StatelessRequest& request) {
  ATTN_ASSIGN_OR_RETURN(QkvShape shape,
                        ValidateQkv(request.q, request.k, request.v,
                                    std::nullopt));
  const MaskSpec& mask = request.mask;
  if (mask.window < 0 || mask.num_sink_tokens < 0 || mask.query_start < 0) {
    return absl::InvalidArgumentError(
        "window, num_sink_tokens and query_start must be >= 0");
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
  float scale = request.scale;
  if (scale == 0.0f) scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  if (!std::isfinite(scale) || scale < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("scale must be finite and positive (0 = 1/sqrt(head_dim)), "
                     "got ", request.scale));
  }
  // The kernels read the bias as float32.
  Tensor bias_f32;
  TensorView bias_view;
  if (request.bias.has_value()) {
    ATTN_RETURN_IF_ERROR(ValidateBias(*request.bias, shape));
    bias_view = *request.bias;
    if (bias_view.dtype != DType::kFloat32) {
      bias_f32 = Tensor(DType::kFloat32, bias_view.shape);
      ConvertToFloat(bias_view.dtype, bias_view.data, bias_view.num_elements(),
                     bias_f32.float_data());
      bias_view = bias_f32.view();
    }
  }
  AttentionOutput result;
  result.position = mask.query_start;
  if (request.return_weights) {
    const int64_t weight_bytes =
        int64_t{shape.num_q_heads} * shape.num_queries * shape.num_keys * 4;
    if (weight_bytes > options_.max_weights_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "the requested weights would take ", weight_bytes,
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
  problem.kv = ContiguousKvView(request.k, request.v, blocks);
  problem.mask = mask;
  problem.sink_logits = request.sink_logits;
  problem.scale = scale;
  problem.bias = request.bias.has_value() ? &bias_view : nullptr;
  problem.empty_row_policy = request.empty_row_policy;
  problem.output = output.float_data();
  problem.lse = result.lse.has_value() ? result.lse->float_data() : nullptr;
  problem.weights =
      result.weights.has_value() ? result.weights->float_data() : nullptr;
  ATTN_RETURN_IF_ERROR(backend_->Attend(absl::MakeConstSpan(&problem, 1)));
  ATTN_ASSIGN_OR_RETURN(result.output,
                        ToOutputDType(std::move(output), request.output_dtype));
  return result;
}

EngineStats AttentionEngine::stats() const {
  EngineStats stats;
  stats.pool = pool_->stats();
  stats.active_sessions = sessions_.size();
  stats.sessions_created_total = sessions_.created_total();
  stats.sessions_expired_total = sessions_.expired_total();
  return stats;
}

int64_t AttentionEngine::ExpireIdleSessions() {
  return sessions_.ExpireIdle(sessions_.Now());
}

}  // namespace attention
