// shard_append, pass 3 of 3: copy each new token's K and V into its heads' pages and write their
// slot metadata. Dispatched once per pool buffer; x runs over the token's K/V words, y over tokens.

//!import common/pool.wgsl
//!import common/append.wgsl
//!import common/window.wgsl

@group(0) @binding(0) var<uniform> geo: Geometry;
@group(0) @binding(1) var<uniform> params: AppendParams;
@group(0) @binding(2) var<uniform> window: PoolWindow;
@group(0) @binding(3) var<storage, read> new_tokens: array<u32>;
@group(0) @binding(4) var<storage, read> new_kv: array<u32>;
@group(0) @binding(5) var<storage, read_write> plan: array<TokenPlan>;
@group(0) @binding(6) var<storage, read> ring_pages: array<u32>;
@group(0) @binding(7) var<storage, read> ctl: PoolCtl;
@group(0) @binding(8) var<storage, read_write> pool: array<u32>;
@group(0) @binding(9) var<storage, read_write> slot_meta: array<u32>;
@group(0) @binding(10) var<storage, read_write> page_meta: array<PageMeta>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.y;
    let w = gid.x;
    let vw = geo.vec_words;
    let H = geo.kv_heads;
    let token_kv_words = 2u * H * vw;
    if (i >= params.n_tokens || w >= token_kv_words || ctl.abort != 0u) {
        return;
    }
    // Word w of the token is (kv, head, j); its place in the head's page is [kv][slot][j].
    let kv = w / (H * vw);
    let head = (w / vw) % H;
    let j = w % vw;
    let item = i * H + head;
    let p = plan[item];
    let page = ring_pages[p.key * geo.ring_capacity + p.ring_index];
    if (!in_window(window, page)) {
        return;
    }
    let local_page = page - window.first_page;
    let dst = local_page * geo.page_words + kv * block_words(geo) + p.slot * vw + j;
    pool[dst] = new_kv[i * token_kv_words + w];

    if (kv == 0u && j == 0u) {
        let base = i * params.token_words;
        let m = (page * geo.page_size + p.slot) * geo.meta_words;
        slot_meta[m + META_POSITION] = new_tokens[base + TOKEN_POSITION];
        slot_meta[m + META_LAST_ACCESS] = params.step;
        slot_meta[m + META_ACCESS_COUNT] = 0u;
        for (var e = 0u; e < 2u * geo.top_k; e++) {
            slot_meta[m + META_EXPERTS + e] = new_tokens[base + TOKEN_EXPERTS + e];
        }
        slot_meta[m + meta_attn(geo)] = 0u;  // f32 0.0
        if ((p.flags & PLAN_LAST_IN_PAGE) != 0u) {
            page_meta[page].fill = p.slot + 1u;
        }
        plan[item].page = page;
    }
}
