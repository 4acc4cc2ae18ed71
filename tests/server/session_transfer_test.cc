// ExportSession / ImportSession over gRPC and --snapshot_dir on an
// in-process server: round trips that continue bitwise, every malformed
// stream refused with nothing left behind, the snapshot on drain restored
// at the next start, and a corrupt file moved aside.
#include "server/session_transfer.h"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"
#include "server/snapshot_store.h"
#include "tests/core/hold_at_first_check.h"
#include "tests/server/frozen_reader.h"
#include "tests/server/scoped_temp_dir.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

using Records = std::vector<v1::SessionChunk>;

v1::SessionSpec HybridSpec(v1::DType kv_dtype = v1::DTYPE_FLOAT32) {
  v1::SessionSpec spec = MakeSpec(3, 4, 2, 16, {0, 24, 16}, kv_dtype);
  spec.mutable_layers(2)->set_num_sink_tokens(4);
  for (int h = 0; h < 4; ++h) spec.mutable_layers(1)->add_sink_logits(0.5f * h);
  return spec;
}

absl::StatusOr<Records> Export(client::AttentionClient& client,
                               const std::string& id) {
  Records records;
  absl::Status status =
      client.ExportSession(id, [&](const v1::SessionChunk& record) {
        records.push_back(record);
        return absl::OkStatus();
      });
  if (!status.ok()) return status;
  return records;
}

absl::StatusOr<v1::SessionInfo> Import(client::AttentionClient& client,
                                       const Records& records,
                                       bool keep_id = false) {
  size_t next = 0;
  return client.ImportSession(
      [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
        if (next == records.size()) return false;
        *record = records[next++];
        return true;
      },
      keep_id);
}

// Prefills `tokens` rows [0, length) into every layer.
void Fill(client::SessionHandle& session, const Tokens& tokens,
          int64_t length) {
  for (int layer = 0; layer < session.spec().num_layers(); ++layer) {
    ATTN_ASSERT_OK(session.Prefill(layer, tokens.q_rows(0, length),
                                   tokens.k_rows(0, length),
                                   tokens.v_rows(0, length)));
  }
}

// `count` sessions of HybridSpec() on `client`, each holding `length`
// random tokens (seeds `seed`, `seed` + 1, ...); their ids.
std::vector<std::string> FilledSessions(client::AttentionClient& client,
                                        int count, int64_t length,
                                        uint32_t seed) {
  std::vector<std::string> ids;
  for (int i = 0; i < count; ++i) {
    auto session = client.OpenSession(HybridSpec());
    if (!session.ok()) {
      ADD_FAILURE() << session.status();
      break;
    }
    Fill(*session, RandomTokens(session->spec(), length, seed + i), length);
    ids.push_back(session->id());
  }
  return ids;
}

// Decode steps [from, to) on every layer; the outputs' bytes.
std::vector<std::string> Continue(client::SessionHandle& session,
                                  const Tokens& tokens, int64_t from,
                                  int64_t to) {
  std::vector<std::string> outputs;
  for (int64_t t = from; t < to; ++t) {
    for (int layer = 0; layer < session.spec().num_layers(); ++layer) {
      auto result = session.DecodeStep(
          layer, tokens.q_rows(t, 1), tokens.k_rows(t, 1), tokens.v_rows(t, 1));
      EXPECT_TRUE(result.ok()) << result.status();
      outputs.push_back(result.ok() ? result->output().data() : "");
    }
  }
  return outputs;
}

// MLA shared-latent (latent 16 + RoPE 8, one KV head) or separate K/V
// sessions whose layers 0 and 2 are top-k: full; dense window with sinks;
// top-k ReLU window with learned sinks.
v1::SessionSpec SparseSpec(bool latent) {
  v1::SessionSpec spec = MakeSpec(3, 4, latent ? 1 : 2, 24, {0, 24, 30});
  spec.set_value_dim(16);
  if (latent) {
    spec.set_kv_layout(v1::KV_LAYOUT_SHARED_LATENT);
    spec.set_scale(0.25f);
  }
  spec.mutable_layers(1)->set_num_sink_tokens(2);
  spec.mutable_layers(0)->set_topk(8);
  spec.mutable_layers(2)->set_topk(8);
  spec.mutable_layers(2)->set_index_score(v1::INDEX_SCORE_RELU);
  for (int h = 0; h < 4; ++h)
    spec.mutable_layers(2)->add_sink_logits(0.25f * h);
  spec.set_index_dim(8);
  spec.set_index_heads(2);
  return spec;
}

// Index keys [T, 8], queries [T, 2, 8] and weights [T, 2].
struct IndexTokens {
  std::vector<float> k, q, w;
  IndexTokens(int64_t count, uint32_t seed)
      : k(RandomFloats(count * 8, seed)),
        q(RandomFloats(count * 16, seed + 1)),
        w(RandomFloats(count * 2, seed + 2)) {}
};

void SetFloats(v1::Tensor* out, absl::Span<const float> values,
               std::vector<int64_t> shape) {
  out->set_dtype(v1::DTYPE_FLOAT32);
  out->clear_shape();
  for (int64_t d : shape) out->add_shape(d);
  out->set_data(reinterpret_cast<const char*>(values.data()),
                values.size() * sizeof(float));
}

// Appends rows [begin, end) to `layer` (a DecodeStep for one row) with the
// LSE and the top-k selection; returns the reply's output, LSE and
// selected positions as one string.
template <typename Request>
std::string SendSparse(client::AttentionClient& client, Request request,
                       const IndexTokens& index, int64_t begin, int64_t end) {
  const int64_t rows = end - begin;
  if (request.layer() != 1) {
    SetFloats(request.mutable_index_k(),
              absl::MakeConstSpan(index.k).subspan(begin * 8, rows * 8),
              {rows, 8});
    SetFloats(request.mutable_index_q(),
              absl::MakeConstSpan(index.q).subspan(begin * 16, rows * 16),
              {rows, 2, 8});
    SetFloats(request.mutable_index_weights(),
              absl::MakeConstSpan(index.w).subspan(begin * 2, rows * 2),
              {rows, 2});
    request.set_return_topk_indices(true);
  }
  absl::StatusOr<v1::AttentionResult> result;
  if constexpr (std::is_same_v<Request, v1::DecodeRequest>) {
    result = client.DecodeStep(request);
  } else {
    result = client.Prefill(request);
  }
  EXPECT_TRUE(result.ok()) << result.status();
  if (!result.ok()) return "";
  std::string out = result->output().data() + result->lse().data();
  for (int64_t position : result->topk_indices()) {
    out += absl::StrCat(",", position);
  }
  return out;
}

std::string StepSparse(client::AttentionClient& client,
                       client::SessionHandle& session, const Tokens& t,
                       const IndexTokens& index, int layer, int64_t begin,
                       int64_t end) {
  const bool latent = session.spec().kv_layout() == v1::KV_LAYOUT_SHARED_LATENT;
  const absl::Span<const float> v =
      latent ? absl::Span<const float>() : t.v_rows(begin, end - begin);
  client::StepOptions options;
  options.return_lse = true;
  if (end - begin == 1) {
    auto request = session.MakeDecodeRequest(layer, t.q_rows(begin, 1),
                                             t.k_rows(begin, 1), v, options);
    EXPECT_TRUE(request.ok()) << request.status();
    return request.ok() ? SendSparse(client, *request, index, begin, end) : "";
  }
  auto request =
      session.MakePrefillRequest(layer, t.q_rows(begin, end - begin),
                                 t.k_rows(begin, end - begin), v, options);
  EXPECT_TRUE(request.ok()) << request.status();
  return request.ok() ? SendSparse(client, *request, index, begin, end) : "";
}

// Decode steps [from, to) on every layer of a SparseSpec session.
std::vector<std::string> ContinueSparse(client::AttentionClient& client,
                                        client::SessionHandle& session,
                                        const Tokens& t,
                                        const IndexTokens& index, int64_t from,
                                        int64_t to) {
  std::vector<std::string> outputs;
  for (int64_t p = from; p < to; ++p) {
    for (int layer = 0; layer < 3; ++layer) {
      outputs.push_back(StepSparse(client, session, t, index, layer, p, p + 1));
    }
  }
  return outputs;
}

class SessionSnapshotTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto a = StartTestServer();
    ATTN_ASSERT_OK(a);
    a_ = *std::move(a);
    server::ServerOptions options = TestServerOptions();
    options.kv_block_bytes = 8192;  // another block size
    auto b = StartTestServer(options);
    ATTN_ASSERT_OK(b);
    b_ = *std::move(b);
  }

  std::unique_ptr<TestServer> a_, b_;
};

TEST_F(SessionSnapshotTest, ExportImportContinuesBitwise) {
  for (v1::DType dtype : {v1::DTYPE_FLOAT32, v1::DTYPE_BFLOAT16}) {
    const v1::SessionSpec spec = HybridSpec(dtype);
    auto original = a_->client->OpenSession(spec);
    ATTN_ASSERT_OK(original);
    const Tokens tokens = RandomTokens(original->spec(), 160, 21);
    Fill(*original, tokens, 150);
    auto records = Export(*a_->client, original->id());
    ATTN_ASSERT_OK(records);
    ASSERT_GE(records->size(), 3u);
    EXPECT_TRUE(records->front().has_header());
    EXPECT_TRUE(records->back().has_trailer());
    EXPECT_EQ(records->front().header().server_version(),
              a_->server->engine().options().version);
    auto imported = Import(*b_->client, *records);
    ATTN_ASSERT_OK(imported);
    EXPECT_NE(imported->session_id(), original->id());
    EXPECT_EQ(imported->layer_lengths().size(), 3);
    client::SessionHandle copy(b_->client.get(), *imported);
    EXPECT_EQ(Continue(copy, tokens, 150, 160),
              Continue(*original, tokens, 150, 160));
  }
  const std::string metrics = b_->server->metrics().TextExposition();
  EXPECT_TRUE(absl::StrContains(metrics, "attention_sessions_imported_total 2"))
      << metrics;
  EXPECT_TRUE(absl::StrContains(a_->server->metrics().TextExposition(),
                                "attention_sessions_exported_total 2"));
}

// MLA shared-latent and top-k sessions move through the RPCs too: the
// imported session continues bitwise (outputs, LSE, selections), also after
// a fork of the original and a truncation of the copy.
TEST_F(SessionSnapshotTest, LatentAndTopKSessionsContinueBitwise) {
  for (bool latent : {true, false}) {
    SCOPED_TRACE(latent ? "latent" : "separate");
    auto original = a_->client->OpenSession(SparseSpec(latent));
    ATTN_ASSERT_OK(original);
    const Tokens tokens = RandomTokens(original->spec(), 140, 71);
    const IndexTokens index(140, 72);
    for (int layer = 0; layer < 3; ++layer) {
      StepSparse(*a_->client, *original, tokens, index, layer, 0, 120);
    }
    auto records = Export(*a_->client, original->id());
    ATTN_ASSERT_OK(records);
    EXPECT_EQ(records->front().header().format_version(), 2u);
    EXPECT_TRUE(records->at(1).data().v().empty() == latent);
    EXPECT_FALSE(records->at(1).data().index_k().empty());
    auto imported = Import(*b_->client, *records);
    ATTN_ASSERT_OK(imported);
    client::SessionHandle copy(b_->client.get(), *imported);
    auto fork = original->Fork();
    ATTN_ASSERT_OK(fork);
    EXPECT_EQ(ContinueSparse(*b_->client, copy, tokens, index, 120, 130),
              ContinueSparse(*a_->client, *original, tokens, index, 120, 130));
    // Truncated back, the copy replays the fork's steps bitwise.
    ATTN_ASSERT_OK(copy.Truncate(120));
    EXPECT_EQ(ContinueSparse(*b_->client, copy, tokens, index, 120, 125),
              ContinueSparse(*a_->client, *fork, tokens, index, 120, 125));
  }
}

TEST_F(SessionSnapshotTest, KeepIdAndUnknownSession) {
  auto original = a_->client->OpenSession(HybridSpec());
  ATTN_ASSERT_OK(original);
  Fill(*original, RandomTokens(original->spec(), 20, 3), 20);
  auto records = Export(*a_->client, original->id());
  ATTN_ASSERT_OK(records);
  auto kept = Import(*b_->client, *records, /*keep_id=*/true);
  ATTN_ASSERT_OK(kept);
  EXPECT_EQ(kept->session_id(), original->id());
  ATTN_EXPECT_CODE(Import(*b_->client, *records, /*keep_id=*/true),
                   absl::StatusCode::kAlreadyExists);
  ATTN_EXPECT_CODE(Export(*a_->client, "no-such-session"),
                   absl::StatusCode::kNotFound);
}

// An import the server refused says so in its trailers, whatever the
// code (a replica handing a session over then knows nothing was created);
// one that created the session does not. One whose header passed the
// checks says so in its initial metadata: no session of the id was held
// (a hand-over asking again then knows its first attempt left nothing
// there).
TEST_F(SessionSnapshotTest, ARefusedImportSaysSoInItsTrailers) {
  auto original = a_->client->OpenSession(HybridSpec());
  ATTN_ASSERT_OK(original);
  Fill(*original, RandomTokens(original->spec(), 20, 3), 20);
  auto records = Export(*a_->client, original->id());
  ATTN_ASSERT_OK(records);
  (*records)[0].set_keep_session_id(true);
  bool id_checked = true;
  const auto import = [&](const Records& sent,
                          bool* refused) -> grpc::StatusCode {
    grpc::ClientContext context;
    v1::SessionInfo info;
    auto writer = b_->client->stub()->ImportSession(&context, &info);
    for (const v1::SessionChunk& record : sent) {
      if (!writer->Write(record)) break;
    }
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    const auto& trailers = context.GetServerTrailingMetadata();
    const auto set = [](const auto& metadata, const char* key) {
      auto it = metadata.find(key);
      return it != metadata.end() && it->second == "1";
    };
    *refused = set(trailers, server::kImportRefusedMetadata);
    id_checked = set(context.GetServerInitialMetadata(),
                     server::kImportIdCheckedMetadata);
    return status.error_code();
  };
  bool refused = true;
  EXPECT_EQ(import(*records, &refused), grpc::StatusCode::OK);
  EXPECT_FALSE(refused);
  EXPECT_TRUE(id_checked);
  EXPECT_EQ(import(*records, &refused), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_TRUE(refused);
  EXPECT_FALSE(id_checked);
  Records cut(records->begin(), records->end() - 1);  // no trailer
  cut[0].mutable_header()->set_session_id("another-id");
  EXPECT_EQ(import(cut, &refused), grpc::StatusCode::DATA_LOSS);
  EXPECT_TRUE(refused);
  EXPECT_TRUE(id_checked);
  // Refused before the id was looked up: no news of it.
  Records bad_id = cut;
  bad_id[0].mutable_header()->set_session_id("bad id with spaces");
  EXPECT_EQ(import(bad_id, &refused), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_TRUE(refused);
  EXPECT_FALSE(id_checked);
}

TEST_F(SessionSnapshotTest, MalformedStreamsLeaveNothingBehind) {
  auto original = a_->client->OpenSession(HybridSpec());
  ATTN_ASSERT_OK(original);
  Fill(*original, RandomTokens(original->spec(), 200, 5), 200);
  auto good = Export(*a_->client, original->id());
  ATTN_ASSERT_OK(good);
  ASSERT_GE(good->size(), 4u);
  auto before = Snapshot(*b_->client, "");
  const auto expect_refused = [&](const Records& records, absl::StatusCode code,
                                  absl::string_view message_part) {
    auto imported = Import(*b_->client, records);
    EXPECT_EQ(imported.status().code(), code) << imported.status();
    EXPECT_TRUE(absl::StrContains(imported.status().message(), message_part))
        << imported.status();
    auto info = b_->client->GetServerInfo();
    ATTN_ASSERT_OK(info);
    EXPECT_EQ(info->active_sessions(), 0);
    EXPECT_EQ(info->kv_cache_used_bytes(), 0);
  };
  Records records = *good;
  records.pop_back();  // no trailer
  expect_refused(records, absl::StatusCode::kDataLoss, "truncated");
  // A record whose bytes do not parse (a proto3 string of invalid UTF-8)
  // ends gRPC's reads as the stream's end does: it was DATA_LOSS in the
  // middle of the stream, and after the trailer the import succeeded.
  v1::SessionChunk unparsable;
  unparsable.mutable_header()->set_session_id("\xff\xfe");
  records = *good;
  records.insert(records.begin() + 2, unparsable);
  expect_refused(records, absl::StatusCode::kInvalidArgument,
                 "a record of the snapshot stream: the request bytes are not "
                 "a valid protobuf message for "
                 "/attention.v1.AttentionService/ImportSession");
  records = *good;
  records.push_back(unparsable);
  expect_refused(records, absl::StatusCode::kInvalidArgument,
                 "a record of the snapshot stream: the request bytes are not "
                 "a valid protobuf message for "
                 "/attention.v1.AttentionService/ImportSession");
  expect_refused({}, absl::StatusCode::kDataLoss, "truncated");
  records = *good;
  records.erase(records.begin() + 1);  // a data chunk missing
  expect_refused(records, absl::StatusCode::kInvalidArgument, "out of order");
  records = *good;
  std::swap(records[1], records[2]);
  expect_refused(records, absl::StatusCode::kInvalidArgument, "out of order");
  records = *good;
  (*records[1].mutable_data()->mutable_k())[5] ^= 0x10;
  expect_refused(records, absl::StatusCode::kDataLoss, "checksum");
  records = *good;
  records.push_back(records.back());  // a record after the trailer
  expect_refused(records, absl::StatusCode::kInvalidArgument, "trailer");
  records = *good;
  std::swap(records[0], records[1]);  // no header first
  expect_refused(records, absl::StatusCode::kInvalidArgument, "header");
  records = *good;
  records[0].mutable_header()->set_format_version(7);
  expect_refused(records, absl::StatusCode::kFailedPrecondition, "version 7");
  // A later version's header may hold values this build does not know: it
  // is still a newer server's snapshot, not a broken one.
  records[0].mutable_header()->set_kv_dtype(static_cast<v1::DType>(42));
  records[0].mutable_header()->mutable_spec()->set_kv_layout(
      static_cast<v1::KvLayout>(9));
  expect_refused(records, absl::StatusCode::kFailedPrecondition, "version 7");
  records = *good;
  records[0].mutable_header()->set_kv_bytes(1);
  expect_refused(records, absl::StatusCode::kInvalidArgument, "kv_bytes");
  // A spec's num_layers is checked before anything is sized from it.
  for (const int32_t layers : {-1, 0, std::numeric_limits<int32_t>::max()}) {
    records = *good;
    v1::SessionSpec* spec = records[0].mutable_header()->mutable_spec();
    spec->set_num_layers(layers);
    spec->clear_layers();
    expect_refused(records, absl::StatusCode::kInvalidArgument, "num_layers");
  }
  // Still importable after all that.
  ATTN_EXPECT_OK(Import(*b_->client, *good));
}

TEST_F(SessionSnapshotTest, ImportRespectsThePool) {
  server::ServerOptions options = TestServerOptions();
  options.kv_cache_bytes = 64 << 10;
  auto small = StartTestServer(options);
  ATTN_ASSERT_OK(small);
  auto original = a_->client->OpenSession(HybridSpec());
  ATTN_ASSERT_OK(original);
  Fill(*original, RandomTokens(original->spec(), 400, 5), 400);
  auto records = Export(*a_->client, original->id());
  ATTN_ASSERT_OK(records);
  ATTN_EXPECT_CODE(Import(*(*small)->client, *records),
                   absl::StatusCode::kResourceExhausted);
  auto info = (*small)->client->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->kv_cache_used_bytes(), 0);
  EXPECT_EQ(info->active_sessions(), 0);
}

// An import whose SessionInfo reply could, at its largest (the spec's 64
// layers spelled out, the longest id and owner), pass the server's message
// limit is refused right after its header, before anything is reserved, as
// create, fork and truncate are. Every record of this stream fits the limit;
// without the check the import goes through.
TEST_F(SessionSnapshotTest, ImportRespectsTheMessageLimit) {
  v1::SessionSpec wide = MakeSpec(64, 256, 1, 16);
  wide.clear_layers();
  v1::LayerSpec* layer = wide.add_layers();
  for (int h = 0; h < 256; ++h) layer->add_sink_logits(0.5f);
  auto created = a_->client->CreateSession(wide);
  ATTN_ASSERT_OK(created);
  auto records = Export(*a_->client, created->session_id());
  ATTN_ASSERT_OK(records);
  server::ServerOptions options = TestServerOptions();
  options.max_message_bytes =
      static_cast<int64_t>(records->front().ByteSizeLong()) + 256;
  for (const v1::SessionChunk& record : *records) {
    ASSERT_LE(static_cast<int64_t>(record.ByteSizeLong()),
              options.max_message_bytes);
  }
  auto small = StartTestServer(options);
  ATTN_ASSERT_OK(small);
  auto imported = Import(*(*small)->client, *records);
  ATTN_EXPECT_CODE(imported, absl::StatusCode::kResourceExhausted);
  EXPECT_NE(imported.status().message().find("--max_message_bytes"),
            std::string::npos)
      << imported.status();
  auto info = (*small)->client->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->active_sessions(), 0);
  EXPECT_EQ(info->kv_cache_used_bytes(), 0);
}

// A server whose message limit is below the usual 1 MiB chunks exports in
// chunks within half of it, and the copy continues bitwise.
TEST_F(SessionSnapshotTest, ExportChunksFitASmallMessageLimit) {
  server::ServerOptions options = TestServerOptions();
  options.max_message_bytes = 32 << 10;
  auto small = StartTestServer(options);
  ATTN_ASSERT_OK(small);
  auto original = (*small)->client->OpenSession(HybridSpec());
  ATTN_ASSERT_OK(original);
  const Tokens tokens = RandomTokens(original->spec(), 160, 9);
  for (int layer = 0; layer < 3; ++layer) {
    for (int64_t begin = 0; begin < 150; begin += 15) {  // 7.5 KiB requests
      ATTN_ASSERT_OK(original->Prefill(layer, tokens.q_rows(begin, 15),
                                       tokens.k_rows(begin, 15),
                                       tokens.v_rows(begin, 15)));
    }
  }
  auto records = Export(*(*small)->client, original->id());
  ATTN_ASSERT_OK(records);
  for (const v1::SessionChunk& record : *records) {
    // Rows of at most half the limit, plus the record's fields.
    EXPECT_LE(static_cast<int64_t>(record.ByteSizeLong()), (16 << 10) + 128);
  }
  auto imported = Import(*a_->client, *records);
  ATTN_ASSERT_OK(imported);
  client::SessionHandle copy(a_->client.get(), *imported);
  EXPECT_EQ(Continue(copy, tokens, 150, 160),
            Continue(*original, tokens, 150, 160));
}

// A session whose export could not start (its snapshot header, the first
// message, would pass the message limit) is not created: an export or a
// hand-over of it would fail after it had sealed the session. The header
// spells out a first position per layer besides what SessionInfo carries:
// with 1024 sliding-window layers that dropped their first 384 tokens (two
// bytes each), it is about 1 KB larger than the SessionInfo.
TEST(SessionSnapshotLimitTest, ASessionWhoseHeaderCouldNotBeSentIsNotCreated) {
  v1::SessionSpec spec = MakeSpec(1024, 1, 1, 16, {16});
  spec.set_max_tokens(400);
  auto roomy = StartTestServer();
  ATTN_ASSERT_OK(roomy);
  auto session = (*roomy)->client->OpenSession(spec);
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 400, 5);
  for (int layer = 0; layer < 1024; ++layer) {
    ATTN_ASSERT_OK(session->Prefill(layer, tokens.q, tokens.k, tokens.v));
  }
  auto records = Export(*(*roomy)->client, session->id());
  ATTN_ASSERT_OK(records);
  ASSERT_FALSE(records->empty());
  const int64_t header_bytes =
      static_cast<int64_t>(records->front().ByteSizeLong());
  roomy->reset();

  server::ServerOptions options = TestServerOptions();
  options.max_message_bytes = header_bytes - 1;
  auto tight = StartTestServer(options);
  ATTN_ASSERT_OK(tight);
  auto refused = (*tight)->client->CreateSession(spec);
  ATTN_EXPECT_CODE(refused, absl::StatusCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("--max_message_bytes"),
            std::string::npos)
      << refused.status();
  auto info = (*tight)->client->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->active_sessions(), 0);
}

// A transfer whose peer stops moving messages is cancelled after
// --transfer_stall_timeout, and what it held goes: an import's reserved
// blocks, an export's pinned ones.
TEST(StalledTransferTest, IsCancelledAndFreesWhatItHeld) {
  server::ServerOptions options = TestServerOptions();
  options.kv_cache_bytes = int64_t{128} << 20;
  options.kv_block_bytes = 64 << 10;
  options.transfer_stall_timeout = absl::Seconds(2);
  auto server = StartTestServer(options);
  ATTN_ASSERT_OK(server);
  client::AttentionClient& client = *(*server)->client;
  const auto used_bytes = [&] {
    auto info = client.GetServerInfo();
    EXPECT_TRUE(info.ok()) << info.status();
    return info.ok() ? info->kv_cache_used_bytes() : -1;
  };
  // 20 layers × 64 tokens × 32 heads × 128 × fp32 K and V: 40 MiB, more
  // than the transport buffers between a server and a client not reading.
  auto session = client.OpenSession(MakeSpec(20, 32, 32, 128));
  ATTN_ASSERT_OK(session);
  Fill(*session, RandomTokens(session->spec(), 64, 9), 64);
  const int64_t session_bytes = used_bytes();
  ASSERT_GE(session_bytes, int64_t{40} << 20);

  // The export's client stops reading after the header; the session goes
  // meanwhile, its blocks pinned by the export until the server ends it.
  bool pinned = false;
  bool freed = false;
  const absl::Status exported =
      client.ExportSession(session->id(), [&](const v1::SessionChunk&) {
        if (pinned) return absl::OkStatus();
        EXPECT_TRUE(client.DeleteSession(session->id()).ok());
        pinned = used_bytes() == session_bytes;
        freed =
            Eventually([&] { return used_bytes() == 0; }, absl::Seconds(50));
        return absl::OkStatus();
      });
  EXPECT_EQ(exported.code(), absl::StatusCode::kCancelled) << exported;
  EXPECT_TRUE(pinned);
  EXPECT_TRUE(freed);

  // An import that stalls after its header: its reservation goes with it.
  auto original = client.OpenSession(HybridSpec());
  ATTN_ASSERT_OK(original);
  Fill(*original, RandomTokens(original->spec(), 200, 5), 200);
  auto records = Export(client, original->id());
  ATTN_ASSERT_OK(records);
  const int64_t before = used_bytes();
  bool reserved = false;
  freed = false;
  int sent = 0;
  auto imported = client.ImportSession(
      [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
        if (sent == 0) {
          *record = (*records)[sent++];
          return true;
        }
        reserved = Eventually([&] { return used_bytes() > before; },
                              absl::Seconds(50));
        freed = Eventually([&] { return used_bytes() == before; },
                           absl::Seconds(50));
        return false;
      });
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kCancelled)
      << imported.status();
  EXPECT_TRUE(reserved);
  EXPECT_TRUE(freed);
  auto info = client.GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->active_sessions(), 1);
  const std::string metrics = (*server)->server->metrics().TextExposition();
  for (const char* method : {"ExportSession", "ImportSession"}) {
    EXPECT_TRUE(absl::StrContains(
        metrics, absl::StrCat("attention_requests_total{method=\"", method,
                              "\",code=\"CANCELLED\"} 1")))
        << method;
  }
}

// An import waiting for another import of its kept id is not stalled: the
// stall watchdog leaves it waiting (the other import is watched itself),
// and it then finds the session that one created.
TEST(StalledTransferTest, WaitingForAnotherImportOfTheIdIsNoStall) {
  server::ServerOptions options = TestServerOptions();
  options.transfer_stall_timeout = absl::Seconds(2);
  auto server = StartTestServer(options);
  ATTN_ASSERT_OK(server);
  client::AttentionClient& client = *(*server)->client;
  const auto used_bytes = [&] {
    auto info = client.GetServerInfo();
    return info.ok() ? info->kv_cache_used_bytes() : -1;
  };
  auto original = client.OpenSession(HybridSpec());
  ATTN_ASSERT_OK(original);
  Fill(*original, RandomTokens(original->spec(), 200, 5), 200);
  auto records = Export(client, original->id());
  ATTN_ASSERT_OK(records);
  ATTN_ASSERT_OK(client.DeleteSession(original->id()));
  Records keep = *records;
  keep[0].set_keep_session_id(true);
  // The first import holds the id for about 4 s, longer than the stall
  // timeout, moving its records well within it.
  ASSERT_GE(keep.size(), 2u);
  const absl::Duration gap = absl::Seconds(4) / (keep.size() - 1);
  ASSERT_LE(gap, absl::Seconds(1)) << keep.size() << " records";
  const int64_t before = used_bytes();
  absl::StatusOr<v1::SessionInfo> first;
  std::thread slow([&] {
    size_t next = 0;
    first = client.ImportSession(
        [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
          if (next == keep.size()) return false;
          if (next > 0) absl::SleepFor(gap);
          *record = keep[next++];
          return true;
        });
  });
  // Its header has claimed the id and reserved its blocks.
  EXPECT_TRUE(
      Eventually([&] { return used_bytes() > before; }, absl::Seconds(50)));
  size_t next = 0;
  auto second = client.ImportSession(
      [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
        if (next == keep.size()) return false;
        *record = keep[next++];
        return true;
      });
  slow.join();
  ATTN_ASSERT_OK(first);
  EXPECT_EQ(first->session_id(), original->id());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kAlreadyExists)
      << second.status();
}

// Imports `records` into `server`, beginning its drain once the import is
// in its handler (the header's blocks are reserved) and calling
// `while_draining` once the server says it drains; then sends the rest.
// Returns the import's result; `*drain_began` whether both waits ended as
// expected. Joins the drain.
absl::StatusOr<v1::SessionInfo> ImportAcrossTheDrain(
    TestServer& server, const Records& records,
    const std::function<void()>& while_draining, bool* drain_began) {
  client::AttentionClient& client = *server.client;
  const auto used_bytes = [&] {
    auto info = client.GetServerInfo();
    return info.ok() ? info->kv_cache_used_bytes() : -1;
  };
  const int64_t before = used_bytes();
  std::thread drain;
  size_t next = 0;
  *drain_began = false;
  auto imported = client.ImportSession(
      [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
        if (next == 1) {
          const bool importing = Eventually(
              [&] { return used_bytes() > before; }, absl::Seconds(20));
          drain = std::thread([&] { server.server->Shutdown(); });
          const bool draining = Eventually(
              [&] {
                auto info = client.GetServerInfo();
                return info.ok() && info->draining();
              },
              absl::Seconds(20));
          *drain_began = importing && draining;
          while_draining();
        }
        if (next == records.size()) return false;
        *record = records[next++];
        return true;
      });
  if (drain.joinable()) drain.join();
  return imported;
}

// An import still streaming when the drain begins is refused at its end:
// the drain's hand-over or snapshot may have listed the sessions already,
// so a session it created would be lost with the process.
TEST(DrainingImportTest, AnImportEndingAfterTheDrainBeganIsUnavailable) {
  server::ServerOptions options = TestServerOptions();
  options.drain_timeout = absl::Seconds(30);
  auto server = StartTestServer(options);
  ATTN_ASSERT_OK(server);
  client::AttentionClient& client = *(*server)->client;
  auto original = client.OpenSession(HybridSpec());
  ATTN_ASSERT_OK(original);
  Fill(*original, RandomTokens(original->spec(), 50, 8), 50);
  auto records = Export(client, original->id());
  ATTN_ASSERT_OK(records);
  bool drain_began = false;
  auto imported = ImportAcrossTheDrain(
      **server, *records, [] {}, &drain_began);
  EXPECT_TRUE(drain_began);
  EXPECT_EQ(imported.status().code(), absl::StatusCode::kUnavailable)
      << imported.status();
}

// A draining server still answers ALREADY_EXISTS for a kept id it holds
// (a hand-over asking again after a lost answer learns that its first
// attempt created the session there) and refuses any other import as
// draining.
TEST(DrainingImportTest, AHeldIdIsStillAlreadyExistsWhileDraining) {
  server::ServerOptions options = TestServerOptions();
  options.drain_timeout = absl::Seconds(30);
  auto server = StartTestServer(options);
  ATTN_ASSERT_OK(server);
  client::AttentionClient& client = *(*server)->client;
  auto held = client.OpenSession(HybridSpec());
  ATTN_ASSERT_OK(held);
  Fill(*held, RandomTokens(held->spec(), 30, 9), 30);
  auto records = Export(client, held->id());
  ATTN_ASSERT_OK(records);
  // The same records asking to keep the id, and asking for a new one.
  Records keep = *records;
  keep[0].set_keep_session_id(true);
  Records fresh = *records;
  fresh[0].set_keep_session_id(false);
  const auto import = [&](const Records& stream) {
    size_t next = 0;
    return client.ImportSession(
        [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
          if (next == stream.size()) return false;
          *record = stream[next++];
          return true;
        });
  };
  absl::StatusOr<v1::SessionInfo> kept_while_draining, fresh_while_draining;
  bool drain_began = false;
  auto holding = ImportAcrossTheDrain(
      **server, fresh,
      [&] {
        kept_while_draining = import(keep);
        fresh_while_draining = import(fresh);
      },
      &drain_began);
  EXPECT_TRUE(drain_began);
  EXPECT_EQ(kept_while_draining.status().code(),
            absl::StatusCode::kAlreadyExists)
      << kept_while_draining.status();
  EXPECT_EQ(fresh_while_draining.status().code(),
            absl::StatusCode::kUnavailable)
      << fresh_while_draining.status();
  EXPECT_EQ(holding.status().code(), absl::StatusCode::kUnavailable)
      << holding.status();
}

// `count` filled sessions written into `dir` by a server that is gone
// since: their ids.
std::vector<std::string> SavedSessions(const std::string& dir, int count) {
  auto server = StartTestServer();
  EXPECT_TRUE(server.ok()) << server.status();
  if (!server.ok()) return {};
  std::vector<std::string> ids =
      FilledSessions(*(*server)->client, count, 10, 70);
  EXPECT_EQ(server::SaveAllSessions((*server)->server->engine(), dir,
                                    absl::Now() + absl::Minutes(1))
                .written,
            count);
  return ids;
}

// A client that stops reading in the middle of its replies (a stopped or
// hung process) keeps gRPC's shutdown waiting past the drain's deadline.
// The snapshot does not wait for it: it is written in time, and holds the
// session.
TEST(SnapshotDirTest, AFrozenClientDoesNotHoldUpTheSnapshot) {
  const ScopedTempDir scoped_dir("snapshot-frozen");
  const std::string& dir = scoped_dir.path();
  server::ServerOptions options = TestServerOptions();
  options.snapshot_dir = dir;
  options.drain_timeout = absl::Seconds(4);
  auto server = StartTestServer(options);
  ATTN_ASSERT_OK(server);
  auto session = (*server)->client->OpenSession(HybridSpec());
  ATTN_ASSERT_OK(session);
  Fill(*session, RandomTokens(session->spec(), 20, 7), 20);

  // Calls whose replies fill the socket buffers.
  const v1::AttentionRequest request = LargeReplyRequest();
  FrozenReader frozen;
  ATTN_ASSERT_OK(frozen.Connect((*server)->server->port()));
  for (int call = 0; call < 2; ++call) {
    ATTN_ASSERT_OK(frozen.Call("/attention.v1.AttentionService/Attention",
                               request.SerializeAsString()));
  }
  ASSERT_TRUE(Eventually(
      [&] {
        return absl::StrContains(
            (*server)->server->metrics().TextExposition(),
            "attention_requests_total{method=\"Attention\",code=\"OK\"} 2");
      },
      absl::Seconds(30)));

  std::atomic<bool> shut_down{false};
  std::thread drain([&] {
    (*server)->server->Shutdown();
    shut_down = true;
  });
  const std::string file = absl::StrCat(dir, "/", session->id(), ".session");
  // The drain's whole budget, and a margin, while the client stays frozen:
  // the snapshot is written and Shutdown returns.
  EXPECT_TRUE(Eventually([&] { return shut_down.load(); },
                         options.drain_timeout + absl::Seconds(4)));
  EXPECT_TRUE(std::filesystem::exists(file));
  // The frozen client still holds gRPC's transport (else this test shows
  // nothing); the server's destruction waits for it.
  EXPECT_FALSE((*server)->server->transport_stopped());
  frozen.Close();
  drain.join();
  EXPECT_TRUE(Eventually([&] { return (*server)->server->transport_stopped(); },
                         absl::Seconds(30)));
}

TEST(SnapshotDirTest, DrainWritesAndStartRestoresBitwise) {
  const ScopedTempDir scoped_dir("snapshot-dir");
  const std::string& dir = scoped_dir.path();
  server::ServerOptions options = TestServerOptions();
  options.snapshot_dir = dir;
  // The snapshot gets the second half of the drain: generous for slow
  // (sanitizer) builds; the drain still ends once the snapshot is written.
  options.drain_timeout = absl::Seconds(60);
  auto first = StartTestServer(options);
  ATTN_ASSERT_OK(first);
  std::vector<std::string> ids;
  std::vector<Tokens> tokens;
  std::vector<std::vector<std::string>> expected;
  for (int i = 0; i < 3; ++i) {
    auto session = (*first)->client->OpenSession(HybridSpec());
    ATTN_ASSERT_OK(session);
    tokens.push_back(RandomTokens(session->spec(), 120, 40 + i));
    Fill(*session, tokens.back(), 100 + 5 * i);
    ids.push_back(session->id());
  }
  // What the sessions would answer next, computed on forks that stay here.
  for (int i = 0; i < 3; ++i) {
    auto fork = (*first)->client->ForkSession(ids[i]);
    ATTN_ASSERT_OK(fork);
    client::SessionHandle handle((*first)->client.get(), *fork);
    expected.push_back(Continue(handle, tokens[i], 100 + 5 * i, 115));
    ATTN_ASSERT_OK(handle.Delete());
  }
  // Leftovers of an earlier crash: a partial file and a corrupt one.
  std::ofstream(dir + "/deadbeef.session.tmp") << "partial";
  std::ofstream(dir + "/0123456789abcdef.session") << "not a snapshot";
  (*first)->server->Shutdown();
  EXPECT_TRUE(absl::StrContains((*first)->server->metrics().TextExposition(),
                                "attention_snapshot_sessions_written_total 3"));
  for (const std::string& id : ids) {
    EXPECT_TRUE(std::filesystem::exists(dir + "/" + id + ".session")) << id;
  }
  first->reset();

  auto second = StartTestServer(options);
  ATTN_ASSERT_OK(second);
  for (int i = 0; i < 3; ++i) {
    auto info = (*second)->client->GetSession(ids[i]);
    ATTN_ASSERT_OK(info);
    client::SessionHandle handle((*second)->client.get(), *info);
    EXPECT_EQ(Continue(handle, tokens[i], 100 + 5 * i, 115), expected[i]);
  }
  const std::string metrics = (*second)->server->metrics().TextExposition();
  EXPECT_TRUE(absl::StrContains(metrics, "attention_sessions_restored_total 3"))
      << metrics;
  EXPECT_TRUE(
      absl::StrContains(metrics, "attention_snapshots_corrupt_total 1"));
  // Restored files are removed, the corrupt one moved aside, the partial
  // one deleted; the server's lock file stays.
  std::vector<std::string> left;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    left.push_back(entry.path().filename().string());
  }
  std::sort(left.begin(), left.end());
  EXPECT_EQ(left, (std::vector<std::string>{
                      ".lock", "0123456789abcdef.session.corrupt"}));
  second->reset();
}

// --snapshot_dir carries MLA shared-latent and top-k sessions across a
// restart like dense ones.
TEST(SnapshotDirTest, LatentAndTopKSessionsSurviveARestartBitwise) {
  const ScopedTempDir scoped_dir("snapshot-sparse");
  const std::string& dir = scoped_dir.path();
  server::ServerOptions options = TestServerOptions();
  options.snapshot_dir = dir;
  // The snapshot gets the second half of the drain: generous for slow
  // (sanitizer) builds; the drain still ends once the snapshot is written.
  options.drain_timeout = absl::Seconds(60);
  auto first = StartTestServer(options);
  ATTN_ASSERT_OK(first);
  std::vector<std::string> ids;
  std::vector<Tokens> tokens;
  std::vector<std::vector<std::string>> expected;
  const IndexTokens index(80, 90);
  for (bool latent : {true, false}) {
    auto session = (*first)->client->OpenSession(SparseSpec(latent));
    ATTN_ASSERT_OK(session);
    tokens.push_back(RandomTokens(session->spec(), 80, latent ? 91 : 92));
    for (int layer = 0; layer < 3; ++layer) {
      StepSparse(*(*first)->client, *session, tokens.back(), index, layer, 0,
                 70);
    }
    ids.push_back(session->id());
    auto fork = session->Fork();
    ATTN_ASSERT_OK(fork);
    expected.push_back(
        ContinueSparse(*(*first)->client, *fork, tokens.back(), index, 70, 76));
    ATTN_ASSERT_OK(fork->Delete());
  }
  (*first)->server->Shutdown();
  EXPECT_TRUE(absl::StrContains((*first)->server->metrics().TextExposition(),
                                "attention_snapshot_sessions_written_total 2"));
  first->reset();

  auto second = StartTestServer(options);
  ATTN_ASSERT_OK(second);
  for (size_t i = 0; i < ids.size(); ++i) {
    auto info = (*second)->client->GetSession(ids[i]);
    ATTN_ASSERT_OK(info);
    client::SessionHandle handle((*second)->client.get(), *info);
    EXPECT_EQ(
        ContinueSparse(*(*second)->client, handle, tokens[i], index, 70, 76),
        expected[i])
        << ids[i];
  }
  second->reset();
}

// Files damaged after the snapshot (cut short, a flipped byte) are moved
// aside and counted; the others are restored; the start goes on.
TEST(SnapshotDirTest, DamagedFilesAreMovedAsideAndTheRestRestored) {
  const ScopedTempDir scoped_dir("snapshot-damaged");
  const std::string& dir = scoped_dir.path();
  server::ServerOptions options = TestServerOptions();
  auto first = StartTestServer(options);
  ATTN_ASSERT_OK(first);
  const std::vector<std::string> ids =
      FilledSessions(*(*first)->client, 3, 80, 60);
  ASSERT_EQ(ids.size(), 3u);
  const server::SaveAllResult saved = server::SaveAllSessions(
      (*first)->server->engine(), dir, absl::Now() + absl::Minutes(1));
  EXPECT_EQ(saved.written, 3);
  EXPECT_EQ(saved.failed, 0);
  first->reset();
  const std::string cut = dir + "/" + ids[0] + ".session";
  std::filesystem::resize_file(cut, std::filesystem::file_size(cut) / 2);
  const std::string flipped = dir + "/" + ids[1] + ".session";
  {
    std::fstream file(flipped, std::ios::in | std::ios::out | std::ios::binary);
    file.seekg(
        static_cast<std::streamoff>(std::filesystem::file_size(flipped) / 2));
    char byte = 0;
    file.read(&byte, 1);
    file.seekp(
        static_cast<std::streamoff>(std::filesystem::file_size(flipped) / 2));
    byte = static_cast<char>(byte ^ 0x20);
    file.write(&byte, 1);
  }
  options.snapshot_dir = dir;
  auto second = StartTestServer(options);
  ATTN_ASSERT_OK(second);
  ATTN_EXPECT_CODE((*second)->client->GetSession(ids[0]),
                   absl::StatusCode::kNotFound);
  ATTN_EXPECT_CODE((*second)->client->GetSession(ids[1]),
                   absl::StatusCode::kNotFound);
  ATTN_EXPECT_OK((*second)->client->GetSession(ids[2]));
  EXPECT_TRUE(std::filesystem::exists(cut + ".corrupt"));
  EXPECT_TRUE(std::filesystem::exists(flipped + ".corrupt"));
  EXPECT_TRUE(absl::StrContains((*second)->server->metrics().TextExposition(),
                                "attention_snapshots_corrupt_total 2"));
  auto info = (*second)->client->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->active_sessions(), 1);
  second->reset();
}

// A file whose header spec declares an absurd num_layers (and no layers)
// is moved aside as corrupt like any other malformed file; the start goes
// on. (Sizing the session's reply from that num_layers once threw from the
// restore at every start.)
// Writes a snapshot file at `path` holding `record` alone, with its
// length prefix (the file form's framing).
void WriteRecordFile(const std::string& path, const std::string& record) {
  const uint32_t size = static_cast<uint32_t>(record.size());
  const char size_bytes[4] = {static_cast<char>(size & 0xff),
                              static_cast<char>(size >> 8 & 0xff),
                              static_cast<char>(size >> 16 & 0xff),
                              static_cast<char>(size >> 24 & 0xff)};
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(size_bytes, 4);
  out.write(record.data(), static_cast<std::streamsize>(record.size()));
  ASSERT_TRUE(out.good());
}

// Rewrites the snapshot file at `path` with its header record changed by
// `change`, followed by the file's other records when `keep_records`, or
// alone.
void RewriteHeader(
    const std::string& path,
    const std::function<void(v1::SessionSnapshotHeader*)>& change,
    bool keep_records = false) {
  v1::SessionChunk header;
  std::string records;
  {
    std::ifstream in(path, std::ios::binary);
    unsigned char size_bytes[4];
    ASSERT_TRUE(in.read(reinterpret_cast<char*>(size_bytes), 4));
    const uint32_t size = size_bytes[0] | size_bytes[1] << 8 |
                          size_bytes[2] << 16 | uint32_t{size_bytes[3]} << 24;
    std::string bytes(size, '\0');
    ASSERT_TRUE(in.read(bytes.data(), size));
    ASSERT_TRUE(header.ParseFromString(bytes));
    ASSERT_TRUE(header.has_header());
    if (keep_records) {
      records.assign(std::istreambuf_iterator<char>(in),
                     std::istreambuf_iterator<char>());
    }
  }
  change(header.mutable_header());
  WriteRecordFile(path, header.SerializeAsString());
  std::ofstream out(path, std::ios::binary | std::ios::app);
  out.write(records.data(), static_cast<std::streamsize>(records.size()));
  ASSERT_TRUE(out.good());
}

TEST(SnapshotDirTest, AHeaderWithABadLayerCountIsMovedAside) {
  const ScopedTempDir scoped_dir("snapshot-layers");
  const std::string& dir = scoped_dir.path();
  server::ServerOptions options = TestServerOptions();
  auto first = StartTestServer(options);
  ATTN_ASSERT_OK(first);
  const std::vector<std::string> ids =
      FilledSessions(*(*first)->client, 2, 40, 80);
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(server::SaveAllSessions((*first)->server->engine(), dir,
                                    absl::Now() + absl::Minutes(1))
                .written,
            2);
  first->reset();
  const std::string path = dir + "/" + ids[0] + ".session";
  RewriteHeader(path, [](v1::SessionSnapshotHeader* header) {
    header->mutable_spec()->set_num_layers(-1);
    header->mutable_spec()->clear_layers();
  });
  options.snapshot_dir = dir;
  auto second = StartTestServer(options);
  ATTN_ASSERT_OK(second);
  ATTN_EXPECT_CODE((*second)->client->GetSession(ids[0]),
                   absl::StatusCode::kNotFound);
  ATTN_EXPECT_OK((*second)->client->GetSession(ids[1]));
  EXPECT_TRUE(std::filesystem::exists(path + ".corrupt"));
  EXPECT_TRUE(absl::StrContains((*second)->server->metrics().TextExposition(),
                                "attention_snapshots_corrupt_total 1"));
  second->reset();
}

// A session that a call holds through the drain (a long prefill that
// outlived StopChanges' wait) costs only its own file: the snapshot writes
// the other sessions first, then waits for it until its deadline. (Before,
// the snapshot waited for it in list order, and the sessions after it ran
// out of time.)
TEST(SnapshotDirTest, ASessionACallHoldsCostsOnlyItsOwnFile) {
  const ScopedTempDir scoped_dir("snapshot-busy");
  const std::string& dir = scoped_dir.path();
  auto server = StartTestServer();
  ATTN_ASSERT_OK(server);
  AttentionEngine& engine = (*server)->server->engine();
  SessionSpec spec;
  spec.num_layers = 1;
  spec.num_q_heads = 1;
  spec.num_kv_heads = 1;
  spec.head_dim = 8;
  std::vector<std::string> ids;
  for (int i = 0; i < 2; ++i) {
    auto info = engine.CreateSession(spec, absl::Hours(1));
    ATTN_ASSERT_OK(info);
    ids.push_back(info->session_id);
  }
  std::sort(ids.begin(), ids.end());  // the order the snapshot lists them in
  // A prefill held inside the engine on the first one.
  const std::vector<float> values(4 * 8, 0.5f);
  AppendRequest prefill;
  prefill.session_id = ids[0];
  prefill.q = FloatView(values, {4, 1, 8});
  prefill.k = prefill.q;
  prefill.v = prefill.q;
  testing::HoldAtFirstCheck hold;
  prefill.control = &hold;
  absl::Status prefill_status;
  std::thread prefill_thread(
      [&] { prefill_status = engine.Append(prefill).status(); });
  hold.WaitUntilHeld();
  // Let go a second after the snapshot's deadline whatever happens (the
  // old snapshot waited for it).
  const absl::Time deadline = absl::Now() + absl::Milliseconds(500);
  absl::Notification saved;
  std::thread release([&] {
    saved.WaitForNotificationWithDeadline(deadline + absl::Seconds(1));
    hold.Release();
  });
  const server::SaveAllResult result =
      server::SaveAllSessions(engine, dir, deadline);
  saved.Notify();
  release.join();
  prefill_thread.join();
  ATTN_EXPECT_OK(prefill_status);
  EXPECT_EQ(result.written, 1);
  EXPECT_EQ(result.failed, 1);
  EXPECT_TRUE(std::filesystem::exists(dir + "/" + ids[1] + ".session"));
  EXPECT_FALSE(std::filesystem::exists(dir + "/" + ids[0] + ".session"));
  server->reset();
}

// A corrupt file that cannot be moved aside (here its .corrupt name is
// taken by a directory) stays where it is, and the log says so rather
// than naming a file that does not exist.
TEST(SnapshotDirTest, ACorruptFileThatCannotMoveIsReportedInPlace) {
  const ScopedTempDir scoped_dir("snapshot-unmovable");
  const std::string& dir = scoped_dir.path();
  const std::vector<std::string> ids = SavedSessions(dir, 2);
  ASSERT_EQ(ids.size(), 2u);
  const std::string path = dir + "/" + ids[0] + ".session";
  RewriteHeader(path, [](v1::SessionSnapshotHeader* header) {
    header->mutable_spec()->set_num_layers(-1);
    header->mutable_spec()->clear_layers();
  });
  std::filesystem::create_directories(path + ".corrupt/taken");
  server::ServerOptions options = TestServerOptions();
  options.snapshot_dir = dir;
  ::testing::internal::CaptureStderr();
  auto server = StartTestServer(options);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ATTN_ASSERT_OK(server);
  ATTN_EXPECT_OK((*server)->client->GetSession(ids[1]));
  EXPECT_TRUE(std::filesystem::is_regular_file(path));
  EXPECT_TRUE(absl::StrContains(log, "event=snapshot_corrupt")) << log;
  EXPECT_TRUE(absl::StrContains(log, "moved_to=\"(not moved: ")) << log;
  server->reset();
}

// A file in a later format version than this server reads (written by a
// newer server before a rollback) is kept for a start that reads it, not
// put aside as corrupt, also when it holds values this build does not know
// (here a dtype and an index score).
TEST(SnapshotDirTest, ANewerServersFileIsKeptNotPutAside) {
  const ScopedTempDir scoped_dir("snapshot-newer");
  const std::string& dir = scoped_dir.path();
  const std::vector<std::string> ids = SavedSessions(dir, 2);
  ASSERT_EQ(ids.size(), 2u);
  const std::string path = dir + "/" + ids[0] + ".session";
  RewriteHeader(path, [](v1::SessionSnapshotHeader* header) {
    header->set_format_version(3);
    header->set_kv_dtype(static_cast<v1::DType>(42));
    header->mutable_spec()->mutable_layers(0)->set_index_score(
        static_cast<v1::IndexScore>(7));
  });
  server::ServerOptions options = TestServerOptions();
  options.snapshot_dir = dir;
  auto server = StartTestServer(options);
  ATTN_ASSERT_OK(server);
  ATTN_EXPECT_CODE((*server)->client->GetSession(ids[0]),
                   absl::StatusCode::kNotFound);
  ATTN_EXPECT_OK((*server)->client->GetSession(ids[1]));
  EXPECT_TRUE(std::filesystem::exists(path));
  EXPECT_FALSE(std::filesystem::exists(path + ".corrupt"));
  const std::string metrics = (*server)->server->metrics().TextExposition();
  EXPECT_TRUE(absl::StrContains(metrics, "attention_snapshots_kept_total 1"));
  EXPECT_TRUE(
      absl::StrContains(metrics, "attention_snapshots_corrupt_total 0"));
  server->reset();
}

// A header corrupted into one that is well formed but that this server
// cannot take now (here: a max_tokens over --max_session_tokens) fails its
// import as a valid file of a larger server would; its checksum tells them
// apart, and the corrupt one is moved aside instead of being kept and
// reported at every start. A file this server cannot take whose checksum
// holds is still kept.
TEST(SnapshotDirTest, AHeaderCorruptedIntoOneTheServerCannotTakeIsMovedAside) {
  const ScopedTempDir scoped_dir("snapshot-corrupt-spec");
  const std::string& dir = scoped_dir.path();
  const std::vector<std::string> ids = SavedSessions(dir, 2);
  ASSERT_EQ(ids.size(), 2u);
  const std::string corrupted = dir + "/" + ids[0] + ".session";
  const int64_t limit = TestServerOptions().max_session_tokens;
  RewriteHeader(
      corrupted,
      [&](v1::SessionSnapshotHeader* header) {
        header->mutable_spec()->set_max_tokens(limit + 1);
      },
      /*keep_records=*/true);
  server::ServerOptions options = TestServerOptions();
  options.snapshot_dir = dir;
  options.max_session_tokens = 16;  // neither session fits
  ::testing::internal::CaptureStderr();
  auto server = StartTestServer(options);
  const std::string log = ::testing::internal::GetCapturedStderr();
  ATTN_ASSERT_OK(server);
  const std::string metrics = (*server)->server->metrics().TextExposition();
  EXPECT_TRUE(
      absl::StrContains(metrics, "attention_snapshots_corrupt_total 1"));
  EXPECT_TRUE(absl::StrContains(metrics, "attention_snapshots_kept_total 1"));
  EXPECT_TRUE(std::filesystem::exists(corrupted + ".corrupt"));
  EXPECT_TRUE(std::filesystem::exists(dir + "/" + ids[1] + ".session"));
  EXPECT_TRUE(absl::StrContains(log, "its records are")) << log;
  server->reset();
}

// A stop requested while a start restores (a rollout replacing the pod)
// ends the start before it serves, and the snapshot files stay: a later
// start restores every session (before, the restore ran to its end, the
// files were removed, and the drain that followed could be cut short).
TEST(SnapshotDirTest, AStopDuringTheRestoreKeepsTheFiles) {
  const ScopedTempDir scoped_dir("snapshot-stopped");
  const std::string& dir = scoped_dir.path();
  const std::vector<std::string> ids = SavedSessions(dir, 3);
  ASSERT_EQ(ids.size(), 3u);
  server::ServerOptions options = TestServerOptions();
  options.snapshot_dir = dir;
  int polls = 0;
  options.stop_requested = [&polls] { return ++polls > 2; };  // mid-restore
  auto stopped = StartTestServer(options);
  ATTN_EXPECT_CODE(stopped, absl::StatusCode::kCancelled);
  EXPECT_GT(polls, 2);
  for (const std::string& id : ids) {
    EXPECT_TRUE(std::filesystem::exists(dir + "/" + id + ".session")) << id;
  }
  options.stop_requested = nullptr;
  auto second = StartTestServer(options);
  ATTN_ASSERT_OK(second);
  for (const std::string& id : ids) {
    ATTN_EXPECT_OK((*second)->client->GetSession(id));
  }
  second->reset();
}

// Valid files a server cannot take now (here: past --max_sessions; forks,
// restored one whole copy each, can fill the pool the same way) stay in the
// directory, counted, and the next start that has room restores them: no
// session is lost to a smaller server.
TEST(SnapshotDirTest, FilesTheServerCannotTakeNowAreKeptForTheNextStart) {
  const ScopedTempDir scoped_dir("snapshot-kept");
  const std::string& dir = scoped_dir.path();
  const std::vector<std::string> ids = SavedSessions(dir, 3);
  ASSERT_EQ(ids.size(), 3u);
  server::ServerOptions options = TestServerOptions();
  options.snapshot_dir = dir;
  options.max_sessions = 1;
  auto second = StartTestServer(options);
  ATTN_ASSERT_OK(second);
  const std::string metrics = (*second)->server->metrics().TextExposition();
  EXPECT_TRUE(
      absl::StrContains(metrics, "attention_sessions_restored_total 1"));
  EXPECT_TRUE(absl::StrContains(metrics, "attention_snapshots_kept_total 2"));
  EXPECT_TRUE(
      absl::StrContains(metrics, "attention_snapshots_rejected_total 0"));
  EXPECT_TRUE(
      absl::StrContains(metrics, "attention_snapshots_corrupt_total 0"));
  int session_files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    session_files += absl::EndsWith(entry.path().string(), ".session");
  }
  EXPECT_EQ(session_files, 2);  // the restored one is gone
  second->reset();              // drains: writes the one it restored
  options.max_sessions = 3;
  auto third = StartTestServer(options);
  ATTN_ASSERT_OK(third);
  for (const std::string& id : ids) {
    ATTN_EXPECT_OK((*third)->client->GetSession(id));
  }
  third->reset();
}

// Valid files this start's configuration cannot hold (here: a lower
// --max_session_tokens than their sessions' max_tokens) are kept, not put
// aside: a start with the configuration rolled back restores them.
TEST(SnapshotDirTest, FilesAConfigurationCannotHoldAreKeptForTheNextStart) {
  const ScopedTempDir scoped_dir("snapshot-config");
  const std::string& dir = scoped_dir.path();
  const std::vector<std::string> ids = SavedSessions(dir, 2);
  ASSERT_EQ(ids.size(), 2u);
  server::ServerOptions options = TestServerOptions();
  options.snapshot_dir = dir;
  options.max_session_tokens = 16;
  auto lowered = StartTestServer(options);
  ATTN_ASSERT_OK(lowered);
  const std::string metrics = (*lowered)->server->metrics().TextExposition();
  EXPECT_TRUE(
      absl::StrContains(metrics, "attention_sessions_restored_total 0"));
  EXPECT_TRUE(absl::StrContains(metrics, "attention_snapshots_kept_total 2"));
  EXPECT_TRUE(
      absl::StrContains(metrics, "attention_snapshots_rejected_total 0"));
  lowered->reset();
  options.max_session_tokens = TestServerOptions().max_session_tokens;
  auto restored = StartTestServer(options);
  ATTN_ASSERT_OK(restored);
  for (const std::string& id : ids) {
    ATTN_EXPECT_OK((*restored)->client->GetSession(id));
  }
  restored->reset();
}

// Only regular files are snapshots: a FIFO does not hold up the start and
// a link is not followed (both are moved aside as rejected); and a
// directory serves one server at a time.
TEST(SnapshotDirTest, OnlyRegularFilesAreRestoredAndOneServerUsesTheDir) {
  const ScopedTempDir scoped_dir("snapshot-odd");
  const std::string& dir = scoped_dir.path();
  const ScopedTempDir scoped_elsewhere("snapshot-elsewhere");
  const std::string& elsewhere = scoped_elsewhere.path();
  const std::vector<std::string> ids = SavedSessions(elsewhere, 1);
  ASSERT_EQ(ids.size(), 1u);
  ASSERT_EQ(::mkfifo((dir + "/fifo.session").c_str(), 0600), 0);
  std::filesystem::create_symlink(
      absl::StrCat(elsewhere, "/", ids[0], ".session"),
      absl::StrCat(dir, "/", ids[0], ".session"));
  server::ServerOptions options = TestServerOptions();
  options.snapshot_dir = dir;
  auto second = StartTestServer(options);
  ATTN_ASSERT_OK(second);
  const std::string metrics = (*second)->server->metrics().TextExposition();
  EXPECT_TRUE(
      absl::StrContains(metrics, "attention_sessions_restored_total 0"));
  EXPECT_TRUE(
      absl::StrContains(metrics, "attention_snapshots_rejected_total 2"));
  ATTN_EXPECT_CODE((*second)->client->GetSession(ids[0]),
                   absl::StatusCode::kNotFound);
  // A second server on the same directory would restore every session
  // again: it does not start.
  server::ServerOptions again = TestServerOptions();
  again.snapshot_dir = dir;
  auto third = StartTestServer(again);
  ATTN_EXPECT_CODE(third, absl::StatusCode::kFailedPrecondition);
  if (!third.ok()) {
    EXPECT_TRUE(absl::StrContains(third.status().message(), "/.lock"))
        << third.status();
  }
  second->reset();
  // Once the first one is gone, the directory is free again.
  auto fourth = StartTestServer(again);
  ATTN_EXPECT_OK(fourth);
}

// A record within the size limit that would parse into far more memory
// (4 Mi empty groups of an unknown field, 8 MiB: hundreds of MiB once
// parsed) is refused unparsed, as a request over its parse budget is, and
// its file is moved aside as corrupt.
TEST(SnapshotDirTest, ARecordOverItsParseBudgetIsRefusedUnparsed) {
  auto server = StartTestServer(TestServerOptions());
  ATTN_ASSERT_OK(server);
  const ScopedTempDir scoped_dir("snapshot-budget");
  const std::string& dir = scoped_dir.path();
  const std::string path = dir + "/0123456789abcdef.session";
  std::string record;
  for (int i = 0; i < (4 << 20); ++i) record += "\x7b\x7c";  // field 15
  WriteRecordFile(path, record);
  const absl::StatusOr<int64_t> restored =
      server::RestoreSession((*server)->server->engine(), path);
  ATTN_EXPECT_CODE(restored, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(restored.status().message(),
                                "bytes of memory to parse"))
      << restored.status();
  const server::RestoreAllResult all =
      server::RestoreAllSessions((*server)->server->engine(), dir);
  EXPECT_EQ(all.corrupt, 1);
  EXPECT_TRUE(std::filesystem::exists(path + ".corrupt"));
}

// A snapshot that runs out of time counts what it could not write and
// leaves no file behind for it.
// A session restored under a smaller --max_message_bytes than it was
// created under can have a SessionInfo this server cannot send (restore
// loses no session for it). GetSession then fails, and a failed call
// changes nothing: the idle clock keeps running.
TEST(SnapshotDirTest, AGetSessionThatCannotBeAnsweredLeavesTheIdleClock) {
  const ScopedTempDir scoped_dir("snapshot-limit");
  const std::string& dir = scoped_dir.path();
  // A 1 KiB layer entry spelled out for 64 layers: about 66 KB.
  v1::SessionSpec wide = MakeSpec(64, 256, 1, 16);
  wide.clear_layers();
  v1::LayerSpec* layer = wide.add_layers();
  for (int h = 0; h < 256; ++h) layer->add_sink_logits(0.5f);
  std::string id;
  {
    auto first = StartTestServer();
    ATTN_ASSERT_OK(first);
    auto info = (*first)->client->CreateSession(wide, absl::Seconds(60));
    ATTN_ASSERT_OK(info);
    id = info->session_id();
    EXPECT_EQ(server::SaveAllSessions((*first)->server->engine(), dir,
                                      absl::Now() + absl::Minutes(1))
                  .written,
              1);
  }
  server::ServerOptions options = TestServerOptions();
  options.snapshot_dir = dir;
  options.max_message_bytes = 64 << 10;
  auto second = StartTestServer(options);
  ATTN_ASSERT_OK(second);
  server::AttentionServer& server = *(*second)->server;
  EXPECT_TRUE(absl::StrContains(server.metrics().TextExposition(),
                                "attention_sessions_restored_total 1"));
  const auto idle_deadline_ms = [&] {
    auto exported = server.engine().ExportSession(id);
    EXPECT_TRUE(exported.ok()) << exported.status();
    return exported.ok() ? (*exported)->header().idle_deadline_unix_ms : -1;
  };
  const int64_t before = idle_deadline_ms();
  absl::SleepFor(absl::Milliseconds(20));  // a later clock would show
  auto got = (*second)->client->GetSession(id);
  ATTN_EXPECT_CODE(got, absl::StatusCode::kResourceExhausted);
  EXPECT_NE(got.status().message().find("--max_message_bytes"),
            std::string::npos)
      << got.status();
  // Nor can an export send its header: said so before it is sent.
  auto records = Export(*(*second)->client, id);
  ATTN_EXPECT_CODE(records, absl::StatusCode::kResourceExhausted);
  EXPECT_NE(records.status().message().find("the session's header"),
            std::string::npos)
      << records.status();
  EXPECT_EQ(idle_deadline_ms(), before);
  second->reset();
}

// An export of such a session whose one token's rows could not be sent
// fails RESOURCE_EXHAUSTED before its first data record, naming the flag
// that limits it (gRPC's own refusal to send the record named none).
TEST(SnapshotDirTest, AnExportWhoseRowCouldNotBeSentSaysWhy) {
  const ScopedTempDir scoped_dir("snapshot-row-limit");
  const std::string& dir = scoped_dir.path();
  // One token of 8 heads of 1024 float32 K and V: 64 KiB of rows.
  const v1::SessionSpec wide = MakeSpec(1, 8, 8, 1024);
  server::ServerOptions options = TestServerOptions();
  options.kv_block_bytes = 64 << 10;
  std::string id;
  {
    auto first = StartTestServer(options);
    ATTN_ASSERT_OK(first);
    auto session = (*first)->client->OpenSession(wide);
    ATTN_ASSERT_OK(session);
    id = session->id();
    const Tokens tokens = RandomTokens(session->spec(), 1, 3);
    ATTN_ASSERT_OK(session->Prefill(0, tokens.q_rows(0, 1), tokens.k_rows(0, 1),
                                    tokens.v_rows(0, 1)));
    EXPECT_EQ(server::SaveAllSessions((*first)->server->engine(), dir,
                                      absl::Now() + absl::Minutes(1))
                  .written,
              1);
  }
  options.snapshot_dir = dir;
  options.max_message_bytes = 48 << 10;
  auto second = StartTestServer(options);
  ATTN_ASSERT_OK(second);
  auto records = Export(*(*second)->client, id);
  ATTN_EXPECT_CODE(records, absl::StatusCode::kResourceExhausted);
  EXPECT_NE(records.status().message().find("--max_message_bytes"),
            std::string::npos)
      << records.status();
  ATTN_EXPECT_OK((*second)->client->GetSession(id));
  second->reset();
}

TEST(SnapshotDirTest, SessionsPastTheDeadlineAreCountedAndLeaveNoFile) {
  const ScopedTempDir scoped_dir("snapshot-late");
  const std::string& dir = scoped_dir.path();
  auto server = StartTestServer();
  ATTN_ASSERT_OK(server);
  ASSERT_EQ(FilledSessions(*(*server)->client, 2, 30, 70).size(), 2u);
  const server::SaveAllResult saved = server::SaveAllSessions(
      (*server)->server->engine(), dir, absl::Now() - absl::Seconds(1));
  EXPECT_EQ(saved.written, 0);
  EXPECT_EQ(saved.failed, 2);
  EXPECT_TRUE(std::filesystem::is_empty(dir));
}

}  // namespace
}  // namespace attention::testing
