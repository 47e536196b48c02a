// Python bindings of the compiled drafter core: `drafter_service._core`.
// Arguments are converted with the GIL held; the work itself runs without it.
// Drafts come back as tuples (token_ids, parents, probs, score, match_len, source, step_len, detours), each
// detour a tuple (position, token, token_ids, probs).
#include <cstdint>
#include <tuple>
#include <utility>
#include <vector>

#include "cache.h"
#include "ngram_index.h"
#include "py_support.h"
#include "suffix_tree.h"

namespace py = pybind11;
using namespace speclane;

namespace {

using DetourTuple = std::tuple<int, int32_t, Tokens, std::vector<double>>;
using DraftTuple = std::tuple<Tokens, Tokens, std::vector<double>, double, int, int, int, std::vector<DetourTuple>>;
using Released = py::call_guard<py::gil_scoped_release>;

DraftTuple as_tuple(Draft draft) {
  std::vector<DetourTuple> detours;
  for (Detour& detour : draft.detours)
    detours.emplace_back(detour.position, detour.token, std::move(detour.token_ids), std::move(detour.probs));
  return {std::move(draft.token_ids), std::move(draft.parents), std::move(draft.probs), draft.score, draft.match_len,
          draft.source, draft.step_len, std::move(detours)};
}

PyObject* detour_list(const std::vector<Detour>& detours) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(detours.size()));
  for (size_t i = 0; i < detours.size(); ++i) {
    const Detour& detour = detours[i];
    PyObject* item = Py_BuildValue("(iiNN)", detour.position, detour.token, int_list(detour.token_ids),
                                   float_list(detour.probs));
    if (item == nullptr) {
      Py_DECREF(list);
      throw py::error_already_set();
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), item);
  }
  return list;
}

SpecParams spec(int k, double factor, double offset, double min_token_prob, bool use_tree, bool reanchor,
                int lookahead) {
  if (lookahead < 0) throw std::invalid_argument("lookahead must be >= 0");
  SpecParams params;
  params.max_spec_tokens = k;
  params.max_spec_factor = factor;
  params.max_spec_offset = offset;
  params.min_token_prob = min_token_prob;
  params.use_tree = use_tree;
  params.reanchor = reanchor;
  params.lookahead = lookahead;
  return params;
}

}  // namespace

namespace speclane {
void bind_arctic_api(py::module_& m);  // arctic_api.cc
}

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
              bool use_tree, bool reanchor, int lookahead) {
             return as_tuple(tree.speculate(context.data(), context.size(),
                                            spec(k, factor, offset, min_token_prob, use_tree, reanchor, lookahead)));
           },
           py::arg("context"), py::arg("max_spec_tokens"), py::arg("max_spec_factor") = 1.0,
           py::arg("max_spec_offset") = 0.0, py::arg("min_token_prob") = 0.1, py::arg("use_tree") = false,
           py::arg("reanchor") = true, py::arg("lookahead") = 0, Released())
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
              int ngram_min, int ngram_max, bool ngram_latest, int lookahead) {
             SessionParams params;
             params.method = method;
             params.spec = spec(k, factor, offset, min_token_prob, use_tree, reanchor, lookahead);
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
           py::arg("ngram_latest") = false, py::arg("lookahead") = 0, Released())
      .def("add_active_response",
           [](Cache& cache, int64_t id, const Tokens& tokens) { cache.add_active_response(id, tokens.data(), tokens.size()); },
           Released())
      .def("stop_request", &Cache::stop_request, Released())
      .def("evict_cached_response", &Cache::evict_cached_response, Released())
      .def("speculate",
           [](Cache& cache, int64_t id, const Tokens& context, int k, double factor, double offset,
              double min_token_prob, bool use_tree, bool reanchor, int lookahead) {
             return as_tuple(cache.speculate(id, context.data(), context.size(),
                                             spec(k, factor, offset, min_token_prob, use_tree, reanchor, lookahead)));
           },
           py::arg("req_id"), py::arg("context"), py::arg("max_spec_tokens"), py::arg("max_spec_factor") = 1.0,
           py::arg("max_spec_offset") = 0.0, py::arg("min_token_prob") = 0.1, py::arg("use_tree_spec") = false,
           py::arg("reanchor") = true, py::arg("lookahead") = 0, Released())
      .def("step",
           [](Cache& cache, const std::vector<int64_t>& ids, const std::vector<Tokens>& tokens,
              const std::vector<std::pair<double, double>>& budgets) {
             std::vector<Cache::StepBudget> step_budgets;
             step_budgets.reserve(budgets.size());
             for (const auto& [factor, min_prob] : budgets) step_budgets.push_back({factor, min_prob});
             std::vector<Draft> drafts;
             {
               py::gil_scoped_release released;
               drafts = cache.step(ids, tokens, step_budgets);
             }
             // Built directly: pybind11's generic tuple and list casters cost about 1 us a draft.
             py::list out(drafts.size());
             for (size_t i = 0; i < drafts.size(); ++i) {
               const Draft& draft = drafts[i];
               PyObject* item = Py_BuildValue("(NNNdiiiN)", int_list(draft.token_ids), int_list(draft.parents),
                                              float_list(draft.probs), draft.score, draft.match_len, draft.source,
                                              draft.step_len, detour_list(draft.detours));
               if (item == nullptr) throw py::error_already_set();
               PyList_SET_ITEM(out.ptr(), static_cast<Py_ssize_t>(i), item);
             }
             return out;
           },
           py::arg("ids"), py::arg("tokens"), py::arg("budgets") = std::vector<std::pair<double, double>>())
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

  bind_arctic_api(m);
}
