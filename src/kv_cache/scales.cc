// KVCache scales: global scales, calibration flags, re-encode, reads.
#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "fp4kv/calibrate.h"
#include "fp4kv/recipe.h"
#include "src/kv_cache/state.h"
#include "src/validate.h"

namespace fp4kv {

using internal::CeilDiv;
using internal::KVCacheState;

namespace internal {

absl::Status CheckScale(float v, const char* name, int layer) {
  if (!IsValidGlobalScale(v)) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, "[", layer, "]: expected a global scale in (0, ", MaxGlobalScale(),
                     "] (positive, with 6 * 448 * g finite), got ", v));
  }
  return absl::OkStatus();
}

absl::Status ScaleState::Init(const KVCacheOptions& o, const CacheGeometry& g, uint8_t* d_step,
                              const StepLayout& sl, bool cuda) {
  constexpr char kCall[] = "KVCache::Create";
  d_scales_ = reinterpret_cast<float*>(d_step + sl.scales);
  d_flags_ = reinterpret_cast<int32_t*>(d_step + sl.flags);
  d_calib_ = reinterpret_cast<uint32_t*>(d_step + sl.calib);
  d_events_ = reinterpret_cast<uint64_t*>(d_step + sl.events);
  d_old_scales_ = reinterpret_cast<float*>(d_step + sl.old_scales);
  const int L = o.num_layers;
  // [L, 4] and [L, 2]: L is bounded by the pools (and counted by
  // PlanCapacity); through the helper like the other host tables.
  HostVector<float> scales;
  HostVector<int32_t> flags;
  FP4KV_RETURN_IF_ERROR(SizeHost(&scales, 4 * int64_t{L}, 0.0f, kCall, "the global scales"));
  FP4KV_RETURN_IF_ERROR(
      SizeHost(&flags, 2 * int64_t{L}, int32_t{0}, kCall, "the calibration flags"));
  for (int l = 0; l < L; ++l) {
    const float k = o.k_global_scales.empty() ? 1.0f : o.k_global_scales[l];
    const float v = o.v_global_scales.empty() ? 1.0f : o.v_global_scales[l];
    absl::StatusOr<float> kf =
        g.fp8_keys() ? absl::StatusOr<float>(MinFp8ScaleForFp8Keys(k)) : MinFp8Scale(k);
    absl::StatusOr<float> vf = MinFp8Scale(v);
    if (!kf.ok()) return kf.status();
    if (!vf.ok()) return vf.status();
    scales[4 * l + 0] = k;
    scales[4 * l + 1] = v;
    scales[4 * l + 2] = *kf;
    scales[4 * l + 3] = *vf;
    flags[2 * l + 0] = o.k_global_scales.empty() ? 0 : 1;
    flags[2 * l + 1] = o.v_global_scales.empty() ? 0 : 1;
  }
  if (cuda) {
    FP4KV_RETURN_IF_ERROR(mapped_flags_.Allocate(Memory::Kind::kPinnedMapped, 4 * 2 * L,
                                                 "the mapped calibration flags"));
    h_flags_ = reinterpret_cast<int32_t*>(mapped_flags_.get());
    void* dev_ptr = nullptr;
    FP4KV_CUDA_RETURN_IF_ERROR(cudaHostGetDevicePointer(&dev_ptr, h_flags_, 0));
    h_flags_dev_ = static_cast<int32_t*>(dev_ptr);
    std::memcpy(h_flags_, flags.data(), flags.size() * sizeof(int32_t));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpy(d_scales_, scales.data(), scales.size() * sizeof(float),
                                          cudaMemcpyHostToDevice));
    FP4KV_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(d_flags_, flags.data(), flags.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  } else {
    std::memcpy(d_scales_, scales.data(), scales.size() * sizeof(float));
    std::memcpy(d_flags_, flags.data(), flags.size() * sizeof(int32_t));
    h_flags_ = d_flags_;
  }
  append_serial_.assign(L, 0);
  captured_.assign(L, 0);
  known_scales_.assign(scales.begin(), scales.end());
  known_.assign(L, 0);
  for (int l = 0; l < L; ++l) known_[l] = flags[2 * l] != 0 && flags[2 * l + 1] != 0;
  settled_ = known_;
  return absl::OkStatus();
}

void ScaleState::RecordAppend(int layer, uint64_t serial, bool captured, bool tokens) {
  if (captured) captured_[layer] = 1;
  if (!tokens) return;
  append_serial_[layer] = serial;
  Settle(layer, 1);  // its calibration (if any) is enqueued before the append
}

void ScaleState::Settle(int first, int count) {
  std::fill(settled_.begin() + first, settled_.begin() + first + count, 1);
}

bool ScaleState::AllSettled() {
  if (all_settled_) return true;
  for (uint8_t settled : settled_) {
    if (settled == 0) return false;
  }
  all_settled_ = true;
  return true;
}

void ScaleState::SetKnown(int first, int count, const float* vals) {
  std::copy(vals, vals + 4 * count, known_scales_.begin() + 4 * first);
  std::fill(known_.begin() + first, known_.begin() + first + count, 1);
}

bool ScaleState::Fingerprint(uint64_t* out) const {
  for (uint8_t k : known_) {
    if (k == 0) return false;
  }
  *out = XXH3_64bits(known_scales_.data(), known_scales_.size() * sizeof(float));
  return true;
}

int64_t KVCacheState::TokensHeld(int layer) const {
  int64_t n = TokensResident();
  if (!scales.AppendedFor(layer, step.serial())) n -= step.cur().info.num_tokens;
  return n < 0 ? 0 : n;
}

bool KVCacheState::LayerPending(int layer) const {
  const volatile int32_t* f = scales.h_flags() + 2 * layer;
  return f[0] == 0 || f[1] == 0;
}

absl::Status KVCacheState::CheckScaleChange(int layer, StoredTokens stored, bool* reencode) const {
  SequenceId swapped = 0;
  if (const int64_t t = SwappedTokens(&swapped); t > 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, ": sequence ", swapped, " (and ", t,
        " swapped-out tokens in all) is swapped out to the host tier under the current "
        "scales, which a scale change cannot re-encode there (SwapIn or release it first); "
        "nothing changed"));
  }
  const int64_t held = TokensHeld(layer);
  *reencode = held > 0;
  if (held > 0 && stored != StoredTokens::kReencode) {
    return absl::FailedPreconditionError(absl::StrCat(
        "layer ", layer, ": holds ", held,
        " tokens quantized under its current global scales; changing the scales would "
        "silently re-scale them (pass StoredTokens::kReencode to requantize the stored pages, "
        "or change scales before storing tokens); nothing changed"));
  }
  return absl::OkStatus();
}

absl::Status KVCacheState::SaveOldScales(int layer, Stream stream) {
  if (!cuda) {
    std::memcpy(scales.d_old_scales() + 2 * layer, scales.d_scales() + 4 * layer,
                2 * sizeof(float));
    return absl::OkStatus();
  }
  return CudaStatus(
      cudaMemcpyAsync(scales.d_old_scales() + 2 * layer, scales.d_scales() + 4 * layer,
                      2 * sizeof(float), cudaMemcpyDeviceToDevice,
                      reinterpret_cast<cudaStream_t>(stream)),
      "cudaMemcpyAsync(old scales)");
}

absl::Status KVCacheState::Reencode(int layer, Stream stream) const {
  uint8_t* base = mem.pools.get() + layer * mem.pool.layer_bytes;
  for (int kv = 0; kv < 2; ++kv) {
    ReencodeParams p;
    p.data = base + mem.pool.regions[kv].offset;
    if (kv == 0 && geometry.fp8_keys()) {  // 16 FP8 key bytes a "block"
      p.fp8_keys = true;
      p.blocks = mem.pool.regions[0].page_bytes * geometry.num_pages / kBlockSize;
    } else {
      p.scales = base + mem.pool.regions[2 + kv].offset;
      p.blocks =
          mem.pool.regions[2 + kv].page_bytes * geometry.num_pages;  // one scale byte a block
    }
    p.old_scale = scales.d_old_scales() + 2 * layer + kv;
    p.new_scale = scales.d_scales() + 4 * layer + kv;
    p.recipe = options.recipe;
    if (!cuda) {
      ReferenceReencode(p);
    } else {
      FP4KV_RETURN_IF_ERROR(LaunchReencode(p, stream));
    }
  }
  return absl::OkStatus();
}

absl::Status KVCacheState::MarkCalibrated(int first, int count, Stream stream) {
  std::vector<int32_t> ones(2 * static_cast<size_t>(count), 1);
  if (cuda) {
    FP4KV_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(scales.d_flags() + 2 * first, ones.data(), ones.size() * sizeof(int32_t),
                        cudaMemcpyHostToDevice, reinterpret_cast<cudaStream_t>(stream)));
  }
  for (size_t i = 0; i < ones.size(); ++i) scales.h_flags()[2 * first + i] = 1;
  SettleLayers(first, count);
  return absl::OkStatus();
}

void KVCacheState::SettleLayers(int first, int count) { scales.Settle(first, count); }

void KVCacheState::RecordAppend(int layer, uint64_t serial, bool captured, bool tokens) {
  scales.RecordAppend(layer, serial, captured, tokens);
}

bool KVCacheState::ScaleFingerprint(uint64_t* out) const { return scales.Fingerprint(out); }

bool KVCacheState::Calibrated() { return scales.AllSettled(); }

}  // namespace internal

absl::Status KVCache::UpdateGlobalScales(int layer, float k_scale, float v_scale, Stream stream,
                                         StoredTokens stored) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  return UpdateGlobalScalesRange(layer, 1, &k_scale, &v_scale, stream, stored);
}

absl::Status KVCache::UpdateGlobalScales(absl::Span<const float> k_scales,
                                         absl::Span<const float> v_scales, Stream stream,
                                         StoredTokens stored) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const int L = state_->options.num_layers;
  for (const auto& [v, name] :
       {std::pair<absl::Span<const float>, const char*>{k_scales, "k_scales"},
        std::pair<absl::Span<const float>, const char*>{v_scales, "v_scales"}}) {
    if (static_cast<int64_t>(v.size()) != L) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected ", L, " values (one per layer), got ", v.size()));
    }
  }
  return UpdateGlobalScalesRange(0, L, k_scales.data(), v_scales.data(), stream, stored);
}

absl::Status KVCache::UpdateGlobalScalesRange(int first, int count, const float* k_scales,
                                              const float* v_scales, Stream stream,
                                              StoredTokens stored) {
  KVCacheState& s = *state_;
  const bool one = count == 1;
  if (one) FP4KV_RETURN_IF_ERROR(s.CheckLayer(first));
  std::vector<float> vals(4 * static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) {
    const int l = first + i;
    FP4KV_RETURN_IF_ERROR(internal::CheckScale(k_scales[i], one ? "k_scale" : "k_scales", l));
    FP4KV_RETURN_IF_ERROR(internal::CheckScale(v_scales[i], one ? "v_scale" : "v_scales", l));
    absl::StatusOr<float> kf = s.geometry.fp8_keys()
                                   ? absl::StatusOr<float>(MinFp8ScaleForFp8Keys(k_scales[i]))
                                   : MinFp8Scale(k_scales[i]);
    if (!kf.ok()) return kf.status();
    absl::StatusOr<float> vf = MinFp8Scale(v_scales[i]);
    if (!vf.ok()) return vf.status();
    vals[4 * i + 0] = k_scales[i];
    vals[4 * i + 1] = v_scales[i];
    vals[4 * i + 2] = *kf;
    vals[4 * i + 3] = *vf;
  }
  std::vector<uint8_t> reencode(count, 0);
  for (int i = 0; i < count; ++i) {
    bool r = false;
    FP4KV_RETURN_IF_ERROR(s.CheckScaleChange(first + i, stored, &r));
    reencode[i] = r;
  }
  internal::ScopedDevice scoped;
  if (s.cuda) FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  s.ClearPrefixIndex();  // cached bytes are only valid under the old scales
  for (int i = 0; i < count; ++i) {
    if (reencode[i]) FP4KV_RETURN_IF_ERROR(s.SaveOldScales(first + i, stream));
  }
  if (s.cuda) {
    // From pageable memory: staged before the call returns.
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(s.scales.d_scales() + 4 * first, vals.data(),
                                               vals.size() * sizeof(float), cudaMemcpyHostToDevice,
                                               reinterpret_cast<cudaStream_t>(stream)));
  } else {
    std::memcpy(s.scales.d_scales() + 4 * first, vals.data(), vals.size() * sizeof(float));
  }
  if (std::find(reencode.begin(), reencode.end(), 1) != reencode.end()) {
    // SwapIn copies still filling pages come first.
    FP4KV_RETURN_IF_ERROR(s.OrderAfterCopies(stream));
  }
  for (int i = 0; i < count; ++i) {
    if (reencode[i]) FP4KV_RETURN_IF_ERROR(s.Reencode(first + i, stream));
  }
  s.scales.SetKnown(first, count, vals.data());
  return s.MarkCalibrated(first, count, stream);
}

absl::Status KVCache::CalibrateGlobalScales(int layer, const TensorView& k, const TensorView& v,
                                            Calibrator& calibrator, Stream stream,
                                            StoredTokens stored) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  const Calibrator::Options& co = calibrator.options();
  if (!(co.recipe == s.options.recipe)) {
    return absl::InvalidArgumentError(absl::StrCat("calibrator: expected the cache's recipe (",
                                                   RecipeName(s.options.recipe), "), got ",
                                                   RecipeName(co.recipe)));
  }
  if (co.device != s.options.device) {
    return absl::InvalidArgumentError(absl::StrCat("calibrator: expected device ",
                                                   s.options.device.ToString(), ", got ",
                                                   co.device.ToString()));
  }
  // Check both tensors first so a bad V cannot leave K's scales half-updated.
  for (const auto& [t, name] : {std::pair<const TensorView&, const char*>{k, "k"},
                                std::pair<const TensorView&, const char*>{v, "v"}}) {
    FP4KV_RETURN_IF_ERROR(internal::CheckExtents(t, name));
    if (t.numel() > co.max_elements) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected at most ", co.max_elements,
                                                     " elements (calibrator.max_elements), got ",
                                                     t.numel()));
    }
    if (t.numel() > 0 && t.data == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected a tensor, got a null pointer"));
    }
    if (t.dtype != co.dtype) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected dtype ", DTypeName(co.dtype),
                                                     ", got ", DTypeName(t.dtype)));
    }
    if (t.device != co.device) {
      return absl::InvalidArgumentError(absl::StrCat(
          name, ": expected device ", co.device.ToString(), ", got ", t.device.ToString()));
    }
    if (reinterpret_cast<uintptr_t>(t.data) % DTypeSize(t.dtype) != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": expected a ", DTypeSize(t.dtype), "-byte aligned pointer"));
    }
  }
  bool reencode = false;
  FP4KV_RETURN_IF_ERROR(s.CheckScaleChange(layer, stored, &reencode));
  internal::ScopedDevice scoped;
  if (s.cuda) FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  s.ClearPrefixIndex();  // cached bytes are only valid under the old scales
  if (reencode) FP4KV_RETURN_IF_ERROR(s.SaveOldScales(layer, stream));
  float* scales = s.scales.d_scales() + 4 * layer;
  s.scales.Forget(layer);  // computed on the device
  // FP8 keys: g_k = MakeFp8KeyScale(amax), k_fp8 = g_k (the same reduction).
  FP4KV_RETURN_IF_ERROR(s.geometry.fp8_keys()
                            ? calibrator.RunFp8Key(k, nullptr, scales + 0, stream, scales + 2)
                            : calibrator.Run(k, nullptr, scales + 0, stream, scales + 2));
  FP4KV_RETURN_IF_ERROR(calibrator.Run(v, nullptr, scales + 1, stream, scales + 3));
  if (reencode) FP4KV_RETURN_IF_ERROR(s.OrderAfterCopies(stream));
  if (reencode) FP4KV_RETURN_IF_ERROR(s.Reencode(layer, stream));
  return s.MarkCalibrated(layer, 1, stream);
}

absl::StatusOr<LayerScales> KVCache::ReadScales(int layer, Stream stream) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  float vals[4];
  int32_t flags[2];
  if (s.cuda) {
    internal::ScopedDevice scoped;
    FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
    const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(vals, s.scales.d_scales() + 4 * layer, sizeof(vals),
                                               cudaMemcpyDeviceToHost, cs));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(flags, s.scales.d_flags() + 2 * layer, sizeof(flags),
                                               cudaMemcpyDeviceToHost, cs));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cs));
  } else {
    std::memcpy(vals, s.scales.d_scales() + 4 * layer, sizeof(vals));
    std::memcpy(flags, s.scales.d_flags() + 2 * layer, sizeof(flags));
  }
  LayerScales r;
  r.k = vals[0];
  r.v = vals[1];
  r.k_fp8 = vals[2];
  r.v_fp8 = vals[3];
  r.k_calibrated = flags[0] != 0;
  r.v_calibrated = flags[1] != 0;
  return r;
}

absl::StatusOr<int64_t> KVCache::LayerTokens(int layer) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  FP4KV_RETURN_IF_ERROR(state_->CheckLayer(layer));
  return state_->TokensHeld(layer);
}

absl::StatusOr<ScaleEventCounts> KVCache::ReadScaleEvents(int layer, Stream stream) const {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  const KVCacheState& s = *state_;
  FP4KV_RETURN_IF_ERROR(s.CheckLayer(layer));
  if (!s.options.count_scale_events) {
    return absl::FailedPreconditionError(
        "ReadScaleEvents: expected a cache created with count_scale_events, got one without");
  }
  uint64_t c[4];
  if (s.cuda) {
    internal::ScopedDevice scoped;
    FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
    const cudaStream_t cs = reinterpret_cast<cudaStream_t>(stream);
    FP4KV_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(c, s.scales.d_events() + 4 * layer, sizeof(c), cudaMemcpyDeviceToHost, cs));
    FP4KV_CUDA_RETURN_IF_ERROR(cudaStreamSynchronize(cs));
  } else {
    std::memcpy(c, s.scales.d_events() + 4 * layer, sizeof(c));
  }
  return ScaleEventCounts{c[0], c[1], c[2], c[3]};
}

absl::Status KVCache::ResetScaleEvents(Stream stream) {
  FP4KV_KV_RETURN_IF_MOVED_FROM();
  KVCacheState& s = *state_;
  if (!s.options.count_scale_events) {
    return absl::FailedPreconditionError(
        "ResetScaleEvents: expected a cache created with count_scale_events, got one without");
  }
  const size_t bytes = 4 * sizeof(uint64_t) * static_cast<size_t>(s.options.num_layers);
  if (!s.cuda) {
    std::memset(s.scales.d_events(), 0, bytes);
    return absl::OkStatus();
  }
  internal::ScopedDevice scoped;
  FP4KV_RETURN_IF_ERROR(scoped.Set(s.options.device));
  return internal::CudaStatus(
      cudaMemsetAsync(s.scales.d_events(), 0, bytes, reinterpret_cast<cudaStream_t>(stream)),
      "cudaMemsetAsync(scale events)");
}

const float* KVCache::global_scale_ptr(int layer, int kv) const {
  if (state_ == nullptr || !state_->CheckLayer(layer).ok()) return nullptr;
  return state_->scales.d_scales() + 4 * layer + (kv != 0 ? 1 : 0);
}
const float* KVCache::fp8_scale_ptr(int layer, int kv) const {
  if (state_ == nullptr || !state_->CheckLayer(layer).ok()) return nullptr;
  return state_->scales.d_scales() + 4 * layer + 2 + (kv != 0 ? 1 : 0);
}

}  // namespace fp4kv
