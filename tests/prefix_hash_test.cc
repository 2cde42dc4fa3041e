#include "src/prefix_hash.h"

#include <xxhash.h>

#include <cstring>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace fp4kv {
namespace internal {
namespace {

// The bytes docs/kv_cache.md specifies, built the slow way.
std::vector<uint8_t> SpecBytes(const BlockHash* parent, const std::vector<int32_t>& tokens,
                               const std::string& key) {
  std::vector<uint8_t> b;
  auto u32 = [&](uint32_t v) {
    for (int k = 0; k < 4; ++k) b.push_back(static_cast<uint8_t>(v >> (8 * k)));
  };
  auto u64be = [&](uint64_t v) {
    for (int k = 0; k < 8; ++k) b.push_back(static_cast<uint8_t>(v >> (56 - 8 * k)));
  };
  if (parent != nullptr) {
    u64be(parent->high);
    u64be(parent->low);
  } else {
    b.resize(16, 0);
  }
  u32(static_cast<uint32_t>(tokens.size()));
  for (int32_t t : tokens) u32(static_cast<uint32_t>(t));
  u32(static_cast<uint32_t>(key.size()));
  b.insert(b.end(), key.begin(), key.end());
  return b;
}

TEST(PrefixHash, GoldenValuesPinTheFormat) {
  // Fixed forever: a router compares these across processes and versions.
  std::vector<uint8_t> scratch;
  const std::vector<int32_t> t0 = {1, 2, 3, 50000};
  const BlockHash h0 = HashPage(nullptr, t0, "", &scratch);
  EXPECT_EQ(h0.ToHex(), "e34c4c4be5fc1bb96f6b4bd20a897e6a");
  const std::vector<int32_t> t1 = {-1, 0, 7, 8};
  const BlockHash h1 = HashPage(&h0, t1, "lora7", &scratch);
  EXPECT_EQ(h1.ToHex(), "ddd26c6e0f7b9e1cb966a5fb4d565789");
}

TEST(PrefixHash, MatchesTheSpecifiedBytes) {
  std::mt19937 rng(7);
  std::vector<uint8_t> scratch;
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 40);
    std::vector<int32_t> tokens(n);
    for (int32_t& t : tokens) t = static_cast<int32_t>(rng());
    std::string key(rng() % 9, 'x');
    for (char& c : key) c = static_cast<char>(rng());
    const BlockHash parent{rng(), static_cast<uint64_t>(rng()) << 32 | rng()};
    const bool has_parent = trial % 3 != 0;
    const std::vector<uint8_t> bytes = SpecBytes(has_parent ? &parent : nullptr, tokens, key);
    const XXH128_hash_t want = XXH3_128bits(bytes.data(), bytes.size());
    const BlockHash got = HashPage(has_parent ? &parent : nullptr, tokens, key, &scratch);
    EXPECT_EQ(got.high, want.high64);
    EXPECT_EQ(got.low, want.low64);
  }
}

TEST(PrefixHash, EveryInputChangesTheHash) {
  std::vector<uint8_t> scratch;
  const std::vector<int32_t> t = {10, 11, 12, 13};
  const BlockHash base = HashPage(nullptr, t, "", &scratch);
  std::set<std::string> seen = {base.ToHex()};
  const BlockHash p{1, 2};
  EXPECT_TRUE(seen.insert(HashPage(&p, t, "", &scratch).ToHex()).second) << "parent";
  const BlockHash zero{0, 0};
  EXPECT_TRUE(seen.insert(HashPage(&zero, {10, 11, 12, 14}, "", &scratch).ToHex()).second);
  EXPECT_TRUE(seen.insert(HashPage(nullptr, t, "tenant-a", &scratch).ToHex()).second) << "key";
  EXPECT_TRUE(seen.insert(HashPage(nullptr, t, "tenant-b", &scratch).ToHex()).second) << "key";
  EXPECT_TRUE(seen.insert(HashPage(nullptr, {10, 11, 12}, "", &scratch).ToHex()).second)
      << "page size";
  // A token moved into the key does not collide (lengths are hashed).
  EXPECT_TRUE(seen.insert(HashPage(nullptr, {10, 11, 12}, std::string("\x0d\0\0\0", 4), &scratch)
                              .ToHex())
                  .second);
}

TEST(TokenChain, TruncateKeepsTheHashesOfFullPages) {
  std::vector<uint8_t> scratch;
  TokenChain c;
  c.Reset(true, "k");
  const BlockHash h0 = HashPage(nullptr, {1, 2, 3, 4}, "k", &scratch);
  c.hashes = {h0, HashPage(&h0, {5, 6, 7, 8}, "k", &scratch)};
  c.Truncate(6, 4);
  ASSERT_EQ(c.hashes.size(), 1u);
  EXPECT_EQ(c.hashes[0], h0);
  c.Truncate(6, 4);
  EXPECT_EQ(c.hashes.size(), 1u);
  c.Untrack();
  EXPECT_FALSE(c.tracked);
  EXPECT_TRUE(c.hashes.empty());
  c.Reset(true, "");
  EXPECT_TRUE(c.tracked);
  EXPECT_EQ(c.extra_key, "");
}

}  // namespace
}  // namespace internal
}  // namespace fp4kv
