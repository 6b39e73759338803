"""Build configuration: every shape and kernel setting a plan fixes (BuildConfig, a plain dataclass), the choices
it accepts, and ConfigError. The model's configuration is xserv_aot/model_config.py's."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

from xserv_aot.errors import XservError


class ConfigError(XservError, ValueError):
    """A model or build configuration that xserv-aot cannot handle; the message is one line."""


TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)
QUANTIZATIONS = ("none", "fp8")
FP8_W8A16_MAX_ROWS = 64      # default of fp8_w8a16_max_rows (the W8A16 skinny kernels end at 64 rows)
FP8_SCHEME_CHOICES = ("channel", "block128", "auto")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8_e4m3")   # auto: build dtype (xserv_aot/kv_cache.py)
KV_CACHE_SCALES = ("auto", "calibrate")   # fp8 KV: the checkpoint's per-layer scales, else 1.0 | calibrated
FP8_ROUNDINGS = ("nearest", "gptq")
FP8_SCALES = ("amax", "mse", "refit")


RENAMED_SETTINGS = {"fp8_fold_norm": "fold_norm"}   # old build setting -> its name now (older manifests load)


@dataclass
class BuildConfig:
    """Every shape the plan fixes. Bucket = (num_tokens, num_seqs)."""
    max_num_seqs: int = 8                 # largest decode batch
    decode_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    prefill_buckets: list[int] = field(default_factory=lambda: [32, 128, 256])  # token counts; last = prefill chunk
    max_seq_len: int = 2048
    block_size: int = 16
    num_blocks: int = 0                   # 0: derived from max_num_seqs * max_seq_len
    mixed_prefill_tokens: int = 0         # prompt tokens in a step that also runs decodes; 0 = prefill_chunk
    dtype: str = "bfloat16"               # weights, activations and KV cache: bfloat16 | float32
    target: str = "sm_90a"                # GPU arch for cubins, or "cpu" (no kernels built)
    gemm_library: bool = True             # CUDA: CUTLASS GEMMs for linears of >= 128 rows, when nvcc can build them
    pdl: bool = False                     # CUDA: programmatic dependent launch of every kernel that waits
    pdl_max_seqs: int = 0                 # CUDA: the same in decode buckets of at most this many sequences only
                                          # (the tc GEMVs launch under PDL in every bucket: plan/gemv_tc_plan.py)
    smem_carveout: int = -1               # CUDA: preferred shared-memory carveout (percent of the SM's L1 + shared
                                          # memory) of every NVRTC kernel; -1: the driver's choice (a performance
                                          # hint only: results do not depend on it)
    megakernel_sms: int = 0               # CUDA: decode buckets of 1-2 seqs as one persistent kernel of this many
                                          # blocks, the GPU's SM count (plan/megakernel_plan.py); 0: per-op kernels
    megakernel_max_context: int = 0       # > 0: those buckets keep their per-op kernels and a copy `<name>_mk` runs
                                          # the megakernel for steps whose contexts are all <= this; 0: every step
    gemm_configs: dict[str, str] = field(default_factory=dict)  # CUDA: CUTLASS config per prefill linear shape
    #   ("NxK" or "MxNxK" -> cutlass_build.TABLE_CONFIGS name); a shape not listed: the tile model
    gemv: str = "cuda_cores"              # CUDA: linears of 1-2 rows on the CUDA-core GEMVs (kernels/gemv.cu, gemv_fp8.cu;
                                          # 3+ rows: the skinny kernels), or "tc": bf16 and W8A16 linears of 1-8 rows on
                                          # the tensor cores, weights streamed by the copy engine (kernels/gemv_tc.cu,
                                          # plan/gemv_tc_plan.py)
    gemm_residual: bool = False           # CUDA: o_proj / down add the residual in their GEMM epilogue
    tensor_parallel: int = 1              # ranks (GPUs) the weights, heads and KV pool are split over (1, 2, 4, 8)
    quantization: str = "none"            # none | fp8: linear weights stored as e4m3 with scales (plan/quantize.py)
    fp8_scheme: str = "auto"              # fp8: channel | block128 | auto (block128 where N and K divide by 128)
    quantize_lm_head: bool = False        # fp8: the lm_head too (embedding and norms always stay in dtype)
    fp8_rounding: str = "nearest"         # fp8: nearest | gptq (error-compensated on calibration text at compile
                                          # time, plan/fp8_calibrate.py; same formats and scales, slower compile)
    fp8_scale: str = "amax"               # fp8: amax (amax / 448 per row or block) | mse (the clip factor of least
                                          # squared rounding error per row or block, fp8.mse_scale) | refit (least
                                          # squares on calibration text after rounding, plan/scale_refit.py)
    fp8_refit_rounds: int = 0             # fp8_scale refit: refits per weight, a rounding between two (0: the
                                          # rounding's default, plan/fp8_calibrate.REFIT_ROUNDS)
    prefill_attention: str = "auto"       # CUDA: a prefill attention variant (plan/attention_plan.py), auto: the default
    prefill_row_kernels: str = "auto"     # CUDA: v1 | rows | auto: the norms / silu_mul / rope kernels of prefill
                                          # buckets (plan/row_kernels.py)
    fp8_w8a16_max_rows: int = FP8_W8A16_MAX_ROWS  # fp8: linears of at most this many rows read bf16 activations
                                          # (W8A16), larger ones quantize them per token (W8A8), ops.linear_ops
    fp8_quantize_in_producer: bool = False  # fp8, CUDA: rmsnorm / add_rmsnorm / silu_mul also write the next
                                          # quantize_fp8's output (plan/fp8_build.producer_fuses_quantize)
    fold_norm: bool = False               # CUDA: an add_rmsnorm between two decode GEMVs launches nothing (the one
                                          # before adds the residual, the one after norms its input; gemv "tc": bf16
                                          # and FP8 of 1 row, else FP8 of 1-2 rows: plan/norm_fold.py)
    fp8_w8a8_wgmma: bool = False          # fp8, CUDA: W8A8 linears of 33-256 rows on kernels/gemm_w8a8_wgmma.cu, not
                                          # CUTLASS (plan/fp8_build.plan_w8a8)
    fp8_w8a8_tma: bool = False            # fp8, CUDA: W8A8 linears of 33-64 rows (33-256 without the CUTLASS
                                          # library) on the TMA-fed wgmma kernel, kernels/gemm_w8a8_tma.cu (K >= 128)
    kv_cache_dtype: str = "auto"          # auto (= dtype) | bfloat16 | float32 | fp8_e4m3 (per-layer scales,
                                          # xserv_aot/kv_cache.py)
    kv_cache_scales: str = "auto"         # fp8_e4m3 KV: auto (the checkpoint's k/v scales, else 1.0) | calibrate

    @property
    def prefill_chunk(self) -> int:
        return max(self.prefill_buckets)

    @property
    def mixed_prefill_budget(self) -> int:
        """Most prompt tokens a step that also carries decodes may take (a prompt delays decodes by one such step)."""
        return self.mixed_prefill_tokens or self.prefill_chunk

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "BuildConfig":
        """A build config (a --build-config file, a manifest's build section); an unknown key is an error, so a
        misspelt setting is never silently dropped."""
        names = [f.name for f in dataclasses.fields(cls)]
        d = {RENAMED_SETTINGS.get(k, k): v for k, v in d.items()}
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise ConfigError(f"unknown build setting {unknown[0]!r} (known: {', '.join(names)})")
        return cls(**d)

    def validate(self) -> "BuildConfig":
        if self.dtype not in ("bfloat16", "float32"):
            raise ConfigError(f"unsupported dtype {self.dtype!r} (supported: bfloat16, float32)")
        if not self.decode_buckets or min(self.decode_buckets) < 1:
            raise ConfigError("decode buckets must be positive batch sizes")
        if max(self.decode_buckets) != self.max_num_seqs:
            raise ConfigError(f"largest decode bucket {max(self.decode_buckets)} must equal max_num_seqs {self.max_num_seqs}")
        if not self.prefill_buckets or min(self.prefill_buckets) < 1:
            raise ConfigError("prefill buckets must be positive token counts")
        if self.prefill_chunk < self.max_num_seqs:
            raise ConfigError(f"largest prefill bucket {self.prefill_chunk} must hold max_num_seqs {self.max_num_seqs} tokens")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block size {self.block_size} must be a power of two")
        if self.max_seq_len < 2:
            raise ConfigError("max_seq_len must be at least 2")
        if self.num_blocks < 0:
            raise ConfigError("num_blocks must be >= 0")
        if not 0 <= self.mixed_prefill_tokens <= max(self.prefill_buckets):
            raise ConfigError(f"mixed_prefill_tokens {self.mixed_prefill_tokens} must be in 0..largest prefill bucket")
        if self.tensor_parallel not in TENSOR_PARALLEL_SIZES or isinstance(self.tensor_parallel, bool):
            raise ConfigError(f"tensor_parallel {self.tensor_parallel!r} is not one of "
                              f"{', '.join(map(str, TENSOR_PARALLEL_SIZES))}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
        if self.fp8_scheme not in FP8_SCHEME_CHOICES:
            raise ConfigError(f"fp8_scheme {self.fp8_scheme!r} is not one of {', '.join(FP8_SCHEME_CHOICES)}")
        from xserv_aot.kv_cache import check_kv_build
        check_kv_build(self)
        if self.fp8_rounding not in FP8_ROUNDINGS:
            raise ConfigError(f"fp8_rounding {self.fp8_rounding!r} is not one of {', '.join(FP8_ROUNDINGS)}")
        if self.fp8_scale not in FP8_SCALES:
            raise ConfigError(f"fp8_scale {self.fp8_scale!r} is not one of {', '.join(FP8_SCALES)}")
        if self.fp8_rounding != "nearest" and self.quantization != "fp8":
            raise ConfigError(f"fp8_rounding {self.fp8_rounding} rounds FP8 weights; it needs quantization fp8")
        if self.fp8_refit_rounds < 0 or (self.fp8_refit_rounds and self.fp8_scale != "refit"):
            raise ConfigError(f"fp8_refit_rounds {self.fp8_refit_rounds}: a count >= 1 of fp8_scale refit (0: its "
                              f"default)")
        if self.fp8_scale != "amax" and self.quantization != "fp8":
            raise ConfigError(f"fp8_scale {self.fp8_scale} scales FP8 weights; it needs quantization fp8")
        if isinstance(self.megakernel_sms, bool) or not isinstance(self.megakernel_sms, int) or self.megakernel_sms < 0:
            raise ConfigError(f"megakernel_sms must be a block count >= 0 (the GPU's SMs), got {self.megakernel_sms!r}")
        if isinstance(self.megakernel_max_context, bool) or not isinstance(self.megakernel_max_context, int) \
                or self.megakernel_max_context < 0:
            raise ConfigError(f"megakernel_max_context must be a token count >= 0, got {self.megakernel_max_context!r}")
        if not isinstance(self.gemm_configs, dict):
            raise ConfigError(f"gemm_configs must be an object of shape -> config name, got {self.gemm_configs!r}")
        from xserv_aot.plan.cutlass_build import check_gemm_table
        try:
            check_gemm_table(self.gemm_configs)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        from xserv_aot.plan.attention_plan import PREFILL_ATTN_VARIANTS
        if self.prefill_attention != "auto" and self.prefill_attention not in PREFILL_ATTN_VARIANTS:
            raise ConfigError(f"prefill_attention {self.prefill_attention!r} is not auto or one of "
                              f"{', '.join(PREFILL_ATTN_VARIANTS)}")
        from xserv_aot.plan.row_kernels import ROW_KERNEL_CHOICES
        if self.prefill_row_kernels not in ROW_KERNEL_CHOICES:
            raise ConfigError(f"prefill_row_kernels {self.prefill_row_kernels!r} is not one of "
                              f"{', '.join(ROW_KERNEL_CHOICES)}")
        if not (isinstance(self.fp8_w8a16_max_rows, int) and 2 <= self.fp8_w8a16_max_rows <= FP8_W8A16_MAX_ROWS) \
                or isinstance(self.fp8_w8a16_max_rows, bool):
            raise ConfigError(f"fp8_w8a16_max_rows {self.fp8_w8a16_max_rows!r} must be an integer in 2..64 (rows 1-2 "
                              f"are always W8A16 GEMVs; the W8A16 skinny kernels end at 64 rows)")
        if not (isinstance(self.smem_carveout, int) and -1 <= self.smem_carveout <= 100) \
                or isinstance(self.smem_carveout, bool):
            raise ConfigError(f"smem_carveout {self.smem_carveout!r} must be an integer percent in 0..100, or -1 "
                              f"(the driver's choice)")
        if not isinstance(self.pdl_max_seqs, int) or isinstance(self.pdl_max_seqs, bool) or self.pdl_max_seqs < 0:
            raise ConfigError(f"pdl_max_seqs must be a sequence count >= 0, got {self.pdl_max_seqs!r}")
        from xserv_aot.plan.gemv_tc_plan import GEMV_CHOICES
        if self.gemv not in GEMV_CHOICES:
            raise ConfigError(f"gemv {self.gemv!r} is not one of {', '.join(GEMV_CHOICES)}")
        for name in ("gemm_library", "pdl", "quantize_lm_head", "gemm_residual", "fp8_quantize_in_producer",
                     "fold_norm", "fp8_w8a8_wgmma", "fp8_w8a8_tma"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self.decode_buckets = sorted(set(int(b) for b in self.decode_buckets))
        self.prefill_buckets = sorted(set(int(b) for b in self.prefill_buckets))
        if self.num_blocks == 0:
            self.num_blocks = self.max_num_seqs * self.max_blocks_per_seq
        return self


def cache_root() -> Path:
    """Root of the compile caches (NVRTC cubins, the CUTLASS library): $XSERV_AOT_CACHE, else ~/.cache/xserv-aot.
    Cached artifacts are keyed by their full inputs, so the location never changes a plan."""
    return Path(os.environ.get("XSERV_AOT_CACHE", "~/.cache/xserv-aot")).expanduser()
