"""Device and dtype selection with fake CUDA and torch_npu (neither is installed here)."""

import sys
from types import SimpleNamespace

import pytest
import torch

from verifier_service.device import (
    DeviceError,
    HeadPrecision,
    auto_cpu_bf16,
    cpu_has_native_bf16,
    resolve_device,
    resolve_dtype,
    resolve_head_precision,
    resolve_threads,
)


def fake_backend(available: bool, count: int = 1, bf16: bool = True):
    return SimpleNamespace(is_available=lambda: available, device_count=lambda: count,
                           is_bf16_supported=lambda: bf16)


NO_CUDA = fake_backend(False, 0)


def importer(npu=None, error: type[Exception] = ImportError):
    """An import_module that offers a fake torch_npu (or fails like a missing one)."""
    def import_module(name):
        assert name == "torch_npu"
        if npu is None:
            raise error("No module named 'torch_npu'")
        return SimpleNamespace(npu=npu)
    return import_module


def must_not_import(name):
    raise AssertionError(f"imported {name}")


def test_auto_prefers_cuda():
    assert resolve_device("auto", import_module=must_not_import, cuda=fake_backend(True)) == "cuda:0"


def test_auto_falls_back_to_npu_then_cpu():
    assert resolve_device("auto", import_module=importer(fake_backend(True)), cuda=NO_CUDA) == "npu:0"
    assert resolve_device("auto", import_module=importer(fake_backend(False, 0)), cuda=NO_CUDA) == "cpu"
    assert resolve_device("auto", import_module=importer(None), cuda=NO_CUDA) == "cpu"
    # A torch_npu without CANN fails with other errors than ImportError.
    assert resolve_device("auto", import_module=importer(None, RuntimeError), cuda=NO_CUDA) == "cpu"


def test_cpu_never_probes_accelerators():
    assert resolve_device("cpu", import_module=must_not_import, cuda=fake_backend(True)) == "cpu"


def test_explicit_npu_without_library_is_a_clear_error():
    with pytest.raises(DeviceError, match="torch_npu is not installed"):
        resolve_device("npu", import_module=importer(None), cuda=NO_CUDA)
    with pytest.raises(DeviceError, match="no NPU is visible"):
        resolve_device("npu", import_module=importer(fake_backend(False, 0)), cuda=NO_CUDA)


def test_explicit_indices_are_checked():
    two_npus = importer(fake_backend(True, 2))
    assert resolve_device("npu:1", import_module=two_npus, cuda=NO_CUDA) == "npu:1"
    with pytest.raises(DeviceError, match="only 2"):
        resolve_device("npu:2", import_module=two_npus, cuda=NO_CUDA)
    assert resolve_device("cuda:1", import_module=must_not_import, cuda=fake_backend(True, 2)) == "cuda:1"
    with pytest.raises(DeviceError, match="CUDA is not available"):
        resolve_device("cuda", import_module=must_not_import, cuda=NO_CUDA)


@pytest.mark.parametrize("name", ["gpu", "npu:x", "cuda:", "CPU", ""])
def test_unknown_device_names_are_refused(name):
    with pytest.raises(DeviceError, match="unknown device"):
        resolve_device(name, import_module=must_not_import, cuda=NO_CUDA)


def test_real_host_resolves_to_cpu_without_loading_torch_npu():
    assert resolve_device("auto") == "cpu"
    assert "torch_npu" not in sys.modules


def test_dtype_defaults_per_device():
    assert resolve_dtype("auto", "cpu") is torch.float32
    assert resolve_dtype("auto", "cpu", cpu_bf16=True) is torch.bfloat16
    assert resolve_dtype("float32", "cpu", cpu_bf16=True) is torch.float32
    assert resolve_dtype("auto", "npu:0") is torch.bfloat16
    assert resolve_dtype("auto", "cuda:0", cuda=fake_backend(True, bf16=True)) is torch.bfloat16
    assert resolve_dtype("auto", "cuda:0", cuda=fake_backend(True, bf16=False)) is torch.float16
    assert resolve_dtype("float16", "cpu") is torch.float16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("fp8", "cpu")


def test_auto_is_bf16_on_a_cpu_only_where_it_multiplies_bf16_natively_and_passes_can_be_batch_invariant():
    cases = [  # native bf16, tensor-parallel size, --batch-invariant, --attention-backend -> bf16
        (True, 1, "auto", "auto", True),
        (True, 1, "on", "auto", True),
        (False, 1, "auto", "auto", False),  # torch widens bf16 to fp32 first: no faster
        (True, 2, "auto", "auto", False),  # the ranks' reductions are not invariant
        (True, 1, "off", "auto", False),  # speculation could change a greedy output
        (True, 1, "auto", "TORCH_SDPA", False),  # a named backend attends as it does, not invariantly
    ]
    for native, ranks, invariant, backend, expected in cases:
        assert auto_cpu_bf16(native, ranks, invariant, backend) is expected, (native, ranks, invariant, backend)


def test_auto_threads_share_the_cores_among_the_ranks():
    assert resolve_threads(0, cores=16) == 16
    assert resolve_threads(0, ranks_here=4, cores=16) == 4
    assert resolve_threads(0, ranks_here=4, cores=2) == 1
    assert resolve_threads(3, cores=16) == 3


def test_a_head_has_int8_weights_by_default_only_on_a_cpu_that_multiplies_bf16_natively():
    int8 = HeadPrecision(torch.bfloat16, int8_weights=True)
    cases = [  # requested, device, target's dtype, native bf16 -> the head's precision
        ("auto", "cpu", torch.float32, True, int8),
        ("auto", "cpu", torch.float32, False, HeadPrecision(torch.float32)),
        ("auto", "cuda:0", torch.float16, True, HeadPrecision(torch.float16)),
        ("float32", "cpu", torch.float32, True, HeadPrecision(torch.float32)),
        ("bfloat16", "cpu", torch.float32, True, HeadPrecision(torch.bfloat16)),
        ("int8", "cpu", torch.float32, False, int8),
    ]
    for requested, device, target, native, expected in cases:
        assert resolve_head_precision(requested, device, target, native_bf16=lambda n=native: n) == expected


def test_int8_head_weights_are_refused_off_a_cpu():
    with pytest.raises(ValueError, match="CPU only"):
        resolve_head_precision("int8", "npu:0", torch.bfloat16)


def test_native_bf16_is_read_from_the_cpus_flags(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    assert cpu_has_native_bf16(str(cpuinfo))
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n")
    assert not cpu_has_native_bf16(str(cpuinfo))
    assert not cpu_has_native_bf16(str(tmp_path / "absent"))
