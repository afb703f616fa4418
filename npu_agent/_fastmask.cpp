/* A random call's record in C++ (npu_agent.capture, docs/design.md §4, "A dropout's input checked in C++"): whether a
 * dropout call's keep-mask can be read off its output, and the bytes of the generator state read before the call.
 *
 * A dropout's keep-mask is where its output is not zero when every input value is finite and not zero; the capture
 * checks that before it reads the mask off the output (else it rebuilds the mask from the generator state). In
 * Python that check is four torch calls, `torch.stack(torch.aminmax(x.abs())).tolist()`, then `low > 0 and high <
 * inf`: 20-30 us a dropout call in a training, where each small op costs several times what it costs warm.
 * `finite_nonzero(x)` gives the same answer: True exactly when every element's absolute value is above 0 and below
 * infinity (NaN fails both, as it fails both comparisons in Python). A plain tensor in CPU memory of a floating dtype
 * is read in place by the bits of its values (a zero, an infinity, a NaN each has a pattern), in chunks the compiler
 * turns into vector instructions: about 0.1 ns a value (0.4-0.5 ns read one by one as floats before), without the
 * interpreter lock above 64 KiB; any other (another device, a subclass, a functorch wrapper) goes
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

#include <cstdint>
#include <cstring>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/TensorSubclassLikeUtils.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

namespace {

/* Every value in `data` (n values of U's width) finite and not zero, told by its bits: a floating value with its
 * sign bit cleared (`magnitude`) is zero when all its bits are 0, and infinite or NaN when they are at least those
 * of infinity (`inf`: the exponent all ones). Subnormal values are neither (as |x| > 0 says of them). The values are
 * read in chunks whose loop has no exit (the compiler makes it vector instructions), a chunk with a bad value ending
 * the read. */
template <typename U>
bool finite_nonzero_bits(const unsigned char* data, int64_t n, U magnitude, U inf) {
    constexpr int64_t chunk = 256;
    int64_t i = 0;
    for (; i + chunk <= n; i += chunk) {
        unsigned bad = 0;
        for (int64_t j = 0; j < chunk; j++) {
            U u;
            std::memcpy(&u, data + (i + j) * sizeof(U), sizeof(U));
            u &= magnitude;
            bad |= static_cast<unsigned>(u == 0) | static_cast<unsigned>(u >= inf);
        }
        if (bad)
            return false;
    }
    for (; i < n; i++) {
        U u;
        std::memcpy(&u, data + i * sizeof(U), sizeof(U));
        u &= magnitude;
        if (u == 0 || u >= inf)
            return false;
    }
    return true;
}

/* The elements of a contiguous CPU tensor of a floating dtype, read in place: all finite and not zero. */
bool in_memory(const at::Tensor& x) {
    const auto* data = static_cast<const unsigned char*>(x.const_data_ptr());
    const int64_t n = x.numel();
    switch (x.scalar_type()) {
    case at::kFloat:
        return finite_nonzero_bits<uint32_t>(data, n, 0x7FFFFFFFu, 0x7F800000u);
    case at::kDouble:
        return finite_nonzero_bits<uint64_t>(data, n, 0x7FFFFFFFFFFFFFFFull, 0x7FF0000000000000ull);
    case at::kHalf:
        return finite_nonzero_bits<uint16_t>(data, n, 0x7FFF, 0x7C00);
    case at::kBFloat16:
        return finite_nonzero_bits<uint16_t>(data, n, 0x7FFF, 0x7F80);
    default:
        TORCH_CHECK(false, "finite_nonzero: read in place only for float, double, half and bfloat16");
    }
}

/* The Python path's ops: the extremes of |x|, copied to the host together. */
bool by_ops(const at::Tensor& x) {
    auto extremes = at::aminmax(x.detach().abs());   // as Python: no autograd node for the check
    auto both = at::stack({std::get<0>(extremes), std::get<1>(extremes)}).to(at::kDouble).cpu();
    const double* v = both.const_data_ptr<double>();
    return v[0] > 0 && v[1] < std::numeric_limits<double>::infinity();
}

/* A plain tensor of at most this many bytes is read without letting go of the interpreter lock: the read takes a few
 * microseconds at most (TinyLM's 16 KiB: under one), and a lock let go may be taken by one of the agent's threads,
 * which the training then waits for. */
constexpr size_t in_place_with_lock = 64 << 10;

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
    if (plain && x.nbytes() <= in_place_with_lock)
        return PyBool_FromLong(in_memory(x));
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
