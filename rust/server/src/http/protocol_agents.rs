//! Request bodies (and, for the OpenAPI document, response bodies) of the two agent-facing APIs: OpenAI's Responses API (`/v1/responses`) and
//! Anthropic's Messages API (`/v1/messages`). Both are validated into a chat request
//! (`validate::responses`, `validate::messages`); fields these structs do not name land in
//! `extra`, where validation refuses any that carries a non-neutral value.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use utoipa::ToSchema;

/// `POST /v1/responses`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    /// A string (one user message) or a list of input items.
    pub input: Value,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    /// `{"format": {"type": "text" | "json_object" | "json_schema", ...}, "verbosity": ...}`.
    pub text: Option<Value>,
    /// `{"effort": ..., "summary": ...}`: only null values (the reasoning parser decides).
    pub reasoning: Option<Value>,
    pub previous_response_id: Option<String>,
    /// Default true: kept for `previous_response_id` and `GET /v1/responses/{id}`.
    pub store: Option<bool>,
    pub stream: Option<bool>,
    /// Echoed back; up to 16 string pairs.
    pub metadata: Option<Map<String, Value>>,
    pub user: Option<String>,
    /// `["message.output_text.logprobs"]` adds the output text's logprobs.
    pub include: Option<Vec<String>>,
    /// With that `include`: the most likely alternatives per token (0 to 20).
    pub top_logprobs: Option<i32>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// `POST /v1/messages`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct MessagesRequest {
    pub model: Option<String>,
    /// Required (`/v1/messages/count_tokens` takes the body without it).
    pub max_tokens: Option<u32>,
    pub messages: Vec<Value>,
    /// A string or a list of text blocks.
    pub system: Option<Value>,
    pub stop_sequences: Option<Vec<String>>,
    pub stream: Option<bool>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// `{"user_id": ...}`: accepted, no effect on generation.
    pub metadata: Option<Value>,
    /// `{"type": "disabled"}` only (the reasoning parser decides what is thinking).
    pub thinking: Option<Value>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

// The response bodies below are what the OpenAPI document states (the fields a client relies
// on); the handlers build the JSON themselves.

/// A Responses API response object (`object: "response"`).
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub struct ResponseObject {
    pub id: String,
    pub object: String,
    pub created_at: u64,
    /// completed, incomplete or in_progress.
    pub status: String,
    pub model: String,
    /// reasoning, message and function_call items.
    pub output: Vec<Value>,
    pub usage: Option<Value>,
}

/// `DELETE /v1/responses/{id}`.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub struct ResponseDeleted {
    pub id: String,
    pub object: String,
    pub deleted: bool,
}

/// An Anthropic message (`type: "message"`).
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub struct AnthropicMessage {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub role: String,
    pub model: String,
    /// thinking, text and tool_use blocks.
    pub content: Vec<Value>,
    pub stop_reason: Option<String>,
    pub stop_sequence: Option<String>,
    pub usage: Value,
}

/// `POST /v1/messages/count_tokens`.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub struct AnthropicTokenCount {
    pub input_tokens: u32,
}

/// Anthropic's error body: `{"type": "error", "error": {"type", "message"}}`.
#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub struct AnthropicError {
    #[serde(rename = "type")]
    pub kind: String,
    pub error: AnthropicErrorDetail,
}

#[derive(Serialize, ToSchema)]
#[allow(dead_code)]
pub struct AnthropicErrorDetail {
    #[serde(rename = "type")]
    pub kind: String,
    pub message: String,
}
