"""Build setting fold_norm: which add_rmsnorms of a bucket launch nothing because the decode GEMVs around them do
their work (the one before adds its output into the residual, the one after normalizes the residual while staging
its input), and which role each of those GEMVs plays. gemv "tc": bf16 and W8A16 linears on kernels/gemv_tc.cu
(plan/gemv_tc_plan.py); "cuda_cores": the FP8 GEMVs of kernels/gemv_fp8.cu (plan/fp8_build.plan_gemv_fold).
Called by plan.kernel_build."""
from __future__ import annotations

from xserv_aot.plan.fp8_build import is_fp8_gemv
from xserv_aot.plan.gemv_tc_plan import gemv_tc_fits
from xserv_aot.plan.op_records import AddRmsNorm, Linear, Op, SiluMul, read_later

TC_FOLD_MAX_ROWS = 1                      # gemv "tc": buckets of at most this many rows fold (H100, session 27:
                                          # decode_1 -0.05 to -0.16 ms, decode_2 +0.07 to +0.20; the kernels take 1-8)


def folding_gemv(ops: list[Op], idx: int, gemv: str) -> bool:
    """Whether ops[idx] runs on a GEMV with a folded-norm variant: gemv "tc", a bf16 or W8A16 linear that
    kernels/gemv_tc.cu takes (gate: fused with the silu_mul after it); "cuda_cores", an FP8 GEMV of 1-2 rows."""
    op = ops[idx]
    if gemv != "tc":
        return is_fp8_gemv(op)
    nxt = ops[idx + 1] if idx + 1 < len(ops) else None
    gate = isinstance(nxt, SiluMul) and nxt.inp == getattr(op, "out", None)
    return isinstance(op, Linear) and not op.inp_scale and gemv_tc_fits(op, gate)


def folds_norm(ops: list[Op], idx: int, enabled: bool, gemv: str = "cuda_cores") -> bool:
    """Build setting fold_norm: ops[idx], an add_rmsnorm between two GEMVs (folding_gemv; gemv "tc": of at most
    TC_FOLD_MAX_ROWS rows), launches nothing. The GEMV before it adds its output into the residual; the one after
    it normalizes the residual while staging its input (gemv "tc": kernels/gemv_tc.cu RES / NORM; "cuda_cores":
    kernels/gemv_fp8.cu, where the one before also writes the sums of squares, NORM_PARTIALS, one a block and row).
    Only where nothing later reads the norm's output or the delta it no longer receives."""
    if not enabled or not 0 < idx < len(ops) - 1 or not isinstance(ops[idx], AddRmsNorm):
        return False
    prev, norm, nxt = ops[idx - 1], ops[idx], ops[idx + 1]
    if gemv == "tc" and norm.rows > TC_FOLD_MAX_ROWS:
        return False
    return (folding_gemv(ops, idx - 1, gemv) and folding_gemv(ops, idx + 1, gemv) and prev.out == norm.delta
            and nxt.inp == norm.out and prev.rows == norm.rows == nxt.rows and prev.n == nxt.k
            and not (prev.bias and gemv != "tc")
            and not read_later(ops, idx + 1, norm.delta) and not read_later(ops, idx + 2, norm.out))


def folded_norms(ops: list[Op], enabled: bool, gemv: str = "cuda_cores") -> set[int]:
    """Indices of the add_rmsnorms of ops that fold (folds_norm)."""
    return {i for i in range(len(ops)) if folds_norm(ops, i, enabled, gemv)}


def fold_role(ops: list[Op], idx: int, folded: set[int]) -> tuple[str, AddRmsNorm] | None:
    """("res", norm) for the linear before a folded add_rmsnorm, ("norm", norm) for the one after it."""
    if idx + 1 in folded:
        return "res", ops[idx + 1]
    if idx - 1 in folded:
        return "norm", ops[idx - 1]
    return None
