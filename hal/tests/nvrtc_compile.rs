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

#[test]
fn the_dependent_demo_kernel_waits_for_the_kernel_before_it_and_the_plain_one_does_not() {
    if cuda::nvrtc_unavailable_reason().is_some() {
        assert!(std::env::var_os("HOLDFAST_REQUIRE_NVRTC").is_none(), "NVRTC is required here");
        eprintln!("skipped: NVRTC is not available");
        return;
    }
    let (_, ptx) = cuda::compile(demo_kernels::source(), "sm_90a", 32).expect("compiles");
    let ptx = String::from_utf8_lossy(&ptx);
    assert!(cuda::ptx_entry_waits_for_prior(&ptx, "hf_touch_dependent"));
    assert!(!cuda::ptx_entry_waits_for_prior(&ptx, "hf_touch"));
    // Before sm_90 the portability header compiles the wait to nothing.
    let (_, ptx80) = cuda::compile(demo_kernels::source(), "sm_80", 32).expect("compiles");
    assert!(!cuda::ptx_entry_waits_for_prior(&String::from_utf8_lossy(&ptx80), "hf_touch_dependent"));
}

#[test]
fn the_cubin_names_every_kernel_with_its_registers_and_a_spilling_one_with_its_frame() {
    let Some(found) = holdfast_hal::testing::sm90a_kernel_resources(demo_kernels::source()) else { return };
    for k in &found {
        assert!(k.registers > 0 && k.registers <= 255, "{k:?}");
        assert_eq!(k.frame_bytes, 0, "{}: the demo kernels keep everything in registers", k.name);
    }
    // A local array indexed by a run-time value lives in local memory: a frame of its 64 floats.
    let mut local = demo_kernels::source().clone();
    local.name = "local_frame";
    local.code = "HF_KERNEL void hf_touch(float* y, uint32_t n) { float a[64]; \
                  for (uint32_t i = 0; i < 64; ++i) a[i] = y[i]; \
                  for (uint32_t i = 0; i < 64; ++i) a[(i * n) & 63u] += 1.0f; y[0] = a[n & 63u]; }";
    local.entries.retain(|e| e.name == "hf_touch");
    let (cubin, _) = cuda::compile(&local, "sm_90a", 32).expect("compiles");
    let k = cuda::kernel_resources(&cubin).expect("a cubin");
    assert_eq!(k.len(), 1, "{k:?}");
    assert_eq!(k[0].name, local.entries[0].name);
    assert!(k[0].frame_bytes >= 256, "{:?}", k[0]);
}

#[test]
fn ptxas_notes_on_warpgroup_mmas_read_before_their_wait_are_caught() {
    // The demo's warpgroup-MMA kernel waits before it reads its accumulators: a clean log.
    if !holdfast_hal::testing::assert_sm90a_wgmma_not_serialised(demo_kernels::source()) {
        return;
    }
    // One that adds to an accumulator while its MMA may still be in flight: ptxas must keep the
    // order itself (a note C7514 or C7517), which the check reports.
    let mut early = demo_kernels::source().clone();
    early.name = "early_read";
    early.code = "HF_KERNEL void hf_touch(float* y, uint32_t n) {\n\
                  #if defined(HF_HAS_WGMMA)\n\
                  extern __shared__ __align__(1024) unsigned char sm[];\n\
                  const uint64_t d = hf_wgmma_desc(hf_smem_addr(sm), 128u, 1024u);\n\
                  float acc[16];\n\
                  for (int i = 0; i < 16; ++i) acc[i] = y[i];\n\
                  hf_wgmma_fence();\n\
                  hf_wgmma_m64n32k16(acc, d, d, 1u);\n\
                  hf_wgmma_commit();\n\
                  acc[0] += (float)n;\n\
                  hf_wgmma_wait<0>();\n\
                  for (int i = 0; i < 16; ++i) y[threadIdx.x * 16u + i] = acc[i];\n\
                  #endif\n\
                  }";
    early.entries.retain(|e| e.name == "hf_touch");
    let log = cuda::compile_log(&early, "sm_90a", 32).expect("compiles");
    assert!(log.contains("(C7514)") || log.contains("(C7517)"), "no ptxas note on the early read: {log}");
    let caught = std::panic::catch_unwind(|| holdfast_hal::testing::assert_sm90a_wgmma_not_serialised(&early));
    assert!(caught.is_err(), "the check lets an early read through");
}
