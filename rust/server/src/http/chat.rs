//! `/v1/chat/completions` (SSE or not): messages checked and rendered by the chat template, then
//! the same choices, streams and logprobs as the completions route (`openai.rs`).

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use super::error::ApiError;
use super::openai::{
    request_id, sse_data, sse_response, stream_options, total_usage, vllm_prompt_logprobs,
    with_prompts, LogprobStyle,
};
use super::protocol::{check_extra_fields, parse_body, ChatCompletionRequest};
#[allow(unused_imports)] // named by the #[utoipa::path] attributes
use super::response::ErrorResponse;
use super::response::{
    ChatChoice, ChatChunkChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatLogprobEntry,
    ChatLogprobs, ChatMessage, TopLogprob, Usage,
};
use super::{ok_json, unix_now, AppState};
use crate::engine::TokenUsage;
use crate::generate::{self, Chunk, Prompt, TokenLogprob};
use crate::validate;

#[utoipa::path(post, path = "/v1/chat/completions", request_body = ChatCompletionRequest, responses((status = 200, description = "a chat completion, or server-sent ChatCompletionChunks with stream", body = ChatCompletion), (status = 400, description = "invalid request", body = ErrorResponse), (status = 503, description = "overloaded or no worker", body = ErrorResponse)))]
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
