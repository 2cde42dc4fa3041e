#include "testing/fake_image_cache.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"

namespace fp4kv {
namespace testing {
namespace {

constexpr uint64_t kMagic = 0x31474d49454b4146ull;  // "FAKEIMG1"

struct FakeHeader {
  uint64_t magic;
  int64_t image_bytes;
  int64_t length;
  int64_t tag;
  uint64_t check;  // simple sum of the four fields above
};

uint64_t Check(const FakeHeader& h) {
  return h.magic * 3 + static_cast<uint64_t>(h.image_bytes) * 5 +
         static_cast<uint64_t>(h.length) * 7 + static_cast<uint64_t>(h.tag) * 11;
}

}  // namespace

class FakePort : public internal::TransferCachePort {
 public:
  explicit FakePort(FakeImageCache* c) : c_(c) {}
  Device device() const override { return c_->device_; }
  int64_t header_bytes() const override { return FakeImageCache::kHeaderBytes; }
  absl::StatusOr<int64_t> ExportedBytes(SequenceId seq) const override {
    auto it = c_->seqs_.find(seq);
    if (it == c_->seqs_.end()) return absl::NotFoundError(absl::StrCat("seq ", seq));
    return it->second.bytes;
  }
  absl::StatusOr<int64_t> Length(SequenceId seq) const override {
    auto it = c_->seqs_.find(seq);
    if (it == c_->seqs_.end()) return absl::NotFoundError(absl::StrCat("seq ", seq));
    return it->second.length;
  }
  absl::Status Export(SequenceId seq, void* dst, int64_t dst_bytes, Stream stream) const override {
    auto it = c_->seqs_.find(seq);
    if (it == c_->seqs_.end()) return absl::NotFoundError(absl::StrCat("seq ", seq));
    if (dst_bytes < it->second.bytes) return absl::InvalidArgumentError("dst_bytes");
    if (c_->device_.is_cuda()) {
      if (cudaMemcpyAsync(dst, it->second.data, it->second.bytes, cudaMemcpyDeviceToDevice,
                          stream) != cudaSuccess) {
        return absl::InternalError("cudaMemcpyAsync");
      }
    } else {
      std::memcpy(dst, it->second.data, it->second.bytes);
    }
    return absl::OkStatus();
  }
  absl::Status Release(SequenceId seq) override {
    auto it = c_->seqs_.find(seq);
    if (it == c_->seqs_.end()) return absl::NotFoundError(absl::StrCat("seq ", seq));
    c_->pages_used_ -= c_->PagesFor(it->second.length);
    c_->Free(it->second.data);
    c_->seqs_.erase(it);
    return absl::OkStatus();
  }
  absl::StatusOr<Reserved> Reserve(const void* header, int64_t bytes) override {
    if (bytes < static_cast<int64_t>(sizeof(FakeHeader))) {
      return absl::InvalidArgumentError("header: too short");
    }
    FakeHeader h;
    std::memcpy(&h, header, sizeof(h));
    if (h.magic != kMagic || h.check != Check(h)) {
      return absl::InvalidArgumentError("header: not an image");
    }
    if (h.tag != c_->tag_) {
      return absl::InvalidArgumentError(
          absl::StrCat("geometry: expected ", c_->tag_, ", got ", h.tag));
    }
    const int64_t pages = c_->PagesFor(h.length);
    if (c_->pages_used_ + pages > c_->pages_total_) {
      return absl::ResourceExhaustedError(absl::StrCat("pages: need ", pages, ", ",
                                                       c_->pages_total_ - c_->pages_used_,
                                                       " free"));
    }
    c_->pages_used_ += pages;
    const uint64_t handle = c_->next_handle_++;
    c_->reserved_[handle] = pages;
    c_->reserved_shape_[handle] = {h.image_bytes, h.length};
    return Reserved{handle, h.image_bytes, h.length};
  }
  absl::StatusOr<SequenceId> Commit(uint64_t handle, const void* image, int64_t bytes,
                                    Stream stream) override {
    auto it = c_->reserved_.find(handle);
    if (it == c_->reserved_.end()) return absl::InvalidArgumentError("reservation");
    const auto [image_bytes, length] = c_->reserved_shape_[handle];
    const int64_t pages = it->second;
    c_->reserved_.erase(it);
    c_->reserved_shape_.erase(handle);
    if (c_->fail_commits_ > 0 || bytes != image_bytes) {
      if (c_->fail_commits_ > 0) --c_->fail_commits_;
      c_->pages_used_ -= pages;
      return absl::DataLossError("commit failed (scripted)");
    }
    FakeImageCache::Seq s;
    s.length = length;
    s.bytes = bytes;
    s.data = c_->Alloc(bytes);
    if (c_->device_.is_cuda()) {
      if (cudaMemcpyAsync(s.data, image, bytes, cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
        return absl::InternalError("cudaMemcpyAsync");
      }
    } else {
      std::memcpy(s.data, image, bytes);
    }
    const SequenceId id = c_->next_seq_++;
    c_->seqs_[id] = s;
    return id;
  }
  absl::Status Cancel(uint64_t handle) override {
    auto it = c_->reserved_.find(handle);
    if (it == c_->reserved_.end()) return absl::InvalidArgumentError("reservation");
    c_->pages_used_ -= it->second;
    c_->reserved_.erase(it);
    c_->reserved_shape_.erase(handle);
    return absl::OkStatus();
  }

 private:
  FakeImageCache* c_;
};

FakeImageCache::FakeImageCache(Device device, int64_t pages, int64_t bytes_per_token,
                               int64_t geometry_tag)
    : device_(device), pages_total_(pages), bytes_per_token_(bytes_per_token), tag_(geometry_tag) {}

FakeImageCache::~FakeImageCache() {
  for (auto& [id, s] : seqs_) Free(s.data);
}

void* FakeImageCache::Alloc(int64_t bytes) {
  void* p = nullptr;
  if (device_.is_cuda()) {
    if (cudaMalloc(&p, bytes) != cudaSuccess) return nullptr;
  } else {
    p = std::malloc(bytes);
  }
  return p;
}
void FakeImageCache::Free(void* p) {
  if (device_.is_cuda()) {
    cudaFree(p);
  } else {
    std::free(p);
  }
}

SequenceId FakeImageCache::Add(int64_t length, uint64_t seed) {
  Seq s;
  s.length = length;
  s.bytes = ImageBytes(length);
  std::vector<uint8_t> host(s.bytes);
  std::mt19937_64 rng(seed);
  for (auto& b : host) b = static_cast<uint8_t>(rng());
  FakeHeader h{kMagic, s.bytes, length, tag_, 0};
  h.check = Check(h);
  std::memcpy(host.data(), &h, sizeof(h));
  s.data = Alloc(s.bytes);
  if (device_.is_cuda()) {
    cudaMemcpy(s.data, host.data(), s.bytes, cudaMemcpyHostToDevice);
  } else {
    std::memcpy(s.data, host.data(), s.bytes);
  }
  pages_used_ += PagesFor(length);
  const SequenceId id = next_seq_++;
  seqs_[id] = s;
  return id;
}

std::vector<uint8_t> FakeImageCache::Image(SequenceId seq) const {
  auto it = seqs_.find(seq);
  if (it == seqs_.end()) return {};
  std::vector<uint8_t> out(it->second.bytes);
  if (device_.is_cuda()) {
    cudaDeviceSynchronize();
    if (cudaMemcpy(out.data(), it->second.data, out.size(), cudaMemcpyDeviceToHost) !=
        cudaSuccess) {
      out.clear();
    }
  } else {
    std::memcpy(out.data(), it->second.data, out.size());
  }
  return out;
}

FakeImageCache::State FakeImageCache::Snap() const {
  State s;
  for (const auto& [id, seq] : seqs_) s.images[id] = Image(id);
  s.pages_used = pages_used_;
  s.reservations = static_cast<int64_t>(reserved_.size());
  return s;
}

std::string FakeImageCache::Diff(const State& a, const State& b) {
  if (a.pages_used != b.pages_used) {
    return absl::StrCat("pages_used ", a.pages_used, " vs ", b.pages_used);
  }
  if (a.reservations != b.reservations) {
    return absl::StrCat("reservations ", a.reservations, " vs ", b.reservations);
  }
  if (a.images.size() != b.images.size()) {
    return absl::StrCat("sequences ", a.images.size(), " vs ", b.images.size());
  }
  for (const auto& [id, img] : a.images) {
    auto it = b.images.find(id);
    if (it == b.images.end()) return absl::StrCat("sequence ", id, " missing");
    if (it->second != img) return absl::StrCat("sequence ", id, " bytes differ");
  }
  return "";
}

std::unique_ptr<internal::TransferCachePort> FakeImageCache::Port() {
  return std::make_unique<FakePort>(this);
}

}  // namespace testing
}  // namespace fp4kv
