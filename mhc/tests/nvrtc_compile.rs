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
        if warp == 32 {
            static_shared_memory_is_within_the_plans_allowance(&cubin);
        }
        let ptx = String::from_utf8_lossy(&ptx);
        for e in &src.entries {
            assert!(ptx.contains(e.name), "PTX lacks entry point {}", e.name);
        }
    }
}

/// The launchers launch dependent (`Stream::launch_dependent`), which needs every entry to wait
/// for the kernel before it.
#[test]
fn every_mhc_kernel_waits_for_the_kernel_before_it() {
    holdfast_hal::testing::assert_entries_wait_for_prior(holdfast_mhc::source());
}

/// `mhc_post` and `hc_head` on clusters use no local memory on sm_90a; the split-reduction
/// kernels at 128 and 255 registers keep the frames they have now (a few spills and the precise
/// division and square root's slow paths), so a change that makes them spill more fails here.
#[test]
fn the_mhc_kernels_spill_no_more_than_they_do() {
    holdfast_hal::testing::assert_sm90a_frames_within(
        holdfast_mhc::source(),
        &[("mhc_hc_head_n4", 56), ("mhc_pre_n4", 16), ("mhc_fused_post_pre_n4", 96), ("mhc_pre_finish_n4", 0)],
    );
}

/// The split-reduction kernels' static shared memory stays within the 8 KiB the launch plan
/// leaves beside a resident tile's dynamic stages (`RESIDENT_STATIC_MAX` in `src/plan.rs`), so the
/// largest tiles fit a block. Each entry's `.nv.shared.<entry>` section of an sm_90 CUBIN also
/// counts the 1 KiB the system reserves per block: `mhc_post_n4`, which declares none, shows it.
fn static_shared_memory_is_within_the_plans_allowance(cubin: &[u8]) {
    let kernels = cuda::kernel_resources(cubin).expect("a readable CUBIN");
    let size = |entry: &str| {
        kernels
            .iter()
            .find(|k| k.name == entry)
            .map(|k| k.static_shared_bytes)
            .unwrap_or_else(|| panic!("no kernel {entry}: {kernels:?}"))
    };
    let reserved = size("mhc_post_n4");
    assert!(reserved <= 1024, "mhc_post_n4 declares shared memory: {kernels:?}");
    for entry in ["mhc_hc_head_n4", "mhc_pre_n4", "mhc_fused_post_pre_n4"] {
        let own = size(entry).saturating_sub(reserved);
        assert!(own <= 8 * 1024, "{entry} declares {own} bytes of static shared memory, more than the plan allows");
    }
    // `hc_head` on clusters: within `CLUSTER_STATIC_BYTES` of `src/plan.rs`.
    let own = size("mhc_hc_head_cluster_n4").saturating_sub(reserved);
    assert!(
        own <= 9216,
        "mhc_hc_head_cluster_n4 declares {own} bytes of static shared memory, more than the plan allows"
    );
}
