//! Request validation: the one place that turns a parsed request into a typed one, or into a
//! `RequestError::Invalid` naming the parameter and the numbers involved (`http/` renders it
//! as a 400). Sampling fields here, chat messages and tools in `chat`, structured output forms
//! in `grammar`; the context-length rule is `prompt_budget`, written once; the operations
//! routes' fields in `admin`; the other steps' typed errors (body, prompt, grammar) worded in
//! `refusals`. `ApiError` cannot build a 400 any other way. Two 400s come from elsewhere, by
//! design: the engine's `EngineErrorKind::BadRequest` (its own guards, and a grammar matcher
//! that fails mid-request), and `http::ops::op_status` for an operation the workers refused
//! (SGLang's `{success: false}` reply).

pub mod admin;
pub mod agents;
pub mod chat;
pub mod grammar;
pub mod logprobs;
pub mod messages;
pub mod pd;
pub mod pooling;
mod refusals;
pub mod responses;
pub mod routes;
mod stop;

use serde_json::{Map, Value};
use tokenspeed_engine::{SamplingParams, MAX_LOGIT_BIAS, NO_SEED};

use crate::config::SamplingDefaults;
use crate::error::RequestError;
use crate::generate::{GenerationSpec, Prompt};
use crate::http::protocol::SamplingFields;

pub use logprobs::top_logprobs;
pub use pd::{bootstrap, PdFields, PdPair};

/// Choices one request may ask for (prompts × n).
pub const MAX_CHOICES: usize = 128;
pub use stop::{MAX_STOP_STRINGS, MAX_STOP_STRING_BYTES, MAX_STOP_TOKEN_IDS};

/// Fields other servers define whose feature TokenSpeed does not have: refused with a 400
/// naming them (accepting them would silently change what the client asked for), unless
/// given at their neutral value (null, false, empty; `NEUTRAL_TRUE`: null or true), which is
/// accepted silently. SGLang's router re-serializes each request with its own fields spelled
/// out at their defaults (`no_stop_trim` ... `return_entropy` below).
const NOT_IMPLEMENTED: &[(&str, &str)] = &[
    (
        "guided_decoding_backend",
        "choosing the grammar backend per request",
    ),
    (
        "guided_whitespace_pattern",
        "a custom JSON whitespace pattern",
    ),
    ("functions", "tool calling"),
    ("function_call", "tool calling"),
    ("lora_request", "LoRA adapters"),
    ("audio", "audio output"),
    ("prediction", "predicted outputs"),
    ("logits_processors", "custom logits processors"),
    ("bad_words", "bad words"),
    ("return_hidden_states", "hidden-state output"),
    ("use_beam_search", "beam search"),
    ("logprob_token_ids", "logprobs of chosen token ids"),
    ("kv_transfer_params", "disaggregated prefill (KV transfer)"),
    (
        "no_stop_trim",
        "SGLang's spelling of include_stop_str_in_output",
    ),
    ("stream_reasoning", "holding streamed reasoning back"),
    ("log_metrics", "leaving a request out of the metrics"),
    ("no_logs", "leaving a request out of the logs"),
    ("background", "background requests"),
    ("return_bytes", "image bytes output"),
    ("return_entropy", "entropy output"),
];

/// Fields of `NOT_IMPLEMENTED` whose neutral value is `true` (SGLang's default): `false` asks.
const NEUTRAL_TRUE: &[&str] = &["stream_reasoning", "log_metrics"];

/// Whether `name` is a field of `NOT_IMPLEMENTED`: known, so never warned about as unknown.
pub fn is_unbuilt_field(name: &str) -> bool {
    NOT_IMPLEMENTED.iter().any(|(n, _)| *n == name)
}

/// Refuses a field of `NOT_IMPLEMENTED` set to anything but its neutral value.
pub fn unsupported_fields(extra: &Map<String, Value>) -> Result<(), RequestError> {
    let neutral = |name: &str, v: &Value| match v {
        Value::Bool(b) if NEUTRAL_TRUE.contains(&name) => *b,
        Value::Null | Value::Bool(false) => true,
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        Value::Bool(true) | Value::Number(_) => false,
    };
    for (name, feature) in NOT_IMPLEMENTED {
        if extra.get(*name).is_some_and(|v| !neutral(name, v)) {
            return Err(RequestError::bad_param(
                name,
                format!(
                    "'{name}' is not supported yet ({feature} is not implemented in TokenSpeed)"
                ),
            ));
        }
    }
    Ok(())
}

/// Everything a generating route needs from the shared fields, checked: the spec of one
/// prompt's generation (the caller sets the prompt per choice).
pub fn generation_spec(
    f: &SamplingFields,
    defaults: &SamplingDefaults,
    max_new_tokens: Option<u32>,
    top_logprobs: u32,
    vocab_size: u32,
    max_logprobs: i64,
) -> Result<GenerationSpec, RequestError> {
    // The model's defaults (vLLM's behaviour) stand in for what the request omits, and are
    // checked like the request's own values.
    let f = &SamplingFields {
        temperature: f.temperature.or(defaults.temperature),
        top_p: f.top_p.or(defaults.top_p),
        top_k: f.top_k.or(defaults.top_k.map(|k| k as i32)),
        min_p: f.min_p.or(defaults.min_p),
        repetition_penalty: f.repetition_penalty.or(defaults.repetition_penalty),
        ..f.clone()
    };
    let stop = stop::stop_strings(f.stop.as_ref())?;
    let stop_regex = stop::stop_regexes(f.stop_regex.as_ref())?;
    let stop_token_ids = stop::stop_token_ids(f.stop_token_ids.as_deref(), vocab_size)?;
    let prompt_logprobs = match f.prompt_logprobs {
        Some(k) => Some(self::top_logprobs(
            "prompt_logprobs",
            Some(k),
            vocab_size,
            max_logprobs,
        )?),
        None => None,
    };
    let grammar = grammar::output_constraint(f, vocab_size)?;
    let mut sampling = sampling_params(f, top_logprobs.max(prompt_logprobs.unwrap_or(0)))?;
    sampling.prompt_logprobs = prompt_logprobs.is_some();
    (sampling.logit_bias_ids, sampling.logit_bias_values) =
        logit_bias(f.logit_bias.as_ref(), vocab_size)?;
    Ok(GenerationSpec {
        prompt: Prompt::Ids(Vec::new()),
        sampling,
        max_new_tokens,
        min_new_tokens: f.min_tokens.unwrap_or(0),
        stop,
        stop_regex,
        stop_token_ids,
        ignore_eos: f.ignore_eos.unwrap_or(false),
        skip_special_tokens: f.skip_special_tokens.unwrap_or(true),
        spaces_between_special_tokens: f.spaces_between_special_tokens.unwrap_or(true),
        include_stop_str_in_output: f.include_stop_str_in_output.unwrap_or(false),
        top_logprobs,
        prompt_logprobs,
        grammar,
        grammar_starts_after: None,
        priority: 0,
        truncate_prompt: truncation(f.truncate_prompt_tokens)?,
        kv_transfer: tokenspeed_engine::KvTransfer::None,
    })
}

/// vLLM's `truncate_prompt_tokens`: keep the prompt's last k tokens (k >= 1), or with -1 as
/// many as fit beside `max_tokens`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Truncation {
    Keep(usize),
    ToFit,
}

fn truncation(value: Option<i64>) -> Result<Option<Truncation>, RequestError> {
    match value {
        None => Ok(None),
        Some(-1) => Ok(Some(Truncation::ToFit)),
        Some(k) if k >= 1 => Ok(Some(Truncation::Keep(k as usize))),
        Some(k) => Err(RequestError::bad_param(
            "truncate_prompt_tokens",
            format!("truncate_prompt_tokens must be -1 or at least 1, got {k}"),
        )),
    }
}

/// Cuts the tokenized prompt to its last tokens as `truncate_prompt_tokens` asked (the
/// context-length rule, `prompt_budget`, then checks what is left).
pub fn truncate_prompt(
    ids: &mut Vec<u32>,
    truncation: Option<Truncation>,
    context_length: u32,
    max_tokens: Option<u32>,
) {
    let keep = match truncation {
        None => return,
        Some(Truncation::Keep(k)) => k,
        Some(Truncation::ToFit) => {
            (context_length as usize).saturating_sub(max_tokens.unwrap_or(1).max(1) as usize)
        }
    };
    if ids.len() > keep {
        ids.drain(..ids.len() - keep);
    }
}

/// What a stream sends besides the text: the final usage chunk, and usage in every chunk.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamSettings {
    pub include_usage: bool,
    pub continuous_usage: bool,
}

/// `stream_options` needs `stream: true` (OpenAI's rule); vLLM's `continuous_usage_stats`
/// counts only with `include_usage`.
pub fn stream_settings(f: &SamplingFields) -> Result<StreamSettings, RequestError> {
    let Some(o) = &f.stream_options else {
        return Ok(StreamSettings::default());
    };
    if f.stream != Some(true) {
        return Err(RequestError::bad_param(
            "stream_options",
            "stream_options is only allowed when stream is true",
        ));
    }
    let include_usage = o.include_usage.unwrap_or(false);
    Ok(StreamSettings {
        include_usage,
        continuous_usage: include_usage && o.continuous_usage_stats.unwrap_or(false),
    })
}

/// The request's `priority` (vLLM's and SGLang's field, top level): any integer with
/// --enable-priority-scheduling; without it only the neutral 0 (or none), since accepting
/// another value would promise an order the scheduler does not keep.
pub fn priority(given: Option<i64>, enabled: bool) -> Result<i64, RequestError> {
    match given {
        None => Ok(0),
        Some(p) if enabled || p == 0 => Ok(p),
        Some(p) => Err(RequestError::bad_param(
            "priority",
            format!(
                "'priority' {p} needs priority scheduling: start the server with \
                 --enable-priority-scheduling (only the neutral 0 is accepted without it)"
            ),
        )),
    }
}

/// OpenAI's `logit_bias`: token id (a string key) → bias in [-100, 100], sorted by id.
fn logit_bias(
    bias: Option<&std::collections::HashMap<String, f32>>,
    vocab_size: u32,
) -> Result<(Vec<u32>, Vec<f32>), RequestError> {
    let Some(bias) = bias else {
        return Ok((Vec::new(), Vec::new()));
    };
    if bias.len() > MAX_LOGIT_BIAS {
        return Err(RequestError::bad_param(
            "logit_bias",
            format!("at most {MAX_LOGIT_BIAS} entries, got {}", bias.len()),
        ));
    }
    let mut entries = Vec::with_capacity(bias.len());
    let mut problems = Vec::new();
    for (key, &value) in bias {
        let Ok(id) = key.trim().parse::<u32>() else {
            problems.push(format!("key {key:?} is not a token id"));
            continue;
        };
        if id >= vocab_size {
            problems.push(format!(
                "token id {id} is out of range (vocabulary size {vocab_size})"
            ));
        } else if !(-100.0..=100.0).contains(&value) {
            problems.push(format!(
                "the bias {value} of token {id} is not in [-100, 100]"
            ));
        } else {
            entries.push((id, value));
        }
    }
    if !problems.is_empty() {
        // Every bad key at once: a client fixing them one 400 at a time is slow.
        problems.sort();
        return Err(RequestError::bad_param(
            "logit_bias",
            format!("invalid logit_bias: {}", problems.join("; ")),
        ));
    }
    entries.sort_by_key(|&(id, _)| id);
    Ok(entries.into_iter().unzip())
}

/// Choices asked for: `n` (1 when absent) per prompt, at most `MAX_CHOICES` in all.
pub fn choices(n: Option<u32>, prompts: usize) -> Result<usize, RequestError> {
    let n = n.unwrap_or(1) as usize;
    if n == 0 {
        return Err(RequestError::bad_param("n", "n must be at least 1, got 0"));
    }
    if n.saturating_mul(prompts) > MAX_CHOICES {
        return Err(RequestError::bad_param(
            "n",
            format!("{prompts} prompt(s) × n={n} exceeds {MAX_CHOICES} choices per request"),
        ));
    }
    Ok(n)
}

/// Builds engine sampling parameters from the API's optional fields, checking ranges.
fn sampling_params(f: &SamplingFields, top_logprobs: u32) -> Result<SamplingParams, RequestError> {
    let mut p = SamplingParams {
        top_logprobs,
        ..SamplingParams::neutral()
    };
    if let Some(t) = f.temperature {
        if !t.is_finite() || t < 0.0 {
            return Err(RequestError::bad_param(
                "temperature",
                format!("temperature must be >= 0, got {t}"),
            ));
        }
        p.temperature = t;
    }
    if let Some(v) = f.top_p {
        if !(v > 0.0 && v <= 1.0) {
            return Err(RequestError::bad_param(
                "top_p",
                format!("top_p must be in (0, 1], got {v}"),
            ));
        }
        p.top_p = v;
    }
    if let Some(k) = f.top_k {
        if k < -1 {
            return Err(RequestError::bad_param(
                "top_k",
                format!("top_k must be -1 (disabled) or >= 1, got {k}"),
            ));
        }
        p.top_k = if k == 0 { -1 } else { k };
    }
    if let Some(v) = f.min_p {
        if !(0.0..=1.0).contains(&v) {
            return Err(RequestError::bad_param(
                "min_p",
                format!("min_p must be in [0, 1], got {v}"),
            ));
        }
        p.min_p = v;
    }
    for (name, value, slot) in [
        (
            "frequency_penalty",
            f.frequency_penalty,
            &mut p.frequency_penalty,
        ),
        (
            "presence_penalty",
            f.presence_penalty,
            &mut p.presence_penalty,
        ),
    ] {
        if let Some(v) = value {
            if !(-2.0..=2.0).contains(&v) {
                return Err(RequestError::bad_param(
                    name,
                    format!("{name} must be in [-2, 2], got {v}"),
                ));
            }
            *slot = v;
        }
    }
    if let Some(v) = f.repetition_penalty {
        if !(v > 0.0 && v.is_finite()) {
            return Err(RequestError::bad_param(
                "repetition_penalty",
                format!("repetition_penalty must be > 0, got {v}"),
            ));
        }
        p.repetition_penalty = v;
    }
    // The worker seeds a 63-bit generator state.
    p.seed = f.seed.map_or(NO_SEED, |s| s & i64::MAX);
    Ok(p)
}

pub fn max_tokens(name: &str, value: Option<u32>) -> Result<Option<u32>, RequestError> {
    match value {
        Some(0) => Err(RequestError::bad_param(
            name,
            format!("{name} must be at least 1, got 0"),
        )),
        v => Ok(v),
    }
}

/// The context-length rule, written once: the prompt must be non-empty, use known token ids
/// and leave room for at least one generated token; `max_tokens` (None: up to the context
/// length) must fit beside it, and `min_tokens` within that. Returns the request's
/// `max_new_tokens`. (The scheduler keeps a defensive check; this is the user-facing one.)
pub fn prompt_budget(
    ids: &[u32],
    vocab_size: u32,
    context_length: u32,
    max_tokens: Option<u32>,
    min_tokens: u32,
) -> Result<u32, RequestError> {
    if ids.is_empty() {
        return Err(RequestError::bad_param("prompt", "the prompt is empty"));
    }
    if ids.len() as u64 >= context_length as u64 {
        return Err(RequestError::bad_param(
            "prompt",
            format!(
                "The prompt has {} tokens, but this model's maximum context length is {context_length} tokens \
                 (at least one must remain for the completion).",
                ids.len()
            ),
        ));
    }
    if let Some(bad) = ids.iter().find(|&&t| t >= vocab_size) {
        return Err(RequestError::bad_param(
            "prompt",
            format!("token id {bad} is out of range (vocabulary size {vocab_size})"),
        ));
    }
    let prompt = ids.len() as u32;
    let room = context_length - prompt;
    let max_new_tokens = match max_tokens {
        Some(m) if m > room => {
            return Err(RequestError::bad_param(
                "max_tokens",
                format!(
                    "This model's maximum context length is {context_length} tokens. However, you requested {} tokens \
                     ({prompt} in the prompt, {m} for the completion). Reduce the prompt or max_tokens.",
                    prompt + m,
                ),
            ))
        }
        Some(m) => m,
        None => room,
    };
    if min_tokens > max_new_tokens {
        return Err(RequestError::bad_param(
            "min_tokens",
            format!("min_tokens ({min_tokens}) must not exceed max_tokens ({max_new_tokens})"),
        ));
    }
    Ok(max_new_tokens)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(f: SamplingFields, d: &SamplingDefaults) -> Result<GenerationSpec, RequestError> {
        generation_spec(&f, d, Some(4), 0, 1000, 20)
    }

    #[test]
    fn model_defaults_fill_only_what_the_request_omits() {
        let d = SamplingDefaults {
            temperature: Some(0.25),
            top_k: Some(7.0),
            repetition_penalty: Some(1.1),
            ..Default::default()
        };
        let s = spec(SamplingFields::default(), &d).expect("valid").sampling;
        assert_eq!(
            (s.temperature, s.top_k, s.repetition_penalty),
            (0.25, 7, 1.1)
        );
        let own = SamplingFields {
            temperature: Some(1.0),
            ..Default::default()
        };
        let s = spec(own, &d).expect("valid").sampling;
        assert_eq!((s.temperature, s.top_k), (1.0, 7));
        let neutral = spec(SamplingFields::default(), &SamplingDefaults::default())
            .expect("valid")
            .sampling;
        assert_eq!(neutral.temperature, SamplingParams::neutral().temperature);
    }

    #[test]
    fn logit_bias_is_checked_and_sorted() {
        let f = |pairs: &[(&str, f32)]| SamplingFields {
            logit_bias: Some(pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()),
            ..Default::default()
        };
        let s = spec(f(&[("9", 1.0), ("3", -2.0)]), &SamplingDefaults::default())
            .expect("valid")
            .sampling;
        assert_eq!(
            (s.logit_bias_ids, s.logit_bias_values),
            (vec![3, 9], vec![-2.0, 1.0])
        );
        for bad in [&[("x", 1.0)][..], &[("1000", 1.0)], &[("1", 101.0)]] {
            let err = spec(f(bad), &SamplingDefaults::default()).expect_err("invalid");
            assert_eq!(err.param(), Some("logit_bias"), "{bad:?}");
        }
    }
}
