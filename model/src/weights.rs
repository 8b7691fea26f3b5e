//! Model weights on the device, filled from a [`WeightSource`].
//!
//! Every tensor has a name (`embed.weight`, `layers.3.attn.wq_b`, ...), a shape and a dtype
//! (matrices and norm weights bf16, hyper-connection parameters and the other small vectors f32).
//! [`SeededInit`] fills them deterministically from a seed with scales chosen so activations stay
//! finite and logits are not degenerate; a checkpoint loader implements [`WeightSource`] too.

use std::collections::HashMap;

use half::bf16;
use holdfast_attention::LayerKind;
use holdfast_hal::{Buffer, Device};
use rayon::prelude::*;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// What a weight tensor holds, which decides its seeded initialisation.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    /// Uniform with this standard deviation around 0 (projection matrices, embeddings).
    Normal(f32),
    /// `1 + noise` with this standard deviation (RMSNorm weights).
    NearOne(f32),
    /// Every element equal to the value.
    Const(f32),
    /// The `mhc_pre` bias `[n(n+2)]`: pre gates near `sigmoid(-1)`, post gates near 1 (after
    /// `post_mult`), comb logits favouring the identity routing.
    HcBase(usize),
}

/// A provider of weight values: called once per tensor with its name, shape and initialisation
/// hint; it fills `out` (row-major, `shape.iter().product()` elements).
pub trait WeightSource {
    /// Fills a bf16 tensor.
    fn fill_bf16(&mut self, name: &str, shape: &[usize], init: Init, out: &mut [bf16]) -> Result<()>;
    /// Fills an f32 tensor.
    fn fill_f32(&mut self, name: &str, shape: &[usize], init: Init, out: &mut [f32]) -> Result<()>;
}

/// Deterministic initialisation from a seed: each tensor's values depend only on the seed, the
/// tensor's name and the element index (not on the order tensors are filled or on thread count).
#[derive(Clone, Copy, Debug)]
pub struct SeededInit {
    /// The seed.
    pub seed: u64,
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn name_hash(seed: u64, name: &str) -> u64 {
    name.bytes().fold(splitmix(seed), |h, b| splitmix(h ^ u64::from(b)))
}

/// Uniform in `[-1, 1)` from a counter.
fn unit(key: u64, i: u64) -> f32 {
    let r = splitmix(key ^ i.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    ((r >> 40) as f32 / (1u64 << 23) as f32) - 1.0
}

const SQRT3: f32 = 1.732_050_8;

impl SeededInit {
    fn value(key: u64, i: usize, init: Init) -> f32 {
        match init {
            Init::Normal(std) => unit(key, i as u64) * std * SQRT3,
            Init::NearOne(std) => 1.0 + unit(key, i as u64) * std * SQRT3,
            Init::Const(v) => v,
            Init::HcBase(n) => {
                let noise = 0.1 * unit(key, i as u64);
                if i < n {
                    -1.0 + noise
                } else if i < 2 * n {
                    noise
                } else {
                    let (r, c) = ((i - 2 * n) / n, (i - 2 * n) % n);
                    if r == c {
                        2.0 + noise
                    } else {
                        noise
                    }
                }
            }
        }
    }
}

impl WeightSource for SeededInit {
    fn fill_bf16(&mut self, name: &str, _shape: &[usize], init: Init, out: &mut [bf16]) -> Result<()> {
        let key = name_hash(self.seed, name);
        out.par_chunks_mut(1 << 16).enumerate().for_each(|(c, chunk)| {
            for (j, o) in chunk.iter_mut().enumerate() {
                *o = bf16::from_f32(Self::value(key, (c << 16) + j, init));
            }
        });
        Ok(())
    }

    fn fill_f32(&mut self, name: &str, _shape: &[usize], init: Init, out: &mut [f32]) -> Result<()> {
        let key = name_hash(self.seed, name);
        out.par_chunks_mut(1 << 16).enumerate().for_each(|(c, chunk)| {
            for (j, o) in chunk.iter_mut().enumerate() {
                *o = Self::value(key, (c << 16) + j, init);
            }
        });
        Ok(())
    }
}

/// A [`WeightSource`] that asks `inner` for each tensor once and hands the same values to every
/// later load of that tensor (same name, shape and initialisation hint): for building several
/// runners over one set of weights (one per graph mode, say) without filling them again. It holds
/// a host copy of every tensor it has seen ([`CachedSource::cached_bytes`]) until dropped.
#[derive(Debug)]
pub struct CachedSource<S> {
    inner: S,
    bf16s: HashMap<String, (Vec<usize>, Init, Vec<bf16>)>,
    f32s: HashMap<String, (Vec<usize>, Init, Vec<f32>)>,
}

impl<S: WeightSource> CachedSource<S> {
    /// An empty cache in front of `inner`.
    pub fn new(inner: S) -> Self {
        CachedSource { inner, bf16s: HashMap::new(), f32s: HashMap::new() }
    }

    /// Host bytes held: every cached tensor's elements.
    pub fn cached_bytes(&self) -> usize {
        self.bf16s.values().map(|(_, _, v)| v.len() * 2).sum::<usize>()
            + self.f32s.values().map(|(_, _, v)| v.len() * 4).sum::<usize>()
    }
}

/// `out` from `cache[name]` when it holds the same shape and hint, else from `fill`, kept.
fn fill_cached<T: Copy>(
    cache: &mut HashMap<String, (Vec<usize>, Init, Vec<T>)>,
    name: &str,
    shape: &[usize],
    init: Init,
    out: &mut [T],
    fill: impl FnOnce(&mut [T]) -> Result<()>,
) -> Result<()> {
    if let Some((s, i, v)) = cache.get(name) {
        if s == shape && *i == init && v.len() == out.len() {
            out.copy_from_slice(v);
            return Ok(());
        }
    }
    fill(out)?;
    cache.insert(name.to_owned(), (shape.to_vec(), init, out.to_vec()));
    Ok(())
}

impl<S: WeightSource> WeightSource for CachedSource<S> {
    fn fill_bf16(&mut self, name: &str, shape: &[usize], init: Init, out: &mut [bf16]) -> Result<()> {
        let inner = &mut self.inner;
        fill_cached(&mut self.bf16s, name, shape, init, out, |o| inner.fill_bf16(name, shape, init, o))
    }

    fn fill_f32(&mut self, name: &str, shape: &[usize], init: Init, out: &mut [f32]) -> Result<()> {
        let inner = &mut self.inner;
        fill_cached(&mut self.f32s, name, shape, init, out, |o| inner.fill_f32(name, shape, init, o))
    }
}

/// The weights of one compressor (ratio 4 or 128): `wkv_gate [2·dim, H]` (KV then score
/// projection), `ape [ratio, dim]` f32 positional score bias, `norm [dim]`.
#[derive(Debug)]
pub struct CompressorTensors {
    /// `[2·dim, H]` bf16.
    pub wkv_gate: Buffer<bf16>,
    /// `[ratio, dim]` f32.
    pub ape: Buffer<f32>,
    /// `[dim]` bf16.
    pub norm: Buffer<bf16>,
}

/// The c4a indexer's weights.
#[derive(Debug)]
pub struct IndexerTensors {
    /// `wq [index_heads · index_head_dim, q_lora_rank]` bf16 (from the query latent).
    pub wq: Buffer<bf16>,
    /// `weights [index_heads, H]` bf16: per-head weights (the `index_heads^-1/2` scale folded in).
    pub head_weights: Buffer<bf16>,
    /// Its own ratio-4 compressor of `index_head_dim` entries.
    pub compressor: CompressorTensors,
}

/// One `mhc_pre` parameter set (f32): `fn [n(n+2), n·H]`, `scale [3]`, `base [n(n+2)]`.
#[derive(Debug)]
pub struct HcTensors {
    /// `[n(n+2), n·H]`.
    pub hc_fn: Buffer<f32>,
    /// `[3]`.
    pub scale: Buffer<f32>,
    /// `[n(n+2)]`.
    pub base: Buffer<f32>,
}

/// One decoder layer's weights.
#[derive(Debug)]
pub struct LayerWeights {
    /// Attention input RMSNorm `[H]`.
    pub attn_norm: Buffer<bf16>,
    /// `wq_a [q_lora_rank, H]`.
    pub wq_a: Buffer<bf16>,
    /// `q_norm [q_lora_rank]`.
    pub q_norm: Buffer<bf16>,
    /// `wq_b [heads · head_dim, q_lora_rank]` (a rank's heads only under tensor parallelism, as
    /// are `attn_sink`, `wo_a`'s groups, `wo_b`'s columns and the FFN's columns; see [`Shard`]).
    pub wq_b: Buffer<bf16>,
    /// `wkv [head_dim, H]` (the latent KV, shared by every head).
    pub wkv: Buffer<bf16>,
    /// `kv_norm [head_dim]`.
    pub kv_norm: Buffer<bf16>,
    /// Per-head attention sink logits `[heads]` f32.
    pub attn_sink: Buffer<f32>,
    /// Grouped output projection `wo_a [o_groups, o_lora_rank, heads · head_dim / o_groups]`.
    pub wo_a: Buffer<bf16>,
    /// `wo_b [H, o_groups · o_lora_rank]`.
    pub wo_b: Buffer<bf16>,
    /// The compressed layers' KV compressor (ratio 4 or 128, `head_dim` entries).
    pub compressor: Option<CompressorTensors>,
    /// The c4a layers' indexer.
    pub indexer: Option<IndexerTensors>,
    /// Hyper-connection parameters before attention.
    pub hc_attn: HcTensors,
    /// Hyper-connection parameters before the FFN.
    pub hc_ffn: HcTensors,
    /// FFN input RMSNorm `[H]`.
    pub ffn_norm: Buffer<bf16>,
    /// `w13 [2·F, H]`: gate rows then up rows.
    pub w13: Buffer<bf16>,
    /// `w2 [H, F]`.
    pub w2: Buffer<bf16>,
}

/// Every weight of the model, on one device.
#[derive(Debug)]
pub struct Weights {
    /// `embed [vocab, H]`.
    pub embed: Buffer<bf16>,
    /// Per layer.
    pub layers: Vec<LayerWeights>,
    /// `hc_head_fn [n, n·H]` f32.
    pub hc_head_fn: Buffer<f32>,
    /// `hc_head_scale [1]` f32.
    pub hc_head_scale: Buffer<f32>,
    /// `hc_head_base [n]` f32.
    pub hc_head_base: Buffer<f32>,
    /// Final RMSNorm `[H]`.
    pub norm: Buffer<bf16>,
    /// LM head `[vocab, H]`.
    pub head: Buffer<bf16>,
    /// Bytes on the device.
    pub bytes: usize,
    /// The part of the model these are.
    pub shard: Shard,
}

/// The part of the weights one tensor-parallel rank holds: rank `rank` of `size` (`size = 1`:
/// everything). Query heads, output groups and FFN columns are split in contiguous blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shard {
    /// This rank, `0..size`.
    pub rank: usize,
    /// Ranks in the group.
    pub size: usize,
}

impl Shard {
    /// The whole model on one device.
    pub const WHOLE: Shard = Shard { rank: 0, size: 1 };
}

/// How a tensor is split across ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Split {
    /// Every rank holds all of it.
    Whole,
    /// Rank r holds the r-th contiguous block of the first dimension (column-parallel outputs,
    /// heads, groups).
    Rows,
    /// Rank r holds the r-th block of the last dimension in every row (row-parallel inputs).
    Cols,
    /// `[2·F, H]` gate rows then up rows: rank r holds its block of each half, gate then up.
    GateUp,
}

/// `shard`'s part of a row-major tensor `full` of `shape` under `split` (the full tensor when
/// the split is `Whole` or the group has one rank).
fn take_shard<T: Copy>(full: Vec<T>, shape: &[usize], split: Split, shard: Shard) -> Vec<T> {
    let (r, n) = (shard.rank, shard.size);
    if n == 1 || split == Split::Whole {
        return full;
    }
    let rows = shape.first().copied().unwrap_or(1);
    let row_len = full.len() / rows.max(1);
    match split {
        Split::Whole => full,
        Split::Rows => full[r * (rows / n) * row_len..(r + 1) * (rows / n) * row_len].to_vec(),
        Split::Cols => {
            let cols = shape.last().copied().unwrap_or(1);
            let c = cols / n;
            full.chunks(cols).flat_map(|row| row[r * c..(r + 1) * c].iter().copied()).collect()
        }
        Split::GateUp => {
            let half = rows / 2 * row_len;
            let block = half / n;
            let (gate, up) = full.split_at(half);
            gate[r * block..(r + 1) * block].iter().chain(&up[r * block..(r + 1) * block]).copied().collect()
        }
    }
}

struct Loader<'a> {
    dev: &'a Device,
    src: &'a mut dyn WeightSource,
    shard: Shard,
    bytes: usize,
}

/// A zeroed host tensor of `shape` for weight `name`: an error (not an abort) where its element
/// count overflows or the host cannot hold it.
fn host_tensor<T: Clone>(name: &str, shape: &[usize], zero: T) -> Result<Vec<T>> {
    let n = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| ModelError::Weights(format!("weight {name} {shape:?}: the element count overflows")))?;
    let mut host = Vec::new();
    host.try_reserve_exact(n).map_err(|e| {
        ModelError::Weights(format!(
            "weight {name} {shape:?}: {n} elements of {} bytes do not fit host memory ({e})",
            std::mem::size_of::<T>()
        ))
    })?;
    host.resize(n, zero);
    Ok(host)
}

impl Loader<'_> {
    fn bf16(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Buffer<bf16>> {
        self.bf16_split(name, shape, init, Split::Whole)
    }

    fn f32(&mut self, name: &str, shape: &[usize], init: Init) -> Result<Buffer<f32>> {
        self.f32_split(name, shape, init, Split::Whole)
    }

    /// Fills the whole tensor (a source sees the same names, shapes and values on every rank),
    /// then keeps this rank's part.
    fn bf16_split(&mut self, name: &str, shape: &[usize], init: Init, split: Split) -> Result<Buffer<bf16>> {
        let mut host = host_tensor(name, shape, bf16::ZERO)?;
        self.src.fill_bf16(name, shape, init, &mut host)?;
        if let Some(i) = host.iter().position(|v| !v.is_finite()) {
            return Err(ModelError::Weights(format!("weight {name}: element {i} is not finite")));
        }
        let host = take_shard(host, shape, split, self.shard);
        self.bytes += host.len() * 2;
        Ok(self.dev.alloc_from_slice(name, &host, true)?)
    }

    fn f32_split(&mut self, name: &str, shape: &[usize], init: Init, split: Split) -> Result<Buffer<f32>> {
        let mut host = host_tensor(name, shape, 0.0f32)?;
        self.src.fill_f32(name, shape, init, &mut host)?;
        if let Some(i) = host.iter().position(|v| !v.is_finite()) {
            return Err(ModelError::Weights(format!("weight {name}: element {i} is not finite")));
        }
        let host = take_shard(host, shape, split, self.shard);
        self.bytes += host.len() * 4;
        Ok(self.dev.alloc_from_slice(name, &host, true)?)
    }

    fn compressor(&mut self, p: &str, ratio: usize, dim: usize, h: usize) -> Result<CompressorTensors> {
        Ok(CompressorTensors {
            wkv_gate: self.bf16(&format!("{p}.wkv_gate"), &[2 * dim, h], Init::Normal(fan_in(h)))?,
            ape: self.f32(&format!("{p}.ape"), &[ratio, dim], Init::Normal(0.5))?,
            norm: self.bf16(&format!("{p}.norm"), &[dim], Init::NearOne(0.05))?,
        })
    }

    fn hc(&mut self, p: &str, n: usize, h: usize) -> Result<HcTensors> {
        let m3 = n * (n + 2);
        Ok(HcTensors {
            hc_fn: self.f32(&format!("{p}.fn"), &[m3, n * h], Init::Normal(fan_in(n * h)))?,
            scale: self.f32(&format!("{p}.scale"), &[3], Init::Const(0.5))?,
            base: self.f32(&format!("{p}.base"), &[m3], Init::HcBase(n))?,
        })
    }
}

fn fan_in(k: usize) -> f32 {
    1.0 / (k as f32).sqrt()
}

impl Weights {
    /// Allocates and fills every tensor of `cfg` on `dev` (persistent buffers: graphs read them).
    pub fn load(dev: &Device, cfg: &ModelConfig, src: &mut dyn WeightSource) -> Result<Self> {
        Self::load_shard(dev, cfg, src, Shard::WHOLE)
    }

    /// As [`Weights::load`], keeping `shard`'s part of the split tensors: `wq_b` and the
    /// attention sinks by query head, `wo_a` by output group, `wo_b` by its input columns (the
    /// groups), `w13` by FFN column (gate and up alike), `w2` by its input columns; everything
    /// else whole. The values are the whole model's, so the ranks together hold exactly it.
    pub fn load_shard(dev: &Device, cfg: &ModelConfig, src: &mut dyn WeightSource, shard: Shard) -> Result<Self> {
        cfg.validate()?;
        cfg.validate_tp(shard.size)?;
        if shard.rank >= shard.size {
            return Err(ModelError::Setting {
                setting: "tensor_parallel_rank",
                detail: format!("rank {} of a group of {}", shard.rank, shard.size),
            });
        }
        let (h, v, d, heads) = (cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_attention_heads);
        let (n, q, f, g, r) = (cfg.hc_mult, cfg.q_lora_rank, cfg.moe_intermediate_size, cfg.o_groups, cfg.o_lora_rank);
        let mut ld = Loader { dev, src, shard, bytes: 0 };
        let embed = ld.bf16("embed.weight", &[v, h], Init::Normal(1.0))?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("layers.{l}");
            let kind = cfg.layer_kind(l);
            let compressor = match kind {
                LayerKind::SwaOnly => None,
                _ => Some(ld.compressor(&format!("{p}.attn.compressor"), cfg.ratio(l), d, h)?),
            };
            let indexer = if kind == LayerKind::C4a {
                let (ih, id) = (cfg.index_n_heads, cfg.index_head_dim);
                Some(IndexerTensors {
                    wq: ld.bf16(&format!("{p}.attn.indexer.wq"), &[ih * id, q], Init::Normal(fan_in(q)))?,
                    head_weights: ld.bf16(
                        &format!("{p}.attn.indexer.weights"),
                        &[ih, h],
                        Init::Normal(fan_in(h) / (ih as f32).sqrt()),
                    )?,
                    compressor: ld.compressor(&format!("{p}.attn.indexer.compressor"), 4, id, h)?,
                })
            } else {
                None
            };
            let wo_in = heads * d / g;
            layers.push(LayerWeights {
                attn_norm: ld.bf16(&format!("{p}.attn_norm"), &[h], Init::NearOne(0.05))?,
                wq_a: ld.bf16(&format!("{p}.attn.wq_a"), &[q, h], Init::Normal(fan_in(h)))?,
                q_norm: ld.bf16(&format!("{p}.attn.q_norm"), &[q], Init::NearOne(0.05))?,
                wq_b: ld.bf16_split(
                    &format!("{p}.attn.wq_b"),
                    &[heads * d, q],
                    Init::Normal(fan_in(q)),
                    Split::Rows,
                )?,
                wkv: ld.bf16(&format!("{p}.attn.wkv"), &[d, h], Init::Normal(fan_in(h)))?,
                kv_norm: ld.bf16(&format!("{p}.attn.kv_norm"), &[d], Init::NearOne(0.05))?,
                attn_sink: ld.f32_split(&format!("{p}.attn.sink"), &[heads], Init::Normal(1.0), Split::Rows)?,
                wo_a: ld.bf16_split(
                    &format!("{p}.attn.wo_a"),
                    &[g, r, wo_in],
                    Init::Normal(fan_in(wo_in)),
                    Split::Rows,
                )?,
                wo_b: ld.bf16_split(
                    &format!("{p}.attn.wo_b"),
                    &[h, g * r],
                    Init::Normal(0.5 * fan_in(g * r)),
                    Split::Cols,
                )?,
                compressor,
                indexer,
                hc_attn: ld.hc(&format!("{p}.hc_attn"), n, h)?,
                hc_ffn: ld.hc(&format!("{p}.hc_ffn"), n, h)?,
                ffn_norm: ld.bf16(&format!("{p}.ffn_norm"), &[h], Init::NearOne(0.05))?,
                w13: ld.bf16_split(&format!("{p}.ffn.w13"), &[2 * f, h], Init::Normal(fan_in(h)), Split::GateUp)?,
                w2: ld.bf16_split(&format!("{p}.ffn.w2"), &[h, f], Init::Normal(0.5 * fan_in(f)), Split::Cols)?,
            });
        }
        let hc_head_fn = ld.f32("hc_head.fn", &[n, n * h], Init::Normal(fan_in(n * h)))?;
        let hc_head_scale = ld.f32("hc_head.scale", &[1], Init::Const(0.5))?;
        let hc_head_base = ld.f32("hc_head.base", &[n], Init::Normal(0.1))?;
        let norm = ld.bf16("norm.weight", &[h], Init::NearOne(0.05))?;
        let head = ld.bf16("head.weight", &[v, h], Init::Normal(fan_in(h) * 4.0))?;
        let bytes = ld.bytes;
        Ok(Weights { embed, layers, hc_head_fn, hc_head_scale, hc_head_base, norm, head, bytes, shard })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tensor_past_the_host_is_an_error_not_an_abort() {
        let e = host_tensor("w", &[usize::MAX, 2], 0.0f32).expect_err("overflow");
        assert!(matches!(&e, ModelError::Weights(m) if m.contains("weight w") && m.contains("overflows")), "{e}");
        let e = host_tensor("w", &[1 << 40, 1 << 22], 0u16).expect_err("too large");
        assert!(matches!(&e, ModelError::Weights(m) if m.contains("do not fit host memory")), "{e}");
        assert_eq!(host_tensor("w", &[2, 3], 1u8).expect("small"), vec![1u8; 6]);
    }

    /// A source that counts its fills and writes `calls` into every element.
    struct Counting {
        calls: usize,
    }

    impl WeightSource for Counting {
        fn fill_bf16(&mut self, _: &str, _: &[usize], _: Init, out: &mut [bf16]) -> Result<()> {
            self.calls += 1;
            out.fill(bf16::from_f32(self.calls as f32));
            Ok(())
        }
        fn fill_f32(&mut self, _: &str, _: &[usize], _: Init, out: &mut [f32]) -> Result<()> {
            self.calls += 1;
            out.fill(self.calls as f32);
            Ok(())
        }
    }

    #[test]
    fn a_cached_source_fills_each_tensor_once_and_replays_it() -> Result<()> {
        let mut c = CachedSource::new(Counting { calls: 0 });
        let (mut a, mut b) = (vec![bf16::ZERO; 6], vec![bf16::ZERO; 6]);
        c.fill_bf16("w", &[2, 3], Init::Normal(0.1), &mut a)?;
        c.fill_bf16("w", &[2, 3], Init::Normal(0.1), &mut b)?;
        assert_eq!((c.inner.calls, &a), (1, &b), "the second load is the first's values, not a new fill");
        let mut f = vec![0.0f32; 4];
        c.fill_f32("v", &[4], Init::Const(1.0), &mut f)?;
        assert_eq!((c.inner.calls, f[0]), (2, 2.0));
        assert_eq!(c.cached_bytes(), 6 * 2 + 4 * 4);
        // Another shape or hint under the same name is filled again (and replaces the entry).
        c.fill_bf16("w", &[3, 2], Init::Normal(0.1), &mut b)?;
        assert_eq!((c.inner.calls, b[0].to_f32()), (3, 3.0));
        c.fill_bf16("w", &[3, 2], Init::NearOne(0.1), &mut b)?;
        assert_eq!((c.inner.calls, b[0].to_f32()), (4, 4.0));
        Ok(())
    }

    #[test]
    fn cached_seeded_weights_equal_freshly_seeded_ones() -> Result<()> {
        let mut cached = CachedSource::new(SeededInit { seed: 7 });
        for _ in 0..2 {
            let (mut got, mut want) = (vec![bf16::ZERO; 1000], vec![bf16::ZERO; 1000]);
            cached.fill_bf16("layers.0.attn.wq_a", &[10, 100], Init::Normal(0.02), &mut got)?;
            SeededInit { seed: 7 }.fill_bf16("layers.0.attn.wq_a", &[10, 100], Init::Normal(0.02), &mut want)?;
            assert_eq!(got, want);
        }
        Ok(())
    }
}
