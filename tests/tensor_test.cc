// Tests of the tensor views (include/fp4kv/tensor.h), DLPack import and the
// paged-cache views and geometry (include/fp4kv/geometry.h), on the CPU.
#include "fp4kv/tensor.h"

#include <dlpack/dlpack.h>

#include <cstdint>
#include <string>
#include <vector>

#include "fp4kv/geometry.h"
#include "gtest/gtest.h"

namespace fp4kv {
namespace {

// Byte distance from a to b.
int64_t ByteDiff(const void* a, const void* b) {
  return static_cast<const char*>(b) - static_cast<const char*>(a);
}

// Byte address of element `idx` of a view (strides in elements).
const char* ElementAddress(const TensorView& v, std::initializer_list<int64_t> idx) {
  int64_t off = 0;
  int d = 0;
  for (int64_t i : idx) off += i * v.strides[d++];
  return static_cast<const char*>(v.data) + off * DTypeSize(v.dtype);
}

void ExpectStatusMentions(const absl::Status& s, std::initializer_list<const char*> words) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const char* w : words) {
    EXPECT_NE(s.message().find(w), std::string::npos) << "'" << w << "' not in: " << s.message();
  }
}

// ===========================================================================
// TensorView
// ===========================================================================
TEST(TensorView, ContiguousIsRowMajor) {
  std::vector<uint16_t> buf(2 * 3 * 4);
  const TensorView v = TensorView::Contiguous(buf.data(), DType::kBF16, {2, 3, 4});
  EXPECT_EQ(v.data, buf.data());
  EXPECT_EQ(v.dtype, DType::kBF16);
  EXPECT_EQ(v.ndim, 3);
  EXPECT_EQ(v.shape[0], 2);
  EXPECT_EQ(v.shape[1], 3);
  EXPECT_EQ(v.shape[2], 4);
  EXPECT_EQ(v.strides[0], 12);
  EXPECT_EQ(v.strides[1], 4);
  EXPECT_EQ(v.strides[2], 1);
  EXPECT_EQ(v.numel(), 24);
  EXPECT_TRUE(v.IsContiguous());
  EXPECT_EQ(v.device, Device::Cpu());
  EXPECT_EQ(v.size(-1), 4);
  EXPECT_EQ(v.stride(-2), 4);
  EXPECT_EQ(v.size(0), 2);
  EXPECT_FALSE(v.empty());
  EXPECT_EQ(v.ShapeString(), "[2, 3, 4]");
  // The const overload and a CUDA device.
  const std::vector<uint8_t> cbuf(8);
  const TensorView c = TensorView::Contiguous(cbuf.data(), DType::kU8, {8}, Device::Cuda(2));
  EXPECT_EQ(c.data, cbuf.data());
  EXPECT_TRUE(c.device.is_cuda());
  EXPECT_EQ(c.device.ordinal, 2);
  EXPECT_EQ(c.device.ToString(), "cuda:2");
}

TEST(TensorView, EmptyAndDegenerateShapes) {
  const TensorView none;
  EXPECT_TRUE(none.empty());
  EXPECT_EQ(none.numel(), 1);  // a 0-d view holds one element
  int x = 0;
  const TensorView scalar = TensorView::Contiguous(&x, DType::kI32, {});
  EXPECT_FALSE(scalar.empty());
  EXPECT_EQ(scalar.ndim, 0);
  EXPECT_EQ(scalar.numel(), 1);
  EXPECT_TRUE(scalar.IsContiguous());
  const TensorView zero = TensorView::Contiguous(&x, DType::kI32, {3, 0, 5});
  EXPECT_EQ(zero.numel(), 0);
  EXPECT_EQ(zero.strides[0], 0);
  EXPECT_EQ(zero.strides[1], 5);
}

TEST(TensorView, StridedAndIsContiguous) {
  std::vector<float> buf(64);
  // A transposed [4, 3] view of a [3, 4] matrix.
  const TensorView t = TensorView::Strided(buf.data(), DType::kF32, {4, 3}, {1, 4});
  EXPECT_EQ(t.strides[0], 1);
  EXPECT_EQ(t.strides[1], 4);
  EXPECT_EQ(t.numel(), 12);
  EXPECT_FALSE(t.IsContiguous());
  // Row-padded rows: not contiguous.
  EXPECT_FALSE(TensorView::Strided(buf.data(), DType::kF32, {3, 4}, {8, 1}).IsContiguous());
  // Exactly row-major strides: contiguous.
  EXPECT_TRUE(TensorView::Strided(buf.data(), DType::kF32, {3, 4}, {4, 1}).IsContiguous());
  // Extent-1 dimensions may have any stride.
  EXPECT_TRUE(TensorView::Strided(buf.data(), DType::kF32, {1, 3, 1, 4}, {99, 4, 7, 1})
                  .IsContiguous());
  EXPECT_FALSE(TensorView::Strided(buf.data(), DType::kF32, {2, 3, 1, 4}, {99, 4, 7, 1})
                   .IsContiguous());
}

TEST(TensorView, SelectRemovesTheDimensionAndOffsetsInBytes) {
  std::vector<uint16_t> buf(2 * 3 * 4 * 5);
  const TensorView v = TensorView::Contiguous(buf.data(), DType::kF16, {2, 3, 4, 5});
  for (int dim = 0; dim < 4; ++dim) {
    for (int64_t i = 0; i < v.shape[dim]; ++i) {
      const TensorView s = v.Select(dim, i);
      ASSERT_EQ(s.ndim, 3);
      EXPECT_EQ(ByteDiff(v.data, s.data), i * v.strides[dim] * 2) << dim << " " << i;
      int d = 0;
      for (int k = 0; k < 4; ++k) {
        if (k == dim) continue;
        EXPECT_EQ(s.shape[d], v.shape[k]);
        EXPECT_EQ(s.strides[d], v.strides[k]);
        ++d;
      }
      EXPECT_EQ(s.shape[3], 0);
      EXPECT_EQ(s.strides[3], 0);
      EXPECT_EQ(s.dtype, DType::kF16);
      EXPECT_EQ(s.IsContiguous(), dim == 0);
    }
  }
  // Every element of a selected view is the element of the full view.
  const TensorView s = v.Select(2, 3);
  for (int64_t a = 0; a < 2; ++a) {
    for (int64_t b = 0; b < 3; ++b) {
      for (int64_t c = 0; c < 5; ++c) {
        EXPECT_EQ(ElementAddress(s, {a, b, c}), ElementAddress(v, {a, b, 3, c}));
      }
    }
  }
  // Selecting twice reaches a single row.
  const TensorView row = v.Select(0, 1).Select(0, 2);
  EXPECT_EQ(row.ndim, 2);
  EXPECT_EQ(ByteDiff(v.data, row.data), (1 * 60 + 2 * 20) * 2);
}

TEST(TensorView, WithDTypeRetags) {
  uint8_t buf[16];
  const TensorView u = TensorView::Contiguous(buf, DType::kU8, {4, 4});
  const TensorView e = u.WithDType(DType::kE4M3);
  EXPECT_EQ(e.dtype, DType::kE4M3);
  EXPECT_EQ(e.data, u.data);
  EXPECT_EQ(e.strides[0], 4);
  EXPECT_EQ(DTypeSize(DType::kE4M3), 1);
  EXPECT_EQ(DTypeSize(DType::kI64), 8);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2);
  EXPECT_STREQ(DTypeName(DType::kE4M3), "e4m3");
}

// ===========================================================================
// DLPack
// ===========================================================================
struct DLHolder {
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;
  DLTensor t = {};
};

DLHolder MakeDL(void* data, uint8_t code, uint8_t bits, std::vector<int64_t> shape,
                std::vector<int64_t> strides = {}, DLDeviceType dev = kDLCPU, int dev_id = 0) {
  DLHolder h;
  h.shape = std::move(shape);
  h.strides = std::move(strides);
  h.t.data = data;
  h.t.device = DLDevice{dev, dev_id};
  h.t.ndim = static_cast<int>(h.shape.size());
  h.t.dtype = DLDataType{code, bits, 1};
  h.t.shape = h.shape.data();
  h.t.strides = h.strides.empty() ? nullptr : h.strides.data();
  h.t.byte_offset = 0;
  return h;
}

TEST(DLPack, SupportedDTypes) {
  alignas(16) char buf[256];
  const struct {
    uint8_t code, bits;
    DType want;
  } cases[] = {{kDLFloat, 16, DType::kF16}, {kDLBfloat, 16, DType::kBF16},
               {kDLFloat, 32, DType::kF32}, {kDLUInt, 8, DType::kU8},
               {kDLInt, 32, DType::kI32},   {kDLInt, 64, DType::kI64}};
  for (const auto& c : cases) {
    DLHolder h = MakeDL(buf, c.code, c.bits, {2, 3});
    absl::StatusOr<TensorView> v = TensorView::FromDLPack(h.t);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->dtype, c.want) << DTypeName(c.want);
    EXPECT_EQ(v->ndim, 2);
    EXPECT_EQ(v->shape[0], 2);
    EXPECT_EQ(v->shape[1], 3);
    EXPECT_EQ(v->data, buf);
    EXPECT_EQ(v->device, Device::Cpu());
  }
}

TEST(DLPack, NullStridesMeanContiguousAndGivenStridesAreKept) {
  alignas(16) char buf[4096];
  DLHolder h = MakeDL(buf, kDLFloat, 16, {4, 5, 6});
  absl::StatusOr<TensorView> v = TensorView::FromDLPack(h.t);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->strides[0], 30);
  EXPECT_EQ(v->strides[1], 6);
  EXPECT_EQ(v->strides[2], 1);
  EXPECT_TRUE(v->IsContiguous());
  DLHolder s = MakeDL(buf, kDLFloat, 16, {4, 5, 6}, {1, 24, 4});
  absl::StatusOr<TensorView> w = TensorView::FromDLPack(s.t);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->strides[0], 1);
  EXPECT_EQ(w->strides[1], 24);
  EXPECT_EQ(w->strides[2], 4);
  EXPECT_FALSE(w->IsContiguous());
}

TEST(DLPack, ByteOffsetIsApplied) {
  alignas(16) char buf[1024];
  DLHolder h = MakeDL(buf, kDLInt, 64, {3, 8});
  h.t.byte_offset = 136;
  absl::StatusOr<TensorView> v = TensorView::FromDLPack(h.t);
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(ByteDiff(buf, v->data), 136);
  EXPECT_EQ(v->numel(), 24);
}

TEST(DLPack, DevicesAreCarried) {
  alignas(16) char buf[64];
  {
    DLHolder h = MakeDL(buf, kDLUInt, 8, {64}, {}, kDLCUDA, 3);
    absl::StatusOr<TensorView> v = TensorView::FromDLPack(h.t);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->device, Device::Cuda(3));
    EXPECT_NE(v->device, Device::Cuda(0));
  }
  {
    // Pinned host memory is host memory.
    DLHolder h = MakeDL(buf, kDLUInt, 8, {64}, {}, kDLCUDAHost, 0);
    absl::StatusOr<TensorView> v = TensorView::FromDLPack(h.t);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->device, Device::Cpu());
  }
}

TEST(DLPack, UnsupportedInputsAreRejectedWithAMessage) {
  alignas(16) char buf[64];
  const struct {
    uint8_t code, bits;
  } bad_dtypes[] = {{kDLFloat, 64}, {kDLFloat, 8},  {kDLInt, 8},  {kDLInt, 16},
                    {kDLUInt, 16},  {kDLUInt, 32},  {kDLBfloat, 32}, {kDLComplex, 64}};
  for (const auto& d : bad_dtypes) {
    DLHolder h = MakeDL(buf, d.code, d.bits, {4});
    absl::StatusOr<TensorView> v = TensorView::FromDLPack(h.t);
    ASSERT_FALSE(v.ok()) << int(d.code) << "/" << int(d.bits);
    ExpectStatusMentions(v.status(), {"DLTensor", "dtype", "expected", "f16, bf16"});
  }
  for (uint16_t lanes : {0, 2, 4}) {
    DLHolder h = MakeDL(buf, kDLFloat, 16, {4});
    h.t.dtype.lanes = lanes;
    absl::StatusOr<TensorView> v = TensorView::FromDLPack(h.t);
    ASSERT_FALSE(v.ok()) << lanes;
    ExpectStatusMentions(v.status(), {"DLTensor", "expected lanes 1"});
  }
  for (DLDeviceType dev : {kDLOpenCL, kDLVulkan, kDLMetal, kDLROCM}) {
    DLHolder h = MakeDL(buf, kDLFloat, 16, {4}, {}, dev);
    absl::StatusOr<TensorView> v = TensorView::FromDLPack(h.t);
    ASSERT_FALSE(v.ok()) << dev;
    ExpectStatusMentions(v.status(), {"DLTensor", "expected device type CPU"});
  }
  {
    DLHolder h = MakeDL(buf, kDLFloat, 16, {1, 1, 1, 1, 1, 1, 1});
    absl::StatusOr<TensorView> v = TensorView::FromDLPack(h.t);
    ASSERT_FALSE(v.ok());
    ExpectStatusMentions(v.status(), {"DLTensor", "expected ndim", "got 7"});
  }
}

// ===========================================================================
// PagedCache and CacheGeometry
// ===========================================================================
struct StackedPools {
  std::vector<uint8_t> data, scales;
  TensorView data_view, scale_view;
};

// Stacked [P, 2, rows_a, rows_b, D/2] and [P, 2, rows_a, rows_b, D/16].
StackedPools MakeStacked(int64_t pages, int64_t rows_a, int64_t rows_b, int64_t head_dim) {
  StackedPools p;
  p.data.resize(pages * 2 * rows_a * rows_b * head_dim / 2);
  p.scales.resize(pages * 2 * rows_a * rows_b * head_dim / 16);
  p.data_view = TensorView::Contiguous(p.data.data(), DType::kU8,
                                       {pages, 2, rows_a, rows_b, head_dim / 2});
  p.scale_view = TensorView::Contiguous(p.scales.data(), DType::kE4M3,
                                        {pages, 2, rows_a, rows_b, head_dim / 16});
  return p;
}

TEST(PagedCache, FromStackedNhd) {
  const int64_t P = 3, S = 5, H = 2, D = 32;
  StackedPools p = MakeStacked(P, S, H, D);
  absl::StatusOr<PagedCache> cache = PagedCache::FromStacked(p.data_view, p.scale_view, Layout::kNHD);
  ASSERT_TRUE(cache.ok()) << cache.status();
  EXPECT_EQ(cache->layout, Layout::kNHD);
  EXPECT_EQ(cache->k_data.data, p.data.data());
  EXPECT_EQ(ByteDiff(p.data.data(), cache->v_data.data), S * H * D / 2);
  EXPECT_EQ(cache->k_scales.data, p.scales.data());
  EXPECT_EQ(ByteDiff(p.scales.data(), cache->v_scales.data), S * H * D / 16);
  EXPECT_EQ(cache->k_data.ShapeString(), "[3, 5, 2, 16]");
  EXPECT_EQ(cache->v_scales.ShapeString(), "[3, 5, 2, 2]");
  EXPECT_EQ(cache->k_data.strides[0], 2 * S * H * D / 2);  // skips the V half
  EXPECT_EQ(cache->k_scales.dtype, DType::kE4M3);
  absl::StatusOr<CacheGeometry> g = cache->Geometry();
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->num_pages, P);
  EXPECT_EQ(g->page_size, S);
  EXPECT_EQ(g->num_kv_heads, H);
  EXPECT_EQ(g->head_dim_k, D);
  EXPECT_EQ(g->head_dim_v, D);
  EXPECT_EQ(g->layout, Layout::kNHD);
  // Row (page, entry, head) of K / V lies at ((page * 2 + kv) * S + entry) * H + head
  // rows of the stacked tensor.
  for (int64_t pg = 0; pg < P; ++pg) {
    for (int64_t e = 0; e < S; ++e) {
      for (int64_t h = 0; h < H; ++h) {
        for (int kv = 0; kv < 2; ++kv) {
          const int64_t row = ((pg * 2 + kv) * S + e) * H + h;
          const TensorView& d = kv ? cache->v_data : cache->k_data;
          const TensorView& s = kv ? cache->v_scales : cache->k_scales;
          EXPECT_EQ(ByteDiff(p.data.data(), ElementAddress(d, {pg, e, h, 0})), row * D / 2);
          EXPECT_EQ(ByteDiff(p.scales.data(), ElementAddress(s, {pg, e, h, 0})), row * D / 16);
        }
      }
    }
  }
}

TEST(PagedCache, FromStackedHnd) {
  const int64_t P = 4, S = 3, H = 5, D = 64;
  StackedPools p = MakeStacked(P, H, S, D);  // [P, 2, H, S, D/2]
  absl::StatusOr<PagedCache> cache = PagedCache::FromStacked(p.data_view, p.scale_view, Layout::kHND);
  ASSERT_TRUE(cache.ok()) << cache.status();
  absl::StatusOr<CacheGeometry> g = cache->Geometry();
  ASSERT_TRUE(g.ok()) << g.status();
  EXPECT_EQ(g->num_pages, P);
  EXPECT_EQ(g->page_size, S);
  EXPECT_EQ(g->num_kv_heads, H);
  EXPECT_EQ(g->head_dim_k, D);
  EXPECT_EQ(g->head_dim_v, D);
  EXPECT_EQ(g->layout, Layout::kHND);
  EXPECT_EQ(ByteDiff(p.data.data(), cache->v_data.data), H * S * D / 2);
  for (int64_t pg = 0; pg < P; ++pg) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t e = 0; e < S; ++e) {
        for (int kv = 0; kv < 2; ++kv) {
          const int64_t row = ((pg * 2 + kv) * H + h) * S + e;
          const TensorView& d = kv ? cache->v_data : cache->k_data;
          const TensorView& s = kv ? cache->v_scales : cache->k_scales;
          EXPECT_EQ(ByteDiff(p.data.data(), ElementAddress(d, {pg, h, e, 0})), row * D / 2);
          EXPECT_EQ(ByteDiff(p.scales.data(), ElementAddress(s, {pg, h, e, 0})), row * D / 16);
        }
      }
    }
  }
  // The same memory read as NHD has its dimensions 1 and 2 swapped.
  absl::StatusOr<PagedCache> as_nhd = PagedCache::FromStacked(p.data_view, p.scale_view, Layout::kNHD);
  ASSERT_TRUE(as_nhd.ok());
  absl::StatusOr<CacheGeometry> gn = as_nhd->Geometry();
  ASSERT_TRUE(gn.ok()) << gn.status();
  EXPECT_EQ(gn->page_size, H);
  EXPECT_EQ(gn->num_kv_heads, S);
}

TEST(PagedCache, TupleGeometryOffsetsMatchContiguousPools) {
  // Tuple form with different K and V head dims; the geometry's offsets are
  // the byte offsets of contiguous pools.
  for (Layout layout : {Layout::kNHD, Layout::kHND}) {
    const int64_t P = 3, S = 4, H = 2, Dk = 32, Dv = 48;
    const int64_t a = layout == Layout::kNHD ? S : H, b = layout == Layout::kNHD ? H : S;
    std::vector<uint8_t> kd(P * S * H * Dk / 2), vd(P * S * H * Dv / 2);
    std::vector<uint8_t> ks(P * S * H * Dk / 16), vs(P * S * H * Dv / 16);
    const PagedCache cache = PagedCache::FromTuple(
        TensorView::Contiguous(kd.data(), DType::kU8, {P, a, b, Dk / 2}),
        TensorView::Contiguous(vd.data(), DType::kU8, {P, a, b, Dv / 2}),
        TensorView::Contiguous(ks.data(), DType::kU8, {P, a, b, Dk / 16}),  // u8 accepted
        TensorView::Contiguous(vs.data(), DType::kE4M3, {P, a, b, Dv / 16}), layout);
    absl::StatusOr<CacheGeometry> g = cache.Geometry();
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->head_dim_k, Dk);
    EXPECT_EQ(g->head_dim_v, Dv);
    EXPECT_EQ(g->page_size, S);
    EXPECT_EQ(g->num_kv_heads, H);
    EXPECT_EQ(g->DataRowBytes(false), Dk / 2);
    EXPECT_EQ(g->DataRowBytes(true), Dv / 2);
    EXPECT_EQ(g->ScaleRowBytes(false), Dk / 16);
    EXPECT_EQ(g->ScaleRowBytes(true), Dv / 16);
    for (int64_t pg = 0; pg < P; ++pg) {
      for (int64_t e = 0; e < S; ++e) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t i = layout == Layout::kNHD ? e : h, j = layout == Layout::kNHD ? h : e;
          EXPECT_EQ(g->DataOffset(pg, e, h, false),
                    ByteDiff(kd.data(), ElementAddress(cache.k_data, {pg, i, j, 0})));
          EXPECT_EQ(g->DataOffset(pg, e, h, true),
                    ByteDiff(vd.data(), ElementAddress(cache.v_data, {pg, i, j, 0})));
          EXPECT_EQ(g->ScaleOffset(pg, e, h, false),
                    ByteDiff(ks.data(), ElementAddress(cache.k_scales, {pg, i, j, 0})));
          EXPECT_EQ(g->ScaleOffset(pg, e, h, true),
                    ByteDiff(vs.data(), ElementAddress(cache.v_scales, {pg, i, j, 0})));
        }
      }
    }
    // One page: S * H * (Dk/2 + Dv/2 + Dk/16 + Dv/16) bytes.
    EXPECT_EQ(g->PageBytes(), S * H * (16 + 24 + 2 + 3));
    EXPECT_DOUBLE_EQ(g->BytesPerToken(), H * (16 + 24 + 2 + 3));
  }
}

// FP8 keys: K rows of Dk bytes without scales, V as NVFP4; the geometry
// derives Dk from the key data and sizes rows and pages accordingly.
TEST(PagedCache, Fp8KeyTupleGeometry) {
  for (Layout layout : {Layout::kNHD, Layout::kHND}) {
    const int64_t P = 3, S = 4, H = 2, Dk = 32, Dv = 48;
    const int64_t a = layout == Layout::kNHD ? S : H, b = layout == Layout::kNHD ? H : S;
    alignas(16) static uint8_t kd[3 * 4 * 2 * 32];
    std::vector<uint8_t> vd(P * S * H * Dv / 2), vs(P * S * H * Dv / 16);
    const TensorView k = TensorView::Contiguous(kd, DType::kE4M3, {P, a, b, Dk});
    const TensorView v = TensorView::Contiguous(vd.data(), DType::kU8, {P, a, b, Dv / 2});
    const TensorView vsc = TensorView::Contiguous(vs.data(), DType::kE4M3, {P, a, b, Dv / 16});
    const PagedCache cache = PagedCache::Fp8Keys(k, v, vsc, layout);
    EXPECT_EQ(cache.key_format, KeyFormat::kFp8);
    absl::StatusOr<CacheGeometry> g = cache.Geometry();
    ASSERT_TRUE(g.ok()) << g.status();
    EXPECT_EQ(g->key_format, KeyFormat::kFp8);
    EXPECT_TRUE(g->fp8_keys());
    EXPECT_EQ(g->head_dim_k, Dk);
    EXPECT_EQ(g->head_dim_v, Dv);
    EXPECT_EQ(g->DataRowBytes(false), Dk);
    EXPECT_EQ(g->ScaleRowBytes(false), 0);
    EXPECT_EQ(g->DataRowBytes(true), Dv / 2);
    EXPECT_EQ(g->ScaleRowBytes(true), Dv / 16);
    for (int64_t pg = 0; pg < P; ++pg) {
      for (int64_t e = 0; e < S; ++e) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t i = layout == Layout::kNHD ? e : h, j = layout == Layout::kNHD ? h : e;
          EXPECT_EQ(g->DataOffset(pg, e, h, false),
                    ByteDiff(kd, ElementAddress(cache.k_data, {pg, i, j, 0})));
        }
      }
    }
    EXPECT_EQ(g->PageBytes(), S * H * (32 + 24 + 3));
    EXPECT_DOUBLE_EQ(g->BytesPerToken(), H * (32 + 24 + 3));

    // Key scales given for FP8 keys, NVFP4-sized key rows, a key format the
    // geometry does not match: each refused, naming the view.
    PagedCache with_scales = cache;
    with_scales.k_scales = vsc;
    absl::StatusOr<CacheGeometry> bad = with_scales.Geometry();
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("cache.k_scales"), std::string::npos) << bad.status();
    PagedCache odd = cache;
    odd.key_format = static_cast<KeyFormat>(7);
    bad = odd.Geometry();
    ASSERT_FALSE(bad.ok());
    EXPECT_NE(bad.status().message().find("cache.key_format"), std::string::npos) << bad.status();
    const PagedCache nvfp4_keys_as_fp8 = PagedCache::Fp8Keys(
        TensorView::Contiguous(kd, DType::kU8, {P, a, b, Dk / 2}), v, vsc, layout);
    absl::StatusOr<CacheGeometry> half = nvfp4_keys_as_fp8.Geometry();
    ASSERT_TRUE(half.ok()) << half.status();  // a valid FP8 cache of head dim Dk / 2
    EXPECT_EQ(half->head_dim_k, Dk / 2);
  }
  CacheGeometry g;
  g.num_kv_heads = 1;
  g.head_dim_k = g.head_dim_v = 16;
  g.page_size = 1;
  g.num_pages = 1;
  g.key_format = static_cast<KeyFormat>(2);
  absl::Status s = g.Validate();
  EXPECT_NE(s.message().find("geometry.key_format"), std::string::npos) << s;
  EXPECT_STREQ(KeyFormatName(KeyFormat::kFp8), "FP8");
  EXPECT_STREQ(KeyFormatName(KeyFormat::kNvfp4), "NVFP4");
}

// The placement example of docs/format.md: elements 16..31 (block 1) of
// head 3 of the token in entry 5 of page 7, H = 8, D = 128, page_size 16.
TEST(PagedCache, WorkedPlacementOfFormatDoc) {
  CacheGeometry g;
  g.num_kv_heads = 8;
  g.head_dim_k = 128;
  g.head_dim_v = 128;
  g.page_size = 16;
  g.num_pages = 10;
  g.layout = Layout::kNHD;
  EXPECT_EQ(g.RowIndex(7, 5, 3), 939);
  EXPECT_EQ(g.DataOffset(7, 5, 3, false) + 1 * kBlockBytes, 60104);
  EXPECT_EQ(g.ScaleOffset(7, 5, 3, false) + 1, 7513);
  g.layout = Layout::kHND;
  EXPECT_EQ(g.RowIndex(7, 5, 3), 949);
  EXPECT_EQ(g.DataOffset(7, 5, 3, true) + 1 * kBlockBytes, 60744);
  EXPECT_EQ(g.ScaleOffset(7, 5, 3, true) + 1, 7593);
  EXPECT_EQ(g.PageBytes(), 16 * 8 * (64 + 64 + 8 + 8));
}

TEST(PagedCache, BadViewsAreRejected) {
  const int64_t P = 2, S = 4, H = 2, D = 32;
  StackedPools p = MakeStacked(P, S, H, D);
  {
    absl::StatusOr<PagedCache> c =
        PagedCache::FromStacked(p.data_view.Select(0, 0), p.scale_view, Layout::kNHD);
    ASSERT_FALSE(c.ok());
    ExpectStatusMentions(c.status(), {"cache.data", "expected rank 5", "got rank 4"});
  }
  {
    const TensorView three = TensorView::Contiguous(p.data.data(), DType::kU8, {1, 3, S, H, D / 2});
    absl::StatusOr<PagedCache> c = PagedCache::FromStacked(three, p.scale_view, Layout::kNHD);
    ASSERT_FALSE(c.ok());
    ExpectStatusMentions(c.status(), {"cache.data", "dimension 1", "[1, 3, 4, 2, 16]"});
  }
  {
    const TensorView three = TensorView::Contiguous(p.scales.data(), DType::kU8, {P, 1, S, H, 2});
    absl::StatusOr<PagedCache> c = PagedCache::FromStacked(p.data_view, three, Layout::kNHD);
    ASSERT_FALSE(c.ok());
    ExpectStatusMentions(c.status(), {"cache.scales", "dimension 1"});
  }
  absl::StatusOr<PagedCache> good = PagedCache::FromStacked(p.data_view, p.scale_view, Layout::kNHD);
  ASSERT_TRUE(good.ok());
  {
    PagedCache c = *good;
    c.k_scales = TensorView::Contiguous(p.scales.data(), DType::kU8, {P, S, H, 3});
    absl::StatusOr<CacheGeometry> g = c.Geometry();
    ASSERT_FALSE(g.ok());
    ExpectStatusMentions(g.status(), {"cache.k_scales", "expected shape [2, 4, 2, 2]", "[2, 4, 2, 3]"});
  }
  {
    PagedCache c = *good;
    c.v_data = c.v_data.WithDType(DType::kI32);
    absl::StatusOr<CacheGeometry> g = c.Geometry();
    ASSERT_FALSE(g.ok());
    ExpectStatusMentions(g.status(), {"cache.v_data", "dtype"});
  }
  {
    PagedCache c = *good;
    c.v_scales.device = Device::Cuda(0);
    absl::StatusOr<CacheGeometry> g = c.Geometry();
    ASSERT_FALSE(g.ok());
    ExpectStatusMentions(g.status(), {"cache.v_scales", "expected device cpu", "cuda:0"});
  }
  {
    PagedCache c = *good;
    c.k_data = TensorView();
    absl::StatusOr<CacheGeometry> g = c.Geometry();
    ASSERT_FALSE(g.ok());
    ExpectStatusMentions(g.status(), {"cache.k_data"});
  }
  {
    // Head dim 24: not a multiple of 16.
    std::vector<uint8_t> d(P * S * H * 12), s(P * S * H * 2);
    PagedCache c = *good;
    c.k_data = TensorView::Contiguous(d.data(), DType::kU8, {P, S, H, 12});
    absl::StatusOr<CacheGeometry> g = c.Geometry();
    ASSERT_FALSE(g.ok());
    ExpectStatusMentions(g.status(), {"head_dim_k", "multiple of 16", "24"});
  }
  {
    // A strided last dimension.
    PagedCache c = *good;
    c.k_data.strides[3] = 2;
    absl::StatusOr<CacheGeometry> g = c.Geometry();
    ASSERT_FALSE(g.ok());
    ExpectStatusMentions(g.status(), {"cache.k_data", "contiguous last dimension"});
  }
}

TEST(CacheGeometry, ValidateNamesTheField) {
  CacheGeometry g;
  g.num_kv_heads = 2;
  g.head_dim_k = 64;
  g.head_dim_v = 64;
  g.page_size = 16;
  g.num_pages = 10;
  EXPECT_TRUE(g.Validate().ok());
  CacheGeometry b = g;
  b.num_kv_heads = 0;
  ExpectStatusMentions(b.Validate(), {"geometry.num_kv_heads"});
  b = g;
  b.head_dim_v = 40;
  ExpectStatusMentions(b.Validate(), {"geometry.head_dim_v", "40"});
  b = g;
  b.page_size = -1;
  ExpectStatusMentions(b.Validate(), {"geometry.page_size"});
  b = g;
  b.num_pages = 0;
  ExpectStatusMentions(b.Validate(), {"geometry.num_pages"});
  b = g;
  b.layout = static_cast<Layout>(7);
  ExpectStatusMentions(b.Validate(), {"geometry.layout"});
}

TEST(TensorView, MalformedBuildsAreInvalidViews) {
  int64_t shape7[7] = {1, 1, 1, 1, 1, 1, 1};
  const TensorView seven =
      TensorView::Contiguous(static_cast<void*>(nullptr), DType::kU8, absl::MakeConstSpan(shape7));
  EXPECT_EQ(seven.ndim, -1);
  EXPECT_EQ(seven.numel(), -1);
  EXPECT_EQ(seven.ShapeString(), "[invalid view]");
  const TensorView mismatched = TensorView::Strided(static_cast<void*>(nullptr), DType::kU8, {2, 3}, {1});
  EXPECT_EQ(mismatched.ndim, -1);
  const TensorView t = TensorView::Contiguous(static_cast<void*>(nullptr), DType::kU8, {2, 3});
  EXPECT_EQ(t.Select(2, 0).ndim, -1);
  EXPECT_EQ(t.Select(0, 2).ndim, -1);
  EXPECT_EQ(t.Select(0, -1).ndim, -1);
}

TEST(TensorView, NumelIsMinusOneOnNegativeOrOverflowingExtents) {
  EXPECT_EQ(TensorView::Contiguous(static_cast<void*>(nullptr), DType::kU8, {2, -3}).numel(), -1);
  EXPECT_EQ(TensorView::Contiguous(static_cast<void*>(nullptr), DType::kU8,
                                   {int64_t{1} << 32, int64_t{1} << 32})
                .numel(),
            -1);
  EXPECT_EQ(TensorView::Contiguous(static_cast<void*>(nullptr), DType::kU8, {0, INT64_MAX}).numel(), 0);
}

TEST(DLPack, NullShapeAndNullPointerOffsetsAreRejected) {
  int64_t shape[2] = {2, 3};
  DLTensor t{};
  t.ndim = 2;
  t.shape = nullptr;
  t.dtype = DLDataType{kDLFloat, 32, 1};
  t.device = DLDevice{kDLCPU, 0};
  float data[6] = {};
  t.data = data;
  absl::StatusOr<TensorView> v = TensorView::FromDLPack(t);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("DLTensor: expected a shape array"), std::string::npos);
  t.shape = shape;
  t.data = nullptr;
  t.byte_offset = 16;
  EXPECT_FALSE(TensorView::FromDLPack(t).ok());
  t.data = data;
  t.byte_offset = 0;
  shape[1] = -3;
  v = TensorView::FromDLPack(t);
  ASSERT_FALSE(v.ok());
  EXPECT_NE(v.status().message().find("non-negative extents"), std::string::npos) << v.status();
  shape[1] = INT64_MAX;
  EXPECT_FALSE(TensorView::FromDLPack(t).ok());
  shape[1] = 3;
  int64_t strides[2] = {-3, 1};
  t.strides = strides;
  EXPECT_FALSE(TensorView::FromDLPack(t).ok());
}

}  // namespace
}  // namespace fp4kv
