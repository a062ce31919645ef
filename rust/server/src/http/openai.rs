//! OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions (SSE or not), /v1/models.

use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::protocol::{
    parse_body, ChatCompletionRequest, CompletionRequest, PromptField, SamplingFields,
};
use super::{ok_json, unix_now, AppState};
use crate::engine::TokenUsage;
use crate::generate::{self, Chunk, Generation, GenerationSpec, Prompt, TokenLogprob};
use crate::validate;

pub async fn models(State(state): State<AppState>) -> Response {
    ok_json(json!({
        "object": "list",
        "data": [{
            "id": state.config.served_model_name,
            "object": "model",
            "created": state.started_unix(),
            "owned_by": "tokenspeed",
            "root": state.config.model_path,
            "max_model_len": state.config.context_length,
        }]
    }))
}

impl AppState {
    fn started_unix(&self) -> u64 {
        unix_now().saturating_sub(self.started.elapsed().as_secs())
    }
}

fn spec_from(
    prompt: Prompt,
    f: &SamplingFields,
    max_tokens: Option<u32>,
    top_logprobs: u32,
) -> Result<GenerationSpec, ApiError> {
    Ok(GenerationSpec {
        prompt,
        sampling: validate::sampling_params(f, top_logprobs)?,
        max_new_tokens: max_tokens,
        min_new_tokens: f.min_tokens.unwrap_or(0),
        stop: f.stop.clone().map(|s| s.into_vec()).unwrap_or_default(),
        stop_token_ids: f.stop_token_ids.clone().unwrap_or_default(),
        ignore_eos: f.ignore_eos.unwrap_or(false),
        skip_special_tokens: f.skip_special_tokens.unwrap_or(true),
    })
}

fn usage_json(u: &TokenUsage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    })
}

pub async fn completions(State(state): State<AppState>, body: Bytes) -> Response {
    match completions_inner(state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completions_inner(state: AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    super::protocol::log_unknown_fields("/v1/completions", &req.extra);
    state.check_model(req.model.as_deref())?;
    let prompt = match req.prompt {
        PromptField::Text(t) => Prompt::Text(t),
        PromptField::Ids(ids) => Prompt::Ids(ids),
        PromptField::Texts(mut v) if v.len() == 1 => Prompt::Text(v.remove(0)),
        PromptField::IdBatches(mut v) if v.len() == 1 => Prompt::Ids(v.remove(0)),
        _ => {
            return Err(ApiError::bad_param(
                "prompt",
                "batched prompts are not supported yet: send one prompt per request",
            ))
        }
    };
    if req.echo == Some(true) {
        return Err(ApiError::bad_param("echo", "echo is not supported yet"));
    }
    let want_logprobs = req.logprobs.is_some();
    let top = validate::top_logprobs("logprobs", req.logprobs)?;
    let max_tokens = validate::max_tokens("max_tokens", Some(req.max_tokens.unwrap_or(16)))?;
    let spec = spec_from(prompt, &req.sampling, max_tokens, top)?;
    let model = state.config.served_model_name.clone();
    let id = format!("cmpl-{}", uuid_like());
    let mut gen = generate::start(&state, spec).await?;
    if req.sampling.stream.unwrap_or(false) {
        let include_usage = req
            .sampling
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let first = first_chunk(&mut gen).await?;
        let tokenizer = state.tokenizer.clone();
        let head =
            json!({"id": id, "object": "text_completion", "created": unix_now(), "model": model});
        let frame = {
            let head = head.clone();
            move |c: &Chunk| {
                let logprobs = want_logprobs.then(|| completion_logprobs(&tokenizer, &c.logprobs));
                merged(
                    &head,
                    json!({"choices": [{"index": 0, "text": c.text, "logprobs": logprobs,
                    "finish_reason": c.finish.as_ref().map(|f| f.reason),
                    "matched_stop": c.finish.as_ref().and_then(|f| f.matched.clone())}]}),
                )
            }
        };
        let usage = include_usage.then_some(move |u: &TokenUsage| {
            merged(&head, json!({"choices": [], "usage": usage_json(u)}))
        });
        return Ok(sse_response(gen, first, None, frame, usage));
    }
    let all = gen.collect().await?;
    let logprobs = want_logprobs.then(|| completion_logprobs(&state.tokenizer, &all.logprobs));
    Ok(ok_json(json!({
        "id": id, "object": "text_completion", "created": unix_now(), "model": model,
        "choices": [{"index": 0, "text": all.text, "logprobs": logprobs,
                     "finish_reason": all.finish.as_ref().map(|f| f.reason),
                     "matched_stop": all.finish.as_ref().and_then(|f| f.matched.clone())}],
        "usage": usage_json(&all.usage),
    })))
}

pub async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Response {
    match chat_inner(state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn chat_inner(state: AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_body(body)?;
    super::protocol::log_unknown_fields("/v1/chat/completions", &req.extra);
    state.check_model(req.model.as_deref())?;
    if req.messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "messages must be a non-empty array",
        ));
    }
    for (i, m) in req.messages.iter().enumerate() {
        if !m.get("role").is_some_and(Value::is_string) {
            return Err(ApiError::bad_param(
                "messages",
                format!("messages[{i}] has no string 'role'"),
            ));
        }
    }
    let want_logprobs = req.logprobs.unwrap_or(false);
    let top = if want_logprobs {
        validate::top_logprobs("top_logprobs", req.top_logprobs)?
    } else {
        0
    };
    let max_tokens = validate::max_tokens(
        "max_completion_tokens",
        req.max_completion_tokens.or(req.max_tokens),
    )?;
    let mut vars = req.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(tools) = req.tools.clone() {
        vars.insert("tools".into(), tools);
    }
    let template_vars = (!vars.is_empty()).then_some(Value::Object(vars));
    let spec = spec_from(
        Prompt::Chat {
            messages: req.messages,
            template_vars,
        },
        &req.sampling,
        max_tokens,
        top,
    )?;
    let model = state.config.served_model_name.clone();
    let id = format!("chatcmpl-{}", uuid_like());
    let mut gen = generate::start(&state, spec).await?;
    if req.sampling.stream.unwrap_or(false) {
        let include_usage = req
            .sampling
            .stream_options
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        let first = first_chunk(&mut gen).await?;
        let tokenizer = state.tokenizer.clone();
        let head = json!({"id": id, "object": "chat.completion.chunk", "created": unix_now(), "model": model});
        let role = merged(
            &head,
            json!({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
            "logprobs": null, "finish_reason": null}]}),
        );
        let frame = {
            let head = head.clone();
            move |c: &Chunk| {
                let logprobs = want_logprobs.then(|| chat_logprobs(&tokenizer, &c.logprobs));
                let delta = if c.text.is_empty() {
                    json!({})
                } else {
                    json!({"content": c.text})
                };
                merged(
                    &head,
                    json!({"choices": [{"index": 0, "delta": delta, "logprobs": logprobs,
                    "finish_reason": c.finish.as_ref().map(|f| f.reason)}]}),
                )
            }
        };
        let usage = include_usage.then_some(move |u: &TokenUsage| {
            merged(&head, json!({"choices": [], "usage": usage_json(u)}))
        });
        return Ok(sse_response(gen, first, Some(role), frame, usage));
    }
    let all = gen.collect().await?;
    let logprobs = want_logprobs.then(|| chat_logprobs(&state.tokenizer, &all.logprobs));
    Ok(ok_json(json!({
        "id": id, "object": "chat.completion", "created": unix_now(), "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": all.text},
                     "logprobs": logprobs, "finish_reason": all.finish.as_ref().map(|f| f.reason),
                     "matched_stop": all.finish.as_ref().and_then(|f| f.matched.clone())}],
        "usage": usage_json(&all.usage),
    })))
}

/// `head` with the fields of `extra` added (both JSON objects).
fn merged(head: &Value, extra: Value) -> Value {
    let mut out = head.clone();
    if let (Value::Object(o), Value::Object(e)) = (&mut out, extra) {
        o.extend(e);
    }
    out
}

/// Streams a generation as OpenAI server-sent events: an optional first event, one event per
/// chunk with text or a finish (`frame`), an error event if the request fails midway, the
/// usage event when asked for, then `[DONE]`.
fn sse_response<F, U>(
    mut gen: Generation,
    first: Chunk,
    preamble: Option<Value>,
    frame: F,
    usage: Option<U>,
) -> Response
where
    F: Fn(&Chunk) -> Value + Send + 'static,
    U: Fn(&TokenUsage) -> Value + Send + 'static,
{
    let stream = async_stream::stream! {
        if let Some(p) = preamble {
            yield Ok::<_, Infallible>(Event::default().data(p.to_string()));
        }
        let mut pending = Some(Ok(first));
        let mut last_usage = TokenUsage::default();
        loop {
            let item = match pending.take() { Some(c) => Some(c), None => gen.next().await };
            let Some(item) = item else { break };
            match item {
                Ok(chunk) => {
                    last_usage = chunk.usage;
                    if chunk.text.is_empty() && chunk.finish.is_none() { continue; }
                    yield Ok(Event::default().data(frame(&chunk).to_string()));
                }
                Err(e) => { yield Ok(Event::default().data(e.body().to_string())); break; }
            }
        }
        if let Some(usage) = &usage {
            yield Ok(Event::default().data(usage(&last_usage).to_string()));
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(stream).into_response()
}

/// Waits for the first chunk so that a request the engine rejects gets a proper HTTP status
/// instead of an error inside a 200 stream.
async fn first_chunk(gen: &mut Generation) -> Result<Chunk, ApiError> {
    match gen.next().await {
        Some(Ok(c)) => Ok(c),
        Some(Err(e)) => Err(e),
        None => Err(ApiError::internal("the request ended without output")),
    }
}

fn token_text(tokenizer: &tokenspeed_text::TextTokenizer, id: u32) -> String {
    tokenizer.decode(&[id], false).unwrap_or_default()
}

fn completion_logprobs(tokenizer: &tokenspeed_text::TextTokenizer, lps: &[TokenLogprob]) -> Value {
    let tokens: Vec<String> = lps.iter().map(|l| token_text(tokenizer, l.token)).collect();
    let top: Vec<Value> = lps
        .iter()
        .map(|l| {
            let m: Map<String, Value> = l
                .top
                .iter()
                .map(|(t, lp)| (token_text(tokenizer, *t), json!(lp)))
                .collect();
            Value::Object(m)
        })
        .collect();
    json!({
        "tokens": tokens,
        "token_logprobs": lps.iter().map(|l| l.logprob).collect::<Vec<_>>(),
        "top_logprobs": top,
    })
}

fn chat_logprobs(tokenizer: &tokenspeed_text::TextTokenizer, lps: &[TokenLogprob]) -> Value {
    let entry = |id: u32, lp: f32| {
        let text = token_text(tokenizer, id);
        json!({"token": text, "logprob": lp, "bytes": text.as_bytes()})
    };
    let content: Vec<Value> = lps
        .iter()
        .map(|l| {
            let mut e = entry(l.token, l.logprob);
            e["top_logprobs"] = Value::Array(l.top.iter().map(|(t, lp)| entry(*t, *lp)).collect());
            e
        })
        .collect();
    json!({ "content": content })
}

/// A unique-enough request id without another dependency: time and a process-wide counter.
pub fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{:x}{:06x}", t, n)
}
