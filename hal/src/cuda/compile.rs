//! NVRTC compilation: CUBIN for the device's `sm_XY`, PTX kept as the fallback.

use std::ffi::{CStr, CString};

use cudarc::nvrtc::{result as nvrtc, sys as nvrtc_sys};

use crate::error::{HalError, Result};
use crate::kernel::{KernelSource, PORTABILITY_HEADER};

/// The output of one compilation.
pub(crate) struct Compiled {
    /// CUBIN for the exact architecture (empty if NVRTC produced none).
    pub(crate) cubin: Vec<u8>,
    /// PTX text, NUL-terminated (the driver JIT-compiles it if the CUBIN cannot load).
    pub(crate) ptx: Vec<u8>,
}

/// The full text NVRTC compiles: the portability header then the kernel code.
pub(crate) fn full_source(src: &KernelSource) -> String {
    format!("{PORTABILITY_HEADER}\n#line 1 \"{}.cu\"\n{}", src.name, src.code)
}

fn require_nvrtc() -> Result<()> {
    match super::loader::nvrtc_unavailable() {
        Some(reason) => Err(HalError::BackendUnavailable { backend: "cuda", reason }),
        None => Ok(()),
    }
}

/// Why NVRTC cannot be used here (compilation needs only NVRTC, not a GPU), or `None`.
pub fn nvrtc_unavailable_reason() -> Option<String> {
    super::loader::nvrtc_unavailable()
}

/// NVRTC's version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32)> {
    require_nvrtc()?;
    let (mut a, mut b) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { nvrtc_sys::nvrtcVersion(&mut a, &mut b) }.result().map_err(|e| nvrtc_err("nvrtcVersion", e))?;
    Ok((a, b))
}

fn nvrtc_err(call: &'static str, e: cudarc::nvrtc::result::NvrtcError) -> HalError {
    HalError::Driver { call, code: e.0 as i64, message: format!("{e:?}") }
}

/// Compiles `src` for `arch` (e.g. `sm_90`) with warp width `warp`; returns (CUBIN, PTX). Needs
/// NVRTC only, no GPU or driver. Always runs NVRTC (the module loads of a device go through the
/// on-disk cache, [`super::kernel_cache_dir`]).
pub fn compile(src: &KernelSource, arch: &str, warp: u32) -> Result<(Vec<u8>, Vec<u8>)> {
    let c = compile_inner(src, arch, warp)?;
    Ok((c.cubin, c.ptx))
}

/// NVRTC's program log of compiling `src` for `arch` with warp width `warp` (never cached):
/// empty for a clean compilation, else its notes, ptxas's among them (for example C7514 and
/// C7517, which say that a kernel's warpgroup MMAs were serialised or had waits inserted because
/// other instructions touch their registers while they are in flight).
pub fn compile_log(src: &KernelSource, arch: &str, warp: u32) -> Result<String> {
    compile_with_log(src, arch, warp).map(|(_, log)| log)
}

fn options(arch: &str, warp: u32) -> Vec<String> {
    vec![format!("-arch={arch}"), "--std=c++17".to_string(), format!("-DHF_WARP_SIZE={warp}"), "-lineinfo".to_string()]
}

/// [`compile_inner`] through the on-disk cache ([`super::kcache`]): a hit skips NVRTC.
pub(crate) fn compile_cached(src: &KernelSource, arch: &str, warp: u32) -> Result<Compiled> {
    compile_cached_in(src, arch, warp, super::kcache::kernel_cache_dir().as_deref()).map(|(c, _)| c)
}

/// [`compile_cached`] with the cache at `dir` (`None`: no cache); also says whether it was a hit.
fn compile_cached_in(
    src: &KernelSource,
    arch: &str,
    warp: u32,
    dir: Option<&std::path::Path>,
) -> Result<(Compiled, bool)> {
    require_nvrtc()?;
    let Some(dir) = dir else {
        return Ok((compile_inner(src, arch, warp)?, false));
    };
    let key = super::kcache::key(&full_source(src), &options(arch, warp), nvrtc_version()?);
    if let Some(hit) = super::kcache::load(dir, &key) {
        return Ok((hit, true));
    }
    let c = compile_inner(src, arch, warp)?;
    super::kcache::store(dir, &key, &c);
    Ok((c, false))
}

/// One NVRTC compilation of `src` (never cached).
pub(crate) fn compile_inner(src: &KernelSource, arch: &str, warp: u32) -> Result<Compiled> {
    compile_with_log(src, arch, warp).map(|(c, _)| c)
}

/// [`compile_inner`], with NVRTC's program log of the successful compilation (ptxas's notes
/// among it).
fn compile_with_log(src: &KernelSource, arch: &str, warp: u32) -> Result<(Compiled, String)> {
    require_nvrtc()?;
    let fail = |log: String| HalError::Compile { source_name: src.name.to_string(), arch: arch.to_string(), log };
    let text = CString::new(full_source(src)).map_err(|_| fail("kernel source contains a NUL byte".into()))?;
    let name = CString::new(format!("{}.cu", src.name)).map_err(|_| fail("kernel name contains a NUL byte".into()))?;
    let prog = nvrtc::create_program(&text, Some(&name)).map_err(|e| nvrtc_err("nvrtcCreateProgram", e))?;
    let opts = options(arch, warp);
    // SAFETY: `prog` is a live program; options are valid C strings.
    let res = unsafe { nvrtc::compile_program(prog, &opts) };
    // SAFETY: `prog` is live; the log is NUL-terminated.
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|v| unsafe { CStr::from_ptr(v.as_ptr()) }.to_string_lossy().into_owned())
        .unwrap_or_default();
    let out = (|| {
        res.map_err(|e| fail(format!("{e:?}\n{log}")))?;
        let mut n = 0usize;
        // SAFETY: `prog` compiled successfully; out-parameter.
        unsafe { cudarc::nvrtc::sys::nvrtcGetCUBINSize(prog, &mut n) }
            .result()
            .map_err(|e| nvrtc_err("nvrtcGetCUBINSize", e))?;
        let mut cubin = vec![0u8; n];
        if n > 0 {
            // SAFETY: `cubin` has exactly the size NVRTC reported.
            unsafe { cudarc::nvrtc::sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast()) }
                .result()
                .map_err(|e| nvrtc_err("nvrtcGetCUBIN", e))?;
        }
        // SAFETY: `prog` compiled successfully.
        let ptx: Vec<u8> = unsafe { nvrtc::get_ptx(prog) }
            .map_err(|e| nvrtc_err("nvrtcGetPTX", e))?
            .into_iter()
            .map(|c| c as u8)
            .collect();
        Ok(Compiled { cubin, ptx })
    })();
    // SAFETY: `prog` is live and destroyed exactly once.
    let _ = unsafe { nvrtc::destroy_program(prog) };
    out.map(|c| (c, log))
}

/// Whether entry point `entry` of the PTX text `ptx` waits for the kernel launched before it
/// (`griddepcontrol.wait`, what `hf_grid_dependency_wait()` compiles to on sm_90 and newer), so
/// that a programmatic dependent launch of it ([`crate::Stream::launch_dependent`]) is ordered
/// after that kernel's writes. Device functions are normally inlined into their entry, so the
/// entry's own body is what is searched: from its `.entry` line to the next top-level function; a
/// wait left in a function that was not inlined reads as missing (the launch is then refused,
/// which is safe). It checks that the wait is there, not where: that every block reaches it before
/// any memory access or return is the kernel's part ([`crate::Stream::launch_dependent`]).
/// `false` when the entry is not in `ptx`.
pub fn ptx_entry_waits_for_prior(ptx: &str, entry: &str) -> bool {
    let Some(start) = ptx.match_indices(".entry ").map(|(i, _)| i + ".entry ".len()).find(|&i| {
        let rest = &ptx[i..];
        rest.strip_prefix(entry).is_some_and(|r| r.trim_start().starts_with('('))
    }) else {
        return false;
    };
    let body = &ptx[start..];
    let end = [".entry ", ".func "].iter().filter_map(|m| body.find(m)).min().unwrap_or(body.len());
    body[..end].contains("griddepcontrol.wait")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::{KernelEntry, Param, ScalarKind};

    fn noop(_: &crate::cpu::CpuLaunch<'_>) -> Result<()> {
        Ok(())
    }

    fn source(code: &'static str) -> KernelSource {
        KernelSource {
            name: "kcache_probe",
            code,
            entries: vec![KernelEntry {
                name: "kcache_probe",
                params: vec![Param::output::<f32>("y"), Param::scalar("n", ScalarKind::U32)],
                cpu: noop,
            }],
        }
    }

    /// A second compile of the same source from the cache gives the same bytes without NVRTC; a
    /// changed source, architecture or warp width is a miss.
    #[test]
    fn the_disk_cache_returns_what_nvrtc_produced_and_misses_on_any_change() {
        if let Some(reason) = nvrtc_unavailable_reason() {
            assert!(std::env::var_os("HOLDFAST_REQUIRE_NVRTC").is_none(), "NVRTC is required here: {reason}");
            eprintln!("skipped: NVRTC is not available ({reason})");
            return;
        }
        let dir = std::env::temp_dir().join(format!("holdfast-kcache-nvrtc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let a =
            source("HF_KERNEL void kcache_probe(float* y, uint32_t n) { if (threadIdx.x < n) y[threadIdx.x] = 1.0f; }");
        let (first, hit) = compile_cached_in(&a, "sm_90", 32, Some(&dir)).expect("compile");
        assert!(!hit && !first.cubin.is_empty());
        let (again, hit) = compile_cached_in(&a, "sm_90", 32, Some(&dir)).expect("cached");
        assert!(hit, "the second compile is a hit");
        assert_eq!((&again.cubin, &again.ptx), (&first.cubin, &first.ptx));
        let fresh = compile_inner(&a, "sm_90", 32).expect("nvrtc");
        assert_eq!(fresh.ptx, first.ptx, "the cached PTX is NVRTC's");
        let b =
            source("HF_KERNEL void kcache_probe(float* y, uint32_t n) { if (threadIdx.x < n) y[threadIdx.x] = 2.0f; }");
        assert!(!compile_cached_in(&b, "sm_90", 32, Some(&dir)).expect("b").1, "changed source");
        assert!(!compile_cached_in(&a, "sm_80", 32, Some(&dir)).expect("sm_80").1, "changed architecture");
        assert!(!compile_cached_in(&a, "sm_90", 64, Some(&dir)).expect("warp 64").1, "changed warp width");
        assert!(!compile_cached_in(&a, "sm_90", 32, None).expect("no cache").1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    const PTX: &str = "\
.version 8.8
.target sm_90a
.visible .entry plain(\n\t.param .u64 p\n)\n{\n\tret;\n}
.visible .entry plain_dependent(\n\t.param .u64 p\n)\n{\n\tgriddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;\n\tret;\n}
.visible .entry late(\n)\n{\n\tret;\n}
.func helper()\n{\n\tgriddepcontrol.wait;\n\tret;\n}
";

    #[test]
    fn finds_the_wait_in_the_entrys_own_body_only() {
        assert!(ptx_entry_waits_for_prior(PTX, "plain_dependent"));
        // `plain` is a prefix of `plain_dependent`, whose body holds a wait: not this entry's.
        assert!(!ptx_entry_waits_for_prior(PTX, "plain"));
        // A wait in a function after the entry is not the entry's.
        assert!(!ptx_entry_waits_for_prior(PTX, "late"));
        assert!(!ptx_entry_waits_for_prior(PTX, "missing"));
    }
}
