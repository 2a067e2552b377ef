"""Shared pytest configuration for the qmuon_lightning test suite.

The ``cuda`` and ``slow`` markers are declared in pyproject.toml; nothing is re-registered here.
"""

from __future__ import annotations

import os

import pytest
import torch

# The suite uses small matrices. With intra-op parallelism on a small shared machine every op
# pays an OpenMP barrier: measured on the 2-core CI box under load, torch.floor on a 32x640
# tensor took 16 ms with 2 threads and 0.01 ms with 1. Results are compared only between runs
# in the same process, so the thread count never enters a tolerance.
torch.set_num_threads(1)

# ns_dtype="auto" picks the Newton-Schulz dtype from the CPU (bf16 where bf16 matmul is native, fp32
# elsewhere), and the suite runs what users get on this CPU. A test whose bit-exactness needs bf16
# Newton-Schulz (a bf16 carrier is lossless only against bf16 NS) says so with
# @pytest.mark.ns_bf16, which pins "auto" to bf16 through QMUON_NS_DTYPE for that test, its fixtures
# and the processes it starts. Running the suite with QMUON_NS_DTYPE=fp32 (or bf16) set tests the
# other choice everywhere else.
_USER_NS_DTYPE = os.environ.get("QMUON_NS_DTYPE")

# Inductor's on-disk cache does not key its compiled CPU kernels by the ATen capability: a kernel built
# under ATEN_CPU_CAPABILITY=avx2 and loaded in an AVX512 run (or the reverse) returned garbage or crashed
# (measured on the AMX Xeon, tests/test_ops_api.py, torch 2.13). One cache per capability keeps the
# suite's runs on each CPU kind (native, AVX2-capped) apart; the processes the tests start inherit it.
_inductor_root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
if _inductor_root is None:
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    _inductor_root = default_cache_dir()
_capability_dir = f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"
if os.path.basename(os.path.normpath(_inductor_root)) != _capability_dir:  # a pytest the tests start
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_inductor_root, _capability_dir)

#: What a one-process Lightning / Accelerate run sets and leaves behind in this process.
_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK",
             "GROUP_RANK")


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """A test that starts the default process group (or sets the rendezvous variables) in the pytest
    process must undo it: later tests inherited them (Accelerate wrapped models in DDP, forked workers
    found a group, a rendezvous hit EADDRINUSE). Cleaned up here, and the test errors, naming the leak."""
    import torch.distributed as dist

    env = {k: os.environ.get(k) for k in _DIST_ENV}
    had_group = dist.is_available() and dist.is_initialized()
    yield
    leaks = []
    if dist.is_available() and dist.is_initialized() and not had_group:
        dist.destroy_process_group()
        leaks.append("the default process group")
    for k, v in env.items():
        if os.environ.get(k) != v:
            leaks.append(f"{k}={os.environ.get(k)!r}")
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    if leaks:
        pytest.fail(f"the test left {', '.join(leaks)} in the pytest process (cleaned up now); undo it in the test")


#: Decorator for tests that need a GPU: ``@requires_cuda``. Skips (never passes) without CUDA.
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before a test's fixtures run: tell the launchers whether it is marked ``slow`` (a test that
    starts processes must be; tests/_dist.py fails it otherwise), and apply its ``ns_bf16`` pin."""
    import _dist

    _dist.running_test_is_slow = item.get_closest_marker("slow") is not None
    # before the test's fixtures (module-scoped ones included) run, so that they see the pin
    if item.get_closest_marker("ns_bf16") is not None:
        os.environ["QMUON_NS_DTYPE"] = "bf16"
    else:
        _restore_ns_dtype()


def pytest_runtest_teardown(item, nextitem):
    _restore_ns_dtype()  # the doc pages (collected after tests/) run without a test's pin


def _restore_ns_dtype() -> None:
    if _USER_NS_DTYPE is None:
        os.environ.pop("QMUON_NS_DTYPE", None)
    else:
        os.environ["QMUON_NS_DTYPE"] = _USER_NS_DTYPE


@pytest.fixture(scope="session")
def ext():
    """The loaded compiled kernels (``qmuon.ops._extension.status()``); the test skips, with
    the reason, where they cannot be built (or ``QMUON_BACKEND=reference`` asks for none)."""
    from qmuon.ops import _extension

    st = _extension.status()
    if not st.cpu:
        pytest.skip(f"compiled kernels unavailable: {st.reason}")
    return st


@pytest.fixture(scope="session")
def cuda_ext():
    """The loaded compiled kernels, with CUDA ones (for ``@pytest.mark.cuda`` kernel tests): from the
    prebuilt GPU library or the JIT build, with or without the CPU ones; skips with the reason where
    there are none."""
    from qmuon.ops import _extension

    st = _extension.status()
    if not st.cuda:
        pytest.skip(f"CUDA kernels unavailable: {st.reason}")
    return st


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def kernel_device(request):
    """Each kernel test once per device: ``cpu`` (the compiled CPU kernels, ``ext``) and ``cuda`` (marked
    ``cuda``: skipped cleanly without a GPU; ``cuda_ext``). Yields the ``torch.device``."""
    fixture = "cuda_ext" if request.param == "cuda" else "ext"
    request.getfixturevalue(fixture)
    return torch.device(request.param)


def pytest_collection_modifyitems(config, items):
    """Tests marked ``@pytest.mark.cuda`` are skipped (reported as skips) when no GPU is present,
    so GPU tests only need the marker and cannot silently run on CPU.

    Tests marked ``qmuon_train`` parse configs with ``qmuon-train``'s LightningCLI, which needs
    jsonargparse >= 4.53 (a core dependency). In LitGPT's environment (LitGPT 0.5.x caps jsonargparse
    at 4.41; qmuon-lightning goes in with --no-deps, docs/litgpt.md) they skip, with the reason, instead of failing on the install."""
    try:
        from qmuon_lightning.cli import cli_dependency_problem

        problem = cli_dependency_problem()
    except ImportError as e:  # the library's own environments (.ci/run-litgpt) have no kit
        problem = f"the Lightning kit (qmuon-lightning) cannot be imported here: {e}"
    for item in items:
        if not torch.cuda.is_available() and item.get_closest_marker("cuda") is not None:
            item.add_marker(requires_cuda)
        if problem is not None and item.get_closest_marker("qmuon_train"):
            item.add_marker(pytest.mark.skip(reason=problem))
