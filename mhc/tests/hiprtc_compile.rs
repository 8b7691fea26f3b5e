//! Compiles the mHC kernel source with hipRTC for gfx90a (wavefront 64, the portable projection
//! and finish items). Needs hipRTC only, no GPU; skips when it is absent unless
//! `HOLDFAST_REQUIRE_HIPRTC` is set (as in CI).
#![cfg(feature = "rocm")]

#[test]
fn mhc_kernels_compile_for_gfx90a() {
    holdfast_hal::testing::assert_compiles_for_gfx90a(holdfast_mhc::source());
}
