//! Prefix reuse across processes: a prompt's full pages stored under keys derived from the model
//! file's hash and the chained hash of the token ids (so a key names its whole prefix, as
//! LMCache's chunk keys do), and fetched back into another model's pool instead of prefilling.
//!
//! A key is `{namespace}:{model hash}:{dtype}-{codec}-p{page}-h{heads}x{dim}:{chain}:{layer}`;
//! the value's header repeats the model hash, the shape, the codec, the position, the previous
//! chain hash and the page's own token ids, so a page is used only where its own tokens match
//! the prompt's. The hashes are 64-bit FNV-style and the checksum is no signature: the store is
//! trusted (anyone who can write to the server can write a page that passes every check).

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use expertkv_core::digest::{FNV_OFFSET, fnv1a, hash64};
use expertkv_core::runtime::Runtime;
use expertkv_model::forward::GpuLlama;

use crate::value::{PageHeader, StoreCodec, decode, encode};
use crate::{PageStore, RedisStore, Result, StoreError};

/// Pages asked for in a fetch's first round (every layer of each): a fetch stops at the first
/// page some layer of which is missing, so a cold store costs one small round. Each later round
/// asks for twice as many, up to [`FETCH_PAGES_MAX_ROUND`], so a long prefix takes few.
pub const FETCH_PAGES_PER_ROUND: usize = 8;

/// The most pages a fetch asks for in one round.
pub const FETCH_PAGES_MAX_ROUND: usize = 256;

/// A value's verdict: its words and stored size, or why it is not the page.
type Checked = std::result::Result<(Vec<u32>, u64), String>;

/// Each value checked against its expected header and decoded (`None`: the store had no
/// value), with its stored size; on several threads when there are many.
fn check_all(values: &[Option<Vec<u8>>], headers: &[PageHeader]) -> Vec<Option<Checked>> {
    let one = |v: &Option<Vec<u8>>, h: &PageHeader| v.as_ref().map(|v| decode(v, h).map(|w| (w, v.len() as u64)));
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(8);
    if threads < 2 || values.len() < 64 {
        return values.iter().zip(headers).map(|(v, h)| one(v, h)).collect();
    }
    let per = values.len().div_ceil(threads);
    std::thread::scope(|s| {
        let parts: Vec<_> = values
            .chunks(per)
            .zip(headers.chunks(per))
            .map(|(vs, hs)| s.spawn(move || vs.iter().zip(hs).map(|(v, h)| one(v, h)).collect::<Vec<_>>()))
            .collect();
        parts.into_iter().flat_map(|p| p.join().unwrap_or_else(|e| std::panic::resume_unwind(e))).collect()
    })
}

/// How to reach and use a store.
#[derive(Clone, Debug)]
pub struct StoreOptions {
    /// `redis://HOST:PORT/DB` (`redis://:PASSWORD@HOST:PORT/DB` with AUTH).
    pub url: String,
    /// Keys start with `{namespace}:`.
    pub namespace: String,
    /// Stored pages expire after this many seconds (`None`: never).
    pub ttl_s: Option<u64>,
    /// How pages are kept.
    pub codec: StoreCodec,
    /// Bound the server's memory to this many bytes (`CONFIG SET maxmemory`, least recently
    /// used keys evicted past it); `None` leaves the server's setting.
    pub max_bytes: Option<u64>,
    /// Connection and request timeout.
    pub timeout: Duration,
}

impl StoreOptions {
    /// `url` with the defaults: namespace `expertkv`, no TTL, raw pages, the server's memory
    /// setting, a 2 s timeout.
    pub fn new(url: &str) -> Self {
        StoreOptions {
            url: url.into(),
            namespace: "expertkv".into(),
            ttl_s: None,
            codec: StoreCodec::Raw,
            max_bytes: None,
            timeout: Duration::from_secs(2),
        }
    }
}

/// What a store did for one run.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct StoreReport {
    /// The store's address.
    pub addr: String,
    /// Prompt tokens whose K/V came from the store (not prefilled).
    pub tokens_reused: u32,
    /// Pages (one layer each) fetched and used.
    pub pages_fetched: u64,
    /// Their bytes as stored.
    pub bytes_fetched: u64,
    /// Values refused (another model's, another format's, a bad checksum): each a miss.
    pub refused: u64,
    /// Pages (one layer each) written.
    pub pages_stored: u64,
    /// Their bytes.
    pub bytes_stored: u64,
    /// Pages already in the store when storing (not written again).
    pub pages_present: u64,
    /// Seconds spent fetching (round trips, checks, decoding, the pool's append).
    pub fetch_s: f64,
    /// Of which waiting for the store's replies.
    pub fetch_get_s: f64,
    /// Of which checking and decoding values.
    pub fetch_check_s: f64,
    /// Of which appending the restored K/V into the pool.
    pub fetch_restore_s: f64,
    /// Seconds spent storing (reading the pool, encoding, round trips; the encoding and the
    /// writes on a thread beside the decoding).
    pub store_s: f64,
    /// Why the store was switched off mid-run, if it was.
    pub failed: Option<String>,
    /// Why some value was refused (the first).
    pub first_refusal: Option<String>,
}

/// [`hash64`] of a model file's bytes: the model part of every key and header.
pub fn model_hash(bytes: &[u8]) -> u64 {
    hash64(bytes)
}

/// The chained hashes of the prompt's full pages: entry 0 is the root (the model hash alone),
/// entry p + 1 hashes entry p with page p's token ids. `ids.len() / page_size + 1` entries.
pub fn chain_hashes(model_hash: u64, ids: &[u32], page_size: u32) -> Vec<u64> {
    let mut h = fnv1a(fnv1a(FNV_OFFSET, b"expertkv-prefix"), &model_hash.to_le_bytes());
    let mut out = vec![h];
    for page in ids.chunks_exact(page_size as usize) {
        for t in page {
            h = fnv1a(h, &t.to_le_bytes());
        }
        out.push(h);
    }
    out
}

/// A store used for prefix reuse by one model.
pub struct PrefixStore {
    /// The connection; while a write is in flight it is the writer thread's, and this is a
    /// stand-in that refuses everything.
    store: Box<dyn PageStore>,
    /// A write in flight ([`PrefixStore::store_in_background`]).
    writer: Option<JoinHandle<Written>>,
    namespace: String,
    model_hash: u64,
    codec: StoreCodec,
    ttl_s: Option<u64>,
    /// What this store did so far.
    pub report: StoreReport,
}

impl PrefixStore {
    /// Prefix reuse over `store`, for the model whose file hashes to `model_hash`.
    pub fn new(store: Box<dyn PageStore>, namespace: &str, model_hash: u64, codec: StoreCodec, ttl_s: Option<u64>) -> Result<Self> {
        Self::check(namespace, ttl_s)?;
        let report = StoreReport { addr: store.addr(), ..StoreReport::default() };
        Ok(PrefixStore { store, writer: None, namespace: namespace.into(), model_hash, codec, ttl_s, report })
    }

    fn check(namespace: &str, ttl_s: Option<u64>) -> Result<()> {
        crate::check_namespace(namespace)?;
        if ttl_s == Some(0) {
            return Err(StoreError::Options("a TTL of 0 s would expire every page at once; give at least 1".into()));
        }
        Ok(())
    }

    /// Connect to the Redis/Valkey server `opts.url` (refused at once, with the address tried,
    /// when it cannot be reached), bounding its memory if asked (after the options are checked).
    pub fn connect(opts: &StoreOptions, model_hash: u64) -> Result<Self> {
        Self::check(&opts.namespace, opts.ttl_s)?;
        let mut r = RedisStore::connect(&opts.url, opts.timeout)?;
        if let Some(b) = opts.max_bytes {
            r.set_max_memory(b)?;
        }
        Self::new(Box::new(r), &opts.namespace, model_hash, opts.codec, opts.ttl_s)
    }

    /// The underlying store (after any write in flight has finished).
    pub fn store_mut(&mut self) -> &mut dyn PageStore {
        self.finish();
        self.store.as_mut()
    }

    /// Wait for a write in flight ([`PrefixStore::store_in_background`]) and fold what it did
    /// into the report; returns the pages (one layer each) it wrote. A write that failed has
    /// switched the store off ([`StoreReport::failed`]). Nothing in flight: 0.
    pub fn finish(&mut self) -> u64 {
        let Some(writer) = self.writer.take() else { return 0 };
        match writer.join() {
            Ok(w) => {
                self.store = w.store;
                self.report.store_s += w.seconds;
                match w.outcome {
                    Ok((pages, bytes)) => {
                        self.report.pages_stored += pages;
                        self.report.bytes_stored += bytes;
                        pages
                    }
                    Err(e) => {
                        self.report.failed.get_or_insert(e.to_string());
                        0
                    }
                }
            }
            Err(_) => {
                let why = "the page store's writer thread panicked; the store is off for the rest of the run";
                self.report.failed.get_or_insert(why.into());
                0
            }
        }
    }

    /// The store's failure: switched off for the rest of the run, reported once.
    fn fail(&mut self, e: StoreError) -> Result<()> {
        match e {
            StoreError::Server { .. } | StoreError::Connect { .. } => {
                self.report.failed.get_or_insert(e.to_string());
                Ok(())
            }
            other => Err(other),
        }
    }

    fn key(&self, m: &GpuLlama, chain: u64, layer: u32) -> String {
        let c = &m.kv.pool.cfg;
        format!(
            "{}:{:016x}:{}-{}-p{}-h{}x{}:{chain:016x}:{layer}",
            self.namespace,
            self.model_hash,
            c.dtype.name(),
            self.codec.name(),
            c.page_size,
            c.kv_heads,
            c.head_dim
        )
    }

    /// The key of page `page` (positions `page * page_size..`) of `ids`, layer `layer`; `None`
    /// past the prompt's full pages.
    pub fn page_key(&self, m: &GpuLlama, ids: &[u32], page: usize, layer: u32) -> Option<String> {
        let ps = m.kv.pool.cfg.page_size as usize;
        let end = (page + 1).checked_mul(ps).filter(|&e| e <= ids.len())?;
        let chain = chain_hashes(self.model_hash, &ids[..end], ps as u32);
        Some(self.key(m, chain[page + 1], layer))
    }

    fn header(&self, m: &GpuLlama, page: usize, prev_chain: u64, layer: u32, ids: &[u32]) -> PageHeader {
        let c = &m.kv.pool.cfg;
        let ps = c.page_size as usize;
        PageHeader {
            model_hash: self.model_hash,
            prev_chain,
            layer,
            kv_heads: c.kv_heads,
            head_dim: c.head_dim,
            page_size: c.page_size,
            dtype: c.dtype,
            codec: self.codec,
            first_position: (page * ps) as u32,
            tokens: ids[page * ps..(page + 1) * ps].to_vec(),
        }
    }

    /// Whether the store is still on (`false` once it failed), and an error where `m`'s pool or
    /// the store codec cannot take a restored prefix.
    fn usable(&mut self, m: &GpuLlama) -> Result<bool> {
        self.finish();
        if self.report.failed.is_some() {
            return Ok(false);
        }
        if let Some(why) = m.prefix_refusal() {
            return Err(StoreError::Options(format!("prefix reuse needs a pool a prefill can fill: {why}")));
        }
        self.codec.check(m.kv.pool.cfg.dtype, m.kv.pool.cfg.head_dim)?;
        Ok(true)
    }

    /// Before prefilling `ids` into the empty sequence `seq`: fetch the longest run of its
    /// full pages the store holds for every layer (leaving at least the last token to run, for
    /// its logits) and restore them into the pool. Returns the tokens restored; the caller
    /// prefills `ids[n..]`. A store that fails is switched off with [`StoreReport::failed`]
    /// set, and 0 returned: the pool is as it was.
    pub fn fetch(&mut self, rt: &Runtime, m: &mut GpuLlama, seq: u32, ids: &[u32]) -> Result<u32> {
        if !self.usable(m)? {
            return Ok(0);
        }
        let t0 = Instant::now();
        let ps = m.kv.pool.cfg.page_size as usize;
        let layers = m.cfg.block_count;
        let max_pages = ids.len().saturating_sub(1) / ps;
        let chain = chain_hashes(self.model_hash, &ids[..max_pages * ps], ps as u32);
        let words_per_page = ps * m.prefix_token_words();
        let mut kv: Vec<Vec<u32>> = vec![Vec::new(); layers as usize];
        let (mut pages, mut bytes) = (0usize, 0u64);
        let mut round_pages = FETCH_PAGES_PER_ROUND;
        'rounds: while pages < max_pages {
            let round: Vec<usize> = (pages..(pages + round_pages).min(max_pages)).collect();
            round_pages = (round_pages * 2).min(FETCH_PAGES_MAX_ROUND);
            let wanted: Vec<(usize, u32)> = round.iter().flat_map(|&p| (0..layers).map(move |l| (p, l))).collect();
            let keys: Vec<String> = wanted.iter().map(|&(p, l)| self.key(m, chain[p + 1], l)).collect();
            let t_get = Instant::now();
            let values = match self.store.get_many(&keys) {
                Ok(v) => v,
                Err(e) => {
                    self.fail(e)?;
                    return Ok(0);
                }
            };
            self.report.fetch_get_s += t_get.elapsed().as_secs_f64();
            let t_check = Instant::now();
            let headers: Vec<PageHeader> = wanted.iter().map(|&(p, l)| self.header(m, p, chain[p], l, ids)).collect();
            let checked = check_all(&values, &headers);
            self.report.fetch_check_s += t_check.elapsed().as_secs_f64();
            let mut checked = checked.into_iter();
            for buf in &mut kv {
                buf.reserve(round.len() * words_per_page);
            }
            for &p in &round {
                let mut page_words = Vec::with_capacity(layers as usize);
                let mut page_bytes = 0u64;
                for l in 0..layers {
                    match checked.next() {
                        Some(Some(Ok((w, n)))) => {
                            page_bytes += n;
                            page_words.push(w);
                        }
                        Some(Some(Err(why))) => {
                            self.report.refused += 1;
                            self.report.first_refusal.get_or_insert(format!("page {p}, layer {l}: {why}"));
                            break 'rounds;
                        }
                        Some(None) | None => break 'rounds,
                    }
                }
                for (l, w) in page_words.into_iter().enumerate() {
                    kv[l].extend(w);
                }
                bytes += page_bytes;
                pages += 1;
            }
        }
        let n = (pages * ps) as u32;
        if n > 0 {
            let t_restore = Instant::now();
            pollster::block_on(m.restore_prefix(rt, seq, n, &kv))?;
            self.report.fetch_restore_s += t_restore.elapsed().as_secs_f64();
        }
        self.report.tokens_reused += n;
        self.report.pages_fetched += (pages * layers as usize) as u64;
        self.report.bytes_fetched += bytes;
        self.report.fetch_s += t0.elapsed().as_secs_f64();
        Ok(n)
    }

    /// After prefilling `ids` into sequence `seq`: store its full pages the store does not
    /// hold yet (every layer). Returns the pages (one layer each) written. A store that fails
    /// is switched off ([`StoreReport::failed`]) and 0 returned.
    pub fn store(&mut self, rt: &Runtime, m: &GpuLlama, seq: u32, ids: &[u32]) -> Result<u64> {
        self.store_in_background(rt, m, seq, ids)?;
        Ok(self.finish())
    }

    /// [`PrefixStore::store`] with the slow part off the caller's thread: which pages the store
    /// lacks (one round trip) and their K/V (one read of the pool) are found here, then a
    /// thread encodes and writes them while the caller goes on decoding (`m` may change as soon
    /// as this returns). [`PrefixStore::finish`] waits for it; so does every other use of the
    /// store.
    pub fn store_in_background(&mut self, rt: &Runtime, m: &GpuLlama, seq: u32, ids: &[u32]) -> Result<()> {
        if !self.usable(m)? {
            return Ok(());
        }
        let t0 = Instant::now();
        let ps = m.kv.pool.cfg.page_size as usize;
        let held = m.positions.get(seq as usize).copied().unwrap_or(0) as usize;
        let n_pages = ids.len().min(held) / ps;
        if n_pages == 0 {
            return Ok(());
        }
        let layers = m.cfg.block_count;
        let chain = chain_hashes(self.model_hash, &ids[..n_pages * ps], ps as u32);
        let keys: Vec<(usize, u32, String)> =
            (0..n_pages).flat_map(|p| (0..layers).map(move |l| (p, l))).map(|(p, l)| (p, l, self.key(m, chain[p + 1], l))).collect();
        let names: Vec<String> = keys.iter().map(|k| k.2.clone()).collect();
        let present = match self.store.exists_many(&names) {
            Ok(v) => v,
            Err(e) => return self.fail(e),
        };
        let missing: Vec<(usize, u32, String)> = keys.into_iter().zip(&present).filter(|(_, p)| !**p).map(|(k, _)| k).collect();
        self.report.pages_present += (names.len() - missing.len()) as u64;
        if missing.is_empty() {
            self.report.store_s += t0.elapsed().as_secs_f64();
            return Ok(());
        }
        let last = missing.iter().map(|k| k.0).max().unwrap_or(0) + 1;
        let kv = pollster::block_on(m.read_prefix(rt, seq, (last * ps) as u32))?;
        // The pool's words go to the writer as read; it slices each page out of them.
        let pages: Vec<(String, PageHeader, usize, usize)> =
            missing.into_iter().map(|(p, l, key)| (key, self.header(m, p, chain[p], l, ids), p, l as usize)).collect();
        let page_words = ps * m.prefix_token_words();
        self.report.store_s += t0.elapsed().as_secs_f64();
        let mut store = std::mem::replace(&mut self.store, Box::new(Busy { addr: self.report.addr.clone() }));
        let ttl_s = self.ttl_s;
        self.writer = Some(std::thread::spawn(move || {
            let t0 = Instant::now();
            let outcome = (|| -> Result<(u64, u64)> {
                let mut items = Vec::with_capacity(pages.len());
                for (key, header, p, l) in pages {
                    items.push((key, encode(&header, &kv[l][p * page_words..(p + 1) * page_words])?));
                }
                let bytes: u64 = items.iter().map(|(_, v)| v.len() as u64).sum();
                store.put_many(&items, ttl_s)?;
                Ok((items.len() as u64, bytes))
            })();
            Written { store, outcome, seconds: t0.elapsed().as_secs_f64() }
        }));
        Ok(())
    }
}

impl expertkv_model::batch::PrefixCache for PrefixStore {
    fn fetch(&mut self, rt: &Runtime, m: &mut GpuLlama, seq: u32, ids: &[u32]) -> expertkv_core::Result<u32> {
        PrefixStore::fetch(self, rt, m, seq, ids).map_err(StoreError::into_core)
    }

    fn store(&mut self, rt: &Runtime, m: &GpuLlama, seq: u32, ids: &[u32]) -> expertkv_core::Result<()> {
        self.store_in_background(rt, m, seq, ids).map_err(StoreError::into_core)
    }
}

impl Drop for PrefixStore {
    /// A write in flight is finished, not cut off when the process ends.
    fn drop(&mut self) {
        self.finish();
    }
}

/// What a background write hands back: the connection, and the pages and bytes it wrote.
struct Written {
    store: Box<dyn PageStore>,
    outcome: Result<(u64, u64)>,
    seconds: f64,
}

/// The store's stand-in while its connection is lent to a writer thread (never reached:
/// every use of the store waits for the writer first).
struct Busy {
    addr: String,
}

impl Busy {
    fn refuse<T>(&self) -> Result<T> {
        Err(StoreError::Server { addr: self.addr.clone(), message: "the connection is busy with a background write".into() })
    }
}

impl PageStore for Busy {
    fn addr(&self) -> String {
        self.addr.clone()
    }
    fn get_many(&mut self, _: &[String]) -> Result<Vec<Option<Vec<u8>>>> {
        self.refuse()
    }
    fn exists_many(&mut self, _: &[String]) -> Result<Vec<bool>> {
        self.refuse()
    }
    fn put_many(&mut self, _: &[(String, Vec<u8>)], _: Option<u64>) -> Result<()> {
        self.refuse()
    }
    fn remove_many(&mut self, _: &[String]) -> Result<u64> {
        self.refuse()
    }
    fn stats(&mut self, _: &str) -> Result<crate::StoreStats> {
        self.refuse()
    }
    fn clear(&mut self, _: &str) -> Result<u64> {
        self.refuse()
    }
}

#[cfg(test)]
mod tests {
    use expertkv_core::config::KvDtype;
    use expertkv_core::rng::Rng;

    use super::check_all;
    use crate::value::{PageHeader, StoreCodec, decode, encode};

    /// The threaded check gives each value's own verdict, in order: missing, refused (another
    /// layer's header, a flipped byte) and good values mixed over several threads' shares.
    #[test]
    fn checking_on_threads_gives_each_values_own_verdict() {
        let seed = 0xc4ec;
        let mut rng = Rng::new(seed);
        let (mut values, mut headers) = (Vec::new(), Vec::new());
        for i in 0..150u32 {
            let h = PageHeader {
                model_hash: 7,
                prev_chain: u64::from(i),
                layer: i % 5,
                kv_heads: 2,
                head_dim: 8,
                page_size: 4,
                dtype: KvDtype::F32,
                codec: StoreCodec::Raw,
                first_position: 4 * i,
                tokens: (0..4).map(|_| rng.below(100)).collect(),
            };
            let words: Vec<u32> = (0..4 * h.token_words()).map(|_| rng.below(u32::MAX)).collect();
            let mut v = Some(encode(&h, &words).expect("encode"));
            match rng.below(4) {
                0 => v = None,
                1 => {
                    let b = v.as_mut().expect("a value");
                    let at = rng.below(b.len() as u32) as usize;
                    b[at] ^= 4;
                }
                _ => {}
            }
            values.push(v);
            headers.push(if rng.below(8) == 0 { PageHeader { layer: h.layer + 1, ..h } } else { h });
        }
        let got = check_all(&values, &headers);
        assert_eq!(got.len(), values.len());
        for (i, ((g, v), h)) in got.into_iter().zip(&values).zip(&headers).enumerate() {
            let want = v.as_ref().map(|v| decode(v, h).map(|w| (w, v.len() as u64)));
            assert_eq!(g, want, "seed {seed}: value {i}");
        }
    }
}
