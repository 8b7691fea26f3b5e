//! Finding `libamdhip64` and `libhiprtc` at run time.
//!
//! `cubecl-hip-sys` resolves every HIP symbol lazily from libraries it opens itself (under
//! `$ROCM_PATH` and `$HIP_PATH`, then by bare name). Calling a HIP function while they are missing
//! aborts the process, so `is_available()` is checked before anything else. Its answer is cached
//! for the life of the process: set `ROCM_PATH` before the first device is opened.

use std::sync::OnceLock;

/// Why the ROCm backend cannot start, or `None` if both libraries load.
pub(crate) fn unavailable_reason() -> Option<String> {
    static REASON: OnceLock<Option<String>> = OnceLock::new();
    REASON
        .get_or_init(|| {
            if cubecl_hip_sys::is_available() {
                return None;
            }
            let env = |v: &str| std::env::var(v).unwrap_or_else(|_| "(unset)".into());
            Some(format!(
                "libamdhip64 and libhiprtc did not both load; searched $ROCM_PATH/lib ({}), $HIP_PATH/lib ({}), then \
                 the system loader path for libamdhip64.so[.1|.0] and libhiprtc.so[.1|.0]",
                env("ROCM_PATH"),
                env("HIP_PATH")
            ))
        })
        .clone()
}
