//! The crate's error type: shape, parameter and aliasing misuse of the ops, plus the HAL's errors.

use holdfast_hal::HalError;

/// Result alias of this crate.
pub type Result<T, E = MhcError> = std::result::Result<T, E>;

/// Everything an mHC op can reject. Shapes are checked before anything is launched, so a rejected
/// call has enqueued nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MhcError {
    /// A HAL call failed (launch, allocation, compilation, capture rules).
    #[error(transparent)]
    Hal(#[from] HalError),
    /// A view or slice has the wrong number of elements.
    #[error("{op}: `{arg}` has {got} elements, expected {expected} ({shape})")]
    Shape {
        /// The op (`hc_head`, `mhc_pre`, ...).
        op: &'static str,
        /// The argument.
        arg: &'static str,
        /// Elements expected.
        expected: usize,
        /// Elements given.
        got: usize,
        /// The expected shape in words, e.g. `[T=3, n=4, H=256]`.
        shape: String,
    },
    /// The residual's length is not a whole number of tokens.
    #[error("{op}: `{arg}` has {got} elements, not a multiple of one token's {row} ({shape})")]
    PartialToken {
        /// The op.
        op: &'static str,
        /// The argument.
        arg: &'static str,
        /// Elements given.
        got: usize,
        /// Elements per token.
        row: usize,
        /// One token's shape in words.
        shape: String,
    },
    /// More tokens than the ops (and their workspace) were built for.
    #[error("{op}: {tokens} tokens exceed max_tokens = {max_tokens} of this MhcOps")]
    TooManyTokens {
        /// The op.
        op: &'static str,
        /// Tokens in the call.
        tokens: usize,
        /// The configured maximum.
        max_tokens: usize,
    },
    /// A configuration that no kernel supports (hc_mult other than 4, zero hidden size, sizes past
    /// the kernels' 32-bit indices).
    #[error("unsupported mHC configuration: {0}")]
    Unsupported(String),
    /// A scalar parameter out of its domain (negative or non-finite epsilon, zero Sinkhorn
    /// iterations, ...).
    #[error("{op}: parameter `{name}` = {value} is invalid: {why}")]
    InvalidParam {
        /// The op.
        op: &'static str,
        /// The parameter.
        name: &'static str,
        /// Its value, printed.
        value: String,
        /// What it must satisfy.
        why: &'static str,
    },
    /// An output view overlaps an input view (only the in-place residual update of `mhc_post` and
    /// `mhc_fused_post_pre`, with exactly equal views, is allowed).
    #[error("{op}: output `{output}` overlaps input `{input}`")]
    Overlap {
        /// The op.
        op: &'static str,
        /// The output argument.
        output: &'static str,
        /// The input (or other output) it overlaps.
        input: &'static str,
    },
}
