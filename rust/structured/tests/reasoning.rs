//! Reasoning parsers on recorded-style outputs: whole, and streamed split at every char boundary
//! (and char by char), the pieces reassemble to the whole parse.

use tokenspeed_structured::{ReasoningFormat, ReasoningOutput};

fn out(reasoning: &str, content: &str) -> ReasoningOutput {
    ReasoningOutput {
        reasoning_content: reasoning.into(),
        content: content.into(),
    }
}

fn stream(format: ReasoningFormat, thinking: Option<bool>, pieces: &[&str]) -> ReasoningOutput {
    let mut parser = format.stream(thinking);
    let mut got = ReasoningOutput::default();
    let mut deltas: Vec<_> = pieces.iter().map(|p| parser.push(p)).collect();
    deltas.push(parser.finish());
    for d in deltas {
        got.reasoning_content.push_str(&d.reasoning_content);
        got.content.push_str(&d.content);
    }
    got
}

fn check(format: ReasoningFormat, thinking: Option<bool>, text: &str, expected: ReasoningOutput) {
    assert_eq!(
        format.parse(text, thinking),
        expected,
        "{format:?} whole: {text:?}"
    );
    for (k, _) in text.char_indices().skip(1) {
        let got = stream(format, thinking, &[&text[..k], &text[k..]]);
        assert_eq!(got, expected, "{format:?} split at byte {k}: {text:?}");
    }
    let chars: Vec<String> = text.chars().map(String::from).collect();
    let pieces: Vec<&str> = chars.iter().map(String::as_str).collect();
    assert_eq!(
        stream(format, thinking, &pieces),
        expected,
        "char by char: {text:?}"
    );
}

#[test]
fn deepseek_r1_with_and_without_the_opening_tag() {
    let r1 = ReasoningFormat::DeepSeekR1;
    check(
        r1,
        None,
        "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
        out(
            "\nThe user wants 2+2. That is 4.\n",
            "\n\nThe answer is **4**.",
        ),
    );
    // R1's template opens the block in the prompt: the output starts inside it.
    check(
        r1,
        None,
        "Okay, 東京 is Tokyo 🗼. So</think>Tokyo.",
        out("Okay, 東京 is Tokyo 🗼. So", "Tokyo."),
    );
}

#[test]
fn deepseek_r1_unfinished_reasoning_is_all_reasoning() {
    check(
        ReasoningFormat::DeepSeekR1,
        None,
        "<think>Let me think about </thi",
        out("Let me think about </thi", ""),
    );
}

#[test]
fn qwen3_thinking_and_not() {
    let q = ReasoningFormat::Qwen3;
    let text = "<think>\nI should call the tool with city=Paris.\n</think>\n\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>";
    check(
        q,
        Some(true),
        text,
        out(
            "\nI should call the tool with city=Paris.\n",
            "\n\n<tool_call>\n{\"name\": \"f\"}\n</tool_call>",
        ),
    );
    check(q, None, "<think></think>Paris.", out("", "Paris."));
    // enable_thinking=false: the template closed an empty block in the prompt; all is content,
    // even text that mentions the tags.
    check(
        q,
        Some(false),
        "Paris is the capital. Tags like </think> are just text here.",
        out(
            "",
            "Paris is the capital. Tags like </think> are just text here.",
        ),
    );
}

#[test]
fn stream_reports_when_reasoning_ends() {
    let mut s = ReasoningFormat::Qwen3.stream(None);
    s.push("<think>abc</th");
    assert!(!s.reasoning_ended());
    s.push("ink>x");
    assert!(s.reasoning_ended());
    assert!(ReasoningFormat::Qwen3.stream(Some(false)).reasoning_ended());
}

#[test]
fn deepseek_v3_thinks_only_when_asked() {
    let v3 = ReasoningFormat::DeepSeekV3;
    let thought =
        "The user wants the weather; call get_weather.</think>\n\nChecking.<｜tool▁calls▁begin｜>";
    // thinking=true: the template opened the block in the prompt.
    check(
        v3,
        Some(true),
        thought,
        out(
            "The user wants the weather; call get_weather.",
            "\n\nChecking.<｜tool▁calls▁begin｜>",
        ),
    );
    check(v3, Some(true), "<think>hm</think>ok", out("hm", "ok"));
    // Not asked (SGLang's default for this parser): all is content, tags included.
    check(
        v3,
        None,
        "Hello </think> there",
        out("", "Hello </think> there"),
    );
    check(
        v3,
        Some(false),
        "<think>x</think>y",
        out("", "<think>x</think>y"),
    );
    assert_eq!(v3.thinking_kwarg(), "thinking");
    assert!(v3.stream(None).reasoning_ended());
}

#[test]
fn kimi_reasons_only_inside_an_opening_block() {
    let kimi = ReasoningFormat::Kimi;
    check(
        kimi,
        None,
        "◁think▷Compare 3 and 5: 5 ◁ bigger.◁/think▷5 is larger.",
        out("Compare 3 and 5: 5 ◁ bigger.", "5 is larger."),
    );
    check(kimi, None, "◁think▷cut off ◁/thi", out("cut off ◁/thi", ""));
    check(
        kimi,
        None,
        "No block: ◁think▷ here is text.",
        out("", "No block: ◁think▷ here is text."),
    );
    check(kimi, None, "◁thi", out("", "◁thi"));
    let mut s = kimi.stream(None);
    s.push("◁th");
    assert!(!s.reasoning_ended());
    s.push("ink▷a◁/think▷");
    assert!(s.reasoning_ended());
    let mut s = kimi.stream(None);
    s.push("Hi");
    assert!(s.reasoning_ended());
}
