/* The capture mode's answer for a call the sampling skips, in C (docs/design.md §4.6).
 *
 * Under sampling most calls are skipped: a step not taken, or a call site checked less than
 * `online_coverage_steps` ago. Answering that in Python costs about 2 us a call on top of the
 * TorchFunctionMode itself. `Skipper.skip(func, args, kwargs)` answers it here: it returns True after
 * doing exactly the bookkeeping npu_agent.capture.Capturer.before_call and npu_agent.sampling.Sampler.take
 * do for such a call (the call counted in the step's names, in the sampler's counts), or returns False
 * having changed nothing, and the Python path decides as before. It reads the same dicts and attributes
 * the Python code reads, so the two cannot drift apart: whenever a case is not plainly a skip (a call
 * not classified yet, a collective, a call that may write what a record holds, a backward pass, a scope
 * or an api list, a new call site, a call due for its check), it says False. Any error: False, cleared.
 * It also says True, counting nothing, for a call that is not an API where the Python path would only run it: a
 * property's getter (`x.shape`: about 4 us a call in Python, which looked it up twice and failed twice), or a call
 * classified as no API while no record holds a tensor.
 * Build: `python -m npu_agent.compiled --build` (scripts/setup.sh runs it). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#define MAX_REASONS 8   /* skipped_steps, _ranks, _repeats, _budget: far fewer */

static PyObject *s_step_taken, *s_reason, *s_coverage, *s_step, *s_shape, *s_dtype, *s_calls, *s_repeats,
    *s_inplace, *s_out, *s_name;
static PyTypeObject *method_wrapper_type;   /* type(None.__repr__): a slot bound to its object */

typedef struct {
    PyObject_HEAD
    PyObject *classified;   /* naming.CLASSIFIED: func -> (category, api) or None */
    PyObject *kinds;        /* capture._KINDS: (category, api) -> (by_name, by_table, collective, random) */
    PyObject *kind_of;      /* sampling._KIND_OF: type -> 1 tensor, 2 list or tuple, 0 other */
    PyObject *tensor_type;  /* torch.Tensor */
    PyObject *pending;      /* snapshot.HELD.pending: records holding tensors */
    PyObject *grad_enabled; /* torch.is_grad_enabled */
    PyObject *graph_task;   /* torch._C._current_graph_task_id */
    PyObject *writes_inputs;/* Capturer._writes_inputs */
    PyObject *index_counts; /* Capturer._counts: (category, api) -> calls so far this step */
    PyObject *sampler;      /* Capturer.sampler */
    PyObject *last;         /* Sampler.last: call site -> the step it was last captured */
    PyObject *counts;       /* Sampler._counts: what flush() adds the pending counts to */
    /* The sampler's counts of the calls skipped here, kept here until flush() (Sampler.counts calls it before
     * anyone reads them): a dict update of a large int costs more than the rest of a skipped call's bookkeeping */
    long calls_pending;
    int nreasons;
    PyObject *reasons[MAX_REASONS];
    long reason_pending[MAX_REASONS];
} Skipper;

static int
skipper_traverse(Skipper *self, visitproc visit, void *arg)
{
    Py_VISIT(self->classified); Py_VISIT(self->kinds); Py_VISIT(self->kind_of); Py_VISIT(self->tensor_type); Py_VISIT(self->pending); Py_VISIT(self->grad_enabled);
    Py_VISIT(self->graph_task); Py_VISIT(self->writes_inputs); Py_VISIT(self->index_counts); Py_VISIT(self->sampler); Py_VISIT(self->last); Py_VISIT(self->counts);
    return 0;
}

static int
skipper_clear(Skipper *self)
{
    Py_CLEAR(self->classified); Py_CLEAR(self->kinds); Py_CLEAR(self->kind_of); Py_CLEAR(self->tensor_type); Py_CLEAR(self->pending); Py_CLEAR(self->grad_enabled);
    Py_CLEAR(self->graph_task); Py_CLEAR(self->writes_inputs); Py_CLEAR(self->index_counts); Py_CLEAR(self->sampler); Py_CLEAR(self->last); Py_CLEAR(self->counts);
    return 0;
}

static void
drop_reasons(Skipper *self)
{
    for (int i = 0; i < self->nreasons; i++)
        Py_CLEAR(self->reasons[i]);
    self->nreasons = 0;
    self->calls_pending = 0;
}

static void
skipper_dealloc(Skipper *self)
{
    PyObject_GC_UnTrack(self);
    drop_reasons(self);
    skipper_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The containers are the Python objects themselves, which the Python path mutates in place and never replaces. */
static int
skipper_init(Skipper *self, PyObject *args, PyObject *kwds)
{
    PyObject *o[12];
    if (!PyArg_ParseTuple(args, "O!O!O!OO!OOO!O!OO!O!:Skipper", &PyDict_Type, &o[0], &PyDict_Type, &o[1],
                          &PyDict_Type, &o[2], &o[3], &PyDict_Type, &o[4], &o[5], &o[6], &PySet_Type, &o[7],
                          &PyDict_Type, &o[8], &o[9], &PyDict_Type, &o[10], &PyDict_Type, &o[11]))
        return -1;
    if (!PyType_Check(o[3])) {
        PyErr_SetString(PyExc_TypeError, "Skipper: the tensor type must be a type");
        return -1;
    }
    PyObject **slots[12] = {&self->classified, &self->kinds, &self->kind_of, &self->tensor_type, &self->pending,
                            &self->grad_enabled, &self->graph_task, &self->writes_inputs, &self->index_counts,
                            &self->sampler, &self->last, &self->counts};
    for (int i = 0; i < 12; i++) {
        Py_INCREF(o[i]);
        Py_XSETREF(*slots[i], o[i]);
    }
    return 0;
}

/* isinstance(v, torch.Tensor), as Python answers it: torch.Tensor's metaclass keeps type.__instancecheck__
 * (npu_agent.fastskip checks it), so a subtype is an instance, and an int, a float, a bool, None or a str never is;
 * anything else asks Python (an object may claim another __class__). */
static int
is_tensor(Skipper *self, PyObject *v)
{
    PyTypeObject *tp = Py_TYPE(v);
    if (tp == &PyLong_Type || tp == &PyFloat_Type || tp == &PyBool_Type || v == Py_None || tp == &PyUnicode_Type)
        return 0;
    if (PyType_IsSubtype(tp, (PyTypeObject *)self->tensor_type))
        return 1;
    return PyObject_IsInstance(v, self->tensor_type);
}

#define MAX_TENSORS 64   /* a call with more tensor arguments goes the Python way */

/* The tensors sampling._signature reads, in its order: each tensor argument, the tensors in a list or tuple
 * argument, tensor keyword arguments (new references, into `found`: an isinstance check may run Python code). Their
 * count, or -1 (none held): an error set, or none set when an argument's type is not in the kind table yet (the
 * Python path fills it) or there are too many. */
static Py_ssize_t
find_tensors(Skipper *self, PyObject *args, PyObject *kwargs, PyObject **found)
{
    Py_ssize_t n = 0, count = PyTuple_GET_SIZE(args);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *v = PyTuple_GET_ITEM(args, i);
        PyObject *kind = PyDict_GetItemWithError(self->kind_of, (PyObject *)Py_TYPE(v));
        if (kind == NULL)
            goto fail;
        long k = PyLong_AsLong(kind);
        if (k == 1) {
            if (n == MAX_TENSORS)
                goto fail;
            Py_INCREF(v);
            found[n++] = v;
        }
        else if (k == 2) {   /* a list or tuple (or a subclass): its tensors */
            int list = PyList_Check(v);
            for (Py_ssize_t j = 0; j < (list ? PyList_GET_SIZE(v) : PyTuple_GET_SIZE(v)); j++) {
                PyObject *t = list ? PyList_GET_ITEM(v, j) : PyTuple_GET_ITEM(v, j);
                Py_INCREF(t);
                int is = is_tensor(self, t);
                if (is > 0 && n < MAX_TENSORS) {
                    found[n++] = t;
                    continue;
                }
                Py_DECREF(t);
                if (is != 0)   /* an error, or too many */
                    goto fail;
            }
        }
        else if (k == -1 && PyErr_Occurred())
            goto fail;
    }
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        Py_ssize_t pos = 0;
        PyObject *key, *v;
        while (PyDict_Next(kwargs, &pos, &key, &v)) {
            int is = is_tensor(self, v);
            if (is < 0 || (is && n == MAX_TENSORS))
                goto fail;
            if (is) {
                Py_INCREF(v);
                found[n++] = v;
            }
        }
    }
    return n;
fail:
    while (n > 0)
        Py_DECREF(found[--n]);
    return -1;
}

/* sampling._signature: (shape, dtype, shape, dtype, ...) of those tensors, one flat tuple. NULL: see find_tensors.
 */
static PyObject *
signature(Skipper *self, PyObject *args, PyObject *kwargs)
{
    PyObject *found[MAX_TENSORS];
    Py_ssize_t n = find_tensors(self, args, kwargs, found);
    if (n < 0)
        return NULL;
    PyObject *sig = PyTuple_New(2 * n);
    for (Py_ssize_t i = 0; sig != NULL && i < n; i++) {
        PyObject *shape = PyObject_GetAttr(found[i], s_shape);
        PyObject *dtype = shape == NULL ? NULL : PyObject_GetAttr(found[i], s_dtype);
        if (dtype == NULL) {
            Py_XDECREF(shape);
            Py_CLEAR(sig);
            break;
        }
        PyTuple_SET_ITEM(sig, 2 * i, shape);
        PyTuple_SET_ITEM(sig, 2 * i + 1, dtype);
    }
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(found[i]);
    return sig;
}

/* *out = int(obj.name): 0, or -1 with an error set */
static int
long_attr(PyObject *obj, PyObject *name, long *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLong(v);
    Py_DECREF(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* counts[key] = counts.get(key, 0) + by */
static int
add_to(PyObject *counts, PyObject *key, long by)
{
    PyObject *old = PyDict_GetItemWithError(counts, key);
    long n;
    if (old == NULL) {
        if (PyErr_Occurred())
            return -1;
        n = 0;
    }
    else {
        n = PyLong_AsLong(old);
        if (n == -1 && PyErr_Occurred())
            return -1;
    }
    PyObject *nv = PyLong_FromLong(n + by);
    if (nv == NULL)
        return -1;
    int rc = PyDict_SetItem(counts, key, nv);
    Py_DECREF(nv);
    return rc;
}

/* Sampler._counts["calls"] and [reason] += what was counted here: 0, or -1 with an error set (what could not be
 * added stays pending) */
static int
flush_pending(Skipper *self)
{
    while (self->nreasons > 0) {
        int i = self->nreasons - 1;
        if (add_to(self->counts, self->reasons[i], self->reason_pending[i]) < 0)
            return -1;
        Py_CLEAR(self->reasons[i]);
        self->nreasons = i;
    }
    if (self->calls_pending) {
        if (add_to(self->counts, s_calls, self->calls_pending) < 0)
            return -1;
        self->calls_pending = 0;
    }
    return 0;
}

/* One more skipped call for `reason` (a new reference is taken when it is new here): 0, or -1 with an error set */
static int
count_skip(Skipper *self, PyObject *reason)
{
    int i;
    for (i = 0; i < self->nreasons && self->reasons[i] != reason; i++)
        ;
    if (i == self->nreasons) {
        if (i == MAX_REASONS && flush_pending(self) < 0)
            return -1;
        i = self->nreasons++;
        Py_INCREF(reason);
        self->reasons[i] = reason;
        self->reason_pending[i] = 0;
    }
    self->reason_pending[i]++;
    self->calls_pending++;
    return 0;
}

/* A property's getter: `x.shape` reaches the mode as `Tensor.shape.__get__`, a method-wrapper made anew at each
 * access (so never in naming.CLASSIFIED). naming.classify says it is not an API, and for a call that is not an API
 * and has no `out=` the Python path only runs it (capture.protect_unseen: a getter writes nothing). 1: a getter; 0:
 * not one; -1: an error set. */
static int
is_getter(PyObject *func)
{
    if (Py_TYPE(func) != method_wrapper_type)
        return 0;
    PyObject *name = PyObject_GetAttr(func, s_name);
    if (name == NULL)
        return -1;
    int is = PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, "__get__") == 0;
    Py_DECREF(name);
    return is;
}

/* 1: run the call as it is: skipped and counted, or not an API and nothing the Python path would do for it (a
 * property's getter; a call classified as no API while no record holds a tensor); 0: not plainly either, nothing
 * changed; -1: an error (nothing changed either). */
static int
decide(Skipper *self, PyObject *func, PyObject *args, PyObject *kwargs)
{
    int rc = 0;
    long was = 0;
    PyObject *sampler = self->sampler, *info = NULL, *grad = NULL, *site = NULL, *sig = NULL, *tmp = NULL;
    PyObject *reason = NULL;

    if (kwargs == NULL || !PyDict_GET_SIZE(kwargs)) {
        int getter = is_getter(func);
        if (getter != 0)
            return getter;
    }
    info = PyDict_GetItemWithError(self->classified, func);
    if (info == Py_None && !PyDict_GET_SIZE(self->pending))
        return 1;   /* not an API (capture: `info is None`), and no record holds a tensor it might write */
    if (info == NULL || info == Py_None || !PyTuple_Check(info) || PyTuple_GET_SIZE(info) != 2) {
        info = NULL;
        goto check;
    }
    Py_INCREF(info);
    PyObject *kind = PyDict_GetItemWithError(self->kinds, info);   /* borrowed: read at once */
    if (kind == NULL || !PyTuple_Check(kind) || PyTuple_GET_SIZE(kind) != 4)
        goto check;
    if (PyTuple_GET_ITEM(kind, 2) != Py_False)   /* a collective: checked across ranks */
        goto check;
    int writes = PyTuple_GET_ITEM(kind, 0) != Py_False || PyTuple_GET_ITEM(kind, 1) != Py_False;
    if (!writes && kwargs != NULL && PyDict_GET_SIZE(kwargs)) {   /* naming.is_inplace: inplace=True, out= */
        PyObject *v = PyDict_GetItemWithError(kwargs, s_inplace);
        PyObject *out = v == NULL && PyErr_Occurred() ? NULL : PyDict_GetItemWithError(kwargs, s_out);
        if (PyErr_Occurred())
            goto error;
        writes = v == Py_True || (out != NULL && out != Py_None);
    }
    if (!writes && (writes = PySet_Contains(self->writes_inputs, info)) < 0)
        goto error;
    if (writes && PyDict_GET_SIZE(self->pending))   /* records hold tensors: the Python path protects them */
        goto check;
    tmp = PyObject_CallNoArgs(self->graph_task);   /* protos.torch_compat.in_backward_pass */
    if (tmp == NULL)
        goto error;
    long task = PyLong_AsLong(tmp);
    Py_CLEAR(tmp);
    if (task != -1)   /* a backward pass: a recompute or a custom backward */
        goto check;
    grad = PyObject_CallNoArgs(self->grad_enabled);
    if (grad == NULL || (sig = signature(self, args, kwargs)) == NULL)
        goto check;
    site = PyTuple_Pack(4, PyTuple_GET_ITEM(info, 0), PyTuple_GET_ITEM(info, 1), sig, grad);
    if (site == NULL)
        goto error;
    PyObject *last_step = PyDict_GetItemWithError(self->last, site);   /* borrowed: read at once */
    if (last_step == NULL)
        goto check;   /* a new call site: the Python path decides */
    was = PyLong_AsLong(last_step);
    if (was == -1 && PyErr_Occurred())
        goto error;
    tmp = PyObject_GetAttr(sampler, s_step_taken);
    if (tmp == NULL)
        goto error;
    int taken = PyObject_IsTrue(tmp);
    Py_CLEAR(tmp);
    if (taken < 0)
        goto error;
    if (!taken) {
        reason = PyObject_GetAttr(sampler, s_reason);
        if (reason == NULL)
            goto error;
    }
    else {   /* a taken step: skipped only as a repeat within the coverage period */
        long k, step;
        if (long_attr(sampler, s_coverage, &k) < 0)
            goto error;
        if (k <= 0)
            goto check;
        if (long_attr(sampler, s_step, &step) < 0)
            goto error;
        if (step - was >= k)
            goto check;   /* due for its check */
        reason = s_repeats;
        Py_INCREF(reason);
    }
    /* the bookkeeping of a skipped call: its index in the step's names, the sampler's counts */
    if (add_to(self->index_counts, info, 1) < 0 || count_skip(self, reason) < 0)
        goto error;
    rc = 1;
    goto done;
check:
    rc = PyErr_Occurred() ? -1 : 0;
    goto done;
error:
    rc = -1;
done:
    Py_XDECREF(info); Py_XDECREF(grad); Py_XDECREF(sig); Py_XDECREF(site); Py_XDECREF(tmp); Py_XDECREF(reason);
    return rc;
}

static PyObject *
skipper_skip(Skipper *self, PyObject *const *argv, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_Check(argv[1]) || (argv[2] != Py_None && !PyDict_Check(argv[2])))
        Py_RETURN_FALSE;
    int rc = decide(self, argv[0], argv[1], argv[2] == Py_None ? NULL : argv[2]);
    if (rc < 0) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    return PyBool_FromLong(rc);
}

static PyObject *
skipper_flush(Skipper *self, PyObject *unused)
{
    if (flush_pending(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef skipper_methods[] = {
    {"flush", (PyCFunction)skipper_flush, METH_NOARGS,
     "flush() adds the calls skipped here to the sampler's counts (Sampler.counts calls it before they are read)."},
    {"skip", (PyCFunction)(void (*)(void))skipper_skip, METH_FASTCALL,
     "skip(func, args, kwargs) -> True: run the call as it is (a call the sampling skips, counted; or no API and "
     "nothing to do for it); False: nothing changed, ask Python."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SkipperType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "npu_agent._fastskip.Skipper",
    .tp_basicsize = sizeof(Skipper),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Skipper(classified, kinds, kind_of, tensor_type, held_pending, grad_enabled, graph_task_id, "
              "writes_inputs, index_counts, sampler, sampler_last, sampler_counts)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)skipper_init,
    .tp_dealloc = (destructor)skipper_dealloc,
    .tp_traverse = (traverseproc)skipper_traverse,
    .tp_clear = (inquiry)skipper_clear,
    .tp_methods = skipper_methods,
};

static struct PyModuleDef fastskip_module = {
    PyModuleDef_HEAD_INIT, "npu_agent._fastskip", "The sampling's skipped calls, answered in C.", -1, NULL,
};

PyMODINIT_FUNC
PyInit__fastskip(void)
{
    struct { PyObject **slot; const char *name; } names[] = {
        {&s_step_taken, "step_taken"}, {&s_reason, "_reason"}, {&s_coverage, "_coverage"}, {&s_step, "step"},
        {&s_shape, "shape"}, {&s_dtype, "dtype"}, {&s_calls, "calls"}, {&s_repeats, "skipped_repeats"},
        {&s_inplace, "inplace"}, {&s_out, "out"}, {&s_name, "__name__"},
    };
    for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++) {
        *names[i].slot = PyUnicode_InternFromString(names[i].name);
        if (*names[i].slot == NULL)
            return NULL;
    }
    PyObject *bound = PyObject_GetAttrString(Py_None, "__repr__");
    if (bound == NULL)
        return NULL;
    method_wrapper_type = Py_TYPE(bound);   /* a built-in type: lives as long as the interpreter */
    Py_DECREF(bound);
    if (PyType_Ready(&SkipperType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&fastskip_module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&SkipperType);
    if (PyModule_AddObject(m, "Skipper", (PyObject *)&SkipperType) < 0) {
        Py_DECREF(&SkipperType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
