//! OpenAI-compatible endpoints: /v1/completions (SSE or not), /v1/models, and what the chat
//! route (`chat.rs`) shares with them.
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
use serde_json::{json, Value};

use super::error::ApiError;
use super::protocol::{
    check_extra_fields, parse_body, CompletionRequest, PromptField, SamplingFields,
};
use super::response::{
    Completion, CompletionChoice, CompletionLogprobs, PromptLogprob, PromptLogprobs, Usage,
};
#[allow(unused_imports)] // named by the #[utoipa::path] attributes
use super::response::{ErrorResponse, ServerSentEvent};
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
        "max_model_len": state.config.scheduler.context_length,
    })
}

/// A loaded LoRA adapter, listed as vLLM lists one: its base model as `parent`.
fn adapter_card(state: &AppState, adapter: &crate::lora::Adapter) -> Value {
    json!({
        "id": adapter.name,
        "object": "model",
        "created": state.started_unix(),
        "owned_by": "tokenspeed",
        "root": adapter.path,
        "parent": state.config.served_model_name,
        "max_model_len": state.config.scheduler.context_length,
    })
}

#[utoipa::path(get, path = "/v1/models", responses((status = 200, description = "the served model and its LoRA adapters")))]
pub async fn models(State(state): State<AppState>) -> Response {
    let mut data = vec![model_card(&state)];
    data.extend(state.lora.list().iter().map(|a| adapter_card(&state, a)));
    ok_json(json!({"object": "list", "data": data}))
}

#[utoipa::path(get, path = "/v1/models/{id}", params(("id" = String, Path, description = "model id")), responses((status = 200, description = "the model"), (status = 404, body = ErrorResponse)))]
pub async fn model(State(state): State<AppState>, Path(id): Path<String>) -> Response {
    if let Some(adapter) = state.lora.get(&id) {
        return ok_json(adapter_card(&state, &adapter));
    }
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
pub(super) struct LogprobStyle {
    /// vLLM's `return_tokens_as_token_ids`: `token_id:<id>` instead of the token's text.
    pub(super) as_ids: bool,
}

impl LogprobStyle {
    pub(super) fn token(&self, tokenizer: &tokenspeed_text::TextTokenizer, id: u32) -> String {
        if self.as_ids {
            format!("token_id:{id}")
        } else {
            tokenizer.decode(&[id], false).unwrap_or_default()
        }
    }
}

/// The usage of a whole request: each prompt counted once (its samples share it), the
/// completions of every choice, and per prompt the most tokens any of its samples found cached.
pub(super) fn total_usage(usages: &[TokenUsage], n: usize) -> TokenUsage {
    let mut total = TokenUsage::default();
    for samples in usages.chunks(n.max(1)) {
        total.prompt_tokens += samples.first().map_or(0, |u| u.prompt_tokens);
        total.cached_tokens += samples.iter().map(|u| u.cached_tokens).max().unwrap_or(0);
        total.completion_tokens += samples.iter().map(|u| u.completion_tokens).sum::<u32>();
    }
    total
}

pub(super) struct StreamOptions {
    pub(super) include_usage: bool,
    pub(super) continuous_usage: bool,
}

pub(super) fn stream_options(f: &SamplingFields) -> StreamOptions {
    let o = f.stream_options.clone().unwrap_or_default();
    StreamOptions {
        include_usage: o.include_usage.unwrap_or(false),
        continuous_usage: o.continuous_usage_stats.unwrap_or(false),
    }
}

pub(super) fn sse_data(value: &impl Serialize) -> Event {
    Event::default().data(serde_json::to_string(value).unwrap_or_default())
}

/// Streams every choice as server-sent events: `preamble` first, one event per chunk (`frame`;
/// None: nothing to send for it yet), an error event if a choice fails midway (the rest are
/// aborted), the usage event (`usage`, given each choice's last usage) when asked for, then
/// `[DONE]`.
pub(super) fn sse_response<F, U>(
    choices: Choices,
    preamble: Vec<Event>,
    mut frame: F,
    usage: Option<U>,
) -> Response
where
    F: FnMut(usize, &Chunk) -> Option<Event> + Send + 'static,
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
                    // The frame decides what a chunk without text sends: its tokens' logprobs
                    // (held-back text still has them), its prompt logprobs, or nothing.
                    if let Some(event) = frame(i, &chunk) {
                        yield Ok(event);
                    }
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

#[utoipa::path(post, path = "/v1/completions", request_body = CompletionRequest, responses((status = 200, description = "a completion, or server-sent CompletionChunks with stream", content((Completion = "application/json"), (ServerSentEvent = "text/event-stream"))), (status = 400, description = "invalid request", body = ErrorResponse), (status = 503, description = "overloaded or no worker", body = ErrorResponse)))]
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
    check_extra_fields("/v1/completions", "CompletionRequest", &req.extra)?;
    let adapter = state.adapter_for(req.model.as_deref(), req.lora_path.as_deref())?;
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
    // Responses name the adapter a request ran on, as vLLM's do.
    let model = adapter.as_ref().map(|a| a.name.clone());
    crate::lora::run_on(&mut base.sampling, adapter);
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
    let rid = generate::new_request_id();
    let choices = generate::start_choices(&state, rid, specs, n).await?;
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
        id: format!("cmpl-{}", rid.request()),
        object: "text_completion",
        created: unix_now(),
        model: model.unwrap_or_else(|| state.config.served_model_name.clone()),
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
                if c.text.is_empty()
                    && c.finish.is_none()
                    && c.prompt_logprobs.is_empty()
                    && !want_logprobs
                {
                    return None;
                }
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
                Some(sse_data(&Completion {
                    choices: vec![choice],
                    usage: opts.continuous_usage.then(|| Usage::of(&c.usage)),
                    ..head.clone()
                }))
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

pub(super) fn with_prompts(base: &GenerationSpec, prompts: Vec<Prompt>) -> Vec<GenerationSpec> {
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
        // One decode gives both the offset step and (unless ids are asked for) the token.
        let text = tokenizer.decode(&[l.token], false).unwrap_or_default();
        out.text_offset.push(*offset);
        *offset += text.chars().count();
        out.tokens.push(if style.as_ids {
            style.token(tokenizer, l.token)
        } else {
            text
        });
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
pub(super) fn vllm_prompt_logprobs(
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
            rank: l.rank,
            decoded_token: decoded(l.token),
        });
        out.push(Some(entries));
    }
    out
}
