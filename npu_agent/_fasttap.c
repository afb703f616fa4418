/* A captured call's flat arguments read in C (npu_agent.backward and npu_agent.snapshot, docs/design.md §4, "A
 * captured call's arguments read in C").
 *
 * Before it taps a call's inputs for their gradients, the capture reads each flat argument once: a tensor gives its
 * (key, tapped, dtype, dimensions) to the call's signature, and is tapped when it requires grad and is floating or
 * complex; any other argument gives its value (bool, int, str, None, dtype, device, layout, memory format), whether
 * it is 0 (a float), or its type; a nested argument that may hold tensors ends the read (the call's tree is walked in
 * Python instead). In Python that loop is 1.5-3 us a call (more in a training, with its caches cold).
 * `scan(args, kwargs, signature)` appends exactly what backward._scan_py appends to `signature` and returns the same
 * [(key, tensor, flattened position)] of the tapped tensors, or None where it returns None.
 *
 * The same call's inputs are held by reference for its record (snapshot.snapshot_call): `hold(args, kwargs, held,
 * grads)` fills `held` and `grads` exactly as snapshot._hold_flat does (id -> [tensor, its _version, None, None];
 * the ids of those that require grad) and returns the bytes held, or None where that returns None (a nested
 * argument other than a plain tuple without tensors: the tree walk holds it).
 *
 * After the call, a call given no aliases (its signature made a known tree of autograd nodes before) has its nodes'
 * edges checked against its own inputs before its hooks go on: `hooks_of(tree, fn, inputs, leaf)` returns exactly
 * what backward._hooks_of_py returns, [(node, its (edge, slot) pairs)] or None.
 *
 * The Python functions stay the path where this module is not built. `scan` and `hold` read the names their Python
 * twins read (KIND_OF, arg_kind, without_tensors; VALUE_KEYS for scan) from that twin's module, at each call, as
 * Python looks up its globals: `bind(name, namespace)` gives "scan" npu_agent.backward's and "hold"
 * npu_agent.snapshot's (each module's use_compiled). So the kind table is the same dict, read in place, and a name
 * replaced in the module (a test's monkeypatch) is replaced for the C path too.
 * Build: `python -m npu_agent.compiled --build` (scripts/setup.sh runs it). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* The namespaces (module dicts) whose names scan and hold read at each call (`bind`); in them:
 *   KIND_OF: dict, type -> 1 (a tensor), 2 (nested), 0 (anything else);
 *   arg_kind(type) -> its kind, remembered in KIND_OF;
 *   without_tensors(value) -> true when a nested value holds no tensor;
 *   VALUE_KEYS (scan's only): the types whose values go into the signature. */
static PyObject *scan_names = NULL, *hold_names = NULL;
static PyObject *s_requires_grad, *s_is_floating_point, *s_is_complex, *s_dtype, *s_dim, *s_version, *s_numel,
                *s_element_size, *s_KIND_OF, *s_arg_kind, *s_without_tensors, *s_VALUE_KEYS, *s_variable,
                *s_grad_fn, *s_output_nr, *s_next_functions, *s_Snapshot, *s_HELD, *s_add;

#define TENSOR 1
#define NESTED 2

static PyObject *
bind(PyObject *unused, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyUnicode_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "bind(name: str, namespace: dict)");
        return NULL;
    }
    if (PyUnicode_CompareWithASCIIString(args[0], "scan") == 0)
        Py_XSETREF(scan_names, Py_NewRef(args[1]));
    else if (PyUnicode_CompareWithASCIIString(args[0], "hold") == 0)
        Py_XSETREF(hold_names, Py_NewRef(args[1]));
    else {
        PyErr_SetString(PyExc_ValueError, "bind: the name is 'scan' or 'hold'");
        return NULL;
    }
    Py_RETURN_NONE;
}

/* `ns[name]`, a new reference; NULL with an exception set (NameError where it is missing). */
static PyObject *
name_in(PyObject *ns, PyObject *name)
{
    PyObject *v = PyDict_GetItemWithError(ns, name);
    if (v != NULL)
        return Py_NewRef(v);
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_NameError, "name '%U' is not defined", name);
    return NULL;
}

/* What one call reads: its namespace, and the kind table (and VALUE_KEYS for scan) taken from it at the start. */
typedef struct {
    PyObject *ns;
    PyObject *kinds;
    PyObject *value_keys;
} Names;

/* `name(arg)`, the function `name` of the call's namespace: a new reference, or NULL with an exception set. */
static PyObject *
call_name(Names *n, PyObject *name, PyObject *arg)
{
    PyObject *fn = name_in(n->ns, name);
    PyObject *r = fn == NULL ? NULL : PyObject_CallOneArg(fn, arg);
    Py_XDECREF(fn);
    return r;
}

/* The truth of `r` (a new reference, released here): 1, 0, or -1 with an exception set (also where r is NULL). */
static int
truth_of(PyObject *r)
{
    if (r == NULL)
        return -1;
    int truth = PyObject_IsTrue(r);
    Py_DECREF(r);
    return truth;
}

/* The integer `r` (a new reference, released here); -1 with an exception set (also where r is NULL). */
static long long
integer_of(PyObject *r)
{
    if (r == NULL)
        return -1;
    long long v = PyLong_AsLongLong(r);
    Py_DECREF(r);
    return v;
}

/* The kind of `tp`: KIND_OF.get(tp), else arg_kind(tp); -1 with an exception set. */
static long
kind_of(Names *n, PyObject *tp)
{
    PyObject *kind = PyDict_GetItemWithError(n->kinds, tp);   /* borrowed */
    if (kind != NULL)
        return PyLong_AsLong(kind);
    if (PyErr_Occurred())
        return -1;
    return (long)integer_of(call_name(n, s_arg_kind, tp));
}

/* `without_tensors(value)`: 1, 0, or -1 with an exception set. */
static int
holds_no_tensor(Names *n, PyObject *value)
{
    return truth_of(call_name(n, s_without_tensors, value));
}

/* Names for one call from `ns`: 0, or -1 with an exception set; `release_names` after. */
static int
names_for(Names *n, PyObject *ns, int with_value_keys)
{
    if (ns == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "npu_agent._fasttap: called before bind()");
        return -1;
    }
    n->ns = Py_NewRef(ns);
    n->value_keys = NULL;
    n->kinds = name_in(ns, s_KIND_OF);
    if (n->kinds == NULL)
        goto fail;
    if (!PyDict_Check(n->kinds)) {
        PyErr_SetString(PyExc_TypeError, "KIND_OF is not a dict");
        goto fail;
    }
    if (!with_value_keys)
        return 0;
    n->value_keys = name_in(ns, s_VALUE_KEYS);
    if (n->value_keys == NULL)
        goto fail;
    if (!PyAnySet_Check(n->value_keys)) {
        PyErr_SetString(PyExc_TypeError, "VALUE_KEYS is not a set");
        goto fail;
    }
    return 0;
fail:
    Py_XDECREF(n->value_keys);
    Py_XDECREF(n->kinds);
    Py_DECREF(n->ns);
    return -1;
}

static void
release_names(Names *n)
{
    Py_XDECREF(n->value_keys);
    Py_DECREF(n->kinds);
    Py_DECREF(n->ns);
}

/* What an argument that is not a tensor gives the signature: its value for the types in `value_keys`, whether it is
 * 0 for a float, else its type (a new reference; NULL with an exception set). */
static PyObject *
value_key(Names *n, PyObject *value, PyObject *tp)
{
    int keyed = PySet_Contains(n->value_keys, tp);
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
scan_one(Names *n, PyObject *key, PyObject *value, PyObject *signature, PyObject *tapped, Py_ssize_t *position)
{
    PyObject *tp = (PyObject *)Py_TYPE(value);
    long kind = kind_of(n, tp);
    if (kind == -1 && PyErr_Occurred())
        return -1;
    if (kind != TENSOR) {
        if (kind == NESTED) {
            int truth = holds_no_tensor(n, value);
            if (truth < 0)
                return -1;
            if (!truth)
                return 1;
        }
        PyObject *item = value_key(n, value, tp);
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
    Names n;
    if (names_for(&n, scan_names, 1) < 0)
        return NULL;
    PyObject *call_args = args[0], *kwargs = args[1], *signature = args[2];
    PyObject *tapped = PyList_New(0);
    if (tapped == NULL) {
        release_names(&n);
        return NULL;
    }
    Py_ssize_t position = -1;
    int done = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(call_args) && !done; i++) {
        PyObject *key = PyLong_FromSsize_t(i);
        if (key == NULL)
            goto error;
        done = scan_one(&n, key, PyTuple_GET_ITEM(call_args, i), signature, tapped, &position);
        Py_DECREF(key);
        if (done < 0)
            goto error;
    }
    Py_ssize_t at = 0;
    PyObject *key, *value;
    while (!done && PyDict_Next(kwargs, &at, &key, &value)) {
        Py_INCREF(key);   /* held while Python code runs (arg_kind, a tensor's attributes) */
        Py_INCREF(value);
        done = scan_one(&n, key, value, signature, tapped, &position);
        Py_DECREF(key);
        Py_DECREF(value);
        if (done < 0)
            goto error;
    }
    release_names(&n);
    if (done) {
        Py_DECREF(tapped);
        Py_RETURN_NONE;
    }
    return tapped;
error:
    release_names(&n);
    Py_DECREF(tapped);
    return NULL;
}

/* The tensor `v` into `held` (id -> [v, its _version, None, None]) unless it is there already; its id into `grads`
 * when it requires grad (not asked where grads is NULL), its bytes added to *nbytes. 0, or -1 with an exception
 * set. */
static int
hold_tensor(PyObject *v, PyObject *held, PyObject *grads, long long *nbytes)
{
    PyObject *tid = PyLong_FromVoidPtr(v);   /* id(v) */
    if (tid == NULL)
        return -1;
    int known = PyDict_Contains(held, tid);
    if (known != 0) {
        Py_DECREF(tid);
        return known < 0 ? -1 : 0;
    }
    int failed = 1;
    PyObject *version = PyObject_GetAttr(v, s_version);
    PyObject *entry = version == NULL ? NULL : PyList_New(4);
    if (entry != NULL) {
        PyList_SET_ITEM(entry, 0, Py_NewRef(v));
        PyList_SET_ITEM(entry, 1, Py_NewRef(version));
        PyList_SET_ITEM(entry, 2, Py_NewRef(Py_None));
        PyList_SET_ITEM(entry, 3, Py_NewRef(Py_None));
        if (PyDict_SetItem(held, tid, entry) == 0) {
            int truth = grads == NULL ? 0 : truth_of(PyObject_GetAttr(v, s_requires_grad));
            if (truth >= 0 && (truth == 0 || PySet_Add(grads, tid) == 0)) {
                long long numel = integer_of(PyObject_CallMethodNoArgs(v, s_numel));
                long long size = numel == -1 && PyErr_Occurred() ? -1
                                 : integer_of(PyObject_CallMethodNoArgs(v, s_element_size));
                if (!(size == -1 && PyErr_Occurred())) {
                    *nbytes += numel * size;
                    failed = 0;
                }
            }
        }
    }
    Py_XDECREF(entry);
    Py_XDECREF(version);
    Py_DECREF(tid);
    return failed ? -1 : 0;
}

/* One argument of `hold`: 0, 1 when the tree walk must hold the call, -1 with an exception set. */
static int
hold_one(Names *n, PyObject *v, PyObject *held, PyObject *grads, long long *nbytes)
{
    PyObject *tp = (PyObject *)Py_TYPE(v);
    long kind = kind_of(n, tp);
    if (kind == -1 && PyErr_Occurred())
        return -1;
    if (kind == NESTED) {
        if (tp != (PyObject *)&PyTuple_Type)
            return 1;
        int truth = holds_no_tensor(n, v);
        return truth < 0 ? -1 : !truth;
    }
    if (kind != TENSOR)
        return 0;
    return hold_tensor(v, held, grads, nbytes);
}

static PyObject *
hold(PyObject *unused, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_Check(args[0]) || !PyDict_Check(args[1]) || !PyDict_CheckExact(args[2])
            || !PySet_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "hold(args: tuple, kwargs: dict, held: dict, grads: set)");
        return NULL;
    }
    Names n;
    if (names_for(&n, hold_names, 0) < 0)
        return NULL;
    PyObject *call_args = args[0], *kwargs = args[1], *held = args[2], *grads = args[3];
    long long nbytes = 0;
    int done = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(call_args) && !done; i++)
        done = hold_one(&n, PyTuple_GET_ITEM(call_args, i), held, grads, &nbytes);
    Py_ssize_t at = 0;
    PyObject *key, *value;
    while (done == 0 && PyDict_Next(kwargs, &at, &key, &value)) {
        Py_INCREF(value);   /* held while Python code runs (arg_kind, a tensor's attributes) */
        done = hold_one(&n, value, held, grads, &nbytes);
        Py_DECREF(value);
    }
    release_names(&n);
    if (done < 0)
        return NULL;
    if (done)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(nbytes);
}

/* grads(values): snapshot.grads_snapshot(values) in C, for a list of gradients (tensors, or None where none
 * arrived): the same held dict (each tensor once), the same bytes, then snapshot.Snapshot(list(values), nbytes, set(),
 * held) registered by snapshot.HELD.add, both looked up in the namespace bound as "hold". */
static PyObject *
grads(PyObject *unused, PyObject *values)
{
    if (!PyList_Check(values)) {
        PyErr_SetString(PyExc_TypeError, "grads(values: list)");
        return NULL;
    }
    if (hold_names == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "grads: bind('hold', npu_agent.snapshot's namespace) first");
        return NULL;
    }
    PyObject *items = PySequence_Tuple(values);   /* the values as they are now, whatever the calls below do */
    PyObject *held = items == NULL ? NULL : PyDict_New();
    PyObject *snap = NULL;
    long long nbytes = 0;
    if (held == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(items); i++) {
        PyObject *v = PyTuple_GET_ITEM(items, i);
        if (v != Py_None && hold_tensor(v, held, NULL, &nbytes) < 0)
            goto done;
    }
    PyObject *cls = name_in(hold_names, s_Snapshot);
    PyObject *registry = cls == NULL ? NULL : name_in(hold_names, s_HELD);
    PyObject *tree = registry == NULL ? NULL : PySequence_List(items);
    PyObject *size = tree == NULL ? NULL : PyLong_FromLongLong(nbytes);
    PyObject *none_grad = size == NULL ? NULL : PySet_New(NULL);
    if (none_grad != NULL) {
        PyObject *stack[4] = {tree, size, none_grad, held};
        snap = PyObject_Vectorcall(cls, stack, 4, NULL);
        PyObject *added = snap == NULL ? NULL : PyObject_CallMethodOneArg(registry, s_add, snap);
        if (added == NULL)
            Py_CLEAR(snap);
        Py_XDECREF(added);
    }
    Py_XDECREF(none_grad);
    Py_XDECREF(size);
    Py_XDECREF(tree);
    Py_XDECREF(registry);
    Py_XDECREF(cls);
done:
    Py_XDECREF(held);
    Py_XDECREF(items);
    return snap;
}

/* One tree entry's (edge, slot) pairs against the node's edges `nf`: 1 when each leads to this call's input of its
 * slot (a leaf's AccumulateGrad node holding that very tensor, else the tensor's own node and output number), 0
 * when one does not, -1 with an exception set. */
static int
edges_lead_to_inputs(PyObject *edges, PyObject *nf, PyObject *inputs, PyObject *leaf)
{
    for (Py_ssize_t e = 0; e < PyTuple_GET_SIZE(edges); e++) {
        PyObject *pair = PyTuple_GET_ITEM(edges, e);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "hooks_of: a tree's edges are (edge, slot) pairs");
            return -1;
        }
        Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(pair, 0));
        PyObject *slot = PyTuple_GET_ITEM(pair, 1);
        if (i == -1 && PyErr_Occurred())
            return -1;
        if (i < 0 || i >= PyTuple_GET_SIZE(nf)) {
            PyErr_SetString(PyExc_IndexError, "hooks_of: an edge past the node's edges");
            return -1;
        }
        PyObject *next = PyTuple_GET_ITEM(nf, i);   /* (node or None, output number) */
        if (!PyTuple_Check(next) || PyTuple_GET_SIZE(next) != 2) {
            PyErr_SetString(PyExc_TypeError, "hooks_of: next_functions holds (node, number) pairs");
            return -1;
        }
        PyObject *edge = PyTuple_GET_ITEM(next, 0), *nr = PyTuple_GET_ITEM(next, 1);
        PyObject *t = PyObject_GetItem(inputs, slot);
        int truth = truth_of(t == NULL ? NULL : PyObject_GetItem(leaf, slot));
        int same = -1;
        if (truth > 0) {   /* getattr(edge, "variable", None) is t */
            PyObject *variable = PyObject_GetAttr(edge, s_variable);
            if (variable == NULL && PyErr_ExceptionMatches(PyExc_AttributeError)) {
                PyErr_Clear();
                variable = Py_NewRef(Py_None);
            }
            same = variable == NULL ? -1 : variable == t;
            Py_XDECREF(variable);
        } else if (truth == 0) {   /* edge is t.grad_fn and nr == t.output_nr */
            if (edge == Py_None)
                same = 0;
            else {
                PyObject *grad_fn = PyObject_GetAttr(t, s_grad_fn);
                if (grad_fn != NULL && grad_fn != edge)
                    same = 0;
                else if (grad_fn != NULL) {
                    PyObject *output_nr = PyObject_GetAttr(t, s_output_nr);
                    same = output_nr == NULL ? -1 : PyObject_RichCompareBool(nr, output_nr, Py_EQ);
                    Py_XDECREF(output_nr);
                }
                Py_XDECREF(grad_fn);
            }
        }
        Py_XDECREF(t);
        if (same <= 0)
            return same;
    }
    return 1;
}

static PyObject *
hooks_of(PyObject *unused, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "hooks_of(tree: tuple, fn, inputs, leaf)");
        return NULL;
    }
    PyObject *tree = args[0], *fn = args[1], *inputs = args[2], *leaf = args[3];
    Py_ssize_t size = PyTuple_GET_SIZE(tree);
    PyObject *found = PyList_New(0), *hooks = PyList_New(0);   /* each tree node's next_functions; the hooks */
    if (found == NULL || hooks == NULL)
        goto error;
    for (Py_ssize_t k = 0; k < size; k++) {
        PyObject *entry = PyTuple_GET_ITEM(tree, k);
        if (!PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 5 || !PyTuple_Check(PyTuple_GET_ITEM(entry, 4))) {
            PyErr_SetString(PyExc_TypeError, "hooks_of: a tree entry is (parent, j, size, count, edges)");
            goto error;
        }
        Py_ssize_t parent = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 0));
        Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1));
        Py_ssize_t want_size = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 2));
        Py_ssize_t want_count = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 3));
        PyObject *edges = PyTuple_GET_ITEM(entry, 4);
        if (PyErr_Occurred())
            goto error;
        PyObject *node;   /* borrowed */
        if (parent < 0)
            node = fn;
        else {
            if (parent >= PyList_GET_SIZE(found)) {
                PyErr_SetString(PyExc_IndexError, "hooks_of: a parent after its child");
                goto error;
            }
            PyObject *pnf = PyList_GET_ITEM(found, parent);
            if (j < 0 || j >= PyTuple_GET_SIZE(pnf) || !PyTuple_Check(PyTuple_GET_ITEM(pnf, j))
                    || PyTuple_GET_SIZE(PyTuple_GET_ITEM(pnf, j)) != 2) {
                PyErr_SetString(PyExc_IndexError, "hooks_of: a child past its parent's edges");
                goto error;
            }
            node = PyTuple_GET_ITEM(PyTuple_GET_ITEM(pnf, j), 0);
        }
        if (node == Py_None)
            goto none;
        PyObject *nf = PyObject_GetAttr(node, s_next_functions);
        if (nf == NULL)
            goto error;
        if (!PyTuple_Check(nf)) {
            Py_DECREF(nf);
            PyErr_SetString(PyExc_TypeError, "hooks_of: next_functions is not a tuple");
            goto error;
        }
        int ok = PyTuple_GET_SIZE(nf) == want_size;
        Py_ssize_t count = 0;
        for (Py_ssize_t i = 0; ok && i < want_size; i++) {
            PyObject *next = PyTuple_GET_ITEM(nf, i);
            if (!PyTuple_Check(next) || PyTuple_GET_SIZE(next) != 2) {
                Py_DECREF(nf);
                PyErr_SetString(PyExc_TypeError, "hooks_of: next_functions holds (node, number) pairs");
                goto error;
            }
            count += PyTuple_GET_ITEM(next, 0) != Py_None;
        }
        int lead = ok && count == want_count ? edges_lead_to_inputs(edges, nf, inputs, leaf) : 0;
        if (lead < 0 || (lead > 0 && PyList_Append(found, nf) < 0)) {
            Py_DECREF(nf);
            goto error;
        }
        Py_DECREF(nf);
        if (!lead)
            goto none;
        if (PyTuple_GET_SIZE(edges) || parent < 0) {
            PyObject *hook = PyTuple_Pack(2, node, edges);
            if (hook == NULL || PyList_Append(hooks, hook) < 0) {
                Py_XDECREF(hook);
                goto error;
            }
            Py_DECREF(hook);
        }
    }
    Py_DECREF(found);
    return hooks;
none:
    Py_DECREF(found);
    Py_DECREF(hooks);
    Py_RETURN_NONE;
error:
    Py_XDECREF(found);
    Py_XDECREF(hooks);
    return NULL;
}

static PyMethodDef tap_methods[] = {
    {"hooks_of", (PyCFunction)(void (*)(void))hooks_of, METH_FASTCALL,
     "hooks_of(tree, fn, inputs, leaf) -> [(node, edges)] or None: backward._hooks_of_py in C."},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(name, namespace): 'scan' or 'hold' reads KIND_OF, arg_kind, without_tensors (and VALUE_KEYS) from it."},
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(args, kwargs, signature) -> [(key, tensor, position)] or None: backward._scan_py in C."},
    {"grads", (PyCFunction)grads, METH_O,
     "grads(values) -> Snapshot: snapshot.grads_snapshot in C (Snapshot and HELD from the namespace bound as 'hold')."},
    {"hold", (PyCFunction)(void (*)(void))hold, METH_FASTCALL,
     "hold(args, kwargs, held, grads) -> bytes held or None: snapshot._hold_flat in C."},
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
            || (s_dim = PyUnicode_InternFromString("dim")) == NULL
            || (s_version = PyUnicode_InternFromString("_version")) == NULL
            || (s_numel = PyUnicode_InternFromString("numel")) == NULL
            || (s_Snapshot = PyUnicode_InternFromString("Snapshot")) == NULL
            || (s_HELD = PyUnicode_InternFromString("HELD")) == NULL
            || (s_add = PyUnicode_InternFromString("add")) == NULL
            || (s_element_size = PyUnicode_InternFromString("element_size")) == NULL
            || (s_KIND_OF = PyUnicode_InternFromString("KIND_OF")) == NULL
            || (s_arg_kind = PyUnicode_InternFromString("arg_kind")) == NULL
            || (s_without_tensors = PyUnicode_InternFromString("without_tensors")) == NULL
            || (s_VALUE_KEYS = PyUnicode_InternFromString("VALUE_KEYS")) == NULL
            || (s_variable = PyUnicode_InternFromString("variable")) == NULL
            || (s_grad_fn = PyUnicode_InternFromString("grad_fn")) == NULL
            || (s_output_nr = PyUnicode_InternFromString("output_nr")) == NULL
            || (s_next_functions = PyUnicode_InternFromString("next_functions")) == NULL)
        return NULL;
    return PyModule_Create(&fasttap_module);
}
