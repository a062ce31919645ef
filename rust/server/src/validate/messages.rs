//! The request side of `/v1/messages` (Anthropic's Messages API, as vLLM and SGLang serve it):
//! the system prompt, text / tool_use / tool_result blocks, tools and tool_choice are
//! translated into a chat request and checked by the chat rules (`validate::chat`), so the
//! template, the tool-call grammar and parsers and the reasoning parser are the chat route's.

use serde_json::{json, Map, Value};

use super::agents::{agent_chat, is_neutral, refuse_unbuilt, AgentChat, ChatContext};
use super::chat::ValidatedChat;
use crate::error::RequestError;
use crate::http::protocol::{SamplingFields, StopField};
use crate::http::protocol_agents::MessagesRequest;

fn bad(param: &str, message: impl Into<String>) -> RequestError {
    RequestError::bad_param(param, message)
}

fn chat_message(role: &str, content: String) -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("role".into(), json!(role));
    m.insert("content".into(), json!(content));
    m
}

/// Text blocks (or a string) joined; `at` names the place in errors.
fn block_text(content: &Value, param: &str, at: &str) -> Result<String, RequestError> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Null => Ok(String::new()),
        Value::Array(blocks) => blocks
            .iter()
            .enumerate()
            .map(|(j, b)| match (b["type"].as_str(), b["text"].as_str()) {
                (Some("text"), Some(t)) => Ok(t.to_string()),
                (kind, _) => Err(bad(
                    param,
                    format!(
                        "{at}[{j}] has type {:?}: only text blocks are supported here",
                        kind.unwrap_or_default()
                    ),
                )),
            })
            .collect(),
        _ => Err(bad(
            param,
            format!("{at} must be a string or a list of text blocks"),
        )),
    }
}

/// One Anthropic message as chat messages: tool results become tool messages (before the
/// turn's text, which answers them), tool_use blocks the assistant's tool calls.
fn convert_message(
    i: usize,
    m: &Value,
    out: &mut Vec<Map<String, Value>>,
) -> Result<(), RequestError> {
    let role = match m["role"].as_str() {
        Some(r @ ("user" | "assistant")) => r,
        _ => {
            return Err(bad(
                "messages",
                format!("messages[{i}].role must be \"user\" or \"assistant\""),
            ))
        }
    };
    let blocks = match &m["content"] {
        Value::String(s) => {
            out.push(chat_message(role, s.clone()));
            return Ok(());
        }
        Value::Array(blocks) => blocks,
        _ => {
            return Err(bad(
                "messages",
                format!("messages[{i}].content must be a string or a list of blocks"),
            ))
        }
    };
    let (mut text, mut calls, mut results) = (String::new(), Vec::new(), 0);
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("messages[{i}].content[{j}]");
        match b["type"].as_str().unwrap_or_default() {
            "text" => text.push_str(
                b["text"]
                    .as_str()
                    .ok_or_else(|| bad("messages", format!("{at} needs a string 'text'")))?,
            ),
            "tool_use" if role == "assistant" => calls.push(tool_call(b, &at)?),
            "tool_result" if role == "user" => {
                out.push(tool_result(b, &at)?);
                results += 1;
            }
            // Earlier thinking is not shown to the model again (chat templates drop it too).
            "thinking" | "redacted_thinking" if role == "assistant" => {}
            kind => {
                return Err(bad(
                    "messages",
                    format!(
                        "{at} has type {kind:?}, which is not supported in a {role} message \
                 (text, tool_use from the assistant, tool_result from the user)"
                    ),
                ))
            }
        }
    }
    if !text.is_empty() || !calls.is_empty() || results == 0 {
        let mut msg = chat_message(role, text);
        if !calls.is_empty() {
            msg.insert("tool_calls".into(), Value::Array(calls));
        }
        out.push(msg);
    }
    Ok(())
}

/// An assistant's `tool_use` block as a chat tool call.
fn tool_call(b: &Value, at: &str) -> Result<Value, RequestError> {
    let (Some(id), Some(name)) = (b["id"].as_str(), b["name"].as_str()) else {
        return Err(bad(
            "messages",
            format!("{at} (tool_use) needs string 'id' and 'name'"),
        ));
    };
    let input = if b["input"].is_null() {
        json!({})
    } else {
        b["input"].clone()
    };
    Ok(json!({"id": id, "type": "function",
        "function": {"name": name, "arguments": input.to_string()}}))
}

/// A user's `tool_result` block as a tool message.
fn tool_result(b: &Value, at: &str) -> Result<Map<String, Value>, RequestError> {
    let id = b["tool_use_id"].as_str().ok_or_else(|| {
        bad(
            "messages",
            format!("{at} (tool_result) needs a string 'tool_use_id'"),
        )
    })?;
    let mut result = chat_message(
        "tool",
        block_text(&b["content"], "messages", &format!("{at}.content"))?,
    );
    result.insert("tool_call_id".into(), json!(id));
    Ok(result)
}

fn chat_tools(tools: &[Value]) -> Result<Vec<Value>, RequestError> {
    tools
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let kind = t["type"].as_str().unwrap_or("custom");
            let name = t["name"].as_str().filter(|_| kind == "custom").ok_or_else(|| {
                bad("tools", format!(
                    "tools[{i}] must be a client tool {{\"name\", \"description\", \"input_schema\"}} \
                     (type {kind:?} is not supported)"))
            })?;
            let mut f = json!({"name": name, "parameters": t.get("input_schema").cloned().unwrap_or(json!({"type": "object"}))});
            if let Some(d) = t["description"].as_str() {
                f["description"] = json!(d);
            }
            Ok(json!({"type": "function", "function": f}))
        })
        .collect()
}

/// Anthropic's tool_choice as the chat one, and whether parallel calls are allowed.
fn chat_tool_choice(choice: &Value) -> Result<(Value, Option<bool>), RequestError> {
    let parallel = choice["disable_parallel_tool_use"].as_bool().map(|d| !d);
    let chat = match choice["type"].as_str() {
        Some("auto") => json!("auto"),
        Some("any") => json!("required"),
        Some("none") => json!("none"),
        Some("tool") => {
            let name = choice["name"].as_str().ok_or_else(|| {
                bad(
                    "tool_choice",
                    "tool_choice {\"type\": \"tool\"} needs a string 'name'",
                )
            })?;
            json!({"type": "function", "function": {"name": name}})
        }
        _ => {
            return Err(bad(
                "tool_choice",
                "tool_choice.type must be \"auto\", \"any\", \"tool\" or \"none\"",
            ))
        }
    };
    Ok((chat, parallel))
}

/// The chat parameters whose Messages name differs, for errors.
const MESSAGES_NAMES: &[(&str, &str)] = &[
    ("max_completion_tokens", "max_tokens"),
    ("stop", "stop_sequences"),
];

/// Checks a Messages request into a chat one.
pub fn messages_request(
    req: &MessagesRequest,
    ctx: &ChatContext,
) -> Result<ValidatedChat, RequestError> {
    refuse_unbuilt("Messages API", &req.extra, &[])?;
    if let Some(t) = req
        .thinking
        .as_ref()
        .filter(|t| !is_neutral(t) && t["type"] != "disabled")
    {
        return Err(bad("thinking", format!(
            "thinking {t} is not supported: the server's --reasoning-parser decides what is thinking")));
    }
    let max_tokens = match req.max_tokens {
        None => return Err(bad("max_tokens", "max_tokens is required")),
        Some(0) => return Err(bad("max_tokens", "max_tokens must be at least 1")),
        Some(n) => n,
    };
    let mut messages = Vec::new();
    if let Some(system) = req.system.as_ref().filter(|s| !s.is_null()) {
        let text = block_text(system, "system", "system")?;
        if !text.is_empty() {
            messages.push(chat_message("system", text));
        }
    }
    if req.messages.is_empty() {
        return Err(bad("messages", "messages must be a non-empty array"));
    }
    for (i, m) in req.messages.iter().enumerate() {
        convert_message(i, m, &mut messages)?;
    }
    let (tool_choice, parallel_tool_calls) = match req.tool_choice.as_ref().filter(|c| !c.is_null())
    {
        Some(c) => {
            let (c, p) = chat_tool_choice(c)?;
            (Some(c), p)
        }
        None => (None, None),
    };
    let parts = AgentChat {
        messages,
        max_completion_tokens: Some(max_tokens),
        tools: chat_tools(req.tools.as_deref().unwrap_or_default())?,
        tool_choice,
        parallel_tool_calls,
        logprobs: None,
        sampling: SamplingFields {
            temperature: req.temperature,
            top_p: req.top_p,
            top_k: req.top_k,
            stop: req.stop_sequences.clone().map(StopField::Many),
            ..Default::default()
        },
    };
    agent_chat(parts, ctx, MESSAGES_NAMES)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tool_blocks_become_calls_and_tool_messages() {
        let mut out = Vec::new();
        convert_message(0, &json!({"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]}), &mut out)
        .expect("assistant");
        convert_message(1, &json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
            {"type": "text", "text": "And tomorrow?"}]}), &mut out)
        .expect("user");
        assert_eq!(out.len(), 3);
        assert_eq!(
            out[0]["tool_calls"][0]["function"]["arguments"],
            "{\"city\":\"Paris\"}"
        );
        assert_eq!(out[1]["role"], "tool");
        assert_eq!(out[1]["content"], "sunny");
        assert_eq!(out[2]["content"], "And tomorrow?");
        let err = convert_message(
            2,
            &json!({"role": "user", "content": [{"type": "image"}]}),
            &mut out,
        )
        .expect_err("images");
        assert_eq!(err.param(), Some("messages"));
        let (choice, parallel) =
            chat_tool_choice(&json!({"type": "any", "disable_parallel_tool_use": true}))
                .expect("valid");
        assert_eq!((choice, parallel), (json!("required"), Some(false)));
    }
}
