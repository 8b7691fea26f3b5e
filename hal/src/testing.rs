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
