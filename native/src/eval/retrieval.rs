//! `eval`'s retrieval checks, the way users hit a long context: facts planted in filler text and
//! asked for later. Three kinds of case, each a fresh model fed token by token (so every policy
//! acts as it would while serving), its answers generated greedily:
//! - a single fact at each depth of `--needle-depth` (a share of the filler before it), the
//!   question right after the filler;
//! - `--needles N` facts at evenly spread depths in one context, asked one after another, each
//!   question fed after the answer the model gave to the last;
//! - two turns: the context ends a first turn, the model answers that turn, and only then is the
//!   fact asked for, so nothing at the end of the context knows the question.
//!
//! A case is found when every answer holds its fact's number.

use anyhow::{Result, bail};

/// The single fact of the depth and two-turn cases, its question and the number it holds.
const FACT: (&str, &str, &str) = ("The secret number is 7291.", " The secret number is", "7291");

/// The facts of the several-needle case, each with its question and number.
const FACTS: [(&str, &str, &str); 5] = [
    ("The code of the red door is 4830.", " The code of the red door is", "4830"),
    ("The code of the blue door is 1576.", " The code of the blue door is", "1576"),
    ("The code of the green door is 9264.", " The code of the green door is", "9264"),
    ("The code of the black door is 3057.", " The code of the black door is", "3057"),
    ("The code of the white door is 6418.", " The code of the white door is", "6418"),
];

/// What ends the first turn of the two-turn case (the model then answers it).
const FIRST_TURN_END: &str = " That is the end of the story. Tell me what the harbour looked like.";

/// Tokens generated for an answer: SmolLM2 writes a space and each digit as a token of its own,
/// so a four-digit number fits with a token to spare.
pub const ANSWER_TOKENS: u32 = 6;

/// Tokens the model answers the first turn of the two-turn case with.
pub const FIRST_TURN_TOKENS: u32 = 8;

/// One turn of a case: tokens fed, then tokens generated; with `expect`, the generated text must
/// hold that number.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Turn {
    pub feed: Vec<u32>,
    pub generate: u32,
    pub expect: Option<&'static str>,
}

/// A retrieval case: its name (as the tables and JSON show it) and its turns.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Case {
    pub name: String,
    pub turns: Vec<Turn>,
}

impl Case {
    /// Tokens the case feeds and generates, the context a model needs for it.
    pub fn tokens(&self) -> u32 {
        self.turns.iter().map(|t| t.feed.len() as u32 + t.generate).sum()
    }
}

/// What a case gave: every answer, and whether each held its number.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Found {
    pub case: String,
    pub found: bool,
    /// The answers, turn by turn (the generated text of the turns that ask).
    pub answers: Vec<String>,
}

/// The depths `--needle-depth` lists: shares of the filler before the fact, `10%,50%,90%`.
pub fn parse_depths(spec: &str) -> Result<Vec<f64>> {
    let mut out = Vec::new();
    for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        match part.strip_suffix('%').map(|p| p.trim().parse::<f64>()) {
            Some(Ok(f)) if (0.0..=100.0).contains(&f) => out.push(f),
            _ => bail!("--needle-depth: shares of the filler from 0% to 100%, comma-separated, not `{part}`"),
        }
    }
    if out.is_empty() {
        bail!("--needle-depth: at least one depth (such as 10%,50%,90%)");
    }
    Ok(out)
}

/// `filler` with `facts` inserted, fact i before the share `depths[i]` of the filler (at token
/// boundaries of the filler, in depth order).
fn plant(filler: &[u32], facts: &[(Vec<u32>, f64)]) -> Vec<u32> {
    let mut at: Vec<(usize, &Vec<u32>)> = facts.iter().map(|(f, d)| (((filler.len() as f64) * d / 100.0).round() as usize, f)).collect();
    at.sort_by_key(|(i, _)| *i);
    let mut out = Vec::with_capacity(filler.len() + facts.iter().map(|f| f.0.len()).sum::<usize>());
    let mut from = 0;
    for (i, fact) in at {
        out.extend_from_slice(&filler[from..i.min(filler.len())]);
        out.extend_from_slice(fact);
        from = i.min(filler.len());
    }
    out.extend_from_slice(&filler[from..]);
    out
}

/// The cases over `filler` (token ids of text): one a depth, the several-needle case with
/// `needles` facts (none below 2), and the two-turn case with the fact at the middle depth of
/// `depths` when `two_turns`. `encode` turns text into token ids.
pub fn cases(filler: &[u32], depths: &[f64], needles: u32, two_turns: bool, encode: &dyn Fn(&str) -> Vec<u32>) -> Result<Vec<Case>> {
    if needles as usize > FACTS.len() {
        bail!("--needles {needles}: at most {} facts in one context", FACTS.len());
    }
    let mut out = Vec::new();
    let (fact, question, number) = FACT;
    for &d in depths {
        let mut feed = plant(filler, &[(encode(fact), d)]);
        feed.extend(encode(question));
        out.push(Case { name: format!("depth {d}%"), turns: vec![Turn { feed, generate: ANSWER_TOKENS, expect: Some(number) }] });
    }
    if needles >= 2 {
        let facts = &FACTS[..needles as usize];
        let spread: Vec<(Vec<u32>, f64)> =
            facts.iter().enumerate().map(|(i, f)| (encode(f.0), 100.0 * (i + 1) as f64 / (needles + 1) as f64)).collect();
        let mut turns = Vec::new();
        for (i, (_, q, n)) in facts.iter().enumerate() {
            let mut feed = if i == 0 { plant(filler, &spread) } else { Vec::new() };
            feed.extend(encode(q));
            turns.push(Turn { feed, generate: ANSWER_TOKENS, expect: Some(n) });
        }
        out.push(Case { name: format!("{needles} needles"), turns });
    }
    if two_turns {
        let d = depths[depths.len() / 2];
        let mut first = plant(filler, &[(encode(fact), d)]);
        first.extend(encode(FIRST_TURN_END));
        out.push(Case {
            name: format!("2 turns, depth {d}%"),
            turns: vec![
                Turn { feed: first, generate: FIRST_TURN_TOKENS, expect: None },
                Turn { feed: encode(question), generate: ANSWER_TOKENS, expect: Some(number) },
            ],
        });
    }
    Ok(out)
}

/// The result of a case whose turns generated `answers` (the text of every turn, in order).
pub fn judge(case: &Case, answers: Vec<String>) -> Found {
    let found = case.turns.iter().zip(&answers).all(|(t, a)| t.expect.is_none_or(|n| a.contains(n)));
    let asked: Vec<String> = case.turns.iter().zip(answers).filter(|(t, _)| t.expect.is_some()).map(|(_, a)| a).collect();
    Found { case: case.name.clone(), found, answers: asked }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A byte-per-token stand-in for a tokenizer: the cases' layout is checked on text.
    fn bytes(s: &str) -> Vec<u32> {
        s.bytes().map(u32::from).collect()
    }

    fn text(ids: &[u32]) -> String {
        ids.iter().map(|&b| b as u8 as char).collect()
    }

    #[test]
    fn depths_parse_or_say_why_not() {
        assert_eq!(parse_depths("10%, 50% ,90%").unwrap(), [10.0, 50.0, 90.0]);
        assert_eq!(parse_depths("0%").unwrap(), [0.0]);
        for bad in ["", "50", "120%", "x%", "10%,-5%"] {
            assert!(parse_depths(bad).unwrap_err().to_string().contains("--needle-depth"), "{bad}");
        }
    }

    #[test]
    fn facts_sit_at_their_depths_and_questions_follow_the_filler() {
        let filler = bytes(&"abcdefghij".repeat(10));
        let cs = cases(&filler, &[10.0, 50.0, 90.0], 3, true, &bytes).unwrap();
        let names: Vec<&str> = cs.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["depth 10%", "depth 50%", "depth 90%", "3 needles", "2 turns, depth 50%"]);
        for (c, d) in cs.iter().zip([10usize, 50, 90]) {
            let t = text(&c.turns[0].feed);
            assert_eq!(t.find(FACT.0), Some(d), "{}: {t}", c.name);
            assert!(t.ends_with(FACT.1) && t.len() == filler.len() + FACT.0.len() + FACT.1.len(), "{t}");
        }
        // Three facts at 25%, 50%, 75%, then three questions, one a turn.
        let multi = &cs[3];
        let t = text(&multi.turns[0].feed);
        for (i, (f, _, _)) in FACTS[..3].iter().enumerate() {
            let before: usize = FACTS[..i].iter().map(|x| x.0.len()).sum();
            assert_eq!(t.find(f), Some(25 * (i + 1) + before), "{t}");
        }
        assert!(t.ends_with(FACTS[0].1));
        assert_eq!(multi.turns.iter().map(|t| t.expect).collect::<Vec<_>>(), [Some("4830"), Some("1576"), Some("9264")]);
        assert_eq!(text(&multi.turns[2].feed), FACTS[2].1);
        // Two turns: the first ends without the question; the question comes after the answer.
        let two = &cs[4];
        assert!(text(&two.turns[0].feed).ends_with(FIRST_TURN_END) && two.turns[0].expect.is_none());
        assert_eq!((text(&two.turns[1].feed).as_str(), two.turns[1].expect), (FACT.1, Some("7291")));
        assert_eq!(two.tokens(), (filler.len() + FACT.0.len() + FIRST_TURN_END.len() + FACT.1.len()) as u32 + 14);
        assert!(cases(&filler, &[50.0], 6, false, &bytes).unwrap_err().to_string().contains("--needles 6"));
    }

    #[test]
    fn a_case_is_found_when_every_asked_answer_holds_its_number() {
        let filler = bytes("xxxxxxxxxx");
        let cs = cases(&filler, &[50.0], 2, true, &bytes).unwrap();
        let multi = &cs[1];
        assert!(judge(multi, vec![" 4830.".into(), " 1576".into()]).found);
        let missed = judge(multi, vec![" 4830.".into(), " 1567".into()]);
        assert!(!missed.found && missed.answers == [" 4830.", " 1567"]);
        // The first turn's free answer is not judged, nor listed.
        let two = judge(&cs[2], vec![" anything".into(), " 7291.".into()]);
        assert!(two.found && two.answers == [" 7291."]);
    }
}
