//! cuBLAS as the GEMM reference, through cudarc with run-time loading.
//!
//! cudarc panics when a library it calls into is missing, so presence is checked first with
//! `cublas::sys::is_culib_present()`; when the system loader does not find `libcublas`, it is
//! preloaded by absolute path from `$CUDA_HOME`/`$CUDA_PATH`, `/usr/local/cuda/lib64` and
//! `/usr/local/nvidia/lib64` (as the HAL does for `libcuda`), and the whole run sits inside
//! `catch_unwind` as a last guard. Any failure is a reason string, never an error of the report.

use holdfast_hal::Device;

use crate::timing::{Effort, Stat};

/// Median µs of one `n × n × n` bf16 cuBLAS GEMM on `dev`'s GPU, or why it could not run.
#[cfg(feature = "cuda")]
pub fn gemm_us(dev: &Device, n: usize, effort: Effort) -> Result<Stat, String> {
    if dev.backend() != holdfast_hal::BackendKind::Cuda {
        return Err(format!("the device is {}, not cuda", dev.backend()));
    }
    if !present() {
        return Err(format!("libcublas was not found; searched the system loader path, then {}", dirs().join(", ")));
    }
    let ordinal = dev.info().ordinal;
    match std::panic::catch_unwind(move || run(ordinal, n, effort)) {
        Ok(r) => r,
        Err(_) => Err("cuBLAS panicked while loading or running".into()),
    }
}

/// Without the `cuda` feature there is no cuBLAS.
#[cfg(not(feature = "cuda"))]
pub fn gemm_us(_dev: &Device, _n: usize, _effort: Effort) -> Result<Stat, String> {
    Err("built without the `cuda` feature".into())
}

#[cfg(feature = "cuda")]
fn dirs() -> Vec<String> {
    let mut v = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(p) = std::env::var_os(var) {
            let p = std::path::PathBuf::from(p);
            v.push(p.join("lib64").display().to_string());
            v.push(p.join("lib").display().to_string());
        }
    }
    v.push("/usr/local/cuda/lib64".into());
    v.push("/usr/local/nvidia/lib64".into());
    v
}

#[cfg(feature = "cuda")]
fn present() -> bool {
    // SAFETY: `is_culib_present` only tries to open the library and closes it again.
    if unsafe { cudarc::cublas::sys::is_culib_present() } {
        return true;
    }
    for dir in dirs() {
        for name in ["libcublas.so.13", "libcublas.so.12", "libcublas.so"] {
            let p = std::path::Path::new(&dir).join(name);
            if !p.exists() {
                continue;
            }
            // cuBLAS needs cuBLASLt beside it; load that first so the bare-name lookup succeeds.
            for lt in ["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"] {
                let l = std::path::Path::new(&dir).join(lt);
                if l.exists() {
                    preload(&l);
                    break;
                }
            }
            // SAFETY: as above.
            if preload(&p) && unsafe { cudarc::cublas::sys::is_culib_present() } {
                return true;
            }
        }
    }
    false
}

#[cfg(feature = "cuda")]
fn preload(path: &std::path::Path) -> bool {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    // SAFETY: loading the vendor's library runs its initialisers, exactly as cudarc's own open
    // would; the handle is kept for the life of the process, as cudarc keeps its own.
    match unsafe { Library::open(Some(path), RTLD_NOW | RTLD_GLOBAL) } {
        Ok(lib) => {
            std::mem::forget(lib);
            true
        }
        Err(_) => false,
    }
}

#[cfg(feature = "cuda")]
fn run(ordinal: usize, n: usize, effort: Effort) -> Result<Stat, String> {
    use cudarc::cublas::{sys::cublasOperation_t, CudaBlas, Gemm, GemmConfig};
    use cudarc::driver::{sys::CUevent_flags, CudaContext};
    use holdfast_hal::bf16;

    let e = |what: &str| {
        let what = what.to_string();
        move |err: &dyn std::fmt::Debug| format!("{what}: {err:?}")
    };
    let ctx = CudaContext::new(ordinal).map_err(|x| e("cuDevicePrimaryCtxRetain")(&x))?;
    // SAFETY: nothing has been allocated through this handle of the primary context yet; the
    // report orders its own work (one stream).
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(|x| e("cuStreamCreate")(&x))?;
    let blas = CudaBlas::new(stream.clone()).map_err(|x| e("cublasCreate")(&x))?;
    let host = vec![bf16::from_f32(0.0115); n * n];
    let a = stream.clone_htod(&host).map_err(|x| e("upload")(&x))?;
    let b = stream.clone_htod(&host).map_err(|x| e("upload")(&x))?;
    let mut c = stream.alloc_zeros::<bf16>(n * n).map_err(|x| e("alloc")(&x))?;
    let ni = i32::try_from(n).map_err(|_| format!("n = {n} does not fit cuBLAS's int"))?;
    // Row-major y [n, n] = x [n, k] · w [n, k]ᵀ, i.e. column-major yᵀ = w · xᵀ with w transposed.
    let cfg = GemmConfig {
        transa: cublasOperation_t::CUBLAS_OP_T,
        transb: cublasOperation_t::CUBLAS_OP_N,
        m: ni,
        n: ni,
        k: ni,
        alpha: bf16::ONE,
        lda: ni,
        ldb: ni,
        beta: bf16::ZERO,
        ldc: ni,
    };
    let mut call = || -> Result<(), String> {
        // SAFETY: a, b, c hold n·n elements each, matching m = n = k = lda = ldb = ldc = n.
        unsafe { blas.gemm(cfg, &b, &a, &mut c) }.map_err(|x| e("cublasGemmEx")(&x))
    };
    let start = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|x| e("cuEventCreate")(&x))?;
    let end = ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT)).map_err(|x| e("cuEventCreate")(&x))?;
    for _ in 0..effort.warmup.max(1) {
        call()?;
    }
    let mut time = |reps: usize| -> Result<f64, String> {
        start.record(&stream).map_err(|x| e("cuEventRecord")(&x))?;
        for _ in 0..reps {
            call()?;
        }
        end.record(&stream).map_err(|x| e("cuEventRecord")(&x))?;
        Ok(f64::from(start.elapsed_ms(&end).map_err(|x| e("cuEventElapsedTime")(&x))?) * 1e3 / reps as f64)
    };
    let t = time(1)?.max(0.05);
    let reps = ((effort.sample_us / t).ceil() as usize).clamp(1, effort.max_reps);
    let samples = ((effort.case_us / (t * reps as f64)) as usize).clamp(effort.min_samples, effort.max_samples);
    let mut v = Vec::with_capacity(samples);
    for _ in 0..samples {
        v.push(time(reps)?);
    }
    Ok(Stat { median_us: crate::timing::median(&mut v), samples })
}
