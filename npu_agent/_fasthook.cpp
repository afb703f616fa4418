/* Autograd hooks put on a node without torch's Python registration (npu_agent.backward, docs/design.md §4,
 * "Hooks put on in C++").
 *
 * A captured call's backward taps put one or two hooks on autograd nodes (`node.register_hook(fn)`,
 * `node.register_prehook(fn)`). For a node of torch's own (a C++ node), torch's registration calls back into
 * Python (`_register_hook`) to make a removable handle and the dict that holds the hook: 1.3 of its 1.7 us. The
 * backward taps never remove a hook, so they need neither. `post_hook(node, fn, *args)` and `pre_hook(node, fn,
 * *args)` put the hook `functools.partial(fn, *args)` on the node directly, without making it: when the engine runs
 * the node, `fn(*args, grad_inputs, grad_outputs)` (post) or `fn(*args, grad_outputs)` (pre) is called with the
 * same tuples (a tensor, or None where a gradient is undefined) that torch's Python hooks get, and an exception it
 * raises propagates out of the backward the same way.
 *
 * Torch keeps a node's Python hooks in one dict, run in the order they were put on; where the node has that dict
 * already (a hook of the training's own), the hook goes into it as torch's registration would put it (under a key
 * of its own: torch's handles count up from 0, ours down from -1), so the order among them is the same. Otherwise
 * it is a hook of its own, and a Python hook put on later runs after it, as it would. What `fn` returns is
 * ignored: the taps' hooks return None (a Python hook that returns tensors would replace the gradients; `fn`
 * cannot, outside such a dict). Under compiled autograd each hook hands `functools.partial(fn, *args)` to the
 * compiler as torch's Python hooks do. A node that is not a C++ node (a custom Function's) takes the Python
 * registration.
 *
 * A hook that gets a parameter's gradient keeps a copy of it (AccumulateGrad may adopt the gradient itself as the
 * parameter's .grad, which later steps change in place): `copy_grad(grad)` is backward._copy_py's
 * `grad.detach().clone()` with torch's Python functions out of the way, in C++ (the same ops through the dispatcher,
 * without the interpreter lock while the copy runs), None for None.
 *
 * Built against the torch it is loaded with (its headers and libraries): `python -m npu_agent.compiled --build`
 * (scripts/setup.sh runs it); the binary's name carries the torch version and build, so another torch finds it
 * missing and the taps register through Python (the same hooks, called the same way). */
#include <Python.h>

#include <cstring>
#include <memory>
#include <typeinfo>

#include <torch/csrc/Exceptions.h>
#include <torch/csrc/PyInterpreter.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/python_cpp_function.h>
#include <torch/csrc/autograd/python_hook.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/dynamo/compiled_autograd.h>
#include <torch/csrc/utils/pybind.h>

namespace {

using torch::autograd::variable_list;

/* The gradients as torch's Python hooks get them: a tuple, None for an undefined one (a new reference). */
PyObject* wrap(const variable_list& vars) {
    PyObject* tuple = PyTuple_New(static_cast<Py_ssize_t>(vars.size()));
    if (tuple == nullptr)
        throw python_error();
    for (size_t i = 0; i < vars.size(); i++) {
        PyObject* item = vars[i].defined() ? THPVariable_Wrap(vars[i]) : Py_NewRef(Py_None);
        if (item == nullptr) {
            Py_DECREF(tuple);
            throw python_error();
        }
        PyTuple_SET_ITEM(tuple, static_cast<Py_ssize_t>(i), item);
    }
    return tuple;
}

PyObject* partial_type = nullptr;   // functools.partial

/* `fn` and its bound arguments (strong references, released with the GIL held: the node may be freed on any
 * thread). */
struct Held {
    PyObject* fn;
    PyObject* args;   // a tuple
    Held(PyObject* f, PyObject* a) : fn(Py_NewRef(f)), args(Py_NewRef(a)) {}
    Held(const Held&) = delete;
    Held& operator=(const Held&) = delete;
    ~Held() {
        if (Py_IsInitialized()) {   // at interpreter exit the objects are left (torch's hooks do the same)
            pybind11::gil_scoped_acquire gil;
            Py_DECREF(fn);
            Py_DECREF(args);
        }
    }
    /* fn(*args, a[, b]), consuming a and b; raises python_error (the engine's way of carrying a Python exception)
     * when it raised */
    void call(PyObject* a, PyObject* b) const {
        Py_ssize_t n = PyTuple_GET_SIZE(args);
        PyObject* stack[8];
        PyObject* res;
        if (n <= 6) {
            for (Py_ssize_t i = 0; i < n; i++)
                stack[i] = PyTuple_GET_ITEM(args, i);
            stack[n] = a;
            stack[n + 1] = b;
            res = PyObject_Vectorcall(fn, stack, static_cast<size_t>(n + (b == nullptr ? 1 : 2)), nullptr);
        } else {
            PyObject* tail = b == nullptr ? PyTuple_Pack(1, a) : PyTuple_Pack(2, a, b);
            PyObject* all = tail == nullptr ? nullptr : PySequence_Concat(args, tail);
            Py_XDECREF(tail);
            res = all == nullptr ? nullptr : PyObject_Call(fn, all, nullptr);
            Py_XDECREF(all);
        }
        Py_DECREF(a);
        Py_XDECREF(b);
        if (res == nullptr)
            throw python_error();
        Py_DECREF(res);
    }
    /* functools.partial(fn, *args): the hook as torch's Python registration would hold it (a new reference) */
    PyObject* partial() const {
        PyObject* all = PyTuple_New(PyTuple_GET_SIZE(args) + 1);
        if (all == nullptr)
            return nullptr;
        PyTuple_SET_ITEM(all, 0, Py_NewRef(fn));
        for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args); i++)
            PyTuple_SET_ITEM(all, i + 1, Py_NewRef(PyTuple_GET_ITEM(args, i)));
        PyObject* res = PyObject_Call(partial_type, all, nullptr);
        Py_DECREF(all);
        return res;
    }
    c10::SafePyObject for_compiler() const {
        pybind11::gil_scoped_acquire gil;
        PyObject* p = partial();
        if (p == nullptr)
            throw python_error();
        return c10::SafePyObject(p, getPyInterpreter());
    }
};

struct PostHook : torch::autograd::FunctionPostHook {
    Held held;
    PostHook(PyObject* fn, PyObject* args) : held(fn, args) {}
    variable_list operator()(const variable_list& grad_inputs, const variable_list& grad_outputs) override {
        pybind11::gil_scoped_acquire gil;
        PyObject* inputs = wrap(grad_inputs);
        PyObject* outputs;
        try {
            outputs = wrap(grad_outputs);
        } catch (...) {
            Py_DECREF(inputs);
            throw;
        }
        held.call(inputs, outputs);
        return grad_inputs;
    }
    void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
        args.add_post_hook(held.for_compiler());
    }
};

struct PreHook : torch::autograd::FunctionPreHook {
    Held held;
    PreHook(PyObject* fn, PyObject* args) : held(fn, args) {}
    variable_list operator()(const variable_list& grad_outputs) override {
        pybind11::gil_scoped_acquire gil;
        held.call(wrap(grad_outputs), nullptr);
        return grad_outputs;
    }
    void compiled_args(torch::dynamo::autograd::CompiledNodeArgs& args) const override {
        args.add_pre_hook(held.for_compiler());
    }
};

PyObject* s_register_hook = nullptr;
PyObject* s_register_prehook = nullptr;
long long next_key = 0;   // the keys `fn` takes in a dict of torch's: -1, -2, ... (torch's handles: 0, 1, ...)

/* The dict of torch's Python hooks among `hooks` (PyFunctionPostHook's or PyFunctionPreHook's), or nullptr. Their
 * type information is not exported by libtorch_python, so each hook's type is told by its name. */
template <typename PyHook, typename List>
PyObject* python_dict(const List& hooks, const char* type_name) {
    for (const auto& hook : hooks) {
        if (hook != nullptr && std::strcmp(typeid(*hook).name(), type_name) == 0)
            return static_cast<PyHook*>(hook.get())->dict;
    }
    return nullptr;
}

template <typename Hook>
PyObject* put(PyObject* const* args, Py_ssize_t nargs, const char* usage, PyObject* python_name) {
    if (nargs < 2 || !PyCallable_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, usage);
        return nullptr;
    }
    PyObject *node = args[0], *fn = args[1];
    PyObject* bound = PyTuple_New(nargs - 2);
    if (bound == nullptr)
        return nullptr;
    for (Py_ssize_t i = 2; i < nargs; i++)
        PyTuple_SET_ITEM(bound, i - 2, Py_NewRef(args[i]));
    Held held(fn, bound);
    Py_DECREF(bound);
    if (!torch::autograd::THPCppFunction_Check(node)) {   // a custom Function's node: torch's registration
        PyObject* hook = held.partial();
        PyObject* handle = hook == nullptr ? nullptr : PyObject_CallMethodOneArg(node, python_name, hook);
        Py_XDECREF(hook);
        if (handle == nullptr)
            return nullptr;
        Py_DECREF(handle);
        Py_RETURN_NONE;
    }
    HANDLE_TH_ERRORS
    auto& cdata = reinterpret_cast<torch::autograd::THPCppFunction*>(node)->cdata;
    constexpr bool post = std::is_same_v<Hook, PostHook>;
    PyObject* dict = post ? python_dict<torch::autograd::PyFunctionPostHook>(
                                cdata->post_hooks(), "N5torch8autograd18PyFunctionPostHookE")
                          : python_dict<torch::autograd::PyFunctionPreHook>(
                                cdata->pre_hooks(), "N5torch8autograd17PyFunctionPreHookE");
    if (dict != nullptr) {
        PyObject* hook = held.partial();
        PyObject* key = hook == nullptr ? nullptr : PyLong_FromLongLong(--next_key);
        int failed = key == nullptr || PyDict_SetItem(dict, key, hook);
        Py_XDECREF(key);
        Py_XDECREF(hook);
        if (failed)
            return nullptr;
        Py_RETURN_NONE;
    }
    if constexpr (post)
        cdata->add_post_hook(std::make_unique<PostHook>(held.fn, held.args));
    else
        cdata->add_pre_hook(std::make_unique<PreHook>(held.fn, held.args));
    Py_RETURN_NONE;
    END_HANDLE_TH_ERRORS
}

PyObject* post_hook(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    return put<PostHook>(args, nargs, "post_hook(node, fn, *args): fn(*args, grad_inputs, grad_outputs) after the "
                         "node runs", s_register_hook);
}

PyObject* pre_hook(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
    return put<PreHook>(args, nargs, "pre_hook(node, fn, *args): fn(*args, grad_outputs) before the node runs",
                        s_register_prehook);
}

PyObject* copy_grad(PyObject*, PyObject* grad) {
    if (grad == Py_None)
        Py_RETURN_NONE;
    HANDLE_TH_ERRORS
    if (!THPVariable_Check(grad)) {
        PyErr_SetString(PyExc_TypeError, "copy_grad(grad): grad is a tensor or None");
        return nullptr;
    }
    const at::Tensor& g = THPVariable_Unpack(grad);
    at::Tensor copy;
    {
        pybind11::gil_scoped_release no_gil;
        copy = g.detach().clone();
    }
    return THPVariable_Wrap(std::move(copy));
    END_HANDLE_TH_ERRORS
}

PyMethodDef hook_methods[] = {
    {"copy_grad", copy_grad, METH_O,
     "copy_grad(grad) -> grad.detach().clone() (torch's Python functions out of the way), or None for None."},
    {"post_hook", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(post_hook)), METH_FASTCALL,
     "post_hook(node, fn, *args): node.register_hook(functools.partial(fn, *args)) without a handle or a partial; "
     "fn's result is ignored."},
    {"pre_hook", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(pre_hook)), METH_FASTCALL,
     "pre_hook(node, fn, *args): node.register_prehook(functools.partial(fn, *args)) without a handle or a partial; "
     "fn's result is ignored."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef hook_module = {
    PyModuleDef_HEAD_INIT, "npu_agent._fasthook", "Autograd hooks put on a node without torch's Python registration.",
    -1, hook_methods, nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__fasthook() {
    if ((s_register_hook = PyUnicode_InternFromString("register_hook")) == nullptr
            || (s_register_prehook = PyUnicode_InternFromString("register_prehook")) == nullptr)
        return nullptr;
    PyObject* functools = PyImport_ImportModule("functools");
    if (functools == nullptr)
        return nullptr;
    partial_type = PyObject_GetAttrString(functools, "partial");
    Py_DECREF(functools);
    if (partial_type == nullptr)
        return nullptr;
    return PyModule_Create(&hook_module);
}
