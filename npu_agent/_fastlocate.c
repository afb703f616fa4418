/* The modules running on this thread, read off its frames in C (npu_agent.location, docs/design.md §4).
 *
 * A captured call's module path comes from the frames of `nn.Module._call_impl` on the thread's stack: each
 * holds its module as `self`. In Python that walk reads every frame's `f_back` (making a frame object for each)
 * and each such frame's `f_locals` (a dict of all its locals, rebuilt on every read): 3-7 us a captured call.
 * `modules(frame, code, module_type)` walks the same frames from `frame` outwards and returns the `self` of each
 * frame running `code` that is an instance of `module_type`, innermost first: exactly the list
 * location._walk builds in Python, which stays the path where this module is not built.
 *
 * CPython 3.11 keeps a thread's running frames as `_PyInterpreterFrame`s linked by `previous`; the walk reads
 * them in place (each frame's code and first local), skipping the frames that have not started yet as
 * PyFrame_GetBack does, without making frame objects. `self` of `_call_impl` is a cell variable there (its
 * closures use it): the cell's content is read. A frame that has finished (its frame object owns it and links on
 * by `f_back`) is left to Python: `modules` returns None. On any other CPython the module has no `modules` and
 * Python walks (the public API of 3.12, PyFrame_GetVar, would do; it is not built until it is tested here).
 * Build: `python -m npu_agent.compiled --build` (scripts/setup.sh runs it). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
#ifndef Py_BUILD_CORE
#define Py_BUILD_CORE 1
#endif
#include "internal/pycore_frame.h"
#undef Py_BUILD_CORE

/* Append `self` (a module) to `out` when it is an instance of `module_type`; 0, or -1 with an exception set. */
static int
add_module(PyObject *out, PyObject *self, PyObject *module_type)
{
    if (self == NULL)
        return 0;
    int is = PyObject_IsInstance(self, module_type);
    if (is < 0)
        return -1;
    return is ? PyList_Append(out, self) : 0;
}

static PyObject *
modules(PyObject *unused, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyFrame_Check(args[0]) || !PyCode_Check(args[1]) || !PyType_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "modules(frame, code, module_type)");
        return NULL;
    }
    PyObject *code = args[1], *module_type = args[2];
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (_PyInterpreterFrame *f = ((PyFrameObject *)args[0])->f_frame; f != NULL; f = f->previous) {
        if (f->owner == FRAME_OWNED_BY_FRAME_OBJECT) {   /* finished: linked on by f_back, which Python follows */
            Py_DECREF(out);
            Py_RETURN_NONE;
        }
        if (_PyFrame_IsIncomplete(f) || (PyObject *)f->f_code != code)
            continue;
        PyObject *self = f->localsplus[0];   /* co_varnames[0] == "self" (checked by npu_agent.location) */
        if (self != NULL && PyCell_Check(self))
            self = PyCell_GET(self);
        if (add_module(out, self, module_type) < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyMethodDef locate_methods[] = {
    {"modules", (PyCFunction)(void (*)(void))modules, METH_FASTCALL,
     "modules(frame, code, module_type) -> [module]: `self` of each frame from `frame` outwards that runs `code` "
     "and is a `module_type`, innermost first."},
    {NULL, NULL, 0, NULL},
};

#else
static PyMethodDef locate_methods[] = {{NULL, NULL, 0, NULL}};   /* another CPython: location walks in Python */
#endif

static struct PyModuleDef fastlocate_module = {
    PyModuleDef_HEAD_INIT, "npu_agent._fastlocate", "The modules running on this thread, read off its frames in C.",
    -1, locate_methods,
};

PyMODINIT_FUNC
PyInit__fastlocate(void)
{
    return PyModule_Create(&fastlocate_module);
}
