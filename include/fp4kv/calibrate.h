// Calibration: the amax of a tensor and the global scale derived from it,
// computed where the tensor lives, without a host synchronization.
//
//   amax         = max |x| over the view (NaN ignored; +-0 count as 0; 0 for
//                  an empty view)
//   global_scale = MakeGlobalScale(amax, recipe)     (recipe.h)
//                  (RunFp8Key: MakeFp8KeyScale(amax), format.h)
//
// On a CUDA device both results are written to device floats by work
// enqueued on the given stream (a CUB max-reduction, then a one-thread kernel
// that converts amax on the device), so Run() can be captured in a CUDA graph
// and, replayed, recalibrates from whatever the view's memory then holds.
// KVCache::CalibrateGlobalScales uses it to set a cache layer's scales on the
// device; the calibrator's recipe must be the cache's recipe (recipe.h says why).
// CPU views are reduced on the host, synchronously, with the same result bits.
#ifndef FP4KV_CALIBRATE_H_
#define FP4KV_CALIBRATE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "fp4kv/format.h"
#include "fp4kv/ops.h"
#include "fp4kv/tensor.h"

namespace fp4kv {

// Invariants: options are valid; on a CUDA device the scratch memory for a
// reduction of up to options.max_elements values is allocated (once, in
// Create) and owned. Move-only. Run() uses that scratch, so one Calibrator
// runs one reduction at a time: calls on different streams must be ordered by
// the caller, and concurrent Run() calls from several threads need several
// Calibrators.
class Calibrator {
 public:
  struct Options {
    int64_t max_elements = 0;    // largest input.numel() a Run() accepts, >= 0
    DType dtype = DType::kBF16;  // of the input: f16, bf16 or f32
    Device device;
    Recipe recipe;  // its e4m3_max sizes the global scale
  };

  // Validates the options; on CUDA, sizes and allocates the reduction scratch
  // on options.device (the calling thread's current device is restored).
  static absl::StatusOr<Calibrator> Create(const Options& options);

  Calibrator(Calibrator&& other) noexcept;
  Calibrator& operator=(Calibrator&& other) noexcept;
  Calibrator(const Calibrator&) = delete;
  Calibrator& operator=(const Calibrator&) = delete;
  ~Calibrator();

  // Writes amax and global_scale (one fp32 each) for `input`.
  //   input: any shape and strides (a contiguous view takes the faster path),
  //     dtype options.dtype, device options.device, numel <= max_elements;
  //     data may be null only when numel == 0.
  //   amax: where amax goes, or nullptr to keep it in internal scratch.
  //   global_scale: where the global scale goes; not null, not `amax`.
  //   Both pointers are memory on options.device (host memory for the CPU).
  // CUDA: enqueues on `stream` (the calling thread's current device must be
  // options.device); allocates nothing, never synchronizes, graph-capturable;
  // returns the launch status. CPU: computes synchronously, ignores `stream`.
  // On InvalidArgument nothing is enqueued or written.
  //   fp8_scale: when not null, also gets MinFp8ScaleFor(global_scale), the
  //     FP8 decode scale of materialized pages (format.h); distinct pointer.
  absl::Status Run(const TensorView& input, float* amax, float* global_scale,
                   Stream stream = nullptr, float* fp8_scale = nullptr);

  // The same as Run (same checks, same amax reduction) for FP8 keys
  // (KeyFormat::kFp8, docs/format.md "FP8 key pages"): global_scale gets
  // MakeFp8KeyScale(amax) and fp8_scale, when not null,
  // MinFp8ScaleForFp8Keys(global_scale) (format.h); the recipe plays no part.
  absl::Status RunFp8Key(const TensorView& input, float* amax, float* global_scale,
                         Stream stream = nullptr, float* fp8_scale = nullptr);

  const Options& options() const { return options_; }
  // Bytes of device scratch held (0 on the CPU).
  size_t scratch_bytes() const { return scratch_bytes_; }

 private:
  explicit Calibrator(const Options& o) : options_(o) {}
  absl::Status RunImpl(const TensorView& input, float* amax, float* global_scale, Stream stream,
                       float* fp8_scale, bool fp8_key);

  Options options_;
  void* d_scratch_ = nullptr;  // [internal amax slot | CUB temp storage]
  size_t scratch_bytes_ = 0;
  size_t temp_bytes_ = 0;  // CUB part of the scratch
};

}  // namespace fp4kv

#endif  // FP4KV_CALIBRATE_H_
