#include "testing/kv_cache_harness.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <sstream>

#include "fp4kv/format.h"
#include "fp4kv/ops.h"
#include "src/params.h"

namespace fp4kv {
namespace testing {

KVCache CreateCacheOrAbort(const KVCacheOptions& options) {
  absl::StatusOr<KVCache> c = KVCache::Create(options);
  if (!c.ok()) {
    ADD_FAILURE() << c.status();
    std::abort();
  }
  return *std::move(c);
}

ScopedPageCopyDelay::ScopedPageCopyDelay(int64_t microseconds) {
  internal::SetPageCopyDelayForTesting(microseconds);
}

ScopedPageCopyDelay::~ScopedPageCopyDelay() { internal::SetPageCopyDelayForTesting(0); }

void CpuOrGpuStreamTest::SetUp() {
  if (!GetParam()) return;
  FP4KV_SKIP_WITHOUT_GPU();
  device_ = Device::Cuda(0);
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  cuda_stream_ = s;
  stream_ = reinterpret_cast<Stream>(s);
}

void CpuOrGpuStreamTest::TearDown() {
  if (cuda_stream_ != nullptr) (void)cudaStreamDestroy(static_cast<cudaStream_t>(cuda_stream_));
}

void CpuOrGpuStreamTest::Sync() {
  if (cuda_stream_ != nullptr) {
    ASSERT_EQ(cudaStreamSynchronize(static_cast<cudaStream_t>(cuda_stream_)), cudaSuccess);
  }
}


// ------------------------------------------------------------------ Buffer
Buffer::Buffer(const Device& device, size_t bytes) : device_(device), bytes_(bytes) {
  if (device.is_cuda()) {
    dev_ = DeviceBuffer(bytes);
  } else {
    host_.assign((bytes + 7) / 8 + 2, 0);
  }
}

void* Buffer::get() const {
  return device_.is_cuda() ? dev_.get() : const_cast<void*>(static_cast<const void*>(host_.data()));
}

bool Buffer::Upload(const void* host, size_t bytes) {
  if (bytes > bytes_) return false;
  if (device_.is_cuda()) return dev_.Upload(host, bytes);
  std::memcpy(get(), host, bytes);
  return true;
}

bool Buffer::Download(void* host, size_t bytes) const {
  if (bytes > bytes_) return false;
  if (device_.is_cuda()) return dev_.Download(host, bytes);
  std::memcpy(host, get(), bytes);
  return true;
}

bool Buffer::Fill(uint8_t byte) {
  if (device_.is_cuda()) return dev_.Fill(byte);
  std::memset(get(), byte, bytes_);
  return true;
}

TensorView Buffer::View(DType dtype, std::initializer_list<int64_t> shape) const {
  return TensorView::Contiguous(get(), dtype, shape, device_);
}

std::vector<uint8_t> DownloadView(const TensorView& v) {
  if (v.ndim == 0 || v.data == nullptr) return {};  // absent (FP8 keys' scales)
  const size_t bytes = static_cast<size_t>(v.shape[0] * v.strides[0] * DTypeSize(v.dtype));
  std::vector<uint8_t> out(bytes);
  if (v.device.is_cuda()) {
    if (cudaMemcpy(out.data(), v.data, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) out.clear();
  } else {
    std::memcpy(out.data(), v.data, bytes);
  }
  return out;
}

// ------------------------------------------------------------------ tokens
namespace {

int64_t KindRowBytes(const CacheGeometry& g, int kind) {
  switch (kind) {
    case 0:
      return g.DataRowBytes(false);
    case 1:
      return g.ScaleRowBytes(false);
    case 2:
      return g.DataRowBytes(true);
    default:
      return g.ScaleRowBytes(true);
  }
}

int64_t LayerExpectedBytes(const CacheGeometry& g) {
  int64_t n = 0;
  for (int k = 0; k < 4; ++k) n += KindRowBytes(g, k) * g.num_kv_heads;
  return n;
}

// The layer's scales as the device holds them (NaN when they cannot be read,
// which makes every later comparison fail).
LayerScales ScalesOf(const KVCache& c, int layer) {
  absl::StatusOr<LayerScales> s = c.ReadScales(layer);
  if (!s.ok()) {
    ADD_FAILURE() << "ReadScales(" << layer << "): " << s.status();
    const float nan = std::nanf("");
    return LayerScales{nan, nan, nan, nan, false, false};
  }
  return *s;
}

float GlobalOf(const KVCache& c, int layer, bool is_v) {
  const LayerScales s = ScalesOf(c, layer);
  return is_v ? s.v : s.k;
}

}  // namespace

int64_t TokenFactory::OriginalOffset(int layer, bool is_v) const {
  const CacheGeometry& g = cache_->geometry();
  const int64_t per_layer = static_cast<int64_t>(g.num_kv_heads) * (g.head_dim_k + g.head_dim_v);
  return layer * per_layer + (is_v ? static_cast<int64_t>(g.num_kv_heads) * g.head_dim_k : 0);
}

int64_t TokenFactory::ExpectedOffset(int layer, int kind) const {
  const CacheGeometry& g = cache_->geometry();
  int64_t off = layer * LayerExpectedBytes(g);
  for (int k = 0; k < kind; ++k) off += KindRowBytes(g, k) * g.num_kv_heads;
  return off;
}

Token TokenFactory::Make(uint64_t seed) const {
  const CacheGeometry& g = cache_->geometry();
  const int L = cache_->num_layers();
  const int H = g.num_kv_heads;
  auto rec = std::make_shared<TokenRecord>();
  rec->original.resize(static_cast<size_t>(L) * H * (g.head_dim_k + g.head_dim_v));
  rec->expected.resize(static_cast<size_t>(L * LayerExpectedBytes(g)));
  for (int l = 0; l < L; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const int d = kv ? g.head_dim_v : g.head_dim_k;
      std::vector<uint16_t> x =
          RandomHalfBits(DType::kBF16, static_cast<int64_t>(H) * d, seed * 1000003 + l * 2 + kv);
      std::memcpy(rec->original.data() + OriginalOffset(l, kv), x.data(), x.size() * 2);
      if (kv == 0 && g.fp8_keys()) {  // E4M3 key bytes, no key scales
        const float r = Fp8KeyEncodeMultiplier(GlobalOf(*cache_, l, false));
        uint8_t* out = rec->expected.data() + ExpectedOffset(l, 0);
        for (size_t i = 0; i < x.size(); ++i) out[i] = QuantizeFp8Key(Bf16BitsToFloat(x[i]), r);
        continue;
      }
      std::vector<uint64_t> packed(static_cast<size_t>(H) * d / 16);  // 8-byte aligned
      std::vector<uint8_t> scales(static_cast<size_t>(H) * d / kBlockSize);
      const absl::Status s =
          QuantizeLinear(TensorView::Contiguous(x.data(), DType::kBF16, {H, d}),
                         TensorView::Contiguous(packed.data(), DType::kU8, {H, d / 2}),
                         TensorView::Contiguous(scales.data(), DType::kE4M3, {H, d / kBlockSize}),
                         GlobalScale::Value(GlobalOf(*cache_, l, kv)), cache_->options().recipe);
      if (!s.ok()) {
        ADD_FAILURE() << "QuantizeLinear: " << s;
        return nullptr;
      }
      std::memcpy(rec->expected.data() + ExpectedOffset(l, kv ? 2 : 0), packed.data(),
                  static_cast<size_t>(H) * d / 2);
      std::memcpy(rec->expected.data() + ExpectedOffset(l, kv ? 3 : 1), scales.data(),
                  scales.size());
    }
  }
  return rec;
}

// ------------------------------------------------------------------- pools
PoolCopy DownloadPools(const KVCache& cache) {
  PoolCopy p;
  for (int l = 0; l < cache.num_layers(); ++l) {
    const PagedCache v = cache.LayerCache(l);
    p.views.push_back(v);
    p.regions.push_back(DownloadView(v.k_data));
    p.regions.push_back(DownloadView(v.k_scales));
    p.regions.push_back(DownloadView(v.v_data));
    p.regions.push_back(DownloadView(v.v_scales));
  }
  return p;
}

const uint8_t* PoolRow(const PoolCopy& pools, const CacheGeometry& g, int layer, int kind,
                       int64_t page, int64_t entry, int64_t head) {
  const PagedCache& c = pools.views[layer];
  const TensorView& v = kind == 0   ? c.k_data
                        : kind == 1 ? c.k_scales
                        : kind == 2 ? c.v_data
                                    : c.v_scales;
  const bool nhd = g.layout == Layout::kNHD;
  const int64_t off = page * v.strides[0] + (nhd ? entry * v.strides[1] + head * v.strides[2]
                                                 : head * v.strides[1] + entry * v.strides[2]);
  return pools.regions[layer * 4 + kind].data() + off;
}

std::string CheckSequenceBytes(const KVCache& cache, const PoolCopy& pools, SequenceId seq,
                               const std::vector<Token>& tokens) {
  const CacheGeometry& g = cache.geometry();
  absl::StatusOr<absl::Span<const int32_t>> pages = cache.SequencePages(seq);
  if (!pages.ok()) return pages.status().ToString();
  absl::StatusOr<int64_t> len = cache.SequenceLength(seq);
  if (!len.ok() || *len != static_cast<int64_t>(tokens.size())) {
    std::ostringstream os;
    os << "sequence " << seq << ": length " << (len.ok() ? *len : -1) << ", model "
       << tokens.size();
    return os.str();
  }
  TokenFactory f(cache);
  for (size_t t = 0; t < tokens.size(); ++t) {
    const int64_t page = (*pages)[t / g.page_size];
    const int64_t entry = static_cast<int64_t>(t % g.page_size);
    for (int l = 0; l < cache.num_layers(); ++l) {
      for (int kind = 0; kind < 4; ++kind) {
        const int64_t rb = KindRowBytes(g, kind);
        if (rb == 0) continue;  // no key scales (FP8 keys)
        for (int h = 0; h < g.num_kv_heads; ++h) {
          const uint8_t* got = PoolRow(pools, g, l, kind, page, entry, h);
          const uint8_t* want = tokens[t]->expected.data() + f.ExpectedOffset(l, kind) + h * rb;
          if (std::memcmp(got, want, rb) != 0) {
            std::ostringstream os;
            os << "sequence " << seq << " token " << t << " (page " << page << " entry " << entry
               << ") layer " << l << " kind " << kind << " head " << h
               << ": pool bytes differ from the reference";
            return os.str();
          }
        }
      }
    }
  }
  return "";
}

// -------------------------------------------------------------------- steps
absl::Status FillStepInputs(const KVCache& cache, const std::vector<Token>& tokens, StepInputs* in,
                            Stream stream) {
  const CacheGeometry& g = cache.geometry();
  const int L = cache.num_layers();
  const int64_t T = cache.options().max_tokens_per_step;
  const int H = g.num_kv_heads;
  if (static_cast<int64_t>(tokens.size()) > T) return absl::InvalidArgumentError("too many tokens");
  if (in->k.empty()) {
    for (int l = 0; l < L; ++l) {
      in->k.emplace_back(cache.device(), static_cast<size_t>(T * H * g.head_dim_k * 2));
      in->v.emplace_back(cache.device(), static_cast<size_t>(T * H * g.head_dim_v * 2));
      if (!in->k.back().ok() || !in->v.back().ok()) return absl::InternalError("alloc");
    }
  }
  if (cache.device().is_cuda() &&
      cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)) != cudaSuccess) {
    return absl::InternalError("cudaStreamSynchronize");
  }
  TokenFactory f(cache);
  for (int l = 0; l < L; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const int64_t row = static_cast<int64_t>(H) * (kv ? g.head_dim_v : g.head_dim_k);
      std::vector<uint16_t> host(static_cast<size_t>(T * row), 0xA5A5);  // poison past the step
      for (size_t i = 0; i < tokens.size(); ++i) {
        std::memcpy(host.data() + i * row, tokens[i]->original.data() + f.OriginalOffset(l, kv),
                    row * 2);
      }
      Buffer& b = kv ? in->v[l] : in->k[l];
      if (!b.Upload(host.data(), host.size() * 2)) return absl::InternalError("upload");
    }
  }
  return absl::OkStatus();
}

absl::Status RunAppendAllLayers(const KVCache& cache, const CacheAppender& appender, StepInputs* in,
                                Stream stream) {
  const CacheGeometry& g = cache.geometry();
  const int64_t T = cache.options().max_tokens_per_step;
  for (int l = 0; l < cache.num_layers(); ++l) {
    absl::Status s =
        appender.Run(l, in->k[l].View(DType::kBF16, {T, g.num_kv_heads, g.head_dim_k}),
                     in->v[l].View(DType::kBF16, {T, g.num_kv_heads, g.head_dim_v}), stream);
    if (!s.ok()) return s;
  }
  return absl::OkStatus();
}

std::string CheckMaterialized(const KVCache& cache, int layer, const std::vector<uint8_t>& out,
                              const std::vector<int32_t>& fp8_tables, const StepRows& rows) {
  const CacheGeometry& g = cache.geometry();
  const int H = g.num_kv_heads;
  const int S = g.page_size;
  const int D = g.head_dim_k;
  const int M = cache.options().max_pages_per_seq;
  const int64_t entry_stride = D, head_stride = int64_t{S} * D, kv_stride = head_stride * H,
                page_stride = 2 * kv_stride;
  TokenFactory f(cache);
  std::ostringstream os;
  for (int64_t i = 0; i < page_stride; ++i) {
    if (out[i] != 0) {
      os << "out page 0 (the zero page) byte " << i << " is " << int(out[i]);
      return os.str();
    }
  }
  const absl::Span<const int32_t> indptr = cache.host_kv_page_indptr();
  const LayerScales sc = ScalesOf(cache, layer);
  const float mult[2] = {Fp8MaterializeMultiplier(sc.k, sc.k_fp8),
                         Fp8MaterializeMultiplier(sc.v, sc.v_fp8)};
  for (size_t b = 0; b < rows.size(); ++b) {
    const int64_t len = static_cast<int64_t>(rows[b].size());
    const int64_t pages = (len + S - 1) / S;
    if (indptr[b + 1] - indptr[b] != pages) {
      os << "row " << b << ": kv_page_indptr gives " << indptr[b + 1] - indptr[b] << " pages, want "
         << pages;
      return os.str();
    }
    for (int64_t j = 0; j < pages; ++j) {
      const int64_t o = indptr[b] + j + 1;
      if (fp8_tables[b * M + j] != o) {
        os << "row " << b << " page " << j << ": fp8 block table " << fp8_tables[b * M + j]
           << ", want " << o;
        return os.str();
      }
      for (int kv = 0; kv < 2; ++kv) {
        for (int h = 0; h < H; ++h) {
          for (int e = 0; e < S; ++e) {
            const uint8_t* got =
                out.data() + o * page_stride + kv * kv_stride + h * head_stride + e * entry_stride;
            const int64_t t = j * S + e;
            if (kv == 0 && g.fp8_keys()) {  // FP8 key bytes re-scaled (or copied)
              for (int i = 0; i < D; ++i) {
                const uint8_t want =
                    t < len
                        ? MaterializeFp8KeyValue(
                              rows[b][t]->expected[f.ExpectedOffset(layer, 0) + h * D + i], mult[0])
                        : 0;
                if (got[i] != want) {
                  os << "row " << b << " token " << t << " K head " << h << " elem " << i
                     << ": fp8 byte " << int(got[i]) << ", want " << int(want);
                  return os.str();
                }
              }
              continue;
            }
            for (int blk = 0; blk < D / kBlockSize; ++blk) {
              uint8_t scale = 0;
              const uint8_t* data = nullptr;
              if (t < len) {
                const TokenRecord& r = *rows[b][t];
                scale =
                    r.expected[f.ExpectedOffset(layer, kv ? 3 : 1) + h * (D / kBlockSize) + blk];
                data = r.expected.data() + f.ExpectedOffset(layer, kv ? 2 : 0) + h * (D / 2) +
                       blk * kBlockBytes;
              }
              for (int i = 0; i < kBlockSize; ++i) {
                uint8_t want = 0;
                if (t < len) {
                  const uint8_t byte = data[i / 2];
                  const uint8_t code = (i % 2 == 0) ? (byte & 0xf) : (byte >> 4);
                  want = MaterializeFp8Value(code, E4m3Decode(scale), mult[kv]);
                }
                if (got[blk * kBlockSize + i] != want) {
                  os << "row " << b << " token " << t << " kv " << kv << " head " << h << " elem "
                     << blk * kBlockSize + i << ": fp8 byte " << int(got[blk * kBlockSize + i])
                     << ", want " << int(want);
                  return os.str();
                }
              }
            }
          }
        }
      }
    }
  }
  return "";
}

std::string CheckDequantized(const KVCache& cache, int layer, const std::vector<uint16_t>& k_out,
                             const std::vector<uint16_t>& v_out, int64_t batch, int64_t max_len,
                             const StepRows& rows, uint16_t poison) {
  const CacheGeometry& g = cache.geometry();
  const int H = g.num_kv_heads;
  TokenFactory f(cache);
  std::ostringstream os;
  for (int kv = 0; kv < 2; ++kv) {
    const int D = kv ? g.head_dim_v : g.head_dim_k;
    const std::vector<uint16_t>& outv = kv ? v_out : k_out;
    const float gs = GlobalOf(cache, layer, kv != 0);
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = b < static_cast<int64_t>(rows.size()) ? rows[b].size() : 0;
      for (int64_t t = 0; t < max_len; ++t) {
        for (int h = 0; h < H; ++h) {
          const uint16_t* got = outv.data() + ((b * max_len + t) * H + h) * D;
          if (t >= len) {
            for (int i = 0; i < D; ++i) {
              if (got[i] != poison) {
                os << "kv " << kv << " row " << b << " position " << t
                   << " past the length was written";
                return os.str();
              }
            }
            continue;
          }
          const TokenRecord& r = *rows[b][t];
          const uint16_t* orig = r.original.data() + f.OriginalOffset(layer, kv) + h * D;
          if (kv == 0 && g.fp8_keys()) {
            const uint8_t* bytes = r.expected.data() + f.ExpectedOffset(layer, 0) + h * D;
            for (int i = 0; i < D; ++i) {
              const uint16_t want = FloatToBf16Bits(DequantFp8Key(bytes[i], gs));
              const float x = Bf16BitsToFloat(orig[i]);
              const float dq = Bf16BitsToFloat(got[i]);
              // E4M3: relative step 1/8 (normal codes), absolute 2^-9 * g_k
              // below; plus bf16 rounding; saturation at 448 * g_k.
              const float bound =
                  std::fabs(x) / 15 + gs * 0.002f + std::max(0.0f, std::fabs(x) - 448.0f * gs);
              if (got[i] != want || !(std::fabs(x - dq) <= bound)) {
                os << "K row " << b << " token " << t << " head " << h << " elem " << i
                   << ": dequantized " << dq << " (bits " << got[i] << ", reference " << want
                   << ") of " << x << ", bound " << bound;
                return os.str();
              }
            }
            continue;
          }
          for (int blk = 0; blk < D / kBlockSize; ++blk) {
            const uint8_t* data = r.expected.data() + f.ExpectedOffset(layer, kv ? 2 : 0) +
                                  h * (D / 2) + blk * kBlockBytes;
            const uint8_t scale =
                r.expected[f.ExpectedOffset(layer, kv ? 3 : 1) + h * (D / kBlockSize) + blk];
            uint32_t packed[2] = {0, 0};
            for (int i = 0; i < kBlockBytes; ++i)
              packed[i / 4] |= uint32_t{data[i]} << (8 * (i % 4));
            float y[kBlockSize];
            DequantizeBlock(packed, scale, gs, y);
            float amax = 0;
            for (int i = 0; i < kBlockSize; ++i) {
              amax = std::max(amax, std::fabs(Bf16BitsToFloat(orig[blk * kBlockSize + i])));
            }
            for (int i = 0; i < kBlockSize; ++i) {
              const int idx = blk * kBlockSize + i;
              const uint16_t want = FloatToBf16Bits(y[i]);
              if (got[idx] != want) {
                os << "kv " << kv << " row " << b << " token " << t << " head " << h << " elem "
                   << idx << ": dequantized bits " << got[idx] << ", reference " << want;
                return os.str();
              }
              const float x = Bf16BitsToFloat(orig[idx]);
              const float dq = Bf16BitsToFloat(got[idx]);
              const float bound = 0.25f * amax + 6.0f * gs * 0.001953125f + std::fabs(x) / 128;
              if (!(std::fabs(x - dq) <= bound)) {
                os << "kv " << kv << " row " << b << " token " << t << " head " << h << " elem "
                   << idx << ": |" << x << " - " << dq << "| exceeds NVFP4's error bound " << bound;
                return os.str();
              }
            }
          }
        }
      }
    }
  }
  return "";
}

// ----------------------------------------------------------------- snapshot
Snapshot TakeSnapshot(const KVCache& cache) {
  Snapshot s;
  const KVCacheStats st = cache.Stats();
  s.lengths = st.sequence_lengths;
  for (const auto& [id, len] : s.lengths) {
    absl::StatusOr<absl::Span<const int32_t>> p = cache.SequencePages(id);
    s.pages.emplace_back(p.ok() ? std::vector<int32_t>(p->begin(), p->end())
                                : std::vector<int32_t>{});
  }
  for (int64_t p = 0; p < cache.geometry().num_pages; ++p)
    s.ref_counts.push_back(*cache.PageRefCount(p));
  s.pages_free = st.pages_free;
  s.pages_used = st.pages_used;
  s.pages_shared = st.pages_shared;
  s.tokens_stored = st.tokens_stored;
  s.wasted = st.wasted_slots;
  s.prefix = {st.pages_cached, st.pages_indexed, st.evictions, st.events_pending,
              st.events_dropped};
  s.step = cache.step();
  auto copy = [](auto span, auto* out) { out->assign(span.begin(), span.end()); };
  copy(cache.host_slot_mapping(), &s.host_slots);
  copy(cache.host_seq_lens(), &s.host_lens);
  copy(cache.host_kv_page_indptr(), &s.host_kv_indptr);
  copy(cache.host_token_indptr(), &s.host_token_indptr);
  for (int b = 0; b < s.step.num_seqs; ++b) {
    absl::Span<const int32_t> row = cache.host_block_table(b);
    s.host_tables.insert(s.host_tables.end(), row.begin(), row.end());
  }
  const StepViews& v = cache.step_views();
  for (const TensorView* t : {&v.slot_mapping, &v.block_tables, &v.seq_lens, &v.kv_page_indptr,
                              &v.token_indptr, &v.fp8_block_tables}) {
    const std::vector<uint8_t> bytes = DownloadView(*t);
    s.step_buffers.insert(s.step_buffers.end(), bytes.begin(), bytes.end());
  }
  for (int l = 0; l < cache.num_layers(); ++l) {
    const LayerScales sc = ScalesOf(cache, l);
    s.scales.push_back(sc.k);
    s.scales.push_back(sc.v);
    s.scales.push_back(sc.k_fp8);
    s.scales.push_back(sc.v_fp8);
    s.scales.push_back(sc.k_calibrated ? 1.0f : 0.0f);
    s.scales.push_back(sc.v_calibrated ? 1.0f : 0.0f);
  }
  const std::vector<uint8_t> dev_scales = DownloadView(TensorView::Contiguous(
      cache.global_scale_ptr(0, 0), DType::kF32, {4 * cache.num_layers()}, cache.device()));
  const size_t n = s.scales.size();
  s.scales.resize(n + dev_scales.size() / sizeof(float));
  std::memcpy(s.scales.data() + n, dev_scales.data(), dev_scales.size());
  s.pools = DownloadPools(cache);
  return s;
}

std::string DiffSnapshots(const Snapshot& a, const Snapshot& b) {
  if (a.lengths != b.lengths) return "sequence lengths differ";
  if (a.pages != b.pages) return "sequence pages differ";
  if (a.ref_counts != b.ref_counts) return "page reference counts differ";
  if (a.pages_free != b.pages_free || a.pages_used != b.pages_used ||
      a.pages_shared != b.pages_shared || a.tokens_stored != b.tokens_stored ||
      a.wasted != b.wasted) {
    return "stats differ";
  }
  if (a.prefix != b.prefix) return "prefix cache state differs";
  if (a.step.num_seqs != b.step.num_seqs || a.step.num_tokens != b.step.num_tokens ||
      a.step.max_seq_len != b.step.max_seq_len || a.step.num_pages != b.step.num_pages ||
      a.step.fp8_workspace_pages != b.step.fp8_workspace_pages ||
      a.step.pages_allocated != b.step.pages_allocated ||
      a.step.pages_copied != b.step.pages_copied) {
    return "step info differs";
  }
  if (a.host_slots != b.host_slots || a.host_lens != b.host_lens ||
      a.host_kv_indptr != b.host_kv_indptr || a.host_token_indptr != b.host_token_indptr ||
      a.host_tables != b.host_tables) {
    return "host step staging differs";
  }
  if (a.step_buffers != b.step_buffers) return "device step buffers differ";
  if (a.scales != b.scales) return "scales differ";
  if (a.pools.regions != b.pools.regions) return "pool bytes differ";
  return "";
}

}  // namespace testing
}  // namespace fp4kv
