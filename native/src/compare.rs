//! `expertkv compare A B`: two model traces (`run --trace`) side by side, pass by pass: where
//! their routing, their expert residency and their K/V page counts first part, and each one's
//! traffic.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use expertkv_model::forward::trace::{ModelTrace, compare, read_model_trace};

use crate::fmt_bytes;

#[derive(Args)]
pub struct CompareArgs {
    /// A trace written by `run --trace`.
    a: PathBuf,
    /// Another, compared with it.
    b: PathBuf,
    /// One JSON object instead of the text.
    #[arg(long)]
    json: bool,
}

fn read(path: &PathBuf) -> Result<ModelTrace> {
    let f = std::fs::File::open(path).with_context(|| format!("cannot open the trace {}", path.display()))?;
    read_model_trace(std::io::BufReader::new(f)).with_context(|| format!("{} is not a readable model trace", path.display()))
}

pub fn run(a: &CompareArgs) -> Result<()> {
    let (x, y) = (read(&a.a)?, read(&a.b)?);
    let (ha, ta, hb, tb) = (&x.header, &x.passes, &y.header, &y.passes);
    let c = compare(ta, tb);
    if a.json {
        println!("{}", serde_json::json!({ "a": ha, "b": hb, "torn": [x.torn, y.torn], "comparison": c }));
        return Ok(());
    }
    for (name, t) in [("A", &x), ("B", &y)] {
        let prefill = t.passes.iter().filter(|p| p.prefill).count();
        let torn = if t.torn { " (its last record cut short: left out)" } else { "" };
        println!(
            "{name}: {} (hash {}), {} passes ({prefill} prefill chunks){torn}; {}",
            t.header.model,
            t.header.model_hash,
            t.passes.len(),
            t.header.options
        );
    }
    if ha.model_hash != hb.model_hash {
        println!("the traces are of different model files: their routing need not agree");
    }
    let both = c.passes[0].min(c.passes[1]);
    if c.passes[0] != c.passes[1] {
        println!("the traces hold {} and {} passes: compared over the first {both}", c.passes[0], c.passes[1]);
    }
    let at = |what: &str, pass: Option<usize>| match pass {
        None => println!("{what}: equal over the {both} passes both hold"),
        Some(p) => println!("{what}: parts at pass {p}"),
    };
    at("routing (tokens, positions, chosen experts)", c.routing_parts_at);
    if let Some(p) = c.routing_parts_at {
        let (x, y) = (&ta[p], &tb[p]);
        if let Some(l) = (0..x.experts.len().max(y.experts.len())).find(|&l| x.experts.get(l) != y.experts.get(l)) {
            println!("  layer {l}: A chose {:?}, B {:?}", x.experts.get(l), y.experts.get(l));
        } else {
            println!("  A fed {:?} at {:?}, B {:?} at {:?}", x.fed, x.positions, y.fed, y.positions);
        }
    }
    at("expert residency (fetches)", c.residency_parts_at);
    at("K/V page counts (in use, moved between tiers)", c.kv_parts_at);
    println!(
        "experts fetched: A {} ({}), B {} ({}); K/V pages moved between GPU and host: A {}, B {}",
        c.expert_misses[0],
        fmt_bytes(c.expert_bytes[0]),
        c.expert_misses[1],
        fmt_bytes(c.expert_bytes[1]),
        c.kv_pages_moved[0],
        c.kv_pages_moved[1]
    );
    Ok(())
}
