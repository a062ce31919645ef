use super::*;

fn stage(reasoning: Option<&str>, thinking: Option<bool>, tools: ToolMode) -> OutputStage {
    let reasoning = reasoning.map(|n| ReasoningFormat::from_name(n).expect("format"));
    let harmony = reasoning == Some(ReasoningFormat::GptOss)
        || matches!(
            tools,
            ToolMode::Parse {
                format: ToolCallFormat::Harmony,
                ..
            }
        );
    OutputStage {
        reasoning,
        enable_thinking: thinking,
        tools,
        harmony,
        separate_reasoning: true,
    }
}

fn parse_mode(name: &str) -> ToolMode {
    ToolMode::Parse {
        format: ToolCallFormat::from_name(name).expect("format"),
        single: false,
    }
}

/// The stream's deltas, reassembled the way an OpenAI client does.
fn reassemble(stage: &OutputStage, pieces: &[&str]) -> (ParsedMessage, bool) {
    let mut s = stage.stream();
    let mut out = ParsedMessage::default();
    let apply = |d: MessageDelta, out: &mut ParsedMessage| {
        out.reasoning_content.push_str(&d.reasoning_content);
        out.content.push_str(&d.content);
        for c in d.tool_calls {
            if let Some(name) = c.name {
                assert_eq!(
                    c.index,
                    out.tool_calls.len(),
                    "a call's first delta names it"
                );
                out.tool_calls.push(ToolCall {
                    name,
                    arguments: String::new(),
                });
            }
            let call = out
                .tool_calls
                .get_mut(c.index)
                .expect("named before arguments");
            call.arguments.push_str(&c.arguments);
        }
    };
    for (i, p) in pieces.iter().enumerate() {
        let d = s.push(p, i + 1 == pieces.len());
        apply(d, &mut out);
    }
    (out, s.made_calls())
}

/// Every split of `text` in two (at each char boundary) and byte-wise pieces stream to the
/// non-streamed parse.
fn check_splits(stage: &OutputStage, text: &str) -> ParsedMessage {
    let whole = stage.parse(text);
    let (one, calls) = reassemble(stage, &[text]);
    assert_eq!(one, whole, "one chunk: {text:?}");
    assert_eq!(calls, !whole.tool_calls.is_empty());
    for (cut, _) in text.char_indices().skip(1) {
        let (two, _) = reassemble(stage, &[&text[..cut], &text[cut..]]);
        assert_eq!(two, whole, "split at {cut}: {text:?}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    if !pieces.is_empty() {
        let (each, _) = reassemble(stage, &pieces);
        assert_eq!(each, whole, "char by char: {text:?}");
    }
    // A final empty chunk (a finish arriving after the text) changes nothing.
    let mut with_end = pieces.clone();
    with_end.push("");
    assert_eq!(reassemble(stage, &with_end).0, whole);
    whole
}

const HERMES: &str = "<think>The user wants Paris weather.</think>\n\n<tool_call>\n{\"name\": \
    \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"°C\"}}\n</tool_call>\n\
    <tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";

#[test]
fn reasoning_then_hermes_calls() {
    let s = stage(Some("qwen3"), None, parse_mode("hermes"));
    let m = check_splits(&s, HERMES);
    assert_eq!(m.reasoning_content, "The user wants Paris weather.");
    assert_eq!(m.content, "", "whitespace between calls is dropped");
    assert_eq!(m.tool_calls.len(), 2);
    assert_eq!(m.tool_calls[0].name, "get_weather");
    let args: serde_json::Value =
        serde_json::from_str(&m.tool_calls[0].arguments).expect("json arguments");
    assert_eq!(args["unit"], "°C");
    assert_eq!(m.tool_calls[1].arguments, "{}");
}

#[test]
fn separate_reasoning_false_keeps_the_reasoning_in_the_content() {
    let text = "<think>Paris is in France.</think>\n\nIt is sunny in Paris.";
    let split = check_splits(&stage(Some("qwen3"), None, ToolMode::Off), text);
    assert_eq!(split.reasoning_content, "Paris is in France.");
    let kept = OutputStage {
        separate_reasoning: false,
        ..stage(Some("qwen3"), None, ToolMode::Off)
    };
    // The grammar still starts after the reasoning; only the output is left whole.
    assert!(kept.starts_in_reasoning() && kept.is_passthrough());
    let m = check_splits(&kept, text);
    assert_eq!(
        (m.reasoning_content.as_str(), m.content.as_str()),
        ("", text)
    );
}

#[test]
fn single_call_without_parallel_tool_calls() {
    let s = OutputStage {
        tools: ToolMode::Parse {
            format: ToolCallFormat::Hermes,
            single: true,
        },
        ..stage(Some("qwen3"), None, ToolMode::Off)
    };
    let m = check_splits(&s, HERMES);
    assert_eq!(m.tool_calls.len(), 1);
}

#[test]
fn content_around_calls_is_kept() {
    let s = stage(None, None, parse_mode("hermes"));
    let text =
        "Let me check.\n<tool_call>{\"name\": \"f\", \"arguments\": {\"a\": 1}}</tool_call>\n";
    let m = check_splits(&s, text);
    // (the parser drops the whitespace that separates calls from the text)
    assert_eq!(m.content, "Let me check.\n");
    assert_eq!(m.tool_calls[0].arguments, "{\"a\": 1}");
}

#[test]
fn no_calls_leaves_content_and_whitespace() {
    let s = stage(None, None, parse_mode("hermes"));
    assert_eq!(check_splits(&s, "  \n").content, "  \n");
    let m = check_splits(&s, "Paris is the capital. <tool");
    assert_eq!(m.content, "Paris is the capital. <tool");
    assert!(m.tool_calls.is_empty());
}

#[test]
fn required_json_array() {
    let s = stage(
        None,
        None,
        ToolMode::Parse {
            format: ToolCallFormat::JsonArray,
            single: false,
        },
    );
    let text = "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Par\\\"is\"}}, \
                {\"name\": \"get_time\", \"parameters\": {\"tz\": [1, 2]}}]";
    let m = check_splits(&s, text);
    assert_eq!(m.content, "");
    assert_eq!(m.tool_calls.len(), 2);
    assert_eq!(m.tool_calls[1].arguments, "{\"tz\": [1, 2]}");
}

#[test]
fn named_function_takes_the_whole_answer() {
    let named = ToolMode::Named("get_weather".into());
    let m = check_splits(&stage(None, None, named.clone()), "{\"city\": \"Oslo\"}");
    assert_eq!(m.tool_calls[0].name, "get_weather");
    assert_eq!(m.tool_calls[0].arguments, "{\"city\": \"Oslo\"}");
    // After reasoning: only the answer is the arguments.
    let m = check_splits(
        &stage(Some("deepseek-r1"), None, named.clone()),
        "hmm</think>{\"city\": \"Oslo\"}",
    );
    assert_eq!(m.reasoning_content, "hmm");
    assert_eq!(m.tool_calls[0].arguments, "{\"city\": \"Oslo\"}");
    // An empty answer still names the call (arguments empty).
    let m = check_splits(&stage(None, None, named), "");
    assert_eq!(m.tool_calls.len(), 1);
}

#[test]
fn reasoning_only() {
    let r1 = stage(Some("deepseek-r1"), None, ToolMode::Off);
    let m = check_splits(&r1, "<think>2 + 2 is 4.</think>\n\nThe answer is 4.");
    assert_eq!(m.reasoning_content, "2 + 2 is 4.");
    assert_eq!(m.content, "\n\nThe answer is 4.");
    let m = check_splits(&r1, "still thinking </thi");
    assert_eq!(m.reasoning_content, "still thinking </thi");
    assert_eq!(m.content, "");
    // Qwen3 with thinking disabled: all content.
    let off = stage(Some("qwen3"), Some(false), ToolMode::Off);
    assert!(!off.starts_in_reasoning());
    let m = check_splits(&off, "no <think>here</think> x");
    assert_eq!(m.content, "no <think>here</think> x");
    assert!(stage(Some("qwen3"), None, ToolMode::Off).starts_in_reasoning());
}

const HARMONY: &str = "<|channel|>analysis<|message|>Weather, then time.<|end|><|start|>\
    assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
    {\"city\": \"Paris\"}<|call|><|start|>assistant<|channel|>commentary \
    to=functions.get_time <|constrain|>json<|message|>{}<|call|>";

#[test]
fn harmony_reads_reasoning_and_calls_with_one_parser() {
    let both = stage(Some("gpt-oss"), None, parse_mode("gpt-oss"));
    assert!(both.harmony && both.starts_in_reasoning() && !both.is_passthrough());
    let m = check_splits(&both, HARMONY);
    assert_eq!(m.reasoning_content, "Weather, then time.");
    assert_eq!(m.content, "");
    let names: Vec<&str> = m.tool_calls.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["get_weather", "get_time"]);
    assert_eq!(m.tool_calls[0].arguments, "{\"city\": \"Paris\"}");
    // Without parallel_tool_calls: the first call only.
    let single = OutputStage {
        tools: ToolMode::Parse {
            format: ToolCallFormat::Harmony,
            single: true,
        },
        ..both.clone()
    };
    assert_eq!(check_splits(&single, HARMONY).tool_calls.len(), 1);
    // The tool parser alone: the calls, the reasoning dropped (not shown as content).
    let tools_only = stage(None, None, parse_mode("openai"));
    assert!(
        tools_only.starts_in_reasoning(),
        "a grammar cannot start first"
    );
    let m = check_splits(&tools_only, HARMONY);
    assert_eq!((m.reasoning_content.as_str(), m.tool_calls.len()), ("", 2));
    // The reasoning parser alone (no tools in the request): call bodies are answer text.
    let reasoning_only = stage(Some("openai_gptoss"), None, ToolMode::Off);
    let m = check_splits(&reasoning_only, HARMONY);
    assert_eq!(m.reasoning_content, "Weather, then time.");
    assert_eq!(m.content, "{\"city\": \"Paris\"}\n{}");
    assert!(m.tool_calls.is_empty());
}

#[test]
fn harmony_answers_and_truncated_outputs() {
    let both = stage(Some("gpt-oss"), None, parse_mode("gpt-oss"));
    let text = "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final\
        <|message|>2 + 2 = 4.<|return|>";
    let m = check_splits(&both, text);
    assert_eq!(
        (m.reasoning_content.as_str(), m.content.as_str()),
        ("Easy.", "2 + 2 = 4.")
    );
    // Cut by max_tokens in the second call's header: the first call only.
    let m = check_splits(&both, &HARMONY[..HARMONY.len() - 40]);
    assert_eq!(m.tool_calls.len(), 1);
    assert_eq!(m.tool_calls[0].arguments, "{\"city\": \"Paris\"}");
    let m = check_splits(&both, "<|channel|>analysis<|message|>Hmm, the us");
    assert_eq!(m.reasoning_content, "Hmm, the us");
}

#[test]
fn harmony_is_one_format_for_both_flags() {
    let gpt = ReasoningFormat::GptOss;
    assert!(check_harmony_pair(Some(gpt), Some(ToolCallFormat::Harmony)).is_ok());
    assert!(check_harmony_pair(Some(gpt), None).is_ok());
    assert!(check_harmony_pair(None, Some(ToolCallFormat::Harmony)).is_ok());
    let err = check_harmony_pair(Some(gpt), Some(ToolCallFormat::Hermes)).expect_err("mixed");
    assert!(err.contains("--tool-call-parser"), "{err}");
    let qwen = ReasoningFormat::Qwen3;
    assert!(check_harmony_pair(Some(qwen), Some(ToolCallFormat::Harmony)).is_err());
    assert!(check_harmony_pair(Some(qwen), Some(ToolCallFormat::Hermes)).is_ok());
}

#[test]
fn finish_reason_reports_tool_calls_only_on_a_normal_end() {
    assert_eq!(finish_reason("stop", true), "tool_calls");
    assert_eq!(finish_reason("length", true), "length");
    assert_eq!(finish_reason("stop", false), "stop");
}
