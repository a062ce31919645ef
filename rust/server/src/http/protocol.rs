//! Request bodies of the OpenAI and SGLang-native APIs, as typed serde structs.
//! Fields nobody defines are collected in `extra` and named once in a warning (clients send
//! many); fields OpenAI, vLLM or SGLang define that TokenSpeed does not implement are refused.

use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, OnceLock};

use serde::Deserialize;
use serde_json::{Map, Value};
use utoipa::ToSchema;

use super::error::ApiError;
use crate::error::RequestError;

/// `"stop": "x"` or `"stop": ["x", "y"]`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(untagged, expecting = "stop must be a string or a list of strings")]
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
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(
    untagged,
    expecting = "the prompt must be a string, a list of strings, a list of token ids or a list \
                 of token-id lists"
)]
pub enum PromptField {
    Text(String),
    Ids(Vec<u32>),
    Texts(Vec<String>),
    IdBatches(Vec<Vec<u32>>),
}

/// Sampling and output fields shared by every generating route (OpenAI, plus the vLLM/SGLang
/// extras that clients send at the top level or through `extra_body`).
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i32>,
    pub min_p: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<i64>,
    /// vLLM's: no stop ends generation before this many tokens.
    pub min_tokens: Option<u32>,
    pub stop: Option<StopField>,
    /// SGLang's: stop when the output matches one of these regexes (cut like a stop string).
    pub stop_regex: Option<StopField>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub spaces_between_special_tokens: Option<bool>,
    pub include_stop_str_in_output: Option<bool>,
    /// Token id (as a string key, OpenAI's format) → bias added to its logit.
    pub logit_bias: Option<HashMap<String, f32>>,
    /// vLLM's: logprobs of the prompt tokens, with this many top alternatives each (-1: all,
    /// refused past the 20 this server returns).
    pub prompt_logprobs: Option<i32>,
    /// vLLM's: only these token ids may be sampled.
    pub allowed_token_ids: Option<Vec<u32>>,
    /// vLLM's: keep only the last this many prompt tokens (-1: as many as fit beside
    /// max_tokens).
    pub truncate_prompt_tokens: Option<i64>,
    /// vLLM's: the choices carry their generated `token_ids`, the response `prompt_token_ids`.
    pub return_token_ids: Option<bool>,
    /// vLLM's: logprob tokens rendered as `token_id:<id>`.
    pub return_tokens_as_token_ids: Option<bool>,
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// OpenAI's end-user id: accepted (logged with the request), no effect on generation.
    pub user: Option<String>,
    #[serde(flatten)]
    pub constraint: ConstraintFields,
}

/// Every request form that constrains the output (structured output), as OpenAI, SGLang and
/// vLLM spell them; `crate::constraint` maps them to one grammar. At most one may be set.
#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct ConstraintFields {
    /// OpenAI's `{"type": "text" | "json_object" | "json_schema", "json_schema": {"schema": ..}}`.
    pub response_format: Option<Value>,
    /// SGLang's: a JSON schema, as JSON text or an object.
    pub json_schema: Option<Value>,
    /// SGLang's: a regex the whole output matches.
    pub regex: Option<String>,
    /// SGLang's: a grammar (GBNF `::=` rules with a `root`, or Lark).
    pub ebnf: Option<String>,
    /// SGLang's `{"structures": [...], "triggers": [...]}`, as JSON text or an object.
    pub structural_tag: Option<Value>,
    /// vLLM's (older) guided decoding fields.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    /// vLLM's: `{"json" | "regex" | "choice" | "grammar" | "json_object" | "structural_tag": ..}`.
    pub structured_outputs: Option<Map<String, Value>>,
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
    /// vLLM's: usage in every chunk.
    pub continuous_usage_stats: Option<bool>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct CompletionRequest {
    pub model: Option<String>,
    /// SGLang's: the name of a loaded LoRA adapter to run the request on.
    pub lora_path: Option<String>,
    pub prompt: PromptField,
    pub max_tokens: Option<u32>,
    /// Number of top logprobs per token (legacy completions API; -1: all, vLLM's).
    pub logprobs: Option<i32>,
    pub echo: Option<bool>,
    pub best_of: Option<u32>,
    pub suffix: Option<String>,
    /// vLLM's and SGLang's admission priority (`validate::priority`).
    pub priority: Option<i64>,
    /// SGLang's PD router's KV transfer id, and where it says the pair meets
    /// (`validate::bootstrap`).
    pub bootstrap_room: Option<u64>,
    pub bootstrap_host: Option<String>,
    pub bootstrap_port: Option<u32>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct ChatCompletionRequest {
    pub model: Option<String>,
    /// SGLang's: the name of a loaded LoRA adapter to run the request on.
    pub lora_path: Option<String>,
    pub messages: Vec<Map<String, Value>>,
    pub max_tokens: Option<u32>,
    pub max_completion_tokens: Option<u32>,
    pub logprobs: Option<bool>,
    /// -1: all (vLLM's), refused past the 20 this server returns.
    pub top_logprobs: Option<i32>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    /// Several calls in one answer (default true); false keeps (and forces) at most one.
    pub parallel_tool_calls: Option<bool>,
    pub add_generation_prompt: Option<bool>,
    /// vLLM's assistant prefill: the last (assistant) message is continued, not closed.
    pub continue_final_message: Option<bool>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    /// vLLM's: the reply starts with the last message's content when that is the assistant's.
    pub echo: Option<bool>,
    /// vLLM's and SGLang's admission priority (`validate::priority`).
    pub priority: Option<i64>,
    /// SGLang's: false leaves the reasoning in `content` (default true: with
    /// `--reasoning-parser`, it goes to `reasoning_content`).
    pub separate_reasoning: Option<bool>,
    /// SGLang's PD router's KV transfer id, and where it says the pair meets
    /// (`validate::bootstrap`).
    pub bootstrap_room: Option<u64>,
    pub bootstrap_host: Option<String>,
    pub bootstrap_port: Option<u32>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

/// SGLang's native `/generate`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct GenerateRequest {
    pub text: Option<String>,
    /// The name of a loaded LoRA adapter to run the request on.
    pub lora_path: Option<String>,
    pub input_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub sampling_params: NativeSamplingParams,
    pub stream: Option<bool>,
    pub return_logprob: Option<bool>,
    pub top_logprobs_num: Option<u32>,
    /// With `return_logprob`: prompt tokens from this position on get `input_token_logprobs`
    /// (-1 or absent: only the last one, whose logprob is null, as in SGLang).
    pub logprob_start_len: Option<i64>,
    /// The third element of each logprob entry is the token's text instead of null.
    pub return_text_in_logprobs: Option<bool>,
    /// vLLM's and SGLang's admission priority (`validate::priority`).
    pub priority: Option<i64>,
    /// SGLang's PD router's KV transfer id, and where it says the pair meets
    /// (`validate::bootstrap`).
    pub bootstrap_room: Option<u64>,
    pub bootstrap_host: Option<String>,
    pub bootstrap_port: Option<u32>,
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Default, Deserialize, ToSchema)]
pub struct NativeSamplingParams {
    pub max_new_tokens: Option<u32>,
    pub min_new_tokens: Option<u32>,
    #[serde(flatten)]
    pub sampling: SamplingFields,
    #[serde(flatten)]
    #[schema(ignore)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct TokenizeRequest {
    pub model: Option<String>,
    pub prompt: Option<String>,
    pub text: Option<String>,
    pub messages: Option<Vec<Map<String, Value>>>,
    pub add_special_tokens: Option<bool>,
    pub add_generation_prompt: Option<bool>,
}

/// SGLang's `/abort_request` body.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AbortRequest {
    pub rid: String,
}

#[derive(Debug, Clone, Deserialize, ToSchema)]
pub struct DetokenizeRequest {
    pub model: Option<String>,
    pub tokens: Vec<u32>,
    pub skip_special_tokens: Option<bool>,
}

/// Why a body is not the request its route takes (`validate::refusals` decides what the
/// client is told).
#[derive(Debug)]
pub enum BodyError {
    Empty,
    /// The body stream broke off before its end.
    Unreadable(String),
    /// Not JSON at all.
    Json(String),
    NotAnObject,
    /// JSON, but not of the route's shape: `field` names the top-level field to blame, when
    /// one is.
    Shape {
        field: Option<String>,
        message: String,
    },
}

/// Parses a JSON body into `T`, turning syntax and type errors into a 400 that names the
/// offending parameter.
pub fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    parse::<T>(body).map_err(|e| RequestError::from(e).into())
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, BodyError> {
    if body.is_empty() {
        return Err(BodyError::Empty);
    }
    let value: Value = serde_json::from_slice(body).map_err(|e| BodyError::Json(e.to_string()))?;
    if !value.is_object() {
        return Err(BodyError::NotAnObject);
    }
    serde_path_to_error::deserialize::<_, T>(&value).map_err(|e| {
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
        BodyError::Shape { field, message }
    })
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

/// The request fields `/openapi.json` defines for the component `schema`, through its `$ref`s
/// and `allOf`s: the document is the one list of what each request may carry. (Serde's nested
/// `#[serde(flatten)]` hands a catch-all map every key, the known ones included, so the
/// `extra` maps alone cannot tell an unknown field.)
fn documented_fields(schema: &str) -> HashSet<String> {
    fn collect(doc: &Value, schema: &Value, out: &mut HashSet<String>) {
        if let Some(name) = schema["$ref"].as_str().and_then(|r| r.rsplit('/').next()) {
            collect(doc, &doc["components"]["schemas"][name], out);
        }
        if let Some(props) = schema["properties"].as_object() {
            out.extend(props.keys().cloned());
        }
        for part in schema["allOf"].as_array().into_iter().flatten() {
            collect(doc, part, out);
        }
    }
    static DOC: OnceLock<Value> = OnceLock::new();
    let doc =
        DOC.get_or_init(|| serde_json::to_value(super::openapi::document()).unwrap_or(Value::Null));
    let mut out = HashSet::new();
    collect(doc, &doc["components"]["schemas"][schema], &mut out);
    out
}

/// Refuses a field another server defines that TokenSpeed does not implement; names the fields
/// the document does not define for `schema` in a warning, once per field name per process.
pub fn check_extra_fields(
    endpoint: &str,
    schema: &str,
    extra: &Map<String, Value>,
) -> Result<(), ApiError> {
    crate::validate::unsupported_fields(extra)?;
    static WARNED: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let warned = WARNED.get_or_init(Default::default);
    if let Ok(mut warned) = warned.lock() {
        for key in unknown_fields(schema, extra) {
            if warned.insert(key.clone()) {
                tracing::warn!(endpoint, field = %key, "ignoring a request field no API defines");
            }
        }
    }
    Ok(())
}

/// The fields of `extra` that the document does not define for `schema`, less the known ones
/// `unsupported_fields` let through at their neutral value, and nulls (they ask for nothing).
fn unknown_fields<'a>(schema: &str, extra: &'a Map<String, Value>) -> Vec<&'a String> {
    static KNOWN: OnceLock<Mutex<HashMap<String, HashSet<String>>>> = OnceLock::new();
    let Ok(mut known) = KNOWN.get_or_init(Default::default).lock() else {
        return Vec::new();
    };
    let known = known
        .entry(schema.to_string())
        .or_insert_with(|| documented_fields(schema));
    let unknown = |(k, v): &(&String, &Value)| {
        !known.contains(*k) && !crate::validate::is_unbuilt_field(k) && !v.is_null()
    };
    extra.iter().filter(unknown).map(|(k, _)| k).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unimplemented_fields_pass_only_at_their_neutral_value() {
        for neutral in [json!(null), json!(false), json!([]), json!({})] {
            let extra = json!({"return_hidden_states": neutral});
            let extra = extra.as_object().expect("object");
            assert!(check_extra_fields("/v1/completions", "CompletionRequest", extra).is_ok());
        }
        for asks in [json!(true), json!(["x"])] {
            let extra = json!({"return_hidden_states": asks});
            let extra = extra.as_object().expect("object");
            let err = check_extra_fields("/v1/completions", "CompletionRequest", extra);
            assert!(err.is_err(), "{asks}");
        }
    }

    #[test]
    fn sglang_routers_spelled_out_defaults_pass_silently() {
        // What SGLang's router (sglang-router 0.3.2, PD mode) adds to each request.
        let generate = json!({"background": false, "log_metrics": true, "model": null,
            "no_logs": false, "return_bytes": false, "return_entropy": false,
            "return_hidden_states": false, "bogus": 1});
        let chat = json!({"no_stop_trim": false, "separate_reasoning": true,
            "stream_reasoning": true, "return_hidden_states": false});
        for (schema, body) in [
            ("GenerateRequest", generate),
            ("ChatCompletionRequest", chat),
        ] {
            let extra = body.as_object().expect("object");
            assert!(check_extra_fields("/x", schema, extra).is_ok(), "{schema}");
            let unknown: Vec<&String> = unknown_fields(schema, extra);
            let want: &[&str] = if schema == "GenerateRequest" {
                &["bogus"]
            } else {
                &[]
            };
            assert_eq!(unknown, want, "{schema}");
        }
        // Each asks for what TokenSpeed does not build at its other value: a 400 naming it.
        for (field, asks) in [
            ("no_stop_trim", json!(true)),
            ("stream_reasoning", json!(false)),
            ("log_metrics", json!(false)),
            ("no_logs", json!(true)),
            ("background", json!(true)),
            ("return_entropy", json!(true)),
        ] {
            let extra = json!({ field: asks });
            let err = check_extra_fields("/x", "ChatCompletionRequest", extra.as_object().unwrap())
                .expect_err(field);
            assert!(format!("{err:?}").contains(field), "{field}: {err:?}");
        }
    }

    #[test]
    fn only_fields_the_document_lacks_are_unknown() {
        let req: CompletionRequest =
            serde_json::from_value(json!({"prompt": "a", "temperature": 0.5,
            "regex": "a", "guided_regex": "b", "response_format": {"type": "text"}, "bogus": 1}))
            .expect("parses");
        let known = documented_fields("CompletionRequest");
        let unknown: Vec<_> = req.extra.keys().filter(|k| !known.contains(*k)).collect();
        assert_eq!(unknown, ["bogus"]);
        for (schema, field) in [
            ("ChatCompletionRequest", "messages"),
            ("ChatCompletionRequest", "guided_choice"),
            ("GenerateRequest", "input_ids"),
            ("NativeSamplingParams", "max_new_tokens"),
        ] {
            assert!(
                documented_fields(schema).contains(field),
                "{schema}.{field}"
            );
        }
    }
}
