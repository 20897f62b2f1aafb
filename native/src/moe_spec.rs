//! `--moe E:K[:fitted]` and `--labels`: the MoEfication a command asks for, and making it (from
//! the disk cache when it can). Its own module because `run`, `eval`, `moefy`, `view` and the
//! route stage's options ([`crate::routing`], which `run` takes) all read it, below each of them.

use anyhow::{Context, Result, bail};
use expertkv_core::digest::{FNV_OFFSET, fnv1a};
use expertkv_model::gguf::Gguf;
use expertkv_model::moe::{Calibration, MoeConfig, Moefication};
use expertkv_model::tokenizer::Tokenizer;
use expertkv_model::{LlamaConfig, LlamaWeights, LoadOptions};

/// A MoEfication to make: its experts, and whether to fit the routers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MoeSpec {
    pub config: MoeConfig,
    pub fitted: bool,
}

/// `E:K` (`8:2`) or `E:K:fitted` as a MoEfication; `dense` or `none`: none.
pub fn parse_moe(spec: &str) -> Result<Option<MoeSpec>> {
    let spec = spec.trim();
    if spec == "dense" || spec == "none" {
        return Ok(None);
    }
    let parts: Vec<&str> = spec.split(':').map(str::trim).collect();
    let fitted = match parts.get(2) {
        None => false,
        Some(&"fitted") if parts.len() == 3 => true,
        Some(_) => bail!("--moe: expected E:K or E:K:fitted, got `{spec}`"),
    };
    let parsed = (parts.len() >= 2).then(|| Some((parts[0].parse::<usize>().ok()?, parts[1].parse::<usize>().ok()?))).flatten();
    match parsed {
        Some((e, k)) if e >= 1 && k >= 1 && k <= e => Ok(Some(MoeSpec { config: MoeConfig::new(e, k), fitted })),
        _ => bail!("--moe: expected E:K with 1 <= K <= E (for example 8:2, or 8:2:fitted) or dense, got `{spec}`"),
    }
}

/// A MoEfication ready to upload, and how it was had.
pub struct Moefied {
    pub moe: Moefication,
    /// `clustered in 0.43 s`, `clustered and routers fitted in 17.30 s`, or `loaded from the
    /// cache FILE in 0.9 s`; plus where it was cached, if it was.
    pub how: String,
}

/// MoEfications of one model file: its f32 weights are read once, and the calibration run that
/// fitted routers need (the dense model on the CPU over
/// [`expertkv_model::moe::CALIBRATION_TEXT`], about 25 s for SmolLM2 on two cores) is
/// made at most once, however many specs ask for one.
pub struct Moefier<'a> {
    g: &'a Gguf<'a>,
    bytes: &'a [u8],
    path: &'a std::path::Path,
    weights: Option<std::sync::Arc<LlamaWeights>>,
    calibration: Option<Calibration>,
}

impl<'a> Moefier<'a> {
    /// For the model in `bytes` (parsed as `g`), read from `path`.
    pub fn new(g: &'a Gguf<'a>, bytes: &'a [u8], path: &'a std::path::Path) -> Self {
        Moefier { g, bytes, path, weights: None, calibration: None }
    }

    /// The spec's MoEfication: from the disk cache when one was made for the same file and
    /// settings, else clustered (a few seconds for SmolLM2 on two cores) and, when asked, its
    /// routers fitted, then cached. The cache lives in `EXPERTKV_CACHE_DIR`, else
    /// `.expertkv-cache` beside the model file; its key is a hash of the file's bytes, the
    /// settings and the calibration text, so any change makes a new entry. A cache that cannot
    /// be read or written costs a recomputation and a note, never the run.
    pub fn moefy(&mut self, spec: &MoeSpec) -> Result<Moefied> {
        let t0 = std::time::Instant::now();
        let (g, bytes, path) = (self.g, self.bytes, self.path);
        let w = match &self.weights {
            Some(w) => w.clone(),
            None => {
                let lc = LlamaConfig::from_gguf(g)?;
                let w = LlamaWeights::from_gguf_with(g, &lc, LoadOptions { f32: true, raw: false })
                    .context("the model's weights for MoEfication")?;
                self.weights.insert(std::sync::Arc::new(w)).clone()
            }
        };
        let c = &spec.config;
        let key = {
            let mut h = fnv1a(FNV_OFFSET, bytes);
            let settings = format!("{}:{}:{}:{}:{}:{}", c.experts, c.top_k, c.seed, c.iterations, c.balanced, spec.fitted);
            h = fnv1a(h, settings.as_bytes());
            if spec.fitted {
                h = fnv1a(h, expertkv_model::moe::CALIBRATION_TEXT.as_bytes());
                h = fnv1a(h, &expertkv_model::moe::DEFAULT_RIDGE.to_le_bytes());
            }
            h
        };
        let dir = std::env::var_os("EXPERTKV_CACHE_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| path.parent().unwrap_or(std::path::Path::new(".")).join(".expertkv-cache"));
        let file = dir.join(format!("moe-{key:016x}.bin"));
        let mut note = String::new();
        if let Ok(cached) = std::fs::read(&file) {
            match Moefication::from_bytes(&cached, &w) {
                Ok(m) if m.config == *c && m.fitted.is_some() == spec.fitted => {
                    return Ok(Moefied {
                        moe: m,
                        how: format!("loaded from the cache {} in {:.2} s", file.display(), t0.elapsed().as_secs_f64()),
                    });
                }
                Ok(_) => note = format!(" (the cache {} held other settings: replaced)", file.display()),
                Err(e) => note = format!(" (the cache {} was unusable, {e}: replaced)", file.display()),
            }
        }
        let mut m = Moefication::from_weights(&w, c).context("MoEfication")?;
        if spec.fitted {
            let calib = match self.calibration.take() {
                Some(c) => c,
                None => {
                    let tok = Tokenizer::from_gguf(g).context("the model's tokenizer, for the calibration text")?;
                    let mut ids: Vec<u32> = tok.bos().filter(|_| tok.add_bos()).into_iter().collect();
                    ids.extend(tok.encode(expertkv_model::moe::CALIBRATION_TEXT));
                    let dense = expertkv_model::CpuModel::new(w.clone())?;
                    dense.calibration(&ids).context("the calibration run")?
                }
            };
            let fitted = m.fit_router(&w, &calib, expertkv_model::moe::DEFAULT_RIDGE);
            self.calibration = Some(calib);
            fitted.context("fitting the routers")?;
        }
        let secs = t0.elapsed().as_secs_f64();
        let made = if spec.fitted { "clustered and routers fitted" } else { "clustered" };
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        let written = m.to_bytes().map_err(anyhow::Error::from).and_then(|b| {
            std::fs::create_dir_all(&dir)?;
            std::fs::write(&tmp, b)?;
            std::fs::rename(&tmp, &file)?;
            Ok(())
        });
        let cached = match written {
            Ok(()) => format!("; cached in {}", file.display()),
            Err(e) => {
                let _ = std::fs::remove_file(&tmp);
                format!("; not cached ({e})")
            }
        };
        Ok(Moefied { moe: m, how: format!("{made} in {secs:.2} s{cached}{note}") })
    }
}
