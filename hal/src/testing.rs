//! Test support shared by every crate: one suite written against `&Device`, run per backend.

/// Instantiates test functions `fn name(dev: &Device)` once per backend: always on `cpu`, and on
/// `cuda:0` when the calling crate's `cuda` feature is on (printing a `skipped:` line when no CUDA
/// driver or device is present). An optional `setup = path;` function runs on the device first
/// (for example, compiling every module before a test captures).
///
/// ```text
/// fn adds(dev: &holdfast_hal::Device) { /* ... */ }
/// holdfast_hal::device_suite!(adds);
/// ```
#[macro_export]
macro_rules! device_suite {
    (setup = $setup:path; $($name:ident),* $(,)?) => {
        mod cpu {
            $(
                #[test]
                fn $name() {
                    let dev = $crate::Device::cpu().expect("the cpu backend always opens");
                    $setup(&dev);
                    super::$name(&dev);
                }
            )*
        }
        #[cfg(feature = "cuda")]
        mod cuda {
            $(
                #[test]
                fn $name() {
                    match $crate::Device::open("cuda:0") {
                        Ok(dev) => {
                            $setup(&dev);
                            super::$name(&dev)
                        }
                        Err(e) => eprintln!("skipped: cuda:0 is not usable here ({e})"),
                    }
                }
            )*
        }
    };
    ($($name:ident),* $(,)?) => {
        $crate::device_suite!(setup = $crate::testing::no_setup; $($name),*);
    };
}

/// The default `setup` of [`device_suite!`]: nothing.
pub fn no_setup(_dev: &crate::Device) {}

/// One rejected call of an error table: what it is, its result, the variant it must be, and the
/// words its message must contain (what is at fault, and the bound it breaks or what is allowed):
/// owned strings ([`words`]) or a static list.
pub type ErrorCase<E, W = Vec<String>> = (&'static str, std::result::Result<(), E>, fn(&E) -> bool, W);

/// Checks every case of an error table: an error of the expected variant whose message holds each
/// of its words. Panics on the first case that does not: this is a test helper.
pub fn check_errors<E, W>(cases: Vec<ErrorCase<E, W>>)
where
    E: std::fmt::Debug + std::fmt::Display,
    W: IntoIterator,
    W::Item: AsRef<str>,
{
    for (what, result, variant, words) in cases {
        let Err(e) = result else { panic!("{what}: expected an error") };
        assert!(variant(&e), "{what}: unexpected variant {e:?}");
        let msg = e.to_string();
        for w in words {
            let w = w.as_ref();
            assert!(msg.contains(w), "{what}: `{msg}` should mention `{w}`");
        }
    }
}

/// A binary of this workspace for a test to run: `built` (the `env!("CARGO_BIN_EXE_…")` path
/// cargo gave the test), or the file of that name in `$HOLDFAST_BIN_DIR` where that is set (a test
/// executable run on another machine, without the build tree).
pub fn workspace_binary(built: &str) -> std::path::PathBuf {
    let built = std::path::PathBuf::from(built);
    match (std::env::var_os("HOLDFAST_BIN_DIR"), built.file_name()) {
        (Some(dir), Some(name)) => std::path::PathBuf::from(dir).join(name),
        _ => built,
    }
}

/// The words of an [`ErrorCase`].
pub fn words(w: &[&str]) -> Vec<String> {
    w.iter().map(|s| (*s).to_owned()).collect()
}

/// Compiles `src` with NVRTC for `sm_90` and for `sm_90a` (the target an H100 or H200 runs, with
/// warpgroup MMA) and checks that every entry point is in each PTX: the CI compile check of a
/// crate's kernels, with no GPU needed. Returns the `sm_90a` CUBIN size, or `None` (after printing
/// a `skipped:` line) when NVRTC is not installed, unless `HOLDFAST_REQUIRE_NVRTC` is set (as in
/// CI), where a missing NVRTC fails. Panics on failure: this is a test helper.
#[cfg(feature = "cuda")]
pub fn assert_compiles_for_sm_90(src: &crate::KernelSource) -> Option<usize> {
    if compiler_missing("NVRTC", "HOLDFAST_REQUIRE_NVRTC", crate::cuda::nvrtc_unavailable_reason()) {
        return None;
    }
    let mut size = 0;
    for arch in ["sm_90", "sm_90a"] {
        let (cubin, ptx) = crate::cuda::compile(src, arch, 32).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert!(!cubin.is_empty(), "`{}`: NVRTC produced no CUBIN for {arch}", src.name);
        let ptx = String::from_utf8_lossy(&ptx);
        for e in &src.entries {
            assert!(ptx.contains(e.name), "`{}`: the {arch} PTX lacks entry point {}", src.name, e.name);
        }
        size = cubin.len();
    }
    Some(size)
}

/// Compiles `src` with NVRTC for `sm_90a` and checks that every entry point waits for the kernel
/// before it (`hf_dependent_kernel_start()` or
/// `hf_grid_dependency_wait()` in its code), which a launch through
/// [`crate::Stream::launch_dependent`] needs there: the CUDA backend refuses it otherwise, so this
/// is the check that catches a missing wait without a GPU. Returns `false` (after printing a
/// `skipped:` line) where NVRTC is missing, unless `HOLDFAST_REQUIRE_NVRTC` is set. Panics on
/// failure: this is a test helper.
#[cfg(feature = "cuda")]
pub fn assert_entries_wait_for_prior(src: &crate::KernelSource) -> bool {
    let Some(compiled) = sm90a(src) else { return false };
    let ptx = String::from_utf8_lossy(&compiled.ptx);
    let missing: Vec<&str> =
        src.entries.iter().map(|e| e.name).filter(|n| !crate::cuda::ptx_entry_waits_for_prior(&ptx, n)).collect();
    assert!(missing.is_empty(), "`{}`: entries that never wait for the kernel before them: {missing:?}", src.name);
    true
}

/// Compiles `src` with NVRTC for `sm_90a` and returns every kernel's registers, local-memory
/// frame (spills) and stack per thread ([`crate::cuda::kernel_resources`]), so a crate's tests
/// can hold its kernels to a register and spill budget with no GPU. `None` (after printing a
/// `skipped:` line) where NVRTC is missing, unless `HOLDFAST_REQUIRE_NVRTC` is set. Panics on
/// failure: this is a test helper.
#[cfg(feature = "cuda")]
pub fn sm90a_kernel_resources(src: &crate::KernelSource) -> Option<Vec<crate::cuda::KernelResources>> {
    let compiled = sm90a(src)?;
    let found = crate::cuda::kernel_resources(&compiled.cubin).unwrap_or_else(|e| panic!("`{}`: {e}", src.name));
    let mut names: Vec<&str> = found.iter().map(|k| k.name.as_str()).collect();
    names.sort_unstable();
    let mut want: Vec<&str> = src.entries.iter().map(|e| e.name).collect();
    want.sort_unstable();
    assert_eq!(names, want, "`{}`: the CUBIN's kernels are the source's entries", src.name);
    Some(found)
}

/// Compiles `src` with NVRTC for `sm_90a` ([`sm90a_kernel_resources`]), prints each kernel's
/// registers and local memory per thread, and asserts that no kernel has a local-memory frame
/// (register spills or local arrays) larger than its allowance in `frames` (name, bytes), 0 for
/// a kernel not listed: a change that makes a kernel spill fails here with no GPU. `false`
/// (after printing a `skipped:` line) where NVRTC is missing, unless `HOLDFAST_REQUIRE_NVRTC` is
/// set. Panics on failure: this is a test helper.
#[cfg(feature = "cuda")]
pub fn assert_sm90a_frames_within(src: &crate::KernelSource, frames: &[(&str, u32)]) -> bool {
    let Some(found) = sm90a_kernel_resources(src) else { return false };
    for (name, _) in frames {
        assert!(found.iter().any(|k| k.name == *name), "`{}`: no kernel `{name}` to allow a frame", src.name);
    }
    let over: Vec<String> = found
        .iter()
        .filter_map(|k| {
            let allowed = frames.iter().find(|(n, _)| *n == k.name).map_or(0, |&(_, b)| b);
            eprintln!(
                "{}: {} registers, {} bytes of local frame (allowed {allowed}), {} of stack",
                k.name, k.registers, k.frame_bytes, k.stack_bytes
            );
            (k.frame_bytes > allowed).then(|| format!("{} ({} bytes, allowed {allowed})", k.name, k.frame_bytes))
        })
        .collect();
    assert!(over.is_empty(), "`{}`: kernels with more local memory than allowed: {over:?}", src.name);
    true
}

/// Compiles `src` with NVRTC for `sm_90a` (uncached, so that ptxas's notes are in the log) and
/// asserts that ptxas neither serialised a kernel's warpgroup MMAs (C7514) nor inserted waits for
/// them (C7517): both mean that some instruction touches an MMA's registers while it may still be
/// in flight, which costs the overlap the code was written for (and, where the compiler could not
/// see it, would be a race). `false` (after printing a `skipped:` line) where NVRTC is missing,
/// unless `HOLDFAST_REQUIRE_NVRTC` is set. Panics on failure: this is a test helper.
#[cfg(feature = "cuda")]
pub fn assert_sm90a_wgmma_not_serialised(src: &crate::KernelSource) -> bool {
    if compiler_missing("NVRTC", "HOLDFAST_REQUIRE_NVRTC", crate::cuda::nvrtc_unavailable_reason()) {
        return false;
    }
    let log = crate::cuda::compile_log(src, "sm_90a", 32).unwrap_or_else(|e| panic!("`{}` for sm_90a: {e}", src.name));
    let notes: Vec<&str> = log.lines().filter(|l| l.contains("(C7514)") || l.contains("(C7517)")).collect();
    assert!(notes.is_empty(), "`{}`: ptxas serialised or waited on warpgroup MMAs:\n{}", src.name, notes.join("\n"));
    true
}

/// `src` compiled for `sm_90a` (warp 32) as a CUDA device loads it, through the kernel cache, so
/// the checks above compile each source once per machine; `None` (after printing a `skipped:`
/// line) where NVRTC is missing, unless `HOLDFAST_REQUIRE_NVRTC` is set.
#[cfg(feature = "cuda")]
fn sm90a(src: &crate::KernelSource) -> Option<crate::cuda::Compiled> {
    if compiler_missing("NVRTC", "HOLDFAST_REQUIRE_NVRTC", crate::cuda::nvrtc_unavailable_reason()) {
        return None;
    }
    Some(crate::cuda::compile_cached(src, "sm_90a", 32).unwrap_or_else(|e| panic!("`{}` for sm_90a: {e}", src.name)))
}

/// Compiles `src` with hipRTC for `gfx90a` (wavefront 64): the CI compile check of a crate's
/// kernels for AMD, with no GPU needed. Returns the code object's size, or `None` (after printing
/// a `skipped:` line) when HIP / hipRTC are not installed, unless `HOLDFAST_REQUIRE_HIPRTC` is set
/// (as in CI), where a missing hipRTC fails. Panics on failure: this is a test helper.
#[cfg(feature = "rocm")]
pub fn assert_compiles_for_gfx90a(src: &crate::KernelSource) -> Option<usize> {
    if compiler_missing("hipRTC", "HOLDFAST_REQUIRE_HIPRTC", crate::rocm::unavailable_reason()) {
        return None;
    }
    let code = crate::rocm::compile(src, "gfx90a", 64).unwrap_or_else(|e| panic!("{e}"));
    assert!(!code.is_empty(), "`{}`: hipRTC produced no code object", src.name);
    Some(code.len())
}

/// True (after printing a `skipped:` line) when the run-time compiler is absent for `reason`;
/// panics instead when the environment variable `require` is set.
#[cfg(any(feature = "cuda", feature = "rocm"))]
fn compiler_missing(compiler: &str, require: &str, reason: Option<impl std::fmt::Display>) -> bool {
    let Some(reason) = reason else { return false };
    assert!(std::env::var_os(require).is_none(), "{compiler} is required here: {reason}");
    eprintln!("skipped: {compiler} is not available ({reason})");
    true
}
