//! `/v1/responses` (OpenAI's Responses API) and `GET` / `DELETE /v1/responses/{id}`. The request
//! becomes a chat request (`validate::responses`), so the template, tools, grammars and parsers
//! are the chat route's; this adapter renders the output stage's split (reasoning, text, tool
//! calls) as Responses output items, whole or as the documented event stream, and keeps stored
//! answers for `previous_response_id` (`response_store`).

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{json, Map, Value};

use super::agents::{self as agent, new_id, Agent, Answer, Output};
use super::chat::chat_logprobs;
use super::error::ApiError;
use super::openai::LogprobStyle;
use super::protocol::parse_body;
use super::protocol_agents::ResponsesRequest;
use super::{ok_json, unix_now, AppState};
#[allow(unused_imports)] // named by the #[utoipa::path] attributes
use super::{
    protocol_agents::{ResponseDeleted, ResponseObject},
    response::{ErrorResponse, ServerSentEvent},
};
use crate::chat_output::MessageDelta;
use crate::engine::TokenUsage;
use crate::generate::{self, Chunk, TokenLogprob};
use crate::response_store::{ResponseStore, StoredResponse};
use crate::validate;

#[utoipa::path(post, path = "/v1/responses", request_body = ResponsesRequest, responses((status = 200, description = "a response, or its server-sent events with stream", content((ResponseObject = "application/json"), (ServerSentEvent = "text/event-stream"))), (status = 400, description = "invalid request", body = ErrorResponse)))]
pub async fn create(State(state): State<AppState>, body: Bytes) -> Response {
    match create_inner(state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

#[utoipa::path(get, path = "/v1/responses/{id}", params(("id" = String, Path, description = "response id")), responses((status = 200, description = "the stored response", body = ResponseObject), (status = 404, description = "not stored (or deleted)", body = ErrorResponse)))]
pub async fn get(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    match state.responses.get(&id) {
        Some(stored) => ok_json(stored.response),
        None => not_found(&id).into_response(),
    }
}

#[utoipa::path(delete, path = "/v1/responses/{id}", params(("id" = String, Path, description = "response id")), responses((status = 200, description = "deleted", body = ResponseDeleted), (status = 404, description = "not stored (or deleted)", body = ErrorResponse)))]
pub async fn delete(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    if state.responses.delete(&id) {
        ok_json(json!({"id": id, "object": "response.deleted", "deleted": true}))
    } else {
        not_found(&id).into_response()
    }
}

fn not_found(id: &str) -> ApiError {
    ApiError::not_found(format!("Response with id '{id}' not found."))
}

async fn create_inner(state: AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: ResponsesRequest = parse_body(body)?;
    let agent = Agent::resolve(&state, req.model.as_deref())?;
    let history = validate::responses::history(req.previous_response_id.as_deref(), |id| {
        state.responses.get(id).map(|s| s.messages)
    })?;
    let checked =
        validate::responses::responses_request(&req, history, &agent::chat_context(&state))?;
    let stream = req.stream.unwrap_or(false);
    let started = agent.run(&state, checked.chat.spec.clone(), stream).await?;
    let mut head = head(&req, format!("resp_{}", started.rid.request()));
    head.insert("model".into(), json!(started.model));
    let render = Render {
        head,
        answer: Answer::new(&state, &checked.chat),
        logprobs: checked.chat.want_logprobs,
        store: checked
            .store
            .then(|| (state.responses.clone(), checked.conversation)),
    };
    match started.output {
        Output::Stream(choices) => Ok(render.stream(choices)),
        Output::Whole(chunk) => Ok(ok_json(render.whole(&chunk))),
    }
}

/// The request fields every rendering of the response repeats (OpenAI echoes them).
fn head(req: &ResponsesRequest, id: String) -> Map<String, Value> {
    let or =
        |v: Option<&Value>, default: Value| v.filter(|v| !v.is_null()).cloned().unwrap_or(default);
    let object = json!({
        "id": id,
        "object": "response",
        "created_at": unix_now(),
        "status": "in_progress",
        "error": null,
        "incomplete_details": null,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": null,
        "output": [],
        "parallel_tool_calls": req.parallel_tool_calls.unwrap_or(true),
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": null, "summary": null},
        "store": req.store.unwrap_or(true),
        "temperature": req.temperature,
        "text": or(req.text.as_ref(), json!({"format": {"type": "text"}})),
        "tool_choice": or(req.tool_choice.as_ref(), json!("auto")),
        "tools": req.tools.clone().unwrap_or_default(),
        "top_p": req.top_p,
        "top_logprobs": req.top_logprobs,
        "truncation": "disabled",
        "usage": null,
        "user": req.user,
        "metadata": req.metadata.clone().unwrap_or_default(),
    });
    match object {
        Value::Object(m) => m,
        _ => Map::new(),
    }
}

fn message_item(id: String, text: &str, logprobs: Value, status: &str) -> Value {
    json!({"type": "message", "id": id, "status": status, "role": "assistant",
           "content": [output_text(text, logprobs)]})
}

fn output_text(text: &str, logprobs: Value) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs})
}

fn reasoning_item(id: String, text: &str, status: &str) -> Value {
    json!({"type": "reasoning", "id": id, "status": status, "summary": [],
           "content": [{"type": "reasoning_text", "text": text}]})
}

fn call_item(id: String, call_id: String, name: &str, arguments: &str) -> Value {
    json!({"type": "function_call", "id": id, "call_id": call_id, "name": name,
           "arguments": arguments, "status": "completed"})
}

fn usage(u: &TokenUsage) -> Value {
    json!({
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    })
}

/// The assistant turn of `output` as a chat message (what the next turn's template shows).
fn assistant_message(output: &[Value]) -> Map<String, Value> {
    let mut content = String::new();
    let mut calls = Vec::new();
    for item in output {
        match item["type"].as_str() {
            Some("message") => {
                for part in item["content"].as_array().into_iter().flatten() {
                    content.push_str(part["text"].as_str().unwrap_or_default());
                }
            }
            Some("function_call") => calls.push(json!({"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}})),
            _ => {}
        }
    }
    let mut m = Map::new();
    m.insert("role".into(), json!("assistant"));
    m.insert("content".into(), json!(content));
    if !calls.is_empty() {
        m.insert("tool_calls".into(), Value::Array(calls));
    }
    m
}

/// How one response is rendered and kept.
struct Render {
    head: Map<String, Value>,
    answer: Answer,
    /// `include: ["message.output_text.logprobs"]` was asked for.
    logprobs: bool,
    /// With `store`: where the response goes, and the conversation it answered.
    store: Option<Keep>,
}

/// Where a stored response goes, and the conversation (chat messages) it answered.
type Keep = (Arc<ResponseStore>, Vec<Map<String, Value>>);

impl Render {
    /// The tokens' logprobs as the output text's (the chat route's entries), or [].
    fn logprobs(&self, lps: &[TokenLogprob]) -> Value {
        if !self.logprobs {
            return json!([]);
        }
        let style = LogprobStyle { as_ids: false };
        json!(chat_logprobs(&self.answer.tokenizer, style, lps).content)
    }

    /// The whole response: reasoning, the message (with the logprobs of every output token,
    /// as vLLM's) and the calls.
    fn whole(&self, chunk: &Chunk) -> Value {
        let parsed = self.answer.stage.parse(&self.answer.text(chunk));
        let mut output = Vec::new();
        if !parsed.reasoning_content.is_empty() {
            let text = &parsed.reasoning_content;
            output.push(reasoning_item(new_id("rs"), text, "completed"));
        }
        if !parsed.content.is_empty() || parsed.tool_calls.is_empty() {
            let logprobs = self.logprobs(&chunk.logprobs);
            output.push(message_item(
                new_id("msg"),
                &parsed.content,
                logprobs,
                "completed",
            ));
        }
        for call in &parsed.tool_calls {
            let item = call_item(new_id("fc"), new_id("call"), &call.name, &call.arguments);
            output.push(item);
        }
        self.finish(output, chunk)
    }

    fn object(&self, status: &str, output: Vec<Value>, usage: Option<Value>) -> Value {
        let mut m = self.head.clone();
        m.insert("status".into(), json!(status));
        m.insert("output".into(), Value::Array(output));
        m.insert("usage".into(), usage.unwrap_or(Value::Null));
        Value::Object(m)
    }

    /// The finished response (stored when asked to), given its output and last chunk.
    fn finish(&self, output: Vec<Value>, last: &Chunk) -> Value {
        let incomplete = last.finish.as_ref().is_some_and(|f| f.reason == "length");
        let status = if incomplete {
            "incomplete"
        } else {
            "completed"
        };
        let assistant = assistant_message(&output);
        let mut object = self.object(status, output, Some(usage(&last.usage)));
        if incomplete {
            object["incomplete_details"] = json!({"reason": "max_output_tokens"});
        }
        if let (Some((store, conversation)), Some(id)) = (&self.store, self.head["id"].as_str()) {
            let mut messages = conversation.clone();
            messages.push(assistant);
            store.put(
                id.to_string(),
                StoredResponse {
                    response: object.clone(),
                    messages,
                },
            );
        }
        object
    }

    fn stream(self, choices: generate::Choices) -> Response {
        let mut events = ResponseEvents {
            render: self,
            seq: 0,
            output: Vec::new(),
            open: None,
            pending: Vec::new(),
        };
        let mut chunks = choices.stream();
        let mut output = events.render.answer.stage.stream();
        let stream = async_stream::stream! {
            let created = events.render.object("in_progress", Vec::new(), None);
            yield Ok::<_, Infallible>(events.event("response.created", json!({"response": created})));
            let progress = events.render.object("in_progress", Vec::new(), None);
            yield Ok(events.event("response.in_progress", json!({"response": progress})));
            while let Some((_, item)) = chunks.next().await {
                match item {
                    Ok(chunk) => {
                        let text = events.render.answer.text(&chunk);
                        if events.render.logprobs {
                            events.pending.extend_from_slice(&chunk.logprobs);
                        }
                        let delta = output.push(&text, chunk.finish.is_some());
                        for e in events.push(delta) {
                            yield Ok(e);
                        }
                        if chunk.finish.is_some() {
                            for e in events.end(&chunk) {
                                yield Ok(e);
                            }
                            break;
                        }
                    }
                    Err(e) => {
                        let e = ApiError::from(e);
                        yield Ok(events.event("error", json!({"code": e.kind, "message": e.message,
                                                              "param": e.param})));
                        break;
                    }
                }
            }
        };
        Sse::new(stream).into_response()
    }
}

#[derive(PartialEq)]
enum Kind {
    Reasoning,
    Message,
    Call,
}

/// The output item being streamed.
struct OpenItem {
    kind: Kind,
    item: Value,
    /// Its text so far (the reasoning, the message text or the call's arguments).
    text: String,
    /// A message's logprobs so far.
    logprobs: Vec<TokenLogprob>,
}

/// A streamed response's events: the output items opened and closed as the output stage's
/// deltas change kind, each event numbered.
struct ResponseEvents {
    render: Render,
    seq: u64,
    output: Vec<Value>,
    open: Option<OpenItem>,
    /// Logprobs of tokens whose text has not gone out in an output_text delta yet (held back,
    /// or reasoning before the text): the next one carries them.
    pending: Vec<TokenLogprob>,
}

impl ResponseEvents {
    fn event(&mut self, kind: &str, mut body: Value) -> Event {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        Event::default()
            .event(kind)
            .data(serde_json::to_string(&body).unwrap_or_default())
    }

    fn index(&self) -> usize {
        self.output.len()
    }

    fn item_ref(&self) -> Value {
        let id = self
            .open
            .as_ref()
            .map(|o| o.item["id"].clone())
            .unwrap_or(Value::Null);
        json!({"item_id": id, "output_index": self.index()})
    }

    /// Opens an item of `kind` unless one is open already.
    fn ensure(&mut self, kind: Kind, out: &mut Vec<Event>) {
        if self.open.as_ref().is_some_and(|o| o.kind == kind) {
            return;
        }
        out.extend(self.close());
        let item = match kind {
            Kind::Reasoning => {
                json!({"type": "reasoning", "id": new_id("rs"), "status": "in_progress",
                                      "summary": [], "content": []})
            }
            Kind::Message => {
                json!({"type": "message", "id": new_id("msg"), "status": "in_progress",
                                    "role": "assistant", "content": []})
            }
            Kind::Call => Value::Null, // opened by `open_call`, which knows the name
        };
        self.open_item(kind, item, out);
    }

    fn open_item(&mut self, kind: Kind, item: Value, out: &mut Vec<Event>) {
        let index = self.index();
        out.push(self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        ));
        let part = match kind {
            Kind::Reasoning => Some(json!({"type": "reasoning_text", "text": ""})),
            Kind::Message => Some(output_text("", json!([]))),
            Kind::Call => None,
        };
        self.open = Some(OpenItem {
            kind,
            item,
            text: String::new(),
            logprobs: Vec::new(),
        });
        if let Some(part) = part {
            let mut body = self.item_ref();
            body["content_index"] = json!(0);
            body["part"] = part;
            out.push(self.event("response.content_part.added", body));
        }
    }

    fn push(&mut self, delta: MessageDelta) -> Vec<Event> {
        let mut out = Vec::new();
        if !delta.reasoning_content.is_empty() {
            self.ensure(Kind::Reasoning, &mut out);
            out.push(self.text_delta("response.reasoning_text.delta", &delta.reasoning_content));
        }
        if !delta.content.is_empty() {
            self.ensure(Kind::Message, &mut out);
            out.push(self.text_delta("response.output_text.delta", &delta.content));
        }
        for call in delta.tool_calls {
            if let Some(name) = call.name {
                out.extend(self.close());
                let item = json!({"type": "function_call", "id": new_id("fc"), "call_id": new_id("call"),
                                  "name": name, "arguments": "", "status": "in_progress"});
                self.open_item(Kind::Call, item, &mut out);
            }
            if !call.arguments.is_empty()
                && self.open.as_ref().is_some_and(|o| o.kind == Kind::Call)
            {
                out.push(
                    self.text_delta("response.function_call_arguments.delta", &call.arguments),
                );
            }
        }
        out
    }

    fn text_delta(&mut self, kind: &str, delta: &str) -> Event {
        let logprobs = match kind {
            "response.output_text.delta" => std::mem::take(&mut self.pending),
            _ => Vec::new(),
        };
        let mut body = self.item_ref();
        if kind != "response.function_call_arguments.delta" {
            body["content_index"] = json!(0);
        }
        body["delta"] = json!(delta);
        if kind == "response.output_text.delta" {
            body["logprobs"] = self.render.logprobs(&logprobs);
        }
        if let Some(open) = self.open.as_mut() {
            open.text.push_str(delta);
            open.logprobs.extend(logprobs);
        }
        self.event(kind, body)
    }

    /// Closes the open item: its `.done` events, then the item joins the output.
    fn close(&mut self) -> Vec<Event> {
        let mut out = Vec::new();
        let Some(open) = self.open.take() else {
            return out;
        };
        let index = self.index();
        let id = open.item["id"].as_str().unwrap_or_default().to_string();
        let at = json!({"item_id": id, "output_index": index});
        let item = match open.kind {
            Kind::Reasoning => {
                let mut body = at.clone();
                body["content_index"] = json!(0);
                body["text"] = json!(open.text);
                out.push(self.event("response.reasoning_text.done", body.clone()));
                body["part"] = json!({"type": "reasoning_text", "text": open.text});
                out.push(self.event("response.content_part.done", body));
                reasoning_item(id, &open.text, "completed")
            }
            Kind::Message => {
                let mut body = at.clone();
                body["content_index"] = json!(0);
                let logprobs = self.render.logprobs(&open.logprobs);
                body["text"] = json!(open.text);
                body["logprobs"] = logprobs.clone();
                out.push(self.event("response.output_text.done", body.clone()));
                if let Some(b) = body.as_object_mut() {
                    b.remove("logprobs");
                }
                body["part"] = output_text(&open.text, logprobs.clone());
                out.push(self.event("response.content_part.done", body));
                message_item(id, &open.text, logprobs, "completed")
            }
            Kind::Call => {
                let mut body = at.clone();
                let name = open.item["name"].as_str().unwrap_or_default().to_string();
                body["name"] = json!(name);
                body["arguments"] = json!(open.text);
                out.push(self.event("response.function_call_arguments.done", body));
                let call_id = open.item["call_id"]
                    .as_str()
                    .unwrap_or_default()
                    .to_string();
                call_item(id, call_id, &name, &open.text)
            }
        };
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        ));
        self.output.push(item);
        out
    }

    /// The last events: the open item closed (an empty message if nothing was said), then
    /// `response.completed` (or `response.incomplete` at max_output_tokens).
    fn end(&mut self, last: &Chunk) -> Vec<Event> {
        let mut out = Vec::new();
        if self.output.is_empty() && self.open.is_none() {
            self.ensure(Kind::Message, &mut out);
        }
        // The last tokens' logprobs (an end token's, with no text) go out with an empty delta.
        if !self.pending.is_empty() && self.open.as_ref().is_some_and(|o| o.kind == Kind::Message) {
            out.push(self.text_delta("response.output_text.delta", ""));
        }
        out.extend(self.close());
        let response = self.render.finish(std::mem::take(&mut self.output), last);
        let kind = if response["status"] == "incomplete" {
            "response.incomplete"
        } else {
            "response.completed"
        };
        out.push(self.event(kind, json!({"response": response})));
        out
    }
}
