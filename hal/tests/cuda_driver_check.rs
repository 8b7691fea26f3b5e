//! A `libcuda` that is not a CUDA 13 driver library is refused with the reason when a CUDA device
//! opens, never a panic inside the driver bindings. Builds a stand-in `libcuda.so.1` without the
//! driver's entry points with the system C compiler, points `CUDA_HOME` at it and opens `cuda:0`.
//! Skips (with a line saying why) where the system loader finds a real driver, or where no C
//! compiler is installed. One test per binary: the backend probes its libraries once per process.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::process::Command;

use holdfast_hal::{Device, HalError};

#[test]
fn a_foreign_libcuda_is_refused_with_the_reason() {
    // SAFETY: only checks whether the system loader resolves the name; the handle is dropped.
    if unsafe { libloading::Library::new("libcuda.so.1") }.is_ok() {
        eprintln!("skipped: the system loader finds a libcuda (a real driver is installed)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("holdfast-fake-cuda-{}", std::process::id()));
    let lib64: PathBuf = dir.join("lib64");
    std::fs::create_dir_all(&lib64).expect("temp dir");
    let src = dir.join("fake.c");
    std::fs::write(&src, "int holdfast_fake_cuda_marker(void) { return 0; }\n").expect("write source");
    let built = Command::new("cc")
        .args(["-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o"])
        .arg(lib64.join("libcuda.so.1"))
        .arg(&src)
        .status();
    match built {
        Ok(s) if s.success() => {}
        other => {
            eprintln!("skipped: no C compiler to build the stand-in library ({other:?})");
            return;
        }
    }
    // SAFETY: the only test of this binary, so no other thread reads the environment; set before
    // the backend's first probe.
    unsafe {
        std::env::set_var("CUDA_HOME", &dir);
        std::env::remove_var("CUDA_PATH");
    }
    match Device::open("cuda:0") {
        Err(HalError::BackendUnavailable { backend: "cuda", reason }) => {
            assert!(reason.contains("lacks `cuInit`"), "{reason}");
        }
        other => panic!("expected the stand-in libcuda to be refused, got {other:?}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}
