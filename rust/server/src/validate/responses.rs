//! The request side of `/v1/responses` (OpenAI's Responses API): its input items, instructions,
//! tools and text format are translated into a chat request and checked by the chat rules
//! (`validate::chat`), so the template, the tool-call grammar and parsers, the reasoning parser
//! and the streams are the chat route's. Errors name the Responses field, not the chat one.

use serde_json::{json, Map, Value};

use super::agents::{agent_chat, is_neutral, refuse_unbuilt, AgentChat, ChatContext};
use super::chat::ValidatedChat;
use crate::error::RequestError;
use crate::http::protocol::{ConstraintFields, SamplingFields};
use crate::http::protocol_agents::ResponsesRequest;

/// A Responses request, checked.
pub struct ValidatedResponse {
    pub chat: ValidatedChat,
    /// The conversation so far (the previous responses' and this input), without the
    /// instructions: what this response's output is appended to when it is stored.
    pub conversation: Vec<Map<String, Value>>,
    pub store: bool,
}

/// Neutral values of the Responses fields TokenSpeed does not build.
const RESPONSES_NEUTRAL: &[(&str, &str)] = &[
    ("truncation", "disabled"),
    ("service_tier", "auto"),
    ("service_tier", "default"),
];

fn bad(param: &str, message: impl Into<String>) -> RequestError {
    RequestError::bad_param(param, message)
}

/// The text of a content value: a string, or a list of text parts (`input_text`,
/// `output_text`, `text`).
fn content_text(content: &Value, at: &str) -> Result<String, RequestError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str).unwrap_or_default();
                match part.get("text").and_then(Value::as_str) {
                    Some(t) if matches!(kind, "input_text" | "output_text" | "text") => {
                        text.push_str(t)
                    }
                    _ => {
                        return Err(bad(
                            "input",
                            format!(
                                "{at}.content[{j}] has type {kind:?}: only text parts \
                                 (input_text, output_text) are supported"
                            ),
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(bad(
            "input",
            format!("{at}.content must be a string or a list of text parts"),
        )),
    }
}

fn message(role: &str, content: String) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("role".into(), Value::from(role));
    m.insert("content".into(), Value::from(content));
    m
}

/// Appends a call to the preceding assistant message (one turn may make several calls), or
/// starts an assistant message for it.
fn push_call(messages: &mut Vec<Map<String, Value>>, call: Value) {
    let last_is_assistant = messages
        .last()
        .is_some_and(|m| m.get("role").and_then(Value::as_str) == Some("assistant"));
    if !last_is_assistant {
        let mut m = message("assistant", String::new());
        m.insert("tool_calls".into(), json!([]));
        messages.push(m);
    }
    if let Some(last) = messages.last_mut() {
        let calls = last.entry("tool_calls").or_insert_with(|| json!([]));
        if let Value::Array(calls) = calls {
            calls.push(call);
        } else {
            *calls = json!([call]);
        }
    }
}

/// The input (a string or items) as chat messages, appended to `messages`.
fn input_messages(
    input: &Value,
    messages: &mut Vec<Map<String, Value>>,
) -> Result<(), RequestError> {
    let items = match input {
        Value::String(s) => {
            messages.push(message("user", s.clone()));
            return Ok(());
        }
        Value::Array(items) => items,
        _ => {
            return Err(bad(
                "input",
                "input must be a string or a list of input items",
            ))
        }
    };
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let kind = item
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("message");
        let field = |name: &str| {
            item.get(name)
                .and_then(Value::as_str)
                .ok_or_else(|| bad("input", format!("{at} ({kind}) needs a string '{name}'")))
        };
        match kind {
            "message" => {
                let role = field("role")?;
                if !matches!(role, "user" | "assistant" | "system" | "developer") {
                    return Err(bad(
                        "input",
                        format!("{at}.role {role:?} is not user, assistant, system or developer"),
                    ));
                }
                let content = content_text(item.get("content").unwrap_or(&Value::Null), &at)?;
                messages.push(message(role, content));
            }
            "function_call" => {
                let call = json!({"id": field("call_id")?, "type": "function",
                    "function": {"name": field("name")?, "arguments": field("arguments")?}});
                push_call(messages, call);
            }
            "function_call_output" => {
                let mut m = message(
                    "tool",
                    content_text(item.get("output").unwrap_or(&Value::Null), &at)?,
                );
                m.insert("tool_call_id".into(), Value::from(field("call_id")?));
                messages.push(m);
            }
            // Earlier reasoning is not shown to the model again (chat templates drop it too).
            "reasoning" => {}
            other => {
                return Err(bad(
                    "input",
                    format!(
                        "{at} has type {other:?}: only message, function_call, \
                             function_call_output and reasoning items are supported"
                    ),
                ))
            }
        }
    }
    Ok(())
}

/// Responses tools (`{"type": "function", "name", "parameters", ...}`) in the chat form.
fn chat_tools(tools: &[Value]) -> Result<Vec<Value>, RequestError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let kind = t.get("type").and_then(Value::as_str).unwrap_or_default();
            if kind != "function" {
                return Err(bad(
                    "tools",
                    format!("tools[{i}] has type {kind:?}: only function tools are supported"),
                ));
            }
            let mut function = Map::new();
            for key in ["name", "description", "parameters", "strict"] {
                if let Some(v) = t.get(key).filter(|v| !v.is_null()) {
                    function.insert(key.into(), v.clone());
                }
            }
            Ok(json!({"type": "function", "function": function}))
        })
        .collect()
}

fn chat_tool_choice(choice: &Value) -> Result<Value, RequestError> {
    match choice {
        Value::String(_) | Value::Null => Ok(choice.clone()),
        _ if choice.get("type").and_then(Value::as_str) == Some("function") => {
            let name = choice.get("name").and_then(Value::as_str).ok_or_else(|| {
                bad(
                    "tool_choice",
                    "tool_choice {\"type\": \"function\"} needs a string 'name'",
                )
            })?;
            Ok(json!({"type": "function", "function": {"name": name}}))
        }
        _ => Err(bad(
            "tool_choice",
            format!(
                "tool_choice {choice} must be \"none\", \"auto\", \"required\" or \
             {{\"type\": \"function\", \"name\": ...}}"
            ),
        )),
    }
}

/// `text.format` as the chat route's `response_format`.
fn response_format(text: Option<&Value>) -> Result<Option<Value>, RequestError> {
    let Some(text) = text.filter(|t| !t.is_null()) else {
        return Ok(None);
    };
    let obj = text
        .as_object()
        .ok_or_else(|| bad("text", "text must be an object"))?;
    for (key, value) in obj {
        let neutral = is_neutral(value) || (key == "verbosity" && value == "medium");
        if key != "format" && !neutral {
            return Err(bad("text", format!("text.{key} is not supported")));
        }
    }
    let Some(format) = obj.get("format").filter(|f| !f.is_null()) else {
        return Ok(None);
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "json_object"}))),
        Some("json_schema") => {
            let schema = format
                .get("schema")
                .filter(|s| s.is_object())
                .ok_or_else(|| bad("text", "text.format json_schema needs a 'schema' object"))?;
            let mut js = json!({"name": format.get("name").cloned().unwrap_or(json!("response")),
                                "schema": schema});
            if let Some(strict) = format.get("strict").filter(|s| !s.is_null()) {
                js["strict"] = strict.clone();
            }
            Ok(Some(json!({"type": "json_schema", "json_schema": js})))
        }
        _ => Err(bad(
            "text",
            "text.format.type must be \"text\", \"json_object\" or \"json_schema\"",
        )),
    }
}

/// The chat parameters whose Responses name differs, for errors.
const RESPONSES_NAMES: &[(&str, &str)] = &[
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format", "text"),
    ("messages", "input"),
];

/// What `include` may ask for: the output text's logprobs.
const LOGPROBS: &str = "message.output_text.logprobs";

/// The logprobs asked for (`include` and `top_logprobs`), as the chat route's `top_logprobs`.
fn logprobs(req: &ResponsesRequest) -> Result<Option<i32>, RequestError> {
    for item in req.include.iter().flatten() {
        if item != LOGPROBS {
            return Err(bad(
                "include",
                format!("include {item:?} is not supported (only {LOGPROBS:?})"),
            ));
        }
    }
    let wanted = req.include.iter().flatten().any(|i| i == LOGPROBS);
    match req.top_logprobs {
        Some(n) if n != 0 && !wanted => Err(bad(
            "top_logprobs",
            format!("top_logprobs needs include [{LOGPROBS:?}]"),
        )),
        top => Ok(wanted.then_some(top.unwrap_or(0))),
    }
}

/// The conversation `previous_response_id` continues (`stored` looks a response up), or none.
pub fn history(
    previous_response_id: Option<&str>,
    stored: impl FnOnce(&str) -> Option<Vec<Map<String, Value>>>,
) -> Result<Vec<Map<String, Value>>, RequestError> {
    let Some(id) = previous_response_id else {
        return Ok(Vec::new());
    };
    stored(id).ok_or_else(|| {
        RequestError::bad_param(
            "previous_response_id",
            format!("Previous response with id '{id}' not found."),
        )
    })
}

/// Checks a Responses request. `history`: the stored conversation of `previous_response_id`.
pub fn responses_request(
    req: &ResponsesRequest,
    history: Vec<Map<String, Value>>,
    ctx: &ChatContext,
) -> Result<ValidatedResponse, RequestError> {
    refuse_unbuilt("Responses API", &req.extra, RESPONSES_NEUTRAL)?;
    if let Some(r) = req.reasoning.as_ref().filter(|r| !is_neutral(r)) {
        return Err(bad(
            "reasoning",
            format!(
                "reasoning {r} is not supported: the server's --reasoning-parser decides what is \
             reasoning (send null values)"
            ),
        ));
    }
    let mut conversation = history;
    input_messages(&req.input, &mut conversation)?;
    let mut messages = Vec::with_capacity(conversation.len() + 1);
    if let Some(instructions) = req.instructions.as_ref().filter(|s| !s.is_empty()) {
        messages.push(message("system", instructions.clone()));
    }
    messages.extend(conversation.iter().cloned());
    let parts = AgentChat {
        messages,
        max_completion_tokens: req.max_output_tokens,
        tools: chat_tools(req.tools.as_deref().unwrap_or_default())?,
        tool_choice: req.tool_choice.as_ref().map(chat_tool_choice).transpose()?,
        parallel_tool_calls: req.parallel_tool_calls,
        logprobs: logprobs(req)?,
        sampling: SamplingFields {
            temperature: req.temperature,
            top_p: req.top_p,
            user: req.user.clone(),
            constraint: ConstraintFields {
                response_format: response_format(req.text.as_ref())?,
                ..Default::default()
            },
            ..Default::default()
        },
    };
    let chat = agent_chat(parts, ctx, RESPONSES_NAMES)?;
    Ok(ValidatedResponse {
        chat,
        conversation,
        store: req.store.unwrap_or(true),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(input: Value) -> Result<Vec<Map<String, Value>>, RequestError> {
        let mut out = Vec::new();
        input_messages(&input, &mut out).map(|()| out)
    }

    #[test]
    fn input_items_become_chat_messages() {
        let out = items(json!([
            {"role": "user", "content": [{"type": "input_text", "text": "weather?"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
        ]))
        .expect("valid");
        assert_eq!(out.len(), 3);
        assert_eq!(out[0]["content"], "weather?");
        assert_eq!(out[1]["role"], "assistant");
        assert_eq!(out[1]["tool_calls"][1]["id"], "c2");
        assert_eq!(out[2]["role"], "tool");
        assert_eq!(out[2]["tool_call_id"], "c1");
        let err = items(json!([{"role": "user", "content": [{"type": "input_image"}]}]))
            .expect_err("images");
        assert_eq!(err.param(), Some("input"));
    }

    #[test]
    fn unbuilt_fields_are_refused_unless_neutral() {
        let extra = |v: Value| v.as_object().cloned().unwrap_or_default();
        let ok = extra(json!({"background": false, "include": [], "truncation": "disabled"}));
        assert!(refuse_unbuilt("x", &ok, RESPONSES_NEUTRAL).is_ok());
        let err = refuse_unbuilt("x", &extra(json!({"background": true})), RESPONSES_NEUTRAL)
            .expect_err("refused");
        assert_eq!(err.param(), Some("background"));
        let fmt = response_format(Some(&json!({"format": {"type": "json_schema", "name": "n",
            "schema": {"type": "object"}, "strict": true}})))
        .expect("valid");
        assert_eq!(
            fmt.expect("some")["json_schema"]["schema"]["type"],
            "object"
        );
    }
}
