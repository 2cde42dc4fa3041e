// A scripted stand-in for a KVCache behind the transfer protocol's cache
// port: sequences are opaque random images with a small header, pages are a
// counter, and commits can be made to fail. It lets the protocol's framing,
// ordering and failure handling be tested apart from the cache (and on a
// GPU without one).
#ifndef FP4KV_TESTS_TESTING_FAKE_IMAGE_CACHE_H_
#define FP4KV_TESTS_TESTING_FAKE_IMAGE_CACHE_H_

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "fp4kv/transfer.h"
#include "src/transfer/transfer_internal.h"

namespace fp4kv {
namespace testing {

class FakeImageCache {
 public:
  static constexpr int64_t kHeaderBytes = 256;
  static constexpr int64_t kPageTokens = 16;
  // `pages` pages in all; images made here carry `geometry_tag` and a
  // receiver refuses (InvalidArgument) images with another tag.
  FakeImageCache(Device device, int64_t pages, int64_t bytes_per_token = 40,
                 int64_t geometry_tag = 7);
  ~FakeImageCache();

  // A sequence of `length` tokens with random image bytes.
  SequenceId Add(int64_t length, uint64_t seed);
  int64_t ImageBytes(int64_t length) const { return kHeaderBytes + length * bytes_per_token_; }
  // Host copy of a sequence's image (empty when unknown).
  std::vector<uint8_t> Image(SequenceId seq) const;
  bool Has(SequenceId seq) const { return seqs_.count(seq) != 0; }

  struct State {
    std::map<SequenceId, std::vector<uint8_t>> images;
    int64_t pages_used = 0;
    int64_t reservations = 0;
  };
  State Snap() const;
  // "" when equal, else the difference.
  static std::string Diff(const State& a, const State& b);

  int64_t pages_used() const { return pages_used_; }
  int64_t reservations() const { return static_cast<int64_t>(reserved_.size()); }
  // The next `n` commits fail (DataLoss), cancelling their reservations.
  void FailCommits(int n) { fail_commits_ = n; }

  // A port onto this cache (the cache must outlive it).
  std::unique_ptr<internal::TransferCachePort> Port();

 private:
  friend class FakePort;
  struct Seq {
    int64_t length = 0;
    int64_t bytes = 0;
    void* data = nullptr;  // host or device
  };
  int64_t PagesFor(int64_t length) const { return (length + kPageTokens - 1) / kPageTokens; }
  void* Alloc(int64_t bytes);
  void Free(void* p);

  Device device_;
  int64_t pages_total_;
  int64_t bytes_per_token_;
  int64_t tag_;
  int64_t pages_used_ = 0;
  int fail_commits_ = 0;
  SequenceId next_seq_ = 1;
  uint64_t next_handle_ = 1;
  std::map<SequenceId, Seq> seqs_;
  std::map<uint64_t, int64_t> reserved_;  // handle -> pages
  std::map<uint64_t, std::pair<int64_t, int64_t>> reserved_shape_;  // handle -> bytes, length
};

}  // namespace testing
}  // namespace fp4kv

#endif  // FP4KV_TESTS_TESTING_FAKE_IMAGE_CACHE_H_
