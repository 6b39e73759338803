"""Pick a backend for a plan: cuda (kernels in the plan + a GPU), cpu (NumPy), or auto."""
from __future__ import annotations

import ctypes

from xserv_aot.errors import UsageError, XservError, one_line
from xserv_aot.plan.manifest import Plan, PlanError

CUDA_EXTRA_HINT = "pip install 'xserv-aot[cuda]'"


class NoGpuError(XservError, RuntimeError):
    """The CUDA backend was asked for and cannot run here (no cuda-python, no driver, no GPU); one line."""


def cuda_python_available() -> bool:
    try:
        import cuda.bindings  # noqa: F401
        import cuda.core  # noqa: F401
    except ImportError:
        return False
    return True


def gpu_problem() -> str | None:
    """None when a CUDA GPU is usable, else why not (one line)."""
    if not cuda_python_available():
        return f"the CUDA backend needs cuda-python, which is not installed ({CUDA_EXTRA_HINT})"
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return "no NVIDIA driver found (libcuda.so.1 cannot be loaded)"
    from cuda.bindings import runtime as cudart
    try:
        err, n = cudart.cudaGetDeviceCount()
    except Exception as e:                           # noqa: BLE001  (the bindings raise bare RuntimeErrors)
        return f"the NVIDIA driver cannot be used ({one_line(e)})"
    if int(err) != 0:
        return f"no usable CUDA GPU ({getattr(err, 'name', err)})"
    return None if n > 0 else "no CUDA GPU is visible"


def gpu_available() -> bool:
    return gpu_problem() is None


def require_gpu(what: str) -> None:
    problem = gpu_problem()
    if problem is not None:
        raise NoGpuError(f"{what}: {problem}")


def gpu_arch() -> str:
    from cuda.bindings import runtime as cudart
    err, major = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, 0)
    err2, minor = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor, 0)
    if int(err) or int(err2):
        raise NoGpuError(f"cannot read the GPU's compute capability ({err}, {err2})")
    return f"sm_{major}{minor}"


def check_arch(plan: Plan, arch: str) -> None:
    """A plan's cubins run only on the arch they were built for (sm_90a needs exactly sm_90)."""
    target = plan.build.target
    if target.rstrip("a") != arch:
        raise PlanError(f"{plan.dir}: plan was compiled for {target} but this GPU is {arch}; "
                        f"recompile with --target {arch}{'a' if arch == 'sm_90' else ''}")


def make_runner(plan: Plan, backend: str = "auto"):
    if backend not in ("auto", "cuda", "cpu"):
        raise UsageError(f"unknown backend {backend!r} (cuda | cpu | auto)")
    has_kernels = plan.build.target != "cpu" and bool(plan.kernels.get("cubins"))
    if backend == "auto":
        backend = "cuda" if has_kernels and gpu_available() else "cpu"
    if backend == "cpu":                 # a tensor-parallel plan: its ranks simulated in this process
        from xserv_aot.runtime.numpy_backend import NumpyRunner
        return NumpyRunner(plan)
    if not has_kernels:
        raise PlanError(f"{plan.dir}: plan was compiled for target {plan.build.target!r} without CUDA kernels; "
                        "recompile with --target sm_90a")
    require_gpu("--backend cuda")
    check_arch(plan, gpu_arch())
    if plan.tensor_parallel > 1:         # one process per GPU (NOT RUN on a multi-GPU machine yet)
        from xserv_aot.runtime.cuda.driver import Device
        if Device.count() < plan.tensor_parallel:
            raise PlanError(f"{plan.dir}: plan has tensor_parallel {plan.tensor_parallel} but "
                            f"{Device.count()} GPUs are visible")
        from xserv_aot.runtime.tp_ranks import TensorParallelRunner
        return TensorParallelRunner(plan, "cuda")
    from xserv_aot.runtime.cuda.runner import CudaRunner
    return CudaRunner(plan)
