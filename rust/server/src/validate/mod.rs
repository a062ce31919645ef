//! Request validation: the one place that turns a parsed request into a typed one, or into a
//! `RequestError::Invalid` naming the parameter and the numbers involved (`http/` renders it
//! as a 400). Sampling fields here, chat messages and tools in `chat`, structured output forms
//! in `grammar`; the context-length rule is `prompt_budget`, written once.

pub mod chat;
pub mod grammar;
pub mod routes;

use tokenspeed_engine::{SamplingParams, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, NO_SEED};

use crate::config::SamplingDefaults;
use crate::error::RequestError;
use crate::generate::{GenerationSpec, Prompt};
use crate::http::protocol::SamplingFields;

/// Choices one request may ask for (prompts × n).
pub const MAX_CHOICES: usize = 128;
/// Stop strings per request, and bytes per stop string.
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// Stop token ids per request.
pub const MAX_STOP_TOKEN_IDS: usize = 256;

/// Everything a generating route needs from the shared fields, checked: the spec of one
/// prompt's generation (the caller sets the prompt per choice).
pub fn generation_spec(
    f: &SamplingFields,
    defaults: &SamplingDefaults,
    max_new_tokens: Option<u32>,
    top_logprobs: u32,
    vocab_size: u32,
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
    let stop = f.stop.clone().map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > MAX_STOP_STRINGS {
        return Err(RequestError::bad_param(
            "stop",
            format!(
                "at most {MAX_STOP_STRINGS} stop strings, got {}",
                stop.len()
            ),
        ));
    }
    if let Some(long) = stop.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
        return Err(RequestError::bad_param(
            "stop",
            format!(
                "a stop string may have at most {MAX_STOP_STRING_BYTES} bytes, got {}",
                long.len()
            ),
        ));
    }
    let stop_token_ids = f.stop_token_ids.clone().unwrap_or_default();
    if stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
        return Err(RequestError::bad_param(
            "stop_token_ids",
            format!(
                "at most {MAX_STOP_TOKEN_IDS} stop token ids, got {}",
                stop_token_ids.len()
            ),
        ));
    }
    if let Some(bad) = stop_token_ids.iter().find(|&&t| t >= vocab_size) {
        return Err(RequestError::bad_param(
            "stop_token_ids",
            format!("token id {bad} is out of range (vocabulary size {vocab_size})"),
        ));
    }
    let prompt_logprobs = match f.prompt_logprobs {
        Some(k) => Some(self::top_logprobs("prompt_logprobs", Some(k))?),
        None => None,
    };
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
        stop_token_ids,
        ignore_eos: f.ignore_eos.unwrap_or(false),
        skip_special_tokens: f.skip_special_tokens.unwrap_or(true),
        spaces_between_special_tokens: f.spaces_between_special_tokens.unwrap_or(true),
        include_stop_str_in_output: f.include_stop_str_in_output.unwrap_or(false),
        top_logprobs,
        prompt_logprobs,
        grammar: grammar::grammar_request(&f.constraint)?,
        grammar_starts_after: None,
        priority: 0,
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
    for (key, &value) in bias {
        let id: u32 = key.trim().parse().map_err(|_| {
            RequestError::bad_param(
                "logit_bias",
                format!("logit_bias keys must be token ids, got {key:?}"),
            )
        })?;
        if id >= vocab_size {
            return Err(RequestError::bad_param(
                "logit_bias",
                format!("token id {id} is out of range (vocabulary size {vocab_size})"),
            ));
        }
        if !(-100.0..=100.0).contains(&value) {
            return Err(RequestError::bad_param(
                "logit_bias",
                format!("logit_bias values must be in [-100, 100], got {value} for token {id}"),
            ));
        }
        entries.push((id, value));
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

/// Top logprobs asked for: at most `MAX_TOP_LOGPROBS` (OpenAI's limit).
pub fn top_logprobs(name: &str, value: Option<u32>) -> Result<u32, RequestError> {
    match value {
        Some(v) if v > MAX_TOP_LOGPROBS => Err(RequestError::bad_param(
            name,
            format!("{name} must be at most {MAX_TOP_LOGPROBS}, got {v}"),
        )),
        v => Ok(v.unwrap_or(0)),
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
        generation_spec(&f, d, Some(4), 0, 1000)
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
