// attnctl: command-line tool for attention-service.
//
//   attnctl info                      server version, backend, KV pool usage
//   attnctl demo                      session + prefill + streamed decode,
//                                     checked against stateless attention
//   attnctl plan --preset=NAME | --num_layers=... [--context=N]
//                                     KV-cache bytes per token and context
//   attnctl health                    grpc.health.v1 check; exit codes like
//                                     grpc_health_probe (0 serving, 1 bad
//                                     flags or files, 2 cannot connect, 3 RPC
//                                     failed, 4 not serving)
//   attnctl cluster --cluster=T       the replicas of a fleet: address, state,
//                                     sessions, KV used/capacity, version
//
// Against a server with TLS: --tls_ca_file (and --tls_server_name when the
// certificate names another host; --tls_cert_file/--tls_key_file for mutual
// TLS). With bearer tokens: --auth_token_file (a file holding the token).
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "client/cluster_client.h"
#include "core/dtype.h"
#include "core/kv_size.h"
#include "core/read_file.h"
#include "core/session_spec.h"

ABSL_FLAG(std::string, target, "localhost:50051",
          "attention-server address (host:port).");
ABSL_FLAG(std::string, cluster, "",
          "A fleet of replicas: a DNS name resolving to them (name:port, e.g. "
          "the headless Service) or a list host:port,host:port. Used by "
          "`cluster` (default: --target) and `export` (finds the session's "
          "replica).");
ABSL_FLAG(absl::Duration, timeout, absl::Seconds(10),
          "Deadline for connecting and for each call.");
ABSL_FLAG(bool, tls, false,
          "Use TLS, verifying the server against the system's roots (implied "
          "by any --tls_* file or name).");
ABSL_FLAG(std::string, tls_ca_file, "",
          "PEM CA certificates that verify the server (turns on TLS).");
ABSL_FLAG(std::string, tls_cert_file, "",
          "PEM client certificate for mutual TLS (with --tls_key_file).");
ABSL_FLAG(std::string, tls_key_file, "", "PEM key of --tls_cert_file.");
ABSL_FLAG(std::string, tls_server_name, "",
          "Name the server certificate must carry, when not the target's "
          "host.");
ABSL_FLAG(std::string, auth_token_file, "",
          "File holding the bearer token sent with every call (a file, so "
          "that the token shows in no process list).");
// plan
ABSL_FLAG(std::string, preset, "",
          "plan: model preset (gpt-oss-120b, llama-3.3-70b, qwen2.5-7b, "
          "deepseek-v3, deepseek-v3.2, kimi-k2); "
          "explicit flags override its fields.");
ABSL_FLAG(int32_t, num_layers, 0, "plan: transformer layers.");
ABSL_FLAG(int32_t, num_q_heads, 0, "plan: query heads (0 = num_kv_heads).");
ABSL_FLAG(int32_t, num_kv_heads, 0, "plan: key/value heads.");
ABSL_FLAG(int32_t, head_dim, 0, "plan: key dimension.");
ABSL_FLAG(int32_t, value_dim, 0, "plan: value dimension (0 = head_dim).");
ABSL_FLAG(std::string, kv_dtype, "",
          "plan: KV storage dtype (float32, float16, bfloat16; default "
          "bfloat16). demo: session kv_dtype (default float32).");
ABSL_FLAG(std::string, window_pattern, "",
          "plan: comma-separated windows repeated over the layers, 0 = full "
          "(e.g. \"128,0\" alternates window-128 and full layers).");
ABSL_FLAG(int32_t, num_sink_tokens, 0,
          "plan: StreamingLLM sink tokens of every window layer.");
ABSL_FLAG(int64_t, context, 131072, "plan: context length in tokens.");
ABSL_FLAG(std::string, kv_layout, "",
          "plan: separate (K and V, default) or latent (MLA: one vector of "
          "latent_dim + rope_dim per token, one KV head).");
ABSL_FLAG(int32_t, latent_dim, 0,
          "plan: MLA latent dimension (the values); with --kv_layout=latent.");
ABSL_FLAG(int32_t, rope_dim, 0,
          "plan: MLA decoupled RoPE key dimension; with --kv_layout=latent.");
ABSL_FLAG(int32_t, mha_head_dim, 0,
          "plan: per-head dimension of the MHA equivalent an MLA model is "
          "compared with (e.g. 128 for DeepSeek-V3).");
ABSL_FLAG(int32_t, topk, 0,
          "plan: top-k sparse attention on every layer (0 = dense).");
ABSL_FLAG(int32_t, index_dim, 0,
          "plan: index key dimension of top-k layers (stored per token).");
ABSL_FLAG(int32_t, index_heads, 0, "plan: index query heads of top-k layers.");
// demo
ABSL_FLAG(int32_t, prompt_tokens, 8, "demo: prompt length.");
ABSL_FLAG(int32_t, decode_steps, 8, "demo: streamed decode steps per layer.");
ABSL_FLAG(uint32_t, seed, 1, "demo: random seed of the synthetic q/k/v.");
ABSL_FLAG(bool, keep_session, false,
          "demo: keep the session instead of deleting it (its id is "
          "printed).");
ABSL_FLAG(std::string, session, "", "export: the session to export.");
ABSL_FLAG(std::string, out, "", "export: the snapshot file to write.");
ABSL_FLAG(std::string, in, "", "import: the snapshot file to read.");
ABSL_FLAG(bool, keep_id, false,
          "import: keep the exported session id (fails if it is taken, and "
          "on a server that authenticates tenants).");

namespace attention::attnctl {
namespace {

namespace v1 = ::attention::v1;
using client::AttentionClient;
using client::ClientOptions;

absl::StatusOr<ClientOptions> ClientOptionsFromFlags() {
  ClientOptions options;
  options.call_timeout = absl::GetFlag(FLAGS_timeout);
  if (options.call_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--timeout ", absl::FormatDuration(options.call_timeout),
                     " must be positive (e.g. 10s)"));
  }
  options.tls = absl::GetFlag(FLAGS_tls);
  options.tls_ca_file = absl::GetFlag(FLAGS_tls_ca_file);
  options.tls_cert_file = absl::GetFlag(FLAGS_tls_cert_file);
  options.tls_key_file = absl::GetFlag(FLAGS_tls_key_file);
  options.tls_server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (const std::string path = absl::GetFlag(FLAGS_auth_token_file);
      !path.empty()) {
    absl::StatusOr<std::string> token =
        ReadFile(path, "--auth_token_file", ReadFileFrom::kAnyFile);
    if (!token.ok()) return token.status();
    options.auth_token = std::string(absl::StripAsciiWhitespace(*token));
  }
  return options;
}

absl::StatusOr<std::unique_ptr<AttentionClient>> MakeClient() {
  absl::StatusOr<ClientOptions> options = ClientOptionsFromFlags();
  if (!options.ok()) return options.status();
  return AttentionClient::Open(absl::GetFlag(FLAGS_target), *options);
}

// A ClusterClient on --cluster (default --target), probing with --timeout.
absl::StatusOr<std::unique_ptr<client::ClusterClient>> MakeClusterClient() {
  client::ClusterOptions options;
  absl::StatusOr<ClientOptions> client_options = ClientOptionsFromFlags();
  if (!client_options.ok()) return client_options.status();
  options.client = *client_options;
  options.client.retry_max_attempts = 1;
  options.probe_timeout = absl::GetFlag(FLAGS_timeout);
  options.refresh_interval = absl::Hours(1);  // one look is enough here
  std::string target = absl::GetFlag(FLAGS_cluster);
  if (target.empty()) target = absl::GetFlag(FLAGS_target);
  return client::ClusterClient::Open(target, options);
}

int Fail(const absl::Status& status, absl::string_view doing) {
  std::cerr << "attnctl: " << doing << ": " << status << std::endl;
  return 1;
}

// "4.504 GiB", "320 KiB", "12 bytes".
std::string HumanBytes(int64_t bytes) {
  static constexpr const char* kUnits[] = {"KiB", "MiB", "GiB", "TiB"};
  if (bytes < 1024) return absl::StrCat(bytes, " bytes");
  double value = static_cast<double>(bytes);
  int unit = -1;
  while (value >= 1024.0 && unit < 3) {
    value /= 1024.0;
    ++unit;
  }
  std::string text = absl::StrFormat("%.3f", value);
  text.erase(text.find_last_not_of('0') + 1);
  if (text.back() == '.') text.pop_back();
  return absl::StrCat(text, " ", kUnits[unit]);
}

// ---------------------------------------------------------------------------
// info

int RunInfo() {
  auto made = MakeClient();
  if (!made.ok()) return Fail(made.status(), "connecting");
  std::unique_ptr<AttentionClient> client = *std::move(made);
  auto info = client->GetServerInfo();
  if (!info.ok()) return Fail(info.status(), "GetServerInfo");
  std::cout << "version:            " << info->version() << "\n"
            << "backend:            " << info->backend() << "\n"
            << "device:             " << info->device() << "\n"
            << "kv cache capacity:  " << info->kv_cache_capacity_bytes()
            << " bytes (" << HumanBytes(info->kv_cache_capacity_bytes())
            << ")\n"
            << "kv cache used:      " << info->kv_cache_used_bytes()
            << " bytes (" << HumanBytes(info->kv_cache_used_bytes()) << ")\n"
            << "active sessions:    " << info->active_sessions() << "\n"
            << "max message bytes:  " << info->max_message_bytes() << " ("
            << HumanBytes(info->max_message_bytes()) << ")\n"
            << "tenant:             " << info->tenant() << "\n"
            << "tenant sessions:    " << info->tenant_sessions()
            << (info->has_tenant_max_sessions()
                    ? absl::StrCat(" of ", info->tenant_max_sessions())
                    : std::string())
            << "\n"
            << "tenant kv bytes:    " << info->tenant_kv_bytes()
            << (info->has_tenant_max_kv_bytes()
                    ? absl::StrCat(" of ", info->tenant_max_kv_bytes())
                    : std::string())
            << std::endl;
  return 0;
}

// ---------------------------------------------------------------------------
// health

int RunHealth() {
  auto made = MakeClient();
  if (!made.ok()) {
    // Our own configuration (a TLS or token file, a flag), not the server:
    // a probe tells the two apart by the exit code.
    std::cerr << "attnctl health: " << made.status() << std::endl;
    return 1;
  }
  std::unique_ptr<AttentionClient> client = *std::move(made);
  const absl::Duration timeout = absl::GetFlag(FLAGS_timeout);
  if (absl::Status connected = client->WaitForConnected(timeout);
      !connected.ok()) {
    std::cerr << "attnctl health: cannot connect to "
              << absl::GetFlag(FLAGS_target) << ": " << connected.message()
              << std::endl;
    return 2;
  }
  auto status = client->CheckHealth();
  if (!status.ok()) {
    std::cerr << "attnctl health: health check RPC failed: " << status.status()
              << std::endl;
    return 3;
  }
  if (*status != client::ServingStatus::kServing) {
    std::cout << "status: NOT_SERVING" << std::endl;
    return 4;
  }
  std::cout << "status: SERVING" << std::endl;
  return 0;
}

// ---------------------------------------------------------------------------
// cluster

// "12 KiB / 16 MiB (0.1%)".
std::string KvUsage(const v1::ServerInfo& info) {
  const int64_t capacity = info.kv_cache_capacity_bytes();
  const int64_t used = info.kv_cache_used_bytes();
  return absl::StrFormat(
      "%s / %s (%.1f%%)", HumanBytes(used), HumanBytes(capacity),
      capacity > 0 ? 100.0 * static_cast<double>(used) / capacity : 0.0);
}

// Exit 0 when some replica is SERVING, 1 otherwise.
int RunCluster() {
  auto made = MakeClusterClient();
  if (!made.ok()) return Fail(made.status(), "cluster");
  const std::vector<client::ReplicaStatus> replicas = (*made)->Replicas();
  std::cout << absl::StrFormat("%-32s %-12s %8s  %-30s %s\n", "REPLICA",
                               "STATE", "SESSIONS", "KV USED / CAPACITY",
                               "VERSION");
  int serving = 0;
  for (const client::ReplicaStatus& replica : replicas) {
    const bool answered =
        replica.state != client::ReplicaStatus::State::kUnreachable &&
        replica.info.kv_cache_capacity_bytes() > 0;
    serving += replica.state == client::ReplicaStatus::State::kServing;
    std::string address = replica.address;
    if (replica.address != replica.dialed) {
      absl::StrAppend(&address, " (", replica.dialed, ")");
    }
    if (!replica.listed) absl::StrAppend(&address, " [not listed]");
    std::cout << absl::StrFormat(
        "%-32s %-12s %8s  %-30s %s%s\n", address,
        client::ReplicaStateName(replica.state),
        answered ? absl::StrCat(replica.info.active_sessions()) : "-",
        answered ? KvUsage(replica.info) : "-",
        answered ? replica.info.version() : "-",
        replica.error.empty() ? "" : absl::StrCat("  ", replica.error));
  }
  std::cout << replicas.size() << " replicas, " << serving << " SERVING"
            << std::endl;
  return serving > 0 ? 0 : 1;
}

// ---------------------------------------------------------------------------
// plan

struct Preset {
  int32_t num_layers;
  int32_t num_q_heads;
  int32_t num_kv_heads;
  int32_t head_dim;
  const char* window_pattern;
  const char* kv_dtype;
  // MLA (shared latent): head_dim = latent_dim + rope_dim, value_dim =
  // latent_dim; 0 = a separate K/V layout.
  int32_t latent_dim = 0;
  int32_t mha_head_dim = 0;
  // Top-k sparse layers (DeepSeek-V3.2's indexer); 0 = dense.
  int32_t topk = 0;
  int32_t index_dim = 0;
  int32_t index_heads = 0;
};

const std::map<std::string, Preset>& Presets() {
  // Public model configurations; gpt-oss alternates window-128 and full
  // layers. DeepSeek-V3/R1 and Kimi K2 cache a 512 + 64 latent (MLA);
  // DeepSeek-V3.2 adds a lightning indexer (64 heads of 128, top-2048).
  static const auto* presets = new std::map<std::string, Preset>{
      {"gpt-oss-120b", {36, 64, 8, 64, "128,0", "bfloat16"}},
      {"llama-3.3-70b", {80, 64, 8, 128, "0", "bfloat16"}},
      {"qwen2.5-7b", {28, 28, 4, 128, "0", "bfloat16"}},
      {"deepseek-v3", {61, 128, 1, 512 + 64, "0", "bfloat16", 512, 128}},
      {"deepseek-v3.2",
       {61, 128, 1, 512 + 64, "0", "bfloat16", 512, 128, 2048, 128, 64}},
      {"kimi-k2", {61, 64, 1, 512 + 64, "0", "bfloat16", 512, 128}},
  };
  return *presets;
}

// What plan accepts before sizing anything: more layers than any model has,
// and a latent row of at most 2^20 elements.
constexpr int32_t kMaxPlanLayers = 1 << 16;
constexpr int64_t kMaxPlanDim = 1 << 20;

absl::StatusOr<SessionSpec> PlanSpecFromFlags() {
  SessionSpec spec;
  int32_t topk = 0;
  std::string window_pattern = "0";
  std::string kv_dtype = "bfloat16";
  const std::string preset_name = absl::GetFlag(FLAGS_preset);
  if (!preset_name.empty()) {
    auto it = Presets().find(preset_name);
    if (it == Presets().end()) {
      std::vector<std::string> names;
      for (const auto& [name, unused] : Presets()) names.push_back(name);
      return absl::InvalidArgumentError(
          absl::StrCat("unknown --preset ", preset_name, "; choose one of ",
                       absl::StrJoin(names, ", ")));
    }
    const Preset& preset = it->second;
    spec.num_layers = preset.num_layers;
    spec.num_q_heads = preset.num_q_heads;
    spec.num_kv_heads = preset.num_kv_heads;
    spec.head_dim = preset.head_dim;
    window_pattern = preset.window_pattern;
    kv_dtype = preset.kv_dtype;
    spec.model = preset_name;
    if (preset.latent_dim > 0) {
      spec.kv_layout = KvLayout::kSharedLatent;
      spec.value_dim = preset.latent_dim;
    }
    topk = preset.topk;
    spec.index_dim = preset.index_dim;
    spec.index_heads = preset.index_heads;
  }
  const std::string layout = absl::GetFlag(FLAGS_kv_layout);
  if (layout == "latent") {
    spec.kv_layout = KvLayout::kSharedLatent;
  } else if (layout == "separate") {
    spec.kv_layout = KvLayout::kSeparate;
  } else if (!layout.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_layout must be separate or latent, got \"", layout, "\""));
  }
  if (spec.kv_layout == KvLayout::kSharedLatent) {
    const int32_t latent = absl::GetFlag(FLAGS_latent_dim);
    const int32_t rope = absl::GetFlag(FLAGS_rope_dim);
    if (latent > 0) {
      if (rope < 0 || int64_t{latent} + rope > kMaxPlanDim) {
        return absl::InvalidArgumentError(
            absl::StrCat("--latent_dim + --rope_dim must be at most ",
                         kMaxPlanDim, " (and --rope_dim >= 0)"));
      }
      spec.head_dim = latent + rope;
      spec.value_dim = latent;
    } else if (rope > 0) {
      return absl::InvalidArgumentError("--rope_dim needs --latent_dim");
    }
    if (spec.num_kv_heads == 0) spec.num_kv_heads = 1;
    // A latent spec must name its scale; plan only sizes the cache, which
    // the scale does not change.
    spec.scale = 1.0f;
  }
  if (int32_t v = absl::GetFlag(FLAGS_topk); v != 0) topk = v;
  if (int32_t v = absl::GetFlag(FLAGS_index_dim); v != 0) spec.index_dim = v;
  if (int32_t v = absl::GetFlag(FLAGS_index_heads); v != 0) {
    spec.index_heads = v;
  }
  if (int32_t v = absl::GetFlag(FLAGS_num_layers); v != 0) spec.num_layers = v;
  if (int32_t v = absl::GetFlag(FLAGS_num_kv_heads); v != 0) {
    spec.num_kv_heads = v;
  }
  if (int32_t v = absl::GetFlag(FLAGS_num_q_heads); v != 0) {
    spec.num_q_heads = v;
  }
  if (spec.num_q_heads == 0) spec.num_q_heads = spec.num_kv_heads;
  if (int32_t v = absl::GetFlag(FLAGS_head_dim); v != 0) spec.head_dim = v;
  if (int32_t v = absl::GetFlag(FLAGS_value_dim); v != 0) spec.value_dim = v;
  if (!absl::GetFlag(FLAGS_kv_dtype).empty()) {
    kv_dtype = absl::GetFlag(FLAGS_kv_dtype);
  }
  if (!absl::GetFlag(FLAGS_window_pattern).empty()) {
    window_pattern = absl::GetFlag(FLAGS_window_pattern);
  }
  if (spec.num_layers <= 0 || spec.num_kv_heads <= 0 || spec.head_dim <= 0) {
    return absl::InvalidArgumentError(
        "plan needs --preset or --num_layers, --num_kv_heads and --head_dim");
  }
  // Bounded before a LayerSpec is made per layer.
  if (spec.num_layers > kMaxPlanLayers) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num_layers ", spec.num_layers, " is over ", kMaxPlanLayers));
  }
  auto dtype = ParseDType(kv_dtype);
  if (!dtype.ok()) return dtype.status();
  spec.kv_dtype = *dtype;

  std::vector<int32_t> windows;
  for (absl::string_view part : absl::StrSplit(window_pattern, ',')) {
    int32_t window = 0;
    if (!absl::SimpleAtoi(part, &window) || window < 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--window_pattern \"", window_pattern,
          "\" must be comma-separated non-negative integers (0 = full)"));
    }
    windows.push_back(window);
  }
  const int32_t sinks = absl::GetFlag(FLAGS_num_sink_tokens);
  for (int32_t layer = 0; layer < spec.num_layers; ++layer) {
    LayerSpec& layer_spec = spec.layers.emplace_back();
    layer_spec.window = windows[layer % windows.size()];
    layer_spec.num_sink_tokens = layer_spec.window > 0 ? sinks : 0;
    layer_spec.topk = topk;
  }
  return spec;
}

// The MHA-equivalent head dimension of the chosen preset (0 = none).
int32_t PresetMhaHeadDim() {
  auto it = Presets().find(absl::GetFlag(FLAGS_preset));
  return it == Presets().end() ? 0 : it->second.mha_head_dim;
}

int RunPlan() {
  auto spec = PlanSpecFromFlags();
  if (!spec.ok()) return Fail(spec.status(), "plan");
  const int64_t context = absl::GetFlag(FLAGS_context);
  if (context < 0) {
    return Fail(absl::InvalidArgumentError("--context must be >= 0"), "plan");
  }
  SpecLimits limits;
  limits.max_tokens_limit = std::max(limits.max_tokens_limit, context);
  limits.max_layers = std::max(limits.max_layers, spec->num_layers);
  auto resolved = ResolveSessionSpec(*spec, limits);
  if (!resolved.ok()) return Fail(resolved.status(), "plan");
  // The byte counts are int64: bound the flags they multiply.
  const int64_t per_token = PlanKvSize(*resolved, 0).bytes_per_token_all_full;
  if (per_token > 0 &&
      context > std::numeric_limits<int64_t>::max() / per_token) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
                    "--context ", context, " at ", per_token,
                    " bytes per token would pass 2^63 bytes; use a "
                    "smaller --context")),
                "plan");
  }
  if (absl::GetFlag(FLAGS_mha_head_dim) > limits.max_head_dim) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
                    "--mha_head_dim must be at most ", limits.max_head_dim)),
                "plan");
  }
  const KvSizePlan plan = PlanKvSize(*resolved, context);

  auto line = [](absl::string_view label, absl::string_view value) {
    std::cout << absl::StrFormat("%-42s %s\n", label, value);
  };
  auto bytes = [](int64_t count, absl::string_view suffix) {
    return absl::StrCat(count, " bytes (", HumanBytes(count), suffix, ")");
  };
  line("model:", resolved->model.empty() ? "(custom)" : resolved->model);
  line("layers:",
       absl::StrCat(resolved->num_layers, " (", plan.full_layers, " full, ",
                    plan.window_layers, " sliding-window)"));
  line("heads:", absl::StrCat(resolved->num_q_heads, " query, ",
                              resolved->num_kv_heads, " key/value"));
  line("head_dim / value_dim:",
       absl::StrCat(resolved->head_dim, " / ", resolved->value_dim));
  line("kv_dtype:", DTypeName(resolved->kv_dtype));
  const bool latent = resolved->kv_layout == KvLayout::kSharedLatent;
  if (latent) {
    line("kv_layout:",
         absl::StrCat("shared latent (MLA): latent ", resolved->value_dim,
                      " + rope ", resolved->head_dim - resolved->value_dim));
  }
  line("KV per token per layer:",
       bytes(plan.bytes_per_token_per_layer, "/token"));
  if (plan.sparse_layers > 0) {
    line("top-k sparse layers:",
         absl::StrCat(plan.sparse_layers, " (top-",
                      resolved->layers.front().topk, ", index ",
                      resolved->index_heads, " heads x ", resolved->index_dim,
                      ")"));
    line("index keys per token per sparse layer:",
         bytes(plan.index_bytes_per_token_per_layer, "/token"));
    line("index keys per token (all layers):",
         bytes(plan.index_bytes_per_token_per_layer * plan.sparse_layers,
               "/token"));
  }
  line("KV per token (all layers):",
       bytes(plan.bytes_per_token_all_full, "/token"));
  const int32_t mha_head_dim = absl::GetFlag(FLAGS_mha_head_dim) > 0
                                   ? absl::GetFlag(FLAGS_mha_head_dim)
                                   : PresetMhaHeadDim();
  if (latent && mha_head_dim > 0) {
    // The seeds' comparison: latent cache against K + V of every query
    // head at the pre-absorption head dimension (index keys excluded).
    const int64_t mha = MhaEquivalentBytesPerToken(*resolved, mha_head_dim);
    const int64_t latent_bytes =
        plan.bytes_per_token_per_layer * resolved->num_layers;
    line(absl::StrCat("MHA equivalent (", resolved->num_q_heads, " heads x ",
                      mha_head_dim, ", K+V):"),
         bytes(mha, "/token"));
    line("MHA equivalent / latent:",
         absl::StrFormat("\u00d7%.1f", static_cast<double>(mha) / latent_bytes));
  }
  line(absl::StrCat("KV at ", context, " tokens:"),
       bytes(plan.context_bytes, ""));
  line(absl::StrCat("KV at ", context, " tokens, every layer full:"),
       bytes(plan.context_bytes_all_full, ""));
  std::cout << "(window layers keep only window + sink tokens)" << std::endl;
  return 0;
}

// ---------------------------------------------------------------------------
// demo

std::vector<float> RandomValues(std::mt19937& rng, int64_t count) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values) value = uniform(rng);
  return values;
}

int RunDemo() {
  auto made = MakeClient();
  if (!made.ok()) return Fail(made.status(), "connecting");
  std::unique_ptr<AttentionClient> client = *std::move(made);
  const int32_t prompt = absl::GetFlag(FLAGS_prompt_tokens);
  const int32_t steps = absl::GetFlag(FLAGS_decode_steps);
  // A check of the service, not a load test: its tensors stay small.
  constexpr int64_t kMaxDemoTokens = 1 << 14;
  if (prompt < 1 || steps < 0 || int64_t{prompt} + steps > kMaxDemoTokens) {
    return Fail(absl::InvalidArgumentError(absl::StrCat(
                    "--prompt_tokens must be >= 1, --decode_steps >= 0, and "
                    "the two together at most ",
                    kMaxDemoTokens)),
                "demo");
  }
  v1::DType kv_dtype = v1::DTYPE_FLOAT32;
  if (std::string name = absl::GetFlag(FLAGS_kv_dtype); !name.empty()) {
    auto parsed = ParseDType(name);
    if (!parsed.ok()) return Fail(parsed.status(), "demo");
    kv_dtype = static_cast<v1::DType>(static_cast<int>(*parsed));
  }

  // Two layers: full causal, and a sliding window with StreamingLLM sinks.
  v1::SessionSpec spec;
  spec.set_num_layers(2);
  spec.set_num_q_heads(4);
  spec.set_num_kv_heads(2);
  spec.set_head_dim(16);
  spec.set_kv_dtype(kv_dtype);
  spec.set_model("attnctl-demo");
  spec.add_layers()->set_window(0);
  v1::LayerSpec* window_layer = spec.add_layers();
  window_layer->set_window(6);
  window_layer->set_num_sink_tokens(2);

  auto session = client->OpenSession(spec);
  if (!session.ok()) return Fail(session.status(), "CreateSession");
  std::cout << "session " << session->id() << ": 2 layers (full; window 6 + 2 "
            << "sinks), 4 query heads, 2 KV heads, head_dim 16, kv_dtype "
            << DTypeName(static_cast<DType>(kv_dtype)) << std::endl;
  // Failures below leave no session behind (unless --keep_session).
  bool keep = absl::GetFlag(FLAGS_keep_session);
  absl::Cleanup delete_on_failure = [&] {
    if (!keep) (void)session->Delete();
  };

  const int64_t heads = 4, kv_heads = 2, dim = 16;
  const int64_t total = prompt + steps;
  std::mt19937 rng(absl::GetFlag(FLAGS_seed));
  int exit_code = 0;
  std::vector<std::vector<float>> q(2), k(2), v(2), session_out(2);
  for (int layer = 0; layer < 2; ++layer) {
    q[layer] = RandomValues(rng, total * heads * dim);
    k[layer] = RandomValues(rng, total * kv_heads * dim);
    v[layer] = RandomValues(rng, total * kv_heads * dim);
  }
  auto slice = [](const std::vector<float>& values, int64_t row, int64_t rows,
                  int64_t width) {
    return absl::MakeConstSpan(values).subspan(row * width, rows * width);
  };
  // An output of `rows` tokens as floats, of the shape the demo asked for.
  auto rows_of = [&](const v1::Tensor& tensor,
                     int64_t rows) -> absl::StatusOr<std::vector<float>> {
    auto values = client::TensorToFloats(tensor);
    if (values.ok() &&
        static_cast<int64_t>(values->size()) != rows * heads * dim) {
      return absl::InternalError(
          absl::StrCat("the server answered ", values->size(), " values for ",
                       rows, " tokens of ", heads, " heads x ", dim));
    }
    return values;
  };

  // 1. Prefill the prompt on both layers.
  for (int layer = 0; layer < 2; ++layer) {
    auto result =
        session->Prefill(layer, slice(q[layer], 0, prompt, heads * dim),
                         slice(k[layer], 0, prompt, kv_heads * dim),
                         slice(v[layer], 0, prompt, kv_heads * dim));
    if (!result.ok()) return Fail(result.status(), "Prefill");
    auto output = rows_of(result->output(), prompt);
    if (!output.ok()) return Fail(output.status(), "Prefill output");
    session_out[layer] = *std::move(output);
  }
  std::cout << "prefilled " << prompt << " tokens on each layer" << std::endl;

  // 2. Stream the decode steps through one Decode stream.
  auto stream = client->OpenDecodeStream();
  for (int64_t t = prompt; t < total; ++t) {
    for (int layer = 0; layer < 2; ++layer) {
      auto request =
          session->MakeDecodeRequest(layer, slice(q[layer], t, 1, heads * dim),
                                     slice(k[layer], t, 1, kv_heads * dim),
                                     slice(v[layer], t, 1, kv_heads * dim));
      if (!request.ok()) return Fail(request.status(), "Decode request");
      auto result = stream->Step(*request);
      if (!result.ok()) return Fail(result.status(), "Decode");
      auto output = rows_of(result->output(), 1);
      if (!output.ok()) return Fail(output.status(), "Decode output");
      session_out[layer].insert(session_out[layer].end(), output->begin(),
                                output->end());
    }
  }
  if (absl::Status finished = stream->Finish(); !finished.ok()) {
    return Fail(finished, "Decode stream");
  }
  std::cout << "streamed " << steps << " decode steps per layer" << std::endl;

  // 3. One stateless causal Attention call per layer over the same keys.
  //    With float32 KV storage the results must be bitwise identical.
  double worst = 0.0;
  for (int layer = 0; layer < 2; ++layer) {
    v1::AttentionRequest request;
    auto q_tensor = client::MakeTensor(q[layer], {total, heads, dim});
    auto k_tensor =
        client::MakeTensor(k[layer], {total, kv_heads, dim}, kv_dtype);
    auto v_tensor =
        client::MakeTensor(v[layer], {total, kv_heads, dim}, kv_dtype);
    if (!q_tensor.ok() || !k_tensor.ok() || !v_tensor.ok()) {
      return Fail(absl::InternalError("could not build the tensors"), "demo");
    }
    *request.mutable_q() = *std::move(q_tensor);
    *request.mutable_k() = *std::move(k_tensor);
    *request.mutable_v() = *std::move(v_tensor);
    request.set_causal(true);
    request.set_window(spec.layers(layer).window());
    request.set_num_sink_tokens(spec.layers(layer).num_sink_tokens());
    auto result = client->Attention(request);
    if (!result.ok()) return Fail(result.status(), "Attention");
    auto stateless = rows_of(result->output(), total);
    if (!stateless.ok()) return Fail(stateless.status(), "Attention output");
    double max_diff = 0.0;
    for (size_t i = 0; i < stateless->size(); ++i) {
      max_diff = std::max(
          max_diff, std::fabs(static_cast<double>((*stateless)[i]) -
                              static_cast<double>(session_out[layer][i])));
    }
    std::cout << "layer " << layer
              << ": max |session - stateless| = " << max_diff << std::endl;
    worst = std::max(worst, max_diff);
  }
  std::cout << "max abs difference: " << worst << std::endl;
  if (kv_dtype == v1::DTYPE_FLOAT32 && worst != 0.0) {
    std::cerr << "attnctl demo: float32 results must be bitwise identical"
              << std::endl;
    exit_code = 1;
  }

  keep = true;  // deleted here, reporting the outcome
  if (absl::GetFlag(FLAGS_keep_session)) {
    std::cout << "kept session " << session->id() << std::endl;
    return exit_code;
  }
  if (absl::Status deleted = session->Delete(); !deleted.ok()) {
    return Fail(deleted, "DeleteSession");
  }
  std::cout << "deleted session " << session->id() << std::endl;
  return exit_code;
}

// ---------------------------------------------------------------------------
// export / import
//
// The file holds the snapshot records (attention.v1.SessionChunk), each
// preceded by its serialized length as 4 bytes little-endian: the format of
// attention-server --snapshot_dir files, so an exported file can also be
// put into a snapshot directory.

// Sessions with at least this many K/V bytes get a progress line.
constexpr int64_t kProgressBytes = int64_t{16} << 20;

// Rewrites one progress line on stderr (at most every 1%).
class Progress {
 public:
  Progress(absl::string_view verb, int64_t total)
      : verb_(verb), total_(total) {}
  void Add(int64_t bytes) {
    done_ += bytes;
    if (total_ < kProgressBytes) return;
    const int64_t percent = done_ * 100 / total_;
    if (percent == shown_) return;
    shown_ = percent;
    std::cerr << "\r" << verb_ << " " << HumanBytes(done_) << " of "
              << HumanBytes(total_) << " (" << percent << "%)" << std::flush;
    if (done_ >= total_) std::cerr << std::endl;
  }

 private:
  std::string verb_;
  int64_t total_;
  int64_t done_ = 0;
  int64_t shown_ = -1;
};

// The K/V bytes a snapshot data record carries (what its header's kv_bytes
// counts: k, v and the index keys of top-k layers).
int64_t KvBytesOf(const v1::SessionChunk& record) {
  const auto& data = record.data();
  return static_cast<int64_t>(data.k().size() + data.v().size() +
                              data.index_k().size());
}

// Flushes the file at `path` to the disk; whether that worked.
bool SyncFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool synced = ::fsync(fd) == 0;
  ::close(fd);
  return synced;
}

int RunExport() {
  const std::string id = absl::GetFlag(FLAGS_session);
  const std::string path = absl::GetFlag(FLAGS_out);
  if (id.empty() || path.empty()) {
    std::cerr << "attnctl export: give --session=ID and --out=FILE"
              << std::endl;
    return 1;
  }
  // From one server (--target), or from the session's replica (--cluster).
  std::unique_ptr<AttentionClient> client;
  std::unique_ptr<client::ClusterClient> cluster;
  if (absl::GetFlag(FLAGS_cluster).empty()) {
    auto made = MakeClient();
    if (!made.ok()) return Fail(made.status(), "connecting");
    client = *std::move(made);
  } else {
    auto made = MakeClusterClient();
    if (!made.ok()) return Fail(made.status(), "connecting");
    cluster = *std::move(made);
  }
  const std::string temporary = path + ".tmp";
  std::ofstream out(temporary, std::ios::binary | std::ios::trunc);
  if (!out) {
    std::cerr << "attnctl export: cannot write " << temporary << std::endl;
    return 1;
  }
  std::optional<Progress> progress;
  std::string bytes;
  const auto sink = [&](const v1::SessionChunk& record) -> absl::Status {
    if (record.has_header()) {
      progress.emplace("exported", record.header().kv_bytes());
    }
    record.SerializeToString(&bytes);
    const uint32_t size = static_cast<uint32_t>(bytes.size());
    const char prefix[4] = {
        static_cast<char>(size), static_cast<char>(size >> 8),
        static_cast<char>(size >> 16), static_cast<char>(size >> 24)};
    out.write(prefix, 4);
    out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    if (!out) return absl::InternalError("cannot write " + temporary);
    if (record.has_data() && progress.has_value()) {
      progress->Add(KvBytesOf(record));
    }
    return absl::OkStatus();
  };
  absl::Status status = cluster != nullptr ? cluster->ExportSession(id, sink)
                                           : client->ExportSession(id, sink);
  out.close();
  // The last records reach the file only when it is closed (a full disk
  // shows here), and on the disk only once synced.
  if (status.ok() && (!out || !SyncFile(temporary))) {
    status = absl::InternalError("cannot write " + temporary);
  }
  if (status.ok() && std::rename(temporary.c_str(), path.c_str()) != 0) {
    status = absl::InternalError("cannot rename " + temporary + " to " + path);
  }
  if (!status.ok()) {
    std::remove(temporary.c_str());
    return Fail(status, "ExportSession");
  }
  std::cout << "exported session " << id << " to " << path << std::endl;
  return 0;
}

int RunImport() {
  const std::string path = absl::GetFlag(FLAGS_in);
  if (path.empty()) {
    std::cerr << "attnctl import: give --in=FILE" << std::endl;
    return 1;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::cerr << "attnctl import: cannot read " << path << std::endl;
    return 1;
  }
  auto made = MakeClient();
  if (!made.ok()) return Fail(made.status(), "connecting");
  std::unique_ptr<AttentionClient> client = *std::move(made);
  std::optional<Progress> progress;
  std::string bytes;
  auto info = client->ImportSession(
      [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
        unsigned char prefix[4];
        if (!in.read(reinterpret_cast<char*>(prefix), 4)) {
          if (in.gcount() == 0) return false;
          return absl::DataLossError(path + " ends inside a record");
        }
        const uint32_t size = prefix[0] | (prefix[1] << 8) | (prefix[2] << 16) |
                              (static_cast<uint32_t>(prefix[3]) << 24);
        if (size > (64u << 20)) {
          return absl::InvalidArgumentError(path +
                                            " is not a session snapshot");
        }
        bytes.resize(size);
        if (!in.read(bytes.data(), size) || !record->ParseFromString(bytes)) {
          return absl::DataLossError(path + " holds a damaged record");
        }
        if (record->has_header()) {
          progress.emplace("imported", record->header().kv_bytes());
        } else if (record->has_data() && progress.has_value()) {
          progress->Add(KvBytesOf(*record));
        }
        return true;
      },
      absl::GetFlag(FLAGS_keep_id));
  if (!info.ok()) return Fail(info.status(), "ImportSession");
  std::cout << "imported session " << info->session_id() << " ("
            << HumanBytes(info->kv_cache_bytes()) << " of KV blocks)"
            << std::endl;
  return 0;
}

int Usage() {
  std::cerr << "usage: attnctl info|demo|plan|health|cluster|export|import "
               "[flags]   "
               "(attnctl --help for flags)"
            << std::endl;
  return 1;
}

}  // namespace
}  // namespace attention::attnctl

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "Command-line tool for attention-service.\n"
      "  attnctl info     server version, backend and KV pool usage\n"
      "  attnctl demo     session, prefill, streamed decode, compared with "
      "stateless attention\n"
      "  attnctl plan     KV-cache bytes per token and per context "
      "(--preset or --num_layers ...)\n"
      "  attnctl health   grpc.health.v1 check (exit 0 serving, 1 bad flags "
      "or files, 2 cannot connect, 3 RPC failed, 4 not serving)\n"
      "  attnctl cluster  --cluster=NAME:PORT|LIST: the replicas of a fleet "
      "(state, sessions, KV usage, version)\n"
      "  attnctl export   --session=ID --out=FILE: a session's snapshot to a "
      "file\n"
      "  attnctl import   --in=FILE [--keep_id]: a session from a snapshot "
      "file");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) return attention::attnctl::Usage();
  const std::string command = args[1];
  if (command == "info") return attention::attnctl::RunInfo();
  if (command == "demo") return attention::attnctl::RunDemo();
  if (command == "plan") return attention::attnctl::RunPlan();
  if (command == "health") return attention::attnctl::RunHealth();
  if (command == "cluster") return attention::attnctl::RunCluster();
  if (command == "export") return attention::attnctl::RunExport();
  if (command == "import") return attention::attnctl::RunImport();
  std::cerr << "attnctl: unknown command \"" << command << "\"" << std::endl;
  return attention::attnctl::Usage();
}
