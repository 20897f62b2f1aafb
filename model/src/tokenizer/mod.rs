//! The tokenizers GGUF files describe, built from the file's own vocabulary: byte-level BPE, the
//! tokenizer of GPT-2 and of SmolLM2 (`tokenizer.ggml.model` = `gpt2`, with its merges), and
//! SentencePiece-style merging by score with byte fallback (`llama`: Llama 1/2, Mistral, Mixtral;
//! the `spm` module). The rest of this page is about byte-level BPE.
//!
//! Encoding: special tokens are cut out of the text first (user-defined tokens always; control
//! tokens such as `<|im_start|>` only in [`Tokenizer::encode_with_special`], as llama.cpp does with
//! `parse_special`); the rest is split by the pre-tokenizer `tokenizer.ggml.pre` names; each piece's
//! UTF-8 bytes start as one symbol per byte (GPT-2's byte-to-unicode mapping names those tokens),
//! and adjacent symbols are merged lowest merge rank first, leftmost first among equal ranks,
//! until no ranked pair is left. `decode(encode(s)) == s` for every string whose bytes all have a
//! token. A vocabulary may lack some: SmolLM2's has no token for 21 bytes (the ASCII controls 0x04,
//! 0x06, 0x13, 0x14, 0x16, 0x1d; 0xf1 and 0xf2, which lead the UTF-8 of planes 4 to 11; and 13 bytes
//! that never occur in UTF-8). Such bytes are dropped, and split the piece around them, as in
//! llama.cpp (Hugging Face's BPE drops them too); [`Tokenizer::unencodable`] finds them first.
//!
//! Pre-tokenizers implemented, as llama.cpp defines them (`llama-vocab.cpp`):
//! - `gpt2`: GPT-2's pattern `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`,
//!   written by hand (the lookahead included) following llama.cpp's `unicode_regex_split_custom_gpt2`.
//! - `smollm` (and `starcoder`, `refact`, `command-r`, `codeshell`, `exaone`, `minerva-7b`, which
//!   share it): every `\p{N}` character is isolated first, then GPT-2's pattern runs on the rest;
//!   Hugging Face's `Digits(individual_digits) + ByteLevel` pre-tokenizer of SmolLM2 is the same.
//! - `llama3` (`llama-bpe`, `llama-v3`): `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
//!   ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`, and `qwen2` (Qwen2.5, Qwen3) the same with
//!   single digits; checked against Python's `regex` on 150 texts (`data/pretokenizer_cases.json`).
//!
//! `\p{L}` and `\p{N}` are Unicode general categories (L*, N*), `\s` is the White_Space property.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use unicode_general_category::{GeneralCategory, get_general_category};

use crate::gguf::Gguf;
use crate::{Error, Result};

mod spm;

/// Marks a byte without a token.
const NO_TOKEN: u32 = u32::MAX;

fn model_err(what: impl Into<String>) -> Error {
    Error::Model(what.into())
}

/// A token's role (`tokenizer.ggml.token_type`, llama.cpp's `llama_token_type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TokenType {
    /// An ordinary token (type 1, or 0 for undefined): its spelling maps back to bytes through
    /// GPT-2's byte-to-unicode table.
    Normal,
    /// The unknown token (`<unk>`, type 2): decodes to its spelling verbatim, matched in text only
    /// by `encode_with_special`.
    Unknown,
    /// `<|im_start|>`, `<|endoftext|>`: matched in text only by `encode_with_special`.
    Control,
    /// Added tokens matched verbatim in any text.
    UserDefined,
    /// A reserved slot (type 5), handled as a normal token.
    Unused,
    /// A byte token of SentencePiece vocabularies (`<0x0A>`, type 6): in a SentencePiece
    /// vocabulary it is the byte fallback and decodes to the byte; in a byte-level BPE one it is
    /// handled as a normal token and decodes to its spelling.
    Byte,
}

impl TokenType {
    /// llama.cpp's numbering; 0 (undefined) counts as normal.
    pub fn from_gguf(v: i64) -> Option<Self> {
        Some(match v {
            0 | 1 => TokenType::Normal,
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => return None,
        })
    }

    /// Whether the token stands for its text verbatim rather than for mapped bytes.
    fn is_special(self) -> bool {
        matches!(self, TokenType::Control | TokenType::UserDefined | TokenType::Unknown)
    }
}

/// How text is split into pieces before BPE (see the module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2's pattern over the whole text (`gpt2`).
    Gpt2,
    /// Every `\p{N}` character a piece of its own, then GPT-2's pattern over the rest (`smollm`,
    /// `starcoder` and the others of the module docs).
    DigitsThenGpt2,
    /// Llama 3's pattern (`llama3`, `llama-bpe`): contractions in either case, a letter run with
    /// one leading non-letter, numbers in groups of up to three digits, punctuation runs taking
    /// their newlines, newline runs.
    Llama3,
    /// Qwen2's pattern (`qwen2`, which Qwen2.5 and Qwen3 files name): Llama 3's with single
    /// digits.
    Qwen2,
}

impl PreTokenizer {
    /// The pre-tokenizer of llama.cpp's `tokenizer.ggml.pre` name, when implemented here.
    pub fn from_gguf_name(name: &str) -> Option<Self> {
        match name {
            "gpt2" | "gpt-2" => Some(PreTokenizer::Gpt2),
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" => Some(PreTokenizer::DigitsThenGpt2),
            "llama3" | "llama-v3" | "llama-bpe" => Some(PreTokenizer::Llama3),
            "qwen2" | "deepseek-r1-qwen" => Some(PreTokenizer::Qwen2),
            _ => None,
        }
    }

    /// Splits `text` into the pieces BPE runs on (their concatenation is `text`).
    pub fn split(self, text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        match self {
            PreTokenizer::Gpt2 => split_gpt2(text, &mut out),
            PreTokenizer::Llama3 => split_llama3(text, 3, &mut out),
            PreTokenizer::Qwen2 => split_llama3(text, 1, &mut out),
            PreTokenizer::DigitsThenGpt2 => {
                let mut start = 0;
                for (i, c) in text.char_indices() {
                    if class(c) == Class::Number {
                        split_gpt2(text.get(start..i).unwrap_or_default(), &mut out);
                        out.push(text.get(i..i + c.len_utf8()).unwrap_or_default());
                        start = i + c.len_utf8();
                    }
                }
                split_gpt2(text.get(start..).unwrap_or_default(), &mut out);
            }
        }
        out
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Class {
    Letter,
    Number,
    Space,
    Other,
}

fn class(c: char) -> Class {
    if c.is_ascii() {
        return match c {
            'a'..='z' | 'A'..='Z' => Class::Letter,
            '0'..='9' => Class::Number,
            '\t' | '\n' | '\x0b' | '\x0c' | '\r' | ' ' => Class::Space,
            _ => Class::Other,
        };
    }
    if c.is_whitespace() {
        return Class::Space;
    }
    use GeneralCategory::*;
    match get_general_category(c) {
        UppercaseLetter | LowercaseLetter | TitlecaseLetter | ModifierLetter | OtherLetter => Class::Letter,
        DecimalNumber | LetterNumber | OtherNumber => Class::Number,
        _ => Class::Other,
    }
}

/// GPT-2's pattern, alternative by alternative, at each position the first that matches.
fn split_gpt2<'t>(text: &'t str, out: &mut Vec<&'t str>) {
    if text.is_empty() {
        return;
    }
    let chars: Vec<(usize, char, Class)> = text.char_indices().map(|(i, c)| (i, c, class(c))).collect();
    let n = chars.len();
    let ch = |i: usize| chars.get(i).map(|&(_, c, _)| c);
    let cl = |i: usize| chars.get(i).map(|&(_, _, k)| k);
    let byte = |i: usize| chars.get(i).map_or(text.len(), |&(b, _, _)| b);
    let mut pos = 0;
    while let Some(c) = ch(pos) {
        let end = 'm: {
            // 's|'t|'re|'ve|'m|'ll|'d
            if c == '\'' {
                match (ch(pos + 1), ch(pos + 2)) {
                    (Some('s' | 't' | 'm' | 'd'), _) => break 'm pos + 2,
                    (Some('r' | 'v'), Some('e')) | (Some('l'), Some('l')) => break 'm pos + 3,
                    _ => {}
                }
            }
            //  ?\p{L}+ |  ?\p{N}+ |  ?[^\s\p{L}\p{N}]+  (the optional prefix is U+0020 only)
            let first = pos + usize::from(c == ' ');
            if let Some(k @ (Class::Letter | Class::Number | Class::Other)) = cl(first) {
                let mut e = first;
                while cl(e) == Some(k) {
                    e += 1;
                }
                break 'm e;
            }
            // \s+(?!\S) | \s+ : a run of spaces followed by more text leaves its last space to
            // prefix the next piece.
            let mut e = pos;
            while cl(e) == Some(Class::Space) {
                e += 1;
            }
            match e - pos {
                0 => pos + 1,
                k if k > 1 && e < n => e - 1,
                _ => e,
            }
        };
        out.push(text.get(byte(pos)..byte(end)).unwrap_or_default());
        pos = end;
    }
}

/// Llama 3's pattern (Qwen2's with `max_digits` 1), alternative by alternative, at each position
/// the first that matches:
/// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`.
fn split_llama3<'t>(text: &'t str, max_digits: usize, out: &mut Vec<&'t str>) {
    if text.is_empty() {
        return;
    }
    let chars: Vec<(usize, char, Class)> = text.char_indices().map(|(i, c)| (i, c, class(c))).collect();
    let n = chars.len();
    let ch = |i: usize| chars.get(i).map(|&(_, c, _)| c);
    let cl = |i: usize| chars.get(i).map(|&(_, _, k)| k);
    let byte = |i: usize| chars.get(i).map_or(text.len(), |&(b, _, _)| b);
    let newline = |i: usize| matches!(ch(i), Some('\r' | '\n'));
    let mut pos = 0;
    while let Some(c) = ch(pos) {
        let end = 'm: {
            // (?i:'s|'t|'re|'ve|'m|'ll|'d)
            if c == '\'' {
                let lower = |i: usize| ch(i).map(|c| c.to_ascii_lowercase());
                match (lower(pos + 1), lower(pos + 2)) {
                    (Some('s' | 't' | 'm' | 'd'), _) => break 'm pos + 2,
                    (Some('r' | 'v'), Some('e')) | (Some('l'), Some('l')) => break 'm pos + 3,
                    _ => {}
                }
            }
            // [^\r\n\p{L}\p{N}]?\p{L}+
            let first = if cl(pos) != Some(Class::Letter) && cl(pos) != Some(Class::Number) && !newline(pos) { pos + 1 } else { pos };
            if cl(first) == Some(Class::Letter) {
                let mut e = first;
                while cl(e) == Some(Class::Letter) {
                    e += 1;
                }
                break 'm e;
            }
            // \p{N}{1,max}
            if cl(pos) == Some(Class::Number) {
                let mut e = pos;
                while e - pos < max_digits && cl(e) == Some(Class::Number) {
                    e += 1;
                }
                break 'm e;
            }
            //  ?[^\s\p{L}\p{N}]+[\r\n]*
            let first = pos + usize::from(c == ' ');
            if cl(first) == Some(Class::Other) {
                let mut e = first;
                while cl(e) == Some(Class::Other) {
                    e += 1;
                }
                while newline(e) {
                    e += 1;
                }
                break 'm e;
            }
            // \s*[\r\n]+ : the whitespace run up to and including its last newline.
            let mut e = pos;
            let mut last_newline = None;
            while cl(e) == Some(Class::Space) {
                if newline(e) {
                    last_newline = Some(e + 1);
                }
                e += 1;
            }
            if let Some(l) = last_newline {
                break 'm l;
            }
            // \s+(?!\S) | \s+
            match e - pos {
                0 => pos + 1,
                k if k > 1 && e < n => e - 1,
                _ => e,
            }
        };
        out.push(text.get(byte(pos)..byte(end)).unwrap_or_default());
        pos = end;
    }
}

/// GPT-2's reversible map from bytes to printable characters: printable Latin-1 bytes stand for
/// themselves, the other 68 bytes take U+0100.. in byte order (so a space is `Ġ`, a newline `Ċ`).
pub fn byte_to_char() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in table.iter_mut().enumerate() {
        let printable = matches!(b, 0x21..=0x7e | 0xa1..=0xac | 0xae..=0xff);
        let code = if printable {
            b as u32
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).unwrap_or(char::REPLACEMENT_CHARACTER);
    }
    table
}

/// `tokenizer.ggml.tokens` and `tokenizer.ggml.token_type` (empty when absent: all normal).
fn vocabulary_from_gguf(g: &Gguf<'_>) -> Result<(Vec<String>, Vec<TokenType>)> {
    let texts: Vec<String> = g.get_array("tokenizer.ggml.tokens")?.to_strs()?.into_iter().map(str::to_owned).collect();
    let types = match g.get("tokenizer.ggml.token_type") {
        None => Vec::new(),
        Some(_) => g
            .get_array("tokenizer.ggml.token_type")?
            .to_i64s()?
            .into_iter()
            .enumerate()
            .map(|(id, t)| TokenType::from_gguf(t).ok_or_else(|| model_err(format!("token {id} has unknown token type {t}"))))
            .collect::<Result<_>>()?,
    };
    Ok((texts, types))
}

/// The parts every vocabulary shares: its token types (all normal when none are given) and its
/// text lookup (the first of duplicate spellings wins).
fn vocabulary(texts: &[String], types: Vec<TokenType>) -> Result<(Vec<TokenType>, HashMap<String, u32>)> {
    let n = texts.len();
    if n == 0 || u32::try_from(n).is_err() {
        return Err(model_err(format!("a vocabulary of {n} tokens")));
    }
    let types = if types.is_empty() { vec![TokenType::Normal; n] } else { types };
    if types.len() != n {
        return Err(model_err(format!("{} token types for {n} tokens", types.len())));
    }
    let mut id_from_text = HashMap::with_capacity(n);
    for (id, t) in texts.iter().enumerate() {
        id_from_text.entry(t.clone()).or_insert(id as u32);
    }
    Ok((types, id_from_text))
}

/// The special tokens matched verbatim in text, longest first, and which bytes start one.
fn special_table(texts: &[String], types: &[TokenType]) -> (Vec<(u32, TokenType)>, [bool; 256]) {
    let mut specials: Vec<(u32, TokenType)> =
        types.iter().enumerate().filter(|(id, ty)| ty.is_special() && !texts[*id].is_empty()).map(|(id, &ty)| (id as u32, ty)).collect();
    specials.sort_by_key(|&(id, _)| (Reverse(texts[id as usize].len()), id));
    let mut starts_special = [false; 256];
    for &(id, _) in &specials {
        if let Some(&b) = texts[id as usize].as_bytes().first() {
            starts_special[usize::from(b)] = true;
        }
    }
    (specials, starts_special)
}

/// A tokenizer: byte-level BPE, or SentencePiece-style (the `spm` module).
#[derive(Clone, Debug)]
pub struct Tokenizer {
    /// Token text as the vocabulary spells it (byte-mapped for normal tokens).
    texts: Vec<String>,
    /// The bytes each token stands for.
    bytes: Vec<Box<[u8]>>,
    types: Vec<TokenType>,
    id_from_text: HashMap<String, u32>,
    /// (left, right) -> (rank, merged token).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// The token of each byte, [`NO_TOKEN`] when the vocabulary has none.
    token_from_byte: [u32; 256],
    /// Special tokens matched verbatim in text, longest first, and which bytes start one.
    specials: Vec<(u32, TokenType)>,
    starts_special: [bool; 256],
    pre: PreTokenizer,
    /// A SentencePiece vocabulary's scores and space prefix (`tokenizer.ggml.model` = `llama`);
    /// `None` for byte-level BPE.
    spm: Option<spm::Spm>,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
}

impl Tokenizer {
    /// Builds a tokenizer from a vocabulary (`texts[id]`, byte-mapped as in GGUF/`tokenizer.json`),
    /// token types (empty: all normal) and merges (`"left right"`, highest priority first).
    pub fn new(texts: Vec<String>, types: Vec<TokenType>, merges: &[&str], pre: PreTokenizer) -> Result<Self> {
        let (types, id_from_text) = vocabulary(&texts, types)?;
        let to_byte: HashMap<char, u8> = byte_to_char().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let mut token_from_byte = [NO_TOKEN; 256];
        for (b, c) in byte_to_char().into_iter().enumerate() {
            if let Some(&id) = id_from_text.get(c.encode_utf8(&mut [0; 4]) as &str) {
                token_from_byte[b] = id;
            }
        }
        // Every printable ASCII byte has a token in any byte-level vocabulary; without them this
        // is some other kind of vocabulary.
        if let Some(b) = (0x21u8..0x7f).find(|&b| token_from_byte[usize::from(b)] == NO_TOKEN) {
            return Err(model_err(format!("the vocabulary has no token for `{}`: it is not a byte-level BPE vocabulary", char::from(b))));
        }
        let missing = token_from_byte.iter().filter(|&&id| id == NO_TOKEN).count();
        if missing > 0 {
            log::debug!("tokenizer: {missing} of the 256 bytes have no token; text containing them loses them");
        }
        let bytes = texts
            .iter()
            .zip(&types)
            .map(|(t, ty)| {
                if ty.is_special() {
                    t.as_bytes().into()
                } else {
                    let mut v = Vec::with_capacity(t.len());
                    for c in t.chars() {
                        match to_byte.get(&c) {
                            Some(&b) => v.push(b),
                            // Not from the byte map (a malformed vocabulary): kept as written.
                            None => v.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                        }
                    }
                    v.into_boxed_slice()
                }
            })
            .collect();
        let mut merge_map = HashMap::with_capacity(merges.len());
        let mut skipped = 0usize;
        for (rank, m) in merges.iter().enumerate() {
            // llama.cpp splits at the first space after the first byte.
            let split = m.bytes().skip(1).position(|b| b == b' ').map(|i| i + 1);
            let Some((left, right)) = split.map(|i| (m.get(..i).unwrap_or_default(), m.get(i + 1..).unwrap_or_default())) else {
                return Err(model_err(format!("merge {rank} ({m:?}) is not two tokens separated by a space")));
            };
            let ids = (id_from_text.get(left), id_from_text.get(right), id_from_text.get(&format!("{left}{right}")));
            let rank = u32::try_from(rank).map_err(|_| model_err("more than 2^32 merges"))?;
            match ids {
                (Some(&l), Some(&r), Some(&merged)) => {
                    merge_map.entry((l, r)).or_insert((rank, merged));
                }
                // A merge whose parts or result are not tokens can never yield a token.
                _ => skipped += 1,
            }
        }
        if skipped > 0 {
            log::debug!("tokenizer: {skipped} of {} merges name strings outside the vocabulary; ignored", merges.len());
        }
        let (specials, starts_special) = special_table(&texts, &types);
        Ok(Tokenizer {
            texts,
            bytes,
            types,
            id_from_text,
            merges: merge_map,
            token_from_byte,
            specials,
            starts_special,
            pre,
            spm: None,
            bos: None,
            eos: None,
            add_bos: false,
        })
    }

    /// Builds a SentencePiece-style tokenizer (see the `spm` module): `texts[id]` as the
    /// vocabulary spells them (`▁the`, `<0x0A>`), their types (empty: all normal) and scores,
    /// and whether each run of text gets a leading `▁`.
    pub fn new_spm(texts: Vec<String>, types: Vec<TokenType>, scores: Vec<f32>, add_space_prefix: bool) -> Result<Self> {
        let (types, id_from_text) = vocabulary(&texts, types)?;
        if scores.len() != texts.len() {
            return Err(model_err(format!("{} scores for {} tokens", scores.len(), texts.len())));
        }
        if let Some(i) = scores.iter().position(|s| !s.is_finite()) {
            return Err(model_err(format!("token {i}'s score is {}", scores[i])));
        }
        let mut token_from_byte = [NO_TOKEN; 256];
        for (b, slot) in token_from_byte.iter_mut().enumerate() {
            let named = id_from_text.get(&format!("<0x{b:02X}>")).copied();
            let plain = (b < 0x80).then(|| id_from_text.get(&char::from(b as u8).to_string()).copied()).flatten();
            *slot = named.or(plain).unwrap_or(NO_TOKEN);
        }
        let bytes = texts
            .iter()
            .zip(&types)
            .map(|(t, ty)| match ty {
                TokenType::Byte => match spm::byte_token(t) {
                    Some(b) => vec![b].into_boxed_slice(),
                    None => t.as_bytes().into(),
                },
                TokenType::Control | TokenType::Unknown => t.as_bytes().into(),
                _ => t.replace(spm::SPACE, " ").into_bytes().into_boxed_slice(),
            })
            .collect();
        let (specials, starts_special) = special_table(&texts, &types);
        Ok(Tokenizer {
            texts,
            bytes,
            types,
            id_from_text,
            merges: HashMap::new(),
            token_from_byte,
            specials,
            starts_special,
            pre: PreTokenizer::Gpt2,
            spm: Some(spm::Spm { scores, add_space_prefix }),
            bos: None,
            eos: None,
            add_bos: false,
        })
    }

    /// Whether this is a SentencePiece-style vocabulary (`tokenizer.ggml.model` = `llama`).
    pub fn is_sentencepiece(&self) -> bool {
        self.spm.is_some()
    }

    /// The tokenizer a GGUF file describes (`tokenizer.ggml.*`).
    pub fn from_gguf(g: &Gguf<'_>) -> Result<Self> {
        let model = g.get_str("tokenizer.ggml.model")?;
        if model == "llama" {
            return Self::spm_from_gguf(g);
        }
        if model != "gpt2" {
            return Err(model_err(format!(
                "tokenizer.ggml.model is `{model}`; implemented: byte-level BPE (`gpt2`) and SentencePiece-style (`llama`)"
            )));
        }
        let pre_name = g.get_str("tokenizer.ggml.pre")?;
        let pre = PreTokenizer::from_gguf_name(pre_name).ok_or_else(|| {
            model_err(format!(
                "tokenizer.ggml.pre is `{pre_name}`, a pre-tokenizer not implemented here (implemented: gpt2, smollm, starcoder, refact, command-r, codeshell, exaone, minerva-7b, llama3, llama-bpe, qwen2)"
            ))
        })?;
        let (texts, types) = vocabulary_from_gguf(g)?;
        let merges = g.get_array("tokenizer.ggml.merges")?.to_strs()?;
        let t = Tokenizer::new(texts, types, &merges, pre)?;
        t.specials_from_gguf(g, None)
    }

    /// A SentencePiece-style vocabulary (`tokenizer.ggml.model` = `llama`): scores, the space
    /// prefix (default on), and llama.cpp's defaults for it (`<s>` = 1 first, `</s>` = 2).
    fn spm_from_gguf(g: &Gguf<'_>) -> Result<Self> {
        let (texts, types) = vocabulary_from_gguf(g)?;
        let scores = match g.get("tokenizer.ggml.scores") {
            Some(_) => g.get_array("tokenizer.ggml.scores")?.to_f32s()?,
            None => return Err(model_err("a SentencePiece vocabulary (`llama`) without tokenizer.ggml.scores")),
        };
        let prefix = g.opt("tokenizer.ggml.add_space_prefix", Gguf::get_bool)?.unwrap_or(true);
        let t = Tokenizer::new_spm(texts, types, scores, prefix)?;
        t.specials_from_gguf(g, Some((1, 2, true)))
    }

    /// Beginning/end-of-sequence tokens and whether prompts start with the first, from the file;
    /// `defaults`: (bos, eos, add_bos) where the file names none.
    fn specials_from_gguf(mut self, g: &Gguf<'_>, defaults: Option<(u32, u32, bool)>) -> Result<Self> {
        let n = self.texts.len();
        let special = |key: &str, default: Option<u32>| -> Result<Option<u32>> {
            match g.opt(key, Gguf::get_u32)?.or(default.filter(|&d| (d as usize) < n)) {
                Some(id) if id as usize >= n => Err(model_err(format!("{key} is {id}, outside the vocabulary of {n}"))),
                other => Ok(other),
            }
        };
        self.bos = special("tokenizer.ggml.bos_token_id", defaults.map(|d| d.0))?;
        self.eos = special("tokenizer.ggml.eos_token_id", defaults.map(|d| d.1))?;
        self.add_bos = g.opt("tokenizer.ggml.add_bos_token", Gguf::get_bool)?.unwrap_or(defaults.is_some_and(|d| d.2));
        Ok(self)
    }

    /// Sets the beginning/end-of-sequence tokens (read from the GGUF by [`Tokenizer::from_gguf`]).
    pub fn with_bos_eos(mut self, bos: Option<u32>, eos: Option<u32>, add_bos: bool) -> Result<Self> {
        for id in [bos, eos].into_iter().flatten() {
            if id as usize >= self.texts.len() {
                return Err(model_err(format!("special token {id} is outside the vocabulary of {}", self.texts.len())));
            }
        }
        (self.bos, self.eos, self.add_bos) = (bos, eos, add_bos);
        Ok(self)
    }

    /// Tokens in the vocabulary; ids are `0..vocab_size`.
    pub fn vocab_size(&self) -> usize {
        self.texts.len()
    }
    /// The pre-tokenizer `tokenizer.ggml.pre` names.
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }
    /// The beginning-of-sequence token (`tokenizer.ggml.bos_token_id`), when there is one.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    /// The end-of-sequence token (`tokenizer.ggml.eos_token_id`), when there is one.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
    /// Whether a prompt should start with [`Tokenizer::bos`] (`tokenizer.ggml.add_bos_token`);
    /// `encode` never adds it.
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    /// The token's text as the vocabulary spells it (`Ġthe` for " the").
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize).map(String::as_str)
    }
    /// The bytes the token stands for.
    pub fn token_bytes(&self, id: u32) -> Option<&[u8]> {
        self.bytes.get(id as usize).map(|b| &b[..])
    }
    /// The token's type (all normal when the file has no `tokenizer.ggml.token_type`); `None`
    /// outside the vocabulary.
    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        self.types.get(id as usize).copied()
    }
    /// The id of a token spelled as in the vocabulary (`Ġthe`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.id_from_text.get(text).copied()
    }

    /// Tokens of `text`; control tokens' spellings in it are encoded as plain text (safe for
    /// untrusted text), user-defined tokens are matched.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.encode_impl(text, false)
    }

    /// Tokens of `text`, where the spellings of control tokens (`<|im_start|>`) become those
    /// tokens: for chat templates.
    pub fn encode_with_special(&self, text: &str) -> Vec<u32> {
        self.encode_impl(text, true)
    }

    fn encode_impl(&self, text: &str, control: bool) -> Vec<u32> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut start = 0;
        let mut i = 0;
        while let Some(rest) = text.get(i..) {
            let Some(c) = rest.chars().next() else { break };
            let hit = if self.starts_special[usize::from(rest.as_bytes()[0])] {
                self.specials
                    .iter()
                    .find(|&&(id, ty)| (control || ty == TokenType::UserDefined) && rest.starts_with(self.texts[id as usize].as_str()))
            } else {
                None
            };
            match hit {
                Some(&(id, _)) => {
                    self.encode_ordinary(text.get(start..i).unwrap_or_default(), &mut out);
                    out.push(id);
                    i += self.texts[id as usize].len();
                    start = i;
                }
                None => i += c.len_utf8(),
            }
        }
        self.encode_ordinary(text.get(start..).unwrap_or_default(), &mut out);
        out
    }

    fn encode_ordinary(&self, text: &str, out: &mut Vec<u32>) {
        if let Some(spm) = &self.spm {
            // Each run of ordinary text starts the text or follows a special token: llama.cpp
            // puts the space prefix there.
            spm::encode(self, spm, text, true, out);
            return;
        }
        for piece in self.pre.split(text) {
            for run in piece.as_bytes().split(|&b| self.token_from_byte[usize::from(b)] == NO_TOKEN) {
                self.bpe(run, out);
            }
        }
    }

    /// The bytes that have no token in this vocabulary (see the module docs).
    pub fn unencodable_bytes(&self) -> Vec<u8> {
        (0..=255u8).filter(|&b| self.token_from_byte[usize::from(b)] == NO_TOKEN).collect()
    }

    /// The first character of `text` (byte offset, character) that the vocabulary cannot encode,
    /// or `None` when `decode(encode(text)) == text` is guaranteed (for a SentencePiece
    /// vocabulary, up to its space marker: a literal `▁` in the text is how it spells a space,
    /// and decodes as one, as in SentencePiece and llama.cpp).
    pub fn unencodable(&self, text: &str) -> Option<(usize, char)> {
        let no_bytes = |c: char| c.encode_utf8(&mut [0; 4]).bytes().any(|b| self.token_from_byte[usize::from(b)] == NO_TOKEN);
        match &self.spm {
            // A character is a token of its own (a space is `▁`), or its bytes are.
            Some(_) => text.char_indices().find(|&(_, c)| {
                let spelled = if c == ' ' { spm::SPACE } else { c };
                !self.id_from_text.contains_key(spelled.encode_utf8(&mut [0; 4]) as &str) && no_bytes(c)
            }),
            None => text.char_indices().find(|&(_, c)| no_bytes(c)),
        }
    }

    /// Merges the byte tokens of a run of bytes that all have one, lowest rank first and leftmost
    /// among equal ranks, with a heap over a linked list of symbols: O(n log n) in its length.
    fn bpe(&self, piece: &[u8], out: &mut Vec<u32>) {
        const NONE: usize = usize::MAX;
        const DEAD: u32 = u32::MAX;
        if piece.len() <= 1 {
            out.extend(piece.iter().map(|&b| self.token_from_byte[usize::from(b)]));
            return;
        }
        struct Sym {
            id: u32,
            prev: usize,
            next: usize,
        }
        let mut syms: Vec<Sym> = piece
            .iter()
            .enumerate()
            .map(|(i, &b)| Sym {
                id: self.token_from_byte[usize::from(b)],
                prev: if i == 0 { NONE } else { i - 1 },
                next: if i + 1 == piece.len() { NONE } else { i + 1 },
            })
            .collect();
        // (rank, left position, left id, right id); stale entries are skipped when popped.
        let mut heap = BinaryHeap::new();
        let push = |heap: &mut BinaryHeap<Reverse<(u32, usize, u32, u32)>>, pos: usize, l: u32, r: u32| {
            if let Some(&(rank, _)) = self.merges.get(&(l, r)) {
                heap.push(Reverse((rank, pos, l, r)));
            }
        };
        for i in 0..syms.len() - 1 {
            push(&mut heap, i, syms[i].id, syms[i + 1].id);
        }
        while let Some(Reverse((_, i, l, r))) = heap.pop() {
            let j = syms[i].next;
            if syms[i].id != l || j == NONE || syms[j].id != r {
                continue;
            }
            let Some(&(_, merged)) = self.merges.get(&(l, r)) else { continue };
            let after = syms[j].next;
            syms[i].id = merged;
            syms[i].next = after;
            syms[j].id = DEAD;
            if after != NONE {
                syms[after].prev = i;
                push(&mut heap, i, merged, syms[after].id);
            }
            let before = syms[i].prev;
            if before != NONE {
                push(&mut heap, before, syms[before].id, merged);
            }
        }
        let mut i = 0;
        while i != NONE {
            out.push(syms[i].id);
            i = syms[i].next;
        }
    }

    /// A prompt's token ids, with the beginning-of-sequence token first when `starts_sequence`
    /// and the vocabulary adds one. A character the vocabulary cannot spell is an error naming
    /// it and its byte offset (never dropped).
    pub fn encode_prompt(&self, text: &str, starts_sequence: bool) -> Result<Vec<u32>> {
        if let Some((at, c)) = self.unencodable(text) {
            return Err(Error::Input(format!("character {c:?} at byte {at} has no token in this model's vocabulary")));
        }
        let mut ids = self.encode(text);
        if starts_sequence
            && self.add_bos
            && let Some(b) = self.bos
        {
            ids.insert(0, b);
        }
        Ok(ids)
    }

    /// The bytes the tokens stand for (control tokens as their spelling). A sequence cut inside a
    /// multi-byte character gives a partial character: stream with this, not [`Tokenizer::decode`].
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for &id in ids {
            let b = self
                .bytes
                .get(id as usize)
                .ok_or_else(|| Error::Input(format!("token id {id} is outside the vocabulary of {}", self.bytes.len())))?;
            out.extend_from_slice(b);
        }
        Ok(out)
    }

    /// The text of the tokens, with U+FFFD for byte sequences that are not UTF-8; exactly the
    /// encoded text when it had no [`Tokenizer::unencodable`] character.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut bytes = self.decode_bytes(ids)?;
        // The space prefix a SentencePiece vocabulary put in front of the text goes again (as
        // llama.cpp's detokenizer strips it from the first piece).
        if self.spm.as_ref().is_some_and(|s| s.add_space_prefix) && bytes.first() == Some(&b' ') {
            bytes.remove(0);
        }
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Llama 3's and Qwen2's pre-tokenizers against the regular expressions they are written
    /// from (`data/pretokenizer_cases.json`: 150 texts, fixed and random, split by Python's
    /// `regex` module with llama.cpp's patterns).
    #[test]
    fn llama3_and_qwen2_pretokenizers_split_as_their_patterns() {
        let cases: Vec<serde_json::Value> = serde_json::from_str(include_str!("../../data/pretokenizer_cases.json")).expect("cases");
        assert_eq!(cases.len(), 150);
        for c in &cases {
            let pre = PreTokenizer::from_gguf_name(c["pre"].as_str().expect("pre")).expect("implemented");
            let text = c["text"].as_str().expect("text");
            let want: Vec<&str> = c["pieces"].as_array().expect("pieces").iter().map(|p| p.as_str().expect("piece")).collect();
            assert_eq!(pre.split(text), want, "{:?} on {text:?}", c["pre"]);
        }
    }
    use crate::gguf::test_model_bytes;
    use crate::gguf::writer::GgufWriter;
    use expertkv_core::rng::Rng;

    /// A tiny vocabulary: two specials, the 256 byte tokens, and a few merges whose order the
    /// tests below depend on.
    const MERGES: [&str; 9] = ["t h", "Ġ t", "th e", "Ġ the", "i n", "in g", "a a", "b c", "a b"];

    fn tiny_vocab() -> (Vec<String>, Vec<TokenType>) {
        let mut texts = vec!["<|endoftext|>".to_string(), "<tool>".to_string()];
        let mut types = vec![TokenType::Control, TokenType::UserDefined];
        for c in byte_to_char() {
            texts.push(c.to_string());
            types.push(TokenType::Normal);
        }
        for m in MERGES {
            texts.push(m.replace(' ', ""));
            types.push(TokenType::Normal);
        }
        (texts, types)
    }

    fn tiny() -> Tokenizer {
        let (texts, types) = tiny_vocab();
        Tokenizer::new(texts, types, &MERGES, PreTokenizer::DigitsThenGpt2).unwrap()
    }

    fn spell(t: &Tokenizer, ids: &[u32]) -> Vec<String> {
        ids.iter().map(|&id| t.token_text(id).unwrap().to_string()).collect()
    }

    #[test]
    fn tokenizer_byte_map_cpu() {
        let m = byte_to_char();
        assert_eq!((m[b' ' as usize], m[b'\n' as usize], m[b'a' as usize], m[b'~' as usize]), ('Ġ', 'Ċ', 'a', '~'));
        assert_eq!((m[0], m[0x7f], m[0xa0], m[0xad], m[0xa1], m[0xff]), ('\u{100}', '\u{121}', '\u{142}', '\u{143}', '¡', 'ÿ'));
        let mut sorted = m.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 256, "the map must be one-to-one");
    }

    #[test]
    fn tokenizer_pretokenize_cpu() {
        let cases: &[(&str, &[&str], &[&str])] = &[
            ("", &[], &[]),
            ("Hello world", &["Hello", " world"], &["Hello", " world"]),
            ("I'm don't", &["I", "'m", " don", "'t"], &["I", "'m", " don", "'t"]),
            ("'S 're 'll", &["'", "S", " '", "re", " '", "ll"], &["'", "S", " '", "re", " '", "ll"]),
            ("a  b", &["a", " ", " b"], &["a", " ", " b"]),
            ("a \n\nb", &["a", " \n", "\n", "b"], &["a", " \n", "\n", "b"]),
            ("end   ", &["end", "   "], &["end", "   "]),
            ("x!!? y", &["x", "!!?", " y"], &["x", "!!?", " y"]),
            (" 123abc", &[" 123", "abc"], &[" ", "1", "2", "3", "abc"]),
            ("v2.0", &["v", "2", ".", "0"], &["v", "2", ".", "0"]),
            ("x٣Ⅻ½", &["x", "٣Ⅻ½"], &["x", "٣", "Ⅻ", "½"]),
            ("हिन्दी", &["ह", "\u{93f}", "न", "\u{94d}", "द", "\u{940}"], &["ह", "\u{93f}", "न", "\u{94d}", "द", "\u{940}"]),
            // Only U+0020 prefixes a word; other spaces stand alone.
            ("a\u{3000}b", &["a", "\u{3000}", "b"], &["a", "\u{3000}", "b"]),
        ];
        for &(text, gpt2, digits) in cases {
            assert_eq!(PreTokenizer::Gpt2.split(text), gpt2, "gpt2 split of {text:?}");
            assert_eq!(PreTokenizer::DigitsThenGpt2.split(text), digits, "smollm split of {text:?}");
        }
    }

    #[test]
    fn tokenizer_bpe_merges_by_rank_cpu() {
        let t = tiny();
        let cases: &[(&str, &[&str])] = &[
            ("the", &["the"]),
            (" the", &["Ġthe"]),
            ("thing", &["th", "ing"]),
            ("aaa", &["aa", "a"]),
            ("aaaa", &["aa", "aa"]),
            // "b c" outranks "a b": the later merge never gets its pair.
            ("abc", &["a", "bc"]),
            ("ab", &["ab"]),
            // (t, h) outranks (Ġ, t), and (Ġ, th) is no merge.
            ("the thing", &["the", "Ġ", "th", "ing"]),
            ("é", &["Ã", "©"]),
        ];
        for &(text, want) in cases {
            let ids = t.encode(text);
            assert_eq!(spell(&t, &ids), want, "{text:?}");
            assert_eq!(t.decode(&ids).unwrap(), text);
        }
    }

    #[test]
    fn tokenizer_special_tokens_cpu() {
        let t = tiny();
        let text = "a<|endoftext|><tool>b<|endoftext|";
        let plain = t.encode(text);
        assert!(!plain.contains(&0), "encode must not produce control tokens from text");
        assert_eq!(plain.iter().filter(|&&id| id == 1).count(), 1, "user-defined tokens are always matched");
        let special = t.encode_with_special(text);
        assert_eq!(special.iter().filter(|&&id| id == 0).count(), 1, "the cut-off second one stays text");
        assert_eq!(special[..4], [t.token_id("a").unwrap(), 0, 1, t.token_id("b").unwrap()]);
        assert_eq!(t.decode(&plain).unwrap(), text);
        assert_eq!(t.decode(&special).unwrap(), text);
        assert_eq!(t.token_type(0), Some(TokenType::Control));
        assert_eq!(t.token_bytes(0), Some(&b"<|endoftext|>"[..]));
    }

    #[test]
    fn tokenizer_decode_rejects_bad_ids_cpu() {
        let t = tiny();
        assert!(matches!(t.decode(&[2, 99_999]), Err(Error::Input(m)) if m.contains("99999")));
        // Half of a two-byte character decodes to bytes, and lossily to text.
        let ids = t.encode("é");
        assert_eq!(t.decode_bytes(&ids[..1]).unwrap(), [0xc3]);
        assert_eq!(t.decode(&ids[..1]).unwrap(), "\u{fffd}");
    }

    /// Bytes without a token are dropped and split the piece (no merge across them), as in
    /// llama.cpp; `unencodable` names the first such character.
    #[test]
    fn tokenizer_bytes_without_tokens_cpu() {
        let (mut texts, types) = tiny_vocab();
        let (hole, hole_text) = (2 + 4, texts[2 + 4].clone());
        assert_eq!(hole_text, byte_to_char()[4].to_string());
        texts[hole] = "<unreachable>".to_string();
        let t = Tokenizer::new(texts, types, &MERGES, PreTokenizer::Gpt2).unwrap();
        assert_eq!(t.unencodable_bytes(), [4]);
        assert_eq!(t.unencodable("th\u{4}e"), Some((2, '\u{4}')));
        assert_eq!(t.unencodable("the é 😀"), None);
        let ids = t.encode("th\u{4}e");
        assert_eq!(spell(&t, &ids), ["th", "e"], "no merge across the dropped byte");
        assert_eq!(t.decode(&ids).unwrap(), "the");
        // Printable ASCII missing means this is not a byte-level vocabulary at all.
        let (mut texts, types) = tiny_vocab();
        texts[2 + usize::from(b'q')] = "qq".to_string();
        assert!(matches!(Tokenizer::new(texts, types, &[], PreTokenizer::Gpt2), Err(Error::Model(m)) if m.contains("`q`")));
    }

    /// Random strings mixing ASCII, spaces, digits of several scripts, combining marks, CJK,
    /// emoji sequences, controls, the highest code point and special-token spellings.
    fn random_text(rng: &mut Rng) -> String {
        const ATOMS: &[&str] = &[
            "a",
            "b",
            "c",
            "t",
            "h",
            "e",
            "i",
            "n",
            "g",
            "the",
            " ",
            "  ",
            "\n",
            "\n\n",
            "\t",
            "\r\n",
            "'",
            "'s",
            "'ll",
            "0",
            "7",
            "42",
            "٣",
            "Ⅻ",
            "½",
            "é",
            "ß",
            "東京",
            "한",
            "😀",
            "👍🏽",
            "👨\u{200d}👩",
            "\u{301}",
            "\u{a0}",
            "\u{3000}",
            "\u{2028}",
            "<|endoftext|>",
            "<tool>",
            "<|",
            "|>",
            "<",
            ".",
            ",",
            "!?",
            "$",
            "\0",
            "\u{1f}",
            "\u{7f}",
            "\u{10ffff}",
            "\u{fffd}",
            "ह",
            "\u{93f}",
            "ا",
        ];
        let n = rng.below(40) as usize;
        let mut s = String::new();
        for _ in 0..n {
            if rng.below(8) == 0 {
                // Any scalar value at all.
                if let Some(c) = char::from_u32(rng.below(0x11_0000)) {
                    s.push(c);
                }
            } else {
                s.push_str(ATOMS[rng.below(ATOMS.len() as u32) as usize]);
            }
        }
        s
    }

    fn check_round_trips(t: &Tokenizer, seeds: std::ops::Range<u64>) {
        for seed in seeds {
            let mut rng = Rng::new(seed);
            let text = random_text(&mut rng);
            // What must come back: the text less the bytes the vocabulary has no token for.
            let missing = t.unencodable_bytes();
            let kept: Vec<u8> = text.bytes().filter(|b| !missing.contains(b)).collect();
            for (what, ids) in [("encode", t.encode(&text)), ("encode_with_special", t.encode_with_special(&text))] {
                assert!(ids.iter().all(|&id| (id as usize) < t.vocab_size()), "seed {seed}: {what} produced an out-of-range id");
                assert_eq!(t.decode_bytes(&ids).unwrap(), kept, "seed {seed}: {what} of {text:?} does not decode back");
                if t.unencodable(&text).is_none() {
                    assert_eq!(t.decode(&ids).unwrap(), text, "seed {seed}: {what} of {text:?}");
                }
            }
            // Pieces tile the text exactly.
            assert_eq!(t.pre_tokenizer().split(&text).concat(), text, "seed {seed}");
        }
    }

    #[test]
    fn tokenizer_round_trip_random_cpu() {
        check_round_trips(&tiny(), 0..3000);
        let (texts, types) = tiny_vocab();
        check_round_trips(&Tokenizer::new(texts, types, &MERGES, PreTokenizer::Gpt2).unwrap(), 0..500);
    }

    /// A single 200k-byte piece: merging is O(n log n), and still exact.
    #[test]
    fn tokenizer_long_piece_cpu() {
        let t = tiny();
        let text = "a".repeat(200_001);
        let ids = t.encode(&text);
        assert_eq!(ids.len(), 100_001);
        assert_eq!(t.decode(&ids).unwrap(), text);
    }

    /// The tiny vocabulary as GGUF metadata; `types` and `bos` override the token types and BOS.
    fn tiny_gguf(types: Option<&[i32]>, bos: u32) -> Vec<u8> {
        let (texts, tys) = tiny_vocab();
        let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
        let tys: Vec<i32> = tys
            .iter()
            .map(|t| {
                if *t == TokenType::Control {
                    3
                } else if *t == TokenType::UserDefined {
                    4
                } else {
                    1
                }
            })
            .collect();
        let mut w = GgufWriter::new();
        w.str("tokenizer.ggml.model", "gpt2")
            .str("tokenizer.ggml.pre", "smollm")
            .strs("tokenizer.ggml.tokens", &texts)
            .i32s("tokenizer.ggml.token_type", types.unwrap_or(&tys))
            .strs("tokenizer.ggml.merges", &MERGES)
            .u32("tokenizer.ggml.bos_token_id", bos)
            .u32("tokenizer.ggml.eos_token_id", 0)
            .bool("tokenizer.ggml.add_bos_token", true);
        w.finish()
    }

    #[test]
    fn tokenizer_from_gguf_cpu() {
        let bytes = tiny_gguf(None, 0);
        let t = Tokenizer::from_gguf(&Gguf::parse(&bytes).unwrap()).unwrap();
        assert_eq!((t.bos(), t.eos(), t.add_bos(), t.pre_tokenizer()), (Some(0), Some(0), true, PreTokenizer::DigitsThenGpt2));
        let direct = tiny();
        for text in ["the thing", "abc <tool> <|endoftext|> 123", "é東😀"] {
            assert_eq!(t.encode_with_special(text), direct.encode_with_special(text), "{text:?}");
        }
        let refuse = |bytes: Vec<u8>, needle: &str| match Tokenizer::from_gguf(&Gguf::parse(&bytes).unwrap()) {
            Err(Error::Model(m)) => assert!(m.contains(needle), "{m:?} should mention {needle:?}"),
            other => panic!("expected an error mentioning {needle:?}, got {other:?}"),
        };
        let mut w = GgufWriter::new();
        w.str("tokenizer.ggml.model", "t5");
        refuse(w.finish(), "implemented: byte-level BPE (`gpt2`) and SentencePiece-style (`llama`)");
        let mut w = GgufWriter::new();
        w.str("tokenizer.ggml.model", "gpt2").str("tokenizer.ggml.pre", "deepseek-llm");
        refuse(w.finish(), "`deepseek-llm`, a pre-tokenizer not implemented");
        let mut w = GgufWriter::new();
        w.str("tokenizer.ggml.model", "gpt2")
            .str("tokenizer.ggml.pre", "gpt2")
            .strs("tokenizer.ggml.tokens", &["a", "b"])
            .strs("tokenizer.ggml.merges", &[]);
        refuse(w.finish(), "not a byte-level BPE vocabulary");
        refuse(tiny_gguf(Some(&[1, 1, 1]), 0), "3 token types");
        refuse(tiny_gguf(Some(&[9; 267]), 0), "unknown token type 9");
        refuse(tiny_gguf(None, 100_000), "bos_token_id is 100000");
        let (texts, _) = tiny_vocab();
        assert!(matches!(Tokenizer::new(texts.clone(), vec![TokenType::Normal; 3], &MERGES, PreTokenizer::Gpt2), Err(Error::Model(_))));
        assert!(
            matches!(Tokenizer::new(texts.clone(), Vec::new(), &["nospace"], PreTokenizer::Gpt2), Err(Error::Model(m)) if m.contains("nospace"))
        );
        assert!(tiny().with_bos_eos(Some(100_000), None, false).is_err());
        // Merges naming strings outside the vocabulary are ignored, not fatal.
        let t = Tokenizer::new(texts, Vec::new(), &["x y", "t h"], PreTokenizer::Gpt2).unwrap();
        assert_eq!(spell(&t, &t.encode("th")), ["th"]);
    }

    fn smollm2(test: &str) -> Option<Tokenizer> {
        let bytes = test_model_bytes(test)?;
        Some(Tokenizer::from_gguf(&Gguf::parse(bytes).unwrap()).unwrap())
    }

    /// Encodings of the real vocabulary against Hugging Face `tokenizers` 0.23 built from the same
    /// GGUF's tokens and merges with SmolLM2's pre-tokenizer (`Digits(individual_digits=true)`
    /// then `ByteLevel(add_prefix_space=false)`, the 17 control tokens added as special).
    #[test]
    fn tokenizer_smollm2_known_encodings_real() {
        let Some(t) = smollm2("tokenizer_smollm2_known_encodings_real") else { return };
        assert_eq!((t.vocab_size(), t.bos(), t.eos(), t.add_bos()), (49152, Some(1), Some(2), false));
        assert_eq!(t.pre_tokenizer(), PreTokenizer::DigitsThenGpt2);
        assert_eq!(t.token_id("ĠParis"), Some(7042));
        assert_eq!((t.token_text(1), t.token_type(1)), (Some("<|im_start|>"), Some(TokenType::Control)));
        // The 21 bytes this vocabulary has no token for (the module docs list them).
        let mut missing = vec![0x04, 0x06, 0x13, 0x14, 0x16, 0x1d, 0xc0, 0xc1, 0xf1, 0xf2];
        missing.extend(0xf5..=0xff);
        assert_eq!(t.unencodable_bytes(), missing);
        assert_eq!(t.unencodable("a\u{4}b"), Some((1, '\u{4}')));
        #[rustfmt::skip]
        let cases: &[(&str, &[u32])] = &[
            ("The capital of France is", &[504, 3575, 282, 4649, 314]),
            (" Paris", &[7042]),
            ("Hello, world! It's 2024-11-30: 3.14159 apples cost $1,000,000.", &[19556, 28, 905, 17, 657, 506, 216, 34, 32, 34, 36, 29, 33, 33, 29, 35, 32, 42, 216, 35, 30, 33, 36, 33, 37, 41, 13855, 1708, 1885, 33, 28, 32, 32, 32, 28, 32, 32, 32, 30]),
            ("I'm sure you're right; we've said they'll go and he'd know. DON'T SHOUT'S", &[57, 5248, 2090, 346, 2316, 1048, 43, 392, 3543, 1137, 502, 3060, 685, 284, 384, 6737, 699, 30, 422, 2154, 23, 68, 334, 21953, 23, 67]),
            ("  leading spaces\n\n\ttabs   and  trailing   ", &[216, 2899, 5600, 1116, 197, 100, 7366, 256, 284, 216, 35079, 333]),
            ("fn main() {\n    println!(\"hi {}\", x[0]);\n}\n", &[7853, 1085, 1000, 1662, 472, 1628, 34115, 17, 1470, 6004, 4548, 1002, 1792, 75, 32, 2255, 43, 198, 109, 198]),
            ("Größe naïve café — “quotes” and ‘apostrophes’ … €5", &[27302, 7466, 34878, 85, 15486, 46494, 37366, 1841, 619, 385, 2346, 573, 284, 1551, 512, 474, 41866, 417, 5548, 24927, 37]),
            ("東京タワーは高い。한국어 텍스트。", &[30679, 126, 16736, 122, 10391, 140, 11100, 124, 35130, 7365, 124, 180, 121, 242, 41679, 19076, 33085, 246, 181, 130, 251, 183, 240, 129, 48138, 223, 231, 183, 228, 114, 184, 228, 133, 19076]),
            ("ह\u{93f}न\u{94d}द\u{940} और اللغة العربية ١٢٣", &[4300, 134, 27011, 30658, 16525, 44757, 37189, 12335, 238, 21891, 27819, 12667, 163, 135, 43463, 27819, 34966, 20602, 31462, 23339, 43463, 216, 164, 111, 164, 112, 164, 113]),
            ("emoji 😀👍🏽 and 👨\u{200d}👩\u{200d}👧 family", &[391, 33777, 40303, 218, 10813, 235, 231, 10813, 233, 138, 284, 15107, 235, 118, 321, 231, 10813, 235, 119, 321, 231, 10813, 235, 117, 1564]),
            ("x\u{301} combining, \u{a0}nbsp, \u{2003}em space, zero\u{200b}width", &[104, 151, 219, 9301, 28, 216, 15442, 94, 32093, 28, 216, 321, 221, 391, 1898, 28, 6708, 321, 229, 6930]),
            ("numbers Ⅻ ½ ² ٣ 𝟙 mixed9a9", &[28707, 216, 173, 223, 121, 216, 16738, 216, 19133, 216, 164, 113, 216, 23159, 249, 243, 6468, 41, 81, 41]),
            ("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n", &[1, 4093, 198, 1780, 314, 216, 34, 27, 34, 47, 2, 198, 1, 520, 9531, 198]),
            ("\u{0}\u{1}\u{1f}\u{7f} control bytes", &[190, 191, 215, 217, 1533, 15590]),
            ("'s 't 're 've 'm 'll 'd ' 'x '", &[506, 637, 100, 637, 257, 637, 307, 637, 93, 637, 764, 637, 84, 637, 637, 104, 637]),
        ];
        for &(text, want) in cases {
            let ids = if text.contains("<|im_start|>") { t.encode_with_special(text) } else { t.encode(text) };
            assert_eq!(ids, want, "{text:?}: ours {:?}, reference {:?}", spell(&t, &ids), spell(&t, want));
            assert_eq!(t.decode(&ids).unwrap(), text);
        }
        // The prompt of RECIPES.md, and the answer it should lead to, token by token.
        let prompt = t.encode("The capital of France is");
        assert_eq!(spell(&t, &prompt), ["The", "Ġcapital", "Ġof", "ĠFrance", "Ġis"]);
        assert_eq!(t.decode(&t.encode(" Paris.")).unwrap(), " Paris.");
    }

    #[test]
    fn tokenizer_smollm2_round_trip_random_real() {
        let Some(t) = smollm2("tokenizer_smollm2_round_trip_random_real") else { return };
        check_round_trips(&t, 0..1000);
    }
}
