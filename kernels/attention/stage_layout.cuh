// Internal: the shared-memory layouts of the decode kernels' K/V tiles
// (device and host constants), one description for every family: the
// per-token row sizes of a configuration (AttnTileRows), the 16-token stage
// that tile_copy.cuh fills (AttnStageLayout), and the warp regions of the
// rows-in-M family built from them (AttnConfig). The tokens-in-M family
// (tokens_in_m.cuh) lays its rings out from the same two.
#ifndef FP4KV_KERNELS_ATTENTION_STAGE_LAYOUT_CUH_
#define FP4KV_KERNELS_ATTENTION_STAGE_LAYOUT_CUH_

#include "kernels/attention/schedule.cuh"

namespace fp4kv {
namespace kernels {

// The rows of one token: NVFP4 codes (D / 2 bytes; keys too unless kFp8K:
// FP8 E4M3 keys, D bytes and no block scales), D / 16 scale bytes, and the
// D + 4 floats a query row takes in the warps' combine (merge.cuh).
template <int D, bool kFp8K>
struct AttnTileRows {
  static constexpr int kRowBytes = D / 2;               // V code row (and NVFP4 K)
  static constexpr int kKRowBytes = kFp8K ? D : D / 2;  // K data bytes per token
  static constexpr int kScaleBytes = D / 16;
  static constexpr int kKScaleBytes = kFp8K ? 0 : kScaleBytes;
  static constexpr int kRedStride = D + 4;  // floats per row of the warp combine
};

// One 16-token stage (tile_copy.cuh): K codes [16][kKRowStride] token-major,
// V codes [16][D/2], K scales [16][D/16], V scales [16][D/16], then the
// 32-bit valid mask. kPadK: K rows padded by 16 bytes (FP8 keys at D = 128
// in the rows-in-M family: the 16-byte fragment loads of two tokens then
// hit different banks).
template <int D, bool kFp8K, bool kPadK>
struct AttnStageLayout : AttnTileRows<D, kFp8K> {
  using Rows = AttnTileRows<D, kFp8K>;
  static constexpr int kKRowStride = Rows::kKRowBytes + (kPadK ? 16 : 0);
  static constexpr int kKcOff = 0;
  static constexpr int kVcOff = kAttnTile * kKRowStride;
  static constexpr int kKsOff = kVcOff + kAttnTile * Rows::kRowBytes;
  static constexpr int kVsOff = kKsOff + kAttnTile * Rows::kKScaleBytes;
  static constexpr int kMaskOff = kVsOff + kAttnTile * Rows::kScaleBytes;
  static constexpr int kStageBytes = kMaskOff + 16;
  static_assert(kStageBytes % 16 == 0 && kVsOff % 8 == 0, "aligned stage regions");
};

// The rows-in-M family's warp region: its Q tile, then a ring of kStages
// stages. D = 128 with FP8 keys keeps two stages so that four CTAs still
// fit an SM's shared memory.
template <int D, bool kFp8K = false>
struct AttnConfig : AttnStageLayout<D, kFp8K, kFp8K && D == 128> {
  using Stage = AttnStageLayout<D, kFp8K, kFp8K && D == 128>;
  static constexpr int kStages = D <= 128 ? (kFp8K && D == 128 ? 2 : 3) : 2;
  static constexpr int kCtasPerSm = D == 64 ? 4 : (D == 128 ? 4 : 2);
  static constexpr int kQStride = D + 8;  // halves per Q row in shared memory
  static constexpr int kQBytes = kAttnTile * kQStride * 2;
  static constexpr int kWarpBytes = kQBytes + kStages * Stage::kStageBytes;
  // Position of 16-byte chunk k of K row t (FP8 rows; unswizzled here).
  __host__ __device__ static constexpr int KChunk(int /*t*/, int k) { return k; }
  static_assert(kAttnTile * Stage::kRedStride * 4 <= kWarpBytes,
                "combine fits a warp's shared memory");
  static_assert(kWarpBytes % 16 == 0, "16-byte aligned warp regions");
};

}  // namespace kernels
}  // namespace fp4kv

#endif  // FP4KV_KERNELS_ATTENTION_STAGE_LAYOUT_CUH_
