//! `/v1/chat/completions` (SSE or not): messages checked and rendered by the chat template, then
//! the same choices, streams and logprobs as the completions route (`openai.rs`). Tools and
//! `tool_choice` decide the output stage (`chat_output.rs`: reasoning, then tool calls) and, for
//! "required" or a named function, the grammar that forces the call.

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};

use super::chat_output::{finish_reason, ChatParsers, OutputStage, OutputStream, ToolMode};
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
    ChatLogprobs, ChatMessage, FunctionCallChunk, FunctionCallOut, ToolCallChunk, ToolCallOut,
    TopLogprob, Usage,
};
use super::{ok_json, unix_now, AppState};
use crate::constraint::GrammarRequest;
use crate::engine::TokenUsage;
use crate::generate::{self, Chunk, GenerationSpec, Prompt, TokenLogprob};
use crate::validate;
use tokenspeed_structured::tool_call::forced;
use tokenspeed_structured::{GrammarSpec, ToolCallFormat};
use tokenspeed_text::TextTokenizer;

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
        if role == "tool" && !m.get("tool_call_id").is_some_and(Value::is_string) {
            return Err(ApiError::bad_param(
                "messages",
                format!("messages[{i}] (role \"tool\") needs a string 'tool_call_id'"),
            ));
        }
        if let Some(calls) = m.get("tool_calls").filter(|v| !v.is_null()) {
            check_message_tool_calls(i, role, calls)?;
        }
        last_role = role.to_string();
    }
    Ok(last_role)
}

/// An assistant message's `tool_calls`, as OpenAI sends them back.
fn check_message_tool_calls(i: usize, role: &str, calls: &Value) -> Result<(), ApiError> {
    let bad = |m: String| ApiError::bad_param("messages", m);
    if role != "assistant" {
        return Err(bad(format!(
            "messages[{i}] has tool_calls but role {role:?}: only assistant messages make calls"
        )));
    }
    let calls = calls
        .as_array()
        .ok_or_else(|| bad(format!("messages[{i}].tool_calls must be an array")))?;
    for (j, call) in calls.iter().enumerate() {
        let function = call.get("function");
        let named = function
            .and_then(|f| f.get("name"))
            .is_some_and(Value::is_string);
        let args_ok = function
            .and_then(|f| f.get("arguments"))
            .is_none_or(|a| a.is_string() || a.is_object());
        if !named || !args_ok {
            return Err(bad(format!(
                "messages[{i}].tool_calls[{j}] needs a \"function\" with a string \"name\" and \
                 \"arguments\" (JSON text)"
            )));
        }
    }
    Ok(())
}

/// Messages as chat templates expect them (vLLM's conventions): null content is "" (templates
/// concatenate it), and a call's `arguments` JSON text is an object (templates `tojson` it).
fn template_messages(messages: Vec<Map<String, Value>>) -> Vec<Map<String, Value>> {
    messages
        .into_iter()
        .map(|mut m| {
            if m.get("content").is_none_or(Value::is_null) {
                m.insert("content".into(), Value::String(String::new()));
            }
            if let Some(Value::Array(calls)) = m.get_mut("tool_calls") {
                for call in calls {
                    let Some(args) = call
                        .get_mut("function")
                        .and_then(|f| f.get_mut("arguments"))
                    else {
                        continue;
                    };
                    if let Some(parsed) = args
                        .as_str()
                        .and_then(|t| serde_json::from_str::<Value>(t).ok())
                        .filter(Value::is_object)
                    {
                        *args = parsed;
                    }
                }
            }
            m
        })
        .collect()
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

/// `tool_choice`, as OpenAI spells it.
#[derive(Debug, Clone, PartialEq)]
enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

fn tool_choice(req: &ChatCompletionRequest, has_tools: bool) -> Result<ToolChoice, ApiError> {
    let bad = |m: String| ApiError::bad_param("tool_choice", m);
    let choice = match &req.tool_choice {
        None | Some(Value::Null) if has_tools => ToolChoice::Auto,
        None | Some(Value::Null) => ToolChoice::None,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(bad(format!(
                    "tool_choice {other:?} is not one of \"none\", \"auto\", \"required\" \
                     or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"
                )))
            }
        },
        Some(v) => {
            let name = (v.get("type").and_then(Value::as_str) == Some("function"))
                .then(|| v.get("function")?.get("name")?.as_str())
                .flatten()
                .ok_or_else(|| {
                    bad(format!(
                        "tool_choice {v} must be {{\"type\": \"function\", \"function\": \
                         {{\"name\": ...}}}}"
                    ))
                })?;
            ToolChoice::Named(name.to_string())
        }
    };
    if !has_tools && matches!(choice, ToolChoice::Required | ToolChoice::Named(_)) {
        return Err(bad(
            "tool_choice \"required\" or a named function needs tools".into(),
        ));
    }
    Ok(choice)
}

/// Each tool is `{"type": "function", "function": {"name": .., "parameters": {..}}}`.
fn check_tools(tools: &[Value]) -> Result<(), ApiError> {
    for (i, tool) in tools.iter().enumerate() {
        let function = tool.get("function").and_then(Value::as_object);
        let ok = tool.get("type").and_then(Value::as_str) == Some("function")
            && function.is_some_and(|f| {
                f.get("name")
                    .and_then(Value::as_str)
                    .is_some_and(|n| !n.is_empty())
                    && f.get("parameters")
                        .is_none_or(|p| p.is_object() || p.is_null())
            });
        if !ok {
            return Err(ApiError::bad_param(
                "tools",
                format!(
                    "tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": \
                     <non-empty string>, \"parameters\": <JSON schema object>}}}}"
                ),
            ));
        }
    }
    Ok(())
}

/// How the request's tools shape the output: how it is read, and for "required" or a named
/// function the grammar that forces the call (so its arguments always follow the schema).
fn tool_plan(
    req: &ChatCompletionRequest,
    parsers: &ChatParsers,
) -> Result<(ToolMode, Option<GrammarRequest>), ApiError> {
    let tools = req.tools.as_deref().unwrap_or_default();
    check_tools(tools)?;
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    let forced = |schema: Result<Value, String>| {
        schema
            .map(|s| GrammarRequest {
                spec: GrammarSpec::JsonSchema(s),
                field: "tool_choice",
            })
            .map_err(|m| ApiError::bad_param("tool_choice", m))
    };
    Ok(match tool_choice(req, !tools.is_empty())? {
        ToolChoice::None => (ToolMode::Off, None),
        ToolChoice::Auto if tools.is_empty() => (ToolMode::Off, None),
        ToolChoice::Auto => match parsers.tool_call {
            Some(format) if parsers.auto_tool_choice => (
                ToolMode::Parse {
                    format,
                    single: !parallel,
                },
                None,
            ),
            _ => {
                return Err(ApiError::bad_param(
                    "tool_choice",
                    "tool_choice \"auto\" (the default when tools are given) needs the server \
                     started with --enable-auto-tool-choice and --tool-call-parser; \
                     \"required\", a named function and \"none\" work without them",
                ))
            }
        },
        ToolChoice::Required => (
            ToolMode::Parse {
                format: ToolCallFormat::JsonArray,
                single: !parallel,
            },
            Some(forced(forced::required_schema(tools, parallel))?),
        ),
        ToolChoice::Named(name) => {
            let grammar = forced(forced::named_schema(tools, &name))?;
            (ToolMode::Named(name), Some(grammar))
        }
    })
}

/// The output stage of a request, and the spec changes it needs: the forced-call grammar,
/// special tokens kept for the model's tool-call markers, grammars after the reasoning.
fn output_stage(
    req: &ChatCompletionRequest,
    parsers: &ChatParsers,
    spec: &mut GenerationSpec,
) -> Result<OutputStage, ApiError> {
    let (tools, grammar) = tool_plan(req, parsers)?;
    if let Some(grammar) = grammar {
        if let Some(other) = &spec.grammar {
            return Err(ApiError::bad_param(
                "tool_choice",
                format!(
                    "tool_choice \"required\" or a named function constrains the output, so it \
                     cannot be combined with '{}'",
                    other.field
                ),
            ));
        }
        spec.grammar = Some(grammar);
    }
    if matches!(tools, ToolMode::Parse { format, .. } if format != ToolCallFormat::JsonArray)
        && req.sampling.skip_special_tokens.is_none()
    {
        // Tool-call markers (`<|python_tag|>`, `[TOOL_CALLS]`, Qwen's `<tool_call>`) may be
        // special tokens: the parser must see them.
        spec.skip_special_tokens = false;
    }
    let enable_thinking = req
        .chat_template_kwargs
        .as_ref()
        .and_then(|k| k.get("enable_thinking"))
        .and_then(Value::as_bool);
    let stage = OutputStage {
        reasoning: parsers.reasoning,
        enable_thinking,
        tools,
    };
    if let Some(grammar) = spec
        .grammar
        .as_ref()
        .filter(|_| stage.starts_in_reasoning())
    {
        // The reasoning stays free; the grammar applies from the token after its end.
        spec.grammar_starts_after = Some(parsers.think_end_id.ok_or_else(|| {
            ApiError::bad_param(
                grammar.field,
                format!(
                    "'{}' constrains the answer after the reasoning, but this model's tokenizer \
                     has no single think-end token; send chat_template_kwargs \
                     {{\"enable_thinking\": false}} if the model supports it",
                    grammar.field
                ),
            )
        })?);
    }
    Ok(stage)
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
    format!("call_{}", request_id())
}

fn non_empty(s: String) -> Option<String> {
    (!s.is_empty()).then_some(s)
}

async fn chat_inner(state: AppState, body: &[u8]) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_body(body)?;
    check_extra_fields("/v1/chat/completions", &req.extra)?;
    state.check_model(req.model.as_deref())?;
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
                            ..ChatDelta::default()
                        },
                        logprobs: None,
                        finish_reason: None,
                        matched_stop: None,
                    }],
                    ..head.clone()
                })
            })
            .collect();
        // Per choice: its pass through the output stage, and its call ids.
        let mut streams: Vec<OutputStream> =
            (0..choices.gens.len()).map(|_| stage.stream()).collect();
        let mut ids: Vec<Vec<String>> = vec![Vec::new(); choices.gens.len()];
        let frame = {
            let head = head.clone();
            move |i: usize, c: &Chunk| {
                let mut text = c.text.clone();
                strip_special_stop(&tokenizer, keep_special, &mut text, c);
                let (stream, ids) = (streams.get_mut(i)?, ids.get_mut(i)?);
                let out = stream.push(&text, c.finish.is_some());
                let logprobs = want_logprobs.then(|| chat_logprobs(&tokenizer, style, &c.logprobs));
                if out.is_empty() && c.finish.is_none() && logprobs.is_none() {
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
                prompt_logprobs: req
                    .sampling
                    .prompt_logprobs
                    .is_some()
                    .then(|| vllm_prompt_logprobs(&state.tokenizer, &c.prompt_logprobs)),
            }
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokenspeed_structured::ReasoningFormat;

    fn request(extra: Value) -> ChatCompletionRequest {
        let mut body = json!({
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f",
                "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}],
        });
        if let (Some(b), Some(e)) = (body.as_object_mut(), extra.as_object()) {
            b.extend(e.clone());
        }
        serde_json::from_value(body).expect("request")
    }

    fn spec() -> GenerationSpec {
        GenerationSpec {
            prompt: Prompt::Ids(Vec::new()),
            sampling: tokenspeed_engine::SamplingParams::greedy(),
            max_new_tokens: None,
            min_new_tokens: 0,
            stop: vec![],
            stop_token_ids: vec![],
            ignore_eos: false,
            skip_special_tokens: true,
            include_stop_str_in_output: false,
            top_logprobs: 0,
            prompt_logprobs: None,
            grammar: None,
            grammar_starts_after: None,
        }
    }

    const THINK_END: u32 = 7;

    fn reasoning_parsers() -> ChatParsers {
        ChatParsers {
            tool_call: Some(ToolCallFormat::Hermes),
            reasoning: Some(ReasoningFormat::Qwen3),
            auto_tool_choice: true,
            think_end_id: Some(THINK_END),
        }
    }

    #[test]
    fn forced_calls_get_a_grammar_that_starts_after_the_reasoning() {
        let named = json!({"tool_choice": {"type": "function", "function": {"name": "f"}}});
        let mut s = spec();
        let stage =
            output_stage(&request(named.clone()), &reasoning_parsers(), &mut s).expect("valid");
        assert_eq!(stage.tools, ToolMode::Named("f".into()));
        let grammar = s.grammar.expect("forced with a grammar");
        assert_eq!(grammar.field, "tool_choice");
        assert!(
            matches!(grammar.spec, GrammarSpec::JsonSchema(ref v) if v["properties"]["a"]["type"] == "integer")
        );
        assert_eq!(s.grammar_starts_after, Some(THINK_END));
        assert!(
            s.skip_special_tokens,
            "the forced output has no special markers"
        );

        // Thinking off: the grammar applies from the first token.
        let mut off = named.clone();
        off["chat_template_kwargs"] = json!({"enable_thinking": false});
        let mut s = spec();
        output_stage(&request(off), &reasoning_parsers(), &mut s).expect("valid");
        assert!(s.grammar.is_some());
        assert_eq!(s.grammar_starts_after, None);

        // No think-end token: refused, naming the field whose grammar could not be placed.
        let parsers = ChatParsers {
            think_end_id: None,
            ..reasoning_parsers()
        };
        let err = output_stage(&request(named), &parsers, &mut spec()).expect_err("refused");
        assert_eq!(err.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn required_parses_the_forced_array_and_auto_keeps_special_tokens() {
        let mut s = spec();
        let stage = output_stage(
            &request(json!({"tool_choice": "required", "parallel_tool_calls": false})),
            &ChatParsers::default(),
            &mut s,
        )
        .expect("valid");
        assert_eq!(
            stage.tools,
            ToolMode::Parse {
                format: ToolCallFormat::JsonArray,
                single: true
            }
        );
        let Some(GrammarSpec::JsonSchema(schema)) = s.grammar.map(|g| g.spec) else {
            panic!("required is forced with a JSON schema");
        };
        assert_eq!(schema["maxItems"], 1);

        let mut s = spec();
        let stage = output_stage(&request(json!({})), &reasoning_parsers(), &mut s).expect("auto");
        assert!(matches!(
            stage.tools,
            ToolMode::Parse {
                format: ToolCallFormat::Hermes,
                ..
            }
        ));
        assert!(
            !s.skip_special_tokens,
            "the model's markers may be special tokens"
        );
        assert!(s.grammar.is_none());
    }

    #[test]
    fn a_forced_call_and_another_grammar_conflict() {
        let mut s = spec();
        s.grammar = Some(GrammarRequest {
            spec: GrammarSpec::JsonObject,
            field: "response_format",
        });
        let err = output_stage(
            &request(json!({"tool_choice": "required"})),
            &ChatParsers::default(),
            &mut s,
        )
        .expect_err("two grammars");
        assert_eq!(err.param.as_deref(), Some("tool_choice"));
    }

    #[test]
    fn template_messages_fill_null_content_and_parse_arguments() {
        let messages: Vec<Map<String, Value>> = serde_json::from_value(json!([
            {"role": "assistant", "content": null, "tool_calls": [{"id": "c", "type": "function",
                "function": {"name": "f", "arguments": "{\"a\": 1}"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "2"},
        ]))
        .expect("messages");
        let out = template_messages(messages);
        assert_eq!(out[0]["content"], "");
        assert_eq!(
            out[0]["tool_calls"][0]["function"]["arguments"],
            json!({"a": 1})
        );
        assert_eq!(out[1]["content"], "2");
    }
}
