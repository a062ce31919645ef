//! How a request may end early: stop strings, stop regexes (SGLang) and stop token ids, each
//! bounded so that matching them stays cheap per token.

use tokenspeed_text::StopRegex;

use crate::error::RequestError;
use crate::http::protocol::StopField;

/// Stop strings per request, and bytes per stop string.
pub const MAX_STOP_STRINGS: usize = 16;
pub const MAX_STOP_STRING_BYTES: usize = 256;
/// Stop token ids per request.
pub const MAX_STOP_TOKEN_IDS: usize = 256;

/// The `stop` strings, at most `MAX_STOP_STRINGS` of at most `MAX_STOP_STRING_BYTES` each.
pub(super) fn stop_strings(field: Option<&StopField>) -> Result<Vec<String>, RequestError> {
    let stop = field.cloned().map(StopField::into_vec).unwrap_or_default();
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
    Ok(stop)
}

/// SGLang's `stop_regex`, compiled (as many, and as long, as stop strings may be).
pub(super) fn stop_regexes(field: Option<&StopField>) -> Result<Vec<StopRegex>, RequestError> {
    let patterns = field.cloned().map(StopField::into_vec).unwrap_or_default();
    let bad = |m: String| RequestError::bad_param("stop_regex", m);
    if patterns.len() > MAX_STOP_STRINGS {
        return Err(bad(format!(
            "at most {MAX_STOP_STRINGS} stop regexes, got {}",
            patterns.len()
        )));
    }
    patterns
        .iter()
        .map(|p| match p.len() {
            n if n > MAX_STOP_STRING_BYTES => Err(bad(format!(
                "a stop regex may have at most {MAX_STOP_STRING_BYTES} bytes, got {n}"
            ))),
            _ => StopRegex::new(p).map_err(|e| bad(format!("stop_regex {p:?}: {e}"))),
        })
        .collect()
}

/// `stop_token_ids`: at most `MAX_STOP_TOKEN_IDS`, each in the vocabulary.
pub(super) fn stop_token_ids(
    ids: Option<&[u32]>,
    vocab_size: u32,
) -> Result<Vec<u32>, RequestError> {
    let stop_token_ids = ids.map(<[u32]>::to_vec).unwrap_or_default();
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
    Ok(stop_token_ids)
}
