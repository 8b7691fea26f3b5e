//! hipRTC compilation: a code object for the device's `gfxNNN`.

use std::ffi::{c_char, CStr, CString};

use cubecl_hip_sys as hip;

use crate::error::{HalError, Result};
use crate::kernel::{KernelSource, PORTABILITY_HEADER};

/// The full text hipRTC compiles: the portability header then the kernel code.
pub(crate) fn full_source(src: &KernelSource) -> String {
    format!("{PORTABILITY_HEADER}\n#line 1 \"{}.hip\"\n{}", src.name, src.code)
}

/// Compiles `src` for `arch` (e.g. `gfx90a`) with wavefront width `warp`; returns the code object.
/// The ROCm libraries must be available ([`super::unavailable_reason`] is `None`).
pub fn compile(src: &KernelSource, arch: &str, warp: u32) -> Result<Vec<u8>> {
    if let Some(reason) = super::loader::unavailable_reason() {
        return Err(HalError::BackendUnavailable { backend: "rocm", reason });
    }
    let fail = |log: String| HalError::Compile { source_name: src.name.to_string(), arch: arch.to_string(), log };
    let text = CString::new(full_source(src)).map_err(|_| fail("kernel source contains a NUL byte".into()))?;
    let name = CString::new(format!("{}.hip", src.name)).map_err(|_| fail("kernel name contains a NUL byte".into()))?;
    let opts: Vec<CString> = [format!("--offload-arch={arch}"), "-std=c++17".into(), format!("-DHF_WARP_SIZE={warp}")]
        .into_iter()
        .map(|o| CString::new(o).map_err(|_| fail("option contains a NUL byte".into())))
        .collect::<Result<_>>()?;
    let opt_ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: hip::hiprtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings; no headers are passed.
    let rc = unsafe {
        hip::hiprtcCreateProgram(&mut prog, text.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null())
    };
    if rc != hip::hiprtcResult_HIPRTC_SUCCESS {
        return Err(HalError::Driver {
            call: "hiprtcCreateProgram",
            code: i64::from(rc),
            message: "program creation failed".into(),
        });
    }
    // SAFETY: `prog` is live; `opt_ptrs` outlives the call.
    let rc = unsafe { hip::hiprtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    let mut log_len = 0usize;
    // SAFETY: `prog` is live; out-parameter.
    unsafe { hip::hiprtcGetProgramLogSize(prog, &mut log_len) };
    let mut log = vec![0 as c_char; log_len.max(1)];
    // SAFETY: `log` has the size hipRTC reported.
    unsafe { hip::hiprtcGetProgramLog(prog, log.as_mut_ptr()) };
    // SAFETY: hipRTC NUL-terminates the log; `log` has at least one element.
    let log = unsafe { CStr::from_ptr(log.as_ptr()) }.to_string_lossy().into_owned();
    let out = if rc != hip::hiprtcResult_HIPRTC_SUCCESS {
        Err(fail(format!("hipRTC error {rc}\n{log}")))
    } else {
        let mut n = 0usize;
        // SAFETY: compiled program; out-parameter.
        unsafe { hip::hiprtcGetCodeSize(prog, &mut n) };
        let mut code = vec![0u8; n];
        // SAFETY: `code` has the size hipRTC reported.
        unsafe { hip::hiprtcGetCode(prog, code.as_mut_ptr().cast()) };
        if n == 0 {
            Err(fail(format!("hipRTC produced an empty code object\n{log}")))
        } else {
            Ok(code)
        }
    };
    // SAFETY: destroyed exactly once.
    unsafe { hip::hiprtcDestroyProgram(&mut prog) };
    out
}
