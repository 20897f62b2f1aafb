//! One schedule for a step's host-to-GPU transfers: FlexGen's host-tier K/V pages and the
//! expert cache's weights.
//!
//! A step is recorded as segments ([`Segment`]) that end where the host must act
//! ([`Pause`]): after a layer's append, FlexGen scores the layer's host pages against its
//! queries and brings the winners back before the layer's page lists are gathered; after a
//! layer's router, the expert cache copies the experts it chose that are not resident before
//! the layer's FFN; after a layer's experts, the next layer's predicted experts may be copied
//! ahead. [`GpuLlama::submit_step`] walks the segments once, for any mix of the two tiers, and
//! logs every transfer ([`Transfer`]) with the stage that needs it and the stage it was
//! submitted ahead of.
//!
//! The order follows the deadlines. Demand transfers go as late as their decision allows and
//! never later than their stage: a layer's pages before its attention, its missing experts
//! before its FFN. A prefetch is speculative: with a host tier it waits behind the next layer's
//! page fetch (whose query read is on the step's critical path) and still lands before that
//! layer's FFN; without one it goes right after the current layer's experts. wgpu gives one
//! queue, so the copies run in submission order between the step's kernels.
//!
//! Nothing the step still needs is replaced: a demand fetch evicts only experts its layer did not
//! choose ([`crate::experts::victim`]), and a page fetch swaps out only a resident page whose
//! bound is below the fetched one's, never a ring's newest page nor a page fetched earlier in the
//! same step (that page's bound beats every host page left). The GPU tests check both on the
//! log.

use super::GpuLlama;
use super::trace::ExpertFetch;
use crate::Result;
use crate::experts::ExpertPolicy;
use expertkv_core::evict::flexgen::PageFetch;
use expertkv_core::pipeline::{check_carried, check_eviction, compare_pool, pool_model_of};
use expertkv_core::reference::PoolModel;
use expertkv_core::runtime::Runtime;
use expertkv_core::step::{KvPause, Segment, StepStage};

/// A stage of a step that a transfer can be needed by, in step order (a layer's attention, then
/// its experts, then the next layer's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub struct Stage {
    /// The layer.
    pub layer: u32,
    /// Its attention or its experts.
    pub part: Part,
}

/// The part of a layer a [`Stage`] names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
pub enum Part {
    /// The layer's attention (reads its K/V pages).
    Attention,
    /// The layer's expert FFN (reads its expert slots).
    Experts,
}

impl From<StepStage> for Stage {
    fn from(s: StepStage) -> Stage {
        match s {
            StepStage::Attention(l) => Stage::attention(l),
            StepStage::Output(l) => Stage::experts(l),
        }
    }
}

impl Stage {
    /// Layer `layer`'s attention.
    pub fn attention(layer: u32) -> Stage {
        Stage { layer, part: Part::Attention }
    }

    /// Layer `layer`'s experts.
    pub fn experts(layer: u32) -> Stage {
        Stage { layer, part: Part::Experts }
    }
}

/// What one transfer copied to the GPU.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub enum Moved {
    /// A host-tier K/V page back in a GPU page (FlexGen).
    Page(PageFetch),
    /// An expert's weights into a slot (the expert cache), on demand or ahead.
    Expert(ExpertFetch),
}

/// One host-to-GPU transfer of a step, in the order the step submitted them.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Transfer {
    /// What was copied.
    pub moved: Moved,
    /// Bytes copied to the GPU.
    pub bytes: u64,
    /// The stage that reads it: its layer's attention (a page) or experts (an expert).
    pub needed_by: Stage,
    /// The first stage submitted after it (`None` if none followed in the step).
    pub issued_before: Option<Stage>,
}

/// Every step's transfers so far, summed ([`GpuLlama::transfer_totals`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct TransferTotals {
    /// Steps that moved anything host-to-GPU.
    pub steps_moving: u64,
    /// Steps that moved both a K/V page and an expert (one schedule for the two).
    pub steps_moving_both: u64,
    /// K/V pages back from the host tier.
    pub pages: u64,
    /// Their bytes.
    pub page_bytes: u64,
    /// Experts copied on demand (after their layer's router).
    pub experts: u64,
    /// Their bytes.
    pub expert_bytes: u64,
    /// Experts copied ahead of their layer's router.
    pub experts_ahead: u64,
    /// Their bytes.
    pub ahead_bytes: u64,
    /// Seconds the host waited at the host tier's pauses for its inputs (each layer's queries,
    /// page bounds and the pool's tables, read after the work submitted before them), before
    /// and after the step.
    pub tier_read_s: f64,
}

impl TransferTotals {
    /// Add one step's transfers.
    fn add_step(&mut self, step: &[Transfer]) {
        let (mut page, mut expert) = (false, false);
        for t in step {
            match &t.moved {
                Moved::Page(_) => {
                    page = true;
                    self.pages += 1;
                    self.page_bytes += t.bytes;
                }
                Moved::Expert(f) if f.ahead => {
                    expert = true;
                    self.experts_ahead += 1;
                    self.ahead_bytes += t.bytes;
                }
                Moved::Expert(_) => {
                    expert = true;
                    self.experts += 1;
                    self.expert_bytes += t.bytes;
                }
            }
        }
        self.steps_moving += u64::from(page || expert);
        self.steps_moving_both += u64::from(page && expert);
    }
}

/// Where a step's recording stops for the host, after a [`Segment`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Pause {
    /// The K/V side's: after layer `l`'s append (FlexGen fetches the layer's host pages before
    /// its page lists are gathered: the host reads the queries and page bounds), and around the
    /// eviction (FlexGen's offload; the eviction's check against the CPU reference with
    /// [`GpuLlama::verify_evictions`]).
    Kv(KvPause),
    /// Layer `l`'s router chose and its choices were copied for the host: the missing experts are
    /// copied before its FFN.
    Experts(u32),
    /// Layer `l`'s experts are recorded: the next layer's predicted experts may be copied from
    /// here on (no wait).
    Ahead(u32),
}

impl From<KvPause> for Pause {
    fn from(p: KvPause) -> Pause {
        Pause::Kv(p)
    }
}

/// The eviction check's reference (see [`GpuLlama::verify_evictions`]): the pool as the GPU
/// held it before the scheduler ran, and the lists then.
struct EvictionCheck {
    reference: PoolModel,
    before: Vec<expertkv_core::gpu_data::ListState>,
}

impl GpuLlama {
    /// Submit a step's segments, acting at their pauses: FlexGen's page fetches, the expert
    /// cache's demand fetches and prefetches, logged in [`GpuLlama::last_transfers`]. Returns
    /// every layer's choices as the host read them, with an expert cache.
    pub(super) async fn submit_step(&mut self, rt: &Runtime, segments: Vec<Segment<Pause>>) -> Result<Option<Vec<u32>>> {
        self.transfers.clear();
        if !self.verify_evictions {
            // A step not checked leaves the carried pool behind it.
            self.carried_pool = None;
        }
        if let Some((fg, _)) = &mut self.kv.flexgen {
            fg.begin_step();
        }
        let layers = self.cfg.block_count as usize;
        let step = u64::from(self.step);
        let mut check: Option<EvictionCheck> = None;
        let sizes: Vec<Vec<usize>> = match &self.moe {
            Some(m) if m.cache.is_some() => {
                (0..layers).map(|l| m.sync_ranges(l, self.n_seqs).iter().map(|r| r.2 as usize).collect()).collect()
            }
            _ => Vec::new(),
        };
        if let Some(cache) = self.moe.as_mut().and_then(|m| m.cache.as_mut()) {
            cache.begin_step();
        }
        let mut chosen_all: Option<Vec<u32>> = (!sizes.is_empty()).then(Vec::new);
        let mut pending: Vec<wgpu::CommandBuffer> = Vec::new();
        // Transfers from here on were submitted with no stage after them yet (always the log's
        // tail: transfers join it in submission order).
        let mut placed = 0;
        // The next layer's prediction read at a layer's pause, and a prefetch held back behind
        // the next layer's page fetch.
        let mut predicted: Option<(Vec<u32>, Vec<f32>)> = None;
        let mut held: Option<(wgpu::CommandBuffer, Vec<Transfer>)> = None;
        for seg in segments {
            if let Some(&first) = seg.stages.first() {
                for t in &mut self.transfers[placed..] {
                    t.issued_before = Some(first.into());
                }
                placed = self.transfers.len();
            }
            pending.push(seg.cb);
            match seg.then {
                None => {}
                Some(Pause::Kv(KvPause::Appended(l))) => {
                    rt.queue.submit(pending.drain(..));
                    let (fetched, read_s) = self.kv.fetch_host_pages(rt, l).await?;
                    self.transfer_totals.tier_read_s += read_s;
                    for f in fetched {
                        self.transfers.push(Transfer {
                            moved: Moved::Page(f),
                            bytes: f.bytes,
                            needed_by: Stage::attention(l),
                            issued_before: None,
                        });
                    }
                    // The prefetch held for this layer follows its pages.
                    if let Some((cb, ts)) = held.take() {
                        pending.push(cb);
                        self.transfers.extend(ts);
                    }
                }
                Some(Pause::Kv(KvPause::Attended(_))) => {}
                Some(Pause::Kv(KvPause::BeforeEvict)) => {
                    rt.queue.submit(pending.drain(..));
                    if self.kv.flexgen.is_some() {
                        // This step's attention mass counts: the coldest pages past the budget go
                        // to host memory.
                        self.transfer_totals.tier_read_s += self.kv.offload_host_pages(rt).await?;
                    }
                    if let (Some(sch), true) = (&self.kv.scheduler, self.verify_evictions) {
                        rt.wait()?;
                        let reference = pool_model_of(rt, &self.kv.pool).await?;
                        // The pool the last checked eviction left, against this one: only this
                        // step's appends and attention acted between them.
                        if let Some(prev) = self.carried_pool.take() {
                            check_carried(&prev, &reference, self.step)?;
                        }
                        check = Some(EvictionCheck { reference, before: sch.read_lists(rt).await? });
                    }
                }
                Some(Pause::Kv(KvPause::Evicted)) => {
                    rt.queue.submit(pending.drain(..));
                    if let (Some(sch), Some(mut c)) = (&self.kv.scheduler, check.take()) {
                        let after = sch.read_lists(rt).await?;
                        let lens: Vec<u32> = self.positions.iter().map(|p| p + 1).collect();
                        check_eviction(rt, sch, &mut c.reference, self.step, &lens, &c.before, &after).await?;
                        compare_pool(rt, &self.kv.pool, &c.reference).await?;
                        // Carried to the next checked step (raw pages: a codec moves pages as it
                        // compresses them).
                        if self.kv.pool.cfg.codec == expertkv_core::config::Codec::None {
                            self.carried_pool = Some(c.reference);
                        }
                    }
                }
                Some(Pause::Experts(l)) => {
                    rt.queue.submit(pending.drain(..));
                    let Some(moe) = self.moe.as_mut() else { continue };
                    let Some(cache) = moe.cache.as_mut() else { continue };
                    let lu = l as usize;
                    // The layer's segment copied its choices (and scores, and the prediction) here.
                    let words: Vec<u32> = rt.read_staging(&moe.sync[lu]).await?;
                    let mut at = 0;
                    let mut read = sizes[lu].iter().map(|&len| {
                        let part = words.get(at..at + len).unwrap_or_default().to_vec();
                        at += len;
                        part
                    });
                    let by_score = cache.cfg.policy == ExpertPolicy::Score;
                    let chosen = read.next().unwrap_or_default();
                    let scores: Vec<f32> = if by_score { bytemuck::cast_vec(read.next().unwrap_or_default()) } else { Vec::new() };
                    let from = cache.last_fetches.len();
                    let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("expert fetch") });
                    cache.ensure(rt, &mut enc, l, &chosen, &scores, step, &moe.layers[lu].1)?;
                    pending.push(enc.finish());
                    let bytes = cache.layer_expert_bytes(l);
                    for f in &cache.last_fetches[from..] {
                        self.transfers.push(Transfer {
                            moved: Moved::Expert(*f),
                            bytes,
                            needed_by: Stage::experts(l),
                            issued_before: None,
                        });
                    }
                    if moe.pregate.is_some() && lu + 1 < layers {
                        let p = read.next().unwrap_or_default();
                        let s: Vec<f32> = if by_score { bytemuck::cast_vec(read.next().unwrap_or_default()) } else { Vec::new() };
                        predicted = Some((p, s));
                    }
                    if let Some(all) = &mut chosen_all {
                        all.extend(chosen);
                    }
                }
                Some(Pause::Ahead(l)) => {
                    let (Some((p, s)), Some(moe)) = (predicted.take(), self.moe.as_mut()) else { continue };
                    let Some(cache) = moe.cache.as_mut() else { continue };
                    let next = l + 1;
                    let from = cache.last_fetches.len();
                    let mut enc = rt.device.create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("expert prefetch") });
                    cache.prefetch(rt, &mut enc, next, &p, &s, step, &moe.layers[next as usize].1)?;
                    let bytes = cache.layer_expert_bytes(next);
                    let ts: Vec<Transfer> = cache.last_fetches[from..]
                        .iter()
                        .map(|f| Transfer { moved: Moved::Expert(*f), bytes, needed_by: Stage::experts(next), issued_before: None })
                        .collect();
                    if self.kv.flexgen.is_some() {
                        held = Some((enc.finish(), ts));
                    } else {
                        pending.push(enc.finish());
                        self.transfers.extend(ts);
                    }
                }
            }
        }
        rt.queue.submit(pending);
        if let Some(cache) = self.moe.as_mut().and_then(|m| m.cache.as_mut()) {
            cache.end_step();
        }
        self.transfer_totals.add_step(&self.transfers);
        Ok(chosen_all)
    }

    /// The last step's host-to-GPU transfers (FlexGen's pages, the expert cache's experts) in
    /// the order they were submitted, each with the stage that needs it and the stage it went
    /// ahead of; empty without either tier.
    pub fn last_transfers(&self) -> &[Transfer] {
        &self.transfers
    }

    /// Every step's transfers since load, summed.
    pub fn transfer_totals(&self) -> TransferTotals {
        self.transfer_totals
    }
}
