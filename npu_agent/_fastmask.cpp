/* A random call's record in C++ (npu_agent.capture, docs/design.md §4, "A dropout's input checked in C++"): whether a
 * dropout call's keep-mask can be read off its output, and the bytes of the generator state read before the call.
 *
 * A dropout's keep-mask is where its output is not zero when every input value is finite and not zero; the capture
 * checks that before it reads the mask off the output (else it rebuilds the mask from the generator state). In
 * Python that check is four torch calls, `torch.stack(torch.aminmax(x.abs())).tolist()`, then `low > 0 and high <
 * inf`: 20-30 us a dropout call in a training, where each small op costs several times what it costs warm.
 * `finite_nonzero(x)` gives the same answer: True exactly when every element's absolute value is above 0 and below
 * infinity (NaN fails both, as it fails both comparisons in Python). A plain tensor in CPU memory of a floating dtype
 * is read in place, without the interpreter lock; any other (another device, a subclass, a functorch wrapper) goes
 * through the same ops as the Python path, in C++, with one copy of the two extremes to the host. An error of those
 * ops gives False, as the Python path's RuntimeError or TypeError does.
 *
 * A random call's record carries the generator state read before the call as bytes: `state_bytes(state)` gives
 * exactly `state.cpu().numpy().tobytes()` (capture._state_bytes_py: the tensor's elements in order, copied to the host
 * first), without the three calls and the numpy array (4 us a call in a training, 1.5 us warm).
 *
 * Built against the torch it is loaded with: `python -m npu_agent.compiled --build` (scripts/setup.sh runs it); the
 * binary's name carries the torch version and build, so another torch finds it missing and Python checks. */
#include <Python.h>

#include <cmath>
#include <limits>
#include <type_traits>

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

namespace {

/* The elements of a contiguous CPU tensor, read in place: all finite and not zero. */
bool in_memory(const at::Tensor& x) {
    bool ok = true;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "finite_nonzero", [&] {
        const scalar_t* p = x.const_data_ptr<scalar_t>();
        const int64_t n = x.numel();
        using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;   // exact for each
        const acc_t inf = std::numeric_limits<acc_t>::infinity();
        for (int64_t i = 0; i < n; i++) {
            const acc_t v = std::abs(static_cast<acc_t>(p[i]));
            if (!(v > 0 && v < inf)) {
                ok = false;
                break;
            }
        }
    });
    return ok;
}

/* The Python path's ops: the extremes of |x|, copied to the host together. */
bool by_ops(const at::Tensor& x) {
    auto extremes = at::aminmax(x.detach().abs());   // as Python: no autograd node for the check
    auto both = at::stack({std::get<0>(extremes), std::get<1>(extremes)}).to(at::kDouble).cpu();
    const double* v = both.const_data_ptr<double>();
    return v[0] > 0 && v[1] < std::numeric_limits<double>::infinity();
}

PyObject* finite_nonzero(PyObject*, PyObject* arg) {
    HANDLE_TH_ERRORS
    if (!THPVariable_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "finite_nonzero(x): x is a tensor");
        return nullptr;
    }
    const at::Tensor& x = THPVariable_Unpack(arg);
    bool plain = THPVariable_CheckExact(arg) && !at::isTensorSubclassLike(x) && x.layout() == at::kStrided
                 && x.device().is_cpu() && x.has_storage() && x.is_contiguous()
                 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kDouble || x.scalar_type() == at::kHalf
                     || x.scalar_type() == at::kBFloat16);
    bool ok;
    {
        pybind11::gil_scoped_release no_gil;
        try {
            ok = plain ? in_memory(x) : by_ops(x);
        } catch (const c10::Error&) {   // a dtype or device those ops do not take: rebuilt from the generator
            ok = false;
        }
    }
    return PyBool_FromLong(ok);
    END_HANDLE_TH_ERRORS
}

PyObject* state_bytes(PyObject*, PyObject* arg) {
    HANDLE_TH_ERRORS
    if (!THPVariable_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "state_bytes(state): state is a tensor");
        return nullptr;
    }
    at::Tensor host;
    {
        pybind11::gil_scoped_release no_gil;
        host = THPVariable_Unpack(arg).cpu().contiguous();
    }
    return PyBytes_FromStringAndSize(static_cast<const char*>(host.const_data_ptr()),
                                     static_cast<Py_ssize_t>(host.nbytes()));
    END_HANDLE_TH_ERRORS
}

PyMethodDef mask_methods[] = {
    {"state_bytes", state_bytes, METH_O,
     "state_bytes(state) -> bytes: state.cpu().numpy().tobytes() (a generator state's bytes)."},
    {"finite_nonzero", finite_nonzero, METH_O,
     "finite_nonzero(x) -> bool: every element of x finite and not zero (the dropout mask's check)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef mask_module = {
    PyModuleDef_HEAD_INIT, "npu_agent._fastmask", "A random call's record: the dropout's input checked, the generator state's bytes.",
    -1, mask_methods, nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__fastmask() {
    return PyModule_Create(&mask_module);
}
