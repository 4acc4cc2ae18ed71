#include "tests/server/test_server.h"

#include <grpcpp/generic/generic_stub.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "client/tensor_codec.h"

namespace attention::testing {

server::ServerOptions TestServerOptions() {
  server::ServerOptions options;
  options.listen_address = "127.0.0.1";
  options.port = 0;
  options.backend = "cpu";
  options.threads = 2;
  options.kv_cache_bytes = int64_t{64} << 20;
  options.kv_block_bytes = 4096;
  options.session_reap_interval = absl::Milliseconds(50);
  options.drain_timeout = absl::Seconds(2);
  return options;
}

absl::StatusOr<std::unique_ptr<TestServer>> StartTestServer(
    const server::ServerOptions& options) {
  auto server = server::AttentionServer::Start(options);
  if (!server.ok()) return server.status();
  auto test_server = std::make_unique<TestServer>();
  test_server->server = *std::move(server);
  client::ClientOptions client_options;
  client_options.call_timeout = absl::Seconds(60);
  test_server->client = client::AttentionClient::Connect(
      test_server->server->local_target(), client_options);
  return test_server;
}

v1::SessionSpec MakeSpec(int num_layers, int num_q_heads, int num_kv_heads,
                         int head_dim, std::vector<int> windows,
                         v1::DType kv_dtype) {
  v1::SessionSpec spec;
  spec.set_num_layers(num_layers);
  spec.set_num_q_heads(num_q_heads);
  spec.set_num_kv_heads(num_kv_heads);
  spec.set_head_dim(head_dim);
  spec.set_kv_dtype(kv_dtype);
  for (int window : windows) spec.add_layers()->set_window(window);
  return spec;
}

std::vector<float> RandomFloats(int64_t count, uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uniform(-scale, scale);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = uniform(rng);
  return values;
}

absl::Span<const float> Tokens::q_rows(int64_t begin, int64_t rows) const {
  const int64_t width = heads * head_dim;
  return absl::MakeConstSpan(q).subspan(begin * width, rows * width);
}
absl::Span<const float> Tokens::k_rows(int64_t begin, int64_t rows) const {
  const int64_t width = kv_heads * head_dim;
  return absl::MakeConstSpan(k).subspan(begin * width, rows * width);
}
absl::Span<const float> Tokens::v_rows(int64_t begin, int64_t rows) const {
  const int64_t width = kv_heads * value_dim;
  return absl::MakeConstSpan(v).subspan(begin * width, rows * width);
}

Tokens RandomTokens(const v1::SessionSpec& spec, int64_t count, uint32_t seed) {
  Tokens tokens;
  tokens.count = count;
  tokens.heads = spec.num_q_heads();
  tokens.kv_heads = spec.num_kv_heads();
  tokens.head_dim = spec.head_dim();
  tokens.value_dim = spec.value_dim() > 0 ? spec.value_dim() : spec.head_dim();
  tokens.q = RandomFloats(count * tokens.heads * tokens.head_dim, seed);
  tokens.k = RandomFloats(count * tokens.kv_heads * tokens.head_dim,
                          seed * 7919u + 1u);
  tokens.v = RandomFloats(count * tokens.kv_heads * tokens.value_dim,
                          seed * 104729u + 2u);
  return tokens;
}

v1::AttentionRequest StatelessRequestFor(const Tokens& tokens,
                                         const v1::SessionSpec& spec, int layer,
                                         v1::DType kv_dtype) {
  v1::AttentionRequest request;
  *request.mutable_q() = *client::MakeTensor(
      tokens.q, {tokens.count, tokens.heads, tokens.head_dim});
  *request.mutable_k() = *client::MakeTensor(
      tokens.k, {tokens.count, tokens.kv_heads, tokens.head_dim}, kv_dtype);
  *request.mutable_v() = *client::MakeTensor(
      tokens.v, {tokens.count, tokens.kv_heads, tokens.value_dim}, kv_dtype);
  request.set_causal(true);
  request.set_scale(spec.scale());
  if (layer < spec.layers_size()) {
    const v1::LayerSpec& layer_spec = spec.layers(layer);
    request.set_window(layer_spec.window());
    request.set_num_sink_tokens(layer_spec.num_sink_tokens());
    *request.mutable_sink_logits() = layer_spec.sink_logits();
  }
  return request;
}

v1::AttentionRequest LargeReplyRequest() {
  v1::AttentionRequest request;
  const int64_t tokens = 4000;
  for (v1::Tensor* tensor :
       {request.mutable_q(), request.mutable_k(), request.mutable_v()}) {
    tensor->set_dtype(v1::DTYPE_FLOAT16);
    for (int64_t dim : {tokens, int64_t{1}, int64_t{1}}) tensor->add_shape(dim);
    tensor->set_data(std::string(tokens * 2, '\0'));
  }
  request.set_return_weights(true);
  return request;
}

std::string RowBytes(const v1::Tensor& tensor, int64_t begin, int64_t rows) {
  int64_t row_bytes = client::DTypeBytes(tensor.dtype());
  for (int i = 1; i < tensor.shape_size(); ++i) row_bytes *= tensor.shape(i);
  if ((begin + rows) * row_bytes > static_cast<int64_t>(tensor.data().size())) {
    ADD_FAILURE() << "rows [" << begin << ", " << begin + rows
                  << ") are outside the tensor";
    return "";
  }
  return tensor.data().substr(begin * row_bytes, rows * row_bytes);
}

absl::StatusOr<StateSnapshot> Snapshot(client::AttentionClient& client,
                                       const std::string& session_id) {
  StateSnapshot snapshot;
  auto info = client.GetSession(session_id);
  if (!info.ok()) return info.status();
  snapshot.layer_lengths.assign(info->layer_lengths().begin(),
                                info->layer_lengths().end());
  snapshot.kv_cache_bytes = info->kv_cache_bytes();
  auto server_info = client.GetServerInfo();
  if (!server_info.ok()) return server_info.status();
  snapshot.kv_cache_used_bytes = server_info->kv_cache_used_bytes();
  snapshot.active_sessions = server_info->active_sessions();
  return snapshot;
}

std::string ToString(const StateSnapshot& snapshot) {
  return absl::StrCat("lengths [", absl::StrJoin(snapshot.layer_lengths, ","),
                      "] session bytes ", snapshot.kv_cache_bytes,
                      " pool used ", snapshot.kv_cache_used_bytes, " sessions ",
                      snapshot.active_sessions);
}

ReferenceResult ReferenceAttention(const ReferenceProblem& p) {
  ReferenceResult result;
  result.output.assign(p.tq * p.heads * p.value_dim, 0.0);
  result.lse.assign(p.tq * p.heads, 0.0);
  result.weights.assign(p.heads * p.tq * p.tk, 0.0);
  const double scale = p.scale != 0.0
                           ? p.scale
                           : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  const int64_t group = p.heads / p.kv_heads;
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < p.tq; ++i) {
    const int64_t pos = p.query_start + i;
    for (int64_t h = 0; h < p.heads; ++h) {
      const int64_t g = h / group;
      std::vector<double> logits(p.tk, kNegInf);
      double max_logit = kNegInf;
      for (int64_t j = 0; j < p.tk; ++j) {
        const bool visible =
            (!p.causal || j <= pos) &&
            (p.window == 0 || pos - j < p.window || j < p.num_sink_tokens);
        if (!visible) continue;
        double dot = 0.0;
        for (int64_t d = 0; d < p.head_dim; ++d) {
          dot += static_cast<double>(p.q[(i * p.heads + h) * p.head_dim + d]) *
                 p.k[(j * p.kv_heads + g) * p.head_dim + d];
        }
        double logit = dot * scale;
        if (!p.bias.empty()) logit += p.bias[(h * p.tq + i) * p.tk + j];
        logits[j] = logit;
        max_logit = std::max(max_logit, logit);
      }
      const bool has_sink = !p.sink_logits.empty();
      if (has_sink) max_logit = std::max<double>(max_logit, p.sink_logits[h]);
      if (max_logit == kNegInf) {
        result.lse[i * p.heads + h] = kNegInf;
        continue;
      }
      double denominator =
          has_sink ? std::exp(p.sink_logits[h] - max_logit) : 0.0;
      for (int64_t j = 0; j < p.tk; ++j) {
        if (logits[j] != kNegInf)
          denominator += std::exp(logits[j] - max_logit);
      }
      result.lse[i * p.heads + h] = max_logit + std::log(denominator);
      for (int64_t j = 0; j < p.tk; ++j) {
        if (logits[j] == kNegInf) continue;
        const double weight = std::exp(logits[j] - max_logit) / denominator;
        result.weights[(h * p.tq + i) * p.tk + j] = weight;
        for (int64_t d = 0; d < p.value_dim; ++d) {
          result.output[(i * p.heads + h) * p.value_dim + d] +=
              weight * p.v[(j * p.kv_heads + g) * p.value_dim + d];
        }
      }
    }
  }
  return result;
}

std::vector<float> RoundThrough(absl::Span<const float> values,
                                v1::DType dtype) {
  auto tensor =
      client::MakeTensor(values, {static_cast<int64_t>(values.size())}, dtype);
  if (!tensor.ok()) {
    ADD_FAILURE() << tensor.status();
    return {};
  }
  return *client::TensorToFloats(*tensor);
}

std::vector<float> Floats(const v1::Tensor& tensor) {
  auto values = client::TensorToFloats(tensor);
  if (!values.ok()) {
    ADD_FAILURE() << values.status();
    return {};
  }
  return *std::move(values);
}

grpc::Status RawUnaryCall(const std::shared_ptr<grpc::Channel>& channel,
                          const std::string& method, const std::string& bytes,
                          const std::string& authorization) {
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  if (!authorization.empty())
    context.AddMetadata("authorization", authorization);
  grpc::Slice slice(bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  grpc::Status status;
  bool done = false;
  absl::Mutex mu;
  stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   absl::MutexLock lock(&mu);
                   status = std::move(s);
                   done = true;
                 });
  absl::MutexLock lock(&mu);
  mu.Await(absl::Condition(&done));
  return status;
}

}  // namespace attention::testing
