//! Finding `libcuda` and `libnvrtc` at run time.
//!
//! cudarc opens its libraries by bare name through the system loader. We check with cudarc's
//! `is_culib_present()` first (calling into a missing library panics), and when the loader cannot
//! find them we preload them by absolute path from the usual install locations: the loader then
//! matches cudarc's later bare-name open against the already-loaded SONAME. NVRTC opens its
//! builtins library by bare name too, so it is preloaded from the directory NVRTC came from.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Directories searched after the standard loader search, in order.
pub(crate) fn search_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(v) = std::env::var_os(var) {
            let p = PathBuf::from(v);
            dirs.push(p.join("lib64"));
            dirs.push(p.join("lib"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs.push(PathBuf::from("/usr/local/nvidia/lib64"));
    dirs
}

fn preload(path: &Path) -> bool {
    // SAFETY: loading a shared library runs its initialisers; these are the vendor's own
    // libraries, loaded exactly as the system loader would load them for cudarc.
    match unsafe {
        libloading::os::unix::Library::open(
            Some(path),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
        )
    } {
        Ok(lib) => {
            // Keep it loaded for the life of the process, as cudarc does with its own handle.
            std::mem::forget(lib);
            true
        }
        Err(_) => false,
    }
}

fn try_dirs(names: &[&str], also: &[&str]) -> Option<PathBuf> {
    for dir in search_dirs() {
        for name in names {
            let p = dir.join(name);
            if p.exists() && preload(&p) {
                for extra in also {
                    let e = dir.join(extra);
                    if e.exists() {
                        preload(&e);
                    }
                }
                return Some(p);
            }
        }
    }
    None
}

fn searched() -> String {
    let dirs: Vec<String> = search_dirs().iter().map(|d| d.display().to_string()).collect();
    format!("the system loader path (LD_LIBRARY_PATH, ld.so.cache), then {}", dirs.join(", "))
}

/// Why `libcuda` cannot be loaded, or `None` if it can.
pub(crate) fn driver_unavailable() -> Option<String> {
    static REASON: OnceLock<Option<String>> = OnceLock::new();
    REASON
        .get_or_init(|| {
            // SAFETY: `is_culib_present` only tries to open the library and closes it again.
            if unsafe { cudarc::driver::sys::is_culib_present() } {
                return driver_problem();
            }
            try_dirs(&["libcuda.so.1", "libcuda.so"], &[]);
            // SAFETY: as above.
            if unsafe { cudarc::driver::sys::is_culib_present() } {
                return driver_problem();
            }
            Some(format!("libcuda (the NVIDIA driver library) was not found; searched {}", searched()))
        })
        .clone()
}

/// The oldest driver API the backend calls into (CUDA 13.0, as `cuDriverGetVersion` reports it).
const MIN_DRIVER_VERSION: i32 = 13_000;

/// Why the `libcuda` the loader finds cannot serve the backend, or `None`: it must export the
/// entry points the backend starts with and report a driver of at least CUDA 13.0. (cudarc
/// resolves each entry point on first use and panics where one is missing, so an older or foreign
/// library is refused here, with the reason, before any call into it.)
fn driver_problem() -> Option<String> {
    type GetVersion = unsafe extern "C" fn(*mut i32) -> i32;
    // SAFETY: as in `preload`; the handle is dropped at the end of this function (the library stays
    // loaded for cudarc, which opened it too or will).
    let lib = ["libcuda.so.1", "libcuda.so"].iter().find_map(|n| unsafe { libloading::Library::new(*n) }.ok())?;
    for name in
        ["cuInit", "cuDeviceGetCount", "cuDevicePrimaryCtxRetain", "cuGraphInstantiateWithFlags", "cuLaunchKernelEx"]
    {
        // SAFETY: only the symbol's presence is checked; it is not called.
        if unsafe { lib.get::<*const ()>(name.as_bytes()) }.is_err() {
            return Some(format!("the libcuda found lacks `{name}`: not an NVIDIA driver library of CUDA 13 or newer"));
        }
    }
    // SAFETY: `cuDriverGetVersion` has this C signature in every CUDA driver and needs no prior
    // `cuInit`; it writes one int.
    let get: libloading::Symbol<'_, GetVersion> = match unsafe { lib.get(b"cuDriverGetVersion") } {
        Ok(f) => f,
        Err(_) => return Some("the libcuda found lacks `cuDriverGetVersion`: not an NVIDIA driver library".into()),
    };
    let mut version = 0i32;
    // SAFETY: see above; `version` outlives the call.
    let rc = unsafe { get(&mut version) };
    if rc != 0 {
        return Some(format!("cuDriverGetVersion failed (CUresult {rc})"));
    }
    (version < MIN_DRIVER_VERSION).then(|| {
        format!(
            "the NVIDIA driver supports CUDA {}.{}; the CUDA backend needs {}.{} or newer",
            version / 1000,
            version % 1000 / 10,
            MIN_DRIVER_VERSION / 1000,
            MIN_DRIVER_VERSION % 1000 / 10
        )
    })
}

/// Why `libnvrtc` cannot be loaded, or `None` if it can (its builtins are preloaded beside it).
pub(crate) fn nvrtc_unavailable() -> Option<String> {
    static REASON: OnceLock<Option<String>> = OnceLock::new();
    REASON
        .get_or_init(|| {
            // SAFETY: as in `driver_unavailable`.
            if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return None;
            }
            try_dirs(&["libnvrtc.so.13", "libnvrtc.so"], &["libnvrtc-builtins.so.13.0", "libnvrtc-builtins.so"]);
            // SAFETY: as above.
            if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return None;
            }
            Some(format!("libnvrtc (the CUDA 13 runtime compiler) was not found; searched {}", searched()))
        })
        .clone()
}

/// Why the CUDA backend cannot start, or `None` if both libraries are present.
pub(crate) fn unavailable_reason() -> Option<String> {
    driver_unavailable().or_else(nvrtc_unavailable)
}
