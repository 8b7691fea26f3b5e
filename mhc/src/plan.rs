//! Launch shapes. Each is a function of the token count, the hidden size and the device's
//! multiprocessor count only, so a graph captured at a padded `T` replays the same shape; and none
//! of them changes a token's arithmetic (the reduction structure depends on `H` alone), so any
//! shape gives the same bits.

use holdfast_hal::LaunchConfig;

use crate::reference::{splits, PRE_ROWS};
use crate::HC_MULT;

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

/// Tokens of one tensor-core m-tile.
const MMA_ROWS: usize = 16;
/// Largest resident tile sized to fill the device about once; larger ones (up to
/// [`Reduce::resident_tile_max`]) are taken only where they need fewer waves of blocks.
const RESIDENT_FILL_MAX: usize = 64;
/// A resident block's time that does not grow with its tile (loading and splitting its `fn`
/// slice, the barrier, the gates), in tokens of tile work: `mhc_pre` on an H200 measured about
/// 10–12 µs per wave of blocks plus 0.15 µs per token of the tile (tiles of 64 and 96).
/// Where one fill's tile is smaller than the largest, the plan compares the two only.
const RESIDENT_FIXED_TOKENS: usize = 70;

impl Reduce {
    /// The split reduction `op` runs (`None` for `mhc_post`, which has none).
    pub(crate) fn of(op: crate::params::MhcOp) -> Option<Reduce> {
        use crate::params::MhcOp;
        match op {
            MhcOp::HcHead => Some(Reduce::Head),
            MhcOp::Pre => Some(Reduce::Pre),
            MhcOp::FusedPostPre => Some(Reduce::Fused),
            MhcOp::Post => None,
        }
    }

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

    /// 16-byte pieces per lane and row of a resident m-tile: the 4 streams (+ x, fused).
    fn pieces(self) -> usize {
        match self {
            Reduce::Head | Reduce::Pre => 4,
            Reduce::Fused => 5,
        }
    }

    /// Blocks of the resident kernel one multiprocessor holds (registers and shared memory).
    fn resident_blocks_per_unit(self) -> usize {
        match self {
            Reduce::Head => 2,
            Reduce::Pre | Reduce::Fused => 1,
        }
    }

    /// Largest resident tile: what [`Self::resident_blocks_per_unit`] blocks' shared memory holds
    /// (a tile of more than [`RESIDENT_FILL_MAX`] tokens only where it saves waves, see [`reduce`]).
    fn resident_tile_max(self) -> usize {
        match self {
            Reduce::Head => 32,
            Reduce::Pre => 96,
            Reduce::Fused => 64,
        }
    }
}

/// Dynamic shared memory of a resident launch with `tile` tokens per tile, bytes
/// (`mhc_resident_launch_ok` in `kernels.cu`): one stage per m-tile of `8 warps · pieces · 2 rows
/// · 32 lanes · 16 B`, then two `[8 warps][16 rows][values]` f32 reduction buffers.
pub(crate) fn resident_shared_bytes(kind: Reduce, tile: usize) -> u32 {
    let stage = WARPS * kind.pieces() * 2 * 32 * 16;
    let red = 2 * WARPS * MMA_ROWS * kind.values() * 4;
    (tile.div_ceil(MMA_ROWS) * stage + red) as u32
}

/// Floats of the split-reduction workspace `mhc_pre` and the fused op use for `tokens` tokens and
/// `splits` splits: the partials `[T, S, 1 + n(n + 2)]`, then (from a 16-byte boundary) the
/// resident items' copy of the gate partials `[T, 1 + n, S rounded up to 4]` (`mhc_gate_copy` in
/// `kernels.cu`). `hc_head` needs less (`[T, S, 1 + n]`, no copy).
pub(crate) fn workspace_floats(tokens: usize, splits: usize) -> usize {
    (tokens * splits * (PRE_ROWS + 1)).next_multiple_of(4) + tokens * (HC_MULT + 1) * splits.next_multiple_of(4)
}

/// Stages of the streamed projection pass's ring (`MHC_ST_STREAM_PRE`, `MHC_ST_STREAM_FUSED` in
/// `kernels.cu`).
fn stream_stages(kind: Reduce) -> usize {
    match kind {
        Reduce::Head | Reduce::Pre => 3,
        Reduce::Fused => 4,
    }
}

/// Whether [`crate::MhcPasses::Auto`] takes the two passes: where every multiprocessor has at
/// least this many (token, split) pairs of work (`T · S / units`): 96 for `mhc_pre`, 48 for the
/// fused op, whose one-launch items spend longer on each tile. Measured on an H100 (two passes
/// against one): `mhc_pre` H 4096 T 512 (62 per unit) 23.2 against 21.1 µs, T 1024 (124) 36.0
/// against 45.6; H 7168 T 256 (54) 24.7 against 22.9, T 512 (108) 34.8 against 43.8; the fused op
/// H 4096 T 256 (31) 24.2 against 22.0, T 512 (62) 39.5 against 42.8, H 7168 T 256 (54) 39.0
/// against 40.2.
fn stream_pays(kind: Reduce, tokens: usize, hidden: usize, units: usize) -> bool {
    let per_unit = match kind {
        Reduce::Head | Reduce::Pre => 96,
        Reduce::Fused => 48,
    };
    tokens.saturating_mul(splits(hidden)) >= per_unit * units
}
/// Fewest 8-h chunks per finish block of the two passes.
const FINISH_MIN_CHUNKS: usize = 64;

/// Dynamic shared memory of the streamed projection pass, bytes (`mhc_stream_launch_ok`): the
/// ring's stages and the reduction buffers.
pub(crate) fn stream_shared_bytes(kind: Reduce) -> u32 {
    resident_shared_bytes(kind, stream_stages(kind) * MMA_ROWS)
}

/// Whether the two passes can run for `kind` on a device whose blocks may use `max_shared` bytes
/// of shared memory (`mhc_pre` and the fused op only).
pub(crate) fn stream_fits(kind: Reduce, max_shared: u32) -> bool {
    kind != Reduce::Head && stream_shared_bytes(kind) as usize + RESIDENT_STATIC_MAX <= max_shared as usize
}

/// Static shared memory the resident kernels may declare besides the dynamic stages, bytes
/// (`tests/nvrtc_compile.rs` checks the compiled kernels against it; the HAL gives each kernel
/// the device's limit less its static).
const RESIDENT_STATIC_MAX: usize = 8 * 1024;

/// Largest resident tile of `kind` on a device whose blocks may use `max_shared` bytes of shared
/// memory: [`Reduce::resident_tile_max`] or the most whole m-tiles that fit (0: none fits).
pub(crate) fn resident_cap(kind: Reduce, max_shared: u32) -> usize {
    let mut tile = kind.resident_tile_max();
    while tile >= MMA_ROWS && resident_shared_bytes(kind, tile) as usize + RESIDENT_STATIC_MAX > max_shared as usize {
        tile -= MMA_ROWS;
    }
    if tile < MMA_ROWS {
        0
    } else {
        tile
    }
}

/// Whether the resident (tensor-core) items of `kind` can run for `hidden`: a tile's `S` items
/// wait for each other, so the device must hold them all at once (it is asked to hold twice as
/// many), and one m-tile's stage must fit a block's shared memory.
pub(crate) fn resident_fits(kind: Reduce, hidden: usize, units: usize, max_shared: u32) -> bool {
    2 * splits(hidden) <= units && resident_cap(kind, max_shared) > 0
}

/// Shape of one split-reduction launch: `tiles · (splits + finish_per_tile)` blocks, or
/// `tiles · splits` resident items (`finish_tokens == 0`), or `splits` self-finishing projection
/// items (one tile; [`Self::self_finish`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReducePlan {
    /// Tokens per projection tile.
    pub tile_tokens: usize,
    /// Tokens per finish item; 0 selects the resident items (`tile_tokens` when self-finishing:
    /// no finish items run).
    pub finish_tokens: usize,
    /// Tiles: `ceil(T / tile_tokens)` (counters needed: `1 + 2·tiles`).
    pub tiles: usize,
    /// The launch.
    pub config: LaunchConfig,
    /// The grid is at most half the multiprocessors (every kernel here fits at least one block
    /// on each), so all of it is resident at once and blocks may take their index as ticket.
    pub resident_grid: bool,
    /// `hc_head` at decode sizes: one tile of every token, `S` projection items that each write
    /// their own 256 h after the tile's projections are in (no finish items; grid `S`).
    pub self_finish: bool,
    /// The two passes (`mhc_pre` and the fused op, tensor cores): `config` is the streamed
    /// projection (at most one block per multiprocessor, one split each), this the
    /// `mhc_pre_finish_n4` launch after it.
    pub finish: Option<LaunchConfig>,
}

impl ReducePlan {
    /// The kernels' `resident` argument: bit 0 [`Self::resident_grid`], bit 1
    /// [`Self::self_finish`] (`MHC_RESIDENT_GRID`, `MHC_SELF_FINISH` in `kernels.cu`).
    pub(crate) fn flags(&self) -> u32 {
        u32::from(self.resident_grid) | (u32::from(self.self_finish) << 1) | (u32::from(self.finish.is_some()) << 2)
    }
}

/// How the projection items run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ReduceShape {
    /// Tensor cores for `mhc_pre` and the fused op (resident items where [`resident_fits`]).
    pub mma: bool,
    /// Tensor cores for `hc_head`, likewise.
    pub head_mma: bool,
    /// Tokens per tile forced by the caller (`1..=128`), else the plan's choice.
    pub tile_tokens: Option<usize>,
    /// Most dynamic shared memory a block may use on the device, bytes
    /// (`DeviceInfo::max_shared_mem_per_block`): it caps the resident tiles.
    pub max_shared: u32,
    /// One launch or two for `mhc_pre` and the fused op on tensor cores.
    pub passes: crate::MhcPasses,
    /// The CPU backend, which emulates the streamed projection pass with the reference's split
    /// partials: [`crate::MhcPasses::Two`] takes the two passes there too (unless the portable
    /// path is chosen), so their schedule runs without a GPU.
    pub emulated_stream: bool,
}

impl ReduceShape {
    /// Whether tensor cores are chosen for `kind` ([`Self::head_mma`] for `hc_head`, else
    /// [`Self::mma`]); they run where [`resident_fits`] too.
    pub(crate) fn mma_for(&self, kind: Reduce) -> bool {
        if kind == Reduce::Head {
            self.head_mma
        } else {
            self.mma
        }
    }
}

/// Plans a split-reduction launch for `tokens > 0`.
///
/// `hc_head` without tensor cores at decode sizes (`T ≤ 16`, `2·S` ≤ the multiprocessors, no
/// forced tile): [`ReducePlan::self_finish`].
///
/// Resident items (tensor cores, where they fit): tiles of whole m-tiles (16 tokens), at most
/// [`Reduce::resident_tile_max`] and `16·S` (each item finishes at most 16 of its tile's tokens),
/// sized so that the items fill the resident blocks about once (at most [`RESIDENT_FILL_MAX`]),
/// or the largest tile where that needs enough fewer waves of blocks (each costing
/// [`RESIDENT_FIXED_TOKENS`] plus the tile). Portable: enough projection items
/// to give every multiprocessor about two, tiles of whole passes (8 warps × the tokens of a warp)
/// up to 128 tokens, and finish items of `ceil(T / 2·units)` tokens (1 to 16, at most the tile), so
/// that the finish items, which read whole rows, also give every multiprocessor about two.
pub(crate) fn reduce(kind: Reduce, tokens: usize, hidden: usize, units: usize, shape: ReduceShape) -> ReducePlan {
    let s = splits(hidden);
    let units = units.max(1);
    if kind != Reduce::Head && shape.emulated_stream && shape.passes == crate::MhcPasses::Two {
        return stream(kind, tokens, hidden, units);
    }
    if shape.mma_for(kind) && resident_fits(kind, hidden, units, shape.max_shared) {
        let two = match shape.passes {
            crate::MhcPasses::Auto => stream_pays(kind, tokens, hidden, units),
            crate::MhcPasses::One => false,
            crate::MhcPasses::Two => true,
        };
        if two && stream_fits(kind, shape.max_shared) {
            return stream(kind, tokens, hidden, units);
        }
        let cap = resident_cap(kind, shape.max_shared).min(MMA_ROWS * s).min(TILE_MAX);
        let tile = match shape.tile_tokens {
            Some(t) => t.clamp(1, cap),
            None => {
                let per_wave = units * kind.resident_blocks_per_unit();
                let want = (tokens * s).div_ceil(per_wave);
                let fill = (want.div_ceil(MMA_ROWS) * MMA_ROWS).clamp(1, cap.min(RESIDENT_FILL_MAX));
                // The largest tile where it saves enough waves: a wave costs its blocks' fixed time
                // plus their tile's work. (Tiles between the two measured slower: 80 tokens at
                // H 7168, T 1024 took 93.2 µs against 86.5 for 64 and 84.8 for 96.)
                let cost = |t: usize| (tokens.div_ceil(t) * s).div_ceil(per_wave) * (RESIDENT_FIXED_TOKENS + t);
                if kind == Reduce::Pre && cap == kind.resident_tile_max() && cap > fill && cost(cap) < cost(fill) {
                    cap
                } else {
                    fill
                }
            }
        }
        .min(tokens.max(1));
        let tiles = tokens.div_ceil(tile);
        let mut config = LaunchConfig::blocks(u32::try_from(tiles * s).unwrap_or(u32::MAX), THREADS);
        config.shared_mem_bytes = resident_shared_bytes(kind, tile);
        let resident_grid = LaunchConfig::grid_resident_at_once(tiles * s, units);
        return ReducePlan {
            tile_tokens: tile,
            finish_tokens: 0,
            tiles,
            config,
            resident_grid,
            self_finish: false,
            finish: None,
        };
    }
    if kind == Reduce::Head
        && shape.tile_tokens.is_none()
        && tokens <= FINISH_MAX
        && LaunchConfig::grid_resident_at_once(s, units)
    {
        // Decode sizes: the projection items finish their own h; the grid is resident at once.
        let config = LaunchConfig::blocks(s as u32, THREADS);
        return ReducePlan {
            tile_tokens: tokens,
            finish_tokens: tokens,
            tiles: 1,
            config,
            resident_grid: true,
            self_finish: true,
            finish: None,
        };
    }
    let pass = WARPS * kind.tokens_per_slot();
    let tiles_wanted = (2 * units).div_ceil(s).max(1);
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
    // Finish items read whole rows: enough of them that each multiprocessor gets about two.
    let finish = tokens.div_ceil(2 * units).clamp(1, FINISH_MAX).min(tile);
    let tiles = tokens.div_ceil(tile);
    let blocks = tiles * (s + tile.div_ceil(finish));
    ReducePlan {
        tile_tokens: tile,
        finish_tokens: finish,
        tiles,
        config: LaunchConfig::blocks(u32::try_from(blocks).unwrap_or(u32::MAX), THREADS),
        resident_grid: LaunchConfig::grid_resident_at_once(blocks, units),
        self_finish: false,
        finish: None,
    }
}

/// The two passes for `tokens > 0`: the streamed projection on `S · per` blocks, `per = units /
/// S` (at most the m-tiles), so that at most one block runs per multiprocessor and each loads one
/// split's weights (equal runs of the split-major units, which crossed splits to use every
/// multiprocessor, measured up to 12% slower on an H100, and 0.6% faster at one shape, the
/// fused op at H 7168, T 4096); then finish blocks of 16 tokens, each token group cut into
/// enough runs of chunks (at least [`FINISH_MIN_CHUNKS`] each) that the finish grid gives every
/// multiprocessor about two blocks.
fn stream(kind: Reduce, tokens: usize, hidden: usize, units: usize) -> ReducePlan {
    let (m, s) = (tokens.div_ceil(MMA_ROWS), splits(hidden));
    let blocks = s * (units / s).clamp(1, m);
    let mut config = LaunchConfig::blocks(u32::try_from(blocks).unwrap_or(u32::MAX), THREADS);
    config.shared_mem_bytes = stream_shared_bytes(kind);
    let chunks = hidden.div_ceil(8);
    let parts = (2 * units).div_ceil(m).clamp(1, (chunks / FINISH_MIN_CHUNKS).max(1));
    let finish = LaunchConfig {
        grid: (u32::try_from(m).unwrap_or(u32::MAX), parts as u32, 1),
        block: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    ReducePlan {
        tile_tokens: MMA_ROWS,
        finish_tokens: 0,
        tiles: m,
        config,
        resident_grid: false,
        self_finish: false,
        finish: Some(finish),
    }
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

/// Blocks per thread-block cluster of `hc_head` on clusters at hidden size `hidden`: 8, or 16
/// (NVIDIA sm_90's non-portable size) past `H = 4096`, so that no block owns more than 512 `h`: each
/// of its 256 threads then owns at most one 16-byte chunk (stream, 8 `h`), and two blocks fit a
/// multiprocessor.
pub(crate) fn cluster_blocks(hidden: usize) -> usize {
    if hidden <= 4096 {
        8
    } else {
        16
    }
}

/// Tokens per tile of `hc_head` on clusters (`MHC_CL_TILE`).
const CLUSTER_TILE: usize = 8;
/// Threads per block of `hc_head` on clusters (`MHC_CL_THREADS`).
const CLUSTER_THREADS: u32 = 256;
/// Static shared memory of `hc_head` on clusters, bytes (`red`, `inbox`, `full`, `gate`: 8.9
/// KiB), with room to spare.
const CLUSTER_STATIC_BYTES: u32 = 9216;

/// Dynamic shared memory of a block of `hc_head` on clusters for hidden size `hidden`, bytes: three
/// tiles' rows (`3 · 8 · 4 · Hs` bf16, `Hs = H / cluster_blocks(H)`), `192 · Hs` (the `fn` slice
/// stays in registers).
pub(crate) fn cluster_shared_bytes(hidden: usize) -> usize {
    192 * hidden / cluster_blocks(hidden)
}

/// Whether `hc_head` runs on clusters at `hidden` on a device with `max_shared` bytes of shared
/// memory per block: each of a cluster's `nb` blocks owns `H/nb` of every stream in 16-byte chunks
/// (`H` a multiple of `8·nb`), at most 512 `h` (`H <= 8192`), and its tile buffers fit in shared
/// memory.
pub(crate) fn cluster_head_fits(hidden: usize, max_shared: u32) -> bool {
    hidden > 0
        && hidden.is_multiple_of(8 * cluster_blocks(hidden))
        && hidden / cluster_blocks(hidden) <= 512
        && hidden <= 8192
        && cluster_shared_bytes(hidden) + CLUSTER_STATIC_BYTES as usize <= max_shared as usize
}

/// The block shape of `hc_head` on clusters at `hidden` (the grid is one cluster): what
/// [`holdfast_hal::Device::max_active_clusters`] is asked about.
pub(crate) fn cluster_block(hidden: usize) -> LaunchConfig {
    cluster_head(1, hidden, 1)
}

/// Launch of `hc_head` on clusters for `tokens > 0`: clusters of [`cluster_blocks`] blocks, one per
/// tile of 8 tokens up to `slots`, the clusters the device runs at once (each cluster then takes
/// tiles in turn, its next tile's rows in flight while it works on one).
pub(crate) fn cluster_head(tokens: usize, hidden: usize, slots: usize) -> LaunchConfig {
    let tiles = tokens.div_ceil(CLUSTER_TILE).max(1);
    let clusters = tiles.min(slots.max(1));
    LaunchConfig {
        grid: (u32::try_from(clusters * cluster_blocks(hidden)).unwrap_or(u32::MAX), 1, 1),
        block: (CLUSTER_THREADS, 1, 1),
        shared_mem_bytes: u32::try_from(cluster_shared_bytes(hidden)).unwrap_or(u32::MAX),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_plans_are_whole_clusters_within_the_tiles_and_the_limits() {
        let sm90 = holdfast_hal::SM90_MAX_SHARED_MEM_PER_BLOCK;
        for hidden in [64, 4096, 7168, 8192] {
            assert!(cluster_head_fits(hidden, sm90), "{hidden}");
            let nb = cluster_blocks(hidden);
            assert_eq!(nb, if hidden > 4096 { 16 } else { 8 });
            assert!(hidden / nb <= 512, "{hidden}");
            assert_eq!(cluster_block(hidden).grid.0 as usize, nb, "one cluster");
            for tokens in [1, 3, 8, 9, 64, 1000, 16_384] {
                for slots in [1, 16, 32] {
                    let cfg = cluster_head(tokens, hidden, slots);
                    let blocks = cfg.grid.0 as usize;
                    assert_eq!(blocks % nb, 0, "H {hidden} T {tokens}");
                    assert_eq!(blocks / nb, tokens.div_ceil(CLUSTER_TILE).min(slots), "H {hidden} T {tokens}");
                    assert_eq!(cfg.shared_mem_bytes as usize, 192 * hidden / nb);
                }
            }
        }
        for hidden in [1, 63, 100, 4100, 4160, 8256, 16_384] {
            assert!(!cluster_head_fits(hidden, sm90), "{hidden}");
        }
        assert!(!cluster_head_fits(4096, 96 * 1024), "a block whose shared memory is too small");
        assert_eq!(cluster_head(1, 4096, 0).grid.0 as usize, 8, "at least one cluster");
    }

    #[test]
    fn reduce_plans_cover_every_token_and_respect_the_limits() {
        for kind in [Reduce::Head, Reduce::Pre, Reduce::Fused] {
            for hidden in [1, 7, 256, 300, 1000, 4096, 7168, 40_000] {
                for tokens in [1, 2, 3, 31, 64, 100, 1000, 1024, 4096, 16_384] {
                    for (units, mma, forced) in [
                        (1, false, None),
                        (2, true, None),
                        (132, false, None),
                        (132, true, None),
                        (132, true, Some(48)),
                        (132, true, Some(1000)),
                    ] {
                        let p = reduce(
                            kind,
                            tokens,
                            hidden,
                            units,
                            ReduceShape {
                                mma,
                                head_mma: mma,
                                tile_tokens: forced,
                                max_shared: holdfast_hal::SM90_MAX_SHARED_MEM_PER_BLOCK,
                                passes: crate::MhcPasses::One,
                                emulated_stream: false,
                            },
                        );
                        let s = splits(hidden);
                        assert_eq!(p.resident_grid, 2 * p.config.grid.0 as usize <= units);
                        assert!(p.tile_tokens >= 1 && p.tile_tokens <= TILE_MAX);
                        assert!(p.tiles * p.tile_tokens >= tokens && (p.tiles - 1) * p.tile_tokens < tokens);
                        assert_eq!(p.config.block, (THREADS, 1, 1));
                        if mma && resident_fits(kind, hidden, units, holdfast_hal::SM90_MAX_SHARED_MEM_PER_BLOCK) {
                            assert_eq!(p.finish_tokens, 0);
                            assert!(p.tile_tokens <= kind.resident_tile_max().min(16 * s));
                            assert_eq!(p.config.grid.0 as usize, p.tiles * s);
                            assert_eq!(p.config.shared_mem_bytes, resident_shared_bytes(kind, p.tile_tokens));
                            // Each of a tile's S items finishes at most 16 of its tokens.
                            assert!(p.tile_tokens.div_ceil(s) <= FINISH_MAX);
                            if let Some(f) = forced {
                                assert_eq!(p.tile_tokens, f.min(kind.resident_tile_max().min(16 * s)).min(tokens));
                            }
                        } else if p.self_finish {
                            assert!(kind == Reduce::Head && forced.is_none() && tokens <= FINISH_MAX);
                            assert_eq!((p.tiles, p.tile_tokens, p.finish_tokens), (1, tokens, tokens));
                            assert_eq!(p.config.grid.0 as usize, s);
                            assert!(p.resident_grid && p.flags() == 3);
                            assert_eq!(p.config.shared_mem_bytes, 0);
                        } else {
                            assert!(
                                !(kind == Reduce::Head && forced.is_none() && tokens <= FINISH_MAX && 2 * s <= units)
                            );
                            assert!(p.finish_tokens >= 1 && p.finish_tokens <= FINISH_MAX.min(p.tile_tokens));
                            let f = p.tile_tokens.div_ceil(p.finish_tokens);
                            assert_eq!(p.config.grid.0 as usize, p.tiles * (s + f));
                            assert_eq!(p.config.shared_mem_bytes, 0);
                            if let Some(f) = forced {
                                assert_eq!(p.tile_tokens, f.min(TILE_MAX).min(tokens));
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn two_pass_plans_cover_every_unit_and_give_the_finish_grid_two_blocks_per_multiprocessor() {
        use crate::MhcPasses;
        let sm90 = holdfast_hal::SM90_MAX_SHARED_MEM_PER_BLOCK;
        let shape = ReduceShape {
            mma: true,
            head_mma: true,
            tile_tokens: None,
            max_shared: sm90,
            passes: MhcPasses::Auto,
            emulated_stream: false,
        };
        for kind in [Reduce::Pre, Reduce::Fused] {
            for hidden in [300, 1000, 4096, 7168] {
                for tokens in [1, 64, 511, 512, 1000, 1024, 16_384] {
                    let p = reduce(kind, tokens, hidden, 132, shape);
                    let per_unit = if kind == Reduce::Pre { 96 } else { 48 };
                    let two = tokens * splits(hidden) >= per_unit * 132;
                    assert_eq!(p.finish.is_some(), two, "{kind:?} H {hidden} T {tokens}");
                    let Some(f) = p.finish else { continue };
                    let m = tokens.div_ceil(MMA_ROWS);
                    assert_eq!(p.flags(), 4, "streamed: no tickets, no self-finish");
                    let s = splits(hidden);
                    assert_eq!(p.config.grid.0 as usize, s * (132 / s).clamp(1, m), "whole splits");
                    assert_eq!(p.config.shared_mem_bytes, stream_shared_bytes(kind));
                    assert_eq!((f.grid.0 as usize, f.block), (m, (THREADS, 1, 1)));
                    let (parts, chunks) = (f.grid.1 as usize, hidden.div_ceil(8));
                    assert!(parts >= 1 && (parts == 1 || chunks / parts >= FINISH_MIN_CHUNKS), "H {hidden}");
                    assert!(m * parts >= 264 || parts == (chunks / FINISH_MIN_CHUNKS).max(1), "H {hidden} T {tokens}");
                }
            }
            // The crossovers measured at H 4096 and 7168.
            let two = |t, h| reduce(kind, t, h, 132, shape).finish.is_some();
            if kind == Reduce::Pre {
                assert!(!two(512, 4096) && two(1024, 4096) && !two(256, 7168) && two(512, 7168));
            } else {
                assert!(!two(256, 4096) && two(512, 4096) && two(256, 7168));
            }
            // Forced either way.
            let two = reduce(kind, 1, 4096, 132, ReduceShape { passes: MhcPasses::Two, ..shape });
            assert_eq!(two.finish.map(|f| f.grid), Some((1, 8, 1)));
            assert_eq!(two.config.grid.0, 16, "one block per unit");
            assert!(reduce(kind, 16_384, 4096, 132, ReduceShape { passes: MhcPasses::One, ..shape }).finish.is_none());
        }
        // hc_head and the portable path make one launch.
        assert!(reduce(Reduce::Head, 16_384, 4096, 132, ReduceShape { passes: MhcPasses::Two, ..shape })
            .finish
            .is_none());
        let portable = ReduceShape { mma: false, head_mma: false, passes: MhcPasses::Two, ..shape };
        assert!(reduce(Reduce::Pre, 16_384, 4096, 132, portable).finish.is_none());
        // sm_80's 163 KiB hold mhc_pre's three stages (121.6 KiB with the reduction buffers) but
        // not the fused op's four (185.6 KiB): it stays on one launch there.
        let sm80 = ReduceShape { max_shared: 163 * 1024, ..shape };
        assert!(reduce(Reduce::Pre, 16_384, 4096, 108, sm80).finish.is_some());
        assert!(reduce(Reduce::Fused, 16_384, 4096, 108, sm80).finish.is_none());
        assert_eq!(stream_shared_bytes(Reduce::Pre), 3 * 32 * 1024 + 25 * 1024);
        assert_eq!(stream_shared_bytes(Reduce::Fused), 4 * 40 * 1024 + 25 * 1024);
    }

    #[test]
    fn resident_tiles_grow_past_one_fill_only_where_they_save_waves() {
        let shape = ReduceShape {
            mma: true,
            head_mma: true,
            tile_tokens: None,
            max_shared: holdfast_hal::SM90_MAX_SHARED_MEM_PER_BLOCK,
            passes: crate::MhcPasses::One,
            emulated_stream: false,
        };
        let tile = |kind, t, h| reduce(kind, t, h, 132, shape).tile_tokens;
        // mhc_pre, H 4096 (16 splits): 1024 tokens fit two waves of 64-token tiles (256 blocks)
        // and two of 96 (176): 64; from 4096 tokens 96-token tiles need fewer waves.
        for (t, want) in [(1, 1), (8, 8), (64, 16), (256, 32), (1024, 64), (4096, 96), (16_384, 96)] {
            assert_eq!(tile(Reduce::Pre, t, 4096), want, "mhc_pre T = {t}");
        }
        // H 7168 (28 splits), 1024 tokens: 64 → 448 blocks, 4 waves; 96 → 308 blocks, 3 waves.
        assert_eq!(tile(Reduce::Pre, 1024, 7168), 96);
        // The fused op's and hc_head's shared memory holds no larger tile than one fill's.
        assert_eq!(tile(Reduce::Fused, 16_384, 4096), 64);
        assert_eq!(tile(Reduce::Head, 16_384, 4096), 32);
        // Only mhc_pre's full-size tile is weighed against one fill's: at H 1152 (5 splits, a
        // largest tile of 80) the fill's tile stays.
        assert_eq!(tile(Reduce::Pre, 16_384, 1152), 64);
    }

    #[test]
    fn resident_tiles_fit_the_devices_shared_memory() {
        // sm_90 (227 KiB per block): every kind's largest tile.
        let sm90 = holdfast_hal::SM90_MAX_SHARED_MEM_PER_BLOCK;
        for kind in [Reduce::Head, Reduce::Pre, Reduce::Fused] {
            assert_eq!(resident_cap(kind, sm90), kind.resident_tile_max());
        }
        // sm_80 (163 KiB per block): mhc_pre to 64 tokens, the fused op to 48.
        let sm80 = 163 * 1024;
        assert_eq!((resident_cap(Reduce::Pre, sm80), resident_cap(Reduce::Fused, sm80)), (64, 48));
        let shape = ReduceShape {
            mma: true,
            head_mma: true,
            tile_tokens: None,
            max_shared: sm80,
            passes: crate::MhcPasses::One,
            emulated_stream: false,
        };
        for kind in [Reduce::Head, Reduce::Pre, Reduce::Fused] {
            for t in [1, 1024, 16_384] {
                let p = reduce(kind, t, 4096, 108, shape);
                assert!(p.config.shared_mem_bytes as usize + RESIDENT_STATIC_MAX <= sm80 as usize, "{kind:?} T {t}");
            }
        }
        // Too little for one m-tile: no resident items; the portable path runs.
        assert_eq!(resident_cap(Reduce::Pre, 48 * 1024), 0);
        assert!(!resident_fits(Reduce::Pre, 4096, 132, 48 * 1024));
        let p = reduce(Reduce::Pre, 64, 4096, 132, ReduceShape { max_shared: 48 * 1024, ..shape });
        assert!(p.finish_tokens > 0);
    }

    #[test]
    fn resident_shared_memory_fits_and_matches_the_kernel() {
        // mhc_resident_launch_ok in kernels.cu: ceil(tile / 16) stages + 1024·V bytes.
        assert_eq!(resident_shared_bytes(Reduce::Head, 32), 2 * 32 * 1024 + 5 * 1024);
        assert_eq!(resident_shared_bytes(Reduce::Pre, 64), 4 * 32 * 1024 + 25 * 1024);
        assert_eq!(resident_shared_bytes(Reduce::Pre, 96), 6 * 32 * 1024 + 25 * 1024);
        assert_eq!(resident_shared_bytes(Reduce::Fused, 64), 4 * 40 * 1024 + 25 * 1024);
        assert_eq!(resident_shared_bytes(Reduce::Pre, 1), 32 * 1024 + 25 * 1024);
        // Static shared memory of the kernels is under RESIDENT_STATIC_MAX (checked against the
        // compiled kernels in tests/nvrtc_compile.rs); the largest tiles fit the blocks per
        // multiprocessor the plan counts on (228 KiB per sm_90 multiprocessor, 1 KiB reserved each).
        for kind in [Reduce::Head, Reduce::Pre, Reduce::Fused] {
            let per = resident_shared_bytes(kind, kind.resident_tile_max()) + RESIDENT_STATIC_MAX as u32;
            assert!(per <= holdfast_hal::SM90_MAX_SHARED_MEM_PER_BLOCK);
            assert!(kind.resident_blocks_per_unit() as u32 * (per + 1024) <= 228 * 1024);
        }
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
