//! OpenAI-compatible endpoints: /v1/completions (SSE or not), /v1/models, and what the chat
//! route (`chat.rs`) shares with them.
//! Each request becomes `prompts × n` choices (`generate::start_choices`); the bodies are the
//! typed structs of `response.rs`, the same for a stream chunk and a whole response.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde::Serialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::protocol::{check_extra_fields, parse_body, CompletionRequest};
use super::response::{
    Completion, CompletionChoice, CompletionLogprobs, PromptLogprob, PromptLogprobs, Usage,
};
#[allow(unused_imports)] // named by the #[utoipa::path] attributes
use super::response::{ErrorResponse, ServerSentEvent};
use super::{ok_json, unix_now, AppState};
use crate::engine::TokenUsage;
use crate::generate::{self, Choices, Chunk, Prompt, TokenLogprob};
use crate::validate::{self, StreamSettings};

fn model_card(state: &AppState) -> Value {
    json!({
        "id": state.config.served_model_name,
        "object": "model",
        "created": state.started_unix(),
        "owned_by": "tokenspeed",
        // The served id, as vLLM and SGLang send it (not a path on the server's disk).
        "root": state.config.served_model_name,
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
                Err(e) => { yield Ok(Event::default().data(ApiError::from(e).body().to_string())); break; }
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

async fn completions_inner(state: AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: CompletionRequest = parse_body(body)?;
    check_extra_fields("/v1/completions", "CompletionRequest", &req.extra)?;
    let adapter = state.adapter_for(req.model.as_deref(), req.lora_path.as_deref())?;
    let mut checked = validate::routes::completion_request(
        &req,
        &state.config.sampling_defaults,
        state.tokenizer.vocab_size() as u32,
        state.config.max_logprobs,
    )?;
    let model = state.response_model(adapter.as_ref());
    let priority = validate::priority(
        req.priority,
        state.config.scheduler.enable_priority_scheduling,
    )?;
    let pd = validate::PdFields {
        room: req.bootstrap_room,
        host: req.bootstrap_host.as_deref(),
        port: req.bootstrap_port,
    };
    let kv_transfer =
        validate::bootstrap(pd, state.config.pd_pair(), checked.specs.len() * checked.n)?;
    for spec in &mut checked.specs {
        spec.priority = priority;
        spec.kv_transfer = kv_transfer;
        crate::lora::run_on(&mut spec.sampling, adapter.clone());
    }
    let mut echo_texts: Vec<String> = if checked.echo {
        checked
            .specs
            .iter()
            .map(|s| prompt_text(&state, &s.prompt))
            .collect()
    } else {
        Vec::new()
    };
    let rid = generate::new_request_id();
    let specs = std::mem::take(&mut checked.specs);
    let choices = generate::start_choices(&state, rid, specs, checked.n).await?;
    if req.sampling.truncate_prompt_tokens.is_some() && checked.echo {
        // The echo is the prompt the model continued: what truncation left of it.
        echo_texts = choices
            .prompts
            .iter()
            .map(|ids| prompt_text(&state, &Prompt::Ids(ids.clone())))
            .collect();
    }
    let head = Completion {
        id: format!("cmpl-{}", rid.request()),
        object: "text_completion",
        created: unix_now(),
        model,
        choices: Vec::new(),
        usage: None,
    };
    let prompts = choices.prompts.clone();
    let render = CompletionRender::new(&state, &req, &checked, head, prompts, echo_texts);
    if req.sampling.stream.unwrap_or(false) {
        return Ok(Arc::new(render).stream(choices, checked.stream));
    }
    let chunks = choices.collect().await?;
    Ok(ok_json(json!(render.completion(&chunks))))
}

/// How a completion request's answer is rendered: what the checked request asked for, and
/// the fields every chunk repeats.
struct CompletionRender {
    head: Completion,
    style: LogprobStyle,
    tokenizer: Arc<tokenspeed_text::TextTokenizer>,
    /// Per prompt: its token ids.
    prompts: Vec<Vec<u32>>,
    /// Per prompt: the text `echo` prepends (empty without echo).
    echo_texts: Vec<String>,
    n: usize,
    top: u32,
    want_logprobs: bool,
    echo_logprobs: bool,
    /// vLLM's `prompt_logprobs` was asked for.
    prompt_logprobs: bool,
    /// vLLM's `return_token_ids` was asked for.
    token_ids: bool,
}

impl CompletionRender {
    fn new(
        state: &AppState,
        req: &CompletionRequest,
        checked: &validate::routes::ValidatedCompletion,
        head: Completion,
        prompts: Vec<Vec<u32>>,
        echo_texts: Vec<String>,
    ) -> Self {
        CompletionRender {
            head,
            style: LogprobStyle {
                as_ids: req.sampling.return_tokens_as_token_ids.unwrap_or(false),
            },
            tokenizer: state.tokenizer.clone(),
            prompts,
            echo_texts,
            n: checked.n,
            top: checked.top,
            want_logprobs: checked.want_logprobs,
            echo_logprobs: checked.echo_logprobs,
            prompt_logprobs: req.sampling.prompt_logprobs.is_some(),
            token_ids: req.sampling.return_token_ids.unwrap_or(false),
        }
    }

    /// The whole answer, once every choice has finished (without `stream`).
    fn completion(&self, chunks: &[Chunk]) -> Completion {
        let usages: Vec<TokenUsage> = chunks.iter().map(|c| c.usage).collect();
        let choices = chunks
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let prefix = self.echo_of(i);
                let mut offset = prefix.chars().count();
                let logprobs = self.logprobs(i, c, true, &mut offset);
                let mut choice = completion_choice(i, prefix + &c.text, logprobs, c);
                // vLLM's shape: both keys present, null unless asked for.
                choice.prompt_logprobs = Some(
                    self.prompt_logprobs
                        .then(|| vllm_prompt_logprobs(&self.tokenizer, &c.prompt_logprobs)),
                );
                choice.prompt_token_ids = Some(self.prompt_ids(i));
                choice.token_ids = self.token_ids.then(|| c.token_ids.clone());
                choice
            })
            .collect();
        Completion {
            choices,
            usage: Some(Usage::of(&total_usage(&usages, self.n))),
            ..self.head.clone()
        }
    }

    /// Choice `i`'s prompt token ids, when `return_token_ids` asked for them.
    fn prompt_ids(&self, i: usize) -> Option<Vec<u32>> {
        self.token_ids
            .then(|| self.prompts.get(i / self.n).cloned().unwrap_or_default())
    }

    fn echo_of(&self, i: usize) -> String {
        self.echo_texts.get(i / self.n).cloned().unwrap_or_default()
    }

    /// Logprobs of choice `i`'s chunk `c` (None unless asked for): on its first chunk the
    /// echoed prompt's, then its tokens'.
    fn logprobs(
        &self,
        i: usize,
        c: &Chunk,
        first: bool,
        offset: &mut usize,
    ) -> Option<CompletionLogprobs> {
        if !self.want_logprobs {
            return None;
        }
        let (tokenizer, style) = (&*self.tokenizer, self.style);
        let mut out = CompletionLogprobs::default();
        if first && self.echo_logprobs {
            let ids = self.prompts.get(i / self.n).map_or(&[][..], Vec::as_slice);
            out = prompt_completion_logprobs(tokenizer, style, ids, &c.prompt_logprobs, self.top);
            *offset = out.tokens.iter().map(|t| t.chars().count()).sum();
        }
        let generated = completion_logprobs(tokenizer, style, &c.logprobs, offset);
        out.tokens.extend(generated.tokens);
        out.token_logprobs.extend(generated.token_logprobs);
        out.top_logprobs.extend(generated.top_logprobs);
        out.text_offset.extend(generated.text_offset);
        Some(out)
    }

    fn stream(self: Arc<Self>, choices: Choices, opts: StreamSettings) -> Response {
        // Per choice: whether its echo went out, and its text offset so far.
        let mut started = vec![false; choices.gens.len()];
        let mut offsets = vec![0usize; choices.gens.len()];
        let render = self.clone();
        let frame = move |i: usize, c: &Chunk| {
            if c.text.is_empty()
                && c.finish.is_none()
                && c.prompt_logprobs.is_empty()
                && !render.want_logprobs
                && (!render.token_ids || c.token_ids.is_empty())
            {
                return None;
            }
            let mut text = String::new();
            let first = !std::mem::replace(started.get_mut(i)?, true);
            let offset = offsets.get_mut(i)?;
            if first {
                text = render.echo_of(i);
                *offset = text.chars().count();
            }
            text.push_str(&c.text);
            let logprobs = render.logprobs(i, c, first, offset);
            let mut choice = completion_choice(i, text, logprobs, c);
            if first && render.prompt_logprobs {
                choice.prompt_logprobs = Some(Some(vllm_prompt_logprobs(
                    &render.tokenizer,
                    &c.prompt_logprobs,
                )));
            }
            if render.token_ids {
                choice.prompt_token_ids = first.then(|| render.prompt_ids(i));
                choice.token_ids = Some(c.token_ids.clone());
            }
            Some(sse_data(&Completion {
                choices: vec![choice],
                usage: opts.continuous_usage.then(|| Usage::of(&c.usage)),
                ..render.head.clone()
            }))
        };
        let usage = opts.include_usage.then_some(move |u: &[TokenUsage]| {
            sse_data(&Completion {
                usage: Some(Usage::of(&total_usage(u, self.n))),
                ..self.head.clone()
            })
        });
        sse_response(choices, Vec::new(), frame, usage)
    }
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
        prompt_token_ids: None,
        token_ids: None,
    }
}

/// The text a prompt stands for (what `echo` prepends): the text itself, or its ids decoded.
fn prompt_text(state: &AppState, prompt: &Prompt) -> String {
    match prompt {
        Prompt::Text(t) => t.clone(),
        Prompt::PlainText(t) => t.clone(),
        Prompt::Ids(ids) => state.tokenizer.decode(ids, false).unwrap_or_default(),
        Prompt::Chat { .. } => String::new(),
    }
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
