// ArenaMessageAllocator: the request and response of a unary callback-API
// call allocated on one protobuf arena per call, so that parsing the
// request (its tensor bytes included) and building the response (the
// output bytes the engine writes into) allocate from one block instead of
// one heap allocation per field; all of it is freed at once when gRPC is
// done with the call. It also notes when the messages were allocated: right
// before gRPC parses the request (DecodeStepTiming::received).
#ifndef ATTENTION_SERVER_ARENA_MESSAGES_H_
#define ATTENTION_SERVER_ARENA_MESSAGES_H_

#include <google/protobuf/arena.h>
#include <grpcpp/support/message_allocator.h>

#include <chrono>

namespace attention::server {

// One call's messages. Release (by gRPC, after the call) deletes it.
template <typename Request, typename Response>
class ArenaMessageHolder final
    : public grpc::MessageHolder<Request, Response> {
 public:
  ArenaMessageHolder()
      : arena_(Options()), allocated_(std::chrono::steady_clock::now()) {
    this->set_request(
        google::protobuf::Arena::CreateMessage<Request>(&arena_));
    this->set_response(
        google::protobuf::Arena::CreateMessage<Response>(&arena_));
  }
  void Release() override { delete this; }

  std::chrono::steady_clock::time_point allocated() const {
    return allocated_;
  }

 private:
  // A decode step's request and reply (a few KiB to tens of KiB) fit in
  // the first block.
  static google::protobuf::ArenaOptions Options() {
    google::protobuf::ArenaOptions options;
    options.start_block_size = 32 << 10;
    options.max_block_size = 8 << 20;
    return options;
  }

  google::protobuf::Arena arena_;
  const std::chrono::steady_clock::time_point allocated_;
};

// Thread-safety: thread-safe (stateless).
template <typename Request, typename Response>
class ArenaMessageAllocator final
    : public grpc::MessageAllocator<Request, Response> {
 public:
  grpc::MessageHolder<Request, Response>* AllocateMessages() override {
    return new ArenaMessageHolder<Request, Response>();
  }
};

// The holder of a call whose method uses ArenaMessageAllocator<Request,
// Response> (from CallbackServerContext::GetRpcAllocatorState()).
template <typename Request, typename Response>
const ArenaMessageHolder<Request, Response>& ArenaMessagesOf(
    grpc::RpcAllocatorState* state) {
  return *static_cast<ArenaMessageHolder<Request, Response>*>(state);
}

}  // namespace attention::server

#endif  // ATTENTION_SERVER_ARENA_MESSAGES_H_
