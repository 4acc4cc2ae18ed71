// engine_ops_fuzzer: drives a small AttentionEngine (CPU backend, a few KV
// blocks, small dimensions) through random session operations — create
// with random layer specs (window, sinks, top-k sparse layers, the shared
// latent layout of MLA), prefill, decode, AppendBatch, AppendEach, fork,
// truncate, delete, idle expiry on a fuzzer-driven clock — and checks it
// against a model kept here: the K/V (and index key) history of every
// (session, layer), every output against the float64 reference of
// tests/core, every top-k selection against one computed here, failed calls
// changing nothing, and the block pool's accounting after each step.
#include <algorithm>
#include <limits>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "core/cpu/cpu_backend.h"
#include "core/cpu/cpu_features.h"
#include "core/dtype.h"
#include "core/engine.h"
#include "core/tensor.h"
#include "fuzzer/FuzzedDataProvider.h"
#include "tests/core/reference_attention.h"
#include "tests/fuzz/fuzz_check.h"

namespace attention::fuzz {
namespace {

constexpr int64_t kBlockBytes = 1024;
constexpr int64_t kPoolBlocks = 40;
constexpr int64_t kMaxTokens = 48;  // the server default and limit here
constexpr int kMaxLiveSessions = 6;
constexpr int kMaxOps = 64;
constexpr int64_t kMaxPrefill = 9;

// Rounds `values` to `dtype` and back, as the KV cache stores them.
std::vector<float> StoredAs(DType dtype, const std::vector<float>& values) {
  const int64_t n = static_cast<int64_t>(values.size());
  std::vector<std::byte> bytes(n * DTypeSize(dtype));
  ConvertFromFloat(values.data(), n, dtype, bytes.data());
  std::vector<float> out(n);
  ConvertToFloat(dtype, bytes.data(), n, out.data());
  return out;
}

// Absolute tolerance of an output element (|values| <= 4) in `dtype`, the
// reference being exact: float32 accumulation error, or the output's own
// rounding.
double Tolerance(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return 2e-4;
    case DType::kFloat16:
      return 6e-3;
    case DType::kBFloat16:
      return 4e-2;
  }
  return 0.0;
}

// The engine's clock, which Expire() advances.
absl::Time& FuzzClock() {
  static absl::Time now;
  return now;
}

// One engine per CPU kernel set (the scalar one where the processor lacks
// it), created once and reused: a CpuBackend reads /proc/cpuinfo, too slow
// for every input. Each input deletes every session it creates.
AttentionEngine& SharedEngine(CpuIsa isa) {
  static AttentionEngine* engines[3] = {};
  if (!CpuIsaSupported(isa)) isa = CpuIsa::kScalar;
  AttentionEngine*& engine = engines[static_cast<int>(isa)];
  if (engine != nullptr) return *engine;
  EngineOptions options;
  options.kv_cache_bytes = kPoolBlocks * kBlockBytes;
  options.kv_block_bytes = kBlockBytes;
  options.max_weights_bytes = 1 << 16;
  options.sessions.reap_interval = absl::ZeroDuration();
  options.sessions.max_sessions = kMaxLiveSessions;
  options.sessions.default_idle_timeout = absl::Seconds(100);
  options.sessions.max_idle_timeout = absl::Seconds(200);
  options.sessions.limits.default_max_tokens = kMaxTokens;
  options.sessions.limits.max_tokens_limit = kMaxTokens;
  options.sessions.limits.max_layers = 4;
  options.sessions.limits.max_heads = 8;
  options.sessions.limits.max_head_dim = 16;
  options.sessions.now = [] { return FuzzClock(); };
  absl::StatusOr<std::unique_ptr<CpuBackend>> backend =
      CpuBackend::Create(/*num_threads=*/1, isa, absl::ZeroDuration());
  Check(backend.ok(), backend.status().ToString());
  absl::StatusOr<std::unique_ptr<AttentionEngine>> created =
      AttentionEngine::Create(*std::move(backend), options);
  Check(created.ok(), created.status().ToString());
  engine = created->release();  // lives as long as the process
  return *engine;
}

struct ModelSession {
  std::string id;
  SessionSpec spec;  // resolved
  absl::Duration timeout;
  // K/V as stored (rounded to kv_dtype), per layer: [len, H_kv, d(v)]. A
  // shared-latent session's v is the leading value_dim entries of its k.
  std::vector<std::vector<float>> k, v;
  // Index keys as stored, per layer: [len, index_dim] (top-k layers).
  std::vector<std::vector<float>> index_k;
  int64_t group = 0;  // sessions of one group may share blocks (forks)
  // The idle clock: the last call certainly / possibly touching it.
  absl::Time last_sure, last_maybe;

  int64_t length(int layer) const {
    return static_cast<int64_t>(k[layer].size()) /
           (int64_t{spec.num_kv_heads} * spec.head_dim);
  }
};

// One append the fuzzer sends, the inputs it owns and what it expects.
struct PlannedAppend {
  int session = -1;  // index into sessions_, -1 = an unknown id
  int layer = 0;
  // Made invalid on purpose: how, or empty.
  std::string corrupt;
  std::vector<float> q, k, v;
  // Top-k layers: index keys [T, index_dim], queries [T, index_heads,
  // index_dim] and weights [T, index_heads].
  std::vector<float> index_k, index_q, index_w;
  std::vector<std::byte> destination;
  int64_t destination_offset = 0;
  AppendRequest request;
};

class EngineOpsFuzzer {
 public:
  explicit EngineOpsFuzzer(FuzzedDataProvider& in)
      : in_(in),
        engine_(SharedEngine(in_.PickValueInArray(
            {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}))) {
    FuzzClock() = absl::FromUnixSeconds(1'700'000'000);
    Check(engine_.stats().active_sessions == 0, "sessions left over");
  }

  void Run() {
    for (int op = 0; op < kMaxOps && in_.remaining_bytes() > 0; ++op) {
      switch (in_.ConsumeIntegralInRange<int>(0, 10)) {
        case 0:
          Create();
          break;
        case 1:
        case 2:
          AppendOne(/*decode=*/false);
          break;
        case 3:
          AppendOne(/*decode=*/true);
          break;
        case 4:
          AppendMany(/*atomic=*/true);
          break;
        case 5:
          AppendMany(/*atomic=*/false);
          break;
        case 6:
          Fork();
          break;
        case 7:
          Truncate();
          break;
        case 8:
          Delete();
          break;
        case 9:
          Expire();
          break;
        case 10:
          Get();
          break;
      }
      CheckState();
    }
    // Everything is freed once every session is gone.
    while (!sessions_.empty()) RemoveAt(0, /*delete_it=*/true);
    CheckState();
    const EngineStats stats = engine_.stats();
    Check(stats.pool.blocks_used == 0,
          absl::StrCat(stats.pool.blocks_used, " blocks used, no session"));
    Check(stats.active_sessions == 0, "sessions left");
  }

 private:
  // --- inputs -------------------------------------------------------------

  int PickSession() {
    if (sessions_.empty()) return -1;
    return in_.ConsumeIntegralInRange<int>(
        0, static_cast<int>(sessions_.size()) - 1);
  }

  // Values v/32 for a signed byte v: in [-4, 4], never overflowing.
  std::vector<float> Values(int64_t count) {
    std::vector<float> out(count);
    for (float& x : out) x = in_.ConsumeIntegral<int8_t>() / 32.0f;
    return out;
  }

  // Small integers in [-4, 4]: index weights with which every index score
  // of Values() inputs is exact in float32, so that the selection is the
  // one computed here whatever the kernel's order of summation.
  std::vector<float> SmallIntegers(int64_t count) {
    std::vector<float> out(count);
    for (float& x : out) x = in_.ConsumeIntegralInRange<int>(-4, 4);
    return out;
  }

  DType PickDType() {
    return in_.PickValueInArray(
        {DType::kFloat32, DType::kFloat16, DType::kBFloat16});
  }

  SessionSpec RandomSpec() {
    SessionSpec spec;
    spec.num_layers = in_.ConsumeIntegralInRange<int32_t>(1, 3);
    spec.num_kv_heads = in_.ConsumeIntegralInRange<int32_t>(1, 3);
    spec.num_q_heads =
        spec.num_kv_heads * in_.ConsumeIntegralInRange<int32_t>(1, 2);
    spec.head_dim = in_.ConsumeIntegralInRange<int32_t>(1, 8);
    spec.value_dim = in_.ConsumeIntegralInRange<int32_t>(0, 8);
    spec.kv_dtype = PickDType();
    if (in_.ConsumeBool()) {
      spec.scale = in_.ConsumeIntegralInRange<int>(1, 16) / 16.0f;
    }
    if (in_.ConsumeIntegralInRange<int>(0, 3) == 0) {
      // MLA: one latent per token, values its leading entries; a scale.
      spec.kv_layout = KvLayout::kSharedLatent;
      spec.num_kv_heads = 1;
      spec.value_dim = in_.ConsumeIntegralInRange<int32_t>(1, spec.head_dim);
      spec.scale = in_.ConsumeIntegralInRange<int>(1, 16) / 16.0f;
    }
    spec.max_tokens = in_.ConsumeIntegralInRange<int64_t>(0, kMaxTokens);
    const int layer_specs = in_.PickValueInArray({0, 1, spec.num_layers});
    for (int i = 0; i < layer_specs; ++i) {
      LayerSpec layer;
      if (in_.ConsumeBool()) {
        layer.window = in_.ConsumeIntegralInRange<int32_t>(1, 12);
        layer.num_sink_tokens = in_.ConsumeIntegralInRange<int32_t>(0, 3);
      }
      if (in_.ConsumeBool()) {
        for (int h = 0; h < spec.num_q_heads; ++h) {
          layer.sink_logits.push_back(in_.ConsumeIntegralInRange<int>(-24, 24) /
                                      8.0f);
        }
      }
      if (in_.ConsumeIntegralInRange<int>(0, 2) == 0) {
        layer.topk = in_.ConsumeIntegralInRange<int32_t>(1, 6);
        layer.index_score =
            in_.ConsumeBool() ? IndexScore::kRelu : IndexScore::kIdentity;
        spec.index_dim = in_.ConsumeIntegralInRange<int32_t>(1, 4);
        spec.index_heads = in_.ConsumeIntegralInRange<int32_t>(1, 3);
      }
      spec.layers.push_back(std::move(layer));
    }
    // Now and then an invalid spec: it must be refused.
    switch (in_.ConsumeIntegralInRange<int>(0, 15)) {
      case 0:
        spec.num_q_heads += 1;  // no longer a multiple (or H_kv too large)
        if (spec.num_q_heads % spec.num_kv_heads == 0) spec.num_kv_heads += 1;
        break;
      case 1: {
        LayerSpec bad;
        bad.num_sink_tokens = 2;  // sinks need a window
        spec.layers.assign(1, bad);
        break;
      }
      case 2:
        spec.max_tokens = kMaxTokens + 1;
        break;
      case 3:  // a top-k layer without an index, or an index without one
        spec.index_dim = spec.index_dim == 0 ? 2 : 0;
        break;
      case 4:  // a shared latent needs one KV head and a scale
        spec.kv_layout = KvLayout::kSharedLatent;
        if (spec.num_kv_heads == 1) spec.scale = 0.0f;
        break;
      default:
        break;
    }
    return spec;
  }

  // --- operations ---------------------------------------------------------

  void Create() {
    const SessionSpec spec = RandomSpec();
    const absl::Duration timeout =
        absl::Seconds(in_.ConsumeIntegralInRange<int>(0, 150));
    const int64_t before = engine_.stats().active_sessions;
    absl::StatusOr<SessionInfo> info = engine_.CreateSession(spec, timeout);
    if (!info.ok()) {
      Check(info.status().code() == absl::StatusCode::kInvalidArgument ||
                (info.status().code() == absl::StatusCode::kResourceExhausted &&
                 before == kMaxLiveSessions),
            absl::StrCat("CreateSession: ", info.status().ToString()));
      return;
    }
    const SessionSpec& resolved = info->spec;
    Check(resolved.num_layers == spec.num_layers &&
              static_cast<int>(resolved.layers.size()) == spec.num_layers &&
              resolved.value_dim ==
                  (spec.value_dim == 0 ? spec.head_dim : spec.value_dim) &&
              resolved.max_tokens ==
                  (spec.max_tokens == 0 ? kMaxTokens : spec.max_tokens),
          "CreateSession resolved the spec wrongly");
    ModelSession session;
    session.id = info->session_id;
    session.spec = resolved;
    session.timeout =
        timeout == absl::ZeroDuration() ? absl::Seconds(100) : timeout;
    session.k.resize(resolved.num_layers);
    session.v.resize(resolved.num_layers);
    session.index_k.resize(resolved.num_layers);
    session.group = next_group_++;
    session.last_sure = session.last_maybe = FuzzClock();
    sessions_.push_back(std::move(session));
  }

  // Plans an append to a random (session, layer); T == 1 for decode.
  PlannedAppend Plan(bool decode) {
    PlannedAppend plan;
    plan.session = PickSession();
    if (plan.session < 0 || in_.ConsumeIntegralInRange<int>(0, 31) == 0) {
      plan.session = -1;  // unknown id
    }
    SessionSpec spec;
    if (plan.session >= 0) {
      spec = sessions_[plan.session].spec;
    } else {
      spec.num_layers = 1;
      spec.num_q_heads = spec.num_kv_heads = 1;
      spec.head_dim = spec.value_dim = 4;
    }
    plan.layer = in_.ConsumeIntegralInRange<int>(0, spec.num_layers - 1);
    const bool latent = spec.kv_layout == KvLayout::kSharedLatent;
    const bool sparse = plan.session >= 0 && spec.layers[plan.layer].topk > 0;
    const int64_t t =
        decode ? 1 : in_.ConsumeIntegralInRange<int64_t>(1, kMaxPrefill);
    plan.q = Values(t * spec.num_q_heads * spec.head_dim);
    plan.k = Values(t * spec.num_kv_heads * spec.head_dim);
    if (!latent) plan.v = Values(t * spec.num_kv_heads * spec.value_dim);
    AppendRequest& r = plan.request;
    r.session_id = plan.session >= 0 ? sessions_[plan.session].id
                                     : std::string("no-such-session");
    r.layer = plan.layer;
    r.q = FloatView(plan.q, {t, spec.num_q_heads, spec.head_dim});
    r.k = FloatView(plan.k, {t, spec.num_kv_heads, spec.head_dim});
    if (!latent) {
      r.v = FloatView(plan.v, {t, spec.num_kv_heads, spec.value_dim});
    }
    if (sparse) {
      plan.index_k = Values(t * spec.index_dim);
      plan.index_q = Values(t * spec.index_heads * spec.index_dim);
      plan.index_w = SmallIntegers(t * spec.index_heads);
      r.index_k = FloatView(plan.index_k, {t, spec.index_dim});
      r.index_q =
          FloatView(plan.index_q, {t, spec.index_heads, spec.index_dim});
      r.index_weights = FloatView(plan.index_w, {t, spec.index_heads});
      r.return_topk_indices = in_.ConsumeBool();
    }
    if (decode) r.required_tokens = 1;
    r.output_dtype = PickDType();
    r.return_lse = in_.ConsumeBool();
    switch (in_.ConsumeIntegralInRange<int>(0, 27)) {
      case 0:  // a layer past the end
        r.layer = spec.num_layers;
        plan.corrupt = "layer past the end";
        break;
      case 1:  // a wrong head count
        r.q.shape[1] += 1;
        plan.corrupt = "wrong q head count";
        break;
      case 2:  // bytes that do not match the shape
        r.k.size_bytes -= 4;
        plan.corrupt = "k bytes not matching its shape";
        break;
      case 3:  // not finite
        (latent ? plan.k : plan.v)[0] = std::nanf("");
        plan.corrupt = "NaN in k or v";
        break;
      case 4:  // a v for a shared latent, or none for separate values
        if (latent) {
          plan.v = Values(t * spec.value_dim);
          r.v = FloatView(plan.v, {t, 1, spec.value_dim});
        } else {
          r.v = TensorView();
        }
        plan.corrupt = "v present iff the values are not the latent";
        break;
      case 5:  // index inputs on a dense layer, or none on a top-k layer
        if (sparse) {
          r.index_weights = TensorView();
        } else {
          r.return_topk_indices = true;
        }
        plan.corrupt = "index inputs iff the layer is top-k";
        break;
      case 6:  // an index query of the wrong width
        if (!sparse) break;
        r.index_q.shape[2] += 1;
        plan.corrupt = "index_q of the wrong width";
        break;
      default:
        break;
    }
    if (in_.ConsumeBool()) {
      // Caller-owned output, sometimes not 4-byte aligned.
      const int64_t bytes =
          t * spec.num_q_heads * spec.value_dim * DTypeSize(r.output_dtype);
      plan.destination_offset = in_.ConsumeBool() ? 0 : 2;
      plan.destination.resize(bytes + plan.destination_offset + 4);
      r.output_destination = absl::MakeSpan(
          plan.destination.data() + plan.destination_offset, bytes);
      if (in_.ConsumeIntegralInRange<int>(0, 15) == 0) {
        // One byte short (never empty: an empty destination means none).
        r.output_destination = r.output_destination.first(bytes - 1);
        plan.corrupt = "destination too small";
      }
    }
    return plan;
  }

  // The values `s` stores for appended keys `k` (as stored) and values `v`
  // (as sent): the keys' leading value_dim entries for a shared latent.
  static std::vector<float> StoredValues(const ModelSession& s,
                                         const std::vector<float>& k,
                                         const std::vector<float>& v) {
    if (s.spec.kv_layout != KvLayout::kSharedLatent) {
      return StoredAs(s.spec.kv_dtype, v);
    }
    std::vector<float> values;
    for (size_t begin = 0; begin < k.size(); begin += s.spec.head_dim) {
      values.insert(values.end(), k.begin() + begin,
                    k.begin() + begin + s.spec.value_dim);
    }
    return values;
  }

  // The positions query `row` of `plan` selects on a top-k layer over the
  // session's history and the plan's own keys, increasing: the `topk`
  // visible keys of highest index score, ties to the lower position. The
  // scores are exact (see SmallIntegers), so computed here in double.
  std::vector<int64_t> Selection(const PlannedAppend& plan, int64_t row,
                                 const MaskSpec& mask) {
    const ModelSession& s = sessions_[plan.session];
    const SessionSpec& spec = s.spec;
    const LayerSpec& layer = spec.layers[plan.layer];
    std::vector<float> keys = s.index_k[plan.layer];
    const std::vector<float> stored = StoredAs(spec.kv_dtype, plan.index_k);
    keys.insert(keys.end(), stored.begin(), stored.end());
    const int64_t position = mask.query_start + row;
    std::vector<std::pair<double, int64_t>> scored;
    for (int64_t key = 0; key <= position; ++key) {
      if (!testing::ReferenceKeyVisible(mask, position, key)) continue;
      double score = 0;
      for (int j = 0; j < spec.index_heads; ++j) {
        double dot = 0;
        for (int d = 0; d < spec.index_dim; ++d) {
          dot +=
              double{
                  plan.index_q[(row * spec.index_heads + j) * spec.index_dim +
                               d]} *
              keys[key * spec.index_dim + d];
        }
        if (layer.index_score == IndexScore::kRelu) dot = std::max(dot, 0.0);
        score += plan.index_w[row * spec.index_heads + j] * dot;
      }
      scored.emplace_back(-score, key);  // sorted: highest score first
    }
    std::sort(scored.begin(), scored.end());
    scored.resize(std::min<size_t>(scored.size(), layer.topk));
    std::vector<int64_t> positions;
    for (const auto& [score, key] : scored) positions.push_back(key);
    std::sort(positions.begin(), positions.end());
    return positions;
  }

  // The expected output of `plan` over the session's current history, and
  // on a top-k layer each query's selection.
  testing::ReferenceOutputs Expected(
      const PlannedAppend& plan,
      std::vector<std::vector<int64_t>>* selections = nullptr) {
    const ModelSession& s = sessions_[plan.session];
    const SessionSpec& spec = s.spec;
    const LayerSpec& layer = spec.layers[plan.layer];
    testing::ReferenceInputs in;
    in.num_queries = plan.request.q.shape[0];
    in.num_heads = spec.num_q_heads;
    in.num_kv_heads = spec.num_kv_heads;
    in.head_dim = spec.head_dim;
    in.value_dim = spec.value_dim;
    in.num_keys = s.length(plan.layer) + in.num_queries;
    in.q = plan.q;
    in.k = s.k[plan.layer];
    in.v = s.v[plan.layer];
    const std::vector<float> k = StoredAs(spec.kv_dtype, plan.k);
    const std::vector<float> v = StoredValues(s, k, plan.v);
    in.k.insert(in.k.end(), k.begin(), k.end());
    in.v.insert(in.v.end(), v.begin(), v.end());
    in.mask = MaskSpec{.causal = true,
                       .window = layer.window,
                       .num_sink_tokens = layer.num_sink_tokens,
                       .query_start = s.length(plan.layer)};
    in.sink_logits = layer.sink_logits;
    in.scale = spec.scale;
    if (layer.topk > 0) {
      // Attention over the selected keys only: the others biased to -inf.
      in.bias_rank = 2;
      in.bias.assign(in.num_queries * in.num_keys,
                     -std::numeric_limits<float>::infinity());
      for (int64_t row = 0; row < in.num_queries; ++row) {
        std::vector<int64_t> selected = Selection(plan, row, in.mask);
        for (int64_t key : selected) in.bias[row * in.num_keys + key] = 0.0f;
        if (selections != nullptr) selections->push_back(std::move(selected));
      }
    }
    absl::StatusOr<testing::ReferenceOutputs> out =
        testing::ReferenceAttention(in);
    Check(out.ok(), absl::StrCat("reference: ", out.status().ToString()));
    return *std::move(out);
  }

  // Checks a successful append's output and applies it to the model.
  void Commit(const PlannedAppend& plan, const AttentionOutput& output) {
    ModelSession& s = sessions_[plan.session];
    const AppendRequest& r = plan.request;
    std::vector<std::vector<int64_t>> selections;
    const testing::ReferenceOutputs want = Expected(plan, &selections);
    const int64_t n = static_cast<int64_t>(want.output.size());
    Check(output.position == s.length(plan.layer), "wrong position");
    std::vector<float> got(n);
    if (r.output_destination.empty()) {
      Check(output.output.dtype() == r.output_dtype &&
                output.output.num_elements() == n,
            "output has the wrong dtype or size");
      ConvertToFloat(r.output_dtype, output.output.data(), n, got.data());
    } else {
      Check(output.output.num_elements() == 0,
            "output given a destination is not empty");
      Check(static_cast<int64_t>(r.output_destination.size()) ==
                n * DTypeSize(r.output_dtype),
            "destination size");
      ConvertToFloat(r.output_dtype, r.output_destination.data(), n,
                     got.data());
    }
    const double tolerance = Tolerance(r.output_dtype);
    for (int64_t i = 0; i < n; ++i) {
      Check(std::abs(got[i] - want.output[i]) <= tolerance,
            absl::StrCat("output[", i, "] = ", got[i], ", reference ",
                         want.output[i], " (session ", plan.session, " layer ",
                         plan.layer, ")"));
    }
    Check(output.lse.has_value() == r.return_lse, "lse presence");
    if (output.lse.has_value()) {
      const int64_t rows = static_cast<int64_t>(want.lse.size());
      Check(output.lse->num_elements() == rows, "lse size");
      for (int64_t i = 0; i < rows; ++i) {
        const double lse = output.lse->float_data()[i];
        Check(
            std::abs(lse - want.lse[i]) <= 1e-4 * (1.0 + std::abs(want.lse[i])),
            absl::StrCat("lse[", i, "] = ", lse, ", reference ", want.lse[i]));
      }
    }
    CheckSelections(plan, selections, output.topk_indices);
    const std::vector<float> k = StoredAs(s.spec.kv_dtype, plan.k);
    const std::vector<float> v = StoredValues(s, k, plan.v);
    const std::vector<float> index_k = StoredAs(s.spec.kv_dtype, plan.index_k);
    s.k[plan.layer].insert(s.k[plan.layer].end(), k.begin(), k.end());
    s.v[plan.layer].insert(s.v[plan.layer].end(), v.begin(), v.end());
    s.index_k[plan.layer].insert(s.index_k[plan.layer].end(), index_k.begin(),
                                 index_k.end());
  }

  // The selected positions a successful append returned: [T, topk], each
  // row the expected selection padded with -1; none unless asked for.
  void CheckSelections(const PlannedAppend& plan,
                       const std::vector<std::vector<int64_t>>& selections,
                       const std::vector<int64_t>& got) {
    if (!plan.request.return_topk_indices) {
      Check(got.empty(), "selected positions nobody asked for");
      return;
    }
    const int64_t topk = sessions_[plan.session].spec.layers[plan.layer].topk;
    Check(got.size() == selections.size() * topk,
          absl::StrCat(got.size(), " selected positions for ",
                       selections.size(), " rows of top-", topk));
    for (size_t row = 0; row < selections.size(); ++row) {
      std::vector<int64_t> want = selections[row];
      want.resize(topk, -1);
      Check(std::equal(want.begin(), want.end(), got.begin() + row * topk),
            absl::StrCat("row ", row, " selected [",
                         absl::StrJoin(got.begin() + row * topk,
                                       got.begin() + (row + 1) * topk, ","),
                         "], expected [", absl::StrJoin(want, ","), "]"));
    }
  }

  // Whether a failed append's status is one it may fail with.
  bool AllowedFailure(const PlannedAppend& plan, const absl::Status& status) {
    if (plan.session < 0) return absl::IsNotFound(status);
    if (!plan.corrupt.empty() && absl::IsInvalidArgument(status)) {
      return true;
    }
    const ModelSession& s = sessions_[plan.session];
    const int64_t end = s.length(plan.layer) + plan.request.q.shape[0];
    if (end > s.spec.max_tokens) return absl::IsOutOfRange(status);
    return absl::IsResourceExhausted(status);  // the pool is full
  }

  void Touch(int session, bool sure) {
    if (session < 0) return;
    sessions_[session].last_maybe = FuzzClock();
    if (sure) sessions_[session].last_sure = FuzzClock();
  }

  void AppendOne(bool decode) {
    PlannedAppend plan = Plan(decode);
    absl::StatusOr<AttentionOutput> out = engine_.Append(plan.request);
    Touch(plan.session, /*sure=*/true);
    if (out.ok()) {
      Check(plan.session >= 0 && plan.corrupt.empty(),
            absl::StrCat("bad append succeeded: ", plan.corrupt));
      Commit(plan, *out);
    } else {
      Check(AllowedFailure(plan, out.status()),
            absl::StrCat("Append: ", out.status().ToString()));
    }
  }

  void AppendMany(bool atomic) {
    const int n = in_.ConsumeIntegralInRange<int>(1, 4);
    std::vector<PlannedAppend> plans;
    plans.reserve(n);
    for (int i = 0; i < n; ++i) plans.push_back(Plan(/*decode=*/true));
    std::vector<AppendRequest> requests;
    for (const PlannedAppend& plan : plans) requests.push_back(plan.request);
    // Which steps repeat an earlier (session, layer) of the batch.
    std::vector<bool> repeated(n, false);
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < i; ++j) {
        if (requests[j].session_id == requests[i].session_id &&
            requests[j].layer == requests[i].layer) {
          repeated[i] = true;
        }
      }
    }
    if (atomic) {
      absl::StatusOr<std::vector<AttentionOutput>> out =
          engine_.AppendBatch(requests);
      for (const PlannedAppend& plan : plans) Touch(plan.session, out.ok());
      if (out.ok()) {
        Check(static_cast<int>(out->size()) == n, "batch result count");
        for (int i = 0; i < n; ++i) {
          Check(
              plans[i].session >= 0 && plans[i].corrupt.empty() && !repeated[i],
              absl::StrCat("bad batch succeeded: ", plans[i].corrupt));
          Commit(plans[i], (*out)[i]);
        }
      } else {
        // Some step must be entitled to the failure.
        bool explained = false;
        for (int i = 0; i < n; ++i) {
          explained |= repeated[i] || AllowedFailure(plans[i], out.status()) ||
                       absl::IsResourceExhausted(out.status());
        }
        Check(explained,
              absl::StrCat("AppendBatch: ", out.status().ToString()));
      }
      return;
    }
    std::vector<absl::StatusOr<AttentionOutput>> out =
        engine_.AppendEach(requests);
    Check(static_cast<int>(out.size()) == n, "AppendEach result count");
    for (int i = 0; i < n; ++i) {
      Touch(plans[i].session, /*sure=*/true);
      if (out[i].ok()) {
        Check(plans[i].session >= 0 && plans[i].corrupt.empty() && !repeated[i],
              absl::StrCat("bad step succeeded: ", plans[i].corrupt));
        Commit(plans[i], *out[i]);
      } else {
        Check(
            (repeated[i] && absl::IsAborted(out[i].status())) ||
                AllowedFailure(plans[i], out[i].status()),
            absl::StrCat("AppendEach[", i, "]: ", out[i].status().ToString()));
      }
    }
  }

  void Fork() {
    const int parent = PickSession();
    if (parent < 0) return;
    const int64_t before = engine_.stats().active_sessions;
    absl::StatusOr<SessionInfo> info =
        engine_.ForkSession(sessions_[parent].id);
    Touch(parent, /*sure=*/true);
    if (!info.ok()) {
      Check(absl::IsResourceExhausted(info.status()) &&
                before == kMaxLiveSessions,
            absl::StrCat("ForkSession: ", info.status().ToString()));
      return;
    }
    ModelSession child = sessions_[parent];
    child.id = info->session_id;
    child.last_sure = child.last_maybe = FuzzClock();
    sessions_.push_back(std::move(child));
  }

  void Truncate() {
    const int index = PickSession();
    if (index < 0) return;
    ModelSession& s = sessions_[index];
    const int64_t length = in_.ConsumeIntegralInRange<int64_t>(0, kMaxTokens);
    absl::StatusOr<SessionInfo> info = engine_.TruncateSession(s.id, length);
    Touch(index, /*sure=*/true);
    if (!info.ok()) {
      // Only a window layer can lack the keys a truncation needs.
      bool window_cut = false;
      for (int l = 0; l < s.spec.num_layers; ++l) {
        window_cut |= s.spec.layers[l].window > 0 && s.length(l) > length;
      }
      Check(absl::IsFailedPrecondition(info.status()) && window_cut,
            absl::StrCat("TruncateSession: ", info.status().ToString()));
      return;
    }
    const int64_t kv_row = int64_t{s.spec.num_kv_heads} * s.spec.head_dim;
    const int64_t v_row = int64_t{s.spec.num_kv_heads} * s.spec.value_dim;
    for (int l = 0; l < s.spec.num_layers; ++l) {
      if (s.length(l) > length) {
        s.k[l].resize(length * kv_row);
        s.v[l].resize(length * v_row);
        if (s.spec.layers[l].topk > 0) {
          s.index_k[l].resize(length * s.spec.index_dim);
        }
      }
    }
  }

  void RemoveAt(int index, bool delete_it) {
    if (delete_it) {
      absl::Status status = engine_.DeleteSession(sessions_[index].id);
      Check(status.ok(), absl::StrCat("DeleteSession: ", status.ToString()));
      Check(absl::IsNotFound(engine_.DeleteSession(sessions_[index].id)),
            "deleted twice");
    }
    sessions_.erase(sessions_.begin() + index);
  }

  void Delete() {
    const int index = PickSession();
    if (index >= 0) RemoveAt(index, /*delete_it=*/true);
  }

  void Get() {
    const int index = PickSession();
    if (index < 0) return;
    absl::StatusOr<SessionInfo> info = engine_.GetSession(sessions_[index].id);
    Check(info.ok(), absl::StrCat("GetSession: ", info.status().ToString()));
    Touch(index, /*sure=*/true);
  }

  // Advances the clock, then looks every session up: an idle one is gone
  // (the engine expires it on lookup), a live one is used again.
  void Expire() {
    FuzzClock() += absl::Seconds(in_.ConsumeIntegralInRange<int>(0, 120));
    for (int i = static_cast<int>(sessions_.size()) - 1; i >= 0; --i) {
      const ModelSession& s = sessions_[i];
      const bool present = engine_.GetSession(s.id).ok();
      const bool must_expire = FuzzClock() - s.last_maybe > s.timeout;
      const bool must_stay = FuzzClock() - s.last_sure <= s.timeout;
      Check(!(present && must_expire), "an idle session was not expired");
      Check(present || !must_stay, "a recently used session expired");
      if (present) {
        Touch(i, /*sure=*/true);
      } else {
        RemoveAt(i, /*delete_it=*/false);
      }
    }
  }

  // --- invariants ---------------------------------------------------------

  // The engine's sessions are the model's, with the model's lengths, and
  // the pool holds exactly the blocks they reference.
  void CheckState() {
    const std::vector<SessionInfo> live = engine_.ListSessions("", std::numeric_limits<int64_t>::max());
    Check(live.size() == sessions_.size(),
          absl::StrCat(live.size(), " sessions live, model has ",
                       sessions_.size()));
    int64_t referenced_blocks = 0;
    int64_t most_blocks = 0;
    std::vector<int64_t> groups;
    bool shared = false;
    for (const ModelSession& s : sessions_) {
      auto it = std::find_if(
          live.begin(), live.end(),
          [&](const SessionInfo& info) { return info.session_id == s.id; });
      Check(it != live.end(), "a session vanished");
      std::vector<int64_t> lengths;
      for (int l = 0; l < s.spec.num_layers; ++l) {
        lengths.push_back(s.length(l));
      }
      Check(
          it->layer_lengths == lengths,
          absl::StrCat("layer lengths [", absl::StrJoin(it->layer_lengths, ","),
                       "], model [", absl::StrJoin(lengths, ","), "]"));
      Check(it->kv_cache_bytes % kBlockBytes == 0, "partial block");
      const int64_t blocks = it->kv_cache_bytes / kBlockBytes;
      referenced_blocks += blocks;
      most_blocks = std::max(most_blocks, blocks);
      shared |=
          std::find(groups.begin(), groups.end(), s.group) != groups.end();
      groups.push_back(s.group);
    }
    const EngineStats stats = engine_.stats();
    Check(stats.active_sessions == static_cast<int64_t>(sessions_.size()),
          "active_sessions");
    Check(stats.pool.blocks_total == kPoolBlocks, "blocks_total");
    const int64_t used = stats.pool.blocks_used;
    Check(stats.pool.used_bytes == used * kBlockBytes, "used_bytes");
    // Forks share blocks, so sessions of one group may count a block twice.
    if (shared) {
      Check(used >= most_blocks && used <= referenced_blocks,
            absl::StrCat(used, " blocks used, sessions reference ", most_blocks,
                         "..", referenced_blocks));
    } else {
      Check(used == referenced_blocks,
            absl::StrCat(used, " blocks used, sessions reference ",
                         referenced_blocks));
    }
  }

  FuzzedDataProvider& in_;
  AttentionEngine& engine_;
  std::vector<ModelSession> sessions_;
  int64_t next_group_ = 0;
};

}  // namespace
}  // namespace attention::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  attention::fuzz::EngineOpsFuzzer(in).Run();
  return 0;
}
