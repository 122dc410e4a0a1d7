"""profile_steps.py sorts kernels into kinds by name; a kernel that lands in the wrong kind would move
the profile's explanation of the offline run (benchmarks/results/profile-offline-qwen3-0.6b-h200.md)."""

from __future__ import annotations

import pytest

from tandem.benchmarks.profile_steps import kind_of


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("void flashinfer::BatchPrefillWithPagedKVCacheKernel<...>", "attention"),
        ("void flashinfer::BatchDecodeWithPagedKVCacheKernel<...>", "attention"),
        ("void flashinfer::AppendPagedKVCacheKernel<128u, 8u>", "kv append"),
        ("qk_norm_rope_kernel", "q/k norm + rope"),
        ("void flashinfer::norm::FusedAddRMSNormKernel<8u, bf16>", "rms norms"),
        ("void flashinfer::activation::act_and_mul_kernel<...>", "activation"),
        ("race_kernel", "sampling"),
        ("nvjet_sm90_tst_64x32_64x16_4x2_h_bz_TNT", "gemm"),
        ("void cublasLt::splitKreduce_kernel<32, 16>", "gemm"),
        ("Memcpy HtoD (Pinned -> Device)", "memcpy"),
        ("void at::native::vectorized_elementwise_kernel<4>", "elementwise"),
        ("some_new_kernel", "other"),
    ],
)
def test_kernel_kinds(name: str, kind: str) -> None:
    assert kind_of(name) == kind
