// Moving sequences between KVCaches (disaggregated prefill -> decode).
//
// A SequenceSender on one cache and a SequenceReceiver on another talk over a
// Transport: a point-to-point link to one peer that moves device buffers
// (NCCL send/recv between two GPUs, or an in-process loopback pair for tests
// and for two caches in one process). The sender exports a sequence into one
// of its preallocated staging slots (KVCache::ExportSequence), offers it
// (image header, size, id) in a control frame; the receiver reserves the
// pages all-or-nothing (KVCache::ReserveImport) and answers READY or NACK;
// the image then goes device to device into a receive slot, the receiver
// commits it (KVCache::CommitImport) and answers ACK. The sender never
// releases a sequence before that ACK; every failure or cancellation before
// it leaves both caches as they were (the reservation is cancelled, the
// sender still holds its sequence). The protocol is a pipeline of steps
// (TransferOptions::pipeline_depth in flight): later offers, earlier acks
// and exports into freed slots happen while payloads are on the link, in an
// issue order both sides derive from the frames they hold. docs/transfer.md
// has the protocol.
//
// Progress model: Progress() never blocks; it advances the state machine
// from completed transport operations and CUDA events (cudaEventQuery), so a
// server calls it between decode steps. RunUntilIdle() is the blocking
// helper for simple programs.
//
// Thread safety: none; a sender/receiver, its transport and its cache are
// used from one thread (the cache's thread).
#ifndef FP4KV_TRANSFER_H_
#define FP4KV_TRANSFER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp4kv/kv_cache.h"
#include "fp4kv/ops.h"
#include "fp4kv/tensor.h"

namespace fp4kv {

// ------------------------------------------------------------ transports

// One endpoint of a reliable, ordered point-to-point link to one peer.
//
// Matching rule (NCCL's, kept by every transport): the k-th operation posted
// on one endpoint pairs with the k-th operation posted on the other, a send
// with a receive of the same byte count. A protocol that posts mirrored
// sequences on both sides therefore never deadlocks, whatever the timing.
// Operations of one endpoint complete in the order they were posted.
class Transport {
 public:
  using OpId = uint64_t;
  virtual ~Transport() = default;

  // Where Send/Recv buffers live (the CPU for a host loopback).
  virtual Device device() const = 0;
  // CUDA: the stream the operations run on; null on the CPU.
  virtual Stream stream() const = 0;

  // Posts a send of `bytes` bytes from device memory `buf` (must stay valid
  // and unchanged until the op completes). Returns the op's id.
  virtual absl::StatusOr<OpId> Send(const void* buf, int64_t bytes) = 0;
  // Posts a receive of exactly `bytes` bytes into device memory `buf`.
  virtual absl::StatusOr<OpId> Recv(void* buf, int64_t bytes) = 0;
  // Control messages: the same, from and to host memory (the transport
  // stages them through device memory when it must); `host` must stay valid
  // until the op completes, and on a CUDA transport be pinned
  // (cudaMallocHost) so that the staging copies stay asynchronous.
  virtual absl::StatusOr<OpId> SendControl(const void* host, int64_t bytes) = 0;
  virtual absl::StatusOr<OpId> RecvControl(void* host, int64_t bytes) = 0;
  // Non-blocking: true once op `op` (and so every op posted before it) has
  // completed, its data in place. An error means the link is broken (the
  // peer failed, a message did not match): every later call fails too.
  virtual absl::StatusOr<bool> Poll(OpId op) = 0;
};

// Faults a loopback endpoint injects into the messages it sends (for tests).
struct LoopbackFault {
  enum class Kind {
    kNone,
    kDrop,      // never delivered: the receive never completes
    kTruncate,  // only the first `bytes` bytes are delivered
    kCorrupt,   // byte `offset` of the delivered message is overwritten
    kDelay,     // completes only after `polls` more Poll calls on the receiver
    kFail,      // both ops fail: the link breaks
  };
  Kind kind = Kind::kNone;
  int64_t bytes = 0;
  int64_t offset = 0;
  int polls = 0;
};

// An in-process connected pair of endpoints (two caches in one process, or
// tests). Device::Cpu(): host memory, copies happen when an op is matched.
// CUDA: each endpoint gets its own stream on that device (or the given
// ones); a matched message is one cudaMemcpyAsync device to device on the
// receiver's stream, completing when its event does.
class LoopbackTransport : public Transport {
 public:
  static absl::StatusOr<std::pair<std::unique_ptr<LoopbackTransport>,
                                  std::unique_ptr<LoopbackTransport>>>
  CreatePair(Device device, Stream stream_a = nullptr, Stream stream_b = nullptr);
  ~LoopbackTransport() override;

  Device device() const override;
  Stream stream() const override;
  absl::StatusOr<OpId> Send(const void* buf, int64_t bytes) override;
  absl::StatusOr<OpId> Recv(void* buf, int64_t bytes) override;
  absl::StatusOr<OpId> SendControl(const void* host, int64_t bytes) override;
  absl::StatusOr<OpId> RecvControl(void* host, int64_t bytes) override;
  absl::StatusOr<bool> Poll(OpId op) override;

  // Applies `fault` to the `index`-th message (0-based, control and data
  // counted together) this endpoint sends.
  void InjectFault(int64_t index, const LoopbackFault& fault);
  // Messages this endpoint has posted for sending so far.
  int64_t sends_posted() const;
  // Breaks the link now (both endpoints fail from their next call).
  void Break(absl::Status why);

  struct Shared;

 private:
  LoopbackTransport(std::shared_ptr<Shared> shared, int side);
  absl::StatusOr<OpId> Post(bool send, bool control, void* buf, int64_t bytes);
  std::shared_ptr<Shared> shared_;
  int side_;
};

// NCCL (loaded at run time with dlopen, so linking fp4kv does not pull in
// libnccl; the library is looked up as libnccl.so.2 on the loader's path,
// or at $FP4KV_NCCL_LIBRARY). Built only when CMake found nccl.h
// (FP4KV_NCCL); otherwise every call returns Unimplemented.
inline constexpr int kNcclUniqueIdBytes = 128;
struct NcclUniqueId {
  char bytes[kNcclUniqueIdBytes] = {};
};

// True when this build has the NCCL transport and libnccl could be loaded;
// `why` gets the reason when not.
bool NcclAvailable(std::string* why = nullptr);
// ncclGetUniqueId: rank 0 makes it and hands it to the others out of band.
absl::StatusOr<NcclUniqueId> NcclCreateUniqueId();

// An NCCL communicator (owned, or the caller's) on one CUDA device.
class NcclCommunicator {
 public:
  // ncclCommInitRank on `device` (made current for the call). Blocks until
  // every rank joined.
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Create(const NcclUniqueId& id,
                                                                  int num_ranks, int rank,
                                                                  Device device);
  // Wraps a caller's ncclComm_t (not destroyed here).
  static absl::StatusOr<std::unique_ptr<NcclCommunicator>> Wrap(void* nccl_comm, Device device);
  // An owned communicator: ncclCommDestroy, or ncclCommAbort when one of
  // its endpoints failed or was destroyed with an operation still waiting
  // for its peer (destroying would wait forever). Destroy the endpoints
  // first.
  ~NcclCommunicator();
  int rank() const;
  int num_ranks() const;
  Device device() const;
  void* comm() const;  // the ncclComm_t

  // An endpoint to rank `peer` (!= rank()); its ops run on `stream` (null:
  // a new stream the transport owns). The communicator must outlive it.
  absl::StatusOr<std::unique_ptr<Transport>> Connect(int peer, Stream stream = nullptr);
  // Two endpoints of this 1-rank communicator that talk to each other
  // through NCCL send/recv to self (one GPU): a send and the matching
  // receive are issued together in one ncclGroupStart/End. For testing and
  // measuring the NCCL path on a single GPU.
  absl::StatusOr<std::pair<std::unique_ptr<Transport>, std::unique_ptr<Transport>>> SelfPair(
      Stream stream = nullptr);

  struct Impl;

 private:
  explicit NcclCommunicator(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// ------------------------------------------------------------- protocol

using TransferId = uint64_t;

struct TransferOptions {
  // Bytes of one staging slot: the largest sequence image that can move
  // (KVCache::ExportedBytes). Both sides allocate num_slots of them once, in
  // the cache's device memory; nothing is allocated per transfer.
  int64_t slot_bytes = 0;
  // Sequences in flight: the sender's exported-and-unconfirmed images, the
  // receiver's images being received. Also the most transfers one step of
  // the protocol offers. Both sides must use the same value. A transfer
  // holds a slot for about pipeline_depth + 2 steps, so the link stays busy
  // when num_slots / (pipeline_depth + 2) images keep it busy for longer
  // than a control message's round trip.
  int num_slots = 4;
  // Steps of the protocol in flight (1 .. 4; docs/transfer.md, "Pipeline"):
  // the payload of the transfers answered READY in step r moves in step
  // r + pipeline_depth, behind step r + pipeline_depth's offer, so with 2 or
  // more neither side's host decisions sit between two payloads on the
  // link. 1 has the lowest latency for a lone sequence. Both sides must use
  // the same value.
  int pipeline_depth = 2;
  // Where the cache's own work goes (ExportSequence, CommitImport): the
  // stream the server appends and decodes on. The transport's stream only
  // moves bytes; the two are ordered by host-observed events.
  Stream cache_stream = nullptr;
  // A side that has steps in flight and hears nothing from the peer for
  // longer than this fails every unfinished transfer (both caches
  // unchanged) and breaks the link. <= 0: wait forever.
  int64_t timeout_ms = 60000;
  // Sender: release the sequence once the receiver confirmed it.
  bool release_on_confirm = false;
};

enum class TransferState {
  kQueued,     // sender: waiting for a slot
  kExporting,  // sender: export enqueued, header not yet on the host
  kReady,      // sender: exported, waiting for the next step's offer
  kOffered,    // offered, no answer yet (receiver: reserved or refusing)
  kMoving,     // READY: the payload is moving
  kConfirmed,  // committed on the receiver; final
  kRefused,    // receiver said NACK (e.g. out of pages); final, sender keeps it
  kCancelled,  // cancelled by either side before commit; final, both unchanged
  kFailed,     // the link or the import failed; final, both unchanged
};
const char* TransferStateName(TransferState s);

// A transfer that reached a final state.
struct TransferResult {
  TransferId id = 0;
  SequenceId seq = 0;        // sender: the sequence sent; receiver: the new sequence (0 unless confirmed)
  TransferState state = TransferState::kFailed;
  absl::Status status;       // why, for refused / cancelled / failed
  int64_t image_bytes = 0;
  int64_t length = 0;        // tokens
};

// What the receiver learns from an offer, before reserving anything.
struct TransferOffer {
  TransferId id = 0;
  int64_t image_bytes = 0;
  int64_t length = 0;
};

class SequenceSender {
 public:
  // `cache` and `transport` must outlive the sender and live on the same
  // device. InvalidArgument naming the option; ResourceExhausted (naming the
  // buffer and the bytes asked and available, nothing allocated) when the
  // slots or frames do not fit in the memory available.
  static absl::StatusOr<SequenceSender> Create(KVCache* cache, Transport* transport,
                                               const TransferOptions& options);
  SequenceSender(SequenceSender&&) noexcept;
  SequenceSender& operator=(SequenceSender&&) noexcept;
  ~SequenceSender();

  // Queues sequence `seq` for sending; it must not change (no appends,
  // truncation or release) until its transfer is final. NotFound for an
  // unknown sequence; InvalidArgument when its image exceeds slot_bytes;
  // FailedPrecondition once the link is broken. Ids are in send order.
  absl::StatusOr<TransferId> Send(SequenceId seq);
  // Cancels a transfer that is queued, exported, or offered (not yet
  // answered): it ends kCancelled and the receiver cancels its reservation.
  // FailedPrecondition once its payload moves (it then ends confirmed or
  // failed as a whole); NotFound for an unknown or final id.
  absl::Status Cancel(TransferId id);
  // Non-blocking: advances exports, rounds and confirmations. An error
  // means the link broke: every unfinished transfer ends kFailed (reported
  // by TakeResults) and the sender holds all its sequences.
  absl::Status Progress();
  // Blocking: Progress until nothing is in flight (or an error, or the
  // timeout of one round).
  absl::Status RunUntilIdle();
  // Tells the receiver that nothing more comes (it stops listening), after
  // every transfer is final: FailedPrecondition while some are in flight.
  // Blocks until the receiver got it (or the timeout).
  absl::Status Close();
  // Final transfers since the last call, in the order they finished.
  std::vector<TransferResult> TakeResults();
  absl::StatusOr<TransferState> State(TransferId id) const;
  // Transfers not yet final.
  int64_t in_flight() const;

  struct Impl;
  explicit SequenceSender(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

class SequenceReceiver {
 public:
  // As SequenceSender::Create; options must match the sender's (slot_bytes
  // and num_slots are checked in the first exchange).
  static absl::StatusOr<SequenceReceiver> Create(KVCache* cache, Transport* transport,
                                                 const TransferOptions& options);
  SequenceReceiver(SequenceReceiver&&) noexcept;
  SequenceReceiver& operator=(SequenceReceiver&&) noexcept;
  ~SequenceReceiver();

  // Admission control: called for every offer before anything is reserved;
  // false refuses it (NACK, sender keeps the sequence). Default: accept.
  void SetAdmission(std::function<bool(const TransferOffer&)> admit);
  // Cancels an offered or moving transfer before its commit: the
  // reservation is released, the sender keeps its sequence. NotFound for an
  // id not in flight here.
  absl::Status Cancel(TransferId id);
  absl::Status Progress();
  // Blocking: Progress until `count` results wait in TakeResults and the
  // acks of the committed ones went out (or an error, a timeout, or the
  // sender closed the link first).
  absl::Status RunUntilResults(int64_t count);
  // The sender closed the link (Close): nothing more arrives.
  bool closed() const;
  // Final transfers since the last call; a confirmed one names the new
  // sequence (owned by the caller from then on).
  std::vector<TransferResult> TakeResults();
  int64_t in_flight() const;

  struct Impl;
  explicit SequenceReceiver(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace fp4kv

#endif  // FP4KV_TRANSFER_H_
