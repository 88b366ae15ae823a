// The Python half of reporting to the GPU trace: keeping a pending Python error across the
// report's callbacks. It needs Python.h, so it compiles with the bindings, not the runtime.
#include <Python.h>

#include "gpu_trace.h"

namespace supa {

PendingPythonErrorKept::PendingPythonErrorKept() {
  if (!Py_IsInitialized()) {
    return;
  }
  gil_state_ = static_cast<int>(PyGILState_Ensure());
  held_ = true;
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
  PyErr_Fetch(&type, &value, &traceback);
  error_[0] = type;
  error_[1] = value;
  error_[2] = traceback;
}

PendingPythonErrorKept::~PendingPythonErrorKept() {
  if (!held_) {
    return;
  }
  PyErr_Clear();  // what a callback left behind was already logged by PyTorch's trace
  PyErr_Restore(static_cast<PyObject*>(error_[0]), static_cast<PyObject*>(error_[1]),
                static_cast<PyObject*>(error_[2]));
  PyGILState_Release(static_cast<PyGILState_STATE>(gil_state_));
}

}  // namespace supa
