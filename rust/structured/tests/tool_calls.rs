//! Tool-call parsers on recorded-style model outputs: the non-streamed parse is as specified,
//! and streaming the same text split at every char boundary (and char by char) reassembles to it.

use serde_json::json;
use tokenspeed_structured::tool_call::forced;
use tokenspeed_structured::{ParsedToolCalls, ToolCall, ToolCallFormat};

fn call(name: &str, arguments: &str) -> ToolCall {
    ToolCall {
        name: name.into(),
        arguments: arguments.into(),
    }
}

fn expect(content: &str, calls: Vec<ToolCall>) -> ParsedToolCalls {
    ParsedToolCalls {
        content: content.into(),
        tool_calls: calls,
    }
}

/// Streams `pieces` and reassembles OpenAI-shaped deltas; checks the shape on the way (each
/// call's first delta has its name, names come once, indices in order).
fn stream(format: ToolCallFormat, pieces: &[&str]) -> ParsedToolCalls {
    let mut parser = format.stream();
    let mut deltas: Vec<_> = pieces.iter().map(|p| parser.push(p)).collect();
    deltas.push(parser.finish());
    let mut out = ParsedToolCalls::default();
    for delta in deltas {
        out.content.push_str(&delta.content);
        for d in delta.tool_calls {
            if d.index == out.tool_calls.len() {
                let name = d.name.clone().expect("a call's first delta names it");
                out.tool_calls.push(call(&name, ""));
            } else {
                assert!(
                    d.index < out.tool_calls.len(),
                    "index {} skipped ahead",
                    d.index
                );
                assert!(d.name.is_none(), "name sent twice for call {}", d.index);
            }
            out.tool_calls[d.index].arguments.push_str(&d.arguments);
        }
    }
    out
}

fn check(format: ToolCallFormat, text: &str, expected: ParsedToolCalls) {
    assert_eq!(format.parse(text), expected, "{format:?} whole: {text:?}");
    for arguments in expected.tool_calls.iter().map(|c| &c.arguments) {
        serde_json::from_str::<serde_json::Value>(arguments)
            .unwrap_or_else(|e| panic!("arguments are not JSON ({e}): {arguments}"));
    }
    for (k, _) in text.char_indices().skip(1) {
        let got = stream(format, &[&text[..k], &text[k..]]);
        assert_eq!(got, expected, "{format:?} split at byte {k}: {text:?}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(
        stream(format, &pieces),
        expected,
        "{format:?} char by char: {text:?}"
    );
}

#[test]
fn hermes_single_call_after_content() {
    check(
        ToolCallFormat::Hermes,
        "I'll check the weather for you.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n</tool_call>",
        expect(
            "I'll check the weather for you.\n",
            vec![call("get_weather", r#"{"city": "Paris", "unit": "celsius"}"#)],
        ),
    );
}

#[test]
fn hermes_parallel_calls_with_unicode() {
    check(
        ToolCallFormat::Hermes,
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"東京\", \"note\": \"🌧️\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {\"timezone\": \"Asia/Tokyo\"}}\n</tool_call>",
        expect(
            "",
            vec![
                call("get_weather", r#"{"city": "東京", "note": "🌧️"}"#),
                call("get_time", r#"{"timezone": "Asia/Tokyo"}"#),
            ],
        ),
    );
}

#[test]
fn hermes_escaped_strings_and_name_after_arguments() {
    check(
        ToolCallFormat::Hermes,
        "<tool_call>\n{\"arguments\": {\"code\": \"print(\\\"}</tool_call>\\\")\\nx = {'a': [1, 2]}\"}, \"name\": \"run_code\"}\n</tool_call>\nDone.",
        expect(
            "Done.",
            vec![call(
                "run_code",
                r#"{"code": "print(\"}</tool_call>\")\nx = {'a': [1, 2]}"}"#,
            )],
        ),
    );
}

#[test]
fn hermes_plain_content_with_angle_brackets() {
    check(
        ToolCallFormat::Hermes,
        "Use a < b, or <b>bold</b>, or even <tool_ but not a call.",
        expect(
            "Use a < b, or <b>bold</b>, or even <tool_ but not a call.",
            vec![],
        ),
    );
}

#[test]
fn hermes_call_without_arguments_or_closing_tag() {
    check(
        ToolCallFormat::Hermes,
        "<tool_call>\n{\"name\": \"list_files\"}",
        expect("", vec![call("list_files", "{}")]),
    );
}

#[test]
fn llama3_json_calls() {
    check(
        ToolCallFormat::Llama3Json,
        "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"San Francisco\", \"unit\": \"fahrenheit\"}}",
        expect(
            "",
            vec![call("get_weather", r#"{"city": "San Francisco", "unit": "fahrenheit"}"#)],
        ),
    );
    check(
        ToolCallFormat::Llama3Json,
        "<|python_tag|>{\"name\": \"search\", \"parameters\": {\"query\": \"rust borrow checker\"}}",
        expect("", vec![call("search", r#"{"query": "rust borrow checker"}"#)]),
    );
    check(
        ToolCallFormat::Llama3Json,
        "{\"type\": \"function\", \"name\": \"a\", \"parameters\": {\"x\": 1.5e3}}; {\"name\": \"b\", \"parameters\": {}}",
        expect(
            "",
            vec![call("a", r#"{"x": 1.5e3}"#), call("b", "{}")],
        ),
    );
}

#[test]
fn llama3_json_plain_and_json_answers_are_content() {
    check(
        ToolCallFormat::Llama3Json,
        "The capital of France is Paris. {not json}",
        expect("The capital of France is Paris. {not json}", vec![]),
    );
    check(
        ToolCallFormat::Llama3Json,
        "{\"answer\": 42, \"unit\": \"°C\"}",
        expect("{\"answer\": 42, \"unit\": \"°C\"}", vec![]),
    );
}

#[test]
fn mistral_array_calls() {
    check(
        ToolCallFormat::Mistral,
        "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}, {\"name\": \"get_time\", \"arguments\": {\"tz\": \"CET\"}}]",
        expect(
            "",
            vec![
                call("get_weather", r#"{"city": "Paris"}"#),
                call("get_time", r#"{"tz": "CET"}"#),
            ],
        ),
    );
    check(
        ToolCallFormat::Mistral,
        "Sure, one moment.[TOOL_CALLS] [{\"name\": \"translate\", \"arguments\": {\"text\": \"é ü ß\", \"to\": \"en\"}}]",
        expect(
            "Sure, one moment.",
            vec![call("translate", r#"{"text": "é ü ß", "to": "en"}"#)],
        ),
    );
}

#[test]
fn mistral_named_calls_and_content() {
    check(
        ToolCallFormat::Mistral,
        "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}[TOOL_CALLS]get_time[ARGS]{}",
        expect(
            "",
            vec![
                call("get_weather", r#"{"city": "Paris"}"#),
                call("get_time", "{}"),
            ],
        ),
    );
    check(
        ToolCallFormat::Mistral,
        "Use [brackets] and [TOOL freely.",
        expect("Use [brackets] and [TOOL freely.", vec![]),
    );
}

#[test]
fn pythonic_calls() {
    check(
        ToolCallFormat::Pythonic,
        "[get_weather(city=\"San Francisco\", metric=True), get_time(timezone='America/Los_Angeles')]",
        expect(
            "",
            vec![
                call("get_weather", r#"{"city": "San Francisco", "metric": true}"#),
                call("get_time", r#"{"timezone": "America/Los_Angeles"}"#),
            ],
        ),
    );
    check(
        ToolCallFormat::Pythonic,
        "[search(query=\"café ☕\", limit=5, filters={'lang': ['en', 'fr'], 'safe': None}, score=-0.75), now()]",
        expect(
            "",
            vec![
                call(
                    "search",
                    r#"{"query": "café ☕", "limit": 5, "filters": {"lang":["en","fr"],"safe":null}, "score": -0.75}"#,
                ),
                call("now", "{}"),
            ],
        ),
    );
    check(
        ToolCallFormat::Pythonic,
        "<|python_start|>[send_email(to='a@b.com', body='Hi,\\nsee you')]<|python_end|>",
        expect(
            "",
            vec![call(
                "send_email",
                r#"{"to": "a@b.com", "body": "Hi,\nsee you"}"#,
            )],
        ),
    );
}

#[test]
fn pythonic_plain_text_is_content() {
    check(
        ToolCallFormat::Pythonic,
        "[Note] This is plain text with a list [1, 2].",
        expect("[Note] This is plain text with a list [1, 2].", vec![]),
    );
    check(
        ToolCallFormat::Pythonic,
        "Sure! I can call [get_weather(city='x')] later.",
        expect("Sure! I can call [get_weather(city='x')] later.", vec![]),
    );
}

#[test]
fn parser_names_resolve() {
    for name in ToolCallFormat::NAMES {
        assert!(ToolCallFormat::from_name(name).is_some(), "{name}");
    }
    assert_eq!(ToolCallFormat::from_name("nope"), None);
}

#[test]
fn required_tool_choice_output_parses_as_a_json_array() {
    check(
        ToolCallFormat::JsonArray,
        "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Zürich\"}}, {\"name\": \"now\", \"parameters\": {}}]",
        expect(
            "",
            vec![call("get_weather", r#"{"city": "Zürich"}"#), call("now", "{}")],
        ),
    );
}

#[test]
fn forced_schemas_follow_the_tools() {
    let tools = vec![
        json!({"type": "function", "function": {"name": "get_weather",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}}),
        json!({"type": "function", "function": {"name": "now"}}),
    ];
    let required = forced::required_schema(&tools, false).unwrap();
    assert_eq!(required["maxItems"], json!(1));
    assert_eq!(
        required["items"]["anyOf"][0]["properties"]["name"],
        json!({"const": "get_weather"})
    );
    assert_eq!(
        required["items"]["anyOf"][1]["properties"]["parameters"],
        json!({"type": "object"})
    );
    assert!(forced::required_schema(&tools, true)
        .unwrap()
        .get("maxItems")
        .is_none());
    assert_eq!(
        forced::named_schema(&tools, "get_weather").unwrap(),
        tools[0]["function"]["parameters"]
    );
    let err = forced::named_schema(&tools, "missing").unwrap_err();
    assert!(err.contains("\"missing\""), "{err}");
    assert!(forced::required_schema(&[], true).is_err());
}

#[test]
fn deepseek_v3_fenced_calls() {
    check(
        ToolCallFormat::DeepSeekV3,
        "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"東京\", \"unit\": \"celsius\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        expect(
            "Let me look.",
            vec![
                call("get_weather", r#"{"city": "東京", "unit": "celsius"}"#),
                call("get_time", "{}"),
            ],
        ),
    );
}

#[test]
fn deepseek_v3_plain_answer_and_a_cut_off_call() {
    check(
        ToolCallFormat::DeepSeekV3,
        "Use `<｜tool` with ```json fences``` | ▁.",
        expect("Use `<｜tool` with ```json fences``` | ▁.", vec![]),
    );
    // The output ended inside the arguments: the call is kept with what was written.
    check(
        ToolCallFormat::DeepSeekV3,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": [1, 2]}",
        expect("", vec![call("f", r#"{"a": [1, 2]}"#)]),
    );
}

#[test]
fn deepseek_v31_calls() {
    check(
        ToolCallFormat::DeepSeekV31,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\": \"Tokyo\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"location\": \"Paris\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        expect(
            "",
            vec![
                call("get_weather", r#"{"location": "Tokyo"}"#),
                call("get_weather", r#"{"location": "Paris"}"#),
            ],
        ),
    );
}

#[test]
fn kimi_k2_calls_with_ids() {
    check(
        ToolCallFormat::KimiK2,
        "I'll search.<|tool_calls_section_begin|>\n<|tool_call_begin|>functions.web.search:0<|tool_call_argument_begin|>{\"q\": \"rust \\\"serde\\\"\"}<|tool_call_end|>\n<|tool_call_begin|>functions.get_time:1 <|tool_call_argument_begin|> {}<|tool_call_end|>\n<|tool_calls_section_end|>",
        expect(
            "I'll search.",
            vec![
                call("web.search", r#"{"q": "rust \"serde\""}"#),
                call("get_time", "{}"),
            ],
        ),
    );
    check(
        ToolCallFormat::KimiK2,
        "No tools: <|tool_calls",
        expect("No tools: <|tool_calls", vec![]),
    );
}
