//! # holdfast-mhc: the mHC ops of DeepSeek-V4 as fused, capturable, batch-invariant kernels
//!
//! Manifold-constrained hyper-connections keep `n = 4` residual streams per token
//! (`[T, n, H]` bf16). Four ops move data between them and the sublayers (spec §6):
//! [`MhcOps::pre`] (gates, Sinkhorn-mixed streams, the sublayer input), [`MhcOps::post`] (write a
//! sublayer output back), [`MhcOps::fused_post_pre`] (both, one launch) and [`MhcOps::hc_head`]
//! (collapse the streams before the final norm). Each is one kernel launch into caller-provided
//! views (`mhc_pre` and the fused op two at large `T` on tensor cores, [`MhcPasses`]), validated
//! first ([`MhcError`]), and a no-op for `T = 0`.
//!
//! ## Who defines the numbers
//! [`reference`](mod@reference) is the definition (DESIGN.md 3.3): plain Rust over slices that the CPU backend
//! runs in place of the kernels. The device kernels (`src/kernels.cu`, one source for CUDA and
//! HIP) follow it operation for operation on the portable path ([`MhcProjection::Portable`]):
//! the same partition of each token's `n·H` row, the same per-lane fma order, the same xor-tree
//! lane sums and split order, explicit fmas where the reference has them (so the compiler's
//! contraction changes nothing), and correctly rounded division and square root (no `rsqrtf`).
//! There a GPU result differs from the reference only where the device `expf` does, a few ulp in
//! a gate. On NVIDIA sm_80+ the default ([`MhcProjection::Auto`]) runs `mhc_pre` and the fused op
//! on tensor cores instead (and [`MhcProjection::TensorCores`] `hc_head` too): the projection in
//! its own fixed order, within rounding of the reference (below); the gates, Sinkhorn and output
//! arithmetic are the same code on both paths.
//!
//! ## Precision policy
//! - bf16 storage, f32 arithmetic; every bf16 input converts exactly; outputs round to nearest
//!   even once.
//! - The projection `x · fnᵀ`: on the portable path an f32 fma reduction on the CUDA cores; on
//!   tensor cores, bf16 `mma.sync` with f32 accumulation, `x` exact (it is bf16) and each f32
//!   weight split into `hi = bf16(w)` and `lo = bf16(w − hi)`, so the products carry the weight
//!   to about 2⁻¹⁷ relative — no TF32 (2⁻¹¹; vLLM's CUDA path uses a TF32 GEMM), no bf16
//!   rounding of `x̂` (its Triton `hc_head` does that). Σx² is an f32 fma sum on the portable
//!   path; on tensor cores it is the diagonal of `x · xᵀ` from the same bf16 pieces (exact
//!   products, f32 accumulation). The RMS factor is applied after the projection, `mix = (x ·
//!   fnᵀ) · rsqrt(Σx²/D + eps)`, as in §6.2 and vLLM's fused kernels; this equals projecting the
//!   normalised input up to rounding.
//! - Sinkhorn runs in f32 with IEEE division, exactly §6.2 step 4 (softmax + eps, column
//!   normalisation, then `iters - 1` row/column pairs).
//! - Tests hold bf16 outputs to relative L2 ≤ 1e-2 and f32 outputs to ≤ 1e-4 of an f64 evaluation
//!   of §6, and the device to the same bounds against the reference on both paths (DESIGN.md 8).
//!
//! ## Batch invariance and capture
//! A token's reduction structure depends on `H` only (`ceil(H / 256)` splits of 256 `h`, each
//! split summed in a fixed order: a lane tree on the portable path, mma fragments then warp order
//! on tensor cores; the splits in split order), never on `T`, the tile sizes or the grid, and no
//! atomics touch data: a
//! token's outputs are the same bits whether it runs alone or among 16 K others, at any tile
//! ([`MhcOps::with_tile_tokens`]). Launch shapes are a
//! function of `T` (see [`MhcOps::launch_configs`]), so a graph captured at a padded `T` replays the
//! same launches. The split-reduction kernels claim work items from a ticket counter; a finish item
//! waits only for items claimed before it, and a resident item only for the other items of its
//! tile, which hold the neighbouring tickets and fit on the device together (as do `hc_head`'s
//! self-finishing items at decode sizes, whose whole grid is resident), so none can deadlock.
//! Every counter is reset by its last user, so each launch leaves the workspace ready for the
//! next, graph replays included.
//!
//! ## Kernel design (memory-bound; one launch per op, or two)
//! - `mhc_pre`, `mhc_fused_post_pre` (and `hc_head` when asked) on tensor cores (NVIDIA sm_80+): blocks of 256
//!   threads, one *resident item* per (tile of up to 32 (`hc_head`), 96 (`mhc_pre`) or 64 (fused)
//!   tokens, as the device's shared memory allows, split of 256 `h`). Each warp owns 32 `h` of all
//!   4 streams and holds its weights as mma fragments; the tile's rows are copied into shared
//!   memory with `cp.async` (three or four m-tiles of 16 ahead) and stay there. After one barrier
//!   among the tile's items (all partials written) every item sums the gate partials of the
//!   tile's tokens itself (from a row-major copy the items also write, `[T][1 + n][S]`, with
//!   16-byte loads; and, in the same round trip of loads, all partials of its share of the
//!   tokens) and writes its own 256 `h` of the outputs from shared memory: the residual is
//!   read from memory once. Then each item computes post and comb (Sinkhorn) for its share of
//!   the tokens. A tile's items wait for each other, so this path runs where the device
//!   holds at least twice `ceil(H / 256)` blocks at once ([`MhcOps::uses_tensor_cores`]). Up to
//!   217 KB of dynamic shared memory per block. Grid: `tiles · splits`.
//! - `mhc_pre` and the fused op on tensor cores where every multiprocessor has enough work
//!   ([`MhcPasses::Auto`]: `T · splits` at least 96 (fused: 48) per multiprocessor), in two
//!   launches that never wait inside a launch: a *streamed projection*, `S · (units / S)` blocks
//!   (at most one per multiprocessor), each taking one split and an equal run of its 16-token
//!   m-tiles, loading the split's weight fragments once and streaming the m-tiles through a ring
//!   of three stages (the fused op: four; each copy asks L2 for the whole 256-byte block around
//!   it, which the block's other warps read next); it writes the same per-(token, split)
//!   partials as the resident items (the fused op also its post-mixed streams to
//!   `residual_out`). Then *finish blocks* (`mhc_pre_finish_n4`, 16 tokens × a run of 8-`h`
//!   chunks each, about two per multiprocessor) sum the partials in split order, form the gates
//!   (and post and comb, Sinkhorn) and write `layer_input` from the residual (the fused op's
//!   `residual_out`), read a second time. The same arithmetic per token as the resident items:
//!   the same bits. (Running the two passes over chunks of `T`, each chunk's finish beside the
//!   next chunk's projection so that it reads its rows from L2, measured 1.07–2.7× the time on
//!   an H100: `benches/RESULTS.md`, seventeenth run.) The CPU backend emulates the streamed
//!   projection (the reference's per-split partials), so [`MhcPasses::Two`] runs there too.
//! - The same ops elsewhere (portable path): a *projection item* (tile of up to 128 tokens × one
//!   split) accumulates Σx² and the `n` (or `n(n+2)`) dot products per token and writes per-split
//!   partials: `hc_head` gives each token 32 lanes × 2 quads per split (a register tile of 2
//!   tokens); `mhc_pre` gives it 8 lanes × 8 quads, so the 4 tokens of a warp slot (× a register
//!   tile of 2) share every weight load, one 128-byte line per instruction. A *finish item* (up to
//!   16 tokens) waits for its tile's projection items, sums the partials, computes the gates (and
//!   the Sinkhorn, 16 lanes per token), and writes the weighted stream sum, reading the residual
//!   a second time (from L2 while it is there), four 16-byte chunks per thread in flight. Grid:
//!   `tiles · (splits + finish items per tile)`. `hc_head` at decode sizes (T ≤ 16) instead lets
//!   its `splits` projection items wait for each other, as resident items do, and each write its
//!   own 256 `h` (no block reads whole rows). Grid: `splits`.
//! - `hc_head` on thread-block clusters (the default where they run: NVIDIA sm_90+, `H` up to
//!   8192): clusters of `nb` blocks of 256 threads (8 up to `H = 4096`, a multiple of 64; 16
//!   past it, a multiple of 128: no block owns more than 512 `h`), block `r` owning `h` in
//!   `[r·H/nb, (r+1)·H/nb)` of every stream, each thread one 16-byte chunk of it (stream, 8 `h`)
//!   with that chunk's `fn` weights in registers for the whole launch. Clusters take tiles of 8
//!   tokens in turn; per tile each block sums its partial Σx² and dots over the block (butterflies
//!   per warp, then the warps in order), pushes them into every block's shared memory
//!   (`st.async`, completing bytes on the tile slot's mbarrier there: no cluster barrier per
//!   tile), sums the cluster's partials in rank order once they are all in (the same bits in
//!   every block) and writes its slice of the outputs: the residual is read from memory once. The
//!   tiles are pipelined over three row buffers and partial slots: while one warp waits for a
//!   tile's partials and forms its gates, the block's other warps form their partials of the
//!   next tile, and the rows of the one after are copied (`cp.async`). A token's reduction order
//!   depends on `H` alone (the cluster size is a function of `H`). Grid: the clusters the device runs at once (`Device::max_active_clusters`), at most
//!   one per tile. Shared memory `192·H/nb` bytes per block.
//! - `mhc_post`: elementwise, `(ceil(H/1024), T)` blocks of 128 threads, 16-byte loads and stores.
//! - Rows that are not 16-byte aligned or `H % 8 != 0` take element loads with the same
//!   arithmetic (the same bits).
//!
//! Bytes moved per op: [`MhcOp::bytes_moved`].

mod error;
mod fused;
mod head;
mod kernels;
mod ops;
mod params;
mod plan;
mod post;
mod pre;
pub mod reference;

pub use error::{MhcError, Result};
pub use fused::MhcPostInputs;
pub use kernels::{source, MhcKernels};
pub use ops::{HcHeadWeights, MhcConfig, MhcOps, MhcPasses, MhcPreOutputs, MhcPreWeights, MhcProjection};
pub use params::{HcHeadParams, MhcOp, MhcPreParams};

/// Residual streams per token (`hc_mult`) that the kernels are built for.
pub const HC_MULT: usize = 4;
