//! Stop strings over real token streams: IncrementalDetokenizer feeding StopMatcher.

mod common;

use common::all_tokenizers;
use proptest::prelude::*;
use tokenspeed_text::{IncrementalDetokenizer, StopMatcher, TextTokenizer};

struct Outcome {
    /// Text sent to the client, chunk by chunk (finish's release last).
    chunks: Vec<String>,
    stopped: bool,
}

impl Outcome {
    fn text(&self) -> String {
        self.chunks.concat()
    }
}

/// What the server does per generated token: detokenize, then stop-match.
fn generate(tok: &TextTokenizer, text: &str, stops: &[&str]) -> Outcome {
    let ids = tok.encode(text, false).expect("encode");
    let mut detok = IncrementalDetokenizer::new(true);
    let mut matcher = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
    let mut chunks = Vec::new();
    for &id in &ids {
        let step = matcher.push(&detok.push(tok, id).expect("push"));
        chunks.push(step.emit);
        if step.stopped {
            return Outcome {
                chunks,
                stopped: true,
            };
        }
    }
    let step = matcher.push(&detok.finish(tok).expect("finish"));
    chunks.push(step.emit);
    if !step.stopped {
        chunks.push(matcher.finish());
    }
    Outcome {
        chunks,
        stopped: step.stopped,
    }
}

/// Expected client text: the decoded text cut before the stop string that completes first
/// (ties: the one that starts first), whatever the token boundaries.
fn expected(decoded: &str, stops: &[&str]) -> (String, bool) {
    let first = stops
        .iter()
        .filter_map(|s| decoded.find(s).map(|pos| (pos + s.len(), pos)))
        .min();
    match first {
        Some((_, cut)) => (decoded[..cut].to_owned(), true),
        None => (decoded.to_owned(), false),
    }
}

fn check(tok: &TextTokenizer, name: &str, text: &str, stops: &[&str]) {
    let decoded = tok
        .decode(&tok.encode(text, false).expect("encode"), true)
        .expect("decode");
    let out = generate(tok, text, stops);
    let (want, want_stopped) = expected(&decoded, stops);
    assert_eq!(out.text(), want, "{name}: {text:?} stops {stops:?}");
    assert_eq!(
        out.stopped, want_stopped,
        "{name}: {text:?} stops {stops:?}"
    );
    // Every emitted prefix is a prefix of the final text: nothing is ever taken back.
    let mut sent = String::new();
    for chunk in &out.chunks {
        sent.push_str(chunk);
        assert!(want.starts_with(&sent), "{name}: over-emitted {sent:?}");
    }
}

#[test]
fn stop_strings_spanning_several_tokens_cut_the_stream() {
    let cases: &[(&str, &[&str])] = &[
        (
            "The answer is 42.<|endofanswer|> ignored",
            &["<|endofanswer|>"],
        ),
        ("first paragraph\n\nsecond paragraph", &["\n\n"]),
        ("答案是四十二。然后继续", &["然后"]),
        ("crab 🦀 stop here 🦀🦀 more", &["🦀🦀"]),
        (
            "Observation: done\nThought: next",
            &["Thought:", "Observation: nope"],
        ),
        ("abcabcabd tail", &["abcabd"]),
    ];
    for (name, tok) in all_tokenizers() {
        for (text, stops) in cases {
            check(tok, name, text, stops);
        }
    }
}

#[test]
fn partial_stop_string_at_the_end_is_released_by_finish() {
    for (name, tok) in all_tokenizers() {
        let out = generate(tok, "the end is ###", &["####"]);
        assert!(!out.stopped, "{name}");
        assert_eq!(out.text(), "the end is ###", "{name}");
        // "###" could have begun "####", so it arrives only with the final release.
        let released = out.chunks.last().expect("finish chunk");
        assert!(released.ends_with("###"), "{name}: {:?}", out.chunks);
    }
}

#[test]
fn text_without_stop_strings_streams_unchanged() {
    for (name, tok) in all_tokenizers() {
        check(tok, name, "nothing to stop here 🙂 中文", &["STOP"]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn random_stop_strings_cut_at_the_earliest_match(
        text in "[ ab中🦀\\n]{0,30}",
        stop_a in "[ ab中🦀\\n]{1,4}",
        stop_b in "[ab中]{1,3}",
    ) {
        for (name, tok) in all_tokenizers() {
            check(tok, name, &text, &[stop_a.as_str(), stop_b.as_str()]);
        }
    }
}
