//! Compiles the HAL's kernel sources with NVRTC for sm_90 (CUBIN and PTX). Needs NVRTC only, no
//! GPU: CI installs it from the `nvidia-cuda-nvrtc` wheel and sets `HOLDFAST_REQUIRE_NVRTC=1`, so
//! there a missing NVRTC fails instead of skipping.
#![cfg(feature = "cuda")]

use holdfast_hal::{cuda, demo_kernels};

#[test]
fn demo_kernels_compile_for_sm_90() {
    if let Some(bytes) = holdfast_hal::testing::assert_compiles_for_sm_90(demo_kernels::source()) {
        let (major, minor) = cuda::nvrtc_version().expect("version");
        eprintln!("NVRTC {major}.{minor}: {bytes} bytes of CUBIN for sm_90");
    }
}

#[test]
fn a_kernel_with_a_syntax_error_reports_the_compiler_log() {
    if cuda::nvrtc_unavailable_reason().is_some() {
        eprintln!("skipped: NVRTC is not available");
        return;
    }
    let mut bad = demo_kernels::source().clone();
    bad.name = "broken";
    bad.code = "HF_KERNEL void broken(float* x) { x[0] = undeclared_name; }";
    match cuda::compile(&bad, "sm_90", 32) {
        Err(holdfast_hal::HalError::Compile { log, arch, .. }) => {
            assert_eq!(arch, "sm_90");
            assert!(log.contains("undeclared_name"), "{log}");
        }
        other => panic!("expected a compile error, got {:?}", other.map(|(c, _)| c.len())),
    }
}
