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
/// NVRTC only, no GPU or driver.
pub fn compile(src: &KernelSource, arch: &str, warp: u32) -> Result<(Vec<u8>, Vec<u8>)> {
    let c = compile_inner(src, arch, warp)?;
    Ok((c.cubin, c.ptx))
}

pub(crate) fn compile_inner(src: &KernelSource, arch: &str, warp: u32) -> Result<Compiled> {
    require_nvrtc()?;
    let fail = |log: String| HalError::Compile { source_name: src.name.to_string(), arch: arch.to_string(), log };
    let text = CString::new(full_source(src)).map_err(|_| fail("kernel source contains a NUL byte".into()))?;
    let name = CString::new(format!("{}.cu", src.name)).map_err(|_| fail("kernel name contains a NUL byte".into()))?;
    let prog = nvrtc::create_program(&text, Some(&name)).map_err(|e| nvrtc_err("nvrtcCreateProgram", e))?;
    let opts =
        [format!("-arch={arch}"), "--std=c++17".to_string(), format!("-DHF_WARP_SIZE={warp}"), "-lineinfo".to_string()];
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
    out
}
