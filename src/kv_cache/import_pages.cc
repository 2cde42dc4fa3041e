// KVCache: a sequence from a cache prefilled elsewhere in f16/bf16 pages.
#include <vector>

#include "src/kv_cache/state.h"

namespace fp4kv {

using internal::CeilDiv;
using internal::KVCacheState;

absl::StatusOr<SequenceId> KVCache::ImportHalfPages(absl::Span<const HalfPagedCache> layers,
                                                    absl::Span<const int32_t> src_pages,
                                                    int64_t length, Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  s.PollSwaps();
  const int L = s.options.num_layers;
  const int64_t ps = s.geometry.page_size;
  if (static_cast<int64_t>(layers.size()) != L) {
    return absl::InvalidArgumentError(
        absl::StrCat("layers: expected ", L, " (one per layer), got ", layers.size()));
  }
  if (length < 0) {
    return absl::InvalidArgumentError(absl::StrCat("length: expected >= 0, got ", length));
  }
  const int64_t n = CeilDiv(length, ps);
  if (n > static_cast<int64_t>(src_pages.size())) {
    return absl::InvalidArgumentError(absl::StrCat("src_pages: expected at least ", n,
                                                   " pages for ", length, " tokens, got ",
                                                   src_pages.size()));
  }
  if (n > s.options.max_pages_per_seq) {
    return absl::InvalidArgumentError(
        absl::StrCat("length: expected at most max_pages_per_seq * "
                     "page_size = ",
                     s.options.max_pages_per_seq * ps, ", got ", length));
  }
  // Validate every layer's quantization before anything changes; the lists'
  // device memory does not exist yet, so a stand-in address is checked (the
  // checks never read through it).
  PagedCacheQuantizer::Options o;
  o.geometry = s.geometry;
  o.input_dtype = L > 0 ? layers[0].k.dtype : DType::kBF16;
  o.recipe = s.options.recipe;
  o.device = s.options.device;
  std::vector<internal::QuantizeCacheParams> params(L);  // L: bounded by the pools
  // Source and destination page ids; n is bounded by the caller's src_pages
  // (and max_pages_per_seq), so its host copy goes through the helper.
  internal::HostVector<int32_t> lists;
  FP4KV_RETURN_IF_ERROR(
      internal::SizeHost(&lists, 2 * n, int32_t{0}, "ImportHalfPages", "the page lists"));
  int32_t* const stand_in = reinterpret_cast<int32_t*>(s.mem.pools.get());
  for (int l = 0; l < L; ++l) {
    o.source_layout = layers[l].layout;
    o.compute_scales = s.LayerPending(l);
    o.headroom = s.options.calibration_headroom;
    absl::StatusOr<PagedCacheQuantizer> op = PagedCacheQuantizer::Create(o);
    if (!op.ok()) return op.status();
    QuantizeCacheArgs a;
    a.source = layers[l];
    a.src_pages = TensorView::Contiguous(stand_in, DType::kI32, {n}, s.options.device);
    a.dst_pages = TensorView::Contiguous(stand_in + n, DType::kI32, {n}, s.options.device);
    a.num_tokens = length;
    float* scales = s.scales.d_scales() + 4 * l;
    if (o.compute_scales) {
      a.k_scale_out = scales + 0;
      a.v_scale_out = scales + 1;
    } else {
      a.k_scale = GlobalScale::Pointer(scales + 0);
      a.v_scale = GlobalScale::Pointer(scales + 1);
    }
    absl::StatusOr<internal::QuantizeCacheParams> p =
        internal::MakeQuantizeCacheParams(o, a, s.LayerCache(l));
    if (!p.ok()) {
      return absl::Status(p.status().code(),
                          absl::StrCat("layers[", l, "].", p.status().message()));
    }
    for (int64_t i = 0; i < n; ++i) {
      if (src_pages[i] < 0 || src_pages[i] >= p->src_num_pages) {
        return absl::InvalidArgumentError(absl::StrCat("src_pages: expected ids in [0, ",
                                                       p->src_num_pages, ") (pages of layers[", l,
                                                       "]), got ", src_pages[i], " at ", i));
      }
    }
    if (o.compute_scales) {  // a pending layer: calibrate like a first append
      p->zero_first = false;
      p->amax_bits[0] = s.scales.d_calib() + 4 * l + 0;
      p->amax_bits[1] = s.scales.d_calib() + 4 * l + 1;
      p->fp8_out[0] = scales + 2;
      p->fp8_out[1] = scales + 3;
      p->flags = s.scales.d_flags() + 2 * l;
      p->host_flags = s.cuda ? s.scales.h_flags_dev() + 2 * l : nullptr;
    }
    params[l] = *p;
  }
  if (n > s.allocator.available_count() && !s.retire.empty()) {
    FP4KV_RETURN_IF_ERROR(s.WaitSwapOuts());
  }
  if (n > s.allocator.available_count()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "ImportHalfPages: needs ", n, " free pages, the pool has ", s.allocator.available_count()));
  }
  internal::ScopedDevice scoped;
  int32_t* d_lists = lists.data();
  if (s.cuda) {
    FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
    if (n > 0) {
      void* mem = nullptr;
      FP4KV_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&mem, lists.size() * sizeof(int32_t),
                                                 reinterpret_cast<cudaStream_t>(stream)));
      d_lists = static_cast<int32_t*>(mem);
    }
  }
  // Commit: the sequence and its pages.
  const SequenceId id = s.NewSequence();
  KVCacheState::Sequence& q = *s.Find(id);
  // The rows' token ids are unknown: the sequence is never prefix-tracked, so
  // its pages are not indexed (nor are those of later steps).
  if (q.chain.tracked) q.chain.Untrack();
  for (int64_t i = 0; i < n; ++i) {
    q.pages.push_back(s.allocator.Allocate());
    lists[i] = src_pages[i];
    lists[n + i] = q.pages.back();
  }
  q.length = length;
  if (n == 0) return id;
  s.SettleLayers(0, L);
  absl::Status status = absl::OkStatus();
  const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
  if (s.cuda) {
    // New pages a promotion may still be writing: its copy goes first.
    status = s.OrderAfterPromotion(q.pages, stream);
    if (status.ok()) {
      status = internal::CudaStatus(
          cudaMemcpyAsync(d_lists, lists.data(), lists.size() * sizeof(int32_t),
                          cudaMemcpyHostToDevice, cs),
          "cudaMemcpyAsync(import page lists)");
    }
  }
  for (int l = 0; l < L && status.ok(); ++l) {
    params[l].src_pages = d_lists;
    params[l].dst_pages = d_lists + n;
    if (!s.cuda) {
      internal::ReferenceQuantizeCache(params[l]);
    } else {
      status = internal::LaunchQuantizeCache(params[l], stream);
    }
  }
  if (s.cuda) {
    const absl::Status freed = internal::CudaStatus(cudaFreeAsync(d_lists, cs), "cudaFreeAsync");
    if (status.ok()) status = freed;
  }
  if (!status.ok()) {
    (void)ReleaseSequence(id);
    return absl::InternalError(absl::StrCat("ImportHalfPages: ", status.message()));
  }
  return id;
}

}  // namespace fp4kv
