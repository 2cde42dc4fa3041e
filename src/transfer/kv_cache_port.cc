// The transfer protocol's view of a KVCache: export, two-phase import.
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "fp4kv/kv_cache.h"
#include "src/transfer/transfer_internal.h"

#include "fp4kv/sequence_image.h"

namespace fp4kv {
namespace internal {
namespace {

class KVCachePort : public TransferCachePort {
 public:
  explicit KVCachePort(KVCache* cache) : cache_(cache) {}
  ~KVCachePort() override {
    for (auto& [handle, r] : reserved_) cache_->CancelImport(std::move(r)).IgnoreError();
  }
  Device device() const override { return cache_->device(); }
  int64_t header_bytes() const override { return kSequenceImageHeaderBytes; }
  absl::StatusOr<int64_t> ExportedBytes(SequenceId seq) const override {
    return cache_->ExportedBytes(seq);
  }
  absl::StatusOr<int64_t> Length(SequenceId seq) const override {
    return cache_->SequenceLength(seq);
  }
  absl::Status Export(SequenceId seq, void* dst, int64_t dst_bytes, Stream stream) const override {
    return cache_->ExportSequence(seq, dst, dst_bytes, stream);
  }
  absl::Status Release(SequenceId seq) override { return cache_->ReleaseSequence(seq); }
  absl::StatusOr<Reserved> Reserve(const void* header, int64_t bytes) override {
    absl::StatusOr<SequenceImageHeader> h = ParseSequenceImageHeader(header, bytes);
    if (!h.ok()) return h.status();
    absl::StatusOr<ImportReservation> r = cache_->ReserveImport(*h);
    if (!r.ok()) return r.status();
    const uint64_t handle = next_++;
    reserved_.emplace(handle, std::move(*r));
    return Reserved{handle, h->image_bytes, h->length};
  }
  absl::StatusOr<SequenceId> Commit(uint64_t handle, const void* image, int64_t bytes,
                                    Stream stream) override {
    auto it = reserved_.find(handle);
    if (it == reserved_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("reservation ", handle, " is not open"));
    }
    ImportReservation r = std::move(it->second);
    reserved_.erase(it);
    return cache_->CommitImport(std::move(r), image, bytes, ImportOptions{}, stream);
  }
  absl::Status Cancel(uint64_t handle) override {
    auto it = reserved_.find(handle);
    if (it == reserved_.end()) {
      return absl::InvalidArgumentError(absl::StrCat("reservation ", handle, " is not open"));
    }
    ImportReservation r = std::move(it->second);
    reserved_.erase(it);
    return cache_->CancelImport(std::move(r));
  }

 private:
  KVCache* cache_;
  uint64_t next_ = 1;
  absl::flat_hash_map<uint64_t, ImportReservation> reserved_;
};


}  // namespace

std::unique_ptr<TransferCachePort> MakeKVCachePort(KVCache* cache) {
  return std::make_unique<KVCachePort>(cache);
}

}  // namespace internal
}  // namespace fp4kv
