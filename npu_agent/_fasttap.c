/* A captured call's flat arguments read in C (npu_agent.backward, docs/design.md §4, "The call's signature in C").
 *
 * Before it taps a call's inputs for their gradients, the capture reads each flat argument once: a tensor gives its
 * (key, tapped, dtype, dimensions) to the call's signature, and is tapped when it requires grad and is floating or
 * complex; any other argument gives its value (bool, int, str, None, dtype, device, layout, memory format), whether
 * it is 0 (a float), or its type; a nested argument that may hold tensors ends the read (the call's tree is walked in
 * Python instead). In Python that loop is 1.5-3 us a call (more in a training, with its caches cold).
 * `scan(args, kwargs, signature)` appends exactly what backward._scan_py appends to `signature` and returns the same
 * [(key, tensor, flattened position)] of the tapped tensors, or None where it returns None. backward._scan_py stays
 * the path where this module is not built. `configure(kinds, arg_kind, without_tensors, value_keys)` gives it the
 * Python path's own tables and functions first (snapshot.KIND_OF, snapshot.arg_kind, snapshot.without_tensors,
 * backward._VALUE_KEYS): the table is read in place, never copied, so both paths see the same entries.
 * Build: `python -m npu_agent.compiled --build` (scripts/setup.sh runs it). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

static PyObject *kinds = NULL;            /* dict: type -> 1 (a tensor), 2 (nested), 0 (anything else) */
static PyObject *arg_kind = NULL;         /* arg_kind(type) -> its kind, remembered in `kinds` */
static PyObject *without_tensors = NULL;  /* without_tensors(value) -> true when a nested value holds no tensor */
static PyObject *value_keys = NULL;       /* frozenset of the types whose values go into the signature */
static PyObject *s_requires_grad, *s_is_floating_point, *s_is_complex, *s_dtype, *s_dim;

#define TENSOR 1
#define NESTED 2

static PyObject *
configure(PyObject *unused, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyDict_CheckExact(args[0]) || !PyCallable_Check(args[1]) || !PyCallable_Check(args[2])
            || !PyFrozenSet_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "configure(kinds: dict, arg_kind, without_tensors, value_keys: frozenset)");
        return NULL;
    }
    Py_XSETREF(kinds, Py_NewRef(args[0]));
    Py_XSETREF(arg_kind, Py_NewRef(args[1]));
    Py_XSETREF(without_tensors, Py_NewRef(args[2]));
    Py_XSETREF(value_keys, Py_NewRef(args[3]));
    Py_RETURN_NONE;
}

/* The kind of `tp`: kinds.get(tp), else arg_kind(tp); -1 with an exception set. */
static long
kind_of(PyObject *tp)
{
    PyObject *kind = PyDict_GetItemWithError(kinds, tp);   /* borrowed */
    if (kind != NULL)
        return PyLong_AsLong(kind);
    if (PyErr_Occurred())
        return -1;
    PyObject *computed = PyObject_CallOneArg(arg_kind, tp);
    if (computed == NULL)
        return -1;
    long k = PyLong_AsLong(computed);
    Py_DECREF(computed);
    return k;
}

/* What an argument that is not a tensor gives the signature: its value for the types in `value_keys`, whether it is
 * 0 for a float, else its type (a new reference; NULL with an exception set). */
static PyObject *
value_key(PyObject *value, PyObject *tp)
{
    int keyed = PySet_Contains(value_keys, tp);
    if (keyed < 0)
        return NULL;
    if (keyed)
        return Py_NewRef(value);
    if (tp == (PyObject *)&PyFloat_Type)
        return PyBool_FromLong(PyFloat_AS_DOUBLE(value) == 0.0);   /* `t == 0`: NaN false, -0.0 true */
    return Py_NewRef(tp);
}

/* `t.requires_grad and (t.is_floating_point() or t.is_complex())`, the very object Python's `and`/`or` give (a new
 * reference; NULL with an exception set). */
static PyObject *
tapped_flag(PyObject *t)
{
    PyObject *rg = PyObject_GetAttr(t, s_requires_grad);
    if (rg == NULL)
        return NULL;
    int truth = PyObject_IsTrue(rg);
    if (truth <= 0)
        return truth < 0 ? (Py_DECREF(rg), NULL) : rg;
    Py_DECREF(rg);
    PyObject *fp = PyObject_CallMethodNoArgs(t, s_is_floating_point);
    if (fp == NULL)
        return NULL;
    truth = PyObject_IsTrue(fp);
    if (truth != 0)
        return truth < 0 ? (Py_DECREF(fp), NULL) : fp;
    Py_DECREF(fp);
    return PyObject_CallMethodNoArgs(t, s_is_complex);
}

/* One argument (`key`, `value`): 0, 1 when it ends the read (nested, may hold tensors), -1 with an exception set. */
static int
scan_one(PyObject *key, PyObject *value, PyObject *signature, PyObject *tapped, Py_ssize_t *position)
{
    PyObject *tp = (PyObject *)Py_TYPE(value);
    long kind = kind_of(tp);
    if (kind == -1 && PyErr_Occurred())
        return -1;
    if (kind != TENSOR) {
        if (kind == NESTED) {
            PyObject *none = PyObject_CallOneArg(without_tensors, value);
            if (none == NULL)
                return -1;
            int truth = PyObject_IsTrue(none);
            Py_DECREF(none);
            if (truth < 0)
                return -1;
            if (!truth)
                return 1;
        }
        PyObject *item = value_key(value, tp);
        if (item == NULL)
            return -1;
        int failed = PyList_Append(signature, item);
        Py_DECREF(item);
        return failed;
    }
    *position += 1;
    PyObject *tap = tapped_flag(value);
    if (tap == NULL)
        return -1;
    PyObject *dtype = PyObject_GetAttr(value, s_dtype);
    PyObject *dim = dtype == NULL ? NULL : PyObject_CallMethodNoArgs(value, s_dim);
    PyObject *item = dim == NULL ? NULL : PyTuple_Pack(4, key, tap, dtype, dim);
    Py_XDECREF(dtype);
    Py_XDECREF(dim);
    int failed = item == NULL || PyList_Append(signature, item) < 0;
    Py_XDECREF(item);
    if (!failed) {
        int truth = PyObject_IsTrue(tap);
        failed = truth < 0;
        if (truth > 0) {
            PyObject *pos = PyLong_FromSsize_t(*position);
            PyObject *entry = pos == NULL ? NULL : PyTuple_Pack(3, key, value, pos);
            Py_XDECREF(pos);
            failed = entry == NULL || PyList_Append(tapped, entry) < 0;
            Py_XDECREF(entry);
        }
    }
    Py_DECREF(tap);
    return failed ? -1 : 0;
}

static PyObject *
scan(PyObject *unused, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_Check(args[0]) || !PyDict_Check(args[1]) || !PyList_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "scan(args: tuple, kwargs: dict, signature: list)");
        return NULL;
    }
    if (kinds == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "scan() before configure()");
        return NULL;
    }
    PyObject *call_args = args[0], *kwargs = args[1], *signature = args[2];
    PyObject *tapped = PyList_New(0);
    if (tapped == NULL)
        return NULL;
    Py_ssize_t position = -1;
    int done = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(call_args) && !done; i++) {
        PyObject *key = PyLong_FromSsize_t(i);
        if (key == NULL)
            goto error;
        done = scan_one(key, PyTuple_GET_ITEM(call_args, i), signature, tapped, &position);
        Py_DECREF(key);
        if (done < 0)
            goto error;
    }
    Py_ssize_t at = 0;
    PyObject *key, *value;
    while (!done && PyDict_Next(kwargs, &at, &key, &value)) {
        Py_INCREF(key);   /* held while Python code runs (arg_kind, a tensor's attributes) */
        Py_INCREF(value);
        done = scan_one(key, value, signature, tapped, &position);
        Py_DECREF(key);
        Py_DECREF(value);
        if (done < 0)
            goto error;
    }
    if (done) {
        Py_DECREF(tapped);
        Py_RETURN_NONE;
    }
    return tapped;
error:
    Py_DECREF(tapped);
    return NULL;
}

static PyMethodDef tap_methods[] = {
    {"configure", (PyCFunction)(void (*)(void))configure, METH_FASTCALL,
     "configure(kinds, arg_kind, without_tensors, value_keys): the Python path's tables, read in place by scan."},
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(args, kwargs, signature) -> [(key, tensor, position)] or None: backward._scan_py in C."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fasttap_module = {
    PyModuleDef_HEAD_INIT, "npu_agent._fasttap", "A captured call's flat arguments read in C.", -1, tap_methods,
};

PyMODINIT_FUNC
PyInit__fasttap(void)
{
    if ((s_requires_grad = PyUnicode_InternFromString("requires_grad")) == NULL
            || (s_is_floating_point = PyUnicode_InternFromString("is_floating_point")) == NULL
            || (s_is_complex = PyUnicode_InternFromString("is_complex")) == NULL
            || (s_dtype = PyUnicode_InternFromString("dtype")) == NULL
            || (s_dim = PyUnicode_InternFromString("dim")) == NULL)
        return NULL;
    return PyModule_Create(&fasttap_module);
}
