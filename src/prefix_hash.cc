#include "src/prefix_hash.h"

#include <cstring>

#include <xxhash.h>

namespace fp4kv {
namespace {

void PutU32(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
  p[2] = static_cast<uint8_t>(v >> 16);
  p[3] = static_cast<uint8_t>(v >> 24);
}

void PutU64BigEndian(uint8_t* p, uint64_t v) {
  for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(v >> (56 - 8 * i));
}

}  // namespace

std::string BlockHash::ToHex() const {
  static const char kDigits[] = "0123456789abcdef";
  std::string s(32, '0');
  for (int i = 0; i < 16; ++i) {
    const uint64_t word = i < 8 ? high : low;
    const uint8_t byte = static_cast<uint8_t>(word >> (56 - 8 * (i % 8)));
    s[2 * i] = kDigits[byte >> 4];
    s[2 * i + 1] = kDigits[byte & 15];
  }
  return s;
}

namespace internal {

BlockHash HashPage(const BlockHash* parent, absl::Span<const int32_t> tokens,
                   absl::string_view extra_key, std::vector<uint8_t>* scratch) {
  const size_t n = tokens.size();
  const size_t bytes = 16 + 4 + 4 * n + 4 + extra_key.size();
  if (scratch->size() < bytes) scratch->resize(bytes);
  uint8_t* p = scratch->data();
  if (parent != nullptr) {
    PutU64BigEndian(p, parent->high);
    PutU64BigEndian(p + 8, parent->low);
  } else {
    std::memset(p, 0, 16);
  }
  PutU32(p + 16, static_cast<uint32_t>(n));
  uint8_t* t = p + 20;
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  std::memcpy(t, tokens.data(), 4 * n);
#else
  for (size_t i = 0; i < n; ++i) PutU32(t + 4 * i, static_cast<uint32_t>(tokens[i]));
#endif
  PutU32(t + 4 * n, static_cast<uint32_t>(extra_key.size()));
  if (!extra_key.empty()) std::memcpy(t + 4 * n + 4, extra_key.data(), extra_key.size());
  const XXH128_hash_t h = XXH3_128bits(p, bytes);
  return BlockHash{h.high64, h.low64};
}

}  // namespace internal
}  // namespace fp4kv
