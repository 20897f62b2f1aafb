// The browser demo's end-to-end test, run by `scripts/web.sh test`:
//   node e2e.mjs URL NATIVE.json STEPS SCREENSHOT.png
// NATIVE.json: the native run's `expertkv demo --config web/browser.toml --checksum --json`
// line ({"checksum", "steps", "fingerprint"}).
// 1. Headless Chromium with WebGPU (SwiftShader, on the CPU) loads the page, which runs
//    web/browser.toml for STEPS decode steps; the page's decision checksum (routing, evictions,
//    pool placement of every step) must equal the native run's, its attention-output
//    fingerprint (three sums of every step's output) must agree with the native one within
//    FINGERPRINT_RTOL, and a screenshot of the viewer beside the live pipeline is saved.
// 2. The same page in a Chromium without WebGPU must say so in the page instead of failing, and
//    a malformed URL option (`?steps=abc`, `?renderer=foo`) is named on the page.
// 3. The JS API (examples/web/index.html's page, served at /examples/): init(), loadModel() of
//    a small synthetic GGUF file served at /data/model.gguf under H2O with the recall tier, generate() streaming
//    through its callback, stats(); the generated token ids must equal the native `expertkv run
//    --json` of the same file, prompt and policy (API.json: {prompt, tokens, policy,
//    generated_ids}), the viewer beside the model (showViewer) must have drawn one snapshot per
//    generated token, and bad options must be refused with a message naming them. Skipped when
//    API.json is not given.
// Exit status 0 only when all hold.
import { chromium } from 'playwright-core';

import { readFileSync } from 'node:fs';

const [url, nativeFile, stepsArg, shot, apiFile] = process.argv.slice(2);
if (!url || !nativeFile || !stepsArg || !shot) {
  console.error('usage: node e2e.mjs URL NATIVE.json STEPS SCREENSHOT.png [API.json]');
  process.exit(2);
}
const native = JSON.parse(readFileSync(nativeFile, 'utf8'));
const expected = native.checksum;
// The two adapters run different attention kernels (summation orders): their outputs agree to
// about 1e-6; a dropped token, a broken reduce or corrupted K/V moves a sum by far more.
const FINGERPRINT_RTOL = 1e-4;

// The first step and sum where the fingerprints differ beyond the tolerance (the same rule as
// core::digest::fingerprint_difference), or null.
function fingerprintDifference(a, b, rtol) {
  if (!Array.isArray(a) || !Array.isArray(b) || a.length !== b.length || a.length % 3 !== 0) {
    return `fingerprints of ${a && a.length} and ${b && b.length} sums`;
  }
  // JSON carries NaN and infinities as null: anything not a finite number never agrees.
  const bad = [...a, ...b].findIndex((x) => typeof x !== 'number' || !Number.isFinite(x));
  if (bad >= 0) return `sum ${bad % a.length} is ${JSON.stringify([...a, ...b][bad])}, not a finite number`;
  let worst = 0;
  for (let i = 0; i < a.length; i += 3) {
    const scale = [Math.max(Math.abs(a[i]), Math.abs(b[i])), Math.max(Math.abs(a[i + 1]), Math.abs(b[i + 1])),
      Math.max(Math.abs(a[i]), Math.abs(b[i]))];
    for (let k = 0; k < 3; k++) {
      const d = Math.abs(a[i + k] - b[i + k]);
      if (!(d <= rtol * scale[k])) return `step ${i / 3}, sum ${k}: ${a[i + k]} against ${b[i + k]} (tolerance ${rtol} of ${scale[k]})`;
      worst = Math.max(worst, d / scale[k]);
    }
  }
  console.log(`fingerprint: ${a.length / 3} steps agree, worst relative difference ${worst.toExponential(2)} (tolerance ${rtol})`);
  return null;
}
const steps = Number(stepsArg);
const executablePath = process.env.CHROMIUM || '/usr/bin/chromium';
const common = ['--no-sandbox', '--disable-quic', '--no-first-run', '--disable-background-networking',
  '--disable-component-update', '--disable-sync'];
const timeoutMs = Number(process.env.EXPERTKV_WEB_TIMEOUT_S || 900) * 1000;

function fail(msg) {
  console.error(`FAIL: ${msg}`);
  process.exitCode = 1;
}

async function withWebGpu() {
  const browser = await chromium.launch({ executablePath, headless: true, args: [...common, '--enable-unsafe-webgpu'] });
  try {
    const page = await browser.newPage({ viewport: { width: 1400, height: 900 } });
    page.on('console', (m) => { if (m.type() === 'error' || m.type() === 'warning') console.log(`[page ${m.type()}] ${m.text()}`); });
    page.on('pageerror', (e) => console.log(`[page error] ${e.message}`));
    const target = `${url}${url.includes('?') ? '&' : '?'}steps=${steps}`;
    console.log(`loading ${target} (Chromium at ${executablePath}, WebGPU on)`);
    await page.goto(target);
    const t0 = Date.now();
    let last = '';
    for (;;) {
      const s = await page.evaluate(() => window.expertkv || null);
      const line = s ? `${s.phase} ${s.stepsDone ?? 0}/${s.steps ?? '?'}${s.adapter ? ' on ' + s.adapter : ''}` : 'loading';
      if (line !== last) {
        console.log(`  [${((Date.now() - t0) / 1000).toFixed(1)} s] ${line}`);
        last = line;
      }
      if (s && s.error) {
        fail(`the page stopped: ${s.error}`);
        await page.screenshot({ path: shot });
        return;
      }
      if (s && s.phase === 'finished') break;
      if (Date.now() - t0 > timeoutMs) {
        fail(`no result within ${timeoutMs / 1000} s (last state: ${line})`);
        await page.screenshot({ path: shot });
        return;
      }
      await page.waitForTimeout(500);
    }
    const r = await page.evaluate(() => window.expertkv);
    // Let the viewer draw the last step before the screenshot.
    await page.waitForTimeout(1500);
    await page.screenshot({ path: shot });
    console.log(`page: ${r.stepsDone} steps, checksum ${r.checksum}, adapter ${r.adapter}; native: ${expected}`);
    console.log(`screenshot: ${shot}`);
    if (r.stepsDone !== steps) fail(`the page ran ${r.stepsDone} steps, expected ${steps}`);
    if (!r.shippedConfig) fail('the page ran an edited configuration');
    if (r.checksum !== expected) fail(`decision checksum ${r.checksum} differs from the native run's ${expected}`);
    const diff = fingerprintDifference(r.fingerprint, native.fingerprint, FINGERPRINT_RTOL);
    if (diff) fail(`attention outputs differ from the native run's: ${diff}`);
  } finally {
    await browser.close();
  }
}

async function withoutWebGpu() {
  const browser = await chromium.launch({ executablePath, headless: true, args: common });
  try {
    const page = await browser.newPage();
    await page.goto(url);
    await page.waitForFunction(() => window.expertkv && (window.expertkv.phase === 'unsupported' || window.expertkv.error), null, {
      timeout: 60000,
    });
    const r = await page.evaluate(() => ({ state: window.expertkv, shown: !document.getElementById('nogpu').hidden,
      text: document.getElementById('nogpu').innerText }));
    console.log(`without WebGPU: phase ${r.state.phase}; the page says: ${r.text.split('\n')[0]}`);
    if (r.state.phase !== 'unsupported' || !r.shown || !/WebGPU/.test(r.text)) {
      fail(`a browser without WebGPU should see the message, got ${JSON.stringify(r.state)}`);
    }
  } finally {
    await browser.close();
  }
}

async function withApi() {
  const want = JSON.parse(readFileSync(apiFile, 'utf8'));
  const browser = await chromium.launch({ executablePath, headless: true, args: [...common, '--enable-unsafe-webgpu'] });
  try {
    const page = await browser.newPage();
    page.on('pageerror', (e) => console.log(`[api page error] ${e.message}`));
    const base = new URL(url);
    await page.goto(new URL('/examples/', base).href);
    await page.waitForFunction(() => /WebGPU:|cannot start/.test(document.getElementById('status').textContent), null, { timeout: 120000 });
    const r = await page.evaluate(async (want) => {
      try {
      const api = await import('/pkg/expertkv_web.js');
      const refused = async (f) => { try { await f(); return null; } catch (e) { return String(e); } };
      const adapter = await api.init();
      const bytes = new Uint8Array(await (await fetch('/data/model.gguf')).arrayBuffer());
      const early = await refused(() => api.generate('x', {}, null));
      const misspelt = await refused(() => api.loadModel(bytes, { sheduler: 'h2o' }));
      const info = await api.loadModel(bytes, want.policy);
      const streamed = [];
      const out = await api.generate(want.prompt, { maxTokens: want.tokens }, (text, id) => { streamed.push(id); });
      const stats = await api.stats();
      const badOption = await refused(() => api.generate('x', { maxTokenz: 3 }, null));
      // The viewer beside the model drew a snapshot per generated token.
      const t0 = performance.now();
      while (!(window.expertkvViewer && window.expertkvViewer.steps >= out.tokens.length) && performance.now() - t0 < 30000) {
        await new Promise((res) => setTimeout(res, 100));
      }
      const viewerSteps = window.expertkvViewer ? window.expertkvViewer.steps : null;
      return { adapter, info, out, streamed, stats, early, misspelt, badOption, viewerSteps };
      } catch (e) {
        return { error: String(e) };
      }
    }, want);
    if (r.error) {
      fail(`the JS API failed: ${r.error}`);
      return;
    }
    const modelShot = shot.replace(/\.png$/, '-model.png');
    await page.screenshot({ path: modelShot, fullPage: true });
    console.log(`screenshot of the model with the viewer: ${modelShot}`);
    console.log(`API on ${r.adapter}: ${r.info.layers} layers, generated ${JSON.stringify(r.out.tokens)}; native ${JSON.stringify(want.generated_ids)}`);
    console.log(`API stats: ${JSON.stringify(r.stats).slice(0, 160)}`);
    if (JSON.stringify(r.out.tokens) !== JSON.stringify(want.generated_ids)) fail('the API\'s tokens differ from the native run\'s');
    if (JSON.stringify(r.streamed) !== JSON.stringify(r.out.tokens)) fail(`onToken saw ${JSON.stringify(r.streamed)}`);
    if (r.stats.contextTokens !== r.out.promptTokens + r.out.tokens.length - 1) fail(`stats: ${JSON.stringify(r.stats)}`);
    if (r.info.scheduler !== 'h2o' || !(r.stats.evicted > 0)) fail(`the policy did not reach the model: ${JSON.stringify(r.info)}, ${JSON.stringify(r.stats)}`);
    // The recall tier kept every evicted token (in device memory: WebGPU cannot read host memory).
    const rc = r.stats.recall;
    if (!rc || rc.pages !== 2 || rc.captured !== r.stats.evicted || rc.dropped !== 0 || rc.hostMemory !== false) {
      fail(`the recall tier did not keep what H2O evicted: ${JSON.stringify(rc)}, evicted ${r.stats.evicted}`);
    }
    if (new Set(r.out.tokens).size < 4) fail(`a degenerate model: ${JSON.stringify(r.out.tokens)}`);
    if (r.viewerSteps !== r.out.tokens.length) fail(`the viewer beside the model drew ${r.viewerSteps} steps, not ${r.out.tokens.length}`);
    if (!/loadModel first/.test(r.early || '')) fail(`generate before loadModel: ${r.early}`);
    if (!/sheduler/.test(r.misspelt || '')) fail(`a misspelt option: ${r.misspelt}`);
    if (!/maxTokenz/.test(r.badOption || '')) fail(`an unknown generate option: ${r.badOption}`);
  } finally {
    await browser.close();
  }
}

// Malformed URL options are said on the page (the bar and window.expertkv.error), not ignored.
async function withBadOptions() {
  const browser = await chromium.launch({ executablePath, headless: true, args: [...common, '--enable-unsafe-webgpu'] });
  try {
    const page = await browser.newPage();
    for (const [option, needle] of [['steps=abc', '?steps=abc'], ['renderer=foo', 'renderer `foo`']]) {
      await page.goto(`${url}${url.includes('?') ? '&' : '?'}${option}`);
      await page.waitForFunction(() => window.expertkv && window.expertkv.error, null, { timeout: 60000 });
      const shown = await page.evaluate(() => document.getElementById('status').textContent);
      console.log(`?${option}: the page says: ${shown}`);
      if (!shown.includes(needle)) fail(`?${option} should be named on the page, got: ${shown}`);
    }
  } finally {
    await browser.close();
  }
}

await withWebGpu();
await withoutWebGpu();
await withBadOptions();
if (apiFile) await withApi();
if (process.exitCode) {
  console.error('browser test failed');
} else {
  console.log('browser test passed: the page\'s decisions equal the native run\'s and its attention outputs agree' +
    (apiFile ? '; the JS API generates the native run\'s tokens' : ''));
}
