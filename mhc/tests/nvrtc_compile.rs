//! Compiles the mHC kernel source with NVRTC for sm_90 (CUBIN and PTX), with both warp widths the
//! portability header supports. Needs NVRTC only, no GPU; skips when NVRTC is absent unless
//! `HOLDFAST_REQUIRE_NVRTC` is set (as in CI).
#![cfg(feature = "cuda")]

use holdfast_hal::cuda;

#[test]
fn mhc_kernels_compile_for_sm_90() {
    if let Some(reason) = cuda::nvrtc_unavailable_reason() {
        assert!(std::env::var_os("HOLDFAST_REQUIRE_NVRTC").is_none(), "NVRTC is required here: {reason}");
        eprintln!("skipped: NVRTC is not available ({reason})");
        return;
    }
    let src = holdfast_mhc::source();
    for warp in [32, 64] {
        let (cubin, ptx) = cuda::compile(src, "sm_90", warp).expect("the mhc kernels compile");
        assert!(!cubin.is_empty(), "no CUBIN for warp {warp}");
        let ptx = String::from_utf8_lossy(&ptx);
        for e in &src.entries {
            assert!(ptx.contains(e.name), "PTX lacks entry point {}", e.name);
        }
    }
}
