// Python <-> core conversions shared by the bindings (bindings.cc) and the
// Arctic-compatible class (arctic_api.cc), and the argument binding of its
// fastcall methods. Token lists cross the boundary on every call, so they are
// read and built directly with the CPython API instead of element by element
// through pybind11's generic casters.
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <vector>

namespace speclane {

using Tokens = std::vector<int32_t>;

// Calls fn(tokens, n) with the last `keep` items (all: SIZE_MAX) of a sequence
// of ints as int32, in a stack buffer when they fit (no allocation on the
// per-step calls). Lists and tuples are read in place; anything else (a numpy
// array, a range) is sliced first, so only the kept items are converted.
template <typename Fn>
auto with_tail(PyObject* sequence, size_t keep, Fn fn) {
  if (PyUnicode_Check(sequence) || PyBytes_Check(sequence)) throw pybind11::type_error("token ids must be integers");
  pybind11::object owned;
  if (!PyList_Check(sequence) && !PyTuple_Check(sequence)) {
    Py_ssize_t size = PyObject_Length(sequence);
    if (size < 0) {
      PyErr_Clear();
      throw pybind11::type_error("token ids must be a sequence of integers");
    }
    Py_ssize_t from = size - static_cast<Py_ssize_t>(std::min(static_cast<size_t>(size), keep));
    owned = pybind11::reinterpret_steal<pybind11::object>(PySequence_GetSlice(sequence, from, size));
    if (owned) owned = pybind11::reinterpret_steal<pybind11::object>(PySequence_Fast(owned.ptr(), ""));
    if (!owned) {
      PyErr_Clear();
      throw pybind11::type_error("token ids must be a sequence of integers");
    }
    sequence = owned.ptr();
  }
  Py_ssize_t size = PySequence_Fast_GET_SIZE(sequence);
  PyObject** items = PySequence_Fast_ITEMS(sequence);
  Py_ssize_t from = size - static_cast<Py_ssize_t>(std::min(static_cast<size_t>(size), keep));
  const size_t n = static_cast<size_t>(size - from);
  int32_t small[64];
  Tokens large;
  int32_t* tokens = small;
  if (n > 64) {
    large.resize(n);
    tokens = large.data();
  }
  for (size_t i = 0; i < n; ++i) {
    long token = PyLong_AsLong(items[from + static_cast<Py_ssize_t>(i)]);
    if ((token == -1 && PyErr_Occurred()) || token < INT32_MIN || token > INT32_MAX) {
      PyErr_Clear();
      throw pybind11::type_error("token ids must be int32 integers");
    }
    tokens[i] = static_cast<int32_t>(token);
  }
  return fn(static_cast<const int32_t*>(tokens), n);
}

inline PyObject* int_list(const Tokens& tokens) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(tokens.size()));
  for (size_t i = 0; i < tokens.size(); ++i) PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), PyLong_FromLong(tokens[i]));
  return list;
}

// Path probabilities stay the same along an edge: equal neighbours share one float object.
inline PyObject* float_list(const std::vector<double>& values) {
  PyObject* list = PyList_New(static_cast<Py_ssize_t>(values.size()));
  PyObject* last = nullptr;
  for (size_t i = 0; i < values.size(); ++i) {
    if (last != nullptr && values[i] == values[i - 1]) {
      Py_INCREF(last);
    } else {
      last = PyFloat_FromDouble(values[i]);
    }
    PyList_SET_ITEM(list, static_cast<Py_ssize_t>(i), last);
  }
  return list;
}

// CPython fastcall methods (METH_FASTCALL | METH_KEYWORDS) for the calls made
// per decode step: arguments bound without pybind11's dispatch.

// A method's parameter names as interned strings, made once: call sites
// intern their keyword names too, so matching one is a pointer compare.
struct Parameters {
  Parameters(const char* function, std::initializer_list<const char*> names, size_t required)
      : function(function), required(required) {
    for (const char* name : names) interned.push_back(PyUnicode_InternFromString(name));  // kept for the process
  }
  std::string function;
  size_t required;
  std::vector<PyObject*> interned;
};

inline size_t index_of(const Parameters& parameters, PyObject* name) {
  const size_t count = parameters.interned.size();
  for (size_t i = 0; i < count; ++i)
    if (parameters.interned[i] == name) return i;
  for (size_t i = 0; i < count; ++i)  // a name that was not interned
    if (PyUnicode_Compare(name, parameters.interned[i]) == 0) return i;
  return count;
}

// Matches a fastcall's positional and keyword arguments to the parameters:
// out[i] is the i-th argument, or nullptr when not given.
inline void bind_arguments(const Parameters& parameters, PyObject* const* args, Py_ssize_t nargs,
                           PyObject* kwnames, PyObject** out) {
  const size_t count = parameters.interned.size();
  auto fail = [&](const std::string& what) { throw pybind11::type_error(parameters.function + ("() " + what)); };
  std::fill(out, out + count, nullptr);
  if (static_cast<size_t>(nargs) > count) fail("takes at most " + std::to_string(count) + " arguments");
  std::copy(args, args + nargs, out);
  Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
  for (Py_ssize_t k = 0; k < nkw; ++k) {
    PyObject* name = PyTuple_GET_ITEM(kwnames, k);
    size_t i = index_of(parameters, name);
    if (i == count) fail(std::string("got an unexpected keyword argument ") + PyUnicode_AsUTF8(name));
    if (out[i] != nullptr) fail(std::string("got multiple values for ") + PyUnicode_AsUTF8(name));
    out[i] = args[nargs + k];
  }
  for (size_t i = 0; i < parameters.required; ++i)
    if (out[i] == nullptr) fail(std::string("missing argument ") + PyUnicode_AsUTF8(parameters.interned[i]));
}

// Runs a fastcall method body, mapping C++ exceptions to Python ones as pybind11 does.
template <typename Body>
PyObject* fastcall(Body body) {
  try {
    return body();
  } catch (pybind11::error_already_set& error) {
    error.restore();
  } catch (const pybind11::builtin_exception& error) {
    error.set_error();
  } catch (const std::invalid_argument& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
  } catch (const std::out_of_range& error) {
    PyErr_SetString(PyExc_IndexError, error.what());
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
  return nullptr;
}

}  // namespace speclane

namespace pybind11 {
namespace detail {
template <>
struct type_caster<speclane::Tokens> {
  PYBIND11_TYPE_CASTER(speclane::Tokens, const_name("list[int]"));

  bool load(handle src, bool) {
    if (!src) return false;
    try {
      value = speclane::with_tail(src.ptr(), SIZE_MAX,
                                  [](const int32_t* tokens, size_t n) { return speclane::Tokens(tokens, tokens + n); });
    } catch (const type_error&) {
      return false;
    }
    return true;
  }

  static handle cast(const speclane::Tokens& tokens, return_value_policy, handle) { return speclane::int_list(tokens); }
};
}  // namespace detail
}  // namespace pybind11
