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
                return None;
            }
            try_dirs(&["libcuda.so.1", "libcuda.so"], &[]);
            // SAFETY: as above.
            if unsafe { cudarc::driver::sys::is_culib_present() } {
                return None;
            }
            Some(format!("libcuda (the NVIDIA driver library) was not found; searched {}", searched()))
        })
        .clone()
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
