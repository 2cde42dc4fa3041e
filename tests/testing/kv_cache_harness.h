// Test support for KVCache: memory on the cache's device, tokens with their
// expected NVFP4 bytes, host copies of the pools and step buffers, and checks
// of stored, materialized and dequantized tokens against those bytes.
#ifndef FP4KV_TESTS_TESTING_KV_CACHE_HARNESS_H_
#define FP4KV_TESTS_TESTING_KV_CACHE_HARNESS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "fp4kv/kv_cache.h"
#include "testing/test_util.h"

namespace fp4kv {
namespace testing {

// KVCache::Create, or a test failure and abort: for tests whose every later
// step needs the cache.
KVCache CreateCacheOrAbort(const KVCacheOptions& options);

// While in scope, every page copy of the cache (swaps, promotions,
// demotions, image copies) first holds its stream `microseconds` (0: none),
// so that work reading or reusing a page before its copy completes finds
// wrong bytes every time (internal::SetPageCopyDelayForTesting). No copy is
// held once it goes out of scope.
class ScopedPageCopyDelay {
 public:
  explicit ScopedPageCopyDelay(int64_t microseconds);
  ScopedPageCopyDelay(const ScopedPageCopyDelay&) = delete;
  ScopedPageCopyDelay& operator=(const ScopedPageCopyDelay&) = delete;
  ~ScopedPageCopyDelay();
};

// Cases that run on the CPU (parameter false) and on GPU 0 with a stream of
// their own (true; skipped without a GPU). stream_ is null on the CPU.
class CpuOrGpuStreamTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override;
  void TearDown() override;
  // Waits for the stream (nothing on the CPU).
  void Sync();
  Device device_ = Device::Cpu();
  void* cuda_stream_ = nullptr;  // cudaStream_t
  Stream stream_ = nullptr;
};

// Bytes on a device: host memory for the CPU, cudaMalloc for CUDA.
class Buffer {
 public:
  Buffer() = default;
  Buffer(const Device& device, size_t bytes);
  bool ok() const { return device_.is_cuda() ? dev_.ok() : true; }
  void* get() const;
  size_t size() const { return bytes_; }
  bool Upload(const void* host, size_t bytes);
  bool Download(void* host, size_t bytes) const;
  bool Fill(uint8_t byte);
  TensorView View(DType dtype, std::initializer_list<int64_t> shape) const;
  template <typename T>
  std::vector<T> DownloadAs(size_t count) const {
    std::vector<T> v(count);
    if (!Download(v.data(), count * sizeof(T))) v.clear();
    return v;
  }

 private:
  Device device_;
  size_t bytes_ = 0;
  std::vector<uint64_t> host_;  // 8-byte aligned (16 via the allocator on x86-64)
  DeviceBuffer dev_;
};

// Copies a view's bytes (its whole extent: shape[0] * stride[0] elements) to
// the host.
std::vector<uint8_t> DownloadView(const TensorView& v);

// One appended token of every layer: the original K/V rows and the bytes the
// reference quantizer makes of them under the cache's scales and recipe.
struct TokenRecord {
  // Per layer: K [H, Dk] then V [H, Dv], bf16 bits.
  std::vector<uint16_t> original;
  // Per layer: K data [H, Dk/2], K scales [H, Dk/16], V data, V scales
  // (FP8 keys: K data [H, Dk] E4M3 bytes, no K scales).
  std::vector<uint8_t> expected;
};
using Token = std::shared_ptr<const TokenRecord>;

// Makes tokens for `cache` (its geometry, global scales and recipe, as set
// when called).
class TokenFactory {
 public:
  explicit TokenFactory(const KVCache& cache) : cache_(&cache) {}
  Token Make(uint64_t seed) const;
  // Offsets into TokenRecord::original / expected for layer l.
  int64_t OriginalOffset(int layer, bool is_v) const;
  int64_t ExpectedOffset(int layer, int kind) const;  // kind: 0 Kd, 1 Ks, 2 Vd, 3 Vs

 private:
  const KVCache* cache_;
};

// Host copies of every layer's four pool regions.
struct PoolCopy {
  std::vector<std::vector<uint8_t>> regions;  // [layer * 4 + kind]
  std::vector<PagedCache> views;              // per layer (for strides)
};
PoolCopy DownloadPools(const KVCache& cache);
// The bytes of row (page, entry, head) of region `kind` of a layer.
const uint8_t* PoolRow(const PoolCopy& pools, const CacheGeometry& g, int layer, int kind,
                       int64_t page, int64_t entry, int64_t head);

// "" when every token of the sequence (pages from the cache) holds its
// expected bytes in every layer; otherwise the first difference.
std::string CheckSequenceBytes(const KVCache& cache, const PoolCopy& pools, SequenceId seq,
                               const std::vector<Token>& tokens);

// Runs the cache's appender for every layer on the current step. `tokens`
// are the step's new tokens in order; rows past them up to the buffer's
// capacity (max_tokens_per_step rows) are filled with poison, which must not
// reach the pools. The buffers are allocated on first use (one K and one V
// per layer) and kept, so a captured graph can reuse them.
struct StepInputs {
  std::vector<Buffer> k, v;  // per layer, [max_tokens_per_step, H, D] bf16
};
absl::Status FillStepInputs(const KVCache& cache, const std::vector<Token>& tokens,
                            StepInputs* inputs, Stream stream);
absl::Status RunAppendAllLayers(const KVCache& cache, const CacheAppender& appender,
                                StepInputs* inputs, Stream stream);

// The expected tokens of each row of the current step (all tokens of the
// sequence after the append).
using StepRows = std::vector<std::vector<Token>>;

// Checks a materialized workspace (host copy of out, [W, 2, H, S, D]) and the
// FP8 block tables (host copy, [max_seqs, max_pages]) of layer `layer`
// against the rows' expected bytes.
std::string CheckMaterialized(const KVCache& cache, int layer, const std::vector<uint8_t>& out,
                              const std::vector<int32_t>& fp8_tables, const StepRows& rows);

// Checks dequantized k_out/v_out (host copies of [B, T, H, D] bf16) of
// layer `layer` against the rows: byte-exact with the reference dequantizer of
// the expected bytes, within NVFP4's error of the originals, and positions
// past each length untouched (still `poison`).
std::string CheckDequantized(const KVCache& cache, int layer, const std::vector<uint16_t>& k_out,
                             const std::vector<uint16_t>& v_out, int64_t batch, int64_t max_len,
                             const StepRows& rows, uint16_t poison);

// Everything observable about a cache's state (for "nothing changed").
struct Snapshot {
  std::vector<std::pair<SequenceId, int64_t>> lengths;
  std::vector<std::vector<int32_t>> pages;
  std::vector<int32_t> ref_counts;
  int64_t pages_free = 0, pages_used = 0, pages_shared = 0, tokens_stored = 0, wasted = 0;
  // Prefix caching: cached, indexed, evictions, events pending, events dropped.
  std::vector<int64_t> prefix;
  StepInfo step;
  std::vector<int64_t> host_slots;
  std::vector<int32_t> host_lens, host_kv_indptr, host_token_indptr, host_tables;
  std::vector<uint8_t> step_buffers;  // device step buffers
  std::vector<float> scales;
  PoolCopy pools;
};
Snapshot TakeSnapshot(const KVCache& cache);
// "" when equal; otherwise what differs.
std::string DiffSnapshots(const Snapshot& a, const Snapshot& b);

}  // namespace testing
}  // namespace fp4kv

#endif  // FP4KV_TESTS_TESTING_KV_CACHE_HARNESS_H_
