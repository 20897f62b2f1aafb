//! The KV page store from the command line: `run --kv-store URL` (prefix reuse across
//! processes) and `expertkv store stats|clear|bench`.

use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Subcommand};
use expertkv_core::rng::Rng;
use expertkv_store::prefix::{StoreOptions, StoreReport, model_hash};
use expertkv_store::{PageStore, PrefixStore, RedisStore, StoreCodec, StoreSpill, redact};

use crate::fmt_bytes;

/// Where `run` keeps its prompt's pages for other processes.
#[derive(Args, Clone, Debug)]
pub struct KvStoreArgs {
    /// Share the prompt's K/V pages across processes through a Redis or Valkey server
    /// (redis://HOST:PORT/DB; redis://:PASSWORD@HOST:PORT/DB with AUTH): the longest run of the
    /// prompt's full pages the store holds is fetched instead of prefilled, and the prompt's
    /// full pages are stored after the run [default: off].
    #[arg(long, value_name = "URL")]
    pub kv_store: Option<String>,
    /// Keys start with NAME: (one server, several deployments).
    #[arg(long, default_value = "expertkv", value_name = "NAME")]
    pub kv_store_namespace: String,
    /// Stored pages expire after this many seconds [default: never].
    #[arg(long, value_name = "SECONDS")]
    pub kv_store_ttl: Option<u64>,
    /// How pages are kept in the store: raw (fetched bit for bit), int8 or int4 (KIVI, about
    /// 1/2 and 1/4 of f16 pages' bytes; f16 K/V only).
    #[arg(long, default_value = "raw", value_name = "CODEC")]
    pub kv_store_codec: String,
    /// Bound the server's memory (bytes, or with K, M or G): `CONFIG SET maxmemory` with the
    /// least recently used keys evicted past it; an evicted page is a miss [default: the
    /// server's setting].
    #[arg(long, value_name = "BYTES")]
    pub kv_store_max_bytes: Option<String>,
    /// With --scheduler flexgen: the store is the tier below host memory instead, and host
    /// memory keeps the K/V of at most N pages; the least attended beyond go to the store and
    /// come back when QUEST selects them [default: 0, every host-tier page in the store].
    #[arg(long, value_name = "N")]
    pub kv_store_host_pages: Option<u32>,
}

/// Bytes from `123`, `64K`, `512M`, `2G` (powers of 1024).
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    let (num, mul) = match t.char_indices().last() {
        Some((i, 'K' | 'k')) => (&t[..i], 1u64 << 10),
        Some((i, 'M' | 'm')) => (&t[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    let n: u64 = num.parse().map_err(|_| anyhow::anyhow!("`{s}`: give bytes as a whole number, optionally with K, M or G"))?;
    n.checked_mul(mul).filter(|&b| b > 0).ok_or_else(|| anyhow::anyhow!("`{s}`: give at least 1 byte and at most 2^64"))
}

impl KvStoreArgs {
    /// The store's options, or `None` without `--kv-store`.
    pub fn options(&self) -> Result<Option<StoreOptions>> {
        let Some(url) = &self.kv_store else {
            if self.kv_store_ttl.is_some()
                || self.kv_store_max_bytes.is_some()
                || self.kv_store_codec != "raw"
                || self.kv_store_host_pages.is_some()
            {
                bail!("--kv-store-ttl, --kv-store-codec, --kv-store-max-bytes and --kv-store-host-pages need --kv-store URL");
            }
            return Ok(None);
        };
        Ok(Some(StoreOptions {
            url: url.clone(),
            namespace: self.kv_store_namespace.clone(),
            ttl_s: self.kv_store_ttl,
            codec: StoreCodec::parse(&self.kv_store_codec)?,
            max_bytes: self.kv_store_max_bytes.as_deref().map(parse_bytes).transpose().context("--kv-store-max-bytes")?,
            timeout: Duration::from_secs(2),
        }))
    }

    /// Connected to the store for prefix reuse of the model file `bytes` run as `variant` (what
    /// else changes the K/V: a MoEfication's spec), or `None` without `--kv-store`; an
    /// unreachable or misconfigured store is an error naming the address tried.
    pub fn connect(&self, bytes: &[u8], variant: &str) -> Result<Option<PrefixStore>> {
        let Some(opts) = self.options()? else { return Ok(None) };
        if self.kv_store_host_pages.is_some() {
            bail!("--kv-store-host-pages limits FlexGen's host tier: give it with --scheduler flexgen");
        }
        let hash = expertkv_core::digest::fnv1a(model_hash(bytes), variant.as_bytes());
        let store = PrefixStore::connect(&opts, hash).with_context(|| format!("--kv-store {}", redact(&opts.url)))?;
        Ok(Some(store))
    }

    /// Connected to the store as FlexGen's spill tier (its pages under a key prefix of this
    /// process's own), with the host tier's page limit; `None` without `--kv-store`.
    pub fn spill(&self) -> Result<Option<(StoreSpill, u32)>> {
        let Some(opts) = self.options()? else { return Ok(None) };
        if opts.codec != StoreCodec::Raw || opts.ttl_s.is_some() {
            bail!(
                "--kv-store-codec and --kv-store-ttl apply to prefix pages; FlexGen's spilled pages are raw and removed when the run ends"
            );
        }
        expertkv_store::check_namespace(&opts.namespace)?;
        let mut r = RedisStore::connect(&opts.url, opts.timeout).with_context(|| format!("--kv-store {}", redact(&opts.url)))?;
        if let Some(b) = opts.max_bytes {
            r.set_max_memory(b)?;
        }
        let clock = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        let run = expertkv_core::digest::fnv1a(clock, &std::process::id().to_le_bytes());
        Ok(Some((StoreSpill::new(Box::new(r), &opts.namespace, run)?, self.kv_store_host_pages.unwrap_or(0))))
    }
}

/// `run`'s line about the store.
pub fn report_line(r: &StoreReport, prompt_tokens: usize) -> String {
    let mut line = format!(
        "kv store {}: {} of {prompt_tokens} prompt tokens fetched instead of prefilled ({} pages, {}, {:.3} s: replies {:.3}, checks {:.3}, pool {:.3}); {} pages stored ({}, {:.3} s), {} already there",
        r.addr,
        r.tokens_reused,
        r.pages_fetched,
        fmt_bytes(r.bytes_fetched),
        r.fetch_s,
        r.fetch_get_s,
        r.fetch_check_s,
        r.fetch_restore_s,
        r.pages_stored,
        fmt_bytes(r.bytes_stored),
        r.store_s,
        r.pages_present
    );
    if r.refused > 0 {
        line += &format!("; {} values refused ({})", r.refused, r.first_refusal.as_deref().unwrap_or(""));
    }
    line
}

/// A store's failure mid-run, as a warning (the run went on without it).
pub fn warn_failed(r: &StoreReport) {
    if let Some(f) = &r.failed {
        eprintln!("warning: {f}; the run went on without the store (its GPU and host tiers are whole)");
    }
}

#[derive(Args)]
pub struct StoreArgs {
    #[command(subcommand)]
    cmd: StoreCmd,
}

#[derive(Subcommand)]
enum StoreCmd {
    /// Keys and bytes under the namespace, the models they belong to, the server's memory.
    Stats(Target),
    /// Delete every key under the namespace.
    Clear(Target),
    /// Store and fetch throughput for values of one size (pipelined SETs, MGETs), GB/s.
    Bench(BenchArgs),
}

#[derive(Args)]
struct Target {
    /// The server: redis://HOST:PORT/DB.
    #[arg(long, value_name = "URL")]
    kv_store: String,
    /// Keys start with NAME:.
    #[arg(long, default_value = "expertkv", value_name = "NAME")]
    kv_store_namespace: String,
    /// One JSON line instead of text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    target: Target,
    /// Bytes per value (12,288 is a raw f16 page of SmolLM2: 16 positions x 3 KV heads x 64 x 2 x 2).
    #[arg(long, default_value = "12K")]
    value_bytes: String,
    /// Values written and read per round.
    #[arg(long, default_value_t = 2000)]
    values: u32,
    /// Rounds; the median is reported.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
}

fn connect(t: &Target) -> Result<RedisStore> {
    expertkv_store::check_namespace(&t.kv_store_namespace)?;
    RedisStore::connect(&t.kv_store, Duration::from_secs(5)).with_context(|| format!("--kv-store {}", redact(&t.kv_store)))
}

pub fn run(a: &StoreArgs) -> Result<()> {
    match &a.cmd {
        StoreCmd::Stats(t) => {
            let s = connect(t)?.stats(&t.kv_store_namespace)?;
            if t.json {
                println!("{}", serde_json::to_string(&s)?);
            } else {
                let server = match (s.server_used_bytes, s.server_max_bytes) {
                    (Some(u), Some(0)) => format!("; the server uses {} (no memory bound)", fmt_bytes(u)),
                    (Some(u), Some(m)) => format!("; the server uses {} of {}", fmt_bytes(u), fmt_bytes(m)),
                    _ => String::new(),
                };
                println!(
                    "{}: {} keys under `{}:` ({}), pages of {} model{}{server}",
                    s.addr,
                    s.keys,
                    t.kv_store_namespace,
                    fmt_bytes(s.value_bytes),
                    s.models,
                    if s.models == 1 { "" } else { "s" }
                );
            }
        }
        StoreCmd::Clear(t) => {
            let n = connect(t)?.clear(&t.kv_store_namespace)?;
            if t.json {
                println!("{}", serde_json::json!({ "deleted": n }));
            } else {
                println!("deleted {n} keys under `{}:`", t.kv_store_namespace);
            }
        }
        StoreCmd::Bench(b) => bench(b)?,
    }
    Ok(())
}

fn bench(b: &BenchArgs) -> Result<()> {
    let size = parse_bytes(&b.value_bytes).context("--value-bytes")?;
    if size > 512 << 20 || b.values == 0 || b.rounds == 0 || size * u64::from(b.values) > 4 << 30 {
        bail!("--value-bytes at most 512M, --values and --rounds at least 1, at most 4G in all (values x bytes)");
    }
    let mut s = connect(&b.target)?;
    let ns = format!("{}-bench", b.target.kv_store_namespace);
    let mut rng = Rng::new(0xbe9c);
    let items: Vec<(String, Vec<u8>)> =
        (0..b.values).map(|i| (format!("{ns}:{i}"), (0..size).map(|_| rng.next_u32() as u8).collect())).collect();
    let keys: Vec<String> = items.iter().map(|i| i.0.clone()).collect();
    let total = size * u64::from(b.values);
    let (mut put, mut get) = (Vec::new(), Vec::new());
    for _ in 0..b.rounds {
        s.clear(&ns)?;
        let t = Instant::now();
        s.put_many(&items, None)?;
        put.push(t.elapsed().as_secs_f64());
        let t = Instant::now();
        let back = s.get_many(&keys)?;
        get.push(t.elapsed().as_secs_f64());
        // Every value back whole.
        if let Some(i) = back.iter().zip(&items).position(|(g, w)| g.as_deref() != Some(w.1.as_slice())) {
            bail!("value {i} came back different from what was stored");
        }
    }
    s.clear(&ns)?;
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (p, g) = (median(&mut put), median(&mut get));
    println!(
        "{}",
        serde_json::json!({
            "measure": "kv_store_throughput",
            "addr": s.addr(),
            "value_bytes": size,
            "values": b.values,
            "keys_per_round_trip": expertkv_store::redis_store::BATCH_KEYS,
            "store_gb_per_s": total as f64 / p / 1e9,
            "fetch_gb_per_s": total as f64 / g / 1e9,
            "store_values_per_s": f64::from(b.values) / p,
            "fetch_values_per_s": f64::from(b.values) / g,
        })
    );
    Ok(())
}
