// Shared pieces of the fp4kv Python extension (fp4kv._core): Status errors as
// Python exceptions, tensors in and out (DLPack, the buffer protocol), caller
// caches, the KVCache helpers, and the binding pattern (options from
// arguments, calls whose Status raises). Each binding file (errors.cc,
// types.cc, tensors.cc, ops.cc, cache.cc) registers one concept; module.cc
// calls them in order.
#ifndef FP4KV_PYTHON_SRC_BINDING_H_
#define FP4KV_PYTHON_SRC_BINDING_H_

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
inline Exceptions g_exc;

inline PyObject* ExceptionFor(absl::StatusCode code) {
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

[[noreturn]] inline void Throw(absl::Status s) { throw StatusError(std::move(s)); }
[[noreturn]] inline void ThrowInvalid(const std::string& message) {
  Throw(absl::InvalidArgumentError(message));
}
inline void Check(const absl::Status& s) {
  if (!s.ok()) Throw(s);
}
template <typename T>
inline T Take(absl::StatusOr<T>&& r) {
  if (!r.ok()) Throw(r.status());
  return *std::move(r);
}

// Runs `f` (a C++ call that touches no Python object and returns a Status)
// without the GIL, then raises its non-OK Status. Only the functional ops do
// (they touch caller memory only, and may run concurrently, ops.h); calls on a
// KVCache and its bound ops keep the GIL, so Python threads cannot break the
// cache's rule that its calls are serialized.
template <typename F>
inline void RunWithoutGil(F&& f) {
  absl::Status s;
  {
    nb::gil_scoped_release release;
    s = f();
  }
  Check(s);
}

// ------------------------------------------------------------ tensors
using RoArray = nb::ndarray<nb::ro>;
using RwArray = nb::ndarray<>;

template <typename A>
inline TensorView ViewOf(const A& a, const char* name) {
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
inline RoArray ReadArray(nb::handle h, const char* name) {
  RoArray a;
  if (!nb::try_cast(h, a, /*convert=*/false)) {
    ThrowInvalid(std::string(name) +
                 ": expected a tensor (an object with __dlpack__ or the "
                 "buffer protocol), got " +
                 nb::type_name(h.type()).c_str());
  }
  return a;
}
inline TensorView In(nb::handle h, const char* name) { return ViewOf(ReadArray(h, name), name); }
inline TensorView InOpt(nb::handle h, const char* name) {
  return h.is_none() ? TensorView() : In(h, name);
}

// A tensor the op writes: refused when read-only.
inline RwArray WriteArray(nb::handle h, const char* name) {
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
inline TensorView Out(nb::handle h, const char* name) { return ViewOf(WriteArray(h, name), name); }
inline TensorView OutOpt(nb::handle h, const char* name) {
  return h.is_none() ? TensorView() : Out(h, name);
}

// Bytes of a contiguous tensor (images, workspaces).
struct Bytes {
  void* data = nullptr;
  int64_t size = 0;
};
inline Bytes BytesOf(const TensorView& v, const char* name) {
  if (!v.IsContiguous()) {
    ThrowInvalid(std::string(name) +
                 ": expected a contiguous tensor, got a strided view of shape " + v.ShapeString());
  }
  const int64_t n = v.numel();
  return Bytes{v.data, n * DTypeSize(v.dtype)};
}
inline Bytes OutBytes(nb::handle h, const char* name) {
  if (h.is_none()) return Bytes{};
  return BytesOf(Out(h, name), name);
}

// A global scale: a number (the value; Python and numpy scalars) or a tensor
// whose first fp32 element is read when the op runs (GlobalScale::Pointer).
inline GlobalScale ScaleOf(nb::handle h, const char* name) {
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

inline float* FloatOut(nb::handle h, const char* name) {
  if (h.is_none()) return nullptr;
  const TensorView v = Out(h, name);
  if (v.dtype != DType::kF32 || v.numel() < 1) {
    ThrowInvalid(std::string(name) + ": expected an fp32 tensor of at least one element, got " +
                 std::string(DTypeName(v.dtype)) + " " + v.ShapeString());
  }
  return static_cast<float*>(v.data);
}

inline Stream StreamOf(uintptr_t s) { return reinterpret_cast<Stream>(s); }

// DLPack dtype of an exported view (E4M3 bytes go out as uint8, which every
// framework reads; torch users may .view(torch.float8_e4m3fn)).
inline nb::dlpack::dtype ExportDtype(DType t) {
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
inline nb::object Export(const TensorView& v, nb::handle owner, bool read_only) {
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
inline void IdsOf(nb::handle h, const char* name, Ids& out) {
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

inline bool IsWritable(nb::handle h) {
  RwArray a;
  return nb::try_cast(h, a, false);
}

inline PyPagedCache MakePagedCache(nb::handle k_data, nb::handle v_data, nb::handle k_scales,
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

inline const PagedCache& WritableCache(const PyPagedCache& c) {
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
inline std::vector<StepEntry> EntriesOf(nb::handle entries, std::vector<Ids>& ids) {
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

inline nb::dict StepViewsDict(const StepViews& v, nb::handle owner) {
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
inline std::vector<T> ToVector(absl::Span<const T> s) {
  return std::vector<T>(s.begin(), s.end());
}

inline KVCache& Self(nb::handle h) { return nb::cast<KVCache&>(h); }

// ------------------------------------------------------------ the binding pattern
// An op object's options come from keyword arguments, one a field; a C++ call
// that returns a Status or StatusOr raises instead; a stream is passed as its
// address (an int, 0 the default stream). Each binding then names only its
// fields, arguments and defaults.

template <class C, class T>
T FieldTypeOf(T C::*);
template <class C, class T>
C FieldClassOf(T C::*);
// The type of the data member `Field` points to.
template <auto Field>
using FieldType = decltype(FieldTypeOf(Field));

// An options struct with fields `First, Rest...` set from the values, in
// order, and the others left at their defaults.
template <auto First, auto... Rest>
decltype(FieldClassOf(First)) OptionsOf(FieldType<First> first, FieldType<Rest>... rest) {
  decltype(FieldClassOf(First)) o;
  o.*First = std::move(first);
  ((o.*Rest = std::move(rest)), ...);
  return o;
}

// nanobind's __init__ of an op object: Create() validates the options once and
// a bad Status becomes the matching exception; `p` is the object's storage.
template <class Op>
void CreateInto(Op* p, const typename Op::Options& o) {
  new (p) Op(Take(Op::Create(o)));
}

// An __init__ whose arguments are the fields of Op::Options, in order:
//   .def("__init__", &CreateFrom<Op, &Op::Options::a, &Op::Options::b>, "a"_a, "b"_a = ...)
template <class Op, auto... Fields>
void CreateFrom(Op* p, FieldType<Fields>... values) {
  CreateInto(p, OptionsOf<Fields...>(std::move(values)...));
}

// A C++ parameter as Python passes it: the same, but a Stream is its address.
template <class T>
struct PyArg {
  using type = T;
  static T From(T v) { return v; }
};
template <>
struct PyArg<Stream> {
  using type = uintptr_t;
  static Stream From(uintptr_t s) { return StreamOf(s); }
};

// A call's result on its way to Python: a Status raises, a StatusOr raises or
// gives its value.
inline void Unwrap(const absl::Status& s) { Check(s); }
template <typename T>
T Unwrap(absl::StatusOr<T>&& r) {
  return Take(std::move(r));
}

template <auto Fn, class = decltype(Fn)>
struct CheckedCall;
template <auto Fn, class R, class... A>
struct CheckedCall<Fn, R (*)(A...)> {
  static auto Call(typename PyArg<A>::type... a) { return Unwrap(Fn(PyArg<A>::From(a)...)); }
};
template <auto Fn, class R, class C, class... A>
struct CheckedCall<Fn, R (C::*)(A...)> {
  static auto Call(C& self, typename PyArg<A>::type... a) {
    return Unwrap((self.*Fn)(PyArg<A>::From(a)...));
  }
};
template <auto Fn, class R, class C, class... A>
struct CheckedCall<Fn, R (C::*)(A...) const> {
  static auto Call(const C& self, typename PyArg<A>::type... a) {
    return Unwrap((self.*Fn)(PyArg<A>::From(a)...));
  }
};
// A function or method (not overloaded) that returns a Status or StatusOr,
// bound with the same parameters, streams as ints, and raising on error:
//   .def("truncate", Checked<&KVCache::Truncate>, "seq"_a, "new_len"_a)
template <auto Fn>
inline constexpr auto Checked = &CheckedCall<Fn>::Call;

// Registration of each concept (module.cc calls them in this order).
void RegisterErrors(nb::module_& m);
void RegisterTypes(nb::module_& m);
void RegisterTensors(nb::module_& m);
void RegisterOps(nb::module_& m);
void RegisterCache(nb::module_& m);

}  // namespace python
}  // namespace fp4kv

#endif  // FP4KV_PYTHON_SRC_BINDING_H_
