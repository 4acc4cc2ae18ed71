#include "server/reply_size.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "attention/v1/attention.pb.h"
#include "core/session_snapshot.h"
#include "core/tenant.h"
#include "server/attention_server.h"
#include "server/proto_convert.h"
#include "server/session_transfer.h"

namespace attention::server {
namespace {

// Longest session id (generated or kept by an import) and owner address a
// SessionInfo reply carries.
constexpr size_t kSessionIdBytes = 64;
constexpr double kOwnerBytes = 1024;

}  // namespace

int64_t ResultBudget(int64_t max_message_bytes, int64_t results) {
  return std::max<int64_t>(0,
                           max_message_bytes - results * kResultFramingBytes);
}

double StatelessReplyBytes(const StatelessRequest& request) {
  if (request.q.rank() != 3 || request.k.rank() != 3 ||
      request.v.rank() != 3) {
    return 0;
  }
  const double tokens = static_cast<double>(request.q.dim(0));
  const double heads = static_cast<double>(request.q.dim(1));
  double bytes = kResultFramingBytes +
                 tokens * heads * static_cast<double>(request.v.dim(2)) *
                     DTypeSize(request.output_dtype);
  if (request.return_lse) bytes += tokens * heads * 4;
  if (request.return_weights) {
    bytes += heads * tokens * static_cast<double>(request.k.dim(0)) * 4;
  }
  return bytes;
}

absl::Status CheckReplySize(double bytes, int64_t max_message_bytes) {
  if (bytes <= static_cast<double>(max_message_bytes)) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "the reply would take ", absl::StrFormat("%.0f", bytes),
      " bytes, over the server's message limit of ", max_message_bytes,
      " bytes (--max_message_bytes); nothing was computed or applied. Send "
      "fewer tokens per call (chunks give bitwise the same outputs), ask for "
      "output_dtype FLOAT16 or BFLOAT16, or drop return_weights/return_lse"));
}

double SessionMessageBytes(const SessionSpec& spec) {
  constexpr int64_t kLargest = std::numeric_limits<int64_t>::max();
  const std::vector<int64_t> lengths(static_cast<size_t>(spec.num_layers),
                                     spec.max_tokens);
  SessionInfo info;
  info.session_id.assign(kSessionIdBytes, 'x');
  info.spec = spec;
  info.layer_lengths = lengths;
  info.kv_cache_bytes = kLargest;
  info.metadata_bytes = kLargest;
  v1::SessionInfo proto;
  SessionInfoToProto(info, &proto);
  // An export's first message, the snapshot header, carries the same spec
  // and lengths plus a first position per layer, the server version and
  // the owner's tenant name.
  SnapshotHeader header;
  header.session_id = info.session_id;
  header.spec = spec;
  header.layer_lengths = lengths;
  header.first_positions = lengths;
  header.server_version = ServerVersion();
  header.idle_timeout_ms = kLargest;
  header.idle_deadline_unix_ms = kLargest;
  header.kv_bytes = kLargest;
  header.owner.assign(kMaxTenantNameBytes, 'x');
  v1::SessionChunk record;
  SnapshotHeaderToProto(header, record.mutable_header());
  return std::max(static_cast<double>(proto.ByteSizeLong()) + kOwnerBytes,
                  static_cast<double>(record.ByteSizeLong()));
}

absl::Status CheckSessionMessageSize(const SessionSpec& spec,
                                     int64_t max_message_bytes) {
  const double bytes = SessionMessageBytes(spec);
  if (bytes <= static_cast<double>(max_message_bytes)) {
    return absl::OkStatus();
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "the session's SessionInfo or export header (its spec, every layer "
      "spelled out) would take up to ",
      absl::StrFormat("%.0f", bytes),
      " bytes, over the server's message limit of ", max_message_bytes,
      " bytes (--max_message_bytes), so no reply or export could carry it; "
      "nothing was created or changed. Use fewer layers or sink_logits, or "
      "raise the limit"));
}

}  // namespace attention::server
