//! Request bodies of the OpenAI and SGLang-native APIs, as typed serde structs.
//! Unknown fields are collected in `extra` and logged, never rejected (clients send many).

use serde::Deserialize;
use serde_json::{Map, Value};

use super::error::ApiError;

/// `"stop": "x"` or `"stop": ["x", "y"]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

impl StopField {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            StopField::One(s) => vec![s],
            StopField::Many(v) => v,
        }
    }
}

/// `/v1/completions` prompt: text, token ids, or a batch of one of them.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdBatches(Vec<Vec<u32>>),
}

/// Sampling fields shared by completions and chat completions (OpenAI + vLLM/SGLang extras).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<u64>,
    /// vLLM's: no stop ends generation before this many tokens.
    pub min_tokens: Option<u32>,
    pub stop: Option<StopField>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: PromptField,
    pub max_tokens: Option<u32>,
    /// Number of top logprobs per token (legacy completions API).
    pub logprobs: Option<u32>,
    pub echo: Option<bool>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    pub messages: Vec<Map<String, Value>>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<u32>,
    pub tools: Option<Value>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// SGLang's native `/generate`.
#[derive(Debug, Clone, Deserialize)]
pub struct GenerateRequest {
    pub text: Option<String>,
    pub input_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub sampling_params: NativeSamplingParams,
    pub stream: Option<bool>,
    pub return_logprob: Option<bool>,
    pub top_logprobs_num: Option<u32>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct NativeSamplingParams {
    pub max_new_tokens: Option<u32>,
    pub min_new_tokens: Option<u32>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub text: Option<String>,
    pub messages: Option<Vec<Map<String, Value>>>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
    pub skip_special_tokens: Option<bool>,
}

/// Parses a JSON body into `T`, turning syntax and type errors into a 400 that names the
/// offending parameter.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    if body.is_empty() {
        return Err(ApiError::bad_request(
            "request body is empty; expected a JSON object",
        ));
    }
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request(
            "the request body must be a JSON object",
        ));
    }
    match serde_path_to_error::deserialize::<_, T>(&value) {
        Ok(parsed) => Ok(parsed),
        Err(e) => {
            let message = e.inner().to_string();
            let path = e.path().to_string();
            let field = if path.is_empty() || path == "." || path == "?" {
                culprit_field::<T>(&value, &message)
            } else {
                Some(
                    path.split(['.', '['])
                        .next()
                        .unwrap_or_default()
                        .to_string(),
                )
            };
            Err(match field {
                Some(field) => ApiError::bad_param(&field, format!("invalid '{field}': {message}")),
                None => ApiError::bad_request(format!("invalid request: {message}")),
            })
        }
    }
}

/// Fields inside flattened structs lose their path, so find the culprit by removing one
/// top-level field at a time: the one whose removal makes the body valid. Error path only.
fn culprit_field<T: serde::de::DeserializeOwned>(value: &Value, message: &str) -> Option<String> {
    if let Some(rest) = message.strip_prefix("missing field `") {
        return rest.split('`').next().map(str::to_string);
    }
    let object = value.as_object()?;
    object.keys().find_map(|key| {
        let mut probe = object.clone();
        probe.remove(key);
        serde_json::from_value::<T>(Value::Object(probe))
            .ok()
            .map(|_| key.clone())
    })
}

/// Logs fields we do not act on, so a client's intent is visible rather than silently lost.
pub fn log_unknown_fields(endpoint: &str, extra: &Map<String, Value>) {
    if !extra.is_empty() {
        let keys: Vec<&str> = extra.keys().map(String::as_str).collect();
        tracing::debug!(endpoint, ?keys, "ignoring unknown request fields");
    }
}
