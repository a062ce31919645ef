//! OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions (SSE or not), /v1/models.
//! Each request becomes `prompts × n` choices (`generate::start_choices`); the bodies are the
//! typed structs of `response.rs`, the same for a stream chunk and a whole response.

use std::collections::BTreeMap;
use std::convert::Infallible;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::protocol::{
    check_extra_fields, parse_body, ChatCompletionRequest, CompletionRequest, PromptField,
    SamplingFields,
};
use super::response::{
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatLogprobEntry,
    ChatLogprobs, ChatMessage, Completion, CompletionChoice, CompletionLogprobs, PromptLogprob,
    PromptLogprobs, TopLogprob, Usage,
};
use super::{ok_json, unix_now, AppState};
use crate::engine::TokenUsage;
use crate::generate::{self, Choices, Chunk, GenerationSpec, Prompt, TokenLogprob};
use crate::validate;

fn model_card(state: &AppState) -> Value {
    json!({
        "id": state.config.served_model_name,
        "object": "model",
        "created": state.started_unix(),
        "owned_by": "tokenspeed",
        "root": state.config.model_path,
        "max_model_len": state.config.context_length,
    })
}

pub async fn models(State(state): State<AppState>) -> Response {
    ok_json(json!({"object": "list", "data": [model_card(&state)]}))
}

pub async fn model(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    match state.check_model(Some(&id)) {
        Ok(()) => ok_json(model_card(&state)),
        Err(e) => e.into_response(),
    }
}

impl AppState {
    fn started_unix(&self) -> u64 {
        unix_now().saturating_sub(self.started.elapsed().as_secs())
    }
}

/// How choices' logprobs are rendered (shared by both APIs).
#[derive(Clone, Copy)]
struct LogprobStyle {
    /// vLLM's `return_tokens_as_token_ids`: `token_id:<id>` instead of the token's text.
    as_ids: bool,
}

impl LogprobStyle {
    fn token(&self, tokenizer: &tokenspeed_text::TextTokenizer, id: u32) -> String {
        if self.as_ids {
            format!("token_id:{id}")
        } else {
            tokenizer.decode(&[id], false).unwrap_or_default()
        }
    }
}

/// The usage of a whole request: each prompt counted once (its samples share it), the
/// completions of every choice, and per prompt the most tokens any of its samples found cached.
fn total_usage(usages: &[TokenUsage], n: usize) -> TokenUsage {
    let mut total = TokenUsage::default();
    for samples in usages.chunks(n.max(1)) {
        total.prompt_tokens += samples.first().map_or(0, |u| u.prompt_tokens);
        total.cached_tokens += samples.iter().map(|u| u.cached_tokens).max().unwrap_or(0);
        total.completion_tokens += samples.iter().map(|u| u.completion_tokens).sum::<u32>();
    }
    total
}

struct StreamOptions {
    include_usage: bool,
    continuous_usage: bool,
}

fn stream_options(f: &SamplingFields) -> StreamOptions {
    let o = f.stream_options.clone().unwrap_or_default();
    StreamOptions {
        include_usage: o.include_usage.unwrap_or(false),
        continuous_usage: o.continuous_usage_stats.unwrap_or(false),
    }
}

fn sse_data(value: &impl Serialize) -> Event {
    Event::default().data(serde_json::to_string(value).unwrap_or_default())
}

/// Streams every choice as server-sent events: `preamble` first, one event per chunk with text
/// or a finish (`frame`), an error event if a choice fails midway (the rest are aborted), the
/// usage event (`usage`, given each choice's last usage) when asked for, then `[DONE]`.
fn sse_response<F, U>(
    choices: Choices,
    preamble: Vec<Event>,
    mut frame: F,
    usage: Option<U>,
) -> Response
where
    F: FnMut(usize, &Chunk) -> Event + Send + 'static,
    U: Fn(&[TokenUsage]) -> Event + Send + 'static,
{
    let mut usages = vec![TokenUsage::default(); choices.gens.len()];
    let mut chunks = choices.stream();
    let stream = async_stream::stream! {
        for event in preamble {
            yield Ok::<_, Infallible>(event);
        }
        while let Some((i, item)) = chunks.next().await {
            match item {
                Ok(chunk) => {
                    usages[i] = chunk.usage;
                    if chunk.text.is_empty() && chunk.finish.is_none() { continue; }
                    yield Ok(frame(i, &chunk));
                }
                Err(e) => { yield Ok(Event::default().data(e.body().to_string())); break; }
            }
        }
        if let Some(usage) = &usage {
            yield Ok(usage(&usages));
        }
        yield Ok(Event::default().data("[DONE]"));
    };
    Sse::new(stream).into_response()
}

// --- /v1/completions ------------------------------------------------------------------------

pub async fn completions(State(state): State<AppState>, body: Bytes) -> Response {
    match completions_inner(state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

fn completion_prompts(prompt: PromptField) -> Result<Vec<Prompt>, ApiError> {
    let prompts: Vec<Prompt> = match prompt {
        PromptField::Text(t) => vec![Prompt::Text(t)],
        PromptField::Ids(ids) => vec![Prompt::Ids(ids)],
        PromptField::Texts(v) => v.into_iter().map(Prompt::Text).collect(),
        PromptField::IdBatches(v) => v.into_iter().map(Prompt::Ids).collect(),
    };
    if prompts.is_empty() {
        return Err(ApiError::bad_param("prompt", "the prompt list is empty"));
    }
    Ok(prompts)
}

async fn completions_inner(state: AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    check_extra_fields("/v1/completions", &req.extra)?;
    state.check_model(req.model.as_deref())?;
    if req.suffix.is_some() {
        return Err(ApiError::bad_param(
            "suffix",
            "suffix (fill-in-the-middle) is not supported",
        ));
    }
    let prompts = completion_prompts(req.prompt)?;
    let n = validate::choices(req.sampling.n, prompts.len())?;
    if let Some(best_of) = req.best_of.filter(|&b| b as usize != n) {
        return Err(ApiError::bad_param(
            "best_of",
            format!("best_of must equal n ({n}) or be absent (ranking samples is not supported), got {best_of}"),
        ));
    }
    let echo = req.echo.unwrap_or(false);
    let want_logprobs = req.logprobs.is_some();
    let top = validate::top_logprobs("logprobs", req.logprobs)?;
    let max_tokens = validate::max_tokens("max_tokens", Some(req.max_tokens.unwrap_or(16)))?;
    let vocab = state.tokenizer.vocab_size() as u32;
    let mut base = validate::generation_spec(
        &req.sampling,
        &state.config.sampling_defaults,
        max_tokens,
        top,
        vocab,
    )?;
    let echo_logprobs = echo && want_logprobs;
    if echo_logprobs {
        // The echoed prompt's tokens come with their logprobs (the first has none).
        base.sampling.prompt_logprobs = true;
        base.sampling.top_logprobs = base.sampling.top_logprobs.max(top);
    }
    let prompt_logprobs_field = req.sampling.prompt_logprobs.is_some();
    let echo_texts: Vec<String> = if echo {
        prompts.iter().map(|p| prompt_text(&state, p)).collect()
    } else {
        Vec::new()
    };
    let specs = with_prompts(&base, prompts);
    let choices = generate::start_choices(&state, specs, n).await?;
    let style = LogprobStyle {
        as_ids: req.sampling.return_tokens_as_token_ids.unwrap_or(false),
    };
    let prompts = choices.prompts.clone();
    let tokenizer = state.tokenizer.clone();
    // Logprobs of choice `i`'s first chunk `c`: the echoed prompt's, then its tokens'.
    let logprobs_of = move |i: usize, c: &Chunk, first: bool, offset: &mut usize| {
        let mut out = CompletionLogprobs::default();
        if first && echo_logprobs {
            let ids = prompts.get(i / n).map_or(&[][..], Vec::as_slice);
            out = prompt_completion_logprobs(&tokenizer, style, ids, &c.prompt_logprobs, top);
            *offset = 0;
            for t in &out.tokens {
                *offset += t.chars().count();
            }
        }
        let generated = completion_logprobs(&tokenizer, style, &c.logprobs, offset);
        out.tokens.extend(generated.tokens);
        out.token_logprobs.extend(generated.token_logprobs);
        out.top_logprobs.extend(generated.top_logprobs);
        out.text_offset.extend(generated.text_offset);
        out
    };
    let head = Completion {
        id: format!("cmpl-{}", request_id()),
        object: "text_completion",
        created: unix_now(),
        model: state.config.served_model_name.clone(),
        choices: Vec::new(),
        usage: None,
    };
    let echo_of = move |i: usize| echo_texts.get(i / n).cloned().unwrap_or_default();
    if req.sampling.stream.unwrap_or(false) {
        let opts = stream_options(&req.sampling);
        // Per choice: whether its echo went out, and its text offset so far.
        let mut started = vec![false; choices.gens.len()];
        let mut offsets = vec![0usize; choices.gens.len()];
        let frame = {
            let head = head.clone();
            let tokenizer2 = state.tokenizer.clone();
            move |i: usize, c: &Chunk| {
                let mut text = String::new();
                let first = !std::mem::replace(&mut started[i], true);
                if first {
                    text = echo_of(i);
                    offsets[i] = text.chars().count();
                }
                text.push_str(&c.text);
                let logprobs = want_logprobs.then(|| logprobs_of(i, c, first, &mut offsets[i]));
                let mut choice = completion_choice(i, text, logprobs, c);
                if first && prompt_logprobs_field {
                    choice.prompt_logprobs =
                        Some(vllm_prompt_logprobs(&tokenizer2, &c.prompt_logprobs));
                }
                sse_data(&Completion {
                    choices: vec![choice],
                    usage: opts.continuous_usage.then(|| Usage::of(&c.usage)),
                    ..head.clone()
                })
            }
        };
        let usage = opts.include_usage.then_some(move |u: &[TokenUsage]| {
            sse_data(&Completion {
                usage: Some(Usage::of(&total_usage(u, n))),
                ..head.clone()
            })
        });
        return Ok(sse_response(choices, Vec::new(), frame, usage));
    }
    let chunks = choices.collect().await?;
    let usages: Vec<TokenUsage> = chunks.iter().map(|c| c.usage).collect();
    let choices = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let prefix = echo_of(i);
            let mut offset = prefix.chars().count();
            let logprobs = want_logprobs.then(|| logprobs_of(i, c, true, &mut offset));
            let mut choice = completion_choice(i, prefix + &c.text, logprobs, c);
            if prompt_logprobs_field {
                choice.prompt_logprobs =
                    Some(vllm_prompt_logprobs(&state.tokenizer, &c.prompt_logprobs));
            }
            choice
        })
        .collect();
    Ok(ok_json(json!(Completion {
        choices,
        usage: Some(Usage::of(&total_usage(&usages, n))),
        ..head
    })))
}

fn completion_choice(
    index: usize,
    text: String,
    logprobs: Option<CompletionLogprobs>,
    c: &Chunk,
) -> CompletionChoice {
    CompletionChoice {
        index: index as u32,
        text,
        logprobs,
        finish_reason: c.finish.as_ref().map(|f| f.reason),
        matched_stop: c.finish.as_ref().and_then(|f| f.matched.clone()),
        prompt_logprobs: None,
    }
}

/// The text a prompt stands for (what `echo` prepends): the text itself, or its ids decoded.
fn prompt_text(state: &AppState, prompt: &Prompt) -> String {
    match prompt {
        Prompt::Text(t) => t.clone(),
        Prompt::Ids(ids) => state.tokenizer.decode(ids, false).unwrap_or_default(),
        Prompt::Chat { .. } => String::new(),
    }
}

fn with_prompts(base: &GenerationSpec, prompts: Vec<Prompt>) -> Vec<GenerationSpec> {
    prompts
        .into_iter()
        .map(|prompt| GenerationSpec {
            prompt,
            ..base.clone()
        })
        .collect()
}

/// Legacy logprobs of generated tokens; `offset` is the text offset (in characters) of the
/// first one and advances past the last.
fn completion_logprobs(
    tokenizer: &tokenspeed_text::TextTokenizer,
    style: LogprobStyle,
    lps: &[TokenLogprob],
    offset: &mut usize,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for l in lps {
        let token = style.token(tokenizer, l.token);
        out.text_offset.push(*offset);
        *offset += tokenizer
            .decode(&[l.token], false)
            .map_or(0, |t| t.chars().count());
        out.tokens.push(token);
        out.token_logprobs.push(Some(l.logprob));
        let top: BTreeMap<String, f32> = l
            .top
            .iter()
            .map(|&(t, lp)| (style.token(tokenizer, t), lp))
            .collect();
        out.top_logprobs.push(Some(top));
    }
    out
}

/// Legacy logprobs of an echoed prompt: its first token has none.
fn prompt_completion_logprobs(
    tokenizer: &tokenspeed_text::TextTokenizer,
    style: LogprobStyle,
    prompt: &[u32],
    lps: &[TokenLogprob],
    top: u32,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    let mut offset = 0;
    if let Some(&first) = prompt.first() {
        out.tokens.push(style.token(tokenizer, first));
        out.token_logprobs.push(None);
        out.top_logprobs.push(None);
        out.text_offset.push(0);
        offset = tokenizer
            .decode(&[first], false)
            .map_or(0, |t| t.chars().count());
    }
    let cut: Vec<TokenLogprob> = lps
        .iter()
        .map(|l| TokenLogprob {
            top: l.top.iter().take(top as usize).copied().collect(),
            ..l.clone()
        })
        .collect();
    let rest = completion_logprobs(tokenizer, style, &cut, &mut offset);
    out.tokens.extend(rest.tokens);
    out.token_logprobs.extend(rest.token_logprobs);
    out.top_logprobs.extend(rest.top_logprobs);
    out.text_offset.extend(rest.text_offset);
    out
}

/// vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map of token
/// id → entry holding the prompt's own token and the top alternatives.
fn vllm_prompt_logprobs(
    tokenizer: &tokenspeed_text::TextTokenizer,
    lps: &[TokenLogprob],
) -> PromptLogprobs {
    let decoded = |t: u32| tokenizer.decode(&[t], false).unwrap_or_default();
    let mut out: PromptLogprobs = vec![None];
    for l in lps {
        let mut entries: BTreeMap<String, PromptLogprob> = l
            .top
            .iter()
            .enumerate()
            .map(|(rank, &(t, lp))| {
                let entry = PromptLogprob {
                    logprob: lp,
                    rank: Some(rank as u32 + 1),
                    decoded_token: decoded(t),
                };
                (t.to_string(), entry)
            })
            .collect();
        entries.entry(l.token.to_string()).or_insert(PromptLogprob {
            logprob: l.logprob,
            rank: None,
            decoded_token: decoded(l.token),
        });
        out.push(Some(entries));
    }
    out
}

// --- /v1/chat/completions -------------------------------------------------------------------

pub async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Response {
    match chat_inner(state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

const CHAT_ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Roles OpenAI defines, and content that is a string or text parts (no images or audio until
/// a multimodal model exists). Returns the last message's role.
fn check_messages(messages: &[Map<String, Value>]) -> Result<String, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "messages must be a non-empty array",
        ));
    }
    let mut last_role = String::new();
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::bad_param("messages", format!("messages[{i}] has no string 'role'"))
        })?;
        if !CHAT_ROLES.contains(&role) {
            return Err(ApiError::bad_param(
                "messages",
                format!("messages[{i}].role {role:?} is not one of {CHAT_ROLES:?}"),
            ));
        }
        match m.get("content") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                for (j, part) in parts.iter().enumerate() {
                    let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
                    if kind != "text" || !part.get("text").is_some_and(Value::is_string) {
                        return Err(ApiError::bad_param(
                            "messages",
                            format!(
                                "messages[{i}].content[{j}] has type {kind:?}: only text parts \
                                 ({{\"type\": \"text\", \"text\": ...}}) are supported"
                            ),
                        ));
                    }
                }
            }
            Some(_) => {
                return Err(ApiError::bad_param(
                    "messages",
                    format!("messages[{i}].content must be a string or a list of text parts"),
                ))
            }
        }
        last_role = role.to_string();
    }
    Ok(last_role)
}

/// The text content of a message (its string, or its text parts joined).
fn message_text(m: &Map<String, Value>) -> String {
    match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

/// Tool calling is not wired yet: tools may be rendered into the prompt only with
/// `tool_choice: "none"`, which asks for no call.
fn check_tools(req: &ChatCompletionRequest) -> Result<(), ApiError> {
    let choice_none = match &req.tool_choice {
        None => false,
        Some(Value::String(s)) if s == "none" => true,
        Some(other) => {
            return Err(ApiError::bad_param(
                "tool_choice",
                format!("tool_choice {other} is not supported yet (tool calling is not implemented); only \"none\""),
            ))
        }
    };
    if req.tools.as_ref().is_some_and(|t| !t.is_empty()) && !choice_none {
        return Err(ApiError::bad_param(
            "tools",
            "tools are not supported yet (tool calling is not implemented); send tool_choice \"none\" to only render them into the prompt",
        ));
    }
    Ok(())
}

async fn chat_inner(state: AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_body(body)?;
    check_extra_fields("/v1/chat/completions", &req.extra)?;
    state.check_model(req.model.as_deref())?;
    let last_role = check_messages(&req.messages)?;
    check_tools(&req)?;
    let continue_final = req.continue_final_message.unwrap_or(false);
    let add_generation_prompt = req.add_generation_prompt.unwrap_or(!continue_final);
    if continue_final && add_generation_prompt {
        return Err(ApiError::bad_param(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        ));
    }
    if continue_final && last_role != "assistant" {
        return Err(ApiError::bad_param(
            "continue_final_message",
            "continue_final_message needs the last message to be the assistant's",
        ));
    }
    let want_logprobs = req.logprobs.unwrap_or(false);
    if req.top_logprobs.is_some() && !want_logprobs {
        return Err(ApiError::bad_param(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
    let top = validate::top_logprobs("top_logprobs", req.top_logprobs)?;
    let max_tokens = validate::max_tokens(
        "max_completion_tokens",
        req.max_completion_tokens.or(req.max_tokens),
    )?;
    let n = validate::choices(req.sampling.n, 1)?;
    let vocab = state.tokenizer.vocab_size() as u32;
    let base = validate::generation_spec(
        &req.sampling,
        &state.config.sampling_defaults,
        max_tokens,
        top,
        vocab,
    )?;
    // vLLM's echo: the reply starts with the last message when that is the assistant's.
    let echo = match req.messages.last() {
        Some(m) if req.echo == Some(true) && last_role == "assistant" => message_text(m),
        _ => String::new(),
    };
    let mut vars = req.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(tools) = req.tools.clone() {
        vars.insert("tools".into(), Value::Array(tools));
    }
    let prompt = Prompt::Chat {
        messages: req.messages,
        template_vars: (!vars.is_empty()).then_some(Value::Object(vars)),
        add_generation_prompt,
        continue_final_message: continue_final,
    };
    let choices = generate::start_choices(&state, with_prompts(&base, vec![prompt]), n).await?;
    let style = LogprobStyle {
        as_ids: req.sampling.return_tokens_as_token_ids.unwrap_or(false),
    };
    let id = format!("chatcmpl-{}", request_id());
    let (created, model) = (unix_now(), state.config.served_model_name.clone());
    if req.sampling.stream.unwrap_or(false) {
        let opts = stream_options(&req.sampling);
        let tokenizer = state.tokenizer.clone();
        let head = ChatCompletionChunk {
            id,
            object: "chat.completion.chunk",
            created,
            model,
            choices: Vec::new(),
            usage: None,
        };
        // The first delta of each choice carries the role (and the echo).
        let preamble = (0..choices.gens.len())
            .map(|i| {
                sse_data(&ChatCompletionChunk {
                    choices: vec![ChatChunkChoice {
                        index: i as u32,
                        delta: ChatDelta {
                            role: Some("assistant"),
                            content: Some(echo.clone()),
                        },
                        logprobs: None,
                        finish_reason: None,
                        matched_stop: None,
                    }],
                    ..head.clone()
                })
            })
            .collect();
        let frame = {
            let head = head.clone();
            move |i: usize, c: &Chunk| {
                let logprobs = want_logprobs.then(|| chat_logprobs(&tokenizer, style, &c.logprobs));
                sse_data(&ChatCompletionChunk {
                    choices: vec![ChatChunkChoice {
                        index: i as u32,
                        delta: ChatDelta {
                            role: None,
                            content: (!c.text.is_empty()).then(|| c.text.clone()),
                        },
                        logprobs,
                        finish_reason: c.finish.as_ref().map(|f| f.reason),
                        matched_stop: c.finish.as_ref().and_then(|f| f.matched.clone()),
                    }],
                    usage: opts.continuous_usage.then(|| Usage::of(&c.usage)),
                    ..head.clone()
                })
            }
        };
        let usage = opts.include_usage.then_some(move |u: &[TokenUsage]| {
            sse_data(&ChatCompletionChunk {
                usage: Some(Usage::of(&total_usage(u, n))),
                ..head.clone()
            })
        });
        return Ok(sse_response(choices, preamble, frame, usage));
    }
    let chunks = choices.collect().await?;
    let usages: Vec<TokenUsage> = chunks.iter().map(|c| c.usage).collect();
    let choices = chunks
        .iter()
        .enumerate()
        .map(|(i, c)| ChatChoice {
            index: i as u32,
            message: ChatMessage {
                role: "assistant",
                content: echo.clone() + &c.text,
            },
            logprobs: want_logprobs.then(|| chat_logprobs(&state.tokenizer, style, &c.logprobs)),
            finish_reason: c.finish.as_ref().map(|f| f.reason),
            matched_stop: c.finish.as_ref().and_then(|f| f.matched.clone()),
            prompt_logprobs: req
                .sampling
                .prompt_logprobs
                .is_some()
                .then(|| vllm_prompt_logprobs(&state.tokenizer, &c.prompt_logprobs)),
        })
        .collect();
    Ok(ok_json(json!(ChatCompletion {
        id,
        object: "chat.completion",
        created,
        model,
        choices,
        usage: Usage::of(&total_usage(&usages, n)),
    })))
}

fn chat_logprobs(
    tokenizer: &tokenspeed_text::TextTokenizer,
    style: LogprobStyle,
    lps: &[TokenLogprob],
) -> ChatLogprobs {
    let entry = |id: u32, logprob: f32| {
        let bytes = tokenizer
            .decode(&[id], false)
            .unwrap_or_default()
            .into_bytes();
        TopLogprob {
            token: style.token(tokenizer, id),
            logprob,
            bytes,
        }
    };
    let content = lps
        .iter()
        .map(|l| {
            let e = entry(l.token, l.logprob);
            ChatLogprobEntry {
                token: e.token,
                logprob: e.logprob,
                bytes: e.bytes,
                top_logprobs: l.top.iter().map(|&(t, lp)| entry(t, lp)).collect(),
            }
        })
        .collect();
    ChatLogprobs { content }
}

/// A request id unique in this process and across restarts: time and a process-wide counter.
pub fn request_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{:x}{:06x}", t, n)
}
