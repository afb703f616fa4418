/* A record's header and values read off its protobuf bytes, in C (docs/design.md §6.2, "Records decoded in C").
 *
 * gpu_server.decode.decode_job turns a Record into a Job. In Python most of a small record's decoding is reading
 * protobuf fields one at a time (each a wrapper object: 20-30 us for a record of one 4 KiB tensor on the test VMs,
 * bench/intake.py). The functions here read the same fields straight from the record's bytes, as
 * Record.SerializeToString() gives them:
 *   head(raw)    the header's fields, each tensor meta's bytes (the key protos.codec.RecordDecoder checks a meta
 *                under), the payload size, the scalar fields and where the five values (args, kwargs, output,
 *                grad_output, grad_input) lie in `raw`;
 *   values(raw, spans, tensor, dtypes, max_values, max_depth, max_string_len)
 *                those values rebuilt as RecordDecoder.value and .mapping rebuild them, in the same order and
 *                under the same limits, `tensor(i)` called for each tensor index (RecordDecoder.tensor);
 *   peak(raw, base, factors, header_factor)
 *                the record's estimated checking peak, as gpu_server.intake.budget.check_peak gives it (the
 *                intake reserves it before the record is decoded).
 *
 * Only the common cases are read here: a record without a Random or a Collective field, values that are None,
 * bool, int, float, str, a tensor, a tuple, list or named tuple of values, a str-keyed dict, or a dtype named in
 * `dtypes`. Anything else (another kind of value, a field this file does not know, a field given twice, a value
 * beyond a limit, a string that is not UTF-8, a `tensor` call that raises; for `peak`, a field it does not know, a
 * tree of a million values, an estimate beyond 64 bits) makes the function return None, and the whole record is
 * decoded (or estimated) in Python, which accepts or refuses it with its own message: so the two paths cannot differ
 * by design, and tests/test_fastdecode.py checks that they give the same jobs and estimates.
 *
 * Build: `python -m gpu_server.compiled --build` (scripts/setup.sh runs it). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#define OK 0
#define BAIL 1          /* not a common case: the caller decodes the record in Python */
#define FAIL (-1)       /* a Python error is set (out of memory) */

typedef struct {
    const uint8_t *p, *end;
} Cur;

static int
varint(Cur *c, uint64_t *out)
{
    uint64_t v = 0;
    for (int shift = 0; shift < 64 && c->p < c->end; shift += 7) {
        uint8_t b = *c->p++;
        v |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *out = v;
            return OK;
        }
    }
    return BAIL;
}

/* The next field's number and wire type; BAIL at a malformed tag. */
static int
tag(Cur *c, uint32_t *field, int *wire)
{
    uint64_t t;
    if (varint(c, &t) != OK || (t >> 3) == 0 || (t >> 3) > 0x1fffffff)
        return BAIL;
    *field = (uint32_t)(t >> 3);
    *wire = (int)(t & 7);
    return OK;
}

/* A length-delimited field's bytes (wire type 2). */
static int
span(Cur *c, Cur *out)
{
    uint64_t n;
    if (varint(c, &n) != OK || n > (uint64_t)(c->end - c->p))
        return BAIL;
    out->p = c->p;
    out->end = c->p + n;
    c->p += n;
    return OK;
}

static PyObject *
text(Cur s)
{
    PyObject *u = PyUnicode_DecodeUTF8((const char *)s.p, s.end - s.p, NULL);
    if (u == NULL && PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
        PyErr_Clear();   /* the caller bails: Python says what is wrong with it */
    return u;
}

/* ------------------------------------------------------------------------------------------------ head */

#define N_SPANS 5   /* args, kwargs, output, grad_output, grad_input: Record fields 4, 5, 6, 11, 12 */

typedef struct {
    PyObject *run_id, *name, *module, *source;
    uint64_t rank, step, seq;
    int64_t direction;
    int seen[9];
} Header;

static int
header(Cur c, Header *h)
{
    uint32_t f;
    int w;
    while (c.p < c.end) {
        if (tag(&c, &f, &w) != OK || f > 8 || h->seen[f]++)
            return BAIL;
        if (f == 1 || f == 5 || f == 7 || f == 8) {
            Cur s;
            if (w != 2 || span(&c, &s) != OK)
                return BAIL;
            PyObject *u = text(s);
            if (u == NULL)
                return PyErr_Occurred() ? FAIL : BAIL;
            PyObject **slot = f == 1 ? &h->run_id : f == 5 ? &h->name : f == 7 ? &h->module : &h->source;
            Py_XSETREF(*slot, u);
        } else {
            uint64_t v;
            if (w != 0 || varint(&c, &v) != OK)
                return BAIL;
            if (f == 2)
                h->rank = (uint32_t)v;
            else if (f == 3)
                h->step = v;
            else if (f == 4)
                h->seq = v;
            else
                h->direction = (int32_t)v;   /* an enum: int32 on the wire (a negative one in ten bytes) */
        }
    }
    return OK;
}

/* Autocast: (enabled, dtype, device_type). */
static int
autocast(Cur c, int *enabled, PyObject **dtype, PyObject **device)
{
    uint32_t f;
    int w, seen[4] = {0, 0, 0, 0};
    while (c.p < c.end) {
        if (tag(&c, &f, &w) != OK || f > 3 || seen[f]++)
            return BAIL;
        if (f == 1) {
            uint64_t v;
            if (w != 0 || varint(&c, &v) != OK)
                return BAIL;
            *enabled = v != 0;
        } else {
            Cur s;
            if (w != 2 || span(&c, &s) != OK)
                return BAIL;
            PyObject *u = text(s);
            if (u == NULL)
                return PyErr_Occurred() ? FAIL : BAIL;
            Py_XSETREF(*(f == 2 ? dtype : device), u);
        }
    }
    return OK;
}

/* Record.grad_input_positions (repeated uint32): one varint (wire type 0) or a packed run of them (2). */
static int
add_positions(PyObject *positions, Cur *c, int wire)
{
    Cur run = *c;
    if (wire == 2 ? span(c, &run) != OK : wire != 0)
        return BAIL;
    do {
        uint64_t v;
        if (varint(&run, &v) != OK)
            return BAIL;
        PyObject *n = PyLong_FromUnsignedLong((uint32_t)v);
        int bad = n == NULL || PyList_Append(positions, n) < 0;
        Py_XDECREF(n);
        if (bad)
            return FAIL;
    } while (wire == 2 && run.p < run.end);
    if (wire == 0)
        c->p = run.p;
    return OK;
}

static PyObject *
fd_head(PyObject *self, PyObject *arg)
{
    Py_buffer buf;
    if (PyObject_GetBuffer(arg, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    Cur c = {(const uint8_t *)buf.buf, (const uint8_t *)buf.buf + buf.len};
    const uint8_t *base = c.p;
    Header h;
    memset(&h, 0, sizeof h);
    PyObject *keys = PyList_New(0), *positions = PyList_New(0), *skip = NULL, *ac_dtype = NULL, *ac_device = NULL;
    PyObject *result = NULL;
    uint64_t payload_bytes = 0, threads = 0;
    int grad_enabled = 0, inplace = 0, backward_expected = 0, ac_enabled = 0, rc = OK;
    int seen[17];
    Py_ssize_t spans[N_SPANS][2];
    memset(seen, 0, sizeof seen);
    for (int i = 0; i < N_SPANS; i++)
        spans[i][0] = -1;
    if (keys == NULL || positions == NULL) {
        rc = FAIL;
        goto done;
    }
    while (c.p < c.end && rc == OK) {
        uint32_t f;
        int w;
        if (tag(&c, &f, &w) != OK || f > 16 || f == 10) {   /* 10 Random, 17 Collective and unknown: Python */
            rc = BAIL;
            break;
        }
        if (f != 2 && f != 15 && seen[f]++) {   /* a field given twice: Python's merge rules apply */
            rc = BAIL;
            break;
        }
        if (f == 15) {
            rc = add_positions(positions, &c, w);
            continue;
        }
        if (f == 3 || f == 7 || f == 9 || f == 13 || f == 16) {
            uint64_t v;
            if (w != 0 || varint(&c, &v) != OK) {
                rc = BAIL;
                break;
            }
            if (f == 3)
                payload_bytes = v;
            else if (f == 7)
                grad_enabled = v != 0;
            else if (f == 9)
                inplace = v != 0;
            else if (f == 13)
                backward_expected = v != 0;
            else
                threads = (uint32_t)v;
            continue;
        }
        Cur s;
        if (w != 2 || span(&c, &s) != OK) {
            rc = BAIL;
            break;
        }
        if (f == 1) {
            rc = header(s, &h);
        } else if (f == 2) {
            PyObject *key = PyBytes_FromStringAndSize((const char *)s.p, s.end - s.p);
            rc = key == NULL || PyList_Append(keys, key) < 0 ? FAIL : OK;
            Py_XDECREF(key);
        } else if (f == 8) {
            rc = autocast(s, &ac_enabled, &ac_dtype, &ac_device);
        } else if (f == 14) {
            PyObject *u = text(s);
            if (u == NULL)
                rc = PyErr_Occurred() ? FAIL : BAIL;
            Py_XSETREF(skip, u);
        } else {
            int i = f == 4 ? 0 : f == 5 ? 1 : f == 6 ? 2 : f == 11 ? 3 : 4;
            spans[i][0] = s.p - base;
            spans[i][1] = s.end - base;
        }
    }
    if (rc != OK)
        goto done;
    PyObject *span_tuple = PyTuple_New(N_SPANS);
    if (span_tuple == NULL) {
        rc = FAIL;
        goto done;
    }
    for (int i = 0; i < N_SPANS; i++) {
        PyObject *item = spans[i][0] < 0 ? Py_NewRef(Py_None) : Py_BuildValue("(nn)", spans[i][0], spans[i][1]);
        if (item == NULL) {
            Py_DECREF(span_tuple);
            rc = FAIL;
            goto done;
        }
        PyTuple_SET_ITEM(span_tuple, i, item);
    }
#define STR(o) ((o) != NULL ? Py_NewRef(o) : PyUnicode_FromStringAndSize("", 0))
    result = Py_BuildValue("(NKKKNLNNOKN(NNN)NNNNKN)",
                           STR(h.run_id), (unsigned long long)h.rank, (unsigned long long)h.step,
                           (unsigned long long)h.seq, STR(h.name), (long long)h.direction,
                           STR(h.module), STR(h.source), keys, (unsigned long long)payload_bytes,
                           PyBool_FromLong(grad_enabled), PyBool_FromLong(ac_enabled), STR(ac_dtype), STR(ac_device),
                           PyBool_FromLong(inplace), PyBool_FromLong(backward_expected), STR(skip),
                           PyList_AsTuple(positions), (unsigned long long)threads, span_tuple);
#undef STR
    if (result == NULL)
        rc = FAIL;
done:
    Py_XDECREF(h.run_id);
    Py_XDECREF(h.name);
    Py_XDECREF(h.module);
    Py_XDECREF(h.source);
    Py_XDECREF(keys);
    Py_XDECREF(positions);
    Py_XDECREF(skip);
    Py_XDECREF(ac_dtype);
    Py_XDECREF(ac_device);
    PyBuffer_Release(&buf);
    if (rc == FAIL)
        return NULL;
    if (rc == BAIL) {
        Py_XDECREF(result);
        Py_RETURN_NONE;
    }
    return result;
}

/* ---------------------------------------------------------------------------------------------- values */

typedef struct {
    PyObject *tensor, *dtypes;
    long long count, max_values, max_depth, max_string;
} Ctx;

static int value(Ctx *x, Cur c, long long depth, PyObject **out);

/* A str within the string limit (RecordDecoder._string), or BAIL. */
static int
string(Ctx *x, Cur s, PyObject **out)
{
    PyObject *u = text(s);
    if (u == NULL)
        return PyErr_Occurred() ? FAIL : BAIL;
    if (PyUnicode_GET_LENGTH(u) > x->max_string) {
        Py_DECREF(u);
        return BAIL;
    }
    *out = u;
    return OK;
}

/* A Sequence's items (field 1, each a Value) as a list, each read at `depth`. */
static int
sequence(Ctx *x, Cur c, long long depth, PyObject **out)
{
    PyObject *items = PyList_New(0);
    if (items == NULL)
        return FAIL;
    while (c.p < c.end) {
        uint32_t f;
        int w, rc;
        Cur s;
        PyObject *item;
        if (tag(&c, &f, &w) != OK || f != 1 || w != 2 || span(&c, &s) != OK) {
            Py_DECREF(items);
            return BAIL;
        }
        if ((rc = value(x, s, depth, &item)) != OK) {
            Py_DECREF(items);
            return rc;
        }
        rc = PyList_Append(items, item);
        Py_DECREF(item);
        if (rc < 0) {
            Py_DECREF(items);
            return FAIL;
        }
    }
    *out = items;
    return OK;
}

/* The next field `want` of a Mapping (1: a key, 2: a value) from `c` on: 1 found, 0 none left, BAIL otherwise. */
static int
next_of(Cur *c, uint32_t want, Cur *s)
{
    while (c->p < c->end) {
        uint32_t f;
        int w;
        Cur skip;
        if (tag(c, &f, &w) != OK || (f != 1 && f != 2) || w != 2 || span(c, &skip) != OK)
            return -BAIL;
        if (f == want) {
            *s = skip;
            return 1;
        }
    }
    return 0;
}

/* A Mapping as RecordDecoder.mapping(m, depth) reads it: its values at depth + 1. */
static int
mapping(Ctx *x, Cur c, long long depth, PyObject **out)
{
    PyObject *d = PyDict_New();
    if (d == NULL)
        return FAIL;
    Cur keys = c, vals = c;
    for (;;) {
        Cur ks, vs;
        int k = next_of(&keys, 1, &ks), v = next_of(&vals, 2, &vs), rc;
        if (k != v || k < 0) {   /* as many keys as values, or Python says what is wrong */
            Py_DECREF(d);
            return BAIL;
        }
        if (k == 0)
            break;
        PyObject *key, *item;
        if ((rc = string(x, ks, &key)) != OK) {
            Py_DECREF(d);
            return rc;
        }
        if ((rc = value(x, vs, depth + 1, &item)) != OK) {
            Py_DECREF(key);
            Py_DECREF(d);
            return rc;
        }
        rc = PyDict_SetItem(d, key, item);
        Py_DECREF(key);
        Py_DECREF(item);
        if (rc < 0) {
            Py_DECREF(d);
            return FAIL;
        }
    }
    *out = d;
    return OK;
}

/* One Value as RecordDecoder.value(v, depth) reads it. */
static int
value(Ctx *x, Cur c, long long depth, PyObject **out)
{
    if (++x->count > x->max_values || depth > x->max_depth)
        return BAIL;
    if (c.p == c.end) {   /* no kind set */
        *out = Py_NewRef(Py_None);
        return OK;
    }
    uint32_t f;
    int w, rc;
    uint64_t v;
    Cur s;
    if (tag(&c, &f, &w) != OK)
        return BAIL;
    switch (f) {
    case 1: case 2: case 3: case 6:   /* none, b, i, tensor */
        if (w != 0 || varint(&c, &v) != OK || c.p != c.end)
            return BAIL;
        if (f == 1) {
            *out = Py_NewRef(Py_None);
        } else if (f == 2) {
            *out = PyBool_FromLong(v != 0);
        } else if (f == 3) {
            *out = PyLong_FromLongLong((long long)((v >> 1) ^ (~(v & 1) + 1)));   /* sint64: zigzag */
        } else {
            PyObject *index = PyLong_FromUnsignedLong((uint32_t)v);
            if (index == NULL)
                return FAIL;
            *out = PyObject_CallOneArg(x->tensor, index);
            Py_DECREF(index);
            if (*out == NULL) {   /* RecordDecoder.tensor refused it: Python decodes the record and says why */
                PyErr_Clear();
                return BAIL;
            }
        }
        return *out == NULL ? FAIL : OK;
    case 4: {   /* f: a double */
        double d;
        if (w != 1 || c.end - c.p != 8)
            return BAIL;
        memcpy(&d, c.p, 8);   /* the wire is little-endian, as every host protos.codec runs on */
        *out = PyFloat_FromDouble(d);
        return *out == NULL ? FAIL : OK;
    }
    case 5: case 10:   /* s, dtype */
        if (w != 2 || span(&c, &s) != OK || c.p != c.end)
            return BAIL;
        if (f == 5)
            return string(x, s, out);
        {
            PyObject *name = text(s), *dtype;
            if (name == NULL)
                return PyErr_Occurred() ? FAIL : BAIL;
            dtype = PyDict_GetItemWithError(x->dtypes, name);
            Py_DECREF(name);
            if (dtype == NULL)
                return PyErr_Occurred() ? FAIL : BAIL;
            *out = Py_NewRef(dtype);
            return OK;
        }
    case 7: case 8: case 19: case 9: {   /* tuple, list, named tuple; dict */
        PyObject *items;
        if (w != 2 || span(&c, &s) != OK || c.p != c.end)
            return BAIL;
        if (f == 9)
            return mapping(x, s, depth + 1, out);
        if ((rc = sequence(x, s, depth + 1, &items)) != OK)
            return rc;
        if (f == 8) {
            *out = items;
            return OK;
        }
        *out = PyList_AsTuple(items);
        Py_DECREF(items);
        return *out == NULL ? FAIL : OK;
    }
    default:   /* size, device, slice, ellipsis, complex, memory format, layout, opaque: Python */
        return BAIL;
    }
}

static PyObject *
fd_values(PyObject *self, PyObject *args)
{
    PyObject *raw, *spans, *out[N_SPANS] = {NULL, NULL, NULL, NULL, NULL};
    Ctx x = {NULL, NULL, 0, 0, 0, 0};
    if (!PyArg_ParseTuple(args, "OO!OO!LLL", &raw, &PyTuple_Type, &spans, &x.tensor, &PyDict_Type, &x.dtypes,
                          &x.max_values, &x.max_depth, &x.max_string))
        return NULL;
    if (PyTuple_GET_SIZE(spans) != N_SPANS) {
        PyErr_SetString(PyExc_ValueError, "values: five spans expected (args, kwargs, output, grad_output, "
                        "grad_input)");
        return NULL;
    }
    Py_buffer buf;
    if (PyObject_GetBuffer(raw, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    const uint8_t *base = (const uint8_t *)buf.buf;
    int rc = OK;
    for (int i = 0; i < N_SPANS && rc == OK; i++) {
        PyObject *where = PyTuple_GET_ITEM(spans, i);
        Py_ssize_t a, b;
        if (where == Py_None) {
            out[i] = i == 0 ? PyList_New(0) : i == 1 ? PyDict_New() : Py_NewRef(Py_None);
            rc = out[i] == NULL ? FAIL : OK;
            continue;
        }
        if (!PyArg_ParseTuple(where, "nn", &a, &b)) {
            rc = FAIL;
            break;
        }
        if (a < 0 || a > b || b > buf.len) {
            PyErr_SetString(PyExc_ValueError, "values: a span outside the record's bytes");
            rc = FAIL;
            break;
        }
        Cur c = {base + a, base + b};
        /* as decode_job reads them: args' items at depth 0, kwargs through mapping (its values at depth 1), the
         * other three as values at depth 0 */
        rc = i == 0 ? sequence(&x, c, 0, &out[i]) : i == 1 ? mapping(&x, c, 0, &out[i]) : value(&x, c, 0, &out[i]);
    }
    PyBuffer_Release(&buf);
    PyObject *result = NULL;
    if (rc == OK) {
        PyObject *args_tuple = PyList_AsTuple(out[0]);
        if (args_tuple != NULL)
            result = Py_BuildValue("(NOOOO)", args_tuple, out[1], out[2], out[3], out[4]);
    }
    for (int i = 0; i < N_SPANS; i++)
        Py_XDECREF(out[i]);
    if (rc == BAIL)
        Py_RETURN_NONE;
    return result;
}

/* ------------------------------------------------------------------------------------------------ peak */

/* Skips one field of wire type `wire`. */
static int
skip_field(Cur *c, int wire)
{
    uint64_t v;
    Cur s;
    switch (wire) {
    case 0:
        return varint(c, &v);
    case 1: case 5: {
        Py_ssize_t n = wire == 1 ? 8 : 4;
        if (c->end - c->p < n)
            return BAIL;
        c->p += n;
        return OK;
    }
    case 2:
        return span(c, &s);
    default:
        return BAIL;
    }
}

#define MAX_WALKED 1000000   /* values budget.check_peak walks at most */

typedef struct {
    uint32_t *items;
    Py_ssize_t n, cap;
    long long walked;
} Indices;

/* The tensor indices of a Value tree into `ix`, as budget._compared_tensors collects them (tensors in tuples,
 * lists, sizes, named tuples and dict values; other kinds hold none). */
static int
tensor_indices(Cur c, Indices *ix, int depth)
{
    if (++ix->walked >= MAX_WALKED || depth > 200)   /* Python's walk stops there: let it */
        return BAIL;
    if (c.p == c.end)
        return OK;
    uint32_t f;
    int w;
    if (tag(&c, &f, &w) != OK)
        return BAIL;
    if (f == 6) {
        uint64_t v;
        if (w != 0 || varint(&c, &v) != OK || c.p != c.end)
            return BAIL;
        if (ix->n == ix->cap) {
            Py_ssize_t cap = ix->cap ? 2 * ix->cap : 16;
            uint32_t *grown = PyMem_Realloc(ix->items, cap * sizeof(uint32_t));
            if (grown == NULL) {
                PyErr_NoMemory();
                return FAIL;
            }
            ix->items = grown;
            ix->cap = cap;
        }
        ix->items[ix->n++] = (uint32_t)v;
        return OK;
    }
    if (f == 7 || f == 8 || f == 9 || f == 14 || f == 19) {   /* tuple, list, dict, size, named tuple */
        Cur s;
        if (w != 2 || span(&c, &s) != OK || c.p != c.end)
            return BAIL;
        while (s.p < s.end) {
            uint32_t g;
            int gw, rc;
            Cur item;
            if (tag(&s, &g, &gw) != OK || gw != 2 || span(&s, &item) != OK)
                return BAIL;
            if (f == 9 && g == 1)   /* a dict's key: no tensor */
                continue;
            if (g != (f == 9 ? 2u : 1u))   /* a dict's values, a sequence's items: nothing else */
                return BAIL;
            if ((rc = tensor_indices(item, ix, depth + 1)) != OK)
                return rc;
        }
        return OK;
    }
    if (f > 19)
        return BAIL;
    if (skip_field(&c, w) != OK || c.p != c.end)   /* a scalar, a string, a slice, a complex: no tensor */
        return BAIL;
    return OK;
}

static int
compare_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* Whether `i` is among the indices (sorted). */
static int
in_indices(const Indices *ix, uint32_t i)
{
    return ix->n && bsearch(&i, ix->items, ix->n, sizeof(uint32_t), compare_u32) != NULL;
}

/* budget.check_peak(record, base) off the record's bytes: peak(raw, base, factors, header_factor) -> int or None.
 * `factors`: dtype name -> (factor of a compared tensor, factor of any other), budget.PEAK_FACTORS. */
static PyObject *
fd_peak(PyObject *self, PyObject *args)
{
    PyObject *raw, *factors;
    long long base, header_factor;
    if (!PyArg_ParseTuple(args, "OLO!L", &raw, &base, &PyDict_Type, &factors, &header_factor))
        return NULL;
    Py_buffer buf;
    if (PyObject_GetBuffer(raw, &buf, PyBUF_SIMPLE) < 0)
        return NULL;
    Cur c = {(const uint8_t *)buf.buf, (const uint8_t *)buf.buf + buf.len};
    Cur metas_at = c;
    uint64_t payload = 0;
    int seen_payload = 0, seen_output = 0, seen_grad = 0, rc = OK;
    Indices ix = {NULL, 0, 0, 0};
    PyObject *result = NULL;
    /* first pass: the payload size and the compared tensors (output, grad_input) */
    while (c.p < c.end && rc == OK) {
        uint32_t f;
        int w;
        if (tag(&c, &f, &w) != OK || f > 17) {
            rc = BAIL;
            break;
        }
        if (f == 3) {
            if (w != 0 || seen_payload++ || varint(&c, &payload) != OK)
                rc = BAIL;
        } else if (f == 6 || f == 12) {
            Cur s;
            if (w != 2 || (f == 6 ? seen_output++ : seen_grad++) || span(&c, &s) != OK)
                rc = BAIL;
            else
                rc = tensor_indices(s, &ix, 0);
        } else {
            rc = skip_field(&c, w);
        }
    }
    __int128 total = 0;   /* (as Python's int: no overflow on a hostile record's claims) */
    if (rc == OK) {
        if (ix.n > 1)
            qsort(ix.items, ix.n, sizeof(uint32_t), compare_u32);
        total = (__int128)base;
        if (base > (long long)payload)
            total += ((__int128)base - (__int128)payload) * (header_factor - 1);
    }
    /* second pass: each tensor meta's dtype and size */
    c = metas_at;
    Py_ssize_t i = 0;
    while (rc == OK && c.p < c.end) {
        uint32_t f;
        int w;
        Cur m;
        if (tag(&c, &f, &w) != OK) {
            rc = BAIL;
            break;
        }
        if (f != 2) {
            rc = skip_field(&c, w);
            continue;
        }
        if (w != 2 || span(&c, &m) != OK) {
            rc = BAIL;
            break;
        }
        Cur dtype = {NULL, NULL};
        uint64_t nbytes = 0;
        int seen_dtype = 0, seen_nbytes = 0;
        while (rc == OK && m.p < m.end) {
            uint32_t g;
            int gw;
            if (tag(&m, &g, &gw) != OK || g > 7) {
                rc = BAIL;
            } else if (g == 1) {
                rc = gw != 2 || seen_dtype++ ? BAIL : span(&m, &dtype);
            } else if (g == 5) {
                rc = gw != 0 || seen_nbytes++ ? BAIL : varint(&m, &nbytes);
            } else {
                rc = skip_field(&m, gw);
            }
        }
        if (rc != OK)
            break;
        PyObject *name = dtype.p == NULL ? PyUnicode_FromStringAndSize("", 0) : text(dtype), *pair;
        if (name == NULL) {
            rc = PyErr_Occurred() ? FAIL : BAIL;
            break;
        }
        pair = PyDict_GetItemWithError(factors, name);
        Py_DECREF(name);
        if (pair == NULL) {
            if (PyErr_Occurred())
                rc = FAIL;
            i++;
            continue;   /* a dtype without factors adds nothing, as in Python */
        }
        long long f0, f1;
        if (!PyArg_ParseTuple(pair, "LL", &f0, &f1)) {
            rc = FAIL;
            break;
        }
        uint64_t counted = nbytes < payload ? nbytes : payload;
        total += (__int128)counted * ((in_indices(&ix, (uint32_t)i) ? f0 : f1) - 1);
        i++;
    }
    if (rc == OK) {
        if (total > (__int128)LLONG_MAX || total < (__int128)LLONG_MIN)
            rc = BAIL;   /* beyond 64 bits: Python's int says it */
        else
            result = PyLong_FromLongLong((long long)total);
    }
    PyMem_Free(ix.items);
    PyBuffer_Release(&buf);
    if (rc == FAIL)
        return NULL;
    if (rc == BAIL)
        Py_RETURN_NONE;
    return result;
}

static PyMethodDef fd_methods[] = {
    {"head", fd_head, METH_O, "A record's header, tensor meta bytes, scalars and value spans, or None."},
    {"values", fd_values, METH_VARARGS, "A record's five values, or None."},
    {"peak", fd_peak, METH_VARARGS, "budget.check_peak of a record's bytes, or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fd_module = {
    PyModuleDef_HEAD_INIT, "gpu_server._fastdecode", "A record's header and values read off its bytes, in C.", -1,
    fd_methods,
};

PyMODINIT_FUNC
PyInit__fastdecode(void)
{
    return PyModule_Create(&fd_module);
}
