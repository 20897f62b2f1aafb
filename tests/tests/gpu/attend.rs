//! attend_decode (split over page chunks and pool buffers, reduce, attention mass) against the
//! f64 reference, for both split variants and both shader-check modes.

use expertkv_core::append::KvPool;
use expertkv_core::attend::{AttendOptions, Attention, SplitVariant, subgroup_layout};
use expertkv_core::config::{Codec, KvDtype, PoolConfig, ShardMap};
use expertkv_core::gpu_data::meta;
use expertkv_core::reference::{PoolModel, attend_decode};
use expertkv_core::rng::Rng;
use expertkv_core::runtime::Runtime;

use crate::append::{random_batch, random_kv};
use crate::common::{POISON_F32, fixed_seeds, rt, rt_trusted, seeds, skip};

/// Tolerances: K/V are the same stored values on both sides, so only f32 arithmetic differs.
const ATOL: f64 = 2e-5;
const RTOL: f64 = 1e-4;

struct Case {
    cfg: PoolConfig,
    group: u32,
    n_seqs: u32,
    chunk_pages: u32,
    tokens_in_flight: u32,
    transpose: bool,
}

fn random_case(rng: &mut Rng) -> Case {
    let dtype = if rng.below(2) == 0 { KvDtype::F16 } else { KvDtype::F32 };
    let head_dim = [8u32, 16, 32, 64, 128][rng.below(5) as usize];
    let n_shards = [1u32, 2, 4][rng.below(3) as usize];
    let page_size = [1u32, 4, 8, 16, 32][rng.below(5) as usize];
    let max_seqs = 1 + rng.below(4);
    let ring = 4 + rng.below(8);
    let mut cfg = PoolConfig {
        layers: 1 + rng.below(2),
        kv_heads: 1 + rng.below(3),
        head_dim,
        page_size,
        dtype,
        n_pages: 0,
        max_seqs,
        n_shards,
        ring_capacity: ring,
        top_k: 1,
        shard_map: ShardMap::Pikv { n_tok: n_shards, n_exp: n_shards },
        max_buffer_bytes: None,
        codec: Codec::None,
        codec_pages: 0,
    };
    cfg.n_pages = cfg.n_keys() * ring; // every ring can fill
    if rng.below(2) == 0 {
        cfg.max_buffer_bytes = Some(cfg.page_bytes() * u64::from(1 + rng.below(6)));
    }
    Case {
        cfg,
        group: 1 + rng.below(8),
        n_seqs: 1 + rng.below(max_seqs),
        chunk_pages: 1 + rng.below(6),
        tokens_in_flight: 1 + rng.below(8),
        transpose: rng.below(4) != 0,
    }
}

fn fill(rt: &Runtime, rng: &mut Rng, case: &Case) -> (KvPool, PoolModel) {
    let cfg = &case.cfg;
    let mut pool = pollster::block_on(KvPool::new(rt, cfg.clone())).expect("pool");
    let mut model = PoolModel::new(cfg);
    let mut positions = vec![0u32; cfg.max_seqs as usize];
    // Fill to about half the rings' capacity, unevenly across sequences (one may stay empty).
    let target = cfg.n_shards * (cfg.ring_capacity - 1) * cfg.page_size / 2;
    let max_batch = ((cfg.ring_capacity - 1) * cfg.page_size).min(64) as usize;
    let mut step = 0;
    while positions.iter().sum::<u32>() < target * cfg.max_seqs / 2 {
        let n = 1 + rng.below(max_batch as u32) as usize;
        let tokens = random_batch(rng, cfg, &mut positions, n, false);
        let kv = random_kv(rng, cfg, n);
        pool.append(rt, &tokens, &kv, step).expect("append");
        model.append(&tokens, &kv, step).expect("append");
        step += 1;
    }
    pollster::block_on(pool.check_errors(rt, 0)).expect("no pool errors while filling");
    pool.gather(rt).expect("gather");
    (pool, model)
}

fn close(got: f64, want: f64) -> bool {
    (got - want).abs() <= ATOL + RTOL * want.abs()
}

/// Runs one random case; false when the device cannot run `variant` at the drawn shape.
fn check_case(rt: &Runtime, seed: u64, variant: SplitVariant) -> bool {
    check_case_with(rt, seed, variant, |_, _| {})
}

/// [`check_case`], the drawn case changed by `tweak` before it runs.
fn check_case_with(rt: &Runtime, seed: u64, variant: SplitVariant, tweak: impl Fn(&mut Rng, &mut Case)) -> bool {
    let mut rng = Rng::new(seed);
    let mut case = random_case(&mut rng);
    tweak(&mut rng, &mut case);
    let cfg = &case.cfg;
    if matches!(variant, SplitVariant::Subgroup { .. }) && subgroup_layout(rt, cfg.head_dim, cfg.dtype).is_none() {
        return false;
    }
    let variant = match variant {
        SplitVariant::Tiled => SplitVariant::Tiled,
        SplitVariant::Subgroup { .. } => subgroup_layout(rt, cfg.head_dim, cfg.dtype).expect("layout checked above"),
    };
    let ctx = format!(
        "seed {seed}, variant {}, checks {}, group {}, n_seqs {}, chunk_pages {}, tokens_in_flight {}, transpose {}, {cfg:?}",
        variant.name(),
        rt.checks.name(),
        case.group,
        case.n_seqs,
        case.chunk_pages,
        case.tokens_in_flight,
        case.transpose
    );
    let (pool, mut model) = fill(rt, &mut rng, &case);
    let attn = pollster::block_on(Attention::new(
        rt,
        &pool,
        AttendOptions {
            group: case.group,
            n_seqs: case.n_seqs,
            chunk_pages: case.chunk_pages,
            mass: true,
            variant: Some(variant),
            tokens_in_flight: case.tokens_in_flight,
            transpose: case.transpose,
            ..Default::default()
        },
    ))
    .unwrap_or_else(|e| panic!("{ctx}: {e}"));
    for layer in 0..cfg.layers {
        let q: Vec<f32> = (0..case.n_seqs * attn.q_heads() * cfg.head_dim).map(|_| rng.normal() as f32 * 2.0).collect();
        attn.set_queries(rt, &q).expect("queries");
        for b in [&attn.out, &attn.partials, &attn.scores, &attn.stats] {
            rt.fill_u32(b, POISON_F32);
        }
        attn.run(rt, layer, 100 + layer).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let got = pollster::block_on(attn.read_output(rt)).expect("output");
        let want = attend_decode(&model, layer, case.n_seqs, &q, case.group, f64::from(attn.scale()));
        assert_eq!(got.len(), want.out.len());
        for (i, (g, w)) in got.iter().zip(&want.out).enumerate() {
            assert!(close(f64::from(*g), *w), "{ctx}: layer {layer} output[{i}] = {g}, reference {w}");
        }
        assert_mass(rt, &pool, &mut model, &want.mass, 100 + layer, &format!("{ctx}: layer {layer}"));
    }
    true
}

/// Attention mass (`mass`, a reference's) accumulated into the GPU's slot metadata, with the
/// access at `step` recorded, and every other word of the metadata (every slot of every
/// sequence, layer and page, attended or not) as it was; then the GPU's metadata carried into
/// `model`, so that the next comparison starts from it.
pub fn assert_mass(rt: &Runtime, pool: &KvPool, model: &mut PoolModel, mass: &[(u32, u32, u32, u32, f64)], step: u32, ctx: &str) {
    let cfg = &pool.cfg;
    let slot_meta: Vec<u32> = pollster::block_on(rt.read_all(&pool.slot_meta)).expect("meta");
    let mw = cfg.meta_words() as usize;
    let attn_off = meta::attn(cfg.top_k as usize);
    assert_eq!(slot_meta.len(), model.slot_meta.len(), "{ctx}: slot metadata size");
    let mut want = model.slot_meta.clone();
    for &(seq, head, page, slot, w) in mass {
        let m = (page as usize * cfg.page_size as usize + slot as usize) * mw;
        let prev = f64::from(f32::from_bits(model.slot_meta[m + attn_off]));
        let g = f64::from(f32::from_bits(slot_meta[m + attn_off]));
        assert!(close(g, prev + w), "{ctx}: seq {seq} head {head} page {page} slot {slot}: mass {g}, reference {}", prev + w);
        // The float sum is checked above; the rest of the word's slot must match exactly.
        want[m + attn_off] = slot_meta[m + attn_off];
        want[m + meta::LAST_ACCESS] = step;
        want[m + meta::ACCESS_COUNT] = model.slot_meta[m + meta::ACCESS_COUNT] + 1;
    }
    if let Some(i) = (0..want.len()).find(|&i| want[i] != slot_meta[i]) {
        let (slot, word) = (i / mw, i % mw);
        panic!(
            "{ctx}: slot metadata word {word} of slot {slot} (page {}, slot {}) is {:#010x}, expected {:#010x} ({} attended slots)",
            slot / cfg.page_size as usize,
            slot % cfg.page_size as usize,
            slot_meta[i],
            want[i],
            mass.len()
        );
    }
    model.slot_meta = slot_meta;
}

#[test]
fn attend_tiled_gpu_match_cpu() {
    for seed in seeds("attend_tiled", 16) {
        assert!(check_case(rt(), seed, SplitVariant::Tiled));
    }
}

#[test]
fn attend_tiled_unchecked_gpu_match_cpu() {
    for seed in seeds("attend_tiled_unchecked", 8) {
        assert!(check_case(rt_trusted(), seed, SplitVariant::Tiled));
    }
}

#[test]
fn attend_subgroup_gpu_match_cpu() {
    let rt = rt();
    if rt.tier != expertkv_core::Tier::Subgroups {
        skip("attend_subgroup_gpu_match_cpu", format!("adapter {} has no subgroups (tier {})", rt.info.name, rt.tier.name()));
        return;
    }
    let mut ran = 0;
    for seed in seeds("attend_subgroup", 24) {
        ran += u32::from(check_case(rt, seed, SplitVariant::Subgroup { lanes: 0, vpl: 0 }));
    }
    // Most random shapes have a subgroup layout; a run where none had proves nothing.
    if fixed_seeds() {
        assert!(ran >= 8, "only {ran} cases ran the subgroup kernel");
    }
}

/// Long lists in long chunks, so that every token group takes many blocks of slots and rescales
/// its running sums many times: the small random cases above give most token groups one block.
#[test]
fn attend_subgroup_long_lists_gpu_match_cpu() {
    let rt = rt();
    if rt.tier != expertkv_core::Tier::Subgroups {
        skip("attend_subgroup_long_lists_gpu_match_cpu", format!("adapter {} has no subgroups (tier {})", rt.info.name, rt.tier.name()));
        return;
    }
    let mut ran = 0;
    for seed in seeds("attend_subgroup_long", 6) {
        ran += u32::from(check_case_with(rt, seed, SplitVariant::Subgroup { lanes: 0, vpl: 0 }, |rng, case| {
            let cfg = &mut case.cfg;
            cfg.head_dim = [64u32, 128][rng.below(2) as usize];
            cfg.page_size = [8u32, 16][rng.below(2) as usize];
            cfg.ring_capacity = 48 + rng.below(17);
            cfg.n_shards = 1;
            cfg.shard_map = ShardMap::Pikv { n_tok: 1, n_exp: 1 };
            cfg.max_seqs = 1 + rng.below(2);
            cfg.layers = 1;
            cfg.max_buffer_bytes = None;
            cfg.n_pages = cfg.n_keys() * cfg.ring_capacity;
            case.n_seqs = cfg.max_seqs;
            case.group = [1u32, 2, 4][rng.below(3) as usize];
            case.transpose = true;
            case.chunk_pages = 24 + rng.below(41);
            case.tokens_in_flight = 1 + rng.below(2);
        }));
    }
    if fixed_seeds() {
        assert!(ran >= 4, "only {ran} cases ran the subgroup kernel");
    }
}

#[test]
fn attend_subgroup_unchecked_gpu_match_cpu() {
    let rt = rt_trusted();
    if rt.tier != expertkv_core::Tier::Subgroups {
        skip("attend_subgroup_unchecked_gpu_match_cpu", format!("adapter {} has no subgroups (tier {})", rt.info.name, rt.tier.name()));
        return;
    }
    let mut ran = 0;
    for seed in seeds("attend_subgroup_unchecked", 12) {
        ran += u32::from(check_case(rt, seed, SplitVariant::Subgroup { lanes: 0, vpl: 0 }));
    }
    if fixed_seeds() {
        assert!(ran >= 4, "only {ran} cases ran the subgroup kernel");
    }
}

/// Prefill attention (a chunk of one sequence's queries, causally masked by each slot's
/// position, split over page chunks and pool buffers, merged by the reduce pass) against the
/// f64 reference, on random pools (shards, page sizes, split buffers, f16 and f32): every
/// earlier token is seen by every query, the chunk's own tokens only by the queries at or after
/// them.
#[test]
fn attend_prefill_gpu_match_cpu() {
    use expertkv_core::attend::prefill::{PREFILL_CHUNK_PAGES, PrefillAttention};
    use expertkv_core::reference::attend::attend_prefill;
    let rt = rt();
    for seed in seeds("attend_prefill", 8) {
        let mut rng = Rng::new(seed);
        let case = random_case(&mut rng);
        let cfg = case.cfg.clone();
        let (mut pool, mut model) = fill(rt, &mut rng, &case);
        let (seq, layer) = (rng.below(cfg.max_seqs), rng.below(cfg.layers));
        let n = 1 + rng.below((cfg.page_size * 2).min(32));
        let first = 10_000 + rng.below(100);
        // Pages per split workgroup: from one (every page its own partial, merged by the reduce)
        // to more than any list holds; among those whose partials (queries x query heads x
        // buffers x page chunks x (d + 4) floats) fit one binding of this device (a large pool
        // split page by page does not, and `new` refuses it by name).
        let partial_bytes = |c: u32| PrefillAttention::partial_bytes(&pool, case.group, n, c);
        let fitting: Vec<u32> =
            [1u32, 2, 3, 8, PREFILL_CHUNK_PAGES].into_iter().filter(|&c| partial_bytes(c) <= rt.max_binding_bytes()).collect();
        assert!(!fitting.is_empty(), "seed {seed}: no split fits a binding");
        let chunk_pages = fitting[rng.below(fitting.len() as u32) as usize];
        let ctx = format!(
            "seed {seed}: {cfg:?}, group {}, {n} queries of sequence {seq}, layer {layer}, {chunk_pages} pages a split",
            case.group
        );
        let mut positions = vec![0u32; cfg.max_seqs as usize];
        positions[seq as usize] = first;
        let tokens: Vec<_> = random_batch(&mut rng, &cfg, &mut positions.clone(), n as usize, false)
            .into_iter()
            .enumerate()
            .map(|(i, mut t)| {
                (t.seq, t.layer, t.position) = (seq, layer, first + i as u32);
                t
            })
            .collect();
        let kv = random_kv(&mut rng, &cfg, n as usize);
        pool.append(rt, &tokens, &kv, 99).expect("append the chunk");
        model.append(&tokens, &kv, 99).expect("append the chunk");
        pool.gather(rt).expect("gather");
        let mut attn = pollster::block_on(PrefillAttention::new(rt, &pool, case.group, n, chunk_pages)).expect("prefill attention");
        let d = cfg.head_dim;
        let q: Vec<f32> = (0..n * cfg.kv_heads * case.group * d).map(|_| rng.normal() as f32).collect();
        rt.queue.write_buffer(&attn.queries, 0, bytemuck::cast_slice(&q));
        rt.fill_u32(attn.output(), POISON_F32);
        attn.stage(rt, seq, first, n).expect("stage");
        let mut enc = rt.device.create_command_encoder(&Default::default());
        attn.encode(&mut enc.begin_compute_pass(&Default::default()), layer).expect("encode");
        rt.queue.submit([enc.finish()]);
        let got: Vec<f32> = pollster::block_on(rt.read_all(attn.output())).expect("read");
        let want = attend_prefill(&model, layer, seq, first, &q, case.group, 1.0 / f64::from(d).sqrt());
        assert_eq!(got.len(), want.len(), "{ctx}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g.is_finite() && close(f64::from(*g), *w), "{ctx}: element {i}: {g} vs {w}");
        }
    }
    // A pool with a page codec is refused by name.
    let mut cfg = random_case(&mut Rng::new(1)).cfg;
    (cfg.head_dim, cfg.dtype, cfg.max_buffer_bytes) = (64, KvDtype::F16, None);
    cfg.codec = Codec::parse("int8").expect("int8");
    cfg.codec_pages = cfg.n_pages;
    let pool = pollster::block_on(KvPool::new(rt, cfg)).expect("pool");
    let e = pollster::block_on(PrefillAttention::new(rt, &pool, 1, 4, PREFILL_CHUNK_PAGES)).err().expect("refused");
    assert!(e.to_string().contains("raw pages only"), "{e}");
}
