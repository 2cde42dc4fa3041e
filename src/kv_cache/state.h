// Internal (KVCache): the state of a cache, grouped by owner. Each group is
// changed by one unit of src/kv_cache/ (named on it); the others only read it.
// KVCache (include/fp4kv/kv_cache.h) is the facade over these units.
#ifndef FP4KV_SRC_KV_CACHE_STATE_H_
#define FP4KV_SRC_KV_CACHE_STATE_H_

#include <cuda_runtime_api.h>

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "fp4kv/kv_cache.h"
#include "src/cuda_util.h"
#include "src/host_alloc.h"
#include "src/kv_cache/copy_engine.h"
#include "src/kv_cache/host_pool.h"
#include "src/kv_cache/memory.h"
#include "src/kv_event_queue.h"
#include "src/page_pool.h"
#include "src/params.h"
#include "src/prefix_hash.h"
#include "src/status_macros.h"

namespace fp4kv {
namespace internal {

// One sequence (owner: sequences.cc; the step builder appends, the prefix
// index keeps `chain`, the host tier `swapped`, `host_pages`, `swapin_event`).
struct Sequence {
  SequenceId id = 0;  // of the live sequence in this slot
  bool live = false;
  int64_t length = 0;
  std::vector<int32_t> pages;  // ceil(length / page_size) entries
  // Bumped whenever an existing block-table entry changes or pages are
  // removed (copy on write, truncation); appends only push.
  uint64_t epoch = 0;
  uint64_t mark = 0;  // step stamp: duplicate detection
  TokenChain chain;   // page hashes (prefix caching)
  // Host tier: swapped out (pages empty once the copy is seen done;
  // host_pages holds ceil(length / page_size) host pages).
  bool swapped = false;
  std::vector<int32_t> host_pages;
  int swapin_event = -1;  // copy of a SwapIn not yet waited for by a stream
  // Bumped by Truncate: token ids given for positions before a truncation
  // (SetTokenIds from device memory, still in flight) do not apply after it.
  uint64_t truncations = 0;
  // Retention priority (KVCache::SetRetentionPriority) the pages it drops get.
  int priority = 0;
};

// The sequences (owner: sequences.cc). Ids count up from 1 and are never
// reused; a live sequence keeps its slot (its index in slots()) until it is
// released, and a released slot is reused by a later sequence. The table
// keeps the id -> slot map and the counts; the records themselves are
// changed by the units named on Sequence.
class SequenceTable {
 public:
  // The live sequence `id`, or null.
  Sequence* Find(SequenceId id);
  const Sequence* Find(SequenceId id) const;
  // A new live sequence (length 0, no pages, priority 0, epoch bumped) in a
  // free slot or a new one; may move the records (look others up again).
  Sequence& Add();
  // Frees the slot of live sequence q, whose pages the caller dropped.
  void Remove(Sequence& q);
  // The slot of q (a record of this table).
  uint32_t SlotOf(const Sequence& q) const { return static_cast<uint32_t>(&q - all_.data()); }
  // Every slot, live or free (q.live tells).
  absl::Span<Sequence> slots() { return absl::MakeSpan(all_); }
  absl::Span<const Sequence> slots() const { return all_; }
  int64_t live() const { return live_; }
  // Every live record is mapped from its id, every mapped id is live, the
  // count agrees and the free slots are exactly the others.
  absl::Status Validate() const;

 private:
  std::vector<Sequence> all_;
  std::vector<uint32_t> free_slots_;
  SequenceId next_id_ = 1;
  std::unordered_map<SequenceId, uint32_t> slot_of_;
  int64_t live_ = 0;
};

// Pools and step buffers as allocated (owner: create.cc; fixed after Create).
struct MemoryState {
  PoolLayout pool;
  StepLayout step_layout;
  Memory pools;
  Memory device_step;  // CPU: also the staging
  Memory staging;      // CUDA only (pinned)
  // Step slots 1 .. step_slots-1 (slot 0 lives in device_step / staging):
  // the step buffers [0, StepLayout::scales) and their staging.
  std::vector<Memory> slot_device, slot_staging;
  uint8_t* d_step = nullptr;
  // Sizing (docs/kv_cache.md, "Allocation and budget rules"): the memory the
  // pools' device had available at Create, and whether memory_budget_bytes
  // was clamped to it.
  int64_t available_at_create = 0;
  bool budget_clamped = false;
};

// One step slot: fixed-address step buffers (device), their staging (pinned
// host on CUDA; the device buffers themselves on the CPU) and what the step
// that last filled them was (owner: step.cc).
struct StepSlot {
  // What row b of the staging block tables holds: the first `count` pages of
  // sequence `seq` as of `epoch`.
  struct Row {
    SequenceId seq = 0;
    uint64_t epoch = 0;
    int32_t count = 0;
  };
  uint8_t* d_base = nullptr;  // device step buffers ([0, StepLayout::scales) of the layout)
  uint8_t* h_base = nullptr;  // staging ([0, StepLayout::staging_bytes))
  // Recorded after the slot's upload (CUDA): the staging may be rewritten
  // once it completed.
  cudaEvent_t upload_done = nullptr;
  bool upload_pending = false;
  // Two or more slots: recorded by the next PrepareStep on this slot's step
  // stream, after every kernel the server enqueued for the step (the step
  // is complete once it completed).
  cudaEvent_t done = nullptr;
  bool done_recorded = false;
  uint64_t serial = 0;       // the step it holds (0: none yet)
  Stream stream = nullptr;   // the stream of that step
  // Staging (host) pointers.
  int32_t* h_seq_lens = nullptr;
  int32_t* h_kv_indptr = nullptr;
  int32_t* h_token_indptr = nullptr;
  int64_t* h_slots = nullptr;
  int32_t* h_tables = nullptr;
  StepViews views;
  StepInfo info;
  HostVector<Row> rows;
  int64_t slot_extent = 0;  // staging slots [0, slot_extent) may be >= 0
  int rows_used = 0;
};

// The step slots and the step builder's scratch (owner: step.cc). The slot
// records are written by the step builder (and their done events by
// RecordStepDone); the counters change only through the methods below.
class StepState {
 public:
  using Row = StepSlot::Row;
  std::vector<StepSlot> slots;  // KVCacheOptions::step_slots of them
  StepSlot& cur() { return slots[current_]; }
  const StepSlot& cur() const { return slots[current_]; }
  // The slot of the latest step, and the count of committed PrepareSteps.
  int current() const { return current_; }
  uint64_t serial() const { return step_serial_; }
  // The slot the next PrepareStep fills (round robin).
  int next() const { return static_cast<int>(step_serial_ % slots.size()); }
  // A stamp no earlier PrepareStep used (duplicate detection).
  uint64_t NewStamp() { return ++stamp_; }
  // The step being committed fills slot k (cur() from now on).
  void SetCurrent(int k) { current_ = k; }
  // The step is committed: returns its serial.
  uint64_t Advance() { return ++step_serial_; }
  // PrepareStep scratch (sized once).
  HostVector<int32_t> claim;        // [num_pages]
  HostVector<Sequence*> step_seqs;  // [max_seqs_per_step]
  HostVector<int32_t> cow_src;      // pages to copy, in entry order
  HostVector<int> cow_entry;        // entry index of each copy
  HostVector<int32_t> cow_dst;

 private:
  int current_ = 0;
  uint64_t step_serial_ = 0;
  uint64_t stamp_ = 0;
};

// Global scales and their bookkeeping (owner: scales.cc). The device
// buffers live in the cache's step block (fixed after Init); the host's
// bookkeeping changes only through the methods below.
class ScaleState {
 public:
  // Create: points the buffers into the step block `d_step` (layout sl),
  // writes the scales and flags of the options (explicit scales are
  // calibrated; a missing side starts pending with a placeholder 1.0 that
  // only all-zero rows are ever stored under) and maps the flags' host
  // mirror (CUDA).
  absl::Status Init(const KVCacheOptions& o, const CacheGeometry& g, uint8_t* d_step,
                    const StepLayout& sl, bool cuda);

  // d_scales [L, 4]: K global, V global, K fp8, V fp8; d_flags [L, 2]: K, V
  // calibrated; d_calib [L, 4]: calibration scratch (zero between launches);
  // d_events [L, 4]: scale-event counters; d_old_scales [L, 2]: the scales
  // before a re-encode; h_flags: the host mirror of d_flags (CPU: d_flags
  // itself), h_flags_dev its device address (CUDA), for the kernel.
  float* d_scales() const { return d_scales_; }
  int32_t* d_flags() const { return d_flags_; }
  uint32_t* d_calib() const { return d_calib_; }
  uint64_t* d_events() const { return d_events_; }
  float* d_old_scales() const { return d_old_scales_; }
  int32_t* h_flags() const { return h_flags_; }
  int32_t* h_flags_dev() const { return h_flags_dev_; }

  // An appender Run of `layer` for the step `serial` (see
  // KVCacheState::RecordAppend).
  void RecordAppend(int layer, uint64_t serial, bool captured, bool tokens);
  // Whether the latest append of `layer` was for step `serial` or was
  // captured into a graph (its tokens then count as held).
  bool AppendedFor(int layer, uint64_t serial) const {
    return append_serial_[layer] == serial || captured_[layer] != 0;
  }
  // Marks layers [first, first + count) settled.
  void Settle(int first, int count);
  // Whether every layer is settled (sticky once true).
  bool AllSettled();
  // Scales [first, first + count) given by the host (vals: [count, 4]).
  void SetKnown(int first, int count, const float* vals);
  // The host no longer knows layer l's scales (computed on the device, or
  // adopted from an import).
  void Forget(int l) { known_[l] = 0; }
  // xxh3 of the scales when the host knows every layer's; false otherwise.
  bool Fingerprint(uint64_t* out) const;

 private:
  float* d_scales_ = nullptr;
  int32_t* d_flags_ = nullptr;
  uint32_t* d_calib_ = nullptr;
  uint64_t* d_events_ = nullptr;
  float* d_old_scales_ = nullptr;
  Memory mapped_flags_;  // CUDA: [L, 2] host-visible mirror of d_flags
  int32_t* h_flags_ = nullptr;
  int32_t* h_flags_dev_ = nullptr;
  // Scale-change bookkeeping (see KVCache::LayerTokens), written by the
  // bound appender's Run through KVCacheState::RecordAppend.
  std::vector<uint64_t> append_serial_;  // [L] step of the last append
  std::vector<uint8_t> captured_;        // [L] an append was captured
  // The host's view of calibration, a function of the calls alone (never of
  // the mapped flags, which the device writes when it gets there): a layer is
  // settled once its scales were given (at Create, UpdateGlobalScales,
  // CalibrateGlobalScales) or a call wrote tokens into it (an appender run of
  // a step with tokens, an import). It gates prefix indexing (Calibrated());
  // docs/kv_cache.md, "Tensor parallelism: decisions are a function of the calls".
  std::vector<uint8_t> settled_;  // [L]
  bool all_settled_ = false;      // sticky: every layer settled
  // Scales the host knows ([L, 4] as d_scales; known_[l]: given at Create or
  // by UpdateGlobalScales, not computed on the device since).
  std::vector<float> known_scales_;
  std::vector<uint8_t> known_;
};

// The prefix index beside the page pool (owner: prefix.cc).
struct PrefixState {
  explicit PrefixState(size_t max_events) : events(max_events) {}
  bool enabled = false;
  KVEventQueue events;
  int64_t queries = 0, query_tokens = 0, hit_tokens = 0;
  mutable std::vector<uint8_t> hash_scratch;
  mutable std::vector<BlockHash> match_hashes;
  mutable std::vector<int32_t> match_pages;  // device page, or -1: host page in match_host
  mutable std::vector<int32_t> match_host;   // host page of the prefix tier, or -1
  // Token id of every slot (page * page_size + entry) written by a tracked
  // sequence: a page's ids travel with it (forks, matches, truncations).
  // Allocated only with prefix caching on.
  HostVector<int32_t> page_tokens;
  // Whether the id in page_tokens of a slot is known (given with the append
  // or later by SetTokenIds); an append without ids clears it.
  HostVector<uint8_t> page_known;
  std::vector<uint32_t> unhashed;  // sequence slots with completed, unhashed pages
  // Ids given as device views (SetTokenIds), copied back into `ids_pinned`
  // (a ring) and applied at PrepareStep `ready` (docs/kv_cache.md, "Late
  // token ids"): a function of the calls, never of when the copy finishes.
  struct PendingIds {
    SequenceId seq = 0;
    int64_t first = 0;      // position of the first id
    int64_t count = 0;
    int64_t offset = 0;     // in ids_pinned
    uint64_t truncations = 0;  // of the sequence when given
    uint64_t ready = 0;     // step_serial of the PrepareStep that applies them
    cudaEvent_t event = nullptr;
  };
  std::vector<PendingIds> pending_ids;  // in call order
  Memory ids_pinned;                    // CUDA: [ids_capacity] i32, pinned
  int64_t ids_capacity = 0;
  std::vector<cudaEvent_t> free_id_events;
  std::vector<cudaEvent_t> all_id_events;
  int64_t ids_dropped = 0;  // device ids that did not apply (truncated, released, conflicting)
};

// Page references whose release waits until no step (or copy) in flight can
// still use the pages (owner: retire.cc; the host tier's SwapOut copies are
// among them). One list, one rule: an entry goes at the first call
// once step_serial >= ready; an entry of released pages (event < 0, seq 0)
// also goes at the start of PrepareStep `ready` itself, after that call
// waited for the step that last used its slot (docs/kv_cache.md, "Ordering
// rules").
struct RetireEntry {
  int event = -1;       // a SwapOut copy (host tier event) to wait for first; -1: none
  SequenceId seq = 0;   // a SwapOut's sequence, whose device pages go then (0: none)
  std::vector<int32_t> orphan;  // page references held, released in order
  uint64_t serial = 0;  // StepState::step_serial when made
  uint64_t ready = 0;   // the step_serial from which it goes
  bool step_pages() const { return event < 0 && seq == 0; }
};

class KVCacheState;

// What an ImportReservation handle points at: alive exactly as long as the
// cache state (handles hold weak references).
struct ReservationBook {
  KVCacheState* state = nullptr;
};

// Export and import (owner: images.cc): the open import reservations (each
// holds its pages allocated, counted in reserved_pages()) and the byte
// counters.
class ImageState {
 public:
  struct Reservation {
    SequenceImageHeader header;
    std::vector<int32_t> pages;
  };
  // Create: the book the reservation handles of `state` point at.
  void Init(KVCacheState* state);
  // Destruction of the state: the handles' book forgets it.
  void Detach();
  const std::shared_ptr<ReservationBook>& book() const { return book_; }
  // Opens reservation r; returns its id (never 0).
  uint64_t Add(Reservation r);
  // The open reservation `id` (null: none).
  Reservation* Find(uint64_t id);
  // Closes reservation `id` and returns its pages (the caller releases or
  // adopts them); empty when none is open.
  std::vector<int32_t> Take(uint64_t id);
  int64_t reserved_pages() const { return reserved_pages_; }
  const std::unordered_map<uint64_t, Reservation>& reservations() const { return reservations_; }
  void AddExported(int64_t bytes) const { bytes_exported_ += bytes; }
  void AddImported(int64_t bytes) { bytes_imported_ += bytes; }
  int64_t bytes_exported() const { return bytes_exported_; }
  int64_t bytes_imported() const { return bytes_imported_; }

 private:
  std::shared_ptr<ReservationBook> book_;
  std::unordered_map<uint64_t, Reservation> reservations_;
  uint64_t next_reservation_ = 1;
  int64_t reserved_pages_ = 0;
  mutable int64_t bytes_exported_ = 0;  // ExportSequence is const
  int64_t bytes_imported_ = 0;
};

// The retire list (owner: retire.cc). SwapOut copies in flight are entries
// with an event, in copy-stream order (seq 0: the sequence was swapped back
// in, keeping its pages, or released: orphan holds its pages, dropped when
// the copy is done). With two or more step slots it also holds the pages
// that releases dropped while steps that may use them are in flight. The
// entries change only through the methods below.
class RetireState {
 public:
  // Create: with two or more step slots, a retire time per page.
  absl::Status Init(bool per_page, int64_t num_pages);
  absl::Span<const RetireEntry> entries() const { return entries_; }
  bool empty() const { return entries_.empty(); }
  // The entry of released pages that go from step_serial `ready` on (the
  // latest one when it has that time; a new one made at step `serial`
  // otherwise).
  RetireEntry& Hold(uint64_t ready, uint64_t serial);
  // Per page: the step_serial from which no step in flight can use it any
  // more (step_serial + step_slots at its latest drop); an entry's page
  // whose time moved on is held by a later entry.
  void SetReady(int32_t page, uint64_t ready) { ready_[page] = ready; }
  uint64_t ready(int32_t page) const { return ready_[page]; }
  // A SwapOut copy of `seq` recorded on copy event `event`.
  void AddSwapOut(int event, SequenceId seq, uint64_t serial, uint64_t ready);
  // The SwapOut copies of `seq` no longer free its device pages when they
  // finish (swapped back in, or released: then `orphan`, if given, holds
  // its pages, which go when the copy is done).
  void DetachSwapOut(SequenceId seq, const std::vector<int32_t>* orphan);
  // Calls finish(entry) for each entry, in order; the entries for which it
  // returns true are removed, the others kept in order.
  template <class Finish>
  void Sweep(Finish finish) {
    size_t kept = 0;
    for (size_t k = 0; k < entries_.size(); ++k) {
      if (!finish(entries_[k])) {
        if (kept != k) entries_[kept] = std::move(entries_[k]);
        ++kept;
      }
    }
    entries_.resize(kept);
  }

 private:
  std::vector<RetireEntry> entries_;
  HostVector<uint64_t> ready_;
};

// The host tier (owner: host_tier.cc): pinned host pages laid out like the
// pools; its SwapOut copies wait in the retire list.
struct HostTierState {
  using SwapOutCopy = RetireEntry;
  HostPagePool pages;  // empty (pages_total() 0): no host tier
  int64_t bytes_swapped_out = 0, bytes_swapped_in = 0;
};
// The host tier of the prefix cache (owner: prefix_host.cc): host pages laid
// out like the pools, each free or cached. Invariants: free pages +
// cached pages == pages_total; a cached page is on the LRU of its priority
// (head: least recently used) and its hash maps to it in `index`; a free
// page is in neither. Room is made by dropping the least recently used page
// of the lowest priority, never one of a priority above the incoming page's
// (that one is dropped instead). A hash may also be indexed on the device (the tiers are not
// exclusive: a prefix recomputed while its demoted copy is on the host);
// matches take the device page first.
struct PrefixHostState {
  HostPagePool pages;  // empty (pages_total() 0): no host tier of the prefix cache
  // The cached pages, one LRU per priority (the retention priority a page
  // was demoted with).
  PriorityLru lru;
  HostVector<uint8_t> cached;       // per page
  HostVector<uint64_t> batch;       // per page: the demotion batch that wrote it last
  HostVector<int32_t> batch_pos;    // per page: its entry in that batch
  uint64_t batches = 0;
  int64_t cached_count = 0;
  HostVector<BlockHash> hash;       // per page
  HostVector<int32_t> tokens;       // [pages_total * page_size] token ids
  absl::flat_hash_map<BlockHash, int32_t, BlockHashHasher> index;
  // CUDA: promotions whose copies may be in flight (docs/kv_cache.md,
  // "Promotions in flight"). Per device page, the serial of the promotion
  // that last wrote it (0: none); promotions up to `promotions_done` are
  // known complete (a cudaEventQuery, never a host wait); `latest_event` (a
  // host tier event this state holds a reference of; -1: none in flight) is
  // recorded after the latest promotion's copy and, the copy stream running
  // in order, covers every earlier one. A sequence that shares a page whose
  // promotion may be in flight holds that event as its swapin_event; a page
  // handed to a writer on another stream makes that stream wait for it.
  HostVector<uint64_t> promoted_by;  // [num_pages]
  uint64_t promotion_serial = 0, promotions_done = 0;
  int latest_event = -1;
  int64_t demotions = 0, promotions = 0, evictions = 0, hit_tokens = 0;
};

// The whole state of a KVCache; heap-allocated so that its address (held by
// the bound op objects) survives moves of the KVCache. The methods are defined
// in the file of the group they change.
class KVCacheState {
 public:
  using Sequence = internal::Sequence;
  using Reservation = ImageState::Reservation;
  using Row = StepState::Row;
  using SwapOutCopy = HostTierState::SwapOutCopy;

  explicit KVCacheState(size_t max_events) : prefix(max_events), allocator(&prefix.events) {}
  ~KVCacheState();

  absl::Status CheckLayer(int layer) const;

  Sequence* Find(SequenceId id);
  const Sequence* Find(SequenceId id) const;
  static absl::Status Unknown(const char* name, SequenceId id);
  // The live sequence `id` whose pages are on the device: NotFound naming
  // `name` when unknown, FailedPrecondition naming `call` when swapped out.
  absl::StatusOr<Sequence*> FindResident(SequenceId id, const char* call, const char* name = "seq");
  absl::StatusOr<const Sequence*> FindResident(SequenceId id, const char* call,
                                               const char* name = "seq") const;

  PagedCache LayerCache(int layer) const;

  // Copies page `src` to page `dst` in every layer, K and V, data and scales:
  // on `stream` for CUDA, now for the CPU.
  absl::Status CopyPage(int32_t src, int32_t dst, Stream stream);

  // Token slots holding data (shared pages counted once); see Stats().
  int64_t TokensResident() const;

  // Tokens whose bytes in `layer` were written (or enqueued) under its
  // current scales: the resident ones, less the current step's new tokens
  // while this layer's appender has not run for the step (and never ran in
  // a capture, whose replays the host cannot see).
  int64_t TokensHeld(int layer) const;

  // True while the host has not seen both of the layer's scales calibrated
  // in the mapped flags: a device fact seen when the device gets there, so it
  // decides only device work (whether a calibration kernel is launched),
  // never what the host does.
  bool LayerPending(int layer) const;

  // The host no longer knows layer l's scales (they come from the device:
  // an import that adopted them).
  void ForgetKnownScales(int l) { scales.Forget(l); }

  // Marks layers [first, first + count) settled (ScaleState::layer_settled).
  void SettleLayers(int first, int count);

  // An appender Run of `layer` for the step `serial` (`captured`: into a
  // CUDA graph capture, whose replays the host cannot see; `tokens`: the
  // step has new tokens, so the layer is settled).
  void RecordAppend(int layer, uint64_t serial, bool captured, bool tokens);

  absl::Status CheckScaleChange(int layer, StoredTokens stored, bool* reencode) const;

  // Enqueues a copy of the layer's current K and V global scales into
  // d_old_scales (the source of a re-encode).
  absl::Status SaveOldScales(int layer, Stream stream);

  // Requantizes every block of the layer's K and V pools from d_old_scales
  // to d_scales.
  absl::Status Reencode(int layer, Stream stream) const;

  // Marks layers [first, first + count) calibrated on the device (enqueued
  // on `stream`) and in the host mirror.
  absl::Status MarkCalibrated(int first, int count, Stream stream);

  // Fixed at Create.
  KVCacheOptions options;
  CacheGeometry geometry;
  bool cuda = false;
  MemoryState mem;
  // Changing state, by owner.
  SequenceTable sequences;
  StepState step;
  ScaleState scales;
  PrefixState prefix;  // before the allocator, which reports to its event queue
  PagePool allocator;  // src/page_pool: free / cached / used pages
  ImageState images;
  HostTierState host;
  RetireState retire;
  PrefixHostState prefix_host;
  // Last: destroyed first, so its destructor's wait for the copies in flight
  // comes before the pools they read and write go.
  CopyEngine copy;

  int64_t PageBytesAllLayers() const;

  // prefix_tier: between the pool and the host tier of the prefix cache
  // (prefix_host) instead of the swap host tier (host).
  PageCopyParams HostCopy(const int32_t* src, const int32_t* dst, int64_t n, bool to_host,
                          bool prefix_tier = false) const;
  PageCopyParams PoolToHost(const int32_t* pages, const int32_t* host, int64_t n) const;
  PageCopyParams HostToPool(const int32_t* host, const int32_t* pages, int64_t n) const;

  // Copies pages between the pool and the host tier on the copy stream,
  // after the work on `stream` so far; *event is recorded after the copy
  // (event null: none, for batches that only stream order follows).
  // n <= max_pages_per_seq pages (the room of the swap ids); prefix_tier:
  // host pages of prefix_host.
  absl::Status EnqueueSwapCopy(const std::vector<int32_t>& pages,
                               const std::vector<int32_t>& host_ids, bool to_host, Stream stream,
                               int* event, bool prefix_tier = false);

  // --- host tier of the prefix cache (prefix_host.cc)
  // Before n pages are allocated: with a host tier of the prefix cache,
  // evicts the cached pages those allocations would evict (least recently
  // used first) and demotes them (a page whose hash the host tier holds
  // only becomes its most recently used; the host tier drops its least
  // recently used pages for room, and keeps at most as many of a batch as
  // it can hold, the most recently used), copying them on the copy stream
  // after the work on `stream` and making `stream` wait for the copy; on
  // the CPU device the copy is done at once. Without a host tier: nothing
  // (Allocate evicts and drops). Call after every check of the caller
  // passed: it changes the pool. `writes_on_copy_stream`: the caller
  // allocates all n pages at once and writes them only on the copy stream
  // (SwapIn, a promotion), after the demotion copies that read them: then
  // `stream` does not wait.
  absl::Status DemoteForAllocation(int64_t n, Stream stream, bool writes_on_copy_stream = false);
  // The host page holding `hash`, or -1.
  int32_t HostLookup(const BlockHash& hash) const;
  // Empties the host tier of the prefix cache (no event: the caller's
  // kAllBlocksCleared covers it).
  void ClearHostPrefix();
  // The promotion of matched host pages (match_pages[i] < 0) of q into new
  // device pages; see KVCache::CreateSequenceFromPrefix.
  absl::Status PromoteInto(Sequence& q, absl::Span<const int32_t> prompt);
  // Pages of the match (prefix.match_*) that a promotion needs and fits:
  // trims the match before its first host page when it does not fit.
  void FitMatch();
  // Checks prefix_host's invariants (CheckInvariants).
  absl::Status CheckHostPrefix() const;
  // Promotions in flight (PrefixHostState::latest_event): whether `page`
  // was written by a promotion not known complete; advancing what is known
  // complete (a cudaEventQuery: no host wait); q holding the latest
  // promotion's event when `pages` (which it shares) hold such a page;
  // `stream` waiting for it when it is handed such a page to write (CUDA;
  // nothing on the CPU). The waits are device facts only: no decision of
  // the host depends on them.
  bool PromotionPending(int32_t page) const;
  void PollPromotions();
  void InheritPromotion(Sequence& q, absl::Span<const int32_t> pages);
  absl::Status OrderAfterPromotion(absl::Span<const int32_t> pages, Stream stream);

  // A new empty sequence (KVCache::CreateSequence).
  SequenceId NewSequence();

  // Drops the sequence's device page references (DropPages).
  void ReleasePages(Sequence& q);

  // Drops one reference of each page (in order): at once with one step
  // slot, or for a page held elsewhere too; otherwise the reference moves to
  // a retire entry of the current step (ready at PrepareStep step_serial +
  // step_slots), so that no step in flight sees its page reused.
  // `priority`: the retention priority the dropping holder gives the pages
  // (PagePool::RaisePriority).
  void DropPages(const int32_t* pages, size_t n, int priority = 0);
  // The released-page entry (the newest) that goes at step_serial `ready`.
  RetireEntry& HoldEntry(uint64_t ready);

  void FinishOut(SwapOutCopy& c);

  // Retires the entries of host.outs whose time has come (ready <=
  // step_serial; with in_prepare, also released pages with ready ==
  // step_serial + 1: PrepareStep calls it after waiting for the step that
  // last used its slot), in order: waits for a SwapOut copy (the copy has
  // had two whole steps to run: normally long done) and drops the pages.
  // SwapOut copies are ready after max(2, step_slots) PrepareSteps,
  // released pages after step_slots. The rule depends only on the calls,
  // never on when the copies or steps finish, so every rank of a
  // tensor-parallel group frees the same pages at the same call.
  void PollSwaps(bool in_prepare = false);

  // Retires every SwapOut copy now (waits for them).
  absl::Status WaitSwapOuts();

  // Retires every entry now: waits for the SwapOut copies and for the
  // latest step to complete (host syncs: only when pages are needed that
  // only these entries hold).
  absl::Status WaitRetiring();

  // The pages released-page entries hold that become free (*to_free) or
  // cached (*to_cached) when they go: all of them (due_only false) or those
  // a PrepareStep retires before its check (due_only true).
  void RetiringReleases(bool due_only, int64_t* to_free, int64_t* to_cached) const;
  // Device pages held only by released-page entries (Stats' pages_retiring).
  int64_t PagesRetiring() const;

  // Makes the stream of the latest step's slot record its `done` event if
  // it has not (CUDA, two or more slots).
  absl::Status RecordStepDone();

  // The device pages unfinished SwapOut copies will release that become
  // free (*to_free) or cached (*to_cached, indexed): those held only there.
  void PendingReleases(int64_t* to_free, int64_t* to_cached) const;

  int64_t PagesSwapPending() const;

  void DropSwapIn(Sequence& q);
  // A swapped-out sequence being released: its host pages go back; device
  // pages its SwapOut copy still reads go when that copy is done (the copy's
  // entry holds them). q is left not swapped, without pages.
  void ReleaseSwapped(Sequence& q);
  // Makes q hold host tier event `e` (a reference) as its swapin_event, or
  // keeps the one it holds when that one comes later in copy-stream order.
  void HoldCopyEvent(Sequence& q, int e);
  // Drops one reference of host tier event `e` (-1: none).
  void ReleaseEvent(int e);

  // Makes `stream` wait for everything enqueued on the copy stream so far
  // (before a kernel that rewrites the whole pool: a re-encode).
  absl::Status OrderAfterCopies(Stream stream);

  // Makes `stream` wait for the SwapIn copy that filled q's pages, if any.
  absl::Status OrderAfterSwapIn(const Sequence& q, Stream stream) const;

  // Tokens of swapped-out sequences, and one of them.
  int64_t SwappedTokens(SequenceId* any = nullptr) const;

  // Waits for unfinished SwapOut copies, then for the steps in flight, when
  // their pages are needed (the caller polled the finished ones at its
  // start); ResourceExhausted when n pages are not there.
  absl::Status MakeAvailable(int64_t n, const char* what);
  // Whether n pages are available now or once the SwapOut copies and the
  // retiring pages are waited for.
  bool WouldBecomeAvailable(int64_t n) const;

  // XXH3-64 of every layer's scales when the host knows them all.
  bool ScaleFingerprint(uint64_t* out) const;

  // True once every layer is settled (ScaleState::layer_settled): only then
  // are completed pages indexed. A layer the device has not calibrated holds
  // only bytes of all-zero rows (a nonzero row calibrates it before it is
  // written), which read the same under any scale; the rule exists so that
  // no page written before a layer's first calibrating write is shared.
  bool Calibrated();

  // The longest indexed prefix of `prompt` in whole pages, leaving at least
  // one token: their hashes and pages (into the given vectors): a device
  // page, else (pages -1) the host page of the prefix tier in `host`.
  void MatchPages(absl::Span<const int32_t> prompt, absl::string_view key,
                  std::vector<BlockHash>* hashes, std::vector<int32_t>* pages,
                  std::vector<int32_t>* host) const;

  // After a committed append of entry `e` to `q` (its slots at h_slots[tok0
  // ..]): records the token ids with the pages and queues the sequence when
  // pages were completed (FlushIndex hashes and indexes them).
  void CommitTokens(Sequence& q, const StepEntry& e, int64_t tok0);

  // Hashes the completed pages of the queued sequences and indexes them (one
  // kBlockStored event per run of consecutive newly indexed pages). Called
  // before anything reads the index or frees pages, so the index is as if
  // PrepareStep had done it.
  void FlushIndex();

  // The token ids recorded for a page (page_size of them).
  absl::Span<const int32_t> PageTokens(int32_t page) const;

  // Token ids of positions [first, first + ids.size()) of q (all appended):
  // InvalidArgument naming `what` and the position when one conflicts with a
  // known id (nothing written then), else records them and queues q for
  // indexing when ids became known for a whole page.
  absl::Status ApplyTokenIds(Sequence& q, int64_t first, absl::Span<const int32_t> ids,
                             const char* what);
  // Copies the token ids (and known flags) of page `from` to page `to`
  // (copy on write); nothing without prefix caching.
  void CopyPageTokens(int32_t from, int32_t to);
  // The token ids of an imported sequence q (all q.length of them, known):
  // recorded with its pages, and q queued for indexing as pages a step
  // completed are.
  void AdoptTokenIds(Sequence& q, const int32_t* ids);
  // Extends q's known-id prefix over positions whose ids are known and
  // queues q when that completed a page.
  void AdvanceKnownIds(Sequence& q);
  // Applies the device ids that are due (ready <= serial): waits for each
  // copy (normally long done). PrepareStep calls it.
  void ApplyPendingIds(uint64_t serial);

  void ClearPrefixIndex();
};

// InvalidArgument unless `v` is a valid global scale; names `name`[layer].
absl::Status CheckScale(float v, const char* name, int layer);

// Undoes the copy-on-write claims of a step check on every exit.
struct ClaimReset {
  KVCacheState& s;
  ~ClaimReset() {
    for (int32_t p : s.step.cow_src) s.step.claim[p] = 0;
  }
};

// Pass 1 of a step: checks the entries and counts the pages they need
// (copies included); changes nothing but scratch (marks, claims, cow_src,
// cow_entry, step_seqs). The caller holds a ClaimReset.
absl::Status CheckStepEntries(KVCacheState& s, absl::Span<const StepEntry> entries,
                              int64_t* need_out);

// Loads every kernel the cache launches itself on the current device
// (create.cc; docs/kv_cache.md, "Kernels are loaded at Create").
absl::Status LoadCacheKernels(const Recipe& recipe);

// What a call on a moved-from KVCache returns.
absl::Status MovedFrom();

}  // namespace internal
}  // namespace fp4kv

// Returns FailedPrecondition from a KVCache member function of a moved-from
// cache.
#define FP4KV_KV_RETURN_IF_MOVED_FROM()                           \
  do {                                                            \
    if (state_ == nullptr) return ::fp4kv::internal::MovedFrom(); \
  } while (0)

#endif  // FP4KV_SRC_KV_CACHE_STATE_H_
