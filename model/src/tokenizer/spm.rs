//! SentencePiece-style tokenization (`tokenizer.ggml.model` = `llama`: Llama 1/2, Mistral,
//! Mixtral), as llama.cpp's `llm_tokenizer_spm` does it:
//!
//! 1. spaces become `▁` (U+2581; a `▁` already in the text is therefore read as a space, and
//!    decodes as one), and a `▁` is put in front of the text when the vocabulary asks
//!    for it (`tokenizer.ggml.add_space_prefix`, default true) at the start of the text and after
//!    every special token cut out of it;
//! 2. the text starts as one symbol per UTF-8 character; every adjacent pair whose concatenation
//!    is a token is queued with that token's score (`tokenizer.ggml.scores`), and the best pair
//!    (highest score, leftmost among equal scores) merges, its new neighbours are queued, until
//!    the queue is empty (a pair whose symbols changed since it was queued is skipped);
//! 3. each final symbol is its token; one that is not (only a single character outside the
//!    vocabulary can be: every merge forms a token, so llama.cpp's re-split along the merges
//!    never applies) becomes its UTF-8 bytes' byte tokens (`<0xE2>`: byte fallback).

use std::collections::BinaryHeap;

use super::Tokenizer;

/// The SentencePiece half of a [`Tokenizer`].
#[derive(Clone, Debug)]
pub(super) struct Spm {
    /// Each token's merge priority (`tokenizer.ggml.scores`): higher merges first.
    pub scores: Vec<f32>,
    /// Put `▁` in front of each run of ordinary text (`tokenizer.ggml.add_space_prefix`).
    pub add_space_prefix: bool,
}

/// The space marker of SentencePiece vocabularies.
pub(super) const SPACE: char = '\u{2581}';

/// A symbol: a byte range of the escaped text, linked to its neighbours.
#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// A queued pair: higher score first, then the leftmost (as llama.cpp's `llm_bigram_spm`).
#[derive(PartialEq)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Eq for Bigram {}

impl Ord for Bigram {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.score.total_cmp(&o.score).then(o.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// Tokens of one run of ordinary text (no special tokens in it); `prefix`: put `▁` first.
pub(super) fn encode(tok: &Tokenizer, spm: &Spm, raw: &str, prefix: bool, out: &mut Vec<u32>) {
    if raw.is_empty() {
        return;
    }
    let mut text = String::with_capacity(raw.len() + 3);
    if prefix && spm.add_space_prefix {
        text.push(SPACE);
    }
    for c in raw.chars() {
        text.push(if c == ' ' { SPACE } else { c });
    }
    if text.is_empty() {
        return;
    }
    let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
    for (i, (start, c)) in text.char_indices().enumerate() {
        syms.push(Sym { start, len: c.len_utf8(), prev: i.checked_sub(1), next: None });
        if i > 0 {
            syms[i - 1].next = Some(i);
        }
    }
    let mut queue = BinaryHeap::new();
    let try_add = |syms: &[Sym], queue: &mut BinaryHeap<Bigram>, l: Option<usize>, r: Option<usize>| {
        let (Some(l), Some(r)) = (l, r) else { return };
        let (a, b) = (syms[l], syms[r]);
        let Some(s) = text.get(a.start..a.start + a.len + b.len) else { return };
        let Some(id) = tok.token_id(s) else { return };
        let score = spm.scores.get(id as usize).copied().unwrap_or(0.0);
        queue.push(Bigram { score, left: l, right: r, size: s.len() });
    };
    for i in 1..syms.len() {
        try_add(&syms, &mut queue, Some(i - 1), Some(i));
    }
    while let Some(b) = queue.pop() {
        let (l, r) = (syms[b.left], syms[b.right]);
        // One of the two merged into another symbol since this pair was queued.
        if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
            continue;
        }
        syms[b.left].len += r.len;
        syms[b.right].len = 0;
        syms[b.left].next = r.next;
        if let Some(n) = r.next {
            syms[n].prev = Some(b.left);
        }
        let left = syms[b.left];
        try_add(&syms, &mut queue, left.prev, Some(b.left));
        try_add(&syms, &mut queue, Some(b.left), left.next);
    }
    let mut i = Some(0);
    while let Some(at) = i {
        let sym = syms[at];
        let piece = text.get(sym.start..sym.start + sym.len).unwrap_or_default();
        match tok.token_id(piece) {
            Some(id) => out.push(id),
            None => out.extend(piece.bytes().map(|b| tok.token_from_byte[usize::from(b)]).filter(|&id| id != super::NO_TOKEN)),
        }
        i = sym.next;
    }
}

/// `<0xAB>` as the byte it names.
pub(super) fn byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::Gguf;
    use crate::gguf::writer::GgufWriter;
    use crate::tokenizer::TokenType;
    use expertkv_core::rng::Rng;

    /// `<unk>`, `<s>`, `</s>`, the 256 byte tokens, then pieces with scores.
    fn vocab(add_space_prefix: bool) -> Tokenizer {
        let pieces: &[(&str, f32)] = &[
            ("▁", -2.0),
            ("h", -3.0),
            ("e", -3.0),
            ("l", -3.0),
            ("o", -3.0),
            ("w", -3.0),
            ("r", -3.0),
            ("d", -3.0),
            ("▁h", -1.5),
            ("he", -2.5),
            ("ll", -1.0),
            ("llo", -0.5),
            ("▁he", -1.2),
            ("▁hello", -0.1),
            ("▁w", -1.6),
            ("or", -1.1),
            ("▁wor", -0.9),
            ("ld", -1.3),
            ("▁world", -0.2),
            ("1", -3.0),
            ("12", -1.0),
            ("23", -1.0),
        ];
        let mut texts = vec!["<unk>".to_string(), "<s>".into(), "</s>".into()];
        let mut types = vec![TokenType::Unknown, TokenType::Control, TokenType::Control];
        let mut scores = vec![0.0; 3];
        for b in 0..=255u8 {
            texts.push(format!("<0x{b:02X}>"));
            types.push(TokenType::Byte);
            scores.push(0.0);
        }
        for &(p, s) in pieces {
            texts.push(p.to_string());
            types.push(TokenType::Normal);
            scores.push(s);
        }
        Tokenizer::new_spm(texts, types, scores, add_space_prefix).expect("vocabulary").with_bos_eos(Some(1), Some(2), true).expect("bos")
    }

    fn ids(t: &Tokenizer, pieces: &[&str]) -> Vec<u32> {
        pieces.iter().map(|p| t.token_id(p).unwrap_or_else(|| panic!("{p} is not a token"))).collect()
    }

    /// The plain rule, rescanning every pair each merge: the best score, leftmost among equals.
    fn naive(t: &Tokenizer, raw: &str, prefix: bool) -> Vec<u32> {
        if raw.is_empty() {
            return Vec::new();
        }
        let spm = t.spm.as_ref().expect("spm");
        let mut syms: Vec<String> = Vec::new();
        if prefix && spm.add_space_prefix {
            syms.push(SPACE.to_string());
        }
        syms.extend(raw.chars().map(|c| if c == ' ' { SPACE.to_string() } else { c.to_string() }));
        loop {
            let mut best: Option<(f32, usize)> = None;
            for i in 0..syms.len().saturating_sub(1) {
                if let Some(id) = t.token_id(&format!("{}{}", syms[i], syms[i + 1])) {
                    let s = spm.scores[id as usize];
                    if best.is_none_or(|(b, _)| s > b) {
                        best = Some((s, i));
                    }
                }
            }
            let Some((_, i)) = best else { break };
            let right = syms.remove(i + 1);
            syms[i].push_str(&right);
        }
        let mut out = Vec::new();
        for s in syms {
            match t.token_id(&s) {
                Some(id) => out.push(id),
                None => out.extend(s.bytes().map(|b| t.token_from_byte[usize::from(b)])),
            }
        }
        out
    }

    #[test]
    fn pinned_ids() {
        let t = vocab(true);
        assert_eq!(t.encode("hello world"), ids(&t, &["▁hello", "▁world"]));
        // Byte fallback: é has no token, its UTF-8 bytes do.
        assert_eq!(t.encode("hé"), vec![t.token_id("▁h").expect("▁h"), 3 + 0xC3, 3 + 0xA9]);
        // Equal scores: the leftmost pair merges first.
        assert_eq!(t.encode("lll"), [vec![t.token_id("▁").expect("▁")], ids(&t, &["ll", "l"])].concat());
        assert_eq!(t.encode("123"), [vec![t.token_id("▁").expect("▁")], ids(&t, &["12"]), vec![3 + b'3' as u32]].concat());
        // Control tokens in text: plain text unless asked; the prefix follows each one.
        assert_eq!(t.encode_with_special("<s>hello"), [vec![1], ids(&t, &["▁hello"])].concat());
        assert_eq!(t.encode("<s>")[0], t.token_id("▁").expect("▁"));
        // Without the prefix, the first word has no `▁`.
        let bare = vocab(false);
        assert_eq!(bare.encode("hello world"), ids(&bare, &["he", "llo", "▁world"]));
        assert_eq!(t.encode(""), Vec::<u32>::new());
        // Decoding: `▁` is a space, byte tokens are bytes, the prefix goes again.
        assert_eq!(t.decode(&t.encode("hé world")).expect("decode"), "hé world");
        assert_eq!(t.decode_bytes(&ids(&t, &["▁world"])).expect("bytes"), b" world");
        assert_eq!(t.encode_prompt("hello", true).expect("prompt"), [vec![1], ids(&t, &["▁hello"])].concat());
    }

    #[test]
    fn random_text_round_trips_and_matches_the_plain_rule() {
        let t = vocab(true);
        let alphabet: Vec<char> = "helowrd 123 \tlé€😀\u{7f}\n▁".chars().collect();
        for seed in 0..300u64 {
            let mut rng = Rng::new(seed);
            let len = rng.below(24) as usize;
            let s: String = (0..len).map(|_| alphabet[rng.below(alphabet.len() as u32) as usize]).collect();
            let got = t.encode(&s);
            assert_eq!(got, naive(&t, &s, true), "seed {seed}: {s:?}");
            // A literal `▁` is SentencePiece's spelling of a space.
            assert_eq!(t.decode(&got).expect("decode"), s.replace(SPACE, " "), "seed {seed}: {s:?} -> {got:?}");
            assert_eq!(t.unencodable(&s), None, "seed {seed}");
        }
    }

    #[test]
    fn a_gguf_llama_vocabulary_loads_with_its_defaults() {
        let t = vocab(true);
        let n = t.vocab_size();
        let texts: Vec<&str> = (0..n as u32).map(|i| t.token_text(i).expect("text")).collect();
        let types: Vec<i32> = (0..n as u32)
            .map(|i| match t.token_type(i).expect("type") {
                TokenType::Unknown => 2,
                TokenType::Control => 3,
                TokenType::Byte => 6,
                _ => 1,
            })
            .collect();
        let scores = t.spm.as_ref().expect("spm").scores.clone();
        let mut w = GgufWriter::new();
        w.str("tokenizer.ggml.model", "llama")
            .strs("tokenizer.ggml.tokens", &texts)
            .i32s("tokenizer.ggml.token_type", &types)
            .f32s("tokenizer.ggml.scores", &scores);
        let bytes = w.finish();
        let g = Gguf::parse(&bytes).expect("parse");
        let loaded = Tokenizer::from_gguf(&g).expect("a llama vocabulary");
        assert!(loaded.is_sentencepiece());
        assert_eq!((loaded.bos(), loaded.eos(), loaded.add_bos()), (Some(1), Some(2), true), "llama.cpp's defaults");
        assert_eq!(loaded.encode("hello world"), t.encode("hello world"));
        // Scores are required.
        let mut w = GgufWriter::new();
        w.str("tokenizer.ggml.model", "llama").strs("tokenizer.ggml.tokens", &texts);
        let bytes = w.finish();
        let e = Tokenizer::from_gguf(&Gguf::parse(&bytes).expect("parse")).expect_err("no scores");
        assert!(e.to_string().contains("scores"), "{e}");
    }
}
