//! The JS API (wasm32): decode a GGUF model on WebGPU from a web page.
//!
//! ```js
//! import initWasm, { init, loadModel, generate, stats } from './pkg/expertkv_web.js';
//! await initWasm();
//! const adapter = await init();                       // opens WebGPU; the adapter's name
//! const bytes = new Uint8Array(await file.arrayBuffer());
//! const info = await loadModel(bytes, { scheduler: 'h2o', budget: '25%', codec: 'int4' });
//! const out = await generate('The capital of France is', { maxTokens: 16 },
//!                            (text, id) => { output.textContent += text; });   // return false to stop
//! console.log(out.tokens, out.text, await stats());
//! await showViewer('canvas-id');  // optional, any time: the viewer beside the model
//! ```
//!
//! With the viewer shown (`showViewer`, `model_view.rs`), `loadModel` starts its run and
//! `generate` decodes one token a call into the model, sending the viewer a snapshot of the pool
//! after each (the same tokens as without it).
//!
//! Options are plain objects; a field this API does not know is an error naming it (nothing is
//! ignored). Every error rejects the promise with a message (a `string`). One call at a time: a
//! call made while another is running is refused, not queued.

use std::cell::RefCell;
use std::rc::Rc;

use expertkv_core::{Runtime, RuntimeOptions};
use expertkv_model::text::{GenerateOptions, Generation, KvPolicy, Piece, Stop, TextModel};
use expertkv_viewer::Event;

use crate::model_view;
use wasm_bindgen::prelude::*;

/// The page's one runtime and model. The model is taken out while a call uses it, so a second
/// call meanwhile finds it missing and says so.
#[derive(Default)]
struct State {
    rt: Option<Rc<Runtime>>,
    model: Option<TextModel>,
    busy: bool,
    loaded: Option<serde_json::Value>,
}

thread_local! {
    static STATE: RefCell<State> = RefCell::new(State::default());
}

fn err(e: impl std::fmt::Display) -> JsValue {
    JsValue::from_str(&e.to_string())
}

/// A JS options object (or `undefined`) read as `T`: unknown fields are errors naming them.
fn options<T: serde::de::DeserializeOwned + Default>(what: &str, v: &JsValue) -> Result<T, JsValue> {
    if v.is_undefined() || v.is_null() {
        return Ok(T::default());
    }
    let text = js_sys::JSON::stringify(v).map_err(|_| err(format!("{what}: not a plain object")))?;
    serde_json::from_str(&String::from(text)).map_err(|e| err(format!("{what}: {e}")))
}

fn to_js(v: &serde_json::Value) -> Result<JsValue, JsValue> {
    js_sys::JSON::parse(&v.to_string())
}

/// Mark the state busy for one call, or refuse.
fn begin(what: &str) -> Result<Rc<Runtime>, JsValue> {
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        if s.busy {
            return Err(err(format!("{what}: another call is still running (await it first)")));
        }
        let rt = s.rt.clone().ok_or_else(|| err(format!("{what}: call init() first")))?;
        s.busy = true;
        Ok(rt)
    })
}

fn end() {
    STATE.with(|s| s.borrow_mut().busy = false);
}

/// Open WebGPU (once; later calls return the same adapter). Resolves to the adapter's name.
#[wasm_bindgen]
pub async fn init() -> Result<String, JsValue> {
    if let Some(rt) = STATE.with(|s| s.borrow().rt.clone()) {
        return Ok(rt.info.name.clone());
    }
    let opts = RuntimeOptions { backends: wgpu::Backends::BROWSER_WEBGPU, ..RuntimeOptions::default() };
    let rt = Runtime::new(opts).await.map_err(|e| err(format!("opening WebGPU: {e}")))?;
    let name = rt.info.name.clone();
    STATE.with(|s| s.borrow_mut().rt = Some(Rc::new(rt)));
    Ok(name)
}

/// Load a GGUF file's bytes with a K/V policy (`{context, dtype, scheduler, budget, codec,
/// recall, recallBounds}`, all optional; `recall` keeps what an evicting scheduler removes and
/// attends that many of each list's best evicted pages, in device memory here: the same answers,
/// no device bytes saved), replacing any model loaded before. Resolves to the model's shape and
/// policy.
#[wasm_bindgen(js_name = loadModel)]
pub async fn load_model(bytes: Vec<u8>, policy: JsValue) -> Result<JsValue, JsValue> {
    let policy: KvPolicy = options("loadModel options", &policy)?;
    let rt = begin("loadModel")?;
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.model = None;
        s.loaded = None;
    });
    let loaded = TextModel::load_with_policy(&rt, &bytes, &policy).await;
    end();
    let model = loaded.map_err(|e| err(format!("loadModel: {e}")))?;
    let c = &model.llama().cfg;
    let info = serde_json::json!({
        "layers": c.block_count,
        "hidden": c.embedding_length,
        "heads": c.head_count,
        "kvHeads": c.head_count_kv,
        "headDim": c.head_dim,
        "vocab": c.vocab_size,
        "experts": c.expert_count,
        "context": model.llama().max_context(),
        "scheduler": model.llama().kv.scheduler.as_ref().map(|s| s.cfg.name()),
        "codec": model.llama().kv.pool.cfg.codec.name(),
        "recall": model.llama().kv.recall.as_ref().map(|t| serde_json::json!({
            "pages": t.cfg.pages, "candidates": t.cfg.candidates, "boundCandidates": t.cfg.bound_candidates,
            "hostMemory": t.host_memory,
        })),
    });
    if model_view::shown() {
        model_view::send(Event::Started(Box::new(model_view::run_info(&rt, &model, "the GGUF file given to loadModel"))));
        model_view::send(Event::Ready);
    }
    STATE.with(|s| {
        let mut s = s.borrow_mut();
        s.model = Some(model);
        s.loaded = Some(info.clone());
    });
    to_js(&info)
}

/// Feed `prompt` and generate greedily (`{maxTokens, stopAtEos}`), calling `onToken(text, id)`
/// for each token as it comes (return `false` to stop). The sequence continues across calls.
/// Resolves to `{tokens, text, promptTokens, stop}`.
#[wasm_bindgen]
pub async fn generate(prompt: String, opts: JsValue, on_token: Option<js_sys::Function>) -> Result<JsValue, JsValue> {
    let opts: GenerateOptions = options("generate options", &opts)?;
    let rt = begin("generate")?;
    let Some(mut model) = STATE.with(|s| s.borrow_mut().model.take()) else {
        end();
        return Err(err("generate: no model loaded (call loadModel first)"));
    };
    let mut callback_error = None;
    let mut on_piece = |piece: &Piece| {
        let Some(f) = &on_token else {
            return true;
        };
        match f.call2(&JsValue::NULL, &JsValue::from_str(&piece.text), &JsValue::from(piece.id)) {
            Ok(v) => v.as_bool() != Some(false),
            Err(e) => {
                callback_error = Some(e);
                false
            }
        }
    };
    let out = if model_view::shown() && opts.max_tokens > 0 {
        generate_viewed(&rt, &mut model, &prompt, &opts, &mut on_piece).await
    } else {
        model.generate(&rt, &prompt, &opts, &mut on_piece).await
    };
    STATE.with(|s| s.borrow_mut().model = Some(model));
    end();
    if let Some(e) = callback_error {
        return Err(e);
    }
    let out = out.map_err(|e| err(format!("generate: {e}")))?;
    to_js(&serde_json::json!({
        "tokens": out.tokens,
        "text": out.text,
        "promptTokens": out.prompt_tokens,
        "stop": match out.stop { Stop::MaxTokens => "maxTokens", Stop::Eos => "eos", Stop::Callback => "callback" },
    }))
}

/// [`TextModel::generate`] one token a call, with the viewer sent a snapshot of the pool after
/// each (the same tokens: a call continues the sequence where the last one stopped). The text is
/// decoded whole at the end, so a character split across tokens comes out whole there.
async fn generate_viewed(
    rt: &Runtime,
    model: &mut TextModel,
    prompt: &str,
    opts: &GenerateOptions,
    on_piece: &mut impl FnMut(&Piece) -> bool,
) -> expertkv_core::Result<Generation> {
    let mut out = Generation { prompt_tokens: 0, tokens: Vec::new(), text: String::new(), stop: Stop::MaxTokens };
    let mut shown = prompt.to_string();
    let one = GenerateOptions { max_tokens: 1, stop_at_eos: opts.stop_at_eos };
    for i in 0..opts.max_tokens {
        let g = model.generate(rt, if i == 0 { prompt } else { "" }, &one, &mut *on_piece).await?;
        if i == 0 {
            out.prompt_tokens = g.prompt_tokens;
        }
        out.tokens.extend(&g.tokens);
        shown.push_str(&g.text);
        match model_view::snapshot(rt, model, shown.clone()).await {
            Ok(snap) => model_view::send(Event::Step(Box::new(snap))),
            Err(e) => model_view::send(Event::Error(format!("capturing the pool: {e}"))),
        }
        if g.stop != Stop::MaxTokens {
            out.stop = g.stop;
            break;
        }
    }
    out.text = String::from_utf8_lossy(&model.tokenizer().decode_bytes(&out.tokens)?).into_owned();
    Ok(out)
}

/// The loaded model's K/V: `{contextTokens, maxContext, pagesInUse, kvBytesInUse,
/// fullCacheBytes, evicted, recall}` (`recall`: `null`, or the tier's `{pages, hostMemory,
/// captured, dropped, gpuBytes, hostBytes}`) and the model's shape (`model`).
#[wasm_bindgen]
pub async fn stats() -> Result<JsValue, JsValue> {
    let rt = begin("stats")?;
    let Some(model) = STATE.with(|s| s.borrow_mut().model.take()) else {
        end();
        return Err(err("stats: no model loaded (call loadModel first)"));
    };
    let st = model.stats(&rt).await;
    STATE.with(|s| s.borrow_mut().model = Some(model));
    end();
    let st = st.map_err(|e| err(format!("stats: {e}")))?;
    let loaded = STATE.with(|s| s.borrow().loaded.clone());
    to_js(&serde_json::json!({
        "contextTokens": st.context_tokens,
        "maxContext": st.max_context,
        "pagesInUse": st.pages_in_use,
        "kvBytesInUse": st.kv_bytes_in_use,
        "fullCacheBytes": st.full_cache_bytes,
        "evicted": st.evicted,
        "recall": st.recall.as_ref().map(|r| serde_json::json!({
            "pages": r.pages, "hostMemory": r.host_memory, "captured": r.captured, "dropped": r.dropped,
            "gpuBytes": r.gpu_bytes, "hostBytes": r.host_bytes,
        })),
        "model": loaded,
    }))
}
