//! Request validation: one place that turns bad parameters into 400s naming the parameter
//! and the numbers involved.

use tokenspeed_engine::{SamplingParams, MAX_TOP_LOGPROBS, NO_SEED};

use crate::http::error::ApiError;
use crate::http::protocol::SamplingFields;

/// Builds engine sampling parameters from the API's optional fields, checking ranges.
pub fn sampling_params(f: &SamplingFields, top_logprobs: u32) -> Result<SamplingParams, ApiError> {
    let mut p = SamplingParams {
        top_logprobs,
        ..SamplingParams::neutral()
    };
    if let Some(t) = f.temperature {
        if !t.is_finite() || t < 0.0 {
            return Err(ApiError::bad_param(
                "temperature",
                format!("temperature must be >= 0, got {t}"),
            ));
        }
        p.temperature = t;
    }
    if let Some(v) = f.top_p {
        if !(v > 0.0 && v <= 1.0) {
            return Err(ApiError::bad_param(
                "top_p",
                format!("top_p must be in (0, 1], got {v}"),
            ));
        }
        p.top_p = v;
    }
    if let Some(k) = f.top_k {
        if k < -1 {
            return Err(ApiError::bad_param(
                "top_k",
                format!("top_k must be -1 (disabled) or >= 1, got {k}"),
            ));
        }
        p.top_k = if k == 0 { -1 } else { k };
    }
    if let Some(v) = f.min_p {
        if !(0.0..=1.0).contains(&v) {
            return Err(ApiError::bad_param(
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
                return Err(ApiError::bad_param(
                    name,
                    format!("{name} must be in [-2, 2], got {v}"),
                ));
            }
            *slot = v;
        }
    }
    if let Some(v) = f.repetition_penalty {
        if !(v > 0.0 && v.is_finite()) {
            return Err(ApiError::bad_param(
                "repetition_penalty",
                format!("repetition_penalty must be > 0, got {v}"),
            ));
        }
        p.repetition_penalty = v;
    }
    // The worker seeds a 63-bit generator state.
    p.seed = f.seed.map_or(NO_SEED, |s| (s & i64::MAX as u64) as i64);
    if let Some(n) = f.n {
        if n != 1 {
            return Err(ApiError::bad_param(
                "n",
                format!("n must be 1 (several choices per request are not supported yet), got {n}"),
            ));
        }
    }
    Ok(p)
}

pub fn max_tokens(name: &str, value: Option<u32>) -> Result<Option<u32>, ApiError> {
    match value {
        Some(0) => Err(ApiError::bad_param(
            name,
            format!("{name} must be at least 1, got 0"),
        )),
        v => Ok(v),
    }
}

/// Top logprobs asked for: at most `MAX_TOP_LOGPROBS` (OpenAI's limit).
pub fn top_logprobs(name: &str, value: Option<u32>) -> Result<u32, ApiError> {
    match value {
        Some(v) if v > MAX_TOP_LOGPROBS => Err(ApiError::bad_param(
            name,
            format!("{name} must be at most {MAX_TOP_LOGPROBS}, got {v}"),
        )),
        v => Ok(v.unwrap_or(0)),
    }
}

/// The prompt must leave room for at least one generated token and use known token ids.
pub fn check_prompt(ids: &[u32], vocab_size: u32, context_length: u32) -> Result<(), ApiError> {
    if ids.is_empty() {
        return Err(ApiError::bad_param("prompt", "the prompt is empty"));
    }
    if ids.len() as u64 >= context_length as u64 {
        return Err(ApiError::bad_param(
            "prompt",
            format!(
                "The prompt has {} tokens, but this model's maximum context length is {context_length} tokens \
                 (at least one must remain for the completion).",
                ids.len()
            ),
        ));
    }
    if let Some(bad) = ids.iter().find(|&&t| t >= vocab_size) {
        return Err(ApiError::bad_param(
            "prompt",
            format!("token id {bad} is out of range (vocabulary size {vocab_size})"),
        ));
    }
    Ok(())
}
