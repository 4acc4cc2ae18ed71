// Session snapshots in core: export -> import round trips over every layer
// kind, dtype, GQA shape and forks, bitwise continuation (also across block
// sizes), consistency against racing appends, and every malformed snapshot
// failing without leaving anything behind.
#include "core/session_snapshot.h"

#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/notification.h"
#include "absl/time/time.h"
#include "core/call_control.h"
#include "core/cpu/cpu_backend.h"
#include "core/crc32c.h"
#include "core/engine.h"
#include "gtest/gtest.h"
#include "tests/core/test_tensors.h"

namespace attention {
namespace {

using testing::HostTensor;
using testing::RandomTensor;
using testing::ToFloats;

struct Shape4 {
  int q_heads, kv_heads, head_dim, value_dim;
};

SessionSpec MakeSpec(const Shape4& s, DType dtype) {
  SessionSpec spec;
  spec.num_layers = 4;
  spec.num_q_heads = s.q_heads;
  spec.num_kv_heads = s.kv_heads;
  spec.head_dim = s.head_dim;
  spec.value_dim = s.value_dim;
  spec.kv_dtype = dtype;
  spec.max_tokens = 4096;
  spec.model = "snapshot-test";
  LayerSpec full;
  LayerSpec window;
  window.window = 37;
  LayerSpec sinks;
  sinks.window = 29;
  sinks.num_sink_tokens = 5;
  LayerSpec learned;
  learned.window = 41;
  for (int h = 0; h < s.q_heads; ++h) learned.sink_logits.push_back(0.25f * h);
  spec.layers = {full, window, sinks, learned};
  return spec;
}

std::unique_ptr<AttentionEngine> MakeEngine(int64_t kv_bytes,
                                            int64_t block_bytes) {
  EngineOptions options;
  options.kv_cache_bytes = kv_bytes;
  options.kv_block_bytes = block_bytes;
  options.version = "test";
  options.sessions.reap_interval = absl::ZeroDuration();
  auto engine =
      AttentionEngine::Create(std::make_unique<CpuBackend>(2), options);
  EXPECT_TRUE(engine.ok()) << engine.status();
  return *std::move(engine);
}

struct Snapshot {
  SnapshotHeader header;
  std::vector<SnapshotChunk> chunks;
  SnapshotTrailer trailer;
};

Snapshot Export(AttentionEngine& engine, const std::string& id) {
  Snapshot snapshot;
  auto session_export = engine.ExportSession(id);
  EXPECT_TRUE(session_export.ok()) << session_export.status();
  if (!session_export.ok()) return snapshot;
  snapshot.header = (*session_export)->header();
  while (true) {
    SnapshotChunk chunk;
    auto more = (*session_export)->NextChunk(&chunk);
    EXPECT_TRUE(more.ok()) << more.status();
    if (!more.ok() || !*more) break;
    snapshot.chunks.push_back(std::move(chunk));
  }
  snapshot.trailer = (*session_export)->trailer();
  return snapshot;
}

absl::StatusOr<SessionInfo> Import(AttentionEngine& engine,
                                   const Snapshot& snapshot,
                                   ImportOptions options = {}) {
  auto import = engine.BeginImport(snapshot.header, options);
  if (!import.ok()) return import.status();
  for (const SnapshotChunk& chunk : snapshot.chunks) {
    if (absl::Status status = (*import)->AddChunk(chunk); !status.ok()) {
      return status;
    }
  }
  return (*import)->Finish(snapshot.trailer);
}

// Recomputes the trailer after a deliberate change, so that a test reaches
// the check behind the checksum.
void Reseal(Snapshot& snapshot) {
  SnapshotChecksum checksum;
  checksum.AddHeader(snapshot.header);
  for (const SnapshotChunk& chunk : snapshot.chunks) checksum.AddChunk(chunk);
  snapshot.trailer.checksum = checksum.value();
  snapshot.trailer.num_chunks = static_cast<int64_t>(snapshot.chunks.size());
}

struct Tokens {
  HostTensor q, k, v;
  Tokens(int64_t count, const Shape4& s, std::mt19937& rng, DType dtype)
      : q(RandomTensor({count, s.q_heads, s.head_dim}, rng)),
        k(RandomTensor({count, s.kv_heads, s.head_dim}, rng, dtype)),
        v(RandomTensor({count, s.kv_heads, s.value_dim}, rng, dtype)) {}
};

// Appends rows [begin, end) of `t` to `layer` and returns the output.
std::vector<float> Append(AttentionEngine& engine, const std::string& id,
                          int layer, const Tokens& t, int64_t begin,
                          int64_t end) {
  AppendRequest r;
  r.session_id = id;
  r.layer = layer;
  r.q = t.q.rows(begin, end);
  r.k = t.k.rows(begin, end);
  r.v = t.v.rows(begin, end);
  auto out = engine.Append(r);
  EXPECT_TRUE(out.ok()) << out.status();
  return out.ok() ? ToFloats(out->output) : std::vector<float>{};
}

TEST(Crc32cTest, KnownValueAndIncremental) {
  EXPECT_EQ(Crc32cExtend(0, "123456789", 9), 0xe3069283u);
  const uint32_t part = Crc32cExtend(0, "1234", 4);
  EXPECT_EQ(Crc32cExtend(part, "56789", 5), 0xe3069283u);
  std::string long_text(1000, 'x');
  uint32_t whole = Crc32cExtend(0, long_text.data(), long_text.size());
  uint32_t pieces = Crc32cExtend(0, long_text.data(), 333);
  pieces = Crc32cExtend(pieces, long_text.data() + 333, 667);
  EXPECT_EQ(whole, pieces);
}

// Every layer kind, dtype and GQA shape; exported from one block size and
// imported into another; the imported session then continues bitwise like
// the original.
TEST(SessionSnapshotTest, RoundTripContinuesBitwise) {
  const Shape4 shapes[] = {{4, 2, 16, 8}, {4, 4, 8, 8}, {8, 1, 32, 16}};
  for (DType dtype : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (const Shape4& shape : shapes) {
      SCOPED_TRACE(::testing::Message()
                   << DTypeName(dtype) << " H=" << shape.q_heads
                   << " Hkv=" << shape.kv_heads);
      std::mt19937 rng(7);
      auto source = MakeEngine(int64_t{32} << 20, 4096);
      auto target = MakeEngine(int64_t{32} << 20, 2048 + 1024);
      const SessionSpec spec = MakeSpec(shape, dtype);
      auto created = source->CreateSession(spec, absl::ZeroDuration());
      ASSERT_TRUE(created.ok()) << created.status();
      const std::string id = created->session_id;
      Tokens t(300, shape, rng, dtype);
      for (int layer = 0; layer < spec.num_layers; ++layer) {
        // Different lengths per layer, in two calls.
        Append(*source, id, layer, t, 0, 50 + 30 * layer);
        Append(*source, id, layer, t, 50 + 30 * layer, 170 + 10 * layer);
      }
      const Snapshot snapshot = Export(*source, id);
      EXPECT_EQ(snapshot.header.layer_lengths,
                source->GetSession(id)->layer_lengths);
      EXPECT_GT(snapshot.header.first_positions[1], 0)
          << "a window layer carries only what it still holds";
      auto imported = Import(*target, snapshot);
      ASSERT_TRUE(imported.ok()) << imported.status();
      EXPECT_NE(imported->session_id, id);
      EXPECT_EQ(imported->spec, source->GetSession(id)->spec);
      EXPECT_EQ(imported->layer_lengths, snapshot.header.layer_lengths);
      for (int layer = 0; layer < spec.num_layers; ++layer) {
        const int64_t length = 170 + 10 * layer;
        EXPECT_EQ(Append(*target, imported->session_id, layer, t, length,
                         length + 40),
                  Append(*source, id, layer, t, length, length + 40))
            << "layer " << layer;
        EXPECT_EQ(Append(*target, imported->session_id, layer, t, length + 40,
                         length + 41),
                  Append(*source, id, layer, t, length + 40, length + 41));
      }
      // An imported session exports the same snapshot again (its own id).
      const Snapshot again = Export(*target, imported->session_id);
      EXPECT_EQ(again.header.layer_lengths,
                source->GetSession(id)->layer_lengths);
    }
  }
}

// A token wider than a snapshot chunk's limit (5 MiB of fp32 K/V: 640 KV
// heads of 1024 + 1024, with --kv_block_bytes of 8 MiB) moves one token
// per chunk and imports: a one-row chunk is accepted whatever its size.
TEST(SessionSnapshotTest, TokensWiderThanAChunkMoveOneAtATime) {
  const Shape4 shape{640, 640, 1024, 1024};
  SessionSpec spec = MakeSpec(shape, DType::kFloat32);
  spec.num_layers = 1;
  spec.layers.resize(1);
  std::mt19937 rng(7);
  auto source = MakeEngine(int64_t{64} << 20, int64_t{8} << 20);
  auto target = MakeEngine(int64_t{64} << 20, int64_t{8} << 20);
  auto created = source->CreateSession(spec, absl::ZeroDuration());
  ASSERT_TRUE(created.ok()) << created.status();
  const std::string id = created->session_id;
  Tokens t(4, shape, rng, DType::kFloat32);
  Append(*source, id, 0, t, 0, 3);
  const Snapshot snapshot = Export(*source, id);
  ASSERT_EQ(snapshot.chunks.size(), 3u);
  EXPECT_GT(static_cast<int64_t>(snapshot.chunks[0].k.size() +
                                 snapshot.chunks[0].v.size()),
            kSnapshotChunkMaxBytes);
  auto imported = Import(*target, snapshot);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(Append(*target, imported->session_id, 0, t, 3, 4),
            Append(*source, id, 0, t, 3, 4));
}

// MLA shared-latent and top-k sessions: one latent vector per token and no
// v, and each top-k token's index key, move bit for bit (format version 2);
// the imported session continues bitwise (outputs, LSE, selections) on
// every layer kind, from one block size into another.
struct SparseTokens {
  HostTensor q, k, v, index_k, index_q, index_w;
  SparseTokens(int64_t count, const SessionSpec& spec, std::mt19937& rng)
      : q(RandomTensor({count, spec.num_q_heads, spec.head_dim}, rng)),
        k(RandomTensor({count, spec.num_kv_heads, spec.head_dim}, rng,
                       spec.kv_dtype)),
        v(RandomTensor({count, spec.num_kv_heads, spec.value_dim}, rng,
                       spec.kv_dtype)),
        index_k(RandomTensor({count, spec.index_dim}, rng, spec.kv_dtype)),
        index_q(RandomTensor({count, spec.index_heads, spec.index_dim}, rng)),
        index_w(RandomTensor({count, spec.index_heads}, rng)) {}
};

struct SparseResult {
  std::vector<float> output, lse;
  std::vector<int64_t> selected;
  bool operator==(const SparseResult&) const = default;
};

SparseResult AppendSparse(AttentionEngine& engine, const std::string& id,
                          const SessionSpec& spec, int layer,
                          const SparseTokens& t, int64_t begin, int64_t end) {
  AppendRequest r;
  r.session_id = id;
  r.layer = layer;
  r.q = t.q.rows(begin, end);
  r.k = t.k.rows(begin, end);
  if (spec.kv_layout != KvLayout::kSharedLatent) r.v = t.v.rows(begin, end);
  r.return_lse = true;
  if (spec.layers[layer].topk > 0) {
    r.index_k = t.index_k.rows(begin, end);
    r.index_q = t.index_q.rows(begin, end);
    r.index_weights = t.index_w.rows(begin, end);
    r.return_topk_indices = true;
  }
  auto out = engine.Append(r);
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok()) return {};
  return {ToFloats(out->output),
          out->lse ? ToFloats(*out->lse) : std::vector<float>{},
          out->topk_indices};
}

// Four layers: top-k full; top-k (ReLU) window; dense window with sinks;
// top-k window with learned sinks.
SessionSpec SparseSpec(KvLayout layout, DType dtype) {
  SessionSpec spec;
  spec.num_layers = 4;
  spec.num_q_heads = 4;
  spec.kv_layout = layout;
  spec.num_kv_heads = layout == KvLayout::kSharedLatent ? 1 : 2;
  spec.head_dim = 24;
  spec.scale = 0.25f;
  spec.value_dim = 16;
  spec.kv_dtype = dtype;
  spec.max_tokens = 4096;
  spec.index_dim = 8;
  spec.index_heads = 2;
  LayerSpec full;
  full.topk = 16;
  LayerSpec window;
  window.window = 37;
  window.topk = 8;
  window.index_score = IndexScore::kRelu;
  LayerSpec sinks;
  sinks.window = 29;
  sinks.num_sink_tokens = 5;
  LayerSpec learned;
  learned.window = 41;
  learned.topk = 12;
  for (int h = 0; h < spec.num_q_heads; ++h) {
    learned.sink_logits.push_back(0.25f * h);
  }
  spec.layers = {full, window, sinks, learned};
  return spec;
}

TEST(SessionSnapshotTest, LatentAndTopKSessionsRoundTripBitwise) {
  for (KvLayout layout : {KvLayout::kSharedLatent, KvLayout::kSeparate}) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      SCOPED_TRACE(
          ::testing::Message()
          << DTypeName(dtype)
          << (layout == KvLayout::kSharedLatent ? " latent" : " separate"));
      std::mt19937 rng(11);
      auto source = MakeEngine(int64_t{32} << 20, 4096);
      auto target = MakeEngine(int64_t{32} << 20, 2048 + 1024);
      const SessionSpec spec = SparseSpec(layout, dtype);
      auto created = source->CreateSession(spec, absl::ZeroDuration());
      ASSERT_TRUE(created.ok()) << created.status();
      const std::string id = created->session_id;
      const SessionSpec& resolved = created->spec;
      SparseTokens t(300, resolved, rng);
      for (int layer = 0; layer < spec.num_layers; ++layer) {
        AppendSparse(*source, id, resolved, layer, t, 0, 50 + 30 * layer);
        AppendSparse(*source, id, resolved, layer, t, 50 + 30 * layer,
                     170 + 10 * layer);
      }
      const Snapshot snapshot = Export(*source, id);
      EXPECT_EQ(snapshot.header.format_version,
                kSnapshotFormatVersionLatentTopK);
      for (const SnapshotChunk& chunk : snapshot.chunks) {
        const int64_t element = DTypeSize(dtype);
        EXPECT_EQ(static_cast<int64_t>(chunk.v.size()),
                  layout == KvLayout::kSharedLatent
                      ? 0
                      : chunk.num_tokens * 2 * 16 * element);
        EXPECT_EQ(static_cast<int64_t>(chunk.index_k.size()),
                  spec.layers[chunk.layer].topk > 0
                      ? chunk.num_tokens * 8 * element
                      : 0);
      }
      auto imported = Import(*target, snapshot);
      ASSERT_TRUE(imported.ok()) << imported.status();
      EXPECT_EQ(imported->spec, resolved);
      for (int layer = 0; layer < spec.num_layers; ++layer) {
        const int64_t length = 170 + 10 * layer;
        EXPECT_EQ(
            AppendSparse(*target, imported->session_id, resolved, layer, t,
                         length, length + 40),
            AppendSparse(*source, id, resolved, layer, t, length, length + 40))
            << "layer " << layer;
        EXPECT_EQ(AppendSparse(*target, imported->session_id, resolved, layer,
                               t, length + 40, length + 41),
                  AppendSparse(*source, id, resolved, layer, t, length + 40,
                               length + 41))
            << "layer " << layer;
      }
      // The imported session exports again (its window layers may hold
      // other rows: the block size differs).
      const Snapshot again = Export(*target, imported->session_id);
      EXPECT_EQ(again.header.format_version, kSnapshotFormatVersionLatentTopK);
      EXPECT_EQ(again.header.layer_lengths,
                source->GetSession(id)->layer_lengths);
    }
  }
}

// A version 2 snapshot names what version 1 cannot: its index keys and
// spec fields are under the checksum, and a version 1 header cannot carry
// such a session.
TEST(SessionSnapshotTest, LatentAndTopKSnapshotsAreVersion2AndChecked) {
  std::mt19937 rng(12);
  auto engine = MakeEngine(int64_t{8} << 20, 4096);
  const SessionSpec spec = SparseSpec(KvLayout::kSharedLatent, DType::kFloat32);
  auto created = engine->CreateSession(spec, absl::ZeroDuration());
  ASSERT_TRUE(created.ok()) << created.status();
  SparseTokens t(60, created->spec, rng);
  for (int layer = 0; layer < spec.num_layers; ++layer) {
    AppendSparse(*engine, created->session_id, created->spec, layer, t, 0, 60);
  }
  const Snapshot good = Export(*engine, created->session_id);
  ASSERT_TRUE(Import(*engine, good).ok());

  Snapshot s = good;
  s.header.format_version = kSnapshotFormatVersion;
  Reseal(s);
  auto status = Import(*engine, s).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("cannot carry"), std::string::npos) << status;

  s = good;  // an index key changed: the checksum catches it
  s.chunks[0].index_k[3] ^= 0x01;
  status = Import(*engine, s).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;

  s = good;  // the index score changed: the checksum covers it
  s.header.spec.layers[0].index_score = IndexScore::kRelu;
  status = Import(*engine, s).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;

  s = good;  // a v on a latent layer, or a missing index key
  s.chunks[0].v = s.chunks[0].k;
  Reseal(s);
  status = Import(*engine, s).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_NE(status.message().find("bytes of k"), std::string::npos) << status;
  s = good;
  s.chunks[0].index_k.clear();
  Reseal(s);
  status = Import(*engine, s).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
}

TEST(SessionSnapshotTest, ForkExportsAsAFullSessionAndKeepIdWorks) {
  const Shape4 shape{4, 2, 16, 8};
  std::mt19937 rng(11);
  auto source = MakeEngine(int64_t{16} << 20, 4096);
  auto target = MakeEngine(int64_t{16} << 20, 4096);
  const SessionSpec spec = MakeSpec(shape, DType::kFloat32);
  const std::string parent =
      source->CreateSession(spec, absl::Minutes(3))->session_id;
  Tokens t(200, shape, rng, DType::kFloat32);
  for (int layer = 0; layer < 4; ++layer)
    Append(*source, parent, layer, t, 0, 120);
  const std::string fork = source->ForkSession(parent)->session_id;
  Append(*source, fork, 0, t, 120, 130);
  const Snapshot snapshot = Export(*source, fork);
  EXPECT_EQ(snapshot.header.session_id, fork);
  EXPECT_EQ(snapshot.header.idle_timeout_ms, 180000);
  ImportOptions keep;
  keep.keep_session_id = true;
  auto imported = Import(*target, snapshot, keep);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->session_id, fork);
  EXPECT_EQ(imported->layer_lengths[0], 130);
  EXPECT_EQ(Append(*target, fork, 0, t, 130, 140),
            Append(*source, fork, 0, t, 130, 140));
  // The id is now taken there: ALREADY_EXISTS, and nothing changes.
  const int64_t used = target->stats().pool.used_bytes;
  auto twice = Import(*target, snapshot, keep);
  EXPECT_EQ(twice.status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(target->stats().pool.used_bytes, used);
  EXPECT_EQ(target->stats().active_sessions, 1);
}

// A restore keeps the snapshot's idle deadline, but never one later than
// a session used just now would have: a far-future deadline in a file
// would otherwise keep its session forever.
TEST(SessionSnapshotTest, AKeptIdleDeadlineIsNeverInTheFuture) {
  const Shape4 shape{4, 2, 16, 8};
  std::mt19937 rng(5);
  auto source = MakeEngine(int64_t{16} << 20, 4096);
  auto target = MakeEngine(int64_t{16} << 20, 4096);
  const std::string id =
      source->CreateSession(MakeSpec(shape, DType::kFloat32), absl::Minutes(3))
          ->session_id;
  Tokens t(10, shape, rng, DType::kFloat32);
  Append(*source, id, 0, t, 0, 10);
  Snapshot snapshot = Export(*source, id);
  snapshot.header.idle_deadline_unix_ms =
      absl::ToUnixMillis(absl::Now() + absl::Hours(240));
  Reseal(snapshot);
  ImportOptions restore;
  restore.keep_session_id = true;
  restore.keep_idle_deadline = true;
  const absl::Time before = absl::Now();
  auto restored = Import(*target, snapshot, restore);
  ASSERT_TRUE(restored.ok()) << restored.status();
  const absl::Time after = absl::Now();
  const int64_t deadline = Export(*target, id).header.idle_deadline_unix_ms;
  EXPECT_GE(deadline, absl::ToUnixMillis(before + absl::Minutes(3)));
  EXPECT_LE(deadline, absl::ToUnixMillis(after + absl::Minutes(3)));
}

// A valid snapshot over this server's --max_session_tokens is refused as a
// precondition (a server with a larger limit takes it), not as a broken
// stream; a spec no server takes is INVALID_ARGUMENT.
TEST(SessionSnapshotTest, ASpecOverThisServersLimitsIsAPreconditionFailure) {
  const Shape4 shape{4, 2, 16, 8};
  auto source = MakeEngine(int64_t{16} << 20, 4096);
  SessionSpec spec = MakeSpec(shape, DType::kFloat32);
  spec.max_tokens = 4096;
  const std::string id =
      source->CreateSession(spec, absl::ZeroDuration())->session_id;
  Snapshot snapshot = Export(*source, id);
  EngineOptions options;
  options.kv_cache_bytes = int64_t{16} << 20;
  options.kv_block_bytes = 4096;
  options.sessions.reap_interval = absl::ZeroDuration();
  options.sessions.limits.max_tokens_limit = 1024;
  options.sessions.limits.default_max_tokens = 1024;
  auto small =
      AttentionEngine::Create(std::make_unique<CpuBackend>(1), options);
  ASSERT_TRUE(small.ok()) << small.status();
  const absl::Status refused = Import(**small, snapshot).status();
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused;
  snapshot.header.spec.num_q_heads = -1;
  Reseal(snapshot);
  EXPECT_EQ(Import(**small, snapshot).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(SessionSnapshotTest, ExportIsConsistentAgainstRacingAppends) {
  const Shape4 shape{4, 2, 16, 8};
  std::mt19937 rng(3);
  auto engine = MakeEngine(int64_t{16} << 20, 4096);
  const SessionSpec spec = MakeSpec(shape, DType::kFloat32);
  const std::string id =
      engine->CreateSession(spec, absl::ZeroDuration())->session_id;
  Tokens t(200, shape, rng, DType::kFloat32);
  for (int layer = 0; layer < 4; ++layer) Append(*engine, id, layer, t, 0, 100);
  auto session_export = engine->ExportSession(id);
  ASSERT_TRUE(session_export.ok());
  // Appends after the export started (into the shared partial block too)
  // and a truncation do not reach it.
  for (int layer = 0; layer < 4; ++layer)
    Append(*engine, id, layer, t, 100, 150);
  Snapshot snapshot;
  snapshot.header = (*session_export)->header();
  SnapshotChunk chunk;
  while (*(*session_export)->NextChunk(&chunk))
    snapshot.chunks.push_back(chunk);
  snapshot.trailer = (*session_export)->trailer();
  session_export->reset();
  EXPECT_EQ(snapshot.header.layer_lengths, std::vector<int64_t>(4, 100));
  auto imported = Import(*engine, snapshot);
  ASSERT_TRUE(imported.ok()) << imported.status();
  // The copy continues from 100 exactly as the original did.
  const std::string copy = imported->session_id;
  auto fresh = engine->CreateSession(spec, absl::ZeroDuration());
  for (int layer = 0; layer < 4; ++layer) {
    Append(*engine, fresh->session_id, layer, t, 0, 100);
    EXPECT_EQ(Append(*engine, copy, layer, t, 100, 150),
              Append(*engine, fresh->session_id, layer, t, 100, 150));
  }
}

// An export pins its session's blocks: they stay the owner's, counted
// against its quota, until the export ends, also after the session went and
// however many other tenants' accounting came and went meanwhile.
TEST(SessionSnapshotTest, AnExportOutlivingItsSessionStaysItsOwners) {
  const Shape4 shape{4, 2, 16, 8};
  std::mt19937 rng(5);
  auto engine = MakeEngine(int64_t{16} << 20, 4096);
  const Tenant alice{.name = "alice", .quota = {}};
  const std::string id = engine
                             ->CreateSession(MakeSpec(shape, DType::kFloat32),
                                             absl::ZeroDuration(), alice)
                             ->session_id;
  AppendRequest r;
  r.session_id = id;
  r.tenant = &alice;
  Tokens t(100, shape, rng, DType::kFloat32);
  r.q = t.q.view();
  r.k = t.k.view();
  r.v = t.v.view();
  ASSERT_TRUE(engine->Append(r).ok());
  const int64_t held = engine->tenant_stats("alice").kv_bytes;
  ASSERT_GT(held, 0);

  auto session_export = engine->ExportSession(id, alice);
  ASSERT_TRUE(session_export.ok()) << session_export.status();
  ASSERT_TRUE(engine->DeleteSession(id, alice).ok());
  // Imports refused for 1,000 other owners leave accounting that is swept.
  ImportOptions refused;
  refused.tenant.quota.max_sessions = 0;
  for (int i = 0; i < 1000; ++i) {
    refused.tenant.name = absl::StrCat("other-", i);
    ASSERT_FALSE(
        engine->BeginImport((*session_export)->header(), refused).ok());
  }
  EXPECT_EQ(engine->tenant_stats("alice").kv_bytes, held);
  EXPECT_EQ(engine->tenant_stats("alice").sessions, 0);

  SnapshotChunk chunk;
  int64_t chunks = 0;
  while (*(*session_export)->NextChunk(&chunk)) ++chunks;
  EXPECT_GT(chunks, 0);
  session_export->reset();
  EXPECT_EQ(engine->tenant_stats("alice").kv_bytes, 0);
  EXPECT_EQ(engine->stats().pool.used_bytes, 0);
}

TEST(SessionSnapshotTest, TruncateAfterImportRespectsWhatWasCarried) {
  const Shape4 shape{4, 2, 16, 8};
  std::mt19937 rng(5);
  auto source = MakeEngine(int64_t{16} << 20, 4096);
  auto target = MakeEngine(int64_t{16} << 20, 1024);
  const SessionSpec spec = MakeSpec(shape, DType::kFloat32);
  const std::string id =
      source->CreateSession(spec, absl::ZeroDuration())->session_id;
  Tokens t(300, shape, rng, DType::kFloat32);
  for (int layer = 0; layer < 4; ++layer) Append(*source, id, layer, t, 0, 250);
  const Snapshot snapshot = Export(*source, id);
  auto imported = Import(*target, snapshot);
  ASSERT_TRUE(imported.ok()) << imported.status();
  // Far back: the window layers no longer hold those keys. The refusal
  // names the shortest length every layer allows (three window layers,
  // some restored with more rows than their smaller blocks keep): it and
  // every longer one work, one less does not.
  const auto expect_shortest_named = [&](AttentionEngine& engine,
                                         const std::string& session) {
    const absl::Status refused = engine.TruncateSession(session, 100).status();
    ASSERT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
    const absl::string_view message = refused.message();
    constexpr absl::string_view kNamed = "any length of ";
    const size_t at = message.find(kNamed);
    ASSERT_NE(at, absl::string_view::npos) << refused;
    const size_t begin = at + kNamed.size();
    int64_t shortest = 0;
    ASSERT_TRUE(absl::SimpleAtoi(
        message.substr(begin, message.find(' ', begin) - begin), &shortest))
        << refused;
    for (int64_t length = shortest - 1; length <= shortest + 3; ++length) {
      auto fork = engine.ForkSession(session);
      ASSERT_TRUE(fork.ok()) << fork.status();
      EXPECT_EQ(engine.TruncateSession(fork->session_id, length).ok(),
                length >= shortest)
          << length << " after " << refused;
      ASSERT_TRUE(engine.DeleteSession(fork->session_id).ok());
    }
  };
  expect_shortest_named(*source, id);
  expect_shortest_named(*target, imported->session_id);
  // A short rollback works and replays bitwise.
  ASSERT_TRUE(source->TruncateSession(id, 245).ok());
  ASSERT_TRUE(target->TruncateSession(imported->session_id, 245).ok());
  for (int layer = 0; layer < 4; ++layer) {
    EXPECT_EQ(Append(*target, imported->session_id, layer, t, 245, 260),
              Append(*source, id, layer, t, 245, 260));
  }
}

// A restored window layer with sinks, cut back inside its sinks, holds
// every row again: its next export says so, imports, and continues
// bitwise. (It exported the cut length as its first held position, which
// no import accepts.)
TEST(SessionSnapshotTest, TruncateIntoTheSinksAfterImportStaysExportable) {
  const Shape4 shape{4, 2, 16, 8};
  std::mt19937 rng(6);
  auto source = MakeEngine(int64_t{16} << 20, 4096);
  auto target = MakeEngine(int64_t{16} << 20, 1024);
  SessionSpec spec = MakeSpec(shape, DType::kFloat32);
  spec.layers = {spec.layers[0], spec.layers[2]};  // full; window + sinks
  spec.num_layers = 2;
  const std::string id =
      source->CreateSession(spec, absl::ZeroDuration())->session_id;
  Tokens t(300, shape, rng, DType::kFloat32);
  for (int layer = 0; layer < 2; ++layer) Append(*source, id, layer, t, 0, 250);
  auto imported = Import(*target, Export(*source, id));
  ASSERT_TRUE(imported.ok()) << imported.status();
  ASSERT_TRUE(source->TruncateSession(id, 3).ok());
  ASSERT_TRUE(target->TruncateSession(imported->session_id, 3).ok());
  const Snapshot again = Export(*target, imported->session_id);
  EXPECT_EQ(again.header.first_positions, (std::vector<int64_t>{0, 0}));
  auto reimported = Import(*source, again);
  ASSERT_TRUE(reimported.ok()) << reimported.status();
  for (int layer = 0; layer < 2; ++layer) {
    EXPECT_EQ(Append(*source, reimported->session_id, layer, t, 3, 60),
              Append(*source, id, layer, t, 3, 60));
  }
}

class MalformedSnapshotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    engine_ = MakeEngine(int64_t{16} << 20, 4096);
    std::mt19937 rng(9);
    const SessionSpec spec = MakeSpec(shape_, DType::kFloat32);
    const std::string id =
        engine_->CreateSession(spec, absl::ZeroDuration())->session_id;
    Tokens t(2000, shape_, rng, DType::kFloat32);
    for (int layer = 0; layer < 4; ++layer) {
      Append(*engine_, id, layer, t, 0, layer == 0 ? 1500 : 200);
    }
    good_ = Export(*engine_, id);
    ASSERT_GT(good_.chunks.size(), 3u);
    used_ = engine_->stats().pool.used_bytes;
    sessions_ = engine_->stats().active_sessions;
  }

  // `snapshot` fails with `code` and leaves nothing behind.
  void ExpectRejected(const Snapshot& snapshot, absl::StatusCode code,
                      const std::string& message_part) {
    auto imported = Import(*engine_, snapshot);
    EXPECT_EQ(imported.status().code(), code) << imported.status();
    EXPECT_NE(imported.status().message().find(message_part), std::string::npos)
        << imported.status();
    EXPECT_EQ(engine_->stats().pool.used_bytes, used_);
    EXPECT_EQ(engine_->stats().active_sessions, sessions_);
  }

  const Shape4 shape_{4, 2, 16, 8};
  std::unique_ptr<AttentionEngine> engine_;
  Snapshot good_;
  int64_t used_ = 0;
  int64_t sessions_ = 0;
};

TEST_F(MalformedSnapshotTest, TheGoodOneImports) {
  ASSERT_TRUE(Import(*engine_, good_).ok());
}

TEST_F(MalformedSnapshotTest, Truncated) {
  Snapshot s = good_;
  s.chunks.pop_back();
  ExpectRejected(s, absl::StatusCode::kDataLoss, "truncated");
  Reseal(s);
  ExpectRejected(s, absl::StatusCode::kDataLoss, "truncated");
}

TEST_F(MalformedSnapshotTest, Reordered) {
  Snapshot s = good_;
  std::swap(s.chunks[0], s.chunks[1]);
  ExpectRejected(s, absl::StatusCode::kInvalidArgument, "out of order");
}

TEST_F(MalformedSnapshotTest, CorruptedBytesFailTheChecksum) {
  Snapshot s = good_;
  s.chunks[2].k[17] ^= 0x04;
  ExpectRejected(s, absl::StatusCode::kDataLoss, "checksum");
  s = good_;
  s.header.idle_deadline_unix_ms += 1;
  ExpectRejected(s, absl::StatusCode::kDataLoss, "checksum");
  s = good_;
  s.header.owner = "mallory";  // the owner is checksummed too
  ExpectRejected(s, absl::StatusCode::kDataLoss, "checksum");
  s = good_;
  s.trailer.num_chunks += 1;
  ExpectRejected(s, absl::StatusCode::kDataLoss, "chunks");
}

TEST_F(MalformedSnapshotTest, Oversized) {
  Snapshot s = good_;
  // Layer 0 holds 1500 rows of 192 bytes; claim 1400 rows in one chunk...
  SnapshotChunk& chunk = s.chunks[0];
  chunk.num_tokens = 1400;
  ExpectRejected(s, absl::StatusCode::kInvalidArgument, "bytes");
  // ...or one real chunk of more than 4 MiB.
  auto big = MakeEngine(int64_t{64} << 20, 64 << 10);
  SessionSpec spec;
  spec.num_layers = 1;
  spec.num_q_heads = 8;
  spec.num_kv_heads = 8;
  spec.head_dim = 64;
  spec.max_tokens = 4096;
  const std::string id =
      big->CreateSession(spec, absl::ZeroDuration())->session_id;
  std::mt19937 rng(1);
  const Shape4 shape{8, 8, 64, 64};
  Tokens t(1100, shape, rng, DType::kFloat32);
  Append(*big, id, 0, t, 0, 1100);
  Snapshot large = Export(*big, id);
  ASSERT_GT(large.chunks.size(), 4u);
  SnapshotChunk merged = large.chunks[0];
  for (size_t i = 1; i < large.chunks.size(); ++i) {
    merged.k += large.chunks[i].k;
    merged.v += large.chunks[i].v;
    merged.num_tokens += large.chunks[i].num_tokens;
  }
  large.chunks = {merged};
  Reseal(large);
  auto imported = Import(*big, large);
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(imported.status().message().find("over the limit"),
            std::string::npos);
  EXPECT_EQ(big->stats().active_sessions, 1);
}

// A later version is a newer server's valid snapshot: FAILED_PRECONDITION
// (kept by --snapshot_dir), not INVALID_ARGUMENT (put aside as corrupt).
TEST_F(MalformedSnapshotTest, UnknownVersion) {
  Snapshot s = good_;
  s.header.format_version = 3;
  Reseal(s);
  ExpectRejected(s, absl::StatusCode::kFailedPrecondition, "version 3");
  s.header.format_version = 0;
  Reseal(s);
  ExpectRejected(s, absl::StatusCode::kInvalidArgument, "version 0");
}

// Dense sessions are written in version 1 (readable by servers that know
// only it); version 2, whose encoding adds the newer fields, holds them too.
TEST_F(MalformedSnapshotTest, DenseSessionsAreVersion1AndVersion2Reads) {
  EXPECT_EQ(good_.header.format_version, kSnapshotFormatVersion);
  for (const SnapshotChunk& chunk : good_.chunks) {
    EXPECT_TRUE(chunk.index_k.empty());
  }
  Snapshot s = good_;
  s.header.format_version = kSnapshotFormatVersionLatentTopK;
  EXPECT_EQ(Import(*engine_, s).status().code(), absl::StatusCode::kDataLoss)
      << "version 2 checksums more fields than version 1";
  Reseal(s);
  EXPECT_TRUE(Import(*engine_, s).ok());
}

TEST_F(MalformedSnapshotTest, InconsistentHeaders) {
  Snapshot s = good_;
  s.header.kv_bytes += 4;
  ExpectRejected(s, absl::StatusCode::kInvalidArgument, "kv_bytes");
  s = good_;
  s.header.layer_lengths.pop_back();
  ExpectRejected(s, absl::StatusCode::kInvalidArgument, "layer lengths");
  s = good_;
  s.header.kv_dtype = DType::kFloat16;
  ExpectRejected(s, absl::StatusCode::kInvalidArgument, "kv_dtype");
  s = good_;
  s.header.first_positions[1] = 199;  // the window needs more
  ExpectRejected(s, absl::StatusCode::kInvalidArgument, "first position");
  s = good_;
  s.header.layer_lengths[0] = 5000;  // past max_tokens
  ExpectRejected(s, absl::StatusCode::kInvalidArgument, "max_tokens");
  s = good_;
  s.header.spec.num_q_heads = 3;  // not a multiple of the KV heads
  ExpectRejected(s, absl::StatusCode::kInvalidArgument, "spec");
  s = good_;
  s.header.spec.scale = 0.0f;  // not resolved
  ExpectRejected(s, absl::StatusCode::kInvalidArgument, "resolved");
  // An owner no tenant can have, quoted short.
  s = good_;
  s.header.owner = std::string(100000, 'o');
  Reseal(s);
  ExpectRejected(s, absl::StatusCode::kInvalidArgument,
                 "tenant names have at most 64");
  EXPECT_LT(Import(*engine_, s).status().message().size(), 400u);
}

TEST_F(MalformedSnapshotTest, BadChunks) {
  Snapshot s = good_;
  s.chunks[1].v.pop_back();
  ExpectRejected(s, absl::StatusCode::kInvalidArgument, "bytes of k");
  s = good_;
  s.chunks.push_back(s.chunks.back());
  ExpectRejected(s, absl::StatusCode::kInvalidArgument, "after every row");
  s = good_;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(s.chunks[1].k.data(), &nan, 4);
  Reseal(s);
  ExpectRejected(s, absl::StatusCode::kInvalidArgument, "finite");
}

TEST_F(MalformedSnapshotTest, PoolExhaustionIsUpFront) {
  auto small = MakeEngine(int64_t{256} << 10, 4096);
  auto imported = Import(*small, good_);
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(imported.status().message().find("KV blocks"), std::string::npos)
      << imported.status();
  EXPECT_EQ(small->stats().pool.used_bytes, 0);
  EXPECT_EQ(small->stats().active_sessions, 0);
  // BeginImport alone refuses it, before any data.
  EXPECT_EQ(small->BeginImport(good_.header, {}).status().code(),
            absl::StatusCode::kResourceExhausted);
}

// A window layer's table covers positions whose rows were dropped: a header
// of long layers that carry nothing still builds tables. An import sets
// their metadata aside before it builds them (4 bytes an entry, and 8 for
// the block it fills), so that imports in progress too stay within the
// server's bound; the session then counts its tables, which store no entry
// for a run of dropped blocks (as a live session's): here one entry a
// layer, for the block its next position goes to.
TEST(SessionImportTest, BlockTablesOfDroppedRowsAreMetadata) {
  SessionSpec spec;
  spec.num_layers = 4;
  spec.num_q_heads = 4;
  spec.num_kv_heads = 2;
  spec.head_dim = 16;
  spec.value_dim = 8;
  spec.max_tokens = 4096;
  LayerSpec window;
  window.window = 1;
  spec.layers = {window};
  EngineOptions options;
  options.kv_cache_bytes = int64_t{1} << 20;
  options.kv_block_bytes = 4096;  // 21 rows of 192 bytes
  options.version = "test";
  options.sessions.reap_interval = absl::ZeroDuration();
  auto resolved = ResolveSessionSpec(spec, options.sessions.limits);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  const int64_t spec_bytes = SessionMetadataBytes(*resolved);
  options.sessions.max_metadata_bytes = spec_bytes + 6000;
  auto engine =
      AttentionEngine::Create(std::make_unique<CpuBackend>(2), options);
  ASSERT_TRUE(engine.ok()) << engine.status();

  const std::string id =
      (*engine)->CreateSession(spec, absl::ZeroDuration())->session_id;
  Snapshot s = Export(**engine, id);
  ASSERT_TRUE((*engine)->DeleteSession(id).ok());
  const auto long_and_empty = [&s](int64_t length) {
    s.header.layer_lengths.assign(4, length);
    s.header.first_positions.assign(4, length);  // a window of 1 keeps none
    s.header.kv_bytes = 0;
    s.chunks.clear();
    Reseal(s);
  };

  long_and_empty(4096);  // 4 tables of 196 entries: 9408 bytes staged
  auto refused = (*engine)->BeginImport(s.header, {});
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted)
      << refused.status();
  EXPECT_NE(refused.status().message().find(
                absl::StrCat(spec_bytes + 9408, " bytes of session metadata")),
            std::string::npos)
      << refused.status();
  EXPECT_EQ((*engine)->stats().active_sessions, 0);
  EXPECT_EQ((*engine)->stats().session_metadata_bytes, 0);

  long_and_empty(2000);  // 4 tables of 96 entries: 4608 bytes staged
  {
    auto staged = (*engine)->BeginImport(s.header, {});
    ASSERT_TRUE(staged.ok()) << staged.status();
    EXPECT_EQ((*engine)->stats().session_metadata_bytes, spec_bytes + 4608);
    // A second import of it at the same time does not fit beside it.
    EXPECT_EQ((*engine)->BeginImport(s.header, {}).status().code(),
              absl::StatusCode::kResourceExhausted);
  }
  EXPECT_EQ((*engine)->stats().session_metadata_bytes, 0);
  auto imported = Import(**engine, s);
  ASSERT_TRUE(imported.ok()) << imported.status();
  EXPECT_EQ(imported->layer_lengths, (std::vector<int64_t>(4, 2000)));
  EXPECT_LE(imported->kv_cache_bytes, 4 * 4096);  // at most a block a layer
  EXPECT_EQ(imported->metadata_bytes,
            SessionMetadataBytes(*resolved) + 4 * kBlockTableEntryBytes);
  EXPECT_EQ((*engine)->stats().session_metadata_bytes,
            imported->metadata_bytes);
}

// A hand-over asks a peer again when an import's answer was lost; the peer
// must then say ALREADY_EXISTS if the lost attempt created the session,
// also when that copy leaves no metadata room for another (a refusal would
// leave two live copies).
TEST(SessionImportTest, AnIdHeldHereIsAlreadyExistsBeforeTheMetadataBound) {
  const Shape4 shape{4, 2, 16, 8};
  const SessionSpec spec = MakeSpec(shape, DType::kFloat32);
  EngineOptions options;
  options.kv_cache_bytes = int64_t{16} << 20;
  options.kv_block_bytes = 4096;  // 21 rows of 192 bytes
  options.version = "test";
  options.sessions.reap_interval = absl::ZeroDuration();
  auto resolved = ResolveSessionSpec(spec, options.sessions.limits);
  ASSERT_TRUE(resolved.ok()) << resolved.status();
  // The session itself fits; an import's tables (20 entries of 12 bytes)
  // would not.
  options.sessions.max_metadata_bytes = SessionMetadataBytes(*resolved) + 100;
  auto engine =
      AttentionEngine::Create(std::make_unique<CpuBackend>(2), options);
  ASSERT_TRUE(engine.ok()) << engine.status();
  std::mt19937 rng(5);
  Tokens t(100, shape, rng, DType::kFloat32);
  const std::string id =
      (*engine)->CreateSession(spec, absl::ZeroDuration())->session_id;
  for (int layer = 0; layer < 4; ++layer)
    Append(**engine, id, layer, t, 0, 100);
  const Snapshot snapshot = Export(**engine, id);
  ImportOptions keep;
  keep.keep_session_id = true;
  auto again = Import(**engine, snapshot, keep);
  EXPECT_EQ(again.status().code(), absl::StatusCode::kAlreadyExists)
      << again.status();
  EXPECT_EQ((*engine)->stats().active_sessions, 1);
}

// A hand-over that asks a peer again after a lost answer must find the
// lost attempt's outcome there, not race it: imports of one kept id run one
// at a time. The second waits while the first runs, then finds its session
// (ALREADY_EXISTS) or, if it was dropped, none; its control bounds the wait.
TEST(SessionImportTest, ImportsOfOneKeptIdRunOneAtATime) {
  const Shape4 shape{2, 2, 16, 8};
  std::mt19937 rng(21);
  auto source = MakeEngine(int64_t{16} << 20, 4096);
  auto target = MakeEngine(int64_t{16} << 20, 4096);
  const std::string id =
      source->CreateSession(MakeSpec(shape, DType::kFloat32), absl::Minutes(3))
          ->session_id;
  Tokens t(40, shape, rng, DType::kFloat32);
  for (int layer = 0; layer < 2; ++layer) Append(*source, id, layer, t, 0, 40);
  const Snapshot snapshot = Export(*source, id);
  ImportOptions keep;
  keep.keep_session_id = true;
  // Begins a second import of the id on another thread; `done` is notified
  // when Begin returned, with its result in `result`.
  struct Second {
    absl::StatusOr<std::unique_ptr<SessionImport>> result =
        absl::UnknownError("not yet");
    absl::Notification done;
    std::thread thread;
  };
  auto begin_second = [&](Second& second, const ImportOptions& options) {
    second.thread = std::thread([&, options] {
      second.result = target->BeginImport(snapshot.header, options);
      second.done.Notify();
    });
  };

  // The first finishes: the second finds its session.
  auto first = target->BeginImport(snapshot.header, keep);
  ASSERT_TRUE(first.ok()) << first.status();
  for (const SnapshotChunk& chunk : snapshot.chunks) {
    ASSERT_TRUE((*first)->AddChunk(chunk).ok());
  }
  Second after_finish;
  begin_second(after_finish, keep);
  // However long it is given, it cannot return while the first runs.
  EXPECT_FALSE(
      after_finish.done.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  ASSERT_TRUE((*first)->Finish(snapshot.trailer).ok());
  after_finish.thread.join();
  EXPECT_EQ(after_finish.result.status().code(),
            absl::StatusCode::kAlreadyExists)
      << after_finish.result.status();
  EXPECT_EQ(target->stats().active_sessions, 1);

  // The first is dropped: the second goes ahead and creates it.
  ASSERT_TRUE(target->DeleteSession(id).ok());
  auto dropped = target->BeginImport(snapshot.header, keep);
  ASSERT_TRUE(dropped.ok()) << dropped.status();
  Second after_drop;
  begin_second(after_drop, keep);
  EXPECT_FALSE(
      after_drop.done.WaitForNotificationWithTimeout(absl::Milliseconds(50)));
  dropped->reset();
  after_drop.thread.join();
  ASSERT_TRUE(after_drop.result.ok()) << after_drop.result.status();
  for (const SnapshotChunk& chunk : snapshot.chunks) {
    ASSERT_TRUE((*after_drop.result)->AddChunk(chunk).ok());
  }
  auto info = (*after_drop.result)->Finish(snapshot.trailer);
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->session_id, id);
  after_drop.result->reset();

  // A withdrawn call stops waiting, and takes nothing.
  ASSERT_TRUE(target->DeleteSession(id).ok());
  auto held = target->BeginImport(snapshot.header, keep);
  ASSERT_TRUE(held.ok()) << held.status();
  CancellationFlag cancel;
  ImportOptions withdrawn = keep;
  withdrawn.control = &cancel;
  Second cancelled;
  begin_second(cancelled, withdrawn);
  cancel.Cancel();
  cancelled.thread.join();
  EXPECT_EQ(cancelled.result.status().code(), absl::StatusCode::kCancelled)
      << cancelled.result.status();
  held->reset();
  EXPECT_EQ(target->stats().active_sessions, 0);
  EXPECT_EQ(target->stats().pool.used_bytes, 0);
}

// A session whose token does not fit this server's KV blocks is a valid
// snapshot another server takes: FAILED_PRECONDITION (a restore moves it
// aside as rejected, not as corrupt).
TEST(SessionImportTest, BlocksTooSmallForATokenAreAFailedPrecondition) {
  const Shape4 shape{4, 4, 64, 64};  // 2048 bytes a token and layer
  std::mt19937 rng(6);
  auto source = MakeEngine(int64_t{16} << 20, 4096);
  auto target = MakeEngine(int64_t{16} << 20, 1024);
  const SessionSpec spec = MakeSpec(shape, DType::kFloat32);
  const std::string id =
      source->CreateSession(spec, absl::ZeroDuration())->session_id;
  Tokens t(8, shape, rng, DType::kFloat32);
  for (int layer = 0; layer < 4; ++layer) Append(*source, id, layer, t, 0, 8);
  auto refused = Import(*target, Export(*source, id));
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition)
      << refused.status();
  EXPECT_NE(refused.status().message().find("--kv_block_bytes >= 2048"),
            std::string::npos)
      << refused.status();
}

TEST_F(MalformedSnapshotTest, TenantQuotasAreUpFrontAndRestoresKeepTheOwner) {
  EXPECT_EQ(good_.header.owner, kDefaultTenantName);
  ImportOptions options;
  options.tenant.name = "small";
  options.tenant.quota.max_kv_bytes = 4096;
  auto refused = Import(*engine_, good_, options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted)
      << refused.status();
  EXPECT_NE(refused.status().message().find("max_kv_bytes of 4096"),
            std::string::npos)
      << refused.status();
  EXPECT_EQ(engine_->tenant_stats("small").kv_bytes, 0);
  EXPECT_EQ(engine_->stats().pool.used_bytes, used_);
  options.tenant.quota = TenantQuota{.max_sessions = 0, .max_kv_bytes = {}};
  EXPECT_EQ(Import(*engine_, good_, options).status().code(),
            absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(engine_->stats().active_sessions, sessions_);

  // A restore gives the session to the header's owner, not to `tenant`.
  Snapshot s = good_;
  s.header.owner = "alice";
  Reseal(s);
  options.keep_owner = true;
  auto restored = Import(*engine_, s, options);
  ASSERT_TRUE(restored.ok()) << restored.status();
  EXPECT_EQ(restored->owner, "alice");
  const Tenant alice{.name = "alice", .quota = {}};
  EXPECT_TRUE(engine_->GetSession(restored->session_id, alice).ok());
  EXPECT_EQ(engine_->GetSession(restored->session_id).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(engine_->tenant_stats("alice").sessions, 1);
  EXPECT_EQ(engine_->tenant_stats("alice").kv_bytes,
            engine_->stats().pool.used_bytes - used_);
  EXPECT_EQ(engine_->tenant_stats("small").sessions, 0);
}

TEST_F(MalformedSnapshotTest, AbandonedImportReturnsItsBlocks) {
  auto import = engine_->BeginImport(good_.header, {});
  ASSERT_TRUE(import.ok());
  ASSERT_TRUE((*import)->AddChunk(good_.chunks[0]).ok());
  EXPECT_GT(engine_->stats().pool.used_bytes, used_);
  import->reset();
  EXPECT_EQ(engine_->stats().pool.used_bytes, used_);
  EXPECT_EQ(engine_->stats().active_sessions, sessions_);
}

}  // namespace
}  // namespace attention
