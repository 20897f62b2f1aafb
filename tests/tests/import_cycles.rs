//! No import cycles between the files of a crate (issue #55). The arrows are the names one file
//! takes from another: `use` declarations (grouped, renamed, glob, `pub use`, inside function
//! bodies too) and paths written out in code (`crate::a::B`, `super::b::C`, `self::`, the crate's
//! own name, `$crate`). A path resolves to the deepest module it names, following re-exports to
//! where the name is defined (`crate::KvPool` is `append::KvPool` when the root re-exports it), so a
//! re-export cannot hide an arrow. Containment is not an arrow: a `mod` declaration, or a path
//! from a module to its own ancestor or descendant. Test-only code (`#[cfg(test)]` items and the
//! files they declare) and the `tests/` folders are left out: tests may reach anywhere.
//!
//! Plain token scanning, no parser dependency: the checker only needs paths, and its own tests
//! below pin the forms it must understand, so that it cannot pass by seeing nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// Cycles tolerated for now, each the exact set of files of one strongly connected component. An
/// entry that no longer matches a cycle fails the test too, so the list cannot go stale.
const KNOWN_CYCLES: &[&[&str]] = &[];

#[test]
fn no_import_cycles_in_any_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let crates = workspace_crates(&root);
    assert!(crates.len() >= 8, "found only {} crates in the workspace manifest", crates.len());
    let graph = Graph::build(&crates, &|p| std::fs::read_to_string(root.join(p)).ok()).unwrap_or_else(|e| panic!("{e}"));

    // Every source file is seen (a module the walk missed would hide its arrows).
    let mut unseen = Vec::new();
    for c in &crates {
        for f in rust_files(&root, &format!("{}/src", c.dir)) {
            if !graph.files.contains(&f) && !graph.test_files.contains(&f) {
                unseen.push(f);
            }
        }
    }
    assert!(unseen.is_empty(), "files under src/ that no crate root reaches through `mod`: {unseen:?}");
    assert!(graph.files.len() > 100 && graph.arrows.len() > 100, "{} files, {} arrows: too few", graph.files.len(), graph.arrows.len());

    if let Err(report) = check(&graph, KNOWN_CYCLES) {
        panic!("{report}");
    }
}

/// The cycles of `graph` against `known`: an error listing every cycle not in `known` with the
/// arrows and names that tie it, and every entry of `known` that is no longer a cycle.
fn check(graph: &Graph, known: &[&[&str]]) -> Result<(), String> {
    let cycles = graph.cycles();
    let known: Vec<BTreeSet<String>> = known.iter().map(|k| k.iter().map(|s| s.to_string()).collect()).collect();
    let mut report = String::new();
    for c in cycles.iter().filter(|c| !known.contains(c)) {
        let _ = writeln!(report, "import cycle of {} files (move what they share into a module below them):", c.len());
        for ((from, to), names) in graph.arrows.iter().filter(|((f, t), _)| c.contains(f) && c.contains(t)) {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let _ = writeln!(report, "  {from} -> {to} ({})", names.join(", "));
        }
    }
    for k in known.iter().filter(|k| !cycles.contains(k)) {
        let _ = writeln!(report, "listed in KNOWN_CYCLES but no longer a cycle (remove it): {k:?}");
    }
    if report.is_empty() { Ok(()) } else { Err(report) }
}

/// One crate of the workspace: its folder, its library's name in paths, its root files.
struct Crate {
    dir: String,
    lib_name: Option<String>,
    lib_root: Option<String>,
    bin_roots: Vec<String>,
}

/// The members of the root `Cargo.toml` and, from each manifest, the library and binary roots.
fn workspace_crates(root: &Path) -> Vec<Crate> {
    let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("the workspace Cargo.toml");
    let members = manifest.split_once("members").and_then(|(_, rest)| rest.split_once(']')).expect("a `members = [...]` list").0;
    quoted(members)
        .into_iter()
        .map(|dir| {
            let m = std::fs::read_to_string(root.join(&dir).join("Cargo.toml")).unwrap_or_else(|e| panic!("{dir}/Cargo.toml: {e}"));
            let (mut package, mut lib_name, mut lib_path, mut has_lib, mut bins) = (None, None, None, false, Vec::new());
            let mut section = String::new();
            for line in m.lines().map(str::trim) {
                if line.starts_with('[') {
                    section = line.to_string();
                    has_lib |= section == "[lib]";
                    continue;
                }
                let Some((key, value)) = line.split_once('=') else { continue };
                let value = quoted(value).into_iter().next();
                match (section.as_str(), key.trim()) {
                    ("[package]", "name") => package = value,
                    ("[lib]", "name") => lib_name = value,
                    ("[lib]", "path") => lib_path = value,
                    ("[[bin]]", "path") => bins.extend(value),
                    _ => {}
                }
            }
            let exists = |p: &str| root.join(&dir).join(p).is_file();
            let lib_path = lib_path.or_else(|| exists("src/lib.rs").then(|| "src/lib.rs".to_string()));
            has_lib |= lib_path.is_some();
            if exists("src/main.rs") && !bins.iter().any(|b| b == "src/main.rs") {
                bins.push("src/main.rs".into());
            }
            for b in rust_files(root, &format!("{dir}/src/bin")) {
                bins.push(b[dir.len() + 1..].to_string());
            }
            let package = package.unwrap_or_else(|| panic!("{dir}/Cargo.toml names no package"));
            Crate {
                lib_name: has_lib.then(|| lib_name.unwrap_or(package).replace('-', "_")),
                lib_root: lib_path.map(|p| format!("{dir}/{p}")),
                bin_roots: bins.into_iter().map(|b| format!("{dir}/{b}")).collect(),
                dir,
            }
        })
        .collect()
}

/// The double-quoted strings of a line.
fn quoted(s: &str) -> Vec<String> {
    s.split('"').skip(1).step_by(2).map(str::to_string).collect()
}

/// Every `.rs` file under `root/dir`, as paths relative to `root` with `/`.
fn rust_files(root: &Path, dir: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut stack = vec![PathBuf::from(dir)];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(root.join(&d)) else { continue };
        for e in entries.flatten() {
            let rel = d.join(e.file_name());
            if e.path().is_dir() {
                stack.push(rel);
            } else if rel.extension().is_some_and(|x| x == "rs") {
                out.push(rel.to_string_lossy().replace('\\', "/"));
            }
        }
    }
    out.sort();
    out
}

// ---- Tokens -------------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`.
    Sep,
    Punct(char),
    /// A string, char, number or lifetime: never part of a path.
    Lit,
}

/// Rust source as tokens, without comments (doc comments included) and with every literal one
/// opaque token, so that text in them is never read as a path.
fn lex(src: &str) -> Vec<Tok> {
    let c: Vec<char> = src.chars().collect();
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let ident_start = |ch: char| ch == '_' || ch.is_alphabetic();
    let ident_char = |ch: char| ch == '_' || ch.is_alphanumeric();
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let ch = c[i];
        if ch.is_whitespace() {
            i += 1;
        } else if ch == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if ch == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if c[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if c[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
        } else if let Some(end) = raw_string_end(&c, i) {
            i = end;
            out.push(Tok::Lit);
        } else if ch == '"' || (matches!(ch, 'b' | 'c') && at(i + 1) == '"') {
            i += if ch == '"' { 1 } else { 2 };
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(Tok::Lit);
        } else if ch == '\'' || (ch == 'b' && at(i + 1) == '\'') {
            i += if ch == 'b' { 1 } else { 0 };
            if at(i + 1) == '\\' {
                i += 2;
                while i < c.len() && c[i] != '\'' {
                    i += 1;
                }
                i += 1;
            } else if at(i + 2) == '\'' {
                i += 3;
            } else {
                // A lifetime or a label.
                i += 1;
                while i < c.len() && ident_char(c[i]) {
                    i += 1;
                }
            }
            out.push(Tok::Lit);
        } else if ch == 'r' && at(i + 1) == '#' && ident_start(at(i + 2)) {
            let start = i + 2;
            i = start;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            out.push(Tok::Ident(c[start..i].iter().collect()));
        } else if ident_start(ch) {
            let start = i;
            while i < c.len() && ident_char(c[i]) {
                i += 1;
            }
            out.push(Tok::Ident(c[start..i].iter().collect()));
        } else if ch.is_ascii_digit() {
            while i < c.len() && (ident_char(c[i]) || (c[i] == '.' && at(i + 1).is_ascii_digit())) {
                i += 1;
            }
            out.push(Tok::Lit);
        } else if ch == ':' && at(i + 1) == ':' {
            i += 2;
            out.push(Tok::Sep);
        } else {
            i += 1;
            out.push(Tok::Punct(ch));
        }
    }
    out
}

/// Where a raw string (`r"…"`, `r#"…"#`, `br"…"`, `cr#"…"#`) starting at `i` ends, if one does.
fn raw_string_end(c: &[char], i: usize) -> Option<usize> {
    let mut j = i + usize::from(matches!(c[i], 'b' | 'c'));
    if c.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = c[j..].iter().take_while(|&&h| h == '#').count();
    j += hashes;
    if c.get(j) != Some(&'"') {
        return None;
    }
    j += 1;
    while j < c.len() {
        if c[j] == '"' && c[j + 1..].iter().take(hashes).filter(|&&h| h == '#').count() == hashes {
            return Some(j + 1 + hashes);
        }
        j += 1;
    }
    Some(c.len())
}

// ---- Modules and arrows -------------------------------------------------------------------

type ModId = usize;

struct Module {
    /// The file that holds it (an inline `mod x { }` is its file's).
    file: String,
    parent: Option<ModId>,
    name: String,
    children: BTreeMap<String, ModId>,
    /// Names of the items defined here (what a re-export chain ends at).
    items: BTreeSet<String>,
    /// Its module-level `use` declarations: the name each brings in (`None`: a glob) and its path.
    bindings: Vec<(Option<String>, Vec<String>)>,
    /// The crate's roots: `(own library name, library root)`, to resolve `crate` and the name.
    tree_root: ModId,
    lib_root: Option<(String, ModId)>,
}

/// A path to resolve later (every module must be known first): from which module, its segments.
struct PathUse {
    from: ModId,
    segs: Vec<String>,
}

/// The files of every crate and the arrows between them, with the names that make each arrow.
struct Graph {
    files: BTreeSet<String>,
    /// Files only compiled for tests (declared under `#[cfg(test)]`).
    test_files: BTreeSet<String>,
    arrows: BTreeMap<(String, String), BTreeSet<String>>,
}

struct Builder<'a> {
    read: &'a dyn Fn(&str) -> Option<String>,
    mods: Vec<Module>,
    paths: Vec<PathUse>,
    test_files: BTreeSet<String>,
}

impl Graph {
    /// Walk every crate from its roots through `mod` declarations, reading files with `read`
    /// (paths relative to the workspace root).
    fn build(crates: &[Crate], read: &dyn Fn(&str) -> Option<String>) -> Result<Graph, String> {
        let mut b = Builder { read, mods: Vec::new(), paths: Vec::new(), test_files: BTreeSet::new() };
        for c in crates {
            let lib = match (&c.lib_root, &c.lib_name) {
                (Some(root), Some(name)) => Some((name.clone(), b.load_root(root, Lib::Itself(name))?)),
                _ => None,
            };
            for root in &c.bin_roots {
                b.load_root(root, Lib::Other(lib.clone()))?;
            }
        }
        let mut arrows: BTreeMap<(String, String), BTreeSet<String>> = BTreeMap::new();
        for p in &b.paths {
            let Some((to, name)) = b.resolve(p.from, &p.segs, 0) else { continue };
            if b.is_ancestor(to, p.from) || b.is_ancestor(p.from, to) {
                continue;
            }
            let (from_file, to_file) = (&b.mods[p.from].file, &b.mods[to].file);
            if from_file != to_file {
                arrows.entry((from_file.clone(), to_file.clone())).or_default().insert(name);
            }
        }
        let files = b.mods.iter().map(|m| m.file.clone()).collect();
        Ok(Graph { files, test_files: b.test_files, arrows })
    }

    /// The strongly connected components of more than one file (Tarjan).
    fn cycles(&self) -> Vec<BTreeSet<String>> {
        let nodes: Vec<&String> = self.files.iter().collect();
        let index_of: BTreeMap<&String, usize> = nodes.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let mut next: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
        for (from, to) in self.arrows.keys() {
            if let (Some(&f), Some(&t)) = (index_of.get(from), index_of.get(to)) {
                next[f].push(t);
            }
        }
        struct Tarjan<'g> {
            next: &'g [Vec<usize>],
            index: Vec<Option<usize>>,
            low: Vec<usize>,
            on_stack: Vec<bool>,
            stack: Vec<usize>,
            counter: usize,
            sccs: Vec<Vec<usize>>,
        }
        impl Tarjan<'_> {
            fn visit(&mut self, v: usize) {
                self.index[v] = Some(self.counter);
                self.low[v] = self.counter;
                self.counter += 1;
                self.stack.push(v);
                self.on_stack[v] = true;
                for &w in &self.next[v] {
                    match self.index[w] {
                        None => {
                            self.visit(w);
                            self.low[v] = self.low[v].min(self.low[w]);
                        }
                        Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                        Some(_) => {}
                    }
                }
                if Some(self.low[v]) == self.index[v] {
                    let mut scc = Vec::new();
                    while let Some(w) = self.stack.pop() {
                        self.on_stack[w] = false;
                        scc.push(w);
                        if w == v {
                            break;
                        }
                    }
                    self.sccs.push(scc);
                }
            }
        }
        let n = nodes.len();
        let mut t = Tarjan {
            next: &next,
            index: vec![None; n],
            low: vec![0; n],
            on_stack: vec![false; n],
            stack: Vec::new(),
            counter: 0,
            sccs: Vec::new(),
        };
        for v in 0..n {
            if t.index[v].is_none() {
                t.visit(v);
            }
        }
        let mut out: Vec<BTreeSet<String>> =
            t.sccs.into_iter().filter(|s| s.len() > 1).map(|s| s.into_iter().map(|i| nodes[i].clone()).collect()).collect();
        out.sort();
        out
    }
}

/// The library a crate root's own crate name stands for.
enum Lib<'a> {
    /// The root is the library (of this name).
    Itself(&'a str),
    /// The root is a binary of a package with this library, or none.
    Other(Option<(String, ModId)>),
}

impl Builder<'_> {
    fn load_root(&mut self, file: &str, lib: Lib<'_>) -> Result<ModId, String> {
        let id = self.mods.len();
        let lib_root = match lib {
            Lib::Itself(name) => Some((name.to_string(), id)),
            Lib::Other(l) => l,
        };
        self.mods.push(Module {
            file: file.to_string(),
            parent: None,
            name: "crate".into(),
            children: BTreeMap::new(),
            items: BTreeSet::new(),
            bindings: Vec::new(),
            tree_root: id,
            lib_root,
        });
        let dir = file.rsplit_once('/').map_or("", |(d, _)| d).to_string();
        self.load_file(id, file, &dir)?;
        Ok(id)
    }

    fn load_file(&mut self, module: ModId, file: &str, child_dir: &str) -> Result<(), String> {
        let src = (self.read)(file).ok_or_else(|| format!("cannot read {file}"))?;
        let toks = lex(&src);
        let mut pos = 0;
        self.items(&toks, &mut pos, module, child_dir, true)
    }

    fn new_module(&mut self, parent: ModId, name: &str, file: &str) -> ModId {
        let id = self.mods.len();
        let (tree_root, lib_root) = (self.mods[parent].tree_root, self.mods[parent].lib_root.clone());
        self.mods.push(Module {
            file: file.to_string(),
            parent: Some(parent),
            name: name.to_string(),
            children: BTreeMap::new(),
            items: BTreeSet::new(),
            bindings: Vec::new(),
            tree_root,
            lib_root,
        });
        self.mods[parent].children.insert(name.to_string(), id);
        id
    }

    /// The file of child module `name` declared in a module whose children live in `dir`.
    fn child_file(&self, dir: &str, name: &str) -> Option<String> {
        let join = |p: &str| if dir.is_empty() { p.to_string() } else { format!("{dir}/{p}") };
        [join(&format!("{name}.rs")), join(&format!("{name}/mod.rs"))].into_iter().find(|p| (self.read)(p).is_some())
    }

    /// The items of a module (`module_level`) or of an `impl`/`trait` block, up to the closing
    /// `}` or the end of the file.
    fn items(&mut self, t: &[Tok], pos: &mut usize, module: ModId, dir: &str, module_level: bool) -> Result<(), String> {
        while *pos < t.len() {
            let mut test_only = false;
            match &t[*pos] {
                Tok::Punct('}') => {
                    *pos += 1;
                    return Ok(());
                }
                Tok::Punct(';') => {
                    *pos += 1;
                    continue;
                }
                _ => {}
            }
            while t.get(*pos) == Some(&Tok::Punct('#')) {
                let inner = t.get(*pos + 1) == Some(&Tok::Punct('!'));
                *pos += 1 + usize::from(inner);
                let start = *pos + 1;
                skip_group(t, pos);
                let attr = &t[start.min(*pos)..(*pos - 1).max(start)];
                if attr.first() == Some(&Tok::Ident("path".into())) {
                    return Err(format!("#[path] in {}: the checker does not follow it", self.mods[module].file));
                }
                test_only |= !inner && is_cfg_test(attr);
            }
            if t.get(*pos) == Some(&ident("pub")) {
                *pos += 1;
                if t.get(*pos) == Some(&Tok::Punct('(')) {
                    skip_group(t, pos);
                }
            }
            let words = [word(t, *pos), word(t, *pos + 1), word(t, *pos + 2), word(t, *pos + 3)];
            if words[0] == "use" && t.get(*pos + 1) != Some(&Tok::Punct('<')) {
                *pos += 1;
                let mut found = Vec::new();
                use_tree(t, pos, &[], &mut found);
                if !test_only {
                    for (name, segs) in found {
                        self.paths.push(PathUse { from: module, segs: segs.clone() });
                        if module_level {
                            self.mods[module].bindings.push((name, segs));
                        }
                    }
                }
            } else if words[0] == "mod" && module_level {
                let name = words[1].to_string();
                *pos += 2;
                let inline = t.get(*pos) == Some(&Tok::Punct('{'));
                let file = if inline { None } else { self.child_file(dir, &name) };
                if test_only {
                    self.test_files.extend(file);
                    if inline {
                        skip_group(t, pos);
                    }
                } else if inline {
                    let f = self.mods[module].file.clone();
                    let child = self.new_module(module, &name, &f);
                    *pos += 1;
                    self.items(t, pos, child, &format!("{dir}/{name}"), true)?;
                } else {
                    let file = file.ok_or_else(|| format!("{}: `mod {name};` has no file", self.mods[module].file))?;
                    let child = self.new_module(module, &name, &file);
                    let child_dir = match file.strip_suffix("/mod.rs") {
                        Some(d) => d.to_string(),
                        None => file.trim_end_matches(".rs").to_string(),
                    };
                    self.load_file(child, &file, &child_dir)?;
                }
            } else if let Some(k) = block_item(&words, t.get(*pos + 1)) {
                // `impl`, `trait`, `extern { }`: a header, then items of the same module.
                if words[k - 1] == "trait" && module_level && !test_only {
                    self.mods[module].items.insert(words[k].to_string());
                }
                *pos += k;
                let start = *pos;
                while *pos < t.len() && t[*pos] != Tok::Punct('{') && t[*pos] != Tok::Punct(';') {
                    if matches!(t[*pos], Tok::Punct('(' | '[')) {
                        skip_group(t, pos);
                    } else {
                        *pos += 1;
                    }
                }
                if test_only {
                    if t.get(*pos) == Some(&Tok::Punct('{')) {
                        skip_group(t, pos);
                    }
                    continue;
                }
                self.scan(t, start, *pos, module);
                if t.get(*pos) == Some(&Tok::Punct('{')) {
                    *pos += 1;
                    self.items(t, pos, module, dir, false)?;
                }
            } else {
                let start = *pos;
                skip_item(t, pos);
                if !test_only {
                    if let Some(name) = item_name(&t[start..*pos]).filter(|_| module_level) {
                        self.mods[module].items.insert(name);
                    }
                    self.scan(t, start, *pos, module);
                }
            }
        }
        Ok(())
    }

    /// Paths written out in `t[start..end]`, and `use` declarations inside bodies.
    fn scan(&mut self, t: &[Tok], start: usize, end: usize, module: ModId) {
        let mut i = start;
        while i < end {
            let after_sep = i > 0 && t[i - 1] == Tok::Sep;
            let dollar = i > 0 && t[i - 1] == Tok::Punct('$');
            match &t[i] {
                Tok::Ident(w) if w == "use" && t.get(i + 1) != Some(&Tok::Punct('<')) => {
                    let mut p = i + 1;
                    let mut found = Vec::new();
                    use_tree(t, &mut p, &[], &mut found);
                    self.paths.extend(found.into_iter().map(|(_, segs)| PathUse { from: module, segs }));
                    i = p.max(i + 1);
                }
                Tok::Ident(w) if !after_sep && t.get(i + 1) == Some(&Tok::Sep) && self.starts_path(w, module) => {
                    let mut segs = vec![if dollar { "crate".to_string() } else { w.clone() }];
                    let mut j = i + 1;
                    while t.get(j) == Some(&Tok::Sep) {
                        match t.get(j + 1) {
                            Some(Tok::Ident(s)) => {
                                segs.push(s.clone());
                                j += 2;
                            }
                            _ => break,
                        }
                    }
                    self.paths.push(PathUse { from: module, segs });
                    i = j;
                }
                _ => i += 1,
            }
        }
    }

    /// Whether a path starting with `w` is the crate's own: `crate`, `super`, `self`, its name.
    fn starts_path(&self, w: &str, module: ModId) -> bool {
        matches!(w, "crate" | "super" | "self") || self.mods[module].lib_root.as_ref().is_some_and(|(n, _)| n == w)
    }

    /// The module a path names (the deepest one, then a named item followed through
    /// re-exports to its definition) and the name it takes; `None` outside the crate.
    fn resolve(&self, from: ModId, segs: &[String], depth: usize) -> Option<(ModId, String)> {
        let mut segs: Vec<&str> = segs.iter().map(String::as_str).collect();
        // `a::{self}` is `a`.
        if segs.len() > 1 && segs.last() == Some(&"self") {
            segs.pop();
        }
        let m = &self.mods[from];
        let (mut at, mut rest) = match segs.first()? {
            &"crate" => (m.tree_root, &segs[1..]),
            &"self" => (from, &segs[1..]),
            &"super" => {
                let mut at = from;
                let mut k = 0;
                while segs.get(k) == Some(&"super") {
                    at = self.mods[at].parent?;
                    k += 1;
                }
                (at, &segs[k..])
            }
            w if m.lib_root.as_ref().is_some_and(|(n, _)| n == w) => (m.lib_root.as_ref()?.1, &segs[1..]),
            w if m.children.contains_key(*w) => (from, &segs[..]),
            _ => return None,
        };
        while let Some(c) = rest.first().and_then(|s| self.mods[at].children.get(*s)) {
            at = *c;
            rest = &rest[1..];
        }
        match rest.first() {
            None => Some((at, self.mods[at].name.clone())),
            Some(name) => Some((self.defined(at, name, depth).unwrap_or(at), name.to_string())),
        }
    }

    /// Where `name`, as seen from module `m`, is defined: here, or through `m`'s `use`s.
    fn defined(&self, m: ModId, name: &str, depth: usize) -> Option<ModId> {
        if depth > 32 {
            return None;
        }
        if self.mods[m].items.contains(name) {
            return Some(m);
        }
        for (bound, segs) in &self.mods[m].bindings {
            match bound {
                Some(b) if b == name => {
                    if let Some((to, _)) = self.resolve(m, segs, depth + 1) {
                        return Some(to);
                    }
                }
                None => {
                    let glob = self.resolve(m, &segs[..segs.len() - 1], depth + 1);
                    if let Some(to) = glob.and_then(|(g, _)| self.defined(g, name, depth + 1)) {
                        return Some(to);
                    }
                }
                Some(_) => {}
            }
        }
        None
    }

    fn is_ancestor(&self, a: ModId, mut b: ModId) -> bool {
        loop {
            if a == b {
                return true;
            }
            match self.mods[b].parent {
                Some(p) => b = p,
                None => return false,
            }
        }
    }
}

/// The identifier at `i`, or "".
fn word(t: &[Tok], i: usize) -> &str {
    match t.get(i) {
        Some(Tok::Ident(s)) => s,
        _ => "",
    }
}

fn ident(s: &str) -> Tok {
    Tok::Ident(s.to_string())
}

/// `#[cfg(test)]` or `#[cfg(all(test, ...))]`: compiled only for tests.
fn is_cfg_test(attr: &[Tok]) -> bool {
    let p = |c| Tok::Punct(c);
    attr == [ident("cfg"), p('('), ident("test"), p(')')] || attr.starts_with(&[ident("cfg"), p('('), ident("all"), p('('), ident("test")])
}

/// Tokens to step over before the header of an `impl`/`trait`/`extern` block item, if `words`
/// start one.
fn block_item(words: &[&str; 4], second: Option<&Tok>) -> Option<usize> {
    match words {
        ["impl" | "trait", ..] => Some(1),
        ["unsafe" | "auto", "impl" | "trait", ..] => Some(2),
        ["unsafe", "auto", "trait", _] => Some(3),
        ["extern", ..] if matches!(second, Some(Tok::Punct('{'))) => Some(1),
        ["unsafe", "extern", ..] => Some(2),
        _ => None,
    }
}

/// Past a balanced group starting at `pos` (`(…)`, `[…]`, `{…}`).
fn skip_group(t: &[Tok], pos: &mut usize) {
    let mut depth = 0usize;
    while *pos < t.len() {
        match t[*pos] {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    *pos += 1;
                    return;
                }
            }
            _ => {}
        }
        *pos += 1;
    }
}

/// Past one item: to its `;`, or to the end of its first `{…}` (a body); stops before a `}`
/// that closes the enclosing block.
fn skip_item(t: &[Tok], pos: &mut usize) {
    while *pos < t.len() {
        match t[*pos] {
            Tok::Punct(';') => {
                *pos += 1;
                return;
            }
            Tok::Punct('{') => {
                skip_group(t, pos);
                return;
            }
            Tok::Punct('(' | '[') => skip_group(t, pos),
            Tok::Punct('}') => return,
            _ => *pos += 1,
        }
    }
}

/// The name an item defines (`fn f`, `struct S`, `const C`, `macro_rules! m`, ...).
fn item_name(t: &[Tok]) -> Option<String> {
    let words: Vec<&str> = t.iter().take(8).map(|x| if let Tok::Ident(s) = x { s.as_str() } else { "" }).collect();
    for (k, w) in words.iter().enumerate() {
        let next = words.get(k + 1).copied().unwrap_or("");
        match *w {
            "fn" | "struct" | "enum" | "union" | "type" | "trait" | "mod" => return Some(next.to_string()).filter(|n| !n.is_empty()),
            "const" | "static" if !matches!(next, "fn" | "unsafe" | "async" | "extern" | "mut") => {
                return Some(next.to_string()).filter(|n| !n.is_empty());
            }
            "static" => return words.get(k + 2).map(|n| n.to_string()).filter(|n| !n.is_empty()),
            "macro_rules" => return words.get(k + 2).map(|n| n.to_string()).filter(|n| !n.is_empty()),
            _ => {}
        }
    }
    None
}

/// A `use` tree from `pos` (after `use`) to its `;`: each leaf's visible name (`None` for a
/// glob, whose path ends in `*`; "" for `as _`) and full path.
fn use_tree(t: &[Tok], pos: &mut usize, prefix: &[String], out: &mut Vec<(Option<String>, Vec<String>)>) {
    let mut segs = prefix.to_vec();
    if t.get(*pos) == Some(&Tok::Sep) {
        *pos += 1;
        if segs.is_empty() {
            // `use ::name`: another crate.
            segs.push("::".into());
        }
    }
    loop {
        match t.get(*pos) {
            Some(Tok::Punct('*')) => {
                *pos += 1;
                segs.push("*".into());
                out.push((None, segs));
                break;
            }
            Some(Tok::Punct('{')) => {
                *pos += 1;
                while *pos < t.len() && t[*pos] != Tok::Punct('}') {
                    use_tree(t, pos, &segs, out);
                    if t.get(*pos) == Some(&Tok::Punct(',')) {
                        *pos += 1;
                    } else if t.get(*pos) != Some(&Tok::Punct('}')) {
                        break;
                    }
                }
                *pos += 1;
                break;
            }
            Some(Tok::Ident(s)) => {
                segs.push(s.clone());
                *pos += 1;
                if t.get(*pos) == Some(&Tok::Sep) {
                    *pos += 1;
                    continue;
                }
                let mut name = if s == "self" { segs.len().checked_sub(2).map(|k| segs[k].clone()) } else { Some(s.clone()) };
                if t.get(*pos) == Some(&ident("as")) {
                    name = match t.get(*pos + 1) {
                        Some(Tok::Ident(a)) => Some(a.clone()),
                        _ => None,
                    };
                    *pos += 2;
                }
                // `as _` brings no name in.
                out.push((name.filter(|n| n != "_").or(Some(String::new())), segs));
                break;
            }
            _ => break,
        }
    }
    if prefix.is_empty() {
        skip_item(t, pos);
    }
}

// ---- The checker's own tests --------------------------------------------------------------

/// A graph of one library crate `demo` made of the given files.
fn graph_of(files: &[(&str, &str)]) -> Graph {
    let files: BTreeMap<String, String> = files.iter().map(|(p, s)| (p.to_string(), s.to_string())).collect();
    let demo = Crate { dir: "demo".into(), lib_name: Some("demo".into()), lib_root: Some("demo/src/lib.rs".into()), bin_roots: Vec::new() };
    Graph::build(&[demo], &|p| files.get(p).cloned()).unwrap_or_else(|e| panic!("{e}"))
}

fn arrow(g: &Graph, from: &str, to: &str) -> Vec<String> {
    g.arrows.get(&(format!("demo/src/{from}"), format!("demo/src/{to}"))).map(|n| n.iter().cloned().collect()).unwrap_or_default()
}

#[test]
fn checker_finds_a_cycle_with_its_names() {
    let g = graph_of(&[
        ("demo/src/lib.rs", "pub mod a;\npub mod b;\npub mod c;"),
        ("demo/src/a.rs", "use crate::b::{B, helper};\npub struct A;"),
        // A path written out in code, no `use`.
        ("demo/src/b.rs", "pub struct B; pub fn helper() {}\nfn f() -> u8 { crate::a::A; 0 }"),
        ("demo/src/c.rs", "use crate::a::A;"),
    ]);
    assert_eq!(arrow(&g, "a.rs", "b.rs"), ["B", "helper"]);
    assert_eq!(arrow(&g, "b.rs", "a.rs"), ["A"]);
    let cycle: BTreeSet<String> = ["demo/src/a.rs", "demo/src/b.rs"].map(String::from).into();
    assert_eq!(g.cycles(), [cycle]);
    let err = check(&g, &[]).unwrap_err();
    assert!(err.contains("demo/src/a.rs -> demo/src/b.rs (B, helper)") && err.contains("demo/src/b.rs -> demo/src/a.rs (A)"), "{err}");
    assert!(check(&g, &[&["demo/src/a.rs", "demo/src/b.rs"]]).is_ok());
    // A listed cycle that is gone fails.
    let stale = check(&g, &[&["demo/src/a.rs", "demo/src/b.rs"], &["demo/src/b.rs", "demo/src/c.rs"]]).unwrap_err();
    assert!(stale.contains("no longer a cycle") && !stale.contains("import cycle of"), "{stale}");

    // So does a listed cycle that grew: it is another cycle now.
    let grown = graph_of(&[
        ("demo/src/lib.rs", "pub mod a;\npub mod b;\npub mod c;"),
        ("demo/src/a.rs", "use crate::b::B;\npub struct A;"),
        ("demo/src/b.rs", "pub struct B;\nuse crate::c::C;"),
        ("demo/src/c.rs", "pub struct C;\nuse crate::a::A;"),
    ]);
    let err = check(&grown, &[&["demo/src/a.rs", "demo/src/b.rs"]]).unwrap_err();
    assert!(err.contains("import cycle of 3 files") && err.contains("no longer a cycle"), "{err}");
}

#[test]
fn checker_resolves_grouped_nested_and_relative_imports() {
    let g = graph_of(&[
        ("demo/src/lib.rs", "pub mod a;\npub mod p;\npub mod x;"),
        ("demo/src/p/mod.rs", "pub mod q;\npub fn pf() {}"),
        ("demo/src/p/q.rs", "pub mod r;\npub struct Q;"),
        ("demo/src/p/q/r.rs", "pub struct R;"),
        ("demo/src/x.rs", "pub mod y;"),
        ("demo/src/x/y.rs", "pub use super::super::p::q::Q as Renamed;\npub(crate) fn deep() {}"),
        (
            "demo/src/a.rs",
            "pub use crate::{p::{self, q::{r::R, Q}}, x::y::*};\nuse self::inner::I;\nmod inner { pub struct I; }\n\
             fn f() { use demo::x::y::deep as d; d(); }",
        ),
    ]);
    assert_eq!(arrow(&g, "a.rs", "p/mod.rs"), ["p"]);
    assert_eq!(arrow(&g, "a.rs", "p/q.rs"), ["Q"]);
    assert_eq!(arrow(&g, "a.rs", "p/q/r.rs"), ["R"]);
    assert_eq!(arrow(&g, "a.rs", "x/y.rs"), ["*", "deep"]);
    assert_eq!(arrow(&g, "x/y.rs", "p/q.rs"), ["Q"]);
    // An inline module is its file's; its own `use` of its parent is containment.
    assert!(!g.arrows.keys().any(|(f, t)| f == t));
    assert!(g.cycles().is_empty());
}

#[test]
fn checker_follows_re_exports_and_skips_containment() {
    let g = graph_of(&[
        ("demo/src/lib.rs", "pub mod a;\npub mod b;\npub use b::Gate;\npub use a::*;"),
        // Through the root's re-export: an arrow to where `Gate` is defined, not to the root.
        ("demo/src/a.rs", "pub mod child;\nuse crate::Gate;\npub fn fa() {}"),
        ("demo/src/a/child.rs", "use super::fa;\nuse crate::fa as g;"),
        ("demo/src/b.rs", "pub enum Gate { Unit }\nfn f() { let _ = crate::fa(); }"),
    ]);
    assert_eq!(arrow(&g, "a.rs", "b.rs"), ["Gate"]);
    assert_eq!(arrow(&g, "b.rs", "a.rs"), ["fa"], "the glob re-export of the root leads to a.rs");
    assert!(arrow(&g, "a/child.rs", "a.rs").is_empty(), "a child taking from its parent is containment");
    assert_eq!(g.cycles().len(), 1);
}

#[test]
fn checker_ignores_tests_comments_and_strings() {
    let g = graph_of(&[
        ("demo/src/lib.rs", "pub mod a;\npub mod b;\n#[cfg(test)]\nmod fixtures;"),
        ("demo/src/fixtures.rs", "use crate::a::A;"),
        ("demo/src/a.rs", "pub struct A;\nuse crate::b::B;"),
        (
            "demo/src/b.rs",
            "pub struct B;\n// use crate::a::A;\n/* crate::a::A /* nested */ crate::a::A */\n/// [`crate::a::A`]\n\
             const S: &str = \"crate::a::A\"; const R: &str = r#\"crate::a::A \" \"#; const C: char = '\"';\n\
             fn f<'a>(x: &'a u8) -> &'a u8 { x }\n#[cfg(test)]\nmod tests { use crate::a::A; }\n\
             #[cfg(test)]\nfn helper() { crate::a::A; }",
        ),
    ]);
    assert_eq!(arrow(&g, "a.rs", "b.rs"), ["B"]);
    assert!(arrow(&g, "b.rs", "a.rs").is_empty(), "{:?}", g.arrows);
    assert!(g.test_files.contains("demo/src/fixtures.rs") && !g.files.contains("demo/src/fixtures.rs"));
    assert!(g.cycles().is_empty());
}
