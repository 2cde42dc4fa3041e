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
  size_t operator()(const BlockHash& h) const { return static_cast<size_t>(h.low ^ h.high); }
};

// The token ids of a sequence and the hashes of its full pages, while the
// sequence is tracked. Invariant when tracked: tokens.size() == the
// sequence's length and hashes.size() == tokens.size() / page_size.
struct TokenChain {
  bool tracked = false;
  std::string extra_key;
  std::vector<int32_t> tokens;
  std::vector<BlockHash> hashes;

  // Starts over, tracked or not (capacities are kept).
  void Reset(bool track, absl::string_view key);
  // Stops tracking (a step came without token ids): later pages are never
  // hashed.
  void Untrack();
  // Appends token ids and hashes every page they complete; returns the
  // index of the first new hash (== hashes.size() when none).
  size_t Append(absl::Span<const int32_t> ids, int page_size, std::vector<uint8_t>* scratch);
  // Keeps the first `len` tokens and the hashes of the pages they fill.
  void Truncate(int64_t len, int page_size);
};

}  // namespace internal
}  // namespace fp4kv

#endif  // FP4KV_SRC_PREFIX_HASH_H_
