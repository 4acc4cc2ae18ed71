// DecodeStepTiming: where one DecodeStep call spent its time on the server,
// for the per-call latency budget attn-bench reports (transport, request
// decode, queueing, engine, reply encode). Recorded only when
// ServerOptions::on_decode_step_timing is set: otherwise no timestamp is
// taken on the call's path.
#ifndef ATTENTION_SERVER_DECODE_STEP_TIMING_H_
#define ATTENTION_SERVER_DECODE_STEP_TIMING_H_

#include <chrono>
#include <functional>

namespace attention::server {

// When a DecodeBatcher entry's engine batch ran; steady clock.
struct BatchTimes {
  std::chrono::steady_clock::time_point start;
  std::chrono::steady_clock::time_point end;
};

// Steady-clock instants of one DecodeStep, in order:
//   received    the request message was allocated, right before gRPC
//               parsed the request bytes into it (ArenaMessageAllocator);
//   handler     the handler started (request parsed, interceptors run);
//   submitted   the request was converted, checked and bounded, and handed
//               to the DecodeBatcher (queued, or run at once when idle);
//   batch       its engine batch started and ended (BatchTimes);
//   replied     the reply was completed and handed to gRPC (Finish) — our
//               code's last moment with the call; gRPC's writing of it
//               after that counts as transport.
// Request decode = received..submitted, queueing = submitted..batch.start,
// engine = batch, reply encode = batch.end..replied; transport is what the
// client measures beyond received..replied.
struct DecodeStepTiming {
  using Clock = std::chrono::steady_clock;
  Clock::time_point received;
  Clock::time_point handler;
  Clock::time_point submitted;
  BatchTimes batch;
  Clock::time_point replied;
};

// Called once per successful DecodeStep, on the thread that replied; must be
// cheap and thread-safe.
using DecodeStepTimingHook = std::function<void(const DecodeStepTiming&)>;

}  // namespace attention::server

#endif  // ATTENTION_SERVER_DECODE_STEP_TIMING_H_
