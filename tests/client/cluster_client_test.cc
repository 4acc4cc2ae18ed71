// ClusterClient against real attention-server processes on 127.0.0.1:
// placement over three replicas, routing of every kind of call (Prefill,
// the multiplexed Decode stream, BatchDecode split across replicas, forks),
// outputs bitwise equal to one-shot stateless attention over the same keys,
// a replica drained in the middle of streamed decoding (its sessions move
// to the others, the client sees no error), a replica killed (its sessions
// report it, the others carry on, a replacement comes up empty), a replica
// restarted from its snapshot directory, a fourth replica joining,
// placement keys, replicas forgotten once gone, look-ups past unreachable
// replicas, and the bound on remembered owners.
#include "client/cluster_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/tensor_codec.h"
#include "gtest/gtest.h"
#include "tests/server/server_process.h"
#include "tests/server/test_server.h"

namespace attention::testing {
namespace {

using client::ClusterClient;
using client::ClusterOptions;

constexpr int kPrompt = 5;
constexpr int kSteps = 4;

// --drain_timeout is generous for slow (sanitizer) builds: a drain ends as
// soon as its calls do.
const std::vector<std::string>& ReplicaFlags() {
  static const auto* flags =
      new std::vector<std::string>{"--listen_address=127.0.0.1",
                                   "--backend=cpu",
                                   "--threads=1",
                                   "--kv_cache_bytes=16777216",
                                   "--kv_block_bytes=4096",
                                   "--metrics_port=-1",
                                   "--drain_timeout=60s"};
  return *flags;
}

// The lowest port the kernel hands out for outgoing connections and for
// port 0 (32768 when it cannot be read).
int FirstEphemeralPort() {
  int low = 32768;
  std::ifstream range("/proc/sys/net/ipv4/ip_local_port_range");
  range >> low;
  return low;
}

// Binds 127.0.0.1:`port` (0: any) and releases it; the port bound, or 0.
int BindAndRelease(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  sockaddr_in address;
  std::memset(&address, 0, sizeof(address));
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  socklen_t length = sizeof(address);
  int bound = 0;
  if (bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0 &&
      getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0) {
    bound = ntohs(address.sin_port);
  }
  close(fd);
  return bound;
}

// A port on 127.0.0.1 free right now (bound, then released) and not in
// `taken`, so that replicas can name each other, and be replaced, on known
// ports. It lies below the ephemeral range when there is room: a port from
// that range, once released, can be taken by any connection the tests
// open before the replica binds it.
int PickFreePort(const std::vector<int>& taken) {
  const int high = FirstEphemeralPort();
  const int low = std::max(1024, high - 16384);
  std::mt19937 random(std::random_device{}());
  std::uniform_int_distribution<int> pick(low, std::max(low, high - 1));
  for (int attempt = 0; attempt < 64; ++attempt) {
    const int port =
        high - low >= 256 ? BindAndRelease(pick(random)) : BindAndRelease(0);
    if (port > 0 &&
        std::find(taken.begin(), taken.end(), port) == taken.end()) {
      return port;
    }
  }
  return 0;
}

// The exit code of a process that has exited (-1: killed by a signal).
int ExitCode(ServerProcess& process) {
  const int status = process.Wait();
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Replicas on ports chosen up front, so that each can be replaced on its
// port; with `peers`, each gets --peers naming all of them (a replica
// leaves itself out). Tests assert ok() (with errors()) once it is made and
// after Add.
class Fleet {
 public:
  explicit Fleet(int size, std::vector<std::string> extra_flags = {},
                 bool peers = false)
      : extra_flags_(std::move(extra_flags)), peers_(peers) {
    for (int i = 0; i < size; ++i) ports_.push_back(PickFreePort(ports_));
    for (int i = 0; i < size; ++i) StartOrNote(i);
  }

  // (Re)starts replica `i` on its port; false when it does not serve.
  bool Start(int i) {
    std::vector<std::string> flags = ReplicaFlags();
    flags.push_back(absl::StrCat("--port=", ports_[i]));
    if (peers_) flags.push_back("--peers=" + List());
    flags.insert(flags.end(), extra_flags_.begin(), extra_flags_.end());
    const std::vector<std::string>& own = replica_flags_[i];
    flags.insert(flags.end(), own.begin(), own.end());
    if (static_cast<int>(replicas_.size()) <= i) replicas_.resize(i + 1);
    replicas_[i].reset();
    replicas_[i] = std::make_unique<ServerProcess>(flags);
    return replicas_[i]->WaitForPort() > 0;
  }
  // Flags of replica `i` alone, from its next Start on.
  void AddFlags(int i, std::vector<std::string> flags) {
    replica_flags_[i].insert(replica_flags_[i].end(), flags.begin(),
                             flags.end());
  }
  // Adds a replica on a new port.
  int Add() {
    ports_.push_back(PickFreePort(ports_));
    StartOrNote(static_cast<int>(ports_.size()) - 1);
    return static_cast<int>(ports_.size()) - 1;
  }
  // Whether every replica the constructor and Add started serves; errors()
  // says which did not, and what they wrote.
  bool ok() const { return errors_.empty(); }
  const std::string& errors() const { return errors_; }

  ServerProcess& replica(int i) { return *replicas_[i]; }
  std::string address(int i) const {
    return absl::StrCat("127.0.0.1:", ports_[i]);
  }
  int size() const { return static_cast<int>(ports_.size()); }
  std::string List() const {
    std::vector<std::string> addresses;
    for (int i = 0; i < size(); ++i) addresses.push_back(address(i));
    return absl::StrJoin(addresses, ",");
  }
  int IndexOf(const std::string& address) const {
    for (int i = 0; i < size(); ++i) {
      if (this->address(i) == address) return i;
    }
    return -1;
  }

 private:
  void StartOrNote(int i) {
    if (ports_[i] <= 0) {
      absl::StrAppend(&errors_, "replica ", i, ": no free port\n");
    } else if (!Start(i)) {
      absl::StrAppend(&errors_, "replica ", i, " (", address(i),
                      ") does not serve:\n", replicas_[i]->output(), "\n");
    }
  }

  std::vector<std::string> extra_flags_;
  bool peers_;
  std::map<int, std::vector<std::string>> replica_flags_;
  std::vector<int> ports_;
  std::vector<std::unique_ptr<ServerProcess>> replicas_;
  std::string errors_;
};

// Refreshes until the cluster sees `address` in `state` (at most 10 s).
bool AwaitState(ClusterClient& cluster, const std::string& address,
                client::ReplicaStatus::State state) {
  const absl::Time deadline = absl::Now() + absl::Seconds(10);
  while (absl::Now() < deadline) {
    cluster.Refresh();
    for (const client::ReplicaStatus& replica : cluster.Replicas()) {
      if (replica.address == address && replica.state == state) return true;
    }
    absl::SleepFor(absl::Milliseconds(50));
  }
  return false;
}

ClusterOptions TestClusterOptions() {
  ClusterOptions options;
  options.client.call_timeout = absl::Seconds(30);
  options.client.retry_max_attempts = 1;
  options.probe_timeout = absl::Seconds(2);
  return options;
}

// A session's specs cycle through: fp32 with a sliding window + sink
// tokens, fp16 GQA 4:1, bf16 with learned sink logits, fp32 window 4 with
// one sink token and GQA 8:2.
v1::SessionSpec MixedSpec(int i) {
  switch (i % 4) {
    case 0: {
      v1::SessionSpec spec = MakeSpec(2, 4, 2, 16, {0, 6});
      spec.mutable_layers(1)->set_num_sink_tokens(2);
      return spec;
    }
    case 1:
      return MakeSpec(1, 4, 1, 8, {}, v1::DTYPE_FLOAT16);
    case 2: {
      v1::SessionSpec spec = MakeSpec(2, 2, 2, 16, {0, 0}, v1::DTYPE_BFLOAT16);
      for (int h = 0; h < 2; ++h) {
        spec.mutable_layers(0)->add_sink_logits(0.25f * h - 0.5f);
      }
      return spec;
    }
    default: {
      v1::SessionSpec spec = MakeSpec(1, 8, 2, 8, {4});
      spec.mutable_layers(0)->set_num_sink_tokens(1);
      return spec;
    }
  }
}

// One session's data and what the fleet answered so far.
struct Workload {
  std::string id;
  v1::SessionSpec spec;          // resolved
  std::vector<Tokens> tokens;    // per layer, kPrompt + kSteps (+ more)
  std::vector<std::string> out;  // per layer: output rows so far
  int64_t length = 0;            // tokens appended to every layer
};

v1::Tensor Rows(const std::vector<float>& values, int64_t begin, int64_t rows,
                int64_t heads, int64_t dim) {
  const int64_t width = heads * dim;
  auto tensor = client::MakeTensor(
      absl::MakeConstSpan(values).subspan(begin * width, rows * width),
      {rows, heads, dim});
  EXPECT_TRUE(tensor.ok()) << tensor.status();
  return *tensor;
}

template <typename Request>
Request AppendRequest(const Workload& w, int layer, int64_t begin,
                      int64_t rows) {
  const Tokens& t = w.tokens[layer];
  Request request;
  request.set_session_id(w.id);
  request.set_layer(layer);
  *request.mutable_q() = Rows(t.q, begin, rows, t.heads, t.head_dim);
  *request.mutable_k() = Rows(t.k, begin, rows, t.kv_heads, t.head_dim);
  *request.mutable_v() = Rows(t.v, begin, rows, t.kv_heads, t.value_dim);
  return request;
}

v1::DecodeRequest NextStep(const Workload& w, int layer) {
  return AppendRequest<v1::DecodeRequest>(w, layer, w.length, 1);
}

// The workload of a created session (MixedSpec(i)) with tokens for `total`
// positions; empty when `info` is an error.
Workload WorkloadOf(const absl::StatusOr<v1::SessionInfo>& info, int i,
                    int64_t total) {
  Workload w;
  EXPECT_TRUE(info.ok()) << info.status();
  if (!info.ok()) return w;
  w.id = info->session_id();
  w.spec = info->spec();
  for (int layer = 0; layer < w.spec.num_layers(); ++layer) {
    w.tokens.push_back(RandomTokens(w.spec, total, 1000 * i + layer + 1));
  }
  w.out.resize(w.spec.num_layers());
  return w;
}

// Creates a session through the cluster with tokens for `total` positions.
Workload NewWorkload(ClusterClient& cluster, int i, int64_t total,
                     absl::string_view placement_key = "") {
  return WorkloadOf(
      cluster.CreateSession(MixedSpec(i), absl::ZeroDuration(), placement_key),
      i, total);
}

// Creates a session on one replica directly, behind the cluster's back.
Workload NewWorkloadOn(const std::string& replica, int i, int64_t total) {
  return WorkloadOf(
      client::AttentionClient::Connect(replica)->CreateSession(MixedSpec(i)), i,
      total);
}

// A clock moved by hand (ClusterOptions::now).
class FakeClock {
 public:
  absl::Time Now() const {
    absl::MutexLock lock(&mu_);
    return now_;
  }
  void Advance(absl::Duration by) {
    absl::MutexLock lock(&mu_);
    now_ += by;
  }

 private:
  mutable absl::Mutex mu_;
  absl::Time now_ = absl::FromUnixSeconds(1'000'000'000);
};

// A membership the test changes (ClusterOptions::resolver).
class Members {
 public:
  explicit Members(std::vector<std::string> addresses)
      : addresses_(std::move(addresses)) {}
  void Set(std::vector<std::string> addresses) {
    absl::MutexLock lock(&mu_);
    addresses_ = std::move(addresses);
  }
  std::function<absl::StatusOr<std::vector<std::string>>()> Resolver() {
    return [this]() -> absl::StatusOr<std::vector<std::string>> {
      absl::MutexLock lock(&mu_);
      return addresses_;
    };
  }

 private:
  absl::Mutex mu_;
  std::vector<std::string> addresses_;
};

// The cluster's view of the replica dialed or known as `address`, if it
// still knows it.
std::optional<client::ReplicaStatus> ReplicaNamed(ClusterClient& cluster,
                                                  const std::string& address) {
  for (const client::ReplicaStatus& replica : cluster.Replicas()) {
    if (replica.address == address || replica.dialed == address) {
      return replica;
    }
  }
  return std::nullopt;
}

void PrefillAll(ClusterClient& cluster, Workload& w) {
  for (int layer = 0; layer < w.spec.num_layers(); ++layer) {
    auto result = cluster.Prefill(
        AppendRequest<v1::PrefillRequest>(w, layer, w.length, kPrompt));
    ASSERT_TRUE(result.ok()) << result.status();
    w.out[layer] += result->output().data();
  }
  w.length += kPrompt;
}

// One decode step of every layer of every session, multiplexed on one
// ClusterDecodeStream: all written first, then read in order.
void StreamStep(ClusterClient& cluster, std::vector<Workload>& workloads) {
  auto stream = cluster.OpenDecodeStream();
  for (const Workload& w : workloads) {
    for (int layer = 0; layer < w.spec.num_layers(); ++layer) {
      ASSERT_TRUE(stream->Write(NextStep(w, layer)));
    }
  }
  for (Workload& w : workloads) {
    for (int layer = 0; layer < w.spec.num_layers(); ++layer) {
      auto result = stream->Read();
      ASSERT_TRUE(result.ok()) << result.status();
      EXPECT_EQ(result->position(), w.length);
      w.out[layer] += result->output().data();
    }
    ++w.length;
  }
  ATTN_ASSERT_OK(stream->Finish());
}

// One decode step of every session through `cluster`'s BatchDecode (split
// over the replicas), results recorded.
void BatchStep(ClusterClient& cluster, std::vector<Workload>& workloads) {
  v1::BatchDecodeRequest batch;
  for (const Workload& w : workloads) {
    for (int layer = 0; layer < w.spec.num_layers(); ++layer) {
      *batch.add_steps() = NextStep(w, layer);
    }
  }
  auto results = cluster.BatchDecode(batch);
  ASSERT_TRUE(results.ok()) << results.status();
  ASSERT_EQ(static_cast<int>(results->size()), batch.steps_size());
  int index = 0;
  for (Workload& w : workloads) {
    for (int layer = 0; layer < w.spec.num_layers(); ++layer) {
      EXPECT_EQ((*results)[index].position(), w.length);
      w.out[layer] += (*results)[index++].output().data();
    }
    ++w.length;
  }
}

// Every output row so far equals one stateless causal call over the same
// keys (bitwise: same kernels, k/v sent in the storage dtype).
void ExpectOneShot(ClusterClient& cluster, const Workload& w) {
  for (int layer = 0; layer < w.spec.num_layers(); ++layer) {
    Tokens prefix = w.tokens[layer];
    prefix.count = w.length;
    prefix.q.resize(w.length * prefix.heads * prefix.head_dim);
    prefix.k.resize(w.length * prefix.kv_heads * prefix.head_dim);
    prefix.v.resize(w.length * prefix.kv_heads * prefix.value_dim);
    auto stateless = cluster.Attention(
        StatelessRequestFor(prefix, w.spec, layer, w.spec.kv_dtype()));
    ASSERT_TRUE(stateless.ok()) << stateless.status();
    EXPECT_TRUE(w.out[layer] == stateless->output().data())
        << "session " << w.id << " layer " << layer << " ("
        << v1::DType_Name(w.spec.kv_dtype()) << ") differs from one-shot";
  }
}

TEST(ClusterClientTest, SixtySessionsSpreadOverThreeReplicasAndMatchOneShot) {
  Fleet fleet(3);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  auto cluster = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  std::vector<Workload> workloads;
  for (int i = 0; i < 60; ++i) {
    workloads.push_back(NewWorkload(**cluster, i, kPrompt + kSteps + 1));
    PrefillAll(**cluster, workloads.back());
  }
  // Placement: every replica has sessions, and each session is where the
  // client routes it.
  std::map<std::string, int> per_owner;
  for (const Workload& w : workloads) ++per_owner[(*cluster)->OwnerOf(w.id)];
  EXPECT_EQ(per_owner.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_GE(per_owner[fleet.address(i)], 5) << fleet.address(i);
    auto direct = client::AttentionClient::Connect(fleet.address(i));
    auto listed = direct->ListSessions();
    ATTN_ASSERT_OK(listed);
    EXPECT_EQ(static_cast<int>(listed->size()), per_owner[fleet.address(i)]);
    for (const v1::SessionInfo& info : *listed) {
      EXPECT_EQ((*cluster)->OwnerOf(info.session_id()), fleet.address(i));
    }
  }
  for (int step = 0; step < kSteps; ++step) StreamStep(**cluster, workloads);

  // One BatchDecode over every session: split per replica, results back
  // in request order.
  BatchStep(**cluster, workloads);
  for (const Workload& w : workloads) ExpectOneShot(**cluster, w);

  // GetSession, Truncate and Delete reach the owner too.
  auto info = (*cluster)->GetSession(workloads[7].id);
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), kPrompt + kSteps + 1);
  ATTN_ASSERT_OK((*cluster)->TruncateSession(workloads[7].id, 2));
  EXPECT_EQ((*cluster)->GetSession(workloads[7].id)->layer_lengths(0), 2);
  auto all = (*cluster)->ListSessions();
  ATTN_ASSERT_OK(all);
  EXPECT_EQ(all->size(), 60u);
  for (const Workload& w : workloads) {
    ATTN_EXPECT_OK((*cluster)->DeleteSession(w.id));
  }
  EXPECT_TRUE((*cluster)->ListSessions()->empty());
  ATTN_EXPECT_CODE((*cluster)->GetSession(workloads[0].id),
                   absl::StatusCode::kNotFound);
}

TEST(ClusterClientTest, PlacementKeysColocateRelatedSessionsAndForks) {
  Fleet fleet(3);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  auto cluster = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  // One conversation's sessions and their forks land together.
  std::set<std::string> owners;
  for (int i = 0; i < 6; ++i) {
    Workload w = NewWorkload(**cluster, i, kPrompt + 2, "conversation-42");
    PrefillAll(**cluster, w);
    owners.insert((*cluster)->OwnerOf(w.id));
    auto fork = (*cluster)->ForkSession(w.id);
    ATTN_ASSERT_OK(fork);
    EXPECT_EQ((*cluster)->OwnerOf(fork->session_id()),
              (*cluster)->OwnerOf(w.id));
    // The fork is really there: decoding it continues from the prompt.
    Workload forked = w;
    forked.id = fork->session_id();
    for (int layer = 0; layer < forked.spec.num_layers(); ++layer) {
      auto step = (*cluster)->DecodeStep(NextStep(forked, layer));
      ATTN_ASSERT_OK(step);
      forked.out[layer] += step->output().data();
    }
    ++forked.length;
    ExpectOneShot(**cluster, forked);
  }
  EXPECT_EQ(owners.size(), 1u);
  // Different keys spread.
  std::set<std::string> spread;
  for (int key = 0; key < 48; ++key) {
    auto info = (*cluster)->CreateSession(MixedSpec(key), absl::ZeroDuration(),
                                          absl::StrCat("user-", key));
    ATTN_ASSERT_OK(info);
    spread.insert((*cluster)->OwnerOf(info->session_id()));
  }
  EXPECT_EQ(spread.size(), 3u);
}

TEST(ClusterClientTest, ADrainingReplicaHandsItsSessionsOverWithoutAnError) {
  Fleet fleet(3, {}, /*peers=*/true);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  auto cluster = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  constexpr int kMaxRounds = 200;
  std::vector<Workload> workloads;
  for (int i = 0; i < 30; ++i) {
    workloads.push_back(NewWorkload(**cluster, i, kPrompt + kMaxRounds + 3));
    PrefillAll(**cluster, workloads.back());
  }
  const std::string victim = (*cluster)->OwnerOf(workloads[0].id);
  const int index = fleet.IndexOf(victim);
  ASSERT_GE(index, 0) << victim;
  // Clients that learn the owners now and are not used during the drain:
  // their first calls meet the redirect, or the replica gone.
  auto late = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(late);
  ATTN_ASSERT_OK((*late)->ListSessions());
  auto later = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(later);
  ATTN_ASSERT_OK((*later)->ListSessions());
  EXPECT_EQ((*late)->OwnerOf(workloads[0].id), victim);
  // An idle stream keeps the draining replica (and its redirects) up until
  // it is closed.
  auto keeper = client::AttentionClient::Connect(victim);
  auto idle = keeper->OpenDecodeStream();
  ATTN_ASSERT_OK(keeper->GetServerInfo());

  // Streamed decoding goes on while the replica drains: SIGTERM half way
  // through writing a round, then rounds until it holds no session.
  const absl::Time start = absl::Now();
  int rounds = 0;
  for (bool emptied = false; rounds < kMaxRounds && !emptied; ++rounds) {
    auto stream = (*cluster)->OpenDecodeStream();
    int written = 0;
    for (const Workload& w : workloads) {
      for (int layer = 0; layer < w.spec.num_layers(); ++layer) {
        ASSERT_TRUE(stream->Write(NextStep(w, layer)));
        if (rounds == 0 && ++written == 20) {
          fleet.replica(index).Signal(SIGTERM);
        }
      }
    }
    for (Workload& w : workloads) {
      for (int layer = 0; layer < w.spec.num_layers(); ++layer) {
        auto result = stream->Read();
        ASSERT_TRUE(result.ok())
            << "round " << rounds << ": " << result.status();
        EXPECT_EQ(result->position(), w.length);
        w.out[layer] += result->output().data();
      }
      ++w.length;
    }
    ATTN_ASSERT_OK(stream->Finish());
    auto info = keeper->GetServerInfo();
    ATTN_ASSERT_OK(info);
    emptied = info->draining() && info->active_sessions() == 0;
  }
  // Every session of the drained replica now lives on one of the others
  // (the last moves show at the next call).
  StreamStep(**cluster, workloads);
  for (const Workload& w : workloads) {
    EXPECT_NE((*cluster)->OwnerOf(w.id), victim);
  }
  // A client that still thinks them there follows the redirects: a
  // BatchDecode spanning every replica.
  BatchStep(**late, workloads);
  for (const Workload& w : workloads) {
    EXPECT_NE((*late)->OwnerOf(w.id), victim);
  }
  // The replica exits 0 within its drain timeout once its last call ends.
  idle->WritesDone();
  EXPECT_TRUE(idle->Read().status().code() == absl::StatusCode::kOutOfRange);
  idle.reset();
  keeper.reset();
  ASSERT_EQ(ExitCode(fleet.replica(index)), 0) << fleet.replica(index).output();
  EXPECT_LT(absl::Now() - start, absl::Seconds(60));  // --drain_timeout
  // However slow the build: the drain ended because its calls did, none
  // cancelled at the deadline (that line is a warning otherwise).
  EXPECT_TRUE(absl::StrContains(fleet.replica(index).output(),
                                "level=info event=drain_finished"))
      << fleet.replica(index).output();
  // A client that meets the replica gone finds the sessions on the others
  // (a call that never reached the replica is sent where they are now).
  BatchStep(**later, workloads);
  StreamStep(**cluster, workloads);

  for (const Workload& w : workloads) {
    auto info = (*cluster)->GetSession(w.id);
    ATTN_ASSERT_OK(info);
    EXPECT_NE(info->owner(), victim);
    EXPECT_EQ(info->layer_lengths(0), w.length);
  }
  // Bitwise what one server gives: one-shot attention over the same keys.
  for (const Workload& w : workloads) ExpectOneShot(**cluster, w);
}

// A draining replica kept up by an idle Decode stream (which holds its
// drain), so that it answers with redirects once its sessions moved.
struct HeldDrain {
  std::unique_ptr<client::AttentionClient> keeper;
  std::unique_ptr<client::DecodeStream> idle;
  bool handed_over = false;  // it holds no session any more
  // Closes the stream: the drain ends.
  void Release() {
    idle->WritesDone();
    idle.reset();
    keeper.reset();
  }
};

// SIGTERM to replica `index` (at `address`), held up as above, then waits
// until it has handed all its sessions over.
HeldDrain DrainHandingOver(Fleet& fleet, int index,
                           const std::string& address) {
  HeldDrain held;
  held.keeper = client::AttentionClient::Connect(address);
  held.idle = held.keeper->OpenDecodeStream();
  EXPECT_TRUE(held.keeper->GetServerInfo().ok());
  fleet.replica(index).Signal(SIGTERM);
  held.handed_over = Eventually(
      [&] {
        auto info = held.keeper->GetServerInfo();
        return info.ok() && info->draining() && info->active_sessions() == 0;
      },
      absl::Seconds(60));
  return held;
}

// A stream request written before one that fails still follows its
// session when the replica it went to answers with the move's redirect:
// only what was written after the failure is left unsent.
TEST(ClusterClientTest, ARequestBeforeAFailedOneStillFollowsItsSession) {
  Fleet fleet(2, {}, /*peers=*/true);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  auto cluster = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  Workload w = NewWorkload(**cluster, 0, kPrompt + 2);
  PrefillAll(**cluster, w);
  const std::string victim = (*cluster)->OwnerOf(w.id);
  const int index = fleet.IndexOf(victim);
  ASSERT_GE(index, 0) << victim;
  // A client that knows the owner and does not probe during the drain.
  ClusterOptions options = TestClusterOptions();
  options.refresh_interval = absl::Hours(1);
  auto late = ClusterClient::Open(fleet.List(), options);
  ATTN_ASSERT_OK(late);
  ATTN_ASSERT_OK((*late)->GetSession(w.id));
  ASSERT_EQ((*late)->OwnerOf(w.id), victim);
  // The replica hands the session over and stays up to redirect.
  HeldDrain held = DrainHandingOver(fleet, index, victim);
  ASSERT_TRUE(held.handed_over);

  auto stream = (*late)->OpenDecodeStream();
  ASSERT_TRUE(stream->Write(NextStep(w, 0)));  // meets the redirect
  v1::DecodeRequest unknown = NextStep(w, 1);
  unknown.set_session_id("no-such-session");
  stream->Write(unknown);  // on no replica: fails unsent
  EXPECT_FALSE(stream->Write(NextStep(w, 1)));
  auto first = stream->Read();
  ATTN_ASSERT_OK(first);
  EXPECT_EQ(first->position(), w.length);
  EXPECT_NE((*late)->OwnerOf(w.id), victim);
  auto second = stream->Read();
  EXPECT_EQ(second.status().code(), absl::StatusCode::kNotFound)
      << second.status();
  EXPECT_TRUE(absl::StrContains(second.status().message(), "no-such-session"))
      << second.status();
  held.Release();
}

// A request that follows its moved session to a replica where a later
// request of the stream already waits goes behind it; when that one fails,
// the earlier one is reported as not applied, not with the later one's
// error (which would let the caller take it as applied).
TEST(ClusterClientTest, ARequestSentAgainBehindAFailedOneIsNotBlamedForIt) {
  Fleet fleet(2, {}, /*peers=*/true);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  auto cluster = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  Workload w = NewWorkload(**cluster, 0, kPrompt + 2);
  PrefillAll(**cluster, w);
  const std::string victim = (*cluster)->OwnerOf(w.id);
  const int index = fleet.IndexOf(victim);
  ASSERT_GE(index, 0) << victim;
  Workload other = NewWorkloadOn(fleet.address(1 - index), 2, kPrompt + 1);
  // A client that knows both owners and does not probe during the drain.
  ClusterOptions options = TestClusterOptions();
  options.refresh_interval = absl::Hours(1);
  auto late = ClusterClient::Open(fleet.List(), options);
  ATTN_ASSERT_OK(late);
  ATTN_ASSERT_OK((*late)->GetSession(w.id));
  ATTN_ASSERT_OK((*late)->GetSession(other.id));
  ASSERT_EQ((*late)->OwnerOf(w.id), victim);
  // The replica hands the session over and stays up to redirect.
  HeldDrain held = DrainHandingOver(fleet, index, victim);
  ASSERT_TRUE(held.handed_over);

  auto stream = (*late)->OpenDecodeStream();
  ASSERT_TRUE(stream->Write(NextStep(w, 0)));  // meets the redirect
  v1::DecodeRequest bad = NextStep(other, 0);  // fails where `w` moved
  bad.mutable_k()->set_dtype(v1::DTYPE_UNSPECIFIED);
  ASSERT_TRUE(stream->Write(bad));
  auto first = stream->Read();
  ATTN_EXPECT_CODE(first, absl::StatusCode::kAborted);
  EXPECT_TRUE(
      absl::StartsWith(first.status().message(), "requests[0]: not applied"))
      << first.status();
  EXPECT_TRUE(absl::StrContains(first.status().message(), "requests[1]: k"))
      << first.status();
  EXPECT_EQ(stream->Finish(), first.status());
  auto info = (*late)->GetSession(w.id);
  ATTN_ASSERT_OK(info);
  EXPECT_NE(info->owner(), victim);
  EXPECT_EQ(info->layer_lengths(0), w.length);
  held.Release();
}

// A stream's idle lane to a replica known to drain is closed at its next
// write, so the replica's drain does not wait for it (nor ends it at its
// deadline), and the stream finishes OK.
TEST(ClusterClientTest, AnIdleLaneDoesNotHoldADrainUp) {
  Fleet fleet(2, {}, /*peers=*/true);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  auto cluster = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  Workload a = NewWorkloadOn(fleet.address(0), 0, kPrompt + 4);
  Workload b = NewWorkloadOn(fleet.address(1), 1, kPrompt + 4);
  PrefillAll(**cluster, a);
  PrefillAll(**cluster, b);
  auto stream = (*cluster)->OpenDecodeStream();
  auto step = [&](Workload& w) {
    auto result = stream->Step(NextStep(w, 0));
    ATTN_ASSERT_OK(result);
    EXPECT_EQ(result->position(), w.length);
    w.out[0] += result->output().data();
    ++w.length;
  };
  step(a);  // opens the lane to replica 0
  step(b);
  fleet.replica(0).Signal(SIGTERM);
  ASSERT_TRUE(AwaitState(**cluster, fleet.address(0),
                         client::ReplicaStatus::State::kDraining));
  step(b);  // closes the idle lane to replica 0
  ASSERT_EQ(ExitCode(fleet.replica(0)), 0) << fleet.replica(0).output();
  // Its drain ended because its calls and streams did, none cancelled.
  EXPECT_TRUE(absl::StrContains(fleet.replica(0).output(),
                                "level=info event=drain_finished"))
      << fleet.replica(0).output();
  step(a);  // where the drain moved it
  ATTN_ASSERT_OK(stream->Finish());
}

// Steps on a session that stays on a replica known to drain (its turn in
// the hand-over has not come, or no peer takes it) keep using the stream
// already open there. (Its idle lane was closed before each write and a
// stream opened again: a stream per step through the drain, in-process
// here.)
TEST(ClusterClientTest, StepsOnADrainingReplicaKeepTheirStream) {
  server::ServerOptions options = TestServerOptions();
  options.drain_timeout = absl::Seconds(60);
  auto server = StartTestServer(options);
  ATTN_ASSERT_OK(server);
  const std::string address =
      absl::StrCat("127.0.0.1:", (*server)->server->port());
  auto cluster = ClusterClient::Open(address, TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  Workload w = NewWorkload(**cluster, 1, kPrompt + 12);
  PrefillAll(**cluster, w);
  const auto streams_opened = [&] {
    const std::string text = (*server)->server->metrics().TextExposition();
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      if (absl::ConsumePrefix(&line, "attention_streams_opened_total ")) {
        return std::string(line);
      }
    }
    return std::string("(absent)");
  };
  auto stream = (*cluster)->OpenDecodeStream();
  const auto step = [&] {
    auto result = stream->Step(NextStep(w, 0));
    ATTN_ASSERT_OK(result);
    EXPECT_EQ(result->position(), w.length);
    ++w.length;
  };
  step();
  // The drain waits for the open stream (no peers: the session stays).
  std::thread drain([&] { (*server)->server->Shutdown(); });
  ASSERT_TRUE(
      AwaitState(**cluster, address, client::ReplicaStatus::State::kDraining));
  for (int i = 0; i < 8; ++i) step();
  EXPECT_EQ(streams_opened(), "1");
  ATTN_EXPECT_OK(stream->Finish());
  drain.join();
}

// A stream's idle lane to a replica whose drain ran out of time for calls
// (this client did not probe it meanwhile, so never closed the lane): the
// replica ends the lane's stream saying nothing sent after its last reply
// was applied, and exits. The stream's next request for a session that was
// there goes where the drain moved it, unasked.
TEST(ClusterClientTest, AStreamEndedByADrainsDeadlineCarriesOnElsewhere) {
  Fleet fleet(2, {"--drain_timeout=3s"}, /*peers=*/true);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  ClusterOptions options = TestClusterOptions();
  options.refresh_interval = absl::Hours(1);
  auto cluster = ClusterClient::Open(fleet.List(), options);
  ATTN_ASSERT_OK(cluster);
  Workload a = NewWorkloadOn(fleet.address(0), 0, kPrompt + 4);
  Workload b = NewWorkloadOn(fleet.address(1), 1, kPrompt + 4);
  PrefillAll(**cluster, a);
  PrefillAll(**cluster, b);
  auto stream = (*cluster)->OpenDecodeStream();
  auto step = [&](Workload& w) {
    for (int layer = 0; layer < w.spec.num_layers(); ++layer) {
      auto result = stream->Step(NextStep(w, layer));
      ATTN_ASSERT_OK(result);
      EXPECT_EQ(result->position(), w.length);
      w.out[layer] += result->output().data();
    }
    ++w.length;
  };
  step(a);  // opens the lane to replica 0, idle from now on
  step(b);
  fleet.replica(0).Signal(SIGTERM);
  ASSERT_EQ(ExitCode(fleet.replica(0)), 0) << fleet.replica(0).output();
  // The lane's stream ended before the deadline's cancel: the drain
  // finished with no call cancelled.
  EXPECT_TRUE(absl::StrContains(fleet.replica(0).output(),
                                "level=info event=drain_finished"))
      << fleet.replica(0).output();
  step(a);
  step(b);
  ATTN_ASSERT_OK(stream->Finish());
  EXPECT_EQ((*cluster)->OwnerOf(a.id), fleet.address(1));
  ExpectOneShot(**cluster, a);
  ExpectOneShot(**cluster, b);
}

TEST(ClusterClientTest, AKilledReplicasSessionsReportItOthersCarryOn) {
  Fleet fleet(3);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  auto cluster = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  std::vector<Workload> workloads;
  for (int i = 0; i < 12; ++i) {
    workloads.push_back(NewWorkload(**cluster, i, kPrompt + 3));
    PrefillAll(**cluster, workloads.back());
  }
  const std::string victim = (*cluster)->OwnerOf(workloads[0].id);
  const int index = fleet.IndexOf(victim);
  ASSERT_GE(index, 0) << victim;
  fleet.replica(index).Signal(SIGKILL);
  EXPECT_EQ(ExitCode(fleet.replica(index)), -1);

  int lost = 0;
  std::vector<Workload> survivors;
  for (Workload& w : workloads) {
    if ((*cluster)->OwnerOf(w.id) != victim) {
      survivors.push_back(w);
      continue;
    }
    ++lost;
    // An append: UNAVAILABLE naming the replica, never re-sent elsewhere.
    auto step = (*cluster)->DecodeStep(NextStep(w, 0));
    EXPECT_EQ(step.status().code(), absl::StatusCode::kUnavailable)
        << step.status();
    EXPECT_TRUE(absl::StrContains(step.status().message(), victim))
        << step.status();
    auto info = (*cluster)->GetSession(w.id);
    EXPECT_EQ(info.status().code(), absl::StatusCode::kUnavailable);
    EXPECT_TRUE(absl::StrContains(info.status().message(), victim))
        << info.status();
  }
  EXPECT_GT(lost, 0);
  // A client that never knew the owner finds the session on no replica
  // that answered: UNAVAILABLE naming the one that did not (the session may
  // be there), not NOT_FOUND.
  auto fresh = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(fresh);
  auto unknown = (*fresh)->GetSession(workloads[0].id);
  EXPECT_EQ(unknown.status().code(), absl::StatusCode::kUnavailable)
      << unknown.status();
  EXPECT_TRUE(absl::StrContains(unknown.status().message(), victim))
      << unknown.status();
  // The other replicas' sessions carry on, bitwise.
  StreamStep(**cluster, survivors);
  for (const Workload& w : survivors) ExpectOneShot(**cluster, w);
  // New sessions avoid the dead replica.
  (*cluster)->Refresh();
  for (int i = 0; i < 6; ++i) {
    auto info = (*cluster)->CreateSession(MixedSpec(i));
    ATTN_ASSERT_OK(info);
    EXPECT_NE((*cluster)->OwnerOf(info->session_id()), victim);
  }

  // A replacement on the same address comes up empty: the lost sessions
  // are NOT_FOUND naming the replica, and nothing is recreated.
  ASSERT_TRUE(fleet.Start(index));
  ASSERT_TRUE(
      AwaitState(**cluster, victim, client::ReplicaStatus::State::kServing));
  for (const Workload& w : workloads) {
    if ((*cluster)->OwnerOf(w.id) != victim) continue;
    auto step = (*cluster)->DecodeStep(NextStep(w, 0));
    EXPECT_EQ(step.status().code(), absl::StatusCode::kNotFound)
        << step.status();
    EXPECT_TRUE(absl::StrContains(step.status().message(), victim))
        << step.status();
    EXPECT_TRUE(absl::StrContains(step.status().message(), "not recreated"))
        << step.status();
  }
  auto direct = client::AttentionClient::Connect(victim);
  auto listed = direct->ListSessions();
  ATTN_ASSERT_OK(listed);
  EXPECT_TRUE(listed->empty());
}

TEST(ClusterClientTest, AReplicaRestartedFromItsSnapshotDirCarriesOn) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/fleet-snap-", getpid());
  std::filesystem::create_directories(dir);
  // Replica 1 keeps its sessions in a snapshot directory.
  Fleet fleet(2);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  fleet.AddFlags(1, {"--snapshot_dir=" + dir});
  ASSERT_TRUE(fleet.Start(1));
  auto cluster = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  const std::string restarted = fleet.address(1);
  // Sessions on both replicas (placement ties spread them at random).
  std::vector<Workload> workloads;
  int on_restarted = 0;
  for (int i = 0; i < 40 && (i < 8 || on_restarted < 2 || i - on_restarted < 2);
       ++i) {
    workloads.push_back(NewWorkload(**cluster, i, kPrompt + 3));
    PrefillAll(**cluster, workloads.back());
    on_restarted += (*cluster)->OwnerOf(workloads.back().id) == restarted;
  }
  ASSERT_GE(on_restarted, 2);
  // Replica 1 restarts alone (the other keeps serving): without peers to
  // take its sessions it writes them to its snapshot directory.
  fleet.replica(1).Signal(SIGTERM);
  EXPECT_EQ(ExitCode(fleet.replica(1)), 0) << fleet.replica(1).output();
  ASSERT_TRUE(fleet.Start(1));
  ASSERT_TRUE(
      AwaitState(**cluster, restarted, client::ReplicaStatus::State::kServing));
  auto direct = client::AttentionClient::Connect(restarted);
  auto restored = direct->ListSessions();
  ATTN_ASSERT_OK(restored);
  EXPECT_EQ(static_cast<int>(restored->size()), on_restarted);
  StreamStep(**cluster, workloads);
  for (const Workload& w : workloads) ExpectOneShot(**cluster, w);
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

// A pod restarted under a new address (its sessions restored from its
// snapshot directory, its advertise name the same) is found under that
// name although the old address's entry, unreachable, is not forgotten
// yet: calls on its sessions went to the dead address (UNAVAILABLE) until
// then.
TEST(ClusterClientTest, AReplicaBackUnderANewAddressIsFoundByItsName) {
  const std::string dir =
      absl::StrCat(::testing::TempDir(), "/fleet-moved-", getpid());
  std::filesystem::create_directories(dir);
  Fleet fleet(2);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  // The old address sorts first among the entries of the name.
  const int old_index = fleet.address(0) < fleet.address(1) ? 0 : 1;
  const int new_index = 1 - old_index;
  for (int i : {0, 1}) {
    fleet.replica(i).Signal(SIGTERM);
    ASSERT_EQ(ExitCode(fleet.replica(i)), 0);
    fleet.AddFlags(
        i, {"--snapshot_dir=" + dir, "--advertise_address=pod-0.test:1"});
  }
  ASSERT_TRUE(fleet.Start(old_index));
  Members members({fleet.address(old_index)});
  ClusterOptions options = TestClusterOptions();
  options.resolver = members.Resolver();
  auto cluster = ClusterClient::Open("membership-from-resolver:1", options);
  ATTN_ASSERT_OK(cluster);
  ATTN_ASSERT_OK((*cluster)->ListSessions());
  Workload w = NewWorkload(**cluster, 0, kPrompt + 3);
  PrefillAll(**cluster, w);
  ASSERT_EQ((*cluster)->OwnerOf(w.id), "pod-0.test:1");

  fleet.replica(old_index).Signal(SIGTERM);
  ASSERT_EQ(ExitCode(fleet.replica(old_index)), 0);
  ASSERT_TRUE(fleet.Start(new_index));
  members.Set({fleet.address(new_index)});
  // Both entries carry the name (the old one from its last answer).
  const auto state_of = [&](int i) {
    for (const client::ReplicaStatus& replica : (*cluster)->Replicas()) {
      if (replica.dialed == fleet.address(i)) return replica.state;
    }
    return client::ReplicaStatus::State::kNotServing;
  };
  ASSERT_TRUE(Eventually(
      [&] {
        (*cluster)->Refresh();
        return state_of(old_index) ==
                   client::ReplicaStatus::State::kUnreachable &&
               state_of(new_index) == client::ReplicaStatus::State::kServing;
      },
      absl::Seconds(10)));
  auto info = (*cluster)->GetSession(w.id);
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), kPrompt);
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

TEST(ClusterClientTest, AFourthReplicaTakesNewSessionsWithoutDisturbing) {
  Fleet fleet(3);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  absl::Mutex mu;
  std::vector<std::string> members = {fleet.address(0), fleet.address(1),
                                      fleet.address(2)};
  ClusterOptions options = TestClusterOptions();
  options.placement_tie_fraction = 0;  // strictly the most free KV
  options.resolver = [&]() -> absl::StatusOr<std::vector<std::string>> {
    absl::MutexLock lock(&mu);
    return members;
  };
  auto cluster = ClusterClient::Open("membership-from-resolver:1", options);
  ATTN_ASSERT_OK(cluster);
  // Each new session goes to the replica with the most free KV: after each
  // prefill (and a refresh), an empty one.
  std::vector<Workload> workloads;
  std::set<std::string> owners;
  for (int i = 0; i < 3; ++i) {
    workloads.push_back(NewWorkload(**cluster, i, kPrompt + 2));
    PrefillAll(**cluster, workloads.back());
    owners.insert((*cluster)->OwnerOf(workloads.back().id));
    (*cluster)->Refresh();
  }
  EXPECT_EQ(owners.size(), 3u);

  const int fourth = fleet.Add();
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  {
    absl::MutexLock lock(&mu);
    members.push_back(fleet.address(fourth));
  }
  (*cluster)->Refresh();
  Workload joined = NewWorkload(**cluster, 3, kPrompt + 2);
  EXPECT_EQ((*cluster)->OwnerOf(joined.id), fleet.address(fourth));
  PrefillAll(**cluster, joined);
  workloads.push_back(joined);
  // The existing sessions stayed where they were and decode on.
  for (int i = 0; i < 3; ++i) {
    EXPECT_NE((*cluster)->OwnerOf(workloads[i].id), fleet.address(fourth));
  }
  StreamStep(**cluster, workloads);
  for (const Workload& w : workloads) ExpectOneShot(**cluster, w);
  bool listed = false;
  for (const client::ReplicaStatus& replica : (*cluster)->Replicas()) {
    if (replica.address == fleet.address(fourth)) {
      listed = replica.listed &&
               replica.state == client::ReplicaStatus::State::kServing;
    }
  }
  EXPECT_TRUE(listed);
}

// A stream request that fails - here one that cannot be routed - ends
// the stream: nothing written after it is sent, as with DecodeStream.
TEST(ClusterClientTest, AFailedStreamRequestStopsTheOnesAfterIt) {
  Fleet fleet(1);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  auto cluster = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  Workload w = NewWorkload(**cluster, 0, kPrompt + 3);
  PrefillAll(**cluster, w);
  auto stream = (*cluster)->OpenDecodeStream();
  v1::DecodeRequest unknown = NextStep(w, 0);
  unknown.set_session_id("no-such-session");
  EXPECT_TRUE(stream->Write(unknown));
  EXPECT_FALSE(stream->Write(NextStep(w, 0)));
  EXPECT_EQ(stream->Read().status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(stream->Finish().code(), absl::StatusCode::kNotFound);
  auto info = (*cluster)->GetSession(w.id);
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), w.length);
}

// A BatchDecode split by replica: a part's error names the step as the
// caller's request counts it, not as the part sent to its replica does.
TEST(ClusterClientTest, ASplitBatchDecodeErrorNamesTheCallersStep) {
  Fleet fleet(2);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  auto cluster = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  Workload a = NewWorkloadOn(fleet.address(0), 0, kPrompt + 1);
  Workload b = NewWorkloadOn(fleet.address(1), 1, kPrompt + 1);
  v1::BatchDecodeRequest batch;
  *batch.add_steps() = NextStep(a, 0);
  *batch.add_steps() = NextStep(b, 0);
  v1::DecodeRequest bad = NextStep(a, 1);
  bad.mutable_k()->set_dtype(v1::DTYPE_UNSPECIFIED);
  *batch.add_steps() = bad;
  auto results = (*cluster)->BatchDecode(batch);
  ATTN_EXPECT_CODE(results, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(results.status().message(), "steps[2].k"))
      << results.status();
  EXPECT_FALSE(absl::StrContains(results.status().message(), "steps[1]"))
      << results.status();
}

// The same for a Decode stream split over replicas: its error names the
// request as the caller wrote it, not as the replica's lane counted it.
TEST(ClusterClientTest, ASplitStreamErrorNamesTheCallersRequest) {
  Fleet fleet(2);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  auto cluster = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  Workload a = NewWorkloadOn(fleet.address(0), 0, kPrompt + 1);
  Workload b = NewWorkloadOn(fleet.address(1), 1, kPrompt + 1);
  auto stream = (*cluster)->OpenDecodeStream();
  ASSERT_TRUE(stream->Write(NextStep(a, 0)));
  ASSERT_TRUE(stream->Write(NextStep(b, 0)));
  v1::DecodeRequest bad = NextStep(b, 0);
  bad.mutable_k()->set_dtype(v1::DTYPE_UNSPECIFIED);
  ASSERT_TRUE(stream->Write(bad));
  ATTN_EXPECT_OK(stream->Read());
  ATTN_EXPECT_OK(stream->Read());
  auto failed = stream->Read();
  ATTN_EXPECT_CODE(failed, absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StartsWith(failed.status().message(), "requests[2]: "))
      << failed.status();
  EXPECT_EQ(stream->Finish(), failed.status());

  // Also when the client's look-up after the replica's error gives the
  // status: `a`, known at replica 0, is gone from every replica.
  ATTN_ASSERT_OK((*cluster)->GetSession(a.id));
  ATTN_ASSERT_OK(
      client::AttentionClient::Connect(fleet.address(0))->DeleteSession(a.id));
  auto again = (*cluster)->OpenDecodeStream();
  ASSERT_TRUE(again->Write(NextStep(b, 0)));
  ASSERT_TRUE(again->Write(NextStep(a, 0)));
  ATTN_EXPECT_OK(again->Read());
  auto gone = again->Read();
  ATTN_EXPECT_CODE(gone, absl::StatusCode::kNotFound);
  EXPECT_TRUE(absl::StartsWith(gone.status().message(), "requests[1]: "))
      << gone.status();
  EXPECT_FALSE(absl::StrContains(gone.status().message(), "requests[0]"))
      << gone.status();
}

// A replica that does not answer (a partition) may hold sessions: the
// listing says so instead of leaving them out.
TEST(ClusterClientTest, ListingWithAnUnreachableReplicaIsUnavailable) {
  Fleet fleet(2);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  auto cluster = ClusterClient::Open(fleet.List(), TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  for (int i = 0; i < 4; ++i) NewWorkload(**cluster, i, 1);
  auto listed = (*cluster)->ListSessions();
  ATTN_ASSERT_OK(listed);
  EXPECT_EQ(listed->size(), 4u);
  ASSERT_TRUE(fleet.replica(1).Freeze());
  ASSERT_TRUE(AwaitState(**cluster, fleet.address(1),
                         client::ReplicaStatus::State::kUnreachable));
  listed = (*cluster)->ListSessions();
  EXPECT_EQ(listed.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(listed.status().message(), fleet.address(1)))
      << listed.status();
  fleet.replica(1).Signal(SIGCONT);
  ASSERT_TRUE(AwaitState(**cluster, fleet.address(1),
                         client::ReplicaStatus::State::kServing));
  listed = (*cluster)->ListSessions();
  ATTN_ASSERT_OK(listed);
  EXPECT_EQ(listed->size(), 4u);
}

// A step written while the client still routes its session to the old
// owner, and a later one written once it knows the new owner, reach the
// session in the order written.
TEST(ClusterClientTest, StepsOfAMovingSessionKeepTheirOrder) {
  Fleet fleet(2, {}, /*peers=*/true);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  ClusterOptions options = TestClusterOptions();
  options.refresh_interval = absl::Hours(1);  // learns of moves by calls
  auto cluster = ClusterClient::Open(fleet.List(), options);
  ATTN_ASSERT_OK(cluster);
  Workload w = NewWorkload(**cluster, 1, kPrompt + 3);
  PrefillAll(**cluster, w);
  const std::string old_owner = (*cluster)->OwnerOf(w.id);
  const int index = fleet.IndexOf(old_owner);
  ASSERT_GE(index, 0) << old_owner;
  const std::string new_owner = fleet.address(1 - index);
  // An idle stream keeps the draining replica (and its redirects) up.
  auto keeper = client::AttentionClient::Connect(old_owner);
  auto idle = keeper->OpenDecodeStream();
  ATTN_ASSERT_OK(keeper->GetServerInfo());
  fleet.replica(index).Signal(SIGTERM);
  auto direct = client::AttentionClient::Connect(new_owner);
  ASSERT_TRUE(Eventually([&] { return direct->GetSession(w.id).ok(); },
                         absl::Seconds(20)));

  auto stream = (*cluster)->OpenDecodeStream();
  ASSERT_TRUE(stream->Write(NextStep(w, 0)));    // routed to the old owner
  ATTN_ASSERT_OK((*cluster)->GetSession(w.id));  // learns the new one
  EXPECT_EQ((*cluster)->OwnerOf(w.id), new_owner);
  v1::DecodeRequest second =
      AppendRequest<v1::DecodeRequest>(w, 0, w.length + 1, 1);
  ASSERT_TRUE(stream->Write(second));
  for (int64_t position : {w.length, w.length + 1}) {
    auto result = stream->Read();
    ATTN_ASSERT_OK(result);
    EXPECT_EQ(result->position(), position);
  }
  ATTN_EXPECT_OK(stream->Finish());
  idle->WritesDone();
  idle->Finish().IgnoreError();
}

// A decode step that meets its session sealed for a move answers
// UNAVAILABLE with attention-session-moving and changes nothing; the client
// waits for the move's end and sends it again, through DecodeStep and
// BatchDecode alike, so the caller sees no error. (Here the move fails: the
// seal goes and the session stays on its replica, in-process.)
TEST(ClusterClientTest, StepsThatMeetAMoveInProgressAreSentAgain) {
  auto server = StartTestServer();
  ATTN_ASSERT_OK(server);
  auto cluster =
      ClusterClient::Open(absl::StrCat("127.0.0.1:", (*server)->server->port()),
                          TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  Workload w = NewWorkload(**cluster, 1, 4);  // one layer
  const auto moving_answers = [&](const std::string& method) {
    const std::string text = (*server)->server->metrics().TextExposition();
    for (absl::string_view line : absl::StrSplit(text, '\n')) {
      if (absl::StartsWith(line, "attention_requests_total{") &&
          absl::StrContains(line, "method=\"" + method + "\"") &&
          absl::StrContains(line, "code=\"UNAVAILABLE\"")) {
        return !absl::EndsWith(line, " 0");
      }
    }
    return false;
  };
  for (const std::string method : {"DecodeStep", "BatchDecode"}) {
    auto seal = (*server)->server->engine().SealSession(
        w.id, absl::Now() + absl::Seconds(30));
    ATTN_ASSERT_OK(seal);
    absl::StatusOr<int64_t> position = absl::UnknownError("not run");
    std::thread caller([&] {
      if (method == "DecodeStep") {
        auto result = (*cluster)->DecodeStep(NextStep(w, 0));
        position = result.ok() ? absl::StatusOr<int64_t>(result->position())
                               : result.status();
      } else {
        v1::BatchDecodeRequest batch;
        *batch.add_steps() = NextStep(w, 0);
        auto results = (*cluster)->BatchDecode(batch);
        position = results.ok()
                       ? absl::StatusOr<int64_t>(results->at(0).position())
                       : results.status();
      }
    });
    // Once the step has met the seal, the move fails.
    EXPECT_TRUE(
        Eventually([&] { return moving_answers(method); }, absl::Seconds(20)))
        << method;
    seal = absl::UnavailableError("the move failed");
    caller.join();
    ASSERT_TRUE(position.ok()) << method << ": " << position.status();
    EXPECT_EQ(*position, w.length) << method;
    ++w.length;
  }
}

// A refresh interval or probe timeout that is not positive is refused
// (zero would probe every replica without a pause, or fail every probe).
TEST(ClusterClientTest, NonPositiveRefreshOrProbeTimesAreRefused) {
  // And a negative move_wait.
  ClusterOptions options = TestClusterOptions();
  options.move_wait = -absl::Seconds(1);
  ATTN_EXPECT_CODE(ClusterClient::Open("127.0.0.1:2", options),
                   absl::StatusCode::kInvalidArgument);
  options = TestClusterOptions();
  options.refresh_interval = absl::ZeroDuration();
  ATTN_EXPECT_CODE(ClusterClient::Open("127.0.0.1:2", options),
                   absl::StatusCode::kInvalidArgument);
  options = TestClusterOptions();
  options.probe_timeout = absl::Seconds(-1);
  ATTN_EXPECT_CODE(ClusterClient::Open("127.0.0.1:2", options),
                   absl::StatusCode::kInvalidArgument);
}

TEST(ClusterClientTest, NoReplicaServingIsUnavailableNamingThem) {
  // Ports nothing listens on (a freed port may be taken meanwhile).
  const std::string nowhere = "127.0.0.1:2";
  auto cluster =
      ClusterClient::Open(nowhere + ",127.0.0.1:1", TestClusterOptions());
  ATTN_ASSERT_OK(cluster);
  auto info = (*cluster)->CreateSession(MixedSpec(0));
  EXPECT_EQ(info.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(info.status().message(), nowhere))
      << info.status();
  EXPECT_TRUE(absl::StrContains(info.status().message(), "127.0.0.1:1"))
      << info.status();
  ATTN_EXPECT_CODE(ClusterClient::Open("no-port"),
                   absl::StatusCode::kInvalidArgument);
}

// A CreateSession whose reply the client cannot take (over its receive
// limit) may have created the session: the cluster client fails the call
// naming the replica instead of creating the session again on the next.
TEST(ClusterClientTest, ACreationInDoubtIsNotRepeatedOnAnotherReplica) {
  Fleet fleet(2);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  // Many layers make the session's SessionInfo larger than a ServerInfo.
  const v1::SessionSpec spec = MakeSpec(256, 2, 1, 8);
  auto plain = client::AttentionClient::Connect(fleet.address(0));
  auto server_info = plain->GetServerInfo();
  ATTN_ASSERT_OK(server_info);
  auto session_info = plain->CreateSession(spec);
  ATTN_ASSERT_OK(session_info);
  ATTN_ASSERT_OK(plain->DeleteSession(session_info->session_id()));
  const int64_t server_info_bytes = server_info->ByteSizeLong();
  const int64_t session_info_bytes = session_info->ByteSizeLong();
  ASSERT_GT(session_info_bytes, server_info_bytes + 64);
  ClusterOptions options = TestClusterOptions();
  options.client.max_receive_message_bytes =
      (server_info_bytes + session_info_bytes) / 2;
  auto cluster = ClusterClient::Open(fleet.List(), options);
  ATTN_ASSERT_OK(cluster);
  auto info = (*cluster)->CreateSession(spec);
  ASSERT_EQ(info.status().code(), absl::StatusCode::kResourceExhausted)
      << info.status();
  EXPECT_TRUE(absl::StrContains(info.status().message(),
                                "may have created the session"))
      << info.status();
  // One replica holds the session, the other none.
  int64_t sessions = 0;
  for (int i = 0; i < fleet.size(); ++i) {
    auto replica_info =
        client::AttentionClient::Connect(fleet.address(i))->GetServerInfo();
    ATTN_ASSERT_OK(replica_info);
    sessions += replica_info->active_sessions();
  }
  EXPECT_EQ(sessions, 1);
  // A session whose SessionInfo fits the limit is created as before.
  ATTN_EXPECT_OK((*cluster)->CreateSession(MakeSpec(1, 2, 1, 8)));
}

// Creates a session on replica 0 directly and opens a ClusterClient that
// has found it there: its id, or empty (with a failure added).
std::string FoundOnTheFirstReplica(Fleet& fleet,
                                   std::unique_ptr<ClusterClient>* cluster) {
  auto session = client::AttentionClient::Connect(fleet.address(0))
                     ->CreateSession(MakeSpec(1, 2, 1, 8));
  auto opened = ClusterClient::Open(fleet.List(), TestClusterOptions());
  if (!session.ok() || !opened.ok()) {
    ADD_FAILURE() << session.status() << "; " << opened.status();
    return "";
  }
  *cluster = *std::move(opened);
  const absl::Status found = (*cluster)->GetSession(session->session_id()).status();
  if (!found.ok() ||
      (*cluster)->OwnerOf(session->session_id()) != fleet.address(0)) {
    ADD_FAILURE() << "not found on replica 0: " << found;
    return "";
  }
  return session->session_id();
}

// A replica's own UNAVAILABLE refusal ("the server is overloaded", or
// draining) applied nothing: when the session turns out to be on another
// replica, the call goes there, instead of failing as one that "may or may
// not have been applied".
TEST(ClusterClientTest, ACallTheReplicaRefusedGoesWhereTheSessionIs) {
  Fleet fleet(2);
  fleet.AddFlags(0, {"--max_rpc_threads=16", "--transfer_stall_timeout=60s"});
  ASSERT_TRUE(fleet.Start(0)) << fleet.replica(0).output();
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  auto first = client::AttentionClient::Connect(fleet.address(0));
  auto second = client::AttentionClient::Connect(fleet.address(1));
  std::unique_ptr<ClusterClient> cluster;
  const std::string id = FoundOnTheFirstReplica(fleet, &cluster);
  ASSERT_FALSE(id.empty());

  // The session moves to the second replica behind the cluster's back.
  std::vector<v1::SessionChunk> records;
  ATTN_ASSERT_OK(first->ExportSession(id, [&](const v1::SessionChunk& record) {
    records.push_back(record);
    return absl::OkStatus();
  }));
  size_t next = 0;
  ATTN_ASSERT_OK(second->ImportSession(
      [&](v1::SessionChunk* record) -> absl::StatusOr<bool> {
        if (next == records.size()) return false;
        *record = records[next++];
        return true;
      },
      /*keep_session_id=*/true));
  ATTN_ASSERT_OK(first->DeleteSession(id));

  // Imports that send nothing hold every synchronous thread of the first
  // replica, which then refuses ForkSession and GetSession as overloaded.
  std::vector<std::unique_ptr<grpc::ClientContext>> contexts;
  std::vector<std::unique_ptr<grpc::ClientWriter<v1::SessionChunk>>> stalled;
  v1::SessionInfo unused;
  absl::Status refusal;
  for (int i = 0; i < 64 && refusal.ok(); ++i) {
    contexts.push_back(std::make_unique<grpc::ClientContext>());
    stalled.push_back(
        first->stub()->ImportSession(contexts.back().get(), &unused));
    refusal = first->GetSession(id).status();
    if (refusal.code() == absl::StatusCode::kNotFound) refusal = {};
  }
  ASSERT_EQ(refusal.code(), absl::StatusCode::kUnavailable) << refusal;
  ASSERT_TRUE(absl::StartsWith(refusal.message(), "the server is overloaded"))
      << refusal;

  auto fork = cluster->ForkSession(id);
  ATTN_ASSERT_OK(fork);
  EXPECT_EQ(cluster->OwnerOf(id), fleet.address(1));
  ATTN_EXPECT_OK(second->GetSession(fork->session_id()));
  for (auto& context : contexts) context->TryCancel();
  for (auto& writer : stalled) (void)writer->Finish();
}

// A fork that the session's draining replica refused (it takes no new
// sessions) before its drain moved the session waits for the move and is
// made at the session's new replica. Here the drain cannot move it until
// its only peer, paused, answers again.
TEST(ClusterClientTest, AForkADrainRefusedIsMadeWhereTheSessionMoves) {
  Fleet fleet(2, {}, /*peers=*/true);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  auto first = client::AttentionClient::Connect(fleet.address(0));
  std::unique_ptr<ClusterClient> cluster;
  const std::string id = FoundOnTheFirstReplica(fleet, &cluster);
  ASSERT_FALSE(id.empty());

  ASSERT_TRUE(fleet.replica(1).Freeze());
  fleet.replica(0).Signal(SIGTERM);
  absl::StatusOr<client::ServingStatus> health;
  for (int i = 0; i < 500; ++i) {
    health = first->CheckHealth();
    if (health.ok() && *health == client::ServingStatus::kNotServing) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(health.ok() && *health == client::ServingStatus::kNotServing);
  // Draining, and still holding the session: its peer does not answer.
  const absl::Status refused = first->ForkSession(id).status();
  ASSERT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  ATTN_ASSERT_OK(first->GetSession(id));
  std::thread resume([&] {
    absl::SleepFor(absl::Milliseconds(1500));
    fleet.replica(1).Signal(SIGCONT);
  });
  auto fork = cluster->ForkSession(id);
  resume.join();
  ATTN_ASSERT_OK(fork);
  EXPECT_EQ(cluster->OwnerOf(id), fleet.address(1));
  auto second = client::AttentionClient::Connect(fleet.address(1));
  ATTN_EXPECT_OK(second->GetSession(id));
  ATTN_EXPECT_OK(second->GetSession(fork->session_id()));
}

// A replica the membership no longer lists is kept while it answers, and
// forgotten once unreachable for forget_unreachable_after; a listed one
// never is. A stream still using the forgotten replica carries on, and a
// remembered owner at its address dials it again.
TEST(ClusterClientTest, AnUnlistedReplicaUnreachableForLongIsForgotten) {
  Fleet fleet(3);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  Members members({fleet.address(0), fleet.address(1), fleet.address(2)});
  FakeClock clock;
  ClusterOptions options = TestClusterOptions();
  options.refresh_interval = absl::Hours(1);  // refreshed by the test
  options.forget_unreachable_after = absl::Seconds(60);
  options.now = [&clock] { return clock.Now(); };
  options.resolver = members.Resolver();
  auto cluster = ClusterClient::Open("membership-from-resolver:1", options);
  ATTN_ASSERT_OK(cluster);
  // A session on replica 2, its owner learned from the listing.
  const std::string gone = fleet.address(2);
  Workload w = NewWorkloadOn(gone, 0, kPrompt + 3);
  ATTN_ASSERT_OK((*cluster)->ListSessions());
  EXPECT_EQ((*cluster)->OwnerOf(w.id), gone);
  PrefillAll(**cluster, w);

  // Replica 2 leaves the membership but answers: kept, however long.
  members.Set({fleet.address(0), fleet.address(1)});
  (*cluster)->Refresh();
  clock.Advance(absl::Hours(1));
  (*cluster)->Refresh();
  std::optional<client::ReplicaStatus> kept = ReplicaNamed(**cluster, gone);
  ASSERT_TRUE(kept.has_value());
  EXPECT_FALSE(kept->listed);

  // A stream with a step for the session that it has not read yet.
  auto stream = (*cluster)->OpenDecodeStream();
  ASSERT_TRUE(stream->Write(NextStep(w, 0)));

  // Replica 1 (listed) is killed, replica 2 (unlisted) stops answering.
  fleet.replica(1).Signal(SIGKILL);
  EXPECT_EQ(ExitCode(fleet.replica(1)), -1);
  ASSERT_TRUE(fleet.replica(2).Freeze());
  ASSERT_TRUE(AwaitState(**cluster, fleet.address(1),
                         client::ReplicaStatus::State::kUnreachable));
  ASSERT_TRUE(
      AwaitState(**cluster, gone, client::ReplicaStatus::State::kUnreachable));
  clock.Advance(absl::Seconds(30));
  (*cluster)->Refresh();
  EXPECT_TRUE(ReplicaNamed(**cluster, gone).has_value());
  clock.Advance(absl::Seconds(31));
  (*cluster)->Refresh();
  EXPECT_FALSE(ReplicaNamed(**cluster, gone).has_value());
  std::optional<client::ReplicaStatus> listed =
      ReplicaNamed(**cluster, fleet.address(1));
  ASSERT_TRUE(listed.has_value());
  EXPECT_TRUE(listed->listed);
  EXPECT_EQ(listed->state, client::ReplicaStatus::State::kUnreachable);

  fleet.replica(2).Signal(SIGCONT);
  // The stream's lane at replica 2 outlives the replica's entry: the next
  // step of the session follows the one waiting there, in order.
  ASSERT_TRUE(
      stream->Write(AppendRequest<v1::DecodeRequest>(w, 0, w.length + 1, 1)));
  for (int64_t position : {w.length, w.length + 1}) {
    auto result = stream->Read();
    ATTN_ASSERT_OK(result);
    EXPECT_EQ(result->position(), position);
  }
  ATTN_EXPECT_OK(stream->Finish());

  // Look-ups no longer ask the forgotten replica (only the dead listed one
  // is named as a replica that may hold the session)...
  Workload unknown = NewWorkloadOn(gone, 1, kPrompt + 1);
  auto not_asked = (*cluster)->GetSession(unknown.id);
  ATTN_EXPECT_CODE(not_asked, absl::StatusCode::kUnavailable);
  EXPECT_TRUE(absl::StrContains(not_asked.status().message(),
                                "replicas " + fleet.address(1) + " did not"))
      << not_asked.status();
  EXPECT_FALSE(absl::StrContains(not_asked.status().message(), gone))
      << not_asked.status();
  // ...until a remembered owner names it: dialed again.
  auto info = (*cluster)->GetSession(w.id);
  ATTN_ASSERT_OK(info);
  EXPECT_EQ(info->layer_lengths(0), w.length + 2);
  EXPECT_TRUE(ReplicaNamed(**cluster, gone).has_value());
  ATTN_EXPECT_OK((*cluster)->GetSession(unknown.id));
}

// A session the client has not seen is found on its replica while two
// unlisted replicas not yet forgotten do not answer (each look-up there
// waits for its deadline; they are asked at once, not in turn).
TEST(ClusterClientTest, ALookUpPastUnreachableReplicasFindsTheOwner) {
  Fleet fleet(3);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  // The owner is the last in address order: every other is asked first.
  int owner = 0;
  for (int i = 1; i < fleet.size(); ++i) {
    if (fleet.address(i) > fleet.address(owner)) owner = i;
  }
  Members members({fleet.address(0), fleet.address(1), fleet.address(2)});
  ClusterOptions options = TestClusterOptions();
  options.refresh_interval = absl::Hours(1);  // refreshed by the test
  options.forget_unreachable_after = absl::Hours(1);
  options.resolver = members.Resolver();
  auto cluster = ClusterClient::Open("membership-from-resolver:1", options);
  ATTN_ASSERT_OK(cluster);
  for (int i = 0; i < fleet.size(); ++i) {
    if (i != owner) {
      ASSERT_TRUE(fleet.replica(i).Freeze());
    }
  }
  members.Set({fleet.address(owner)});
  (*cluster)->Refresh();
  ASSERT_EQ((*cluster)->Replicas().size(), 3u);

  std::vector<Workload> workloads;
  for (int i = 0; i < 2; ++i) {
    workloads.push_back(NewWorkloadOn(fleet.address(owner), i, kPrompt + 2));
    EXPECT_EQ((*cluster)->OwnerOf(workloads.back().id), "");
  }
  PrefillAll(**cluster, workloads[0]);
  EXPECT_EQ((*cluster)->OwnerOf(workloads[0].id), fleet.address(owner));
  auto info = (*cluster)->GetSession(workloads[1].id);
  ATTN_ASSERT_OK(info);
  EXPECT_EQ((*cluster)->OwnerOf(workloads[1].id), fleet.address(owner));
  PrefillAll(**cluster, workloads[1]);
  StreamStep(**cluster, workloads);
  for (const Workload& w : workloads) ExpectOneShot(**cluster, w);
  // Not on the replica that answers: it may be on those that do not.
  auto unknown = (*cluster)->GetSession("no-such-session");
  ATTN_EXPECT_CODE(unknown, absl::StatusCode::kUnavailable);
  for (int i = 0; i < fleet.size(); ++i) {
    if (i == owner) continue;
    EXPECT_TRUE(absl::StrContains(unknown.status().message(), fleet.address(i)))
        << unknown.status();
    fleet.replica(i).Signal(SIGCONT);
  }
}

// At most max_known_owners owners are remembered, the least recently used
// forgotten first; a forgotten one is looked up again at its next use.
TEST(ClusterClientTest, OwnersPastTheBoundAreForgottenAndFoundAgain) {
  Fleet fleet(2);
  ASSERT_TRUE(fleet.ok()) << fleet.errors();
  ClusterOptions options = TestClusterOptions();
  options.max_known_owners = 2;
  auto cluster = ClusterClient::Open(fleet.List(), options);
  ATTN_ASSERT_OK(cluster);
  Workload a = NewWorkload(**cluster, 0, kPrompt + 2);
  Workload b = NewWorkload(**cluster, 1, kPrompt + 2);
  Workload c = NewWorkload(**cluster, 2, kPrompt + 2);
  EXPECT_EQ((*cluster)->OwnerOf(a.id), "");
  EXPECT_NE((*cluster)->OwnerOf(b.id), "");
  EXPECT_NE((*cluster)->OwnerOf(c.id), "");

  // Found again (b, now the least recently used, makes way), then used.
  PrefillAll(**cluster, a);
  EXPECT_NE((*cluster)->OwnerOf(a.id), "");
  EXPECT_EQ((*cluster)->OwnerOf(b.id), "");
  ATTN_ASSERT_OK((*cluster)->GetSession(c.id));  // c: the most recent
  PrefillAll(**cluster, b);                      // a makes way
  EXPECT_EQ((*cluster)->OwnerOf(a.id), "");
  EXPECT_NE((*cluster)->OwnerOf(b.id), "");
  EXPECT_NE((*cluster)->OwnerOf(c.id), "");

  PrefillAll(**cluster, c);
  std::vector<Workload> workloads = {a, b, c};
  StreamStep(**cluster, workloads);
  for (const Workload& w : workloads) {
    ExpectOneShot(**cluster, w);
    auto info = (*cluster)->GetSession(w.id);
    ATTN_ASSERT_OK(info);
    EXPECT_EQ(info->layer_lengths(0), w.length);
  }
}

}  // namespace
}  // namespace attention::testing
