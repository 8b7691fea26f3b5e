//! Launch shapes. Each is a function of the token count, the hidden size and the device's
//! multiprocessor count only, so a graph captured at a padded `T` replays the same shape; and none
//! of them changes a token's arithmetic (the reduction structure depends on `H` alone), so any
//! shape gives the same bits.

use holdfast_hal::LaunchConfig;

use crate::reference::splits;

/// Threads per block of the split-reduction kernels (`MHC_THREADS`).
pub(crate) const THREADS: u32 = 256;
/// Warps (32-lane slots) per block.
const WARPS: usize = 8;
/// Most tokens a finish item handles (`MHC_FINISH_MAX`: one 16-lane Sinkhorn group each).
pub(crate) const FINISH_MAX: usize = 16;
/// Most tokens per projection tile.
const TILE_MAX: usize = 128;
/// Threads per block of `mhc_post` (`MHC_POST_THREADS`).
const POST_THREADS: u32 = 128;
/// Largest grid y dimension.
const GRID_Y_MAX: usize = 65_535;

/// The split-reduction kernels' register tile (`MHC_TT_*`): tokens per lane per pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reduce {
    Head,
    Pre,
    Fused,
}

/// Tokens of one tensor-core m-tile: tiles of the tensor-core projection are multiples of it.
const MMA_ROWS: usize = 16;

impl Reduce {
    /// Tokens one 32-lane slot covers per pass of the portable projection: token groups (32 /
    /// lanes per token) × register tile (`MHC_SUB_*`, `MHC_TT_*` in `kernels.cu`).
    fn tokens_per_slot(self) -> usize {
        match self {
            Reduce::Head => 2,
            Reduce::Pre | Reduce::Fused => 4 * 2,
        }
    }

    /// Outputs per (token, split): the sum of squares and one dot product per `fn` row.
    fn values(self) -> usize {
        match self {
            Reduce::Head => 4 + 1,
            Reduce::Pre | Reduce::Fused => 24 + 1,
        }
    }

    /// Blocks of the tensor-core kernel one multiprocessor holds (its shared memory and registers).
    fn mma_blocks_per_unit(self) -> usize {
        match self {
            Reduce::Head => 2,
            Reduce::Pre | Reduce::Fused => 1,
        }
    }
}

/// Dynamic shared memory of the tensor-core projection, bytes (`MhcMmaSmem` in `kernels.cu`):
/// `stages · 8 warps · pieces · 2 rows · 32 lanes · 16 B` plus two `[8 warps][16 rows][values]`
/// f32 reduction buffers; 3 stages for `hc_head` (two blocks per multiprocessor), 4 otherwise.
pub(crate) fn mma_shared_bytes(kind: Reduce) -> u32 {
    let (stages, pieces) = match kind {
        Reduce::Head => (3, 4),
        Reduce::Pre => (4, 4),
        Reduce::Fused => (4, 5),
    };
    let values = kind.values() as u32;
    stages * WARPS as u32 * pieces * 2 * 32 * 16 + 2 * WARPS as u32 * MMA_ROWS as u32 * values * 4
}

/// Shape of one split-reduction launch: `tiles · (splits + finish_per_tile)` blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReducePlan {
    /// Tokens per projection tile.
    pub tile_tokens: usize,
    /// Tokens per finish item.
    pub finish_tokens: usize,
    /// Tiles: `ceil(T / tile_tokens)` (counters needed: `1 + 2·tiles`).
    pub tiles: usize,
    /// The launch.
    pub config: LaunchConfig,
}

/// How the projection items run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReduceShape {
    /// The tensor-core projection (the launch carries its dynamic shared memory).
    pub mma: bool,
    /// Tokens per tile forced by the caller (`1..=128`), else the plan's choice.
    pub tile_tokens: Option<usize>,
}

/// Plans a split-reduction launch for `tokens > 0`. The portable projection: enough projection
/// items to give every multiprocessor about two (`units` of them), tiles of whole passes (8 warps
/// × the tokens of a warp) up to 128 tokens. The tensor-core one: about one item per resident
/// block, tiles of whole m-tiles (16 tokens) up to 128. Finish items take 16 tokens (fewer if
/// the tile is smaller).
pub(crate) fn reduce(kind: Reduce, tokens: usize, hidden: usize, units: usize, shape: ReduceShape) -> ReducePlan {
    let s = splits(hidden);
    let (pass, per_unit) =
        if shape.mma { (MMA_ROWS, kind.mma_blocks_per_unit()) } else { (WARPS * kind.tokens_per_slot(), 2) };
    let tiles_wanted = (per_unit * units.max(1)).div_ceil(s).max(1);
    let mut tile = match shape.tile_tokens {
        Some(t) => t.clamp(1, TILE_MAX),
        None => {
            let mut tile = tokens.div_ceil(tiles_wanted).clamp(1, TILE_MAX);
            if tile > pass {
                tile = (tile.div_ceil(pass) * pass).min(TILE_MAX);
            }
            tile
        }
    };
    tile = tile.min(tokens.max(1)).max(1);
    let finish = FINISH_MAX.min(tile);
    let tiles = tokens.div_ceil(tile);
    let blocks = tiles * (s + tile.div_ceil(finish));
    let mut config = LaunchConfig::blocks(u32::try_from(blocks).unwrap_or(u32::MAX), THREADS);
    if shape.mma {
        config.shared_mem_bytes = mma_shared_bytes(kind);
    }
    ReducePlan { tile_tokens: tile, finish_tokens: finish, tiles, config }
}

/// Shape of an `mhc_post` launch for `tokens > 0`: `(ceil(H / 8 / 128), ceil(T / per_block))`
/// blocks of 128 threads, one 8-element chunk of `h` per thread; returns the config and the tokens
/// per block (1 unless `T` passes the grid's y limit).
pub(crate) fn post(tokens: usize, hidden: usize) -> (LaunchConfig, usize) {
    let per_block = tokens.div_ceil(GRID_Y_MAX).max(1);
    let x = hidden.div_ceil(8).div_ceil(POST_THREADS as usize).max(1);
    let y = tokens.div_ceil(per_block).max(1);
    let cfg = LaunchConfig {
        grid: (u32::try_from(x).unwrap_or(u32::MAX), u32::try_from(y).unwrap_or(u32::MAX), 1),
        block: (POST_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    (cfg, per_block)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reduce_plans_cover_every_token_and_respect_the_limits() {
        for kind in [Reduce::Head, Reduce::Pre, Reduce::Fused] {
            for hidden in [1, 7, 256, 300, 4096, 7168] {
                for tokens in [1, 2, 3, 31, 64, 100, 1000, 1024, 4096, 16_384] {
                    for (units, mma, forced) in [
                        (1, false, None),
                        (2, true, None),
                        (132, false, None),
                        (132, true, None),
                        (132, true, Some(48)),
                        (132, true, Some(1000)),
                    ] {
                        let p = reduce(kind, tokens, hidden, units, ReduceShape { mma, tile_tokens: forced });
                        assert_eq!(p.config.shared_mem_bytes, if mma { mma_shared_bytes(kind) } else { 0 });
                        if let Some(f) = forced {
                            assert_eq!(p.tile_tokens, f.min(TILE_MAX).min(tokens));
                        }
                        assert!(p.tile_tokens >= 1 && p.tile_tokens <= TILE_MAX);
                        assert!(p.finish_tokens >= 1 && p.finish_tokens <= FINISH_MAX.min(p.tile_tokens));
                        assert!(p.tiles * p.tile_tokens >= tokens && (p.tiles - 1) * p.tile_tokens < tokens);
                        let f = p.tile_tokens.div_ceil(p.finish_tokens);
                        assert_eq!(p.config.grid.0 as usize, p.tiles * (splits(hidden) + f));
                        assert_eq!(p.config.block, (THREADS, 1, 1));
                    }
                }
            }
        }
    }

    #[test]
    fn tensor_core_shared_memory_fits_one_sm90_block_and_matches_the_kernel() {
        // MhcMmaSmem<3, 4, 5>, <4, 4, 25>, <4, 5, 25> in kernels.cu.
        assert_eq!(mma_shared_bytes(Reduce::Head), 3 * 32 * 1024 + 5 * 1024);
        assert_eq!(mma_shared_bytes(Reduce::Pre), 4 * 32 * 1024 + 25 * 1024);
        assert_eq!(mma_shared_bytes(Reduce::Fused), 4 * 40 * 1024 + 25 * 1024);
        // Static shared memory of the kernels is under 8 KiB; two hc_head blocks share one SM.
        let budget = holdfast_hal::SM90_MAX_SHARED_MEM_PER_BLOCK - 8 * 1024;
        assert!(mma_shared_bytes(Reduce::Fused) <= budget);
        assert!(2 * (mma_shared_bytes(Reduce::Head) + 8 * 1024) <= 228 * 1024);
    }

    #[test]
    fn post_plans_cover_every_chunk_and_token() {
        for hidden in [1, 8, 9, 1024, 7168] {
            for tokens in [1, 5, 65_535, 65_536, 200_000] {
                let (cfg, per) = post(tokens, hidden);
                assert!(cfg.grid.1 as usize * per >= tokens && cfg.grid.1 <= 65_535);
                assert!(cfg.grid.0 as usize * 128 * 8 >= hidden);
            }
        }
    }
}
