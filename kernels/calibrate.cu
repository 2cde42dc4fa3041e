// Calibrator: amax by a CUB max-reduction over |x| (NaN read as 0), then a
// one-thread kernel that turns amax into the global scale on the device
// (NVFP4, or an FP8 key scale for RunFp8Key: the same reduction, another
// branch of FinalizeScales). The
// CPU path runs the same element conversion and the same conversion function,
// and max is exact and order-free, so both produce the same bits.
#include "fp4kv/calibrate.h"

#include <cuda_runtime_api.h>

#include <cub/device/device_reduce.cuh>
#include <thrust/iterator/counting_iterator.h>
#include <thrust/iterator/transform_iterator.h>

#include "absl/strings/str_cat.h"
#include "fp4kv/recipe.h"
#include "src/cuda_util.h"
#include "src/status_macros.h"
#include "src/validate.h"

namespace fp4kv {
namespace {

// Offset of the CUB temp storage inside the scratch; the amax slot is at 0.
constexpr size_t kTempOffset = 256;

// |x| as float; NaN -> 0 so that the max ignores it; -0 -> +0.
FP4KV_HD float MagnitudeOrZero(float x) {
  const uint32_t b = FloatBits(x) & 0x7fffffffu;
  return b > 0x7f800000u ? 0.0f : BitsFloat(b);
}

template <DType kDType>
FP4KV_HD float LoadElement(const void* base, int64_t offset) {
  if constexpr (kDType == DType::kF16) {
    return HalfBitsToFloat(static_cast<const uint16_t*>(base)[offset]);
  } else if constexpr (kDType == DType::kBF16) {
    return Bf16BitsToFloat(static_cast<const uint16_t*>(base)[offset]);
  } else {
    return static_cast<const float*>(base)[offset];
  }
}

// Element i of a contiguous view.
template <DType kDType>
struct ContiguousMagnitude {
  const void* base;
  FP4KV_HD float operator()(int64_t i) const {
    return MagnitudeOrZero(LoadElement<kDType>(base, i));
  }
};

// Element i (row-major order) of a strided view with `ndim` collapsed dims.
template <DType kDType>
struct StridedMagnitude {
  const void* base;
  int ndim;
  int64_t shape[TensorView::kMaxDims];
  int64_t strides[TensorView::kMaxDims];  // elements
  FP4KV_HD float operator()(int64_t i) const {
    int64_t offset = 0;
    for (int d = ndim - 1; d >= 0; --d) {
      offset += (i % shape[d]) * strides[d];
      i /= shape[d];
    }
    return MagnitudeOrZero(LoadElement<kDType>(base, offset));
  }
};

struct MaxOp {
  FP4KV_HD float operator()(float a, float b) const { return a > b ? a : b; }
};

// Drops extent-1 dims and merges dims that are contiguous with each other.
// A contiguous view ends up with ndim <= 1 and stride 1.
struct Collapsed {
  int ndim = 0;
  int64_t shape[TensorView::kMaxDims] = {};
  int64_t strides[TensorView::kMaxDims] = {};
  bool contiguous() const { return ndim == 0 || (ndim == 1 && strides[0] == 1); }
};

Collapsed Collapse(const TensorView& t) {
  Collapsed c;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] == 1) continue;
    if (c.ndim > 0 && c.strides[c.ndim - 1] == t.strides[d] * t.shape[d]) {
      c.shape[c.ndim - 1] *= t.shape[d];
      c.strides[c.ndim - 1] = t.strides[d];
    } else {
      c.shape[c.ndim] = t.shape[d];
      c.strides[c.ndim] = t.strides[d];
      ++c.ndim;
    }
  }
  return c;
}

template <DType kDType>
StridedMagnitude<kDType> MakeStrided(const void* base, const Collapsed& c) {
  StridedMagnitude<kDType> f{};
  f.base = base;
  f.ndim = c.ndim;
  for (int d = 0; d < c.ndim; ++d) {
    f.shape[d] = c.shape[d];
    f.strides[d] = c.strides[d];
  }
  return f;
}

template <typename F>
auto MakeIterator(F f) {
  return thrust::make_transform_iterator(thrust::counting_iterator<int64_t>(0), f);
}

// The global scale and FP8 decode scale of an amax: NVFP4 (recipe-sized) or
// an FP8 key scale. The host path calls the same function.
FP4KV_HD void FinalizeScales(float amax, const Recipe& recipe, bool fp8_key, float* g_out,
                             float* fp8_out) {
  const float g = fp8_key ? MakeFp8KeyScale(amax) : MakeGlobalScale(amax, recipe);
  *g_out = g;
  if (fp8_out != nullptr) *fp8_out = fp8_key ? MinFp8ScaleForFp8Keys(g) : MinFp8ScaleFor(g);
}

// Writes amax (0 when the input was empty) and the global scale.
__global__ void CalibrateFinalizeKernel(float* __restrict__ d_amax,          // [1]
                                        float* __restrict__ d_global_scale,  // [1]
                                        float* __restrict__ d_fp8_scale,     // [1] or null
                                        Recipe recipe, bool empty, bool fp8_key) {
  if (empty) *d_amax = 0.0f;
  FinalizeScales(*d_amax, recipe, fp8_key, d_global_scale, d_fp8_scale);
}

// CUB temp bytes for `n` items through the iterators of dtype kDType (both
// paths; the larger).
template <DType kDType>
absl::Status QueryTempBytes(int64_t n, size_t* bytes) {
  size_t contiguous = 0;
  size_t strided = 0;
  FP4KV_CUDA_RETURN_IF_ERROR(cub::DeviceReduce::Reduce(
      nullptr, contiguous, MakeIterator(ContiguousMagnitude<kDType>{nullptr}),
      static_cast<float*>(nullptr), n, MaxOp{}, 0.0f));
  FP4KV_CUDA_RETURN_IF_ERROR(
      cub::DeviceReduce::Reduce(nullptr, strided, MakeIterator(StridedMagnitude<kDType>{}),
                                static_cast<float*>(nullptr), n, MaxOp{}, 0.0f));
  *bytes = contiguous > strided ? contiguous : strided;
  return absl::OkStatus();
}

template <DType kDType>
absl::Status ReduceOnDevice(const void* base, const Collapsed& c, int64_t n, void* d_temp,
                            size_t temp_bytes, float* d_amax, cudaStream_t stream) {
  size_t bytes = temp_bytes;
  if (c.contiguous()) {
    FP4KV_CUDA_RETURN_IF_ERROR(
        cub::DeviceReduce::Reduce(d_temp, bytes, MakeIterator(ContiguousMagnitude<kDType>{base}),
                                  d_amax, n, MaxOp{}, 0.0f, stream));
  } else {
    FP4KV_CUDA_RETURN_IF_ERROR(cub::DeviceReduce::Reduce(d_temp, bytes,
                                                         MakeIterator(MakeStrided<kDType>(base, c)),
                                                         d_amax, n, MaxOp{}, 0.0f, stream));
  }
  return absl::OkStatus();
}

template <DType kDType>
float ReduceOnHost(const void* base, const Collapsed& c, int64_t n) {
  float amax = 0.0f;
  const MaxOp op;
  if (c.contiguous()) {
    const ContiguousMagnitude<kDType> f{base};
    for (int64_t i = 0; i < n; ++i) amax = op(amax, f(i));
  } else {
    const StridedMagnitude<kDType> f = MakeStrided<kDType>(base, c);
    for (int64_t i = 0; i < n; ++i) amax = op(amax, f(i));
  }
  return amax;
}

absl::Status CheckCalibrateDType(DType t, const char* name) {
  if (t != DType::kF16 && t != DType::kBF16 && t != DType::kF32) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": expected dtype f16, bf16 or f32, got ", DTypeName(t)));
  }
  return absl::OkStatus();
}

// Sets the calling thread's current device back to `device` on scope exit.
class DeviceRestorer {
 public:
  explicit DeviceRestorer(int device) : device_(device) {}
  ~DeviceRestorer() { (void)cudaSetDevice(device_); }

 private:
  int device_;
};

}  // namespace

absl::StatusOr<Calibrator> Calibrator::Create(const Options& o) {
  if (o.max_elements < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("options.max_elements: expected >= 0, got ", o.max_elements));
  }
  FP4KV_RETURN_IF_ERROR(CheckCalibrateDType(o.dtype, "options.dtype"));
  FP4KV_RETURN_IF_ERROR(ValidateRecipe(o.recipe));
  FP4KV_RETURN_IF_ERROR(internal::CheckDeviceAvailable(o.device));
  Calibrator c(o);
  if (!o.device.is_cuda()) return c;

  int current = 0;
  FP4KV_CUDA_RETURN_IF_ERROR(cudaGetDevice(&current));
  DeviceRestorer restore(current);
  FP4KV_CUDA_RETURN_IF_ERROR(cudaSetDevice(o.device.ordinal));
  size_t temp = 0;
  if (o.max_elements > 0) {
    switch (o.dtype) {
      case DType::kF16:
        FP4KV_RETURN_IF_ERROR(QueryTempBytes<DType::kF16>(o.max_elements, &temp));
        break;
      case DType::kBF16:
        FP4KV_RETURN_IF_ERROR(QueryTempBytes<DType::kBF16>(o.max_elements, &temp));
        break;
      default:
        FP4KV_RETURN_IF_ERROR(QueryTempBytes<DType::kF32>(o.max_elements, &temp));
        break;
    }
  }
  c.temp_bytes_ = temp;
  c.scratch_bytes_ = kTempOffset + temp;
  if (const cudaError_t err = cudaMalloc(&c.d_scratch_, c.scratch_bytes_); err != cudaSuccess) {
    (void)cudaGetLastError();
    c.d_scratch_ = nullptr;
    return absl::ResourceExhaustedError(absl::StrCat(
        "Calibrator::Create: cannot allocate ", c.scratch_bytes_,
        " bytes of device memory for the calibration scratch of ", o.max_elements,
        " elements (cudaMalloc: ", cudaGetErrorName(err), ")"));
  }
  return c;
}

Calibrator::Calibrator(Calibrator&& other) noexcept
    : options_(other.options_),
      d_scratch_(other.d_scratch_),
      scratch_bytes_(other.scratch_bytes_),
      temp_bytes_(other.temp_bytes_) {
  other.d_scratch_ = nullptr;
  other.scratch_bytes_ = 0;
  other.temp_bytes_ = 0;
}

Calibrator& Calibrator::operator=(Calibrator&& other) noexcept {
  if (this != &other) {
    if (d_scratch_ != nullptr) (void)cudaFree(d_scratch_);
    options_ = other.options_;
    d_scratch_ = other.d_scratch_;
    scratch_bytes_ = other.scratch_bytes_;
    temp_bytes_ = other.temp_bytes_;
    other.d_scratch_ = nullptr;
    other.scratch_bytes_ = 0;
    other.temp_bytes_ = 0;
  }
  return *this;
}

Calibrator::~Calibrator() {
  if (d_scratch_ != nullptr) (void)cudaFree(d_scratch_);
}

absl::Status Calibrator::Run(const TensorView& input, float* amax, float* global_scale,
                             Stream stream, float* fp8_scale) {
  return RunImpl(input, amax, global_scale, stream, fp8_scale, /*fp8_key=*/false);
}

absl::Status Calibrator::RunFp8Key(const TensorView& input, float* amax, float* global_scale,
                                   Stream stream, float* fp8_scale) {
  return RunImpl(input, amax, global_scale, stream, fp8_scale, /*fp8_key=*/true);
}

absl::Status Calibrator::RunImpl(const TensorView& input, float* amax, float* global_scale,
                                 Stream stream, float* fp8_scale, bool fp8_key) {
  const Options& o = options_;
  FP4KV_RETURN_IF_ERROR(internal::CheckExtents(input, "input"));
  const int64_t n = input.numel();
  if (n > o.max_elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("input: expected at most options.max_elements = ", o.max_elements,
                     " elements, got ", n, " (shape ", input.ShapeString(), ")"));
  }
  if (n > 0) FP4KV_RETURN_IF_ERROR(internal::CheckGiven(input, "input"));
  FP4KV_RETURN_IF_ERROR(internal::CheckDType(input, "input", {o.dtype}));
  FP4KV_RETURN_IF_ERROR(internal::CheckDevice(input, "input", o.device));
  FP4KV_RETURN_IF_ERROR(internal::CheckAligned(input, "input", DTypeSize(o.dtype)));
  if (global_scale == nullptr) {
    return absl::InvalidArgumentError("global_scale: expected a pointer to one float, got null");
  }
  if (amax == global_scale) {
    return absl::InvalidArgumentError(
        "amax: expected a pointer distinct from global_scale (or null), got the same address");
  }
  if (fp8_scale != nullptr && (fp8_scale == global_scale || fp8_scale == amax)) {
    return absl::InvalidArgumentError(
        "fp8_scale: expected a pointer distinct from amax and global_scale (or null), got the same "
        "address");
  }
  const Collapsed c = Collapse(input);

  if (!o.device.is_cuda()) {
    float a = 0.0f;
    if (n > 0) {
      switch (o.dtype) {
        case DType::kF16:
          a = ReduceOnHost<DType::kF16>(input.data, c, n);
          break;
        case DType::kBF16:
          a = ReduceOnHost<DType::kBF16>(input.data, c, n);
          break;
        default:
          a = ReduceOnHost<DType::kF32>(input.data, c, n);
          break;
      }
    }
    if (amax != nullptr) *amax = a;
    FinalizeScales(a, o.recipe, fp8_key, global_scale, fp8_scale);
    return absl::OkStatus();
  }

  float* d_amax = amax != nullptr ? amax : static_cast<float*>(d_scratch_);
  void* d_temp = static_cast<char*>(d_scratch_) + kTempOffset;
  if (n > 0) {
    switch (o.dtype) {
      case DType::kF16:
        FP4KV_RETURN_IF_ERROR(
            ReduceOnDevice<DType::kF16>(input.data, c, n, d_temp, temp_bytes_, d_amax, stream));
        break;
      case DType::kBF16:
        FP4KV_RETURN_IF_ERROR(
            ReduceOnDevice<DType::kBF16>(input.data, c, n, d_temp, temp_bytes_, d_amax, stream));
        break;
      default:
        FP4KV_RETURN_IF_ERROR(
            ReduceOnDevice<DType::kF32>(input.data, c, n, d_temp, temp_bytes_, d_amax, stream));
        break;
    }
  }
  CalibrateFinalizeKernel<<<1, 1, 0, stream>>>(d_amax, global_scale, fp8_scale, o.recipe, n == 0,
                                               fp8_key);
  return internal::CudaStatus(cudaGetLastError(), "CalibrateFinalizeKernel launch");
}

}  // namespace fp4kv
