//! Compiles the HAL's kernel sources with hipRTC for gfx90a (wavefront 64). Needs HIP's hipRTC
//! only, no GPU: CI installs Debian's HIP 5.2.3 (`libamdhip64-dev`, `rocm-device-libs`) and sets
//! `HOLDFAST_REQUIRE_HIPRTC=1`, so there a missing hipRTC fails instead of skipping.
#![cfg(feature = "rocm")]

use holdfast_hal::demo_kernels;

#[test]
fn demo_kernels_compile_for_gfx90a() {
    if let Some(bytes) = holdfast_hal::testing::assert_compiles_for_gfx90a(demo_kernels::source()) {
        eprintln!("hipRTC: {bytes} bytes of code object for gfx90a");
    }
}
