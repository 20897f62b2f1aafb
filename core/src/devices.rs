//! The pool's shards on several devices of one host (PiKV's placement across GPUs).
//!
//! A [`ShardedPool`] holds one [`KvPool`] per device, each with the whole pool's configuration,
//! and places every shard on one device (shard `s` on device `s mod N`): a token goes to the
//! device of the shard its position and top expert map to ([`crate::config::ShardMap`]), so each device's page
//! lists hold that device's shards' tokens and nothing else. Decode attention runs the split and
//! reduce passes (flash-decoding over chunks of pages) on every device at once, each over its
//! own pages: every device ends with its own output and softmax (max, sum) per query head. Those
//! cross to the host, `head_dim + 2` floats a head a device, and merge there as the reduce pass
//! merges a device's chunks ([`merge_reduced`], one record per device). The routing and
//! placement decisions are the single-device run's, and the output is its output within f32
//! rounding (the chunks merge in another order).
//!
//! wgpu has no transfer between devices, so the merge goes through host-visible staging: one
//! readback per device per step. Reducing on each device first keeps that readback and the host
//! merge to a record per head and device, whatever the context (the split pass's partials are a
//! record per chunk of pages). With the attention-mass pass (H2O's utilities), the merged
//! (max, sum) of every query head is written back to every device, whose mass pass then adds
//! each of its tokens' share of the whole softmax to the token's slot metadata, as one device
//! holding every token would.

use crate::append::KvPool;
use crate::append::format::NewToken;
use crate::attend::{AttendOptions, Attention};
use crate::config::PoolConfig;
use crate::error::{Error, Result};
use crate::runtime::Runtime;

/// One device's part of a [`ShardedPool`].
pub struct DevicePart {
    /// The pool on this device (every shard's rings exist; only this device's shards fill, and
    /// its pages are what their rings hold at most).
    pub pool: KvPool,
    /// Decode attention over this device's pages (split and reduce; the mass pass after the
    /// merge).
    pub attn: Attention,
    /// Tokens appended here so far.
    pub tokens: u64,
    /// Appended to since its page lists were last gathered.
    stale: bool,
}

/// What one [`ShardedPool::attend`] measured.
#[derive(Clone, Debug)]
pub struct ShardedAttend {
    /// The attention output, `[seq][q_head][head_dim]`.
    pub out: Vec<f32>,
    /// Seconds from the first submission until every device's output and statistics were read
    /// back.
    pub attend_and_read_s: f64,
    /// Seconds of the host merge.
    pub merge_s: f64,
    /// Seconds of the mass passes (the merged statistics written to every device, the passes
    /// run and waited for); 0 without the mass pass.
    pub mass_s: f64,
    /// Bytes read back from all devices.
    pub bytes_read: u64,
}

/// A pool whose shards are spread over several devices (see the module docs).
pub struct ShardedPool {
    /// The pool's configuration (every device's).
    pub cfg: PoolConfig,
    /// Per shard, the device holding it.
    pub placement: Vec<u32>,
    /// Per device, its pool and attention, in the order of the runtimes given to
    /// [`ShardedPool::new`].
    pub parts: Vec<DevicePart>,
}

impl ShardedPool {
    /// A pool of `cfg` spread over the devices of `rts` (one part each, shard `s` on device `s mod
    /// N`), with attention built as `opts` says on each. Refused: fewer shards than devices (a
    /// device would hold nothing), or fewer than two devices.
    pub async fn new(rts: &[&Runtime], cfg: PoolConfig, opts: AttendOptions) -> Result<ShardedPool> {
        let n = rts.len() as u32;
        if n < 2 {
            return Err(Error::Input(format!("sharded pool: {n} device(s); one device is the plain pool")));
        }
        if cfg.n_shards < n {
            return Err(Error::Input(format!("sharded pool: {} shards over {n} devices would leave a device empty", cfg.n_shards)));
        }
        let placement: Vec<u32> = (0..cfg.n_shards).map(|s| s % n).collect();
        let mut parts = Vec::new();
        for (d, rt) in rts.iter().enumerate() {
            // Pages for this device's shards' rings only: at most what those rings hold.
            let mine = placement.iter().filter(|&&p| p == d as u32).count() as u32;
            let keys = cfg.layers.saturating_mul(cfg.max_seqs).saturating_mul(cfg.kv_heads).saturating_mul(mine);
            let part_cfg = PoolConfig { n_pages: cfg.n_pages.min(keys.saturating_mul(cfg.ring_capacity)), ..cfg.clone() };
            let pool = KvPool::new(rt, part_cfg).await?;
            let attn = Attention::new(rt, &pool, opts.clone()).await?;
            parts.push(DevicePart { pool, attn, tokens: 0, stale: false });
        }
        Ok(ShardedPool { placement, cfg, parts })
    }

    /// The device holding `token`'s shard.
    pub fn device_of(&self, token: &NewToken) -> u32 {
        let expert = token.experts.first().copied().unwrap_or(0);
        let shard = self.cfg.shard_map.shard_from_token_expert(self.cfg.n_shards, token.position, expert);
        self.placement[shard as usize]
    }

    /// Append `tokens` (K/V words `kv`, as [`KvPool::append`] takes them) at `step`: each token
    /// to its shard's device (the page lists are gathered for attention by the next
    /// [`ShardedPool::attend`]). A device's refusal (a full ring, say) is returned after the
    /// devices before it have appended their share.
    pub fn append(&mut self, rts: &[&Runtime], tokens: &[NewToken], kv: &[u32], step: u32) -> Result<()> {
        self.check_rts(rts)?;
        let per = if tokens.is_empty() { 0 } else { kv.len() / tokens.len() };
        if per * tokens.len() != kv.len() {
            return Err(Error::Input(format!("sharded append: {} K/V words for {} tokens", kv.len(), tokens.len())));
        }
        let devices: Vec<u32> = tokens.iter().map(|t| self.device_of(t)).collect();
        for (d, (part, rt)) in self.parts.iter_mut().zip(rts).enumerate() {
            let mine: Vec<usize> = (0..tokens.len()).filter(|&i| devices[i] == d as u32).collect();
            if !mine.is_empty() {
                let t: Vec<NewToken> = mine.iter().map(|&i| tokens[i].clone()).collect();
                let words: Vec<u32> = mine.iter().flat_map(|&i| kv[i * per..(i + 1) * per].iter().copied()).collect();
                part.pool.append(rt, &t, &words, step)?;
                part.tokens += t.len() as u64;
                part.stale = true;
            }
        }
        Ok(())
    }

    /// Decode attention of layer `layer` for `queries` (`[seq][q_head][head_dim]`, f32) over
    /// every device's pages: the page lists appended to since the last call gathered first
    /// (outside the timing), then the split and reduce passes submitted on all devices, their
    /// outputs and statistics read back and merged on the host.
    pub async fn attend(&mut self, rts: &[&Runtime], layer: u32, step: u32, queries: &[f32]) -> Result<ShardedAttend> {
        self.check_rts(rts)?;
        for (part, rt) in self.parts.iter_mut().zip(rts).filter(|(p, _)| p.stale) {
            part.pool.gather(rt)?;
            rt.wait()?;
            part.stale = false;
        }
        let t0 = std::time::Instant::now();
        for (part, rt) in self.parts.iter().zip(rts) {
            part.attn.set_queries(rt, queries)?;
            part.attn.prepare(rt, layer, step);
            let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("attend (sharded)") });
            {
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("attend"), timestamp_writes: None });
                part.attn.encode_split(&mut pass);
                part.attn.encode_reduce(&mut pass);
            }
            rt.queue.submit([enc.finish()]);
        }
        let a = &self.parts[0].attn;
        let (heads, d) = ((a.opts.n_seqs * a.q_heads()) as usize, self.cfg.head_dim as usize);
        let mut records = Vec::new();
        let mut bytes_read = 0;
        for (part, rt) in self.parts.iter().zip(rts) {
            let (out, stats) = (&part.attn.out, &part.attn.stats);
            let read = rt.read_many::<f32>(&[(out, 0, (heads * d) as u64), (stats, 0, 2 * heads as u64)]).await?;
            bytes_read += ((heads * d + 2 * heads) * 4) as u64;
            rt.check("attend (sharded)")?;
            records.push(read);
        }
        let attend_and_read_s = t0.elapsed().as_secs_f64();
        let t1 = std::time::Instant::now();
        let parts: Vec<(&[f32], &[f32])> = records.iter().map(|r| (r[0].as_slice(), r[1].as_slice())).collect();
        let merged = merge_reduced(&parts, a.opts.n_seqs, a.q_heads(), self.cfg.head_dim)?;
        let merge_s = t1.elapsed().as_secs_f64();
        let t2 = std::time::Instant::now();
        if a.opts.mass {
            let stats: Vec<f32> = merged.stats.iter().flatten().copied().collect();
            for (part, rt) in self.parts.iter().zip(rts) {
                rt.queue.write_buffer(&part.attn.stats, 0, bytemuck::cast_slice(&stats));
                let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("attend mass (sharded)") });
                {
                    let mut pass =
                        enc.begin_compute_pass(&wgpu::ComputePassDescriptor { label: Some("attend mass"), timestamp_writes: None });
                    part.attn.encode_mass(&mut pass);
                }
                rt.queue.submit([enc.finish()]);
            }
            for rt in rts {
                rt.wait()?;
                rt.check("attend mass (sharded)")?;
            }
        }
        let mass_s = if a.opts.mass { t2.elapsed().as_secs_f64() } else { 0.0 };
        Ok(ShardedAttend { out: merged.out, attend_and_read_s, merge_s, mass_s, bytes_read })
    }

    fn check_rts(&self, rts: &[&Runtime]) -> Result<()> {
        if rts.len() != self.parts.len() {
            return Err(Error::Input(format!("sharded pool: {} runtimes for {} devices", rts.len(), self.parts.len())));
        }
        for (part, rt) in self.parts.iter().zip(rts) {
            rt.check_owner(part.pool.owner(), "this device's pool")?;
        }
        Ok(())
    }
}

/// What [`merge_reduced`] gives.
#[derive(Clone, Debug, PartialEq)]
pub struct Merged {
    /// The attention output, `[seq][q_head][head_dim]`.
    pub out: Vec<f32>,
    /// Per (seq, q_head), the softmax's (max, sum of exponentials) over every device's tokens,
    /// as the reduce pass leaves in [`Attention::stats`]; (0, 0) for a head with no token on any
    /// device.
    pub stats: Vec<[f32; 2]>,
}

/// Merge several devices' reduced attention into the output over all their tokens: each device
/// gives its output `[seq][q_head][head_dim]` (normalised over its own tokens) and its softmax
/// (max, sum of exponentials) per (seq, q_head), as the reduce pass writes them. Per head, the
/// devices with a positive sum are rescaled to the largest max and weighted by their sums, as
/// the reduce pass merges one device's chunks. In f64, rounded to f32 at the end.
pub fn merge_reduced(devices: &[(&[f32], &[f32])], n_seqs: u32, q_heads: u32, head_dim: u32) -> Result<Merged> {
    let (heads, d) = ((n_seqs * q_heads) as usize, head_dim as usize);
    if let Some((out, stats)) = devices.iter().find(|(o, s)| o.len() != heads * d || s.len() != 2 * heads) {
        return Err(Error::Input(format!(
            "merge: {} output and {} statistics floats for {heads} heads of {d} (want {} and {})",
            out.len(),
            stats.len(),
            heads * d,
            2 * heads
        )));
    }
    let mut out = vec![0f32; heads * d];
    let mut stats = vec![[0f32; 2]; heads];
    let mut acc = vec![0f64; d];
    for h in 0..heads {
        let big_m = devices.iter().filter(|(_, s)| s[2 * h + 1] > 0.0).map(|(_, s)| f64::from(s[2 * h])).fold(f64::NEG_INFINITY, f64::max);
        if big_m == f64::NEG_INFINITY {
            continue;
        }
        acc.fill(0.0);
        let mut sum = 0.0;
        for (o, s) in devices.iter().filter(|(_, s)| s[2 * h + 1] > 0.0) {
            // The device's sum at the common max weighs its normalised output.
            let w = f64::from(s[2 * h + 1]) * (f64::from(s[2 * h]) - big_m).exp();
            sum += w;
            for (a, &x) in acc.iter_mut().zip(&o[h * d..(h + 1) * d]) {
                *a += f64::from(x) * w;
            }
        }
        for (o, a) in out[h * d..(h + 1) * d].iter_mut().zip(&acc) {
            *o = (a / sum) as f32;
        }
        stats[h] = [big_m as f32, sum as f32];
    }
    Ok(Merged { out, stats })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Softmax attention of one head over `scores` and `values` (`[token][d]`): (output, max,
    /// sum of exponentials), in f64.
    fn attend(scores: &[f64], values: &[Vec<f64>]) -> (Vec<f64>, f64, f64) {
        let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let l: f64 = w.iter().sum();
        let d = values[0].len();
        let out = (0..d).map(|i| w.iter().zip(values).map(|(w, v)| w * v[i]).sum::<f64>() / l).collect();
        (out, m, l)
    }

    /// Random tokens of two heads split over three devices (one holding nothing of the second
    /// head): the merge of each device's reduced attention equals attention over all the tokens.
    #[test]
    fn merging_devices_equals_attending_over_all_their_tokens() {
        let mut rng = crate::rng::Rng::new(7);
        let (heads, d) = (2usize, 4usize);
        // Per device, per head: its tokens.
        let tokens = [[5usize, 3], [2, 0], [4, 6]];
        // Per device, per head: (scores, values).
        type Head = (Vec<f64>, Vec<Vec<f64>>);
        let data: Vec<Vec<Head>> = tokens
            .iter()
            .map(|per_head| {
                per_head
                    .iter()
                    .map(|&n| {
                        ((0..n).map(|_| rng.normal() * 3.0).collect(), (0..n).map(|_| (0..d).map(|_| rng.normal()).collect()).collect())
                    })
                    .collect()
            })
            .collect();
        let mut reduced = Vec::new();
        for dev in &data {
            let (mut out, mut stats) = (vec![0f32; heads * d], vec![0f32; 2 * heads]);
            for (h, (sc, vals)) in dev.iter().enumerate() {
                if sc.is_empty() {
                    // As the reduce pass leaves a head with no token: the max at its floor, a
                    // sum of 0, a zero output.
                    stats[2 * h] = -3e38;
                    continue;
                }
                let (o, m, l) = attend(sc, vals);
                out[h * d..(h + 1) * d].iter_mut().zip(&o).for_each(|(x, y)| *x = *y as f32);
                stats[2 * h] = m as f32;
                stats[2 * h + 1] = l as f32;
            }
            reduced.push((out, stats));
        }
        let views: Vec<(&[f32], &[f32])> = reduced.iter().map(|(o, s)| (o.as_slice(), s.as_slice())).collect();
        let merged = merge_reduced(&views, 1, heads as u32, d as u32).unwrap();
        for h in 0..heads {
            let sc: Vec<f64> = data.iter().flat_map(|dev| dev[h].0.clone()).collect();
            let vals: Vec<Vec<f64>> = data.iter().flat_map(|dev| dev[h].1.clone()).collect();
            let (want, m, l) = attend(&sc, &vals);
            for (g, w) in merged.out[h * d..(h + 1) * d].iter().zip(&want) {
                assert!((f64::from(*g) - w).abs() < 1e-5, "head {h}: {g} against {w}");
            }
            assert!((f64::from(merged.stats[h][0]) - m).abs() < 1e-5 && (f64::from(merged.stats[h][1]) - l).abs() < 1e-4 * l);
        }
        assert!(merge_reduced(&[(&reduced[0].0[..3], &reduced[0].1)], 1, heads as u32, d as u32).is_err());
    }
}
