//! IncrementalDetokenizer on real and synthetic tokenizers: streamed text always equals a full decode.

mod common;

use common::{all_tokenizers, stream, SMOLLM2, SPM_LEGACY, SPM_METASPACE, WORDPIECE};
use proptest::prelude::*;
use tokenspeed_text::{IncrementalDetokenizer, TextTokenizer};

const CORPUS: &[&str] = &[
    "Hello world",
    "Hello, world! The world is big.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnew\n\nlines\r\n",
    "emoji 🦀🚀 and flags 🇯🇵 and families 👨‍👩‍👧",
    "中文日本語の文章です。汉字测试",
    "mixed: Привет мир, مرحبا بالعالم, γειά σου, नमस्ते",
    "é ñ ü ß ø — “quotes” … ½ ∑ ∞",
    "🙂",
    " ",
    "a",
    "x🦀y中z",
    "code: fn main() { println!(\"{}\", 1 + 2); }",
];

/// The property every tokenizer must satisfy: pushes + finish == decode(all ids), and no delta
/// carries a broken character when the full text has none.
fn assert_stream_matches_decode(name: &str, tok: &tokenspeed_text::TextTokenizer, text: &str) {
    for add_special in [false, true] {
        let ids = tok.encode(text, add_special).expect("encode");
        for skip in [false, true] {
            let expected = tok.decode(&ids, skip).expect("decode");
            let deltas = stream(tok, &ids, skip);
            assert_eq!(
                deltas.concat(),
                expected,
                "{name}: text {text:?} ids {ids:?} skip={skip} deltas {deltas:?}"
            );
            if !expected.contains('\u{FFFD}') {
                assert!(
                    deltas.iter().all(|d| !d.contains('\u{FFFD}')),
                    "{name}: broken character emitted for {text:?}: {deltas:?}"
                );
            }
        }
    }
}

#[test]
fn streamed_text_equals_full_decode_on_corpus() {
    for (name, tok) in all_tokenizers() {
        for text in CORPUS {
            assert_stream_matches_decode(name, tok, text);
        }
    }
}

#[test]
fn byte_fallback_emoji_is_held_until_complete() {
    // 🦀 is not in the synthetic vocab: four <0x..> tokens, emitted only once all have arrived.
    for tok in [&*SPM_LEGACY, &*SPM_METASPACE] {
        let ids = tok.encode("a🦀", false).expect("encode");
        assert_eq!(ids.len(), 1 + 1 + 4, "▁, a, then four byte tokens: {ids:?}");
        let deltas = stream(tok, &ids, true);
        assert_eq!(deltas, vec!["", "a", "", "", "", "🦀", ""]);
    }
}

#[test]
fn byte_level_partial_characters_are_never_emitted() {
    for (name, tok) in all_tokenizers() {
        let text = "🦀🇯🇵中文";
        let ids = tok.encode(text, false).expect("encode");
        let deltas = stream(tok, &ids, true);
        for d in &deltas {
            assert!(!d.contains('\u{FFFD}'), "{name}: {deltas:?}");
        }
        assert_eq!(deltas.concat(), text, "{name}");
    }
}

#[test]
fn sentencepiece_word_boundaries_keep_their_space() {
    for tok in [&*SPM_LEGACY, &*SPM_METASPACE] {
        let ids = tok.encode("Hello the world", false).expect("encode");
        let deltas = stream(tok, &ids, true);
        // The first token's "▁" is dropped (as in a full decode); later ones become spaces.
        assert_eq!(deltas.concat(), "Hello the world");
        assert!(deltas.contains(&" the".to_string()), "{deltas:?}");
        assert!(deltas.contains(&" world".to_string()), "{deltas:?}");
    }
}

#[test]
fn special_tokens_are_kept_or_skipped_as_requested() {
    let tok = &*SMOLLM2;
    let mut ids = tok.encode("Hi there", false).expect("encode");
    ids.push(tok.token_to_id("<|im_end|>").expect("im_end"));
    ids.extend(tok.encode(" bye", false).expect("encode"));
    assert_eq!(stream(tok, &ids, false).concat(), "Hi there<|im_end|> bye");
    assert_eq!(stream(tok, &ids, true).concat(), "Hi there bye");
}

#[test]
fn finish_flushes_an_unfinished_character() {
    let tok = &*SPM_LEGACY;
    // First three bytes of 🦀 (F0 9F A6 80): the stream ends before the character completes.
    let ids: Vec<u32> = ["<0xF0>", "<0x9F>", "<0xA6>"]
        .iter()
        .map(|t| tok.token_to_id(t).expect("byte token"))
        .collect();
    let deltas = stream(tok, &ids, true);
    assert_eq!(&deltas[..3], ["", "", ""]);
    assert_eq!(deltas.concat(), tok.decode(&ids, true).expect("decode"));
    assert!(deltas[3].contains('\u{FFFD}'));
}

#[test]
fn prompt_context_keeps_the_space_before_the_first_generated_word() {
    for (name, tok) in all_tokenizers() {
        let prompt = tok
            .encode("The capital of France is", false)
            .expect("encode");
        let full = tok
            .encode("The capital of France is Paris, of course.", false)
            .expect("encode");
        assert_eq!(
            full[..prompt.len()],
            prompt[..],
            "{name}: the prompt tokenizes the same alone"
        );
        let mut detok = tokenspeed_text::IncrementalDetokenizer::with_prompt(true, &prompt);
        let mut text = String::new();
        for &id in &full[prompt.len()..] {
            text.push_str(&detok.push(tok, id).expect("push"));
        }
        text.push_str(&detok.finish(tok).expect("finish"));
        let expected = tok.decode(&full, true).expect("decode");
        let prompt_text = tok.decode(&prompt, true).expect("decode");
        assert_eq!(text, expected[prompt_text.len()..], "{name}");
        assert!(text.starts_with(" Paris"), "{name}: {text:?}");
        assert_eq!(detok.ids(), &full[prompt.len()..]);
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn streamed_text_equals_full_decode_on_random_strings(
        text in "[ a-zA-Z0-9.,!?'\\t\\n中文日本語éñПриветمرحبا🦀🚀🙂👍🏽\u{200d}\u{301}]{0,40}"
    ) {
        for (name, tok) in all_tokenizers() {
            assert_stream_matches_decode(name, tok, &text);
        }
    }
}

/// Streams `ids` with `spaces_between_special_tokens` as given; returns the whole text.
fn streamed_text(tok: &TextTokenizer, ids: &[u32], skip_special: bool, spaces: bool) -> String {
    let mut detok = IncrementalDetokenizer::new(skip_special).spaces_between_special_tokens(spaces);
    let mut text: String = ids
        .iter()
        .map(|&id| detok.push(tok, id).expect("push"))
        .collect();
    text.push_str(&detok.finish(tok).expect("finish"));
    text
}

#[test]
fn spaces_between_special_tokens_false_joins_adjacent_added_tokens() {
    let tok = &*WORDPIECE;
    // [CLS] hello ##s [SEP] [SEP] <tool> [CLS] world
    let ids = [1, 3, 5, 2, 2, 6, 1, 4];
    let spaced = "[CLS] hellos [SEP] [SEP] <tool> [CLS] world";
    assert_eq!(tok.decode(&ids, false).expect("decode"), spaced);
    assert_eq!(streamed_text(tok, &ids, false, true), spaced);
    // Only an added token right after another loses its space (vLLM's rule): "[SEP]" after
    // "hellos" keeps it, and so does "world" after "[CLS]".
    assert_eq!(
        streamed_text(tok, &ids, false, false),
        "[CLS] hellos [SEP][SEP]<tool>[CLS] world"
    );
}

#[test]
fn spaces_between_special_tokens_is_moot_when_special_tokens_are_skipped() {
    let tok = &*WORDPIECE;
    let ids = [1, 3, 2, 2, 4];
    let skipped = tok.decode(&ids, true).expect("decode");
    assert_eq!(skipped, "hello world");
    assert_eq!(streamed_text(tok, &ids, true, false), skipped);
}

#[test]
fn byte_level_tokenizers_have_no_space_between_special_tokens_to_remove() {
    let tok = &*SMOLLM2;
    let ids: Vec<u32> = ["<|im_end|>", "<|im_start|>", "<|im_end|>"]
        .iter()
        .map(|t| tok.token_to_id(t).expect("special token"))
        .collect();
    let joined = "<|im_end|><|im_start|><|im_end|>";
    assert_eq!(streamed_text(tok, &ids, false, true), joined);
    assert_eq!(streamed_text(tok, &ids, false, false), joined);
}
