//! Tool calls and reasoning through the real `/v1/chat/completions` route, engine thread and
//! scheduler, with a scripted worker that "samples" a recorded Qwen3-style answer (reasoning,
//! then two hermes tool calls, then EOS): the server with `--reasoning-parser qwen3
//! --tool-call-parser hermes --enable-auto-tool-choice` must split it, streamed and not, the same.

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tokenspeed_engine::SchedulerConfig;
use tokenspeed_server::http::{router, AppState};
use tokenspeed_server::{build_state, ServerConfig};
use tokenspeed_text::TextTokenizer;
use tower::ServiceExt;

mod common;
use common::chat::{comparable, post, reassemble, ScriptedWorker};
use common::smollm2_dir;

const ANSWER: &str = "<think>The user wants the weather in Paris and the time.</think>\n\n\
    <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \
    \"celsius\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n\
    </tool_call>";

fn config(tool_parser: Option<&str>, reasoning: Option<&str>, auto: bool) -> ServerConfig {
    ServerConfig {
        scheduler: SchedulerConfig {
            num_pages: 1024,
            ..common::scheduler_config()
        },
        tool_call_parser: tool_parser.map(str::to_string),
        reasoning_parser: reasoning.map(str::to_string),
        enable_auto_tool_choice: auto,
        ..common::server_config()
    }
}

fn state(tool_parser: Option<&str>, reasoning: Option<&str>, auto: bool) -> AppState {
    scripted(ANSWER, tool_parser, reasoning, auto)
}

/// A server whose worker writes `answer`, then EOS.
fn scripted(
    answer: &str,
    tool_parser: Option<&str>,
    reasoning: Option<&str>,
    auto: bool,
) -> AppState {
    let tok = TextTokenizer::from_dir(&smollm2_dir(), None).expect("tokenizer");
    let mut script = tok.encode(answer, false).expect("encode");
    script.push(tok.eos_token_ids()[0]);
    let link = Box::new(ScriptedWorker::start(script));
    build_state(config(tool_parser, reasoning, auto), link).expect("state")
}

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"]}}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    ])
}

fn request(extra: Value) -> Value {
    let mut body = json!({
        "messages": [{"role": "user", "content": "Weather and time in Paris?"}],
        "tools": tools(),
        "max_tokens": 200,
    });
    if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
        b.extend(e.clone());
    }
    body
}

#[tokio::test]
async fn reasoning_and_auto_tool_calls_split_the_same_streamed_or_not() {
    let st = state(Some("hermes"), Some("qwen3"), true);
    let (status, text) = post(&st, &request(json!({}))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    let choice = &v["choices"][0];
    let message = &choice["message"];
    assert_eq!(choice["finish_reason"], "tool_calls", "{text}");
    assert_eq!(
        message["reasoning_content"],
        "The user wants the weather in Paris and the time."
    );
    // Content is null: only whitespace (and the EOS marker, kept for the parser) was left.
    assert_eq!(message["content"], Value::Null, "{text}");
    let calls = message["tool_calls"].as_array().expect("tool_calls");
    assert_eq!(calls.len(), 2, "{text}");
    assert_eq!(calls[0]["type"], "function");
    assert!(calls[0]["id"]
        .as_str()
        .is_some_and(|id| id.starts_with("call_")));
    assert_ne!(calls[0]["id"], calls[1]["id"]);
    assert_eq!(calls[0]["function"]["name"], "get_weather");
    let args: Value =
        serde_json::from_str(calls[0]["function"]["arguments"].as_str().expect("text"))
            .expect("arguments are JSON text");
    assert_eq!(args, json!({"city": "Paris", "unit": "celsius"}));
    assert_eq!(calls[1]["function"]["name"], "get_time");

    let (status, sse) = post(&st, &request(json!({"stream": true}))).await;
    assert_eq!(status, StatusCode::OK, "{sse}");
    let (streamed, finish) = reassemble(&sse);
    assert_eq!(finish, "tool_calls");
    assert_eq!(streamed, comparable(message), "{sse}");
}

#[tokio::test]
async fn without_parallel_tool_calls_only_the_first_call_is_kept() {
    let st = state(Some("hermes"), Some("qwen3"), true);
    let body = request(json!({"parallel_tool_calls": false}));
    let (status, text) = post(&st, &body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    let message = &v["choices"][0]["message"];
    assert_eq!(message["tool_calls"].as_array().map(Vec::len), Some(1));
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, sse) = post(&st, &streamed).await;
    assert_eq!(reassemble(&sse).0, comparable(message));
}

#[tokio::test]
async fn thinking_disabled_leaves_the_think_block_in_the_content() {
    let st = state(None, Some("qwen3"), false);
    let body = json!({
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 200,
        "chat_template_kwargs": {"enable_thinking": false},
    });
    let (status, text) = post(&st, &body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    let message = &v["choices"][0]["message"];
    assert_eq!(
        message.get("reasoning_content"),
        Some(&Value::Null),
        "{text}"
    );
    assert_eq!(message["content"], ANSWER);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    // Thinking on (the default): the reasoning is split off, the rest is content (no tools).
    let mut on = body.clone();
    on["chat_template_kwargs"] = json!({});
    let (_, text) = post(&st, &on).await;
    let v: Value = serde_json::from_str(&text).expect("json");
    let message = &v["choices"][0]["message"];
    assert_eq!(
        message["reasoning_content"],
        "The user wants the weather in Paris and the time."
    );
    let content = message["content"].as_str().expect("content");
    assert!(content.starts_with("\n\n<tool_call>"), "{content:?}");
    on["stream"] = json!(true);
    let (_, sse) = post(&st, &on).await;
    assert_eq!(reassemble(&sse).0, comparable(message));
}

/// DeepSeek-V3.1 with thinking on: reasoning (its template opened the block), then calls in
/// its special-token markup.
const DEEPSEEK_V31_ANSWER: &str = "The user wants the weather in Paris and the time.</think>\
    Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \
    \"Paris\", \"unit\": \"celsius\"}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>\
    {}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";

#[tokio::test]
async fn deepseek_v31_thinking_and_calls_split_the_same_streamed_or_not() {
    let st = scripted(
        DEEPSEEK_V31_ANSWER,
        Some("deepseekv31"),
        Some("deepseek-v3"),
        true,
    );
    let body = request(json!({"chat_template_kwargs": {"thinking": true}}));
    let (status, text) = post(&st, &body).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let v: Value = serde_json::from_str(&text).expect("json");
    let choice = &v["choices"][0];
    let message = &choice["message"];
    assert_eq!(choice["finish_reason"], "tool_calls", "{text}");
    assert_eq!(
        message["reasoning_content"],
        "The user wants the weather in Paris and the time."
    );
    assert_eq!(message["content"], "Checking.", "{text}");
    let calls = message["tool_calls"].as_array().expect("tool_calls");
    let names: Vec<_> = calls.iter().map(|c| &c["function"]["name"]).collect();
    assert_eq!(names, ["get_weather", "get_time"], "{text}");
    assert_eq!(calls[1]["function"]["arguments"], "{}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let (_, sse) = post(&st, &streamed).await;
    let (got, finish) = reassemble(&sse);
    assert_eq!(finish, "tool_calls");
    assert_eq!(got, comparable(message), "{sse}");
}

#[tokio::test]
async fn auto_tool_choice_needs_the_flags() {
    for st in [state(Some("hermes"), None, false), state(None, None, false)] {
        for extra in [json!({}), json!({"tool_choice": "auto"})] {
            let (status, text) = post(&st, &request(extra)).await;
            assert_eq!(status, StatusCode::BAD_REQUEST, "{text}");
            let v: Value = serde_json::from_str(&text).expect("json");
            assert_eq!(v["error"]["param"], "tool_choice", "{text}");
            assert!(text.contains("--enable-auto-tool-choice"), "{text}");
        }
        // "none" renders the tools and parses nothing.
        let (status, text) = post(&st, &request(json!({"tool_choice": "none"}))).await;
        assert_eq!(status, StatusCode::OK, "{text}");
        assert!(!text.contains("\"tool_calls\":["), "{text}");
    }
}

#[tokio::test]
async fn tool_results_render_and_bad_tool_fields_are_400s() {
    let st = state(Some("hermes"), None, true);
    let conversation = json!([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
    ]);
    let (status, text) = post(&st, &request(json!({"messages": conversation}))).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    for (extra, param) in [
        (
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            "messages",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
            "messages",
        ),
        (json!({"tools": [{"type": "function"}]}), "tools"),
        (
            json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
            "tools",
        ),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": [], "tool_choice": "required"}),
            "tool_choice",
        ),
        // Forced calls need a grammar; this server has --grammar-backend none.
        (json!({"tool_choice": "required"}), "tool_choice"),
    ] {
        let (status, text) = post(&st, &request(extra.clone())).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{extra}: {text}");
        let v: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(v["error"]["param"], param, "{extra}: {text}");
    }
}

#[test]
fn unknown_parsers_fail_at_startup() {
    for cfg in [
        config(Some("nonesuch"), None, false),
        config(None, Some("nonesuch"), false),
        config(None, None, true),
    ] {
        let link = Box::new(ScriptedWorker::start(vec![0]));
        let err = build_state(cfg, link).err().expect("refused");
        assert!(err.to_string().contains("--"), "{err}");
    }
}

// --- /v1/responses and /v1/messages: the same output stage, rendered as their items/blocks ----

async fn post_to(
    state: &AppState,
    path: &str,
    body: &Value,
    key: Option<&str>,
) -> (StatusCode, String) {
    let mut req = Request::builder()
        .method("POST")
        .uri(path)
        .header("content-type", "application/json");
    if let Some(key) = key {
        req = req.header("x-api-key", key);
    }
    let req = req.body(Body::from(body.to_string())).expect("request");
    let resp = router(state.clone()).oneshot(req).await.expect("response");
    let status = resp.status();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

/// Server-sent events as (event name, data); each event's name must match its data's `type`.
fn named_events(sse: &str) -> Vec<(String, Value)> {
    sse.split("\n\n")
        .filter(|block| !block.trim().is_empty())
        .map(|block| {
            let line = |prefix: &str| {
                block
                    .lines()
                    .find_map(|l| l.strip_prefix(prefix))
                    .unwrap_or_default()
                    .to_string()
            };
            let data: Value = serde_json::from_str(&line("data: ")).expect("event json");
            let name = line("event: ");
            assert_eq!(data["type"], name.as_str(), "{block}");
            (name, data)
        })
        .collect()
}

fn agent_tools(schema_key: &str) -> Vec<Value> {
    tools()
        .as_array()
        .expect("tools")
        .iter()
        .map(|t| {
            let f = &t["function"];
            match schema_key {
                "input_schema" => json!({"name": f["name"], "input_schema": f["parameters"]}),
                _ => json!({"type": "function", "name": f["name"], "parameters": f["parameters"]}),
            }
        })
        .collect()
}

/// Output items without their ids (a stream's and a whole response's ids differ).
fn items_without_ids(output: &Value) -> Vec<Value> {
    output
        .as_array()
        .expect("output")
        .iter()
        .map(|i| match i["type"].as_str() {
            Some("function_call") => json!({"call": i["name"], "arguments": i["arguments"]}),
            Some("reasoning") => json!({"reasoning": i["content"][0]["text"]}),
            _ => json!({"message": i["content"][0]["text"]}),
        })
        .collect()
}

#[tokio::test]
async fn responses_render_reasoning_and_calls_streamed_or_not() {
    let state = state(Some("hermes"), Some("qwen3"), true);
    let mut body = json!({"input": "Weather and time in Paris?", "tools": agent_tools("parameters"),
                          "max_output_tokens": 200});
    let (status, text) = post_to(&state, "/v1/responses", &body, None).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let whole: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(whole["status"], "completed", "{whole}");
    let items = items_without_ids(&whole["output"]);
    assert_eq!(
        items[0],
        json!({"reasoning": "The user wants the weather in Paris and the time."})
    );
    assert_eq!(items[1]["call"], "get_weather");
    let args: Value =
        serde_json::from_str(items[1]["arguments"].as_str().expect("text")).expect("args");
    assert_eq!(args, json!({"city": "Paris", "unit": "celsius"}));
    assert_eq!(items[2]["call"], "get_time");
    assert_eq!(items.len(), 3, "{whole}");

    body["stream"] = json!(true);
    let (status, sse) = post_to(&state, "/v1/responses", &body, None).await;
    assert_eq!(status, StatusCode::OK, "{sse}");
    let events = named_events(&sse);
    for (i, (_, e)) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], i as u64, "{e}");
    }
    let kinds: Vec<&str> = events.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        kinds[..3],
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added"
        ]
    );
    assert_eq!(kinds.last(), Some(&"response.completed"));
    let last = &events.last().expect("events").1["response"];
    assert_eq!(items_without_ids(&last["output"]), items, "{sse}");
    // The deltas add up to the items, and each done item is the final one.
    let joined = |kind: &str, index: u64| -> String {
        events
            .iter()
            .filter(|(k, e)| k == kind && e["output_index"] == index)
            .map(|(_, e)| e["delta"].as_str().unwrap_or_default())
            .collect()
    };
    assert_eq!(
        joined("response.reasoning_text.delta", 0),
        items[0]["reasoning"]
    );
    assert_eq!(
        joined("response.function_call_arguments.delta", 1),
        items[1]["arguments"]
    );
    let done: Vec<&Value> = events
        .iter()
        .filter(|(k, _)| k == "response.output_item.done")
        .map(|(_, e)| &e["item"])
        .collect();
    assert_eq!(done.len(), 3);
    assert_eq!(*done[1], last["output"][1]);
}

/// A streamed Anthropic message reassembled into content blocks, as Anthropic's client does.
fn anthropic_blocks(events: &[(String, Value)]) -> (Vec<Value>, Value) {
    let mut blocks: Vec<Value> = Vec::new();
    let mut json_text: Vec<String> = Vec::new();
    let mut stop = Value::Null;
    for (kind, e) in events {
        match kind.as_str() {
            "content_block_start" => {
                assert_eq!(e["index"], blocks.len() as u64, "{e}");
                blocks.push(e["content_block"].clone());
                json_text.push(String::new());
            }
            "content_block_delta" => {
                let i = e["index"].as_u64().expect("index") as usize;
                let d = &e["delta"];
                let b = &mut blocks[i];
                match d["type"].as_str() {
                    Some("text_delta") => {
                        b["text"] = json!(format!(
                            "{}{}",
                            b["text"].as_str().unwrap_or_default(),
                            d["text"].as_str().unwrap_or_default()
                        ))
                    }
                    Some("thinking_delta") => {
                        b["thinking"] = json!(format!(
                            "{}{}",
                            b["thinking"].as_str().unwrap_or_default(),
                            d["thinking"].as_str().unwrap_or_default()
                        ))
                    }
                    Some("input_json_delta") => {
                        json_text[i].push_str(d["partial_json"].as_str().unwrap_or_default())
                    }
                    other => panic!("unknown delta {other:?}"),
                }
            }
            "content_block_stop" => {
                let i = e["index"].as_u64().expect("index") as usize;
                if blocks[i]["type"] == "tool_use" {
                    blocks[i]["input"] = serde_json::from_str(&json_text[i]).expect("input json");
                }
            }
            "message_delta" => stop = e["delta"]["stop_reason"].clone(),
            _ => {}
        }
    }
    (blocks, stop)
}

#[tokio::test]
async fn messages_render_thinking_and_tool_use_streamed_or_not() {
    let state = state(Some("hermes"), Some("qwen3"), true);
    let mut body = json!({"max_tokens": 200, "tools": agent_tools("input_schema"),
        "messages": [{"role": "user", "content": "Weather and time in Paris?"}]});
    let (status, text) = post_to(&state, "/v1/messages", &body, None).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let whole: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(whole["stop_reason"], "tool_use", "{whole}");
    let content = whole["content"].as_array().expect("content");
    let kinds: Vec<&str> = content.iter().filter_map(|b| b["type"].as_str()).collect();
    assert_eq!(kinds, ["thinking", "tool_use", "tool_use"]);
    assert_eq!(
        content[0]["thinking"],
        "The user wants the weather in Paris and the time."
    );
    assert_eq!(
        content[1]["input"],
        json!({"city": "Paris", "unit": "celsius"})
    );
    assert_eq!(content[2]["name"], "get_time");

    body["stream"] = json!(true);
    let (status, sse) = post_to(&state, "/v1/messages", &body, None).await;
    assert_eq!(status, StatusCode::OK, "{sse}");
    let events = named_events(&sse);
    assert_eq!(events[0].0, "message_start");
    assert_eq!(events.last().map(|e| e.0.as_str()), Some("message_stop"));
    let (blocks, stop) = anthropic_blocks(&events);
    assert_eq!(stop, "tool_use");
    let strip = |bs: &[Value]| -> Vec<Value> {
        bs.iter()
            .map(|b| {
                let mut b = b.clone();
                if let Some(o) = b.as_object_mut() {
                    o.remove("id");
                }
                b
            })
            .collect()
    };
    assert_eq!(strip(&blocks), strip(content), "{sse}");
}

#[tokio::test]
async fn messages_take_the_x_api_key_and_answer_errors_in_anthropics_shape() {
    let tok = TextTokenizer::from_dir(&smollm2_dir(), None).expect("tokenizer");
    let mut script = tok.encode("Hello there", false).expect("encode");
    script.push(tok.eos_token_ids()[0]);
    let config = ServerConfig {
        api_key: Some("sk-k".into()),
        ..config(None, None, false)
    };
    let state = build_state(config, Box::new(ScriptedWorker::start(script))).expect("state");
    let body = json!({"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]});
    for key in [None, Some("wrong")] {
        let (status, text) = post_to(&state, "/v1/messages", &body, key).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        let err: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(
            err,
            json!({"type": "error", "error": {"type": "authentication_error",
            "message": "invalid or missing API key"}})
        );
    }
    let (status, text) = post_to(&state, "/v1/messages", &body, Some("sk-k")).await;
    assert_eq!(status, StatusCode::OK, "{text}");
    let m: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(
        m["content"],
        json!([{"type": "text", "text": "Hello there"}])
    );
    assert_eq!(m["stop_reason"], "end_turn");
    let (status, text) = post_to(
        &state,
        "/v1/messages",
        &json!({"messages": []}),
        Some("sk-k"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let err: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(err["error"]["type"], "invalid_request_error", "{err}");
    // Other routes keep OpenAI's error shape.
    let (status, text) = post_to(&state, "/v1/responses", &json!({"input": 3}), Some("sk-k")).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    let err: Value = serde_json::from_str(&text).expect("json");
    assert_eq!(err["error"]["param"], "input", "{err}");
}
