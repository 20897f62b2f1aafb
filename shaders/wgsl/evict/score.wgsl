// evict, pass 1: every cached slot's utility under the configured scheduler, as an orderable key
// (higher is kept longer). One invocation per pool slot.
//   H2O:        accumulated attention mass; sinks and the recent window protected
//   StreamingLLM, Duo: position (older goes first); sinks protected
//   LRU:        step of last attention read
//   LRU+:       w_recency * last_access / step + w_freq * ln(1 + accesses) + w_attn * mass;
//               sinks and window protected
//   AdaKV:      accumulated attention mass (budgets per head come from evict/budget)

//!import common/pool.wgsl
//!import common/evict.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: EvictParams;
@group(0) @binding(2) var<storage, read> page_meta: array<PageMeta>;
@group(0) @binding(3) var<storage, read> slot_meta: array<u32>;
@group(0) @binding(4) var<storage, read> seq_lens: array<u32>;
@group(0) @binding(5) var<storage, read_write> utility: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let slot = gid.x + gid.y * 65535u * 64u;
    let page = slot / geo.page_size;
    if (page >= geo.n_pages + geo.codec_pages) {
        return;
    }
    let pm = page_meta[page];
    if (pm.owner == NO_OWNER || slot % geo.page_size >= pm.fill) {
        return;
    }
    let seq = (pm.owner / (geo.kv_heads * geo.n_shards)) % geo.max_seqs;
    let m = slot * geo.meta_words;
    let pos = slot_meta[m + META_POSITION];
    let last = slot_meta[m + META_LAST_ACCESS];
    let count = slot_meta[m + META_ACCESS_COUNT];
    let mass = bitcast<f32>(slot_meta[m + meta_attn(geo)]);
    let len = seq_lens[seq];
    let sink = pos < params.sinks;
    let recent = pos + params.window >= len;
    var key = 0u;
    switch params.policy {
        case 1u, 5u: {
            key = select(orderable(f32(pos)), PROTECTED, sink);
        }
        case 2u: {
            key = orderable(f32(last));
        }
        case 3u: {
            let u = params.w_recency * f32(last) / f32(max(params.step, 1u)) + params.w_freq * log(1.0 + f32(count)) + params.w_attn * mass;
            key = select(orderable(u), PROTECTED, sink || recent);
        }
        default: {
            key = select(orderable(mass), PROTECTED, sink || recent);
        }
    }
    utility[slot] = key;
}
