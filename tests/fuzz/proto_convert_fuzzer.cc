// proto_convert_fuzzer: raw bytes parsed as an attention.v1 request, put
// through the server's proto -> core conversion (server/proto_convert.h)
// and, when that succeeds, run on a small real AttentionEngine (CPU
// backend, small KV pool), converting results back to protos.
//
// Input: byte 0 picks the request type (low 3 bits) and whether the
// request's own session ids are kept (bit 7; otherwise they are replaced by
// a live session's id so that calls get past the lookup); byte 1 picks one
// of five fixed session specs (low 4 bits, modulo 5: three dense ones, a
// shared-latent (MLA) one with a top-k layer, a top-k one) and whether that
// session is first prefilled (bit 7) with 1-8 tokens (bits 4-6); the rest
// is the serialized request. Inputs whose work would be large are skipped
// so the fuzzer stays fast. Checks, besides not crashing: failed
// calls change nothing, successful ones change what they should, a
// resolved spec survives the proto round trip, and every block is free
// once every session is deleted.
#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "attention/v1/attention.pb.h"
#include "core/cpu/cpu_backend.h"
#include "core/engine.h"
#include "core/session_spec.h"
#include "core/tensor.h"
#include "google/protobuf/stubs/logging.h"
#include "server/proto_convert.h"
#include "tests/fuzz/fuzz_check.h"

namespace attention::fuzz {
namespace {

constexpr int64_t kBlockBytes = 2048;
constexpr int64_t kPoolBlocks = 32;
constexpr int64_t kMaxTokens = 64;
// Skip calls with more multiply-adds than this (or tensors larger).
constexpr int64_t kMaxWork = int64_t{1} << 20;
constexpr int64_t kMaxElements = int64_t{1} << 15;

// Product of `dims` (each clamped to >= 1), saturating at int64 max.
int64_t SaturatingProduct(std::initializer_list<int64_t> dims) {
  int64_t product = 1;
  for (int64_t dim : dims) {
    dim = std::max<int64_t>(dim, 1);
    if (product > std::numeric_limits<int64_t>::max() / dim) {
      return std::numeric_limits<int64_t>::max();
    }
    product *= dim;
  }
  return product;
}

int64_t Dim(const v1::Tensor& tensor, int i) {
  return i < tensor.shape_size() ? tensor.shape(i) : 1;
}

int64_t Elements(const v1::Tensor& tensor) {
  int64_t product = 1;
  for (int i = 0; i < tensor.shape_size(); ++i) {
    product = SaturatingProduct({product, tensor.shape(i)});
  }
  return product;
}

// Whether a call with these q/k/v does little enough work to run here.
bool SmallEnough(const v1::Tensor& q, const v1::Tensor& k,
                 const v1::Tensor& v) {
  if (Elements(q) > kMaxElements || Elements(k) > kMaxElements ||
      Elements(v) > kMaxElements) {
    return false;
  }
  const int64_t dim = std::max(Dim(q, 2), Dim(v, 2));
  return SaturatingProduct({Dim(q, 0), Dim(k, 0), Dim(q, 1), dim}) <= kMaxWork;
}

// The fixed session specs byte 1 chooses from (`which` % 5).
SessionSpec FixedSpec(int which) {
  SessionSpec spec;
  spec.max_tokens = kMaxTokens;
  switch (which) {
    case 0:
      spec.num_layers = 2;
      spec.num_q_heads = 2;
      spec.num_kv_heads = 1;
      spec.head_dim = 4;
      spec.layers = {LayerSpec{}, LayerSpec{.window = 4,
                                            .num_sink_tokens = 1,
                                            .sink_logits = {0.5f, -0.5f}}};
      break;
    case 1:
      spec.num_layers = 1;
      spec.num_q_heads = 4;
      spec.num_kv_heads = 2;
      spec.head_dim = 8;
      spec.value_dim = 2;
      spec.kv_dtype = DType::kFloat16;
      break;
    case 2:
      spec.num_layers = 3;
      spec.num_q_heads = 1;
      spec.num_kv_heads = 1;
      spec.head_dim = 2;
      spec.kv_dtype = DType::kBFloat16;
      spec.layers = {
          LayerSpec{.window = 3, .num_sink_tokens = 0, .sink_logits = {}}};
      break;
    case 3:  // MLA: a top-k layer and a dense window layer
      spec.num_layers = 2;
      spec.num_q_heads = 2;
      spec.num_kv_heads = 1;
      spec.head_dim = 6;
      spec.value_dim = 4;
      spec.scale = 0.5f;
      spec.kv_dtype = DType::kFloat16;
      spec.kv_layout = KvLayout::kSharedLatent;
      spec.index_dim = 2;
      spec.index_heads = 2;
      spec.layers.resize(2);
      spec.layers[0].topk = 3;
      spec.layers[1].window = 5;
      break;
    default:  // a top-k window layer with sinks (ReLU index), a dense one
      spec.num_layers = 2;
      spec.num_q_heads = 2;
      spec.num_kv_heads = 2;
      spec.head_dim = 4;
      spec.kv_dtype = DType::kBFloat16;
      spec.index_dim = 3;
      spec.index_heads = 1;
      spec.layers = {LayerSpec{.window = 4,
                               .num_sink_tokens = 1,
                               .sink_logits = {1.0f, -1.0f},
                               .topk = 2,
                               .index_score = IndexScore::kRelu},
                     LayerSpec{}};
      break;
  }
  return spec;
}

// The engine every input runs on, created once (a CpuBackend reads
// /proc/cpuinfo, too slow for every input); each input deletes every
// session it creates.
AttentionEngine& SharedEngine() {
  static AttentionEngine* const engine = [] {
    // Invalid UTF-8 in string fields is logged by protobuf; quiet.
    google::protobuf::SetLogHandler(nullptr);
    EngineOptions options;
    options.kv_cache_bytes = kPoolBlocks * kBlockBytes;
    options.kv_block_bytes = kBlockBytes;
    options.max_weights_bytes = 1 << 18;
    options.sessions.reap_interval = absl::ZeroDuration();
    options.sessions.max_sessions = 8;
    options.sessions.limits.default_max_tokens = kMaxTokens;
    options.sessions.limits.max_tokens_limit = kMaxTokens;
    options.sessions.limits.max_layers = 8;
    options.sessions.limits.max_heads = 16;
    options.sessions.limits.max_head_dim = 64;
    absl::StatusOr<std::unique_ptr<AttentionEngine>> created =
        AttentionEngine::Create(std::make_unique<CpuBackend>(/*num_threads=*/1),
                                options);
    Check(created.ok(), created.status().ToString());
    return created->release();  // lives as long as the process
  }();
  return *engine;
}

class ProtoConvertFuzzer {
 public:
  ProtoConvertFuzzer() : engine_(&SharedEngine()) {}

  ~ProtoConvertFuzzer() {
    for (const SessionInfo& info : engine_->ListSessions("", std::numeric_limits<int64_t>::max())) {
      Check(engine_->DeleteSession(info.session_id).ok(), "delete");
    }
    Check(engine_->stats().pool.blocks_used == 0,
          "blocks left once every session is deleted");
  }

  void Run(const uint8_t* data, size_t size) {
    if (size < 2) return;
    const uint8_t selector = data[0];
    keep_ids_ = (selector & 0x80) != 0;
    const uint8_t session_choice = data[1];
    const char* payload = reinterpret_cast<const char*>(data + 2);
    const int payload_size = static_cast<int>(size - 2);

    absl::StatusOr<SessionInfo> session = engine_->CreateSession(
        FixedSpec((session_choice & 0xF) % 5), absl::ZeroDuration());
    Check(session.ok(), session.status().ToString());
    session_ = *session;
    if (session_choice & 0x80)
      PrefillSession(((session_choice >> 4) & 0x7) + 1);

    switch (selector & 0x7) {
      case 0:
        if (v1::CreateSessionRequest r;
            r.ParseFromArray(payload, payload_size)) {
          CreateSession(r);
        }
        break;
      case 1:
        if (v1::PrefillRequest r; r.ParseFromArray(payload, payload_size)) {
          Prefill(r);
        }
        break;
      case 2:
        if (v1::DecodeRequest r; r.ParseFromArray(payload, payload_size)) {
          Decode(r);
        }
        break;
      case 3:
      case 4:
        if (v1::BatchDecodeRequest r; r.ParseFromArray(payload, payload_size)) {
          BatchDecode(r, /*atomic=*/(selector & 0x7) == 3);
        }
        break;
      case 5:
        if (v1::AttentionRequest r; r.ParseFromArray(payload, payload_size)) {
          Attention(r);
        }
        break;
      case 6:
        if (v1::TruncateSessionRequest r;
            r.ParseFromArray(payload, payload_size)) {
          Truncate(r);
        }
        break;
      default:
        if (v1::GetSessionRequest r; r.ParseFromArray(payload, payload_size)) {
          SessionCalls(r);
        }
        break;
    }
  }

 private:
  void SetId(std::string* id) const {
    if (!keep_ids_) *id = session_.session_id;
  }

  // Appends `t` tokens of fixed values to every layer of the session.
  void PrefillSession(int64_t t) {
    const SessionSpec& spec = session_.spec;
    std::vector<float> q(t * spec.num_q_heads * spec.head_dim, 0.25f);
    std::vector<float> k(t * spec.num_kv_heads * spec.head_dim, -0.5f);
    std::vector<float> v(t * spec.num_kv_heads * spec.value_dim, 1.0f);
    std::vector<float> index(t * spec.index_heads * spec.index_dim, 0.5f);
    const auto index_rows = [&](Shape shape) {
      return FloatView(absl::MakeConstSpan(index).first(NumElements(shape)),
                       shape);
    };
    for (int layer = 0; layer < spec.num_layers; ++layer) {
      AppendRequest r;
      r.session_id = session_.session_id;
      r.layer = layer;
      r.q = FloatView(q, {t, spec.num_q_heads, spec.head_dim});
      r.k = FloatView(k, {t, spec.num_kv_heads, spec.head_dim});
      if (spec.kv_layout != KvLayout::kSharedLatent) {
        r.v = FloatView(v, {t, spec.num_kv_heads, spec.value_dim});
      }
      if (spec.layers[layer].topk > 0) {
        r.index_k = index_rows({t, spec.index_dim});
        r.index_q = index_rows({t, spec.index_heads, spec.index_dim});
        r.index_weights = index_rows({t, spec.index_heads});
      }
      absl::StatusOr<AttentionOutput> out = engine_->Append(r);
      Check(out.ok(), out.status().ToString());
    }
  }

  // Layer lengths of every session and the pool's used blocks.
  std::string State() const {
    std::string state;
    for (const SessionInfo& info : engine_->ListSessions("", std::numeric_limits<int64_t>::max())) {
      absl::StrAppend(&state, info.session_id, ":");
      for (int64_t length : info.layer_lengths) {
        absl::StrAppend(&state, length, ",");
      }
      absl::StrAppend(&state, info.kv_cache_bytes, ";");
    }
    absl::StrAppend(&state, "used=", engine_->stats().pool.blocks_used);
    return state;
  }

  void CheckUnchanged(const std::string& before, const absl::Status& status,
                      const char* call) {
    Check(!status.ok(), "CheckUnchanged on success");
    Check(State() == before, absl::StrCat(call, " failed (", status.ToString(),
                                          ") but changed the engine"));
  }

  void CheckResult(const AttentionOutput& output, int64_t elements) {
    v1::AttentionResult result;
    server::AttentionOutputToProto(output, &result);
    Check(output.output.num_elements() == elements,
          absl::StrCat("output has ", output.output.num_elements(),
                       " elements, expected ", elements));
    Check(result.output().data().size() ==
              static_cast<size_t>(output.output.size_bytes()),
          "output bytes");
    Check(result.topk_indices_size() ==
              static_cast<int>(output.topk_indices.size()),
          "selected positions lost in the reply");
  }

  // Checks a successful append's result: T * H * value_dim output elements
  // of the session's spec (an MLA request has no v to take value_dim
  // from), and T * topk selected positions when asked.
  void CheckAppendResult(const AppendRequest& request,
                         const AttentionOutput& output) {
    const absl::StatusOr<SessionInfo> info =
        engine_->PeekSession(request.session_id);
    Check(info.ok(), "the appended session is gone");
    const SessionSpec* spec = &info->spec;
    const int64_t t = request.q.shape[0];
    CheckResult(output, t * spec->num_q_heads * spec->value_dim);
    const int64_t topk = spec->layers[request.layer].topk;
    Check(static_cast<int64_t>(output.topk_indices.size()) ==
              (request.return_topk_indices ? t * topk : 0),
          absl::StrCat(output.topk_indices.size(), " selected positions for ",
                       t, " tokens of top-", topk));
  }

  int64_t LayerLength(const std::string& id, int32_t layer) const {
    for (const SessionInfo& info : engine_->ListSessions("", std::numeric_limits<int64_t>::max())) {
      if (info.session_id == id && layer >= 0 &&
          layer < static_cast<int32_t>(info.layer_lengths.size())) {
        return info.layer_lengths[layer];
      }
    }
    return -1;
  }

  void CreateSession(const v1::CreateSessionRequest& request) {
    absl::StatusOr<SessionSpec> spec =
        server::SessionSpecFromProto(request.spec());
    if (!spec.ok()) return;
    const std::string before = State();
    absl::StatusOr<SessionInfo> info = engine_->CreateSession(
        *spec, absl::Seconds(request.idle_timeout_seconds()));
    if (!info.ok()) {
      CheckUnchanged(before, info.status(), "CreateSession");
      return;
    }
    // The resolved spec survives the proto round trip and resolves to
    // itself.
    v1::SessionInfo proto;
    server::SessionInfoToProto(*info, &proto);
    absl::StatusOr<SessionSpec> back =
        server::SessionSpecFromProto(proto.spec());
    Check(back.ok() && *back == info->spec, "spec round trip");
    absl::StatusOr<SessionSpec> again =
        ResolveSessionSpec(*back, engine_->options().sessions.limits);
    Check(again.ok() && *again == info->spec, "resolving is not idempotent");
  }

  template <typename Proto>
  void Append(const Proto& proto, absl::StatusOr<AppendRequest> request) {
    if (!request.ok() || !SmallEnough(proto.q(), proto.k(), proto.v())) {
      return;
    }
    const std::string before = State();
    const int64_t length = LayerLength(request->session_id, request->layer);
    absl::StatusOr<AttentionOutput> out = engine_->Append(*request);
    if (!out.ok()) {
      CheckUnchanged(before, out.status(), "Append");
      return;
    }
    const int64_t t = request->q.shape[0];
    Check(out->position == length, "position");
    Check(LayerLength(request->session_id, request->layer) == length + t,
          "layer length after append");
    CheckAppendResult(*request, *out);
  }

  void Prefill(v1::PrefillRequest& request) {
    SetId(request.mutable_session_id());
    Append(request, server::AppendRequestFromProto(request));
  }

  void Decode(v1::DecodeRequest& request) {
    SetId(request.mutable_session_id());
    Append(request, server::AppendRequestFromProto(request));
  }

  void BatchDecode(v1::BatchDecodeRequest& request, bool atomic) {
    if (request.steps_size() > 8) return;
    std::vector<AppendRequest> steps;
    for (int i = 0; i < request.steps_size(); ++i) {
      v1::DecodeRequest& step = *request.mutable_steps(i);
      SetId(step.mutable_session_id());
      if (!SmallEnough(step.q(), step.k(), step.v())) return;
      absl::StatusOr<AppendRequest> converted =
          server::AppendRequestFromProto(step, absl::StrCat("steps[", i, "]"));
      if (!converted.ok()) return;
      steps.push_back(*std::move(converted));
    }
    const std::string before = State();
    if (atomic) {
      absl::StatusOr<std::vector<AttentionOutput>> out =
          engine_->AppendBatch(steps);
      if (!out.ok()) {
        CheckUnchanged(before, out.status(), "AppendBatch");
        return;
      }
      Check(out->size() == steps.size(), "batch result count");
      for (size_t i = 0; i < steps.size(); ++i) {
        CheckAppendResult(steps[i], (*out)[i]);
      }
      return;
    }
    std::vector<absl::StatusOr<AttentionOutput>> out =
        engine_->AppendEach(steps);
    Check(out.size() == steps.size(), "AppendEach result count");
    bool any_ok = false;
    for (size_t i = 0; i < steps.size(); ++i) {
      if (!out[i].ok()) continue;
      any_ok = true;
      CheckAppendResult(steps[i], *out[i]);
    }
    if (!any_ok && !steps.empty()) {
      CheckUnchanged(before, out[0].status(), "AppendEach");
    }
  }

  void Attention(const v1::AttentionRequest& proto) {
    absl::StatusOr<StatelessRequest> request =
        server::StatelessRequestFromProto(proto);
    if (!request.ok() || !SmallEnough(proto.q(), proto.k(), proto.v()) ||
        Elements(proto.bias()) > kMaxElements) {
      return;
    }
    absl::StatusOr<AttentionOutput> out = engine_->Attend(*request);
    if (!out.ok()) return;
    CheckResult(
        *out, request->q.shape[0] * request->q.shape[1] * request->v.shape[2]);
    if (request->return_weights) {
      Check(out->weights.has_value() &&
                out->weights->num_elements() == request->q.shape[1] *
                                                    request->q.shape[0] *
                                                    request->k.shape[0],
            "weights shape");
    }
  }

  void Truncate(v1::TruncateSessionRequest& request) {
    SetId(request.mutable_session_id());
    const std::string before = State();
    absl::StatusOr<SessionInfo> info =
        engine_->TruncateSession(request.session_id(), request.length());
    if (!info.ok()) {
      CheckUnchanged(before, info.status(), "TruncateSession");
      return;
    }
    for (int64_t length : info->layer_lengths) {
      Check(length <= request.length(), "truncated layer too long");
    }
  }

  void SessionCalls(v1::GetSessionRequest& request) {
    SetId(request.mutable_session_id());
    const std::string& id = request.session_id();
    if (absl::StatusOr<SessionInfo> info = engine_->GetSession(id); info.ok()) {
      v1::SessionInfo proto;
      server::SessionInfoToProto(*info, &proto);
    }
    if (absl::StatusOr<SessionInfo> fork = engine_->ForkSession(id);
        fork.ok()) {
      Check(engine_->DeleteSession(fork->session_id).ok(), "delete fork");
    }
    (void)engine_->DeleteSession(id);
  }

  AttentionEngine* const engine_;
  SessionInfo session_;
  bool keep_ids_ = false;
};

}  // namespace
}  // namespace attention::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  attention::fuzz::ProtoConvertFuzzer().Run(data, size);
  return 0;
}
