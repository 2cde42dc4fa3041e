// KVCache: the stateful NVFP4 KV cache of a whole model.
//
// It owns the page pools of every layer (K and V packed data and block scales,
// allocated once at Create), the per-layer global scales (in device memory, so
// a captured CUDA graph reads updates), a reference-counted page allocator,
// the sequences and their block tables, and fixed-address step buffers that
// hold the metadata of one step.
//
// One step (the hot path):
//
//   PrepareStep({{seq, n_new}, ...}, stream)  // host: pages, indices; async upload
//   for layer in 0..L-1:                      // capturable once as a CUDA graph
//     appender.Run(layer, k_new, v_new, stream)
//     materializer.Run(layer, fp8_workspace, stream)   (and/or dequantizer.Run)
//     <server's attention kernel reads the step views>
//
// Ordering contract: the Run() calls of a step go on the stream given to its
// PrepareStep (or a stream synchronized with it), and every step uses the
// same stream. PrepareStep enqueues its uploads (and any copy-on-write page
// copies) on that stream, so they run after the previous step's kernels and
// before this step's. The pinned staging buffer is reused: PrepareStep first
// waits for the previous step's upload (an event recorded right after it,
// normally long done), then rewrites it.
//
// Two steps in flight (KVCacheOptions::step_slots = 2; docs/kv_cache.md):
// the host prepares step N+1 while the device runs step N. Each step slot
// has its own step buffers and staging; PrepareStep fills them round robin
// (StepInfo::slot), waits only for the step that last used the slot it
// fills, orders its stream after the previous step's, and reuses a released
// page only at PrepareStep N + step_slots (N: the latest step when it was
// released), or after waiting for the steps in flight when the pool would
// otherwise run out. Bound ops run on a slot with ForSlot(slot), one
// captured graph per slot. Token ids of appended tokens may come later
// (SetTokenIds, also from device memory without a sync).
//
// Graph capture: the step buffers have fixed addresses and capacity-sized
// shapes (max_seqs_per_step rows, max_tokens_per_step slots; unused slots are
// -1 and unused rows have seq_len 0 and a repeated kv_page_indptr), so the
// kernels' launch shapes depend only on the capacities and a step captured
// once replays correctly for later steps with other sequences and lengths.
// A captured graph also bakes in the K/V input buffers and the FP8 workspace:
// the server must reuse the same buffers (of capacity size) at every replay.
//
// CPU device: the same cache lives in host memory, the step buffers are the
// staging buffers (nothing is copied), and every op runs synchronously
// through the CPU reference; streams are ignored.
//
// Thread safety: none; calls on one cache must be serialized by the caller.
// The bound op objects (appender(), materializer(), dequantizer()) may be used
// from any thread while no mutating cache call runs.
#ifndef FP4KV_KV_CACHE_H_
#define FP4KV_KV_CACHE_H_

#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "fp4kv/attention.h"
#include "fp4kv/format.h"
#include "fp4kv/geometry.h"
#include "fp4kv/kv_events.h"
#include "fp4kv/ops.h"
#include "fp4kv/sequence_image.h"
#include "fp4kv/tensor.h"

namespace fp4kv {

class Calibrator;  // calibrate.h

// Names a sequence of a KVCache. Ids are never reused: a released id stays
// invalid (NotFound) forever. 0 is never a valid id.
using SequenceId = uint64_t;

// One sequence of a step and how many new tokens it appends (0 is allowed:
// the sequence is then only read by the step's kernels).
struct StepEntry {
  SequenceId seq = 0;
  int32_t num_new_tokens = 0;
  // With prefix caching: the ids of the new tokens (num_new_tokens of them),
  // read during the call only. Pages the step completes are hashed and
  // indexed by the next call that reads the index (CreateSequenceFromPrefix,
  // MatchPrefix, Release, Truncate, Fork, TakeEvents, Stats, ...); a sequence
  // sharing them must run its kernels after this step's appends, which stream
  // order gives. Empty: the ids are not known yet (a sampled token still on
  // the device); KVCache::SetTokenIds gives them later, and a page is hashed
  // and shared only once the ids of all its tokens (and of every earlier
  // one) are known. A sequence whose ids never come is never cached, but
  // stays tracked. Ignored without prefix caching.
  absl::Span<const int32_t> token_ids = {};
};

// What PrepareStep did; host values, valid until the next PrepareStep.
struct StepInfo {
  int slot = 0;                     // the step slot it filled (KVCacheOptions::step_slots)
  int num_seqs = 0;                 // rows used in the step buffers
  int64_t num_tokens = 0;           // new K/V rows the appender reads
  int32_t max_seq_len = 0;          // longest sequence after the append
  int64_t num_pages = 0;            // kv_page_indptr[num_seqs]: pages the step reads
  int64_t fp8_workspace_pages = 1;  // out pages the materializer writes: 1 + num_pages
  int64_t pages_allocated = 0;      // new pages taken from the pool (including copies)
  int64_t pages_copied = 0;         // shared partial pages copied on write
  int64_t pages_evicted = 0;        // of pages_allocated, cached pages evicted
};

// Device views of the step buffers (on the cache's device, fixed addresses).
// Rows [0, num_seqs) are the step's entries in order; their new K/V rows are
// token_indptr[b] .. token_indptr[b+1] of the appender's input.
struct StepViews {
  TensorView slot_mapping;    // [max_tokens_per_step] i64; -1 = padding
  TensorView block_tables;    // [max_seqs_per_step, max_pages_per_seq] i32 (K and V share pages)
  TensorView seq_lens;        // [max_seqs_per_step] i32, length after the append; 0 = unused row
  TensorView kv_page_indptr;  // [max_seqs_per_step + 1] i32, prefix sum of ceil(seq_len/page_size)
  TensorView token_indptr;    // [max_seqs_per_step + 1] i32, prefix sum of num_new_tokens
  TensorView
      fp8_block_tables;  // [max_seqs_per_step, max_pages_per_seq] i32, written by the materializer
};

struct KVCacheStats {
  int64_t pages_total = 0;
  int64_t pages_free = 0;    // on the free list
  int64_t pages_used = 0;    // referenced by a sequence, an import reservation, an
                             // unfinished SwapOut or retiring (pages_retiring):
                             // pages_total - pages_free - pages_cached
  int64_t pages_shared = 0;  // used pages referenced by more than one sequence
  int64_t num_sequences = 0;
  int64_t tokens_stored = 0;    // sum of sequence lengths (shared prefixes counted per sequence)
  int64_t tokens_resident = 0;  // token slots holding data (shared pages counted once)
  int64_t wasted_slots = 0;     // pages_used * page_size - tokens_resident
  double bytes_per_token = 0;   // all layers, K and V, data and scales
  int64_t pool_bytes = 0;       // bytes of all pools (data and scales, all layers)
  // Sizing at Create (docs/kv_cache.md, "Allocation and budget rules"): the
  // bytes the pools' device (host memory for Device::Cpu()) had available
  // then, and whether memory_budget_bytes asked for more than a budget may
  // take of them (15/16, less the step buffers and tables): the pools were
  // then sized by what was available (pages_total, pool_bytes).
  int64_t memory_available_at_create = 0;
  bool memory_budget_clamped = false;
  std::vector<std::pair<SequenceId, int64_t>> sequence_lengths;  // by id
  // Prefix caching (all 0 when off).
  int64_t pages_cached = 0;         // in the index, held by no sequence: evictable
  int64_t pages_indexed = 0;        // in the index (cached or used)
  int64_t evictions = 0;            // cached pages evicted for an allocation, ever
  int64_t prefix_queries = 0;       // CreateSequenceFromPrefix calls
  int64_t prefix_query_tokens = 0;  // prompt tokens they asked about
  int64_t prefix_hit_tokens = 0;    // of those, tokens reused from the cache
  double prefix_hit_rate = 0;       // prefix_hit_tokens / prefix_query_tokens (0 when none)
  // Host tier of the prefix cache (PrefixCacheOptions::host_bytes; 0 when off).
  int64_t host_prefix_pages_total = 0;
  int64_t host_prefix_pages_cached = 0;  // holding demoted pages (the rest are free)
  int64_t host_prefix_bytes = 0;         // of its host pool
  int64_t host_prefix_demotions = 0;     // device pages copied to the host tier, ever
  int64_t host_prefix_promotions = 0;    // host pages copied back into device pages, ever
  int64_t host_prefix_evictions = 0;     // host pages dropped for room, ever
  int64_t prefix_hit_tokens_host = 0;    // of prefix_hit_tokens, tokens promoted from the host
  int64_t events_pending = 0;       // queued for TakeEvents
  int64_t events_dropped = 0;       // lost to a full queue, ever
  // Export and import.
  int64_t pages_reserved = 0;       // held by import reservations (counted in pages_used)
  int64_t reservations = 0;         // open import reservations
  int64_t bytes_exported = 0;       // image bytes written by ExportSequence, ever
  int64_t bytes_imported = 0;       // image bytes read by CommitImport, ever
  // Host tier (KVCacheOptions::host_tier; all 0 when off).
  int64_t host_pages_total = 0;
  int64_t host_pages_free = 0;
  int64_t host_pages_used = 0;      // holding swapped-out sequences
  int64_t host_bytes = 0;           // of the pinned host pool
  int64_t sequences_swapped = 0;    // swapped out (also while the copy is in flight)
  int64_t swaps_in_flight = 0;      // SwapOut copies not yet retired (see SwapOut)
  // Two or more step slots: used pages that only released references hold
  // until the steps that may still use them are done (PrepareStep, "Page
  // reuse"); 0 with one slot.
  int64_t pages_retiring = 0;
  int64_t token_ids_pending = 0;    // ids given as device views, not yet applied
  int64_t token_ids_dropped = 0;    // of those, ids that could not apply, ever (SetTokenIds)
  int64_t pages_swap_pending = 0;   // device pages those copies still hold
  int64_t bytes_swapped_out = 0;    // device -> host, ever
  int64_t bytes_swapped_in = 0;     // host -> device, ever
};

// Prefix caching (docs/kv_cache.md, "Prefix caching"): full pages of
// sequences whose token ids are known are content-hashed and indexed; pages
// of released or truncated sequences stay cached (evictable, least recently
// used first) and are shared by later sequences with the same prefix.
struct PrefixCacheOptions {
  bool enabled = false;
  // Bound of the KV event queue (TakeEvents), 0 .. 2^24; 0: no events are
  // kept.
  int64_t max_pending_events = 0;
  // A host tier for the prefix cache (docs/kv_cache.md, "Prefix pages in
  // host memory"): bytes of host memory (pinned on CUDA) for cached pages.
  // 0 (the default): an evicted cached page is dropped. Otherwise a cached
  // page that an allocation evicts is demoted: its bytes (every layer, K and
  // V, data and scales), hash and token ids are copied into a host page
  // (batched copies on the cache's copy stream, ordered before anything
  // rewrites the device page), and the host tier drops its least recently
  // used page when full. CreateSequenceFromPrefix promotes host pages back.
  // The most whole pages that fit are kept; at least one page's bytes.
  // Requires `enabled`.
  int64_t host_bytes = 0;
};

// The pinned host tier of a cache (SwapOut / SwapIn; docs/kv_cache.md,
// "Host tier"): host pages of the cache's page size (every layer, K and V,
// data and scales), allocated at Create with cudaHostAlloc (mapped) on CUDA
// and plain memory on the CPU. Give host_pages or host_bytes (the most whole
// pages that fit), not both; 0 and 0 (the default): no host tier.
struct HostTierOptions {
  int64_t host_pages = 0;
  int64_t host_bytes = 0;
};

struct KVCacheOptions {
  int num_layers = 0;
  // Heads, head dims, page size and layout of every layer. num_pages == 0:
  // derived from memory_budget_bytes (exactly one of the two must be given).
  // geometry.key_format picks how keys are stored (values are always NVFP4):
  // KeyFormat::kNvfp4 (the default) or KeyFormat::kFp8, one E4M3 byte per key
  // value under the layer's key scale g_k (docs/format.md, "FP8 key pages").
  // With FP8 keys there is no key scale pool, so a token costs
  // H * (Dk + Dv / 2 + Dv / 16) bytes per layer instead of
  // H * (Dk + Dv) * 9 / 16 (Stats().bytes_per_token, pool_bytes and the
  // pages a memory budget buys say so); the first-append calibration gives
  // g_k = MakeFp8KeyScale(calibration_headroom * amax), explicit scales are
  // used as g_k, the key FP8 (materialize) scale is g_k itself (key pages are
  // copied), LayerCache() returns a PagedCache::Fp8Keys view, and
  // UpdateGlobalScales(kReencode) re-encodes the key bytes.
  // CalibrateGlobalScales sets g_k = MakeFp8KeyScale(amax). Sequence images
  // carry the key format (ExportSequence); an image imports only into a
  // cache of the same key format.
  CacheGeometry geometry;
  // Bytes for all pools of all layers. A budget beyond what the device (host
  // memory for Device::Cpu()) has available at Create is clamped to 15/16 of
  // that, less the step buffers and tables (Stats().memory_budget_clamped):
  // INT64_MAX means "what there is". Given num_pages that do not fit are
  // refused (ResourceExhausted with the bytes asked and available).
  int64_t memory_budget_bytes = 0;
  Device device = Device::Cpu();
  Recipe recipe;  // fixed for the life of the cache
  // Global decode scales per layer ([num_layers] each, positive, finite),
  // e.g. from a calibrated checkpoint (docs/recipes.md, "Choosing global
  // scales"); they take precedence. Empty (the default): every layer's K (or
  // V) scale is calibrated on the device from the first nonzero rows the
  // cache's appender stores in that layer, before they are quantized:
  //   g = MakeGlobalScale(calibration_headroom * amax, recipe)
  // so tokens up to calibration_headroom times larger than the first ones
  // still fit without saturating. Until then (no rows, or only zeros) the
  // layer is "pending" (LayerScales::k_calibrated false).
  std::vector<float> k_global_scales;
  std::vector<float> v_global_scales;
  float calibration_headroom = 4.0f;  // finite, >= 1
  // The appender counts, per layer, blocks stored with a saturated or an
  // underflowed block scale (ReadScaleEvents). Off costs nothing.
  bool count_scale_events = false;
  // Step capacities: they fix the shapes of the step buffers.
  int max_seqs_per_step = 256;
  int max_tokens_per_step = 8192;
  // Longest sequence: max_pages_per_seq * page_size tokens. 0 (the default):
  // min(num_pages, ceil(32768 / page_size)), sequences of up to 32768 tokens
  // (options() reports the value chosen). It sizes the step block tables
  // (max_seqs_per_step * max_pages_per_seq i32) and the FP8 workspace.
  int max_pages_per_seq = 0;
  // Step slots, 1 .. 8 (docs/kv_cache.md, "Two steps in flight"). 1 (the
  // default): one set of step buffers, rewritten by every PrepareStep (the
  // previous step's kernels must have been enqueued). 2: the host prepares
  // step N+1 while the device runs step N; each slot has its own
  // fixed-address step buffers and staging (a graph captured per slot
  // replays while the other slot is prepared), PrepareStep fills the slots
  // round robin, and released pages are reused only once no step in flight
  // can use them (PrepareStep, "Page reuse").
  int step_slots = 1;
  PrefixCacheOptions prefix_cache;  // off by default
  HostTierOptions host_tier;        // off by default
};

// What MatchPrefix found: the longest cached prefix of whole pages.
struct PrefixMatch {
  int64_t tokens = 0;           // pages * page_size: tokens_gpu + tokens_host
  int64_t pages = 0;
  int64_t pages_evictable = 0;  // of them, cached pages that reuse takes off the LRU
  // With a host tier of the prefix cache (PrefixCacheOptions::host_bytes):
  // the matched pages held in device pages, and those held in host pages
  // (promoted into newly allocated device pages by CreateSequenceFromPrefix).
  int64_t tokens_gpu = 0;
  int64_t tokens_host = 0;
  int64_t pages_host = 0;
};

// A sequence made by CreateSequenceFromPrefix.
struct PrefixSequence {
  SequenceId seq = 0;
  int64_t cached_tokens = 0;  // its length: tokens reused; prefill the rest of the prompt
  int64_t host_tokens = 0;    // of them, tokens promoted from the host tier of the prefix cache
};

// What a step would do (KVCache::PlanStep), computed without changing
// anything.
struct StepPlan {
  bool fits = false;            // PrepareStep would succeed (barring CUDA errors)
  int64_t pages_needed = 0;     // new pages, copies included
  int64_t pages_copied = 0;     // shared partial pages it would copy
  // Free and cached now, with the retiring pages that PrepareStep would
  // retire before its check (two or more step slots).
  int64_t pages_free = 0;
  int64_t pages_evictable = 0;
  int64_t pages_evicted = 0;    // cached pages it would evict
  // Device pages of unfinished SwapOut copies that become free or cached
  // once the copies are done (PrepareStep waits for them when it needs them).
  int64_t pages_swap_pending = 0;
  // Two or more step slots: released pages that become free or cached at a
  // later PrepareStep (this one waits for the steps in flight when it needs
  // them; pages it retires before its check count as free or cached above).
  int64_t pages_retiring = 0;
  // Pages, and tokens in whole pages, still available after the step (0
  // when it does not fit): what further admissions can count on.
  int64_t pages_left = 0;
  int64_t tokens_left = 0;
};

// Retention priorities of cached pages (KVCache::SetRetentionPriority):
// 0 .. kMaxRetentionPriority.
constexpr int kMaxRetentionPriority = 3;

class KVCache;
namespace internal {
class KVCacheState;
struct CacheAttentionPlan;  // src/kv_cache/bound_ops.cc
}  // namespace internal

// The Appender of a cache (AppendIndexing::kSlot on the step's slot_mapping).
class CacheAppender {
 public:
  // Not bound to a cache: Run() returns FailedPrecondition. Assign one from
  // the KVCache accessor (the type is copyable and movable, so it can be a
  // member). A bound op shares no ownership of its cache: once the cache is
  // destroyed, Run() returns FailedPrecondition instead of touching it.
  CacheAppender() = default;
  // key: [R, H, Dk], value: [R, H, Dv] (input dtype of appender()), rows
  // 0 .. num_tokens-1 of the current step in the order of its entries; R >=
  // the step's num_tokens and rows past it are ignored (R = max_tokens_per_step
  // for a buffer that serves every step, as graph capture needs). Quantizes
  // with the layer's global scales from device memory. While a layer's K or
  // V scale is pending (KVCacheOptions::k_global_scales), a small kernel
  // first calibrates it from these rows on the device; the host stops
  // enqueuing it once it sees the calibration done (a mapped flag, no sync),
  // and a graph captured while pending carries it as a no-op after the first
  // nonzero rows. Graph-safe.
  absl::Status Run(int layer, const TensorView& key, const TensorView& value,
                   Stream stream = nullptr) const;
  const Appender& op() const { return op_; }
  // The same op bound to step slot `slot` (KVCacheOptions::step_slots):
  // Run() reads that slot's step buffers and checks its arguments against
  // the step that last filled the slot, whichever step is the latest (for a
  // graph captured per slot). The op of an accessor (slot -1) runs on the
  // latest step's slot. InvalidArgument outside [0, step_slots);
  // FailedPrecondition for an op not bound to a live cache.
  absl::StatusOr<CacheAppender> ForSlot(int slot) const;
  int slot() const { return slot_; }

 private:
  friend class KVCache;
  CacheAppender(std::weak_ptr<internal::KVCacheState> state, Appender op)
      : state_(std::move(state)), bound_(true), op_(std::move(op)) {}
  // Expires with the cache; not const: a Run records its append with the
  // cache's scales (the scale-change rule counts the tokens it wrote).
  std::weak_ptr<internal::KVCacheState> state_;
  bool bound_ = false;
  int slot_ = -1;  // -1: the latest step's slot
  Appender op_;
};

// The Materializer of a cache: writes the step's sequences as FP8 pages.
class CacheMaterializer {
 public:
  // Not bound to a cache: Run() returns FailedPrecondition. Assign one from
  // the KVCache accessor (the type is copyable and movable, so it can be a
  // member). A bound op shares no ownership of its cache: once the cache is
  // destroyed, Run() returns FailedPrecondition instead of touching it.
  CacheMaterializer() = default;
  // out: [W, 2, H, page_size, D] e4m3 (u8 accepted), caller-owned, with W >=
  // the step's fp8_workspace_pages (W = KVCache::Fp8WorkspacePagesAtCapacity()
  // serves every step). Writes the cache's fp8_block_tables step buffer; FP8
  // decode scales are the cache's (KVCache::fp8_scale_ptr). Graph-safe; a
  // replayed graph whose W is below a later step's need drops the pages past
  // W (the op's defined behaviour), so capture with the capacity.
  absl::Status Run(int layer, const TensorView& out, Stream stream = nullptr) const;
  const Materializer& op() const { return op_; }
  // The same op bound to step slot `slot` (KVCacheOptions::step_slots):
  // Run() reads that slot's step buffers and checks its arguments against
  // the step that last filled the slot, whichever step is the latest (for a
  // graph captured per slot). The op of an accessor (slot -1) runs on the
  // latest step's slot. InvalidArgument outside [0, step_slots);
  // FailedPrecondition for an op not bound to a live cache.
  absl::StatusOr<CacheMaterializer> ForSlot(int slot) const;
  int slot() const { return slot_; }

 private:
  friend class KVCache;
  CacheMaterializer(std::weak_ptr<const internal::KVCacheState> state, Materializer op)
      : state_(std::move(state)), bound_(true), op_(std::move(op)) {}
  std::weak_ptr<const internal::KVCacheState> state_;  // expires with the cache
  bool bound_ = false;
  int slot_ = -1;  // -1: the latest step's slot
  Materializer op_;
};

// The Dequantizer of a cache: gathers the step's sequences into contiguous
// f16/bf16 tensors.
class CacheDequantizer {
 public:
  // Not bound to a cache: Run() returns FailedPrecondition. Assign one from
  // the KVCache accessor (the type is copyable and movable, so it can be a
  // member). A bound op shares no ownership of its cache: once the cache is
  // destroyed, Run() returns FailedPrecondition instead of touching it.
  CacheDequantizer() = default;
  // k_out: [B, T, H, Dk], v_out: [B, T, H, Dv] with num_seqs <= B <=
  // max_seqs_per_step and T >= the step's max_seq_len; row b is the step's
  // entry b. Positions past a sequence's length are left unchanged. Graph-safe.
  absl::Status Run(int layer, const TensorView& k_out, const TensorView& v_out,
                   Stream stream = nullptr) const;
  const Dequantizer& op() const { return op_; }
  // The same op bound to step slot `slot` (KVCacheOptions::step_slots):
  // Run() reads that slot's step buffers and checks its arguments against
  // the step that last filled the slot, whichever step is the latest (for a
  // graph captured per slot). The op of an accessor (slot -1) runs on the
  // latest step's slot. InvalidArgument outside [0, step_slots);
  // FailedPrecondition for an op not bound to a live cache.
  absl::StatusOr<CacheDequantizer> ForSlot(int slot) const;
  int slot() const { return slot_; }

 private:
  friend class KVCache;
  CacheDequantizer(std::weak_ptr<const internal::KVCacheState> state, Dequantizer op)
      : state_(std::move(state)), bound_(true), op_(std::move(op)) {}
  std::weak_ptr<const internal::KVCacheState> state_;  // expires with the cache
  bool bound_ = false;
  int slot_ = -1;  // -1: the latest step's slot
  Dequantizer op_;
};

// A layer's scales as the device holds them (KVCache::ReadScales).
struct LayerScales {
  float k = 0, v = 0;          // global decode scales
  float k_fp8 = 0, v_fp8 = 0;  // FP8 decode scales of materialized pages
  bool k_calibrated = false;   // false: waiting for the first nonzero K rows
  bool v_calibrated = false;
};

// Blocks the appender stored in one layer with a block scale that saturated
// at the E4M3 maximum (values clipped: the global scale is too small) or
// that underflowed to zero although the block was nonzero (stored as zeros:
// the global scale is too large). See format.h ClassifyBlockScale.
struct ScaleEventCounts {
  uint64_t k_saturated = 0, k_underflow = 0;
  uint64_t v_saturated = 0, v_underflow = 0;
};

// Options of a cache's attention (KVCache::attention); the geometry,
// capacities and table dtype come from the cache.
struct CacheAttentionOptions {
  int num_qo_heads = 0;            // a positive multiple of the cache's num_kv_heads
  DType dtype = DType::kBF16;      // of q and out
  // Capacity of new tokens per entry, 1 .. kMaxAttentionQLen: decode rows,
  // speculative rows and prefill chunks over a cached prefix alike (> 1: q
  // rows follow the step's token_indptr). On CUDA, entries of at most
  // kDecodeRowsQLen tokens run on the decode kernels, longer ones on the
  // prefill kernel, in the same Run().
  int max_q_len = 1;
  float sm_scale = 0.0f;           // 0: 1 / sqrt(head_dim_k)
  float logits_soft_cap = 0.0f;    // 0: off
  int window_left = -1;            // -1: off
  bool has_sinks = false;
  bool write_lse = false;
};

// DecodeAttention over the current step's sequences, reading the layer's
// NVFP4 pages directly (attention.h has the math and the defined behaviour).
class CacheAttention {
 public:
  // Not bound to a cache: Run() returns FailedPrecondition. Assign one from
  // the KVCache accessor (the type is copyable and movable, so it can be a
  // member). A bound op shares no ownership of its cache: once the cache is
  // destroyed, Run() returns FailedPrecondition instead of touching it.
  CacheAttention() = default;
  // q: [R, Hq, Dk], out: [R, Hq, Dv] (dtype of the options). max_q_len == 1:
  // row b is the step's entry b, num_seqs <= R <= max_seqs_per_step (R =
  // max_seqs_per_step serves every step; rows past num_seqs have seq_len 0
  // and are not written). max_q_len > 1: the rows are the step's new tokens
  // in order (query rows of entry b = token_indptr[b] .. [b+1], the same
  // rows the appender read), R >= num_tokens; every entry may add at most
  // max_q_len tokens (checked here; a replayed graph clamps instead, see
  // attention.h). lse [R, Hq] f32 iff write_lse; sinks [Hq] f32 iff
  // has_sinks. workspace: WorkspaceBytes() bytes on the cache's device.
  // Run after the step's append of this layer, on the same stream.
  // Graph-safe.
  absl::Status Run(int layer, const TensorView& q, const TensorView& out, void* workspace,
                   int64_t workspace_bytes, Stream stream = nullptr,
                   const TensorView& lse = TensorView(), const TensorView& sinks = TensorView()) const;
  int64_t WorkspaceBytes() const { return op_.WorkspaceBytes(); }
  const DecodeAttention& op() const { return op_; }
  // The same op bound to step slot `slot` (KVCacheOptions::step_slots):
  // Run() reads that slot's step buffers and checks its arguments against
  // the step that last filled the slot, whichever step is the latest (for a
  // graph captured per slot). The op of an accessor (slot -1) runs on the
  // latest step's slot. InvalidArgument outside [0, step_slots);
  // FailedPrecondition for an op not bound to a live cache.
  absl::StatusOr<CacheAttention> ForSlot(int slot) const;
  int slot() const { return slot_; }

 private:
  friend class KVCache;
  CacheAttention(std::weak_ptr<const internal::KVCacheState> state, DecodeAttention op,
                 std::shared_ptr<const internal::CacheAttentionPlan> plan)
      : state_(std::move(state)), bound_(true), op_(std::move(op)), plan_(std::move(plan)) {}
  std::weak_ptr<const internal::KVCacheState> state_;  // expires with the cache
  bool bound_ = false;
  int slot_ = -1;  // -1: the latest step's slot
  DecodeAttention op_;
  // What bind time settled per layer (the TMA tensor maps of its pools).
  std::shared_ptr<const internal::CacheAttentionPlan> plan_;
};

// Invariants: every page is free (reference count 0), cached (reference
// count 0, in the prefix index, evictable) or referenced by the sequences
// that hold it in their block tables, and by no other; a sequence of length
// n holds exactly ceil(n / page_size) pages; pages are written only through
// a sequence that is their sole owner and never while indexed (a shared
// partial last page is copied first; an indexed one leaves the index);
// pages_free + pages_cached + pages_used == pages_total.
// A call that returns an error changes nothing (but see PrepareStep on CUDA
// errors).
//
// A moved-from KVCache holds nothing: every call that returns a Status or
// StatusOr returns FailedPrecondition, the accessors return empty values
// (spans, views, null pointers, default options and stats). Assigning a live
// cache to it makes it usable again.
class KVCache {
 public:
  // Validates the options and allocates everything: pools (one allocation),
  // step buffers (one device allocation, one pinned host allocation), the
  // allocator and an event. Errors: InvalidArgument naming the option;
  // FailedPrecondition for a CUDA device that is not there; ResourceExhausted
  // when the allocation fails.
  static absl::StatusOr<KVCache> Create(const KVCacheOptions& options);

  KVCache(KVCache&&) noexcept;
  KVCache& operator=(KVCache&&) noexcept;
  KVCache(const KVCache&) = delete;
  KVCache& operator=(const KVCache&) = delete;
  ~KVCache();

  // ----------------------------------------------------------- sequences
  // A new empty sequence (with prefix caching: tracked, with an empty extra
  // key; its full pages are cached when its steps give token ids).
  // FailedPrecondition on a moved-from cache.
  absl::StatusOr<SequenceId> CreateSequence();
  // With prefix caching: a new sequence that shares the longest cached
  // prefix of `prompt` in whole pages (MatchPrefix) and has that length;
  // the server prefills the rest of the prompt (at least its last token,
  // whose logits it needs: a prompt is never matched in full). `extra_key`
  // names what else determines the K/V of these tokens (adapter, multimodal
  // content hash, a per-tenant salt): only pages stored under the same key
  // match. Counts in Stats' prefix queries. FailedPrecondition when prefix
  // caching is off.
  // Host tier of the prefix cache: matched pages held in host pages are
  // promoted into newly allocated device pages (which may evict, and so
  // demote, other cached pages): one batched copy on the copy stream after
  // the work on the latest step's stream; the sequence's first step (or
  // read, export) makes its stream wait for it, and so does the next
  // PrepareStep. All or nothing: when the free and evictable pages do not
  // cover the promotion, the match ends before its first host page.
  absl::StatusOr<PrefixSequence> CreateSequenceFromPrefix(absl::Span<const int32_t> prompt,
                                                          absl::string_view extra_key = {});
  // How much of `prompt` CreateSequenceFromPrefix would reuse now: whole
  // pages, at most (prompt.size() - 1) / page_size and max_pages_per_seq of
  // them. Changes nothing (no recency, no stats; pages that earlier steps
  // completed are indexed first, as if by those steps: docs/kv_cache.md).
  // Zero when caching is off. With a host tier of the prefix cache, the
  // match is split into tokens_gpu and tokens_host, and ends before its
  // first host page when the promotion would not fit (as
  // CreateSequenceFromPrefix does).
  PrefixMatch MatchPrefix(absl::Span<const int32_t> prompt,
                          absl::string_view extra_key = {}) const;
  // A child holding the parent's tokens: it shares every page of the parent
  // (reference counts go up; no data is copied now). A shared partially
  // filled last page is copied on the device when either side appends to it.
  // NotFound for an unknown parent.
  absl::StatusOr<SequenceId> ForkSequence(SequenceId parent);
  // Shortens a sequence to new_len tokens (e.g. rejected speculative tokens);
  // pages past the new end lose this sequence's reference. NotFound for an
  // unknown id; InvalidArgument unless 0 <= new_len <= length.
  absl::Status Truncate(SequenceId seq, int64_t new_len);
  // Drops the sequence and its page references. NotFound for an unknown or
  // already released id. The current step's buffers still name its pages:
  // release it only after the kernels of the step that used it are enqueued.
  absl::Status ReleaseSequence(SequenceId seq);

  // A new sequence holding `length` tokens of a cache prefilled elsewhere:
  // layers[l] is layer l's unquantized paged K/V (f16/bf16, the cache's
  // heads, head dims and page size; either layout or form, HalfPagedCache),
  // and the sequence's tokens are in its pages src_pages[0 ..
  // ceil(length / page_size)) (host ids, entries past `length` in the last
  // page ignored). Every layer is quantized into newly allocated pages on
  // `stream` (PagedCacheQuantizer, bytes as if the rows had been appended).
  // Scales follow the cache's rules: a layer with scales (given at Create,
  // set or calibrated) uses them; a pending layer's K (V) scale is calibrated
  // on the device from the imported rows first, exactly like a first append
  // (calibration_headroom; all-zero rows leave it pending). All or nothing:
  // every argument is checked (InvalidArgument naming it; ResourceExhausted
  // when the free pages do not suffice) before anything changes. CUDA: the
  // host page ids are copied to a stream-ordered temporary, so this is not
  // for graph capture; the sources must stay valid until the stream gets
  // there. The current step's buffers are not touched. With prefix caching
  // on, the new sequence is not prefix-tracked (its token ids are unknown):
  // its pages, later ones included, are never indexed.
  // (ImportSequence, below, imports a sequence image instead.)
  absl::StatusOr<SequenceId> ImportHalfPages(absl::Span<const HalfPagedCache> layers,
                                             absl::Span<const int32_t> src_pages, int64_t length,
                                             Stream stream = nullptr);

  // ------------------------------------------------- export and import
  // A sequence image (include/fp4kv/sequence_image.h, docs/format.md
  // "Sequence images") holds one sequence's pages (whole pages: a partial
  // last page's unused slots travel too), the source's scales and, with
  // prefix caching, its token ids and page hashes. Not graph-capturable.
  //
  // The size of `seq`'s image. NotFound for an unknown sequence.
  absl::StatusOr<int64_t> ExportedBytes(SequenceId seq) const;
  // Writes `seq`'s image to dst (16-byte aligned, dst_bytes >= ExportedBytes)
  // on `stream`: device memory of the cache's device, pinned host memory
  // (written by one kernel through its mapped address) or pageable host
  // memory (per-page copies that block the host) on CUDA; host memory on the
  // CPU (synchronous). The host-known parts (header, tokens section) are
  // written by the host during the call for a host destination, by copies
  // staged during the call for a device one; the scale table and the pages
  // by work on `stream`, after the work already enqueued there. Uses a fixed
  // device table of page ids: exports and imports must all use one stream
  // (as ReadSequence). Errors (nothing written): NotFound; FailedPrecondition
  // for a swapped-out sequence; InvalidArgument naming dst or dst_bytes.
  absl::Status ExportSequence(SequenceId seq, void* dst, int64_t dst_bytes,
                              Stream stream = nullptr) const;
  // Two-phase import. ReserveImport checks that the image fits this cache
  // (InvalidArgument naming the differing field: layers, heads, head dims,
  // page size, layout, recipe, key format; InvalidArgument past
  // max_pages_per_seq) and takes its pages (ResourceExhausted when free and
  // evictable pages do not suffice; nothing changes). The pages count in
  // Stats' pages_reserved and pages_used; no sequence exists yet.
  absl::StatusOr<ImportReservation> ReserveImport(const SequenceImageHeader& header);
  // Fills the reserved pages from `image` (the image whose header was
  // reserved; the header is compared when the image is host memory) on
  // `stream` and makes them a new sequence of the image's length. Scales per
  // layer: equal to the image's: bytes copied; a pending target layer that
  // holds no tokens adopts the image's scales and calibrated flags (device
  // copies, no sync); otherwise options.on_scale_mismatch (StoredTokens).
  // With prefix caching, an image with tokens makes a tracked sequence whose
  // full pages are indexed (once every layer is calibrated), like appended
  // ones; a device image's tokens section is read with a synchronous copy.
  // The image must stay valid until the stream gets there. On error the
  // reservation is cancelled and nothing else changed: InvalidArgument
  // (reservation of another cache or already used; image, image_bytes),
  // FailedPrecondition (scales differ under kRefuse), DataLoss (the tokens
  // section's hashes do not match its token ids).
  absl::StatusOr<SequenceId> CommitImport(ImportReservation reservation, const void* image,
                                          int64_t image_bytes, const ImportOptions& options = {},
                                          Stream stream = nullptr);
  // Frees the reservation's pages; changes nothing else. InvalidArgument
  // for a reservation of another cache or one already used.
  absl::Status CancelImport(ImportReservation reservation);
  // ParseSequenceImageHeader + ReserveImport + CommitImport. The header of
  // a device image is read with one small synchronous copy (after the work
  // on `stream`).
  absl::StatusOr<SequenceId> ImportSequence(const void* image, int64_t image_bytes,
                                            const ImportOptions& options = {},
                                            Stream stream = nullptr);

  // ------------------------------------------------------------ host tier
  // Copies `seq`'s pages to host pages (KVCacheOptions::host_tier) on the
  // cache's copy stream, after the work enqueued on `stream` so far (an
  // event), and returns without waiting: the sequence is swapped out at
  // once (it cannot join a step, be read, forked, truncated or exported:
  // FailedPrecondition naming it), and its device page references are
  // dropped at a point fixed by the calls alone, never by when the copy
  // finishes: the first call once two PrepareSteps have committed after the
  // SwapOut (it waits for the copy if it is still running; the copy has had
  // a whole step to run), or earlier by a call that needs pages only such
  // copies hold (it waits for them), or SynchronizeSwaps. Pages shared
  // with other sequences stay theirs, unchanged. With prefix
  // caching the sequence stops being tracked. Errors (nothing changed):
  // NotFound; FailedPrecondition (no host tier, already swapped out);
  // ResourceExhausted (host pages).
  absl::Status SwapOut(SequenceId seq, Stream stream = nullptr);
  // Brings a swapped-out sequence back into newly allocated device pages
  // (sharing is not restored) on the copy stream, after the work on
  // `stream`; the first step (or read, export) that uses it makes its
  // stream wait for the copy (an event), so other sequences' steps do not.
  // All or nothing: ResourceExhausted when the free and evictable pages do
  // not suffice. NotFound; FailedPrecondition when `seq` is not swapped out.
  absl::Status SwapIn(SequenceId seq, Stream stream = nullptr);
  // Whether `seq` is swapped out (NotFound for an unknown one).
  absl::StatusOr<bool> IsSwappedOut(SequenceId seq) const;
  // Waits until every copy of the host tier is done and drops the device
  // pages of finished swap-outs (host sync; for tests and shutdown).
  absl::Status SynchronizeSwaps();

  // Eviction priorities: the retention priority (0 .. kMaxRetentionPriority;
  // 0 for every new sequence, a fork's is its parent's) that `seq` gives the
  // pages it drops (release, truncation). A cached page keeps the highest
  // priority its holders gave it; allocations evict the lowest priority
  // first, least recently used within a priority, and so does the host tier
  // of the prefix cache (a demoted page keeps its priority). With every
  // priority 0: one LRU. Errors (nothing changed): NotFound; InvalidArgument
  // naming priority.
  absl::Status SetRetentionPriority(SequenceId seq, int priority);

  absl::StatusOr<int64_t> SequenceLength(SequenceId seq) const;
  // The sequence's block table (page ids, ceil(length / page_size) of them);
  // valid until the next mutating call.
  absl::StatusOr<absl::Span<const int32_t>> SequencePages(SequenceId seq) const;
  // Sequences holding `page`; 0 for a free page. InvalidArgument out of range.
  absl::StatusOr<int32_t> PageRefCount(int64_t page) const;

  // Dequantizes sequence `seq`'s tokens of layer `layer` into k_out [T, H,
  // Dk] and v_out [T, H, Dv] (f16 or bf16, both the same; contiguous rows,
  // 16-byte aligned; T >= the sequence's length): row t is token t; rows at
  // or past the length are left unchanged. Reads the pages as they are after
  // the work already enqueued on `stream`, outside any step (no PrepareStep
  // needed). CUDA: uploads the sequence's block table into a fixed device
  // buffer and enqueues one kernel on `stream`; calls must all use one
  // stream (the step stream) so that a later upload cannot overtake an
  // earlier read; not graph-capturable. CPU: synchronous. NotFound for an
  // unknown sequence; InvalidArgument naming the argument otherwise.
  absl::Status ReadSequence(int layer, SequenceId seq, const TensorView& k_out,
                            const TensorView& v_out, Stream stream = nullptr) const;

  // ---------------------------------------------------------------- steps
  // Reserves pages for the entries, advances their lengths, fills the step
  // staging buffers (slots of the new tokens, block tables, lengths, indptrs)
  // and uploads them with one or two async copies on `stream` (CUDA) — after
  // any copy-on-write page copies, also on `stream`. All or nothing: on an
  // argument error (InvalidArgument: too many entries or tokens, negative
  // counts, duplicate sequence, a sequence past max_pages_per_seq; NotFound:
  // unknown sequence) or when the free pages do not suffice
  // (ResourceExhausted), nothing changes. A CUDA error while enqueueing the
  // upload is returned as Internal after the host state was committed (the
  // stream is then unusable anyway).
  //
  // Step slots (KVCacheOptions::step_slots = N): step s (counting from 1)
  // fills slot (s - 1) % N, reported in StepInfo::slot; the step buffers of
  // the other slots, which steps still in flight read, are not touched.
  // Ordering rules (docs/kv_cache.md, "Two steps in flight"):
  // - Stream order: the Run() calls (or the graph launch) of step s are
  //   enqueued before PrepareStep s+1 is called. Steps may use different
  //   streams with two or more slots: PrepareStep s+1 records an event on
  //   step s's stream and makes its own stream wait for it, so the appends
  //   of step s precede the reads of step s+1 (with one slot every step
  //   uses the same stream, as before).
  // - Host waits: with one slot, PrepareStep waits for the previous step's
  //   upload (normally long done). With N >= 2 it waits only for the step
  //   that last used the slot it fills (step s - N, through the event that
  //   PrepareStep s-N+1 recorded after it): never for the step in flight
  //   before it. Nothing else on the hot path waits.
  // - Page reuse: with N >= 2, a page whose last reference a call drops
  //   (ReleaseSequence, Truncate, a SwapOut on the CPU) while the latest
  //   step is s is "retiring" (Stats().pages_retiring): it becomes free or
  //   cached at PrepareStep s + N, after that call's wait for step s. Only
  //   when the free and evictable pages do not suffice does a call (a step,
  //   SwapIn, imports) wait for the latest step to complete and take the
  //   retiring pages at once. The rule depends only on the calls, never on
  //   device timing (tensor-parallel ranks agree). Copy-on-write sources and
  //   pages shared with a live sequence are never reused while referenced.
  //   With one slot, a released page is reusable at once (stream order
  //   protects the step that used it).
  absl::StatusOr<StepInfo> PrepareStep(absl::Span<const StepEntry> entries,
                                       Stream stream = nullptr);
  // What PrepareStep(entries) would do, changing nothing: the same argument
  // errors (InvalidArgument, NotFound), else a plan whose `fits` says
  // whether the free and evictable pages cover the step (copies included).
  absl::StatusOr<StepPlan> PlanStep(absl::Span<const StepEntry> entries) const;
  const StepInfo& step() const;
  // Fixed-address device views of the step buffers (see StepViews) of the
  // latest step's slot.
  const StepViews& step_views() const;
  // The same for step slot `slot` (the step that last filled it; empty
  // outside [0, step_slots)).
  const StepInfo& step(int slot) const;
  const StepViews& step_views(int slot) const;
  // Host copies of the latest step's staging (the same memory as the
  // device views on the CPU device): valid until the next PrepareStep.
  absl::Span<const int64_t> host_slot_mapping() const;    // [num_tokens]
  absl::Span<const int32_t> host_seq_lens() const;        // [num_seqs]
  absl::Span<const int32_t> host_kv_page_indptr() const;  // [num_seqs + 1]
  absl::Span<const int32_t> host_token_indptr() const;    // [num_seqs + 1]
  // Row b of the host block tables ([max_pages_per_seq] entries; the first
  // ceil(seq_len / page_size) are meaningful).
  absl::Span<const int32_t> host_block_table(int row) const;

  // ------------------------------------------------------------------ ops
  // Op objects bound to this cache; they stay valid while the cache lives
  // (also across moves of the KVCache object); once it is destroyed their
  // Run() returns FailedPrecondition. FailedPrecondition from
  // materializer() when the geometry does not allow FP8 materialization
  // (head_dim_k == head_dim_v, a multiple of 64; page_size % 4 == 0).
  absl::StatusOr<CacheAppender> appender(DType input_dtype = DType::kBF16) const;
  absl::StatusOr<CacheMaterializer> materializer() const;
  absl::StatusOr<CacheDequantizer> dequantizer(DType output_dtype = DType::kBF16) const;
  // Errors: DecodeAttention::Create's (head dims 64/128/256, num_qo_heads,
  // max_q_len ...), naming the option.
  absl::StatusOr<CacheAttention> attention(const CacheAttentionOptions& options) const;

  // FP8 workspace for the materializer: out pages any step can need
  // (1 + max_seqs_per_step * max_pages_per_seq), and the shape of the
  // workspace tensor for `pages` out pages: [pages, 2, H, page_size, D] e4m3.
  int64_t Fp8WorkspacePagesAtCapacity() const;
  std::vector<int64_t> Fp8WorkspaceShape(int64_t pages) const;

  // ------------------------------------------------------- prefix cache
  // Late token ids: the ids of tokens of `seq` appended without them
  // (StepEntry::token_ids empty), at positions first_position ..
  // first_position + ids.size() - 1, all below the sequence's length. Once
  // the ids of a whole page (and of every earlier position) are known, the
  // page is hashed and indexed like one whose ids came with the append.
  // Giving a known id again is allowed; a different one is refused. Errors
  // (nothing changed): NotFound (unknown seq); InvalidArgument (positions
  // outside the appended tokens, naming first_position; an id that differs
  // from the known one, naming ids[k] and the position). Ids of a sequence
  // that is not tracked (prefix caching off, a swapped-out sequence, one
  // made by ImportHalfPages) are checked and ignored.
  absl::Status SetTokenIds(SequenceId seq, int64_t first_position,
                           absl::Span<const int32_t> ids);
  // The same with ids in device memory (a contiguous [n] i32 view on the
  // cache's device, e.g. the sampler's output): on CUDA one async copy into
  // pinned memory on `stream` (after the work enqueued there, no host sync)
  // and an event; the ids apply at PrepareStep step_serial + max(2,
  // step_slots) (counted from this call; a fixed point of the calls, never
  // of when the copy finishes), which waits for the copy (normally long
  // done). Ids whose positions were truncated, released or swapped out by
  // then, or that conflict, are dropped (Stats().token_ids_dropped). On the
  // CPU device the ids apply at once, as the span overload. The view need
  // not stay valid once the stream got past the copy. Errors as above, and
  // InvalidArgument naming ids (dtype, rank, stride, device),
  // ResourceExhausted when more than 2 * max_tokens_per_step * (step_slots +
  // 1) ids wait.
  absl::Status SetTokenIds(SequenceId seq, int64_t first_position, const TensorView& ids,
                           Stream stream = nullptr);
  // The queued KV events, oldest first, and how many were dropped since the
  // previous call (PrefixCacheOptions::max_pending_events).
  KVEventBatch TakeEvents();
  // Empties the prefix index: cached pages become free, pages of live
  // sequences stay theirs but are no longer shared by later sequences. One
  // kAllBlocksCleared event. A no-op when prefix caching is off.
  void ResetPrefixCache();
  // Checks the invariants (class comment) and the prefix index in
  // O(pages + tokens): for tests and debugging. Internal on a violation.
  absl::Status CheckInvariants() const;

  // ------------------------------------------------------ scales and views
  // A stored byte means something only under the scale it was written with,
  // so a scale change of a layer that holds tokens (tokens of live sequences
  // whose append on this layer was issued; the current step's new tokens
  // count once this layer's appender ran for the step, or once it was
  // captured in a graph) is refused with FailedPrecondition naming the layer
  // and its token count, and changes nothing; with StoredTokens::kReencode
  // the layer's pages (all of them, K and V) are requantized on the device
  // from the old scales to the new ones in the same call, on `stream`.
  //
  // Prefix caching: cached bytes are valid only under the scales they were
  // written with, so every successful scale change (and re-encode) empties
  // the prefix index (ResetPrefixCache). Pages are cached only while every
  // layer's scales are calibrated.
  //
  // Sets layer `layer`'s global decode scales (positive, finite) and the FP8
  // decode scales derived from them (MinFp8Scale); the layer counts as
  // calibrated from then on. CUDA: async copies on `stream` from host memory
  // that may be reused on return, ordered with the kernels on that stream.
  absl::Status UpdateGlobalScales(int layer, float k_scale, float v_scale, Stream stream = nullptr,
                                  StoredTokens stored = StoredTokens::kRefuse);
  // All layers at once ([num_layers] each); refused as a whole when any
  // layer holds tokens (the first is named) unless kReencode.
  absl::Status UpdateGlobalScales(absl::Span<const float> k_scales,
                                  absl::Span<const float> v_scales, Stream stream = nullptr,
                                  StoredTokens stored = StoredTokens::kRefuse);
  // Calibrates layer `layer`'s K and V global decode scales from tensors
  // (e.g. the layer's prefill rows) where they live, with no host sync:
  // each scale becomes MakeGlobalScale(amax, recipe) (no headroom: the data
  // given is taken as representative) and its FP8 decode scale
  // MinFp8ScaleFor(scale) (FP8 keys: g_k = MakeFp8KeyScale(amax), its FP8
  // decode scale g_k itself; Calibrator::RunFp8Key), written into the cache's device scale array by
  // work enqueued on `stream` (graph-capturable on CUDA; synchronous on the
  // CPU). `calibrator` must have the cache's device and recipe, and k and v
  // its dtype and at most its max_elements. Both tensors are checked before
  // anything is enqueued. Refused like UpdateGlobalScales while the layer
  // holds tokens, unless kReencode.
  absl::Status CalibrateGlobalScales(int layer, const TensorView& k, const TensorView& v,
                                     Calibrator& calibrator, Stream stream = nullptr,
                                     StoredTokens stored = StoredTokens::kRefuse);
  // The scales layer `layer` uses, read back from the device after all work
  // enqueued on `stream` so far (the first append's calibration included):
  // synchronizes `stream` on CUDA, so not for a hot path or a capture.
  // InvalidArgument for a bad layer.
  absl::StatusOr<LayerScales> ReadScales(int layer, Stream stream = nullptr) const;
  // Tokens layer `layer` holds in the sense of the scale-change rule above.
  absl::StatusOr<int64_t> LayerTokens(int layer) const;
  // The layer's scale-event counters (options.count_scale_events), read back
  // after the work on `stream` (synchronizes it on CUDA). FailedPrecondition
  // when counting is off.
  absl::StatusOr<ScaleEventCounts> ReadScaleEvents(int layer, Stream stream = nullptr) const;
  // Zeroes every layer's counters (on `stream`). FailedPrecondition when off.
  absl::Status ResetScaleEvents(Stream stream = nullptr);
  // Device pointers (fixed addresses): the global decode scale of layer's K
  // (kv = 0) or V (kv = 1), and the FP8 decode scale of the materialized
  // pages, for an attention kernel.
  const float* global_scale_ptr(int layer, int kv) const;
  const float* fp8_scale_ptr(int layer, int kv) const;

  // Layer `layer`'s pools as the four tuple views ([P, S, H, D/2] u8 and
  // [P, S, H, D/16] e4m3 for NHD; [P, H, S, ...] for HND), for an external
  // attention kernel. Empty views (which every op rejects) for a layer
  // outside [0, num_layers); global_scale_ptr and fp8_scale_ptr return null
  // there.
  PagedCache LayerCache(int layer) const;

  const KVCacheOptions& options() const;  // with geometry.num_pages resolved
  const CacheGeometry& geometry() const;
  int num_layers() const;
  Device device() const;
  KVCacheStats Stats() const;

 private:
  explicit KVCache(std::unique_ptr<internal::KVCacheState> state);
  absl::Status UpdateGlobalScalesRange(int first, int count, const float* k_scales,
                                       const float* v_scales, Stream stream, StoredTokens stored);
  // Shared with nobody: the bound ops hold weak references (liveness only).
  std::shared_ptr<internal::KVCacheState> state_;
};

}  // namespace fp4kv

#endif  // FP4KV_KV_CACHE_H_
