//! Response bodies of the OpenAI API, as typed serde structs: every route and stream builds
//! its JSON from these, so the stream and non-stream forms cannot drift apart.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::Value;
use utoipa::ToSchema;

use crate::engine::TokenUsage;

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    /// None on a stream's role chunk, which counts the prompt only (as vLLM's does).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_tokens_details: Option<PromptTokensDetails>,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct PromptTokensDetails {
    pub cached_tokens: u32,
}

impl Usage {
    pub fn of(u: &TokenUsage) -> Self {
        Usage {
            prompt_tokens: u.prompt_tokens,
            completion_tokens: u.completion_tokens,
            total_tokens: u.prompt_tokens + u.completion_tokens,
            prompt_tokens_details: Some(PromptTokensDetails {
                cached_tokens: u.cached_tokens,
            }),
        }
    }

    /// The usage before any output (vLLM's on a stream's first, role chunk with
    /// `continuous_usage_stats`): the prompt only.
    pub fn before_output(prompt_tokens: u32) -> Self {
        Usage {
            prompt_tokens,
            completion_tokens: 0,
            total_tokens: prompt_tokens,
            prompt_tokens_details: None,
        }
    }
}

/// Legacy completions logprobs: parallel lists, one entry per token (prompt tokens first with
/// `echo`; the first prompt token has no logprob).
#[derive(Debug, Clone, Default, Serialize, PartialEq, ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<Option<f32>>,
    pub top_logprobs: Vec<Option<BTreeMap<String, f32>>>,
    pub text_offset: Vec<usize>,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct CompletionChoice {
    pub index: u32,
    pub text: String,
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
    /// SGLang's: the stop string or stop token id that ended the choice.
    pub matched_stop: Option<Value>,
    /// vLLM's `prompt_logprobs`: per prompt token, null for the first, else token id → entry.
    /// A whole response always has it (null unless asked for, as vLLM sends it); a stream
    /// chunk only where it carries them (the outer None omits the key).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<PromptLogprobs>)]
    pub prompt_logprobs: Option<Option<PromptLogprobs>>,
    /// vLLM's `return_token_ids`: the prompt's token ids (null unless asked for, in a whole
    /// response; on the first chunk of a stream).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Vec<u32>>)]
    pub prompt_token_ids: Option<Option<Vec<u32>>>,
    /// vLLM's `return_token_ids`: the generated token ids (of this chunk, when streamed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

pub type PromptLogprobs = Vec<Option<BTreeMap<String, PromptLogprob>>>;

/// One server-sent event of a streamed completion (`text/event-stream`) as a client parses it:
/// `data` is one JSON chunk (a completion or chat completion chunk), `[DONE]` last. Only the
/// OpenAPI document reads this type; the handlers write the events themselves.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[allow(dead_code)]
pub struct ServerSentEvent {
    pub data: String,
    pub event: Option<String>,
    pub id: Option<String>,
}

/// The OpenAI error body (`error.rs` builds it).
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorResponse {
    pub error: ErrorDetail,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: u16,
}

/// One entry of vLLM's `prompt_logprobs` map.
#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct PromptLogprob {
    pub logprob: f32,
    /// 1 for the most likely token; the prompt's own token may rank anywhere.
    pub rank: Option<u32>,
    pub decoded_token: String,
}

/// `/v1/completions` (non-streamed) and each of its stream chunks (`object` differs only in
/// the chat API; for completions both are "text_completion").
#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct Completion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<CompletionChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ChatLogprobEntry {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq, ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<ChatLogprobEntry>,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ChatMessage {
    pub role: &'static str,
    /// Null when a tool call or the reasoning left no answer text.
    pub content: Option<String>,
    /// The reasoning (`--reasoning-parser`), when there was any (null otherwise, as vLLM).
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCallOut>,
}

/// One tool call of a message (OpenAI's shape).
#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ToolCallOut {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCallOut,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct FunctionCallOut {
    pub name: String,
    /// JSON text, as the model wrote it.
    pub arguments: String,
}

/// A piece of a streamed tool call: the first of call `index` carries its id, type and name,
/// later ones argument fragments.
#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ToolCallChunk {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub kind: Option<&'static str>,
    pub function: FunctionCallChunk,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct FunctionCallChunk {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    pub arguments: String,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ChatChoice {
    pub index: u32,
    pub message: ChatMessage,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub matched_stop: Option<Value>,
    /// vLLM's `return_token_ids`: the generated token ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ChatCompletion {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChoice>,
    pub usage: Usage,
    /// vLLM's `prompt_logprobs`: the chat API has it on the response, not on each choice (the
    /// choices share the prompt); null unless asked for, as vLLM sends it.
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// vLLM's `return_token_ids`: the prompt's token ids (null unless asked for).
    pub prompt_token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq, ToSchema)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallChunk>>,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ChatChunkChoice {
    pub index: u32,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
    pub matched_stop: Option<Value>,
    /// vLLM's `return_token_ids`: this chunk's generated token ids.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub token_ids: Option<Vec<u32>>,
}

#[derive(Debug, Clone, Serialize, PartialEq, ToSchema)]
pub struct ChatCompletionChunk {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    pub choices: Vec<ChatChunkChoice>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// As on `ChatCompletion`, once per stream: on choice 0's first chunk after the role.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<PromptLogprobs>,
    /// With `return_token_ids`, once per stream: on the role chunks.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub prompt_token_ids: Option<Vec<u32>>,
}
