//! GPT-OSS harmony outputs (the shapes of openai/harmony's format guide): the whole parse is as
//! specified, and the same text streamed split at every char boundary (and char by char)
//! reassembles to it. Also through `--reasoning-parser gpt-oss` and `--tool-call-parser gpt-oss`
//! alone.

use tokenspeed_structured::harmony::{self, HarmonyMessage};
use tokenspeed_structured::{ReasoningFormat, ReasoningOutput, ToolCall, ToolCallFormat};

fn message(reasoning: &str, content: &str, calls: &[(&str, &str)]) -> HarmonyMessage {
    HarmonyMessage {
        reasoning_content: reasoning.into(),
        content: content.into(),
        tool_calls: calls
            .iter()
            .map(|(name, arguments)| ToolCall {
                name: (*name).into(),
                arguments: (*arguments).into(),
            })
            .collect(),
    }
}

/// Streams `pieces` and reassembles the deltas as an OpenAI client does; checks the call shape.
fn stream(calls: bool, pieces: &[&str]) -> HarmonyMessage {
    let mut parser = harmony::stream(calls);
    let mut deltas: Vec<_> = pieces.iter().map(|p| parser.push(p)).collect();
    deltas.push(parser.finish());
    let mut out = HarmonyMessage::default();
    for delta in deltas {
        out.reasoning_content.push_str(&delta.reasoning_content);
        out.content.push_str(&delta.content);
        for d in delta.tool_calls {
            if d.index == out.tool_calls.len() {
                let name = d.name.clone().expect("a call's first delta names it");
                out.tool_calls.push(ToolCall {
                    name,
                    arguments: String::new(),
                });
            } else {
                assert!(d.name.is_none(), "name sent twice for call {}", d.index);
            }
            out.tool_calls[d.index].arguments.push_str(&d.arguments);
        }
    }
    out
}

fn check(calls: bool, text: &str, expected: &HarmonyMessage) {
    assert_eq!(&harmony::parse(text, calls), expected, "whole: {text:?}");
    for (k, _) in text.char_indices().skip(1) {
        let got = stream(calls, &[&text[..k], &text[k..]]);
        assert_eq!(&got, expected, "split at byte {k}: {text:?}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(&stream(calls, &pieces), expected, "char by char: {text:?}");
}

const ANSWER: &str = "<|channel|>analysis<|message|>User asks: \"What is 2 + 2?\" Simple \
    arithmetic.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>";

const CALL: &str = "<|channel|>analysis<|message|>Need to use function get_weather.<|end|>\
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json\
    <|message|>{\"location\":\"San Francisco\"}<|call|>";

/// A preamble, then two calls (the second's recipient in the role part, no `<|constrain|>`, no
/// arguments), as a server that does not stop at `<|call|>` would see them.
const PREAMBLE_AND_CALLS: &str = "<|channel|>analysis<|message|>Two tools.<|end|><|start|>\
    assistant<|channel|>commentary<|message|>**Plan**: weather, then time.<|end|><|start|>\
    assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
    {\"city\": \"Zürich\"}<|call|><|start|>assistant to=functions.get_time<|channel|>commentary \
    json<|message|><|call|>";

#[test]
fn analysis_is_reasoning_and_final_is_the_answer() {
    let expected = message(
        "User asks: \"What is 2 + 2?\" Simple arithmetic.",
        "2 + 2 = 4.",
        &[],
    );
    check(true, ANSWER, &expected);
    check(false, ANSWER, &expected);
    // Without the stop token (cut from the text when it ended generation): the same.
    let cut = ANSWER
        .strip_suffix(harmony::RETURN)
        .expect("ends in return");
    check(true, cut, &expected);
}

#[test]
fn a_function_recipient_is_a_tool_call() {
    check(
        true,
        CALL,
        &message(
            "Need to use function get_weather.",
            "",
            &[("get_weather", "{\"location\":\"San Francisco\"}")],
        ),
    );
    // Calls not parsed (no tools): the commentary body is answer text.
    check(
        false,
        CALL,
        &message(
            "Need to use function get_weather.",
            "{\"location\":\"San Francisco\"}",
            &[],
        ),
    );
}

#[test]
fn preambles_are_content_and_calls_keep_their_order() {
    check(
        true,
        PREAMBLE_AND_CALLS,
        &message(
            "Two tools.",
            "**Plan**: weather, then time.",
            &[
                ("get_weather", "{\"city\": \"Zürich\"}"),
                ("get_time", "{}"),
            ],
        ),
    );
}

#[test]
fn messages_of_one_kind_join_with_a_newline() {
    let text = "<|channel|>analysis<|message|>First.<|end|><|start|>assistant<|channel|>analysis\
        <|message|>Second.<|end|><|start|>assistant<|channel|>final<|message|>A<|end|><|start|>\
        assistant<|channel|>final<|message|>B<|return|>";
    check(true, text, &message("First.\nSecond.", "A\nB", &[]));
}

#[test]
fn built_in_tools_on_the_analysis_channel_stay_reasoning() {
    let text = "<|channel|>analysis to=python code<|message|>print(2 + 2)<|call|>";
    check(true, text, &message("print(2 + 2)", "", &[]));
}

#[test]
fn output_cut_short_gives_what_was_written() {
    // Mid-reasoning (max_tokens).
    check(
        true,
        "<|channel|>analysis<|message|>Thinking ab",
        &message("Thinking ab", "", &[]),
    );
    // Mid-header: the header adds nothing, a partial marker is not text.
    check(
        true,
        "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>fin",
        &message("Hm.", "", &[]),
    );
    check(true, "<|channel|>analy", &message("", "", &[]));
    // Mid-arguments: the call as far as written.
    let cut = &CALL[..CALL.len() - 12];
    check(
        true,
        cut,
        &message(
            "Need to use function get_weather.",
            "",
            &[("get_weather", "{\"location\":\"San Francis")],
        ),
    );
}

#[test]
fn a_marker_out_of_place_starts_a_header_and_never_shows_as_text() {
    // No `<|end|><|start|>assistant` before the next header.
    let text = "<|channel|>analysis<|message|>Think.<|channel|>final<|message|>Done.<|return|>";
    check(true, text, &message("Think.", "Done.", &[]));
    check(
        true,
        "<|message|><|message|>Hi<|message|>",
        &message("", "Hi", &[]),
    );
}

#[test]
fn text_without_markers_is_all_answer() {
    // Special tokens skipped: the markers are gone, nothing to split on.
    check(
        true,
        "analysisUser asks.",
        &message("", "analysisUser asks.", &[]),
    );
    check(true, "", &message("", "", &[]));
}

#[test]
fn the_reasoning_parser_alone_splits_channels_without_calls() {
    let format = ReasoningFormat::from_name("openai_gptoss").expect("vLLM's name");
    assert_eq!(format, ReasoningFormat::GptOss);
    assert_eq!(format.end_marker(), None, "no single think-end token");
    assert!(format.starts_in_reasoning(None));
    let whole = format.parse(CALL, None);
    assert_eq!(
        whole,
        ReasoningOutput {
            reasoning_content: "Need to use function get_weather.".into(),
            content: "{\"location\":\"San Francisco\"}".into(),
        }
    );
    let mut s = format.stream(None);
    let mut got = ReasoningOutput::default();
    for c in CALL.chars() {
        let d = s.push(&c.to_string());
        got.reasoning_content.push_str(&d.reasoning_content);
        got.content.push_str(&d.content);
        assert!(!s.reasoning_ended(), "analysis may come back");
    }
    let d = s.finish();
    got.content.push_str(&d.content);
    assert_eq!(got, whole);
}

#[test]
fn the_tool_parser_alone_drops_the_reasoning() {
    for name in ["gpt-oss", "openai"] {
        assert_eq!(
            ToolCallFormat::from_name(name),
            Some(ToolCallFormat::Harmony)
        );
    }
    let parsed = ToolCallFormat::Harmony.parse(PREAMBLE_AND_CALLS);
    assert_eq!(parsed.content, "**Plan**: weather, then time.");
    assert_eq!(parsed.tool_calls.len(), 2);
    assert_eq!(parsed.tool_calls[1].arguments, "{}");
}
