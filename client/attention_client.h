// A thin C++ client for attention.v1.AttentionService.
//
//   auto client = attention::client::AttentionClient::Connect("host:50051");
//   auto session = client->OpenSession(spec);           // SessionHandle
//   auto prefill = session->Prefill(/*layer=*/0, q, k, v);
//   auto stream = client->OpenDecodeStream();
//   auto step = stream->Step(*session->MakeDecodeRequest(0, q1, k1, v1));
//   auto out = attention::client::TensorToFloats(step->output());
//
// Every method returns the server's status translated to absl::Status (same
// code, same message); transport failures arrive as UNAVAILABLE or
// DEADLINE_EXCEEDED. Status codes are documented in attention.proto.
//
// Thread-safety: AttentionClient and SessionHandle are thread-safe (calls
// may run concurrently from many threads). A DecodeStream allows one
// writer thread (Write, WritesDone) next to one reader thread (Read);
// Step and Finish need the stream to themselves.
#ifndef ATTENTION_CLIENT_ATTENTION_CLIENT_H_
#define ATTENTION_CLIENT_ATTENTION_CLIENT_H_

#include <grpcpp/channel.h>
#include <grpcpp/client_context.h>
#include <grpcpp/support/status.h>
#include <grpcpp/support/sync_stream.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "attention/v1/attention.grpc.pb.h"
#include "attention/v1/attention.pb.h"
#include "client/blocking_bidi_stream.h"
#include "client/tensor_codec.h"

namespace attention::client {

// The shortest ClientOptions::keepalive_time: an attention-server accepts a
// client's pings this often (server/transport_limits.h); gRPC servers close
// the connection of a client that pings more often than they accept.
inline constexpr absl::Duration kMinKeepaliveTime = absl::Seconds(5);

struct ClientOptions {
  // Largest message sent / received (the server's default is 64 MiB).
  int64_t max_send_message_bytes = int64_t{64} << 20;
  int64_t max_receive_message_bytes = int64_t{64} << 20;
  // Deadline of each unary call; infinite = none. Streams have none.
  absl::Duration call_timeout = absl::InfiniteDuration();
  // Retry policy (gRPC service config, see RetryServiceConfig): calls that
  // are safe to repeat (GetSession, ListSessions, TruncateSession,
  // Attention, GetServerInfo, ExportSession) are retried on UNAVAILABLE,
  // e.g. while a server restarts with --snapshot_dir and restores its
  // sessions, up to retry_max_attempts attempts in all with exponential
  // backoff from 0.2 s to 5 s (about 15 s at 5 attempts; the server
  // reports UNAVAILABLE until its sessions are back). Appends are never
  // retried automatically: after an UNAVAILABLE Prefill/DecodeStep, read
  // GetSession's layer_lengths and resend what is missing. 1 = no retries.
  int retry_max_attempts = 5;
  // Longest wait between attempts to reconnect to an unreachable server;
  // zero = gRPC's default (backoff growing to 120 s). Calls fail fast with
  // UNAVAILABLE while the channel waits, so a short one notices a restarted
  // server sooner.
  absl::Duration max_reconnect_backoff = absl::ZeroDuration();
  // A server that stops answering while calls are open: the channel pings
  // it after keepalive_time (at least kMinKeepaliveTime) without an
  // answer from it and closes the connection when a ping is not answered
  // within keepalive_timeout; the open calls then fail UNAVAILABLE (a
  // ClusterClient then finds the session elsewhere). Without pings a call
  // without deadline (a Decode stream) on a server whose host froze, or
  // that a network partition cut off, waits for ever or until TCP gives
  // up. Infinite keepalive_time = no pings. Idle channels never ping.
  absl::Duration keepalive_time = absl::Seconds(20);
  absl::Duration keepalive_timeout = absl::Seconds(10);

  // Transport security. Plaintext unless `tls` is set or any tls_* field
  // is: then TLS, verifying the server against tls_ca_file (PEM; empty =
  // the system's roots) and, when tls_server_name is set, that name
  // instead of the target's host. tls_cert_file + tls_key_file (PEM) are
  // the client certificate of mutual TLS.
  bool tls = false;
  std::string tls_ca_file;
  std::string tls_cert_file;
  std::string tls_key_file;
  std::string tls_server_name;
  // Whether the tls_* paths must name regular files. False lets a
  // command-line tool read `/dev/stdin` or `<(...)`; a server calling its
  // peers sets it, so that a FIFO named by a flag never blocks its drain.
  bool tls_regular_files_only = false;
  // Bearer token sent with every call (`authorization: Bearer <token>`) to a
  // server with --auth_tokens_file; empty = none. Health checks carry it
  // too, though the server answers them without one (probes have none).
  // A token that fails CheckAuthToken is never sent: Open refuses it, and
  // Connect's calls fail (UNAVAILABLE).
  std::string auth_token;
};

// The gRPC service config the channels install for `max_attempts` (2..5;
// gRPC caps attempts at 5).
std::string RetryServiceConfig(int max_attempts);

// True when `options` ask for TLS.
bool UsesTls(const ClientOptions& options);

// OK when `token` can travel in an HTTP/2 header value: printable ASCII
// (0x20-0x7E) only. INVALID_ARGUMENT (quoting no part of it) otherwise.
absl::Status CheckAuthToken(absl::string_view token);

// A channel to `target` ("host:port") with the options' message size
// limits, retry policy and transport security. INVALID_ARGUMENT when a TLS
// file cannot be read, only one of tls_cert_file and tls_key_file is set,
// or auth_token fails CheckAuthToken.
absl::StatusOr<std::shared_ptr<grpc::Channel>> OpenChannel(
    const std::string& target, const ClientOptions& options);

// As OpenChannel; a TLS file or token error then fails every call of the
// channel (UNAVAILABLE) instead.
std::shared_ptr<grpc::Channel> CreateChannel(const std::string& target,
                                             const ClientOptions& options);

// The absl::Status with the same code and message.
absl::Status FromGrpcStatus(const grpc::Status& status);

// Fleets (attention.proto, "Fleets"): a call on a session that moved to
// another replica fails with NOT_FOUND and the trailing metadata
// `attention-session-owner: host:port`. The client's calls keep that owner
// on the returned status as a payload under this type URL.
inline constexpr char kSessionOwnerMetadata[] = "attention-session-owner";
// A decode step (DecodeStep, the Decode stream, BatchDecode) that reaches
// a session while it is being moved fails at once with UNAVAILABLE and the
// trailing metadata `attention-session-moving: 1` (nothing was applied;
// retried, it is redirected once the move ends), kept on the returned
// status as a payload under this type URL. Other calls wait for the move.
inline constexpr char kSessionMovingMetadata[] = "attention-session-moving";
// A draining server ends a Decode stream that waits for its next request
// when the drain's time for calls is up, with UNAVAILABLE and the trailing
// metadata `attention-stream-drained: 1`: the requests sent after its last
// reply were not applied (send them again on a new stream). Kept on the
// returned status as a payload under this type URL.
inline constexpr char kStreamDrainedMetadata[] = "attention-stream-drained";
// As FromGrpcStatus, plus the new owner, the move in progress or the
// drained stream from `context`'s trailing metadata.
absl::Status FromGrpcCall(const grpc::Status& status,
                          const grpc::ClientContext& context);
// The replica a moved session went to ("host:port"), when `status` is such a
// redirect; nullopt otherwise.
std::optional<std::string> MovedSessionOwner(const absl::Status& status);
// Whether `status` says the session was being moved (nothing applied).
bool IsSessionMoving(const absl::Status& status);
// Whether `status` ended a Decode stream drained as it waited for its next
// request (nothing sent after the last reply applied).
bool IsStreamDrained(const absl::Status& status);

// grpc.health.v1 serving status.
enum class ServingStatus { kUnknown, kServing, kNotServing, kServiceUnknown };

class AttentionClient;

// Per-call options of SessionHandle's typed helpers.
struct StepOptions {
  // dtype q, k and v travel in (values are rounded to it).
  v1::DType input_dtype = v1::DTYPE_FLOAT32;
  // dtype of the result's output; unspecified = float32.
  v1::DType output_dtype = v1::DTYPE_UNSPECIFIED;
  bool return_lse = false;
};

// A session on the server: its id and resolved spec, with typed helpers.
// Copyable; copies name the same server session. Deleting it is explicit
// (Delete), never implied by destruction.
class SessionHandle {
 public:
  // `client` must outlive the handle. `info` comes from the server (its spec
  // is resolved: value_dim and max_tokens are set).
  SessionHandle(AttentionClient* client, v1::SessionInfo info);

  const std::string& id() const { return info_.session_id(); }
  const v1::SessionSpec& spec() const { return info_.spec(); }
  int64_t value_dim() const;

  // Requests appending T tokens to `layer`: q holds T*H*head_dim floats,
  // k T*H_kv*head_dim and v T*H_kv*value_dim (row-major [T, heads, dim]);
  // v is empty for a KV_LAYOUT_SHARED_LATENT session (no v is sent).
  // INVALID_ARGUMENT when the sizes do not describe the same T >= 1.
  absl::StatusOr<v1::PrefillRequest> MakePrefillRequest(
      int layer, absl::Span<const float> q, absl::Span<const float> k,
      absl::Span<const float> v, const StepOptions& options = {}) const;
  // The same for one token (T must be 1), for DecodeStep, DecodeStream and
  // BatchDecode.
  absl::StatusOr<v1::DecodeRequest> MakeDecodeRequest(
      int layer, absl::Span<const float> q, absl::Span<const float> k,
      absl::Span<const float> v, const StepOptions& options = {}) const;

  absl::StatusOr<v1::AttentionResult> Prefill(int layer,
                                              absl::Span<const float> q,
                                              absl::Span<const float> k,
                                              absl::Span<const float> v,
                                              const StepOptions& options = {});
  absl::StatusOr<v1::AttentionResult> DecodeStep(
      int layer, absl::Span<const float> q, absl::Span<const float> k,
      absl::Span<const float> v, const StepOptions& options = {});

  // The session's current state (GetSession).
  absl::StatusOr<v1::SessionInfo> Info() const;
  absl::StatusOr<v1::SessionInfo> Truncate(int64_t length);
  // A copy-on-write copy of the session, as a new handle.
  absl::StatusOr<SessionHandle> Fork() const;
  absl::Status Delete();

 private:
  // T from the sizes of q, k and v; INVALID_ARGUMENT when inconsistent.
  absl::StatusOr<int64_t> TokenCount(absl::Span<const float> q,
                                     absl::Span<const float> k,
                                     absl::Span<const float> v) const;
  template <typename Request>
  absl::StatusOr<Request> MakeRequest(int layer, absl::Span<const float> q,
                                      absl::Span<const float> k,
                                      absl::Span<const float> v,
                                      const StepOptions& options,
                                      std::optional<int64_t> tokens) const;

  AttentionClient* client_;
  v1::SessionInfo info_;
};

// The bidirectional Decode stream: one result per request, in order. The
// first failing request ends the stream; its status is what Read (and
// Finish) then return, and the steps before it stay applied.
class DecodeStream {
 public:
  // `authorization`, when not empty, is sent as the stream's
  // `authorization` metadata ("Bearer <token>").
  explicit DecodeStream(v1::AttentionService::Stub* stub,
                        const std::string& authorization = "");
  ~DecodeStream();  // cancels the stream if it was not finished

  DecodeStream(const DecodeStream&) = delete;
  DecodeStream& operator=(const DecodeStream&) = delete;

  // Queues a request to be sent (after the earlier ones) and returns
  // without waiting for the transport: the queue holds a copy of every
  // request not yet sent, so a caller that writes far ahead of its reads
  // should bound how many steps it leaves unanswered. False when the stream
  // has ended (Read or Finish then give the reason).
  bool Write(const v1::DecodeRequest& request);
  // The next result. When the stream has ended: its error, or OUT_OF_RANGE
  // when it ended cleanly. A stream the server ended with OK before it
  // answered every request sent ends with INVALID_ARGUMENT naming the
  // first unanswered request (servers before December 2026 ended a stream
  // so at a request gRPC could not parse for them); one a draining
  // server ended (IsStreamDrained) after WritesDone and an answer to every
  // request sent ended cleanly. A result for no request sent (a server that
  // breaks the protocol) cancels the stream and ends it with INTERNAL (at
  // the latest in Finish: a result read by Step may then be another
  // request's).
  absl::StatusOr<v1::AttentionResult> Read();
  // Write then Read.
  absl::StatusOr<v1::AttentionResult> Step(const v1::DecodeRequest& request);
  // Signals that no more requests follow.
  void WritesDone();
  // Half-closes, discards unread results, and returns the final status
  // (INVALID_ARGUMENT as Read says for a request left unanswered).
  // Idempotent.
  absl::Status Finish();

 private:
  grpc::ClientContext context_;
  std::unique_ptr<BlockingBidiStream<v1::DecodeRequest, v1::AttentionResult>>
      stream_;
  // The stream's status once it has ended (see Read).
  absl::Status EndStatus();
  // INTERNAL, after cancelling the stream: the server sent more results
  // (answered_) than the `sent` requests.
  absl::Status SurplusAnswers(int64_t sent);

  // Set by the writer; the reader reads it (EndStatus).
  std::atomic<bool> writes_done_{false};
  std::atomic<int64_t> sent_{0};  // requests written (the writer's count)
  int64_t answered_ = 0;          // results read (the reader's count)
  std::optional<absl::Status> final_status_;
};

class AttentionClient {
 public:
  AttentionClient(std::shared_ptr<grpc::Channel> channel,
                  ClientOptions options = {});
  ~AttentionClient();
  // A client on a new channel to `target` (connects lazily).
  static std::unique_ptr<AttentionClient> Connect(const std::string& target,
                                                  ClientOptions options = {});
  // As Connect, with OpenChannel's errors (unreadable TLS files).
  static absl::StatusOr<std::unique_ptr<AttentionClient>> Open(
      const std::string& target, ClientOptions options = {});

  // OK once the channel is connected; DEADLINE_EXCEEDED when it is not
  // within `timeout`.
  absl::Status WaitForConnected(absl::Duration timeout);

  absl::StatusOr<v1::SessionInfo> CreateSession(
      const v1::SessionSpec& spec,
      absl::Duration idle_timeout = absl::ZeroDuration());
  absl::StatusOr<v1::SessionInfo> GetSession(absl::string_view session_id);
  // GetSession without blocking: returns at once, and `done` runs exactly
  // once, on one of gRPC's threads, with what GetSession would have
  // returned. The call ends by `deadline` or by the options' call_timeout,
  // whichever comes first (DEADLINE_EXCEEDED). The client must outlive the
  // call; `done` must not block.
  void GetSessionAsync(
      absl::string_view session_id,
      absl::AnyInvocable<void(absl::StatusOr<v1::SessionInfo>) &&> done,
      absl::Time deadline = absl::InfiniteFuture());
  // Every live session: follows the server's pages (next_page_token).
  absl::StatusOr<std::vector<v1::SessionInfo>> ListSessions();
  absl::Status DeleteSession(absl::string_view session_id);
  absl::StatusOr<v1::SessionInfo> ForkSession(absl::string_view session_id);
  absl::StatusOr<v1::SessionInfo> TruncateSession(absl::string_view session_id,
                                                  int64_t length);
  absl::StatusOr<v1::AttentionResult> Prefill(
      const v1::PrefillRequest& request);
  absl::StatusOr<v1::AttentionResult> DecodeStep(
      const v1::DecodeRequest& request);
  // Results in request order; all steps applied or none.
  absl::StatusOr<std::vector<v1::AttentionResult>> BatchDecode(
      const v1::BatchDecodeRequest& request);
  // BatchDecode without blocking, as GetSessionAsync: `done` runs exactly
  // once, on one of gRPC's threads, with what BatchDecode would have
  // returned. The client must outlive the call; `done` must not block.
  void BatchDecodeAsync(
      v1::BatchDecodeRequest request,
      absl::AnyInvocable<
          void(absl::StatusOr<std::vector<v1::AttentionResult>>) &&>
          done,
      absl::Time deadline = absl::InfiniteFuture());
  absl::StatusOr<v1::AttentionResult> Attention(
      const v1::AttentionRequest& request);
  absl::StatusOr<v1::ServerInfo> GetServerInfo();
  // GetServerInfo without blocking, as GetSessionAsync.
  void GetServerInfoAsync(
      absl::AnyInvocable<void(absl::StatusOr<v1::ServerInfo>) &&> done,
      absl::Time deadline = absl::InfiniteFuture());
  // Streams session `session_id`'s snapshot (attention.proto, SessionChunk)
  // to `sink`, record by record; the first error of `sink` cancels the
  // export and is returned. DATA_LOSS when the records are not a whole
  // snapshot (a header, its data, a trailer counting them; a server that
  // ends the stream early without an error), with the records before that
  // already given to `sink`.
  absl::Status ExportSession(
      absl::string_view session_id,
      const std::function<absl::Status(const v1::SessionChunk&)>& sink);
  // Creates a session from the snapshot records `source` yields (it fills
  // the record and returns true, or false after the last one). With
  // `keep_session_id` the session keeps the snapshot's id. The server
  // validates everything; on any error nothing is created.
  absl::StatusOr<v1::SessionInfo> ImportSession(
      const std::function<absl::StatusOr<bool>(v1::SessionChunk*)>& source,
      bool keep_session_id = false);
  // grpc.health.v1.Health/Check; `service` empty = the whole server.
  absl::StatusOr<ServingStatus> CheckHealth(const std::string& service = "");
  // CheckHealth without blocking, as GetSessionAsync.
  void CheckHealthAsync(
      const std::string& service,
      absl::AnyInvocable<void(absl::StatusOr<ServingStatus>) &&> done,
      absl::Time deadline = absl::InfiniteFuture());

  std::unique_ptr<DecodeStream> OpenDecodeStream();

  // CreateSession, as a handle.
  absl::StatusOr<SessionHandle> OpenSession(
      const v1::SessionSpec& spec,
      absl::Duration idle_timeout = absl::ZeroDuration());

  v1::AttentionService::Stub* stub() { return stub_.get(); }
  const std::shared_ptr<grpc::Channel>& channel() const { return channel_; }

 private:
  // Applies options_.auth_token, and options_.call_timeout or `deadline`,
  // whichever ends first.
  void PrepareContext(grpc::ClientContext* context,
                      absl::Time deadline = absl::InfiniteFuture()) const;
  // "Bearer <token>", or empty without a token.
  std::string Authorization() const;
  // The asynchronous unary calls: `start` starts the call on stub_->async()
  // with the context, request and response it is given (they live until
  // the call completes); `done` then gets convert(response), or the call's
  // error. The call ends by `deadline` (see PrepareContext). Defined in the
  // .cc file, the only one that uses it.
  template <typename Request, typename Response, typename Result>
  void CallAsync(
      Request request,
      absl::FunctionRef<void(grpc::ClientContext*, const Request*, Response*,
                             std::function<void(grpc::Status)>)>
          start,
      Result (*convert)(Response&&),
      absl::AnyInvocable<void(absl::StatusOr<Result>) &&> done,
      absl::Time deadline);

  // grpc.health.v1.Health's stub on channel_ (defined in the .cc file, so
  // that this header does not need the health service's).
  struct HealthStub;

  std::shared_ptr<grpc::Channel> channel_;
  ClientOptions options_;
  std::unique_ptr<v1::AttentionService::Stub> stub_;
  std::unique_ptr<HealthStub> health_;
};

}  // namespace attention::client

#endif  // ATTENTION_CLIENT_ATTENTION_CLIENT_H_
