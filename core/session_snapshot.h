// The session snapshot format: what ExportSession streams, ImportSession
// reads and --snapshot_dir files hold.
//
// A snapshot is a sequence of records: one SnapshotHeader, the
// SnapshotChunks, one SnapshotTrailer. They map 1:1 onto the
// attention.v1.SessionSnapshot{Header,Data,Trailer} messages, whose comments
// in proto/attention/v1/attention.proto are the normative description
// (carried positions, chunk order, checksum). Core defines the records and
// their checksum so that it can produce and consume snapshots without
// knowing protobuf; the server only translates the records and frames them
// (gRPC messages, or length-prefixed in a file).
//
// The checksum is over a canonical encoding of the records' values, not
// over serialized protobuf bytes, so it does not depend on how a protobuf
// library orders or encodes fields.
#ifndef ATTENTION_CORE_SESSION_SNAPSHOT_H_
#define ATTENTION_CORE_SESSION_SNAPSHOT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "core/dtype.h"
#include "core/session_spec.h"

namespace attention {

// The formats this build writes and reads. Version 1 carries K and V rows
// (KV_LAYOUT_SEPARATE, dense layers); version 2 adds MLA shared-latent
// layers (no v) and top-k layers' index keys, and checksums the spec
// fields that describe them. A snapshot is written in the lowest version
// that can hold its session, so servers that read only version 1 still
// import every dense session of this one.
inline constexpr uint32_t kSnapshotFormatVersion = 1;
inline constexpr uint32_t kSnapshotFormatVersionLatentTopK = 2;

// The version a snapshot of a session with the resolved `spec` is written
// in (and must be read in).
uint32_t SnapshotFormatFor(const SessionSpec& spec);

// OK for a format version this build reads. A later one is a valid
// snapshot of a newer server (kept by --snapshot_dir for a start that reads
// it, not a broken one): FAILED_PRECONDITION; 0 is INVALID_ARGUMENT.
// `server_version` (the header's, client input) is named in the message.
// Checked before anything else of a header is read, as a later version may
// hold values (a dtype, a layout) this build does not know.
absl::Status CheckSnapshotFormatVersion(uint32_t format_version,
                                        absl::string_view server_version);

// Rows per data chunk are chosen to fill about this many bytes (k + v +
// index_k)...
inline constexpr int64_t kSnapshotChunkTargetBytes = int64_t{1} << 20;
// ...and a chunk of several rows larger than this is rejected on import
// (one row is accepted whatever its size: the spec bounds it).
inline constexpr int64_t kSnapshotChunkMaxBytes = int64_t{4} << 20;

struct SnapshotHeader {
  uint32_t format_version = kSnapshotFormatVersion;
  std::string session_id;
  SessionSpec spec;  // resolved
  std::vector<int64_t> layer_lengths;
  // Per layer: first position past the sinks that is carried.
  std::vector<int64_t> first_positions;
  DType kv_dtype = DType::kFloat32;
  std::string server_version;
  int64_t idle_timeout_ms = 0;
  int64_t idle_deadline_unix_ms = 0;
  int64_t kv_bytes = 0;  // k + v + index_k bytes of all chunks
  // The name of the tenant that owned the session (Session::owner()).
  std::string owner;
};

// Rows [start, start + num_tokens) of one layer, in the storage dtype:
// k [num_tokens, num_kv_heads, head_dim], v [num_tokens, num_kv_heads,
// value_dim] (empty for a shared-latent layer: its values are the leading
// entries of k), index_k [num_tokens, index_dim] (top-k layers only, else
// empty).
struct SnapshotChunk {
  int32_t layer = 0;
  int64_t start = 0;
  int64_t num_tokens = 0;
  std::string k;
  std::string v;
  std::string index_k;
};

struct SnapshotTrailer {
  int64_t num_chunks = 0;
  uint32_t checksum = 0;
};

// The positions of a layer a snapshot carries: [0, sink_end) and
// [window_start, length) (window_start >= sink_end; the second range may
// be empty, and the first is empty without sinks).
struct CarriedRanges {
  int64_t sink_end = 0;
  int64_t window_start = 0;
  int64_t length = 0;

  int64_t tokens() const { return sink_end + (length - window_start); }
};
CarriedRanges CarriedPositions(int64_t length, int32_t num_sink_tokens,
                               int64_t first_position);

// The chunk order of a snapshot with `header`: moves (layer, position) to
// the next carried row at or after it, past the gap between a window
// layer's ranges and past finished layers, and sets `range_end` to the end
// of the carried range holding it. False (layer = num_layers) once every
// row has been passed. REQUIRES: the header's per-layer vectors have
// num_layers entries.
bool SeekCarriedRow(const SnapshotHeader& header, int* layer, int64_t* position,
                    int64_t* range_end);

// Running CRC-32C of the canonical record encoding (see the proto), in
// the header's format version: AddHeader first.
class SnapshotChecksum {
 public:
  void AddHeader(const SnapshotHeader& header);
  void AddChunk(const SnapshotChunk& chunk);
  uint32_t value() const { return crc_; }

 private:
  void AddInt(int64_t value);
  void AddBytes(absl::string_view bytes);
  uint32_t crc_ = 0;
  uint32_t format_version_ = kSnapshotFormatVersion;
};

}  // namespace attention

#endif  // ATTENTION_CORE_SESSION_SNAPSHOT_H_
