//! The request side of `/v1/chat/completions`: messages checked and prepared for the chat
//! template (tool calls and tool results included), and `tools` / `tool_choice` /
//! `parallel_tool_calls` turned into the output stage (`chat_output.rs`) and, for "required" or
//! a named function, the grammar that forces the call.

use serde_json::{Map, Value};
use tokenspeed_structured::tool_call::forced;
use tokenspeed_structured::{GrammarSpec, ReasoningFormat, ToolCallFormat};

use crate::chat_output::{ChatParsers, OutputStage, ToolMode};
use crate::config::SamplingDefaults;
use crate::constraint::GrammarRequest;
use crate::error::RequestError;
use crate::generate::{GenerationSpec, Prompt};
use crate::http::protocol::ChatCompletionRequest;

const CHAT_ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// Roles OpenAI defines, and content that is a string or text parts (no images or audio until
/// a multimodal model exists). Returns the last message's role.
pub fn check_messages(messages: &[Map<String, Value>]) -> Result<String, RequestError> {
    if messages.is_empty() {
        return Err(RequestError::bad_param(
            "messages",
            "messages must be a non-empty array",
        ));
    }
    let mut last_role = String::new();
    for (i, m) in messages.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
            RequestError::bad_param("messages", format!("messages[{i}] has no string 'role'"))
        })?;
        if !CHAT_ROLES.contains(&role) {
            return Err(RequestError::bad_param(
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
                        return Err(RequestError::bad_param(
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
                return Err(RequestError::bad_param(
                    "messages",
                    format!("messages[{i}].content must be a string or a list of text parts"),
                ))
            }
        }
        if role == "tool" && !m.get("tool_call_id").is_some_and(Value::is_string) {
            return Err(RequestError::bad_param(
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
fn check_message_tool_calls(i: usize, role: &str, calls: &Value) -> Result<(), RequestError> {
    let bad = |m: String| RequestError::bad_param("messages", m);
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
pub fn template_messages(messages: Vec<Map<String, Value>>) -> Vec<Map<String, Value>> {
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
pub fn message_text(m: &Map<String, Value>) -> String {
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

fn tool_choice(req: &ChatCompletionRequest, has_tools: bool) -> Result<ToolChoice, RequestError> {
    let bad = |m: String| RequestError::bad_param("tool_choice", m);
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
fn check_tools(tools: &[Value]) -> Result<(), RequestError> {
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
            return Err(RequestError::bad_param(
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
) -> Result<(ToolMode, Option<GrammarRequest>), RequestError> {
    let tools = req.tools.as_deref().unwrap_or_default();
    check_tools(tools)?;
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    let forced = |schema: Result<Value, String>| {
        schema
            .map(|s| GrammarRequest {
                spec: GrammarSpec::JsonSchema(s),
                field: "tool_choice",
            })
            .map_err(|m| RequestError::bad_param("tool_choice", m))
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
                return Err(RequestError::bad_param(
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
pub fn output_stage(
    req: &ChatCompletionRequest,
    parsers: &ChatParsers,
    spec: &mut GenerationSpec,
) -> Result<OutputStage, RequestError> {
    let (tools, grammar) = tool_plan(req, parsers)?;
    if let Some(grammar) = grammar {
        if let Some(other) = &spec.grammar {
            return Err(RequestError::bad_param(
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
    // The template's thinking switch: `enable_thinking` (Qwen3), `thinking` (DeepSeek-V3.1).
    let thinking_kwarg = parsers
        .reasoning
        .map_or("enable_thinking", ReasoningFormat::thinking_kwarg);
    let enable_thinking = req
        .chat_template_kwargs
        .as_ref()
        .and_then(|k| k.get(thinking_kwarg))
        .and_then(Value::as_bool);
    let separate_reasoning = req.separate_reasoning.unwrap_or(true);
    if !separate_reasoning && parsers.harmony() {
        return Err(RequestError::bad_param(
            "separate_reasoning",
            "GPT-OSS's harmony output is read by one parser that always takes its analysis \
             channel apart: 'separate_reasoning: false' is not supported with it",
        ));
    }
    let stage = OutputStage {
        reasoning: parsers.reasoning,
        enable_thinking,
        tools,
        harmony: parsers.harmony(),
        separate_reasoning,
    };
    let model_markup = matches!(stage.tools, ToolMode::Parse { format, .. } if format != ToolCallFormat::JsonArray);
    if (model_markup || stage.harmony) && req.sampling.skip_special_tokens.is_none() {
        // Tool-call markers (`<|python_tag|>`, `[TOOL_CALLS]`, Qwen's `<tool_call>`) and
        // harmony's channel markers may be special tokens: the parser must see them.
        spec.skip_special_tokens = false;
    }
    if let Some(grammar) = spec
        .grammar
        .as_ref()
        .filter(|_| stage.starts_in_reasoning())
    {
        // The reasoning stays free; the grammar applies from the token after its end.
        spec.grammar_starts_after = Some(parsers.think_end_id.ok_or_else(|| {
            let why = if stage.harmony {
                "GPT-OSS's harmony output starts with its analysis channel and no single token \
                 ends it (a grammar after harmony's reasoning is not built)"
                    .to_string()
            } else {
                format!(
                    "this model's tokenizer has no single think-end token; send \
                     chat_template_kwargs {{\"{thinking_kwarg}\": false}} if the model supports it"
                )
            };
            RequestError::bad_param(
                grammar.field,
                format!(
                    "'{}' constrains the answer after the reasoning, but {why}",
                    grammar.field
                ),
            )
        })?);
    }
    Ok(stage)
}

/// A chat request, checked: the generation to start (its prompt the rendered messages), the
/// choices, and how its answer is rendered.
pub struct ValidatedChat {
    pub spec: GenerationSpec,
    pub n: usize,
    /// vLLM's echo: the reply starts with the last message when that is the assistant's.
    pub echo: String,
    pub stage: OutputStage,
    pub want_logprobs: bool,
    /// Special tokens kept in the text (a special stop token is then cut from the answer).
    pub keep_special: bool,
    pub stream: super::StreamSettings,
}

/// Validates a parsed chat request against the model's defaults, vocabulary and parsers.
pub fn chat_request(
    req: &ChatCompletionRequest,
    defaults: &SamplingDefaults,
    vocab_size: u32,
    max_logprobs: i64,
    parsers: &ChatParsers,
) -> Result<ValidatedChat, RequestError> {
    let last_role = check_messages(&req.messages)?;
    let continue_final = req.continue_final_message.unwrap_or(false);
    let add_generation_prompt = req.add_generation_prompt.unwrap_or(!continue_final);
    if continue_final && add_generation_prompt {
        return Err(RequestError::bad_param(
            "continue_final_message",
            "continue_final_message and add_generation_prompt cannot both be true",
        ));
    }
    if continue_final && last_role != "assistant" {
        return Err(RequestError::bad_param(
            "continue_final_message",
            "continue_final_message needs the last message to be the assistant's",
        ));
    }
    let want_logprobs = req.logprobs.unwrap_or(false);
    if req.top_logprobs.is_some() && !want_logprobs {
        return Err(RequestError::bad_param(
            "top_logprobs",
            "top_logprobs needs logprobs: true",
        ));
    }
    let top = super::top_logprobs("top_logprobs", req.top_logprobs, vocab_size, max_logprobs)?;
    let stream = super::stream_settings(&req.sampling)?;
    let max_tokens = super::max_tokens(
        "max_completion_tokens",
        req.max_completion_tokens.or(req.max_tokens),
    )?;
    let n = super::choices(req.sampling.n, 1)?;
    let mut spec = super::generation_spec(
        &req.sampling,
        defaults,
        max_tokens,
        top,
        vocab_size,
        max_logprobs,
    )?;
    let echo = match req.messages.last() {
        Some(m) if req.echo == Some(true) && last_role == "assistant" => message_text(m),
        _ => String::new(),
    };
    let stage = output_stage(req, parsers, &mut spec)?;
    let mut vars = req.chat_template_kwargs.clone().unwrap_or_default();
    if let Some(tools) = req.tools.clone().filter(|t| !t.is_empty()) {
        vars.insert("tools".into(), Value::Array(tools));
    }
    spec.prompt = Prompt::Chat {
        messages: template_messages(req.messages.clone()),
        template_vars: (!vars.is_empty()).then_some(Value::Object(vars)),
        add_generation_prompt,
        continue_final_message: continue_final,
    };
    Ok(ValidatedChat {
        keep_special: !spec.skip_special_tokens,
        spec,
        n,
        echo,
        stage,
        want_logprobs,
        stream,
    })
}

#[cfg(test)]
mod tests;
