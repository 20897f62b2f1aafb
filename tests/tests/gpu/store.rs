//! The remote page tier (`expertkv-store`): a prompt's full pages stored by one model and
//! fetched by another give the cold prefill's logits bit for bit (raw pages) or within the
//! codec's tolerance; a missing, evicted or foreign page is a miss, never read as ours; a store
//! that dies mid-run is switched off and the run goes on. On Redis (the server `scripts/test.sh`
//! starts, `EXPERTKV_REDIS_URL`, and servers these tests start and kill) and in memory.

use std::time::Duration;

use expertkv_core::config::KvDtype;
use expertkv_core::rng::Rng;
use expertkv_core::runtime::Runtime;
use expertkv_model::SyntheticModel;
use expertkv_model::batch::{BatchDecoder, BatchStats, Completion};
use expertkv_model::forward::{GpuLlama, ModelOptions};
use expertkv_model::gguf::{GgmlType, Gguf};
use expertkv_model::tokenizer::Tokenizer;
use expertkv_store::prefix::model_hash;
use expertkv_store::{MemoryStore, PageStore, PrefixStore, RedisStore, StoreCodec, StoreError};

use crate::common::{case_index, cpu_model, pick, rt, seeds, skip};

const TIMEOUT: Duration = Duration::from_secs(5);

/// A Redis server of this test's own on a free loopback port, killed when dropped.
struct Server {
    child: std::process::Child,
    url: String,
}

impl Server {
    fn start(test: &str) -> Option<Server> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
        let child = std::process::Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .stdout(std::process::Stdio::null())
            .spawn();
        let Ok(child) = child else {
            skip(test, "redis-server is not installed (scripts/test.sh installs Debian's package)");
            return None;
        };
        let s = Server { child, url: format!("redis://127.0.0.1:{port}/0") };
        for _ in 0..100 {
            if RedisStore::connect(&s.url, TIMEOUT).is_ok() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{test}: redis-server on port {port} did not answer in 5 s");
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The server `scripts/test.sh` started, if any.
fn shared_url(test: &str) -> Option<String> {
    let url = std::env::var("EXPERTKV_REDIS_URL").ok();
    if url.is_none() {
        skip(test, "EXPERTKV_REDIS_URL is not set (scripts/test.sh starts a Redis server and sets it)");
    }
    url
}

struct Case {
    file: Vec<u8>,
    opts: ModelOptions,
}

impl Case {
    fn load(&self, rt: &Runtime) -> GpuLlama {
        let g = Gguf::parse(&self.file).expect("gguf");
        pollster::block_on(GpuLlama::load(rt, &g, self.opts.clone())).expect("load")
    }

    fn hash(&self) -> u64 {
        model_hash(&self.file)
    }

    /// The cold run: the prompt prefilled, its logits and two decode steps'.
    fn cold(&self, rt: &Runtime, ids: &[u32], next: &[u32]) -> (GpuLlama, Vec<Vec<f32>>) {
        let mut m = self.load(rt);
        let mut out = vec![pollster::block_on(m.prefill(rt, 0, ids)).expect("prefill")];
        for &t in next {
            out.push(pollster::block_on(m.forward(rt, &[t])).expect("forward"));
        }
        (m, out)
    }

    /// A warm run: the store's prefix restored, the rest prefilled, then the same decode steps.
    fn warm(&self, rt: &Runtime, store: &mut PrefixStore, ids: &[u32], next: &[u32]) -> (u32, Vec<Vec<f32>>) {
        let mut m = self.load(rt);
        let n = store.fetch(rt, &mut m, 0, ids).expect("fetch");
        let mut out = vec![pollster::block_on(m.prefill(rt, 0, &ids[n as usize..])).expect("prefill")];
        for &t in next {
            out.push(pollster::block_on(m.forward(rt, &[t])).expect("forward"));
        }
        (n, out)
    }
}

/// The prefill chunk of these tests' models (prompts run past one).
const CHUNK: u32 = 64;

fn case(seed: u64, dtype: KvDtype) -> Case {
    let spec = SyntheticModel { heads: 4, kv_heads: 2, head_dim: Some(64), context: 512, ..SyntheticModel::dense(seed) }
        .with_weights(GgmlType::Q8_0);
    Case { file: spec.gguf(), opts: ModelOptions::new(1, 400).dtype(dtype).prefill_chunk(CHUNK) }
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs()));
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Raw pages in memory and on Redis, f32 and f16 K/V, prompts that end mid-page and on a page
/// boundary (then the last page is left to prefill, for its logits): the warm run reuses every
/// full page before the last token and its logits, and two decode steps after, equal the cold
/// run's bit for bit, with the pages written by a background thread while their model decodes
/// on. Storing again writes nothing; a store of another model's file reuses
/// nothing. The int8 and int4 codecs reuse as much, within their tolerance, in fewer bytes.
#[test]
fn a_prefix_from_the_store_gives_the_cold_prefill_logits() {
    let rt = rt();
    let redis = shared_url("a_prefix_from_the_store_gives_the_cold_prefill_logits");
    for seed in seeds("store_prefix", 4) {
        let mut rng = Rng::new(seed);
        let i = case_index(seed);
        let dtype = pick(seed, &[KvDtype::F16, KvDtype::F32]);
        let c = case(seed, dtype);
        // Past a prefill chunk, ending mid-page (or on a page boundary every other case).
        let n = CHUNK + 16 * (1 + rng.below(4)) + if i < 2 { 1 + rng.below(15) } else { 0 };
        let ids: Vec<u32> = (0..n).map(|_| rng.below(256)).collect();
        let next = [rng.below(256), rng.below(256)];
        let ctx = format!("seed {seed}: {dtype:?} K/V, {n} prompt tokens");
        let (cold_model, cold) = c.cold(rt, &ids, &next);
        let backends: Vec<(&str, Box<dyn PageStore>)> = match &redis {
            Some(url) => {
                vec![("memory", Box::new(MemoryStore::new())), ("redis", Box::new(RedisStore::connect(url, TIMEOUT).expect("redis")))]
            }
            None => vec![("memory", Box::new(MemoryStore::new()))],
        };
        for (name, backend) in backends {
            let ns = format!("t{seed:x}");
            let mut store = PrefixStore::new(backend, &ns, c.hash(), StoreCodec::Raw, Some(600)).expect("store");
            store.store_mut().clear(&ns).expect("clear");
            let pages = u64::from(n / 16) * u64::from(cold_model.cfg.block_count);
            // Written by a thread while the model it came from decodes on.
            let (mut live, _) = c.cold(rt, &ids, &[]);
            store.store_in_background(rt, &live, 0, &ids).expect("store");
            for &t in &next {
                pollster::block_on(live.forward(rt, &[t])).expect("forward");
            }
            assert_eq!(store.finish(), pages, "{ctx}: {name}");
            assert_eq!(store.report.pages_stored, pages, "{ctx}: {name}");
            assert_eq!(store.store(rt, &cold_model, 0, &ids).expect("store again"), 0, "{ctx}: {name}");
            assert_eq!(store.report.pages_present, pages, "{ctx}: {name}");
            let (reused, warm) = c.warm(rt, &mut store, &ids, &next);
            assert_eq!(reused, (n - 1) / 16 * 16, "{ctx}: {name}");
            assert_eq!(store.report.refused, 0, "{ctx}: {name}");
            for (k, (w, x)) in warm.iter().zip(&cold).enumerate() {
                assert!(w == x, "{ctx}: {name}: logits {k} differ from the cold run's by {}", max_rel(w, x));
            }
            // The same prompt under another model's hash, on the same server: nothing of ours
            // is read.
            if let Some(url) = redis.as_ref().filter(|_| name == "redis") {
                let backend = Box::new(RedisStore::connect(url, TIMEOUT).expect("redis"));
                let mut foreign = PrefixStore::new(backend, &ns, c.hash() ^ 1, StoreCodec::Raw, None).expect("store");
                let mut m = c.load(rt);
                assert_eq!(foreign.fetch(rt, &mut m, 0, &ids).expect("fetch"), 0, "{ctx}: another model's pages read");
            }
            assert_eq!(store.store_mut().clear(&ns).expect("clear"), pages, "{ctx}: {name}");
        }
        if dtype == KvDtype::F16 {
            for codec in [StoreCodec::Int8, StoreCodec::Int4] {
                let mut store = PrefixStore::new(Box::new(MemoryStore::new()), "codec", c.hash(), codec, None).expect("store");
                store.store(rt, &cold_model, 0, &ids).expect("store");
                let (reused, warm) = c.warm(rt, &mut store, &ids, &next);
                assert_eq!(reused, (n - 1) / 16 * 16, "{ctx}: {codec:?}");
                // Against the CPU model whose reused positions hold the store's round trip of
                // the cold pool's own words: f32 arithmetic over f16-rounded K/V, the f16 model
                // check's 1e-3 of the largest logit (the codec's own error, 1e-2 to 1e-1 of
                // it, is far outside that).
                let want = codec_reference(&c, &cold_model, rt, codec, &ids, reused, &next);
                for (k, (w, x)) in warm.iter().zip(&want).enumerate() {
                    let err = max_rel(w, x);
                    assert!(err <= 1e-3, "{ctx}: {codec:?}: logits {k} differ from the reference's by {err} of their scale");
                    let moved = max_rel(&cold[k], x);
                    // The codec's round trip is what the bound tells apart: it moves the reference
                    // (2e-3 to 2.5e-1 of the scale on the fixed seeds and salts 1 and 2) far more
                    // than the warm run sits from it (at most 1.5e-5).
                    assert!(moved > 10.0 * err, "{ctx}: {codec:?}: logits {k}: the codec moved the reference by only {moved}");
                    println!(
                        "{ctx}: {codec:?}: logits {k}: {err:.1e} of their scale from the reference, which the codec moved by {moved:.1e}"
                    );
                }
                let raw_bytes = u64::from(reused) * c_token_bytes(&cold_model);
                assert!(
                    store.report.bytes_fetched * 100 < raw_bytes * if codec == StoreCodec::Int8 { 65 } else { 40 },
                    "{ctx}: {codec:?}: {} bytes for {raw_bytes} raw",
                    store.report.bytes_fetched
                );
            }
        }
    }
}

/// The logits a warm run over `codec`'s pages should give: the CPU model over f16-rounded K/V
/// fed the prompt token by token, with positions `0..reused` of every layer replaced by the
/// store's encoder and decoder applied to `cold`'s own pool words (what the warm model
/// restored), then the last prompt token's logits and each of `next`'s.
fn codec_reference(c: &Case, cold: &GpuLlama, rt: &Runtime, codec: StoreCodec, ids: &[u32], reused: u32, next: &[u32]) -> Vec<Vec<f32>> {
    use expertkv_core::reference::words::decode_words;
    use expertkv_store::value::{PageHeader, decode, encode};
    let cpu = cpu_model(&Gguf::parse(&c.file).expect("gguf"));
    let cfg = cpu.config();
    let (hkv, d, ps) = (cfg.head_count_kv as usize, cfg.head_dim as usize, 16usize);
    let dtype = cold.kv.pool.cfg.dtype;
    let words = pollster::block_on(cold.read_prefix(rt, 0, reused)).expect("read prefix");
    let tw = cold.prefix_token_words();
    let vw = tw / (2 * hkv);
    let mut cache = cpu.new_cache().rounding_to_f16();
    for (pos, &t) in ids[..reused as usize].iter().enumerate() {
        cpu.forward(t, pos as u32, &mut cache).expect("cpu forward");
    }
    for (l, layer_words) in words.iter().enumerate() {
        let layer = cache.layer_mut(l);
        for p in 0..reused as usize / ps {
            let header = PageHeader {
                model_hash: c.hash(),
                prev_chain: 0,
                layer: l as u32,
                kv_heads: hkv as u32,
                head_dim: d as u32,
                page_size: ps as u32,
                dtype,
                codec,
                first_position: (p * ps) as u32,
                tokens: ids[p * ps..(p + 1) * ps].to_vec(),
            };
            let page = &layer_words[p * ps * tw..(p + 1) * ps * tw];
            let back = decode(&encode(&header, page).expect("encode"), &header).expect("decode");
            for s in 0..ps {
                for (kv, dst) in [&mut layer.k, &mut layer.v].into_iter().enumerate() {
                    for h in 0..hkv {
                        let at = s * tw + (kv * hkv + h) * vw;
                        let vals = decode_words(&back[at..at + vw], dtype);
                        for (i, v) in vals.iter().enumerate() {
                            dst[((p * ps + s) * hkv + h) * d + i] = *v as f32;
                        }
                    }
                }
            }
        }
    }
    let mut out = Vec::new();
    let mut last = Vec::new();
    for (pos, &t) in ids.iter().enumerate().skip(reused as usize) {
        last = cpu.forward(t, pos as u32, &mut cache).expect("cpu forward");
    }
    out.push(last);
    for (k, &t) in next.iter().enumerate() {
        out.push(cpu.forward(t, (ids.len() + k) as u32, &mut cache).expect("cpu forward"));
    }
    out
}

fn c_token_bytes(m: &GpuLlama) -> u64 {
    m.kv.pool.cfg.token_kv_bytes() * u64::from(m.cfg.block_count)
}

/// A page gone from the store (evicted) ends the reused prefix there, and a value replaced by
/// a foreign one (another model's page under our key, a flipped byte) is refused and counted,
/// in a fetch's first round or its second: either way the warm run's logits stay the cold
/// run's.
#[test]
fn a_missing_or_foreign_page_is_a_miss_not_an_error() {
    let rt = rt();
    let seed = seeds("store_miss", 1)[0];
    let mut rng = Rng::new(seed);
    let c = case(seed, KvDtype::F16);
    // 24 full pages before the last token: a fetch's first round of 8 pages, then one of 16.
    let n = 16 * 24 + 5;
    let ids: Vec<u32> = (0..n).map(|_| rng.below(256)).collect();
    let (cold_model, cold) = c.cold(rt, &ids, &[]);
    let layer = 1u32;
    for (what, page) in [("evicted", 3usize), ("foreign", 17), ("corrupt", 23)] {
        let mut store = PrefixStore::new(Box::new(MemoryStore::new()), "m", c.hash(), StoreCodec::Raw, None).expect("store");
        store.store(rt, &cold_model, 0, &ids).expect("store");
        let key = store.page_key(&cold_model, &ids, page, layer).expect("a full page");
        assert_eq!(store.page_key(&cold_model, &ids, n as usize / 16, layer), None, "a page past the prompt");
        let stored = store.store_mut().get_many(std::slice::from_ref(&key)).expect("get")[0].clone().expect("stored");
        let bad = match what {
            "evicted" => None,
            "foreign" => {
                // The same page written for another model: its header's model hash differs.
                let mut other = PrefixStore::new(Box::new(MemoryStore::new()), "m", c.hash() ^ 7, StoreCodec::Raw, None).expect("store");
                other.store(rt, &cold_model, 0, &ids).expect("store");
                let k = other.page_key(&cold_model, &ids, page, layer).expect("a full page");
                Some(other.store_mut().get_many(&[k]).expect("get")[0].clone().expect("stored"))
            }
            _ => {
                let mut b = stored.clone();
                let i = b.len() / 2;
                b[i] ^= 1;
                Some(b)
            }
        };
        match bad {
            None => assert_eq!(store.store_mut().remove_many(std::slice::from_ref(&key)).expect("remove"), 1),
            Some(v) => store.store_mut().put_many(&[(key.clone(), v)], None).expect("put"),
        }
        let (reused, warm) = c.warm(rt, &mut store, &ids, &[]);
        assert_eq!(reused, (page * 16) as u32, "seed {seed}: {what}");
        assert_eq!(store.report.refused, u64::from(what != "evicted"), "seed {seed}: {what}: {:?}", store.report.first_refusal);
        assert!(warm[0] == cold[0], "seed {seed}: {what}: logits differ by {}", max_rel(&warm[0], &cold[0]));
    }
}

/// Two writers of the same prefix at once (two models, two connections) leave pages a third
/// model reuses bit for bit; a server killed mid-run switches the store off with its address
/// in the report, and the run goes on (the prompt prefilled cold, the same logits).
#[test]
fn concurrent_writers_and_a_killed_server() {
    let test = "concurrent_writers_and_a_killed_server";
    let rt = rt();
    let Some(mut server) = Server::start(test) else { return };
    let seed = seeds("store_server", 1)[0];
    let mut rng = Rng::new(seed);
    let c = case(seed, KvDtype::F16);
    let n = 16 * 5 + 3;
    let ids: Vec<u32> = (0..n).map(|_| rng.below(256)).collect();
    let (cold_model, cold) = c.cold(rt, &ids, &[]);
    drop(cold_model);
    let connect = |url: &str| {
        PrefixStore::new(Box::new(RedisStore::connect(url, TIMEOUT).expect("redis")), "w", c.hash(), StoreCodec::Raw, None).expect("store")
    };
    std::thread::scope(|s| {
        for _ in 0..2 {
            let url = server.url.clone();
            let c = &c;
            let ids = &ids;
            s.spawn(move || {
                let mut st = connect(&url);
                let (m, _) = c.cold(rt, ids, &[]);
                st.store(rt, &m, 0, ids).expect("store");
                assert!(st.report.failed.is_none());
            });
        }
    });
    let mut store = connect(&server.url);
    let (reused, warm) = c.warm(rt, &mut store, &ids, &[]);
    assert_eq!(reused, 80, "seed {seed}");
    assert!(warm[0] == cold[0], "seed {seed}: concurrent writers' pages differ");
    server.kill();
    let (reused, warm) = c.warm(rt, &mut store, &ids, &[]);
    assert_eq!(reused, 0, "seed {seed}");
    let failed = store.report.failed.clone().expect("the store's failure reported");
    assert!(failed.contains("127.0.0.1"), "{failed}");
    assert!(warm[0] == cold[0], "seed {seed}: the run after the failure differs");
    // Unreachable and misconfigured stores are refused at once, with the address tried.
    let e = RedisStore::connect(&server.url, Duration::from_millis(500)).err().expect("refused");
    assert!(matches!(e, StoreError::Connect { .. }) && e.to_string().contains("127.0.0.1"), "{e}");
    for bad in ["http://127.0.0.1:6379", "rediss://127.0.0.1:6379/0", "redis://127.0.0.1:notaport"] {
        let e = RedisStore::connect(bad, TIMEOUT).err().expect("refused");
        assert!(matches!(e, StoreError::Options(_)), "{bad}: {e}");
    }
}

/// FlexGen's host tier spilling to the store: with at most one page (in memory) or none (on
/// Redis) of K/V words left in host memory, the rest in the store and brought back when QUEST
/// selects them, every step's logits are those of the host tier alone, bit for bit. With the
/// server killed mid-run the tier is switched off and reported, and decoding goes on (a page
/// it held that QUEST selects later is counted lost).
#[test]
fn flexgen_spills_its_coldest_host_pages_to_the_store() {
    use expertkv_core::evict::config::SchedulerConfig;
    use expertkv_store::StoreSpill;
    let test = "flexgen_spills_its_coldest_host_pages_to_the_store";
    let rt = rt();
    let seed = seeds("store_spill", 1)[0];
    let c = Case { opts: ModelOptions::new(1, 64).scheduler(Some((SchedulerConfig::FlexGen, 16))), ..case(seed, KvDtype::F16) };
    let ids: Vec<u32> = (0..44u32).map(|i| (i * 53 + seed as u32) % 256).collect();
    let decode = |spill: Option<(Box<dyn PageStore>, u32)>, kill_at: Option<(usize, &mut Server)>| {
        let mut m = c.load(rt);
        if let Some((store, limit)) = spill {
            let (fg, _) = m.kv.flexgen.as_mut().expect("flexgen");
            fg.set_spill(Box::new(StoreSpill::new(store, "spill", seed).expect("spill")), limit).expect("set_spill");
        }
        let mut kill_at = kill_at;
        let mut out = Vec::new();
        for (i, &t) in ids.iter().enumerate() {
            if let Some((at, server)) = &mut kill_at
                && *at == i
            {
                server.kill();
            }
            out.push(pollster::block_on(m.forward(rt, &[t])).expect("forward"));
        }
        (m.kv.flexgen.as_ref().expect("flexgen").0.stats.clone(), out)
    };
    let (alone, want) = decode(None, None);
    assert!(alone.fetched_pages > 0, "seed {seed}: {alone:?}");
    let mut backends: Vec<(Box<dyn PageStore>, u32)> = vec![(Box::new(MemoryStore::new()), 1)];
    if let Some(url) = shared_url(test) {
        backends.push((Box::new(RedisStore::connect(&url, TIMEOUT).expect("redis")), 0));
    }
    for (store, limit) in backends {
        let name = store.addr();
        let (s, got) = decode(Some((store, limit)), None);
        assert!(s.pages_to_spill > 0 && s.pages_from_spill > 0, "seed {seed}: {name}: {s:?}");
        assert!(s.host_pages <= u64::from(limit) && s.spilled_pages > 0, "seed {seed}: {name}: {s:?}");
        assert_eq!((s.lost_pages, &s.spill_failed), (0, &None), "seed {seed}: {name}");
        assert_eq!((s.offloaded_pages, s.fetched_pages), (alone.offloaded_pages, alone.fetched_pages), "seed {seed}: {name}");
        for (k, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(g == w, "seed {seed}: {name}: step {k}'s logits differ from the host tier alone's by {}", max_rel(g, w));
        }
    }
    let Some(mut server) = Server::start(test) else { return };
    let store = Box::new(RedisStore::connect(&server.url, TIMEOUT).expect("redis"));
    let (s, got) = decode(Some((store, 0)), Some((30, &mut server)));
    let failed = s.spill_failed.clone().expect("the failure reported");
    assert!(failed.contains("127.0.0.1"), "{failed}");
    assert!(got.iter().flatten().all(|x| x.is_finite()), "seed {seed}");
    assert_eq!(got[..30], want[..30], "seed {seed}: the steps before the kill");
}

/// Continuous batching with a store: a prompt joining after an earlier one with the same prefix
/// was fed reuses its pages in the same run, and a second run (another model, the same store)
/// reuses every prompt's full pages; every completion is the run without a store's, token for
/// token. A model with a scheduler is refused a prefix cache, by name.
#[test]
fn continuous_batching_reuses_prefixes_within_and_across_runs() {
    let rt = rt();
    let seed = seeds("store_batch", 1)[0];
    let mut rng = Rng::new(seed);
    let spec = SyntheticModel { heads: 4, kv_heads: 2, head_dim: Some(64), context: 512, ..SyntheticModel::dense(seed) }
        .with_weights(GgmlType::Q8_0);
    let file = spec.gguf();
    let g = Gguf::parse(&file).expect("gguf");
    let tok = Tokenizer::from_gguf(&g).expect("tokenizer");
    let word = |rng: &mut Rng| -> String { (0..3 + rng.below(5)).map(|_| char::from(b'a' + rng.below(26) as u8)).collect() };
    let text = |rng: &mut Rng, words: u32| -> String { (0..words).map(|_| word(rng)).collect::<Vec<_>>().join(" ") };
    let shared = text(&mut rng, 30);
    // Two sequences: prompts 0 and 1 join at once (1 cannot reuse 0's pages yet); 3 joins once
    // 0 has been fed and stored.
    let prompts =
        vec![shared.clone(), format!("{shared} {}", text(&mut rng, 4)), text(&mut rng, 25), format!("{shared} {}", text(&mut rng, 6))];
    let opts = ModelOptions::new(2, 400);
    let run = |store: Option<&mut PrefixStore>| -> (Vec<Completion>, BatchStats) {
        let mut m = pollster::block_on(GpuLlama::load(rt, &g, opts.clone())).expect("load");
        let mut dec = BatchDecoder::new(&mut m, &tok, 4).expect("decoder");
        if let Some(s) = store {
            dec = dec.with_prefix_cache(s).expect("a prefix cache");
        }
        pollster::block_on(dec.run(rt, &prompts, |_| ())).expect("batch")
    };
    // Token for token: a reused prefix is not fed again, so a sequence may finish (and the
    // next prompt take its slot) at other steps than without a store.
    type Said = (usize, Vec<u32>, Vec<u32>, String, &'static str);
    let tokens = |c: &[Completion]| -> Vec<Said> {
        c.iter().map(|c| (c.prompt, c.prompt_ids.clone(), c.generated_ids.clone(), c.text.clone(), c.stop)).collect()
    };
    let (alone, _) = run(None);
    let ids: Vec<usize> = alone.iter().map(|c| c.prompt_ids.len()).collect();
    let full = |i: usize| ((ids[i] - 1) / 16 * 16) as u64;
    let mut store = PrefixStore::new(Box::new(MemoryStore::new()), "batch", model_hash(&file), StoreCodec::Raw, None).expect("store");
    let (first, stats) = run(Some(&mut store));
    store.finish();
    assert_eq!(tokens(&first), tokens(&alone), "seed {seed}: the first run with a store");
    // Prompt 3 shares prompt 0's full pages (prompt 0 is a prefix of it).
    assert!(stats.prefix_tokens_reused >= (ids[0] / 16 * 16) as u64, "seed {seed}: reused {} within the run", stats.prefix_tokens_reused);
    let (second, stats) = run(Some(&mut store));
    assert_eq!(tokens(&second), tokens(&alone), "seed {seed}: the second run");
    assert_eq!(stats.prefix_tokens_reused, (0..4).map(full).sum::<u64>(), "seed {seed}: the second run reuses every full page");
    assert_eq!(store.report.refused, 0);
    // A scheduler evicts between tokens: a restored prefix would not be where it put it.
    let h2o = expertkv_core::evict::config::SchedulerConfig::parse("h2o").expect("h2o");
    let evicting = opts.clone().scheduler(Some((h2o, 64)));
    let mut m = pollster::block_on(GpuLlama::load(rt, &g, evicting)).expect("load");
    let dec = BatchDecoder::new(&mut m, &tok, 4).expect("decoder");
    assert!(dec.with_prefix_cache(&mut store).is_err_and(|e| e.to_string().contains("prefix")));
}
