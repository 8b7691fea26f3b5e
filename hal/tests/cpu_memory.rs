//! The CPU emulator has a device memory of its own size (`HOLDFAST_CPU_MEMORY`, else nine tenths of
//! the host's available memory): an allocation past it fails with `OutOfMemory` naming the buffer,
//! as on a GPU, and freeing makes room again. One test per binary: it sets the process environment.

use holdfast_hal::cpu::CPU_MEMORY_ENV;
use holdfast_hal::{Device, HalError};

#[test]
fn allocations_past_the_emulated_memory_fail_and_freeing_makes_room() {
    std::env::set_var(CPU_MEMORY_ENV, "not bytes");
    match Device::open("cpu") {
        Err(HalError::UnknownDevice { reason, .. }) => assert!(reason.contains(CPU_MEMORY_ENV), "{reason}"),
        other => panic!("a malformed {CPU_MEMORY_ENV} must be refused, got {:?}", other.map(|d| d.info().clone())),
    }

    std::env::set_var(CPU_MEMORY_ENV, (1u64 << 20).to_string());
    let dev = Device::open("cpu").expect("cpu device");
    assert_eq!(dev.info().total_memory, 1 << 20);
    let a = dev.alloc_zeroed::<u8>("a", 600 << 10, false).expect("600 KiB of 1 MiB");
    match dev.alloc_zeroed::<u8>("b", 600 << 10, false) {
        Err(HalError::OutOfMemory { bytes, label }) => {
            assert_eq!((bytes, label.as_str()), (600 << 10, "b"));
        }
        other => panic!("1.2 MiB of 1 MiB must fail, got {:?}", other.map(|b| b.len())),
    }
    drop(a);
    let b = dev.alloc_zeroed::<u8>("b", 600 << 10, false).expect("room again after freeing");
    assert_eq!(b.len(), 600 << 10);
    // Pinned staging is host memory, outside the device's: a size the host cannot give is an
    // out-of-memory error (2^50 bytes pass any x86-64 or AArch64 address space), not an abort.
    match dev.alloc_pinned::<u8>(1 << 50) {
        Err(HalError::OutOfMemory { bytes, label }) => {
            assert_eq!((bytes, label.as_str()), (1 << 50, "pinned host memory"))
        }
        other => panic!("a petabyte of pinned memory must fail, got {:?}", other.map(|p| p.len())),
    }
    assert_eq!(dev.alloc_pinned::<u8>(4 << 20).expect("4 MiB of pinned memory").len(), 4 << 20);
    std::env::remove_var(CPU_MEMORY_ENV);
}
