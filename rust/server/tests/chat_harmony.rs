//! GPT-OSS's harmony output through the real `/v1/chat/completions` route: a scripted worker
//! "samples" recorded harmony answers token by token (a tokenizer with harmony's special tokens,
//! whose generation config stops on `<|return|>` and `<|call|>` as GPT-OSS's does), and the
//! server with `--reasoning-parser gpt-oss --tool-call-parser gpt-oss` must split reasoning,
//! answer and calls the same streamed or not.

use std::path::PathBuf;
use std::sync::OnceLock;

use axum::http::StatusCode;
use serde_json::{json, Value};
use tokenspeed_server::http::AppState;
use tokenspeed_server::{build_state, ServerConfig};
use tokenspeed_text::TextTokenizer;

mod common;
use common::chat::{comparable, post, reassemble, ScriptedWorker};
use common::smollm2_dir;

const HARMONY_TOKENS: [&str; 7] = [
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|return|>",
    "<|call|>",
];

const CALL: &str = "<|channel|>analysis<|message|>Need the weather in Paris.<|end|><|start|>\
    assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>\
    {\"city\": \"Paris\", \"unit\": \"celsius\"}<|call|>";

const ANSWER: &str = "<|channel|>analysis<|message|>Simple arithmetic.<|end|><|start|>assistant\
    <|channel|>final<|message|>2 + 2 = 4.<|return|>";

/// SmolLM2's tokenizer with harmony's special tokens added, stopping on `<|return|>` and
/// `<|call|>` (GPT-OSS's generation config lists both as eos).
fn harmony_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let src = smollm2_dir();
        let dir = std::env::temp_dir().join(format!("tokenspeed-harmony-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        for file in [
            "config.json",
            "tokenizer_config.json",
            "chat_template.jinja",
        ] {
            std::fs::copy(src.join(file), dir.join(file)).expect("copy asset");
        }
        let text = std::fs::read_to_string(src.join("tokenizer.json")).expect("tokenizer.json");
        let mut tok: Value = serde_json::from_str(&text).expect("json");
        let next = tok["model"]["vocab"].as_object().map_or(0, |v| v.len());
        let added = tok["added_tokens"].as_array_mut().expect("added_tokens");
        for (i, content) in HARMONY_TOKENS.iter().enumerate() {
            added.push(
                json!({"id": next + i, "content": content, "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}),
            );
        }
        std::fs::write(dir.join("tokenizer.json"), tok.to_string()).expect("write");
        let (ret, call) = (next + 5, next + 6);
        let generation = json!({"bos_token_id": 1, "eos_token_id": [ret, 2, call]});
        std::fs::write(dir.join("generation_config.json"), generation.to_string()).expect("write");
        dir
    })
    .clone()
}

fn config(reasoning: Option<&str>, tools: Option<&str>) -> ServerConfig {
    ServerConfig {
        tokenizer_path: harmony_dir().to_string_lossy().into_owned(),
        reasoning_parser: reasoning.map(str::to_string),
        tool_call_parser: tools.map(str::to_string),
        enable_auto_tool_choice: tools.is_some(),
        ..common::server_config()
    }
}

/// A server whose worker answers `script` (looped: only a stop token ends it early), and the
/// script's length in tokens.
fn state(script: &str, reasoning: Option<&str>, tools: Option<&str>) -> (AppState, usize) {
    let tok = TextTokenizer::from_dir(&harmony_dir(), None).expect("tokenizer");
    let ids = tok.encode(script, false).expect("encode");
    let specials = HARMONY_TOKENS.map(|t| tok.token_to_id(t).expect("harmony token"));
    assert_eq!(
        ids.iter().filter(|id| specials.contains(id)).count(),
        script.matches("<|").count(),
        "each marker is one special token"
    );
    let n = ids.len();
    let link = Box::new(ScriptedWorker::start(ids));
    let state = build_state(config(reasoning, tools), link).expect("state");
    (state, n)
}

fn request(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters":
            {"type": "object", "properties": {"city": {"type": "string"}}}}}],
        "max_tokens": 200,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

async fn whole(state: &AppState, body: &Value) -> Value {
    let (status, text) = post(state, body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    serde_json::from_str(&text).expect("json")
}

/// The streamed message must reassemble to the non-streamed one, with the same finish reason.
async fn check_stream(state: &AppState, body: &Value, whole: &Value) {
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (status, sse) = post(state, &streamed).await;
    assert_eq!(status, StatusCode::OK, "{sse}");
    let (message, finish) = reassemble(&sse);
    assert_eq!(
        message,
        comparable(&whole["choices"][0]["message"]),
        "{sse}"
    );
    assert_eq!(finish, whole["choices"][0]["finish_reason"], "{sse}");
}

#[tokio::test]
async fn a_harmony_tool_call_is_a_tool_call_and_call_stops_generation() {
    let (st, n) = state(CALL, Some("gpt-oss"), Some("gpt-oss"));
    let body = request(json!({}));
    let v = whole(&st, &body).await;
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], n, "<|call|> ended it");
    let message = &choice["message"];
    assert_eq!(message["reasoning_content"], "Need the weather in Paris.");
    assert_eq!(message["content"], Value::Null, "{v}");
    let call = &message["tool_calls"][0];
    assert_eq!(call["function"]["name"], "get_weather");
    let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().expect("text"))
        .expect("arguments are JSON");
    assert_eq!(args, json!({"city": "Paris", "unit": "celsius"}));
    check_stream(&st, &body, &v).await;
}

#[tokio::test]
async fn analysis_is_reasoning_and_final_is_content_under_vllms_names() {
    let (st, n) = state(ANSWER, Some("openai_gptoss"), Some("openai"));
    for body in [request(json!({})), request(json!({"tools": null}))] {
        let v = whole(&st, &body).await;
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{v}");
        assert_eq!(v["usage"]["completion_tokens"], n, "<|return|> ended it");
        assert_eq!(choice["message"]["reasoning_content"], "Simple arithmetic.");
        assert_eq!(choice["message"]["content"], "2 + 2 = 4.", "{v}");
        check_stream(&st, &body, &v).await;
    }
}

#[tokio::test]
async fn output_cut_by_max_tokens_gives_what_was_parsed() {
    let (st, n) = state(CALL, Some("gpt-oss"), Some("gpt-oss"));
    for max_tokens in [1, 3, n / 2, n - 4] {
        let body = request(json!({ "max_tokens": max_tokens }));
        let v = whole(&st, &body).await;
        assert_eq!(v["choices"][0]["finish_reason"], "length", "{v}");
        check_stream(&st, &body, &v).await;
    }
    // Cut inside the arguments: the reasoning and the call as far as written.
    let v = whole(&st, &request(json!({ "max_tokens": n - 4 }))).await;
    let message = &v["choices"][0]["message"];
    assert_eq!(message["reasoning_content"], "Need the weather in Paris.");
    assert_eq!(message["tool_calls"][0]["function"]["name"], "get_weather");
}

#[tokio::test]
async fn the_tool_parser_alone_drops_the_reasoning() {
    let (st, _) = state(CALL, None, Some("gpt-oss"));
    let v = whole(&st, &request(json!({}))).await;
    let message = &v["choices"][0]["message"];
    assert_eq!(message.get("reasoning_content"), Some(&Value::Null), "{v}");
    assert_eq!(message["content"], Value::Null, "{v}");
    assert_eq!(message["tool_calls"][0]["function"]["name"], "get_weather");
    // A request without tools is still harmony: the answer only, no channel text in it.
    let (st, _) = state(ANSWER, None, Some("gpt-oss"));
    let body = request(json!({"tools": null}));
    let v = whole(&st, &body).await;
    let message = &v["choices"][0]["message"];
    assert_eq!(message["content"], "2 + 2 = 4.", "{v}");
    assert_eq!(message.get("reasoning_content"), Some(&Value::Null), "{v}");
    check_stream(&st, &body, &v).await;
}

#[tokio::test]
async fn grammars_after_harmony_reasoning_are_refused_naming_the_field() {
    let (st, _) = state(ANSWER, Some("gpt-oss"), Some("gpt-oss"));
    let schema = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}});
    for (extra, param) in [
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": null, "response_format": schema}),
            "response_format",
        ),
    ] {
        let (status, text) = post(&st, &request(extra)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
        let v: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["error"]["param"], param, "{text}");
        assert!(text.contains("harmony"), "{text}");
    }
}

#[test]
fn harmony_for_one_flag_and_another_format_for_the_other_fails_at_startup() {
    for (reasoning, tools) in [("gpt-oss", "hermes"), ("qwen3", "gpt-oss")] {
        let link = Box::new(ScriptedWorker::start(vec![0]));
        let err = build_state(config(Some(reasoning), Some(tools)), link)
            .err()
            .expect("refused");
        assert!(err.to_string().contains("--tool-call-parser"), "{err}");
    }
}
