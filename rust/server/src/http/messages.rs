//! `/v1/messages` (Anthropic's Messages API, as vLLM and SGLang serve it). The request becomes a
//! chat request (`validate::messages`), so the template, tools, grammars and parsers are the
//! chat route's; this adapter renders the output stage's split as content blocks (thinking,
//! text, tool_use), whole or as Anthropic's event stream. Every error on this route, the
//! layers' included (auth, body size, admission), is rewritten into Anthropic's error shape by
//! `anthropic_errors`.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{json, Value};

use super::agents::{self as agent, new_id, Agent, Answer, Output};
use super::error::ApiError;
use super::protocol::parse_body;
use super::protocol_agents::MessagesRequest;
use super::{ok_json, AppState};
#[allow(unused_imports)] // named by the #[utoipa::path] attributes
use super::{
    protocol_agents::{AnthropicError, AnthropicMessage, AnthropicTokenCount},
    response::ServerSentEvent,
};
use crate::chat_output::MessageDelta;
use crate::engine::TokenUsage;
use crate::generate::{self, Chunk, Finish};
use crate::validate;

/// The path prefix whose errors take Anthropic's shape.
pub const PATH: &str = "/v1/messages";

#[utoipa::path(post, path = "/v1/messages", request_body = MessagesRequest, responses((status = 200, description = "a message, or Anthropic's server-sent events with stream", content((AnthropicMessage = "application/json"), (ServerSentEvent = "text/event-stream"))), (status = 400, description = "invalid request", body = AnthropicError)))]
pub async fn messages(State(state): State<AppState>, body: Bytes) -> Response {
    match messages_inner(state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn messages_inner(state: AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: MessagesRequest = parse_body(body)?;
    let agent = Agent::resolve(&state, req.model.as_deref())?;
    let checked = validate::messages::messages_request(&req, &agent::chat_context(&state))?;
    let stream = req.stream.unwrap_or(false);
    let started = agent.run(&state, checked.spec.clone(), stream).await?;
    let render = Render {
        id: format!("msg_{}", started.rid.request()),
        // The name the client sent (an adapter's, or an alias of the model), else ours.
        model: req
            .model
            .clone()
            .filter(|m| !m.is_empty())
            .unwrap_or(started.model),
        answer: Answer::new(&state, &checked),
    };
    match started.output {
        Output::Stream(choices) => Ok(render.stream(choices)),
        Output::Whole(chunk) => Ok(ok_json(render.whole(&chunk))),
    }
}

impl Render {
    /// The whole message: thinking, text and tool_use blocks.
    fn whole(&self, chunk: &Chunk) -> Value {
        let parsed = self.answer.stage.parse(&self.answer.text(chunk));
        let mut content = Vec::new();
        if !parsed.reasoning_content.is_empty() {
            content.push(
                json!({"type": "thinking", "thinking": parsed.reasoning_content, "signature": ""}),
            );
        }
        if !parsed.content.is_empty() {
            content.push(json!({"type": "text", "text": parsed.content}));
        }
        for call in &parsed.tool_calls {
            content.push(
                json!({"type": "tool_use", "id": new_id("toolu"), "name": call.name,
                                "input": tool_input(&call.arguments)}),
            );
        }
        let (stop_reason, stop_sequence) =
            stop_reason(chunk.finish.as_ref(), !parsed.tool_calls.is_empty());
        let mut message = self.message(content, &chunk.usage);
        message["stop_reason"] = json!(stop_reason);
        message["stop_sequence"] = stop_sequence;
        message
    }
}

/// `POST /v1/messages/count_tokens`: the prompt's tokens, as `/v1/messages` renders the same
/// body (tools included).
#[utoipa::path(post, path = "/v1/messages/count_tokens", request_body = MessagesRequest, responses((status = 200, description = "`{input_tokens}`", body = AnthropicTokenCount), (status = 400, description = "invalid request", body = AnthropicError)))]
pub async fn count_tokens(State(state): State<AppState>, body: Bytes) -> Response {
    let run = async {
        let mut req: MessagesRequest = parse_body(&body)?;
        state.check_model(req.model.as_deref())?;
        req.max_tokens.get_or_insert(1);
        let checked = validate::messages::messages_request(&req, &agent::chat_context(&state))?;
        let ids = crate::prompt::tokenize_prompt(&state, checked.spec.prompt).await?;
        Ok::<_, ApiError>(ok_json(json!({"input_tokens": ids.len()})))
    };
    run.await.unwrap_or_else(|e| e.into_response())
}

/// A call's arguments as the `input` object (text that is not a JSON object is kept whole
/// under "arguments", so nothing the model wrote is lost).
fn tool_input(arguments: &str) -> Value {
    match serde_json::from_str::<Value>(arguments) {
        Ok(v) if v.is_object() => v,
        _ => json!({"arguments": arguments}),
    }
}

/// Anthropic's `stop_reason` and `stop_sequence` for how the generation ended.
fn stop_reason(finish: Option<&Finish>, made_calls: bool) -> (&'static str, Value) {
    match finish {
        Some(f) if f.reason == "length" => ("max_tokens", Value::Null),
        _ if made_calls => ("tool_use", Value::Null),
        Some(Finish {
            matched: Some(Value::String(s)),
            ..
        }) => ("stop_sequence", json!(s)),
        _ => ("end_turn", Value::Null),
    }
}

struct Render {
    id: String,
    model: String,
    answer: Answer,
}

impl Render {
    fn message(&self, content: Vec<Value>, usage: &TokenUsage) -> Value {
        json!({
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": content, "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens,
                      "cache_read_input_tokens": usage.cached_tokens},
        })
    }

    fn stream(self, choices: generate::Choices) -> Response {
        let mut chunks = choices.stream();
        let mut output = self.answer.stage.stream();
        let mut blocks = Blocks {
            open: None,
            index: 0,
            made_calls: false,
        };
        let stream = async_stream::stream! {
            let mut started = false;
            while let Some((_, item)) = chunks.next().await {
                let chunk = match item {
                    Ok(c) => c,
                    Err(e) => {
                        let e = ApiError::from(e);
                        yield Ok::<_, Infallible>(event("error", anthropic_body(e.status.as_u16(), &e.message)));
                        break;
                    }
                };
                if !started {
                    // The first chunk carries the prompt's usage.
                    started = true;
                    let usage = TokenUsage { completion_tokens: 0, ..chunk.usage };
                    let message = self.message(Vec::new(), &usage);
                    yield Ok(event("message_start", json!({"type": "message_start", "message": message})));
                }
                let delta = output.push(&self.answer.text(&chunk), chunk.finish.is_some());
                for e in blocks.push(delta) {
                    yield Ok(e);
                }
                if chunk.finish.is_some() {
                    for e in blocks.close() {
                        yield Ok(e);
                    }
                    let (reason, sequence) = stop_reason(chunk.finish.as_ref(), blocks.made_calls);
                    yield Ok(event("message_delta", json!({"type": "message_delta",
                        "delta": {"stop_reason": reason, "stop_sequence": sequence},
                        "usage": {"output_tokens": chunk.usage.completion_tokens}})));
                    yield Ok(event("message_stop", json!({"type": "message_stop"})));
                    break;
                }
            }
        };
        Sse::new(stream).into_response()
    }
}

fn event(kind: &str, body: Value) -> Event {
    Event::default()
        .event(kind)
        .data(serde_json::to_string(&body).unwrap_or_default())
}

#[derive(Clone, Copy, PartialEq)]
enum BlockKind {
    Thinking,
    Text,
    ToolUse,
}

/// A streamed message's content blocks: one open at a time, a new one started when the output
/// stage's deltas change kind (or a new call begins).
struct Blocks {
    open: Option<BlockKind>,
    index: usize,
    made_calls: bool,
}

impl Blocks {
    fn start(&mut self, kind: BlockKind, block: Value, out: &mut Vec<Event>) {
        out.extend(self.close());
        self.open = Some(kind);
        out.push(event(
            "content_block_start",
            json!({"type": "content_block_start",
            "index": self.index, "content_block": block}),
        ));
    }

    fn delta(&self, delta: Value) -> Event {
        event(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": self.index, "delta": delta}),
        )
    }

    fn push(&mut self, d: MessageDelta) -> Vec<Event> {
        let mut out = Vec::new();
        if !d.reasoning_content.is_empty() {
            if self.open != Some(BlockKind::Thinking) {
                self.start(
                    BlockKind::Thinking,
                    json!({"type": "thinking", "thinking": "", "signature": ""}),
                    &mut out,
                );
            }
            out.push(
                self.delta(json!({"type": "thinking_delta", "thinking": d.reasoning_content})),
            );
        }
        if !d.content.is_empty() {
            if self.open != Some(BlockKind::Text) {
                self.start(
                    BlockKind::Text,
                    json!({"type": "text", "text": ""}),
                    &mut out,
                );
            }
            out.push(self.delta(json!({"type": "text_delta", "text": d.content})));
        }
        for call in d.tool_calls {
            if let Some(name) = call.name {
                self.made_calls = true;
                self.start(
                    BlockKind::ToolUse,
                    json!({"type": "tool_use", "id": new_id("toolu"),
                    "name": name, "input": {}}),
                    &mut out,
                );
            }
            if !call.arguments.is_empty() && self.open == Some(BlockKind::ToolUse) {
                out.push(
                    self.delta(json!({"type": "input_json_delta", "partial_json": call.arguments})),
                );
            }
        }
        out
    }

    fn close(&mut self) -> Vec<Event> {
        match self.open.take() {
            Some(_) => {
                let e = event(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": self.index}),
                );
                self.index += 1;
                vec![e]
            }
            None => Vec::new(),
        }
    }
}

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`.
fn anthropic_body(status: u16, message: &str) -> Value {
    let kind = match status {
        400 | 422 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        _ => "api_error",
    };
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// Rewrites the OpenAI-shaped errors of `/v1/messages` (from its handler or any layer before
/// it) into Anthropic's shape, keeping the status and headers (Retry-After).
pub async fn anthropic_errors(req: Request, next: Next) -> Response {
    let ours = req.uri().path().starts_with(PATH);
    let response = next.run(req).await;
    if !ours || response.status().is_success() {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    // Error bodies are small JSON objects built by `ApiError`.
    let bytes = axum::body::to_bytes(body, 1 << 20)
        .await
        .unwrap_or_default();
    let message = serde_json::from_slice::<Value>(&bytes)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    let body = anthropic_body(parts.status.as_u16(), &message).to_string();
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Body::from(body))
}
