use super::*;
use serde_json::json;

fn request(extra: Value) -> ChatCompletionRequest {
    let mut body = json!({
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}],
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    serde_json::from_value(body).expect("request")
}

fn spec() -> GenerationSpec {
    GenerationSpec {
        prompt: Prompt::Ids(Vec::new()),
        sampling: tokenspeed_engine::SamplingParams::greedy(),
        max_new_tokens: None,
        min_new_tokens: 0,
        stop: vec![],
        stop_regex: vec![],
        stop_token_ids: vec![],
        ignore_eos: false,
        skip_special_tokens: true,
        spaces_between_special_tokens: true,
        include_stop_str_in_output: false,
        top_logprobs: 0,
        prompt_logprobs: None,
        grammar: None,
        grammar_starts_after: None,
        priority: 0,
        truncate_prompt: None,
        kv_transfer: tokenspeed_engine::KvTransfer::None,
    }
}

const THINK_END: u32 = 7;

fn reasoning_parsers() -> ChatParsers {
    ChatParsers {
        tool_call: Some(ToolCallFormat::Hermes),
        reasoning: Some(ReasoningFormat::Qwen3),
        auto_tool_choice: true,
        think_end_id: Some(THINK_END),
    }
}

#[test]
fn forced_calls_get_a_grammar_that_starts_after_the_reasoning() {
    let named = json!({"tool_choice": {"type": "function", "function": {"name": "f"}}});
    let mut s = spec();
    let stage = output_stage(&request(named.clone()), &reasoning_parsers(), &mut s).expect("valid");
    assert_eq!(stage.tools, ToolMode::Named("f".into()));
    let grammar = s.grammar.expect("forced with a grammar");
    assert_eq!(grammar.field, "tool_choice");
    assert!(
        matches!(grammar.spec, GrammarSpec::JsonSchema(ref v) if v["properties"]["a"]["type"] == "integer")
    );
    assert_eq!(s.grammar_starts_after, Some(THINK_END));
    assert!(
        s.skip_special_tokens,
        "the forced output has no special markers"
    );

    // Thinking off: the grammar applies from the first token.
    let mut off = named.clone();
    off["chat_template_kwargs"] = json!({"enable_thinking": false});
    let mut s = spec();
    output_stage(&request(off), &reasoning_parsers(), &mut s).expect("valid");
    assert!(s.grammar.is_some());
    assert_eq!(s.grammar_starts_after, None);

    // No think-end token: refused, naming the field whose grammar could not be placed.
    let parsers = ChatParsers {
        think_end_id: None,
        ..reasoning_parsers()
    };
    let err = output_stage(&request(named), &parsers, &mut spec()).expect_err("refused");
    assert_eq!(err.param(), Some("tool_choice"));
}

#[test]
fn required_parses_the_forced_array_and_auto_keeps_special_tokens() {
    let mut s = spec();
    let stage = output_stage(
        &request(json!({"tool_choice": "required", "parallel_tool_calls": false})),
        &ChatParsers::default(),
        &mut s,
    )
    .expect("valid");
    assert_eq!(
        stage.tools,
        ToolMode::Parse {
            format: ToolCallFormat::JsonArray,
            single: true
        }
    );
    let Some(GrammarSpec::JsonSchema(schema)) = s.grammar.map(|g| g.spec) else {
        panic!("required is forced with a JSON schema");
    };
    assert_eq!(schema["maxItems"], 1);

    let mut s = spec();
    let stage = output_stage(&request(json!({})), &reasoning_parsers(), &mut s).expect("auto");
    assert!(matches!(
        stage.tools,
        ToolMode::Parse {
            format: ToolCallFormat::Hermes,
            ..
        }
    ));
    assert!(
        !s.skip_special_tokens,
        "the model's markers may be special tokens"
    );
    assert!(s.grammar.is_none());
}

#[test]
fn deepseek_v3_reads_its_templates_thinking_switch() {
    let parsers = ChatParsers {
        tool_call: Some(ToolCallFormat::DeepSeekV31),
        reasoning: Some(ReasoningFormat::DeepSeekV3),
        auto_tool_choice: true,
        think_end_id: Some(THINK_END),
    };
    let stage_for = |kwargs: Value| {
        let req = request(json!({"chat_template_kwargs": kwargs}));
        output_stage(&req, &parsers, &mut spec()).expect("valid")
    };
    let on = stage_for(json!({"thinking": true}));
    assert_eq!(on.enable_thinking, Some(true));
    assert!(on.starts_in_reasoning());
    // Qwen3's switch is not DeepSeek's: the template ignores it, so does the parser.
    let other = stage_for(json!({"enable_thinking": true}));
    assert_eq!(other.enable_thinking, None);
    assert!(!other.starts_in_reasoning());
    let mut s = spec();
    output_stage(&request(json!({})), &parsers, &mut s).expect("valid");
    assert!(
        !s.skip_special_tokens,
        "DeepSeek's tool markers are special tokens"
    );
}

#[test]
fn a_forced_call_and_another_grammar_conflict() {
    let mut s = spec();
    s.grammar = Some(GrammarRequest {
        spec: GrammarSpec::JsonObject,
        field: "response_format",
    });
    let err = output_stage(
        &request(json!({"tool_choice": "required"})),
        &ChatParsers::default(),
        &mut s,
    )
    .expect_err("two grammars");
    assert_eq!(err.param(), Some("tool_choice"));
}

#[test]
fn template_messages_fill_null_content_and_parse_arguments() {
    let messages: Vec<Map<String, Value>> = serde_json::from_value(json!([
        {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
            "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "2"},
    ]))
    .expect("messages");
    let out = template_messages(messages);
    assert_eq!(out[0]["content"], "");
    assert_eq!(
        out[0]["tool_calls"][0]["function"]["arguments"],
        json!({"a": 1})
    );
    assert_eq!(out[1]["content"], "2");
}
