// Property test of the validation layer: seeded random calls of every public
// entry point that takes views, built from a valid call of a random small
// geometry and then broken at random (dtype, rank, extents including
// negative and near-overflow values, strides, pointers, devices, global
// scales). Every call must either return a named error (InvalidArgument or
// FailedPrecondition, "name: expected ...") and leave every output
// untouched, or return OK after touching only memory inside the views it was
// given: each view owns an allocation of exactly its byte extent, so the
// sanitizers of the CI build catch any access outside. A call that accepts a
// malformed view fails the test. A view placed on another device, or at a
// pointer misaligned for its elements (or, for NVFP4 pool data, for the
// 8-byte blocks), must be rejected: InvalidArgument, or FailedPrecondition
// naming an unusable CUDA device when the op takes its device from the views. A call that
// succeeds with mutated views is run again on contiguous, aligned copies of
// the same views: every output must then hold the same bytes, and the bytes
// of an output's allocation outside its elements must be untouched. The
// number of calls of each mutation kind, and their outcomes, is printed.
// Deterministic (fixed seeds) and bounded (fixed iteration counts, views of
// at most kMaxViewBytes).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include <dlpack/dlpack.h>

#include "fp4kv/attention.h"
#include "fp4kv/calibrate.h"
#include "fp4kv/kv_cache.h"
#include "fp4kv/ops.h"
#include "gtest/gtest.h"

namespace fp4kv {
namespace {

constexpr int64_t kMaxViewBytes = int64_t{1} << 20;

// Byte extent of a view as the validation contract defines it; false for a
// malformed view (what every op must reject).
bool WellFormed(const TensorView& t, int64_t* bytes) {
  *bytes = 0;
  if (t.ndim < 0 || t.ndim > TensorView::kMaxDims) return false;
  bool zero = false;
  __int128 n = 1, last = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0) return false;
    if (t.shape[d] > 1 && t.strides[d] < 0) return false;
    if (t.shape[d] == 0) zero = true;
    n *= t.shape[d];
    if (n > INT64_MAX) return false;
  }
  if (zero) return true;
  for (int d = 0; d < t.ndim; ++d) last += static_cast<__int128>(t.shape[d] - 1) * t.strides[d];
  const __int128 b = (last + 1) * DTypeSize(t.dtype);
  if (b > INT64_MAX) return false;
  *bytes = static_cast<int64_t>(b);
  return true;
}

class Fuzzer {
 public:
  explicit Fuzzer(uint64_t seed) : rng_(seed) {}

  int Int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool Chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  template <typename T>
  T Pick(std::initializer_list<T> xs) {
    return *(xs.begin() + Int(0, static_cast<int>(xs.size()) - 1));
  }

  int64_t WildExtent(int64_t was) {
    return Pick<int64_t>({-1, -7, INT64_MIN, INT64_MAX, INT64_MAX / 2 + 1, int64_t{1} << 31,
                          (int64_t{1} << 32) + 1, int64_t{1} << 62, 0, 1, was + 1,
                          was > 0 ? was - 1 : 2, was * 2});
  }
  int64_t WildStride(int64_t was) {
    return Pick<int64_t>({-1, -was, 0, INT64_MAX, int64_t{1} << 40, was * 2, was + 1, 1});
  }
  GlobalScale WildScale() {
    return GlobalScale::Value(Pick<float>({0.0f, -1.0f, std::nanf(""),
                                           std::numeric_limits<float>::infinity(), FLT_MAX,
                                           MaxGlobalScale(),
                                           std::nextafter(MaxGlobalScale(), FLT_MAX), 1e-45f,
                                           1.0f, 0.01f}));
  }

  // Breaks `t` in one random way (or none, most of the time); kind_ says
  // which (-1: none).
  void Mutate(TensorView& t, double p) {
    kind_ = -1;
    if (!Chance(p)) return;
    kind_ = Int(0, 9);
    switch (kind_) {
      case 0: t.dtype = static_cast<DType>(Int(0, 6)); break;
      case 1:
        if (t.ndim > 0) {
          const int d = Int(0, t.ndim - 1);
          t.shape[d] = WildExtent(t.shape[d]);
        }
        break;
      case 2:
        if (t.ndim > 0) {
          const int d = Int(0, t.ndim - 1);
          t.strides[d] = WildStride(t.strides[d]);
        }
        break;
      case 3:
        if (t.ndim < TensorView::kMaxDims && Chance(0.5)) {
          t.shape[t.ndim] = Int(0, 3);
          t.strides[t.ndim] = 1;
          ++t.ndim;
        } else if (t.ndim > 0) {
          --t.ndim;
        }
        break;
      case 4: t.ndim = Pick<int>({-1, -5, TensorView::kMaxDims + 1, 100}); break;
      case 5: t.device = Pick<Device>({Device::Cuda(0), Device::Cuda(7)}); break;
      case 6: misalign_ = Pick<int>({1, 2, 4, 8}); break;
      case 7: null_ = true; break;
      case 8:
        if (t.ndim > 0) t.shape[0] = Pick<int64_t>({INT64_MAX, int64_t{1} << 40, -1});
        break;
      default:
        if (t.ndim > 1) t.shape[1] = WildExtent(t.shape[1]);
        break;
    }
  }

  std::mt19937_64& rng() { return rng_; }

  int misalign_ = 0;
  bool null_ = false;
  int kind_ = -1;

 private:
  std::mt19937_64 rng_;
};

// Mutation kinds of Fuzzer::Mutate, for the tally.
constexpr int kKinds = 10;
constexpr const char* kKindNames[kKinds] = {"dtype",  "extent",   "stride", "rank",
                                            "ndim",   "device",   "misalign", "null",
                                            "dim0",   "dim1"};
constexpr int kDevice = 5, kMisalign = 6;
struct Tally {
  int calls = 0, ok = 0, rejected = 0, bytes_checked = 0;
};
Tally g_tally[kKinds];
int g_unmutated_calls = 0, g_mutated_ok_checked = 0, g_mutated_ok_unchecked = 0;

// Element offsets (in elements) of a well-formed view, in row-major index
// order.
std::vector<int64_t> ElementOffsets(const TensorView& t) {
  int64_t n = 1;
  for (int d = 0; d < t.ndim; ++d) n *= t.shape[d];
  std::vector<int64_t> out;
  if (n <= 0) return out;
  out.reserve(static_cast<size_t>(n));
  int64_t idx[TensorView::kMaxDims] = {};
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int d = 0; d < t.ndim; ++d) off += idx[d] * t.strides[d];
    out.push_back(off);
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
  return out;
}

// The memory behind the views of one call: one exact-size allocation per view.
class Call {
 public:
  explicit Call(Fuzzer& f) : f_(f) {}

  // A contiguous view of `shape`, maybe broken, with its own allocation
  // holding random bytes (or indices in [lo, hi] for index tensors).
  // `align`: the alignment the op requires of the pointer beyond the
  // element size (8 for NVFP4 pool data), for the misalignment rule.
  TensorView View(DType dtype, std::initializer_list<int64_t> shape, double p = 0.08,
                  int64_t lo = 0, int64_t hi = 0, bool output = false, int align = 0) {
    TensorView t = TensorView::Contiguous(static_cast<void*>(nullptr), dtype, shape);
    f_.misalign_ = 0;
    f_.null_ = false;
    f_.Mutate(t, p);
    if (f_.kind_ >= 0) kinds_ |= 1u << f_.kind_;
    if (f_.kind_ == kDevice && t.device != Device::Cpu()) must_reject_device_ = true;
    if (f_.kind_ == kMisalign) {
      const int need = std::max(align, DTypeSize(t.dtype));
      if (f_.misalign_ % need != 0) must_reject_misaligned_ = true;
    }
    int64_t bytes = 0;
    const bool ok = WellFormed(t, &bytes);
    if (!ok) malformed_ = true;
    if (ok && bytes > kMaxViewBytes) too_big_ = true;
    const int64_t alloc = (!ok || bytes > kMaxViewBytes) ? 64 : bytes;
    auto buf = std::make_unique<uint8_t[]>(static_cast<size_t>(alloc + f_.misalign_));
    uint8_t* base = buf.get() + f_.misalign_;
    // Fill: random bytes, or in-range-ish indices for index tensors.
    for (int64_t i = 0; i < alloc; ++i) base[i] = static_cast<uint8_t>(f_.rng()());
    if (hi > lo && ok && (t.dtype == DType::kI32 || t.dtype == DType::kI64)) {
      const int64_t n = alloc / DTypeSize(t.dtype);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t v = std::uniform_int_distribution<int64_t>(lo, hi)(f_.rng());
        if (t.dtype == DType::kI32) {
          const int32_t w = static_cast<int32_t>(v);
          std::memcpy(base + 4 * i, &w, 4);
        } else {
          std::memcpy(base + 8 * i, &v, 8);
        }
      }
    }
    t.data = f_.null_ ? nullptr : base;
    if (f_.null_ && ok && bytes > 0) malformed_ = true;  // a null pointer with elements
    if (output) outputs_.push_back({base, alloc, std::vector<uint8_t>(base, base + alloc)});
    if (ok && alloc == bytes) records_.push_back({t, output, base, alloc});
    bufs_.push_back(std::move(buf));
    return t;
  }

  // Maps a view of this call to its contiguous copy (Check's rerun).
  using Remap = std::function<TensorView(const TensorView&)>;
  using Rerun = std::function<absl::Status(const Remap&)>;

  // Checks the outcome of the call: named error and untouched outputs, or OK
  // with only well-formed views, on the CPU, aligned; when views were
  // mutated and `rerun` is given, the same op on contiguous copies must
  // write the same bytes.
  void Check(const absl::Status& s, const char* what, const Rerun& rerun = nullptr) {
    ++calls_;
    if (kinds_ == 0) ++g_unmutated_calls;
    for (int k = 0; k < kKinds; ++k) {
      if (kinds_ & (1u << k)) {
        ++g_tally[k].calls;
        ++(s.ok() ? g_tally[k].ok : g_tally[k].rejected);
      }
    }
    if (s.ok()) {
      ++ok_calls_;
      EXPECT_FALSE(malformed_) << what << ": accepted a malformed view";
      EXPECT_FALSE(must_reject_device_) << what << ": accepted a view on another device";
      EXPECT_FALSE(must_reject_misaligned_) << what << ": accepted a misaligned view";
      if (kinds_ != 0) {
        if (rerun != nullptr && !malformed_) {
          CheckAgainstContiguous(rerun, what);
        } else {
          ++g_mutated_ok_unchecked;
        }
      }
      return;
    }
    EXPECT_TRUE(s.code() == absl::StatusCode::kInvalidArgument ||
                s.code() == absl::StatusCode::kFailedPrecondition)
        << what << ": " << s;
    if (must_reject_misaligned_) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << what << " (misaligned view): " << s;
    }
    if (must_reject_device_ && s.code() != absl::StatusCode::kInvalidArgument) {
      // A functional op takes its device from its views: a device that is
      // not there is FailedPrecondition, and the message says so.
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << what << ": " << s;
      EXPECT_NE(s.message().find("usable CUDA device"), std::string_view::npos)
          << what << " (view on another device): " << s;
    }
    const std::string msg(s.message());
    const size_t at = msg.find(": expected ");
    EXPECT_TRUE(at != std::string::npos && at > 0) << what << ": unnamed error: " << msg;
    for (const Output& o : outputs_) {
      if (o.before.empty()) continue;
      EXPECT_EQ(0, std::memcmp(o.data, o.before.data(), o.before.size()))
          << what << ": an output changed although the call failed: " << msg;
    }
  }

  bool too_big() const { return too_big_; }
  static int calls_, ok_calls_;

 private:
  struct Output {
    uint8_t* data;
    int64_t bytes;
    std::vector<uint8_t> before;
  };
  struct Record {
    TensorView view;
    bool output;
    uint8_t* base;
    int64_t bytes;
  };
  struct Copy {
    const Record* rec;
    std::vector<int64_t> offsets;  // elements
    std::shared_ptr<uint8_t> data;  // 64-byte aligned, contiguous
    TensorView view;
  };

  const Output* OutputAt(const uint8_t* base) const {
    for (const Output& o : outputs_) {
      if (o.data == base) return &o;
    }
    return nullptr;
  }

  // Runs the op again on contiguous copies of every view (outputs copied
  // from their contents before the call) and compares the outputs'
  // elements; bytes of an output allocation outside its elements must be
  // as before.
  void CheckAgainstContiguous(const Rerun& rerun, const char* what) {
    std::vector<Copy> copies;
    for (const Record& r : records_) {
      if (r.view.data == nullptr) continue;
      Copy c;
      c.rec = &r;
      c.offsets = ElementOffsets(r.view);
      const int es = DTypeSize(r.view.dtype);
      const size_t n = c.offsets.size() * es;
      c.data.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (n + 64) / 64 * 64)), std::free);
      const Output* o = r.output ? OutputAt(r.base) : nullptr;
      const uint8_t* src = o != nullptr ? o->before.data() : r.base;
      for (size_t i = 0; i < c.offsets.size(); ++i) {
        std::memcpy(c.data.get() + i * es, src + c.offsets[i] * es, es);
      }
      c.view = r.view;
      c.view.data = c.data.get();
      int64_t stride = 1;
      for (int d = r.view.ndim - 1; d >= 0; --d) {
        c.view.strides[d] = stride;
        stride *= r.view.shape[d];
      }
      copies.push_back(std::move(c));
    }
    // Outputs whose elements overlap (a zero stride) have no single
    // expected content: not compared.
    for (const Copy& c : copies) {
      if (!c.rec->output) continue;
      std::vector<int64_t> sorted = c.offsets;
      std::sort(sorted.begin(), sorted.end());
      if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end()) {
        ++g_mutated_ok_unchecked;
        return;
      }
    }
    const Remap remap = [&](const TensorView& v) {
      for (const Copy& c : copies) {
        if (c.rec->view.data == v.data && v.data != nullptr) return c.view;
      }
      return v;
    };
    const absl::Status again = rerun(remap);
    ASSERT_TRUE(again.ok()) << what << ": accepted with mutated views, but the contiguous copy "
                            << "was refused: " << again;
    for (const Copy& c : copies) {
      if (!c.rec->output) continue;
      const int es = DTypeSize(c.rec->view.dtype);
      std::vector<bool> covered(static_cast<size_t>(c.rec->bytes), false);
      for (size_t i = 0; i < c.offsets.size(); ++i) {
        const uint8_t* got = c.rec->base + c.offsets[i] * es;
        ASSERT_EQ(0, std::memcmp(got, c.data.get() + i * es, es))
            << what << ": element " << i << " of an output differs from the same op on "
            << "contiguous copies of the views";
        for (int b = 0; b < es; ++b) covered[c.offsets[i] * es + b] = true;
      }
      const Output* o = OutputAt(c.rec->base);
      if (o == nullptr) continue;
      for (int64_t b = 0; b < c.rec->bytes; ++b) {
        ASSERT_TRUE(covered[b] || c.rec->base[b] == o->before[b])
            << what << ": byte " << b << " of an output allocation, outside its elements, was "
            << "written";
      }
    }
    ++g_mutated_ok_checked;
    for (int k = 0; k < kKinds; ++k) {
      if (kinds_ & (1u << k)) ++g_tally[k].bytes_checked;
    }
  }

  Fuzzer& f_;
  bool malformed_ = false;
  bool too_big_ = false;
  bool must_reject_device_ = false;
  bool must_reject_misaligned_ = false;
  uint32_t kinds_ = 0;
  std::vector<std::unique_ptr<uint8_t[]>> bufs_;
  std::vector<Output> outputs_;
  std::vector<Record> records_;
};
int Call::calls_ = 0;
int Call::ok_calls_ = 0;

struct Geo {
  int H, Dk, Dv, S;
  int64_t P;
  Layout layout;
};

Geo RandomGeo(Fuzzer& f, bool equal_dims64) {
  Geo g;
  g.H = f.Int(1, 3);
  g.Dk = equal_dims64 ? f.Pick<int>({64, 128}) : f.Pick<int>({16, 32, 64});
  g.Dv = equal_dims64 ? g.Dk : f.Pick<int>({16, 32, 64});
  g.S = equal_dims64 ? f.Pick<int>({4, 8, 16}) : f.Pick<int>({1, 3, 4, 16});
  g.P = f.Int(1, 6);
  g.layout = f.Chance(0.5) ? Layout::kNHD : Layout::kHND;
  return g;
}

PagedCache CacheViews(Call& c, const Geo& g, bool output) {
  const bool nhd = g.layout == Layout::kNHD;
  const int64_t a = nhd ? g.S : g.H, b = nhd ? g.H : g.S;
  const double p = 0.03;
  return PagedCache::FromTuple(c.View(DType::kU8, {g.P, a, b, g.Dk / 2}, p, 0, 0, output, 8),
                               c.View(DType::kU8, {g.P, a, b, g.Dv / 2}, p, 0, 0, output, 8),
                               c.View(DType::kE4M3, {g.P, a, b, g.Dk / 16}, p, 0, 0, output),
                               c.View(DType::kE4M3, {g.P, a, b, g.Dv / 16}, p, 0, 0, output),
                               g.layout);
}

PagedCache Remapped(const PagedCache& c, const Call::Remap& m) {
  PagedCache r = c;
  r.k_data = m(c.k_data);
  r.v_data = m(c.v_data);
  r.k_scales = m(c.k_scales);
  r.v_scales = m(c.v_scales);
  return r;
}

constexpr int kIterations = 600;

TEST(ValidationFuzz, AppendBySlotAndPaged) {
  Fuzzer f(0x5eed0001);
  for (int it = 0; it < kIterations; ++it) {
    const Geo g = RandomGeo(f, false);
    Call c(f);
    const PagedCache cache = CacheViews(c, g, true);
    const int64_t n = f.Int(0, 9);
    const DType dt = f.Chance(0.5) ? DType::kBF16 : DType::kF16;
    const TensorView key = c.View(dt, {n, g.H, g.Dk});
    const TensorView value = c.View(dt, {n, g.H, g.Dv});
    const GlobalScale ks = f.Chance(0.1) ? f.WildScale() : GlobalScale::Value(0.01f);
    const GlobalScale vs = f.Chance(0.1) ? f.WildScale() : GlobalScale::Value(0.02f);
    const Recipe recipe = f.Chance(0.3) ? Recipe::FourOverSix() : Recipe::Standard();
    if (f.Chance(0.5)) {
      const TensorView slots = c.View(DType::kI64, {f.Int(0, static_cast<int>(n))}, 0.08, -3,
                                      g.P * g.S + 3);
      if (c.too_big()) continue;
      c.Check(QuantizeAppendBySlot(key, value, slots, cache, ks, vs, recipe), "by slot",
              [&](const Call::Remap& m) {
                return QuantizeAppendBySlot(m(key), m(value), m(slots), Remapped(cache, m), ks, vs,
                                            recipe);
              });
    } else {
      const int64_t batch = f.Int(0, 4);
      const TensorView bi = c.View(DType::kI32, {n}, 0.08, -1, batch + 1);
      const TensorView pos = c.View(DType::kI32, {n}, 0.08, -1, 3 * g.S);
      const TensorView kvi = c.View(DType::kI32, {f.Int(0, 8)}, 0.08, -2, g.P + 2);
      const TensorView indptr = c.View(DType::kI32, {batch + 1}, 0.08, -1, 9);
      const TensorView last = c.View(DType::kI32, {batch}, 0.08, 0, g.S);
      if (c.too_big()) continue;
      c.Check(QuantizeAppendPaged(key, value, bi, pos, cache, kvi, indptr, last, ks, vs, recipe),
              "paged", [&](const Call::Remap& m) {
                return QuantizeAppendPaged(m(key), m(value), m(bi), m(pos), Remapped(cache, m),
                                           m(kvi), m(indptr), m(last), ks, vs, recipe);
              });
    }
  }
}

TEST(ValidationFuzz, DequantizeAndMaterialize) {
  Fuzzer f(0x5eed0002);
  for (int it = 0; it < kIterations; ++it) {
    const bool mat = f.Chance(0.5);
    const Geo g = RandomGeo(f, mat);
    Call c(f);
    const PagedCache cache = CacheViews(c, g, false);
    const int64_t batch = f.Int(0, 4), width = f.Int(0, 4);
    const DType table = f.Chance(0.5) ? DType::kI32 : DType::kI64;
    const TensorView lens = c.View(DType::kI32, {batch}, 0.08, -2, 4 * g.S + 2);
    const GlobalScale ks = f.Chance(0.1) ? f.WildScale() : GlobalScale::Value(0.5f);
    const GlobalScale vs = GlobalScale::Value(0.25f);
    if (!mat) {
      const TensorView tables = c.View(table, {batch, width}, 0.08, -2, g.P + 2);
      const int64_t T = f.Int(0, 20);
      const DType out = f.Chance(0.5) ? DType::kBF16 : DType::kF16;
      const TensorView k_out = c.View(out, {batch, T, g.H, g.Dk}, 0.08, 0, 0, true);
      const TensorView v_out = c.View(out, {batch, T, g.H, g.Dv}, 0.08, 0, 0, true);
      if (c.too_big()) continue;
      c.Check(DequantizePaged(cache, tables, lens, k_out, v_out, ks, vs), "dequantize",
              [&](const Call::Remap& m) {
                return DequantizePaged(Remapped(cache, m), m(tables), m(lens), m(k_out), m(v_out),
                                       ks, vs);
              });
    } else {
      const bool separate = f.Chance(0.3);
      const TensorView tables = separate ? c.View(table, {batch, 2, width}, 0.08, -2, g.P + 2)
                                         : c.View(table, {batch, width}, 0.08, -2, g.P + 2);
      const TensorView indptr = c.View(DType::kI32, {batch + 1}, 0.08, -1, 2 * width + 1);
      const int64_t pages = f.Int(0, 6);
      const TensorView out =
          c.View(DType::kE4M3, {pages, 2, g.H, g.S, g.Dk}, 0.08, 0, 0, true);
      const TensorView fp8_tables = c.View(DType::kI32, {batch, width}, 0.08, 0, 0, true);
      const GlobalScale kf = f.Chance(0.1) ? f.WildScale() : GlobalScale::Value(3.0f);
      if (c.too_big()) continue;
      c.Check(MaterializeFp8(cache, tables, lens, indptr, out, fp8_tables, ks, vs, kf,
                             GlobalScale::Value(1.5f)),
              "materialize", [&](const Call::Remap& m) {
                return MaterializeFp8(Remapped(cache, m), m(tables), m(lens), m(indptr), m(out),
                                      m(fp8_tables), ks, vs, kf, GlobalScale::Value(1.5f));
              });
    }
  }
}

TEST(ValidationFuzz, LinearCalibrateAndAttention) {
  Fuzzer f(0x5eed0003);
  for (int it = 0; it < kIterations; ++it) {
    Call c(f);
    const int choice = f.Int(0, 2);
    if (choice == 0) {
      const int64_t m = f.Int(0, 9), k = 16 * f.Int(0, 4);
      const DType dt = f.Chance(0.5) ? DType::kBF16 : DType::kF16;
      const bool quantize = f.Chance(0.5);
      const TensorView x = c.View(dt, {m, k}, 0.08, 0, 0, !quantize);
      const TensorView packed = c.View(DType::kU8, {m, k / 2}, 0.08, 0, 0, quantize);
      const TensorView scales = c.View(DType::kE4M3, {m, k / 16}, 0.08, 0, 0, quantize);
      const GlobalScale gs = f.Chance(0.15) ? f.WildScale() : GlobalScale::Value(0.1f);
      if (c.too_big()) continue;
      if (quantize) {
        c.Check(QuantizeLinear(x, packed, scales, gs), "quantize linear",
                [&](const Call::Remap& m) { return QuantizeLinear(m(x), m(packed), m(scales), gs); });
      } else {
        c.Check(DequantizeLinear(packed, scales, x, gs), "dequantize linear",
                [&](const Call::Remap& m) {
                  return DequantizeLinear(m(packed), m(scales), m(x), gs);
                });
      }
    } else if (choice == 1) {
      absl::StatusOr<Calibrator> cal =
          Calibrator::Create({256, DType::kBF16, Device::Cpu(), Recipe::Standard()});
      ASSERT_TRUE(cal.ok()) << cal.status();
      const TensorView x = c.View(DType::kBF16, {f.Int(0, 8), f.Int(0, 40)}, 0.15);
      float amax = -1, g = -1;
      if (c.too_big()) continue;
      c.Check(cal->Run(x, &amax, &g, nullptr), "calibrate");
    } else {
      const Geo g = RandomGeo(f, true);
      Call& cc = c;
      const PagedCache cache = CacheViews(cc, g, false);
      const int64_t batch = f.Int(1, 3), width = f.Int(1, 3);
      DecodeAttention::Options o;
      o.geometry.num_kv_heads = g.H;
      o.geometry.head_dim_k = g.Dk;
      o.geometry.head_dim_v = g.Dv;
      o.geometry.page_size = g.S;
      o.geometry.num_pages = g.P;
      o.geometry.layout = g.layout;
      o.num_qo_heads = g.H * f.Int(1, 2);
      o.max_batch = 4;
      o.max_pages_per_seq = 4;
      o.device = Device::Cpu();
      DecodeAttentionArgs a;
      a.seq_lens = cc.View(DType::kI32, {batch}, 0.08, -1, width * g.S + 2);
      a.block_tables = cc.View(DType::kI32, {batch, width}, 0.08, -2, g.P + 2);
      a.q = cc.View(DType::kBF16, {batch, o.num_qo_heads, g.Dk});
      a.out = cc.View(DType::kBF16, {batch, o.num_qo_heads, g.Dv}, 0.08, 0, 0, true);
      a.k_scale = f.Chance(0.1) ? f.WildScale() : GlobalScale::Value(0.01f);
      a.v_scale = GlobalScale::Value(0.01f);
      if (cc.too_big()) continue;
      cc.Check(DecodeAttentionPaged(o, a, cache, nullptr, 0), "attention",
               [&](const Call::Remap& m) {
                 DecodeAttentionArgs b = a;
                 b.seq_lens = m(a.seq_lens);
                 b.block_tables = m(a.block_tables);
                 b.q = m(a.q);
                 b.out = m(a.out);
                 return DecodeAttentionPaged(o, b, Remapped(cache, m), nullptr, 0);
               });
    }
  }
}

TEST(ValidationFuzz, DLPackImport) {
  Fuzzer f(0x5eed0004);
  int rejected = 0;
  for (int it = 0; it < 4 * kIterations; ++it) {
    int64_t shape[8], strides[8];
    uint8_t storage[64];
    DLTensor t{};
    t.ndim = f.Pick<int32_t>({-1, 0, 1, 2, 3, 6, 7, 100});
    const int dims = std::max(0, std::min<int32_t>(t.ndim, 8));
    for (int d = 0; d < dims; ++d) {
      shape[d] = f.Chance(0.2) ? f.WildExtent(2) : f.Int(0, 3);
      strides[d] = f.Chance(0.2) ? f.WildStride(1) : f.Int(0, 4);
    }
    t.shape = f.Chance(0.15) ? nullptr : shape;
    t.strides = f.Chance(0.5) ? nullptr : strides;
    t.data = f.Chance(0.2) ? nullptr : storage;
    t.byte_offset = f.Chance(0.2) ? f.Pick<uint64_t>({1, 8, UINT64_MAX, uint64_t{1} << 63}) : 0;
    t.dtype.code = f.Pick<uint8_t>({kDLFloat, kDLBfloat, kDLInt, kDLUInt, 99});
    t.dtype.bits = f.Pick<uint8_t>({8, 16, 32, 64, 7});
    t.dtype.lanes = f.Chance(0.1) ? 4 : 1;
    t.device.device_type = f.Pick<DLDeviceType>({kDLCPU, kDLCUDA, kDLCUDAHost, kDLMetal});
    t.device.device_id = 0;
    absl::StatusOr<TensorView> v = TensorView::FromDLPack(t);
    if (!v.ok()) {
      ++rejected;
      EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(v.status().message().rfind("DLTensor: expected ", 0), 0u) << v.status();
      continue;
    }
    int64_t bytes = 0;
    EXPECT_TRUE(WellFormed(*v, &bytes)) << "accepted " << v->ShapeString();
    EXPECT_TRUE(t.ndim == 0 || t.shape != nullptr);
  }
  EXPECT_GT(rejected, 0);
}

TEST(ValidationFuzz, KVCacheOptions) {
  Fuzzer f(0x5eed0005);
  int created = 0;
  for (int it = 0; it < 300; ++it) {
    KVCacheOptions o;
    o.num_layers = f.Chance(0.1) ? f.Pick<int>({0, -1, INT32_MAX}) : f.Int(1, 3);
    o.geometry.num_kv_heads = f.Chance(0.1) ? f.Pick<int>({0, -1, INT32_MAX}) : f.Int(1, 2);
    o.geometry.head_dim_k = f.Chance(0.1) ? f.Pick<int>({0, 8, INT32_MAX & ~15}) : 64;
    o.geometry.head_dim_v = f.Chance(0.1) ? f.Pick<int>({-16, 17, INT32_MAX & ~15}) : 64;
    o.geometry.page_size = f.Chance(0.1) ? f.Pick<int>({0, -4, INT32_MAX}) : f.Pick<int>({4, 16});
    // Either a few pages, or a budget: small, or large enough that the pool
    // layout overflows int64 for a huge geometry.
    if (f.Chance(0.5)) {
      o.geometry.num_pages = f.Chance(0.1) ? f.Pick<int64_t>({-1, INT64_MAX, int64_t{1} << 31})
                                           : f.Int(1, 8);
    } else {
      o.memory_budget_bytes = f.Chance(0.3) ? f.Pick<int64_t>({-1, 1, INT64_MAX})
                                            : f.Int(1, 64) * int64_t{4096};
    }
    o.max_seqs_per_step = f.Chance(0.1) ? f.Pick<int>({0, INT32_MAX}) : f.Int(1, 4);
    o.max_tokens_per_step = f.Chance(0.1) ? f.Pick<int>({-3, 0}) : f.Int(1, 64);
    o.max_pages_per_seq = f.Chance(0.1) ? f.Pick<int>({-1, INT32_MAX}) : f.Int(0, 4);
    if (f.Chance(0.1)) {
      o.k_global_scales.assign(o.num_layers > 0 && o.num_layers < 8 ? o.num_layers : 1,
                               f.WildScale().value);
    }
    // Skip what is valid but would really allocate a lot (pools past 256
    // MiB that still fit in int64): a legitimate ResourceExhausted or a real
    // allocation, not validation. Sizes past int64 must be rejected.
    {
      const __int128 per_page = static_cast<__int128>(std::max(o.num_layers, 0)) *
                                std::max(o.geometry.page_size, 0) *
                                std::max(o.geometry.num_kv_heads, 0) *
                                (static_cast<__int128>(std::max(o.geometry.head_dim_k, 0)) + std::max(o.geometry.head_dim_v, 0)) *
                                9 / 16;
      const __int128 pages = o.geometry.num_pages > 0 ? o.geometry.num_pages
                             : per_page > 0           ? o.memory_budget_bytes / per_page
                                                      : 0;
      const __int128 bytes = per_page * std::min<__int128>(pages, INT32_MAX);
      if (bytes > (int64_t{1} << 28) && bytes < (static_cast<__int128>(1) << 62)) continue;
    }
    absl::StatusOr<KVCache> cache = KVCache::Create(o);
    if (!cache.ok()) {
      EXPECT_TRUE(cache.status().code() == absl::StatusCode::kInvalidArgument ||
                  cache.status().code() == absl::StatusCode::kResourceExhausted)
          << cache.status();
      if (cache.status().code() == absl::StatusCode::kInvalidArgument) {
        EXPECT_NE(cache.status().message().find(": expected "), std::string::npos)
            << cache.status();
      }
      continue;
    }
    ++created;
    EXPECT_GE(cache->options().max_pages_per_seq, 1);
    // A short life: a sequence, a step, an append, a read back.
    const SequenceId seq = cache->CreateSequence().value();
    const int n = std::min(o.max_tokens_per_step, 3);
    absl::StatusOr<StepInfo> step = cache->PrepareStep({{seq, n}});
    if (!step.ok()) continue;
    const CacheGeometry& g = cache->geometry();
    Call c(f);
    const TensorView k = c.View(DType::kBF16, {n, g.num_kv_heads, g.head_dim_k}, 0.1);
    const TensorView v = c.View(DType::kBF16, {n, g.num_kv_heads, g.head_dim_v}, 0.1);
    absl::StatusOr<CacheAppender> app = cache->appender();
    ASSERT_TRUE(app.ok()) << app.status();
    if (!c.too_big()) c.Check(app->Run(0, k, v), "cache append");
    Call r(f);
    const int64_t T = f.Int(0, 5);
    const TensorView ko = r.View(DType::kBF16, {T, g.num_kv_heads, g.head_dim_k}, 0.1, 0, 0, true);
    const TensorView vo = r.View(DType::kBF16, {T, g.num_kv_heads, g.head_dim_v}, 0.1, 0, 0, true);
    const int layer = f.Int(-1, 1);
    if (!r.too_big()) {
      r.Check(cache->ReadSequence(layer, seq, ko, vo), "read sequence",
              [&](const Call::Remap& m) { return cache->ReadSequence(layer, seq, m(ko), m(vo)); });
    }
  }
  EXPECT_GT(created, 20);
}

TEST(ValidationFuzz, SomeCallsSucceedAndSomeFail) {
  // The property tests above are only meaningful if both outcomes occur
  // (they run first, in the order of this file).
  if (Call::calls_ < 1000) GTEST_SKIP() << "run with the tests above";
  EXPECT_GT(Call::ok_calls_, Call::calls_ / 20) << Call::ok_calls_ << " of " << Call::calls_;
  EXPECT_LT(Call::ok_calls_, Call::calls_ - Call::calls_ / 20) << Call::ok_calls_ << " of "
                                                               << Call::calls_;
  // Calls by mutation kind (a call counts once for every kind among its
  // views): accepted, rejected, and accepted calls whose bytes were checked
  // against contiguous copies.
  std::cout << "calls " << Call::calls_ << " (accepted " << Call::ok_calls_ << "), unmutated "
            << g_unmutated_calls << "; mutated and accepted: " << g_mutated_ok_checked
            << " checked against contiguous copies, " << g_mutated_ok_unchecked
            << " not (no rerun, or overlapping output elements)\n";
  for (int k = 0; k < kKinds; ++k) {
    std::cout << "  " << kKindNames[k] << ": " << g_tally[k].calls << " calls, "
              << g_tally[k].ok << " accepted (" << g_tally[k].bytes_checked
              << " bytes checked), " << g_tally[k].rejected << " rejected\n";
    EXPECT_GT(g_tally[k].calls, 0) << kKindNames[k] << " mutations never ran";
  }
  EXPECT_GT(g_tally[kDevice].rejected, 0);
  EXPECT_GT(g_tally[kMisalign].rejected, 0);
  EXPECT_GT(g_mutated_ok_checked, 50) << "few mutated-but-valid calls were checked";
}

}  // namespace
}  // namespace fp4kv
