// One 8-bit step of a radix search for the k-th key of a list (evict/select's victims,
// evict/quest_select's pages): the importer fills `hist` with the current digit of every key
// still in the running, and `radix_pick` walks it.

var<workgroup> hist: array<atomic<u32>, 256>;

// The digit whose bin holds the `rank`-th key (1-based, counting from bin 0), and that key's
// rank within the bin.
fn radix_pick(rank: u32) -> vec2<u32> {
    var r = rank;
    var d = 0u;
    loop {
        let c = atomicLoad(&hist[d]);
        if (r <= c || d == 255u) {
            break;
        }
        r -= c;
        d += 1u;
    }
    return vec2<u32>(d, r);
}
