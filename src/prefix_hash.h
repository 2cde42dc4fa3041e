// Internal: the content hash of full pages and the per-sequence chain of
// hashes used by prefix caching (docs/kv_cache.md, "Prefix caching").
//
// Hash of page i of a sequence = XXH3-128 (seed 0) of
//   parent   16 bytes  page i-1's hash, canonical (high64 then low64, each
//                      big-endian); 16 zero bytes for page 0
//   size      4 bytes  tokens per page, u32 little-endian
//   tokens  4*size     the page's token ids, i32 little-endian
//   keylen    4 bytes  extra key length, u32 little-endian
//   key     keylen     the extra key's bytes
#ifndef FP4KV_SRC_PREFIX_HASH_H_
#define FP4KV_SRC_PREFIX_HASH_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "fp4kv/kv_events.h"

namespace fp4kv {
namespace internal {

// The hash of one full page; `parent` is null for a sequence's first page.
// `scratch` is reused between calls (no allocation once it is large enough).
BlockHash HashPage(const BlockHash* parent, absl::Span<const int32_t> tokens,
                   absl::string_view extra_key, std::vector<uint8_t>* scratch);

// For hash maps keyed by BlockHash (the hash is already uniform).
struct BlockHashHasher {
  size_t operator()(const BlockHash& h) const { return static_cast<size_t>(h.low); }
};

// The page hashes of a sequence while it is tracked (its token ids live
// with its pages: KVCacheState::page_tokens). Hashing lags the steps: pages
// filled by PrepareStep are hashed (and indexed) by the next call that reads
// the index. Invariant when tracked and not queued: hashes.size() == length
// / page_size, hashes[i] chained from hashes[i-1].
struct TokenChain {
  bool tracked = false;
  bool queued = false;  // on the list of sequences with unhashed full pages
  // Its last page may be indexed while partial (after a truncation): the
  // next append takes it out of the index first. Kept when untracked.
  bool tail_maybe_indexed = false;
  size_t index_from = 0;  // pages below were filled before calibration: never indexed
  // Positions [0, ids_known) have known token ids (given with their append
  // or later); only pages inside it are hashed and indexed.
  int64_t ids_known = 0;
  std::string extra_key;
  std::vector<BlockHash> hashes;

  // Starts over, tracked or not (capacities are kept).
  void Reset(bool track, absl::string_view key) {
    tracked = track;
    queued = false;
    tail_maybe_indexed = false;
    index_from = 0;
    ids_known = 0;
    extra_key.assign(key.data(), key.size());
    hashes.clear();
  }
  // Stops tracking (a swap-out): later pages are never hashed.
  void Untrack() {
    tracked = false;
    hashes.clear();
    ids_known = 0;
  }
  // Keeps the hashes of the pages the first `len` tokens fill.
  void Truncate(int64_t len, int page_size) {
    if (len % page_size != 0) tail_maybe_indexed = true;
    if (ids_known > len) ids_known = len;
    if (tracked && hashes.size() > static_cast<size_t>(len / page_size)) {
      hashes.resize(static_cast<size_t>(len / page_size));
    }
  }
};

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_PREFIX_HASH_H_
