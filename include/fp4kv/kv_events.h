// KV events: what a KVCache with prefix caching tells a KV-aware router about
// the pages it holds (KVCache::TakeEvents). The cache only queues them; how
// they travel (serialization, transport) is the server's.
#ifndef FP4KV_KV_EVENTS_H_
#define FP4KV_KV_EVENTS_H_

#include <cstdint>
#include <string>
#include <vector>

namespace fp4kv {

// The 128-bit content hash of one full page (docs/kv_cache.md, "Prefix
// caching", gives the exact bytes hashed). Stable across processes and
// machines: two caches holding the same tokens under the same extra key and
// page size report the same hashes.
struct BlockHash {
  uint64_t high = 0;  // XXH128 high64
  uint64_t low = 0;   // XXH128 low64
  bool operator==(const BlockHash& o) const { return high == o.high && low == o.low; }
  bool operator!=(const BlockHash& o) const { return !(*this == o); }
  // 32 lowercase hex digits, high then low (XXH128's canonical big-endian form).
  std::string ToHex() const;
};

enum class KVEventType : uint8_t {
  kBlockStored = 0,       // pages entered the prefix index
  kBlockRemoved = 1,      // pages left it (evicted, overwritten)
  kAllBlocksCleared = 2,  // the index was emptied (a scale change, ResetPrefixCache)
};

// Where the pages of an event are: device memory (the cache's pools) or the
// host tier of the prefix cache (PrefixCacheOptions::host_bytes). A page that
// moves between tiers is one kBlockRemoved of the medium it leaves and one
// kBlockStored of the medium it enters.
enum class KVMedium : uint8_t {
  kGpu = 0,   // the cache's pools (also on Device::Cpu(): the pools' memory)
  kHost = 1,  // the host tier of the prefix cache
};

// One event. A page covers every layer (K and V): there is no per-layer
// event. Fields not meaningful for a type are empty.
struct KVEvent {
  KVEventType type = KVEventType::kBlockStored;
  // kBlockStored: consecutive pages of one sequence, in order, each the
  // parent of the next; kBlockRemoved: pages that left the index.
  std::vector<BlockHash> block_hashes;
  // kBlockStored: the hash of the page before the first one, when it has one.
  bool has_parent = false;
  BlockHash parent_block_hash;
  // kBlockStored: the token ids of the pages (block_size per page).
  std::vector<int32_t> token_ids;
  int32_t block_size = 0;  // kBlockStored: tokens per page
  std::string extra_key;   // kBlockStored: the sequences' extra key (adapter, salt, ...)
  // kBlockStored, kBlockRemoved: where the pages are (were). Pages demoted to
  // the host tier are stored there without a parent and an extra key (their
  // hashes already cover both).
  KVMedium medium = KVMedium::kGpu;
};

// Events in the order they happened. `dropped` counts the events lost since
// the previous TakeEvents because the queue was full; a router that sees a
// nonzero count should treat its view of this cache as stale.
struct KVEventBatch {
  std::vector<KVEvent> events;
  uint64_t dropped = 0;
};

}  // namespace fp4kv

#endif  // FP4KV_KV_EVENTS_H_
