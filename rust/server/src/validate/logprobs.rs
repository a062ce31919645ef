//! How many logprobs a request may ask for per token: `--max-logprobs` (vLLM's flag and
//! rule). The cap bounds each step result's top-logprob columns in shared memory (the launcher
//! sizes the ring's slots for it), so a request past it is a 400, never a truncated answer.

use crate::error::RequestError;

/// The cap `--max-logprobs` sets over a vocabulary of `vocab_size` tokens (-1: no cap, the
/// whole vocabulary).
pub fn logprobs_cap(max_logprobs: i64, vocab_size: u32) -> u32 {
    u32::try_from(max_logprobs).unwrap_or(vocab_size)
}

/// Top logprobs a request's `name` field asks for per token (None: none), checked against
/// `--max-logprobs`: -1 means the whole vocabulary (vLLM's "all"), allowed only when the cap
/// covers it. More than the vocabulary (under a larger cap) returns the vocabulary.
pub fn top_logprobs(
    name: &str,
    value: Option<i32>,
    vocab_size: u32,
    max_logprobs: i64,
) -> Result<u32, RequestError> {
    let cap = logprobs_cap(max_logprobs, vocab_size);
    let asked = match value {
        None => return Ok(0),
        Some(-1) => vocab_size,
        Some(v) => u32::try_from(v).map_err(|_| {
            RequestError::bad_param(
                name,
                format!("{name} must be -1 (all) or between 0 and {cap}, got {v}"),
            )
        })?,
    };
    if asked <= cap {
        return Ok(asked.min(vocab_size));
    }
    let what = if value == Some(-1) {
        format!("-1 asks for the logprobs of all {vocab_size} tokens of the vocabulary")
    } else {
        format!("{asked} logprobs per token were asked for")
    };
    Err(RequestError::bad_param(
        name,
        format!(
            "{name}: {what}, more than the max allowed: {cap} (the server's --max-logprobs; \
             -1 there allows the whole vocabulary)"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(r: Result<u32, RequestError>) -> String {
        match r {
            Err(RequestError::Invalid { param, message }) => {
                assert_eq!(param.as_deref(), Some("logprobs"));
                message
            }
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn the_default_cap_allows_up_to_it_and_names_it_past_it() {
        assert_eq!(top_logprobs("logprobs", None, 49152, 20).ok(), Some(0));
        assert_eq!(top_logprobs("logprobs", Some(20), 49152, 20).ok(), Some(20));
        let m = message(top_logprobs("logprobs", Some(21), 49152, 20));
        assert!(m.contains("21") && m.contains("max allowed: 20"), "{m}");
        let m = message(top_logprobs("logprobs", Some(-1), 49152, 20));
        assert!(
            m.contains("all 49152") && m.contains("max allowed: 20"),
            "{m}"
        );
        let m = message(top_logprobs("logprobs", Some(-2), 49152, 20));
        assert!(m.contains("-1 (all) or between 0 and 20"), "{m}");
    }

    #[test]
    fn minus_one_is_the_vocabulary_when_the_cap_covers_it() {
        assert_eq!(
            top_logprobs("logprobs", Some(-1), 49152, -1).ok(),
            Some(49152)
        );
        assert_eq!(
            top_logprobs("logprobs", Some(-1), 49152, 49152).ok(),
            Some(49152)
        );
        assert_eq!(top_logprobs("logprobs", Some(-1), 16, 20).ok(), Some(16));
        // Uncapped still means at most the vocabulary, as vLLM's -1.
        let m = message(top_logprobs("logprobs", Some(49153), 49152, -1));
        assert!(m.contains("max allowed: 49152"), "{m}");
        // A cap past the vocabulary returns the vocabulary.
        assert_eq!(top_logprobs("logprobs", Some(30), 16, 100).ok(), Some(16));
    }

    #[test]
    fn a_raised_cap_allows_up_to_it() {
        assert_eq!(top_logprobs("logprobs", Some(30), 49152, 30).ok(), Some(30));
        assert!(message(top_logprobs("logprobs", Some(31), 49152, 30)).contains("max allowed: 30"));
        assert_eq!(top_logprobs("logprobs", Some(0), 49152, 0).ok(), Some(0));
        assert!(message(top_logprobs("logprobs", Some(1), 49152, 0)).contains("max allowed: 0"));
    }
}
