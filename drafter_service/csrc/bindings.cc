// Python bindings of the compiled drafter core: `drafter_service._core`.
// Arguments are converted with the GIL held; the work itself runs without it.
// Drafts come back as tuples (token_ids, parents, probs, score, match_len, source).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <tuple>

#include "cache.h"
#include "ngram_index.h"
#include "suffix_tree.h"

// Token lists cross the boundary on every call: convert them directly
// (PySequence_Fast + PyLong) instead of element by element through generic casters.
namespace pybind11 {
namespace detail {
template <>
struct type_caster<std::vector<int32_t>> {
  PYBIND11_TYPE_CASTER(std::vector<int32_t>, const_name("list[int]"));

  bool load(handle src, bool) {
    if (!src || PyUnicode_Check(src.ptr()) || PyBytes_Check(src.ptr())) return false;
    PyObject* items = PySequence_Fast(src.ptr(), "expected a sequence of token ids");
    if (items == nullptr) {
      PyErr_Clear();
      return false;
    }
    Py_ssize_t size = PySequence_Fast_GET_SIZE(items);
    PyObject** item = PySequence_Fast_ITEMS(items);
    value.resize(static_cast<size_t>(size));
    bool ok = true;
    for (Py_ssize_t i = 0; i < size && ok; ++i) {
      long token = PyLong_AsLong(item[i]);
      ok = !(token == -1 && PyErr_Occurred()) && token >= INT32_MIN && token <= INT32_MAX;
      value[static_cast<size_t>(i)] = static_cast<int32_t>(token);
    }
    if (!ok) PyErr_Clear();
    Py_DECREF(items);
    return ok;
  }

  static handle cast(const std::vector<int32_t>& tokens, return_value_policy, handle) {
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(tokens.size()));
    for (size_t i = 0; i < tokens.size(); ++i) PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), PyLong_FromLong(tokens[i]));
    return list;
  }
};
}  // namespace detail
}  // namespace pybind11

namespace py = pybind11;
using namespace speclane;

namespace {

using Tokens = std::vector<int32_t>;
using DraftTuple = std::tuple<Tokens, Tokens, std::vector<double>, double, int, int>;
using Released = py::call_guard<py::gil_scoped_release>;

DraftTuple as_tuple(Draft draft) {
  return {std::move(draft.token_ids), std::move(draft.parents), std::move(draft.probs), draft.score, draft.match_len,
          draft.source};
}

SpecParams spec(int k, double factor, double offset, double min_token_prob, bool use_tree, bool reanchor) {
  SpecParams params;
  params.max_spec_tokens = k;
  params.max_spec_factor = factor;
  params.max_spec_offset = offset;
  params.min_token_prob = min_token_prob;
  params.use_tree = use_tree;
  params.reanchor = reanchor;
  return params;
}

// The two calls Arctic-API code makes per decode step skip pybind11's generic
// dispatch: METH_FASTCALL functions that read their arguments straight off the
// call (about 1 us less per call). Core errors map as pybind11 maps them.
template <typename Work>
PyObject* guarded(Work work) {
  try {
    return work();
  } catch (const py::cast_error& error) {
    PyErr_SetString(PyExc_TypeError, error.what());
  } catch (const std::invalid_argument& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
  } catch (const std::out_of_range& error) {
    PyErr_SetString(PyExc_IndexError, error.what());
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
  return nullptr;
}

// The last `keep` tokens of a list or tuple of ints.
Tokens tail_of(PyObject* sequence, size_t keep) {
  if (!PyList_Check(sequence) && !PyTuple_Check(sequence)) throw py::cast_error("token ids must be a list or tuple");
  Py_ssize_t size = PySequence_Fast_GET_SIZE(sequence);
  PyObject** items = PySequence_Fast_ITEMS(sequence);
  Py_ssize_t from = size - static_cast<Py_ssize_t>(std::min(static_cast<size_t>(size), keep));
  Tokens tokens(static_cast<size_t>(size - from));
  for (Py_ssize_t i = from; i < size; ++i) {
    long token = PyLong_AsLong(items[i]);
    if ((token == -1 && PyErr_Occurred()) || token < INT32_MIN || token > INT32_MAX) {
      PyErr_Clear();
      throw py::cast_error("token ids must be int32 integers");
    }
    tokens[static_cast<size_t>(i - from)] = static_cast<int32_t>(token);
  }
  return tokens;
}

int64_t int_arg(PyObject* value) {
  long long number = PyLong_AsLongLong(value);
  if (number == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::cast_error("expected an integer");
  }
  return number;
}

double float_arg(PyObject* value) {
  double number = PyFloat_AsDouble(value);
  if (number == -1.0 && PyErr_Occurred()) {
    PyErr_Clear();
    throw py::cast_error("expected a number");
  }
  return number;
}

PyObject* int_list(const Tokens& tokens) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(tokens.size()));
  for (size_t i = 0; i < tokens.size(); ++i) PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), PyLong_FromLong(tokens[i]));
  return list;
}

PyObject* float_list(const std::vector<double>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  for (size_t i = 0; i < values.size(); ++i)
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), PyFloat_FromDouble(values[i]));
  return list;
}

// speculate_tail(cache, req_id, context, k, factor, offset, min_token_prob, use_tree)
// -> (token_ids, parents, probs, score, match_len): drafts from the last
// max_tree_depth tokens of `context`, the most a match can use.
PyObject* speculate_tail(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return guarded([&]() -> PyObject* {
    if (nargs != 8) throw py::cast_error("speculate_tail takes 8 arguments");
    Cache& cache = py::handle(args[0]).cast<Cache&>();
    int64_t id = int_arg(args[1]);
    Tokens context = tail_of(args[2], static_cast<size_t>(cache.max_depth()));
    SpecParams params = spec(static_cast<int>(int_arg(args[3])), float_arg(args[4]), float_arg(args[5]),
                             float_arg(args[6]), PyObject_IsTrue(args[7]) == 1, true);
    Draft draft;
    {
      py::gil_scoped_release released;
      draft = cache.speculate(id, context, params);
    }
    return Py_BuildValue("(NNNdi)", int_list(draft.token_ids), int_list(draft.parents), float_list(draft.probs),
                         draft.score, draft.match_len);
  });
}

// append_tokens(cache, req_id, token_ids): add_active_response.
PyObject* append_tokens(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return guarded([&]() -> PyObject* {
    if (nargs != 3) throw py::cast_error("append_tokens takes 3 arguments");
    Cache& cache = py::handle(args[0]).cast<Cache&>();
    int64_t id = int_arg(args[1]);
    Tokens tokens = tail_of(args[2], SIZE_MAX);
    {
      py::gil_scoped_release released;
      cache.add_active_response(id, tokens);
    }
    Py_RETURN_NONE;
  });
}

PyMethodDef kFastCalls[] = {
    {"speculate_tail", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(speculate_tail)), METH_FASTCALL,
     "speculate_tail(cache, req_id, context, k, factor, offset, min_token_prob, use_tree)"},
    {"append_tokens", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(append_tokens)), METH_FASTCALL,
     "append_tokens(cache, req_id, token_ids)"},
};

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "Compiled suffix-tree and n-gram drafter core";
  m.attr("SOURCE_REQUEST") = static_cast<int>(kSourceRequest);
  m.attr("SOURCE_GLOBAL") = static_cast<int>(kSourceGlobal);
  m.attr("SOURCE_NGRAM") = static_cast<int>(kSourceNgram);
  m.attr("METHOD_SUFFIX") = static_cast<int>(kMethodSuffix);
  m.attr("METHOD_NGRAM") = static_cast<int>(kMethodNgram);

  py::class_<SuffixTree>(m, "SuffixTree")
      .def(py::init<int>(), py::arg("max_depth"))
      .def_property_readonly("max_depth", &SuffixTree::max_depth)
      .def("__contains__", &SuffixTree::contains)
      .def("add_sequence", &SuffixTree::add_sequence, Released())
      .def("append", [](SuffixTree& tree, int64_t seq, const Tokens& tokens) { tree.append(seq, tokens.data(), tokens.size()); },
           Released())
      .def("seal", &SuffixTree::seal, Released())
      .def("remove_sequence", &SuffixTree::remove_sequence, Released())
      .def("sequence_length", &SuffixTree::sequence_length)
      .def("count", [](const SuffixTree& tree, const Tokens& pattern) { return tree.count(pattern.data(), pattern.size()); },
           Released())
      .def("speculate",
           [](const SuffixTree& tree, const Tokens& context, int k, double factor, double offset, double min_token_prob,
              bool use_tree, bool reanchor) {
             return as_tuple(tree.speculate(context.data(), context.size(),
                                            spec(k, factor, offset, min_token_prob, use_tree, reanchor)));
           },
           py::arg("context"), py::arg("max_spec_tokens"), py::arg("max_spec_factor") = 1.0,
           py::arg("max_spec_offset") = 0.0, py::arg("min_token_prob") = 0.1, py::arg("use_tree") = false,
           py::arg("reanchor") = true, Released())
      .def_property_readonly("num_nodes", &SuffixTree::num_nodes)
      .def("memory_bytes", &SuffixTree::memory_bytes, Released());

  py::class_<NgramIndex>(m, "NgramIndex")
      .def(py::init<int, int, bool>(), py::arg("min_n"), py::arg("max_n"), py::arg("latest") = false)
      .def("append", [](NgramIndex& index, const Tokens& tokens) { index.append(tokens.data(), tokens.size()); },
           Released())
      .def("propose", [](const NgramIndex& index, int k) { return as_tuple(index.propose(k)); }, Released())
      .def("propose_rescan", [](const NgramIndex& index, int k) { return as_tuple(index.propose_rescan(k)); },
           Released())
      .def("__len__", [](const NgramIndex& index) { return index.tokens().size(); })
      .def("memory_bytes", &NgramIndex::memory_bytes);

  py::class_<Cache>(m, "Cache")
      .def(py::init<int, int64_t, int64_t>(), py::arg("max_tree_depth"), py::arg("max_cached_requests"),
           py::arg("max_cached_tokens") = 0)
      .def_property_readonly("max_tree_depth", &Cache::max_depth)
      .def("start_request",
           [](Cache& cache, int64_t id, const Tokens& prompt, const std::string& tenant, int method, int k,
              double factor, double offset, double min_token_prob, bool use_tree, bool reanchor, int local_depth,
              int ngram_min, int ngram_max, bool ngram_latest) {
             SessionParams params;
             params.method = method;
             params.spec = spec(k, factor, offset, min_token_prob, use_tree, reanchor);
             params.local_depth = local_depth;
             params.ngram_min = ngram_min;
             params.ngram_max = ngram_max;
             params.ngram_latest = ngram_latest;
             cache.start_request(id, prompt, tenant, params);
           },
           py::arg("req_id"), py::arg("prompt_token_ids"), py::arg("tenant") = "", py::arg("method") = 1,
           py::arg("max_spec_tokens") = 16, py::arg("max_spec_factor") = 1.0, py::arg("max_spec_offset") = 0.0,
           py::arg("min_token_prob") = 0.1, py::arg("use_tree_spec") = false, py::arg("reanchor") = true,
           py::arg("max_tree_depth") = 0, py::arg("prompt_lookup_min") = 5, py::arg("prompt_lookup_max") = 5,
           py::arg("ngram_latest") = false, Released())
      .def("add_active_response", &Cache::add_active_response, Released())
      .def("stop_request", &Cache::stop_request, Released())
      .def("evict_cached_response", &Cache::evict_cached_response, Released())
      .def("speculate",
           [](Cache& cache, int64_t id, const Tokens& context, int k, double factor, double offset,
              double min_token_prob, bool use_tree, bool reanchor) {
             return as_tuple(cache.speculate(id, context, spec(k, factor, offset, min_token_prob, use_tree, reanchor)));
           },
           py::arg("req_id"), py::arg("context"), py::arg("max_spec_tokens"), py::arg("max_spec_factor") = 1.0,
           py::arg("max_spec_offset") = 0.0, py::arg("min_token_prob") = 0.1, py::arg("use_tree_spec") = false,
           py::arg("reanchor") = true, Released())
      .def("step",
           [](Cache& cache, const std::vector<int64_t>& ids, const std::vector<Tokens>& tokens) {
             std::vector<Draft> drafts;
             {
               py::gil_scoped_release released;
               drafts = cache.step(ids, tokens);
             }
             // Built directly: pybind11's generic tuple and list casters cost about 1 us a draft.
             py::list out(drafts.size());
             for (size_t i = 0; i < drafts.size(); ++i) {
               const Draft& draft = drafts[i];
               PyObject* item = Py_BuildValue("(NNNdii)", int_list(draft.token_ids), int_list(draft.parents),
                                              float_list(draft.probs), draft.score, draft.match_len, draft.source);
               if (item == nullptr) throw py::error_already_set();
               PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), item);
             }
             return out;
           })
      .def("active_requests", &Cache::active_requests, Released())
      .def("cached_requests", &Cache::cached_requests, Released())
      .def("cached_tokens", &Cache::cached_tokens)
      .def("memory_bytes", &Cache::memory_bytes, Released())
      .def("snapshot",
           [](const Cache& cache) {
             std::string data;
             {
               py::gil_scoped_release released;
               data = cache.snapshot();
             }
             return py::bytes(data);
           })
      .def("restore", [](Cache& cache, const std::string& data) { cache.restore(data); }, Released());

  for (PyMethodDef& def : kFastCalls) m.add_object(def.ml_name, py::reinterpret_steal<py::object>(PyCFunction_New(&def, nullptr)));
}
