// Arctic Inference's SuffixDecodingCache API on the compiled Cache: the base
// of drafter_service.SuffixDecodingCache (drafter_service/arctic.py).
//
// Code written for Arctic calls speculate and add_active_response once per
// request per decode step, so those two are CPython fastcall methods: their
// arguments are read straight off the call and the SuffixDecodingDraft comes
// back with its fields filled in directly. Request ids may be any hashable;
// the core numbers them.
//
// The GIL: releasing it and taking it back costs about 0.1 us, a tenth of a
// per-step call, and when another thread is waiting for it the caller can
// stall for up to the interpreter's switch interval. So the per-step calls,
// a few microseconds of work bounded by the depth and k, keep it; work that
// grows with its input (a prompt, an append of more than kLongAppend tokens)
// runs without it, as do the batch step and snapshots of the service's core.
#include <optional>
#include <string>

#include "cache.h"
#include "py_support.h"

#include <structmember.h>  // after Python.h (from py_support.h)

namespace py = pybind11;

namespace speclane {
namespace {

constexpr size_t kLongAppend = 64;
constexpr const char* kDraftFields[] = {"token_ids", "parents", "probs", "score", "match_len"};
constexpr size_t kNumDraftFields = 5;

// Builds instances of the draft dataclass by writing its fields to their
// slots: calling the class would run its Python __init__, about a third of a
// whole speculate call.
class DraftFactory {
 public:
  explicit DraftFactory(py::object type) : type_(std::move(type)) {
    if (!PyType_Check(type_.ptr())) throw py::type_error("draft_type must be a class");
    py::dict attributes = type_.attr("__dict__");
    for (size_t i = 0; i < kNumDraftFields; ++i) {
      PyObject* descr = PyDict_GetItemString(attributes.ptr(), kDraftFields[i]);
      if (descr == nullptr || !Py_IS_TYPE(descr, &PyMemberDescr_Type) ||
          reinterpret_cast<PyMemberDescrObject*>(descr)->d_member->type != T_OBJECT_EX)
        throw py::type_error("draft_type must be a slots class with the fields of SuffixDecodingDraft");
      offsets_[i] = reinterpret_cast<PyMemberDescrObject*>(descr)->d_member->offset;
    }
  }

  PyObject* make(const Draft& draft) const {
    PyObject* fields[kNumDraftFields] = {int_list(draft.token_ids), int_list(draft.parents), float_list(draft.probs),
                                         PyFloat_FromDouble(draft.score), PyLong_FromLong(draft.match_len)};
    PyTypeObject* type = reinterpret_cast<PyTypeObject*>(type_.ptr());
    PyObject* made = type->tp_alloc(type, 0);
    for (size_t i = 0; i < kNumDraftFields; ++i) {
      if (made == nullptr) {
        Py_DECREF(fields[i]);
      } else {
        *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(made) + offsets_[i]) = fields[i];
      }
    }
    return made;
  }

 private:
  py::object type_;
  Py_ssize_t offsets_[kNumDraftFields] = {};
};

class ArcticCache {
 public:
  ArcticCache(int max_tree_depth, int64_t max_cached_requests, int64_t max_cached_tokens, py::object draft_type)
      : core_(max_tree_depth, max_cached_requests, max_cached_tokens),
        max_cached_requests_(max_cached_requests),
        drafts_(std::move(draft_type)) {}

  int max_tree_depth() const { return core_.max_depth(); }
  int64_t max_cached_requests() const { return max_cached_requests_; }
  py::object active_requests() const { return active_.attr("keys")(); }
  py::object cached_requests() const {
    std::vector<int64_t> numbers = core_.cached_requests();
    py::dict ids;
    for (int64_t number : numbers) ids[req_ids_[py::int_(number)]] = py::none();
    return ids.attr("keys")();
  }
  size_t memory_bytes() const {
    py::gil_scoped_release released;
    return core_.memory_bytes();
  }

  void start_request(py::handle req_id, const Tokens& prompt) {
    if (active_.contains(req_id)) throw py::value_error(message(req_id, "is already active"));
    py::object number = numbers_.attr("get")(req_id);
    if (number.is_none()) {
      forget_evicted();
      number = py::int_(next_number_++);
      numbers_[req_id] = number;
      req_ids_[number] = req_id;
    }
    int64_t id = number.cast<int64_t>();
    {
      py::gil_scoped_release released;
      core_.start_request(id, prompt, "", SessionParams{});  // replaces a cached response of req_id
    }
    active_[req_id] = number;
  }

  void stop_request(py::handle req_id) {
    int64_t number = running(req_id);
    PyDict_DelItem(active_.ptr(), req_id.ptr());
    py::gil_scoped_release released;
    core_.stop_request(number);
  }

  void evict_cached_response(py::handle req_id) {
    PyObject* number = PyDict_GetItemWithError(numbers_.ptr(), req_id.ptr());
    if (number == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      throw py::value_error(message(req_id, "is not cached"));
    }
    int64_t id = PyLong_AsLongLong(number);
    py::gil_scoped_release released;
    core_.evict_cached_response(id);  // std::invalid_argument (ValueError) when it is not cached
  }

  // add_active_response(req_id, token_ids)
  void add_active_response(PyObject* req_id, PyObject* token_ids) {
    int64_t number = running(req_id);
    with_tail(token_ids, SIZE_MAX, [&](const int32_t* tokens, size_t n) {
      std::optional<py::gil_scoped_release> released;
      if (n > kLongAppend) released.emplace();
      core_.add_active_response(number, tokens, n);
    });
  }

  // speculate(req_id, context, max_spec_tokens=None, max_spec_factor=1.0,
  //           max_spec_offset=0.0, min_token_prob=0.1, use_tree_spec=False)
  PyObject* speculate(PyObject* const* args) {
    int64_t number = running(args[0]);
    SpecParams params;
    params.max_spec_tokens = is_given(args[2]) ? static_cast<int>(int_arg(args[2])) : core_.max_depth();
    params.max_spec_factor = is_given(args[3]) ? float_arg(args[3]) : 1.0;
    params.max_spec_offset = is_given(args[4]) ? float_arg(args[4]) : 0.0;
    params.min_token_prob = is_given(args[5]) ? float_arg(args[5]) : 0.1;
    params.use_tree = is_given(args[6]) && PyObject_IsTrue(args[6]) == 1;
    // The last max_tree_depth tokens of the context: the most a match uses.
    Draft draft = with_tail(args[1], static_cast<size_t>(core_.max_depth()), [&](const int32_t* context, size_t n) {
      return core_.speculate(number, context, n, params);
    });
    return drafts_.make(draft);
  }

 private:
  static bool is_given(PyObject* arg) { return arg != nullptr && arg != Py_None; }

  static int64_t int_arg(PyObject* value) {
    long long number = PyLong_AsLongLong(value);
    if (number == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      throw py::type_error("expected an integer");
    }
    return number;
  }

  static double float_arg(PyObject* value) {
    double number = PyFloat_AsDouble(value);
    if (number == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      throw py::type_error("expected a number");
    }
    return number;
  }

  static std::string message(py::handle req_id, const char* what) {
    return "Request '" + py::str(req_id).cast<std::string>() + "' " + what;
  }

  int64_t running(py::handle req_id) const {
    PyObject* number = PyDict_GetItemWithError(active_.ptr(), req_id.ptr());
    if (number == nullptr) {
      if (PyErr_Occurred()) throw py::error_already_set();
      throw py::value_error(message(req_id, "is not active"));
    }
    return PyLong_AsLongLong(number);
  }

  void forget_evicted() {
    // The core evicts on its own (FIFO, budgets): drop the ids it no longer holds once they pile up.
    if (py::len(numbers_) < 2 * (py::len(active_) + 1024)) return;
    py::set held;
    for (int64_t number : core_.cached_requests()) held.add(py::int_(number));
    for (auto item : active_) held.add(item.second);
    py::dict numbers, req_ids;
    for (auto item : numbers_) {
      if (!held.contains(item.second)) continue;
      numbers[item.first] = item.second;
      req_ids[item.second] = item.first;
    }
    numbers_ = numbers;
    req_ids_ = req_ids;
  }

  Cache core_;
  int64_t max_cached_requests_;
  DraftFactory drafts_;
  py::dict active_;   // req_id -> number of the running requests
  py::dict numbers_;  // req_id -> number of every request the core may still hold
  py::dict req_ids_;  // number -> req_id
  int64_t next_number_ = 0;
};

// The C++ object of `self`, which the method descriptor has already checked is
// an ArcticCache: read off the instance without pybind11's type lookup.
ArcticCache& cache_of(PyObject* self) {
  py::detail::value_and_holder value = reinterpret_cast<py::detail::instance*>(self)->get_value_and_holder();
  if (!value.holder_constructed()) throw py::type_error("the cache's __init__ was not called");
  return *value.value_ptr<ArcticCache>();
}

PyObject* speculate(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const Parameters parameters("speculate", {"req_id", "context", "max_spec_tokens", "max_spec_factor",
                                                   "max_spec_offset", "min_token_prob", "use_tree_spec"}, 2);
  return fastcall([&] {
    PyObject* bound[7];
    bind_arguments(parameters, args, nargs, kwnames, bound);
    return cache_of(self).speculate(bound);
  });
}

PyObject* add_active_response(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  static const Parameters parameters("add_active_response", {"req_id", "token_ids"}, 2);
  return fastcall([&]() -> PyObject* {
    PyObject* bound[2];
    bind_arguments(parameters, args, nargs, kwnames, bound);
    cache_of(self).add_active_response(bound[0], bound[1]);
    Py_RETURN_NONE;
  });
}

PyMethodDef kFastMethods[] = {
    {"speculate", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(speculate)),
     METH_FASTCALL | METH_KEYWORDS,
     "speculate(req_id, context, max_spec_tokens=None, max_spec_factor=1.0, max_spec_offset=0.0, "
     "min_token_prob=0.1, use_tree_spec=False) -> draft: drafts from the request's tree and its tenant's "
     "global tree, whichever scores higher"},
    {"add_active_response", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(add_active_response)),
     METH_FASTCALL | METH_KEYWORDS, "add_active_response(req_id, token_ids): appends committed output tokens"},
};

}  // namespace

void bind_arctic_api(py::module_& m) {
  py::class_<ArcticCache> cls(m, "ArcticCache");
  cls.def(py::init<int, int64_t, int64_t, py::object>(), py::arg("max_tree_depth"), py::arg("max_cached_requests"),
          py::arg("max_cached_tokens"), py::arg("draft_type"))
      .def_property_readonly("max_tree_depth", &ArcticCache::max_tree_depth)
      .def_property_readonly("max_cached_requests", &ArcticCache::max_cached_requests)
      .def_property_readonly("active_requests", &ArcticCache::active_requests)
      .def_property_readonly("cached_requests", &ArcticCache::cached_requests)
      .def("start_request", &ArcticCache::start_request, py::arg("req_id"), py::arg("prompt_token_ids"))
      .def("stop_request", &ArcticCache::stop_request, py::arg("req_id"))
      .def("evict_cached_response", &ArcticCache::evict_cached_response, py::arg("req_id"))
      .def("memory_bytes", &ArcticCache::memory_bytes);
  PyTypeObject* type = reinterpret_cast<PyTypeObject*>(cls.ptr());
  for (PyMethodDef& def : kFastMethods)
    cls.attr(def.ml_name) = py::reinterpret_steal<py::object>(PyDescr_NewMethod(type, &def));
}

}  // namespace speclane
