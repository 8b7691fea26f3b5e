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

/// The split-reduction kernels' static shared memory stays within the 8 KiB the launch plan
/// leaves beside a resident tile's dynamic stages (`RESIDENT_STATIC_MAX` in `src/plan.rs`), so the
/// largest tiles fit a block. Each entry's `.nv.shared.<entry>` section of an sm_90 CUBIN also
/// counts the 1 KiB the system reserves per block: `mhc_post_n4`, which declares none, shows it.
fn static_shared_memory_is_within_the_plans_allowance(cubin: &[u8]) {
    let sizes = shared_sections(cubin);
    let size = |entry: &str| {
        *sizes.get(&format!(".nv.shared.{entry}")).unwrap_or_else(|| panic!("no shared section for {entry}: {sizes:?}"))
    };
    let reserved = size("mhc_post_n4");
    assert!(reserved <= 1024, "mhc_post_n4 declares shared memory: {sizes:?}");
    for entry in ["mhc_hc_head_n4", "mhc_pre_n4", "mhc_fused_post_pre_n4"] {
        let own = size(entry) - reserved;
        assert!(own <= 8 * 1024, "{entry} declares {own} bytes of static shared memory, more than the plan allows");
    }
}

/// Section name → size of the `.nv.shared.*` sections of an ELF64 little-endian file.
fn shared_sections(elf: &[u8]) -> std::collections::HashMap<String, u64> {
    let u16_at = |o: usize| u16::from_le_bytes(elf[o..o + 2].try_into().expect("2 bytes"));
    let u32_at = |o: usize| u32::from_le_bytes(elf[o..o + 4].try_into().expect("4 bytes"));
    let u64_at = |o: usize| u64::from_le_bytes(elf[o..o + 8].try_into().expect("8 bytes"));
    assert_eq!(&elf[..5], b"\x7fELF\x02", "not an ELF64 file");
    let (shoff, shentsize, shnum, shstrndx) =
        (u64_at(0x28) as usize, u16_at(0x3a) as usize, u16_at(0x3c) as usize, u16_at(0x3e) as usize);
    let header = |i: usize| shoff + i * shentsize;
    let names = u64_at(header(shstrndx) + 0x18) as usize;
    let name = |off: usize| {
        let start = names + off;
        let end = start + elf[start..].iter().position(|&b| b == 0).expect("terminated name");
        String::from_utf8_lossy(&elf[start..end]).into_owned()
    };
    (0..shnum)
        .map(|i| (name(u32_at(header(i)) as usize), u64_at(header(i) + 0x20)))
        .filter(|(n, _)| n.starts_with(".nv.shared"))
        .collect()
}
