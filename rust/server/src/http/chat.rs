//! `/v1/chat/completions` (SSE or not): messages checked and rendered by the chat template, then
//! the same choices, streams and logprobs as the completions route (`openai.rs`). Tools and
//! `tool_choice` decide the output stage (`chat_output.rs`: reasoning, then tool calls) and, for
//! "required" or a named function, the grammar that forces the call.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use std::sync::Arc;

use axum::response::sse::Event;

use super::error::ApiError;
use super::openai::{sse_data, sse_response, total_usage, vllm_prompt_logprobs, LogprobStyle};
use super::protocol::{check_extra_fields, parse_body, ChatCompletionRequest};
use super::response::{
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatLogprobEntry,
    ChatLogprobs, ChatMessage, FunctionCallChunk, FunctionCallOut, ToolCallChunk, ToolCallOut,
    TopLogprob, Usage,
};
#[allow(unused_imports)] // named by the #[utoipa::path] attributes
use super::response::{ErrorResponse, ServerSentEvent};
use super::{ok_json, unix_now, AppState};
use crate::chat_output::{finish_reason, OutputStream};
use crate::engine::TokenUsage;
use crate::generate::{self, Choices, Chunk, TokenLogprob};
use crate::validate::{self, StreamSettings};
use tokenspeed_text::TextTokenizer;

#[utoipa::path(post, path = "/v1/chat/completions", request_body = ChatCompletionRequest, responses((status = 200, description = "a chat completion, or server-sent ChatCompletionChunks with stream", content((ChatCompletion = "application/json"), (ServerSentEvent = "text/event-stream"))), (status = 400, description = "invalid request", body = ErrorResponse), (status = 503, description = "overloaded or no worker", body = ErrorResponse)))]
pub async fn chat_completions(State(state): State<AppState>, body: Bytes) -> Response {
    match chat_inner(state, &body).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// With special tokens kept, a choice that ended on a special stop token (eos) has its text at
/// the end: it is no part of the answer.
pub(super) fn strip_special_stop(
    tokenizer: &TextTokenizer,
    keep_special: bool,
    text: &mut String,
    c: &Chunk,
) {
    let Some(id) = c
        .finish
        .as_ref()
        .and_then(|f| f.matched.as_ref())
        .and_then(Value::as_u64)
    else {
        return;
    };
    if !keep_special
        || tokenizer
            .decode(&[id as u32], true)
            .is_ok_and(|t| !t.is_empty())
    {
        return;
    }
    if let Ok(marker) = tokenizer.decode(&[id as u32], false) {
        if !marker.is_empty() && text.ends_with(&marker) {
            text.truncate(text.len() - marker.len());
        }
    }
}

/// A unique tool call id in OpenAI's form.
fn call_id() -> String {
    format!("call_{}", uuid::Uuid::new_v4().simple())
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

async fn chat_inner(state: AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_body(body)?;
    check_extra_fields("/v1/chat/completions", "ChatCompletionRequest", &req.extra)?;
    let adapter = state.adapter_for(req.model.as_deref(), req.lora_path.as_deref())?;
    let mut checked = validate::chat::chat_request(
        &req,
        &state.config.sampling_defaults,
        state.tokenizer.vocab_size() as u32,
        state.config.max_logprobs,
        &state.chat_parsers,
    )?;
    let model = state.response_model(adapter.as_ref());
    crate::lora::run_on(&mut checked.spec.sampling, adapter);
    checked.spec.priority = validate::priority(
        req.priority,
        state.config.scheduler.enable_priority_scheduling,
    )?;
    let pd = validate::PdFields {
        room: req.bootstrap_room,
        host: req.bootstrap_host.as_deref(),
        port: req.bootstrap_port,
    };
    checked.spec.kv_transfer = validate::bootstrap(pd, state.config.pd_pair(), checked.n)?;
    let rid = generate::new_request_id();
    let choices =
        generate::start_choices(&state, rid, vec![checked.spec.clone()], checked.n).await?;
    let render = ChatRender {
        head: ChatCompletionChunk {
            id: format!("chatcmpl-{}", rid.request()),
            object: "chat.completion.chunk",
            created: unix_now(),
            model,
            choices: Vec::new(),
            usage: None,
            prompt_logprobs: None,
            prompt_token_ids: None,
        },
        style: LogprobStyle {
            as_ids: req.sampling.return_tokens_as_token_ids.unwrap_or(false),
        },
        tokenizer: state.tokenizer.clone(),
        prompt_logprobs: req.sampling.prompt_logprobs.is_some(),
        token_ids: req.sampling.return_token_ids.unwrap_or(false),
        checked,
    };
    if req.sampling.stream.unwrap_or(false) {
        let opts = render.checked.stream;
        return Ok(render.stream(choices, opts));
    }
    render.json(choices).await
}

/// How a chat request's answer is rendered: what the checked request asked for, and the
/// fields every chunk repeats.
struct ChatRender {
    checked: validate::chat::ValidatedChat,
    /// `id`, `created`, `model` (its `object` is the streamed one's).
    head: ChatCompletionChunk,
    style: LogprobStyle,
    tokenizer: Arc<TextTokenizer>,
    /// vLLM's `prompt_logprobs` was asked for.
    prompt_logprobs: bool,
    /// vLLM's `return_token_ids` was asked for.
    token_ids: bool,
}

impl ChatRender {
    fn text(&self, c: &Chunk) -> String {
        let mut text = c.text.clone();
        strip_special_stop(&self.tokenizer, self.checked.keep_special, &mut text, c);
        text
    }

    fn logprobs(&self, c: &Chunk) -> Option<ChatLogprobs> {
        self.checked
            .want_logprobs
            .then(|| chat_logprobs(&self.tokenizer, self.style, &c.logprobs))
    }

    /// The first delta of each choice carries the role (and the echo), and with continuous
    /// usage the prompt's usage (vLLM's role chunk: no completion tokens yet).
    fn preamble(&self, choices: &Choices, opts: &StreamSettings) -> Vec<Event> {
        (0..choices.gens.len())
            .map(|i| {
                let prompt_tokens = choices.prompts.get(i / choices.n).map_or(0, Vec::len) as u32;
                sse_data(&ChatCompletionChunk {
                    choices: vec![ChatChunkChoice {
                        index: i as u32,
                        delta: ChatDelta {
                            role: Some("assistant"),
                            content: Some(self.checked.echo.clone()),
                            ..ChatDelta::default()
                        },
                        logprobs: None,
                        finish_reason: None,
                        matched_stop: None,
                        token_ids: None,
                    }],
                    usage: opts
                        .continuous_usage
                        .then(|| Usage::before_output(prompt_tokens)),
                    prompt_token_ids: self
                        .token_ids
                        .then(|| choices.prompts.get(i / choices.n).cloned())
                        .flatten(),
                    ..self.head.clone()
                })
            })
            .collect()
    }

    fn stream(self, choices: Choices, opts: StreamSettings) -> Response {
        let preamble = self.preamble(&choices, &opts);
        let (n, count) = (choices.n, choices.gens.len());
        let head = self.head.clone();
        let usage = opts.include_usage.then_some(move |u: &[TokenUsage]| {
            sse_data(&ChatCompletionChunk {
                usage: Some(Usage::of(&total_usage(u, n))),
                ..head.clone()
            })
        });
        let mut frames = ChatFrames {
            streams: (0..count).map(|_| self.checked.stage.stream()).collect(),
            ids: vec![Vec::new(); count],
            prompt_logprobs_due: self.prompt_logprobs,
            continuous_usage: opts.continuous_usage,
            render: self,
        };
        sse_response(choices, preamble, move |i, c| frames.frame(i, c), usage)
    }

    async fn json(self, choices: Choices) -> Result<Response, ApiError> {
        let n = choices.n;
        let prompt_token_ids = self
            .token_ids
            .then(|| choices.prompts.first().cloned())
            .flatten();
        let chunks = choices.collect().await?;
        let usages: Vec<TokenUsage> = chunks.iter().map(|c| c.usage).collect();
        let out: Vec<ChatChoice> = chunks
            .iter()
            .enumerate()
            .map(|(i, c)| self.choice(i, c))
            .collect();
        let prompt_logprobs = self
            .prompt_logprobs
            .then_some(())
            .and(chunks.first())
            .map(|c| {
                // Every choice scored the same prompt: the first one's stand for all.
                vllm_prompt_logprobs(&self.tokenizer, &c.prompt_logprobs)
            });
        Ok(ok_json(json!(ChatCompletion {
            id: self.head.id,
            object: "chat.completion",
            created: self.head.created,
            model: self.head.model,
            choices: out,
            usage: Usage::of(&total_usage(&usages, n)),
            prompt_logprobs,
            prompt_token_ids,
        })))
    }

    /// Choice `i` of a whole (non-streamed) answer.
    fn choice(&self, i: usize, c: &Chunk) -> ChatChoice {
        let stage = &self.checked.stage;
        let parsed = stage.parse(&self.text(c));
        let content = self.checked.echo.clone() + &parsed.content;
        let tool_calls: Vec<ToolCallOut> = parsed
            .tool_calls
            .into_iter()
            .map(|call| ToolCallOut {
                id: call_id(),
                kind: "function",
                function: FunctionCallOut {
                    name: call.name,
                    arguments: call.arguments,
                },
            })
            .collect();
        let made_calls = !tool_calls.is_empty();
        ChatChoice {
            index: i as u32,
            message: ChatMessage {
                role: "assistant",
                // Plain chat keeps "" for an empty answer; the parsers' empty parts are null.
                content: if stage.is_passthrough() {
                    Some(content)
                } else {
                    non_empty(content)
                },
                reasoning_content: non_empty(parsed.reasoning_content),
                tool_calls,
            },
            logprobs: self.logprobs(c),
            finish_reason: c
                .finish
                .as_ref()
                .map(|f| finish_reason(f.reason, made_calls)),
            matched_stop: c.finish.as_ref().and_then(|f| f.matched.clone()),
            token_ids: self.token_ids.then(|| c.token_ids.clone()),
        }
    }
}

/// A streamed chat answer's state: per choice its pass through the output stage and its call
/// ids, and whether the prompt's logprobs are still to go out (on choice 0's first chunk).
struct ChatFrames {
    render: ChatRender,
    streams: Vec<OutputStream>,
    ids: Vec<Vec<String>>,
    prompt_logprobs_due: bool,
    continuous_usage: bool,
}

impl ChatFrames {
    fn frame(&mut self, i: usize, c: &Chunk) -> Option<Event> {
        let text = self.render.text(c);
        let (stream, ids) = (self.streams.get_mut(i)?, self.ids.get_mut(i)?);
        let out = stream.push(&text, c.finish.is_some());
        let logprobs = self.render.logprobs(c);
        let prompt_logprobs = (i == 0 && std::mem::take(&mut self.prompt_logprobs_due))
            .then(|| vllm_prompt_logprobs(&self.render.tokenizer, &c.prompt_logprobs));
        let token_ids =
            (self.render.token_ids && !c.token_ids.is_empty()).then(|| c.token_ids.clone());
        if out.is_empty()
            && c.finish.is_none()
            && logprobs.is_none()
            && prompt_logprobs.is_none()
            && token_ids.is_none()
        {
            return None; // held back: the next text decides it
        }
        let tool_calls = out
            .tool_calls
            .into_iter()
            .map(|d| {
                let first = d.name.is_some();
                if first {
                    ids.push(call_id());
                }
                ToolCallChunk {
                    index: d.index as u32,
                    id: first.then(|| ids.get(d.index).cloned()).flatten(),
                    kind: first.then_some("function"),
                    function: FunctionCallChunk {
                        name: d.name,
                        arguments: d.arguments,
                    },
                }
            })
            .collect::<Vec<_>>();
        let finish = c
            .finish
            .as_ref()
            .map(|f| finish_reason(f.reason, stream.made_calls()));
        Some(sse_data(&ChatCompletionChunk {
            choices: vec![ChatChunkChoice {
                index: i as u32,
                delta: ChatDelta {
                    role: None,
                    content: non_empty(out.content),
                    reasoning_content: non_empty(out.reasoning_content),
                    tool_calls: (!tool_calls.is_empty()).then_some(tool_calls),
                },
                logprobs,
                finish_reason: finish,
                matched_stop: c.finish.as_ref().and_then(|f| f.matched.clone()),
                token_ids,
            }],
            usage: self.continuous_usage.then(|| Usage::of(&c.usage)),
            prompt_logprobs,
            ..self.render.head.clone()
        }))
    }
}

pub(super) fn chat_logprobs(
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
