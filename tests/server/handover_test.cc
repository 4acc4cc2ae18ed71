// Replicas handing their sessions over on drain (--peers), run as real
// attention-server processes on the loopback interface: a SIGTERM'd replica
// moves every session (fp32 and fp16 KV, GQA, windows, sinks, forks) to its
// SERVING peers, answers later calls - including the next request of an open
// Decode stream - with NOT_FOUND and `attention-session-owner` metadata, and
// exits 0; decoding continues on the new owner bitwise as on a server whose
// sessions never moved; every RPC naming a moved session redirects. Without
// a SERVING peer, or when peers refuse, the sessions go to the next peer or
// to --snapshot_dir; a session whose export is refused stays behind.
// Redirects answer only the session's own tenant, only the peer identity
// may send a handover import, and peers talk TLS with the peer token.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/attention_client.h"
#include "gmock/gmock.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "server/tokens_file.h"
#include "tests/server/http_get.h"
#include "tests/server/scoped_temp_dir.h"
#include "tests/server/server_process.h"
#include "tests/server/test_certificates.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

constexpr char kOwnerMetadata[] = "attention-session-owner";

// A replica: an attention-server process and a client of it.
struct Replica {
  std::unique_ptr<ServerProcess> process;
  std::string address;  // its advertise address, 127.0.0.1:port
  std::unique_ptr<client::AttentionClient> client;
};

std::vector<std::string> ReplicaFlags(std::vector<std::string> extra) {
  std::vector<std::string> flags = {"--port=0",
                                    "--listen_address=127.0.0.1",
                                    "--backend=cpu",
                                    "--threads=1",
                                    "--metrics_port=-1",
                                    "--kv_cache_bytes=16777216",
                                    "--kv_block_bytes=4096",
                                    "--drain_timeout=20s",
                                    "--log_level=warning"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return flags;
}

// Starts a replica; `token` is the bearer token its client sends, over
// the transport `client_options` give.
std::unique_ptr<Replica> StartReplica(
    std::vector<std::string> extra, const std::string& token = "",
    client::ClientOptions options = client::ClientOptions()) {
  auto replica = std::make_unique<Replica>();
  replica->process =
      std::make_unique<ServerProcess>(ReplicaFlags(std::move(extra)));
  const int port = replica->process->WaitForPort();
  EXPECT_GT(port, 0) << replica->process->output();
  if (port <= 0) return nullptr;
  replica->address = absl::StrCat("127.0.0.1:", port);
  options.auth_token = token;
  options.retry_max_attempts = 1;
  replica->client = client::AttentionClient::Connect(replica->address, options);
  return replica;
}

// The raw answer of a GetSession call: status and owner trailer.
struct RawReply {
  grpc::Status status;
  std::optional<std::string> owner;  // attention-session-owner
};

std::optional<std::string> OwnerTrailer(const grpc::ClientContext& context) {
  const auto& trailers = context.GetServerTrailingMetadata();
  auto it = trailers.find(kOwnerMetadata);
  if (it == trailers.end()) return std::nullopt;
  return std::string(it->second.data(), it->second.size());
}

RawReply RawGetSession(client::AttentionClient& client, const std::string& id,
                       const std::string& token = "") {
  grpc::ClientContext context;
  if (!token.empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  }
  v1::GetSessionRequest request;
  request.set_session_id(id);
  v1::SessionInfo info;
  RawReply reply;
  reply.status = client.stub()->GetSession(&context, request, &info);
  reply.owner = OwnerTrailer(context);
  return reply;
}

// Every RPC naming session `id` (of the session `reference` mirrors) on
// `client` answers NOT_FOUND with `owner` in the trailer and the message.
void ExpectRedirectedEverywhere(client::AttentionClient& client,
                                const std::string& id,
                                const client::SessionHandle& reference,
                                const std::string& owner) {
  const Tokens tokens = RandomTokens(reference.spec(), 1, 99);
  auto decode = reference.MakeDecodeRequest(0, tokens.q, tokens.k, tokens.v);
  ASSERT_TRUE(decode.ok()) << decode.status();
  decode->set_session_id(id);
  auto prefill = reference.MakePrefillRequest(0, tokens.q, tokens.k, tokens.v);
  ASSERT_TRUE(prefill.ok()) << prefill.status();
  prefill->set_session_id(id);
  const auto expect = [&](const char* what, grpc::ClientContext& context,
                          const grpc::Status& status) {
    EXPECT_EQ(status.error_code(), grpc::StatusCode::NOT_FOUND)
        << what << ": " << status.error_message();
    EXPECT_EQ(OwnerTrailer(context), owner) << what;
    EXPECT_THAT(status.error_message(), ::testing::HasSubstr(owner)) << what;
  };
  v1::AttentionService::Stub& stub = *client.stub();
  {
    grpc::ClientContext context;
    v1::DeleteSessionRequest request;
    request.set_session_id(id);
    v1::DeleteSessionResponse response;
    expect("DeleteSession", context,
           stub.DeleteSession(&context, request, &response));
  }
  {
    grpc::ClientContext context;
    v1::ForkSessionRequest request;
    request.set_session_id(id);
    v1::SessionInfo response;
    expect("ForkSession", context,
           stub.ForkSession(&context, request, &response));
  }
  {
    grpc::ClientContext context;
    v1::TruncateSessionRequest request;
    request.set_session_id(id);
    v1::SessionInfo response;
    expect("TruncateSession", context,
           stub.TruncateSession(&context, request, &response));
  }
  {
    grpc::ClientContext context;
    v1::AttentionResult response;
    expect("Prefill", context, stub.Prefill(&context, *prefill, &response));
  }
  {
    grpc::ClientContext context;
    v1::AttentionResult response;
    expect("DecodeStep", context,
           stub.DecodeStep(&context, *decode, &response));
  }
  {
    grpc::ClientContext context;
    v1::BatchDecodeRequest request;
    *request.add_steps() = *decode;
    v1::BatchDecodeResponse response;
    expect("BatchDecode", context,
           stub.BatchDecode(&context, request, &response));
  }
  {
    grpc::ClientContext context;
    v1::ExportSessionRequest request;
    request.set_session_id(id);
    auto reader = stub.ExportSession(&context, request);
    v1::SessionChunk chunk;
    while (reader->Read(&chunk)) {
    }
    expect("ExportSession", context, reader->Finish());
  }
}

// Which of `replicas` holds session `id` now (waits for the handover).
Replica* FindOwner(const std::vector<Replica*>& replicas,
                   const std::string& id) {
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    for (Replica* replica : replicas) {
      if (replica->client->GetSession(id).ok()) return replica;
    }
    absl::SleepFor(absl::Milliseconds(20));
  }
  return nullptr;
}

// Also closes the replica's client first: gRPC's shutdown waits a few
// seconds for idle connections.
void ExpectExitedZero(Replica& replica) {
  replica.client.reset();
  ServerProcess& process = *replica.process;
  const int status = process.Wait();
  ASSERT_TRUE(WIFEXITED(status))
      << "killed by signal " << WTERMSIG(status) << "\n"
      << process.output();
  EXPECT_EQ(WEXITSTATUS(status), 0) << process.output();
}

v1::SessionSpec SinkSpec() {
  v1::SessionSpec spec = MakeSpec(1, 2, 1, 8);
  v1::LayerSpec* layer = spec.add_layers();
  layer->set_window(3);
  layer->set_num_sink_tokens(2);
  layer->add_sink_logits(0.25f);
  layer->add_sink_logits(-0.5f);
  return spec;
}

// One session kept on a replica and, identically, on a reference server
// whose sessions never move.
struct Mirrored {
  std::string name;
  std::string id;  // on the replica (then its new owner)
  client::SessionHandle reference;
  Tokens tokens;     // every token either side will get
  int64_t next = 0;  // the next token to append
};

std::string OutputBytes(const v1::AttentionResult& result) {
  return result.output().data();
}

// Appends token `mirrored.next` to every layer on both sides, expecting
// bitwise equal outputs.
void DecodeBoth(client::AttentionClient& replica, Mirrored& mirrored) {
  client::SessionHandle handle(&replica, [&] {
    v1::SessionInfo info;
    info.set_session_id(mirrored.id);
    *info.mutable_spec() = mirrored.reference.spec();
    return info;
  }());
  const int64_t t = mirrored.next++;
  for (int layer = 0; layer < mirrored.reference.spec().num_layers(); ++layer) {
    const Tokens& tk = mirrored.tokens;
    auto moved = handle.DecodeStep(layer, tk.q_rows(t, 1), tk.k_rows(t, 1),
                                   tk.v_rows(t, 1));
    auto kept = mirrored.reference.DecodeStep(layer, tk.q_rows(t, 1),
                                              tk.k_rows(t, 1), tk.v_rows(t, 1));
    ASSERT_TRUE(moved.ok()) << mirrored.name << ": " << moved.status();
    ASSERT_TRUE(kept.ok()) << mirrored.name << ": " << kept.status();
    EXPECT_EQ(moved->position(), kept->position()) << mirrored.name;
    EXPECT_EQ(OutputBytes(*moved), OutputBytes(*kept))
        << mirrored.name << " token " << t << " layer " << layer;
  }
}

// Creates `spec` on `replica` and on `reference`, prefilling `prefill`
// tokens on both.
Mirrored CreateBoth(const std::string& name, const v1::SessionSpec& spec,
                    client::AttentionClient& replica,
                    client::AttentionClient& reference, int64_t prefill,
                    uint32_t seed) {
  auto on_replica = replica.OpenSession(spec);
  auto on_reference = reference.OpenSession(spec);
  EXPECT_TRUE(on_replica.ok()) << on_replica.status();
  EXPECT_TRUE(on_reference.ok()) << on_reference.status();
  Mirrored mirrored{.name = name,
                    .id = on_replica->id(),
                    .reference = *on_reference,
                    .tokens = RandomTokens(on_replica->spec(), 64, seed)};
  for (int layer = 0; layer < spec.num_layers(); ++layer) {
    const Tokens& tk = mirrored.tokens;
    auto a = on_replica->Prefill(layer, tk.q_rows(0, prefill),
                                 tk.k_rows(0, prefill), tk.v_rows(0, prefill));
    auto b =
        on_reference->Prefill(layer, tk.q_rows(0, prefill),
                              tk.k_rows(0, prefill), tk.v_rows(0, prefill));
    EXPECT_TRUE(a.ok() && b.ok()) << name;
    if (a.ok() && b.ok()) {
      EXPECT_EQ(OutputBytes(*a), OutputBytes(*b)) << name;
    }
  }
  mirrored.next = prefill;
  return mirrored;
}

TEST(HandoverTest, SigtermMovesEverySessionToPeersAndDecodingContinues) {
  std::unique_ptr<Replica> b = StartReplica({});
  std::unique_ptr<Replica> c = StartReplica({});
  ASSERT_NE(b, nullptr);
  ASSERT_NE(c, nullptr);
  std::unique_ptr<Replica> a =
      StartReplica({absl::StrCat("--peers=", b->address, ",", c->address)});
  ASSERT_NE(a, nullptr);
  auto reference = StartTestServer();
  ATTN_ASSERT_OK(reference);
  client::AttentionClient& ref = *(*reference)->client;

  std::vector<Mirrored> sessions;
  sessions.push_back(
      CreateBoth("fp32 gqa", MakeSpec(2, 4, 2, 8), *a->client, ref, 5, 1));
  sessions.push_back(CreateBoth("fp16",
                                MakeSpec(1, 2, 1, 8, {}, v1::DTYPE_FLOAT16),
                                *a->client, ref, 4, 2));
  sessions.push_back(CreateBoth("window", MakeSpec(2, 2, 2, 8, {3, 0}),
                                *a->client, ref, 6, 3));
  sessions.push_back(CreateBoth("sinks", SinkSpec(), *a->client, ref, 3, 4));
  // A fork of the fp32 session (sharing its blocks on A), diverging.
  {
    auto fork = a->client->ForkSession(sessions[0].id);
    ATTN_ASSERT_OK(fork);
    auto ref_fork = sessions[0].reference.Fork();
    ATTN_ASSERT_OK(ref_fork);
    Mirrored forked{.name = "fork",
                    .id = fork->session_id(),
                    .reference = *ref_fork,
                    .tokens = RandomTokens(fork->spec(), 64, 5),
                    .next = sessions[0].next};
    sessions.push_back(std::move(forked));
  }
  for (Mirrored& mirrored : sessions) DecodeBoth(*a->client, mirrored);
  for (const Mirrored& mirrored : sessions) {
    auto info = a->client->GetSession(mirrored.id);
    ATTN_ASSERT_OK(info);
    EXPECT_EQ(info->owner(), a->address);
  }

  // A Decode stream on A, mid-way through the fp32 session's token.
  Mirrored& streamed = sessions[0];
  grpc::ClientContext stream_context;
  auto stream = a->client->stub()->Decode(&stream_context);
  const auto step_request = [&](int layer, int64_t t) {
    auto request = streamed.reference.MakeDecodeRequest(
        layer, streamed.tokens.q_rows(t, 1), streamed.tokens.k_rows(t, 1),
        streamed.tokens.v_rows(t, 1));
    EXPECT_TRUE(request.ok());
    request->set_session_id(streamed.id);
    return *request;
  };
  {
    const int64_t t = streamed.next;
    ASSERT_TRUE(stream->Write(step_request(0, t)));
    v1::AttentionResult result;
    ASSERT_TRUE(stream->Read(&result));
    auto kept = streamed.reference.DecodeStep(0, streamed.tokens.q_rows(t, 1),
                                              streamed.tokens.k_rows(t, 1),
                                              streamed.tokens.v_rows(t, 1));
    ATTN_ASSERT_OK(kept);
    EXPECT_EQ(OutputBytes(result), OutputBytes(*kept));
  }

  a->process->Signal(SIGTERM);
  std::map<std::string, Replica*> owners;
  for (const Mirrored& mirrored : sessions) {
    Replica* owner = FindOwner({b.get(), c.get()}, mirrored.id);
    ASSERT_NE(owner, nullptr) << mirrored.name << " was not handed over\n"
                              << a->process->output();
    owners[mirrored.id] = owner;
    auto info = owner->client->GetSession(mirrored.id);
    ATTN_ASSERT_OK(info);
    EXPECT_EQ(info->owner(), owner->address);
  }

  // While the stream keeps A up, a unary call on a moved session gets the
  // redirect.
  const RawReply moved = RawGetSession(*a->client, sessions[1].id);
  EXPECT_EQ(moved.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(moved.owner, owners[sessions[1].id]->address);
  EXPECT_THAT(moved.status.error_message(),
              ::testing::HasSubstr(owners[sessions[1].id]->address));

  // So does every other RPC naming a moved session.
  ExpectRedirectedEverywhere(*a->client, sessions[2].id,
                             sessions[2].reference,
                             owners[sessions[2].id]->address);

  // The stream's next request (layer 1 of the same token) ends it with the
  // redirect; that step was not applied anywhere.
  EXPECT_TRUE(stream->Write(step_request(1, streamed.next)));
  v1::AttentionResult unused;
  EXPECT_FALSE(stream->Read(&unused));
  const grpc::Status ended = stream->Finish();
  EXPECT_EQ(ended.error_code(), grpc::StatusCode::NOT_FOUND)
      << ended.error_message();
  EXPECT_EQ(OwnerTrailer(stream_context), owners[streamed.id]->address);
  stream.reset();
  ExpectExitedZero(*a);

  // The client re-sends that step at the new owner, and decoding goes on
  // bitwise as on the reference.
  {
    const int64_t t = streamed.next;
    client::SessionHandle handle(
        owners[streamed.id]->client.get(),
        *owners[streamed.id]->client->GetSession(streamed.id));
    auto moved_step = handle.DecodeStep(1, streamed.tokens.q_rows(t, 1),
                                        streamed.tokens.k_rows(t, 1),
                                        streamed.tokens.v_rows(t, 1));
    auto kept = streamed.reference.DecodeStep(1, streamed.tokens.q_rows(t, 1),
                                              streamed.tokens.k_rows(t, 1),
                                              streamed.tokens.v_rows(t, 1));
    ATTN_ASSERT_OK(moved_step);
    ATTN_ASSERT_OK(kept);
    EXPECT_EQ(OutputBytes(*moved_step), OutputBytes(*kept));
    ++streamed.next;
  }
  for (Mirrored& mirrored : sessions) {
    for (int i = 0; i < 3; ++i) {
      DecodeBoth(*owners[mirrored.id]->client, mirrored);
    }
    auto moved_info = owners[mirrored.id]->client->GetSession(mirrored.id);
    auto kept_info = mirrored.reference.Info();
    ATTN_ASSERT_OK(moved_info);
    ATTN_ASSERT_OK(kept_info);
    EXPECT_THAT(moved_info->layer_lengths(),
                ::testing::ElementsAreArray(kept_info->layer_lengths()))
        << mirrored.name;
  }
}

// The session ids `replica` restores from `dir`.
std::vector<std::string> RestoredIds(const std::string& dir) {
  std::unique_ptr<Replica> restarted =
      StartReplica({absl::StrCat("--snapshot_dir=", dir)});
  std::vector<std::string> ids;
  if (restarted == nullptr) return ids;
  auto listed = restarted->client->ListSessions();
  EXPECT_TRUE(listed.ok()) << listed.status();
  if (listed.ok()) {
    for (const v1::SessionInfo& info : *listed)
      ids.push_back(info.session_id());
  }
  return ids;
}

TEST(HandoverTest, WithoutAServingPeerSessionsGoToTheSnapshot) {
  const ScopedTempDir scoped_dir("handover-no-peer");
  const std::string& dir = scoped_dir.path();
  // Nothing listens on port 1.
  std::unique_ptr<Replica> a = StartReplica(
      {"--peers=127.0.0.1:1", absl::StrCat("--snapshot_dir=", dir)});
  ASSERT_NE(a, nullptr);
  auto session = a->client->CreateSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  a->process->Signal(SIGTERM);
  ExpectExitedZero(*a);
  EXPECT_THAT(RestoredIds(dir), ::testing::ElementsAre(session->session_id()));
}

// Peer addresses that take a connection and never answer, as a hung pod's
// do: sockets that listen but never accept (the kernel completes the TCP
// handshake; gRPC then waits for an HTTP/2 answer that never comes).
class SilentPeers {
 public:
  explicit SilentPeers(int count) {
    for (int i = 0; i < count; ++i) {
      const int fd = socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in address = {};
      address.sin_family = AF_INET;
      address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      socklen_t length = sizeof(address);
      if (fd < 0 ||
          bind(fd, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
          listen(fd, 16) != 0 ||
          getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) !=
              0) {
        ADD_FAILURE() << "listening socket: " << std::strerror(errno);
        if (fd >= 0) close(fd);
        continue;
      }
      fds_.push_back(fd);
      addresses_.push_back(absl::StrCat("127.0.0.1:", ntohs(address.sin_port)));
    }
  }
  ~SilentPeers() {
    for (int fd : fds_) close(fd);
  }
  // --peers naming all of them.
  std::string Flag() const {
    return absl::StrCat("--peers=", absl::StrJoin(addresses_, ","));
  }

 private:
  std::vector<int> fds_;
  std::vector<std::string> addresses_;
};

// Peers that never answer cost the drain one probe's timeout, not one per
// address: the drain ends within --drain_timeout and its snapshot holds
// every session. (Probed one after another, the eight addresses' probes
// took 16 s, past the snapshot's deadline and the orchestrator's kill.)
TEST(HandoverTest, PeersThatNeverAnswerLeaveTheDrainItsSnapshot) {
  SilentPeers silent(8);
  const ScopedTempDir scoped_dir("handover-silent-peers");
  const std::string& dir = scoped_dir.path();
  std::unique_ptr<Replica> a =
      StartReplica({silent.Flag(), absl::StrCat("--snapshot_dir=", dir),
                    "--drain_timeout=4s"});
  ASSERT_NE(a, nullptr);
  auto session = a->client->CreateSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  const absl::Time drain_start = absl::Now();
  a->process->Signal(SIGTERM);
  ExpectExitedZero(*a);
  const absl::Duration drain = absl::Now() - drain_start;
  // The drain's own bound, with a second for the process to start and end
  // on a loaded machine.
  EXPECT_LT(drain, absl::Seconds(5)) << a->process->output();
  EXPECT_THAT(RestoredIds(dir), ::testing::ElementsAre(session->session_id()))
      << a->process->output();
}

// With a drain shorter than two probe timeouts, the probes of peers that
// never answer end at the hand-over's time to send, not a probe timeout
// later: the snapshot keeps the rest of --drain_timeout. (With probes of
// their own 1 s, they ended as the 1 s drain did, and the session was
// lost: "the snapshot ran out of --drain_timeout".)
TEST(HandoverTest, ProbesEndWithAShortDrainsTimeToSend) {
  SilentPeers silent(2);
  const ScopedTempDir scoped_dir("handover-short-drain-silent-peers");
  const std::string& dir = scoped_dir.path();
  std::unique_ptr<Replica> a =
      StartReplica({silent.Flag(), absl::StrCat("--snapshot_dir=", dir),
                    "--drain_timeout=1s"});
  ASSERT_NE(a, nullptr);
  auto session = a->client->CreateSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  a->process->Signal(SIGTERM);
  ExpectExitedZero(*a);
  EXPECT_THAT(RestoredIds(dir), ::testing::ElementsAre(session->session_id()))
      << a->process->output();
}

// A stand-in peer (not the project's server): it answers its probes as a
// SERVING peer with room, takes an import's records and never answers it,
// so that each import runs until its deadline, as on a peer too loaded to
// finish one.
class SilentImportPeer final : public v1::AttentionService::Service {
 public:
  SilentImportPeer() {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
    address_ = absl::StrCat("127.0.0.1:", port);
    server_->GetHealthCheckService()->SetServingStatus(
        "attention.v1.AttentionService", true);
  }
  ~SilentImportPeer() override { server_->Shutdown(); }

  const std::string& address() const { return address_; }

  grpc::Status GetServerInfo(grpc::ServerContext*,
                             const v1::GetServerInfoRequest*,
                             v1::ServerInfo* info) override {
    info->set_advertise_address(address_);
    info->set_kv_cache_free_bytes(int64_t{1} << 30);
    return grpc::Status::OK;
  }
  grpc::Status ImportSession(grpc::ServerContext* context,
                             grpc::ServerReader<v1::SessionChunk>* reader,
                             v1::SessionInfo*) override {
    v1::SessionChunk record;
    while (reader->Read(&record)) {
    }
    while (!context->IsCancelled()) absl::SleepFor(absl::Milliseconds(10));
    return grpc::Status(grpc::StatusCode::CANCELLED, "cancelled");
  }

 private:
  std::string address_;
  std::unique_ptr<grpc::Server> server_;
};

// An idle Decode stream ends before the drain's deadline, saying that
// nothing after its last reply was applied, also while the hand-over
// still waits for an import's answer past that deadline (a peer that
// never answers: the import is cut at the deadline, then asked again
// once with 2.5 s more), instead of being cut by the shutdown.
TEST(HandoverTest, IdleStreamsEndInTimeWhileAnImportRunsLate) {
  SilentImportPeer peer;
  std::unique_ptr<Replica> a = StartReplica(
      {absl::StrCat("--peers=", peer.address()), "--drain_timeout=10s"});
  ASSERT_NE(a, nullptr);
  auto session = a->client->OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 1, 7);
  auto step = session->MakeDecodeRequest(0, tokens.q, tokens.k, tokens.v);
  ATTN_ASSERT_OK(step);
  grpc::ClientContext context;
  auto stream = a->client->stub()->Decode(&context);
  ASSERT_TRUE(stream->Write(*step));
  v1::AttentionResult result;
  ASSERT_TRUE(stream->Read(&result));
  const absl::Time drain_start = absl::Now();
  a->process->Signal(SIGTERM);
  EXPECT_FALSE(stream->Read(&result));
  const absl::Duration ended = absl::Now() - drain_start;
  const grpc::Status status = stream->Finish();
  // The streams end a second (the grace) before the deadline.
  EXPECT_LT(ended, absl::Seconds(10)) << a->process->output();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE)
      << status.error_message();
  ExpectExitedZero(*a);
}

// A drain of many sessions probes its peers about once a second, not once
// per session (each probe resolves the peers and calls GetServerInfo and
// the health check on every address). The peer is named by a host name
// (looked up on a thread of its own), not an address.
TEST(HandoverTest, ManySessionsMoveOnAFewProbes) {
  std::unique_ptr<Replica> b =
      StartReplica({"--metrics_port=0", "--log_level=info"});
  ASSERT_NE(b, nullptr);
  std::string output = b->process->output();
  for (int i = 0; i < 100 && output.find(" metrics_port=") == std::string::npos;
       ++i) {
    absl::SleepFor(absl::Milliseconds(50));
    output = b->process->output();
  }
  const size_t at = output.find(" metrics_port=");
  ASSERT_NE(at, std::string::npos) << output;
  const int metrics_port = std::atoi(output.c_str() + at + 14);
  ASSERT_GT(metrics_port, 0) << output;
  const std::string port = b->address.substr(b->address.rfind(':') + 1);
  std::unique_ptr<Replica> a =
      StartReplica({absl::StrCat("--peers=localhost:", port)});
  ASSERT_NE(a, nullptr);
  constexpr int kSessions = 150;
  for (int i = 0; i < kSessions; ++i) {
    ATTN_ASSERT_OK(a->client->CreateSession(MakeSpec(1, 2, 1, 8)));
  }
  const absl::Time drain_start = absl::Now();
  a->process->Signal(SIGTERM);
  ExpectExitedZero(*a);
  const absl::Duration drain = absl::Now() - drain_start;
  auto info = b->client->GetServerInfo();
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->active_sessions(), kSessions);
  // One probe per started second of the drain, and a few to spare.
  const std::string metrics = HttpGet(metrics_port, "/metrics");
  const std::string key =
      "attention_requests_total{method=\"GetServerInfo\",code=\"OK\"} ";
  const size_t line = metrics.find(key);
  ASSERT_NE(line, std::string::npos) << metrics;
  const int probes = std::atoi(metrics.c_str() + line + key.size());
  EXPECT_LE(probes, absl::ToInt64Seconds(drain) + 4) << "drain took " << drain;
}

// The ids of the sessions a replica's log says its snapshot failed to save.
absl::flat_hash_set<std::string> SnapshotFailures(const std::string& log) {
  absl::flat_hash_set<std::string> ids;
  const std::string kKey = "event=snapshot_session_failed session=";
  for (size_t at = log.find(kKey); at != std::string::npos;
       at = log.find(kKey, at + 1)) {
    const size_t begin = at + kKey.size();
    ids.insert(log.substr(begin, log.find(' ', begin) - begin));
  }
  return ids;
}

// A drain whose hand-over runs out of time loses no session: the sessions
// it did not send go to the snapshot, and the import in flight when the
// sending stops still gets its answer (the session ends on one replica,
// never on neither). The only sessions on neither are those the snapshot,
// out of time too, says it could not save.
TEST(HandoverTest, AHandoverOutOfTimeLosesNoSession) {
  std::unique_ptr<Replica> b = StartReplica({});
  ASSERT_NE(b, nullptr);
  const ScopedTempDir scoped_dir("handover-out-of-time");
  const std::string& dir = scoped_dir.path();
  // The hand-over sends for 250 ms of the drain's first half second:
  // fewer sessions than this on a fast machine (1,600-2,000 here; with a
  // 2 s drain, 750 ms moved all 6,000 in one of four runs).
  std::unique_ptr<Replica> a = StartReplica(
      {absl::StrCat("--peers=", b->address),
       absl::StrCat("--snapshot_dir=", dir), "--drain_timeout=1s"});
  ASSERT_NE(a, nullptr);
  constexpr int kSessions = 6000;
  std::vector<std::string> ids;
  for (int i = 0; i < kSessions; ++i) {
    auto session = a->client->CreateSession(MakeSpec(1, 2, 1, 8));
    ATTN_ASSERT_OK(session);
    ids.push_back(session->session_id());
  }
  a->process->Signal(SIGTERM);
  ExpectExitedZero(*a);
  const std::vector<std::string> restored = RestoredIds(dir);
  const absl::flat_hash_set<std::string> snapshotted(restored.begin(),
                                                     restored.end());
  const absl::flat_hash_set<std::string> unsaved =
      SnapshotFailures(a->process->output());
  int moved = 0;
  std::vector<std::string> lost, doubled;
  for (const std::string& id : ids) {
    const bool on_b = b->client->GetSession(id).ok();
    moved += on_b ? 1 : 0;
    if (on_b && snapshotted.contains(id)) doubled.push_back(id);
    if (!on_b && !snapshotted.contains(id) && !unsaved.contains(id)) {
      lost.push_back(id);
    }
  }
  // What the drain says it did (its log has a line per unsaved session).
  std::string summary;
  for (absl::string_view line : absl::StrSplit(a->process->output(), '\n')) {
    if (absl::StrContains(line, "event=handover_finished") ||
        absl::StrContains(line, "event=snapshot_written")) {
      absl::StrAppend(&summary, line, "\n");
    }
  }
  EXPECT_THAT(lost, ::testing::IsEmpty()) << summary;
  EXPECT_THAT(doubled, ::testing::IsEmpty()) << summary;
  // The time ran out with sessions left to snapshot.
  EXPECT_GT(moved, 0) << summary;
  EXPECT_LT(moved, kSessions) << summary;
  EXPECT_GT(restored.size(), 0u) << summary;
}

TEST(HandoverTest, AFullPeerIsSkippedForTheNextOrTheSnapshot) {
  // B has the most free KV memory but no room for another session.
  std::unique_ptr<Replica> b =
      StartReplica({"--max_sessions=1", "--kv_cache_bytes=33554432"});
  ASSERT_NE(b, nullptr);
  ATTN_ASSERT_OK(b->client->CreateSession(MakeSpec(1, 2, 1, 8)));
  std::unique_ptr<Replica> c = StartReplica({});
  ASSERT_NE(c, nullptr);

  // With B and C: the session goes to C after B refuses it.
  {
    std::unique_ptr<Replica> a =
        StartReplica({absl::StrCat("--peers=", b->address, ",", c->address)});
    ASSERT_NE(a, nullptr);
    auto session = a->client->CreateSession(MakeSpec(1, 2, 1, 8));
    ATTN_ASSERT_OK(session);
    a->process->Signal(SIGTERM);
    ExpectExitedZero(*a);
    auto on_c = c->client->GetSession(session->session_id());
    ATTN_EXPECT_OK(on_c);
    if (on_c.ok()) {
      EXPECT_EQ(on_c->owner(), c->address);
    }
    ATTN_EXPECT_CODE(b->client->GetSession(session->session_id()),
                     absl::StatusCode::kNotFound);
  }
  // With B alone: it falls back to the snapshot.
  {
    const ScopedTempDir scoped_dir("handover-full-peer");
    const std::string& dir = scoped_dir.path();
    std::unique_ptr<Replica> a =
        StartReplica({absl::StrCat("--peers=", b->address),
                      absl::StrCat("--snapshot_dir=", dir)});
    ASSERT_NE(a, nullptr);
    auto session = a->client->CreateSession(MakeSpec(1, 2, 1, 8));
    ATTN_ASSERT_OK(session);
    a->process->Signal(SIGTERM);
    ExpectExitedZero(*a);
    EXPECT_THAT(RestoredIds(dir),
                ::testing::ElementsAre(session->session_id()));
  }
}

// A peer too busy (here: paused) to answer the drain's first probes is
// asked again until it serves: the sessions move instead of being given up
// at once.
TEST(HandoverTest, APeerThatAnswersLateStillTakesTheSessions) {
  std::unique_ptr<Replica> b = StartReplica({});
  ASSERT_NE(b, nullptr);
  std::unique_ptr<Replica> a =
      StartReplica({absl::StrCat("--peers=", b->address)});
  ASSERT_NE(a, nullptr);
  std::vector<std::string> ids;
  for (int i = 0; i < 2; ++i) {
    auto session = a->client->CreateSession(MakeSpec(1, 2, 1, 8));
    ATTN_ASSERT_OK(session);
    ids.push_back(session->session_id());
  }
  ASSERT_TRUE(b->process->Freeze());
  a->process->Signal(SIGTERM);
  absl::SleepFor(absl::Milliseconds(2500));  // A's first probes time out
  b->process->Signal(SIGCONT);
  ExpectExitedZero(*a);
  for (const std::string& id : ids) {
    EXPECT_TRUE(b->client->GetSession(id).ok()) << a->process->output();
  }
}

TEST(HandoverTest, ASessionNoPeerAcceptsStaysBehind) {
  // B holds sessions of at most 64 tokens per layer: it refuses the import
  // of a session that may grow to 128.
  std::unique_ptr<Replica> b = StartReplica({"--max_session_tokens=64"});
  ASSERT_NE(b, nullptr);
  std::unique_ptr<Replica> a =
      StartReplica({absl::StrCat("--peers=", b->address)});
  ASSERT_NE(a, nullptr);
  v1::SessionSpec long_spec = MakeSpec(1, 4, 1, 32);
  long_spec.set_max_tokens(128);
  auto stays = a->client->CreateSession(long_spec);
  ATTN_ASSERT_OK(stays);
  v1::SessionSpec short_spec = MakeSpec(1, 2, 1, 8);
  short_spec.set_max_tokens(32);
  auto moves = a->client->CreateSession(short_spec);
  ATTN_ASSERT_OK(moves);
  a->process->Signal(SIGTERM);
  ExpectExitedZero(*a);
  ATTN_EXPECT_OK(b->client->GetSession(moves->session_id()));
  ATTN_EXPECT_CODE(b->client->GetSession(stays->session_id()),
                   absl::StatusCode::kNotFound);
  EXPECT_THAT(a->process->output(),
              ::testing::HasSubstr("event=handover_refused"));
  EXPECT_THAT(a->process->output(),
              ::testing::HasSubstr("event=handover_finished sent=1 failed=1"));
}

TEST(HandoverTest, APeerHoldingAnotherCopyOfTheIdRefusesTheSession) {
  // B holds an older copy of A's session under the same id (a client
  // imported it keeping the id); A's session then grows. No attempt of A's
  // drain created B's copy, so B's ALREADY_EXISTS is a refusal: A keeps the
  // session (and snapshots it whole) instead of redirecting to the stale
  // copy.
  const ScopedTempDir scoped_dir("handover-copy-on-peer");
  const std::string& dir = scoped_dir.path();
  std::unique_ptr<Replica> b = StartReplica({});
  ASSERT_NE(b, nullptr);
  std::unique_ptr<Replica> a =
      StartReplica({absl::StrCat("--peers=", b->address),
                    absl::StrCat("--snapshot_dir=", dir)});
  ASSERT_NE(a, nullptr);
  auto session = a->client->OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  const Tokens tokens = RandomTokens(session->spec(), 30, 17);
  ATTN_ASSERT_OK(session->Prefill(0, tokens.q_rows(0, 10), tokens.k_rows(0, 10),
                                  tokens.v_rows(0, 10)));
  std::vector<v1::SessionChunk> records;
  ATTN_ASSERT_OK(a->client->ExportSession(session->id(),
                                          [&](const v1::SessionChunk& record) {
                                            records.push_back(record);
                                            return absl::OkStatus();
                                          }));
  size_t next = 0;
  ATTN_ASSERT_OK(b->client->ImportSession(
      [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
        if (next == records.size()) return false;
        *record = records[next++];
        return true;
      },
      /*keep_session_id=*/true));
  ATTN_ASSERT_OK(session->Prefill(
      0, tokens.q_rows(10, 20), tokens.k_rows(10, 20), tokens.v_rows(10, 20)));
  a->process->Signal(SIGTERM);
  ExpectExitedZero(*a);
  EXPECT_THAT(a->process->output(),
              ::testing::HasSubstr("event=handover_refused"));
  EXPECT_THAT(a->process->output(),
              ::testing::Not(::testing::HasSubstr("handover_found_on_peer")));
  auto on_b = b->client->GetSession(session->id());
  ATTN_ASSERT_OK(on_b);
  EXPECT_EQ(on_b->layer_lengths(0), 10);  // B's copy untouched
  std::unique_ptr<Replica> restarted =
      StartReplica({absl::StrCat("--snapshot_dir=", dir)});
  ASSERT_NE(restarted, nullptr);
  auto restored = restarted->client->GetSession(session->id());
  ATTN_ASSERT_OK(restored);
  EXPECT_EQ(restored->layer_lengths(0), 30);
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path);
  out << text;
}

TEST(HandoverTest, RedirectsAndImportsKeepTenantsApart) {
  const ScopedTempDir scoped_dir("handover-tenants");
  const std::string& dir = scoped_dir.path();
  const std::string tokens_file = dir + "/tokens";
  WriteFile(tokens_file,
            absl::StrCat("alice ", server::DigestTokenHex("alice-token"),
                         " - -\nbob ", server::DigestTokenHex("bob-token"),
                         " - -\npeer ", server::DigestTokenHex("peer-token"),
                         " - -\n"));
  const std::string peer_token_file = dir + "/peer-token";
  WriteFile(peer_token_file, "peer-token\n");
  const std::string auth = absl::StrCat("--auth_tokens_file=", tokens_file);
  std::unique_ptr<Replica> b = StartReplica({auth}, "alice-token");
  ASSERT_NE(b, nullptr);
  std::unique_ptr<Replica> a =
      StartReplica({auth, absl::StrCat("--peers=", b->address),
                    absl::StrCat("--peer_token_file=", peer_token_file)},
                   "alice-token");
  ASSERT_NE(a, nullptr);
  client::ClientOptions bob_options;
  bob_options.auth_token = "bob-token";
  auto bob_on_a = client::AttentionClient::Connect(a->address, bob_options);
  auto bob_on_b = client::AttentionClient::Connect(b->address, bob_options);

  auto session = a->client->CreateSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  const std::string id = session->session_id();
  // An open stream (one step done: its handler runs) keeps A up after the
  // handover.
  auto keeper = a->client->OpenSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(keeper);
  const Tokens tokens = RandomTokens(keeper->spec(), 1, 7);
  auto step = keeper->MakeDecodeRequest(0, tokens.q, tokens.k, tokens.v);
  ATTN_ASSERT_OK(step);
  grpc::ClientContext keep_alive;
  keep_alive.AddMetadata("authorization", "Bearer alice-token");
  auto stream = a->client->stub()->Decode(&keep_alive);
  ASSERT_TRUE(stream->Write(*step));
  v1::AttentionResult first;
  ASSERT_TRUE(stream->Read(&first));

  // The peer token rotates (both Secrets change) while A serves: its drain
  // reads the token anew.
  WriteFile(tokens_file,
            absl::StrCat("alice ", server::DigestTokenHex("alice-token"),
                         " - -\nbob ", server::DigestTokenHex("bob-token"),
                         " - -\npeer ", server::DigestTokenHex("peer-token-2"),
                         " - -\n"));
  WriteFile(peer_token_file, "peer-token-2\n");
  client::ClientOptions rotated;
  rotated.auth_token = "peer-token-2";
  auto rotated_on_b = client::AttentionClient::Connect(b->address, rotated);
  ASSERT_TRUE(Eventually([&] { return rotated_on_b->GetServerInfo().ok(); },
                         absl::Seconds(20)));

  a->process->Signal(SIGTERM);
  ASSERT_NE(FindOwner({b.get()}, id), nullptr) << a->process->output();
  // On B the session still belongs to alice.
  ATTN_EXPECT_CODE(bob_on_b->GetSession(id), absl::StatusCode::kNotFound);

  const RawReply alice = RawGetSession(*a->client, id, "alice-token");
  EXPECT_EQ(alice.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(alice.owner, b->address);
  // To bob the moved id looks exactly like one that never existed.
  const RawReply bob = RawGetSession(*bob_on_a, id, "bob-token");
  const RawReply unknown =
      RawGetSession(*bob_on_a, std::string(32, '0'), "bob-token");
  EXPECT_EQ(bob.status.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(bob.owner, std::nullopt);
  EXPECT_THAT(bob.status.error_message(),
              ::testing::Not(::testing::HasSubstr(b->address)));
  EXPECT_EQ(unknown.status.error_message().substr(
                unknown.status.error_message().find("' not found")),
            bob.status.error_message().substr(
                bob.status.error_message().find("' not found")));

  // A handover import is the peer identity's alone.
  {
    std::vector<v1::SessionChunk> chunks;
    ATTN_ASSERT_OK(b->client->ExportSession(
        id, [&](const v1::SessionChunk& chunk) -> absl::Status {
          chunks.push_back(chunk);
          return absl::OkStatus();
        }));
    chunks[0].mutable_header()->set_session_id(std::string(32, '1'));
    chunks[0].set_keep_session_id(true);
    grpc::ClientContext context;
    context.AddMetadata("authorization", "Bearer bob-token");
    context.AddMetadata("attention-handover-from", "127.0.0.1:9");
    v1::SessionInfo info;
    auto writer = bob_on_b->stub()->ImportSession(&context, &info);
    for (const v1::SessionChunk& chunk : chunks) {
      if (!writer->Write(chunk)) break;
    }
    writer->WritesDone();
    const grpc::Status status = writer->Finish();
    EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << status.error_message();
    // Without naming the peer identity's tenant.
    EXPECT_THAT(status.error_message(),
                ::testing::Not(::testing::HasSubstr("'peer'")));
  }

  stream->WritesDone();
  EXPECT_TRUE(stream->Finish().ok());
  stream.reset();
  bob_on_a.reset();
  ExpectExitedZero(*a);
}

TEST(HandoverTest, PeersTalkTlsWithThePeerToken) {
  auto dir = MakeTempDirectory();
  ATTN_ASSERT_OK(dir);
  auto ca = MakeCa(*dir, "ca");
  ATTN_ASSERT_OK(ca);
  auto cert = MakeCertificate(*ca, *dir, "server", "attention-server",
                              CertificateUse::kServer);
  ATTN_ASSERT_OK(cert);
  const std::string tokens_file = *dir + "/tokens";
  WriteFile(tokens_file,
            absl::StrCat("alice ", server::DigestTokenHex("alice-token"),
                         " - -\npeer ", server::DigestTokenHex("peer-token"),
                         " - -\n"));
  const std::string peer_token_file = *dir + "/peer-token";
  WriteFile(peer_token_file, "peer-token");
  const std::vector<std::string> tls = {
      absl::StrCat("--tls_cert_file=", cert->cert),
      absl::StrCat("--tls_key_file=", cert->key),
      absl::StrCat("--auth_tokens_file=", tokens_file)};
  client::ClientOptions client_tls;
  client_tls.tls_ca_file = ca->cert;
  client_tls.tls_server_name = "localhost";
  std::unique_ptr<Replica> b = StartReplica(tls, "alice-token", client_tls);
  ASSERT_NE(b, nullptr);
  std::vector<std::string> a_flags = tls;
  a_flags.push_back(absl::StrCat("--peers=", b->address));
  a_flags.push_back(absl::StrCat("--peer_token_file=", peer_token_file));
  a_flags.push_back(absl::StrCat("--peer_tls_ca_file=", ca->cert));
  a_flags.push_back("--peer_tls_server_name=localhost");
  std::unique_ptr<Replica> a = StartReplica(a_flags, "alice-token", client_tls);
  ASSERT_NE(a, nullptr);
  auto session = a->client->CreateSession(MakeSpec(1, 2, 1, 8));
  ATTN_ASSERT_OK(session);
  a->process->Signal(SIGTERM);
  ExpectExitedZero(*a);
  // Moved over TLS, still alice's.
  auto moved = b->client->GetSession(session->session_id());
  ATTN_EXPECT_OK(moved);
  if (moved.ok()) {
    EXPECT_EQ(moved->owner(), b->address);
  }
  std::filesystem::remove_all(*dir);
}

}  // namespace
}  // namespace attention::testing
