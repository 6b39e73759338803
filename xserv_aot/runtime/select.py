"""Pick a backend for a plan: cuda (kernels in the plan + a GPU), cpu (NumPy), or auto."""
from __future__ import annotations

from xserv_aot.plan.manifest import Plan, PlanError


def gpu_available() -> bool:
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        return False
    try:
        err, n = cudart.cudaGetDeviceCount()
    except Exception:
        return False
    return int(err) == 0 and n > 0


def gpu_arch() -> str:
    from cuda.bindings import runtime as cudart
    err, major = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMajor, 0)
    err2, minor = cudart.cudaDeviceGetAttribute(cudart.cudaDeviceAttr.cudaDevAttrComputeCapabilityMinor, 0)
    if int(err) or int(err2):
        raise RuntimeError(f"cannot read the GPU's compute capability ({err}, {err2})")
    return f"sm_{major}{minor}"


def check_arch(plan: Plan, arch: str) -> None:
    """A plan's cubins run only on the arch they were built for (sm_90a needs exactly sm_90)."""
    target = plan.build.target
    if target.rstrip("a") != arch:
        raise PlanError(f"{plan.dir}: plan was compiled for {target} but this GPU is {arch}; "
                        f"recompile with --target {arch}{'a' if arch == 'sm_90' else ''}")


def make_runner(plan: Plan, backend: str = "auto"):
    if backend not in ("auto", "cuda", "cpu"):
        raise ValueError(f"unknown backend {backend!r} (cuda | cpu | auto)")
    has_kernels = plan.build.target != "cpu" and bool(plan.kernels.get("cubins"))
    if backend == "auto":
        backend = "cuda" if has_kernels and gpu_available() else "cpu"
    if backend == "cpu":                 # a tensor-parallel plan: its ranks simulated in this process
        from xserv_aot.runtime.numpy_backend import NumpyRunner
        return NumpyRunner(plan)
    if not has_kernels:
        raise PlanError(f"{plan.dir}: plan was compiled for target {plan.build.target!r} without CUDA kernels; "
                        "recompile with --target sm_90a")
    if not gpu_available():
        raise RuntimeError("--backend cuda: no CUDA GPU is visible")
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
