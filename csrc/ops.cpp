// Operator schemas of the `replica` library, and the Python module replica._C.
//
// The module's pack/unpack take Python lists straight to the op's device
// kernel through the dispatcher's unboxed entry point. Calling
// torch.ops.replica.pack instead boxes every list element into an IValue,
// takes an owning reference to each tensor (which in torch >= 2.10 also
// touches its Python object), and boxes again in the autograd fallback: about
// 240 ns a tensor, more than the copy itself for 10,000 small tensors. Here
// the tensors are borrowed, the call starts below autograd and bumps the
// version counters of what it wrote, as the ADInplaceOrView fallback would.
// Device, fake/meta and Python-mode dispatch are unchanged.
// The headers this file uses, not torch/extension.h (the whole C++ frontend, 28 s of compile
// against 12 s).
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include "replica.h"
#include "simd.h"

#include <algorithm>
#include <vector>

TORCH_LIBRARY(replica, m) {
  m.def("pack(Tensor[] srcs, Tensor(a!) out, int[] offsets) -> ()");
  m.def("unpack(Tensor src, Tensor(a!)[] dsts, int[] offsets) -> ()");
  m.def("checksum(Tensor buf, int block_bytes, int word_offset=0) -> Tensor");
  m.def(
      "pack_checksum(Tensor[] srcs, Tensor(a!) out, int[] offsets, int block_bytes, int word_offset=0) "
      "-> Tensor");
}

namespace {

namespace py = pybind11;
using TensorTraits = c10::MaybeOwnedTraits<at::Tensor>;

// Non-owning tensors viewing the elements of a Python tuple. The tuple, which
// the caller keeps alive, owns them; a tuple (unlike the caller's list) cannot
// be changed by another thread while the GIL is released.
class BorrowedTensors {
 public:
  BorrowedTensors(const py::tuple& items, const char* name) {
    const Py_ssize_t n = PyTuple_GET_SIZE(items.ptr());
    // Check everything before borrowing anything: a throw from the
    // constructor would skip the destructor, and the vector would then drop
    // references it never took.
    for (Py_ssize_t i = 0; i < n; ++i) {
      TORCH_CHECK_TYPE(
          THPVariable_Check(PyTuple_GET_ITEM(items.ptr(), i)),
          "replica: ", name, "[", i, "] is not a tensor");
    }
    tensors_.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      tensors_.push_back(
          TensorTraits::createBorrow(THPVariable_Unpack(PyTuple_GET_ITEM(items.ptr(), i))));
    }
  }
  ~BorrowedTensors() {
    for (at::Tensor& t : tensors_) {
      TensorTraits::destroyBorrow(t);
    }
  }
  BorrowedTensors(const BorrowedTensors&) = delete;
  BorrowedTensors& operator=(const BorrowedTensors&) = delete;

  at::TensorList list() const {
    return tensors_;
  }

 private:
  std::vector<at::Tensor> tensors_;
};

py::tuple as_tuple(py::handle seq) {
  PyObject* tuple = PySequence_Tuple(seq.ptr());
  if (tuple == nullptr) {
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::tuple>(tuple);
}

std::vector<int64_t> int_list(py::handle seq) {
  const py::tuple items = as_tuple(seq);
  const Py_ssize_t n = PyTuple_GET_SIZE(items.ptr());
  std::vector<int64_t> values(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    values[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(items.ptr(), i));
    if (values[i] == -1 && PyErr_Occurred()) {
      throw py::error_already_set();
    }
  }
  return values;
}

void bump_version(const at::Tensor& t) {
  if (!t.is_inference()) {
    torch::autograd::impl::bump_version(t);
  }
}

void pack(py::handle srcs, const at::Tensor& out, py::handle offsets) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("replica::pack", "")
                       .typed<void(at::TensorList, const at::Tensor&, at::IntArrayRef)>();
  const py::tuple items = as_tuple(srcs);
  const BorrowedTensors tensors(items, "srcs");
  const std::vector<int64_t> offs = int_list(offsets);
  {
    py::gil_scoped_release no_gil;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.call(tensors.list(), out, offs);
  }
  bump_version(out);
}

void unpack(const at::Tensor& src, py::handle dsts, py::handle offsets) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("replica::unpack", "")
                       .typed<void(const at::Tensor&, at::TensorList, at::IntArrayRef)>();
  const py::tuple items = as_tuple(dsts);
  const BorrowedTensors tensors(items, "dsts");
  const std::vector<int64_t> offs = int_list(offsets);
  {
    py::gil_scoped_release no_gil;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    op.call(src, tensors.list(), offs);
  }
  for (const at::Tensor& t : tensors.list()) {
    bump_version(t);
  }
}

at::Tensor pack_checksum(
    py::handle srcs, const at::Tensor& out, py::handle offsets, int64_t block_bytes, int64_t word_offset) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("replica::pack_checksum", "")
          .typed<at::Tensor(at::TensorList, const at::Tensor&, at::IntArrayRef, int64_t, int64_t)>();
  const py::tuple items = as_tuple(srcs);
  const BorrowedTensors tensors(items, "srcs");
  const std::vector<int64_t> offs = int_list(offsets);
  at::Tensor digests;
  {
    py::gil_scoped_release no_gil;
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    digests = op.call(tensors.list(), out, offs, block_bytes, word_offset);
  }
  bump_version(out);
  return digests;
}

// Without the GIL: a receiver hashes each bucket while its transport's
// progress thread (Python, for some backends) finishes the next. threads > 0
// on a CPU buffer: that many threads of its own (replica::checksum_cpu_threads).
at::Tensor checksum(const at::Tensor& buf, int64_t block_bytes, int64_t word_offset, int64_t threads) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("replica::checksum", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>();
  py::gil_scoped_release no_gil;
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  if (threads > 0 && buf.device().is_cpu()) {
    return replica::checksum_cpu_threads(buf, block_bytes, word_offset, threads);
  }
  return op.call(buf, block_bytes, word_offset);
}

// The shapes and dtypes a list of tensors must have, checked in one C++ pass:
// a snapshot checks every state tensor at every step, right after its pack has
// brought their TensorImpls into the cache, where Python's t.shape and t.dtype
// (a torch.Size built per tensor) cost ~0.5 us each.
class ShapeCheck {
 public:
  explicit ShapeCheck(py::handle like) {
    const py::tuple items = as_tuple(like);
    const BorrowedTensors tensors(items, "like");
    for (const at::Tensor& t : tensors.list()) {
      sizes_.emplace_back(t.sizes().vec());
      dtypes_.push_back(t.scalar_type());
    }
  }

  // The index of the first of `tensors` whose shape or dtype differs, the
  // count if there are fewer or more of them, or -1 when all match.
  int64_t first_mismatch(py::handle tensors) const {
    const py::tuple items = as_tuple(tensors);
    const auto n = static_cast<size_t>(PyTuple_GET_SIZE(items.ptr()));
    for (size_t i = 0; i < std::min(n, sizes_.size()); ++i) {
      PyObject* item = PyTuple_GET_ITEM(items.ptr(), i);
      if (!THPVariable_Check(item)) {
        return static_cast<int64_t>(i);
      }
      const at::Tensor& t = THPVariable_Unpack(item);
      if (t.scalar_type() != dtypes_[i] || t.sizes() != c10::IntArrayRef(sizes_[i])) {
        return static_cast<int64_t>(i);
      }
    }
    return n == sizes_.size() ? -1 : static_cast<int64_t>(std::min(n, sizes_.size()));
  }

 private:
  std::vector<std::vector<int64_t>> sizes_;
  std::vector<at::ScalarType> dtypes_;
};

}  // namespace

namespace replica {
void bind_heartbeat(pybind11::module& m);  // heartbeat.cpp
void bind_liveness(pybind11::module& m);  // liveness.cpp
}  // namespace replica

PYBIND11_MODULE(_C, m) {
  m.doc() = "replica's kernels; the ops are torch.ops.replica.{pack,unpack,checksum,pack_checksum}";
  m.def("pack", &pack, py::arg("srcs"), py::arg("out"), py::arg("offsets"));
  m.def("unpack", &unpack, py::arg("src"), py::arg("dsts"), py::arg("offsets"));
  m.def("pack_checksum", &pack_checksum, py::arg("srcs"), py::arg("out"), py::arg("offsets"),
        py::arg("block_bytes"), py::arg("word_offset") = 0);
  m.def("checksum", &checksum, py::arg("buf"), py::arg("block_bytes"), py::arg("word_offset") = 0,
        py::arg("threads") = 0);
  m.def("simd_builds", &replica::simd::supported, "the CPU checksum builds this CPU runs, best first");
  m.def("simd_build", [] { return std::string(replica::simd::active().name); }, "the CPU checksum build in use");
  m.def("select_simd_build", &replica::simd::select, py::arg("name"),
        "use another CPU checksum build (tests, benchmarks); returns the previous one's name");
  py::class_<ShapeCheck>(m, "ShapeCheck", "the shapes and dtypes of `like`, to check other tensors against")
      .def(py::init<py::handle>(), py::arg("like"))
      .def("first_mismatch", &ShapeCheck::first_mismatch, py::arg("tensors"),
           "index of the first tensor unlike its counterpart (or the shorter count), -1 if none");
  replica::bind_heartbeat(m);
  replica::bind_liveness(m);
}
