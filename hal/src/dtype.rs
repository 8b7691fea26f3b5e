//! Element types a [`Buffer`](crate::Buffer) may hold.

use std::fmt;

/// The element type of a buffer or pointer parameter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// `u8`, 1 byte.
    U8,
    /// `i32`, 4 bytes.
    I32,
    /// `u32`, 4 bytes.
    U32,
    /// `i64`, 8 bytes.
    I64,
    /// `f32`, 4 bytes.
    F32,
    /// `half::bf16`, 2 bytes.
    BF16,
    /// `half::f16`, 2 bytes.
    F16,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size(self) -> usize {
        match self {
            DType::U8 => 1,
            DType::BF16 | DType::F16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 => 8,
        }
    }

    /// The C type name used in kernel sources.
    pub const fn c_name(self) -> &'static str {
        match self {
            DType::U8 => "uint8_t",
            DType::I32 => "int32_t",
            DType::U32 => "uint32_t",
            DType::I64 => "int64_t",
            DType::F32 => "float",
            DType::BF16 => "hf_bf16",
            DType::F16 => "hf_f16",
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::U8 => "u8",
            DType::I32 => "i32",
            DType::U32 => "u32",
            DType::I64 => "i64",
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
        })
    }
}

mod sealed {
    pub trait Sealed {}
}

/// A type that can live in device memory: plain old data with a [`DType`] tag.
///
/// Sealed: the set is fixed so that every backend and every kernel signature can name it.
pub trait Element: bytemuck::Pod + Default + Send + Sync + PartialEq + fmt::Debug + sealed::Sealed + 'static {
    /// The tag of this type.
    const DTYPE: DType;
}

macro_rules! element {
    ($($t:ty => $d:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Element for $t {
            const DTYPE: DType = DType::$d;
        }
    )*};
}

element!(u8 => U8, i32 => I32, u32 => U32, i64 => I64, f32 => F32, half::bf16 => BF16, half::f16 => F16);
