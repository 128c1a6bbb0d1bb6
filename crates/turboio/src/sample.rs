//! Realistic sample checkpoints, for the CLI's `gen`, benchmarks and tests.
//!
//! The layout imitates a decoder-only transformer: BF16 embeddings and projection weights, F32
//! norms, an F16 output head, I64 position ids and a BOOL mask, with enough layers to reach the
//! requested size. Values are pseudo-random but deterministic for a seed, and generated on the
//! fly by the writers (nothing is held in memory), so a 4 GiB sample costs no 4 GiB buffer.

use crate::save::{save_with, TensorData};
use crate::{Result, SaveOptions};
use std::path::Path;
use turboio_format::{Dtype, TensorSpec};

/// A tensor of a sample: name, dtype, shape.
pub type SampleTensor = (String, Dtype, Vec<usize>);

fn bytes_of(dtype: Dtype, shape: &[usize]) -> u64 {
    shape.iter().product::<usize>() as u64 * dtype.bits() as u64 / 8
}

/// Bytes of one transformer layer of hidden size `h` (BF16 attention and MLP weights, two F32 norms).
fn per_layer(h: u64) -> u64 {
    2 * (4 * h * h + 3 * h * (h * 11 / 4)) + 2 * 4 * h
}

/// Sequence length of the position ids and mask for hidden size `h`.
fn positions(h: u64) -> u64 {
    (8 * h).min(2048)
}

/// Bytes of the tensors every sample has besides its layers (embeddings, head, norm, ids, mask).
fn fixed(h: u64) -> u64 {
    let p = positions(h);
    2 * (8 * h * h * 2) + 4 * h + 8 * p + p * (p / 8)
}

/// The smallest and largest hidden sizes of a sample (multiples of 64, as real models use).
const MIN_HIDDEN: u64 = 64;
const MAX_HIDDEN: u64 = 8192;

/// Layers of a sample of `target` bytes: they grow with the size (about 4 more per doubling,
/// 2 at the smallest sample, 48 at 1 GiB), so bigger samples always have more tensors.
fn layers_for(target: u64) -> u64 {
    let doublings = (target / (256 << 10)).max(1).ilog2() as u64;
    let fit = target.saturating_sub(fixed(MIN_HIDDEN)) / per_layer(MIN_HIDDEN);
    (4 * doublings).clamp(2, 96).min(fit)
}

/// The smallest sample [`sample_tensors`] can make: [`write_sample`] refuses smaller targets.
pub fn min_sample_size() -> u64 {
    fixed(MIN_HIDDEN) + 2 * per_layer(MIN_HIDDEN)
}

/// The tensors of a sample of about `target` bytes of tensor data (at least
/// [`min_sample_size`]; smaller targets get the smallest sample).
///
/// The tensor count never decreases as `target` grows: the number of layers grows with the
/// size and the hidden size is the largest multiple of 64 that fits them.
pub fn sample_tensors(target: u64) -> Vec<SampleTensor> {
    let target = target.max(min_sample_size());
    let layers = layers_for(target);
    let fits = |h: u64| fixed(h) + layers * per_layer(h) <= target;
    let mut h = MIN_HIDDEN;
    while h < MAX_HIDDEN && fits(h + 64) {
        h += 64;
    }
    let hu = h as usize;
    let inter = hu * 11 / 4;
    let vocab = 8 * hu;
    let p = positions(h) as usize;
    let mut out: Vec<SampleTensor> = vec![
        ("model.embed_tokens.weight".into(), Dtype::BF16, vec![vocab, hu]),
        ("model.norm.weight".into(), Dtype::F32, vec![hu]),
        ("model.position_ids".into(), Dtype::I64, vec![1, p]),
        ("model.causal_mask".into(), Dtype::BOOL, vec![p, p / 8]),
        ("lm_head.weight".into(), Dtype::F16, vec![vocab, hu]),
    ];
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        for w in ["q_proj", "k_proj", "v_proj", "o_proj"] {
            out.push((format!("{p}.self_attn.{w}.weight"), Dtype::BF16, vec![hu, hu]));
        }
        out.push((format!("{p}.mlp.gate_proj.weight"), Dtype::BF16, vec![inter, hu]));
        out.push((format!("{p}.mlp.up_proj.weight"), Dtype::BF16, vec![inter, hu]));
        out.push((format!("{p}.mlp.down_proj.weight"), Dtype::BF16, vec![hu, inter]));
        out.push((format!("{p}.input_layernorm.weight"), Dtype::F32, vec![hu]));
        out.push((format!("{p}.post_attention_layernorm.weight"), Dtype::F32, vec![hu]));
    }
    // The rest of the target, so that the file is as big as asked (always present, maybe
    // empty, so that the tensor count depends on the layers alone).
    let total: u64 = out.iter().map(|(_, d, s)| bytes_of(*d, s)).sum();
    let rest = (target.saturating_sub(total) / 4) as usize;
    out.push(("model.extra_state".into(), Dtype::F32, vec![rest]));
    out
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Deterministic data for sample tensors: word `w` of tensor `t` depends only on (seed, t, w),
/// so any chunk can be produced independently by any writer thread.
pub struct SampleData {
    seed: u64,
    dtypes: Vec<Dtype>,
}

impl SampleData {
    /// Data for tensors of these dtypes.
    pub fn new(seed: u64, dtypes: Vec<Dtype>) -> Self {
        SampleData { seed, dtypes }
    }

    /// Eight bytes of tensor `t` starting at byte `8 * w`.
    fn word(&self, t: usize, dtype: Dtype, w: u64) -> [u8; 8] {
        let r = splitmix(self.seed ^ ((t as u64) << 40) ^ w);
        match dtype {
            // Weights in roughly [-1, 1): sign, an exponent near the bias, random mantissa.
            Dtype::F32 => {
                let lane = |x: u64| -> u32 {
                    let x = x as u32;
                    (x & 0x8000_0000) | ((117 + (x >> 23) % 10) << 23) | (x & 0x007F_FFFF)
                };
                let a = lane(r).to_le_bytes();
                let b = lane(r >> 32).to_le_bytes();
                [a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]]
            }
            Dtype::BF16 | Dtype::F16 => {
                let (mbits, lo) = if dtype == Dtype::BF16 { (7, 117) } else { (10, 5) };
                let mut out = [0u8; 8];
                for k in 0..4 {
                    let x = (r >> (16 * k)) as u16;
                    let e = lo + (x >> (mbits + 1)) % 10;
                    let v = (x & 0x8000) | (e << mbits) | (x & ((1 << mbits) - 1));
                    out[2 * k..2 * k + 2].copy_from_slice(&v.to_le_bytes());
                }
                out
            }
            Dtype::I64 => ((r % 100_000) as i64).to_le_bytes(),
            Dtype::BOOL => {
                let mut out = [0u8; 8];
                for (k, b) in out.iter_mut().enumerate() {
                    *b = ((r >> (8 * k)) & 1) as u8;
                }
                out
            }
            _ => r.to_le_bytes(),
        }
    }
}

impl TensorData for SampleData {
    fn fill(&self, index: usize, offset: usize, dst: &mut [u8]) -> std::result::Result<(), String> {
        let dtype = *self.dtypes.get(index).ok_or_else(|| format!("no sample tensor #{index}"))?;
        let mut pos = offset as u64;
        let mut out = dst;
        while !out.is_empty() {
            let word = self.word(index, dtype, pos / 8);
            let skip = (pos % 8) as usize;
            let n = (8 - skip).min(out.len());
            out[..n].copy_from_slice(&word[skip..skip + n]);
            pos += n as u64;
            out = &mut out[n..];
        }
        Ok(())
    }
}

/// Writes a sample checkpoint of about `target` bytes to `path` and returns its tensors.
///
/// A `target` below [`min_sample_size`] gets the smallest sample (the CLI's `gen` refuses such
/// sizes instead of writing a file of another size than asked).
pub fn write_sample(path: impl AsRef<Path>, target: u64, seed: u64, opts: &SaveOptions) -> Result<Vec<SampleTensor>> {
    let tensors = sample_tensors(target);
    let specs: Vec<TensorSpec<'_>> = tensors
        .iter()
        .map(|(n, d, s)| TensorSpec { name: n, dtype: *d, shape: s, data_len: bytes_of(*d, s) as usize })
        .collect();
    let data = SampleData::new(seed, tensors.iter().map(|t| t.1).collect());
    let mut meta = std::collections::BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    meta.insert("generator".to_string(), format!("turboio sample, seed {seed}"));
    save_with(path, &specs, Some(&meta), &data, opts)?;
    Ok(tensors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_track_the_target_and_mix_dtypes() {
        for target in [min_sample_size(), 1u64 << 20, 64 << 20, 1 << 30, 4 << 30] {
            let t = sample_tensors(target);
            let total: u64 = t.iter().map(|(_, d, s)| bytes_of(*d, s)).sum();
            assert!(total + 8 >= target, "{target}: {total}");
            assert!(total <= target, "{target}: {total}");
            for d in [Dtype::F32, Dtype::BF16, Dtype::F16, Dtype::I64, Dtype::BOOL] {
                assert!(t.iter().any(|x| x.1 == d), "{target}: no {d}");
            }
        }
        assert!(sample_tensors(4 << 30).len() > 100);
    }

    #[test]
    fn bigger_samples_have_more_tensors() {
        let mut last = 0;
        let mut target = min_sample_size();
        while target <= 64 << 30 {
            let n = sample_tensors(target).len();
            assert!(n >= last, "{target} bytes: {n} tensors, fewer than the {last} of a smaller sample");
            last = n;
            target = target * 9 / 8;
        }
        assert!(sample_tensors(2 << 30).len() > sample_tensors(1 << 30).len());
    }

    #[test]
    fn too_small_targets_get_the_smallest_sample() {
        let t = sample_tensors(1);
        assert_eq!(t, sample_tensors(min_sample_size()));
        let total: u64 = t.iter().map(|(_, d, s)| bytes_of(*d, s)).sum();
        assert_eq!(total, min_sample_size());
    }

    #[test]
    fn data_is_chunking_independent() {
        let d = SampleData::new(7, vec![Dtype::BF16, Dtype::BOOL]);
        let mut whole = vec![0u8; 1000];
        d.fill(0, 3, &mut whole).unwrap();
        let mut parts = vec![0u8; 1000];
        let (a, b) = parts.split_at_mut(333);
        d.fill(0, 3, a).unwrap();
        d.fill(0, 336, b).unwrap();
        assert_eq!(whole, parts);
        let mut mask = vec![0u8; 64];
        d.fill(1, 0, &mut mask).unwrap();
        assert!(mask.iter().all(|&b| b <= 1) && mask.contains(&1));
    }
}
