//! `/v1/chat/completions` (SSE or not): messages checked and rendered by the chat template, then
//! the same choices, streams and logprobs as the completions route (`openai.rs`). Tools and
//! `tool_choice` decide the output stage (`chat_output.rs`: reasoning, then tool calls) and, for
//! "required" or a named function, the grammar that forces the call.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::chat_output::{finish_reason, OutputStream};
use super::chat_request::{check_messages, message_text, output_stage, template_messages};
use super::error::ApiError;
use super::openai::{
    sse_data, sse_response, stream_options, total_usage, vllm_prompt_logprobs, with_prompts,
    LogprobStyle,
};
use super::protocol::{check_extra_fields, parse_body, ChatCompletionRequest};
use super::response::{
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatLogprobEntry,
    ChatLogprobs, ChatMessage, FunctionCallChunk, FunctionCallOut, ToolCallChunk, ToolCallOut,
    TopLogprob, Usage,
};
#[allow(unused_imports)] // named by the #[utoipa::path] attributes
use super::response::{ErrorResponse, ServerSentEvent};
use super::{ok_json, unix_now, AppState};
use crate::engine::TokenUsage;
use crate::generate::{self, Chunk, Prompt, TokenLogprob};
use crate::validate;
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
fn strip_special_stop(tokenizer: &TextTokenizer, keep_special: bool, text: &mut String, c: &Chunk) {
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
    let last_role = check_messages(&req.messages)?;
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
    // vLLM's echo: the reply starts with the last message when that is the assistant's.
    let echo = match req.messages.last() {
        Some(m) if req.echo == Some(true) && last_role == "assistant" => message_text(m),
        _ => String::new(),
    };
    let stage = output_stage(&req, &state.chat_parsers, &mut base)?;
    let keep_special = !base.skip_special_tokens;
    let mut vars = req.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(tools) = req.tools.clone().filter(|t| !t.is_empty()) {
        vars.insert("tools".into(), Value::Array(tools));
    }
    let prompt = Prompt::Chat {
        messages: template_messages(req.messages),
        template_vars: (!vars.is_empty()).then_some(Value::Object(vars)),
        add_generation_prompt,
        continue_final_message: continue_final,
    };
    let rid = generate::new_request_id();
    let specs = with_prompts(&base, vec![prompt]);
    let choices = generate::start_choices(&state, rid, specs, n).await?;
    let style = LogprobStyle {
        as_ids: req.sampling.return_tokens_as_token_ids.unwrap_or(false),
    };
    let id = format!("chatcmpl-{}", rid.request());
    let model = model.unwrap_or_else(|| state.config.served_model_name.clone());
    let created = unix_now();
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
            prompt_logprobs: None,
        };
        // The first delta of each choice carries the role (and the echo), and with continuous
        // usage the prompt's usage (vLLM's role chunk: no completion tokens yet).
        let preamble = (0..choices.gens.len())
            .map(|i| {
                let prompt_tokens = choices.prompts.get(i / n).map_or(0, Vec::len) as u32;
                sse_data(&ChatCompletionChunk {
                    choices: vec![ChatChunkChoice {
                        index: i as u32,
                        delta: ChatDelta {
                            role: Some("assistant"),
                            content: Some(echo.clone()),
                            ..ChatDelta::default()
                        },
                        logprobs: None,
                        finish_reason: None,
                        matched_stop: None,
                    }],
                    usage: opts
                        .continuous_usage
                        .then(|| Usage::before_output(prompt_tokens)),
                    ..head.clone()
                })
            })
            .collect();
        // Per choice: its pass through the output stage, and its call ids.
        let mut streams: Vec<OutputStream> =
            (0..choices.gens.len()).map(|_| stage.stream()).collect();
        let mut ids: Vec<Vec<String>> = vec![Vec::new(); choices.gens.len()];
        // The prompt's logprobs, until they go out (choice 0's first chunk carries them).
        let mut prompt_logprobs_due = req.sampling.prompt_logprobs.is_some();
        let frame = {
            let head = head.clone();
            move |i: usize, c: &Chunk| {
                let mut text = c.text.clone();
                strip_special_stop(&tokenizer, keep_special, &mut text, c);
                let (stream, ids) = (streams.get_mut(i)?, ids.get_mut(i)?);
                let out = stream.push(&text, c.finish.is_some());
                let logprobs = want_logprobs.then(|| chat_logprobs(&tokenizer, style, &c.logprobs));
                let prompt_logprobs = (i == 0 && std::mem::take(&mut prompt_logprobs_due))
                    .then(|| vllm_prompt_logprobs(&tokenizer, &c.prompt_logprobs));
                if out.is_empty()
                    && c.finish.is_none()
                    && logprobs.is_none()
                    && prompt_logprobs.is_none()
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
                    }],
                    usage: opts.continuous_usage.then(|| Usage::of(&c.usage)),
                    prompt_logprobs,
                    ..head.clone()
                }))
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
        .map(|(i, c)| {
            let mut text = c.text.clone();
            strip_special_stop(&state.tokenizer, keep_special, &mut text, c);
            let parsed = stage.parse(&text);
            let content = echo.clone() + &parsed.content;
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
                logprobs: want_logprobs
                    .then(|| chat_logprobs(&state.tokenizer, style, &c.logprobs)),
                finish_reason: c
                    .finish
                    .as_ref()
                    .map(|f| finish_reason(f.reason, made_calls)),
                matched_stop: c.finish.as_ref().and_then(|f| f.matched.clone()),
            }
        })
        .collect();
    let prompt_logprobs = req.sampling.prompt_logprobs.and(chunks.first()).map(|c| {
        // Every choice scored the same prompt: the first one's stand for all.
        vllm_prompt_logprobs(&state.tokenizer, &c.prompt_logprobs)
    });
    Ok(ok_json(json!(ChatCompletion {
        id,
        object: "chat.completion",
        created,
        model,
        choices,
        usage: Usage::of(&total_usage(&usages, n)),
        prompt_logprobs,
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
