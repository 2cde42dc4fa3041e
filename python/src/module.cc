// The fp4kv Python extension (fp4kv._core): a thin nanobind layer over the
// public C++ API (include/fp4kv/).
//
// Tensors come in through DLPack or the buffer protocol (numpy arrays on the
// CPU, torch tensors on CUDA) without a copy, and go out as DLPack tensors
// that keep their owner alive. A Status error becomes a Python exception of
// the class that matches its code, carrying the Status message.
//
// One file a concept: binding.h (the shared helpers: errors, tensors in and
// out, caller caches, KVCache helpers, the binding pattern), errors.cc, types.cc, tensors.cc,
// ops.cc, cache.cc; this file only names the module and registers them in
// order (a type is registered before the bindings that take or return it).
#include "binding.h"

NB_MODULE(_core, m) {
  m.doc() = "fp4kv: an NVFP4 KV cache for LLM attention (C++/CUDA) - Python binding";

  fp4kv::python::RegisterErrors(m);
  fp4kv::python::RegisterTypes(m);
  fp4kv::python::RegisterTensors(m);
  fp4kv::python::RegisterOps(m);
  fp4kv::python::RegisterCache(m);
}
