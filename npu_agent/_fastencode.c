/* A record's values, tensor table and header as protobuf bytes, and its dense tensors' copy, in C (docs/design.md
 * §5, "Values encoded in C").
 *
 * npu_agent.records lays a record out with protos.record_bytes.RecordEncoder: each argument and output a Value,
 * each tensor an entry of Record.tensors (its TensorMeta) and a place in the payload; then it writes the Record
 * and copies each tensor into the payload. In Python that is some 30 us of a small record's encoding beyond the
 * copy itself (bench/encode.py). The functions here do the same steps for the same encoder object, in the same
 * order, and write the same bytes:
 *   value, sequence, mapping  RecordEncoder.value, .sequence, .mapping (a tensor's entry appended to enc.metas, its
 *                             place to enc.places, enc.size moved on, as _PayloadEncoder.tensor does);
 *   record                    the Record: header, tensor table, payload size, then its other fields as given;
 *   copy_places               _PayloadEncoder.copy_into's loop: a CPU tensor's elements copied into a payload in
 *                             one piece, in row-major order (what `.contiguous()` holds: one memcpy for a
 *                             contiguous tensor, row by row for a transposed or sliced one; the interpreter lock
 *                             released for 64 KiB and more), anything else by the payload's own `copy`;
 *   gather                    the same copy of any part of a tensor's bytes, for a payload in several pieces
 *                             (npu_agent.payload `Spans.copy`: a large record's frames, a record file).
 *
 * Only the common cases are written here: None, bool, int, float, str, exact tuples, lists, str-keyed dicts,
 * torch.Size, dtypes and strided tensors of the exact classes torch.Tensor and torch.nn.Parameter whose dtype and
 * device names are known already (a non-contiguous one with the strides its clone has, as
 * npu_agent.records._clone_stride gives them). Anything else (a tensor subclass, a 4-D or 5-D view whose elements are
 * not dense, whose clone's layout torch picks, a device, a slice, a named tuple, a subclass of int, float, str, list
 * or dict, a value nested deeper than MAX_DEPTH) is handed to the encoder's own Python method (enc.tensor or
 * enc.value), which writes it as always; so the two paths cannot differ by design, and tests/test_fastencode.py
 * checks that they give the same bytes. An error raised by Python code called from here propagates as it would from
 * the Python walk. Python code called from here may let the training's thread run, and change a list being walked:
 * items are read afresh, and held while used.
 *
 * Build: `python -m npu_agent.compiled --build` (scripts/setup.sh runs it). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_DEPTH 64

static PyObject *tensor_type, *parameter_type, *size_type, *dtype_type, *strided, *dtype_names, *device_names;
static long long align = 1;
static PyObject *s_layout, *s_is_contiguous, *s_numel, *s_element_size, *s_dtype, *s_device, *s_shape, *s_metas,
    *s_places, *s_size, *s_tensor, *s_value, *s_mapping, *s_requires_grad, *s_is_cpu, *s_is_conj, *s_is_neg,
    *s_data_ptr, *s_stride;
static PyObject *gather_fn;   /* this module's gather, handed to a payload's own copy */

/* ---------------------------------------------------------------------------------------------- byte buffer */
typedef struct {
    char *p;
    Py_ssize_t n, cap;
} Buf;

static int
reserve(Buf *b, Py_ssize_t more)
{
    if (b->n + more <= b->cap)
        return 0;
    Py_ssize_t cap = b->cap ? b->cap : 256;
    while (cap < b->n + more)
        cap *= 2;
    char *p = PyMem_Realloc(b->p, (size_t)cap);
    if (p == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->p = p;
    b->cap = cap;
    return 0;
}

static int
put(Buf *b, const void *src, Py_ssize_t n)
{
    if (reserve(b, n) < 0)
        return -1;
    memcpy(b->p + b->n, src, (size_t)n);
    b->n += n;
    return 0;
}

static int
put_byte(Buf *b, unsigned char c)
{
    return put(b, &c, 1);
}

static int
varint_bytes(uint64_t v, unsigned char out[10])
{
    int k = 0;
    while (v >= 0x80) {
        out[k++] = (unsigned char)(v | 0x80);
        v >>= 7;
    }
    out[k++] = (unsigned char)v;
    return k;
}

static int
put_varint(Buf *b, uint64_t v)
{
    unsigned char tmp[10];
    return put(b, tmp, varint_bytes(v, tmp));
}

static int
put_key(Buf *b, int field, int wire_type)
{
    return put_varint(b, ((uint64_t)field << 3) | (uint64_t)wire_type);
}

/* The bytes written since `start` become a length-delimited field: key, length, then them. */
static int
wrap(Buf *b, Py_ssize_t start, int field)
{
    unsigned char head[20];
    int k = varint_bytes(((uint64_t)field << 3) | 2, head);
    k += varint_bytes((uint64_t)(b->n - start), head + k);
    if (reserve(b, k) < 0)
        return -1;
    memmove(b->p + start + k, b->p + start, (size_t)(b->n - start));
    memcpy(b->p + start, head, (size_t)k);
    b->n += k;
    return 0;
}

/* protos.record_bytes.string: a proto3 string field, nothing when empty (`always`: written even when empty). */
static int
put_text(Buf *b, int field, PyObject *s, int always)
{
    Py_ssize_t n;
    const char *u = PyUnicode_AsUTF8AndSize(s, &n);
    if (u == NULL)
        return -1;
    if (n == 0 && !always)
        return 0;
    if (put_key(b, field, 2) < 0 || put_varint(b, (uint64_t)n) < 0)
        return -1;
    return put(b, u, n);
}

static int
put_bytes_object(Buf *b, PyObject *bytes)
{
    if (!PyBytes_Check(bytes)) {
        PyErr_Format(PyExc_TypeError, "the encoder returned %.100s, not bytes", Py_TYPE(bytes)->tp_name);
        return -1;
    }
    return put(b, PyBytes_AS_STRING(bytes), PyBytes_GET_SIZE(bytes));
}

/* ------------------------------------------------------------------------------------------------ the walk */
typedef struct {
    PyObject *enc;     /* the npu_agent.records._PayloadEncoder */
    PyObject *grads;   /* ids of the tensors that require grad, or None: none does */
    PyObject *hook;    /* the same as a TensorHook, for enc.value */
    PyObject *metas;   /* enc.metas */
    PyObject *places;  /* enc.places */
} Ctx;

static int put_value(Ctx *c, Buf *b, PyObject *obj, int depth);

static int
requires_grad(Ctx *c, PyObject *t)
{
    if (c->grads == Py_None)
        return 0;
    PyObject *id = PyLong_FromVoidPtr(t);
    if (id == NULL)
        return -1;
    int r = PySequence_Contains(c->grads, id);
    Py_DECREF(id);
    return r;
}

#define MAX_DIMS 64   /* dimensions read here; a tensor with more goes to the Python method */

/* a tuple of n ints */
static int
ints_of(PyObject *seq, long long *out, Py_ssize_t n)
{
    if (!PyTuple_Check(seq) || PyTuple_GET_SIZE(seq) != n)
        return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        out[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
        if (out[i] == -1 && PyErr_Occurred())
            return -1;
    }
    return 1;
}

/* ints_of a new reference (NULL: the error already set), released */
static int
ints_taken(PyObject *seq, long long *out, Py_ssize_t n)
{
    if (seq == NULL)
        return -1;
    int ok = ints_of(seq, out, n);
    Py_DECREF(seq);
    return ok;
}

/* npu_agent.records._clone_stride for a tensor of `ndim` dimensions that is not contiguous: 1 with its own strides
 * in `stride` when its elements are dense (a transpose, channels last: the sizes other than 1, sorted by (stride,
 * size), each stride the product of the sizes before it), 0 when its clone is row-major (a view into a larger
 * storage), -2 where torch decides (4 or 5 dimensions, not dense: the Python method asks it), -1 on error. */
static int
clone_stride(PyObject *t, PyObject *shape, Py_ssize_t ndim, long long *stride)
{
    long long size[MAX_DIMS], key[MAX_DIMS][2];
    if (ndim > MAX_DIMS)
        return -2;
    int ok = ints_taken(PyObject_CallMethodNoArgs(t, s_stride), stride, ndim);
    if (ok <= 0)
        return ok < 0 ? -1 : -2;
    if ((ok = ints_of(shape, size, ndim)) <= 0)
        return ok < 0 ? -1 : -2;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < ndim; i++) {   /* (stride, size) of the sizes other than 1, insertion-sorted */
        if (size[i] == 1)
            continue;
        Py_ssize_t j = n++;
        while (j > 0 && (key[j - 1][0] > stride[i] || (key[j - 1][0] == stride[i] && key[j - 1][1] > size[i]))) {
            key[j][0] = key[j - 1][0];
            key[j][1] = key[j - 1][1];
            j--;
        }
        key[j][0] = stride[i];
        key[j][1] = size[i];
    }
    long long expect = 1;
    for (Py_ssize_t j = 0; j < n; j++) {
        if (key[j][0] != expect)
            return ndim == 4 || ndim == 5 ? -2 : 0;
        expect *= key[j][1];
    }
    return 1;
}

/* _PayloadEncoder.tensor for a strided tensor of an exact class (its clone's strides in the table where it is not
 * contiguous): its index in the table, -2 when this tensor is for the Python method, -1 on error. */
static Py_ssize_t
tensor_here(Ctx *c, PyObject *t, int rg)
{
    PyObject *layout = NULL, *contiguous = NULL, *numel = NULL, *elsize = NULL, *dtype = NULL, *device = NULL;
    PyObject *shape = NULL, *size = NULL, *entry = NULL, *place = NULL, *new_size = NULL;
    PyObject *dtype_name = NULL, *device_name = NULL;
    Py_ssize_t result = -1;
    Buf e = {0};
    if (Py_TYPE(t) != (PyTypeObject *)tensor_type && Py_TYPE(t) != (PyTypeObject *)parameter_type)
        return -2;
    if ((layout = PyObject_GetAttr(t, s_layout)) == NULL)
        goto done;
    if (layout != strided) {
        result = -2;
        goto done;
    }
    if ((contiguous = PyObject_CallMethodNoArgs(t, s_is_contiguous)) == NULL)
        goto done;
    if ((numel = PyObject_CallMethodNoArgs(t, s_numel)) == NULL ||
        (elsize = PyObject_CallMethodNoArgs(t, s_element_size)) == NULL ||
        (dtype = PyObject_GetAttr(t, s_dtype)) == NULL || (device = PyObject_GetAttr(t, s_device)) == NULL ||
        (shape = PyObject_GetAttr(t, s_shape)) == NULL || (size = PyObject_GetAttr(c->enc, s_size)) == NULL)
        goto done;
    long long stride[MAX_DIMS];
    int strided_clone = 0;   /* the table gives the clone's strides */
    if (contiguous != Py_True) {
        strided_clone = PyTuple_Check(shape) ? clone_stride(t, shape, PyTuple_GET_SIZE(shape), stride) : -2;
        if (strided_clone < 0) {
            result = strided_clone == -1 ? -1 : -2;
            goto done;
        }
    }
    dtype_name = PyDict_GetItemWithError(dtype_names, dtype);
    Py_XINCREF(dtype_name);
    device_name = dtype_name ? PyDict_GetItemWithError(device_names, device) : NULL;
    Py_XINCREF(device_name);
    if (device_name == NULL || !PyUnicode_CheckExact(dtype_name) || !PyUnicode_CheckExact(device_name) ||
        !PyTuple_Check(shape)) {
        result = PyErr_Occurred() ? -1 : -2;   /* a name not met yet: the Python method learns it */
        goto done;
    }
    long long n_el = PyLong_AsLongLong(numel), es = PyLong_AsLongLong(elsize), at = PyLong_AsLongLong(size);
    if (PyErr_Occurred())
        goto done;
    long long nbytes = n_el * es;
    long long offset = (at + align - 1) / align * align;
    /* protos.record_bytes.tensor_entry */
    if (put_text(&e, 1, dtype_name, 0) < 0)
        goto done;
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (ndim) {
        Py_ssize_t start = e.n;
        for (Py_ssize_t i = 0; i < ndim; i++) {
            long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
            if (d == -1 && PyErr_Occurred())
                goto done;
            if (put_varint(&e, (uint64_t)d) < 0)
                goto done;
        }
        if (wrap(&e, start, 2) < 0)
            goto done;
    }
    if (strided_clone && ndim) {
        Py_ssize_t start = e.n;
        for (Py_ssize_t i = 0; i < ndim; i++)
            if (put_varint(&e, (uint64_t)stride[i]) < 0)
                goto done;
        if (wrap(&e, start, 3) < 0)
            goto done;
    }
    if (offset && (put_key(&e, 4, 0) < 0 || put_varint(&e, (uint64_t)offset) < 0))
        goto done;
    if (nbytes && (put_key(&e, 5, 0) < 0 || put_varint(&e, (uint64_t)nbytes) < 0))
        goto done;
    if (rg && (put_key(&e, 6, 0) < 0 || put_byte(&e, 1) < 0))
        goto done;
    if (put_text(&e, 7, device_name, 0) < 0 || wrap(&e, 0, 2) < 0)
        goto done;
    if ((entry = PyBytes_FromStringAndSize(e.p, e.n)) == NULL || PyList_Append(c->metas, entry) < 0)
        goto done;
    if ((place = Py_BuildValue("(LLO)", offset, nbytes, t)) == NULL || PyList_Append(c->places, place) < 0)
        goto done;
    if ((new_size = PyLong_FromLongLong(offset + nbytes)) == NULL || PyObject_SetAttr(c->enc, s_size, new_size) < 0)
        goto done;
    result = PyList_GET_SIZE(c->metas) - 1;
done:
    PyMem_Free(e.p);
    Py_XDECREF(layout); Py_XDECREF(contiguous); Py_XDECREF(numel); Py_XDECREF(elsize); Py_XDECREF(dtype);
    Py_XDECREF(device); Py_XDECREF(shape); Py_XDECREF(size); Py_XDECREF(entry); Py_XDECREF(place);
    Py_XDECREF(new_size); Py_XDECREF(dtype_name); Py_XDECREF(device_name);
    return result;
}

static int
put_tensor(Ctx *c, Buf *b, PyObject *t)
{
    int rg = requires_grad(c, t);
    if (rg < 0)
        return -1;
    Py_ssize_t index = tensor_here(c, t, rg);
    if (index == -2) {   /* enc.tensor(t, requires_grad=rg) */
        PyObject *args = PyTuple_Pack(1, t), *kwargs = Py_BuildValue("{OO}", s_requires_grad, rg ? Py_True : Py_False);
        PyObject *method = PyObject_GetAttr(c->enc, s_tensor);
        PyObject *r = (args && kwargs && method) ? PyObject_Call(method, args, kwargs) : NULL;
        Py_XDECREF(args); Py_XDECREF(kwargs); Py_XDECREF(method);
        if (r == NULL)
            return -1;
        index = PyLong_AsSsize_t(r);
        Py_DECREF(r);
        if (index == -1 && PyErr_Occurred())
            return -1;
    }
    if (index < 0)
        return -1;
    if (put_key(b, 6, 0) < 0)
        return -1;
    return put_varint(b, (uint64_t)index);
}

/* enc.value(obj, hook) (or enc.mapping): whatever this file does not write itself */
static int
call_python(Ctx *c, Buf *b, PyObject *method, PyObject *obj)
{
    PyObject *r = PyObject_CallMethodObjArgs(c->enc, method, obj, c->hook, NULL);
    if (r == NULL)
        return -1;
    int rc = put_bytes_object(b, r);
    Py_DECREF(r);
    return rc;
}

static int
put_python(Ctx *c, Buf *b, PyObject *obj)
{
    return call_python(c, b, s_value, obj);
}

static int
put_int(Buf *b, long long v)
{
    uint64_t zigzag = ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
    if (put_key(b, 3, 0) < 0)
        return -1;
    return put_varint(b, zigzag);
}

static int
put_double(Buf *b, double x)
{
    unsigned char le[8];
    if (PyFloat_Pack8(x, (char *)le, 1) < 0)
        return -1;
    if (put_key(b, 4, 1) < 0)
        return -1;
    return put(b, le, 8);
}

/* A Sequence message's body. The training's own list may change while Python code called from here runs (the
 * interpreter lock passes to its thread): each item is read afresh and held, as a Python loop over it does. */
static int
put_items(Ctx *c, Buf *b, PyObject *seq, int depth)
{
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(item);
        Py_ssize_t start = b->n;
        int rc = put_value(c, b, item, depth + 1) < 0 || wrap(b, start, 1) < 0 ? -1 : 0;
        Py_DECREF(item);
        if (rc < 0)
            return -1;
    }
    return 0;
}

static int
str_keys(PyObject *d)
{
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(d, &pos, &k, &v))
        if (!PyUnicode_CheckExact(k))
            return 0;
    return 1;
}

static int
put_mapping(Ctx *c, Buf *b, PyObject *d, int depth)   /* a Mapping message's body: the keys, then the values */
{
    /* the values first, as RecordEncoder.mapping (the same error first where both a value and a key fail) */
    PyObject *values = PyDict_Values(d);   /* a value's own Python code may run: hold them */
    if (values == NULL)
        return -1;
    Buf v = {0};
    int rc = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(values) && rc == 0; i++) {
        Py_ssize_t start = v.n;
        rc = (put_value(c, &v, PyList_GET_ITEM(values, i), depth + 1) < 0 || wrap(&v, start, 2) < 0) ? -1 : 0;
    }
    Py_DECREF(values);
    Py_ssize_t pos = 0;
    PyObject *k, *x;
    while (rc == 0 && PyDict_Next(d, &pos, &k, &x))
        rc = put_text(b, 1, k, 1);
    if (rc == 0 && v.n)
        rc = put(b, v.p, v.n);
    PyMem_Free(v.p);
    return rc;
}

static int
put_size(Ctx *c, Buf *b, PyObject *size)   /* torch.Size: each dimension a Value of an int */
{
    Py_ssize_t start = b->n;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(size); i++) {
        PyObject *d = PyTuple_GET_ITEM(size, i);
        int overflow = 0;
        long long v = PyLong_CheckExact(d) ? PyLong_AsLongLongAndOverflow(d, &overflow) : 0;
        if (!PyLong_CheckExact(d) || overflow || (v == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            b->n = start;
            return put_python(c, b, size);
        }
        Py_ssize_t item = b->n;
        if (put_int(b, v) < 0 || wrap(b, item, 1) < 0)
            return -1;
    }
    return wrap(b, start, 14);
}

/* The Value message of obj (its body), as RecordEncoder.value writes it. */
static int
put_value(Ctx *c, Buf *b, PyObject *obj, int depth)
{
    if (obj == Py_None)
        return put_key(b, 1, 0) < 0 ? -1 : put_byte(b, 1);
    PyTypeObject *tp = Py_TYPE(obj);
    if (PyType_IsSubtype(tp, (PyTypeObject *)tensor_type))
        return put_tensor(c, b, obj);
    if (depth > MAX_DEPTH)
        return put_python(c, b, obj);
    if (PyBool_Check(obj))
        return put_key(b, 2, 0) < 0 ? -1 : put_byte(b, obj == Py_True ? 1 : 0);
    if (PyLong_CheckExact(obj)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (v == -1 && PyErr_Occurred())
            return -1;
        if (!overflow)
            return put_int(b, v);
        double x = PyLong_AsDouble(obj);   /* beyond int64: a double, as float(obj) (OverflowError beyond it) */
        if (x == -1.0 && PyErr_Occurred())
            return -1;
        return put_double(b, x);
    }
    if (PyFloat_CheckExact(obj))
        return put_double(b, PyFloat_AS_DOUBLE(obj));
    if (PyUnicode_CheckExact(obj))
        return put_text(b, 5, obj, 1);
    if (tp == (PyTypeObject *)dtype_type) {   /* by its name, when the table has it */
        PyObject *name = PyDict_GetItemWithError(dtype_names, obj);
        if (name != NULL && PyUnicode_CheckExact(name))
            return put_text(b, 10, name, 1);
        if (PyErr_Occurred())
            return -1;
        return put_python(c, b, obj);
    }
    if (tp == (PyTypeObject *)size_type)
        return put_size(c, b, obj);
    if (PyTuple_CheckExact(obj) || PyList_CheckExact(obj)) {
        Py_ssize_t start = b->n;
        if (put_items(c, b, obj, depth) < 0)
            return -1;
        return wrap(b, start, PyTuple_CheckExact(obj) ? 7 : 8);
    }
    if (PyDict_CheckExact(obj) && str_keys(obj)) {
        Py_ssize_t start = b->n;
        if (put_mapping(c, b, obj, depth) < 0)
            return -1;
        return wrap(b, start, 9);
    }
    return put_python(c, b, obj);
}

/* ------------------------------------------------------------------------------------------- the copy */
/* A strided host tensor, as `gather` reads it: its first element's address, its element size, and its dimensions
 * (size 1 dropped, neighbours that are one run merged), innermost last. */
typedef struct {
    char *addr;
    long long item, ndim;
    long long size[MAX_DIMS], stride[MAX_DIMS];   /* stride in bytes */
} Strided;

static int
truth_of(PyObject *r)
{
    if (r == NULL)
        return -1;
    int truth = PyObject_IsTrue(r);
    Py_DECREF(r);
    return truth;
}

/* 1 with `s` filled when t is a host tensor of an exact class, neither a conjugate nor a negative view, whose
 * elements take exactly nbytes; 0 when not (then the payload's own `copy` converts it); -1 on error. */
static int
strided_of(PyObject *t, long long nbytes, Strided *s)
{
    if (Py_TYPE(t) != (PyTypeObject *)tensor_type && Py_TYPE(t) != (PyTypeObject *)parameter_type)
        return 0;
    int truth = truth_of(PyObject_GetAttr(t, s_is_cpu));
    if (truth != 1)
        return truth;
    for (int i = 0; i < 2; i++) {
        truth = truth_of(PyObject_CallMethodNoArgs(t, i ? s_is_neg : s_is_conj));
        if (truth != 0)
            return truth < 0 ? -1 : 0;
    }
    long long size[MAX_DIMS], stride[MAX_DIMS];
    PyObject *shape = PyObject_GetAttr(t, s_shape);
    if (shape == NULL)
        return -1;
    Py_ssize_t ndim = PyTuple_Check(shape) ? PyTuple_GET_SIZE(shape) : MAX_DIMS + 1;
    int ok = ndim <= MAX_DIMS ? ints_of(shape, size, ndim) : 0;
    Py_DECREF(shape);
    if (ok <= 0)
        return ok;
    if ((ok = ints_taken(PyObject_CallMethodNoArgs(t, s_stride), stride, ndim)) <= 0)
        return ok;
    PyObject *r = PyObject_CallMethodNoArgs(t, s_element_size);
    if (r == NULL)
        return -1;
    long long item = PyLong_AsLongLong(r);
    Py_DECREF(r);
    if (item == -1 && PyErr_Occurred())
        return -1;
    long long numel = 1;
    for (Py_ssize_t i = 0; i < ndim; i++) {
        if (size[i] < 0 || stride[i] < 0)
            return 0;
        numel *= size[i];
    }
    if (item <= 0 || numel * item != nbytes)
        return 0;   /* (resized since the layout: the payload's copy raises) */
    PyObject *ptr = PyObject_CallMethodNoArgs(t, s_data_ptr);
    if (ptr == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_RuntimeError))   /* a wrapper subclass without storage: converted */
            return -1;
        PyErr_Clear();
        return 0;
    }
    s->addr = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(ptr);
    Py_DECREF(ptr);
    if (PyErr_Occurred())
        return -1;
    s->item = item;
    s->ndim = 0;
    for (Py_ssize_t i = 0; i < ndim; i++) {
        if (size[i] == 1)
            continue;
        long long st = stride[i] * item;
        if (s->ndim && s->stride[s->ndim - 1] == st * size[i]) {   /* one run with the dimension before */
            s->size[s->ndim - 1] *= size[i];
            s->stride[s->ndim - 1] = st;
        } else {
            s->size[s->ndim] = size[i];
            s->stride[s->ndim] = st;
            s->ndim++;
        }
    }
    if (s->ndim == 0) {   /* one element */
        s->size[0] = 1;
        s->stride[0] = item;
        s->ndim = 1;
    }
    return 1;
}

/* Bytes [from, to) of a row of elements `step` bytes apart (each `item` bytes), in order, to dst. */
static char *
copy_row(char *dst, const char *src, long long step, long long item, long long from, long long to)
{
    if (step == item) {   /* contiguous */
        memcpy(dst, src + from, (size_t)(to - from));
        return dst + (to - from);
    }
    long long e = from / item, part = from % item;
    if (part) {   /* the end of an element cut at `from` */
        long long n = item - part < to - from ? item - part : to - from;
        memcpy(dst, src + e * step + part, (size_t)n);
        dst += n;
        from += n;
        e++;
    }
    long long full = (to - from) / item;
    const char *p = src + e * step;
    switch (item) {
    case 1:
        for (long long i = 0; i < full; i++, p += step) dst[i] = *p;
        break;
    case 2:
        for (long long i = 0; i < full; i++, p += step) memcpy(dst + 2 * i, p, 2);
        break;
    case 4:
        for (long long i = 0; i < full; i++, p += step) memcpy(dst + 4 * i, p, 4);
        break;
    case 8:
        for (long long i = 0; i < full; i++, p += step) memcpy(dst + 8 * i, p, 8);
        break;
    default:
        for (long long i = 0; i < full; i++, p += step) memcpy(dst + item * i, p, (size_t)item);
    }
    dst += full * item;
    from += full * item;
    if (from < to) {   /* the start of an element cut at `to` */
        memcpy(dst, p, (size_t)(to - from));
        dst += to - from;
    }
    return dst;
}

/* An R x C plane whose element (i, j) is at src + i * s1 + j * s2, to dst in row-major order, in tiles of TILE_ROWS
 * x TILE_COLS elements: where a row's elements lie far apart and a column's close (a transpose), each source cache
 * line is then read once for many rows, not once for every row, and a tile's few columns stay within the cache's
 * ways however their distance aliases. (A 2048 x 2048 float32 transpose on a 2-core EPYC VM: 7.8 ms, 14 ms in 32 x 32
 * tiles, 35 ms row by row; torch's .contiguous() 7.9 ms. bench/encode.py --strided prints such copies.) */
#define TILE_ROWS 64
#define TILE_COLS 8
static void
copy_plane(char *dst, const char *src, long long R, long long C, long long s1, long long s2, long long item)
{
    for (long long i0 = 0; i0 < R; i0 += TILE_ROWS) {
        long long i1 = i0 + TILE_ROWS < R ? i0 + TILE_ROWS : R;
        for (long long j0 = 0; j0 < C; j0 += TILE_COLS) {
            long long n = (j0 + TILE_COLS < C ? TILE_COLS : C - j0) * item;
            for (long long i = i0; i < i1; i++)
                copy_row(dst + (i * C + j0) * item, src + i * s1 + j0 * s2, s2, item, 0, n);
        }
    }
}

/* Bytes [skip, skip + count) of the tensor's elements in row-major order (what `.contiguous()` holds) to dst: the
 * outer dimensions looped over, the inner ones a row, or a plane of rows (copy_plane) where the last dimension's
 * elements lie farther apart than those of the one before it. */
static void
gather(const Strided *s, char *dst, long long skip, long long count)
{
    if (count <= 0)   /* (an empty tensor's plane is 0 bytes) */
        return;
    long long last = s->ndim - 1, item = s->item;
    int tiled = last >= 1 && s->stride[last] != item && s->stride[last - 1] < s->stride[last];
    long long outer = tiled ? last - 1 : last;
    long long R = tiled ? s->size[last - 1] : 1, C = s->size[last];
    long long s1 = tiled ? s->stride[last - 1] : 0, s2 = s->stride[last];
    long long row = C * item, plane = R * row;
    long long idx[MAX_DIMS];
    long long p = skip / plane, at = skip % plane;
    for (long long d = outer - 1; d >= 0; d--) {   /* the plane's index over the outer dimensions */
        idx[d] = p % s->size[d];
        p /= s->size[d];
    }
    while (count > 0) {
        const char *src = s->addr;
        for (long long d = 0; d < outer; d++)
            src += idx[d] * s->stride[d];
        if (R > 1 && at == 0 && count >= plane) {
            copy_plane(dst, src, R, C, s1, s2, item);
            dst += plane;
            count -= plane;
        } else {   /* a part of a plane: its rows */
            long long end = at + count < plane ? at + count : plane;
            while (at < end) {
                long long r = at / row, from = at % row, to = end - r * row < row ? end - r * row : row;
                dst = copy_row(dst, src + r * s1, s2, item, from, to);
                count -= to - from;
                at = r * row + to;
            }
        }
        at = 0;
        for (long long d = outer - 1; d >= 0; d--) {   /* the next plane */
            if (++idx[d] < s->size[d])
                break;
            idx[d] = 0;
        }
    }
}

/* gather, letting the training's thread run meanwhile for a large copy */
static void
copy_elements(const Strided *s, char *dst, long long skip, long long count)
{
    if (count >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        gather(s, dst, skip, count);
        Py_END_ALLOW_THREADS
    } else {
        gather(s, dst, skip, count);
    }
}

/* gather(tensor, nbytes, addr, skip, count) -> bool */
static PyObject *
fe_gather(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError, "gather(tensor, nbytes, addr, skip, count) takes 5 arguments (%zd given)", nargs);
        return NULL;
    }
    long long nbytes = PyLong_AsLongLong(args[1]);
    unsigned long long addr = PyLong_AsUnsignedLongLong(args[2]);
    long long skip = PyLong_AsLongLong(args[3]), count = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (skip < 0 || count < 0 || skip + count > nbytes || !addr) {
        PyErr_SetString(PyExc_ValueError, "gather: bytes [skip, skip + count) must lie within the tensor's nbytes");
        return NULL;
    }
    Strided s;
    int ok = strided_of(args[0], nbytes, &s);
    if (ok < 0)
        return NULL;
    if (ok == 0)
        Py_RETURN_FALSE;
    copy_elements(&s, (char *)(uintptr_t)addr, skip, count);
    Py_RETURN_TRUE;
}

/* _PayloadEncoder.copy_into's loop: each place's tensor (or its copy-on-write source) into the target. */
static PyObject *
fe_copy_places(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "copy_places(target, places, source, addr) takes 4 arguments (%zd given)",
                     nargs);
        return NULL;
    }
    PyObject *target = args[0], *places = args[1], *source = args[2];
    unsigned long long base = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyList_Check(places) || !PyDict_Check(source)) {
        PyErr_SetString(PyExc_TypeError, "copy_places needs a list of places and a dict of sources");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(places); i++) {
        PyObject *place = PyList_GET_ITEM(places, i);   /* the encoder's own list: only this thread uses it */
        if (!PyTuple_Check(place) || PyTuple_GET_SIZE(place) != 3) {
            PyErr_SetString(PyExc_TypeError, "a place is (offset, nbytes, tensor)");
            return NULL;
        }
        long long off = PyLong_AsLongLong(PyTuple_GET_ITEM(place, 0));
        long long nbytes = PyLong_AsLongLong(PyTuple_GET_ITEM(place, 1));
        if (PyErr_Occurred())
            return NULL;
        if (!nbytes)
            continue;
        PyObject *t = PyTuple_GET_ITEM(place, 2);
        PyObject *id = PyLong_FromVoidPtr(t);
        if (id == NULL)
            return NULL;
        PyObject *src = PyDict_GetItemWithError(source, id);   /* borrowed */
        Py_DECREF(id);
        if (src == NULL && PyErr_Occurred())
            return NULL;
        if (src == NULL)
            src = t;
        Py_INCREF(src);
        Strided st;
        int ok = base ? strided_of(src, nbytes, &st) : 0;
        if (ok > 0) {   /* a host tensor, contiguous or not: its elements written in order */
            copy_elements(&st, (char *)(uintptr_t)base + off, 0, nbytes);
        } else if (ok == 0) {   /* target.copy(off, nbytes, src, gather): a payload in pieces, another device or
                                 * class; gather only for the pieces (it reads no tensor strided_of refused) */
            PyObject *r = PyObject_CallMethod(target, "copy", "LLOO", off, nbytes, src, base ? Py_None : gather_fn);
            if (r == NULL)
                ok = -1;
            Py_XDECREF(r);
        }
        Py_DECREF(src);
        if (ok < 0)
            return NULL;
    }
    Py_RETURN_NONE;
}

/* ------------------------------------------------------------------------------------------ the Record */
/* protos.record_bytes.uint: nothing when the int is 0, else the key and its low 64 bits as a varint */
static int
put_uint(Buf *b, int field, PyObject *n)
{
    if (!PyLong_Check(n)) {
        PyErr_Format(PyExc_TypeError, "field %d: an int is needed, not %.100s", field, Py_TYPE(n)->tp_name);
        return -1;
    }
    int truth = PyObject_IsTrue(n);
    if (truth <= 0)
        return truth;
    uint64_t v = (uint64_t)PyLong_AsUnsignedLongLongMask(n);
    if (v == (uint64_t)-1 && PyErr_Occurred())
        return -1;
    if (put_key(b, field, 0) < 0)
        return -1;
    return put_varint(b, v);
}

/* The Record's bytes: its header (run id, rank, step, seq, name, direction, module, source), the tensor table,
 * the payload's size, then the rest of its fields as written already, in number order. */
static PyObject *
fe_record(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 8 || !PyList_Check(args[1]) ||
        !PyTuple_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "record((run_id, rank, step, seq, name, direction, module, source), metas, "
                                         "size, (bytes, ...))");
        return NULL;
    }
    PyObject *const *h = &PyTuple_GET_ITEM(args[0], 0);
    Buf b = {0};
    int rc = 0;
    for (int i = 0; i < 8 && rc == 0; i++) {
        int field = i + 1;
        if (i == 0 || i == 4 || i == 6 || i == 7) {
            if (!PyUnicode_Check(h[i])) {
                PyErr_Format(PyExc_TypeError, "header field %d: a str is needed", field);
                rc = -1;
            } else {
                rc = put_text(&b, field, h[i], 0);
            }
        } else {
            rc = put_uint(&b, field, h[i]);
        }
    }
    if (rc == 0)
        rc = wrap(&b, 0, 1);
    PyObject *metas = args[1], *tail = args[3];
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(metas) && rc == 0; i++)
        rc = put_bytes_object(&b, PyList_GET_ITEM(metas, i));
    if (rc == 0)
        rc = put_uint(&b, 3, args[2]);
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(tail) && rc == 0; i++)
        rc = put_bytes_object(&b, PyTuple_GET_ITEM(tail, i));
    PyObject *out = rc < 0 ? NULL : PyBytes_FromStringAndSize(b.p ? b.p : "", b.n);
    PyMem_Free(b.p);
    return out;
}

/* ------------------------------------------------------------------------------------------- the module */
static int
begin(Ctx *c, PyObject *const *args, Py_ssize_t nargs, const char *name)
{
    if (tensor_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "npu_agent._fastencode: configure() was not called");
        return -1;
    }
    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError, "%s(enc, obj, grads, hook) takes 4 arguments (%zd given)", name, nargs);
        return -1;
    }
    c->enc = args[0];
    c->grads = args[2];
    c->hook = args[3];
    c->metas = PyObject_GetAttr(c->enc, s_metas);
    c->places = c->metas ? PyObject_GetAttr(c->enc, s_places) : NULL;
    if (c->places == NULL)
        return -1;
    if (!PyList_Check(c->metas) || !PyList_Check(c->places)) {
        PyErr_SetString(PyExc_TypeError, "enc.metas and enc.places must be lists");
        return -1;
    }
    return 0;
}

static PyObject *
finish(Ctx *c, Buf *b, int rc)
{
    Py_XDECREF(c->metas);
    Py_XDECREF(c->places);
    PyObject *out = rc < 0 ? NULL : PyBytes_FromStringAndSize(b->p ? b->p : "", b->n);
    PyMem_Free(b->p);
    return out;
}

static int
body_value(Ctx *c, Buf *b, PyObject *obj)
{
    return put_value(c, b, obj, 0);
}

static int
body_sequence(Ctx *c, Buf *b, PyObject *items)
{
    PyObject *seq = PySequence_Fast(items, "sequence() needs a sequence");
    if (seq == NULL)
        return -1;
    int rc = put_items(c, b, seq, 0);
    Py_DECREF(seq);
    return rc;
}

static int
body_mapping(Ctx *c, Buf *b, PyObject *d)
{
    if (PyDict_CheckExact(d) && str_keys(d))
        return put_mapping(c, b, d, 0);
    return call_python(c, b, s_mapping, d);   /* RecordEncoder.mapping itself */
}

/* value(enc, obj, grads, hook), sequence(...) and mapping(...): one walk each over args[1] */
static PyObject *
walk(PyObject *const *args, Py_ssize_t nargs, const char *name, int (*body)(Ctx *, Buf *, PyObject *))
{
    Ctx c = {0};
    Buf b = {0};
    if (begin(&c, args, nargs, name) < 0)
        return finish(&c, &b, -1);
    return finish(&c, &b, body(&c, &b, args[1]));
}

static PyObject *
fe_value(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    return walk(args, nargs, "value", body_value);
}

static PyObject *
fe_sequence(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    return walk(args, nargs, "sequence", body_sequence);
}

static PyObject *
fe_mapping(PyObject *m, PyObject *const *args, Py_ssize_t nargs)
{
    return walk(args, nargs, "mapping", body_mapping);
}

static PyObject *
fe_configure(PyObject *m, PyObject *args)
{
    PyObject *t, *p, *s, *dt, *st, *dn, *vn;
    long long al;
    if (!PyArg_ParseTuple(args, "OOOOOO!O!L", &t, &p, &s, &dt, &st, &PyDict_Type, &dn, &PyDict_Type, &vn, &al))
        return NULL;
    if (!PyType_Check(t) || !PyType_Check(p) || !PyType_Check(s) || !PyType_Check(dt) || al < 1) {
        PyErr_SetString(PyExc_TypeError, "configure(Tensor, Parameter, Size, dtype, strided, dtype names, device "
                                         "names, alignment >= 1)");
        return NULL;
    }
    Py_INCREF(t); Py_XSETREF(tensor_type, t);
    Py_INCREF(p); Py_XSETREF(parameter_type, p);
    Py_INCREF(s); Py_XSETREF(size_type, s);
    Py_INCREF(dt); Py_XSETREF(dtype_type, dt);
    Py_INCREF(st); Py_XSETREF(strided, st);
    Py_INCREF(dn); Py_XSETREF(dtype_names, dn);
    Py_INCREF(vn); Py_XSETREF(device_names, vn);
    align = al;
    Py_RETURN_NONE;
}

static PyMethodDef fe_methods[] = {
    {"configure", fe_configure, METH_VARARGS,
     "configure(torch.Tensor, torch.nn.Parameter, torch.Size, torch.dtype, torch.strided, dtype -> name dict, "
     "device -> name dict, payload alignment): the types and tables the walk reads (the dicts are the Python "
     "path's own)"},
    {"value", (PyCFunction)(void (*)(void))fe_value, METH_FASTCALL,
     "value(enc, obj, grads, hook) -> bytes: RecordEncoder.value(obj, hook) for enc; grads: ids of the tensors "
     "that require grad, or None"},
    {"sequence", (PyCFunction)(void (*)(void))fe_sequence, METH_FASTCALL,
     "sequence(enc, items, grads, hook) -> bytes: RecordEncoder.sequence(items, hook)"},
    {"mapping", (PyCFunction)(void (*)(void))fe_mapping, METH_FASTCALL,
     "mapping(enc, dict, grads, hook) -> bytes: RecordEncoder.mapping(dict, hook)"},
    {"record", (PyCFunction)(void (*)(void))fe_record, METH_FASTCALL,
     "record((run_id, rank, step, seq, name, direction, module, source), metas, size, tail) -> bytes: the "
     "Record's bytes, its header, its tensor table and payload size, then the bytes of `tail` (its other fields)"},
    {"copy_places", (PyCFunction)(void (*)(void))fe_copy_places, METH_FASTCALL,
     "copy_places(target, places, source, addr): each (offset, nbytes, tensor) of places, its tensor or "
     "source[id(tensor)], written at offset: its elements in row-major order to addr + offset where addr is the "
     "target's one span and the tensor lies in host memory (as gather), else by target.copy(offset, nbytes, tensor, "
     "gather) (addr 0: always; with addr, another device or class: gather None)"},
    {"gather", (PyCFunction)(void (*)(void))fe_gather, METH_FASTCALL,
     "gather(tensor, nbytes, addr, skip, count) -> bool: bytes [skip, skip + count) of a host tensor's elements in "
     "row-major order (what its .contiguous() holds) written to addr; False, with nothing written, for a tensor "
     "this does not read (another device or class, a conjugate or negative view, not nbytes of elements)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fe_module = {
    PyModuleDef_HEAD_INIT, "npu_agent._fastencode", "A record's values and tensor table as protobuf bytes, in C.",
    -1, fe_methods,
};

PyMODINIT_FUNC
PyInit__fastencode(void)
{
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_layout, "layout"); INTERN(s_is_contiguous, "is_contiguous"); INTERN(s_numel, "numel");
    INTERN(s_element_size, "element_size"); INTERN(s_dtype, "dtype"); INTERN(s_device, "device");
    INTERN(s_shape, "shape"); INTERN(s_metas, "metas"); INTERN(s_places, "places"); INTERN(s_size, "size");
    INTERN(s_tensor, "tensor"); INTERN(s_value, "value"); INTERN(s_mapping, "mapping");
    INTERN(s_requires_grad, "requires_grad");
    INTERN(s_is_cpu, "is_cpu"); INTERN(s_is_conj, "is_conj"); INTERN(s_is_neg, "is_neg");
    INTERN(s_data_ptr, "data_ptr"); INTERN(s_stride, "stride");
#undef INTERN
    PyObject *module = PyModule_Create(&fe_module);
    if (module == NULL)
        return NULL;
    gather_fn = PyObject_GetAttrString(module, "gather");
    if (gather_fn == NULL) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
