// The fp4kv Python extension (fp4kv._core): a thin nanobind layer over the
// public C++ API (include/fp4kv/).
//
// Tensors come in through DLPack or the buffer protocol (numpy arrays on the
// CPU, torch tensors on CUDA) without a copy, and go out as DLPack tensors
// that keep their owner alive. A Status error becomes a Python exception of
// the class that matches its code, carrying the Status message.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "fp4kv/attention.h"
#include "fp4kv/calibrate.h"
#include "fp4kv/format.h"
#include "fp4kv/geometry.h"
#include "fp4kv/kv_cache.h"
#include "fp4kv/kv_events.h"
#include "fp4kv/ops.h"
#include "fp4kv/recipe.h"
#include "fp4kv/sequence_image.h"
#include "fp4kv/tensor.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace fp4kv {
namespace python {
namespace {

// ------------------------------------------------------------ errors
// A non-OK Status on its way to Python.
struct StatusError : std::exception {
  explicit StatusError(absl::Status s) : status(std::move(s)), text(status.message()) {}
  const char* what() const noexcept override { return text.c_str(); }
  absl::Status status;
  std::string text;
};

// Python exception classes, made at module init.
struct Exceptions {
  PyObject* base = nullptr;                 // fp4kv.Error
  PyObject* invalid_argument = nullptr;     // ValueError
  PyObject* not_found = nullptr;            // LookupError
  PyObject* failed_precondition = nullptr;  // RuntimeError
  PyObject* resource_exhausted = nullptr;   // MemoryError
  PyObject* out_of_range = nullptr;         // IndexError
  PyObject* unimplemented = nullptr;        // NotImplementedError
  PyObject* data_loss = nullptr;            // RuntimeError
  PyObject* internal = nullptr;             // RuntimeError
};
Exceptions g_exc;

PyObject* ExceptionFor(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
      return g_exc.invalid_argument;
    case absl::StatusCode::kNotFound:
      return g_exc.not_found;
    case absl::StatusCode::kFailedPrecondition:
      return g_exc.failed_precondition;
    case absl::StatusCode::kResourceExhausted:
      return g_exc.resource_exhausted;
    case absl::StatusCode::kOutOfRange:
      return g_exc.out_of_range;
    case absl::StatusCode::kUnimplemented:
      return g_exc.unimplemented;
    case absl::StatusCode::kDataLoss:
      return g_exc.data_loss;
    case absl::StatusCode::kInternal:
      return g_exc.internal;
    default:
      return g_exc.base;
  }
}

[[noreturn]] void Throw(absl::Status s) { throw StatusError(std::move(s)); }
[[noreturn]] void ThrowInvalid(const std::string& message) {
  Throw(absl::InvalidArgumentError(message));
}
void Check(const absl::Status& s) {
  if (!s.ok()) Throw(s);
}
template <typename T>
T Take(absl::StatusOr<T>&& r) {
  if (!r.ok()) Throw(r.status());
  return *std::move(r);
}

// Runs `f` (a C++ call that touches no Python object) without the GIL. Only
// the functional ops do (they touch caller memory only, and may run
// concurrently, ops.h); calls on a KVCache and its bound ops keep the GIL, so
// Python threads cannot break the cache's rule that its calls are
// serialized.
template <typename F>
absl::Status NoGil(F&& f) {
  nb::gil_scoped_release release;
  return f();
}

// ------------------------------------------------------------ tensors
using RoArray = nb::ndarray<nb::ro>;
using RwArray = nb::ndarray<>;

template <typename A>
TensorView ViewOf(const A& a, const char* name) {
  DLTensor t{};
  t.data = const_cast<void*>(static_cast<const void*>(a.data()));
  t.device.device_type = static_cast<DLDeviceType>(a.device_type());
  t.device.device_id = a.device_id();
  t.ndim = static_cast<int32_t>(a.ndim());
  t.dtype.code = a.dtype().code;
  t.dtype.bits = a.dtype().bits;
  t.dtype.lanes = a.dtype().lanes;
  t.shape = const_cast<int64_t*>(a.shape_ptr());
  t.strides = const_cast<int64_t*>(a.stride_ptr());
  t.byte_offset = 0;
  absl::StatusOr<TensorView> v = TensorView::FromDLPack(t);
  if (!v.ok()) {
    Throw(absl::Status(v.status().code(),
                       std::string(name) + ": " + std::string(v.status().message())));
  }
  return *v;
}

// A tensor the op reads: anything with __dlpack__ or the buffer protocol.
RoArray ReadArray(nb::handle h, const char* name) {
  RoArray a;
  if (!nb::try_cast(h, a, /*convert=*/false)) {
    ThrowInvalid(std::string(name) +
                 ": expected a tensor (an object with __dlpack__ or the "
                 "buffer protocol), got " +
                 nb::type_name(h.type()).c_str());
  }
  return a;
}
TensorView In(nb::handle h, const char* name) { return ViewOf(ReadArray(h, name), name); }
TensorView InOpt(nb::handle h, const char* name) {
  return h.is_none() ? TensorView() : In(h, name);
}

// A tensor the op writes: refused when read-only.
RwArray WriteArray(nb::handle h, const char* name) {
  RwArray a;
  if (nb::try_cast(h, a, /*convert=*/false)) return a;
  RoArray r;
  if (nb::try_cast(h, r, /*convert=*/false)) {
    ThrowInvalid(std::string(name) + ": expected a writable tensor, got a read-only one");
  }
  ThrowInvalid(std::string(name) +
               ": expected a writable tensor (an object with __dlpack__ or "
               "the buffer protocol), got " +
               nb::type_name(h.type()).c_str());
}
TensorView Out(nb::handle h, const char* name) { return ViewOf(WriteArray(h, name), name); }
TensorView OutOpt(nb::handle h, const char* name) {
  return h.is_none() ? TensorView() : Out(h, name);
}

// Bytes of a contiguous tensor (images, workspaces).
struct Bytes {
  void* data = nullptr;
  int64_t size = 0;
};
Bytes BytesOf(const TensorView& v, const char* name) {
  if (!v.IsContiguous()) {
    ThrowInvalid(std::string(name) +
                 ": expected a contiguous tensor, got a strided view of shape " + v.ShapeString());
  }
  const int64_t n = v.numel();
  return Bytes{v.data, n * DTypeSize(v.dtype)};
}
Bytes OutBytes(nb::handle h, const char* name) {
  if (h.is_none()) return Bytes{};
  return BytesOf(Out(h, name), name);
}

// A global scale: a number (the value; Python and numpy scalars) or a tensor
// whose first fp32 element is read when the op runs (GlobalScale::Pointer).
GlobalScale ScaleOf(nb::handle h, const char* name) {
  if (PyFloat_Check(h.ptr()) || PyLong_Check(h.ptr()) ||
      (!nb::hasattr(h, "__dlpack__") && PyNumber_Check(h.ptr()) &&
       !PyObject_CheckBuffer(h.ptr()))) {
    return GlobalScale::Value(nb::cast<float>(h));
  }
  RoArray a;
  if (!nb::try_cast(h, a, false)) {
    if (PyNumber_Check(h.ptr())) return GlobalScale::Value(nb::cast<float>(h));
    ThrowInvalid(std::string(name) + ": expected a float or an fp32 tensor, got " +
                 nb::type_name(h.type()).c_str());
  }
  if (a.ndim() == 0 && PyNumber_Check(h.ptr()) && a.device_type() == nb::device::cpu::value) {
    return GlobalScale::Value(nb::cast<float>(h));  // a numpy scalar
  }
  const TensorView v = ViewOf(a, name);
  if (v.dtype != DType::kF32 || v.numel() < 1) {
    ThrowInvalid(std::string(name) +
                 ": expected a float or an fp32 tensor of at least one "
                 "element (read when the op runs), got " +
                 DTypeName(v.dtype) + " " + v.ShapeString());
  }
  return GlobalScale::Pointer(static_cast<const float*>(v.data));
}

float* FloatOut(nb::handle h, const char* name) {
  if (h.is_none()) return nullptr;
  const TensorView v = Out(h, name);
  if (v.dtype != DType::kF32 || v.numel() < 1) {
    ThrowInvalid(std::string(name) + ": expected an fp32 tensor of at least one element, got " +
                 std::string(DTypeName(v.dtype)) + " " + v.ShapeString());
  }
  return static_cast<float*>(v.data);
}

Stream StreamOf(uintptr_t s) { return reinterpret_cast<Stream>(s); }

// DLPack dtype of an exported view (E4M3 bytes go out as uint8, which every
// framework reads; torch users may .view(torch.float8_e4m3fn)).
nb::dlpack::dtype ExportDtype(DType t) {
  nb::dlpack::dtype d{};
  d.lanes = 1;
  switch (t) {
    case DType::kF16:
      d.code = (uint8_t)nb::dlpack::dtype_code::Float;
      d.bits = 16;
      break;
    case DType::kBF16:
      d.code = (uint8_t)nb::dlpack::dtype_code::Bfloat;
      d.bits = 16;
      break;
    case DType::kF32:
      d.code = (uint8_t)nb::dlpack::dtype_code::Float;
      d.bits = 32;
      break;
    case DType::kI32:
      d.code = (uint8_t)nb::dlpack::dtype_code::Int;
      d.bits = 32;
      break;
    case DType::kI64:
      d.code = (uint8_t)nb::dlpack::dtype_code::Int;
      d.bits = 64;
      break;
    case DType::kU8:
    case DType::kE4M3:
      d.code = (uint8_t)nb::dlpack::dtype_code::UInt;
      d.bits = 8;
      break;
  }
  return d;
}

// A DLPack tensor over memory `owner` keeps alive.
nb::object Export(const TensorView& v, nb::handle owner, bool read_only) {
  if (v.data == nullptr && v.ndim == 0) return nb::none();
  size_t shape[TensorView::kMaxDims];
  for (int i = 0; i < v.ndim; ++i) shape[i] = static_cast<size_t>(v.shape[i]);
  const int device_type = v.device.is_cuda() ? nb::device::cuda::value : nb::device::cpu::value;
  const int device_id = v.device.is_cuda() ? v.device.ordinal : 0;
  if (read_only) {
    nb::ndarray<nb::array_api, nb::ro> a(v.data, v.ndim, shape, owner, v.strides,
                                         ExportDtype(v.dtype), device_type, device_id);
    return nb::cast(a);
  }
  nb::ndarray<nb::array_api> a(v.data, v.ndim, shape, owner, v.strides, ExportDtype(v.dtype),
                               device_type, device_id);
  return nb::cast(a);
}

// Token ids from a list or a contiguous int32 CPU array (no copy then).
struct Ids {
  nb::ndarray<const int32_t, nb::c_contig, nb::device::cpu, nb::ndim<1>> array;
  std::vector<int32_t> storage;
  absl::Span<const int32_t> span;
};
void IdsOf(nb::handle h, const char* name, Ids& out) {
  if (h.is_none()) return;
  if (nb::try_cast(h, out.array, false)) {
    out.span = absl::Span<const int32_t>(out.array.data(), out.array.shape(0));
    return;
  }
  if (!nb::try_cast(h, out.storage, true)) {
    ThrowInvalid(std::string(name) +
                 ": expected a sequence of int32 token ids or a contiguous "
                 "int32 CPU array, got " +
                 nb::type_name(h.type()).c_str());
  }
  out.span = absl::Span<const int32_t>(out.storage);
}

// ------------------------------------------------------------ paged caches
// A PagedCache over caller tensors; keeps them alive. Built from read-only
// tensors (KVCache.layer_cache), it is refused by the ops that write a cache.
struct PyPagedCache {
  PagedCache cache;
  bool read_only = false;
  std::vector<nb::object> arrays;  // k_data, v_data, k_scales, v_scales (None when absent)
};

bool IsWritable(nb::handle h) {
  RwArray a;
  return nb::try_cast(h, a, false);
}

PyPagedCache MakePagedCache(nb::handle k_data, nb::handle v_data, nb::handle k_scales,
                            nb::handle v_scales, Layout layout, KeyFormat key_format) {
  PyPagedCache p;
  p.cache.k_data = In(k_data, "k_data");
  p.cache.v_data = In(v_data, "v_data");
  p.cache.k_scales = InOpt(k_scales, "k_scales");
  p.cache.v_scales = In(v_scales, "v_scales");
  p.cache.layout = layout;
  p.cache.key_format = key_format;
  for (nb::handle h : {k_data, v_data, k_scales, v_scales}) {
    if (!h.is_none() && !IsWritable(h)) p.read_only = true;
    p.arrays.push_back(nb::borrow(h));
  }
  Take(p.cache.Geometry());  // validate now, by name
  return p;
}

const PagedCache& WritableCache(const PyPagedCache& c) {
  if (c.read_only) {
    ThrowInvalid(
        "cache: expected writable pools, got read-only ones (a KVCache's layer_cache() "
        "is written only through the cache's own appender)");
  }
  return c.cache;
}

struct PyHalfPagedCache {
  HalfPagedCache cache;
  std::vector<nb::object> arrays;
};

// ------------------------------------------------------------ KVCache helpers
std::vector<StepEntry> EntriesOf(nb::handle entries, std::vector<Ids>& ids) {
  nb::sequence seq = nb::cast<nb::sequence>(entries);
  const size_t n = nb::len(seq);
  ids.resize(n);
  std::vector<StepEntry> out(n);
  for (size_t i = 0; i < n; ++i) {
    nb::object e = seq[i];
    if (nb::isinstance<StepEntry>(e)) {
      out[i] = nb::cast<StepEntry>(e);
      out[i].token_ids = {};
      continue;
    }
    nb::sequence t;
    if (!nb::try_cast(e, t) || nb::len(t) < 2 || nb::len(t) > 3) {
      ThrowInvalid("entries[" + std::to_string(i) +
                   "]: expected (seq, num_new_tokens) or (seq, "
                   "num_new_tokens, token_ids), got " +
                   nb::type_name(e.type()).c_str());
    }
    out[i].seq = nb::cast<SequenceId>(t[0]);
    out[i].num_new_tokens = nb::cast<int32_t>(t[1]);
    if (nb::len(t) == 3) {
      IdsOf(t[2], "entries[].token_ids", ids[i]);
      out[i].token_ids = ids[i].span;
    }
  }
  return out;
}

nb::dict StepViewsDict(const StepViews& v, nb::handle owner) {
  nb::dict d;
  d["slot_mapping"] = Export(v.slot_mapping, owner, true);
  d["block_tables"] = Export(v.block_tables, owner, true);
  d["seq_lens"] = Export(v.seq_lens, owner, true);
  d["kv_page_indptr"] = Export(v.kv_page_indptr, owner, true);
  d["token_indptr"] = Export(v.token_indptr, owner, true);
  d["fp8_block_tables"] = Export(v.fp8_block_tables, owner, true);
  return d;
}

template <typename T>
std::vector<T> ToVector(absl::Span<const T> s) {
  return std::vector<T>(s.begin(), s.end());
}

KVCache& Self(nb::handle h) { return nb::cast<KVCache&>(h); }

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "fp4kv: an NVFP4 KV cache for LLM attention (C++/CUDA) - Python binding";

  // ---- exceptions
  {
    auto make = [&](const char* name, PyObject* base2, const char* doc) {
      PyObject* bases =
          base2 ? PyTuple_Pack(2, g_exc.base, base2) : PyTuple_Pack(1, PyExc_Exception);
      std::string full = std::string("fp4kv.") + name;
      PyObject* e = PyErr_NewExceptionWithDoc(full.c_str(), doc, bases, nullptr);
      Py_DECREF(bases);
      if (!e) throw nb::python_error();
      m.attr(name) = nb::borrow(e);
      return e;
    };
    g_exc.base = make("Error", nullptr, "Base of the errors fp4kv raises (a non-OK absl::Status).");
    g_exc.invalid_argument =
        make("InvalidArgumentError", PyExc_ValueError, "absl::StatusCode::kInvalidArgument");
    g_exc.not_found = make("NotFoundError", PyExc_LookupError, "absl::StatusCode::kNotFound");
    g_exc.failed_precondition = make("FailedPreconditionError", PyExc_RuntimeError,
                                     "absl::StatusCode::kFailedPrecondition");
    g_exc.resource_exhausted =
        make("ResourceExhaustedError", PyExc_MemoryError, "absl::StatusCode::kResourceExhausted");
    g_exc.out_of_range = make("OutOfRangeError", PyExc_IndexError, "absl::StatusCode::kOutOfRange");
    g_exc.unimplemented =
        make("UnimplementedError", PyExc_NotImplementedError, "absl::StatusCode::kUnimplemented");
    g_exc.data_loss = make("DataLossError", PyExc_RuntimeError, "absl::StatusCode::kDataLoss");
    g_exc.internal =
        make("InternalError", PyExc_RuntimeError, "absl::StatusCode::kInternal and other codes");
    nb::register_exception_translator([](const std::exception_ptr& p, void*) {
      try {
        std::rethrow_exception(p);
      } catch (const StatusError& e) {
        PyObject* type = ExceptionFor(e.status.code());
        if (type == g_exc.base) type = g_exc.internal;
        PyErr_SetString(type, e.text.c_str());
      }
    });
  }

  // ---- enums
  nb::enum_<DType>(m, "DType", "Element types of tensors.")
      .value("f16", DType::kF16)
      .value("bf16", DType::kBF16)
      .value("f32", DType::kF32)
      .value("u8", DType::kU8)
      .value("e4m3", DType::kE4M3)
      .value("i32", DType::kI32)
      .value("i64", DType::kI64);
  nb::enum_<DeviceType>(m, "DeviceType")
      .value("cpu", DeviceType::kCPU)
      .value("cuda", DeviceType::kCUDA);
  nb::enum_<Layout>(m, "Layout",
                    "Where a page keeps its rows: NHD [P, S, H, D] or HND [P, H, S, D].")
      .value("NHD", Layout::kNHD)
      .value("HND", Layout::kHND);
  nb::enum_<KeyFormat>(m, "KeyFormat", "How a cache stores its keys (values are always NVFP4).")
      .value("nvfp4", KeyFormat::kNvfp4)
      .value("fp8", KeyFormat::kFp8);
  nb::enum_<RecipeKind>(m, "RecipeKind")
      .value("standard", RecipeKind::kStandard)
      .value("four_over_six", RecipeKind::kFourOverSix);
  nb::enum_<ErrorMetric>(m, "ErrorMetric")
      .value("mae", ErrorMetric::kMae)
      .value("mse", ErrorMetric::kMse);
  nb::enum_<AppendIndexing>(m, "AppendIndexing")
      .value("paged", AppendIndexing::kPaged)
      .value("slot", AppendIndexing::kSlot);
  nb::enum_<StoredTokens>(m, "StoredTokens", "What a scale change does to stored tokens.")
      .value("refuse", StoredTokens::kRefuse)
      .value("reencode", StoredTokens::kReencode);
  nb::enum_<KVEventType>(m, "KVEventType")
      .value("block_stored", KVEventType::kBlockStored)
      .value("block_removed", KVEventType::kBlockRemoved)
      .value("all_blocks_cleared", KVEventType::kAllBlocksCleared);
  nb::enum_<KVMedium>(m, "KVMedium").value("gpu", KVMedium::kGpu).value("host", KVMedium::kHost);

  // ---- Device
  nb::class_<Device>(m, "Device",
                     "A device: Device.cpu() or Device.cuda(ordinal); also made from "
                     "'cpu', 'cuda' or 'cuda:N'.")
      .def(nb::init<>())
      .def(
          "__init__",
          [](Device* d, const std::string& s) {
            if (s == "cpu") {
              new (d) Device(Device::Cpu());
              return;
            }
            if (s == "cuda") {
              new (d) Device(Device::Cuda(0));
              return;
            }
            if (s.rfind("cuda:", 0) == 0) {
              try {
                new (d) Device(Device::Cuda(std::stoi(s.substr(5))));
                return;
              } catch (const std::exception&) {
              }
            }
            ThrowInvalid("device: expected 'cpu', 'cuda' or 'cuda:N', got '" + s + "'");
          },
          "name"_a)
      .def_static("cpu", &Device::Cpu)
      .def_static("cuda", &Device::Cuda, "ordinal"_a = 0)
      .def_rw("type", &Device::type)
      .def_rw("ordinal", &Device::ordinal)
      .def_prop_ro("is_cuda", &Device::is_cuda)
      .def("__eq__", [](const Device& a, const Device& b) { return a == b; })
      .def("__repr__", [](const Device& d) { return "Device('" + d.ToString() + "')"; });
  nb::implicitly_convertible<std::string, Device>();

  // ---- Recipe
  nb::class_<Recipe>(m, "Recipe",
                     "Quantization recipe: Recipe.standard() or Recipe.four_over_six(...).")
      .def(nb::init<>())
      .def_static("standard", &Recipe::Standard)
      .def_static("four_over_six", &Recipe::FourOverSix, "e4m3_max"_a = 256,
                  "metric"_a = ErrorMetric::kMae, "fast_math"_a = false)
      .def_rw("kind", &Recipe::kind)
      .def_rw("e4m3_max", &Recipe::e4m3_max)
      .def_rw("metric", &Recipe::metric)
      .def_rw("fast_math", &Recipe::fast_math)
      .def_prop_ro("name", [](const Recipe& r) { return RecipeName(r); })
      .def_prop_ro("code", [](const Recipe& r) { return Take(RecipeToCode(r)); })
      .def_static(
          "from_code", [](int64_t c) { return Take(RecipeFromCode(c)); }, "code"_a)
      .def("__eq__", [](const Recipe& a, const Recipe& b) { return a == b; })
      .def("__repr__", [](const Recipe& r) { return "Recipe('" + RecipeName(r) + "')"; });
  m.def(
      "all_recipes",
      [] {
        auto a = AllRecipes();
        return std::vector<Recipe>(a.begin(), a.end());
      },
      "Every valid recipe, standard first.");
  m.def(
      "validate_recipe", [](const Recipe& r) { Check(ValidateRecipe(r)); }, "recipe"_a);

  // ---- format helpers
  m.def(
      "make_global_scale", [](float amax, const Recipe& r) { return MakeGlobalScale(amax, r); },
      "amax"_a, "recipe"_a = Recipe(), "The global decode scale amax / (6 * e4m3_max).");
  m.def("max_global_scale", [] { return MaxGlobalScale(); });
  m.def(
      "is_valid_global_scale", [](float g) { return IsValidGlobalScale(g); }, "g"_a);
  m.def(
      "min_fp8_scale", [](float g) { return Take(MinFp8Scale(g)); }, "global_scale"_a,
      "The smallest FP8 decode scale under which a cache with global scale g never saturates.");
  m.def(
      "make_fp8_key_scale", [](float amax) { return MakeFp8KeyScale(amax); }, "amax"_a);
  m.attr("BLOCK_SIZE") = kBlockSize;
  m.attr("MAX_ATTENTION_Q_LEN") = kMaxAttentionQLen;
  m.attr("MAX_RETENTION_PRIORITY") = kMaxRetentionPriority;
  m.attr("SEQUENCE_IMAGE_HEADER_BYTES") = kSequenceImageHeaderBytes;

  // ---- CacheGeometry
  nb::class_<CacheGeometry>(m, "CacheGeometry",
                            "Geometry of one paged cache (one layer's K and V).")
      .def(
          "__init__",
          [](CacheGeometry* g, int num_kv_heads, int head_dim_k, int head_dim_v, int page_size,
             int64_t num_pages, Layout layout, KeyFormat key_format) {
            new (g) CacheGeometry();
            g->num_kv_heads = num_kv_heads;
            g->head_dim_k = head_dim_k;
            g->head_dim_v = head_dim_v == 0 ? head_dim_k : head_dim_v;
            g->page_size = page_size;
            g->num_pages = num_pages;
            g->layout = layout;
            g->key_format = key_format;
          },
          "num_kv_heads"_a = 0, "head_dim_k"_a = 0, "head_dim_v"_a = 0, "page_size"_a = 0,
          "num_pages"_a = 0, "layout"_a = Layout::kNHD, "key_format"_a = KeyFormat::kNvfp4,
          "head_dim_v = 0 means head_dim_k.")
      .def_rw("num_kv_heads", &CacheGeometry::num_kv_heads)
      .def_rw("head_dim_k", &CacheGeometry::head_dim_k)
      .def_rw("head_dim_v", &CacheGeometry::head_dim_v)
      .def_rw("page_size", &CacheGeometry::page_size)
      .def_rw("num_pages", &CacheGeometry::num_pages)
      .def_rw("layout", &CacheGeometry::layout)
      .def_rw("key_format", &CacheGeometry::key_format)
      .def("validate", [](const CacheGeometry& g) { Check(g.Validate()); })
      .def("data_row_bytes", &CacheGeometry::DataRowBytes, "is_v"_a)
      .def("scale_row_bytes", &CacheGeometry::ScaleRowBytes, "is_v"_a)
      .def("page_bytes", &CacheGeometry::PageBytes)
      .def("bytes_per_token", &CacheGeometry::BytesPerToken)
      .def("__repr__", [](const CacheGeometry& g) {
        return "CacheGeometry(num_kv_heads=" + std::to_string(g.num_kv_heads) +
               ", head_dim_k=" + std::to_string(g.head_dim_k) +
               ", head_dim_v=" + std::to_string(g.head_dim_v) +
               ", page_size=" + std::to_string(g.page_size) +
               ", num_pages=" + std::to_string(g.num_pages) + ", layout=" + LayoutName(g.layout) +
               ", key_format=" + KeyFormatName(g.key_format) + ")";
      });

  // ---- PagedCache / HalfPagedCache
  nb::class_<PyPagedCache>(m, "PagedCache",
                           "Paged NVFP4 storage over caller tensors (kept alive): data [P, S, H, "
                           "D/2] u8 and scales [P, S, H, D/16] e4m3/u8 for NHD. Read-only when "
                           "any tensor is (KVCache.layer_cache): ops that write a cache refuse it.")
      .def(
          "__init__",
          [](PyPagedCache* p, nb::handle k_data, nb::handle v_data, nb::handle k_scales,
             nb::handle v_scales, Layout layout) {
            new (p) PyPagedCache(
                MakePagedCache(k_data, v_data, k_scales, v_scales, layout, KeyFormat::kNvfp4));
          },
          "k_data"_a, "v_data"_a, "k_scales"_a, "v_scales"_a, "layout"_a = Layout::kNHD)
      .def_static(
          "fp8_keys",
          [](nb::handle k_data, nb::handle v_data, nb::handle v_scales, Layout layout) {
            return MakePagedCache(k_data, v_data, nb::none(), v_scales, layout, KeyFormat::kFp8);
          },
          "k_data"_a, "v_data"_a, "v_scales"_a, "layout"_a = Layout::kNHD,
          "FP8 E4M3 keys [P, S, H, Dk], NVFP4 values.")
      .def_static(
          "stacked",
          [](nb::handle data, nb::handle scales, Layout layout) {
            PyPagedCache p;
            p.cache = Take(PagedCache::FromStacked(In(data, "data"), In(scales, "scales"), layout));
            p.read_only = !IsWritable(data) || !IsWritable(scales);
            p.arrays = {nb::borrow(data), nb::none(), nb::borrow(scales), nb::none()};
            return p;
          },
          "data"_a, "scales"_a, "layout"_a = Layout::kNHD,
          "Stacked 5-D form: data [P, 2, S, H, D/2], scales [P, 2, S, H, D/16] (NHD).")
      .def_prop_ro("geometry", [](const PyPagedCache& p) { return Take(p.cache.Geometry()); })
      .def_prop_ro("read_only", [](const PyPagedCache& p) { return p.read_only; })
      .def_prop_ro("layout", [](const PyPagedCache& p) { return p.cache.layout; })
      .def_prop_ro("key_format", [](const PyPagedCache& p) { return p.cache.key_format; })
      .def_prop_ro("k_data", [](const PyPagedCache& p) { return p.arrays[0]; })
      .def_prop_ro("v_data", [](const PyPagedCache& p) { return p.arrays[1]; })
      .def_prop_ro("k_scales", [](const PyPagedCache& p) { return p.arrays[2]; })
      .def_prop_ro("v_scales", [](const PyPagedCache& p) { return p.arrays[3]; });

  nb::class_<PyHalfPagedCache>(m, "HalfPagedCache",
                               "An unquantized f16/bf16 paged cache: k [P, S, H, Dk], v [P, S, H, "
                               "Dv] (NHD) or [P, H, S, D] (HND).")
      .def(
          "__init__",
          [](PyHalfPagedCache* p, nb::handle k, nb::handle v, Layout layout) {
            new (p) PyHalfPagedCache();
            p->cache = HalfPagedCache::FromTuple(In(k, "k"), In(v, "v"), layout);
            p->arrays = {nb::borrow(k), nb::borrow(v)};
          },
          "k"_a, "v"_a, "layout"_a = Layout::kNHD)
      .def_static(
          "stacked",
          [](nb::handle kv, Layout layout) {
            PyHalfPagedCache p;
            p.cache = Take(HalfPagedCache::FromStacked(In(kv, "kv"), layout));
            p.arrays = {nb::borrow(kv)};
            return p;
          },
          "kv"_a, "layout"_a = Layout::kNHD, "[P, 2, S, H, D] (NHD) or [P, 2, H, S, D] (HND).")
      .def_prop_ro("layout", [](const PyHalfPagedCache& p) { return p.cache.layout; });

  // ---- functional op objects
  nb::class_<Appender>(m, "Appender", "Quantize f16/bf16 rows and scatter them into a paged cache.")
      .def(
          "__init__",
          [](Appender* a, const CacheGeometry& geometry, DType input_dtype, AppendIndexing indexing,
             const Recipe& recipe, const Device& device, bool count_scale_events) {
            Appender::Options o;
            o.geometry = geometry;
            o.input_dtype = input_dtype;
            o.indexing = indexing;
            o.recipe = recipe;
            o.device = device;
            o.count_scale_events = count_scale_events;
            new (a) Appender(Take(Appender::Create(o)));
          },
          "geometry"_a, "input_dtype"_a = DType::kBF16, "indexing"_a = AppendIndexing::kPaged,
          "recipe"_a = Recipe(), "device"_a = Device::Cpu(), "count_scale_events"_a = false)
      .def(
          "run",
          [](const Appender& op, const PyPagedCache& cache, nb::handle key, nb::handle value,
             nb::handle slot_mapping, nb::handle batch_indices, nb::handle positions,
             nb::handle kv_indices, nb::handle kv_indptr, nb::handle kv_last_page_len,
             nb::handle k_scale, nb::handle v_scale, nb::handle scale_events, uintptr_t stream) {
            AppendArgs a;
            a.key = In(key, "key");
            a.value = In(value, "value");
            a.slot_mapping = InOpt(slot_mapping, "slot_mapping");
            a.batch_indices = InOpt(batch_indices, "batch_indices");
            a.positions = InOpt(positions, "positions");
            a.kv_indices = InOpt(kv_indices, "kv_indices");
            a.kv_indptr = InOpt(kv_indptr, "kv_indptr");
            a.kv_last_page_len = InOpt(kv_last_page_len, "kv_last_page_len");
            a.k_scale = ScaleOf(k_scale, "k_scale");
            a.v_scale = ScaleOf(v_scale, "v_scale");
            if (!scale_events.is_none()) {
              TensorView e = Out(scale_events, "scale_events");
              if ((e.dtype != DType::kI64) || e.numel() < 4) {
                ThrowInvalid("scale_events: expected an int64/uint64 tensor of 4 elements, got " +
                             std::string(DTypeName(e.dtype)) + " " + e.ShapeString());
              }
              a.scale_events = static_cast<uint64_t*>(e.data);
            }
            const PagedCache& c = WritableCache(cache);
            Check(NoGil([&] { return op.Run(a, c, StreamOf(stream)); }));
          },
          "cache"_a, "key"_a, "value"_a, nb::kw_only(), "slot_mapping"_a = nb::none(),
          "batch_indices"_a = nb::none(), "positions"_a = nb::none(), "kv_indices"_a = nb::none(),
          "kv_indptr"_a = nb::none(), "kv_last_page_len"_a = nb::none(), "k_scale"_a = 1.0f,
          "v_scale"_a = 1.0f, "scale_events"_a = nb::none(), "stream"_a = 0);

  nb::class_<Dequantizer>(m, "Dequantizer",
                          "Gather a paged cache into contiguous [B, T, H, D] f16/bf16.")
      .def(
          "__init__",
          [](Dequantizer* d, const CacheGeometry& geometry, DType output_dtype, DType table_dtype,
             const Device& device) {
            Dequantizer::Options o;
            o.geometry = geometry;
            o.output_dtype = output_dtype;
            o.table_dtype = table_dtype;
            o.device = device;
            new (d) Dequantizer(Take(Dequantizer::Create(o)));
          },
          "geometry"_a, "output_dtype"_a = DType::kBF16, "table_dtype"_a = DType::kI32,
          "device"_a = Device::Cpu())
      .def(
          "run",
          [](const Dequantizer& op, const PyPagedCache& cache, nb::handle block_tables,
             nb::handle seq_lens, nb::handle k_out, nb::handle v_out, nb::handle k_scale,
             nb::handle v_scale, uintptr_t stream) {
            DequantArgs a;
            a.block_tables = In(block_tables, "block_tables");
            a.seq_lens = In(seq_lens, "seq_lens");
            a.k_out = Out(k_out, "k_out");
            a.v_out = Out(v_out, "v_out");
            a.k_scale = ScaleOf(k_scale, "k_scale");
            a.v_scale = ScaleOf(v_scale, "v_scale");
            Check(NoGil([&] { return op.Run(a, cache.cache, StreamOf(stream)); }));
          },
          "cache"_a, "block_tables"_a, "seq_lens"_a, "k_out"_a, "v_out"_a, nb::kw_only(),
          "k_scale"_a = 1.0f, "v_scale"_a = 1.0f, "stream"_a = 0);

  nb::class_<Materializer>(m, "Materializer", "Write the active pages as FP8 E4M3 pages.")
      .def(
          "__init__",
          [](Materializer* p, const CacheGeometry& geometry, DType table_dtype,
             bool separate_kv_tables, const Device& device) {
            Materializer::Options o;
            o.geometry = geometry;
            o.table_dtype = table_dtype;
            o.separate_kv_tables = separate_kv_tables;
            o.device = device;
            new (p) Materializer(Take(Materializer::Create(o)));
          },
          "geometry"_a, "table_dtype"_a = DType::kI32, "separate_kv_tables"_a = false,
          "device"_a = Device::Cpu())
      .def(
          "run",
          [](const Materializer& op, const PyPagedCache& cache, nb::handle block_tables,
             nb::handle seq_lens, nb::handle kv_page_indptr, nb::handle out,
             nb::handle fp8_block_tables, nb::handle k_scale, nb::handle v_scale,
             nb::handle k_fp8_scale, nb::handle v_fp8_scale, uintptr_t stream) {
            MaterializeArgs a;
            a.block_tables = In(block_tables, "block_tables");
            a.seq_lens = In(seq_lens, "seq_lens");
            a.kv_page_indptr = In(kv_page_indptr, "kv_page_indptr");
            a.out = Out(out, "out");
            a.fp8_block_tables = Out(fp8_block_tables, "fp8_block_tables");
            a.k_scale = ScaleOf(k_scale, "k_scale");
            a.v_scale = ScaleOf(v_scale, "v_scale");
            a.k_fp8_scale = ScaleOf(k_fp8_scale, "k_fp8_scale");
            a.v_fp8_scale = ScaleOf(v_fp8_scale, "v_fp8_scale");
            Check(NoGil([&] { return op.Run(a, cache.cache, StreamOf(stream)); }));
          },
          "cache"_a, "block_tables"_a, "seq_lens"_a, "kv_page_indptr"_a, "out"_a,
          "fp8_block_tables"_a, nb::kw_only(), "k_scale"_a, "v_scale"_a, "k_fp8_scale"_a,
          "v_fp8_scale"_a, "stream"_a = 0);

  nb::class_<LinearQuantizer>(m, "LinearQuantizer",
                              "[M, K] f16/bf16 <-> packed [M, K/2] u8 + scales [M, K/16] e4m3.")
      .def(
          "__init__",
          [](LinearQuantizer* p, DType dtype, const Recipe& recipe, const Device& device) {
            LinearQuantizer::Options o;
            o.dtype = dtype;
            o.recipe = recipe;
            o.device = device;
            new (p) LinearQuantizer(Take(LinearQuantizer::Create(o)));
          },
          "dtype"_a = DType::kBF16, "recipe"_a = Recipe(), "device"_a = Device::Cpu())
      .def(
          "quantize",
          [](const LinearQuantizer& op, nb::handle input, nb::handle packed, nb::handle scales,
             nb::handle global_scale, uintptr_t stream) {
            const TensorView i = In(input, "input"), p = Out(packed, "packed"),
                             s = Out(scales, "scales");
            const GlobalScale g = ScaleOf(global_scale, "global_scale");
            Check(NoGil([&] { return op.Quantize(i, p, s, g, StreamOf(stream)); }));
          },
          "input"_a, "packed"_a, "scales"_a, "global_scale"_a, "stream"_a = 0)
      .def(
          "dequantize",
          [](const LinearQuantizer& op, nb::handle packed, nb::handle scales, nb::handle output,
             nb::handle global_scale, uintptr_t stream) {
            const TensorView p = In(packed, "packed"), s = In(scales, "scales"),
                             o = Out(output, "output");
            const GlobalScale g = ScaleOf(global_scale, "global_scale");
            Check(NoGil([&] { return op.Dequantize(p, s, o, g, StreamOf(stream)); }));
          },
          "packed"_a, "scales"_a, "output"_a, "global_scale"_a, "stream"_a = 0);

  nb::class_<PagedCacheQuantizer>(
      m, "PagedCacheQuantizer",
      "Quantize a whole f16/bf16 paged cache (or listed pages) into NVFP4 pages.")
      .def(
          "__init__",
          [](PagedCacheQuantizer* p, const CacheGeometry& geometry, Layout source_layout,
             DType input_dtype, const Recipe& recipe, const Device& device, bool compute_scales,
             float headroom) {
            PagedCacheQuantizer::Options o;
            o.geometry = geometry;
            o.source_layout = source_layout;
            o.input_dtype = input_dtype;
            o.recipe = recipe;
            o.device = device;
            o.compute_scales = compute_scales;
            o.headroom = headroom;
            new (p) PagedCacheQuantizer(Take(PagedCacheQuantizer::Create(o)));
          },
          "geometry"_a, "source_layout"_a = Layout::kNHD, "input_dtype"_a = DType::kBF16,
          "recipe"_a = Recipe(), "device"_a = Device::Cpu(), "compute_scales"_a = false,
          "headroom"_a = 1.0f)
      .def(
          "run",
          [](const PagedCacheQuantizer& op, const PyHalfPagedCache& source,
             const PyPagedCache& cache, nb::handle src_pages, nb::handle dst_pages,
             int64_t num_tokens, nb::handle k_scale, nb::handle v_scale, nb::handle k_scale_out,
             nb::handle v_scale_out, uintptr_t stream) {
            QuantizeCacheArgs a;
            a.source = source.cache;
            a.src_pages = InOpt(src_pages, "src_pages");
            a.dst_pages = InOpt(dst_pages, "dst_pages");
            a.num_tokens = num_tokens;
            a.k_scale = ScaleOf(k_scale, "k_scale");
            a.v_scale = ScaleOf(v_scale, "v_scale");
            a.k_scale_out = FloatOut(k_scale_out, "k_scale_out");
            a.v_scale_out = FloatOut(v_scale_out, "v_scale_out");
            const PagedCache& c = WritableCache(cache);
            Check(NoGil([&] { return op.Run(a, c, StreamOf(stream)); }));
          },
          "source"_a, "cache"_a, nb::kw_only(), "src_pages"_a = nb::none(),
          "dst_pages"_a = nb::none(), "num_tokens"_a = -1, "k_scale"_a = 1.0f, "v_scale"_a = 1.0f,
          "k_scale_out"_a = nb::none(), "v_scale_out"_a = nb::none(), "stream"_a = 0);

  nb::class_<DecodeAttention>(
      m, "DecodeAttention", "Attention straight from NVFP4 pages (decode rows and prefill chunks).")
      .def(
          "__init__",
          [](DecodeAttention* p, const CacheGeometry& geometry, int num_qo_heads, DType dtype,
             DType table_dtype, int max_batch, int max_pages_per_seq, int max_q_len, float sm_scale,
             float logits_soft_cap, int window_left, bool has_sinks, bool write_lse,
             const Device& device) {
            DecodeAttention::Options o;
            o.geometry = geometry;
            o.num_qo_heads = num_qo_heads;
            o.dtype = dtype;
            o.table_dtype = table_dtype;
            o.max_batch = max_batch;
            o.max_pages_per_seq = max_pages_per_seq;
            o.max_q_len = max_q_len;
            o.sm_scale = sm_scale;
            o.logits_soft_cap = logits_soft_cap;
            o.window_left = window_left;
            o.has_sinks = has_sinks;
            o.write_lse = write_lse;
            o.device = device;
            new (p) DecodeAttention(Take(DecodeAttention::Create(o)));
          },
          "geometry"_a, "num_qo_heads"_a, "dtype"_a = DType::kBF16, "table_dtype"_a = DType::kI32,
          "max_batch"_a, "max_pages_per_seq"_a, "max_q_len"_a = 1, "sm_scale"_a = 0.0f,
          "logits_soft_cap"_a = 0.0f, "window_left"_a = -1, "has_sinks"_a = false,
          "write_lse"_a = false, "device"_a = Device::Cpu())
      .def_prop_ro("workspace_bytes", &DecodeAttention::WorkspaceBytes)
      .def(
          "run",
          [](const DecodeAttention& op, const PyPagedCache& cache, nb::handle q,
             nb::handle block_tables, nb::handle seq_lens, nb::handle out, nb::handle q_indptr,
             nb::handle lse, nb::handle sinks, nb::handle k_scale, nb::handle v_scale,
             nb::handle workspace, uintptr_t stream) {
            DecodeAttentionArgs a;
            a.q = In(q, "q");
            a.q_indptr = InOpt(q_indptr, "q_indptr");
            a.block_tables = In(block_tables, "block_tables");
            a.seq_lens = In(seq_lens, "seq_lens");
            a.out = Out(out, "out");
            a.lse = OutOpt(lse, "lse");
            a.sinks = InOpt(sinks, "sinks");
            a.k_scale = ScaleOf(k_scale, "k_scale");
            a.v_scale = ScaleOf(v_scale, "v_scale");
            const Bytes w = OutBytes(workspace, "workspace");
            Check(NoGil([&] { return op.Run(a, cache.cache, w.data, w.size, StreamOf(stream)); }));
          },
          "cache"_a, "q"_a, "block_tables"_a, "seq_lens"_a, "out"_a, nb::kw_only(),
          "q_indptr"_a = nb::none(), "lse"_a = nb::none(), "sinks"_a = nb::none(),
          "k_scale"_a = 1.0f, "v_scale"_a = 1.0f, "workspace"_a = nb::none(), "stream"_a = 0);

  nb::class_<Calibrator>(m, "Calibrator", "Device amax reduction and global scale, no host sync.")
      .def(
          "__init__",
          [](Calibrator* p, int64_t max_elements, DType dtype, const Device& device,
             const Recipe& recipe) {
            Calibrator::Options o;
            o.max_elements = max_elements;
            o.dtype = dtype;
            o.device = device;
            o.recipe = recipe;
            new (p) Calibrator(Take(Calibrator::Create(o)));
          },
          "max_elements"_a, "dtype"_a = DType::kBF16, "device"_a = Device::Cpu(),
          "recipe"_a = Recipe())
      .def(
          "run",
          [](Calibrator& c, nb::handle input, nb::handle global_scale, nb::handle amax,
             nb::handle fp8_scale, bool fp8_key, uintptr_t stream) {
            const TensorView i = In(input, "input");
            float* g = FloatOut(global_scale, "global_scale");
            float* a = FloatOut(amax, "amax");
            float* f = FloatOut(fp8_scale, "fp8_scale");
            Check(NoGil([&] {
              return fp8_key ? c.RunFp8Key(i, a, g, StreamOf(stream), f)
                             : c.Run(i, a, g, StreamOf(stream), f);
            }));
          },
          "input"_a, "global_scale"_a, nb::kw_only(), "amax"_a = nb::none(),
          "fp8_scale"_a = nb::none(), "fp8_key"_a = false, "stream"_a = 0,
          "Writes the global scale (and amax, the FP8 scale) of `input` into fp32 tensors.");

  // ---- functional API
  m.def(
      "quantize_append_paged",
      [](nb::handle key, nb::handle value, nb::handle batch_indices, nb::handle positions,
         const PyPagedCache& cache, nb::handle kv_indices, nb::handle kv_indptr,
         nb::handle kv_last_page_len, nb::handle k_scale, nb::handle v_scale, const Recipe& recipe,
         uintptr_t stream) {
        const TensorView k = In(key, "key"), v = In(value, "value"),
                         b = In(batch_indices, "batch_indices"), p = In(positions, "positions"),
                         ki = In(kv_indices, "kv_indices"), kp = In(kv_indptr, "kv_indptr"),
                         kl = In(kv_last_page_len, "kv_last_page_len");
        const GlobalScale ks = ScaleOf(k_scale, "k_scale"), vs = ScaleOf(v_scale, "v_scale");
        const PagedCache& c = WritableCache(cache);
        Check(NoGil([&] {
          return QuantizeAppendPaged(k, v, b, p, c, ki, kp, kl, ks, vs, recipe, StreamOf(stream));
        }));
      },
      "key"_a, "value"_a, "batch_indices"_a, "positions"_a, "cache"_a, "kv_indices"_a,
      "kv_indptr"_a, "kv_last_page_len"_a, "k_scale"_a, "v_scale"_a, "recipe"_a = Recipe(),
      "stream"_a = 0);
  m.def(
      "quantize_append_by_slot",
      [](nb::handle key, nb::handle value, nb::handle slot_mapping, const PyPagedCache& cache,
         nb::handle k_scale, nb::handle v_scale, const Recipe& recipe, uintptr_t stream) {
        const TensorView k = In(key, "key"), v = In(value, "value"),
                         s = In(slot_mapping, "slot_mapping");
        const GlobalScale ks = ScaleOf(k_scale, "k_scale"), vs = ScaleOf(v_scale, "v_scale");
        const PagedCache& c = WritableCache(cache);
        Check(NoGil(
            [&] { return QuantizeAppendBySlot(k, v, s, c, ks, vs, recipe, StreamOf(stream)); }));
      },
      "key"_a, "value"_a, "slot_mapping"_a, "cache"_a, "k_scale"_a, "v_scale"_a,
      "recipe"_a = Recipe(), "stream"_a = 0);
  m.def(
      "dequantize_paged",
      [](const PyPagedCache& cache, nb::handle block_tables, nb::handle seq_lens, nb::handle k_out,
         nb::handle v_out, nb::handle k_scale, nb::handle v_scale, uintptr_t stream) {
        const TensorView b = In(block_tables, "block_tables"), s = In(seq_lens, "seq_lens"),
                         ko = Out(k_out, "k_out"), vo = Out(v_out, "v_out");
        const GlobalScale ks = ScaleOf(k_scale, "k_scale"), vs = ScaleOf(v_scale, "v_scale");
        Check(NoGil(
            [&] { return DequantizePaged(cache.cache, b, s, ko, vo, ks, vs, StreamOf(stream)); }));
      },
      "cache"_a, "block_tables"_a, "seq_lens"_a, "k_out"_a, "v_out"_a, "k_scale"_a, "v_scale"_a,
      "stream"_a = 0);
  m.def(
      "materialize_fp8",
      [](const PyPagedCache& cache, nb::handle block_tables, nb::handle seq_lens,
         nb::handle kv_page_indptr, nb::handle out, nb::handle fp8_block_tables, nb::handle k_scale,
         nb::handle v_scale, nb::handle k_fp8_scale, nb::handle v_fp8_scale, uintptr_t stream) {
        const TensorView b = In(block_tables, "block_tables"), s = In(seq_lens, "seq_lens"),
                         ip = In(kv_page_indptr, "kv_page_indptr"), o = Out(out, "out"),
                         f = Out(fp8_block_tables, "fp8_block_tables");
        const GlobalScale ks = ScaleOf(k_scale, "k_scale"), vs = ScaleOf(v_scale, "v_scale"),
                          kf = ScaleOf(k_fp8_scale, "k_fp8_scale"),
                          vf = ScaleOf(v_fp8_scale, "v_fp8_scale");
        Check(NoGil([&] {
          return MaterializeFp8(cache.cache, b, s, ip, o, f, ks, vs, kf, vf, StreamOf(stream));
        }));
      },
      "cache"_a, "block_tables"_a, "seq_lens"_a, "kv_page_indptr"_a, "out"_a, "fp8_block_tables"_a,
      "k_scale"_a, "v_scale"_a, "k_fp8_scale"_a, "v_fp8_scale"_a, "stream"_a = 0);
  m.def(
      "quantize_paged_cache",
      [](const PyHalfPagedCache& source, const PyPagedCache& cache, nb::handle k_scale,
         nb::handle v_scale, nb::handle k_scale_out, nb::handle v_scale_out, const Recipe& recipe,
         uintptr_t stream) {
        const GlobalScale ks = ScaleOf(k_scale, "k_scale"), vs = ScaleOf(v_scale, "v_scale");
        float* ko = FloatOut(k_scale_out, "k_scale_out");
        float* vo = FloatOut(v_scale_out, "v_scale_out");
        const PagedCache& c = WritableCache(cache);
        Check(NoGil([&] {
          return QuantizePagedCache(source.cache, c, ks, vs, ko, vo, recipe, StreamOf(stream));
        }));
      },
      "source"_a, "cache"_a, "k_scale"_a = 1.0f, "v_scale"_a = 1.0f, "k_scale_out"_a = nb::none(),
      "v_scale_out"_a = nb::none(), "recipe"_a = Recipe(), "stream"_a = 0);
  m.def(
      "quantize_linear",
      [](nb::handle input, nb::handle packed, nb::handle scales, nb::handle global_scale,
         const Recipe& recipe, uintptr_t stream) {
        const TensorView i = In(input, "input"), p = Out(packed, "packed"),
                         s = Out(scales, "scales");
        const GlobalScale g = ScaleOf(global_scale, "global_scale");
        Check(NoGil([&] { return QuantizeLinear(i, p, s, g, recipe, StreamOf(stream)); }));
      },
      "input"_a, "packed"_a, "scales"_a, "global_scale"_a, "recipe"_a = Recipe(), "stream"_a = 0);
  m.def(
      "dequantize_linear",
      [](nb::handle packed, nb::handle scales, nb::handle output, nb::handle global_scale,
         uintptr_t stream) {
        const TensorView p = In(packed, "packed"), s = In(scales, "scales"),
                         o = Out(output, "output");
        const GlobalScale g = ScaleOf(global_scale, "global_scale");
        Check(NoGil([&] { return DequantizeLinear(p, s, o, g, StreamOf(stream)); }));
      },
      "packed"_a, "scales"_a, "output"_a, "global_scale"_a, "stream"_a = 0);

  // ---- KVCache option and result structs
  nb::class_<PrefixCacheOptions>(m, "PrefixCacheOptions")
      .def(nb::init<>())
      .def_rw("enabled", &PrefixCacheOptions::enabled)
      .def_rw("max_pending_events", &PrefixCacheOptions::max_pending_events)
      .def_rw("host_bytes", &PrefixCacheOptions::host_bytes);
  nb::class_<HostTierOptions>(m, "HostTierOptions")
      .def(nb::init<>())
      .def_rw("host_pages", &HostTierOptions::host_pages)
      .def_rw("host_bytes", &HostTierOptions::host_bytes);
  nb::class_<KVCacheOptions>(m, "KVCacheOptions", "Options of KVCache (kv_cache.h documents each).")
      .def(nb::init<>())
      .def_rw("num_layers", &KVCacheOptions::num_layers)
      .def_rw("geometry", &KVCacheOptions::geometry)
      .def_rw("memory_budget_bytes", &KVCacheOptions::memory_budget_bytes)
      .def_rw("device", &KVCacheOptions::device)
      .def_rw("recipe", &KVCacheOptions::recipe)
      .def_rw("k_global_scales", &KVCacheOptions::k_global_scales)
      .def_rw("v_global_scales", &KVCacheOptions::v_global_scales)
      .def_rw("calibration_headroom", &KVCacheOptions::calibration_headroom)
      .def_rw("count_scale_events", &KVCacheOptions::count_scale_events)
      .def_rw("max_seqs_per_step", &KVCacheOptions::max_seqs_per_step)
      .def_rw("max_tokens_per_step", &KVCacheOptions::max_tokens_per_step)
      .def_rw("max_pages_per_seq", &KVCacheOptions::max_pages_per_seq)
      .def_rw("step_slots", &KVCacheOptions::step_slots)
      .def_rw("prefix_cache", &KVCacheOptions::prefix_cache)
      .def_rw("host_tier", &KVCacheOptions::host_tier);

  nb::class_<StepEntry>(m, "StepEntry", "One sequence of a step (prepare_step also takes tuples).")
      .def(nb::init<>())
      .def_rw("seq", &StepEntry::seq)
      .def_rw("num_new_tokens", &StepEntry::num_new_tokens);
  nb::class_<StepInfo>(m, "StepInfo")
      .def_ro("slot", &StepInfo::slot)
      .def_ro("num_seqs", &StepInfo::num_seqs)
      .def_ro("num_tokens", &StepInfo::num_tokens)
      .def_ro("max_seq_len", &StepInfo::max_seq_len)
      .def_ro("num_pages", &StepInfo::num_pages)
      .def_ro("fp8_workspace_pages", &StepInfo::fp8_workspace_pages)
      .def_ro("pages_allocated", &StepInfo::pages_allocated)
      .def_ro("pages_copied", &StepInfo::pages_copied)
      .def_ro("pages_evicted", &StepInfo::pages_evicted);
  nb::class_<StepPlan>(m, "StepPlan")
      .def_ro("fits", &StepPlan::fits)
      .def_ro("pages_needed", &StepPlan::pages_needed)
      .def_ro("pages_copied", &StepPlan::pages_copied)
      .def_ro("pages_free", &StepPlan::pages_free)
      .def_ro("pages_evictable", &StepPlan::pages_evictable)
      .def_ro("pages_evicted", &StepPlan::pages_evicted)
      .def_ro("pages_swap_pending", &StepPlan::pages_swap_pending)
      .def_ro("pages_retiring", &StepPlan::pages_retiring)
      .def_ro("pages_left", &StepPlan::pages_left)
      .def_ro("tokens_left", &StepPlan::tokens_left);
  nb::class_<PrefixMatch>(m, "PrefixMatch")
      .def_ro("tokens", &PrefixMatch::tokens)
      .def_ro("pages", &PrefixMatch::pages)
      .def_ro("pages_evictable", &PrefixMatch::pages_evictable)
      .def_ro("tokens_gpu", &PrefixMatch::tokens_gpu)
      .def_ro("tokens_host", &PrefixMatch::tokens_host)
      .def_ro("pages_host", &PrefixMatch::pages_host);
  nb::class_<PrefixSequence>(m, "PrefixSequence")
      .def_ro("seq", &PrefixSequence::seq)
      .def_ro("cached_tokens", &PrefixSequence::cached_tokens)
      .def_ro("host_tokens", &PrefixSequence::host_tokens);
  nb::class_<LayerScales>(m, "LayerScales")
      .def_ro("k", &LayerScales::k)
      .def_ro("v", &LayerScales::v)
      .def_ro("k_fp8", &LayerScales::k_fp8)
      .def_ro("v_fp8", &LayerScales::v_fp8)
      .def_ro("k_calibrated", &LayerScales::k_calibrated)
      .def_ro("v_calibrated", &LayerScales::v_calibrated);
  nb::class_<ScaleEventCounts>(m, "ScaleEventCounts")
      .def_ro("k_saturated", &ScaleEventCounts::k_saturated)
      .def_ro("k_underflow", &ScaleEventCounts::k_underflow)
      .def_ro("v_saturated", &ScaleEventCounts::v_saturated)
      .def_ro("v_underflow", &ScaleEventCounts::v_underflow);
  nb::class_<BlockHash>(m, "BlockHash")
      .def_ro("high", &BlockHash::high)
      .def_ro("low", &BlockHash::low)
      .def("hex", &BlockHash::ToHex)
      .def("__eq__", [](const BlockHash& a, const BlockHash& b) { return a == b; })
      .def("__hash__",
           [](const BlockHash& h) { return static_cast<Py_hash_t>(h.low ^ (h.high * 31)); })
      .def("__repr__", [](const BlockHash& h) { return "BlockHash('" + h.ToHex() + "')"; });
  nb::class_<KVEvent>(m, "KVEvent")
      .def_ro("type", &KVEvent::type)
      .def_ro("block_hashes", &KVEvent::block_hashes)
      .def_ro("has_parent", &KVEvent::has_parent)
      .def_ro("parent_block_hash", &KVEvent::parent_block_hash)
      .def_ro("token_ids", &KVEvent::token_ids)
      .def_ro("block_size", &KVEvent::block_size)
      .def_ro("extra_key", &KVEvent::extra_key)
      .def_ro("medium", &KVEvent::medium);
  nb::class_<KVEventBatch>(m, "KVEventBatch")
      .def_ro("events", &KVEventBatch::events)
      .def_ro("dropped", &KVEventBatch::dropped);

  nb::class_<KVCacheStats> stats(m, "KVCacheStats");
#define FP4KV_STAT(field) stats.def_ro(#field, &KVCacheStats::field)
  FP4KV_STAT(pages_total);
  FP4KV_STAT(pages_free);
  FP4KV_STAT(pages_used);
  FP4KV_STAT(pages_shared);
  FP4KV_STAT(num_sequences);
  FP4KV_STAT(tokens_stored);
  FP4KV_STAT(tokens_resident);
  FP4KV_STAT(wasted_slots);
  FP4KV_STAT(bytes_per_token);
  FP4KV_STAT(pool_bytes);
  FP4KV_STAT(memory_available_at_create);
  FP4KV_STAT(memory_budget_clamped);
  FP4KV_STAT(sequence_lengths);
  FP4KV_STAT(pages_cached);
  FP4KV_STAT(pages_indexed);
  FP4KV_STAT(evictions);
  FP4KV_STAT(prefix_queries);
  FP4KV_STAT(prefix_query_tokens);
  FP4KV_STAT(prefix_hit_tokens);
  FP4KV_STAT(prefix_hit_rate);
  FP4KV_STAT(host_prefix_pages_total);
  FP4KV_STAT(host_prefix_pages_cached);
  FP4KV_STAT(host_prefix_bytes);
  FP4KV_STAT(host_prefix_demotions);
  FP4KV_STAT(host_prefix_promotions);
  FP4KV_STAT(host_prefix_evictions);
  FP4KV_STAT(prefix_hit_tokens_host);
  FP4KV_STAT(events_pending);
  FP4KV_STAT(events_dropped);
  FP4KV_STAT(pages_reserved);
  FP4KV_STAT(reservations);
  FP4KV_STAT(bytes_exported);
  FP4KV_STAT(bytes_imported);
  FP4KV_STAT(host_pages_total);
  FP4KV_STAT(host_pages_free);
  FP4KV_STAT(host_pages_used);
  FP4KV_STAT(host_bytes);
  FP4KV_STAT(sequences_swapped);
  FP4KV_STAT(swaps_in_flight);
  FP4KV_STAT(pages_retiring);
  FP4KV_STAT(token_ids_pending);
  FP4KV_STAT(token_ids_dropped);
  FP4KV_STAT(pages_swap_pending);
  FP4KV_STAT(bytes_swapped_out);
  FP4KV_STAT(bytes_swapped_in);
#undef FP4KV_STAT

  nb::class_<SequenceImageHeader>(m, "SequenceImageHeader", "A parsed sequence image header.")
      .def_ro("version", &SequenceImageHeader::version)
      .def_ro("image_bytes", &SequenceImageHeader::image_bytes)
      .def_ro("length", &SequenceImageHeader::length)
      .def_ro("num_layers", &SequenceImageHeader::num_layers)
      .def_ro("geometry", &SequenceImageHeader::geometry)
      .def_ro("recipe", &SequenceImageHeader::recipe)
      .def_ro("num_pages", &SequenceImageHeader::num_pages)
      .def_ro("flags", &SequenceImageHeader::flags)
      .def_prop_ro("has_tokens", &SequenceImageHeader::has_tokens);
  m.def(
      "parse_sequence_image_header",
      [](nb::handle image) {
        const TensorView v = In(image, "image");
        if (v.device.is_cuda()) ThrowInvalid("image: expected host memory, got a CUDA tensor");
        const Bytes b = BytesOf(v, "image");
        return Take(ParseSequenceImageHeader(b.data, b.size));
      },
      "image"_a, "Parses and validates the header at the start of a host image.");
  nb::class_<ImportReservation>(m, "ImportReservation",
                                "Pages of a KVCache set aside for one image.")
      .def_prop_ro("id", &ImportReservation::id)
      .def_prop_ro("header", &ImportReservation::header);

  // ---- bound ops
  nb::class_<CacheAppender>(m, "CacheAppender", "The appender of a KVCache (keeps it alive).")
      .def(
          "run",
          [](const CacheAppender& op, int layer, nb::handle key, nb::handle value,
             uintptr_t stream) {
            const TensorView k = In(key, "key"), v = In(value, "value");
            Check(op.Run(layer, k, v, StreamOf(stream)));
          },
          "layer"_a, "key"_a, "value"_a, "stream"_a = 0,
          "Quantizes the step's new rows key [R, H, Dk], value [R, H, Dv] into layer `layer`.")
      .def(
          "for_slot", [](const CacheAppender& op, int slot) { return Take(op.ForSlot(slot)); },
          "slot"_a, nb::keep_alive<0, 1>())
      .def_prop_ro("slot", &CacheAppender::slot);
  nb::class_<CacheMaterializer>(m, "CacheMaterializer",
                                "The materializer of a KVCache (keeps it alive).")
      .def(
          "run",
          [](const CacheMaterializer& op, int layer, nb::handle out, uintptr_t stream) {
            const TensorView o = Out(out, "out");
            Check(op.Run(layer, o, StreamOf(stream)));
          },
          "layer"_a, "out"_a, "stream"_a = 0)
      .def(
          "for_slot", [](const CacheMaterializer& op, int slot) { return Take(op.ForSlot(slot)); },
          "slot"_a, nb::keep_alive<0, 1>())
      .def_prop_ro("slot", &CacheMaterializer::slot);
  nb::class_<CacheDequantizer>(m, "CacheDequantizer",
                               "The dequantizer of a KVCache (keeps it alive).")
      .def(
          "run",
          [](const CacheDequantizer& op, int layer, nb::handle k_out, nb::handle v_out,
             uintptr_t stream) {
            const TensorView k = Out(k_out, "k_out"), v = Out(v_out, "v_out");
            Check(op.Run(layer, k, v, StreamOf(stream)));
          },
          "layer"_a, "k_out"_a, "v_out"_a, "stream"_a = 0)
      .def(
          "for_slot", [](const CacheDequantizer& op, int slot) { return Take(op.ForSlot(slot)); },
          "slot"_a, nb::keep_alive<0, 1>())
      .def_prop_ro("slot", &CacheDequantizer::slot);
  nb::class_<CacheAttention>(m, "CacheAttention",
                             "Attention over a KVCache's step (keeps it alive).")
      .def(
          "run",
          [](const CacheAttention& op, int layer, nb::handle q, nb::handle out,
             nb::handle workspace, uintptr_t stream, nb::handle lse, nb::handle sinks) {
            const TensorView qv = In(q, "q"), o = Out(out, "out"), l = OutOpt(lse, "lse"),
                             s = InOpt(sinks, "sinks");
            const Bytes w = OutBytes(workspace, "workspace");
            Check(op.Run(layer, qv, o, w.data, w.size, StreamOf(stream), l, s));
          },
          "layer"_a, "q"_a, "out"_a, "workspace"_a = nb::none(), "stream"_a = 0,
          "lse"_a = nb::none(), "sinks"_a = nb::none(),
          "Attention of the step's query rows q [R, Hq, Dk] into out [R, Hq, Dv].")
      .def_prop_ro("workspace_bytes", &CacheAttention::WorkspaceBytes)
      .def(
          "for_slot", [](const CacheAttention& op, int slot) { return Take(op.ForSlot(slot)); },
          "slot"_a, nb::keep_alive<0, 1>())
      .def_prop_ro("slot", &CacheAttention::slot);

  // ---- KVCache
  nb::class_<KVCache>(m, "KVCache", nb::is_weak_referenceable(),
                      "The stateful NVFP4 KV cache of a whole model (kv_cache.h). Views and "
                      "bound ops keep it alive.")
      .def(
          "__init__",
          [](KVCache* self, const KVCacheOptions& o) {
            new (self) KVCache(Take(KVCache::Create(o)));
          },
          "options"_a)
      // sequences
      .def("create_sequence", [](KVCache& c) { return Take(c.CreateSequence()); })
      .def(
          "create_sequence_from_prefix",
          [](KVCache& c, nb::handle prompt, const std::string& extra_key) {
            Ids ids;
            IdsOf(prompt, "prompt", ids);
            return Take(c.CreateSequenceFromPrefix(ids.span, extra_key));
          },
          "prompt"_a, "extra_key"_a = "")
      .def(
          "match_prefix",
          [](const KVCache& c, nb::handle prompt, const std::string& extra_key) {
            Ids ids;
            IdsOf(prompt, "prompt", ids);
            return c.MatchPrefix(ids.span, extra_key);
          },
          "prompt"_a, "extra_key"_a = "")
      .def(
          "fork_sequence", [](KVCache& c, SequenceId p) { return Take(c.ForkSequence(p)); },
          "parent"_a)
      .def(
          "truncate", [](KVCache& c, SequenceId s, int64_t n) { Check(c.Truncate(s, n)); }, "seq"_a,
          "new_len"_a)
      .def(
          "release_sequence", [](KVCache& c, SequenceId s) { Check(c.ReleaseSequence(s)); },
          "seq"_a)
      .def(
          "import_half_pages",
          [](KVCache& c, const std::vector<const PyHalfPagedCache*>& layers, nb::handle src_pages,
             int64_t length, uintptr_t stream) {
            std::vector<HalfPagedCache> l;
            for (const PyHalfPagedCache* p : layers) {
              if (p == nullptr) ThrowInvalid("layers: expected HalfPagedCache objects, got None");
              l.push_back(p->cache);
            }
            Ids ids;
            IdsOf(src_pages, "src_pages", ids);
            return Take(c.ImportHalfPages(l, ids.span, length, StreamOf(stream)));
          },
          "layers"_a, "src_pages"_a, "length"_a, "stream"_a = 0)
      .def(
          "sequence_length",
          [](const KVCache& c, SequenceId s) { return Take(c.SequenceLength(s)); }, "seq"_a)
      .def(
          "sequence_pages",
          [](const KVCache& c, SequenceId s) { return ToVector(Take(c.SequencePages(s))); },
          "seq"_a)
      .def(
          "page_ref_count", [](const KVCache& c, int64_t p) { return Take(c.PageRefCount(p)); },
          "page"_a)
      .def(
          "set_retention_priority",
          [](KVCache& c, SequenceId s, int p) { Check(c.SetRetentionPriority(s, p)); }, "seq"_a,
          "priority"_a)
      .def(
          "read_sequence",
          [](const KVCache& c, int layer, SequenceId seq, nb::handle k_out, nb::handle v_out,
             uintptr_t stream) {
            const TensorView k = Out(k_out, "k_out"), v = Out(v_out, "v_out");
            Check(c.ReadSequence(layer, seq, k, v, StreamOf(stream)));
          },
          "layer"_a, "seq"_a, "k_out"_a, "v_out"_a, "stream"_a = 0)
      // export / import
      .def(
          "exported_bytes", [](const KVCache& c, SequenceId s) { return Take(c.ExportedBytes(s)); },
          "seq"_a)
      .def(
          "export_sequence",
          [](const KVCache& c, SequenceId s, nb::handle dst, uintptr_t stream) {
            const Bytes b = BytesOf(Out(dst, "dst"), "dst");
            Check(c.ExportSequence(s, b.data, b.size, StreamOf(stream)));
          },
          "seq"_a, "dst"_a, "stream"_a = 0)
      .def(
          "reserve_import",
          [](KVCache& c, const SequenceImageHeader& h) { return Take(c.ReserveImport(h)); },
          "header"_a)
      .def(
          "commit_import",
          [](KVCache& c, ImportReservation& r, nb::handle image, StoredTokens on_mismatch,
             uintptr_t stream) {
            const Bytes b = BytesOf(In(image, "image"), "image");
            ImportOptions o;
            o.on_scale_mismatch = on_mismatch;
            return Take(c.CommitImport(std::move(r), b.data, b.size, o, StreamOf(stream)));
          },
          "reservation"_a, "image"_a, "on_scale_mismatch"_a = StoredTokens::kRefuse, "stream"_a = 0)
      .def(
          "cancel_import",
          [](KVCache& c, ImportReservation& r) { Check(c.CancelImport(std::move(r))); },
          "reservation"_a)
      .def(
          "import_sequence",
          [](KVCache& c, nb::handle image, StoredTokens on_mismatch, uintptr_t stream) {
            const Bytes b = BytesOf(In(image, "image"), "image");
            ImportOptions o;
            o.on_scale_mismatch = on_mismatch;
            return Take(c.ImportSequence(b.data, b.size, o, StreamOf(stream)));
          },
          "image"_a, "on_scale_mismatch"_a = StoredTokens::kRefuse, "stream"_a = 0)
      // host tier
      .def(
          "swap_out",
          [](KVCache& c, SequenceId s, uintptr_t st) { Check(c.SwapOut(s, StreamOf(st))); },
          "seq"_a, "stream"_a = 0)
      .def(
          "swap_in",
          [](KVCache& c, SequenceId s, uintptr_t st) { Check(c.SwapIn(s, StreamOf(st))); }, "seq"_a,
          "stream"_a = 0)
      .def(
          "is_swapped_out", [](const KVCache& c, SequenceId s) { return Take(c.IsSwappedOut(s)); },
          "seq"_a)
      .def("synchronize_swaps", [](KVCache& c) { Check(c.SynchronizeSwaps()); })
      // steps
      .def(
          "prepare_step",
          [](KVCache& c, nb::handle entries, uintptr_t stream) {
            std::vector<Ids> ids;
            std::vector<StepEntry> e = EntriesOf(entries, ids);
            return Take(c.PrepareStep(e, StreamOf(stream)));
          },
          "entries"_a, "stream"_a = 0,
          "entries: (seq, num_new_tokens) or (seq, num_new_tokens, token_ids) tuples, or "
          "StepEntry.")
      .def(
          "plan_step",
          [](const KVCache& c, nb::handle entries) {
            std::vector<Ids> ids;
            std::vector<StepEntry> e = EntriesOf(entries, ids);
            return Take(c.PlanStep(e));
          },
          "entries"_a)
      .def_prop_ro("step", [](const KVCache& c) { return c.step(); })
      .def(
          "step_info", [](const KVCache& c, int slot) { return c.step(slot); }, "slot"_a)
      .def(
          "step_views",
          [](nb::handle self, int slot) {
            const KVCache& c = Self(self);
            return StepViewsDict(slot < 0 ? c.step_views() : c.step_views(slot), self);
          },
          "slot"_a = -1,
          "Read-only DLPack views of the step buffers (fixed addresses): slot_mapping, "
          "block_tables, seq_lens, kv_page_indptr, token_indptr, fp8_block_tables.")
      .def_prop_ro("host_slot_mapping",
                   [](const KVCache& c) { return ToVector(c.host_slot_mapping()); })
      .def_prop_ro("host_seq_lens", [](const KVCache& c) { return ToVector(c.host_seq_lens()); })
      .def_prop_ro("host_kv_page_indptr",
                   [](const KVCache& c) { return ToVector(c.host_kv_page_indptr()); })
      .def_prop_ro("host_token_indptr",
                   [](const KVCache& c) { return ToVector(c.host_token_indptr()); })
      .def(
          "host_block_table",
          [](const KVCache& c, int row) { return ToVector(c.host_block_table(row)); }, "row"_a)
      // ops
      .def(
          "appender", [](const KVCache& c, DType d) { return Take(c.appender(d)); },
          "input_dtype"_a = DType::kBF16, nb::keep_alive<0, 1>())
      .def(
          "materializer", [](const KVCache& c) { return Take(c.materializer()); },
          nb::keep_alive<0, 1>())
      .def(
          "dequantizer", [](const KVCache& c, DType d) { return Take(c.dequantizer(d)); },
          "output_dtype"_a = DType::kBF16, nb::keep_alive<0, 1>())
      .def(
          "attention",
          [](const KVCache& c, int num_qo_heads, DType dtype, int max_q_len, float sm_scale,
             float logits_soft_cap, int window_left, bool has_sinks, bool write_lse) {
            CacheAttentionOptions o;
            o.num_qo_heads = num_qo_heads;
            o.dtype = dtype;
            o.max_q_len = max_q_len;
            o.sm_scale = sm_scale;
            o.logits_soft_cap = logits_soft_cap;
            o.window_left = window_left;
            o.has_sinks = has_sinks;
            o.write_lse = write_lse;
            return Take(c.attention(o));
          },
          "num_qo_heads"_a, "dtype"_a = DType::kBF16, "max_q_len"_a = 1, "sm_scale"_a = 0.0f,
          "logits_soft_cap"_a = 0.0f, "window_left"_a = -1, "has_sinks"_a = false,
          "write_lse"_a = false, nb::keep_alive<0, 1>())
      .def("fp8_workspace_pages_at_capacity", &KVCache::Fp8WorkspacePagesAtCapacity)
      .def("fp8_workspace_shape", &KVCache::Fp8WorkspaceShape, "pages"_a)
      // prefix cache
      .def(
          "set_token_ids",
          [](KVCache& c, SequenceId seq, int64_t first, nb::handle ids, uintptr_t stream) {
            RoArray a;
            if (!PyList_Check(ids.ptr()) && !PyTuple_Check(ids.ptr()) &&
                nb::try_cast(ids, a, false)) {
              if (a.device_type() == nb::device::cuda::value) {
                Check(c.SetTokenIds(seq, first, ViewOf(a, "ids"), StreamOf(stream)));
                return;
              }
            }
            Ids i;
            IdsOf(ids, "ids", i);
            Check(c.SetTokenIds(seq, first, i.span));
          },
          "seq"_a, "first_position"_a, "ids"_a, "stream"_a = 0,
          "ids: a list or CPU int32 array (applied now) or a CUDA int32 tensor (copied on "
          "`stream`).")
      .def("take_events", &KVCache::TakeEvents)
      .def("reset_prefix_cache", &KVCache::ResetPrefixCache)
      .def("check_invariants", [](const KVCache& c) { Check(c.CheckInvariants()); })
      // scales
      .def(
          "update_global_scales",
          [](KVCache& c, int layer, float k, float v, uintptr_t stream, StoredTokens stored) {
            Check(c.UpdateGlobalScales(layer, k, v, StreamOf(stream), stored));
          },
          "layer"_a, "k_scale"_a, "v_scale"_a, "stream"_a = 0, "stored"_a = StoredTokens::kRefuse)
      .def(
          "update_all_global_scales",
          [](KVCache& c, const std::vector<float>& k, const std::vector<float>& v, uintptr_t stream,
             StoredTokens stored) { Check(c.UpdateGlobalScales(k, v, StreamOf(stream), stored)); },
          "k_scales"_a, "v_scales"_a, "stream"_a = 0, "stored"_a = StoredTokens::kRefuse)
      .def(
          "calibrate_global_scales",
          [](KVCache& c, int layer, nb::handle k, nb::handle v, Calibrator& cal, uintptr_t stream,
             StoredTokens stored) {
            Check(c.CalibrateGlobalScales(layer, In(k, "k"), In(v, "v"), cal, StreamOf(stream),
                                          stored));
          },
          "layer"_a, "k"_a, "v"_a, "calibrator"_a, "stream"_a = 0,
          "stored"_a = StoredTokens::kRefuse)
      .def(
          "read_scales",
          [](const KVCache& c, int layer, uintptr_t s) {
            return Take(c.ReadScales(layer, StreamOf(s)));
          },
          "layer"_a, "stream"_a = 0)
      .def(
          "layer_tokens", [](const KVCache& c, int layer) { return Take(c.LayerTokens(layer)); },
          "layer"_a)
      .def(
          "read_scale_events",
          [](const KVCache& c, int layer, uintptr_t s) {
            return Take(c.ReadScaleEvents(layer, StreamOf(s)));
          },
          "layer"_a, "stream"_a = 0)
      .def(
          "reset_scale_events",
          [](KVCache& c, uintptr_t s) { Check(c.ResetScaleEvents(StreamOf(s))); }, "stream"_a = 0)
      .def(
          "global_scale_ptr",
          [](const KVCache& c, int layer, int kv) {
            return reinterpret_cast<uintptr_t>(c.global_scale_ptr(layer, kv));
          },
          "layer"_a, "kv"_a,
          "Device address of layer's K (kv=0) or V (kv=1) global scale; 0 out of range.")
      .def(
          "fp8_scale_ptr",
          [](const KVCache& c, int layer, int kv) {
            return reinterpret_cast<uintptr_t>(c.fp8_scale_ptr(layer, kv));
          },
          "layer"_a, "kv"_a)
      .def(
          "layer_cache",
          [](nb::handle self, int layer) {
            const KVCache& c = Self(self);
            if (layer < 0 || layer >= c.num_layers()) {
              Throw(absl::InvalidArgumentError("layer: expected 0 <= layer < " +
                                               std::to_string(c.num_layers()) + ", got " +
                                               std::to_string(layer)));
            }
            const PagedCache pc = c.LayerCache(layer);
            PyPagedCache p;
            p.cache = pc;
            p.read_only = true;
            p.arrays = {Export(pc.k_data, self, true), Export(pc.v_data, self, true),
                        Export(pc.k_scales, self, true), Export(pc.v_scales, self, true)};
            return p;
          },
          "layer"_a,
          "Layer `layer`'s pools as a read-only PagedCache (DLPack views that keep the cache "
          "alive).")
      // properties
      .def_prop_ro("options", &KVCache::options)
      .def_prop_ro("geometry", &KVCache::geometry)
      .def_prop_ro("num_layers", &KVCache::num_layers)
      .def_prop_ro("device", &KVCache::device)
      .def("stats", &KVCache::Stats);
}

}  // namespace python
}  // namespace fp4kv
