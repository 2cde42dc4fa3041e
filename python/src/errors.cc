// fp4kv._core: Status codes as Python exception classes: fp4kv.Error and one subclass a code,
// each also deriving from the matching builtin (ValueError, LookupError, ...).
#include "binding.h"

namespace fp4kv {
namespace python {

void RegisterErrors(nb::module_& m) {
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

}

}  // namespace python
}  // namespace fp4kv
