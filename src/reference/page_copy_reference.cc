// CPU references of kernels/page_copy.cu (same bytes).
#include <cstring>

#include "fp4kv/format.h"
#include "fp4kv/recipe.h"
#include "src/params.h"

namespace fp4kv {
namespace internal {

void ReferencePageCopy(const PageCopyParams& p) {
  for (int64_t l = 0; l < p.num_layers; ++l) {
    for (int r = 0; r < 4; ++r) {
      const int64_t bytes = p.page_bytes[r];
      if (bytes == 0) continue;  // the K scales of FP8 keys
      for (int64_t i = 0; i < p.num_pages; ++i) {
        const int64_t s = p.SrcPage(i);
        const int64_t d = p.DstPage(i);
        std::memcpy(p.dst + l * p.dst_layer_stride + p.dst_region[r] + d * bytes,
                    p.src + l * p.src_layer_stride + p.src_region[r] + s * bytes,
                    static_cast<size_t>(bytes));
      }
    }
  }
}

void ReferenceAdoptScales(const AdoptScalesParams& p) {
  for (int i = 0; i < 2 * p.num_layers; ++i) {
    if (p.mask[i] == 0) continue;
    const int l = i / 2, kv = i % 2;
    p.scales[4 * l + kv] = p.image_scales[4 * l + kv];
    p.scales[4 * l + 2 + kv] = p.image_scales[4 * l + 2 + kv];
    p.flags[i] = p.image_flags[i];
    if (p.host_flags != nullptr) p.host_flags[i] = p.image_flags[i];
  }
}

void ReferenceRequantizePages(const RequantizePagesParams& p) {
  for (int64_t l = 0; l < p.num_layers; ++l) {
    for (int kv = 0; kv < 2; ++kv) {
      const float old_g = p.src_scales[4 * l + kv];
      const float new_g = p.dst_scales[4 * l + kv];
      if (FloatBits(old_g) == FloatBits(new_g)) continue;
      uint8_t* base = p.pool + l * p.layer_stride;
      if (kv == 0 && p.fp8_keys) {  // FP8 key bytes, no block scales
        const float r = Fp8KeyEncodeMultiplier(new_g);
        for (int64_t i = 0; i < p.num_pages; ++i) {
          uint8_t* c = base + p.region[0] + static_cast<int64_t>(p.pages[i]) * p.page_bytes[0];
          for (int64_t b = 0; b < p.page_bytes[0]; ++b) {
            c[b] = QuantizeFp8Key(DequantFp8Key(c[b], old_g), r);
          }
        }
        continue;
      }
      const int64_t per_page = p.page_bytes[2 + kv];
      for (int64_t i = 0; i < p.num_pages; ++i) {
        const int64_t page = p.pages[i];
        for (int64_t b = 0; b < per_page; ++b) {
          uint8_t* data = base + p.region[kv] + page * p.page_bytes[kv] + b * kBlockBytes;
          uint8_t* scale = base + p.region[2 + kv] + page * per_page + b;
          uint32_t packed[2];
          std::memcpy(packed, data, sizeof(packed));
          float x[kBlockSize];
          DequantizeBlock(packed, *scale, old_g, x);
          *scale = QuantizeBlock(x, new_g, p.recipe, packed);
          std::memcpy(data, packed, sizeof(packed));
        }
      }
    }
  }
}

}  // namespace internal
}  // namespace fp4kv
