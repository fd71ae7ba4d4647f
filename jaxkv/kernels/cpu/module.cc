// The library as a Python extension module, jaxkv.kernels._cpu, so that it imports like the rest of
// the package (its handlers are reached through ctypes: jaxkv.kernels.native); the module is empty.
#include <Python.h>

static PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_cpu",
    "jaxkv's native CPU kernels: XLA FFI handlers, registered by jaxkv.kernels.native", -1, nullptr,
};

PyMODINIT_FUNC PyInit__cpu(void) { return PyModule_Create(&kModule); }
