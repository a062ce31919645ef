//! What the agent-facing routes (`/v1/responses`, `/v1/messages`) share on the request side:
//! both translate their body into one chat request, built here, and checked by the chat rules
//! (`validate::chat`), with errors naming the route's own field; and both refuse the fields
//! they do not build unless the value is neutral. The `model` (the base model or a LoRA
//! adapter) is resolved by the HTTP layer, as on the chat route (`AppState::adapter_for`).

use serde_json::{Map, Value};

use super::chat::{chat_request, ValidatedChat};
use crate::chat_output::ChatParsers;
use crate::config::SamplingDefaults;
use crate::error::RequestError;
use crate::http::protocol::{ChatCompletionRequest, SamplingFields};

/// The parts in which an agent route's chat request differs from a plain one.
#[derive(Default)]
pub struct AgentChat {
    pub messages: Vec<Map<String, Value>>,
    pub max_completion_tokens: Option<u32>,
    pub tools: Vec<Value>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// Logprobs of the output tokens, with this many alternatives each.
    pub logprobs: Option<i32>,
    pub sampling: SamplingFields,
}

/// The model's defaults, vocabulary and parsers the chat rules check against.
pub struct ChatContext<'a> {
    pub defaults: &'a SamplingDefaults,
    pub vocab_size: u32,
    /// `--max-logprobs` (-1: the whole vocabulary).
    pub max_logprobs: i64,
    pub parsers: &'a ChatParsers,
}

/// Builds the chat request and checks it; `names` maps a chat parameter to the route's name
/// for it in errors.
pub fn agent_chat(
    parts: AgentChat,
    ctx: &ChatContext,
    names: &[(&str, &str)],
) -> Result<ValidatedChat, RequestError> {
    let chat = ChatCompletionRequest {
        model: None,
        lora_path: None,
        messages: parts.messages,
        max_tokens: None,
        max_completion_tokens: parts.max_completion_tokens,
        logprobs: parts.logprobs.map(|_| true),
        top_logprobs: parts.logprobs.filter(|&n| n > 0),
        tools: (!parts.tools.is_empty()).then_some(parts.tools),
        tool_choice: parts.tool_choice,
        parallel_tool_calls: parts.parallel_tool_calls,
        add_generation_prompt: None,
        continue_final_message: None,
        chat_template_kwargs: None,
        echo: None,
        // Admission priority: the default (a non-zero `priority` is refused as unbuilt).
        priority: None,
        // SGLang's chat field; these routes have no such field: the reasoning is split.
        separate_reasoning: None,
        bootstrap_room: None,
        bootstrap_host: None,
        bootstrap_port: None,
        sampling: parts.sampling,
        extra: Map::new(),
    };
    chat_request(
        &chat,
        ctx.defaults,
        ctx.vocab_size,
        ctx.max_logprobs,
        ctx.parsers,
    )
    .map_err(|e| rename(e, names))
}

fn rename(e: RequestError, names: &[(&str, &str)]) -> RequestError {
    match e {
        RequestError::Invalid {
            param: Some(p),
            message,
        } => {
            let name = names
                .iter()
                .find(|(chat, _)| *chat == p)
                .map_or(p.clone(), |(_, ours)| (*ours).to_string());
            RequestError::Invalid {
                param: Some(name),
                message,
            }
        }
        other => other,
    }
}

/// A value that asks for nothing: absent, null, false, 0, "", [], {} or an object of such.
pub fn is_neutral(v: &Value) -> bool {
    match v {
        Value::Null | Value::Bool(false) => true,
        Value::Number(n) => n.as_f64() == Some(0.0),
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.values().all(is_neutral),
        Value::Bool(true) => false,
    }
}

/// Refuses the first field in `extra` that asks for something TokenSpeed does not build
/// (`neutral` lists per-field values that mean the default, beyond `is_neutral`).
pub fn refuse_unbuilt(
    api: &str,
    extra: &Map<String, Value>,
    neutral: &[(&str, &str)],
) -> Result<(), RequestError> {
    for (name, value) in extra {
        let default = neutral
            .iter()
            .any(|(n, v)| n == name && value.as_str() == Some(v));
        if !default && !is_neutral(value) {
            return Err(RequestError::bad_param(
                name,
                format!(
                    "'{name}' is not supported by TokenSpeed's {api} (send it null or omit it)"
                ),
            ));
        }
    }
    Ok(())
}
